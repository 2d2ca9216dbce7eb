//! MNIST on the real files (found or fetched by `ddp_data::fetch::mnist_for_tests`: the product's
//! cache, the developers' `../shared/data/mnist`, or a download into the target folder), and
//! every kind of bad IDX input.

use std::io::Write;
use std::sync::OnceLock;

use ddp_data::{BatchSource, DataError, Dataset, Mnist, MnistSplit, Normalization};
use flate2::write::GzEncoder;
use flate2::Compression;

mod common;
use common::real_mnist;

fn train() -> &'static Mnist {
    static TRAIN: OnceLock<Mnist> = OnceLock::new();
    TRAIN.get_or_init(|| Mnist::load(&real_mnist(), MnistSplit::Train).unwrap())
}

#[test]
fn real_train_set() {
    let train = train();
    assert_eq!(train.len(), 60_000);
    assert_eq!(train.image_size(), (28, 28));
    assert_eq!(train.pixels().len(), 60_000 * 784);
    assert_eq!(&train.labels()[..10], &[5, 0, 4, 1, 9, 2, 1, 3, 1, 4]);
    let sum: u64 = train.pixels().iter().map(|&p| u64::from(p)).sum();
    let mean = sum as f64 / train.pixels().len() as f64 / 255.0;
    assert!((mean - 0.1307).abs() < 5e-5, "mean pixel {mean}");
    let item = train.get(0).unwrap();
    assert_eq!((item.pixels.len(), item.label), (784, 5));
    assert!(train.get(60_000).is_none());
}

#[test]
fn normalised_train_pixels_have_mean_0_and_std_1() {
    let train = train();
    let mut histogram = [0u64; 256];
    for &p in train.pixels() {
        histogram[p as usize] += 1;
    }
    let table = train.normalization_table();
    let n = train.pixels().len() as f64;
    let mean: f64 = histogram
        .iter()
        .zip(table)
        .map(|(&c, &v)| c as f64 * f64::from(v))
        .sum::<f64>()
        / n;
    let var: f64 = histogram
        .iter()
        .zip(table)
        .map(|(&c, &v)| c as f64 * (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    assert!(mean.abs() < 1e-3, "mean {mean}");
    assert!((var.sqrt() - 1.0).abs() < 1e-3, "std {}", var.sqrt());

    // write_sample applies exactly (p / 255 - 0.1307) / 0.3081.
    let mut out = vec![0f32; 784];
    assert_eq!(
        train.write_sample(7, &mut out),
        i64::from(train.labels()[7])
    );
    for (o, &p) in out.iter().zip(train.image(7).unwrap()) {
        assert_eq!(*o, (p as f32 / 255.0 - 0.1307) / 0.3081);
    }
    let unit = train.clone().with_normalization(Normalization::UNIT);
    unit.write_sample(7, &mut out);
    assert_eq!(out[0], 0.0);
    assert!(out.iter().all(|&v| (0.0..=1.0).contains(&v)));
}

#[test]
fn real_test_set_raw_and_gzip_agree() {
    let real = Mnist::load(&real_mnist(), MnistSplit::Test).unwrap();
    assert_eq!(real.len(), 10_000);
    assert_eq!(&real.labels()[..10], &[7, 2, 1, 0, 4, 1, 4, 9, 5, 9]);

    // The same files in both forms: raw under the plain names, gzip-compressed under `.gz`.
    for gz in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        for name in ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
            let bytes = common::read_decompressed(&real_mnist(), name);
            if gz {
                std::fs::write(tmp.path().join(format!("{name}.gz")), gzip(&bytes)).unwrap();
            } else {
                std::fs::write(tmp.path().join(name), bytes).unwrap();
            }
        }
        let copy = Mnist::load(tmp.path(), MnistSplit::Test).unwrap();
        assert_eq!(copy.pixels(), real.pixels(), "gz: {gz}");
        assert_eq!(copy.labels(), real.labels(), "gz: {gz}");
    }
}

/// The fetcher's constants (names, lengths, SHA-256 of the decompressed files) against the
/// data set's own published sums (`fixtures/mnist-SHA256SUMS.raw`, copied from the MNIST copy
/// the project was started with) and against the real files.
#[test]
fn fetch_constants_match_the_published_sums_and_the_real_files() {
    use ddp_data::fetch::{MNIST_LEN, MNIST_SHA256};
    use sha2::{Digest, Sha256};
    let listed = include_str!("fixtures/mnist-SHA256SUMS.raw");
    assert_eq!(listed.lines().count(), 4);
    for (&(name, sum), len) in MNIST_SHA256.iter().zip(MNIST_LEN) {
        assert!(
            listed.lines().any(|l| l == format!("{sum}  {name}")),
            "{name} {sum} is not in the published sums"
        );
        let bytes = common::read_decompressed(&real_mnist(), name);
        assert_eq!(bytes.len() as u64, len, "{name}");
        let digest: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(digest, sum, "{name}");
    }
}

