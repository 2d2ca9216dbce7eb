//! An elastic job survives the loss of the node that hosts its store (issue 61), with real
//! processes: `ddprun --nnodes MIN:MAX` agents on this host, one `train-mnist` rank each, node
//! 0's agent hosting the store on a free port, every other agent a standby store.
//!
//! - Node 0's agent and its rank killed together (`SIGKILL`) mid-epoch: the survivors move
//!   the store to node 1's standby and go on at world 2; their next step comes within a few
//!   seconds of the kill (printed in ms), every sample of the epoch is trained once, no step is
//!   repeated, the final replicas are identical, and both survivors' agents exit 0.
//! - A rank killed after the move and restarted alone by its agent is given the store where it
//!   is now, joins there, is healed, and finishes with the others' weights.
//! - The same as the first with four agents (`2:4`) and a second failure during the move: node
//!   1, whose standby the survivors move to, is killed as soon as a survivor says it moves
//!   there; the last two survivors move on to node 2's standby and finish the epoch at world 2.
//!
//! The ranks' records are sealed (`DDP_TOKEN`), in the standby as in the first store. Every
//! process runs under a deadline (`Guarded`): no test can hang.

use std::process::Command;
use std::time::{Duration, Instant};

mod agents;
mod common;
mod mnist;
use agents::{check_whole_epoch, free_port, json_after, number_after, trainer_of, Agent};
use common::workspace_bin;

/// The longest one agent may run.
const DEADLINE: Duration = Duration::from_secs(240);

/// `DDP_PEER_TIMEOUT` (seconds): long, so that a survivor that noticed a death only by its
/// peer timeout would come far too late.
const PEER_TIMEOUT_S: &str = "60";

/// The most milliseconds from the kill to the survivors' next step ("within a few seconds").
const NEXT_STEP_MS: u128 = 8_000;

/// One test of this file at a time: each runs three or four agents on a small machine.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The trainer's arguments: one epoch of `samples`, a log line per step.
fn trainer_args(samples: usize) -> Vec<String> {
    let mut args: Vec<String> = [
        "--epochs",
        "1",
        "--threads",
        "1",
        "--json",
        "--log-interval",
        "1",
        "--test-samples",
        "1000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--train-samples".into(), samples.to_string()]);
    args.extend([
        "--data-dir".into(),
        mnist::real_mnist().display().to_string(),
    ]);
    args
}

