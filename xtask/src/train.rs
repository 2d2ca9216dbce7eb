//! `cargo xtask train-mnist` and `cargo xtask train-pima`: build in release, launch N local
//! ranks of a trainer through `ddprun`, and say where the results went.
//!
//! The trainer itself obtains MNIST when needed (into `~/.cache/ddp-rs/mnist` or
//! `$DDP_DATA_DIR`, unless `--data-dir` is given), writes checkpoints, metrics and the
//! safetensors export; this task only chooses the output folder and reads the trainer's
//! closing `DDP_SUMMARY` line.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::util;

/// Options of `train-mnist` / `train-pima`; anything else goes to the trainer as it is.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks (processes) on this machine.
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Epochs (the trainer's default when absent).
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Folder for checkpoints, metrics and weights (default `runs/<trainer>-<unix time>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Fail unless the final test accuracy reaches this fraction (for CI), e.g. 0.95.
    #[arg(long)]
    pub min_accuracy: Option<f64>,
    /// Flags for the trainer (see `train-mnist --help`), e.g. `--batch-size 32 --lr 2e-3`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    pub trainer_args: Vec<String>,
}

/// What the trainer reported at the end, as far as this task uses it.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Summary {
    /// Test accuracy after the last epoch.
    pub test_accuracy: f64,
    /// Correct test predictions.
    pub test_correct: u64,
    /// Test samples.
    pub test_total: u64,
    /// Epochs done.
    pub epochs: usize,
    /// Steps done.
    pub steps: u64,
    /// Training samples per second, all ranks.
    pub samples_per_sec: f64,
    /// Seconds in gradient synchronisation (rank 0).
    pub comm_seconds: f64,
    /// Of which packing gradients into buckets.
    #[serde(default)]
    pub pack_seconds: f64,
    /// Of which waiting for all-reduces.
    #[serde(default)]
    pub wait_seconds: f64,
    /// Of which unpacking.
    #[serde(default)]
    pub unpack_seconds: f64,
    /// Wall time of rank 0's run.
    pub wall_seconds: f64,
    /// Peak resident memory of each rank, MiB.
    #[serde(default)]
    pub peak_rss_mib: Vec<f64>,
    /// The run's other output lines (every rank's), as printed.
    #[serde(skip)]
    pub output: Vec<String>,
}

/// Runs `trainer` on `nproc` local ranks through ddprun with `args`, streaming its output, and
/// returns the summary rank 0 printed.
pub fn launch(
    bin_dir: &std::path::Path,
    trainer: &str,
    nproc: usize,
    args: &[String],
) -> Result<Summary> {
    let mut command = Command::new(bin_dir.join("ddprun"));
    command
        .args(["--nproc-per-node", &nproc.to_string(), "--"])
        .arg(bin_dir.join(trainer))
        .arg("--json")
        .args(args)
        .stdout(Stdio::piped());
    eprintln!("$ {}", util::command_line(&command));
    let mut child = command.spawn().context("starting ddprun")?;
    let stdout = child.stdout.take().context("ddprun's output")?;
    let (mut summary, mut output) = (None, Vec::new());
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        match line.split_once("DDP_SUMMARY ") {
            Some((_, json)) => {
                summary =
                    Some(serde_json::from_str::<Summary>(json).context("the trainer's summary")?)
            }
            None => {
                println!("{line}");
                output.push(line);
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("{trainer} failed ({status}); see the output above");
    }
    let mut summary: Summary = summary.context("the trainer printed no summary")?;
    summary.output = output;
    Ok(summary)
}

/// The cargo feature the trainer's `--backend` needs on top of the tasks' CPU build, if any:
/// `ddp-apps/wgpu` for `wgpu`, `vulkan` and `metal`, `ddp-apps/cuda` for `cuda` (the trainer
/// itself refuses a backend its build lacks, naming the feature).
fn backend_feature(trainer_args: &[String]) -> Option<&'static str> {
    let mut backend = None;
    for (i, arg) in trainer_args.iter().enumerate() {
        if let Some(value) = arg.strip_prefix("--backend=") {
            backend = Some(value);
        } else if arg == "--backend" {
            backend = trainer_args.get(i + 1).map(String::as_str);
        }
    }
    match backend? {
        "wgpu" | "vulkan" | "metal" => Some("ddp-apps/wgpu"),
        "cuda" => Some("ddp-apps/cuda"),
        _ => None,
    }
}

/// `cargo xtask train-mnist` / `train-pima`.
pub fn run(trainer: &str, args: Args) -> Result<()> {
    let started = Instant::now();
    let features: Vec<&str> = backend_feature(&args.trainer_args).into_iter().collect();
    let bin_dir = util::build_release_bins(&["ddprun", trainer], &features)?;
    let out = util::run_dir(trainer, args.out)?;
    let (checkpoints, metrics, weights) = (
        out.join("checkpoints"),
        out.join("metrics"),
        out.join("model.safetensors"),
    );
    let mut trainer_args: Vec<String> = vec![
        "--checkpoint-dir".into(),
        checkpoints.display().to_string(),
        "--metrics-dir".into(),
        metrics.display().to_string(),
        "--export".into(),
        weights.display().to_string(),
    ];
    if let Some(epochs) = args.epochs {
        trainer_args.extend(["--epochs".into(), epochs.to_string()]);
    }
    trainer_args.extend(args.trainer_args);
    let s = launch(&bin_dir, trainer, args.nproc, &trainer_args)?;
    println!();
    println!(
        "final test accuracy: {:.2}% ({}/{}) after {} epochs ({} steps) on {} ranks",
        100.0 * s.test_accuracy,
        s.test_correct,
        s.test_total,
        s.epochs,
        s.steps,
        args.nproc
    );
    println!(
        "wall time: {:.1} s in all ({:.1} s training run), {:.0} samples/s, {:.1} s in gradient \
         communication on rank 0",
        started.elapsed().as_secs_f64(),
        s.wall_seconds,
        s.samples_per_sec,
        s.comm_seconds
    );
    println!(
        "weights (safetensors, PyTorch names): {}",
        weights.display()
    );
    println!("checkpoints: {}", checkpoints.display());
    println!("metrics (CSV, TensorBoard): {}", metrics.display());
    if let Some(min) = args.min_accuracy {
        if s.test_accuracy < min {
            bail!(
                "test accuracy {:.2}% is below the required {:.2}%",
                100.0 * s.test_accuracy,
                100.0 * min
            );
        }
        println!(
            "accuracy check passed: {:.2}% >= {:.2}%",
            100.0 * s.test_accuracy,
            100.0 * min
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn a_gpu_backend_adds_its_feature_and_the_cpu_none() {
        assert_eq!(backend_feature(&args("--epochs 1")), None);
        assert_eq!(backend_feature(&args("--backend cpu")), None);
        assert_eq!(
            backend_feature(&args("--lr 1e-3 --backend vulkan")),
            Some("ddp-apps/wgpu")
        );
        assert_eq!(
            backend_feature(&args("--backend=cuda")),
            Some("ddp-apps/cuda")
        );
        // The last one counts, as for the trainer's own parser.
        assert_eq!(backend_feature(&args("--backend wgpu --backend cpu")), None);
    }
}