// ---- bad input -------------------------------------------------------------------------------

fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = magic.to_be_bytes().to_vec();
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Writes `images` and `labels` into a fresh directory and loads them.
fn load(images: &[u8], labels: &[u8]) -> (tempfile::TempDir, Result<Mnist, DataError>) {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("train-images-idx3-ubyte"), images).unwrap();
    std::fs::write(tmp.path().join("train-labels-idx1-ubyte"), labels).unwrap();
    let result = Mnist::load(tmp.path(), MnistSplit::Train);
    (tmp, result)
}

fn good_images(n: u32) -> Vec<u8> {
    idx(0x803, &[n, 28, 28], &vec![7u8; n as usize * 784])
}

fn good_labels(labels: &[u8]) -> Vec<u8> {
    idx(0x801, &[labels.len() as u32], labels)
}

fn message(result: Result<Mnist, DataError>) -> (DataError, String) {
    let err = result.expect_err("bad input was accepted");
    let msg = err.to_string();
    (err, msg)
}

#[test]
fn small_valid_files_load() {
    let (_tmp, result) = load(&good_images(3), &good_labels(&[0, 9, 3]));
    let mnist = result.unwrap();
    assert_eq!((mnist.len(), mnist.labels()), (3, &[0u8, 9, 3][..]));
}

#[test]
fn truncated_data() {
    let mut images = good_images(3);
    images.truncate(16 + 2 * 784 + 100);
    let (tmp, result) = load(&images, &good_labels(&[0, 1, 2]));
    let (err, msg) = message(result);
    assert!(
        matches!(
            err,
            DataError::Truncated {
                offset: 1684,
                decompressed: false,
                ..
            }
        ),
        "{err:?}"
    );
    let file = tmp.path().join("train-images-idx3-ubyte");
    assert_eq!(
        msg,
        format!(
            "{}: truncated at byte offset 1684: the header's dimensions 3 x 28 x 28 need 2352 bytes \
             of data after the 16-byte header, up to byte offset 2368",
            file.display()
        )
    );
}

#[test]
fn truncated_header() {
    let images = good_images(3);
    let (tmp, result) = load(&images[..10], &good_labels(&[0, 1, 2]));
    let (_, msg) = message(result);
    let file = tmp.path().join("train-images-idx3-ubyte");
    assert_eq!(
        msg,
        format!(
            "{}: truncated at byte offset 10: the header of 16 bytes (3 dimensions) is cut short",
            file.display()
        )
    );
    let (_, result) = load(&images[..2], &good_labels(&[0, 1, 2]));
    assert!(message(result)
        .1
        .contains("truncated at byte offset 2: the 4-byte IDX magic number"));
}

