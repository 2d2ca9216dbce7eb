//! Sharded data sets on disk and a streaming loader over them, for data sets that do not fit in
//! every rank's memory.
//!
//! # The format (version 1)
//!
//! A split is a directory holding `index.json` and shard files. Each shard is a
//! [safetensors](https://github.com/huggingface/safetensors) file with two tensors:
//!
//! - `images`: `U8`, shape `[n, ...sample_shape]` (MNIST: `[n, 28, 28]`), raw pixels 0..=255;
//! - `labels`: `U8`, shape `[n]`, each below `num_classes`.
//!
//! Other tensors are ignored. The index is JSON:
//!
//! ```json
//! {
//!   "format": "ddp-shards", "version": 1,
//!   "sample_shape": [28, 28], "num_classes": 10, "num_samples": 2500,
//!   "shards": [
//!     {"file": "shard-00000.safetensors", "samples": 1000, "bytes": 784136, "crc32": 305419896},
//!     {"file": "shard-00001.safetensors", "samples": 1000},
//!     {"file": "shard-00002.safetensors", "samples": 500}
//!   ]
//! }
//! ```
//!
//! `bytes` (the file's size) and `crc32` (CRC-32/ISO-HDLC of the whole file, Python's
//! `zlib.crc32`) are optional; when present they are checked, so that a truncated or corrupt
//! shard is an error naming it. A Python user writes a shard with one call,
//! `safetensors.numpy.save_file({"images": x, "labels": y}, path)`, and the index with `json`.
//! [`ShardWriter`] writes both from Rust (`make-shards`, `cargo xtask make-shards`), each file
//! atomically and durably (`ddp_fsio::atomic_write`).
//!
//! # The loader
//!
//! [`ShardLoader`] follows [`DistributedSampler`](crate::DistributedSampler)'s contract at the
//! level of shards, reusing its code: every epoch a seeded permutation of the shards (set with
//! [`set_epoch`](ShardLoader::set_epoch)), padded by wrapping or cut (`drop_last`) to a multiple
//! of the world size, rank `r` taking shards `r, r + R, ...`. Shards may differ in size (the last
//! one usually is short), so the number of samples per rank is fixed up front for all epochs:
//! the sum of the `k` largest shards when padding (a rank short of it wraps around its own
//! shards), of the `k` smallest with `drop_last` (`k` shards per rank). Every rank thus runs the
//! same number of steps, every epoch.
//!
//! A background thread reads the rank's next shards (and only those: a rank never opens
//! another's) through mmap, validates them, copies them out and unmaps them, at most
//! `prefetch_shards` ahead; a second thread shuffles the samples of `shuffle_shards` shards at a
//! time and builds the batches (`f32` pixels normalised as [`Mnist`](crate::Mnist) does, `i64`
//! labels) two ahead. So memory holds at most `prefetch_shards + shuffle_shards + 2` shards and
//! a few batches, whatever the size of the data set.
//!
//! [`ShardLoader::exact`] is the evaluation mode
//! ([`DistributedSampler::exact`](crate::DistributedSampler::exact) over shards): every shard to
//! exactly one rank, no padding, no shuffle.
//!
//! Where things are: `index.rs` (the index and its checks), `set.rs` (opening a split, reading
//! a shard), `writer.rs` (writing a split), `loader.rs` ([`ShardLoader`] and its reader
//! thread), `batches.rs` (the batcher thread, [`ShardBatches`]).

mod batches;
mod index;
mod loader;
mod set;
mod writer;

pub use batches::ShardBatches;
pub use index::{
    ShardEntry, ShardIndex, DEFAULT_SHARD_SIZE, FORMAT_NAME, FORMAT_VERSION, IMAGES_TENSOR,
    INDEX_FILE, LABELS_TENSOR,
};
pub use loader::{ShardLoader, ShardLoaderConfig};
pub use set::{Shard, ShardSet};
pub use writer::{write_shards, ShardWriter};
