//! Sharded data sets: index and shard validation (every error names the file), the shard-level
//! DistributedSampler contract of `ShardLoader` (every sample once per epoch across ranks up to
//! the padding, the same number of steps on every rank, seeded orders), and batches equal to the
//! in-memory loader's on the real MNIST.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use ddp_data::shards::{ShardEntry, INDEX_FILE};
use ddp_data::{
    write_shards, DataError, DataLoader, DistributedSampler, LoaderConfig, Mnist, MnistSplit,
    Normalization, ShardIndex, ShardLoader, ShardLoaderConfig, ShardSet,
};
use safetensors::Dtype;

/// Runs `f` on a thread and fails the test if it takes longer than `secs`.
fn deadline<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|e| panic!("no result within {secs} s: {e}"))
}

/// A data set whose sample `i` holds its own id in its two pixels (little endian), labels
/// `i % 10`, in shards of the given sizes.
fn id_set(dir: &Path, sizes: &[usize]) -> ShardSet {
    let mut writer = ddp_data::ShardWriter::create(dir, &[2], 10).unwrap();
    let mut id = 0u32;
    for &n in sizes {
        let mut pixels = Vec::new();
        let mut labels = Vec::new();
        for _ in 0..n {
            pixels.extend([(id & 0xff) as u8, (id >> 8) as u8]);
            labels.push((id % 10) as u8);
            id += 1;
        }
        writer.write_shard(&pixels, &labels).unwrap();
    }
    writer.finish().unwrap();
    ShardSet::open(dir).unwrap()
}

fn unit_config(batch_size: usize) -> ShardLoaderConfig {
    ShardLoaderConfig {
        batch_size,
        normalization: Normalization::UNIT,
        ..ShardLoaderConfig::default()
    }
}

/// The ids of one epoch's samples, batch by batch (checking labels and batch shapes).
fn epoch_ids(loader: &ShardLoader<2>) -> Vec<Vec<u32>> {
    let mut batches = Vec::new();
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        assert_eq!(batch.shape, [batch.targets.len(), 2]);
        let ids: Vec<u32> = batch
            .inputs
            .chunks(2)
            .map(|p| {
                let lo = (p[0] * 255.0).round() as u32;
                let hi = (p[1] * 255.0).round() as u32;
                lo | hi << 8
            })
            .collect();
        for (id, &t) in ids.iter().zip(&batch.targets) {
            assert_eq!(i64::from(id % 10), t, "label of sample {id}");
        }
        batches.push(ids);
    }
    batches
}

fn counts(ids: impl IntoIterator<Item = u32>) -> HashMap<u32, usize> {
    let mut m = HashMap::new();
    for id in ids {
        *m.entry(id).or_insert(0) += 1;
    }
    m
}

fn message(e: &DataError) -> String {
    e.to_string()
}

// ---------------------------------------------------------------------------------------------
// Validation

fn write_index(dir: &Path, index: &ShardIndex) {
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_string(index).unwrap()).unwrap();
}

fn small_set(dir: &Path) -> ShardIndex {
    let pixels: Vec<u8> = (0..25 * 6).map(|i| i as u8).collect();
    let labels: Vec<u8> = (0..25).map(|i| (i % 10) as u8).collect();
    write_shards(dir, &pixels, &labels, &[2, 3], 10, 10).unwrap()
}

#[test]
fn writer_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let index = small_set(dir.path());
    assert_eq!(index.num_samples, 25);
    assert_eq!(
        index.shards.iter().map(|s| s.samples).collect::<Vec<_>>(),
        [10, 10, 5]
    );
    let set = ShardSet::open(dir.path()).unwrap();
    let shard = set.read_shard(2).unwrap();
    assert_eq!(shard.labels, [0, 1, 2, 3, 4]);
    let expected: Vec<u8> = (120..150).map(|i| i as u8).collect();
    assert_eq!(shard.pixels, expected);
    // A limited set keeps the first samples only.
    let limited = set.limit(13).unwrap();
    assert_eq!((limited.len(), limited.num_shards()), (13, 2));
    assert_eq!(limited.read_shard(1).unwrap().labels, [0, 1, 2]);
}

