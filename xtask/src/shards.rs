//! `cargo xtask make-shards`, `import-h5` and `bench-shards`: sharded data sets (see
//! `ddp_data::shards`), through the `ddp-shards` binary of `ddp-apps` and, for HDF5, the Python
//! importer `xtask/py/import_h5.py`.
//!
//! Why the HDF5 importer is Python: the workshop's file is written by h5py, so whoever has it
//! has h5py; a Rust reader would need either libhdf5 (the `hdf5` crate: a native library and a
//! second build of the workspace with another feature set) or a hand-written parser of HDF5's
//! superblocks, object headers, B-trees and filters, which is a large attack surface to make
//! robust for a one-off conversion. The script writes our format with
//! `safetensors.numpy.save_file`, and `ddp-shards verify` then checks every shard it wrote.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

use crate::util;

/// Options of `make-shards`.
#[derive(Debug, clap::Args)]
pub struct MakeArgs {
    /// The folder of the MNIST IDX files (raw or .gz).
    #[arg(long)]
    pub mnist_dir: PathBuf,
    /// The output folder (train/ and test/ are written in it).
    #[arg(long)]
    pub out: PathBuf,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    pub shard_size: usize,
}

/// Options of `import-h5`.
#[derive(Debug, clap::Args)]
pub struct ImportArgs {
    /// The HDF5 file in the workshop's layout (train/images float32 (G, 100, 1, 28, 28), ...).
    pub file: PathBuf,
    /// The output folder (train/ and test/ are written in it).
    pub out: PathBuf,
    /// Samples per shard.
    #[arg(long, default_value_t = 1000)]
    pub shard_size: usize,
    /// The Python with h5py, numpy and safetensors.
    #[arg(long, env = "DDP_PYTHON", default_value = "python3")]
    pub python: PathBuf,
    /// After importing, also check that the shards hold exactly the samples of this sharded
    /// folder (e.g. `make-shards` output from the same MNIST).
    #[arg(long)]
    pub same_as: Option<PathBuf>,
}

/// Options of `bench-shards`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// The folder of the MNIST IDX files.
    #[arg(long)]
    pub mnist_dir: PathBuf,
    /// Scratch folder (default `target/bench-shards`).
    #[arg(long)]
    pub work: Option<PathBuf>,
    /// Shards of 1000 samples in the large synthetic set.
    #[arg(long, default_value_t = 400)]
    pub large_shards: usize,
}

/// `cargo xtask make-shards`.
pub fn make(args: MakeArgs) -> Result<()> {
    let bin = util::build_release_bins(&["ddp-shards"], &[])?;
    util::run(
        Command::new(bin.join("ddp-shards"))
            .arg("from-mnist")
            .arg("--mnist-dir")
            .arg(&args.mnist_dir)
            .arg("--out")
            .arg(&args.out)
            .args(["--shard-size", &args.shard_size.to_string()]),
    )?;
    util::run(
        Command::new(bin.join("ddp-shards"))
            .arg("verify")
            .arg(&args.out),
    )
}

/// `cargo xtask import-h5`.
pub fn import(args: ImportArgs) -> Result<()> {
    let script = util::workspace_root().join("xtask/py/import_h5.py");
    let bin = util::build_release_bins(&["ddp-shards"], &[])?;
    let mut command = Command::new(&args.python);
    command
        .arg(&script)
        .arg(&args.file)
        .arg(&args.out)
        .args(["--shard-size", &args.shard_size.to_string()]);
    if let Err(e) = util::run(&mut command) {
        bail!(
            "{e:#}\n(the importer needs a Python with h5py, numpy and safetensors: \
             `python3 -m venv target/pyenv && target/pyenv/bin/pip install h5py numpy \
             safetensors`, then --python target/pyenv/bin/python or DDP_PYTHON)"
        );
    }
    let mut verify = Command::new(bin.join("ddp-shards"));
    verify.arg("verify").arg(&args.out);
    if let Some(other) = &args.same_as {
        verify.arg("--same-as").arg(other);
    }
    util::run(&mut verify)
}

/// `cargo xtask bench-shards`.
pub fn bench(args: BenchArgs) -> Result<()> {
    let bin = util::build_release_bins(&["ddp-shards-bench"], &[])?;
    let work = args
        .work
        .unwrap_or_else(|| util::workspace_root().join("target/bench-shards"));
    util::run(
        Command::new(bin.join("ddp-shards-bench"))
            .arg("bench")
            .arg("--mnist-dir")
            .arg(&args.mnist_dir)
            .arg("--work")
            .arg(&work)
            .args(["--large-shards", &args.large_shards.to_string()]),
    )
}
