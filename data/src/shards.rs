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
//! [`ShardWriter`] writes both from Rust (`make-shards`, `cargo xtask make-shards`).
//!
//! # The loader
//!
//! [`ShardLoader`] follows [`DistributedSampler`]'s contract at the level of shards, reusing its
//! code: every epoch a seeded permutation of the shards (set with
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
//! [`ShardLoader::exact`] is the evaluation mode ([`DistributedSampler::exact`] over shards):
//! every shard to exactly one rank, no padding, no shuffle.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::loader::CpuBatch;
use crate::sampler::permutation;
use crate::{DataError, DistributedSampler, Normalization};

/// The name of the index file in a split's directory.
pub const INDEX_FILE: &str = "index.json";
/// The value of the index's `format` field.
pub const FORMAT_NAME: &str = "ddp-shards";
/// The format version this crate reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The name of the images tensor in a shard.
pub const IMAGES_TENSOR: &str = "images";
/// The name of the labels tensor in a shard.
pub const LABELS_TENSOR: &str = "labels";
/// The number of samples per shard that `make-shards` uses by default.
pub const DEFAULT_SHARD_SIZE: usize = 1000;

/// The largest index file read (a million shards fit in far less).
const MAX_INDEX_BYTES: u64 = 256 << 20;
/// The largest sample (in elements) and shard (in samples) accepted from an index.
const MAX_SAMPLE_ELEMS: usize = 1 << 28;
const MAX_SHARD_SAMPLES: usize = 1 << 24;

/// The parsed `index.json` of a split. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardIndex {
    /// Always [`FORMAT_NAME`].
    pub format: String,
    /// Always [`FORMAT_VERSION`].
    pub version: u32,
    /// The shape of one sample (MNIST: `[28, 28]`).
    pub sample_shape: Vec<usize>,
    /// Labels lie in `0..num_classes`.
    pub num_classes: u32,
    /// The sum of the shards' sample counts.
    pub num_samples: usize,
    /// The shards, in data set order.
    pub shards: Vec<ShardEntry>,
}

/// One shard in a [`ShardIndex`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// The file name, relative to the index's directory (no directory part).
    pub file: String,
    /// Number of samples in the shard.
    pub samples: usize,
    /// The file's size in bytes, checked when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// CRC-32 (ISO-HDLC, as zlib's) of the whole file, checked when present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

/// A validated split on disk: its directory and index. Opening it reads only the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSet {
    dir: PathBuf,
    index: ShardIndex,
    /// Samples used of each shard (all of them, unless [`limit`](Self::limit) cut the set).
    used: Vec<usize>,
}

/// One shard read into memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The shard's position in the index.
    pub id: usize,
    /// The pixels, sample after sample.
    pub pixels: Vec<u8>,
    /// The labels.
    pub labels: Vec<u8>,
}

impl Shard {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the shard holds no sample.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

fn bad_index(path: &Path, field: impl Into<String>, detail: impl Into<String>) -> DataError {
    DataError::BadIndex {
        path: path.to_path_buf(),
        field: field.into(),
        detail: detail.into(),
    }
}

fn bad_shard(path: &Path, detail: impl Into<String>) -> DataError {
    DataError::BadShard {
        path: path.to_path_buf(),
        detail: detail.into(),
    }
}

impl ShardIndex {
    /// Checks the index's fields; `path` is only for messages.
    pub fn validate(&self, path: &Path) -> Result<(), DataError> {
        if self.format != FORMAT_NAME {
            return Err(bad_index(
                path,
                "format",
                format!("`{}`, expected `{FORMAT_NAME}`", self.format),
            ));
        }
        if self.version != FORMAT_VERSION {
            return Err(bad_index(
                path,
                "version",
                format!(
                    "{} is not supported (this build reads version {FORMAT_VERSION})",
                    self.version
                ),
            ));
        }
        let elems = self
            .sample_shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|&e| e > 0 && e <= MAX_SAMPLE_ELEMS);
        if self.sample_shape.is_empty() || elems.is_none() {
            return Err(bad_index(
                path,
                "sample_shape",
                format!(
                    "{:?}: needs at least one dimension, none zero, at most {MAX_SAMPLE_ELEMS} \
                     elements",
                    self.sample_shape
                ),
            ));
        }
        if self.num_classes == 0 || self.num_classes > 256 {
            return Err(bad_index(
                path,
                "num_classes",
                format!("{} is not in 1..=256 (labels are u8)", self.num_classes),
            ));
        }
        if self.shards.is_empty() {
            return Err(bad_index(path, "shards", "no shard"));
        }
        let mut total = 0usize;
        let mut names = std::collections::HashSet::new();
        for (i, s) in self.shards.iter().enumerate() {
            let plain = Path::new(&s.file)
                .file_name()
                .is_some_and(|n| n == s.file.as_str());
            if !plain || s.file == ".." || s.file == "." {
                return Err(bad_index(
                    path,
                    format!("shards[{i}].file"),
                    format!("`{}` is not a plain file name", s.file),
                ));
            }
            if !names.insert(s.file.as_str()) {
                return Err(bad_index(
                    path,
                    format!("shards[{i}].file"),
                    format!("`{}` is listed twice", s.file),
                ));
            }
            if s.samples == 0 || s.samples > MAX_SHARD_SAMPLES {
                return Err(bad_index(
                    path,
                    format!("shards[{i}].samples"),
                    format!("{} is not in 1..={MAX_SHARD_SAMPLES}", s.samples),
                ));
            }
            total = total.saturating_add(s.samples);
        }
        if total != self.num_samples {
            return Err(bad_index(
                path,
                "num_samples",
                format!("{} but the shards hold {total} samples", self.num_samples),
            ));
        }
        Ok(())
    }

