//! What the ranks must agree on, checked collectively: the parameter list when the wrapper is
//! made (`verify_same_params`), rank 0's values in every replica (`broadcast_values`, all of
//! them or, for replicas known to be identical, the buffers: [`Start`]), and one
//! value per rank, such as a hash of the replica's parameters or the run and step of a shard
//! file (`diverged_ranks` says who is out of line).

use burn::module::Module;
use ddp_comm::bytes::fnv1a;
use ddp_comm::ProcessGroup;

use crate::gradients::buckets::ADOPT_BYTES;
use crate::gradients::host_buf::HostBuf;
use crate::params::{put_values, take_values, ParamInfo, ParamKind};
use crate::DdpError;

/// How a new wrapper makes the replicas' values agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Start {
    /// Rank 0's parameter and buffer values are broadcast to every rank (a new job, a
    /// generation with joiners).
    Broadcast,
    /// The parameters are identical on every rank already (an elastic generation of
    /// survivors, all at the same committed step): only the buffers are broadcast.
    Identical,
}

impl Start {
    /// `Identical` if `identical`, else `Broadcast`.
    pub(crate) fn identical_if(identical: bool) -> Start {
        match identical {
            true => Start::Identical,
            false => Start::Broadcast,
        }
    }

    /// Whether rank 0's value of `param` travels: every value, or (identical replicas) the
    /// buffers alone, which the forward pass of a dropped step may have changed on some ranks
    /// only.
    pub(crate) fn sends(self, param: &ParamInfo) -> bool {
        self == Start::Broadcast || param.kind == ParamKind::Buffer
    }
}

/// Makes every float tensor of `model` (laid out as `params`) that `start` sends rank 0's,
/// on every rank (nothing when it sends none, as every rank's parameter list is the same): the
/// tensors are taken out of the module (without a copy where it holds them alone), the large
/// ones broadcast one by one in their own memory and the others packed into one buffer, and
/// put back. So a replica is never held twice, which a broadcast of one flat copy of the
/// whole model would do on every rank. A collective.
pub(crate) fn broadcast_values<M: Module>(
    pg: &ProcessGroup,
    model: M,
    params: &[ParamInfo],
    start: Start,
) -> Result<M, DdpError> {
    if !params.iter().any(|p| start.sends(p)) {
        return Ok(model);
    }
    let (model, mut values) = take_values(model, &|i| start.sends(&params[i]))?;
    let large = |v: &HostBuf| v.len() * 4 >= ADOPT_BYTES;
    let mut packed = Vec::new();
    for v in values.iter().flatten().filter(|v| !large(v)) {
        packed.extend_from_slice(v.as_ref());
    }
    let mut works = Vec::new();
    for (i, slot) in values.iter_mut().enumerate() {
        if let Some(v) = slot.take_if(|v| large(v)) {
            works.push((i, pg.submit_broadcast_in_place(v, 0)));
        }
    }
    let packed = pg.submit_broadcast(packed, 0);
    let mut error = None;
    for (i, work) in works {
        match work.wait() {
            Ok(v) => values[i] = Some(v),
            Err(e) => {
                error.get_or_insert(e);
            }
        }
    }
    let packed = packed.wait();
    if let Some(e) = error {
        return Err(e.into());
    }
    let packed = packed?;
    let mut at = 0;
    for v in values.iter_mut().flatten().filter(|v| !large(v)) {
        let n = v.len();
        v.as_mut().copy_from_slice(&packed[at..at + n]);
        at += n;
    }
    Ok(put_values(model, params, values))
}

/// Which ranks' hashes differ, given every rank's: `None` when all agree; otherwise the ranks
/// outside a strict majority (`true`), or, when no strict majority exists, the ranks that
/// differ from rank 0 (`false`: with two ranks, or a tie, nobody can tell which is wrong).
pub(crate) fn diverged_ranks(hashes: &[i64]) -> Option<(Vec<usize>, bool)> {
    let first = *hashes.first()?;
    if hashes.iter().all(|h| *h == first) {
        return None;
    }
    let count = |v: i64| hashes.iter().filter(|h| **h == v).count();
    let majority = hashes
        .iter()
        .copied()
        .find(|h| 2 * count(*h) > hashes.len());
    let (reference, against_majority) = match majority {
        Some(m) => (m, true),
        None => (first, false),
    };
    let ranks = (0..hashes.len())
        .filter(|&r| hashes[r] != reference)
        .collect();
    Some((ranks, against_majority))
}

