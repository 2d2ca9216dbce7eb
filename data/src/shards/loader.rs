//! [`ShardLoader`]: one rank's batches of a split, epoch by epoch, streamed by two threads: a
//! reader (the rank's next shards, at most `prefetch_shards` ahead) and a batcher
//! (`batches.rs`: shuffles `shuffle_shards` shards at a time, builds the batches two ahead).

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::bounded;

use super::batches::{BatchJob, ShardBatches};
use super::set::{Shard, ShardSet};
use crate::loader::CpuBatch;
use crate::{DataError, DistributedSampler, Normalization};

/// Settings of a [`ShardLoader`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShardLoaderConfig {
    /// Samples per batch (default 64). At least 1.
    pub batch_size: usize,
    /// Drops the last batch of an epoch when it is short (default false).
    pub drop_last_batch: bool,
    /// Shards read ahead of the shuffle buffer, `K` (default 2). At least 1.
    pub prefetch_shards: usize,
    /// Shards whose samples are shuffled together (default 2). At least 1.
    pub shuffle_shards: usize,
    /// Shuffles the shard order and the samples inside the buffer (default true).
    pub shuffle: bool,
    /// Seed of both shuffles (default 0); the same on every rank.
    pub seed: u64,
    /// Cuts the shard order to a multiple of the world size instead of padding (default false).
    pub drop_last: bool,
    /// Pixel normalisation (default: MNIST's mean and standard deviation).
    pub normalization: Normalization,
}

impl Default for ShardLoaderConfig {
    fn default() -> Self {
        ShardLoaderConfig {
            batch_size: 64,
            drop_last_batch: false,
            prefetch_shards: 2,
            shuffle_shards: 2,
            shuffle: true,
            seed: 0,
            drop_last: false,
            normalization: Normalization::default(),
        }
    }
}

/// Streams the batches of one rank's shards, epoch by epoch. See the module documentation.
///
/// `D` is the rank of the batch tensor: `[batch, 1, ..., 1, ...sample_shape]` (MNIST with
/// `D = 4`: `[B, 1, 28, 28]`).
#[derive(Debug, Clone)]
pub struct ShardLoader<const D: usize> {
    set: Arc<ShardSet>,
    sampler: DistributedSampler,
    config: ShardLoaderConfig,
    samples_per_rank: usize,
    table: Arc<[f32; 256]>,
}

impl<const D: usize> ShardLoader<D> {
    /// A training loader for `rank` of `num_replicas` (DistributedSampler's contract over
    /// shards). Errors on a bad configuration or a sample shape of more than `D - 1` dimensions.
    pub fn new(
        set: ShardSet,
        num_replicas: usize,
        rank: usize,
        config: ShardLoaderConfig,
    ) -> Result<ShardLoader<D>, DataError> {
        let sampler = DistributedSampler::new(set.num_shards(), num_replicas, rank)?
            .with_seed(config.seed)
            .with_shuffle(config.shuffle)
            .with_drop_last(config.drop_last);
        ShardLoader::build(set, sampler, config)
    }

    /// An evaluation loader: every shard to exactly one rank (`r, r + R, ...` in index order),
    /// no padding, no shuffle; ranks may get different numbers of samples and batches.
    pub fn exact(
        set: ShardSet,
        num_replicas: usize,
        rank: usize,
        mut config: ShardLoaderConfig,
    ) -> Result<ShardLoader<D>, DataError> {
        config.shuffle = false;
        let sampler = DistributedSampler::exact(set.num_shards(), num_replicas, rank)?;
        ShardLoader::build(set, sampler, config)
    }

