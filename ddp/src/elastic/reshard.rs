//! ZeRO's optimizer state across a change of membership: the survivors' shards, cut for the
//! old world, become the new world's shards ([`reshard`]).
//!
//! How: every member of the new group says how many bytes of old shard it holds (a joiner
//! none), then each holder broadcasts its shard (`ShardedDataParallel::shard_state`: the state
//! of its ranges of the flat trainable vector, with the ranges in its header) and every rank
//! copies the part of it that falls in its own new ranges from the received bytes straight
//! into its new shard ([`copy_overlap`]). So a rank holds its new shard and one old shard's
//! bytes at a time, in one receive buffer reused for every old shard, never the whole state
//! (an earlier version built and encoded the consolidated state on every rank, decoded it and
//! loaded its shard: 1.1-1.6 s of a re-form for the 50.9 M-parameter MLP's Adam moments at
//! ZeRO stage 1, 3 ranks to 2 and back). The ranges of the ranks that left are lost with
//! them. A parameter with any element lost starts its optimizer again as a whole, as if it
//! had never been stepped: its state is zeroed on every rank and its step count set to 0,
//! so that moments and bias correction restart together (Adam's first step is then at most
//! lr in size). Keeping the step count with zeroed moments, as an earlier version did, made
//! the bias correction divide moments that hold one step's worth by the weights of many:
//! after t steps the first update of a lost element was up to (1 - beta1) / sqrt(1 - beta2)
//! times lr, about 3.2 x lr for Adam's defaults. Restarting the whole parameter, not only
//! its lost elements, keeps one step count per parameter (burn's Adam keeps one too); every
//! rank reads the same old ranges, so every rank restarts the same parameters.

use std::ops::Range;

use ddp_comm::ProcessGroup;

use crate::zero::state::{check, StateHeader};
use crate::zero::ShardedDataParallel;
use crate::DdpError;

/// Reads the header of an encoded (shard) state, without checking it against anything.
fn header_of(bytes: &[u8], name: &str) -> Result<StateHeader, DdpError> {
    let bad = |what: String| DdpError::Checkpoint(format!("{name}: {what}"));
    let len = bytes
        .get(8..12)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| bad("shorter than a state's header".into()))?;
    let json = bytes
        .get(12..12 + len)
        .ok_or_else(|| bad(format!("header of {len} bytes runs past the end")))?;
    serde_json::from_slice(json).map_err(|e| bad(format!("header: {e}")))
}

/// Makes `zero` (just built over the new group) hold the optimizer state of the old
/// generation: `old` is this rank's shard of it (`shard_state` of the old wrapper, at the step
/// the new generation continues from), `None` for a joiner. A collective of the new group.
/// Returns the elements of the flat vector whose state was lost with the ranks that left.
pub(crate) fn reshard(
    zero: &mut ShardedDataParallel,
    old: Option<&[u8]>,
) -> Result<usize, DdpError> {
    let pg: &ProcessGroup = zero.process_group();
    let (rank, world) = (pg.rank(), pg.world_size());
    let lens = pg.all_gather(vec![old.map_or(0, |b| b.len() as i64)])?;
    let mine = zero.shard_ranges();
    let expected = zero.state_header();
    let mut state = vec![vec![0.0f32; mine.iter().map(|r| r.len()).sum()]; expected.vectors];
    let mut adopted = None;
    let mut covered = 0usize;
    // Every old range held by a member of the new group (the same list on every rank).
    let mut held: Vec<(usize, usize)> = Vec::new();
    let mut bytes: Vec<u8> = Vec::new();
    for (r, &len) in lens.iter().enumerate().take(world) {
        if len <= 0 {
            continue;
        }
        let name = format!("the old shard of rank {r} of the new group");
        bytes.clear();
        match old.filter(|_| r == rank) {
            Some(old) => bytes.extend_from_slice(old),
            None => bytes.resize(len as usize, 0),
        }
        bytes = pg.broadcast(bytes, r)?;
        let header = header_of(&bytes, &name)?;
        let Some(shard) = header.shard.clone() else {
            return Err(DdpError::Checkpoint(format!(
                "{name}: a consolidated state, not a shard"
            )));
        };
        // The same optimizer and parameters as this wrapper's, the old shard's own ranges.
        let mut expect = expected.clone();
        expect.shard = Some(shard.clone());
        let (header, data) = check(&bytes, &expect, &name)?;
        let total = header.total();
        let vectors: Vec<&[u8]> = (0..header.vectors)
            .map(|v| &data[4 * v * total..4 * (v + 1) * total])
            .collect();
        covered += copy_overlap(&shard.ranges, &vectors, &mine, &mut state)
            .map_err(|e| DdpError::Checkpoint(format!("{name}: {e}")))?;
        held.extend_from_slice(&shard.ranges);
        adopted.get_or_insert(header);
    }
    let Some(mut header) = adopted else {
        return Err(DdpError::Checkpoint(
            "no member of the new group holds any of the old optimizer state".into(),
        ));
    };
    restart_lost(&mut header, &held, &mine, &mut state);
    zero.adopt_state(state, header);
    Ok(expected.total().saturating_sub(covered))
}