    /// Elements of one sample (the product of `sample_shape`).
    pub fn sample_elems(&self) -> usize {
        self.sample_shape.iter().product()
    }
}

impl ShardSet {
    /// Opens the split in `dir`: reads and validates `dir/index.json` and checks that every
    /// shard file exists (and has the size the index gives, where it gives one) without opening
    /// any. Errors name the file and field at fault.
    pub fn open(dir: &Path) -> Result<ShardSet, DataError> {
        let path = dir.join(INDEX_FILE);
        let file = File::open(&path).map_err(DataError::io(&path))?;
        let len = file.metadata().map_err(DataError::io(&path))?.len();
        if len > MAX_INDEX_BYTES {
            return Err(bad_index(
                &path,
                "file",
                format!("{len} bytes, more than the {MAX_INDEX_BYTES} accepted"),
            ));
        }
        let text = std::io::read_to_string(file).map_err(DataError::io(&path))?;
        let index: ShardIndex = serde_json::from_str(&text).map_err(|e| {
            bad_index(
                &path,
                "file",
                format!(
                    "not a valid index (line {}, column {}): {e}",
                    e.line(),
                    e.column()
                ),
            )
        })?;
        index.validate(&path)?;
        for entry in &index.shards {
            let shard = dir.join(&entry.file);
            let meta = std::fs::metadata(&shard).map_err(DataError::io(&shard))?;
            if !meta.is_file() {
                return Err(bad_shard(&shard, "not a regular file"));
            }
            if let Some(bytes) = entry.bytes {
                if meta.len() != bytes {
                    return Err(bad_shard(
                        &shard,
                        format!(
                            "{} bytes, but {} says {bytes} (truncated or replaced)",
                            meta.len(),
                            path.display()
                        ),
                    ));
                }
            }
        }
        let used = index.shards.iter().map(|s| s.samples).collect();
        Ok(ShardSet {
            dir: dir.to_path_buf(),
            index,
            used,
        })
    }

    /// Only the first `n` samples of the set (the shards that hold them, the last one cut);
    /// the whole set when it holds no more than `n`. Errors when `n` is 0.
    pub fn limit(mut self, n: usize) -> Result<ShardSet, DataError> {
        if n == 0 {
            return Err(DataError::InvalidArgument(
                "a shard set limited to 0 samples".into(),
            ));
        }
        let mut left = n;
        let mut used = Vec::new();
        for &u in &self.used {
            if left == 0 {
                break;
            }
            used.push(u.min(left));
            left -= u.min(left);
        }
        self.used = used;
        Ok(self)
    }

    /// The split's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index.
    pub fn index(&self) -> &ShardIndex {
        &self.index
    }

    /// Number of shards used.
    pub fn num_shards(&self) -> usize {
        self.used.len()
    }

    /// Number of samples used (all, unless [`limit`](Self::limit) cut the set).
    pub fn len(&self) -> usize {
        self.used.iter().sum()
    }

    /// Whether the set holds no sample (never true for an opened set).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples used of shard `id`.
    pub fn shard_len(&self, id: usize) -> usize {
        self.used[id]
    }