/// A change that breaks an index.
type Change = Box<dyn Fn(&mut ShardIndex)>;

#[test]
fn bad_indexes_name_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let good = small_set(dir.path());
    let index_path = dir.path().join(INDEX_FILE);
    let cases: Vec<(&str, Change)> = vec![
        ("version", Box::new(|i| i.version = 2)),
        ("format", Box::new(|i| i.format = "other".into())),
        ("num_samples", Box::new(|i| i.num_samples = 26)),
        ("sample_shape", Box::new(|i| i.sample_shape = vec![0, 3])),
        ("num_classes", Box::new(|i| i.num_classes = 0)),
        (
            "shards[1].file",
            Box::new(|i| i.shards[1].file = "../x".into()),
        ),
        (
            "shards[2].file",
            Box::new(|i| i.shards[2].file = i.shards[0].file.clone()),
        ),
        ("shards[0].samples", Box::new(|i| i.shards[0].samples = 0)),
    ];
    for (field, change) in cases {
        let mut index = good.clone();
        change(&mut index);
        write_index(dir.path(), &index);
        let err = ShardSet::open(dir.path()).unwrap_err();
        match &err {
            DataError::BadIndex { path, field: f, .. } => {
                assert_eq!(path, &index_path);
                assert_eq!(f, field, "{err}");
            }
            other => panic!("{field}: expected BadIndex, got {other}"),
        }
        assert!(message(&err).contains(INDEX_FILE), "{err}");
    }
    // Not JSON, an unknown field, a missing index.
    std::fs::write(&index_path, "{\"format\": ").unwrap();
    let err = ShardSet::open(dir.path()).unwrap_err();
    assert!(matches!(err, DataError::BadIndex { .. }), "{err}");
    let mut text = serde_json::to_value(&good).unwrap();
    text["extra"] = 1.into();
    std::fs::write(&index_path, text.to_string()).unwrap();
    let err = ShardSet::open(dir.path()).unwrap_err();
    assert!(message(&err).contains("extra"), "{err}");
    std::fs::remove_file(&index_path).unwrap();
    let err = ShardSet::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, DataError::Io { ref path, .. } if path == &index_path),
        "{err}"
    );
}

#[test]
fn a_missing_shard_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let index = small_set(dir.path());
    let shard = dir.path().join(&index.shards[1].file);
    std::fs::remove_file(&shard).unwrap();
    let err = ShardSet::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, DataError::Io { path, .. } if path == &shard),
        "{err}"
    );
    assert!(message(&err).contains("shard-00001.safetensors"), "{err}");
}

/// The index as a Python user might write it: no size, no checksum.
fn strip_checks(dir: &Path, index: &ShardIndex) {
    let mut bare = index.clone();
    for s in &mut bare.shards {
        s.bytes = None;
        s.crc32 = None;
    }
    write_index(dir, &bare);
}

#[test]
fn truncated_shards_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let index = small_set(dir.path());
    let shard = dir.path().join(&index.shards[0].file);
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 7]).unwrap();
    // With sizes in the index: caught when opening the set.
    let err = ShardSet::open(dir.path()).unwrap_err();
    assert!(
        matches!(&err, DataError::BadShard { path, .. } if path == &shard),
        "{err}"
    );
    // Without: caught when reading the shard (safetensors' own length checks).
    strip_checks(dir.path(), &index);
    let set = ShardSet::open(dir.path()).unwrap();
    for cut in [bytes.len() - 7, 100, 9, 3, 0] {
        std::fs::write(&shard, &bytes[..cut]).unwrap();
        let err = set.read_shard(0).unwrap_err();
        assert!(
            matches!(&err, DataError::BadShard { path, .. } if path == &shard),
            "cut at {cut}: {err}"
        );
        assert!(message(&err).contains("shard-00000.safetensors"), "{err}");
    }
}

