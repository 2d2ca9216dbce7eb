//! `cargo xtask bench-allreduce`: all-reduce timings over 2 and 4 local ranks, next to
//! torch.distributed's gloo when a python with torch is at hand.
//!
//! It builds ddprun and the bench binary of `ddp-apps` in release and runs `ddprun --nproc-per-node N -- ddp-allreduce-bench`
//! for every rank count and algorithm asked for, then the same sizes through
//! `xtask/scripts/gloo_allreduce.py` under ddprun. Both check every result exactly and write
//! JSON; this task gathers those into `allreduce.json`, `allreduce.md` and `allreduce.svg` (busbw
//! per size, one panel per rank count, ours beside gloo) under `target/bench/`
//! (or `--out`), and prints the Markdown.
//!
//! The algorithm is chosen through the comm crate's size threshold, `DDP_SMALL_ALLREDUCE_BYTES`
//! (all-reduces of at most that many bytes use the small-buffer algorithm): `ring` sets it to 0,
//! `small` to a size no buffer reaches, `auto` leaves the crate's default. `--crossover` times
//! ring against small on powers of two from 1 KiB to 4 MiB and reports where ring overtakes.
//!
//! Python: `util::torch_python` (`$DDP_PYTHON`, else `~/.cache/torchenv/bin/python`, else `python3`); gloo is skipped, with the reason, unless it can
//! `import torch` and torch has gloo.

use crate::size::{human_size, parse_size};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::netns::TwoHosts;
use crate::{plot, util};

/// The sizes timed by default: 4 KiB to 256 MiB in powers of 4.
const DEFAULT_SIZES: &str = "4K,16K,64K,256K,1M,4M,16M,64M,256M";

/// The sizes `--crossover` times ring and small on: powers of 2 from 1 KiB to 4 MiB.
const CROSSOVER_SIZES: [usize; 13] = [
    1 << 10,
    1 << 11,
    1 << 12,
    1 << 13,
    1 << 14,
    1 << 15,
    1 << 16,
    1 << 17,
    1 << 18,
    1 << 19,
    1 << 20,
    1 << 21,
    1 << 22,
];

/// The environment variable through which the comm crate's algorithm choice is forced.
const THRESHOLD_VAR: &str = "DDP_SMALL_ALLREDUCE_BYTES";
/// The environment variable through which the transport is forced.
const TRANSPORT_VAR: &str = "DDP_TRANSPORT";

/// Arguments of `cargo xtask bench-allreduce`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Numbers of ranks (local processes) to run with, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    ranks: Vec<usize>,
    /// Buffer sizes, comma separated; K, M, G suffixes are powers of 1024.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = DEFAULT_SIZES)]
    sizes: Vec<usize>,
    /// Leave out sizes above this (e.g. 16M for a quick run).
    #[arg(long, value_parser = parse_size)]
    max_size: Option<usize>,
    /// Timed iterations per size (scaled down above 16 MiB, at least 3).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size (scaled down above 16 MiB, at least 1).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Our transports/algorithms to time, comma separated: shm, tcp (its algorithm by size),
    /// auto (the comm crate's choice), ring, small (TCP algorithms forced).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "shm,tcp")]
    algo: Vec<Algo>,
    /// Also time ring against small on powers of 2 from 1 KiB to 4 MiB (up to --max-size) and
    /// report the size from which ring is faster.
    #[arg(long)]
    crossover: bool,
    /// Also time each even rank count as two "hosts" (network namespaces joined by a veth pair,
    /// each with its own DDP_HOST_ID, half the ranks each, one ddprun per host): the
    /// hierarchical all-reduce (`2hosts-hier`: shared memory inside each host, TCP between
    /// them) beside the flat TCP ring (`2hosts-tcp`). Needs root (`ip netns`).
    #[arg(long)]
    two_hosts: bool,
    /// Do not run gloo even if torch is available.
    #[arg(long)]
    no_gloo: bool,
    /// Folder for the results [default: target/bench].
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Which all-reduce algorithm of ours to time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Algo {
    /// Whatever the comm crate picks (shared memory on one host, by default).
    Auto,
    /// Shared memory forced (`DDP_TRANSPORT=shm`).
    Shm,
    /// TCP forced (`DDP_TRANSPORT=tcp`), its algorithm picked by size.
    Tcp,
    /// The TCP ring at every size.
    Ring,
    /// The TCP small-buffer algorithm at every size.
    Small,
}