    fn build(
        set: ShardSet,
        sampler: DistributedSampler,
        config: ShardLoaderConfig,
    ) -> Result<ShardLoader<D>, DataError> {
        let positive = [
            ("batch_size", config.batch_size),
            ("prefetch_shards", config.prefetch_shards),
            ("shuffle_shards", config.shuffle_shards),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(DataError::InvalidArgument(format!(
                "{name} must be at least 1"
            )));
        }
        if D < 2 || set.index().sample_shape.len() > D - 1 {
            return Err(DataError::InvalidArgument(format!(
                "samples of shape {:?} do not fit batches of rank {D}",
                set.index().sample_shape
            )));
        }
        let samples_per_rank = if sampler.is_exact() {
            sampler.indices().iter().map(|&s| set.shard_len(s)).sum()
        } else {
            let mut lens: Vec<usize> = (0..set.num_shards()).map(|s| set.shard_len(s)).collect();
            lens.sort_unstable();
            let k = sampler.num_samples();
            if sampler.drop_last() {
                lens[..k].iter().sum()
            } else {
                // k may exceed the number of shards (padding when shards < ranks): the largest
                // shard, repeated, bounds every rank's share.
                let largest = lens.last().copied().unwrap_or(0);
                lens.iter()
                    .rev()
                    .chain(std::iter::repeat(&largest))
                    .take(k)
                    .sum()
            }
        };
        let n = config.normalization;
        let table = Arc::new(std::array::from_fn(|p| (p as f32 / 255.0 - n.mean) / n.std));
        Ok(ShardLoader {
            set: Arc::new(set),
            sampler,
            config,
            samples_per_rank,
            table,
        })
    }

    /// Sets the epoch, which with the seed determines the shard order and the shuffle.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.sampler.epoch()
    }

    /// The shard set.
    pub fn set(&self) -> &ShardSet {
        &self.set
    }

    /// The settings.
    pub fn config(&self) -> ShardLoaderConfig {
        self.config
    }

    /// The shard-level sampler (its "dataset" is the list of shards).
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// This rank's shards for the current epoch, in reading order (before any wrap-around).
    pub fn shards(&self) -> Vec<usize> {
        self.sampler.indices()
    }

    /// Samples this rank yields per epoch: the same on every rank and every epoch, except in
    /// exact mode.
    pub fn num_samples(&self) -> usize {
        self.samples_per_rank
    }

    /// Batches this rank yields per epoch.
    pub fn num_batches(&self) -> usize {
        let (n, b) = (self.samples_per_rank, self.config.batch_size);
        if self.config.drop_last_batch {
            n / b
        } else {
            n.div_ceil(b)
        }
    }

    /// The shape of a batch of `n` samples.
    pub fn batch_shape(&self, n: usize) -> [usize; D] {
        let shape = &self.set.index().sample_shape;
        let mut out = [1usize; D];
        out[0] = n;
        out[D - shape.len()..].copy_from_slice(shape);
        out
    }

    /// Starts streaming the current epoch: spawns the reader and the batcher threads.
    pub fn iter(&self) -> Result<ShardBatches<D>, DataError> {
        let order = self.shards();
        let cycle = !self.sampler.is_exact() && !self.sampler.drop_last();
        let (shard_tx, shard_rx) = bounded::<Result<Shard, DataError>>(self.config.prefetch_shards);
        let set = self.set.clone();
        let reader = spawn("ddp-data-shard-reader", move || {
            if order.is_empty() {
                return;
            }
            let reads = if cycle { usize::MAX } else { order.len() };
            for &id in order.iter().cycle().take(reads) {
                let shard = set.read_shard(id);
                let failed = shard.is_err();
                if shard_tx.send(shard).is_err() || failed {
                    return;
                }
            }
        })?;
        let (batch_tx, batch_rx) = bounded::<Result<CpuBatch<D>, DataError>>(2);
        let job = BatchJob {
            pass_len: self.sampler.num_samples().max(1),
            target: self.samples_per_rank,
            batch_size: self.config.batch_size,
            drop_last_batch: self.config.drop_last_batch,
            group_shards: self.config.shuffle_shards,
            shuffle: self.config.shuffle,
            seed: mix(
                self.config.seed,
                self.sampler.epoch(),
                self.sampler.rank() as u64,
            ),
            elems: self.set.index().sample_elems(),
            shape: self.batch_shape(1),
            table: self.table.clone(),
        };
        let batcher = spawn("ddp-data-shard-batcher", move || {
            job.run(shard_rx, |b| batch_tx.send(b).is_ok())
        })?;
        Ok(ShardBatches::new(
            batch_rx,
            vec![batcher, reader],
            self.num_batches(),
        ))
    }
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, DataError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| DataError::Io {
            path: format!("<{name} thread>").into(),
            source: e,
        })
}

/// A seed for `(seed, epoch, rank)`: splitmix64's finaliser over the three.
fn mix(seed: u64, epoch: u64, rank: u64) -> u64 {
    let mut z = seed
        ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ rank.wrapping_add(1).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
