//! `--nproc-per-node N` of the trainers: the trainer starts N ranks of itself on this host and
//! waits for them (PyTorch's `mp.spawn`, through [`ddp_launch::spawn`]), instead of needing a
//! launcher. A process that already is a rank (a launcher's variables are set) refuses the
//! flag with an error: the launcher decides how many ranks there are. The batch script of a
//! Slurm job is no rank, although Slurm's variables are set in it: there the flag works.

use std::ffi::{OsStr, OsString};

use anyhow::{anyhow, Result};
use clap::Args;
use ddp_launch::{LaunchError, SpawnOptions};

/// The flag that makes a trainer start its own ranks.
const FLAG: &str = "--nproc-per-node";

/// The trainers' launcher flag (not a training setting, so not in `TrainArgs` or a config file).
#[derive(Debug, Clone, Default, PartialEq, Eq, Args)]
pub struct SpawnArgs {
    /// Start N ranks of this trainer on this host and wait for them, without a launcher (as
    /// `ddprun --nproc-per-node N` would; PyTorch's mp.spawn). Their output comes out prefixed
    /// with [rank R]; when one fails the others are stopped and the first failure is named.
    /// Refused in a process that a launcher (ddprun, torchrun, mpirun, srun) already started
    /// as one rank of several; allowed in a Slurm batch script (sbatch).
    #[arg(long, value_name = "N")]
    pub nproc_per_node: Option<usize>,
}

impl SpawnArgs {
    /// With `--nproc-per-node N`: runs this program as N ranks (its own arguments without the
    /// flag) and returns `Some` with their outcome; without the flag `None`, and the caller
    /// trains in this process. A failed rank's root-cause box is printed before the error is
    /// returned.
    pub fn run_ranks(&self) -> Option<Result<()>> {
        let n = self.nproc_per_node?;
        let options = SpawnOptions::with_args(without_flag(std::env::args_os().skip(1)));
        Some(match ddp_launch::spawn(n, &options) {
            Ok(_) => Ok(()),
            Err(error) => {
                if let Some(the_box) = ddp_launch::root_cause_box(&error) {
                    eprintln!("{the_box}");
                }
                Err(match error {
                    LaunchError::AlreadyARank { .. } | LaunchError::Environment(_) => {
                        anyhow!("{FLAG} {n}: {error}")
                    }
                    _ => anyhow!("{FLAG} {n}: the ranks failed: {error}"),
                })
            }
        })
    }
}

/// `args` without `--nproc-per-node N` and `--nproc-per-node=N` (the ranks must not spawn
/// again).
fn without_flag(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = args.into_iter();
    let with_value = format!("{FLAG}=");
    while let Some(arg) = args.next() {
        if arg == OsStr::new(FLAG) {
            args.next();
        } else if !arg.to_string_lossy().starts_with(&with_value) {
            out.push(arg);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_and_its_value_are_removed() {
        let args = |list: &[&str]| list.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            without_flag(args(&[
                "--epochs",
                "1",
                "--nproc-per-node",
                "2",
                "--seed",
                "3"
            ])),
            args(&["--epochs", "1", "--seed", "3"])
        );
        assert_eq!(
            without_flag(args(&["--nproc-per-node=4", "--max-steps", "5"])),
            args(&["--max-steps", "5"])
        );
    }
}
