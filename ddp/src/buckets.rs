//! Gradient buckets: which parameters travel together in one all-reduce, and one bucket's
//! all-reduce submitted and completed (in the configured wire type, with its presence and
//! failure slots). Shared by the wrapper's `sync` (`ddp.rs`) and the all-reduces started
//! during backward (`overlap.rs`).

use ddp_comm::{ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};

use crate::config::{Compression, DdpConfig};
use crate::params::ParamInfo;
use crate::DdpError;

const MIB: f64 = 1024.0 * 1024.0;

/// The parameters whose gradients travel together in one all-reduce.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// Indices into the parameter list, in packing order.
    pub params: Vec<usize>,
    /// Offset of each parameter's gradient in the bucket buffer.
    pub offsets: Vec<usize>,
    /// Number of gradient elements; the presence slots follow them, then the two failure
    /// slots.
    pub grad_len: usize,
}

impl Bucket {
    /// Elements of the bucket's all-reduce: gradients, one presence slot per parameter, and
    /// the failure slots (how many ranks failed locally, and the sum of their ranks plus one).
    pub fn len(&self) -> usize {
        self.failed_slot() + 2
    }

    /// Index of the first failure slot.
    pub fn failed_slot(&self) -> usize {
        self.grad_len + self.params.len()
    }
}

/// An all-reduce in flight, in whichever element type the config chose.
pub(crate) enum InFlight {
    F32(Work<Vec<f32>>),
    Bf16(Work<Vec<bf16>>),
    F16(Work<Vec<f16>>),
}

/// Submits the all-reduce of `bucket`'s buffer `buf` (taken for `f32`; converted for the
/// compressed types), with this rank's failure slots (`failed`: whether something went wrong
/// here). Compressed buckets are divided by the world size first, so that partial sums stay
/// within the largest gradient (f16 tops out at 65504). Returns the work and the bytes sent.
pub(crate) fn submit_bucket(
    pg: &ProcessGroup,
    buf: &mut Vec<f32>,
    bucket: &Bucket,
    failed: bool,
    compression: Compression,
) -> (InFlight, u64) {
    let slot = bucket.failed_slot();
    buf[slot] = if failed { 1.0 } else { 0.0 };
    buf[slot + 1] = if failed { (pg.rank() + 1) as f32 } else { 0.0 };
    if compression != Compression::None {
        let scale = 1.0 / pg.world_size() as f32;
        buf[..bucket.grad_len].iter_mut().for_each(|x| *x *= scale);
    }
    match compression {
        Compression::None => {
            let bytes = (buf.len() * 4) as u64;
            let work = pg.submit_all_reduce(std::mem::take(buf), ReduceOp::Sum);
            (InFlight::F32(work), bytes)
        }
        Compression::Bf16 => {
            let v = buf.iter().map(|&x| bf16::from_f32(x)).collect();
            (
                InFlight::Bf16(pg.submit_all_reduce(v, ReduceOp::Sum)),
                (buf.len() * 2) as u64,
            )
        }
        Compression::F16 => {
            let v = buf.iter().map(|&x| f16::from_f32(x)).collect();
            (
                InFlight::F16(pg.submit_all_reduce(v, ReduceOp::Sum)),
                (buf.len() * 2) as u64,
            )
        }
    }
}

/// Waits for a bucket's all-reduce and puts the summed values into its buffer `buf` (of `len`
/// elements).
pub(crate) fn complete_bucket(
    work: InFlight,
    buf: &mut Vec<f32>,
    len: usize,
) -> Result<(), DdpError> {
    match work {
        InFlight::F32(w) => match w.wait() {
            Ok(v) => *buf = v,
            Err(e) => {
                *buf = vec![0.0; len];
                return Err(e.into());
            }
        },
        InFlight::Bf16(w) => {
            let v = w.wait()?;
            buf.iter_mut().zip(v).for_each(|(d, s)| *d = s.to_f32());
        }
        InFlight::F16(w) => {
            let v = w.wait()?;
            buf.iter_mut().zip(v).for_each(|(d, s)| *d = s.to_f32());
        }
    }
    Ok(())
}

/// Buckets of the trainable parameters in reverse parameter order: the first holds up to
/// `first_bucket_mb`, the others up to `bucket_cap_mb`; a parameter larger than a bucket gets
/// a bucket of its own. Buffers get no bucket: they are broadcast, not averaged.
pub(crate) fn plan_buckets(params: &[ParamInfo], config: &DdpConfig) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut current = Bucket {
        params: Vec::new(),
        offsets: Vec::new(),
        grad_len: 0,
    };
    for (i, info) in params.iter().enumerate().rev() {
        if !info.trainable() {
            continue;
        }
        let cap_mb = if buckets.is_empty() {
            config.first_bucket_mb
        } else {
            config.bucket_cap_mb
        };
        let cap = (cap_mb * MIB / 4.0) as usize;
        if !current.params.is_empty() && current.grad_len + info.numel() > cap {
            buckets.push(std::mem::replace(
                &mut current,
                Bucket {
                    params: Vec::new(),
                    offsets: Vec::new(),
                    grad_len: 0,
                },
            ));
        }
        current.params.push(i);
        current.offsets.push(current.grad_len);
        current.grad_len += info.numel();
    }
    if !current.params.is_empty() {
        buckets.push(current);
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn buffers_get_no_bucket() {
        let mut buffer = info("running_mean", 4);
        buffer.kind = ParamKind::Buffer;
        let params = vec![info("w", 4), buffer, info("b", 2)];
        let buckets = plan_buckets(&params, &DdpConfig::default());
        assert_eq!(buckets.len(), 1);
        assert_eq!(buckets[0].params, vec![2, 0]);
    }

    #[test]
    fn buckets_are_in_reverse_order_with_a_small_first_bucket() {
        let mib = 1024 * 1024 / 4; // f32 elements in one MiB
        let params = vec![
            info("a", mib),
            info("b", 2 * mib),
            info("c", mib / 2),
            info("d", mib / 2),
            info("e", 3 * mib),
        ];
        let config = DdpConfig {
            bucket_cap_mb: 3.0,
            first_bucket_mb: 1.0,
            ..DdpConfig::default()
        };
        let buckets = plan_buckets(&params, &config);
        let names: Vec<Vec<&str>> = buckets
            .iter()
            .map(|b| b.params.iter().map(|&i| params[i].name.as_str()).collect())
            .collect();
        // e alone (bigger than the first bucket), then d+c+b (3 MiB), then a.
        assert_eq!(names, vec![vec!["e"], vec!["d", "c", "b"], vec!["a"]]);
        assert_eq!(buckets[1].offsets, vec![0, mib / 2, mib]);
        // Gradients, 3 presence slots, 2 failure slots.
        assert_eq!(buckets[1].len(), 3 * mib + 5);
    }
}