impl Algo {
    fn name(self) -> &'static str {
        match self {
            Algo::Auto => "auto",
            Algo::Shm => "shm",
            Algo::Tcp => "tcp",
            Algo::Ring => "ring",
            Algo::Small => "small",
        }
    }

    /// Sets or clears the transport and threshold variables on `command` so that this
    /// algorithm runs.
    fn apply(self, command: &mut Command) {
        match self {
            Algo::Auto => command.env_remove(THRESHOLD_VAR).env_remove(TRANSPORT_VAR),
            Algo::Shm => command.env_remove(THRESHOLD_VAR).env(TRANSPORT_VAR, "shm"),
            Algo::Tcp => command.env_remove(THRESHOLD_VAR).env(TRANSPORT_VAR, "tcp"),
            Algo::Ring => command.env(THRESHOLD_VAR, "0").env(TRANSPORT_VAR, "tcp"),
            Algo::Small => command
                .env(THRESHOLD_VAR, (1u64 << 40).to_string())
                .env(TRANSPORT_VAR, "tcp"),
        };
    }
}

/// One size's measurement, as the bench binary and the gloo script write it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SizeResult {
    bytes: usize,
    iters: usize,
    median_s: f64,
    min_s: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
}

/// One run (one implementation, algorithm and rank count over its sizes), as the bench binary
/// and the gloo script write it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RunReport {
    implementation: String,
    label: String,
    world_size: usize,
    small_allreduce_bytes: Option<String>,
    results: Vec<SizeResult>,
}

impl RunReport {
    fn at(&self, bytes: usize) -> Option<&SizeResult> {
        self.results.iter().find(|result| result.bytes == bytes)
    }
}

/// Whether gloo could be run, and why not.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum Gloo {
    Available { python: String, torch: String },
    Skipped { reason: String },
}

/// Where ring overtakes small for one rank count.
#[derive(Debug, Clone, Serialize)]
struct Crossover {
    world_size: usize,
    /// The smallest measured size from which ring is at least as fast at every larger size.
    ring_from_bytes: Option<usize>,
    summary: String,
}

/// Everything this task measured, as written to `allreduce.json`.
#[derive(Debug, Serialize)]
struct Summary {
    gloo: Gloo,
    runs: Vec<RunReport>,
    crossovers: Vec<Crossover>,
}