    /// The path of shard `id`.
    pub fn shard_path(&self, id: usize) -> PathBuf {
        self.dir.join(&self.index.shards[id].file)
    }

    /// Reads shard `id` through mmap, validates it against the index (size, checksum, tensor
    /// names, dtypes, shapes, labels) and copies its used samples out. Errors name the file.
    pub fn read_shard(&self, id: usize) -> Result<Shard, DataError> {
        let entry = self.index.shards.get(id).ok_or_else(|| {
            DataError::InvalidArgument(format!(
                "shard {id} is beyond the {} shards of {}",
                self.index.shards.len(),
                self.dir.display()
            ))
        })?;
        let path = self.dir.join(&entry.file);
        let file = File::open(&path).map_err(DataError::io(&path))?;
        let len = file.metadata().map_err(DataError::io(&path))?.len();
        if let Some(bytes) = entry.bytes {
            if len != bytes {
                return Err(bad_shard(
                    &path,
                    format!("{len} bytes, but the index says {bytes} (truncated or replaced)"),
                ));
            }
        }
        if len < 8 {
            return Err(bad_shard(
                &path,
                format!("{len} bytes: truncated (not even a safetensors header)"),
            ));
        }
        // SAFETY: the map is read-only and private to this function; the file is not expected
        // to change while it is read (as for any mmap reader, a concurrent writer could make the
        // bytes change under us, which is caught by the checksum where the index has one).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(DataError::io(&path))?;
        if let Some(crc) = entry.crc32 {
            let found = crc32fast::hash(&map);
            if found != crc {
                return Err(bad_shard(
                    &path,
                    format!(
                        "CRC-32 {found:#010x}, but the index says {crc:#010x} (corrupt or \
                         replaced)"
                    ),
                ));
            }
        }
        let tensors = SafeTensors::deserialize(&map).map_err(|e| {
            bad_shard(
                &path,
                format!("not a valid safetensors file (truncated or corrupt): {e}"),
            )
        })?;
        let n = entry.samples;
        let mut images_shape = vec![n];
        images_shape.extend(&self.index.sample_shape);
        let images = tensor(&tensors, &path, IMAGES_TENSOR, &images_shape)?;
        let labels = tensor(&tensors, &path, LABELS_TENSOR, &[n])?;
        let used = self.used[id];
        let labels = labels[..used].to_vec();
        if let Some(i) = labels
            .iter()
            .position(|&l| u32::from(l) >= self.index.num_classes)
        {
            return Err(bad_shard(
                &path,
                format!(
                    "label {} of sample {i} is not below num_classes {}",
                    labels[i], self.index.num_classes
                ),
            ));
        }
        let pixels = images[..used * self.index.sample_elems()].to_vec();
        Ok(Shard { id, pixels, labels })
    }
}

/// The data of tensor `name`, checked to be `U8` of `shape`.
fn tensor<'a>(
    tensors: &SafeTensors<'a>,
    path: &Path,
    name: &str,
    shape: &[usize],
) -> Result<&'a [u8], DataError> {
    let view = tensors
        .tensor(name)
        .map_err(|_| bad_shard(path, format!("no tensor `{name}`")))?;
    if view.dtype() != Dtype::U8 {
        return Err(bad_shard(
            path,
            format!("tensor `{name}` has dtype {:?}, expected U8", view.dtype()),
        ));
    }
    if view.shape() != shape {
        return Err(bad_shard(
            path,
            format!(
                "tensor `{name}` has shape {:?}, the index implies {shape:?}",
                view.shape()
            ),
        ));
    }
    Ok(view.data())
}

/// Writes a split shard by shard: [`create`](Self::create), [`write_shard`](Self::write_shard)
/// for each, then [`finish`](Self::finish) writes the index. Memory: one shard at a time.
#[derive(Debug)]
pub struct ShardWriter {
    dir: PathBuf,
    index: ShardIndex,
}

impl ShardWriter {
    /// A writer into `dir` (created if needed) of samples of `sample_shape` with labels below
    /// `num_classes`.
    pub fn create(
        dir: &Path,
        sample_shape: &[usize],
        num_classes: u32,
    ) -> Result<ShardWriter, DataError> {
        std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
        let index = ShardIndex {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            sample_shape: sample_shape.to_vec(),
            num_classes,
            num_samples: 0,
            shards: Vec::new(),
        };
        Ok(ShardWriter {
            dir: dir.to_path_buf(),
            index,
        })
    }

