//! `ddp-shards`: sharded data sets (see `ddp_data::shards`): convert MNIST's IDX files into
//! shards, verify a sharded directory, and measure the streaming loader against the in-memory
//! one. `cargo xtask make-shards`, `import-h5` and `bench-shards` run it.

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
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
    write_shards, DataLoader, Dataset, DistributedSampler, LoaderConfig, Mnist, MnistSplit,
    ShardLoader, ShardLoaderConfig, ShardSet, ShardWriter,
};
use serde::{Deserialize, Serialize};

/// Sharded data sets: convert, verify, measure.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Writes MNIST (IDX files, raw or .gz) as shards: OUT/train and OUT/test.
    FromMnist {
        /// The folder of the four IDX files.
        #[arg(long)]
        mnist_dir: PathBuf,
        /// The output folder.
        #[arg(long)]
        out: PathBuf,
        /// Samples per shard.
        #[arg(long, default_value_t = DEFAULT_SHARD_SIZE)]
        shard_size: usize,
    },
    /// Reads and validates every shard of DIR/train and DIR/test (or of DIR itself when it
    /// holds an index.json); prints counts, label histogram and mean pixel.
    Verify {
        /// The folder.
        dir: PathBuf,
        /// Fail unless the train split holds this many samples.
        #[arg(long)]
        expect_train: Option<usize>,
        /// Fail unless the test split holds this many samples.
        #[arg(long)]
        expect_test: Option<usize>,
        /// Fail unless every split holds exactly the samples (pixels and labels, in order) of
        /// the same split in this other sharded folder.
        #[arg(long)]
        same_as: Option<PathBuf>,
    },
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
        Cmd::FromMnist {
            mnist_dir,
            out,
            shard_size,
        } => from_mnist(&mnist_dir, &out, shard_size),
        Cmd::Verify {
            dir,
            expect_train,
            expect_test,
            same_as,
        } => verify(&dir, expect_train, expect_test, same_as.as_deref()),
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

fn from_mnist(mnist_dir: &Path, out: &Path, shard_size: usize) -> Result<()> {
    for (split, name) in [(MnistSplit::Train, "train"), (MnistSplit::Test, "test")] {
        let set = Mnist::load(mnist_dir, split)?;
        let (rows, cols) = set.image_size();
        let dir = out.join(name);
        let index = write_shards(
            &dir,
            set.pixels(),
            set.labels(),
            &[rows, cols],
            10,
            shard_size,
        )?;
        println!(
            "{}: {} samples in {} shards",
            dir.display(),
            index.num_samples,
            index.shards.len()
        );
    }
    Ok(())
}

fn verify(
    dir: &Path,
    expect_train: Option<usize>,
    expect_test: Option<usize>,
    same_as: Option<&Path>,
) -> Result<()> {
    let single = dir.join(ddp_data::shards::INDEX_FILE).is_file();
    let splits: Vec<(String, PathBuf, Option<usize>)> = if single {
        vec![("split".into(), dir.to_path_buf(), None)]
    } else {
        vec![
            ("train".into(), dir.join("train"), expect_train),
            ("test".into(), dir.join("test"), expect_test),
        ]
    };
    for (name, path, expect) in splits {
        if let Some(other) = same_as {
            let other = if single {
                other.to_path_buf()
            } else {
                other.join(&name)
            };
            same_samples(&path, &other)?;
            println!("{name}: the same samples as {}", other.display());
        }
        let set = ShardSet::open(&path)?;
        let mut histogram = vec![0usize; set.index().num_classes as usize];
        let mut pixel_sum = 0u64;
        let mut pixels = 0u64;
        for id in 0..set.num_shards() {
            let shard = set.read_shard(id)?;
            for &l in &shard.labels {
                histogram[l as usize] += 1;
            }
            pixel_sum += shard.pixels.iter().map(|&p| u64::from(p)).sum::<u64>();
            pixels += shard.pixels.len() as u64;
        }
        println!(
            "{name} ({}): {} samples of {:?} in {} shards, all valid; labels per class {:?}; \
             mean pixel {:.4} (of 255: {:.4})",
            path.display(),
            set.len(),
            set.index().sample_shape,
            set.num_shards(),
            histogram,
            pixel_sum as f64 / pixels.max(1) as f64,
            pixel_sum as f64 / pixels.max(1) as f64 / 255.0
        );
        if let Some(n) = expect {
            if set.len() != n {
                bail!("{name}: {} samples, expected {n}", set.len());
            }
        }
    }
    Ok(())
}

/// Fails unless the splits in `a` and `b` hold the same samples in the same order (whatever
/// their shard sizes).
fn same_samples(a: &Path, b: &Path) -> Result<()> {
    let (a_set, b_set) = (ShardSet::open(a)?, ShardSet::open(b)?);
    if a_set.index().sample_shape != b_set.index().sample_shape || a_set.len() != b_set.len() {
        bail!(
            "{} holds {} samples of {:?}, {} holds {} of {:?}",
            a.display(),
            a_set.len(),
            a_set.index().sample_shape,
            b.display(),
            b_set.len(),
            b_set.index().sample_shape
        );
    }
    let flatten = |set: &ShardSet| -> Result<(Vec<u8>, Vec<u8>)> {
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for id in 0..set.num_shards() {
            let shard = set.read_shard(id)?;
            pixels.extend(shard.pixels);
            labels.extend(shard.labels);
        }
        Ok((pixels, labels))
    };
    let ((ap, al), (bp, bl)) = (flatten(&a_set)?, flatten(&b_set)?);
    let elems = a_set.index().sample_elems();
    if let Some(i) = (0..al.len()).find(|&i| {
        al[i] != bl[i] || ap[i * elems..(i + 1) * elems] != bp[i * elems..(i + 1) * elems]
    }) {
        bail!(
            "sample {i} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
    Ok(())
}

fn bench(mnist_dir: &Path, work: PathBuf, large_shards: usize, epochs: u64) -> Result<()> {
    let mnist_shards = work.join("mnist");
    from_mnist(mnist_dir, &mnist_shards, DEFAULT_SHARD_SIZE)?;
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