/// Restarts the optimizer of every trainable parameter of `header` (step counts over the flat
/// trainable vector, parameters in order) that `held` (the old ranges some member holds) does
/// not cover wholly: its step count becomes 0 and its elements in `state` (vectors over this
/// rank's ranges `mine`, in order) zeros, so that moments and bias correction start again
/// together (see the module documentation).
fn restart_lost(
    header: &mut StateHeader,
    held: &[(usize, usize)],
    mine: &[Range<usize>],
    state: &mut [Vec<f32>],
) {
    let mut held = held.to_vec();
    held.sort_unstable();
    let mut offset = 0;
    for (k, (_, n)) in header.params.iter().enumerate() {
        let range = offset..offset + n;
        offset = range.end;
        let covered: usize = held
            .iter()
            .map(|&(a, b)| b.min(range.end).saturating_sub(a.max(range.start)))
            .sum();
        if covered >= range.len() {
            continue;
        }
        if let Some(time) = header.times.get_mut(k) {
            *time = 0;
        }
        let mut at = 0;
        for r in mine {
            let (lo, hi) = (r.start.max(range.start), r.end.min(range.end));
            if lo < hi {
                for v in state.iter_mut() {
                    v[at + lo - r.start..at + hi - r.start].fill(0.0);
                }
            }
            at += r.len();
        }
    }
}

