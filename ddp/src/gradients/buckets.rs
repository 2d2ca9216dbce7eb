//! The bucket layout every mode shares (DDP's all-reduce, overlap's hooks, ZeRO's
//! reduce-scatter, the GPU path): which parameters' gradients travel together, and how each
//! bucket is carried, in [`Part`]s.
//!
//! **Buckets** follow PyTorch's rule (`compute_bucket_assignment_by_size` in its reducer): the
//! trainable parameters in reverse visiting order (the order backward produces their
//! gradients), added one by one to the open bucket, which closes as soon as it holds at least
//! its cap: `first_bucket_mb` for the first bucket, `bucket_cap_mb` for every later one. The
//! parameter that crosses the cap is still in the bucket it crossed, so a large layer's
//! gradient leaves with the small ones that came just before it, not with the layers that
//! backward reaches last (the CNN's `fc1` with `fc2`, not with the convolutions).
//!
//! **Parts.** PyTorch makes each gradient a view into its bucket's flat buffer, so autograd
//! writes it in place; burn allocates every gradient itself. So a bucket travels as one or more
//! parts, each one collective over one flat buffer: a gradient of at least [`ADOPT_BYTES`] is
//! a part of its own, and its buffer is burn's own gradient, taken over without a copy
//! (adopted); the smaller gradients between them are copied into one shared buffer, as in
//! PyTorch. A part's buffer holds gradients only: whether each parameter had a gradient, and
//! whether a rank failed, travel in one small control all-reduce after the last part
//! (`pipeline.rs`), so every rank's buffers have the same lengths whatever its gradients.
//!
//! ZeRO's shards follow the parts: rank r owns chunk `chunk_range(len, N, r)` of every part
//! (`zero/sharded.rs`).

use std::ops::Range;

use crate::config::ReducerSettings;
use crate::params::ParamInfo;

const MIB: f64 = 1024.0 * 1024.0;

/// A gradient of at least this many bytes is a part of its own, carried in burn's own buffer
/// (no copy); smaller ones are packed together. At this size a copy (a fraction of a
/// millisecond) costs about what one more collective's latency does.
pub(crate) const ADOPT_BYTES: usize = 1 << 20;

/// The parameters whose gradients are submitted together.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// Indices into the parameter list, in packing (reverse visiting) order.
    pub params: Vec<usize>,
    /// This bucket's parts, a range of [`Layout::parts`] (the communication hooks' view of a
    /// bucket).
    #[cfg_attr(not(test), allow(dead_code))]
    pub parts: Range<usize>,
}

/// One collective of a bucket: the gradients of `params`, one after another in one flat
/// buffer of `len` elements.
#[derive(Debug, Clone)]
pub(crate) struct Part {
    /// The bucket it belongs to.
    pub bucket: usize,
    /// Indices into the parameter list, in packing order.
    pub params: Vec<usize>,
    /// Offset of each parameter's gradient in the part's buffer.
    pub offsets: Vec<usize>,
    /// Elements of the buffer.
    pub len: usize,
}

impl Part {
    /// Whether the part is one large gradient, carried in burn's own buffer.
    pub fn adopted(&self) -> bool {
        self.params.len() == 1 && self.len * 4 >= ADOPT_BYTES
    }
}

/// Where a trainable parameter's gradient goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Place {
    /// Its bucket.
    pub bucket: usize,
    /// Its part (an index into [`Layout::parts`]).
    pub part: usize,
    /// Its offset in the part's buffer.
    pub offset: usize,
}

/// The buckets and parts of one parameter list.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    /// In communication order.
    pub buckets: Vec<Bucket>,
    /// Every bucket's parts, in communication order.
    pub parts: Vec<Part>,
    /// For each parameter (visiting order): where its gradient goes; `None` for frozen
    /// parameters and buffers, which have no gradient to average.
    pub place: Vec<Option<Place>>,
}

