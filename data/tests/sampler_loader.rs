//! `DistributedSampler`'s contract and the loader's batches (order, shapes, worker count).

mod common;

use std::sync::Arc;

use burn::tensor::Device;
use burn::tensor::Int;
use ddp_data::{
    BatchSource, CpuBatch, DataError, DataLoader, Dataset, DistributedSampler, LoaderConfig, Mnist,
    MnistLoader, MnistSplit, PimaLoader, PimaTable,
};

/// How many times each index appears across all ranks' indices for one epoch.
fn coverage(
    len: usize,
    ranks: usize,
    make: impl Fn(usize) -> DistributedSampler,
) -> (Vec<usize>, Vec<usize>) {
    let mut seen = vec![0usize; len];
    let mut per_rank = Vec::new();
    for r in 0..ranks {
        let s = make(r);
        let idx = s.indices();
        assert_eq!(idx.len(), s.num_samples(), "len {len} R {ranks} rank {r}");
        per_rank.push(idx.len());
        for i in idx {
            seen[i] += 1;
        }
    }
    (seen, per_rank)
}

const LENS: [usize; 12] = [0, 1, 2, 3, 5, 7, 8, 10, 64, 97, 100, 101];
const RANKS: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn padding_gives_equal_counts_and_at_most_one_extra_copy() {
    for len in LENS {
        for r in RANKS {
            let (seen, per_rank) = coverage(len, r, |rank| {
                DistributedSampler::new(len, r, rank).unwrap().with_seed(3)
            });
            let want = len.div_ceil(r);
            assert!(
                per_rank.iter().all(|&n| n == want),
                "len {len} R {r}: {per_rank:?}"
            );
            assert_eq!(seen.iter().sum::<usize>(), want * r);
            if len >= r {
                assert!(
                    seen.iter().all(|&c| c == 1 || c == 2),
                    "len {len} R {r}: {seen:?}"
                );
                assert_eq!(seen.iter().filter(|&&c| c == 2).count(), want * r - len);
            } else {
                // Fewer samples than ranks: every sample is seen, every rank gets one.
                assert!(seen.iter().all(|&c| c >= 1), "len {len} R {r}: {seen:?}");
            }
        }
    }
}

#[test]
fn drop_last_gives_equal_counts_and_each_index_at_most_once() {
    for len in LENS {
        for r in RANKS {
            let (seen, per_rank) = coverage(len, r, |rank| {
                DistributedSampler::new(len, r, rank)
                    .unwrap()
                    .with_drop_last(true)
                    .with_seed(5)
            });
            assert!(
                per_rank.iter().all(|&n| n == len / r),
                "len {len} R {r}: {per_rank:?}"
            );
            assert!(seen.iter().all(|&c| c <= 1), "len {len} R {r}");
            assert_eq!(seen.iter().sum::<usize>(), len / r * r);
            if len % r == 0 {
                assert!(seen.iter().all(|&c| c == 1), "len {len} R {r}");
            }
        }
    }
}

#[test]
fn exact_mode_gives_every_index_exactly_once() {
    for len in LENS {
        for r in RANKS {
            for shuffle in [false, true] {
                let (seen, per_rank) = coverage(len, r, |rank| {
                    DistributedSampler::exact(len, r, rank)
                        .unwrap()
                        .with_shuffle(shuffle)
                        .with_drop_last(true)
                });
                assert!(seen.iter().all(|&c| c == 1), "len {len} R {r}");
                assert_eq!(per_rank.iter().sum::<usize>(), len);
                let (min, max) = (
                    per_rank.iter().min().unwrap(),
                    per_rank.iter().max().unwrap(),
                );
                assert!(max - min <= 1, "{per_rank:?}");
                // The first len % R ranks get the extra one.
                for (rank, &n) in per_rank.iter().enumerate() {
                    assert_eq!(n, len / r + usize::from(rank < len % r));
                }
            }
        }
    }
    // Unshuffled, rank r takes r, r + R, ...
    assert_eq!(
        DistributedSampler::exact(10, 3, 1).unwrap().indices(),
        vec![1, 4, 7]
    );
    assert_eq!(
        DistributedSampler::exact(10, 3, 2).unwrap().total_size(),
        10
    );
}

