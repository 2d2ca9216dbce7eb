//! `DistributedSampler`: which dataset indices each rank visits in an epoch.
//!
//! PyTorch's contract (`torch.utils.data.DistributedSampler`):
//!
//! 1. All ranks compute the same order of `0..len`: a permutation that depends only on
//!    `(seed, epoch)` when shuffling, `0..len` otherwise. Call [`DistributedSampler::set_epoch`]
//!    before each epoch, or every epoch repeats the same order.
//! 2. Without `drop_last`, the order is padded by wrapping around from its start until its
//!    length is a multiple of `num_replicas` (some samples are seen twice per epoch); with
//!    `drop_last`, the tail beyond the last multiple is cut (some samples are not seen this
//!    epoch).
//! 3. Rank `r` takes positions `r, r + R, r + 2R, ...` (`R = num_replicas`).
//!
//! So every rank gets the same number of samples, runs the same number of steps and calls the
//! same collectives. For evaluation, where counting a sample twice skews the metric,
//! [`DistributedSampler::exact`] gives every sample to exactly one rank, with no padding; ranks
//! then get counts that differ by at most one, known up front from
//! [`DistributedSampler::num_samples`]. (Sum the per-rank metric totals with one all-reduce at
//! the end rather than one collective per batch.)
//!
//! [`ElasticSampler`] is the same epoch for a world whose size changes at step boundaries
//! (elastic training): it hands out the epoch's order step by step, from a position that
//! counts the samples of the committed steps, so that each sample of the epoch is trained
//! exactly once whatever the membership does (see its documentation).
//!
//! The permutation is a Fisher-Yates shuffle driven by splitmix64, written out here rather than
//! taken from a crate, so that the order for a given `(seed, epoch)` never changes with a
//! dependency's version. It does not reproduce PyTorch's order (which comes from torch's
//! Mersenne Twister), only its contract.

use crate::DataError;

/// Which indices this rank visits, epoch by epoch. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
    exact: bool,
}

impl DistributedSampler {
    /// A training sampler over `dataset_len` samples for `rank` of `num_replicas`, with
    /// PyTorch's defaults: shuffle, seed 0, epoch 0, no `drop_last` (pad by wrapping).
    ///
    /// Errors when `num_replicas` is 0 or `rank >= num_replicas`.
    pub fn new(
        dataset_len: usize,
        num_replicas: usize,
        rank: usize,
    ) -> Result<DistributedSampler, DataError> {
        if num_replicas == 0 {
            return Err(DataError::InvalidArgument(
                "num_replicas must be at least 1".into(),
            ));
        }
        if rank >= num_replicas {
            return Err(DataError::InvalidArgument(format!(
                "rank {rank} is not below num_replicas {num_replicas}"
            )));
        }
        Ok(DistributedSampler {
            dataset_len,
            num_replicas,
            rank,
            shuffle: true,
            seed: 0,
            epoch: 0,
            drop_last: false,
            exact: false,
        })
    }

    /// An evaluation sampler: every sample goes to exactly one rank, no padding and nothing
    /// dropped; rank `r` takes positions `r, r + R, ...` of `0..dataset_len` (no shuffle unless
    /// [`with_shuffle`](Self::with_shuffle) asks for it). Ranks get `len / R` or `len / R + 1`
    /// samples, so they may run different numbers of batches: do not run per-batch collectives
    /// over an exact sampler's batches. `drop_last` has no effect in this mode.
    pub fn exact(
        dataset_len: usize,
        num_replicas: usize,
        rank: usize,
    ) -> Result<DistributedSampler, DataError> {
        let mut s = DistributedSampler::new(dataset_len, num_replicas, rank)?;
        s.shuffle = false;
        s.exact = true;
        Ok(s)
    }