/// Copies what `from` (state vectors over the flat-vector ranges `from_ranges`, in order, as
/// little-endian `f32` bytes) holds of the ranges `to_ranges` into `to` (vectors over those,
/// in order), and returns how many elements `from` covers. Both range lists are a shard's,
/// each range within the flat vector; each pair of ranges is intersected (a shard has one
/// range per part of a bucket, a few hundred at most). An error when `from`'s vectors are
/// shorter than its ranges say.
fn copy_overlap(
    from_ranges: &[(usize, usize)],
    from: &[&[u8]],
    to_ranges: &[Range<usize>],
    to: &mut [Vec<f32>],
) -> Result<usize, String> {
    let mut at = 0;
    for &(start, end) in from_ranges {
        let n = end.saturating_sub(start);
        if from.iter().any(|v| v.len() < 4 * (at + n)) {
            return Err(format!("range {start}..{end} is beyond the state"));
        }
        let mut to_at = 0;
        for range in to_ranges {
            let (lo, hi) = (start.max(range.start), end.min(range.end));
            if lo < hi {
                for (src, dst) in from.iter().zip(to.iter_mut()) {
                    let dst = &mut dst[to_at + lo - range.start..to_at + hi - range.start];
                    let src = &src[4 * (at + lo - start)..4 * (at + hi - start)];
                    for (d, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                        *d = f32::from_le_bytes(b.try_into().expect("4 bytes"));
                    }
                }
            }
            to_at += range.len();
        }
        at += n;
    }
    Ok(from_ranges.iter().map(|(a, b)| b.saturating_sub(*a)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_ranks::ranks;
    use crate::{
        flatten_params, load_flat_params, ShardOptimizer, ShardedAdamConfig, ZeroConfig, ZeroStage,
    };
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::tensor::{Device, Tensor, TensorData};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    fn net() -> Net {
        let device = Device::flex().autodiff();
        let net = Net {
            a: LinearConfig::new(8, 6).init(&device),
            b: LinearConfig::new(6, 3).init(&device),
        };
        let n = flatten_params(&net).unwrap().len();
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 29 + 3) % 31) as f32 / 31.0 - 0.5)
            .collect();
        load_flat_params(net, &values).unwrap()
    }

    /// The gradient of a loss linear in the parameters: the same at every step, element i of
    /// the flat vector `0.5 + (i % 7) / 7`, so that Adam's moments of a parameter stepped
    /// from the start hold exactly that gradient (|update| / lr just under 1) and the only
    /// thing that can push an update beyond it is a bias correction that does not match the
    /// moments.
    fn grads_of(model: &Net) -> GradientsParams {
        let mut at = 0;
        let mut coef = |shape: [usize; 2]| {
            let n = shape[0] * shape[1];
            let c: Vec<f32> = (at..at + n).map(|i| 0.5 + (i % 7) as f32 / 7.0).collect();
            at += n;
            Tensor::<2>::from_data(TensorData::new(c, shape), &Device::flex().autodiff())
        };
        let bias = |t: Tensor<1>| t.unsqueeze_dim::<2>(0);
        let terms = [
            (model.a.weight.val(), [8, 6]),
            (bias(model.a.bias.as_ref().unwrap().val()), [1, 6]),
            (model.b.weight.val(), [6, 3]),
            (bias(model.b.bias.as_ref().unwrap().val()), [1, 3]),
        ];
        let loss = terms
            .into_iter()
            .map(|(p, shape)| (p * coef(shape)).sum())
            .reduce(|a, b| a + b)
            .unwrap();
        GradientsParams::from_grads(loss.backward(), model)
    }

    /// ZeRO stage 1 with Adam (PyTorch's defaults) trains 500 steps on 3 ranks; ranks 0 and 1
    /// go on alone, resharding their old shards (`reshard`, as an elastic re-form does), and
    /// take one step. |change| / lr of every element: on the elements whose state was lost
    /// with rank 2 it must stay within what elements of parameters with all their state kept
    /// get (keeping the lost elements' step count with zeroed moments gives about
    /// 2 x lr after 500 steps, 3.2 x lr in the limit).
    #[test]
    fn a_lost_range_restarts_its_moments_and_bias_correction_together() {
        const STEPS: usize = 500;
        const LR: f64 = 1e-2;
        let config = ZeroConfig::new(ZeroStage::One).with_overlap(false);
        let adam = ShardOptimizer::Adam(ShardedAdamConfig::new());
        let old = ranks(3, |pg| {
            let (mut model, mut zero) =
                ShardedDataParallel::new(net(), pg, config.clone(), adam.clone()).unwrap();
            for _ in 0..STEPS {
                let grads = grads_of(&model);
                model = zero.step(LR, model, grads).unwrap();
            }
            let ranges = zero.shard_ranges();
            (
                flatten_params(&model).unwrap(),
                zero.shard_state().unwrap(),
                ranges,
            )
        });
        let lost: Vec<Range<usize>> = old[2].2.clone();
        let ratios = ranks(2, |pg| {
            let rank = pg.rank();
            let model = load_flat_params(net(), &old[0].0).unwrap();
            let (model, mut zero) =
                ShardedDataParallel::new(model, pg, config.clone(), adam.clone()).unwrap();
            let elements = reshard(&mut zero, Some(&old[rank].1)).unwrap();
            let before = flatten_params(&model).unwrap();
            let grads = grads_of(&model);
            let model = zero.step(LR, model, grads).unwrap();
            let after = flatten_params(&model).unwrap();
            let ratios: Vec<f32> = before
                .iter()
                .zip(&after)
                .map(|(b, a)| (a - b).abs() / LR as f32)
                .collect();
            (ratios, elements)
        });
        assert_eq!(ratios[0].0, ratios[1].0, "the replicas agree");
        let (ratios, elements) = &ratios[0];
        let lost_count: usize = lost.iter().map(|r| r.len()).sum();
        assert_eq!(*elements, lost_count, "the elements rank 2 held are lost");
        // The parameters' ranges of the flat vector (all trainable, in visiting order).
        let mut params = Vec::new();
        let mut at = 0;
        for info in crate::param_infos(&net()) {
            params.push(at..at + info.numel());
            at += info.numel();
        }
        let touches = |p: &Range<usize>| lost.iter().any(|l| l.start < p.end && p.start < l.end);
        let kept: Vec<f32> = params
            .iter()
            .filter(|p| !touches(p))
            .flat_map(|p| ratios[p.clone()].to_vec())
            .collect();
        let on_lost: Vec<f32> = lost
            .iter()
            .flat_map(|r| ratios[r.clone()].to_vec())
            .collect();
        assert!(
            !kept.is_empty() && !on_lost.is_empty(),
            "{lost:?} {params:?}"
        );
        let kept_max = kept.iter().copied().fold(0.0, f32::max);
        let lost_max = on_lost.iter().copied().fold(0.0, f32::max);
        assert!(
            lost_max <= kept_max * 1.001,
            "|change| / lr on the lost elements is up to {lost_max}, on kept parameters up to \
             {kept_max}"
        );
        assert!(kept_max > 0.9, "kept parameters step: {kept_max}");
    }

    /// Two old shards of a flat vector cut one way, copied into a new shard cut another way,
    /// give the flat vector's values at the new ranges (read off the flat vector itself), with
    /// zeros where no old shard held anything.
    #[test]
    fn the_overlap_of_old_shards_lands_at_the_new_ranges() {
        let flat: Vec<f32> = (0..40).map(|i| i as f32 + 0.5).collect();
        let twice: Vec<f32> = flat.iter().map(|v| 2.0 * v).collect();
        // A shard's vectors as little-endian bytes, as its encoded state holds them.
        let shard = |ranges: &[(usize, usize)]| -> Vec<Vec<u8>> {
            [&flat, &twice]
                .iter()
                .map(|v| {
                    ranges
                        .iter()
                        .flat_map(|&(a, b)| v[a..b].iter().flat_map(|x| x.to_le_bytes()))
                        .collect()
                })
                .collect()
        };

        // Old world: rank 0 held 0..5, 12..20, 30..33; rank 1 (still here) 5..12, 33..40;
        // rank 2 (gone) 20..30.
        let old0 = [(0, 5), (12, 20), (30, 33)];
        let old1 = [(5, 12), (33, 40)];
        let new = [3..14, 18..25, 31..36];
        let len: usize = new.iter().map(|r| r.len()).sum();
        let mut to = vec![vec![0.0; len]; 2];
        let (bytes0, bytes1) = (shard(&old0), shard(&old1));
        let (refs0, refs1): (Vec<&[u8]>, Vec<&[u8]>) = (
            bytes0.iter().map(Vec::as_slice).collect(),
            bytes1.iter().map(Vec::as_slice).collect(),
        );
        let covered = copy_overlap(&old0, &refs0, &new, &mut to).unwrap()
            + copy_overlap(&old1, &refs1, &new, &mut to).unwrap();
        assert_eq!(covered, 30);
        let want = |v: &[f32]| -> Vec<f32> {
            new.iter()
                .flat_map(|r| r.clone())
                .map(|i| if (20..30).contains(&i) { 0.0 } else { v[i] })
                .collect()
        };
        assert_eq!(to[0], want(&flat));
        assert_eq!(to[1], want(&twice));
    }

    #[test]
    fn a_shard_shorter_than_its_ranges_is_an_error() {
        let mut to = vec![vec![0.0; 4]];
        let to_ranges = [Range { start: 0, end: 4 }];
        let err = copy_overlap(&[(0, 8)], &[&[0u8; 20][..]], &to_ranges, &mut to).unwrap_err();
        assert!(err.contains("0..8"), "{err}");
    }
}
