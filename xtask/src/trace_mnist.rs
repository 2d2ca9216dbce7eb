//! `cargo xtask trace-mnist`: trains the MNIST CNN on 2 local ranks for a few steps with
//! `--trace-dir`, merges the ranks' Chrome trace files into one (one process per rank, on the
//! common wall clock), prints where a step's time goes and how to open the files.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::train::launch;
use crate::util;

/// Options of `trace-mnist`; anything else goes to the trainer as it is.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks (processes) on this machine.
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// The traced steps, `A..B` (global, from 1, B excluded); the run ends with step B - 1.
    #[arg(long, default_value = "6..11")]
    pub steps: String,
    /// Folder for the trace files (default `runs/trace-mnist-<unix time>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Flags for the trainer (see `train-mnist --help`), e.g. `--batch-size 32`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub trainer_args: Vec<String>,
}

/// The phases of a step as the trainer names its spans, in the order of a step: the training
/// thread's, then the communication thread's `all_reduce`.
const PHASES: [&str; 8] = [
    "data",
    "forward",
    "backward",
    "pack",
    "wait",
    "unpack",
    "optimizer",
    "all_reduce",
];

/// `cargo xtask trace-mnist`.
pub fn run(args: Args) -> Result<()> {
    let bad = || format!("--steps {}: expected A..B with 1 <= A < B", args.steps);
    let (start, end) = args.steps.split_once("..").with_context(bad)?;
    let (start, end): (u64, u64) = (
        start.trim().parse().with_context(bad)?,
        end.trim().parse().with_context(bad)?,
    );
    anyhow::ensure!(start >= 1 && start < end, "{}", bad());
    let bin_dir = util::build_release_bins(&["ddprun", "train-mnist"], &[])?;
    let out = util::run_dir("trace-mnist", args.out)?;
    let mut trainer_args: Vec<String> = vec![
        "--epochs".into(),
        "1".into(),
        "--max-steps".into(),
        (end - 1).to_string(),
        "--test-samples".into(),
        "500".into(),
        "--trace-dir".into(),
        out.display().to_string(),
        "--trace-steps".into(),
        args.steps.clone(),
    ];
    trainer_args.extend(args.trainer_args);
    launch(&bin_dir, "train-mnist", args.nproc, &trainer_args)?;

    let files: Vec<PathBuf> = (0..args.nproc)
        .map(|r| out.join(format!("trace-rank{r}.json")))
        .collect();
    let traces: Vec<Value> = files.iter().map(|f| read(f)).collect::<Result<_>>()?;
    let merged = out.join("trace-all-ranks.json");
    std::fs::write(&merged, serde_json::to_vec(&merge(&traces))?)
        .with_context(|| format!("writing {}", merged.display()))?;

    println!("\nwhere a step's time goes (mean per traced step, ms; share of the step):\n");
    println!("{}", breakdown(&traces));
    println!(
        "what the training thread did while the all-reduces ran (ms per traced step; `wait` is \
         time the all-reduce was not hidden):\n"
    );
    println!("{}", overlap(&traces));
    for (rank, trace) in traces.iter().enumerate() {
        println!(
            "rank {rank}: {:.0} % of the all-reduce time lies inside backward",
            100.0 * inside_backward(trace)
        );
    }
    println!();
    check_kinds(&traces)?;
    println!("trace files (Chrome trace event format, one clock for all ranks):");
    for f in &files {
        println!("  {}", f.display());
    }
    println!("  {} (all ranks in one file)", merged.display());
    println!(
        "\nto open: https://ui.perfetto.dev, \"Open trace file\", pick {} (works offline once \
         loaded; nothing is uploaded); or chrome://tracing, \"Load\". Each rank is a process with \
         a `training` track and a `communication` track (the all-reduces, one per bucket).",
        merged.display()
    );
    Ok(())
}

