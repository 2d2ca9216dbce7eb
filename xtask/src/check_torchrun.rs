//! `cargo xtask check-torchrun`: ddp-rs under PyTorch's own launcher. Runs
//! `torchrun --no-python --standalone --nproc-per-node N target/release/train-mnist ...` with the
//! torch of `$DDP_PYTHON` (a python that imports torch) or `~/.cache/torchenv/bin/python`, and
//! checks that it exits 0 and that every rank trained: one summary per rank, each of the full
//! world size and step count, with identical final parameters (the replicas stayed in step).
//!
//! torchrun's elastic agent hosts a PyTorch `TCPStore` on `MASTER_PORT` and tells the workers
//! with `TORCHELASTIC_USE_AGENT_STORE=True`; ddp-comm then rendezvouses through it (speaking
//! torch's store protocol, `comm/src/rendezvous/torch_store.rs`) instead of hosting its own store. Without
//! that, rank 0 would fail with "address already in use". A missing torch is an error here, not
//! a skip: this task exists to run that check.
//!
//! Then torchrun's elastic restarts: the same run under `torchrun --max-restarts 1` with a rank
//! killed mid-epoch must be restarted once by torchrun, resume from the trainer's mid-epoch
//! checkpoint (the trainers read `TORCHELASTIC_RESTART_COUNT`, which torchrun sets), and end
//! with the uninterrupted run's parameters, bit for bit.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::util;

/// Options of `check-torchrun`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks (processes) on this machine.
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Training steps of every rank.
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// MNIST folder (the trainer's default when absent: `$DDP_DATA_DIR` or its cache).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Give up (and fail) after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout_secs: u64,
}

/// What this check reads from each rank's `DDP_SUMMARY` line.
#[derive(Debug, serde::Deserialize)]
struct RankSummary {
    world_size: usize,
    steps: u64,
    params_hash: String,
    test_accuracy: f64,
}

