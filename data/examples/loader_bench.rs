//! Loader throughput on the real MNIST training set (from `shared/data/mnist`, or the directory
//! given as the first argument): batches of 64, shuffled, with 0, 1 and 2 worker threads, into
//! `Flex` tensors.
//!
//! Two consumers: one that does nothing with the batches (the loader's raw speed), and one that
//! sleeps 1 ms per batch, standing in for a training step that leaves the CPU to the loader
//! (waiting on a GPU or on an all-reduce): there, workers hide the cost of building batches.
//!
//!     cargo run --release -p ddp-data --example loader_bench [-- DIR]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use ddp_data::{
    DataLoader, Dataset, DistributedSampler, LoaderConfig, Mnist, MnistLoader, MnistSplit,
};

fn main() -> Result<(), ddp_data::DataError> {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist")
        });
    let start = Instant::now();
    let train = Arc::new(Mnist::load(&dir, MnistSplit::Train)?);
    println!(
        "loaded {} training images from {} in {:.2} s",
        train.len(),
        dir.display(),
        start.elapsed().as_secs_f64()
    );
    let mut sampler = DistributedSampler::new(train.len(), 1, 0)?.with_seed(0);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("batch 64, shuffled, one epoch per figure ({cpus} CPUs)\n");
    println!(
        "{:>8} {:>14} {:>14} {:>22}",
        "workers", "batches/s", "images/s", "batches/s (1 ms step)"
    );
    for workers in [0, 1, 2] {
        let config = LoaderConfig {
            batch_size: 64,
            num_workers: workers,
            ..Default::default()
        };
        let loader: MnistLoader = DataLoader::new(train.clone(), config, Device::flex())?;
        // Warm up once (page faults, allocator), then measure one epoch.
        sampler.set_epoch(0);
        epoch(&loader, &sampler, None)?;
        sampler.set_epoch(1);
        let (batches, secs) = epoch(&loader, &sampler, None)?;
        sampler.set_epoch(2);
        let (slow_batches, slow_secs) = epoch(&loader, &sampler, Some(Duration::from_millis(1)))?;
        println!(
            "{workers:>8} {:>14.0} {:>14.0} {:>22.0}",
            batches as f64 / secs,
            sampler.num_samples() as f64 / secs,
            slow_batches as f64 / slow_secs
        );
    }
    Ok(())
}

/// Runs one epoch, optionally sleeping `step` per batch; returns (batches, seconds).
fn epoch(
    loader: &MnistLoader,
    sampler: &DistributedSampler,
    step: Option<Duration>,
) -> Result<(usize, f64), ddp_data::DataError> {
    let start = Instant::now();
    let mut batches = 0;
    for batch in loader.iter(sampler.indices())? {
        std::hint::black_box(&batch);
        if let Some(step) = step {
            std::thread::sleep(step);
        }
        batches += 1;
    }
    Ok((batches, start.elapsed().as_secs_f64()))
}
