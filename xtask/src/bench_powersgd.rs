//! `cargo xtask bench-powersgd`: what the communication hooks buy on a slow link. Two ranks,
//! one in each of two network namespaces joined by a veth pair limited with `tc` to 1 Gbit/s
//! (`netns.rs`, as bench-overlap; needs root), train the MNIST CNN and the deep MLP (784 → 4 ×
//! 2048 → 10) with `ddp-zero-bench` under `ddprun` and each hook: plain all-reduce (`none`),
//! `bf16`, and PowerSGD at rank 4 (`--powersgd-start` below the warm-up, so every timed step
//! is compressed). Reported per configuration: the median step time (the slowest rank's) and
//! the bytes on the wire per step (what rank 0's interfaces other than `lo` sent during the
//! timed steps), each against plain all-reduce; and, when a python with torch is at hand,
//! PyTorch's DDP with the same hook (`default_hooks.bf16_compress_hook`, `powerSGD_hook`) on
//! the same link (`xtask/py/powersgd_bench.py`). Then the accuracy check: `train-mnist` for 2
//! epochs on 2 local ranks with `--comm-hook powersgd` and without, both test accuracies
//! printed. Writes `powersgd.md` and `powersgd.json`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::netns::TwoHosts;
use crate::{train, util};

/// Options of `bench-powersgd`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed steps per run.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first (PowerSGD starts after the first of them).
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Runs of each configuration (the hooks alternate); medians reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// PowerSGD's rank.
    #[arg(long, default_value_t = 4)]
    rank: usize,
    /// The veth link's rate (`tc` syntax).
    #[arg(long, default_value = "1gbit")]
    rate: String,
    /// Models to run (comma-separated: cnn, deep).
    #[arg(long, default_value = "cnn,deep", value_delimiter = ',')]
    models: Vec<String>,
    /// Hooks to run (comma-separated: none, bf16, f16, powersgd); `none` is the reference.
    #[arg(long, default_value = "none,bf16,powersgd", value_delimiter = ',')]
    hooks: Vec<String>,
    /// Skip PyTorch's runs even when torch is at hand.
    #[arg(long)]
    no_torch: bool,
    /// Epochs of the MNIST accuracy comparison (0 skips it).
    #[arg(long, default_value_t = 2)]
    accuracy_epochs: usize,
    /// `--powersgd-start` of the accuracy comparison: plain all-reduce for this many steps
    /// first (PyTorch suggests about 10 % of the run; 2 epochs of 2 ranks at batch 64 are
    /// 938 steps).
    #[arg(long, default_value_t = 100)]
    accuracy_start: u64,
    /// Stop both accuracy runs after this many steps (a shorter check, e.g. for CI).
    #[arg(long)]
    accuracy_max_steps: Option<u64>,
    /// Output folder (default `target/bench`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The figures of one run of ours (`ddp-zero-bench`'s `ZERO_BENCH` line, the fields used).
#[derive(Debug, Clone, Deserialize, Serialize)]
struct Ours {
    step_s: f64,
    collective_bytes: u64,
    wire_bytes_per_step: Option<f64>,
}

/// The figures of one run of PyTorch's (`TORCH_POWERSGD`).
#[derive(Debug, Clone, Deserialize, Serialize)]
struct Theirs {
    step_s: f64,
    wire_bytes_per_step: f64,
}

/// One configuration's medians.
#[derive(Debug, Serialize)]
struct Row {
    model: String,
    hook: String,
    step_ms: f64,
    wire_mb: f64,
    collective_mb: f64,
    torch_step_ms: Option<f64>,
    torch_wire_mb: Option<f64>,
}

/// The accuracy comparison.
#[derive(Debug, Serialize)]
struct Accuracy {
    epochs: usize,
    powersgd_start: u64,
    rank: usize,
    plain: f64,
    powersgd: f64,
    plain_wall_s: f64,
    powersgd_wall_s: f64,
}