#[test]
fn pytorch_layout_without_shuffle() {
    // len 5, R 3: order [0 1 2 3 4] padded to [0 1 2 3 4 0]; rank r takes positions r, r + 3.
    let s = |r| {
        DistributedSampler::new(5, 3, r)
            .unwrap()
            .with_shuffle(false)
    };
    assert_eq!(s(0).indices(), vec![0, 3]);
    assert_eq!(s(1).indices(), vec![1, 4]);
    assert_eq!(s(2).indices(), vec![2, 0]);
    assert_eq!(s(0).total_size(), 6);
    // drop_last cuts [0 1 2 3 4] to [0 1 2].
    let d = |r| {
        DistributedSampler::new(5, 3, r)
            .unwrap()
            .with_shuffle(false)
            .with_drop_last(true)
    };
    assert_eq!(
        (d(0).indices(), d(1).indices(), d(2).indices()),
        (vec![0], vec![1], vec![2])
    );
    // Two samples, five ranks: the order wraps around more than once.
    let w: Vec<Vec<usize>> = (0..5)
        .map(|r| {
            DistributedSampler::new(2, 5, r)
                .unwrap()
                .with_shuffle(false)
                .indices()
        })
        .collect();
    assert_eq!(w, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
}

#[test]
fn permutation_depends_on_seed_and_epoch_only() {
    let mut a = DistributedSampler::new(1000, 4, 1).unwrap();
    assert!(a.shuffle() && a.seed() == 0 && !a.drop_last() && a.epoch() == 0 && !a.is_exact());
    let e0 = a.indices();
    a.set_epoch(1);
    let e1 = a.indices();
    assert_ne!(e0, e1, "a new permutation each epoch");
    a.set_epoch(0);
    assert_eq!(
        a.indices(),
        e0,
        "the same permutation for the same (seed, epoch)"
    );
    // Another sampler instance (another process) computes the same thing.
    let mut b = DistributedSampler::new(1000, 4, 1).unwrap();
    b.set_epoch(1);
    assert_eq!(b.indices(), e1);
    let c = DistributedSampler::new(1000, 4, 1).unwrap().with_seed(1);
    assert_ne!(c.indices(), e0, "another seed, another permutation");
    // The shuffled order is a permutation, not the identity.
    let all = DistributedSampler::new(1000, 1, 0).unwrap().indices();
    assert_ne!(all, (0..1000).collect::<Vec<_>>());
    let mut sorted = all.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    // All ranks share one permutation: rank r's i-th index is position r + i*R of rank 0 of 1.
    for r in 0..4 {
        let s = DistributedSampler::new(1000, 4, r).unwrap();
        let want: Vec<usize> = all.iter().copied().skip(r).step_by(4).collect();
        assert_eq!(s.indices(), want);
    }
}

#[test]
fn invalid_sampler_arguments() {
    assert_eq!(
        DistributedSampler::new(10, 2, 2).unwrap_err().to_string(),
        "invalid argument: rank 2 is not below num_replicas 2"
    );
    assert!(matches!(
        DistributedSampler::exact(10, 0, 0),
        Err(DataError::InvalidArgument(_))
    ));
}

// ---- loader ----------------------------------------------------------------------------------

/// All batches of one pass, as (inputs, input shape, targets).
fn run<S: BatchSource<D> + 'static, const D: usize>(
    dataset: Arc<S>,
    indices: &[usize],
    config: LoaderConfig,
) -> Vec<(Vec<f32>, Vec<usize>, Vec<i64>)> {
    let loader = DataLoader::<S, D>::new(dataset, config, Device::flex()).unwrap();
    let iter = loader.iter(indices.to_vec()).unwrap();
    assert_eq!(iter.len(), loader.num_batches(indices.len()));
    iter.map(|b| {
        let shape = b.inputs.dims().to_vec();
        let targets = b
            .targets
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        (
            b.inputs.into_data().try_to_vec::<f32>().unwrap(),
            shape,
            targets,
        )
    })
    .collect()
}

#[test]
fn pima_batches_do_not_depend_on_the_worker_count() {
    let split = PimaTable::load(None).unwrap().split(0.2, 0).unwrap();
    let train = Arc::new(split.train);
    let mut sampler = DistributedSampler::new(train.len(), 2, 1)
        .unwrap()
        .with_seed(9);
    sampler.set_epoch(3);
    let indices = sampler.indices(); // 307 indices
    for drop_last in [false, true] {
        let config = |num_workers| LoaderConfig {
            batch_size: 10,
            num_workers,
            prefetch: 1,
            drop_last,
        };
        let reference = run(train.clone(), &indices, config(0));
        assert_eq!(reference.len(), if drop_last { 30 } else { 31 });
        let last = reference.last().unwrap();
        assert_eq!(last.1, if drop_last { vec![10, 8] } else { vec![7, 8] });
        // Batch contents are the samples at the indices, in order.
        let flat: Vec<i64> = reference.iter().flat_map(|b| b.2.clone()).collect();
        let want: Vec<i64> = indices
            .iter()
            .map(|&i| i64::from(train.labels()[i]))
            .take(flat.len())
            .collect();
        assert_eq!(flat, want);
        assert_eq!(reference[0].0[..8], train.get(indices[0]).unwrap().features);
        for workers in [1, 2, 3, 7, 64] {
            assert_eq!(
                run(train.clone(), &indices, config(workers)),
                reference,
                "{workers} workers"
            );
        }
    }
}

