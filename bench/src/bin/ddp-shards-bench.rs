//! `ddp-shards-bench`: samples/s of the shard loader against the in-memory loader on MNIST,
//! and the shard loader's peak memory over a synthetic set much larger than its prefetch, each
//! measurement in a process of its own. `cargo xtask bench-shards` runs it.

/// mimalloc, as in the trainers (see apps/Cargo.toml).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use ddp_data::shards::DEFAULT_SHARD_SIZE;
use ddp_data::{
    DataLoader, Dataset, DistributedSampler, LoaderConfig, Mnist, MnistSplit, ShardLoader,
    ShardLoaderConfig, ShardSet, ShardWriter,
};
use serde::{Deserialize, Serialize};

/// The shard loader against the in-memory one.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Samples/s of the shard loader against the in-memory loader on MNIST, and peak memory of
    /// the shard loader over a synthetic data set much larger than its prefetch (each
    /// measurement in its own process).
    Bench {
        /// The folder of the MNIST IDX files.
        #[arg(long)]
        mnist_dir: PathBuf,
        /// Scratch folder for the shards (overwritten).
        #[arg(long)]
        work: PathBuf,
        /// Shards of 1000 samples in the large synthetic set.
        #[arg(long, default_value_t = 400)]
        large_shards: usize,
        /// Epochs per measurement.
        #[arg(long, default_value_t = 3)]
        epochs: u64,
    },
    /// One measurement (what `bench` runs in a child process); prints one JSON line.
    #[command(hide = true)]
    Measure {
        /// The loader.
        #[arg(long, value_enum)]
        format: Format,
        /// The IDX folder (memory) or a split's shard folder (shards).
        #[arg(long)]
        source: PathBuf,
        /// Epochs.
        #[arg(long)]
        epochs: u64,
        /// Shards read ahead.
        #[arg(long, default_value_t = 2)]
        prefetch_shards: usize,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Memory,
    Shards,
}

/// What one measurement prints.
#[derive(Debug, Serialize, Deserialize)]
struct Measurement {
    samples: u64,
    seconds: f64,
    samples_per_sec: f64,
    baseline_rss_mib: f64,
    peak_rss_mib: f64,
    data_mib: Option<f64>,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Bench {
            mnist_dir,
            work,
            large_shards,
            epochs,
        } => bench(&mnist_dir, work, large_shards, epochs),
        Cmd::Measure {
            format,
            source,
            epochs,
            prefetch_shards,
        } => {
            let m = measure(format, &source, epochs, prefetch_shards)?;
            println!("{}", serde_json::to_string(&m)?);
            Ok(())
        }
    }
}

fn bench(mnist_dir: &Path, work: PathBuf, large_shards: usize, epochs: u64) -> Result<()> {
    let mnist_shards = work.join("mnist");
    Mnist::load(mnist_dir, MnistSplit::Train)?
        .write_shards(&mnist_shards.join("train"), DEFAULT_SHARD_SIZE)?;
    // A synthetic set of `large_shards` shards, written one shard at a time.
    let large = work.join("large");
    let mut writer = ShardWriter::create(&large, &[28, 28], 10)?;
    let mut state = 0x1234_5678u32;
    for _ in 0..large_shards {
        let pixels: Vec<u8> = (0..1000 * 784)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                state as u8
            })
            .collect();
        let labels: Vec<u8> = (0..1000u32).map(|i| (i % 10) as u8).collect();
        writer.write_shard(&pixels, &labels)?;
    }
    writer.finish()?;

    let me = std::env::current_exe()?;
    let run = |format: &str, source: &Path, prefetch: usize| -> Result<Measurement> {
        let out = Command::new(&me)
            .args(["measure", "--format", format, "--source"])
            .arg(source)
            .args(["--epochs", &epochs.to_string()])
            .args(["--prefetch-shards", &prefetch.to_string()])
            .output()
            .context("running a measurement")?;
        if !out.status.success() {
            bail!(
                "measurement failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let text = String::from_utf8(out.stdout)?;
        Ok(serde_json::from_str(text.trim())?)
    };
    let memory = run("memory", mnist_dir, 2)?;
    let shards = run("shards", &mnist_shards.join("train"), 2)?;
    let big2 = run("shards", &large, 2)?;
    let big8 = run("shards", &large, 8)?;
    println!(
        "loader throughput on MNIST train (60,000 samples, batch 64, {epochs} epochs, one \
         rank, CPU batches only):"
    );
    let line = |name: &str, m: &Measurement| {
        let disk = m
            .data_mib
            .map(|d| format!(", shards on disk {d:.1} MiB"))
            .unwrap_or_default();
        println!(
            "  {name:<34} {:>9.0} samples/s   peak RSS {:>6.1} MiB (baseline {:.1} MiB{disk})",
            m.samples_per_sec, m.peak_rss_mib, m.baseline_rss_mib
        )
    };
    line("in memory (DataLoader, 1 worker)", &memory);
    line("shards (ShardLoader, K = 2)", &shards);
    println!(
        "  shard/in-memory throughput: {:.2}",
        shards.samples_per_sec / memory.samples_per_sec
    );
    println!("peak memory over a synthetic set of {large_shards} shards of 1000 samples:");
    line("shards, K = 2", &big2);
    line("shards, K = 8", &big8);
    Ok(())
}

/// This process's current and peak resident set sizes in MiB (`VmRSS`, `VmHWM`).
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn dir_mib(dir: &Path) -> f64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len() as f64)
                .sum::<f64>()
                / (1024.0 * 1024.0)
        })
        .unwrap_or(f64::NAN)
}

fn measure(
    format: Format,
    source: &Path,
    epochs: u64,
    prefetch_shards: usize,
) -> Result<Measurement> {
    let (baseline, _) = rss_mib();
    let mut samples = 0u64;
    let started;
    let data_mib;
    match format {
        Format::Memory => {
            data_mib = None;
            let set = Arc::new(Mnist::load(source, MnistSplit::Train)?);
            let mut sampler = DistributedSampler::new(set.len(), 1, 0)?;
            let config = LoaderConfig {
                batch_size: 64,
                num_workers: 1,
                ..LoaderConfig::default()
            };
            let loader = DataLoader::<_, 4>::new(set, config, burn::tensor::Device::flex())?;
            started = Instant::now();
            for epoch in 0..epochs {
                sampler.set_epoch(epoch);
                let mut it = loader.iter(sampler.indices())?;
                while let Some(b) = it.next_cpu() {
                    samples += b.targets.len() as u64;
                }
            }
        }
        Format::Shards => {
            data_mib = Some(dir_mib(source));
            let set = ShardSet::open(source)?;
            let config = ShardLoaderConfig {
                batch_size: 64,
                prefetch_shards,
                ..ShardLoaderConfig::default()
            };
            let mut loader = ShardLoader::<4>::new(set, 1, 0, config)?;
            started = Instant::now();
            for epoch in 0..epochs {
                loader.set_epoch(epoch);
                for b in loader.iter()? {
                    samples += b?.targets.len() as u64;
                }
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let (_, peak) = rss_mib();
    Ok(Measurement {
        samples,
        seconds,
        samples_per_sec: samples as f64 / seconds,
        baseline_rss_mib: baseline,
        peak_rss_mib: peak,
        data_mib,
    })
}
