//! `ddp-nccl-bench` (feature `cuda`): check every NCCL collective of `ddp_comm::nccl` on the
//! GPUs, then time NCCL all-reduce of f32 device buffers, one size after another.
//!
//! Run it under ddprun, one process per GPU:
//!
//! ```text
//! ddprun --nproc-per-node 4 -- target/release/ddp-nccl-bench --sizes 4K,1M,64M --json out.json
//! ddp-nccl-bench --probe        # which driver and NCCL files, the GPU count, the NCCL version
//! ```
//!
//! Its first line names the files of the NVIDIA driver and NCCL that were loaded (found under
//! their real names in `LD_LIBRARY_PATH`, the active venv's NVIDIA wheels and the system
//! folders; `ddp_comm::nccl::load_cuda_libraries`), on stderr; a missing one is an error naming
//! it, the names tried and the folders searched.
//!
//! (`cargo xtask gpu-check` does that for every world size the GPUs allow.)
//!
//! First, correctness: all_reduce (sum, avg, max), broadcast, all_gather, reduce_scatter (on a
//! length that the world size divides and on one that it does not) and barrier, each compared
//! with the exact expected values. Then, per size: one checked all-reduce of the pattern of
//! `ddp-allreduce-bench` (small integers, so every sum is exact in f32), then warm-up and timed
//! iterations of back-to-back all-reduces (`--batch` per iteration, the host waiting only for the
//! last one, as nccl-tests does). An iteration's time is the slowest rank's, per all-reduce; the
//! table gives the median over iterations with nccl-tests' bandwidths: `algbw = bytes / time`,
//! `busbw = algbw * 2(N-1)/N`. Rank 0 prints the table and writes JSON (the same shape as
//! `ddp-allreduce-bench`'s, implementation `nccl`) when asked.

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use ddp_bench::sizes::{self, pattern, summarize, SizeResult};
use ddp_comm::bytes::parse_size;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use ddp_comm::nccl::NcclGroup;
use ddp_comm::{chunk_range, ProcessGroup, ReduceOp};
use serde::Serialize;

/// Check NCCL collectives on the GPUs and time all-reduce of f32 buffers across the ranks
/// started by ddprun.
#[derive(Debug, Parser)]
#[command(name = "ddp-nccl-bench", version)]
struct Args {
    /// Buffer sizes in bytes, comma separated; K, M, G suffixes are powers of 1024.
    #[arg(long, value_delimiter = ',', value_parser = parse_size,
          default_value = "4K,64K,1M,16M,64M,256M")]
    sizes: Vec<usize>,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// All-reduces enqueued back to back per iteration.
    #[arg(long, default_value_t = 10)]
    batch: usize,
    /// Where rank 0 writes the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only report the libraries loaded, the GPU count and the NCCL version (no group, no
    /// ddprun needed): `gpus N nccl X.Y.Z` on stdout.
    #[arg(long)]
    probe: bool,
}

/// The whole run, as written to the JSON output.
#[derive(Debug, Serialize)]
struct Report {
    implementation: &'static str,
    label: String,
    world_size: usize,
    nccl_version: String,
    results: Vec<SizeResult>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let libraries = ddp_comm::nccl::load_cuda_libraries(false, true)?;
    if args.probe || local_rank_zero() {
        eprintln!("{libraries}");
    }
    let (major, minor, patch) = ddp_comm::nccl::nccl_version()?;
    if args.probe {
        let gpus = ddp_comm::nccl::device_count()?;
        println!("gpus {gpus} nccl {major}.{minor}.{patch}");
        return Ok(());
    }
    if args.iters == 0 || args.batch == 0 {
        bail!("--iters and --batch must be at least 1");
    }
    for &bytes in &args.sizes {
        if bytes == 0 || !bytes.is_multiple_of(4) {
            bail!("size {bytes} is not a positive multiple of 4 bytes (one f32)");
        }
    }
    let pg = ProcessGroup::from_env().context("joining the process group")?;
    let nccl = NcclGroup::new(&pg).context("creating the NCCL communicator")?;
    let (rank, world) = (pg.rank(), pg.world_size());

