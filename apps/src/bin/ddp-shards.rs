//! `ddp-shards`: sharded data sets (see `ddp_data::shards`): convert MNIST's IDX files into
//! shards, verify a sharded directory. `cargo xtask make-shards` and `import-h5` run it; the
//! loader's benchmark is ddp-bench's `ddp-shards-bench` (`cargo xtask bench-shards`).

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use ddp_data::shards::DEFAULT_SHARD_SIZE;
use ddp_data::{Mnist, MnistSplit, ShardSet};

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
    }
}

fn from_mnist(mnist_dir: &Path, out: &Path, shard_size: usize) -> Result<()> {
    for (split, name) in [(MnistSplit::Train, "train"), (MnistSplit::Test, "test")] {
        let dir = out.join(name);
        let index = Mnist::load(mnist_dir, split)?.write_shards(&dir, shard_size)?;
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
