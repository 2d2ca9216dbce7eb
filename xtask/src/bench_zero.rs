//! `cargo xtask bench-zero`: what ZeRO sharding saves per rank and what a step costs, on an
//! MLP of 50.9 M parameters (784 → 64000 → 10) with Adam, at world sizes 1, 2 and 4 and
//! stages 0 (plain DDP), 1 and 2: `ddp-zero-bench` under `ddprun` for each configuration
//! (gradients reduced during backward, `--overlap`), and PyTorch in the same run when a python
//! with torch is at hand (DDP + Adam for stage 0, DDP + `ZeroRedundancyOptimizer` for stage 1;
//! PyTorch has no stage 2 for DDP). Writes `zero.md`, `zero.json` and `zero.svg` (optimizer
//! state, peak RSS and step time against ranks).
//!
//! Memory is measured from outside each rank: every rank runs under GNU time
//! (`/usr/bin/time -f %M`, the kernel's maximum resident set size of the process), and each
//! row stands beside ZeRO's own accounting for fp32 Adam with M bytes of parameters on N ranks
//! (Rajbhandari et al.): stage 0 keeps parameters, gradients and two moments, 4M; stage 1
//! M + M + 2M/N; stage 2 M + M/N + 2M/N. The limit is 1.3 times that plus 100 MiB (the
//! process, the transport's buffers), and no rank may be more than 10 % above the smallest.
//!
//! Stage 0 steps with `ddp::FusedAdam` (the trainers' Adam); each world size's stage 0 also
//! runs once with burn's own `Adam` (`DDP_BENCH_ADAM=burn`, the same steps bit for bit), and
//! a last table gives both step times and their ratio.
//!
//! One compute thread per rank: on a machine with fewer cores than ranks the ranks share
//! cores, and step times there measure oversubscription as much as the step.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{plot, util};

/// Options of `bench-zero`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// World sizes, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4])]
    worlds: Vec<usize>,
    /// Hidden units of the MLP (64000: 50.9 M parameters).
    #[arg(long, default_value_t = 64000)]
    hidden: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Timed steps per configuration (after one warm-up step); medians are reported.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Output folder (default `target/bench`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One configuration's figures from `ddp-zero-bench` (its `ZERO_BENCH` line).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ours {
    stage: u8,
    world: usize,
    params: usize,
    optimizer_bytes: usize,
    gradient_bytes: usize,
    peak_rss_mib: Vec<f64>,
    step_s: f64,
    collective_bytes: u64,
    ring_sent_bytes: u64,
    /// Every rank's peak RSS measured from outside (GNU time), MiB, in a run with glibc's
    /// malloc (the figures of the memory table).
    #[serde(default)]
    outside_rss_mib: Vec<f64>,
    /// The same with mimalloc, the allocator of this run's step times and of the trainers.
    #[serde(default)]
    outside_rss_mimalloc_mib: Vec<f64>,
}

/// PyTorch's figures (its `TORCH_ZERO` line).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Theirs {
    stage: u8,
    world: usize,
    /// The largest rank's.
    optimizer_bytes: usize,
    /// Every rank's (ZeroRedundancyOptimizer's shares differ).
    #[serde(default)]
    optimizer_bytes_per_rank: Vec<usize>,
    peak_rss_mib: Vec<f64>,
    step_s: f64,
}

/// `cargo xtask bench-zero`.
pub fn run(args: Args) -> Result<()> {
    let bin_dir = util::build_release_bins(&["ddprun", "ddp-zero-bench"], &[])?;
    let out = match args.out.clone() {
        Some(out) => out,
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let python = torch_python();
    if python.is_none() {
        eprintln!("no python with torch (DDP_PYTHON or ~/.cache/torchenv): ours only");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    let mut burn_adam = Vec::new();
    for &world in &args.worlds {
        for stage in 0..=2u8 {
            ours.push(run_ours(&bin_dir, &args, world, stage)?);
            if let (Some(python), true) = (&python, stage <= 1) {
                theirs.push(run_theirs(python, &args, world, stage)?);
            }
        }
        burn_adam.push(run_burn_adam(&bin_dir, &args, world)?);
    }
    let mut md = memory_table(&ours, &crate::bench_overlap::load_average());
    md += &table(&args, cores, &ours, &theirs);
    md += &adam_table(&ours, &burn_adam);
    println!("\n{md}");
    std::fs::write(out.join("zero.md"), &md)?;
    std::fs::write(
        out.join("zero.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "cores": cores, "hidden": args.hidden, "batch": args.batch,
            "ours": ours, "pytorch": theirs, "stage0_burn_adam": burn_adam,
        }))?,
    )?;
    let svg = out.join("zero.svg");
    plot::svg(&svg, &charts(&ours, &theirs))?;
    println!(
        "wrote {}, {} and {}",
        out.join("zero.md").display(),
        out.join("zero.json").display(),
        svg.display()
    );
    Ok(())
}