#[test]
fn corrupt_shards_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let index = small_set(dir.path());
    let shard = dir.path().join(&index.shards[1].file);
    let good = std::fs::read(&shard).unwrap();
    // A flipped pixel: only the checksum can tell.
    let mut bytes = good.clone();
    let last = bytes.len() - 20;
    bytes[last] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let set = ShardSet::open(dir.path()).unwrap();
    let err = set.read_shard(1).unwrap_err();
    assert!(
        matches!(&err, DataError::BadShard { path, detail } if path == &shard && detail.contains("CRC")),
        "{err}"
    );
    // A damaged header, without checksums in the index; and a huge header length.
    strip_checks(dir.path(), &index);
    let set = ShardSet::open(dir.path()).unwrap();
    let mut bytes = good.clone();
    bytes[10] = b'#';
    std::fs::write(&shard, &bytes).unwrap();
    let err = set.read_shard(1).unwrap_err();
    assert!(
        matches!(&err, DataError::BadShard { path, .. } if path == &shard),
        "{err}"
    );
    let mut bytes = good.clone();
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, &bytes).unwrap();
    let err = set.read_shard(1).unwrap_err();
    assert!(
        matches!(&err, DataError::BadShard { path, .. } if path == &shard),
        "{err}"
    );
    // A label beyond num_classes.
    let pixels = vec![0u8; 2 * 6];
    let labels = vec![3u8, 12];
    let t = tempfile::tempdir().unwrap();
    let one = t.path().join("one.safetensors");
    raw_shard(
        &one,
        Dtype::U8,
        &[2, 2, 3],
        &pixels,
        Dtype::U8,
        &[2],
        &labels,
    );
    let set = one_shard_set(t.path(), &[2, 3], 2);
    let err = set.read_shard(0).unwrap_err();
    assert!(
        matches!(&err, DataError::BadShard { path, detail } if path == &one && detail.contains("label 12")),
        "{err}"
    );
}

fn raw_shard(
    path: &Path,
    idt: Dtype,
    ishape: &[usize],
    idata: &[u8],
    ldt: Dtype,
    lshape: &[usize],
    ldata: &[u8],
) {
    let images = safetensors::tensor::TensorView::new(idt, ishape.to_vec(), idata).unwrap();
    let labels = safetensors::tensor::TensorView::new(ldt, lshape.to_vec(), ldata).unwrap();
    let bytes = safetensors::serialize([("images", images), ("labels", labels)], None).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// An index over the single file `one.safetensors` in `dir`.
fn one_shard_set(dir: &Path, sample_shape: &[usize], samples: usize) -> ShardSet {
    let index = ShardIndex {
        format: "ddp-shards".into(),
        version: 1,
        sample_shape: sample_shape.to_vec(),
        num_classes: 10,
        num_samples: samples,
        shards: vec![ShardEntry {
            file: "one.safetensors".into(),
            samples,
            bytes: None,
            crc32: None,
        }],
    };
    write_index(dir, &index);
    ShardSet::open(dir).unwrap()
}

#[test]
fn wrong_dtypes_shapes_and_names_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("one.safetensors");
    let pixels = vec![0u8; 4 * 6];
    let labels = vec![1u8; 4];
    let check = |what: &str, expect: &str| {
        let set = one_shard_set(dir.path(), &[2, 3], 4);
        let err = set.read_shard(0).unwrap_err();
        assert!(
            matches!(&err, DataError::BadShard { path: p, detail } if p == &path && detail.contains(expect)),
            "{what}: {err}"
        );
    };
    // images as f32 (the workshop's dtype), labels as i64 (ditto).
    let f32_pixels = vec![0u8; 4 * 6 * 4];
    raw_shard(
        &path,
        Dtype::F32,
        &[4, 2, 3],
        &f32_pixels,
        Dtype::U8,
        &[4],
        &labels,
    );
    check("f32 images", "dtype F32");
    let i64_labels = vec![0u8; 4 * 8];
    raw_shard(
        &path,
        Dtype::U8,
        &[4, 2, 3],
        &pixels,
        Dtype::I64,
        &[4],
        &i64_labels,
    );
    check("i64 labels", "dtype I64");
    raw_shard(
        &path,
        Dtype::U8,
        &[4, 3, 2],
        &pixels,
        Dtype::U8,
        &[4],
        &labels,
    );
    check("transposed images", "shape [4, 3, 2]");
    raw_shard(&path, Dtype::U8, &[4, 6], &pixels, Dtype::U8, &[4], &labels);
    check("flat images", "shape [4, 6]");
    raw_shard(
        &path,
        Dtype::U8,
        &[3, 2, 3],
        &pixels[..18],
        Dtype::U8,
        &[3],
        &labels[..3],
    );
    check("fewer samples than the index", "shape [3, 2, 3]");
    // No `labels` tensor.
    let images = safetensors::tensor::TensorView::new(Dtype::U8, vec![4, 2, 3], &pixels).unwrap();
    std::fs::write(
        &path,
        safetensors::serialize([("images", images)], None).unwrap(),
    )
    .unwrap();
    check("no labels", "no tensor `labels`");
    // And the right one reads.
    raw_shard(
        &path,
        Dtype::U8,
        &[4, 2, 3],
        &pixels,
        Dtype::U8,
        &[4],
        &labels,
    );
    let set = one_shard_set(dir.path(), &[2, 3], 4);
    assert_eq!(set.read_shard(0).unwrap().labels, labels);
}

