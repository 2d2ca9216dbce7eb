//! MNIST: reading and validating the IDX files, and normalising pixels per batch.
//!
//! The IDX format: a 4-byte big-endian magic number `0x000008NN` (`08` = unsigned bytes, `NN` =
//! number of dimensions), then `NN` big-endian `u32` dimensions, then the data, row-major. MNIST
//! images are `0x00000803` (`count x rows x cols`), labels `0x00000801` (`count`).
//!
//! Files are accepted raw or gzip-compressed (recognised by the gzip magic bytes `1f 8b`, not by
//! the name). Every check names the file and, where one applies, the byte offset; offsets in a
//! gzip file count decompressed bytes. Pixels stay `u8` in memory (47 MB for the training set,
//! not 188) and are normalised to `f32` when a batch is built.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;

use crate::{BatchSource, DataError, Dataset};

/// Magic number of an IDX file of unsigned bytes with three dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of unsigned bytes with one dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// Mean of the MNIST training pixels, on the 0..1 scale.
pub const MNIST_MEAN: f32 = 0.1307;
/// Standard deviation of the MNIST training pixels, on the 0..1 scale.
pub const MNIST_STD: f32 = 0.3081;

/// The file names (without `.gz`) of the four MNIST files.
pub const FILE_NAMES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// Which half of MNIST.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MnistSplit {
    /// The 60,000 training images (`train-*`).
    Train,
    /// The 10,000 test images (`t10k-*`).
    Test,
}

impl MnistSplit {
    /// The file names (without `.gz`) of this split's images and labels.
    pub fn file_names(self) -> (&'static str, &'static str) {
        match self {
            MnistSplit::Train => (FILE_NAMES[0], FILE_NAMES[1]),
            MnistSplit::Test => (FILE_NAMES[2], FILE_NAMES[3]),
        }
    }
}

/// Pixel normalisation: `(pixel / 255 - mean) / std`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalization {
    /// Subtracted after scaling to 0..1.
    pub mean: f32,
    /// Divides after subtracting the mean.
    pub std: f32,
}

impl Default for Normalization {
    /// MNIST's usual statistics: mean 0.1307, std 0.3081.
    fn default() -> Self {
        Normalization {
            mean: MNIST_MEAN,
            std: MNIST_STD,
        }
    }
}

impl Normalization {
    /// No normalisation beyond scaling to 0..1 (mean 0, std 1).
    pub const UNIT: Normalization = Normalization {
        mean: 0.0,
        std: 1.0,
    };

    fn table(self) -> [f32; 256] {
        std::array::from_fn(|p| (p as f32 / 255.0 - self.mean) / self.std)
    }
}

/// One MNIST sample, as returned by [`Dataset::get`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MnistItem {
    /// The raw pixels, row-major, `rows * cols` bytes.
    pub pixels: Vec<u8>,
    /// The digit, 0..=9.
    pub label: u8,
}

/// One split of MNIST in memory: pixels as `u8`, labels, and the normalisation applied when
/// batches are built.
#[derive(Debug, Clone)]
pub struct Mnist {
    pixels: Vec<u8>,
    labels: Vec<u8>,
    rows: usize,
    cols: usize,
    normalization: Normalization,
    table: [f32; 256],
}

impl Mnist {
    /// Loads one split from `dir`, which holds the files under their standard names, raw or with
    /// `.gz` (the raw file is preferred when both exist). See [`crate::fetch::ensure_mnist`] for
    /// getting such a directory.
    pub fn load(dir: &Path, split: MnistSplit) -> Result<Mnist, DataError> {
        let (images, labels) = split.file_names();
        let images = find_file(dir, images)?;
        let labels = find_file(dir, labels)?;
        Mnist::from_files(&images, &labels)
    }

