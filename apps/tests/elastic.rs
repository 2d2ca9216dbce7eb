//! Elastic training with real processes: three `ddprun --nnodes 2:3` agents on this host, one
//! rank each (node ranks 0 to 2, node 0 hosting the store on a free port), training MNIST.
//!
//! - kill -9 of one rank mid-epoch: the survivors notice the death from the closed
//!   connections, not from a timeout (the peer timeout is set to a minute, and their next step
//!   must come well before it), at world 2: the re-form after a death admits nobody, even when
//!   the restarted rank's join request was already in the store; no step is
//!   committed twice, each sample of the epoch is trained once; the killed
//!   rank's agent restarts it, it rejoins healed from a live peer, and the world is back at 3
//!   with every rank holding the same weights; the final accuracy is at least the plain
//!   run's - 0.5 pt. The same with ZeRO stage 2.
//! - The same membership schedule (a rank leaves after a given step, a new agent's rank joins
//!   at a given step) gives bit-identical weights; another schedule gives other weights.
//! - A process started with another `--lr`, then another `--bucket-cap-mb`, than the job's is
//!   refused at join, naming the setting and both values, and the job goes on at 2 ranks.
//! - The three workers killed together: the restarted ranks found a new round, which resumes
//!   from the job's checkpoint; the job finishes, no sample after the checkpoint's position
//!   is trained twice, every agent exits 0.
//!
//! Every process runs under a deadline (`Guarded`): no test can hang.

use std::process::Command;
use std::time::{Duration, Instant};

mod agents;
mod common;
mod mnist;
use agents::{check_whole_epoch, free_port, json_after, now_ms, number_after, trainer_of, Agent};
use common::workspace_bin;
use serde_json::Value;

/// The longest one agent may run.
const DEADLINE: Duration = Duration::from_secs(300);

/// `DDP_PEER_TIMEOUT` (seconds) of the kill tests' ranks.
const PEER_TIMEOUT_S: &str = "60";