#[test]
fn a_bad_shard_mid_epoch_ends_the_stream_with_its_error() {
    let dir = tempfile::tempdir().unwrap();
    let set = id_set(dir.path(), &[10; 8]);
    let victim = set.shard_path(5);
    let mut bytes = std::fs::read(&victim).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 1;
    std::fs::write(&victim, &bytes).unwrap();
    let loader = ShardLoader::<2>::new(set, 1, 0, unit_config(4)).unwrap();
    let results = deadline(30, move || loader.iter().unwrap().collect::<Vec<_>>());
    let errors: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errors.len(), 1, "one error, then the end");
    assert!(results.last().unwrap().is_err());
    assert!(
        matches!(errors[0], DataError::BadShard { path, .. } if path == &victim),
        "{}",
        errors[0]
    );
}

// ---------------------------------------------------------------------------------------------
// The sampler contract at shard level

/// Shard sizes with a short last shard (as `make-shards` writes) and one uneven one.
const SIZES: [usize; 11] = [10, 10, 10, 10, 7, 10, 10, 10, 10, 10, 4];
const TOTAL: usize = 101;

fn loaders(dir: &Path, world: usize, config: ShardLoaderConfig) -> Vec<ShardLoader<2>> {
    let set = ShardSet::open(dir).unwrap();
    (0..world)
        .map(|r| ShardLoader::new(set.clone(), world, r, config).unwrap())
        .collect()
}

#[test]
fn every_sample_once_per_epoch_up_to_the_padding_and_equal_steps() {
    let dir = tempfile::tempdir().unwrap();
    id_set(dir.path(), &SIZES);
    let path = dir.path().to_path_buf();
    deadline(60, move || {
        for world in [1, 2, 3, 4, 5, 12] {
            for epoch in [0, 1, 2] {
                let mut all = Vec::new();
                let mut steps = Vec::new();
                for mut loader in loaders(&path, world, unit_config(8)) {
                    loader.set_epoch(epoch);
                    let batches = epoch_ids(&loader);
                    assert_eq!(batches.len(), loader.num_batches());
                    let samples: usize = batches.iter().map(Vec::len).sum();
                    assert_eq!(samples, loader.num_samples());
                    steps.push(batches.len());
                    all.extend(batches.into_iter().flatten());
                }
                // The same number of steps on every rank.
                assert!(
                    steps.iter().all(|&s| s == steps[0]),
                    "world {world}: {steps:?}"
                );
                let seen = counts(all.iter().copied());
                // Every sample at least once ...
                assert_eq!(seen.len(), TOTAL, "world {world} epoch {epoch}");
                assert!(seen.keys().all(|&id| (id as usize) < TOTAL));
                // ... and the repeats no more than the padding: whole padding shards (fewer
                // than `world`) plus what a rank short of the common count wraps around to.
                let repeats = all.len() - TOTAL;
                let pad_shards = SIZES.len().div_ceil(world) * world - SIZES.len();
                let bound = pad_shards * 10 + world * (10 - 4 + 10 - 7);
                assert!(
                    repeats <= bound,
                    "world {world}: {repeats} repeats > {bound}"
                );
                if world == 1 {
                    assert_eq!(repeats, 0);
                    assert!(seen.values().all(|&c| c == 1));
                }
            }
        }
    });
}