    /// Shuffles (the default for [`new`](Self::new)) or keeps the dataset order.
    pub fn with_shuffle(mut self, shuffle: bool) -> DistributedSampler {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the permutation (default 0). Must be the same on every rank.
    pub fn with_seed(mut self, seed: u64) -> DistributedSampler {
        self.seed = seed;
        self
    }

    /// Cuts the tail to a multiple of `num_replicas` instead of padding (default false).
    pub fn with_drop_last(mut self, drop_last: bool) -> DistributedSampler {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch, which with the seed determines the permutation.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the order is shuffled.
    pub fn shuffle(&self) -> bool {
        self.shuffle
    }

    /// Whether the tail is cut rather than padded.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }

    /// Whether this is an exact (evaluation) sampler.
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// The number of replicas (ranks).
    pub fn num_replicas(&self) -> usize {
        self.num_replicas
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of samples in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// How many indices this rank gets per epoch. The same on every rank, except in exact mode
    /// where the first `len % R` ranks get one more.
    pub fn num_samples(&self) -> usize {
        let (len, r) = (self.dataset_len, self.num_replicas);
        if self.exact {
            len / r + usize::from(self.rank < len % r)
        } else if self.drop_last {
            len / r
        } else {
            len.div_ceil(r)
        }
    }

    /// How many indices all ranks get together per epoch (`dataset_len` in exact mode).
    pub fn total_size(&self) -> usize {
        if self.exact {
            self.dataset_len
        } else {
            self.num_samples() * self.num_replicas
        }
    }

    /// This rank's indices for the current epoch, in the order to visit them.
    pub fn indices(&self) -> Vec<usize> {
        let mut order = if self.shuffle {
            permutation(self.dataset_len, self.seed, self.epoch)
        } else {
            (0..self.dataset_len).collect()
        };
        if !self.exact {
            let total = self.total_size();
            if total <= order.len() {
                order.truncate(total);
            } else {
                // Pad by wrapping around from the start (several times when len < R).
                let len = order.len();
                for i in 0..total - len {
                    order.push(order[i % len]);
                }
            }
        }
        order
            .into_iter()
            .skip(self.rank)
            .step_by(self.num_replicas)
            .collect()
    }
}

/// The samples of an epoch for a world whose size may change at any step boundary (elastic
/// training): each sample of the epoch once, none twice, none lost.
///
/// The epoch's order is [`DistributedSampler`]'s (the permutation of `(seed, epoch)`, or
/// `0..len`), with no padding and nothing dropped. The job keeps one position: how many samples
/// of the order the committed steps took. A step at position `p` for a world of `W` ranks
/// with `b` samples per rank takes the next `n = W·b` samples, or all that remain when fewer
/// than `W` would be left after it (so the last step may be up to `W - 1` samples longer);
/// rank `r` takes the `r`-th of `W` balanced consecutive pieces of them (sizes differ by at
/// most one). When the world changes, the rest of the epoch is simply cut for the new `W` from
/// the same position: a dropped step's samples are taken again, a committed step's never.
///
/// A rank's piece can differ from `b` (the epoch's tail), or be empty (fewer samples left than
/// ranks): then it gets one sample with weight 0, so that it still runs the step's
/// collectives. To train on the mean over the step's samples, multiply the rank's mean loss
/// by [`ElasticStep::loss_scale`] (1 in every full step): the ranks' gradients, averaged over
/// `W`, are then the gradient of the mean over the `n` samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElasticSampler {
    dataset_len: usize,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    epoch: u64,
    drop_last: bool,
}

/// One rank's share of one step of an [`ElasticSampler`].
#[derive(Debug, Clone, PartialEq)]
pub struct ElasticStep {
    /// The dataset indices of this rank's batch, in order (never empty).
    pub indices: Vec<usize>,
    /// How many of them are trained: all, or 0 for the stand-in sample of a rank with none.
    pub real: usize,
    /// The samples of the whole step, all ranks together.
    pub step_samples: usize,
    /// The position after the step, once it is committed.
    pub next: usize,
    /// What to multiply this rank's mean loss by: `real · W / step_samples`.
    pub loss_scale: f32,
}

impl ElasticSampler {
    /// A sampler over `dataset_len` samples with `batch_size` samples per rank and step;
    /// shuffled with seed 0 and epoch 0 by default. Errors when `batch_size` is 0.
    pub fn new(dataset_len: usize, batch_size: usize) -> Result<ElasticSampler, DataError> {
        if batch_size == 0 {
            return Err(DataError::InvalidArgument(
                "batch_size must be at least 1".into(),
            ));
        }
        Ok(ElasticSampler {
            dataset_len,
            batch_size,
            shuffle: true,
            seed: 0,
            epoch: 0,
            drop_last: false,
        })
    }

    /// Ends each epoch before a step that would be partial (fewer than `world · batch_size`
    /// samples left), like PyTorch's `drop_last=True`: every step then has every rank's batch
    /// at its full size, one shape for a GPU backend's kernels. Off by default: the last step
    /// takes what is left (every sample of the epoch trained once).
    pub fn with_drop_last(mut self, drop_last: bool) -> ElasticSampler {
        self.drop_last = drop_last;
        self
    }

    /// Shuffles (the default) or keeps the dataset order.
    pub fn with_shuffle(mut self, shuffle: bool) -> ElasticSampler {
        self.shuffle = shuffle;
        self
    }

    /// The seed of the permutation (default 0). Must be the same on every rank.
    pub fn with_seed(mut self, seed: u64) -> ElasticSampler {
        self.seed = seed;
        self
    }

    /// Sets the epoch, which with the seed determines the order.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The number of samples in the dataset (and in every epoch).
    pub fn dataset_len(&self) -> usize {
        self.dataset_len
    }

    /// Samples per rank and step.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// The epoch's order of the dataset's indices.
    pub fn order(&self) -> Vec<usize> {
        if self.shuffle {
            permutation(self.dataset_len, self.seed, self.epoch)
        } else {
            (0..self.dataset_len).collect()
        }
    }

    /// How many samples the step at `position` takes with `world` ranks (0 at the epoch's end:
    /// nothing left, or with [`with_drop_last`](Self::with_drop_last) less than a full step).
    pub fn step_len(&self, position: usize, world: usize) -> usize {
        let left = self.dataset_len.saturating_sub(position);
        let full = world.max(1) * self.batch_size;
        if self.drop_last {
            if left >= full {
                full
            } else {
                0
            }
        } else if left < full + world.max(1) {
            left
        } else {
            full
        }
    }

    /// Steps left in the epoch from `position` with `world` ranks.
    pub fn steps_left(&self, mut position: usize, world: usize) -> usize {
        let mut steps = 0;
        loop {
            match self.step_len(position, world) {
                0 => return steps,
                n => position += n,
            }
            steps += 1;
        }
    }

    /// Rank `rank`'s share of the step at `position` of the epoch whose order is `order`
    /// ([`order`](Self::order)), in a world of `world`; `None` at the epoch's end.
    pub fn step(
        &self,
        order: &[usize],
        position: usize,
        world: usize,
        rank: usize,
    ) -> Option<ElasticStep> {
        let n = self.step_len(position, world);
        if n == 0 || rank >= world {
            return None;
        }
        let (base, extra) = (n / world, n % world);
        let start = position + rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        let (indices, real) = if len == 0 {
            (vec![order[position]], 0)
        } else {
            (order[start..start + len].to_vec(), len)
        };
        Some(ElasticStep {
            indices,
            real,
            step_samples: n,
            next: position + n,
            loss_scale: (real * world) as f32 / n as f32,
        })
    }
}

/// The permutation of `0..len` for `(seed, epoch)`: a Fisher-Yates shuffle (from the last
/// position down, each swapped with a uniform position at or below it, drawn by Lemire's
/// multiply-and-reject) driven by splitmix64 seeded from `splitmix64(seed) ^ epoch * K`.
/// Stable across versions of this crate's dependencies.
pub fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = SplitMix64::for_stream(seed, epoch);
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// splitmix64's output function (Steele, Lea and Flood, 2014): a bijective 64-bit mixer whose
/// output bits each depend on every input bit. The workspace's one copy: the sampler's
/// generator below steps its state by the golden-ratio constant and returns this of it, and
/// the trainers derive per-(seed, epoch, rank) seeds with it.
pub fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 (Steele, Lea and Flood, 2014): a tiny generator of good quality for shuffling.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator for one `(seed, stream)` pair; different pairs give unrelated sequences.
    pub(crate) fn for_stream(seed: u64, stream: u64) -> SplitMix64 {
        let mut s = SplitMix64(seed);
        let mixed = s.next_u64();
        SplitMix64(mixed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        splitmix64(self.0)
    }

    /// A uniform integer in `0..n` (`n > 0`), without modulo bias.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // Reference output of splitmix64 seeded with 0 (from the public C implementation).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn below_is_roughly_uniform() {
        let mut r = SplitMix64(7);
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[r.below(3) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
    }

    /// Each sample of the epoch is trained exactly once through a membership schedule with a
    /// dropped step (3 ranks, then 2, then 5 after a join, to the epoch's end), counted on the
    /// sample ids every rank takes; the loss scales make every step the mean over its samples.
    #[test]
    fn an_elastic_epoch_sees_each_sample_once_whatever_the_world_does() {
        let sampler = ElasticSampler::new(1003, 16).unwrap().with_seed(7);
        let order = sampler.order();
        let mut seen = vec![0u32; 1003];
        let mut position = 0;
        let mut step = 0;
        loop {
            let world = match step {
                0..=4 => 3,
                5..=9 => 2,
                _ => 5,
            };
            let shares: Vec<ElasticStep> = (0..world)
                .map_while(|r| sampler.step(&order, position, world, r))
                .collect();
            if shares.is_empty() {
                break;
            }
            // Step 7 is dropped (a rank died during it): its samples are not seen, and the
            // next step starts from the same position.
            let dropped = step == 7;
            let n = shares[0].step_samples;
            let mean_weight: f32 = shares.iter().map(|s| s.loss_scale).sum::<f32>() / world as f32;
            assert!(
                (mean_weight - 1.0).abs() < 1e-6,
                "step {step}: {mean_weight}"
            );
            assert_eq!(shares.iter().map(|s| s.real).sum::<usize>(), n);
            if !dropped {
                for s in &shares {
                    for &i in &s.indices[..s.real] {
                        seen[i] += 1;
                    }
                }
                position = shares[0].next;
            }
            step += 1;
        }
        assert!(seen.iter().all(|&c| c == 1), "counts other than 1: {:?}", {
            let odd: Vec<(usize, u32)> = seen
                .iter()
                .copied()
                .enumerate()
                .filter(|(_, c)| *c != 1)
                .collect();
            odd
        });
        // A step takes the tail with it when fewer than W samples would be left after it.
        assert_eq!(sampler.step_len(1003 - 84, 5), 84);
        assert_eq!(sampler.step_len(1003 - 85, 5), 80);
    }

    /// With drop-last every step gives every rank a full batch (weight 1) through a world that
    /// changes, and the epoch ends before the step that would be partial: the samples trained
    /// are the order's prefix, each once, and what is left is less than a full step.
    #[test]
    fn with_drop_last_every_step_is_full_and_the_partial_tail_is_left() {
        let sampler = ElasticSampler::new(1003, 16)
            .unwrap()
            .with_seed(7)
            .with_drop_last(true);
        let order = sampler.order();
        let mut seen = vec![0u32; 1003];
        let (mut position, mut step, mut world) = (0, 0, 3);
        while let Some(first) = sampler.step(&order, position, world, 0) {
            for r in 0..world {
                let share = sampler.step(&order, position, world, r).unwrap();
                assert_eq!((share.indices.len(), share.real), (16, 16), "step {step}");
                assert_eq!(share.loss_scale, 1.0);
                for &i in &share.indices {
                    seen[i] += 1;
                }
            }
            position = first.next;
            step += 1;
            world = if step < 10 { 3 } else { 5 };
        }
        // 10 steps of 48 (480), then 6 of 80 (960): 43 left, less than a step of 80.
        assert_eq!((step, position), (16, 960));
        let left = 1003 - position;
        assert!(left < world * 16, "{left} samples left with world {world}");
        assert_eq!(sampler.step_len(position, world), 0);
        assert_eq!(sampler.steps_left(position, world), 0);
        for (k, &i) in order.iter().enumerate() {
            assert_eq!(
                seen[i],
                u32::from(k < position),
                "sample at {k} of the order"
            );
        }
    }

    /// Fewer samples left than ranks: the ranks without one get a stand-in of weight 0.
    #[test]
    fn a_rank_with_no_sample_left_gets_a_stand_in_of_weight_zero() {
        let sampler = ElasticSampler::new(10, 4).unwrap().with_shuffle(false);
        let order = sampler.order();
        let shares: Vec<ElasticStep> = (0..3)
            .map(|r| sampler.step(&order, 8, 3, r).unwrap())
            .collect();
        assert_eq!(shares[0].indices, [8]);
        assert_eq!(shares[1].indices, [9]);
        assert_eq!(
            (shares[2].indices.as_slice(), shares[2].real),
            (&[8][..], 0)
        );
        assert_eq!(shares[2].loss_scale, 0.0);
        assert_eq!(shares[0].loss_scale, 1.5);
        assert!(sampler.step(&order, 10, 3, 0).is_none());
        // A full step: every scale is exactly 1.
        let s = sampler.step(&order, 0, 2, 1).unwrap();
        assert_eq!(
            (s.indices.as_slice(), s.loss_scale),
            (&[4, 5, 6, 7][..], 1.0)
        );
        assert_eq!(sampler.steps_left(0, 3), 1);
        assert_eq!(sampler.steps_left(0, 2), 2);
        assert_eq!(sampler.steps_left(0, 1), 3);
    }

    #[test]
    fn permutation_is_pinned() {
        // Pins the algorithm: a change here changes every seeded run.
        assert_eq!(permutation(10, 0, 0), PINNED);
    }
    const PINNED: [usize; 10] = [1, 2, 5, 7, 0, 8, 4, 3, 9, 6];
}