/// Starts node `node`'s agent of a `nnodes` (`MIN:MAX`) job at `port`, allowed `restarts`
/// restarts.
fn agent(node: usize, nnodes: &str, port: u16, restarts: usize, args: &[String]) -> Agent {
    let mut command = Command::new(workspace_bin("ddprun"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--grace-period", "1", "--nnodes", nnodes, "--node-rank"])
        .arg(node.to_string())
        .args(["--master-addr", "127.0.0.1", "--master-port"])
        .arg(port.to_string())
        .args(["--max-restarts", &restarts.to_string(), "--"])
        .arg(workspace_bin("train-mnist"))
        .args(args)
        .env("DDP_PEER_TIMEOUT", PEER_TIMEOUT_S)
        .env("DDP_TOKEN", "store-failover-test-secret")
        .env("RUST_LOG", "warn");
    Agent::start(&mut command, DEADLINE)
}

/// The survivors' agents `survivors` after the kill at `killed_at`: each one's next step at
/// world 2, in ms after the kill (each within [`NEXT_STEP_MS`]); then each exits 0 having
/// trained the whole epoch, with the same final weights, at world 2.
fn survivors_go_on(
    agents: &mut [Agent],
    survivors: &[usize],
    killed_at: u128,
    samples: usize,
    deadline: Instant,
) {
    let mut next_steps = Vec::new();
    for &n in survivors {
        let line = agents[n].wait_for("elastic: step ", deadline);
        assert!(line.contains("at world 2 "), "node {n}: {line}");
        next_steps.push(number_after(&line, " at ").saturating_sub(killed_at));
    }
    println!("store failover: the survivors' next steps came {next_steps:?} ms after the kill");
    assert!(
        next_steps.iter().all(|&ms| ms < NEXT_STEP_MS),
        "the survivors' next steps came {next_steps:?} ms after the kill (at most \
         {NEXT_STEP_MS} ms)"
    );
    let mut hashes = Vec::new();
    for &n in survivors {
        let (ok, lines) = agents[n].finish();
        let all = lines.join("\n");
        assert!(ok, "node {n} failed:\n{all}");
        assert!(all.contains("moved the store to node"), "node {n}:\n{all}");
        let s = json_after(&lines, "DDP_ELASTIC_SUMMARY ");
        check_whole_epoch(&s, samples as u64, &format!("node {n}"));
        assert_eq!(s["summary"]["world_size"], 2, "node {n}: {s}");
        hashes.push(s["summary"]["params_hash"].clone());
    }
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "replicas differ: {hashes:?}"
    );
}

#[test]
fn the_job_survives_the_loss_of_the_node_that_hosts_the_store() {
    let _alone = one_at_a_time();
    let samples = 4_000;
    let args = trainer_args(samples);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let mut agents: Vec<Agent> = (0..3).map(|n| agent(n, "2:3", port, 0, &args)).collect();
    agents[0].wait_for("step 8 (", deadline);
    let killed_at = agents[0].kill_node();
    survivors_go_on(&mut agents, &[1, 2], killed_at, samples, deadline);
    let node1 = agents[1].seen.join("\n");
    assert!(
        node1.contains("moved to this node's standby"),
        "node 1's agent did not take the store over:\n{node1}"
    );
}

#[test]
fn the_job_survives_a_second_failure_during_the_move() {
    let _alone = one_at_a_time();
    let samples = 3_000;
    let args = trainer_args(samples);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let mut agents: Vec<Agent> = (0..4).map(|n| agent(n, "2:4", port, 0, &args)).collect();
    agents[0].wait_for("step 6 (", deadline);
    let killed_at = agents[0].kill_node();
    agents[2].wait_for("moving to node 1's standby", deadline);
    agents[1].kill_node();
    survivors_go_on(&mut agents, &[2, 3], killed_at, samples, deadline);
    let node2 = agents[2].seen.join("\n");
    assert!(
        node2.contains("moved to this node's standby"),
        "node 2's agent did not take the store over:\n{node2}"
    );
}

/// Node 0 lost, then node 2's rank killed once the survivors went on (`1:3`: the job runs on
/// at world 1): its agent restarts it with the store's new address, and it joins the job in the
/// standby, is healed, and ends with the same weights as node 1's rank.
#[test]
fn a_rank_restarted_after_the_move_joins_the_moved_store() {
    let _alone = one_at_a_time();
    // Enough steps at world 1 for the restarted rank to start and be admitted before the end.
    let samples = 8_000;
    let args = trainer_args(samples);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| agent(n, "1:3", port, usize::from(n == 2), &args))
        .collect();
    agents[0].wait_for("step 6 (", deadline);
    agents[0].kill_node();
    agents[2].wait_for("elastic: step ", deadline);
    let victim = trainer_of(agents[2].child.id());
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let mut hashes = Vec::new();
    for n in [1, 2] {
        let (ok, lines) = agents[n].finish();
        let all = lines.join("\n");
        assert!(ok, "node {n} failed:\n{all}");
        let s = json_after(&lines, "DDP_ELASTIC_SUMMARY ");
        assert_eq!(s["steps_repeated"], 0, "node {n}: {s}");
        assert_eq!(s["summary"]["world_size"], 2, "node {n}: {s}");
        hashes.push(s["summary"]["params_hash"].clone());
        if n == 1 {
            check_whole_epoch(&s, samples as u64, "node 1");
        } else {
            assert!(all.contains("restarting it alone"), "{all}");
            assert_eq!(s["healed_at_start"], true, "node 2: {s}");
        }
    }
    assert_eq!(hashes[0], hashes[1], "replicas differ");
}