/// All-gathers a hash of the parameter list; when the hashes differ, all-gathers the lists
/// themselves and names the first rank that differs from rank 0 and how.
pub(crate) fn verify_same_params(pg: &ProcessGroup, params: &[ParamInfo]) -> Result<(), DdpError> {
    if pg.world_size() == 1 {
        return Ok(());
    }
    let text = params
        .iter()
        .map(ParamInfo::describe)
        .collect::<Vec<_>>()
        .join("\n");
    let hashes = pg.all_gather(vec![fnv1a(text.as_bytes()) as i64])?;
    let Some(bad) = hashes.iter().position(|h| *h != hashes[0]) else {
        return Ok(());
    };
    let lens = pg.all_gather(vec![text.len() as i64])?;
    let max = lens.iter().copied().max().unwrap_or(0) as usize;
    let mut bytes = text.into_bytes();
    bytes.resize(max, 0);
    let all = pg.all_gather(bytes)?;
    let list = |r: usize| -> Vec<String> {
        let start = r * max;
        String::from_utf8_lossy(&all[start..start + lens[r] as usize])
            .lines()
            .map(str::to_string)
            .collect()
    };
    let (reference, theirs) = (list(0), list(bad));
    let n = reference.len().max(theirs.len());
    let at = (0..n)
        .find(|&i| reference.get(i) != theirs.get(i))
        .unwrap_or(n);
    let show = |l: Option<&String>| l.cloned().unwrap_or_else(|| "nothing".into());
    let others: Vec<usize> = (0..hashes.len())
        .filter(|&r| hashes[r] != hashes[0])
        .collect();
    Err(DdpError::ParamMismatch(format!(
        "rank {bad} differs from rank 0 at parameter #{at}: rank 0 has `{}`, rank {bad} has `{}` \
         (rank 0 has {} parameters, rank {bad} has {}; ranks differing from rank 0: {others:?}; \
         this is rank {})",
        show(reference.get(at)),
        show(theirs.get(at)),
        reference.len(),
        theirs.len(),
        pg.rank()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{flatten_params, load_flat_params, param_infos};
    use crate::test_ranks::two_ranks;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::tensor::Device;

    /// Trainable parameters (a large weight, broadcast in its own memory, and a small bias)
    /// and buffers (the running statistics).
    #[derive(Module, Debug)]
    struct Net {
        lin: Linear,
        norm: BatchNorm,
    }

    /// Each rank's own values (`rank + 1` everywhere), through `start`'s broadcast; returns
    /// `(value of every trainable element, of every buffer element)` as the rank ends with.
    fn start_with(pg: std::sync::Arc<ProcessGroup>, start: Start) -> (Vec<f32>, Vec<f32>) {
        let device = Device::flex().autodiff();
        let net = Net {
            lin: LinearConfig::new(300, 200).init(&device),
            norm: BatchNormConfig::new(200).init(&device),
        };
        let n = flatten_params(&net).unwrap().len();
        let net = load_flat_params(net, &vec![pg.rank() as f32 + 1.0; n]).unwrap();
        let params = param_infos(&net);
        let net = broadcast_values(&pg, net, &params, start).unwrap();
        let (mut trained, mut buffers) = (Vec::new(), Vec::new());
        let mut values = flatten_params(&net).unwrap().into_iter();
        for p in &params {
            let part = values.by_ref().take(p.numel());
            match p.kind {
                ParamKind::Buffer => buffers.extend(part),
                _ => trained.extend(part),
            }
        }
        (trained, buffers)
    }

    #[test]
    fn identical_replicas_get_rank_0s_buffers_and_keep_their_parameters() {
        let all = |v: &[f32], x: f32| !v.is_empty() && v.iter().all(|&y| y == x);
        let identical = two_ranks(|pg| start_with(pg, Start::Identical));
        assert!(
            all(&identical[1].0, 2.0),
            "rank 1's parameters were overwritten"
        );
        assert!(
            all(&identical[1].1, 1.0),
            "rank 1's buffers are not rank 0's"
        );
        let broadcast = two_ranks(|pg| start_with(pg, Start::Broadcast));
        assert!(
            all(&broadcast[1].0, 1.0),
            "rank 1's parameters are not rank 0's"
        );
        assert!(
            all(&broadcast[1].1, 1.0),
            "rank 1's buffers are not rank 0's"
        );
    }

    #[test]
    fn diverged_ranks_blames_a_majority_only_when_there_is_one() {
        assert_eq!(diverged_ranks(&[1, 1, 1]), None);
        // Two ranks: no majority, so rank 1 is named as differing from rank 0, not blamed.
        assert_eq!(diverged_ranks(&[1, 2]), Some((vec![1], false)));
        // Rank 0 is the odd one out of three: the majority names it.
        assert_eq!(diverged_ranks(&[2, 1, 1]), Some((vec![0], true)));
        assert_eq!(diverged_ranks(&[1, 1, 2]), Some((vec![2], true)));
        // A 2-2 tie: no majority.
        assert_eq!(diverged_ranks(&[1, 2, 1, 2]), Some((vec![1, 3], false)));
        // All different: no majority.
        assert_eq!(diverged_ranks(&[1, 2, 3]), Some((vec![1, 2], false)));
    }
}
