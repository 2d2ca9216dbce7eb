//! `cargo xtask check-torchrun`: ddp-rs under PyTorch's own launcher. Runs
//! `torchrun --no-python --standalone --nproc-per-node N target/release/train-mnist ...` with the
//! torch of `$DDP_PYTHON` (a python that imports torch) or `~/.cache/torchenv/bin/python`, and
//! checks that it exits 0 and that every rank trained: one summary per rank, each of the full
//! world size and step count, with identical final parameters (the replicas stayed in step).
//!
//! torchrun's elastic agent hosts a PyTorch `TCPStore` on `MASTER_PORT` and tells the workers
//! with `TORCHELASTIC_USE_AGENT_STORE=True`; ddp-comm then rendezvouses through it (speaking
//! torch's store protocol, `comm/src/torch_store.rs`) instead of hosting its own store. Without
//! that, rank 0 would fail with "address already in use". A missing torch is an error here, not
//! a skip: this task exists to run that check.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
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
/// summary.
pub fn run(args: Args) -> Result<()> {
    let python = torch_python()?;
    let bin_dir = util::build_release_bins(&["train-mnist"], &[])?;
    let mut command = Command::new(&python);
    command
        .args(["-m", "torch.distributed.run", "--no-python", "--standalone"])
        .args(["--nproc-per-node", &args.nproc.to_string()])
        .arg(bin_dir.join("train-mnist"))
        .args(["--epochs", "1", "--max-steps", &args.steps.to_string()])
        .args(["--test-samples", "1000", "--json", "--verbose"]);
    if let Some(dir) = &args.data_dir {
        command.arg("--data-dir").arg(dir);
    }
    command.stdout(Stdio::piped());
    eprintln!("$ {}", util::command_line(&command));
    let mut child = command.spawn().context("starting torchrun")?;
    let stdout = child.stdout.take().context("torchrun's output")?;

    // Read the output on a thread so that the deadline below holds even if nothing is printed.
    let reader = std::thread::spawn(move || -> Result<Vec<RankSummary>> {
        let mut summaries = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line?;
            match line.split_once("DDP_SUMMARY ") {
                Some((_, json)) => summaries.push(
                    serde_json::from_str::<RankSummary>(json)
                        .with_context(|| format!("a rank's summary: {json}"))?,
                ),
                None => println!("{line}"),
            }
        }
        Ok(summaries)
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
    let summaries = reader
        .join()
        .map_err(|_| anyhow::anyhow!("the output reader panicked"))??;
    if !status.success() {
        bail!("torchrun failed ({status}); see the output above");
    }
    check_summaries(&summaries, args.nproc, args.steps)?;
    println!(
        "torchrun check passed: {} ranks trained {} steps each through torchrun's agent store, \
         identical parameters ({}), test accuracy {:.2}%",
        args.nproc,
        args.steps,
        summaries[0].params_hash,
        100.0 * summaries[0].test_accuracy
    );
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
    fn summaries_are_checked() {
        assert!(check_summaries(&[s(2, 30, "a"), s(2, 30, "a")], 2, 30).is_ok());
        assert!(check_summaries(&[s(2, 30, "a")], 2, 30).is_err());
        assert!(check_summaries(&[s(2, 30, "a"), s(2, 30, "b")], 2, 30).is_err());
        assert!(check_summaries(&[s(1, 30, "a"), s(1, 30, "a")], 2, 30).is_err());
        assert!(check_summaries(&[s(2, 29, "a"), s(2, 29, "a")], 2, 30).is_err());
    }
}