    /// Writes the next shard, `shard-NNNNN.safetensors`: `pixels` (sample after sample) and
    /// `labels` (one a sample).
    pub fn write_shard(&mut self, pixels: &[u8], labels: &[u8]) -> Result<(), DataError> {
        let n = labels.len();
        let elems: usize = self.index.sample_shape.iter().product();
        if n == 0 || pixels.len() != n * elems {
            return Err(DataError::InvalidArgument(format!(
                "a shard of {n} labels needs {} pixels, got {}",
                n * elems,
                pixels.len()
            )));
        }
        if let Some(&l) = labels
            .iter()
            .find(|&&l| u32::from(l) >= self.index.num_classes)
        {
            return Err(DataError::InvalidArgument(format!(
                "label {l} is not below num_classes {}",
                self.index.num_classes
            )));
        }
        let file = format!("shard-{:05}.safetensors", self.index.shards.len());
        let path = self.dir.join(&file);
        let mut shape = vec![n];
        shape.extend(&self.index.sample_shape);
        let to_err = |e: safetensors::SafeTensorError| bad_shard(&path, e.to_string());
        let images =
            safetensors::tensor::TensorView::new(Dtype::U8, shape, pixels).map_err(to_err)?;
        let labels_view =
            safetensors::tensor::TensorView::new(Dtype::U8, vec![n], labels).map_err(to_err)?;
        let bytes = safetensors::serialize(
            [(IMAGES_TENSOR, images), (LABELS_TENSOR, labels_view)],
            None,
        )
        .map_err(to_err)?;
        write_atomic(&path, &bytes)?;
        self.index.shards.push(ShardEntry {
            file,
            samples: n,
            bytes: Some(bytes.len() as u64),
            crc32: Some(crc32fast::hash(&bytes)),
        });
        self.index.num_samples += n;
        Ok(())
    }

    /// Writes `index.json` (last, so that a split with an index is complete) and returns it.
    pub fn finish(self) -> Result<ShardIndex, DataError> {
        let path = self.dir.join(INDEX_FILE);
        self.index.validate(&path)?;
        let mut text = serde_json::to_string_pretty(&self.index)
            .map_err(|e| bad_index(&path, "file", e.to_string()))?;
        text.push('\n');
        write_atomic(&path, text.as_bytes())?;
        Ok(self.index)
    }
}

/// Writes a whole split from memory in shards of `shard_size` samples (the last one shorter).
pub fn write_shards(
    dir: &Path,
    pixels: &[u8],
    labels: &[u8],
    sample_shape: &[usize],
    num_classes: u32,
    shard_size: usize,
) -> Result<ShardIndex, DataError> {
    if shard_size == 0 {
        return Err(DataError::InvalidArgument(
            "shard_size must be at least 1".into(),
        ));
    }
    let elems: usize = sample_shape.iter().product();
    if pixels.len() != labels.len() * elems {
        return Err(DataError::InvalidArgument(format!(
            "{} labels need {} pixels, got {}",
            labels.len(),
            labels.len() * elems,
            pixels.len()
        )));
    }
    let mut writer = ShardWriter::create(dir, sample_shape, num_classes)?;
    for (p, l) in pixels
        .chunks(shard_size * elems.max(1))
        .zip(labels.chunks(shard_size))
    {
        writer.write_shard(p, l)?;
    }
    writer.finish()
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(DataError::io(dir))?;
    tmp.write_all(bytes).map_err(DataError::io(path))?;
    tmp.persist(path)
        .map_err(|e| DataError::io(path)(e.error))?;
    Ok(())
}

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
        Ok(ShardBatches {
            rx: Some(batch_rx),
            threads: vec![batcher, reader],
            next: 0,
            num_batches: self.num_batches(),
            failed: false,
        })
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

/// What the batcher thread does with the shards the reader sends.
struct BatchJob<const D: usize> {
    /// Shards in one pass over the rank's list: a shuffle group never spans two passes, so
    /// that the samples beyond `target` (cut off) are all repeats from the wrap-around.
    pass_len: usize,
    target: usize,
    batch_size: usize,
    drop_last_batch: bool,
    group_shards: usize,
    shuffle: bool,
    seed: u64,
    elems: usize,
    shape: [usize; D],
    table: Arc<[f32; 256]>,
}

