//! `ddp-allreduce-bench`: time `ProcessGroup::all_reduce` of f32 buffers, one size after
//! another, and check every result.
//!
//! Run it under ddprun, one process per rank:
//!
//! ```text
//! ddprun --nproc-per-node 4 -- target/release/ddp-allreduce-bench --sizes 4K,1M,64M --json out.json
//! ```
//!
//! (`cargo xtask bench-allreduce` does that for 2 and 4 ranks and compares with gloo.)
//!
//! Per size: each rank fills its buffer with small integers that depend on its rank and the
//! index (so every sum is exact in f32), then runs warm-up iterations and timed iterations, each
//! preceded by a barrier. Every result, warm-up included, is compared with the exact expected
//! sum; a mismatch is an error naming the rank, size and index. An iteration's time is the
//! slowest rank's; the table gives the median over iterations, with nccl-tests' bandwidths:
//! `algbw = bytes / time` and `busbw = algbw * 2(N-1)/N`. Rank 0 prints the table and writes
//! JSON when asked.

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use ddp_bench::sizes::{self, pattern, summarize, SizeResult};
use ddp_comm::bytes::parse_size;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ddp_comm::{ProcessGroup, ReduceOp};
use serde::Serialize;

/// Bytes above which the iteration counts are scaled down (see [`scaled`]).
const FULL_COUNT_BYTES: usize = 16 << 20;

/// Time all-reduce of f32 buffers across the ranks started by ddprun, checking every result.
#[derive(Debug, Parser)]
#[command(name = "ddp-allreduce-bench", version)]
struct Args {
    /// Buffer sizes in bytes, comma separated; K, M, G suffixes are powers of 1024.
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "4K,16K,64K,256K,1M,4M,16M,64M,256M")]
    sizes: Vec<usize>,
    /// Timed iterations per size (scaled down above 16 MiB, at least 3).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size (scaled down above 16 MiB, at least 1).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Where rank 0 writes the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A name for this run in the table and the JSON, e.g. the algorithm forced.
    #[arg(long, default_value = "auto")]
    label: String,
}

/// The whole run, as written to the JSON output.
#[derive(Debug, Serialize)]
struct Report {
    implementation: &'static str,
    label: String,
    world_size: usize,
    small_allreduce_bytes: Option<String>,
    results: Vec<SizeResult>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.iters == 0 {
        bail!("--iters must be at least 1");
    }
    for &bytes in &args.sizes {
        if bytes == 0 || !bytes.is_multiple_of(4) {
            bail!("size {bytes} is not a positive multiple of 4 bytes (one f32)");
        }
    }
    let pg = ProcessGroup::from_env().context("joining the process group")?;
    let (rank, world) = (pg.rank(), pg.world_size());
    let knob = std::env::var("DDP_SMALL_ALLREDUCE_BYTES").ok();
    if rank == 0 {
        println!(
            "all_reduce(f32, sum) over {world} ranks, {} (DDP_SMALL_ALLREDUCE_BYTES={})",
            args.label,
            knob.as_deref().unwrap_or("unset")
        );
        println!("{}", sizes::table_header());
    }

    let mut results = Vec::new();
    for &bytes in &args.sizes {
        let result = bench_size(&pg, bytes, &args)?;
        if rank == 0 {
            println!("{}", sizes::table_row(&result));
        }
        results.push(result);
    }

    if let (0, Some(path)) = (rank, &args.json) {
        let report = Report {
            implementation: "ddp-rs",
            label: args.label.clone(),
            world_size: world,
            small_allreduce_bytes: knob,
            results,
        };
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    pg.barrier().context("final barrier")?;
    Ok(())
}

/// Runs warm-up and timed all-reduces of `bytes` bytes, checking each result, and returns the
/// median and best of the slowest rank's times.
fn bench_size(pg: &ProcessGroup, bytes: usize, args: &Args) -> Result<SizeResult> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let len = bytes / 4;
    let input: Vec<f32> = (0..len).map(|i| pattern(rank, i)).collect();
    let expected: Vec<f32> = (0..len)
        .map(|i| (0..world).map(|r| pattern(r, i)).sum())
        .collect();
    let (warmup, iters) = (scaled(args.warmup, bytes, 1), scaled(args.iters, bytes, 3));

    let mut buf = input.clone();
    let mut times = Vec::with_capacity(iters);
    for iteration in 0..warmup + iters {
        buf.copy_from_slice(&input);
        pg.barrier()
            .with_context(|| format!("barrier before {bytes}-byte iteration {iteration}"))?;
        let start = Instant::now();
        buf = pg
            .all_reduce(buf, ReduceOp::Sum)
            .with_context(|| format!("all_reduce of {bytes} bytes, iteration {iteration}"))?;
        let elapsed = start.elapsed().as_secs_f64();
        check(&buf, &expected, rank, bytes, iteration)?;
        if iteration >= warmup {
            times.push(elapsed);
        }
    }

    // An iteration takes as long as its slowest rank.
    summarize(pg, bytes, times)
}

/// `count` iterations up to 16 MiB, proportionally fewer above (but at least `floor`, or
/// `count` if that is smaller), so that the large sizes do not dominate the run. The same rule is
/// in `gloo_allreduce.py`.
fn scaled(count: usize, bytes: usize, floor: usize) -> usize {
    if bytes <= FULL_COUNT_BYTES {
        count
    } else {
        (count * FULL_COUNT_BYTES / bytes).max(floor.min(count))
    }
}

/// Fails, naming the first wrong element, unless `got` equals `expected` exactly.
fn check(got: &[f32], expected: &[f32], rank: usize, bytes: usize, iteration: usize) -> Result<()> {
    if got.len() != expected.len() {
        bail!(
            "rank {rank}: all_reduce of {bytes} bytes (iteration {iteration}) returned {} \
             elements, expected {}",
            got.len(),
            expected.len()
        );
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != expected[i].to_bits()) {
        bail!(
            "rank {rank}: all_reduce of {bytes} bytes (iteration {iteration}) is wrong at index \
             {i}: got {}, expected {}",
            got[i],
            expected[i]
        );
    }
    Ok(())
}
