//! `cargo xtask`: the project's tasks, as a Rust program (`cargo xtask` is an alias for
//! `cargo run --release -p xtask --`, see `.cargo/config.toml`).
//!
//! One module per subcommand; [`util`] has what they share (building the binaries, running
//! commands). Tasks only orchestrate the binaries of `ddp-apps` and present their results: no
//! training or communication logic lives here.

mod bench_allreduce;
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
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::BenchAllreduce(args) => bench_allreduce::run(args),
    }
}