/// Runs the benchmark as `args` say.
pub fn run(args: Args) -> Result<()> {
    let sizes: Vec<usize> = args
        .sizes
        .iter()
        .copied()
        .filter(|&s| args.max_size.is_none_or(|max| s <= max))
        .collect();
    if sizes.is_empty() {
        bail!(
            "no sizes left to time (--sizes {:?}, --max-size {:?})",
            args.sizes,
            args.max_size
        );
    }
    if let Some(bad) = sizes.iter().find(|&&s| s == 0 || !s.is_multiple_of(4)) {
        bail!("size {bad} is not a positive multiple of 4 bytes (one f32)");
    }
    if args.ranks.iter().any(|&n| n < 2) {
        bail!("--ranks must all be at least 2 (got {:?})", args.ranks);
    }
    let crossover_sizes: Vec<usize> = CROSSOVER_SIZES
        .into_iter()
        .filter(|&s| args.max_size.is_none_or(|max| s <= max))
        .collect();

    let bin = util::build_release_bins(&["ddprun", "ddp-allreduce-bench"], &[])?;
    let out = match &args.out {
        Some(out) => out.clone(),
        None => util::target_dir()?.join("bench"),
    };
    let raw = out.join("raw");
    std::fs::create_dir_all(&raw).with_context(|| format!("creating {}", raw.display()))?;
    let gloo = if args.no_gloo {
        Gloo::Skipped {
            reason: "--no-gloo".into(),
        }
    } else {
        find_gloo()
    };
    if let Gloo::Skipped { reason } = &gloo {
        eprintln!("gloo skipped: {reason}");
    }

    let mut runs = Vec::new();
    let mut crossover_runs = Vec::new();
    for &world in &args.ranks {
        for &algo in &args.algo {
            runs.push(run_ours(&bin, &raw, world, algo, &sizes, &args)?);
        }
        if args.two_hosts && world % 2 == 0 {
            for transport in ["auto", "tcp"] {
                runs.push(run_two_hosts(&bin, &raw, world, transport, &sizes, &args)?);
            }
        }
        if args.crossover && !crossover_sizes.is_empty() {
            let ring = run_ours(&bin, &raw, world, Algo::Ring, &crossover_sizes, &args)?;
            let small = run_ours(&bin, &raw, world, Algo::Small, &crossover_sizes, &args)?;
            crossover_runs.push((ring, small));
        }
        if let Gloo::Available { python, .. } = &gloo {
            runs.push(run_gloo(&bin, &raw, python, world, &sizes, &args)?);
        }
    }

    let crossovers: Vec<Crossover> = crossover_runs
        .iter()
        .map(|(ring, small)| crossover(ring, small))
        .collect();
    let markdown = markdown(&runs, &crossover_runs, &crossovers, &gloo);
    println!("\n{markdown}");
    let mut all_runs = runs;
    for (ring, small) in crossover_runs {
        all_runs.extend([ring, small]);
    }
    let summary = Summary {
        gloo,
        runs: all_runs,
        crossovers,
    };
    let json_path = out.join("allreduce.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let md_path = out.join("allreduce.md");
    std::fs::write(&md_path, &markdown)
        .with_context(|| format!("writing {}", md_path.display()))?;
    let svg_path = out.join("allreduce.svg");
    plot::svg(&svg_path, &plot_busbw(&summary.runs))?;
    eprintln!(
        "results: {}, {} and {}",
        md_path.display(),
        json_path.display(),
        svg_path.display()
    );
    Ok(())
}

/// Sizes as the comma-separated byte counts the bench binary and the gloo script take.
fn size_list(sizes: &[usize]) -> String {
    sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs `ddp-allreduce-bench` over `world` ranks with `algo` forced, and reads its results.
fn run_ours(
    bin: &Path,
    raw: &Path,
    world: usize,
    algo: Algo,
    sizes: &[usize],
    args: &Args,
) -> Result<RunReport> {
    let json = raw.join(format!(
        "ddp-rs-{}-{world}ranks-{}.json",
        algo.name(),
        sizes.len()
    ));
    let mut command = Command::new(bin.join("ddprun"));
    command.args(["--nproc-per-node", &world.to_string(), "--"]);
    command.arg(bin.join("ddp-allreduce-bench"));
    command.args(["--sizes", &size_list(sizes), "--label", algo.name()]);
    command.args([
        "--iters",
        &args.iters.to_string(),
        "--warmup",
        &args.warmup.to_string(),
    ]);
    command.arg("--json").arg(&json);
    algo.apply(&mut command);
    read_run(&mut command, &json)
}

/// Runs `ddp-allreduce-bench` over `world` ranks on two "hosts" ([`TwoHosts`]), half on each,
/// with `DDP_TRANSPORT=transport`, one ddprun per host; reads rank 0's results.
fn run_two_hosts(
    bin: &Path,
    raw: &Path,
    world: usize,
    transport: &str,
    sizes: &[usize],
    args: &Args,
) -> Result<RunReport> {
    let label = if transport == "tcp" {
        "2hosts-tcp"
    } else {
        "2hosts-hier"
    };
    let json = raw.join(format!("ddp-rs-{label}-{world}ranks.json"));
    let _ = std::fs::remove_file(&json);
    let hosts = TwoHosts::new(None)?;
    let mut children = Vec::new();
    for (node, ns) in hosts.names.iter().enumerate() {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]).arg(bin.join("ddprun"));
        command.args(["--nnodes", "2", "--node-rank", &node.to_string()]);
        command.args(["--nproc-per-node", &(world / 2).to_string()]);
        command.args([
            "--master-addr",
            TwoHosts::ADDRS[0],
            "--master-port",
            "29577",
            "--",
        ]);
        command.arg(bin.join("ddp-allreduce-bench"));
        command.args(["--sizes", &size_list(sizes), "--label", label]);
        command.args(["--iters", &args.iters.to_string()]);
        command.args(["--warmup", &args.warmup.to_string()]);
        command.arg("--json").arg(&json);
        command
            .env(TRANSPORT_VAR, transport)
            .env_remove(THRESHOLD_VAR);
        command.env("DDP_HOST_ID", format!("bench-host-{node}"));
        eprintln!("$ {}", util::command_line(&command));
        children.push(command.spawn().context("starting ddprun in a namespace")?);
    }
    for mut child in children {
        let status = child.wait()?;
        if !status.success() {
            bail!("ddprun on a simulated host failed ({status})");
        }
    }
    drop(hosts);
    let text =
        std::fs::read_to_string(&json).with_context(|| format!("reading {}", json.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))
}