    /// Loads an images file and a labels file, validating both and that they hold as many items.
    pub fn from_files(images: &Path, labels: &Path) -> Result<Mnist, DataError> {
        let img = read_idx(images, IMAGES_MAGIC)?;
        let lab = read_idx(labels, LABELS_MAGIC)?;
        let (count, rows, cols) = (img.dims[0], img.dims[1], img.dims[2]);
        if rows == 0 || cols == 0 {
            return Err(DataError::BadHeader {
                path: images.to_path_buf(),
                offset: 8,
                decompressed: img.gzip,
                detail: format!("images of {rows}x{cols} pixels"),
            });
        }
        if lab.dims[0] != count {
            return Err(DataError::CountMismatch {
                images: images.to_path_buf(),
                images_count: count,
                labels: labels.to_path_buf(),
                labels_count: lab.dims[0],
            });
        }
        if let Some(index) = lab.data.iter().position(|&l| l > 9) {
            return Err(DataError::LabelOutOfRange {
                path: labels.to_path_buf(),
                offset: (lab.header_len + index) as u64,
                decompressed: lab.gzip,
                index,
                label: lab.data[index],
            });
        }
        let normalization = Normalization::default();
        Ok(Mnist {
            pixels: img.data,
            labels: lab.data,
            rows,
            cols,
            normalization,
            table: normalization.table(),
        })
    }

    /// Replaces the normalisation applied to batches (the default is [`Normalization::default`]).
    pub fn with_normalization(mut self, normalization: Normalization) -> Mnist {
        self.normalization = normalization;
        self.table = normalization.table();
        self
    }

    /// The normalisation applied to batches.
    pub fn normalization(&self) -> Normalization {
        self.normalization
    }

    /// Writes this split as shards of `shard_size` samples into `dir` (the format
    /// [`crate::ShardSet`] reads; 10 classes, 28×28 `u8` pixels as stored): what
    /// `ddp-shards from-mnist` and the loader benchmark do with each split.
    pub fn write_shards(
        &self,
        dir: &std::path::Path,
        shard_size: usize,
    ) -> Result<crate::shards::ShardIndex, DataError> {
        let (rows, cols) = self.image_size();
        crate::shards::write_shards(
            dir,
            self.pixels(),
            self.labels(),
            &[rows, cols],
            10,
            shard_size,
        )
    }

    /// Image height and width in pixels (28 and 28 for MNIST).
    pub fn image_size(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// All pixels, image after image, row-major.
    pub fn pixels(&self) -> &[u8] {
        &self.pixels
    }

    /// All labels.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }

    /// The raw pixels of image `index`, or `None` past the end.
    pub fn image(&self, index: usize) -> Option<&[u8]> {
        let size = self.rows * self.cols;
        self.pixels.get(index * size..(index + 1) * size)
    }

    /// The normalised value of each possible pixel byte.
    pub fn normalization_table(&self) -> &[f32; 256] {
        &self.table
    }
}

impl Dataset for Mnist {
    type Item = MnistItem;

    fn len(&self) -> usize {
        self.labels.len()
    }

    fn get(&self, index: usize) -> Option<MnistItem> {
        Some(MnistItem {
            pixels: self.image(index)?.to_vec(),
            label: *self.labels.get(index)?,
        })
    }
}

impl BatchSource<4> for Mnist {
    fn batch_shape(&self, batch: usize) -> [usize; 4] {
        [batch, 1, self.rows, self.cols]
    }

    fn write_sample(&self, index: usize, out: &mut [f32]) -> i64 {
        let size = self.rows * self.cols;
        assert_eq!(out.len(), size, "write_sample: output of the wrong length");
        let pixels = &self.pixels[index * size..(index + 1) * size];
        for (o, &p) in out.iter_mut().zip(pixels) {
            *o = self.table[p as usize];
        }
        i64::from(self.labels[index])
    }
}

/// Finds `name` or `name.gz` in `dir`, preferring the raw file.
pub(crate) fn find_file(dir: &Path, name: &str) -> Result<PathBuf, DataError> {
    existing_file(dir, name).ok_or_else(|| DataError::MissingFile {
        dir: dir.to_path_buf(),
        name: name.to_string(),
    })
}

/// `dir/name` or `dir/name.gz` when one of them is a file.
pub(crate) fn existing_file(dir: &Path, name: &str) -> Option<PathBuf> {
    [name.to_string(), format!("{name}.gz")]
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
}

/// A parsed IDX file of unsigned bytes.
#[derive(Debug)]
pub(crate) struct Idx {
    /// The dimensions from the header.
    pub dims: Vec<usize>,
    /// The data, row-major.
    pub data: Vec<u8>,
    /// Length of the header in bytes.
    pub header_len: usize,
    /// Whether the file was gzip-compressed.
    pub gzip: bool,
}

/// Reads and validates an IDX file whose magic number must be `magic`: the header, and the
/// data length against the dimensions (against the file length before reading, for raw files).
pub(crate) fn read_idx(path: &Path, magic: u32) -> Result<Idx, DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    let file_len = file.metadata().map_err(DataError::io(path))?.len();
    let mut reader = BufReader::new(file);
    let gzip = reader
        .fill_buf()
        .map_err(DataError::io(path))?
        .starts_with(&[0x1f, 0x8b]);
    if gzip {
        parse_idx(GzDecoder::new(reader), path, magic, None)
    } else {
        parse_idx(reader, path, magic, Some(file_len))
    }
}

