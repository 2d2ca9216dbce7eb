//! Reading a split: [`ShardSet`] opens a directory (its index, and a look at every shard file's
//! size, without opening any), and [`ShardSet::read_shard`] reads one [`Shard`] through mmap,
//! checked against the index (size, checksum, tensor names, dtypes, shapes, labels).

use std::fs::File;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use super::index::{
    bad_index, bad_shard, ShardIndex, IMAGES_TENSOR, INDEX_FILE, LABELS_TENSOR, MAX_INDEX_BYTES,
};
use crate::DataError;

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