#[test]
fn wrong_magic() {
    // A labels file where the images file should be.
    let (tmp, result) = load(&good_labels(&[1, 2]), &good_labels(&[1, 2]));
    let (err, msg) = message(result);
    assert!(
        matches!(
            err,
            DataError::BadMagic {
                found: 0x801,
                expected: 0x803,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        msg,
        format!(
            "{}: bad IDX magic number 0x00000801 at byte offset 0, expected 0x00000803 (images)",
            tmp.path().join("train-images-idx3-ubyte").display()
        )
    );
    // A file of text.
    let (_, result) = load(&good_images(2), b"hello world");
    assert!(message(result).1.contains(
        "bad IDX magic number 0x68656c6c at byte offset 0, expected 0x00000801 (labels)"
    ));
}

#[test]
fn header_dimensions_that_do_not_fit_the_length() {
    // Header says 2 images; the file holds 3.
    let mut images = idx(0x803, &[2, 28, 28], &vec![0u8; 3 * 784]);
    let (tmp, result) = load(&images, &good_labels(&[1, 2]));
    let (err, msg) = message(result);
    assert!(
        matches!(err, DataError::TrailingBytes { offset: 1584, .. }),
        "{err:?}"
    );
    assert_eq!(
        msg,
        format!(
            "{}: unexpected bytes from byte offset 1584: the header's dimensions 2 x 28 x 28 need \
             1568 bytes of data after the 16-byte header, up to byte offset 1584, but the file is \
             2368 bytes long",
            tmp.path().join("train-images-idx3-ubyte").display()
        )
    );
    // Header says 2^32-1 images of 2^32-1 x 2^32-1: the size overflows or exceeds the file.
    images = idx(0x803, &[u32::MAX, u32::MAX, u32::MAX], &[0u8; 10]);
    let (_, result) = load(&images, &good_labels(&[1, 2]));
    let (err, _) = message(result);
    assert!(
        matches!(
            err,
            DataError::BadHeader { .. } | DataError::Truncated { .. }
        ),
        "{err:?}"
    );
    // Zero-sized images.
    let (_, result) = load(&idx(0x803, &[2, 0, 28], &[]), &good_labels(&[1, 2]));
    assert!(message(result)
        .1
        .contains("bad IDX header at byte offset 8: images of 0x28 pixels"));
}

#[test]
fn label_out_of_range() {
    let (tmp, result) = load(&good_images(4), &good_labels(&[3, 9, 10, 1]));
    let (err, msg) = message(result);
    assert!(
        matches!(
            err,
            DataError::LabelOutOfRange {
                index: 2,
                label: 10,
                offset: 10,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        msg,
        format!(
            "{}: label 10 of item 2 at byte offset 10 is out of range 0..=9",
            tmp.path().join("train-labels-idx1-ubyte").display()
        )
    );
}

#[test]
fn image_and_label_counts_differ() {
    let (tmp, result) = load(&good_images(3), &good_labels(&[1, 2]));
    let (_, msg) = message(result);
    assert_eq!(
        msg,
        format!(
            "{} holds 3 images but {} holds 2 labels",
            tmp.path().join("train-images-idx3-ubyte").display(),
            tmp.path().join("train-labels-idx1-ubyte").display()
        )
    );
}

#[test]
fn gzip_garbage() {
    let tmp = tempfile::tempdir().unwrap();
    // The gzip magic bytes, then garbage.
    let mut garbage = vec![0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0, 0xff];
    garbage.extend((0..200u32).map(|i| (i * 37 % 251) as u8));
    let file = tmp.path().join("train-images-idx3-ubyte.gz");
    std::fs::write(&file, &garbage).unwrap();
    std::fs::write(
        tmp.path().join("train-labels-idx1-ubyte.gz"),
        gzip(&good_labels(&[1])),
    )
    .unwrap();
    let (err, msg) = message(Mnist::load(tmp.path(), MnistSplit::Train));
    assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");
    assert!(
        msg.starts_with(&format!(
            "{}: not a valid gzip stream (corrupt or truncated): ",
            file.display()
        )),
        "{msg}"
    );
}

#[test]
fn truncated_gzip_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("train-images-idx3-ubyte.gz");
    let gz = gzip(&idx(
        0x803,
        &[2, 28, 28],
        &(0..2 * 784)
            .map(|i| (i * 7 % 256) as u8)
            .collect::<Vec<_>>(),
    ));
    std::fs::write(&file, &gz[..gz.len() / 2]).unwrap();
    std::fs::write(
        tmp.path().join("train-labels-idx1-ubyte.gz"),
        gzip(&good_labels(&[1, 2])),
    )
    .unwrap();
    let (err, msg) = message(Mnist::load(tmp.path(), MnistSplit::Train));
    assert!(matches!(err, DataError::Gzip { .. }), "{err:?}");
    assert!(msg.starts_with(&file.display().to_string()), "{msg}");
}

#[test]
fn gzip_of_a_short_file_reports_decompressed_offsets() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("train-images-idx3-ubyte.gz");
    std::fs::write(&file, gzip(&idx(0x803, &[2, 28, 28], &[0u8; 784]))).unwrap();
    std::fs::write(
        tmp.path().join("train-labels-idx1-ubyte.gz"),
        gzip(&good_labels(&[1, 2])),
    )
    .unwrap();
    let (_, msg) = message(Mnist::load(tmp.path(), MnistSplit::Train));
    assert!(
        msg.starts_with(&format!(
            "{}: truncated at byte offset 800 of the decompressed data: ",
            file.display()
        )),
        "{msg}"
    );
    // And one that is too long.
    std::fs::write(&file, gzip(&idx(0x803, &[1, 28, 28], &[0u8; 785]))).unwrap();
    let (err, msg) = message(Mnist::load(tmp.path(), MnistSplit::Train));
    assert!(
        matches!(
            err,
            DataError::TrailingBytes {
                offset: 800,
                decompressed: true,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(
        msg.contains("unexpected bytes from byte offset 800 of the decompressed data"),
        "{msg}"
    );
}

#[test]
fn missing_and_unreadable_files() {
    let tmp = tempfile::tempdir().unwrap();
    let (err, msg) = message(Mnist::load(tmp.path(), MnistSplit::Test));
    assert!(matches!(err, DataError::MissingFile { .. }), "{err:?}");
    assert_eq!(
        msg,
        format!(
            "{}: found neither t10k-images-idx3-ubyte nor t10k-images-idx3-ubyte.gz",
            tmp.path().display()
        )
    );
    let (err, msg) = message(Mnist::from_files(
        &tmp.path().join("nope"),
        &tmp.path().join("nope2"),
    ));
    assert!(matches!(err, DataError::Io { .. }), "{err:?}");
    assert!(
        msg.starts_with(&tmp.path().join("nope").display().to_string()),
        "{msg}"
    );
}
