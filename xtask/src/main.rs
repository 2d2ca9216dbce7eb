//! `cargo xtask`: the project's tasks, as a Rust program (`cargo xtask` is an alias for
//! `cargo run --release -p xtask --`, see `.cargo/config.toml`).
//!
//! One module per subcommand; [`util`] has what they share (building the binaries, running
//! commands). Tasks only orchestrate the binaries of `ddp-apps` and present their results: no
//! training or communication logic lives here.

mod bench_allreduce;
mod bench_elastic;
mod bench_gpt;
mod bench_overlap;
mod bench_powersgd;
mod bench_scaling;
mod bench_step;
mod bench_zero;
mod check_torchrun;
mod gpu_check;
mod netns;
mod plot;
mod shards;
// ddp-comm's byte sizes (`16M`, `4 KiB`): `src/size.rs` is a link to `comm/src/size.rs` (a pack
// holds the file itself, as the crates' licence links). Depending on ddp-comm instead put it and
// its dependencies before a user's first `cargo xtask train-mnist` could start its build: about
// 35 s on two cores.
mod size;
mod trace_mnist;
mod train;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Tasks for ddp-rs.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

/// The subcommands, one module each.
#[derive(Debug, Subcommand)]
enum Task {
    /// Time all-reduce over 2 and 4 local ranks, checked, with gloo beside it when torch is at
    /// hand.
    BenchAllreduce(bench_allreduce::Args),
    /// Step time of 2-rank DDP with the all-reduces after backward and during it (--overlap),
    /// CNN and a deep MLP, over shared memory, TCP and (root) a 10 Gbit/s veth link.
    BenchOverlap(bench_overlap::Args),
    /// Communication hooks on a 1 Gbit/s veth (root): step time and bytes on the wire of plain
    /// all-reduce, bf16 and PowerSGD for the CNN and a deep MLP, PyTorch's hooks beside them
    /// when torch is at hand, and MNIST accuracy after 2 epochs with and without PowerSGD.
    BenchPowersgd(bench_powersgd::Args),
    /// Train the CNN for a fixed number of steps at 1, 2 and 4 ranks: samples/s, efficiency,
    /// communication per step, peak RSS; writes a Markdown table, JSON and an SVG plot.
    BenchScaling(bench_scaling::Args),
    /// A rank's death in an elastic job (ddprun --nnodes 2:3) against ddprun's restart from a
    /// checkpoint (CNN and the 50.9 M-parameter MLP): time to the next step, to the world back
    /// at 3, steps lost and repeated; and the elastic setting's cost where nothing fails.
    BenchElastic(bench_elastic::Args),
    /// Time one training step (forward, backward, Adam) of the CNN and the MLP at 1 thread and
    /// at every core, ours and PyTorch's when torch is at hand, with the ratio.
    BenchStep(bench_step::Args),
    /// train-gpt against PyTorch DDP (torchrun, gloo) from the same initial weights on the
    /// same windows of a text, AdamW, clipping and the cosine schedule: tokens/s of both and
    /// the loss curves side by side (needs torch).
    BenchGpt(bench_gpt::Args),
    /// ZeRO: optimizer state, gradient buffers, peak RSS, step time and bytes sent per rank
    /// at stages 0, 1, 2 and 1, 2, 4 ranks on a 50.9 M-parameter MLP, with PyTorch's
    /// ZeroRedundancyOptimizer beside it when torch is at hand; writes a table, JSON and a plot.
    BenchZero(bench_zero::Args),
    /// Run train-mnist under PyTorch's torchrun (its agent hosts the store) and check that
    /// every rank trained (needs a python with torch).
    CheckTorchrun(check_torchrun::Args),
    /// On a machine with NVIDIA GPUs: NCCL checked and timed, the first step of a cold and a
    /// warm process, samples/s against PyTorch, two ranks on one GPU, a rank killed, the device
    /// gradient path; every row under its own time limit.
    GpuCheck(gpu_check::Args),
    /// Write MNIST (the IDX files) as safetensors shards with an index, for
    /// `train-mnist --data-format shards`.
    MakeShards(shards::MakeArgs),
    /// Convert an HDF5 file in the workshop's layout into shards (Python: h5py, numpy,
    /// safetensors), then verify every shard.
    ImportH5(shards::ImportArgs),
    /// Samples/s of the shard loader against the in-memory loader, and its peak memory over a
    /// large synthetic set.
    BenchShards(shards::BenchArgs),
    /// Trace a few steps of the MNIST CNN on 2 local ranks (Chrome trace files for Perfetto):
    /// data, forward, backward, packing, each bucket's all-reduce, unpacking, optimizer.
    TraceMnist(trace_mnist::Args),
    /// Train the MNIST CNN on N local ranks (default 2) through ddprun.
    TrainMnist(train::Args),
    /// Train the Pima diabetes MLP on N local ranks (default 2) through ddprun.
    TrainPima(train::Args),
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::BenchAllreduce(args) => bench_allreduce::run(args),
        Task::BenchOverlap(args) => bench_overlap::run(args),
        Task::BenchPowersgd(args) => bench_powersgd::run(args),
        Task::BenchScaling(args) => bench_scaling::run(args),
        Task::BenchElastic(args) => bench_elastic::run(args),
        Task::BenchStep(args) => bench_step::run(args),
        Task::BenchGpt(args) => bench_gpt::run(args),
        Task::BenchZero(args) => bench_zero::run(args),
        Task::CheckTorchrun(args) => check_torchrun::run(args),
        Task::GpuCheck(args) => gpu_check::run(args),
        Task::MakeShards(args) => shards::make(args),
        Task::ImportH5(args) => shards::import(args),
        Task::BenchShards(args) => shards::bench(args),
        Task::TraceMnist(args) => trace_mnist::run(args),
        Task::TrainMnist(args) => train::run("train-mnist", args),
        Task::TrainPima(args) => train::run("train-pima", args),
    }
}
