//! `ddp-zero-bench`: one rank of one ZeRO benchmark configuration (see
//! `ddp_apps::zero_bench`); `cargo xtask bench-zero` runs it under `ddprun` for world sizes
//! 1, 2 and 4 at stages 0, 1 and 2.
//!
//! ```text
//! ddprun --nproc-per-node 2 -- target/release/ddp-zero-bench --stage 2
//! ```
//!
//! Unlike the trainers, this binary keeps the system allocator: its figure is the peak memory
//! the kernel sees, and mimalloc keeps freed pages mapped and fills the zeroed buffers burn's
//! CPU backend asks for (every matmul output) by writing zeros into reused memory, which put
//! up to two more copies of the largest tensor into the peak. glibc's malloc maps large
//! blocks fresh (already zero, nothing written) and unmaps them on free.

use anyhow::Result;
use clap::Parser;
use ddp_apps::zero_bench::{self, ZeroBenchArgs};

/// What ZeRO sharding saves per rank, and what a step costs.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    args: ZeroBenchArgs,
    /// Compute threads of this rank (default 1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    ddp_apps::train::set_compute_threads(cli.threads)?;
    if let Some(result) = zero_bench::run(&cli.args)? {
        println!("ZERO_BENCH {}", serde_json::to_string(&result)?);
    }
    Ok(())
}