#[test]
fn drop_last_sees_each_sample_at_most_once() {
    let dir = tempfile::tempdir().unwrap();
    id_set(dir.path(), &SIZES);
    let path = dir.path().to_path_buf();
    deadline(60, move || {
        for world in [2, 3, 4] {
            let config = ShardLoaderConfig {
                drop_last: true,
                ..unit_config(8)
            };
            let mut all = Vec::new();
            let mut steps = Vec::new();
            for mut loader in loaders(&path, world, config) {
                loader.set_epoch(3);
                let batches = epoch_ids(&loader);
                steps.push(batches.len());
                all.extend(batches.into_iter().flatten());
            }
            assert!(steps.iter().all(|&s| s == steps[0]), "{steps:?}");
            let seen = counts(all.iter().copied());
            assert!(
                seen.values().all(|&c| c == 1),
                "world {world}: a sample twice"
            );
            // What is dropped: the shards beyond a multiple of `world`, and what ranks above the
            // smallest common count hold.
            let dropped = TOTAL - all.len();
            let bound = (SIZES.len() % world) * 10 + world * (10 - 4 + 10 - 7);
            assert!(
                dropped <= bound,
                "world {world}: dropped {dropped} > {bound}"
            );
        }
    });
}

#[test]
fn exact_mode_gives_every_sample_to_exactly_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let set = id_set(dir.path(), &SIZES);
    deadline(60, move || {
        for world in [1, 2, 3, 5, 13] {
            let mut all = Vec::new();
            for rank in 0..world {
                let loader =
                    ShardLoader::<2>::exact(set.clone(), world, rank, unit_config(6)).unwrap();
                let ids: Vec<u32> = epoch_ids(&loader).into_iter().flatten().collect();
                assert_eq!(ids.len(), loader.num_samples());
                all.extend(ids);
            }
            all.sort_unstable();
            assert_eq!(all, (0..TOTAL as u32).collect::<Vec<_>>(), "world {world}");
        }
    });
}

#[test]
fn seeded_orders_repeat_and_epochs_differ() {
    let dir = tempfile::tempdir().unwrap();
    id_set(dir.path(), &SIZES);
    let path = dir.path().to_path_buf();
    deadline(60, move || {
        let order = |seed: u64, epoch: u64, prefetch: usize, rank: usize| -> Vec<u32> {
            let config = ShardLoaderConfig {
                seed,
                prefetch_shards: prefetch,
                ..unit_config(7)
            };
            let mut loader = loaders(&path, 2, config).remove(rank);
            loader.set_epoch(epoch);
            epoch_ids(&loader).into_iter().flatten().collect()
        };
        let base = order(5, 0, 2, 0);
        // One seed and epoch: the same order, whatever the prefetch depth.
        assert_eq!(base, order(5, 0, 2, 0));
        assert_eq!(base, order(5, 0, 1, 0));
        assert_eq!(base, order(5, 0, 6, 0));
        // Another epoch, another seed, another rank: another order.
        assert_ne!(base, order(5, 1, 2, 0));
        assert_ne!(base, order(6, 0, 2, 0));
        assert_ne!(base, order(5, 0, 2, 1));
        // Shuffled inside shards, not only across them: consecutive ids are rare.
        let runs = base.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(
            runs < base.len() / 4,
            "{runs} consecutive pairs in {base:?}"
        );
        // Without shuffling: shards in order r, r + R, ..., samples in order.
        let config = ShardLoaderConfig {
            shuffle: false,
            ..unit_config(7)
        };
        let plain: Vec<u32> = epoch_ids(&loaders(&path, 2, config).remove(1))
            .into_iter()
            .flatten()
            .collect();
        let mut expected: Vec<u32> = Vec::new();
        let starts: Vec<u32> = SIZES
            .iter()
            .scan(0u32, |s, &n| {
                let start = *s;
                *s += n as u32;
                Some(start)
            })
            .collect();
        // Rank 1 of 2 takes positions 1, 3, ..., 11 of the order 0..=10 padded by wrapping.
        for shard in [1, 3, 5, 7, 9, 0] {
            expected.extend(starts[shard]..starts[shard] + SIZES[shard] as u32);
        }
        assert_eq!(plain, expected);
    });
}