/// Reads as many bytes as are available into `buf`, up to its length; returns the count.
fn read_up_to(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Parses an IDX stream. `file_len` is the length of a raw file (`None` for gzip, where offsets
/// count decompressed bytes).
fn parse_idx(
    mut reader: impl Read,
    path: &Path,
    magic: u32,
    file_len: Option<u64>,
) -> Result<Idx, DataError> {
    let gzip = file_len.is_none();
    let kind = if magic == IMAGES_MAGIC {
        "images"
    } else {
        "labels"
    };
    let read_err = |source: std::io::Error| {
        if gzip {
            DataError::Gzip {
                path: path.to_path_buf(),
                source,
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    };
    let truncated = |offset: usize, detail: String| DataError::Truncated {
        path: path.to_path_buf(),
        offset: offset as u64,
        decompressed: gzip,
        detail,
    };

    let mut word = [0u8; 4];
    let n = read_up_to(&mut reader, &mut word).map_err(read_err)?;
    if n < 4 {
        return Err(truncated(
            n,
            "the 4-byte IDX magic number is cut short".into(),
        ));
    }
    let found = u32::from_be_bytes(word);
    if found != magic {
        return Err(DataError::BadMagic {
            path: path.to_path_buf(),
            found,
            expected: magic,
            kind,
        });
    }

    let ndim = (magic & 0xff) as usize;
    let header_len = 4 + 4 * ndim;
    let mut dims = Vec::with_capacity(ndim);
    for i in 0..ndim {
        let n = read_up_to(&mut reader, &mut word).map_err(read_err)?;
        if n < 4 {
            return Err(truncated(
                4 + 4 * i + n,
                format!("the header of {header_len} bytes ({ndim} dimensions) is cut short"),
            ));
        }
        dims.push(u32::from_be_bytes(word) as usize);
    }
    let shape = dims
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(" x ");
    let data_len = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| DataError::BadHeader {
            path: path.to_path_buf(),
            offset: 4,
            decompressed: gzip,
            detail: format!("dimensions {shape} overflow"),
        })?;
    let end = header_len + data_len;
    let need = format!(
        "the header's dimensions {shape} need {data_len} bytes of data after the {header_len}-byte \
         header, up to byte offset {end}"
    );

    // Raw file: check the dimensions against the file length before reading anything.
    if let Some(len) = file_len {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len < end {
            return Err(truncated(len, need));
        }
        if len > end {
            return Err(DataError::TrailingBytes {
                path: path.to_path_buf(),
                offset: end as u64,
                decompressed: false,
                detail: format!("{need}, but the file is {len} bytes long"),
            });
        }
    }

    // Read at most one byte more than declared, to detect trailing data in gzip streams without
    // trusting the header for the allocation.
    let mut data = Vec::with_capacity(data_len.min(64 << 20));
    (&mut reader)
        .take(data_len as u64 + 1)
        .read_to_end(&mut data)
        .map_err(read_err)?;
    if data.len() < data_len {
        return Err(truncated(header_len + data.len(), need));
    }
    if data.len() > data_len {
        return Err(DataError::TrailingBytes {
            path: path.to_path_buf(),
            offset: end as u64,
            decompressed: gzip,
            detail: format!("{need}, but more data follows"),
        });
    }
    Ok(Idx {
        dims,
        data,
        header_len,
        gzip,
    })
}