/// A python with torch ([`util::torch_python`]); an error that says how to provide one if it
/// does not import torch.
fn torch_python() -> Result<PathBuf> {
    let candidate = util::torch_python();
    let output = Command::new(&candidate)
        .args(["-c", "import torch; print(torch.__version__)"])
        .output()
        .with_context(|| {
            format!(
                "starting {} (set $DDP_PYTHON to a python with torch)",
                candidate.display()
            )
        })?;
    if !output.status.success() {
        bail!(
            "{} cannot import torch (set $DDP_PYTHON to a python with torch): {}",
            candidate.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    eprintln!(
        "torch {} at {}",
        String::from_utf8_lossy(&output.stdout).trim(),
        candidate.display()
    );
    Ok(candidate)
}

/// `cargo xtask check-torchrun`: build train-mnist, run it under torchrun, check every rank's
/// summary; then run it again under torchrun's own `--max-restarts 1` with the last rank killed
/// (SIGKILL, the trainer's test hook) after step `KILL_AT` and mid-epoch checkpoints every
/// `CHECKPOINT_EVERY` steps: torchrun must restart the group once, the ranks must resume from
/// the last checkpoint on their own, and the run must end with exactly the first run's
/// parameters.
pub fn run(args: Args) -> Result<()> {
    const CHECKPOINT_EVERY: u64 = 5;
    const KILL_AT: u64 = 7;
    /// The last checkpoint before the kill, where the ranks must resume.
    const RESUMED_AT: u64 = KILL_AT / CHECKPOINT_EVERY * CHECKPOINT_EVERY;
    if args.steps <= KILL_AT {
        bail!(
            "--steps must exceed {KILL_AT} (the restart check kills a rank after step {KILL_AT})"
        );
    }
    let python = torch_python()?;
    let bin_dir = util::build_release_bins(&["train-mnist"], &[])?;
    let train_mnist = bin_dir.join("train-mnist");

    let (status, summaries, _) = torchrun(&python, &train_mnist, &args, &[], &[], &[])?;
    if !status.success() {
        bail!("torchrun failed ({status}); see the output above");
    }
    check_summaries(&summaries, args.nproc, args.steps)?;
    let whole = &summaries[0];
    println!(
        "torchrun check passed: {} ranks trained {} steps each through torchrun's agent store, \
         identical parameters ({}), test accuracy {:.2}%",
        args.nproc,
        args.steps,
        whole.params_hash,
        100.0 * whole.test_accuracy
    );

    let checkpoints = tempfile::tempdir().context("a folder for the checkpoints")?;
    let every = CHECKPOINT_EVERY.to_string();
    let kill_at = KILL_AT.to_string();
    let ck = checkpoints.path().to_string_lossy().into_owned();
    let started = Instant::now();
    let (status, restarted, output) = torchrun(
        &python,
        &train_mnist,
        &args,
        &["--max-restarts", "1"],
        &[("DDP_TEST_KILL_AT_STEP", kill_at.as_str())],
        &["--checkpoint-every", &every, "--checkpoint-dir", &ck],
    )?;
    if !status.success() {
        bail!("torchrun --max-restarts 1 failed ({status}) after a rank was killed at step {KILL_AT}; see the output above");
    }
    check_restart(&output, KILL_AT, RESUMED_AT)?;
    check_summaries(&restarted, args.nproc, args.steps)?;
    if restarted[0].params_hash != whole.params_hash {
        bail!(
            "after the restart the ranks ended with other parameters ({}) than the uninterrupted \
             run ({}): the resume was not exact",
            restarted[0].params_hash,
            whole.params_hash
        );
    }
    println!(
        "torchrun restart check passed: rank {} killed after step {KILL_AT}, one restart by \
         torchrun, resumed from the step-{} checkpoint, the uninterrupted run's parameters ({}); \
         {:.1} s in all",
        args.nproc - 1,
        RESUMED_AT,
        restarted[0].params_hash,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs train-mnist under torchrun (`--no-python --standalone`, plus `torchrun_args`), with
/// `env` set and `trainer_args` added; prints its output as it comes, except the summary lines,
/// and returns its exit status, every rank's summary and the output's lines.
fn torchrun(
    python: &Path,
    train_mnist: &Path,
    args: &Args,
    torchrun_args: &[&str],
    env: &[(&str, &str)],
    trainer_args: &[&str],
) -> Result<(ExitStatus, Vec<RankSummary>, Vec<String>)> {
    let mut command = Command::new(python);
    command
        .args(["-m", "torch.distributed.run", "--no-python", "--standalone"])
        .args(["--nproc-per-node", &args.nproc.to_string()])
        .args(torchrun_args)
        .arg(train_mnist)
        .args(["--epochs", "1", "--max-steps", &args.steps.to_string()])
        .args(["--test-samples", "1000", "--json", "--verbose"])
        .args(trainer_args)
        .envs(env.iter().copied());
    if let Some(dir) = &args.data_dir {
        command.arg("--data-dir").arg(dir);
    }
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    eprintln!("$ {}", util::command_line(&command));
    let mut child = command.spawn().context("starting torchrun")?;
    let stdout = child.stdout.take().context("torchrun's output")?;
    let stderr = child.stderr.take().context("torchrun's error output")?;
    // The ranks' logs (and torchrun's) come on stderr: passed through and kept for the checks.
    let errors = std::thread::spawn(move || -> Vec<String> {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            eprintln!("{line}");
            lines.push(line);
        }
        lines
    });

    // Read the output on a thread so that the deadline below holds even if nothing is printed.
    type Read = (Vec<RankSummary>, Vec<String>);
    let reader = std::thread::spawn(move || -> Result<Read> {
        let (mut summaries, mut lines) = (Vec::new(), Vec::new());
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            match line.split_once("DDP_SUMMARY ") {
                Some((_, json)) => summaries.push(
                    serde_json::from_str::<RankSummary>(json)
                        .with_context(|| format!("a rank's summary: {json}"))?,
                ),
                None => println!("{line}"),
            }
            lines.push(line);
        }
        Ok((summaries, lines))
    });
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("torchrun did not finish within {} s", args.timeout_secs);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let (summaries, mut lines) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the output reader panicked"))??;
    lines.extend(
        errors
            .join()
            .map_err(|_| anyhow::anyhow!("the error output reader panicked"))?,
    );
    Ok((status, summaries, lines))
}

/// The output of a run with a rank killed after step `killed_at` shows the kill, a restart by
/// torchrun (`TORCHELASTIC_RESTART_COUNT=1`) and every rank resuming from the checkpoint of
/// step `resumed_at`.
fn check_restart(output: &[String], killed_at: u64, resumed_at: u64) -> Result<()> {
    let count = |needle: &str| output.iter().filter(|l| l.contains(needle)).count();
    if count(&format!("kills itself after step {killed_at}")) != 1 {
        bail!("no rank was killed after step {killed_at} (the trainer's test hook did not fire)");
    }
    let restarts = count("restart 1 of the job (TORCHELASTIC_RESTART_COUNT=1)");
    let resumed = count(&format!("(mid-epoch: step {resumed_at}, "));
    if restarts == 0 || resumed == 0 || restarts != resumed {
        bail!(
            "expected every rank to restart once and resume from the step-{resumed_at} \
             checkpoint; {restarts} rank(s) said they restarted, {resumed} resumed"
        );
    }
    Ok(())
}

/// Every rank printed a summary of the full world size and step count, and the replicas ended
/// with the same parameters.
fn check_summaries(summaries: &[RankSummary], nproc: usize, steps: u64) -> Result<()> {
    if summaries.len() != nproc {
        bail!(
            "{} of {nproc} ranks printed a summary (every rank should have trained)",
            summaries.len()
        );
    }
    for (i, s) in summaries.iter().enumerate() {
        if s.world_size != nproc || s.steps != steps {
            bail!(
                "summary {i}: world size {} and {} steps, expected {nproc} and {steps}",
                s.world_size,
                s.steps
            );
        }
        if s.params_hash != summaries[0].params_hash {
            bail!(
                "the ranks' final parameters differ ({} and {}): the replicas diverged",
                summaries[0].params_hash,
                s.params_hash
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(world_size: usize, steps: u64, hash: &str) -> RankSummary {
        RankSummary {
            world_size,
            steps,
            params_hash: hash.into(),
            test_accuracy: 0.9,
        }
    }

    #[test]
    fn restarts_are_checked() {
        let lines = |text: &str| text.lines().map(String::from).collect::<Vec<_>>();
        let good = lines(
            "test hook DDP_TEST_KILL_AT_STEP: rank 1 kills itself after step 7\n\
             restart 1 of the job (TORCHELASTIC_RESTART_COUNT=1): resuming from /ck\n\
             restart 1 of the job (TORCHELASTIC_RESTART_COUNT=1): resuming from /ck\n\
             resuming from /ck/checkpoint.ddpck (mid-epoch: step 5, epoch 1 continues)\n\
             resuming from /ck/checkpoint.ddpck (mid-epoch: step 5, epoch 1 continues)",
        );
        assert!(check_restart(&good, 7, 5).is_ok());
        assert!(check_restart(&good, 8, 5).is_err(), "no kill at step 8");
        assert!(check_restart(&good, 7, 0).is_err(), "no resume from step 0");
        assert!(
            check_restart(&good[..4], 7, 5).is_err(),
            "one rank did not resume"
        );
        assert!(check_restart(&good[..1], 7, 5).is_err(), "no restart");
    }

    #[test]
    fn summaries_are_checked() {
        assert!(check_summaries(&[s(2, 30, "a"), s(2, 30, "a")], 2, 30).is_ok());
        assert!(check_summaries(&[s(2, 30, "a")], 2, 30).is_err());
        assert!(check_summaries(&[s(2, 30, "a"), s(2, 30, "b")], 2, 30).is_err());
        assert!(check_summaries(&[s(1, 30, "a"), s(1, 30, "a")], 2, 30).is_err());
        assert!(check_summaries(&[s(2, 29, "a"), s(2, 29, "a")], 2, 30).is_err());
    }
}