#[test]
fn mnist_batches_do_not_depend_on_the_worker_count() {
    let test = Arc::new(Mnist::load(&common::real_mnist(), MnistSplit::Test).unwrap());
    let indices = DistributedSampler::new(test.len(), 3, 0)
        .unwrap()
        .with_seed(1)
        .indices(); // 3334
    let config = |num_workers| LoaderConfig {
        batch_size: 64,
        num_workers,
        ..Default::default()
    };
    let reference = run(test.clone(), &indices, config(0));
    assert_eq!(reference.len(), 53);
    assert_eq!(reference[0].1, vec![64, 1, 28, 28]);
    assert_eq!(reference[52].1, vec![6, 1, 28, 28]);
    let first = indices[0];
    assert_eq!(reference[0].2[0], i64::from(test.labels()[first]));
    let pixels = test.image(first).unwrap();
    for (v, &p) in reference[0].0[..784].iter().zip(pixels) {
        assert_eq!(*v, (p as f32 / 255.0 - 0.1307) / 0.3081);
    }
    for workers in [1, 2, 4] {
        assert_eq!(
            run(test.clone(), &indices, config(workers)),
            reference,
            "{workers} workers"
        );
    }
}

#[test]
fn loader_type_aliases_and_tensor_kinds() {
    let split = PimaTable::load(None).unwrap().split(0.2, 0).unwrap();
    let loader: PimaLoader = DataLoader::new(
        Arc::new(split.test),
        LoaderConfig::default(),
        Default::default(),
    )
    .unwrap();
    let batch = loader.iter((0..100).collect()).unwrap().next().unwrap();
    let targets: burn::tensor::Tensor<1, Int> = batch.targets;
    assert_eq!(batch.inputs.dims(), [64, 8]);
    assert_eq!(targets.dims(), [64]);
    let _: Option<MnistLoader> = None;
}

#[test]
fn loader_rejects_bad_arguments() {
    let split = PimaTable::load(None).unwrap().split(0.2, 0).unwrap();
    let data = Arc::new(split.test);
    let bad = |config| {
        DataLoader::<_, 2>::new(data.clone(), config, Device::flex())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        bad(LoaderConfig {
            batch_size: 0,
            ..Default::default()
        }),
        "invalid argument: batch_size must be at least 1"
    );
    assert_eq!(
        bad(LoaderConfig {
            prefetch: 0,
            ..Default::default()
        }),
        "invalid argument: prefetch must be at least 1"
    );
    let loader = DataLoader::<_, 2>::new(data, LoaderConfig::default(), Device::flex()).unwrap();
    let err = loader.iter(vec![0, 1, 154]).err().unwrap();
    assert_eq!(
        err.to_string(),
        "invalid argument: index 154 at position 2 is beyond the dataset of 154 samples"
    );
    assert_eq!(loader.iter(vec![]).unwrap().count(), 0);
}

#[test]
fn dropping_an_iterator_early_stops_its_workers() {
    let split = PimaTable::load(None).unwrap().split(0.2, 0).unwrap();
    let loader = DataLoader::<_, 2>::new(
        Arc::new(split.train),
        LoaderConfig {
            batch_size: 1,
            num_workers: 3,
            prefetch: 1,
            drop_last: false,
        },
        Default::default(),
    )
    .unwrap();
    for _ in 0..20 {
        let mut iter = loader.iter((0..614).collect()).unwrap();
        iter.next().unwrap();
        drop(iter); // must not hang on workers blocked in send
    }
}

/// A dataset whose sample 5 cannot be built.
struct Faulty;

impl Dataset for Faulty {
    type Item = ();
    fn len(&self) -> usize {
        10
    }
    fn get(&self, _: usize) -> Option<()> {
        Some(())
    }
}

impl BatchSource<2> for Faulty {
    fn batch_shape(&self, batch: usize) -> [usize; 2] {
        [batch, 1]
    }
    fn write_sample(&self, index: usize, out: &mut [f32]) -> i64 {
        assert_ne!(index, 5, "sample 5 is faulty");
        out[0] = index as f32;
        index as i64
    }
}

#[test]
fn a_worker_panic_reaches_the_consumer() {
    let loader = DataLoader::<_, 2>::new(
        Arc::new(Faulty),
        LoaderConfig {
            batch_size: 2,
            num_workers: 2,
            ..Default::default()
        },
        Default::default(),
    )
    .unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        loader.iter((0..10).collect()).unwrap().count()
    }));
    let payload = caught.unwrap_err();
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(msg.contains("sample 5 is faulty"), "{msg}");
    // Batches before the faulty one arrive.
    let mut iter = loader.iter((0..10).collect()).unwrap();
    assert_eq!(
        iter.next_cpu(),
        Some(CpuBatch {
            inputs: vec![0.0, 1.0],
            shape: [2, 1],
            targets: vec![0, 1]
        })
    );
}