/// Runs the gloo script over `world` ranks under ddprun, and reads its results.
fn run_gloo(
    bin: &Path,
    raw: &Path,
    python: &str,
    world: usize,
    sizes: &[usize],
    args: &Args,
) -> Result<RunReport> {
    let json = raw.join(format!("gloo-{world}ranks.json"));
    let script = util::workspace_root().join("xtask/scripts/gloo_allreduce.py");
    let mut command = Command::new(bin.join("ddprun"));
    command.args(["--nproc-per-node", &world.to_string(), "--", python]);
    command.arg(script).args(["--sizes", &size_list(sizes)]);
    command.args([
        "--iters",
        &args.iters.to_string(),
        "--warmup",
        &args.warmup.to_string(),
    ]);
    command.arg("--json").arg(&json);
    // One thread per rank for torch's own work (filling, comparing), as the ranks share the cores.
    command.env("OMP_NUM_THREADS", "1");
    read_run(&mut command, &json)
}

/// Runs `command`, which writes a [`RunReport`] to `json`, and reads it.
fn read_run(command: &mut Command, json: &Path) -> Result<RunReport> {
    let _ = std::fs::remove_file(json);
    util::run(command)?;
    let text =
        std::fs::read_to_string(json).with_context(|| format!("reading {}", json.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", json.display()))
}

/// Finds a python that can import torch with gloo ([`util::torch_python`]).
fn find_gloo() -> Gloo {
    let python = util::torch_python().display().to_string();
    let probe = "import torch, torch.distributed as d\n\
                 assert d.is_available() and d.is_gloo_available(), 'this torch has no gloo'\n\
                 print(torch.__version__)";
    match Command::new(&python).args(["-c", probe]).output() {
        Err(error) => Gloo::Skipped {
            reason: format!("cannot run `{python}`: {error}"),
        },
        Ok(output) if output.status.success() => Gloo::Available {
            torch: String::from_utf8_lossy(&output.stdout).trim().to_string(),
            python,
        },
        Ok(output) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no message");
            Gloo::Skipped {
                reason: format!(
                    "`{python}` cannot import torch with gloo ({last}); set DDP_PYTHON to a python \
                     that can"
                ),
            }
        }
    }
}

/// Where ring becomes at least as fast as small, and stays so, in two runs over the same sizes.
fn crossover(ring: &RunReport, small: &RunReport) -> Crossover {
    let world = ring.world_size;
    let pairs: Vec<(usize, f64, f64)> = ring
        .results
        .iter()
        .filter_map(|r| small.at(r.bytes).map(|s| (r.bytes, r.median_s, s.median_s)))
        .collect();
    // Walk down from the largest size while ring keeps winning.
    let mut from = None;
    for &(bytes, ring_s, small_s) in pairs.iter().rev() {
        if ring_s > small_s {
            break;
        }
        from = Some(bytes);
    }
    let largest = pairs.last().map_or(0, |p| p.0);
    let below = |bytes: usize| pairs.iter().rev().map(|p| p.0).find(|&b| b < bytes);
    let summary = match from.map(|bytes| (bytes, below(bytes))) {
        Some((bytes, None)) => format!(
            "{world} ranks: ring is faster at every size measured (from {})",
            human_size(bytes)
        ),
        Some((bytes, Some(under))) => format!(
            "{world} ranks: small is faster at {}, ring from {} up: a threshold \
             ({THRESHOLD_VAR}) of {under} bytes fits these timings",
            human_size(under),
            human_size(bytes)
        ),
        None => format!(
            "{world} ranks: small is faster at {} (the largest size measured)",
            human_size(largest)
        ),
    };
    Crossover {
        world_size: world,
        ring_from_bytes: from,
        summary,
    }
}

/// The results as Markdown: per rank count a table of our runs beside gloo's, then the
/// crossover tables.
fn markdown(
    runs: &[RunReport],
    crossover_runs: &[(RunReport, RunReport)],
    crossovers: &[Crossover],
    gloo: &Gloo,
) -> String {
    let mut md = String::from("# all_reduce(f32, sum) on this host\n\n");
    let _ = writeln!(
        md,
        "Median of the slowest rank's time per iteration; algbw = bytes / time, \
         busbw = algbw * 2(N-1)/N (GB/s = 1e9 bytes/s). Every result was checked exactly.\n"
    );
    match gloo {
        Gloo::Available { python, torch } => {
            let _ = writeln!(md, "gloo: torch {torch} (`{python}`)\n");
        }
        Gloo::Skipped { reason } => {
            let _ = writeln!(md, "gloo: skipped: {reason}\n");
        }
    }
    let mut worlds: Vec<usize> = runs.iter().map(|r| r.world_size).collect();
    worlds.dedup();
    for world in worlds {
        let ours: Vec<&RunReport> = runs
            .iter()
            .filter(|r| r.world_size == world && r.implementation != "gloo")
            .collect();
        let gloo = runs
            .iter()
            .find(|r| r.world_size == world && r.implementation == "gloo");
        let _ = writeln!(md, "## {world} ranks\n");
        let mut header = String::from("| size |");
        let mut rule = String::from("| ---: |");
        for run in &ours {
            let _ = write!(header, " {0} time (us) | {0} busbw (GB/s) |", run.label);
            rule.push_str(" ---: | ---: |");
        }
        if gloo.is_some() {
            header.push_str(" gloo time (us) | gloo busbw (GB/s) | ours / gloo busbw |");
            rule.push_str(" ---: | ---: | ---: |");
        }
        let _ = writeln!(md, "{header}\n{rule}");
        let sizes: Vec<usize> = ours
            .first()
            .map_or_else(Vec::new, |r| r.results.iter().map(|x| x.bytes).collect());
        for bytes in sizes {
            let mut row = format!("| {} |", human_size(bytes));
            for run in &ours {
                row.push_str(&cells(run.at(bytes)));
            }
            if let Some(gloo) = gloo {
                let theirs = gloo.at(bytes);
                row.push_str(&cells(theirs));
                match (ours.first().and_then(|r| r.at(bytes)), theirs) {
                    (Some(a), Some(b)) => {
                        let _ = write!(row, " {:.2} |", a.busbw_gbs / b.busbw_gbs);
                    }
                    _ => row.push_str(" |"),
                }
            }
            let _ = writeln!(md, "{row}");
        }
        md.push('\n');
    }
    for ((ring, small), crossover) in crossover_runs.iter().zip(crossovers) {
        let _ = writeln!(md, "## ring against small, {} ranks\n", ring.world_size);
        let _ = writeln!(
            md,
            "| size | ring time (us) | small time (us) | faster |\n| ---: | ---: | ---: | --- |"
        );
        for r in &ring.results {
            if let Some(s) = small.at(r.bytes) {
                let faster = if r.median_s <= s.median_s {
                    "ring"
                } else {
                    "small"
                };
                let _ = writeln!(
                    md,
                    "| {} | {:.1} | {:.1} | {faster} |",
                    human_size(r.bytes),
                    r.median_s * 1e6,
                    s.median_s * 1e6
                );
            }
        }
        let _ = writeln!(md, "\n{}\n", crossover.summary);
    }
    md
}

/// One panel per rank count: busbw against size (log scale) for each of our runs and gloo's.
fn plot_busbw(runs: &[RunReport]) -> Vec<plot::Chart> {
    let mut worlds: Vec<usize> = runs.iter().map(|r| r.world_size).collect();
    worlds.sort_unstable();
    worlds.dedup();
    worlds
        .into_iter()
        .map(|world| plot::Chart {
            title: format!("all_reduce(f32, sum), {world} ranks"),
            x_desc: "buffer size".into(),
            y_desc: "busbw (GB/s)".into(),
            series: runs
                .iter()
                .filter(|r| r.world_size == world)
                .map(|r| plot::Series {
                    label: if r.implementation == "gloo" {
                        "gloo (torch)".into()
                    } else {
                        format!("ddp-rs {}", r.label)
                    },
                    points: r
                        .results
                        .iter()
                        .map(|x| ((x.bytes as f64).log2(), x.busbw_gbs))
                        .collect(),
                    reference: false,
                })
                .collect(),
            x_label: |x| human_size(x.round().exp2() as usize),
            x_ticks: 10,
        })
        .collect()
}

/// The time and busbw cells of one result, or empty cells.
fn cells(result: Option<&SizeResult>) -> String {
    match result {
        Some(r) => format!(" {:.1} | {:.3} |", r.median_s * 1e6, r.busbw_gbs),
        None => " | |".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("16kib"), Ok(16384));
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert!(parse_size("4X").is_err());
        assert!(parse_size("K").is_err());
        assert_eq!(human_size(256 << 20), "256 MiB");
        assert_eq!(human_size(6000), "6000 B");
    }

    fn report(label: &str, times: &[(usize, f64)]) -> RunReport {
        RunReport {
            implementation: "ddp-rs".into(),
            label: label.into(),
            world_size: 2,
            small_allreduce_bytes: None,
            results: times
                .iter()
                .map(|&(bytes, median_s)| SizeResult {
                    bytes,
                    iters: 1,
                    median_s,
                    min_s: median_s,
                    algbw_gbs: 0.0,
                    busbw_gbs: 0.0,
                })
                .collect(),
        }
    }

    #[test]
    fn crossover_is_where_ring_wins_from_then_on() {
        let small = report(
            "small",
            &[(1024, 1.0), (2048, 2.0), (4096, 4.0), (8192, 8.0)],
        );
        // Ring wins at 2048 by noise, loses at 4096, wins from 8192 on.
        let ring = report(
            "ring",
            &[(1024, 3.0), (2048, 1.9), (4096, 4.5), (8192, 6.0)],
        );
        assert_eq!(crossover(&ring, &small).ring_from_bytes, Some(8192));
        let never = report(
            "ring",
            &[(1024, 3.0), (2048, 3.0), (4096, 5.0), (8192, 9.0)],
        );
        assert_eq!(crossover(&never, &small).ring_from_bytes, None);
        let always = report(
            "ring",
            &[(1024, 0.5), (2048, 1.0), (4096, 1.0), (8192, 1.0)],
        );
        assert_eq!(crossover(&always, &small).ring_from_bytes, Some(1024));
    }
}