/// A python with torch ([`util::torch_python`]) if torch imports.
fn torch_python() -> Option<PathBuf> {
    let candidate = util::torch_python();
    let ok = Command::new(&candidate)
        .args(["-c", "import torch.distributed.optim"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(candidate)
}

/// The JSON after `tag ` on some line of `text`.
fn tagged<T: for<'de> Deserialize<'de>>(text: &str, tag: &str) -> Result<T> {
    let json = text
        .lines()
        .find_map(|l| l.split_once(tag).map(|(_, j)| j.trim()))
        .with_context(|| format!("no `{tag}` line in:\n{text}"))?;
    serde_json::from_str(json).with_context(|| format!("parsing `{tag}` {json}"))
}

/// GNU time, which measures each rank's peak RSS from outside.
const TIME: &str = "/usr/bin/time";

/// One configuration of ours under ddprun, twice: with mimalloc (the step times, and its
/// memory) and with glibc's malloc (the memory table; `ddp-zero-bench`'s `DDP_ALLOCATOR`),
/// each rank under GNU time (its line goes to the rank's stdout, which ddprun prefixes with
/// `[rank R]`).
fn run_ours(bin_dir: &Path, args: &Args, world: usize, stage: u8) -> Result<Ours> {
    if !Path::new(TIME).exists() {
        bail!(
            "bench-zero measures each rank's peak RSS with GNU time: {TIME} is missing \
             (apt-get install time)"
        );
    }
    let run = |allocator: &str| {
        util::run_stdout(
            bench_command(bin_dir, args, world, stage, true).env("DDP_ALLOCATOR", allocator),
        )
    };
    let text = run("mimalloc")?;
    let mut ours: Ours = tagged(&text, "ZERO_BENCH ")?;
    ours.outside_rss_mimalloc_mib = outside_rss(&text, world)?;
    ours.outside_rss_mib = outside_rss(&run("system")?, world)?;
    Ok(ours)
}

/// Stage 0 at `world` with burn's own `Adam` instead of `FusedAdam` (mimalloc, as the step
/// times of [`run_ours`]).
fn run_burn_adam(bin_dir: &Path, args: &Args, world: usize) -> Result<Ours> {
    let text = util::run_stdout(
        bench_command(bin_dir, args, world, 0, false)
            .env("DDP_ALLOCATOR", "mimalloc")
            .env("DDP_BENCH_ADAM", "burn"),
    )?;
    tagged(&text, "ZERO_BENCH ")
}

/// `ddp-zero-bench` at `stage` on `world` ranks under ddprun, with `args`' model and steps and
/// overlap on; with `timed`, each rank under GNU time ([`TIME`], its peak RSS).
fn bench_command(bin_dir: &Path, args: &Args, world: usize, stage: u8, timed: bool) -> Command {
    let mut command = Command::new(bin_dir.join("ddprun"));
    command.args(["--nproc-per-node", &world.to_string(), "--"]);
    if timed {
        command.args([TIME, "-a", "-o", "/dev/stdout", "-f", "PEAK_RSS_KB %M"]);
    }
    command
        .arg(bin_dir.join("ddp-zero-bench"))
        .args(["--stage", &stage.to_string()])
        .args(["--hidden", &args.hidden.to_string()])
        .args(["--batch", &args.batch.to_string()])
        .args(["--steps", &args.steps.to_string()])
        .args(["--overlap", "true"]);
    command
}

/// Stage 0's step with `FusedAdam` against burn's `Adam`, per world size, measured in this
/// run.
fn adam_table(ours: &[Ours], burn_adam: &[Ours]) -> String {
    let mut md = String::from(
        "\n### Stage 0's optimizer: FusedAdam against burn's Adam (same steps, bit for bit)\n\n\
         | ranks | step, burn's Adam (s) | step, FusedAdam (s) | speed-up |\n\
         | --- | --- | --- | --- |\n",
    );
    for b in burn_adam {
        if let Some(f) = ours.iter().find(|o| o.stage == 0 && o.world == b.world) {
            md += &format!(
                "| {} | {:.3} | {:.3} | {:.2}x |\n",
                b.world,
                b.step_s,
                f.step_s,
                b.step_s / f.step_s
            );
        }
    }
    md
}

/// Every rank's `[rank R] PEAK_RSS_KB k` line in `text`, in MiB, in rank order.
fn outside_rss(text: &str, world: usize) -> Result<Vec<f64>> {
    let mut rss = vec![None; world];
    for line in text.lines() {
        let Some((prefix, kb)) = line.split_once("PEAK_RSS_KB ") else {
            continue;
        };
        let rank: Option<usize> = prefix
            .trim()
            .strip_prefix("[rank ")
            .and_then(|r| r.strip_suffix(']'))
            .and_then(|r| r.parse().ok());
        let kb: Option<f64> = kb.trim().parse().ok();
        if let (Some(r), Some(kb)) = (rank, kb) {
            if let Some(slot) = rss.get_mut(r) {
                *slot = Some(kb / 1024.0);
            }
        }
    }
    rss.iter()
        .enumerate()
        .map(|(r, v)| v.with_context(|| format!("no peak RSS of rank {r} in:\n{text}")))
        .collect()
}

/// ZeRO's accounting for fp32 Adam (module documentation), MiB, for `params` trainable
/// elements on `world` ranks at `stage`.
fn zero_figure(params: usize, world: usize, stage: u8) -> f64 {
    let m = 4.0 * params as f64 / MIB;
    let n = world as f64;
    match stage {
        0 => 4.0 * m,
        1 => m + m + 2.0 * m / n,
        _ => m + m / n + 2.0 * m / n,
    }
}

/// One configuration of PyTorch's under torchrun.
fn run_theirs(python: &Path, args: &Args, world: usize, stage: u8) -> Result<Theirs> {
    let script = util::workspace_root().join("xtask/py/zero_bench.py");
    let mut command = Command::new(python);
    command
        .args(["-m", "torch.distributed.run", "--standalone"])
        .args(["--nproc-per-node", &world.to_string()])
        .arg(&script)
        .args([
            stage.to_string(),
            args.hidden.to_string(),
            args.batch.to_string(),
            "1".into(),
            args.steps.to_string(),
        ])
        .env("OMP_NUM_THREADS", "1");
    let text = util::run_stdout(&mut command)?;
    let theirs: Theirs = tagged(&text, "TORCH_ZERO ")?;
    if theirs.world != world {
        bail!("PyTorch ran {} ranks, asked for {world}", theirs.world);
    }
    Ok(theirs)
}

const MIB: f64 = 1024.0 * 1024.0;

/// The largest of every rank's peak RSS.
fn max_rss(rss: &[f64]) -> f64 {
    rss.iter().copied().fold(0.0, f64::max)
}

/// The Markdown table of memory: every rank's peak RSS measured from outside beside ZeRO's
/// figure and its limit, and whether the ranks are balanced.
fn memory_table(ours: &[Ours], load: &str) -> String {
    let mut md = format!(
        "Peak RSS measured from outside each rank (GNU time), against ZeRO's accounting for \
         fp32 Adam (stage 0: 4M, stage 1: 2M + 2M/N, stage 2: M + 3M/N; M = the parameters' \
         bytes); limit 1.3 × figure + 100 MiB, no rank more than 10 % above the smallest; \
         gradients reduced during backward (`--overlap`). With glibc's malloc, which returns \
         freed memory (the verdict), and with mimalloc, the trainers' allocator (largest rank; \
         at stages 1 and 2 its blocks above 64 MiB are mapped on their own, as in the \
         trainers' sharded runs). Load average before the runs: {load}.\n\n"
    );
    md += &util::md_header(
        &["ranks", "stage"],
        [
            "ZeRO's figure (MiB)",
            "limit (MiB)",
            "peak RSS per rank (MiB)",
            "largest / smallest",
            "within limit and balanced",
            "with mimalloc (MiB)",
        ]
        .map(String::from),
    );
    for o in ours {
        let figure = zero_figure(o.params, o.world, o.stage);
        let limit = 1.3 * figure + 100.0;
        let largest = max_rss(&o.outside_rss_mib);
        let smallest = o
            .outside_rss_mib
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min);
        let spread = largest / smallest;
        let met = largest <= limit && spread <= 1.10;
        let per_rank: Vec<String> = o
            .outside_rss_mib
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect();
        md += &format!(
            "| {} | {} | {figure:.0} | {limit:.0} | {} | {spread:.2} | {} | {:.0} |\n",
            o.world,
            o.stage,
            per_rank.join(" / "),
            if met { "yes" } else { "no" },
            max_rss(&o.outside_rss_mimalloc_mib)
        );
    }
    md + "\n"
}

/// The Markdown table: ours per configuration, PyTorch's beside it where it has the stage.
fn table(args: &Args, cores: usize, ours: &[Ours], theirs: &[Theirs]) -> String {
    let params = ours.first().map_or(0, |o| o.params);
    let mut md = format!(
        "MLP 784 → {} → 10 ({:.1} M parameters), Adam, batch {} per rank, 1 compute thread \
         per rank, {} core(s); medians of {} steps (the slowest rank's time per step).\n\n",
        args.hidden,
        params as f64 / 1e6,
        args.batch,
        cores,
        args.steps
    );
    md += &util::md_header(
        &["ranks", "stage"],
        [
            "optimizer state / rank (MiB)",
            "gradient buffers / rank (MiB)",
            "peak RSS / rank (MiB)",
            "step (ms)",
            "ring bytes sent / rank / step (MB)",
            "PyTorch: optimizer state, largest rank (MiB)",
            "PyTorch: peak RSS (MiB)",
            "PyTorch: step (ms)",
            "step: PyTorch / ours",
        ]
        .map(String::from),
    );
    for o in ours {
        let t = theirs
            .iter()
            .find(|t| t.world == o.world && t.stage == o.stage);
        let (t_state, t_rss, t_step, ratio) = match t {
            Some(t) => (
                format!("{:.0}", t.optimizer_bytes as f64 / MIB),
                format!("{:.0}", max_rss(&t.peak_rss_mib)),
                format!("{:.0}", 1e3 * t.step_s),
                format!("{:.2}x", t.step_s / o.step_s),
            ),
            None => ("—".into(), "—".into(), "—".into(), "—".into()),
        };
        md += &format!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {t_state} | {t_rss} | {t_step} | {ratio} |\n",
            o.world,
            o.stage,
            o.optimizer_bytes as f64 / MIB,
            o.gradient_bytes as f64 / MIB,
            max_rss(&o.outside_rss_mimalloc_mib),
            1e3 * o.step_s,
            o.ring_sent_bytes as f64 / 1e6,
        );
    }
    md += "\nStage 0: DDP (all-reduce) and FusedAdam on every rank; stage 1: optimizer state \
           sharded; stage 2: optimizer state and gradients sharded (both: gradients \
           reduce-scattered, parameters all-gathered). Gradient buffers: what the wrapper keeps \
           between micro-steps (DDP: none, its gradients go back to burn; stage 1's full \
           buffer, which it fills when accumulating; stage 2's shard). Ring bytes: what a ring algorithm sends per rank for \
           the step's collectives (all-reduce of B: 2(N-1)/N·B; reduce-scatter: (N-1)/N·B; \
           all-gather: (N-1)/N of the gathered bytes). Peak RSS: the largest rank's, whole \
           process (ours: from outside, GNU time, with mimalloc as the step times; PyTorch: each \
           rank's getrusage). PyTorch stage 1 is DDP + ZeroRedundancyOptimizer (an all-reduce, then a \
           broadcast of each rank's parameters); it assigns whole parameters to ranks, so a \
           model dominated by one tensor keeps its state on one rank (its largest rank shown).\n";
    md
}

