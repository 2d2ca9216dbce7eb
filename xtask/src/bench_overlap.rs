//! `cargo xtask bench-overlap`: step time of 2-rank DDP with the all-reduces after backward
//! and during backward (`--overlap`), in the same run, for the MNIST CNN
//! (4.8 MB of gradients) and a deep MLP (784 → 4 × 2048 → 10, 57 MB), over shared memory,
//! over TCP on this host, and, as root, over TCP between two network namespaces joined by a
//! veth pair limited with `tc` to a data-centre rate (10 Gbit/s) and to 1 Gbit/s, where the
//! deep MLP's communication takes three times as long as its backward at the default batch.
//! One more row runs the deep MLP over the last (slowest) veth rate at a larger batch
//! (`--balanced-batch`, 256), where its backward takes about as long as its all-reduce: the
//! case overlap is for. Buckets are DDP's defaults (25 MiB, the first 1 MiB).
//!
//! Each configuration is `--repeats` runs of `ddp-zero-bench --overlap-pairs` under `ddprun`:
//! within one run the steps alternate with and without overlap (on, off, off, on, ...), so both
//! are timed in the same processes under the same load. (Timed in separate runs, as this bench
//! did before, the same configuration's step moved by up to 15 % from one pair of processes to
//! the next on a shared 2-core machine: more than overlap changes the CNN's step on one host.)
//! The speed-up is the median over pairs of adjacent steps, the other columns medians over
//! steps; each is the median over the runs. The machine's load average before the runs is
//! printed with them. Writes `overlap.md` and `overlap.json`.
//!
//! One compute thread per rank: on a 2-core machine the communication threads compete with
//! the other rank's backward for the cores, which is part of what the figures show.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::netns::TwoHosts;
use crate::util;

/// Options of `bench-overlap`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed steps per run (after 4 warm-up steps), half of them with overlap; even.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Runs of each configuration (each alternating with and without overlap); medians
    /// reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// DDP's bucket size in MiB (both modes; DDP's default).
    #[arg(long, default_value_t = 25.0)]
    bucket_cap_mb: f64,
    /// The veth link's rates (`tc` syntax), comma separated: one row each; the two-namespace
    /// runs need root.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["10gbit".to_string(), "1gbit".to_string()])]
    rate: Vec<String>,
    /// Samples per rank of one more row: the deep MLP over the last `--rate` at a batch where
    /// its backward takes about as long as its all-reduce (256 over 1 Gbit/s on a 2-core
    /// machine; the table's backward column shows how close). 0: no such row.
    #[arg(long, default_value_t = 256)]
    balanced_batch: usize,
    /// Skip the two-namespace runs.
    #[arg(long)]
    no_netns: bool,
    /// The models, comma separated (`cnn`, `deep`).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["cnn".to_string(), "deep".to_string()])]
    models: Vec<String>,
    /// Output folder (default `target/bench`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The figures of one run (`ddp-zero-bench --overlap-pairs`' `OVERLAP_PAIRS` line, the
/// fields used here).
#[derive(Debug, Clone, Deserialize, Serialize)]
struct Run {
    on_step_s: f64,
    off_step_s: f64,
    speedup: f64,
    on_sync_s: f64,
    off_sync_s: f64,
    off_backward_s: f64,
    buckets_during_backward: f64,
}

/// One configuration's medians.
#[derive(Debug, Serialize)]
struct Row {
    model: String,
    link: String,
    batch: usize,
    off_ms: f64,
    on_ms: f64,
    speedup: f64,
    sync_off_ms: f64,
    sync_on_ms: f64,
    backward_off_ms: f64,
}