fn read(path: &Path) -> Result<Value> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// One trace of all ranks' events (each rank is already its own `pid`).
fn merge(traces: &[Value]) -> Value {
    let events: Vec<Value> = traces
        .iter()
        .flat_map(|t| t["traceEvents"].as_array().cloned().unwrap_or_default())
        .collect();
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// A Markdown table: per rank, the mean milliseconds per traced step of every phase and its
/// share of the step (the all-reduce runs on the communication thread, overlapping packing,
/// waiting and unpacking, so the shares do not add up to 100 %).
fn breakdown(traces: &[Value]) -> String {
    let mut md = util::md_header(&["rank", "step"], PHASES.iter().map(|p| p.to_string()));
    for (rank, trace) in traces.iter().enumerate() {
        let spans: Vec<&Value> = trace["traceEvents"]
            .as_array()
            .map(|a| a.iter().filter(|e| e["ph"] == "X").collect())
            .unwrap_or_default();
        let total = |name: &str| -> f64 {
            spans
                .iter()
                .filter(|e| e["name"] == name)
                .filter_map(|e| e["dur"].as_f64())
                .fold(0.0, |a, b| a + b)
                / 1e3
        };
        let steps = spans.iter().filter(|e| e["name"] == "step").count().max(1) as f64;
        let step = total("step") / steps;
        md += &format!("| {rank} | {step:.1} |");
        for p in PHASES {
            let ms = total(p) / steps;
            md += &format!(" {ms:.1} ({:.0}%) |", 100.0 * ms / step.max(1e-9));
        }
        md += "\n";
    }
    md
}

/// The training thread's spans that are phases of their own (`step` and `sync` enclose
/// others): every phase but the last, `all_reduce`.
const TRAINING_PHASES: &[&str] = PHASES.split_last().expect("phases").1;

/// `(name, start, end)` of the complete events of one trace on track `tid`, in microseconds.
fn spans_on(trace: &Value, tid: u64) -> Vec<(String, f64, f64)> {
    trace["traceEvents"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["ph"] == "X" && e["tid"] == tid)
                .filter_map(|e| {
                    let ts = e["ts"].as_f64()?;
                    let dur = e["dur"].as_f64()?;
                    Some((e["name"].as_str()?.to_string(), ts, ts + dur))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A Markdown table: per rank, the all-reduces' time on the communication track (ms per
/// traced step) and how much of it coincided with each phase of the training thread, so that
/// overlap (pack, unpack, backward) and exposed communication (wait) show as numbers.
fn overlap(traces: &[Value]) -> String {
    let mut md = util::md_header(
        &["rank", "all_reduce"],
        TRAINING_PHASES.iter().map(|p| format!("during {p}")),
    );
    for (rank, trace) in traces.iter().enumerate() {
        let training = spans_on(trace, 1);
        let reduces = spans_on(trace, 2);
        let steps = training.iter().filter(|s| s.0 == "step").count().max(1) as f64;
        let reduce_ms: f64 =
            reduces.iter().map(|r| r.2 - r.1).fold(0.0, |a, b| a + b) / 1e3 / steps;
        md += &format!("| {rank} | {reduce_ms:.2} |");
        for &p in TRAINING_PHASES {
            let mut both = 0.0;
            for (_, a, b) in reduces.iter().filter(|r| r.0 == "all_reduce") {
                for (_, c, d) in training.iter().filter(|t| t.0 == p) {
                    both += (b.min(*d) - a.max(*c)).max(0.0);
                }
            }
            md += &format!(" {:.2} |", both / 1e3 / steps);
        }
        md += "\n";
    }
    md
}

/// The share of the communication track's all-reduce time that lies inside the training
/// track's `backward` spans (0 when there is no all-reduce): what overlap hides.
fn inside_backward(trace: &Value) -> f64 {
    let training = spans_on(trace, 1);
    let reduces = spans_on(trace, 2);
    let (mut inside, mut total) = (0.0, 0.0);
    for (_, a, b) in reduces.iter().filter(|r| r.0 == "all_reduce") {
        total += b - a;
        for (_, c, d) in training.iter().filter(|t| t.0 == "backward") {
            inside += (b.min(*d) - a.max(*c)).max(0.0);
        }
    }
    if total > 0.0 {
        inside / total
    } else {
        0.0
    }
}

/// Fails unless every rank's trace holds spans of every kind the trainer records.
fn check_kinds(traces: &[Value]) -> Result<()> {
    for (rank, trace) in traces.iter().enumerate() {
        let mut names: Vec<String> = spans_on(trace, 1).into_iter().map(|s| s.0).collect();
        names.extend(spans_on(trace, 2).into_iter().map(|s| s.0));
        for kind in PHASES.iter().chain(&["step"]) {
            anyhow::ensure!(
                names.iter().any(|n| n == kind),
                "rank {rank}'s trace has no `{kind}` span (was the traced window past the run's \
                 end?)"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_breakdown_averages_over_steps() {
        let x = |name: &str, dur: f64| json!({ "ph": "X", "name": name, "ts": 0.0, "dur": dur });
        let trace = json!({ "traceEvents": [
            x("step", 10_000.0), x("step", 30_000.0),
            x("forward", 4_000.0), x("forward", 6_000.0),
            x("all_reduce", 2_000.0),
            { "ph": "M", "name": "process_name" },
        ]});
        let md = breakdown(std::slice::from_ref(&trace));
        let row = md.lines().nth(2).unwrap();
        // step 20 ms; forward 5 ms (25 %); all_reduce 1 ms (5 %); data absent: 0.
        assert!(
            row.starts_with("| 0 | 20.0 | 0.0 (0%) | 5.0 (25%) |"),
            "{row}"
        );
        assert!(row.ends_with(" 1.0 (5%) |"), "{row}");
        let merged = merge(&[trace.clone(), trace.clone()]);
        assert_eq!(merged["traceEvents"].as_array().unwrap().len(), 12);
        assert!(check_kinds(&[trace]).is_err(), "no pack, wait, ... spans");
    }

    #[test]
    fn overlap_splits_the_all_reduce_by_what_training_did() {
        let x = |name: &str, tid: u64, ts: f64, dur: f64| json!({ "ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur });
        // One step: pack 0..1 ms, wait 1..3 ms, unpack 3..4 ms; the all-reduce ran 0.5..3.5 ms.
        let trace = json!({ "traceEvents": [
            x("step", 1, 0.0, 4_000.0),
            x("sync", 1, 0.0, 4_000.0),
            x("pack", 1, 0.0, 1_000.0),
            x("wait", 1, 1_000.0, 2_000.0),
            x("unpack", 1, 3_000.0, 1_000.0),
            x("all_reduce", 2, 500.0, 3_000.0),
        ]});
        let md = overlap(std::slice::from_ref(&trace));
        let row = md.lines().nth(2).unwrap();
        // all_reduce 3 ms: data, forward, backward 0; pack 0.5; wait 2; unpack 0.5; optimizer 0.
        assert_eq!(
            row,
            "| 0 | 3.00 | 0.00 | 0.00 | 0.00 | 0.50 | 2.00 | 0.50 | 0.00 |"
        );
        let mut complete = trace["traceEvents"].as_array().unwrap().clone();
        for name in ["data", "forward", "backward", "optimizer"] {
            complete.push(x(name, 1, 0.0, 1.0));
        }
        assert!(check_kinds(&[json!({ "traceEvents": complete })]).is_ok());
    }

    #[test]
    fn the_share_inside_backward_counts_only_overlap_with_backward() {
        let x = |name: &str, tid: u64, ts: f64, dur: f64| json!({ "ph": "X", "name": name, "tid": tid, "ts": ts, "dur": dur });
        // Backward 0..4 ms; all-reduces 1..3 ms (inside) and 3..7 ms (1 of 4 ms inside).
        let trace = json!({ "traceEvents": [
            x("backward", 1, 0.0, 4_000.0),
            x("wait", 1, 4_000.0, 3_000.0),
            x("all_reduce", 2, 1_000.0, 2_000.0),
            x("all_reduce", 2, 3_000.0, 4_000.0),
        ]});
        assert!((inside_backward(&trace) - 0.5).abs() < 1e-12);
        assert_eq!(inside_backward(&json!({ "traceEvents": [] })), 0.0);
    }
}
