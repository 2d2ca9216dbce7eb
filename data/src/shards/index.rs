//! The index of a split (`index.json`): [`ShardIndex`] and its [`ShardEntry`]s, the format's
//! names and limits, and the checks every index passes before a shard is opened.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::DataError;

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
pub(super) const MAX_INDEX_BYTES: u64 = 256 << 20;
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

/// An error about the index at `path`: its field `field` and what is wrong with it.
pub(super) fn bad_index(
    path: &Path,
    field: impl Into<String>,
    detail: impl Into<String>,
) -> DataError {
    DataError::BadIndex {
        path: path.to_path_buf(),
        field: field.into(),
        detail: detail.into(),
    }
}

/// An error about the shard file at `path`.
pub(super) fn bad_shard(path: &Path, detail: impl Into<String>) -> DataError {
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