/// `cargo xtask bench-powersgd`.
pub fn run(args: Args) -> Result<()> {
    for hook in &args.hooks {
        if !["none", "bf16", "f16", "powersgd"].contains(&hook.as_str()) {
            bail!("--hooks: unknown hook `{hook}` (none, bf16, f16, powersgd)");
        }
    }
    if args.hooks.first().map(String::as_str) != Some("none") {
        bail!("--hooks must start with `none`, the reference of the ratios");
    }
    let bin = util::build_release_bins(&["ddprun", "ddp-zero-bench", "train-mnist"], &[])?;
    let out = match args.out.clone() {
        Some(out) => out,
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let python = (!args.no_torch).then(torch_python).flatten();
    if python.is_none() && !args.no_torch {
        eprintln!("no python with torch (DDP_PYTHON or ~/.cache/torchenv): ours only");
    }
    let load = load_average();
    let mut rows = Vec::new();
    for model in &args.models {
        let mut ours: Vec<Vec<Ours>> = vec![Vec::new(); args.hooks.len()];
        let mut theirs: Vec<Vec<Theirs>> = vec![Vec::new(); args.hooks.len()];
        for _ in 0..args.repeats {
            for (h, hook) in args.hooks.iter().enumerate() {
                ours[h].push(run_ours(&bin, &args, model, hook)?);
                if let (Some(python), true) = (&python, hook != "f16") {
                    theirs[h].push(run_theirs(python, &args, model, hook)?);
                }
            }
        }
        for (h, hook) in args.hooks.iter().enumerate() {
            let theirs = &theirs[h];
            rows.push(Row {
                model: model.clone(),
                hook: hook.clone(),
                step_ms: 1e3 * median(ours[h].iter().map(|r| r.step_s)),
                wire_mb: median(
                    ours[h]
                        .iter()
                        .map(|r| r.wire_bytes_per_step.unwrap_or(f64::NAN)),
                ) / 1e6,
                collective_mb: median(ours[h].iter().map(|r| r.collective_bytes as f64)) / 1e6,
                torch_step_ms: (!theirs.is_empty())
                    .then(|| 1e3 * median(theirs.iter().map(|r| r.step_s))),
                torch_wire_mb: (!theirs.is_empty())
                    .then(|| median(theirs.iter().map(|r| r.wire_bytes_per_step)) / 1e6),
            });
        }
    }
    let accuracy = if args.accuracy_epochs > 0 {
        Some(accuracy(&bin, &args)?)
    } else {
        None
    };
    let md = report(&args, &rows, accuracy.as_ref(), &load);
    println!("\n{md}");
    std::fs::write(out.join("powersgd.md"), &md)?;
    std::fs::write(
        out.join("powersgd.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "load_average_before": load, "rate": args.rate, "rank": args.rank,
            "rows": rows, "accuracy": accuracy,
        }))?,
    )?;
    println!(
        "wrote {} and {}",
        out.join("powersgd.md").display(),
        out.join("powersgd.json").display()
    );
    Ok(())
}

/// The median of `values` (NaN for none).
fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `/proc/loadavg`'s first three fields (the machine is shared: figures beside the load).
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// A python with torch whose DDP has the PowerSGD hook, if there is one.
fn torch_python() -> Option<PathBuf> {
    let candidate = util::torch_python();
    let ok = Command::new(&candidate)
        .args([
            "-c",
            "import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(candidate)
}

/// The hook flags of our bench and trainer.
fn hook_flags(hook: &str, rank: usize, start: u64) -> Vec<String> {
    let mut flags = vec!["--comm-hook".to_string(), hook.to_string()];
    if hook == "powersgd" {
        flags.extend(["--powersgd-rank".into(), rank.to_string()]);
        flags.extend(["--powersgd-start".into(), start.to_string()]);
    }
    flags
}

/// The network interface of namespace `ns` other than `lo` (the veth end).
fn veth_of(ns: &str) -> Result<String> {
    let text = util::run_stdout(Command::new("ip").args(["-n", ns, "-o", "link", "show"]))?;
    text.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_string())
        .find(|name| name != "lo")
        .with_context(|| format!("no interface but lo in namespace {ns}"))
}

/// Runs `command(node, ns)` in each of two fresh namespaces joined by the limited veth, and
/// returns their standard outputs joined.
fn on_two_hosts(
    rate: &str,
    mut command: impl FnMut(usize, &str) -> Result<Command>,
) -> Result<String> {
    let hosts = TwoHosts::new(Some(rate))?;
    let mut children = Vec::new();
    for (node, ns) in hosts.names.iter().enumerate() {
        let mut c = command(node, ns)?;
        c.stdout(Stdio::piped());
        eprintln!("$ {}", util::command_line(&c));
        children.push(c.spawn().context("starting a rank in a namespace")?);
    }
    let mut text = String::new();
    let mut failed = None;
    for child in children {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            failed = Some(output.status);
        }
        text += &String::from_utf8_lossy(&output.stdout);
    }
    drop(hosts);
    if let Some(status) = failed {
        bail!("a rank on a simulated host failed ({status})");
    }
    Ok(text)
}

/// The JSON after `tag` on some line of `text`.
fn tagged<T: for<'de> Deserialize<'de>>(text: &str, tag: &str) -> Result<T> {
    let json = text
        .lines()
        .find_map(|l| l.split_once(tag).map(|(_, j)| j.trim()))
        .with_context(|| format!("no `{tag}` line in:\n{text}"))?;
    serde_json::from_str(json).with_context(|| format!("parsing `{tag}` {json}"))
}

/// One 2-rank run of ours, one rank per namespace.
fn run_ours(bin: &Path, args: &Args, model: &str, hook: &str) -> Result<Ours> {
    let text = on_two_hosts(&args.rate, |node, ns| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(bin.join("ddprun"));
        c.args(["--nnodes", "2", "--node-rank", &node.to_string()]);
        c.args(["--nproc-per-node", "1", "--master-addr", TwoHosts::ADDRS[0]]);
        c.args(["--master-port", "29581", "--"]);
        c.arg(bin.join("ddp-zero-bench"));
        c.args(["--stage", "0", "--model", model, "--hidden", "2048"]);
        c.args(["--batch", &args.batch.to_string()]);
        c.args(["--warmup", &args.warmup.to_string()]);
        c.args(["--steps", &args.steps.to_string()]);
        c.args(hook_flags(hook, args.rank, 1));
        c.env("DDP_TRANSPORT", "tcp");
        c.env("DDP_HOST_ID", format!("powersgd-host-{node}"));
        Ok(c)
    })?;
    tagged(&text, "ZERO_BENCH ")
}