/// `cargo xtask bench-overlap`.
pub fn run(args: Args) -> Result<()> {
    if args.steps < 2 || !args.steps.is_multiple_of(2) || args.repeats == 0 {
        bail!("--steps must be even and at least 2 (half with overlap), --repeats at least 1");
    }
    let bin = util::build_release_bins(&["ddprun", "ddp-zero-bench"], &[])?;
    let out = match args.out.clone() {
        Some(out) => out,
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let mut links = vec!["shm".to_string(), "tcp".to_string()];
    if !args.no_netns {
        links.extend(args.rate.iter().map(|rate| format!("veth {rate}")));
    }
    let load = load_average();
    let mut configurations: Vec<(&str, String, usize)> = Vec::new();
    for model in &args.models {
        for link in &links {
            configurations.push((model, link.clone(), args.batch));
        }
    }
    if let Some(rate) = args.rate.last().filter(|_| !args.no_netns) {
        if args.balanced_batch > 0 && args.models.iter().any(|m| m == "deep") {
            configurations.push(("deep", format!("veth {rate}"), args.balanced_batch));
        }
    }
    let mut rows = Vec::new();
    for (model, link, batch) in configurations {
        let mut runs = Vec::new();
        for _ in 0..args.repeats {
            let run = one(&bin, &args, model, &link, batch)?;
            if run.buckets_during_backward < 1.0 {
                bail!("{model} over {link}: no all-reduce started during backward with --overlap");
            }
            runs.push(run);
        }
        let med = |f: &dyn Fn(&Run) -> f64| {
            let mut v: Vec<f64> = runs.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        rows.push(Row {
            model: model.into(),
            link,
            batch,
            backward_off_ms: 1e3 * med(&|r| r.off_backward_s),
            off_ms: 1e3 * med(&|r| r.off_step_s),
            on_ms: 1e3 * med(&|r| r.on_step_s),
            speedup: med(&|r| r.speedup),
            sync_off_ms: 1e3 * med(&|r| r.off_sync_s),
            sync_on_ms: 1e3 * med(&|r| r.on_sync_s),
        });
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut md = format!(
        "2 ranks, 1 compute thread each, {cores} core(s); batch per rank in the table, Adam, \
         buckets of {} MiB (the first 1 MiB); {} runs of {} steps, each alternating with and \
         without overlap (each step the slowest rank's time); speed-up: the median over pairs \
         of adjacent steps, the rest medians over steps, each the median over the runs; load \
         average before the runs: {load}.\n\n",
        args.bucket_cap_mb, args.repeats, args.steps
    );
    md += &util::md_header(
        &["model", "link", "batch"],
        [
            "backward, all-reduce after it (ms)",
            "step, all-reduce after backward (ms)",
            "step, during backward (ms)",
            "speed-up",
            "sync after backward: off / on (ms)",
        ]
        .map(String::from),
    );
    for r in &rows {
        md += &format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1} / {:.1} |\n",
            r.model,
            r.link,
            r.batch,
            r.backward_off_ms,
            r.off_ms,
            r.on_ms,
            r.speedup,
            r.sync_off_ms,
            r.sync_on_ms
        );
    }
    md +=
        "\ncnn: the MNIST CNN (1.2 M parameters); deep: 784 → 4 × 2048 → 10 (14.2 M). Sync after \
           backward: rank 0's time in the wrapper after backward returned (packing, waiting for \
           and unpacking the all-reduces), what overlap hides; backward: rank 0's backward \
           itself, the compute it can hide them behind.\n";
    println!("\n{md}");
    std::fs::write(out.join("overlap.md"), &md)?;
    std::fs::write(
        out.join("overlap.json"),
        serde_json::to_string_pretty(
            &serde_json::json!({ "cores": cores, "load": load, "rows": rows }),
        )?,
    )?;
    println!(
        "wrote {} and {}",
        out.join("overlap.md").display(),
        out.join("overlap.json").display()
    );
    Ok(())
}

/// One 2-rank run of `model` over `link` (`shm`, `tcp`, or `veth RATE`: one rank in each of
/// two namespaces).
fn one(bin: &Path, args: &Args, model: &str, link: &str, batch: usize) -> Result<Run> {
    let bench_args = |command: &mut Command| {
        command.arg(bin.join("ddp-zero-bench"));
        command.args(["--stage", "0", "--model", model, "--hidden", "2048"]);
        command.args(["--batch", &batch.to_string()]);
        command.args(["--warmup", "4", "--steps", &args.steps.to_string()]);
        command.args(["--bucket-cap-mb", &args.bucket_cap_mb.to_string()]);
        command.arg("--overlap-pairs");
    };
    let Some(rate) = link.strip_prefix("veth ") else {
        let mut command = Command::new(bin.join("ddprun"));
        command.args(["--nproc-per-node", "2", "--"]);
        bench_args(&mut command);
        command.env("DDP_TRANSPORT", link);
        let text = util::run_stdout(&mut command)?;
        return tagged(&text);
    };
    let hosts = TwoHosts::new(Some(rate))?;
    let mut children = Vec::new();
    for (node, ns) in hosts.names.iter().enumerate() {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns]).arg(bin.join("ddprun"));
        command.args(["--nnodes", "2", "--node-rank", &node.to_string()]);
        command.args(["--nproc-per-node", "1", "--master-addr", TwoHosts::ADDRS[0]]);
        command.args(["--master-port", "29578", "--"]);
        bench_args(&mut command);
        command.env("DDP_TRANSPORT", "tcp");
        command.env("DDP_HOST_ID", format!("overlap-host-{node}"));
        command.stdout(std::process::Stdio::piped());
        eprintln!("$ {}", util::command_line(&command));
        children.push(command.spawn().context("starting ddprun in a namespace")?);
    }
    let mut text = String::new();
    for child in children {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!("ddprun on a simulated host failed ({})", output.status);
        }
        text += &String::from_utf8_lossy(&output.stdout);
    }
    drop(hosts);
    tagged(&text)
}

/// The `OVERLAP_PAIRS` line of rank 0 in `text`.
fn tagged(text: &str) -> Result<Run> {
    let json = text
        .lines()
        .find_map(|l| l.split_once("OVERLAP_PAIRS ").map(|(_, j)| j.trim()))
        .with_context(|| format!("no OVERLAP_PAIRS line in:\n{text}"))?;
    serde_json::from_str(json).with_context(|| format!("parsing {json}"))
}

/// `/proc/loadavg`'s first three fields: the machine is shared, and the figures are printed
/// beside the load they were measured under.
pub(crate) fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}