    check_collectives(&nccl).context("checking the NCCL collectives")?;
    if rank == 0 {
        println!(
            "NCCL {major}.{minor}.{patch}: collectives checked on {world} rank(s) (GPU {} on \
             rank 0)",
            nccl.device_ordinal()
        );
        println!(
            "all_reduce(f32, sum) over {world} ranks, {} per iteration",
            args.batch
        );
        println!("{}", sizes::table_header());
    }
    let mut results = Vec::new();
    for &bytes in &args.sizes {
        let result = bench_size(&pg, &nccl, bytes, &args)?;
        if rank == 0 {
            println!("{}", sizes::table_row(&result));
        }
        results.push(result);
    }
    if let (0, Some(path)) = (rank, &args.json) {
        let report = Report {
            implementation: "nccl",
            label: "nccl".into(),
            world_size: world,
            nccl_version: format!("{major}.{minor}.{patch}"),
            results,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    nccl.barrier().context("final NCCL barrier")?;
    pg.barrier().context("final barrier")?;
    Ok(())
}

/// Whether this process is the first of its host (`LOCAL_RANK` 0 or unset), which prints the
/// libraries line.
fn local_rank_zero() -> bool {
    std::env::var("LOCAL_RANK").map_or(true, |v| v.trim() == "0")
}

/// Runs every collective once on small buffers and compares with the exact expected values.
fn check_collectives(nccl: &NcclGroup) -> Result<()> {
    let (rank, world) = (nccl.rank(), nccl.world_size());
    let n = 1000;
    let value = |r: usize, i: usize| pattern(r, i);
    let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
    let sum: Vec<f32> = (0..n)
        .map(|i| (0..world).map(|r| value(r, i)).sum())
        .collect();

    let got = nccl.to_host(&nccl.all_reduce(nccl.to_device(&mine)?, ReduceOp::Sum)?)?;
    expect("all_reduce sum", &got, &sum, rank)?;
    let max: Vec<f32> = (0..n)
        .map(|i| (0..world).map(|r| value(r, i)).fold(f32::MIN, f32::max))
        .collect();
    let got = nccl.to_host(&nccl.all_reduce(nccl.to_device(&mine)?, ReduceOp::Max)?)?;
    expect("all_reduce max", &got, &max, rank)?;
    // Averages of values that are the same on every rank are exact.
    let same: Vec<f32> = (0..n).map(|i| value(0, i)).collect();
    let got = nccl.to_host(&nccl.all_reduce(nccl.to_device(&same)?, ReduceOp::Avg)?)?;
    expect("all_reduce avg", &got, &same, rank)?;
    let ints: Vec<i64> = (0..n).map(|i| (i * (rank + 1)) as i64).collect();
    let isum: Vec<i64> = (0..n)
        .map(|i| (0..world).map(|r| (i * (r + 1)) as i64).sum())
        .collect();
    let got = nccl.to_host(&nccl.all_reduce(nccl.to_device(&ints)?, ReduceOp::Sum)?)?;
    expect("all_reduce i64 sum", &got, &isum, rank)?;

    let root = world - 1;
    let from_root: Vec<f32> = (0..n).map(|i| value(root, i)).collect();
    let got = nccl.to_host(&nccl.broadcast(nccl.to_device(&mine)?, root)?)?;
    expect("broadcast", &got, &from_root, rank)?;

    let all: Vec<f32> = (0..world)
        .flat_map(|r| (0..n).map(move |i| value(r, i)))
        .collect();
    let got = nccl.to_host(&nccl.all_gather(nccl.to_device(&mine)?)?)?;
    expect("all_gather", &got, &all, rank)?;

    for len in [n * world, n * world + world / 2 + 1] {
        let input: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
        let chunk = chunk_range(len, world, rank);
        let want: Vec<f32> = chunk
            .map(|i| (0..world).map(|r| value(r, i)).sum())
            .collect();
        let got = nccl.to_host(&nccl.reduce_scatter(nccl.to_device(&input)?, ReduceOp::Sum)?)?;
        expect(&format!("reduce_scatter of {len}"), &got, &want, rank)?;
    }
    nccl.barrier()?;
    Ok(())
}

/// Fails, naming the first wrong element, unless `got` equals `want` exactly.
fn expect<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    rank: usize,
) -> Result<()> {
    if got.len() != want.len() {
        bail!(
            "rank {rank}: {what} returned {} elements, expected {}",
            got.len(),
            want.len()
        );
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        bail!(
            "rank {rank}: {what} is wrong at index {i}: got {:?}, expected {:?}",
            got[i],
            want[i]
        );
    }
    Ok(())
}

/// One checked all-reduce of `bytes` bytes, then timed batches of back-to-back all-reduces;
/// returns the median and best of the slowest rank's per-all-reduce times.
fn bench_size(
    pg: &ProcessGroup,
    nccl: &NcclGroup,
    bytes: usize,
    args: &Args,
) -> Result<SizeResult> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let len = bytes / 4;
    let input: Vec<f32> = (0..len).map(|i| pattern(rank, i)).collect();
    let expected: Vec<f32> = (0..len)
        .map(|i| (0..world).map(|r| pattern(r, i)).sum())
        .collect();
    let got = nccl.to_host(&nccl.all_reduce(nccl.to_device(&input)?, ReduceOp::Sum)?)?;
    expect(
        &format!("all_reduce of {bytes} bytes"),
        &got,
        &expected,
        rank,
    )?;

    // Timing does not depend on the values: reduce zeros, which stay zeros.
    let mut buf = nccl.to_device(&vec![0.0f32; len])?;
    let mut times = Vec::with_capacity(args.iters);
    for iteration in 0..args.warmup + args.iters {
        nccl.barrier()
            .with_context(|| format!("barrier before {bytes}-byte iteration {iteration}"))?;
        let start = Instant::now();
        for _ in 0..args.batch - 1 {
            buf = nccl
                .submit_all_reduce(buf, ReduceOp::Sum)
                .without_waiting()?;
        }
        buf = nccl
            .all_reduce(buf, ReduceOp::Sum)
            .with_context(|| format!("all_reduce of {bytes} bytes, iteration {iteration}"))?;
        let elapsed = start.elapsed().as_secs_f64() / args.batch as f64;
        if iteration >= args.warmup {
            times.push(elapsed);
        }
    }
    // An iteration takes as long as its slowest rank.
    summarize(pg, bytes, times)
}