impl<const D: usize> BatchJob<D> {
    /// Groups `group_shards` shards, shuffles their samples together, emits batches until
    /// `target` samples; `send` returns false when the consumer is gone.
    fn run(
        self,
        rx: Receiver<Result<Shard, DataError>>,
        mut send: impl FnMut(Result<CpuBatch<D>, DataError>) -> bool,
    ) {
        let mut emitted = 0usize;
        let mut inputs = Vec::with_capacity(self.batch_size * self.elems);
        let mut targets = Vec::with_capacity(self.batch_size);
        let mut group: Vec<Shard> = Vec::with_capacity(self.group_shards);
        let mut group_no = 0u64;
        let mut received = 0usize;
        while emitted < self.target {
            group.clear();
            while group.len() < self.group_shards {
                if received.is_multiple_of(self.pass_len) && !group.is_empty() {
                    break; // the end of a pass
                }
                match rx.recv() {
                    Ok(Ok(shard)) => {
                        received += 1;
                        group.push(shard);
                    }
                    Ok(Err(e)) => {
                        send(Err(e));
                        return;
                    }
                    Err(_) => break, // the reader has no more shards
                }
            }
            if group.is_empty() {
                break;
            }
            let refs: Vec<(u32, u32)> = group
                .iter()
                .enumerate()
                .flat_map(|(g, s)| (0..s.len() as u32).map(move |i| (g as u32, i)))
                .collect();
            let order = if self.shuffle {
                permutation(refs.len(), self.seed, group_no)
            } else {
                (0..refs.len()).collect()
            };
            group_no += 1;
            for pos in order {
                if emitted == self.target {
                    break;
                }
                let (g, i) = refs[pos];
                let shard = &group[g as usize];
                let i = i as usize;
                let pixels = &shard.pixels[i * self.elems..(i + 1) * self.elems];
                inputs.extend(pixels.iter().map(|&p| self.table[p as usize]));
                targets.push(i64::from(shard.labels[i]));
                emitted += 1;
                if targets.len() == self.batch_size
                    && !send(Ok(self.take(&mut inputs, &mut targets)))
                {
                    return;
                }
            }
        }
        if !targets.is_empty() && !self.drop_last_batch {
            send(Ok(self.take(&mut inputs, &mut targets)));
        }
    }

    fn take(&self, inputs: &mut Vec<f32>, targets: &mut Vec<i64>) -> CpuBatch<D> {
        let mut shape = self.shape;
        shape[0] = targets.len();
        CpuBatch {
            inputs: std::mem::replace(inputs, Vec::with_capacity(self.batch_size * self.elems)),
            shape,
            targets: std::mem::replace(targets, Vec::with_capacity(self.batch_size)),
        }
    }
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

/// The batches of one epoch of a [`ShardLoader`], as CPU data (see
/// [`CpuBatch::into_tensors`]). An error (a bad shard) is yielded once, then the iterator ends.
/// Dropping it early stops the threads.
pub struct ShardBatches<const D: usize> {
    rx: Option<Receiver<Result<CpuBatch<D>, DataError>>>,
    threads: Vec<JoinHandle<()>>,
    next: usize,
    num_batches: usize,
    failed: bool,
}

impl<const D: usize> ShardBatches<D> {
    fn stop(&mut self) {
        self.rx = None; // the batcher's sends fail, it returns and drops the reader's receiver
        for handle in self.threads.drain(..) {
            if let Err(panic) = handle.join() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

impl<const D: usize> Iterator for ShardBatches<D> {
    type Item = Result<CpuBatch<D>, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next == self.num_batches {
            return None;
        }
        let got = self.rx.as_ref()?.recv();
        match got {
            Ok(Ok(batch)) => {
                self.next += 1;
                Some(Ok(batch))
            }
            Ok(Err(e)) => {
                self.failed = true;
                self.stop();
                Some(Err(e))
            }
            Err(_) => {
                // The batcher stopped early: a thread panicked (passed on by stop) or the
                // shards held fewer samples than the index says.
                self.failed = true;
                self.stop();
                Some(Err(DataError::InvalidArgument(format!(
                    "the shard stream ended after {} of {} batches",
                    self.next, self.num_batches
                ))))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.failed {
            0
        } else {
            self.num_batches - self.next
        };
        (0, Some(left))
    }
}

impl<const D: usize> Drop for ShardBatches<D> {
    fn drop(&mut self) {
        self.stop();
    }
}
