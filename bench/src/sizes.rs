//! What the all-reduce benchmarks (`ddp-allreduce-bench`, `ddp-nccl-bench`) share: the checked
//! value pattern, the summary of one size's timings and its line in the table; the binaries
//! keep only what differs (the transport and their JSON reports).

use anyhow::{Context, Result};
use ddp_comm::bytes::human_size;
use ddp_comm::{ProcessGroup, ReduceOp};
use serde::Serialize;

/// One size's measurement, as written to the JSON output.
#[derive(Debug, Serialize)]
pub struct SizeResult {
    /// Buffer size in bytes.
    pub bytes: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median of the slowest rank's time per iteration, seconds.
    pub median_s: f64,
    /// Best of the slowest rank's times, seconds.
    pub min_s: f64,
    /// `bytes / median_s`, GB/s.
    pub algbw_gbs: f64,
    /// `algbw × 2(N-1)/N` (nccl-tests' bus bandwidth), GB/s.
    pub busbw_gbs: f64,
}

/// Rank `rank`'s value at index `i`: an integer below 97, so that sums over any practical number
/// of ranks are exact in f32. The same formula is in `xtask/scripts/gloo_allreduce.py`.
pub fn pattern(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 97) as f32
}

/// Summarises this rank's per-iteration `times` (seconds) for a `bytes`-byte collective: an
/// iteration takes as long as its slowest rank (a max all-reduce over `pg`), then the median,
/// the best, algbw and busbw.
pub fn summarize(pg: &ProcessGroup, bytes: usize, times: Vec<f64>) -> Result<SizeResult> {
    let world = pg.world_size();
    let mut times = pg
        .all_reduce(times, ReduceOp::Max)
        .context("gathering the times")?;
    times.sort_by(f64::total_cmp);
    let iters = times.len();
    anyhow::ensure!(iters > 0, "no timed iterations for {bytes} bytes");
    let median_s = if iters % 2 == 1 {
        times[iters / 2]
    } else {
        (times[iters / 2 - 1] + times[iters / 2]) / 2.0
    };
    let algbw_gbs = bytes as f64 / median_s / 1e9;
    Ok(SizeResult {
        bytes,
        iters,
        median_s,
        min_s: times[0],
        algbw_gbs,
        busbw_gbs: algbw_gbs * 2.0 * (world as f64 - 1.0) / world as f64,
    })
}

/// The header of the table the benchmarks print on rank 0.
pub fn table_header() -> String {
    format!(
        "{:>10} {:>6} {:>12} {:>12} {:>12} {:>12}  check",
        "size", "iters", "median(us)", "min(us)", "algbw(GB/s)", "busbw(GB/s)"
    )
}

/// One size's line in the table (every value was checked before it is printed).
pub fn table_row(result: &SizeResult) -> String {
    format!(
        "{:>10} {:>6} {:>12.1} {:>12.1} {:>12.3} {:>12.3}  ok",
        human_size(result.bytes),
        result.iters,
        result.median_s * 1e6,
        result.min_s * 1e6,
        result.algbw_gbs,
        result.busbw_gbs
    )
}
