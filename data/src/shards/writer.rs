//! Writing a split: [`ShardWriter`] writes shard after shard (`shard-NNNNN.safetensors`) and the
//! index last, so that a split with an index is complete; [`write_shards`] writes a whole split
//! from memory. Every file is written atomically and durably.

use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::index::{
    bad_index, bad_shard, ShardEntry, ShardIndex, FORMAT_NAME, FORMAT_VERSION, IMAGES_TENSOR,
    INDEX_FILE, LABELS_TENSOR,
};
use crate::DataError;

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
        write_file(&path, &bytes)?;
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
        write_file(&path, text.as_bytes())?;
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

/// Writes `bytes` to `path` atomically and durably (`ddp_fsio::atomic_write`: temporary file,
/// fsync, rename, fsync of the folder), so that a crash never leaves a torn shard or index.
fn write_file(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    ddp_fsio::atomic_write(path, |file| file.write_all(bytes)).map_err(DataError::io(path))
}