#[test]
fn dropping_an_epoch_early_stops_the_threads() {
    let dir = tempfile::tempdir().unwrap();
    let set = id_set(dir.path(), &[50; 20]);
    deadline(30, move || {
        let loader = ShardLoader::<2>::new(set, 1, 0, unit_config(4)).unwrap();
        for _ in 0..20 {
            let mut it = loader.iter().unwrap();
            assert!(it.next().unwrap().is_ok());
            drop(it);
        }
    });
}

#[test]
fn bad_configurations_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let set = id_set(dir.path(), &[5, 5]);
    for config in [
        ShardLoaderConfig {
            batch_size: 0,
            ..unit_config(1)
        },
        ShardLoaderConfig {
            prefetch_shards: 0,
            ..unit_config(1)
        },
        ShardLoaderConfig {
            shuffle_shards: 0,
            ..unit_config(1)
        },
    ] {
        assert!(ShardLoader::<2>::new(set.clone(), 1, 0, config).is_err());
    }
    assert!(ShardLoader::<2>::new(set.clone(), 2, 2, unit_config(1)).is_err());
    // Samples of shape [2] do not fit batches of rank 1.
    assert!(ShardLoader::<1>::new(set, 1, 0, unit_config(1)).is_err());
}

// ---------------------------------------------------------------------------------------------
// Batches as the in-memory loader gives them, on the real MNIST

fn mnist_dir() -> PathBuf {
    common::real_mnist()
}

#[test]
fn mnist_batches_equal_the_in_memory_loaders() {
    let test = Arc::new(Mnist::load(&mnist_dir(), MnistSplit::Test).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let index = write_shards(
        dir.path(),
        test.pixels(),
        test.labels(),
        &[28, 28],
        10,
        1000,
    )
    .unwrap();
    assert_eq!(index.shards.len(), 10);
    let set = ShardSet::open(dir.path()).unwrap().limit(2500).unwrap();
    // Unshuffled, one rank: the shard loader yields the data set in order, as the in-memory
    // loader does over 0..2500, with the same normalisation.
    let config = ShardLoaderConfig {
        shuffle: false,
        batch_size: 64,
        ..ShardLoaderConfig::default()
    };
    let shards = ShardLoader::<4>::exact(set, 1, 0, config).unwrap();
    let memory = DataLoader::<_, 4>::new(
        test,
        LoaderConfig {
            batch_size: 64,
            ..LoaderConfig::default()
        },
        Default::default(),
    )
    .unwrap();
    let sampler = DistributedSampler::exact(2500, 1, 0).unwrap();
    let mut expected = memory.iter(sampler.indices()).unwrap();
    let got: Vec<_> = deadline(60, move || shards.iter().unwrap().collect::<Vec<_>>());
    assert_eq!(got.len(), 40); // 2500 / 64, the last batch short
    for batch in got {
        let batch = batch.unwrap();
        let want = expected.next_cpu().unwrap();
        assert_eq!(batch, want);
    }
    assert!(expected.next_cpu().is_none());
}