/// One test of this file at a time: each runs three agents, and three more on two cores would
/// slow every step enough to make the runs long.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`ONE_AT_A_TIME`] (a test that panicked while holding it poisons it; the next goes on).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The trainer's arguments shared by the plain and the elastic runs.
fn trainer_args(samples: usize, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--epochs",
        "1",
        "--threads",
        "1",
        "--json",
        "--log-interval",
        "1",
        "--test-samples",
        "10000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--train-samples".into(), samples.to_string()]);
    args.extend([
        "--data-dir".into(),
        mnist::real_mnist().display().to_string(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Starts node `node`'s agent of a `2:3` job at `port`, allowed `restarts` restarts.
fn agent(node: usize, port: u16, restarts: usize, env: &[(&str, &str)], args: &[String]) -> Agent {
    let mut command = Command::new(workspace_bin("ddprun"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--grace-period", "1", "--nnodes", "2:3", "--node-rank"])
        .arg(node.to_string())
        .args(["--master-addr", "127.0.0.1", "--master-port"])
        .arg(port.to_string())
        .args(["--max-restarts", &restarts.to_string(), "--"])
        .arg(workspace_bin("train-mnist"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn");
    Agent::start(&mut command, DEADLINE)
}

/// The plain 3-rank run's accuracy (`ddprun --nproc-per-node 3`, the same settings).
fn plain_accuracy(args: &[String]) -> f64 {
    let mut command = Command::new(workspace_bin("ddprun"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--nproc-per-node", "3", "--"])
        .arg(workspace_bin("train-mnist"))
        .args(args);
    let out = common::output_with_deadline(&mut command, DEADLINE);
    let text = common::text(&out);
    assert!(out.status.success(), "{text}");
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    json_after(&lines, "DDP_SUMMARY ")["test_accuracy"]
        .as_f64()
        .unwrap()
}

/// Three agents; slot 1's rank is killed mid-epoch; see the module documentation.
fn kill_and_rejoin(extra: &[&str]) {
    let _alone = one_at_a_time();
    let samples = 15_000;
    let args = trainer_args(samples, extra);
    let plain = plain_accuracy(&args);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    // A minute: a survivor that noticed the kill only by its peer timeout would come too late.
    let env = [("DDP_PEER_TIMEOUT", PEER_TIMEOUT_S)];
    let mut agents: Vec<Agent> = (0..3).map(|n| agent(n, port, 1, &env, &args)).collect();
    agents[0].wait_for("step 20 (", deadline);
    let victim = trainer_of(agents[1].child.id());
    let killed_at = now_ms();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let mut next_steps = Vec::new();
    for n in [0, 2] {
        let gen2 = agents[n].wait_for("elastic: generation 2", deadline);
        // A re-form after a death admits no joiner while the survivors keep the minimum,
        // even when the restarted rank asked before it was decided: it waits one step.
        assert!(
            gen2.contains(" of 2 "),
            "node {n}: generation 2 is not the survivors' world of 2: {gen2}"
        );
        let line = agents[n].wait_for("elastic: step ", deadline);
        next_steps.push(number_after(&line, " at ").saturating_sub(killed_at));
    }
    // How fast is a figure of `cargo xtask bench-elastic`; here only: not by a timeout.
    let timeout_ms: u128 = PEER_TIMEOUT_S.parse::<u128>().unwrap() * 1000;
    assert!(
        next_steps.iter().all(|&ms| ms < timeout_ms / 2),
        "the survivors' next steps came {next_steps:?} ms after the kill: not before half \
         the peer timeout ({PEER_TIMEOUT_S} s), so the death was not noticed from the closed \
         connections"
    );
    let finished: Vec<(bool, Vec<String>)> = agents.iter_mut().map(Agent::finish).collect();
    for (n, (ok, lines)) in finished.iter().enumerate() {
        assert!(ok, "node {n} failed:\n{}", lines.join("\n"));
    }
    let node1 = finished[1].1.join("\n");
    assert!(node1.contains("restarting it alone"), "{node1}");
    let summaries: Vec<Value> = finished
        .iter()
        .map(|(_, lines)| json_after(lines, "DDP_ELASTIC_SUMMARY "))
        .collect();
    for n in [0, 2] {
        check_whole_epoch(&summaries[n], samples as u64, &format!("node {n}"));
        assert!(
            summaries[n]["steps_dropped"].as_u64().unwrap() <= 1,
            "{}",
            summaries[n]
        );
    }
    assert_eq!(summaries[1]["healed_at_start"], true, "{}", summaries[1]);
    assert_eq!(summaries[1]["steps_repeated"], 0, "{}", summaries[1]);
    let hashes: Vec<&Value> = summaries
        .iter()
        .map(|s| &s["summary"]["params_hash"])
        .collect();
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "replicas differ: {hashes:?}"
    );
    for s in &summaries {
        assert_eq!(
            s["summary"]["world_size"], 3,
            "the world is not back at 3: {s}"
        );
        // The communication of every generation's wrapper is counted (it was 0).
        let comm = &s["summary"];
        assert!(comm["comm_seconds"].as_f64().unwrap() > 0.0, "{s}");
    }
    // DDP: at least one bucket all-reduced per step a survivor took.
    if !extra.contains(&"--zero-stage") {
        let (steps, buckets) = (
            &summaries[0]["summary"]["steps"],
            &summaries[0]["summary"]["buckets"],
        );
        assert!(
            buckets.as_u64().unwrap() >= steps.as_u64().unwrap(),
            "{}",
            summaries[0]
        );
    }
    let accuracy = summaries[0]["summary"]["test_accuracy"].as_f64().unwrap();
    assert!(
        accuracy >= plain - 0.005,
        "elastic run {accuracy} against the plain run's {plain}"
    );
}

#[test]
fn a_killed_rank_rejoins_and_the_survivors_never_repeat_a_step() {
    kill_and_rejoin(&[]);
}

#[test]
fn a_killed_rank_rejoins_with_zero_stage_2() {
    kill_and_rejoin(&["--zero-stage", "2"]);
}

/// One run of a fixed membership schedule: slot 2 kills itself after step 6 (its agent may
/// not restart it), a new agent for node 2 starts once the survivors re-formed, and its rank
/// is admitted after step `grow_at`. Returns the final weights' hash and each final rank's
/// membership changes.
fn scheduled_run(grow_at: u64) -> (String, Vec<Value>) {
    let args = trainer_args(7_000, &[]);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let grow = grow_at.to_string();
    let env = [
        ("DDP_TEST_KILL_AT_STEP", "6"),
        ("DDP_TEST_KILL_RANK", "2"),
        ("DDP_TEST_GROW_AT_STEP", grow.as_str()),
    ];
    let mut agents: Vec<Agent> = (0..3).map(|n| agent(n, port, 0, &env, &args)).collect();
    agents[0].wait_for("elastic: generation 2", deadline);
    let (ok, lines) = agents[2].finish();
    assert!(!ok, "node 2's rank killed itself: {}", lines.join("\n"));
    agents[2] = agent(2, port, 0, &env, &args);
    let finished: Vec<(bool, Vec<String>)> = agents.iter_mut().map(Agent::finish).collect();
    let mut hashes = Vec::new();
    let mut changes = Vec::new();
    for (n, (ok, lines)) in finished.iter().enumerate() {
        assert!(ok, "node {n} failed:\n{}", lines.join("\n"));
        let s = json_after(lines, "DDP_ELASTIC_SUMMARY ");
        hashes.push(s["summary"]["params_hash"].as_str().unwrap().to_string());
        changes.push(s["changes"].clone());
    }
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "replicas differ: {hashes:?}"
    );
    (hashes[0].clone(), changes)
}

#[test]
fn the_same_membership_schedule_gives_the_same_bits() {
    let _alone = one_at_a_time();
    let (first, changes) = scheduled_run(30);
    // The schedule happened as planned: world 2 after step 6 (step 7 dropped: slot 2 died
    // before it), world 3 again after step 30.
    let survivor = changes[0].as_array().unwrap();
    assert_eq!(survivor.len(), 2, "{changes:?}");
    assert_eq!(
        (&survivor[0]["after_step"], &survivor[0]["world"]),
        (&Value::from(6), &Value::from(2)),
        "{changes:?}"
    );
    assert_eq!(
        (&survivor[1]["after_step"], &survivor[1]["world"]),
        (&Value::from(30), &Value::from(3)),
        "{changes:?}"
    );
    let (second, _) = scheduled_run(30);
    assert_eq!(first, second, "the same schedule gave other weights");
    let (other, _) = scheduled_run(34);
    assert_ne!(first, other, "another schedule gave the same weights");
}

/// A node started with another `--lr` (then another `--bucket-cap-mb`) than the running job's
/// is refused before it joins, its error naming the setting and both values; the job it
/// knocked at never re-forms and finishes its epoch at 2 ranks with equal weights.
#[test]
fn a_joiner_with_another_lr_or_bucket_size_is_refused_and_the_job_goes_on() {
    let _alone = one_at_a_time();
    let samples = 30_000;
    let job = ["--lr", "0.001", "--bucket-cap-mb", "25"];
    let args = trainer_args(samples, &job);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let mut agents: Vec<Agent> = (0..2).map(|n| agent(n, port, 0, &[], &args)).collect();
    agents[0].wait_for("step 5 (", deadline);
    for (flags, said) in [
        (
            ["--lr", "0.002", "--bucket-cap-mb", "25"],
            "lr is 0.002 (not scaled) in this process, the job runs with 0.001 (not scaled)",
        ),
        (
            ["--lr", "0.001", "--bucket-cap-mb", "4"],
            "buckets is 4 MiB in this process, the job runs with 25 MiB",
        ),
    ] {
        let mut stranger = agent(2, port, 0, &[], &trainer_args(samples, &flags));
        let (ok, lines) = stranger.finish();
        let all = lines.join("\n");
        assert!(!ok, "{flags:?} was let in:\n{all}");
        assert!(
            all.contains("refused") && all.contains(said),
            "{flags:?}:\n{all}"
        );
    }
    let finished: Vec<(bool, Vec<String>)> = agents.iter_mut().map(Agent::finish).collect();
    let mut hashes = Vec::new();
    for (n, (ok, lines)) in finished.iter().enumerate() {
        let all = lines.join("\n");
        assert!(ok, "node {n} failed:\n{all}");
        assert!(
            !all.contains("elastic: generation 2"),
            "node {n} re-formed:\n{all}"
        );
        let s = json_after(lines, "DDP_ELASTIC_SUMMARY ");
        check_whole_epoch(&s, samples as u64, &format!("node {n}"));
        assert_eq!(s["summary"]["world_size"], 2, "{s}");
        hashes.push(s["summary"]["params_hash"].clone());
    }
    assert_eq!(hashes[0], hashes[1], "replicas differ");
}

/// Two agents train; a third agent's rank asks to join and kills itself in the middle of its
/// heal (`DDP_TEST_HEAL_DIE=weights`: its group formed, rank 0 sent it the progress, the
/// parameter ids and the optimizer record, the survivors are about to broadcast the weights),
/// and its agent may not restart it. The survivors keep their committed state across the
/// failed heal, re-form again at 2 without it, and finish the epoch: every sample trained
/// once, no step repeated, equal weights; their next step comes well before the peer timeout.
/// Returns the milliseconds from the joiner's death to each survivor's next step.
fn joiner_dies_during_its_heal(extra: &[&str]) -> Vec<u128> {
    let _alone = one_at_a_time();
    let samples = 8_000;
    let args = trainer_args(samples, extra);
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let env = [("DDP_PEER_TIMEOUT", PEER_TIMEOUT_S)];
    let mut agents: Vec<Agent> = (0..2).map(|n| agent(n, port, 0, &env, &args)).collect();
    agents[0].wait_for("step 5 (", deadline);
    let die = [
        ("DDP_PEER_TIMEOUT", PEER_TIMEOUT_S),
        ("DDP_TEST_HEAL_DIE", "weights"),
    ];
    let mut joiner = agent(2, port, 0, &die, &args);
    let line = joiner.wait_for("kills this joiner (weights) at ", deadline);
    let died_at = number_after(&line, " at ");
    let (ok, lines) = joiner.finish();
    assert!(!ok, "the joiner killed itself:\n{}", lines.join("\n"));
    let mut next_steps = Vec::new();
    for (n, a) in agents.iter_mut().enumerate() {
        let change = a.wait_for("elastic: generation ", deadline);
        assert!(
            change.contains(" of 2 ") && change.contains("slot 2"),
            "node {n}: the change after the failed heal is not back at 2 without slot 2: {change}"
        );
        let line = a.wait_for("elastic: step ", deadline);
        next_steps.push(number_after(&line, " at ").saturating_sub(died_at));
    }
    let timeout_ms: u128 = PEER_TIMEOUT_S.parse::<u128>().unwrap() * 1000;
    assert!(
        next_steps.iter().all(|&ms| ms < timeout_ms / 2),
        "the survivors' next steps came {next_steps:?} ms after the joiner's death"
    );
    let finished: Vec<(bool, Vec<String>)> = agents.iter_mut().map(Agent::finish).collect();
    let mut hashes = Vec::new();
    for (n, (ok, lines)) in finished.iter().enumerate() {
        let all = lines.join("\n");
        assert!(ok, "node {n} failed:\n{all}");
        // The heal failed on this survivor (not a step after it): it kept its state.
        assert!(
            all.contains("keeps its committed state"),
            "node {n}: no failed heal:\n{all}"
        );
        let s = json_after(lines, "DDP_ELASTIC_SUMMARY ");
        check_whole_epoch(&s, samples as u64, &format!("node {n}"));
        assert_eq!(s["steps_dropped"], 0, "node {n}: {s}");
        assert_eq!(s["summary"]["world_size"], 2, "node {n}: {s}");
        hashes.push(s["summary"]["params_hash"].clone());
    }
    assert_eq!(hashes[0], hashes[1], "replicas differ");
    eprintln!("joiner killed during its heal: survivors' next steps {next_steps:?} ms after it");
    next_steps
}

#[test]
fn a_joiner_killed_during_its_heal_leaves_the_survivors_training() {
    joiner_dies_during_its_heal(&[]);
}

#[test]
fn a_joiner_killed_during_its_heal_with_zero_stage_2() {
    joiner_dies_during_its_heal(&["--zero-stage", "2"]);
}

/// Three agents (`--max-restarts 1`) train `--model mlp --batch-size 16` with a checkpoint
/// every 20 steps; after step 50 the three workers are killed together (an OOM, a node-wide
/// fault, a bad batch that ends every rank). Each agent restarts its rank; the restarted ranks
/// find nobody of the last generation left to admit them and found a new round, which resumes
/// from the job's last checkpoint and says so. The job trains again well before the peer
/// timeout (a minute here), finishes the epoch, and every agent exits 0 with one restart used;
/// after the checkpoint's position no step is committed twice and every sample is trained
/// exactly once; the replicas end equal. Before, each restarted rank waited its connect
/// deadline for a generation that nobody was left to decide, then failed.
#[test]
fn every_worker_killed_together_the_job_resumes_from_its_checkpoint() {
    let _alone = one_at_a_time();
    let samples: u64 = 15_000;
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().display().to_string();
    let flags = [
        "--model",
        "mlp",
        "--batch-size",
        "16",
        "--checkpoint-dir",
        &ck,
    ];
    let args = trainer_args(
        samples as usize,
        &[&flags[..], &["--checkpoint-every", "20"]].concat(),
    );
    let port = free_port();
    let deadline = Instant::now() + DEADLINE;
    let env = [
        ("DDP_PEER_TIMEOUT", PEER_TIMEOUT_S),
        ("DDP_CONNECT_TIMEOUT", "60"),
    ];
    let mut agents: Vec<Agent> = (0..3).map(|n| agent(n, port, 1, &env, &args)).collect();
    agents[0].wait_for("step 50 (", deadline);
    let trainers: Vec<u32> = agents.iter().map(|a| trainer_of(a.child.id())).collect();
    let killed_at = now_ms();
    for pid in trainers {
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    }
    let mut next_steps = Vec::new();
    for a in agents.iter_mut() {
        let line = a.wait_for("elastic: step ", deadline);
        next_steps.push(number_after(&line, " at ").saturating_sub(killed_at));
    }
    let finished: Vec<(bool, Vec<String>)> = agents.iter_mut().map(Agent::finish).collect();
    for (n, (ok, lines)) in finished.iter().enumerate() {
        let all = lines.join("\n");
        assert!(ok, "node {n} failed:\n{all}");
        for said in ["restarting it alone", "1 of 1 restarts used"] {
            assert!(all.contains(said), "node {n}: no {said:?}:\n{all}");
        }
    }
    let round = finished
        .iter()
        .flat_map(|(_, lines)| lines.iter())
        .find(|l| l.contains(" is a new round "))
        .unwrap_or_else(|| panic!("no new round: {finished:?}"));
    assert!(
        round.contains("resumes from the job's last checkpoint"),
        "{round}"
    );
    let step: u64 = round
        .rsplit_once("(step ")
        .and_then(|(_, s)| s.trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint step in {round:?}"));
    assert!(step >= 40 && step.is_multiple_of(20), "{round}");
    // Every step before the kill was at world 3 and batch 16: the checkpoint's position.
    let position = step * 48;
    let summaries: Vec<Value> = finished
        .iter()
        .map(|(_, lines)| json_after(lines, "DDP_ELASTIC_SUMMARY "))
        .collect();
    for (n, s) in summaries.iter().enumerate() {
        assert_eq!(s["steps_repeated"], 0, "node {n}: {s}");
        assert_eq!(s["steps_in_order"], true, "node {n}: {s}");
        if s["new_round"] == true {
            assert_eq!(s["first_step"], step + 1, "node {n}: {s}");
            let epoch = &s["epochs"][0];
            assert_eq!(
                epoch["max_count"], 1,
                "node {n}: a sample trained twice: {s}"
            );
            assert_eq!(epoch["trained"], samples - position, "node {n}: {s}");
        } else {
            // Too late for the new round's last call: healed into it at a step boundary.
            assert_eq!(s["healed_at_start"], true, "node {n}: {s}");
        }
        assert_eq!(s["summary"]["world_size"], 3, "node {n}: {s}");
    }
    assert_eq!(summaries[0]["new_round"], true, "{}", summaries[0]);
    let hashes: Vec<&Value> = summaries
        .iter()
        .map(|s| &s["summary"]["params_hash"])
        .collect();
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "replicas differ: {hashes:?}"
    );
    eprintln!(
        "every worker killed after step 50: the new round resumed from step {step}; each \
         restarted rank's first step {next_steps:?} ms after the kill"
    );
    let timeout_ms: u128 = PEER_TIMEOUT_S.parse::<u128>().unwrap() * 1000;
    assert!(
        next_steps.iter().all(|&ms| ms < timeout_ms / 2),
        "the first steps came {next_steps:?} ms after the kill: not before half the peer \
         timeout ({PEER_TIMEOUT_S} s)"
    );
}
