//! `--nproc-per-node N`: a trainer started without a launcher starts its own ranks
//! (`ddp_launch::spawn`, PyTorch's `mp.spawn`), on the real MNIST, also as the batch script of a
//! Slurm job; and a trainer that already is a rank refuses the flag.

use std::process::Command;
use std::time::Duration;

mod common;

use common::text;
mod mnist;

/// The longest one trainer run in these tests may take on a loaded 2-core machine (a deadline
/// against hangs, not a speed check).
const DEADLINE: Duration = Duration::from_secs(600);

#[test]
fn nproc_per_node_starts_two_ranks_that_learn() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command
        .args([
            "--nproc-per-node",
            "2",
            "--epochs",
            "1",
            "--max-steps",
            "40",
        ])
        .args(["--threads", "1", "--test-samples", "1000", "--json"])
        .arg("--data-dir")
        .arg(mnist::real_mnist());
    common::clear_launcher_env(&mut command);
    let out = common::output_with_deadline(&mut command, DEADLINE);
    let all = text(&out);
    assert!(out.status.success(), "run failed:\n{all}");
    // Both ranks ran (rank 0 prints; the launcher's forwarding prefixes its lines), as one
    // group of 2 that torchrun's variables formed.
    assert!(
        all.contains("[rank 0] training cnn: world 2 (launcher: spawn; 1 compute threads"),
        "{all}"
    );
    let line = all
        .lines()
        .find_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no summary in:\n{all}"));
    let s: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(s["world_size"], 2, "{line}");
    assert_eq!(s["steps"], 40, "{line}");
    assert_eq!(s["test_total"], 1000, "{line}");
    let accuracy = s["test_accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.8, "accuracy {accuracy} after 40 steps:\n{all}");
}

#[test]
fn a_rank_refuses_nproc_per_node() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command.args(["--nproc-per-node", "2", "--max-steps", "1"]);
    common::clear_launcher_env(&mut command);
    command.envs([("RANK", "0"), ("WORLD_SIZE", "1"), ("RUST_BACKTRACE", "0")]);
    let out = common::output_with_deadline(&mut command, Duration::from_secs(60));
    let all = text(&out);
    assert!(!out.status.success(), "accepted:\n{all}");
    assert!(
        all.contains("--nproc-per-node 2: this process is already rank 0 of 1"),
        "{all}"
    );
    assert!(!all.contains("training cnn"), "it trained:\n{all}");
}

/// In an sbatch script (the batch step of a job of 2 tasks: SLURM_PROCID 0, SLURM_NTASKS 2 and
/// no step number, as Slurm 22.05 sets them there) no rank exists yet: the trainer starts its 2
/// ranks, as mp.spawn would. Inside a step of 2 tasks (srun -n 2: SLURM_STEP_ID 0) the same flag
/// is refused.
#[test]
fn nproc_per_node_works_in_an_sbatch_script_and_not_in_a_step() {
    let batch = [
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_JOB_NODELIST", "localhost"),
        ("SLURM_NODEID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ];
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command
        .args(["--nproc-per-node", "2", "--epochs", "1", "--max-steps", "3"])
        .args(["--threads", "1", "--test-samples", "200", "--json"])
        .arg("--data-dir")
        .arg(mnist::real_mnist());
    common::clear_launcher_env(&mut command);
    command
        .env_remove("SLURM_STEP_ID")
        .env_remove("SLURM_STEPID")
        .envs(batch);
    let out = common::output_with_deadline(&mut command, DEADLINE);
    let all = text(&out);
    assert!(out.status.success(), "run failed:\n{all}");
    assert!(
        all.contains("[rank 0] training cnn: world 2 (launcher: spawn;"),
        "{all}"
    );
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command.args(["--nproc-per-node", "2", "--max-steps", "1"]);
    common::clear_launcher_env(&mut command);
    command.envs(batch).envs([
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "1"),
        ("SLURM_LOCALID", "1"),
        ("RUST_BACKTRACE", "0"),
    ]);
    let out = common::output_with_deadline(&mut command, Duration::from_secs(60));
    let all = text(&out);
    assert!(!out.status.success(), "accepted:\n{all}");
    assert!(
        all.contains("--nproc-per-node 2: this process is already rank 1 of 2 (started by slurm)"),
        "{all}"
    );
}