/// Three panels against ranks: optimizer state per rank, peak RSS per rank, step time.
fn charts(ours: &[Ours], theirs: &[Theirs]) -> Vec<plot::Chart> {
    let ticks = ours.iter().map(|o| o.world).max().unwrap_or(1);
    let series = |f: &dyn Fn(&Ours) -> f64, g: &dyn Fn(&Theirs) -> f64| {
        let mut out = Vec::new();
        for stage in 0..=2u8 {
            out.push(plot::Series {
                label: format!("ours, stage {stage}"),
                points: ours
                    .iter()
                    .filter(|o| o.stage == stage)
                    .map(|o| (o.world as f64, f(o)))
                    .collect(),
                reference: false,
            });
        }
        for stage in 0..=1u8 {
            let points: Vec<(f64, f64)> = theirs
                .iter()
                .filter(|t| t.stage == stage)
                .map(|t| (t.world as f64, g(t)))
                .collect();
            if !points.is_empty() {
                out.push(plot::Series {
                    label: format!("PyTorch, stage {stage}"),
                    points,
                    reference: true,
                });
            }
        }
        out
    };
    let chart = |title: &str, y: &str, s| plot::Chart {
        title: title.into(),
        x_desc: "ranks".into(),
        y_desc: y.into(),
        series: s,
        x_label: |x| format!("{x:.0}"),
        x_ticks: ticks,
    };
    vec![
        chart(
            "Adam state per rank",
            "MiB",
            series(&|o| o.optimizer_bytes as f64 / MIB, &|t| {
                t.optimizer_bytes as f64 / MIB
            }),
        ),
        chart(
            "peak RSS per rank (largest rank; ours with glibc malloc)",
            "MiB",
            series(&|o| max_rss(&o.outside_rss_mib), &|t| {
                max_rss(&t.peak_rss_mib)
            }),
        ),
        chart(
            "step time (slowest rank, median)",
            "ms",
            series(&|o| 1e3 * o.step_s, &|t| 1e3 * t.step_s),
        ),
    ]
}