/// The layout of `params` under `config`'s bucket sizes (see the module documentation).
pub(crate) fn plan_buckets(params: &[ParamInfo], config: &ReducerSettings) -> Layout {
    let cap_of = |mb: f64| ((mb * MIB / 4.0) as usize).max(1);
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut size = 0;
    for (i, info) in params.iter().enumerate().rev() {
        if !info.trainable() {
            continue;
        }
        open.push(i);
        size += info.numel();
        let cap = cap_of(if groups.is_empty() {
            config.first_bucket_mb
        } else {
            config.bucket_cap_mb
        });
        if size >= cap {
            groups.push(std::mem::take(&mut open));
            size = 0;
        }
    }
    if !open.is_empty() {
        groups.push(open);
    }

    let mut layout = Layout {
        buckets: Vec::with_capacity(groups.len()),
        parts: Vec::new(),
        place: vec![None; params.len()],
    };
    for (b, group) in groups.into_iter().enumerate() {
        let first_part = layout.parts.len();
        for &p in &group {
            let n = params[p].numel();
            let large = n * 4 >= ADOPT_BYTES;
            let joins = !large
                && layout.parts.len() > first_part
                && layout.parts.last().is_some_and(|part| !part.adopted());
            if !joins {
                layout.parts.push(Part {
                    bucket: b,
                    params: Vec::new(),
                    offsets: Vec::new(),
                    len: 0,
                });
            }
            let j = layout.parts.len() - 1;
            let part = &mut layout.parts[j];
            layout.place[p] = Some(Place {
                bucket: b,
                part: j,
                offset: part.len,
            });
            part.params.push(p);
            part.offsets.push(part.len);
            part.len += n;
        }
        layout.buckets.push(Bucket {
            params: group,
            parts: first_part..layout.parts.len(),
        });
    }
    layout
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DdpConfig;
    use crate::params::ParamKind;

    fn info(name: &str, numel: usize) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            id: burn::module::ParamId::new(),
            shape: vec![numel],
            dtype: burn::tensor::DType::F32,
            kind: ParamKind::Trainable,
        }
    }

    fn names(params: &[ParamInfo], layout: &Layout) -> Vec<Vec<String>> {
        layout
            .buckets
            .iter()
            .map(|b| b.params.iter().map(|&i| params[i].name.clone()).collect())
            .collect()
    }

    #[test]
    fn buffers_get_no_bucket() {
        let mut buffer = info("running_mean", 4);
        buffer.kind = ParamKind::Buffer;
        let params = vec![info("w", 4), buffer, info("b", 2)];
        let layout = plan_buckets(&params, &(&DdpConfig::default()).into());
        assert_eq!(layout.buckets.len(), 1);
        assert_eq!(layout.buckets[0].params, vec![2, 0]);
        assert_eq!(layout.place[1], None);
    }

    /// PyTorch's rule: reverse order, a bucket closes once it holds at least its cap, and the
    /// parameter that crosses the cap stays in it.
    #[test]
    fn a_bucket_closes_after_the_parameter_that_crosses_its_cap() {
        let mib = 1024 * 1024 / 4; // f32 elements in one MiB
        let params = vec![
            info("a", mib),
            info("b", 2 * mib),
            info("c", mib / 2),
            info("d", mib / 2),
            info("e", 3 * mib),
            info("f", 10),
        ];
        let config = DdpConfig {
            bucket_cap_mb: 3.0,
            first_bucket_mb: 1.0,
            ..DdpConfig::default()
        };
        let layout = plan_buckets(&params, &(&config).into());
        // f (10 elements) is under 1 MiB: e crosses the first cap and closes bucket 0; d + c
        // + b cross 3 MiB; a is left.
        assert_eq!(
            names(&params, &layout),
            vec![vec!["f", "e"], vec!["d", "c", "b"], vec!["a"]]
        );
        let bucket_parts = layout.buckets[1].parts.clone();
        // d and c (half a MiB each) share a part; b (2 MiB) is a part of its own.
        let parts: Vec<(Vec<usize>, usize)> = layout.parts[bucket_parts]
            .iter()
            .map(|part| (part.offsets.clone(), part.len))
            .collect();
        assert_eq!(parts, vec![(vec![0, mib / 2], mib), (vec![0], 2 * mib)]);
    }

    /// The MNIST CNN's parameters (visiting order): under PyTorch's rule the fully connected
    /// layers (4.7 MB) make the first bucket, the convolutions the second, so `fc1` goes out
    /// while backward still runs through the convolutions.
    #[test]
    fn the_cnns_fully_connected_layers_leave_before_its_convolutions() {
        let params = vec![
            info("conv1.weight", 32 * 9),
            info("conv1.bias", 32),
            info("conv2.weight", 64 * 32 * 9),
            info("conv2.bias", 64),
            info("fc1.weight", 9216 * 128),
            info("fc1.bias", 128),
            info("fc2.weight", 128 * 10),
            info("fc2.bias", 10),
        ];
        let layout = plan_buckets(&params, &(&DdpConfig::default()).into());
        assert_eq!(
            names(&params, &layout),
            vec![
                vec!["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"],
                vec!["conv2.bias", "conv2.weight", "conv1.bias", "conv1.weight"],
            ]
        );
    }

    #[test]
    fn a_large_gradient_is_a_part_of_its_own_between_packed_ones() {
        let big = ADOPT_BYTES / 4;
        let params = vec![
            info("w1", 100),
            info("big", big),
            info("b1", 3),
            info("b2", 5),
        ];
        let config = DdpConfig {
            first_bucket_mb: 100.0,
            ..DdpConfig::default()
        };
        let layout = plan_buckets(&params, &(&config).into());
        assert_eq!(layout.buckets.len(), 1);
        let parts: Vec<(Vec<usize>, usize, bool)> = layout
            .parts
            .iter()
            .map(|p| (p.params.clone(), p.len, p.adopted()))
            .collect();
        // Reverse order: b2 and b1 packed, big alone (adopted), w1 packed again.
        assert_eq!(
            parts,
            vec![
                (vec![3, 2], 8, false),
                (vec![1], big, true),
                (vec![0], 100, false)
            ]
        );
        assert_eq!(
            layout.place[2],
            Some(Place {
                bucket: 0,
                part: 0,
                offset: 5
            })
        );
        assert_eq!(layout.buckets[0].parts, 0..3);
    }
}