/// One 2-rank run of PyTorch's, one rank per namespace (gloo on the veth).
fn run_theirs(python: &Path, args: &Args, model: &str, hook: &str) -> Result<Theirs> {
    let script = util::workspace_root().join("xtask/py/powersgd_bench.py");
    let text = on_two_hosts(&args.rate, |node, ns| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(python).arg(&script);
        // PyTorch's PowerSGD needs start ≥ 2 with error feedback: it starts at step 2.
        c.args([model, hook, &args.rank.to_string(), "2"]);
        c.args([args.batch, args.warmup.max(3), args.steps].map(|n| n.to_string()));
        c.env("RANK", node.to_string()).env("WORLD_SIZE", "2");
        c.env("MASTER_ADDR", TwoHosts::ADDRS[0])
            .env("MASTER_PORT", "29582");
        c.env("GLOO_SOCKET_IFNAME", veth_of(ns)?);
        c.env("OMP_NUM_THREADS", "1");
        Ok(c)
    })?;
    tagged(&text, "TORCH_POWERSGD ")
}

/// train-mnist for `accuracy_epochs` on 2 local ranks, plain and with PowerSGD.
fn accuracy(bin: &Path, args: &Args) -> Result<Accuracy> {
    let mut results = Vec::new();
    for hook in ["none", "powersgd"] {
        let mut flags = vec!["--epochs".to_string(), args.accuracy_epochs.to_string()];
        flags.extend(hook_flags(hook, args.rank, args.accuracy_start));
        if let Some(steps) = args.accuracy_max_steps {
            flags.extend(["--max-steps".to_string(), steps.to_string()]);
        }
        results.push(train::launch(bin, "train-mnist", 2, &flags)?);
    }
    Ok(Accuracy {
        epochs: args.accuracy_epochs,
        powersgd_start: args.accuracy_start,
        rank: args.rank,
        plain: results[0].test_accuracy,
        powersgd: results[1].test_accuracy,
        plain_wall_s: results[0].wall_seconds,
        powersgd_wall_s: results[1].wall_seconds,
    })
}

/// The Markdown report.
fn report(args: &Args, rows: &[Row], accuracy: Option<&Accuracy>, load: &str) -> String {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "2 ranks, one per network namespace, joined by a veth limited to {}; 1 compute thread \
         per rank, {cores} core(s), load average before: {load}. Batch {} per rank, Adam, \
         default buckets (25 MiB, first 1 MiB); medians of {} runs of {} steps after {} \
         warm-up steps. PowerSGD at rank {}, compressing from the second step.\n\n",
        args.rate, args.batch, args.repeats, args.steps, args.warmup, args.rank
    );
    md += &util::md_header(
        &["model", "hook"],
        [
            "step (ms)",
            "speed-up",
            "on the wire / step (MB)",
            "less on the wire",
            "handed to collectives / step (MB)",
            "PyTorch: step (ms)",
            "PyTorch: on the wire / step (MB)",
        ]
        .map(String::from),
    );
    let opt = |v: Option<f64>, digits: usize| v.map_or("—".into(), |v| format!("{v:.digits$}"));
    for r in rows {
        let plain = rows
            .iter()
            .find(|p| p.model == r.model && p.hook == "none")
            .expect("none runs first");
        md += &format!(
            "| {} | {} | {:.1} | {:.2}x | {:.3} | {:.1}x | {:.3} | {} | {} |\n",
            r.model,
            r.hook,
            r.step_ms,
            plain.step_ms / r.step_ms,
            r.wire_mb,
            plain.wire_mb / r.wire_mb,
            r.collective_mb,
            opt(r.torch_step_ms, 1),
            opt(r.torch_wire_mb, 3),
        );
    }
    md += "\ncnn: the MNIST CNN (1.2 M parameters); deep: 784 → 4 × 2048 → 10 (14.2 M). On the \
           wire: bytes rank 0's veth sent during the timed steps, per step (TCP/IP headers \
           included).\n";
    if let Some(a) = accuracy {
        md += &format!(
            "\nMNIST test accuracy after {} epochs{} of train-mnist on 2 ranks: plain all-reduce \
             {:.2} %, PowerSGD rank {} (from step {}) {:.2} % (difference {:+.2} pt; runs of \
             {:.0} s and {:.0} s).\n",
            a.epochs,
            args.accuracy_max_steps
                .map_or(String::new(), |s| format!(" (at most {s} steps)")),
            100.0 * a.plain,
            a.rank,
            a.powersgd_start,
            100.0 * a.powersgd,
            100.0 * (a.powersgd - a.plain),
            a.plain_wall_s,
            a.powersgd_wall_s
        );
    }
    md
}
