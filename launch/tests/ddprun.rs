//! The `ddprun` launcher, run as a real process over `sh -c` ranks keyed on `$RANK`.
//!
//! Every run has a deadline (`DEADLINE`) after which the test kills ddprun and fails, so that a
//! launcher that hangs fails the suite instead of stalling it; every ddprun is held by a guard
//! that kills it when the test panics (its ranks die with it: `PR_SET_PDEATHSIG`), so a failed
//! test leaves no process behind.
//!
//! Timing bounds only tell "stopped" from "ran to the end": the ranks sleep 30 s, and the
//! bounds leave many seconds of margin for a loaded 2-core machine. Speed is for the benches.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::Duration;

#[path = "../../apps/tests/common/mod.rs"]
mod common;
use common::Guarded;

/// The longest any ddprun run in these tests may take.
const DEADLINE: Duration = Duration::from_secs(60);

/// A run that ends well before this stopped its ranks rather than letting them finish their
/// 30 s sleep.
const STOPPED_EARLY: Duration = Duration::from_secs(20);

/// A ddprun command with a short grace period and no inherited torchrun variables.
fn ddprun(nproc: usize, script: &str) -> Command {
    ddprun_with(&[], nproc, script)
}

/// [`ddprun`] with more of ddprun's options.
fn ddprun_with(options: &[&str], nproc: usize, script: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--grace-period",
        "0.5",
        "--nproc-per-node",
        &nproc.to_string(),
    ]);
    command.args(options);
    command.args(["--", "sh", "-c", script]);
    common::clear_launcher_env(&mut command);
    command
}

/// What a finished ddprun run left behind.
struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// A ddprun process whose output is being collected.
struct Running {
    child: Guarded,
    stdout: JoinHandle<String>,
    stderr: JoinHandle<String>,
}

fn collect(mut source: impl Read + Send + 'static) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        source
            .read_to_string(&mut text)
            .expect("ddprun output is UTF-8");
        text
    })
}

fn start(mut command: Command) -> Running {
    let mut child = Guarded::spawn(
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        DEADLINE,
    );
    let stdout = collect(child.stdout.take().unwrap());
    let stderr = collect(child.stderr.take().unwrap());
    Running {
        child,
        stdout,
        stderr,
    }
}

impl Running {
    /// Waits for ddprun to exit, killing it and failing the test past [`DEADLINE`].
    fn finish(self) -> Finished {
        let status = self.child.wait();
        let elapsed = self.child.elapsed();
        Finished {
            status,
            stdout: self.stdout.join().unwrap(),
            stderr: self.stderr.join().unwrap(),
            elapsed,
        }
    }
}

fn run(command: Command) -> Finished {
    start(command).finish()
}

/// A shell loop that waits (at most 10 s) until `path` exists and is not empty.
fn wait_for_file(path: &std::path::Path) -> String {
    format!(
        "i=0; while [ ! -s {0} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i + 1)); done",
        path.display()
    )
}

/// The last non-empty lines of `text`, at most `n`, joined.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The root-cause box: from ddprun's last "Root cause" line to the end of stderr, which must be
/// its closing rule (the box is the last thing printed).
fn root_cause(stderr: &str) -> String {
    let start = stderr
        .rfind("ddprun: job failed. Root cause:")
        .unwrap_or_else(|| panic!("no root-cause box in stderr:\n{stderr}"));
    let the_box = stderr[start..].trim_end();
    assert!(
        the_box.ends_with(&"=".repeat(78)),
        "the root-cause box is not the last thing on stderr:\n{stderr}"
    );
    the_box.to_string()
}

#[test]
fn failing_rank_stops_the_others_and_is_named_last() {
    let done = run(ddprun(
        3,
        r#"if [ "$RANK" = 1 ]; then echo "rank one fails"; exit 3; fi; sleep 30; echo "not stopped""#,
    ));
    assert_eq!(
        done.status.code(),
        Some(3),
        "ddprun exits with the failed rank's code\n{}",
        done.stderr
    );
    assert!(
        done.elapsed < STOPPED_EARLY,
        "the sleeping ranks were stopped promptly: {:?}",
        done.elapsed
    );
    assert!(
        done.stdout.contains("[rank 1] rank one fails"),
        "stdout: {}",
        done.stdout
    );
    assert!(
        !done.stdout.contains("not stopped"),
        "stdout: {}",
        done.stdout
    );
    // The root cause is the last thing printed, names rank 1 and code 3, and quotes the rank's
    // last output lines (it wrote no error file).
    let last = root_cause(&done.stderr);
    assert!(
        last.contains("rank 1 (local rank 1) exited with code 3"),
        "stderr:\n{}",
        done.stderr
    );
    assert!(
        last.contains("its error:\n    rank one fails"),
        "the box quotes rank 1's output:\n{last}"
    );
    // The stopped ranks are reported as stopped, not as the cause.
    for rank in [0, 2] {
        assert!(
            done.stderr
                .contains(&format!("rank {rank} stopped: killed by SIGTERM")),
            "rank {rank} was stopped by SIGTERM:\n{}",
            done.stderr
        );
    }
}

#[test]
fn the_root_cause_quotes_the_error_file_the_rank_wrote() {
    // As torchelastic's @record does: the rank writes its error as JSON to
    // $TORCHELASTIC_ERROR_FILE before it exits; its other output is noise the box must not quote.
    let done = run(ddprun(
        2,
        r#"if [ "$RANK" = 1 ]; then
             printf '{"message": {"message": "ValueError: shard 7 of /data/train is truncated", "extraInfo": {"py_callstack": "", "timestamp": "0"}}}' > "$TORCHELASTIC_ERROR_FILE"
             echo "error: a misleading line"; exit 4
           fi; sleep 30"#,
    ));
    assert_eq!(done.status.code(), Some(4), "stderr:\n{}", done.stderr);
    let last = root_cause(&done.stderr);
    assert!(
        last.contains("rank 1 (local rank 1) exited with code 4"),
        "stderr:\n{}",
        done.stderr
    );
    assert!(
        last.contains("its error:\n    ValueError: shard 7 of /data/train is truncated"),
        "the box quotes the error file:\n{last}"
    );
    assert!(!last.contains("misleading"), "{last}");
}

#[test]
fn rank_killed_by_sigkill_is_reported_as_such() {
    let done = run(ddprun(
        2,
        r#"if [ "$RANK" = 1 ]; then kill -9 $$; fi; sleep 30"#,
    ));
    assert_eq!(
        done.status.code(),
        Some(128 + 9),
        "stderr:\n{}",
        done.stderr
    );
    let last = root_cause(&done.stderr);
    assert!(
        last.contains("rank 1 (local rank 1) killed by SIGKILL, possibly out of memory"),
        "stderr:\n{}",
        done.stderr
    );
    assert!(done.elapsed < STOPPED_EARLY, "{:?}", done.elapsed);
}

#[test]
fn all_ranks_exiting_zero_gives_zero() {
    let done = run(ddprun(4, r#"sleep 0.$RANK; echo "rank $RANK done""#));
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    for rank in 0..4 {
        assert!(
            done.stdout
                .contains(&format!("[rank {rank}] rank {rank} done\n")),
            "{}",
            done.stdout
        );
    }
    assert!(!done.stderr.contains("Root cause"), "{}", done.stderr);
}

/// `NAME=value` pairs that each rank printed, keyed by the rank of the prefix.
fn printed_env(stdout: &str, nproc: usize) -> Vec<Vec<(String, String)>> {
    let mut per_rank = vec![Vec::new(); nproc];
    for line in stdout.lines() {
        let rest = line.strip_prefix("[rank ").expect("prefixed line");
        let (rank, vars) = rest.split_once("] ").unwrap();
        let rank: usize = rank.parse().unwrap();
        for pair in vars.split_whitespace() {
            let (name, value) = pair.split_once('=').unwrap();
            per_rank[rank % nproc].push((name.to_string(), value.to_string()));
        }
    }
    per_rank
}

const PRINT_ENV: &str = "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK \
    LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT \
    GROUP_RANK=$GROUP_RANK DDP_JOB_ID=${DDP_JOB_ID:-none} DDP_LAUNCHER=$DDP_LAUNCHER";

fn value<'a>(vars: &'a [(String, String)], name: &str) -> &'a str {
    &vars
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} printed"))
        .1
}

/// A torchrun command line works as it is: `--standalone`, underscore spellings, `=` values
/// and no `--` before the command.
#[test]
fn torchrun_spellings_are_accepted() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--standalone",
        "--nproc_per_node=2",
        "--max_restarts=0",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    common::clear_launcher_env(&mut command);
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let per_rank = printed_env(&done.stdout, 2);
    for (rank, vars) in per_rank.iter().enumerate() {
        assert_eq!(value(vars, "RANK"), rank.to_string());
        assert_eq!(value(vars, "WORLD_SIZE"), "2");
    }

    // --standalone is one node: beside --nnodes it is refused, naming both.
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--standalone", "--nnodes", "2", "--", "true"]);
    let done = run(command);
    assert_eq!(done.status.code(), Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("--standalone") && done.stderr.contains("--nnodes"),
        "{}",
        done.stderr
    );
}

/// torchrun's `--rdzv-conf` (and Kubeflow's `PET_RDZV_CONF`): `last_call_timeout` and
/// `join_timeout` reach the ranks as DDP_ELASTIC_LAST_CALL and DDP_CONNECT_TIMEOUT, torchrun's
/// other keys are accepted and said to have no effect, and a key torchrun does not know is
/// refused, naming it.
#[test]
fn rdzv_conf_reaches_the_ranks() {
    let print = "echo RANK=$RANK LAST_CALL=${DDP_ELASTIC_LAST_CALL:-none} \
                 CONNECT=${DDP_CONNECT_TIMEOUT:-none}";
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(["--standalone", "--nproc_per_node=1"]);
    command.args(["--rdzv_conf=last_call_timeout=7,join_timeout=42.5,read_timeout=60"]);
    command.args(["sh", "-c", print]);
    command
        .env_remove("DDP_ELASTIC_LAST_CALL")
        .env_remove("DDP_CONNECT_TIMEOUT");
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let vars = &printed_env(&done.stdout, 1)[0];
    assert_eq!(
        (value(vars, "LAST_CALL"), value(vars, "CONNECT")),
        ("7", "42.5")
    );
    assert!(
        done.stderr.contains("read_timeout have no effect"),
        "{}",
        done.stderr
    );
    // The same from the pod's variable; without either, the ranks' own defaults.
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(["--", "sh", "-c", print]);
    command.env("PET_RDZV_CONF", "last_call_timeout=3");
    command
        .env_remove("DDP_ELASTIC_LAST_CALL")
        .env_remove("DDP_CONNECT_TIMEOUT");
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let vars = &printed_env(&done.stdout, 1)[0];
    assert_eq!(
        (value(vars, "LAST_CALL"), value(vars, "CONNECT")),
        ("3", "none")
    );
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(["--rdzv-conf", "last_cal_timeout=7", "--", "true"]);
    let done = run(command);
    assert_eq!(done.status.code(), Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("\"last_cal_timeout\""),
        "{}",
        done.stderr
    );
}

#[test]
fn every_rank_gets_its_variables_on_one_node() {
    let done = run(ddprun(3, PRINT_ENV));
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let per_rank = printed_env(&done.stdout, 3);
    let port = value(&per_rank[0], "MASTER_PORT");
    let job = value(&per_rank[0], "DDP_JOB_ID");
    assert!(
        port.parse::<u16>().is_ok_and(|p| p > 0),
        "MASTER_PORT={port}"
    );
    assert_ne!(job, "none", "a single-node job gets a DDP_JOB_ID");
    for (rank, vars) in per_rank.iter().enumerate() {
        let expected = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "3".to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", "3".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
            ("GROUP_RANK", "0".to_string()),
            ("DDP_JOB_ID", job.to_string()),
            // The trainers' first line says `launcher: ddprun` (a real torchrun sets none).
            ("DDP_LAUNCHER", "ddprun".to_string()),
        ];
        for (name, want) in expected {
            assert_eq!(value(vars, name), want, "rank {rank}: {name}");
        }
    }
}

#[test]
fn second_node_ranks_are_offset_by_node_rank() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--nproc-per-node", "2", "--nnodes", "3", "--node-rank", "1"]);
    command.args(["--master-addr", "10.1.2.3", "--master-port", "29511", "--"]);
    command
        .args(["sh", "-c", PRINT_ENV])
        .env_remove("DDP_JOB_ID");
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let per_rank = printed_env(&done.stdout, 2);
    for (local, vars) in per_rank.iter().enumerate() {
        assert_eq!(value(vars, "RANK"), (2 + local).to_string());
        assert_eq!(value(vars, "LOCAL_RANK"), local.to_string());
        assert_eq!(value(vars, "WORLD_SIZE"), "6");
        assert_eq!(value(vars, "LOCAL_WORLD_SIZE"), "2");
        assert_eq!(value(vars, "GROUP_RANK"), "1");
        assert_eq!(value(vars, "MASTER_ADDR"), "10.1.2.3");
        assert_eq!(value(vars, "MASTER_PORT"), "29511");
        // Every node would generate a different id, so none is made up on several nodes.
        assert_eq!(value(vars, "DDP_JOB_ID"), "none");
    }
}

/// In a Kubeflow PyTorchJob pod, ddprun takes torchrun's options from the PET_* variables, as
/// torchrun does; a flag given wins over its variable, and an unusable value is an error naming
/// the variable.
#[test]
fn pet_variables_are_the_defaults_of_the_options() {
    let pod = |command: &mut Command| {
        common::clear_launcher_env(command);
        command.envs([
            ("PET_NNODES", "3"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "1"),
            ("PET_MASTER_ADDR", "10.1.2.3"),
            ("PET_MASTER_PORT", "29512"),
            // What the operator also sets for the pod (its index and the job's size): the
            // ranks get ddprun's values instead.
            ("RANK", "1"),
            ("WORLD_SIZE", "6"),
        ]);
    };
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--", "sh", "-c", PRINT_ENV]);
    pod(&mut command);
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let per_rank = printed_env(&done.stdout, 2);
    for (local, vars) in per_rank.iter().enumerate() {
        assert_eq!(value(vars, "RANK"), (2 + local).to_string());
        assert_eq!(value(vars, "WORLD_SIZE"), "6");
        assert_eq!(value(vars, "LOCAL_WORLD_SIZE"), "2");
        assert_eq!(value(vars, "GROUP_RANK"), "1");
        assert_eq!(value(vars, "MASTER_ADDR"), "10.1.2.3");
        assert_eq!(value(vars, "MASTER_PORT"), "29512");
    }
    // A flag wins over its variable.
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--nproc-per-node", "1", "--", "sh", "-c", PRINT_ENV]);
    pod(&mut command);
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let vars = &printed_env(&done.stdout, 1)[0];
    assert_eq!((value(vars, "RANK"), value(vars, "WORLD_SIZE")), ("1", "3"));
    // torchrun's elastic range: an elastic job of up to 4 nodes, at least 1 (in ranks: 2 to
    // 8), which the ranks learn from DDP_ELASTIC; WORLD_SIZE is the most ranks.
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--",
        "sh",
        "-c",
        "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE DDP_ELASTIC=$DDP_ELASTIC",
    ]);
    pod(&mut command);
    command.env("PET_NNODES", "1:4");
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    let vars = &printed_env(&done.stdout, 2)[1];
    assert_eq!(
        (
            value(vars, "RANK"),
            value(vars, "WORLD_SIZE"),
            value(vars, "DDP_ELASTIC")
        ),
        ("3", "8", "2:8"),
        "{}",
        done.stdout
    );
    // A range that is none: refused, naming the variable.
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--", "true"]);
    pod(&mut command);
    command.env("PET_NNODES", "4:1");
    let done = run(command);
    assert_eq!(done.status.code(), Some(2), "{}", done.stderr);
    assert!(
        done.stderr.contains("PET_NNODES=\"4:1\""),
        "{}",
        done.stderr
    );
}

/// The ranks a ddprun started, from their `[rank R]` lines of `PRINT_ENV`.
fn ranks_started(stdout: &str) -> usize {
    stdout.lines().filter(|l| l.contains("] RANK=")).count()
}

/// The GPUs the NVIDIA driver shows on this host, counted here apart from ddprun: its device
/// nodes `/dev/nvidia<N>`, else its list `/proc/driver/nvidia/gpus`.
fn gpus_here() -> usize {
    let count = |dir: &str, node: bool| {
        std::fs::read_dir(dir).map_or(0, |d| {
            d.flatten()
                .filter(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    !node
                        || name
                            .strip_prefix("nvidia")
                            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
                })
                .count()
        })
    };
    match count("/dev", true) {
        0 => count("/proc/driver/nvidia/gpus", false),
        n => n,
    }
}

/// In a Kubeflow pod the training operator sets PET_NPROC_PER_NODE=auto by default (and an
/// elastic job PET_NNODES=MIN:MAX): a flag given beside such a variable wins, and the variable
/// is not even read, as in torchrun; `auto`, `cpu` and `gpu` mean what they mean to torchrun,
/// as the variable and as the flag.
#[test]
fn a_flag_wins_over_kubeflow_s_auto_and_an_elastic_range() {
    let pod = |command: &mut Command, vars: &[(&str, &str)]| {
        common::clear_launcher_env(command);
        command
            .env_remove("CUDA_VISIBLE_DEVICES")
            .envs(vars.iter().copied());
    };
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--nproc-per-node", "2", "--", "sh", "-c", PRINT_ENV]);
    pod(&mut command, &[("PET_NPROC_PER_NODE", "auto")]);
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    assert_eq!(ranks_started(&done.stdout), 2, "{}", done.stdout);
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    pod(
        &mut command,
        &[("PET_NNODES", "1:4"), ("PET_NPROC_PER_NODE", "gpu")],
    );
    let done = run(command);
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    assert_eq!(ranks_started(&done.stdout), 1, "{}", done.stdout);
    // Without the flag, `auto` is this host's GPUs, else its CPUs; `cpu` its CPUs; `gpu` its
    // GPUs; as the flag too.
    let (cpus, gpus) = (
        std::thread::available_parallelism().unwrap().get(),
        gpus_here(),
    );
    let auto = if gpus > 0 { gpus } else { cpus };
    let mut cases = vec![
        (None, "auto", auto),
        (None, "cpu", cpus),
        (Some("auto"), "", auto),
        (Some("cpu"), "", cpus),
    ];
    if gpus > 0 {
        cases.extend([(None, "gpu", gpus), (Some("gpu"), "", gpus)]);
    }
    for (flag, var, want) in cases {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
        if let Some(flag) = flag {
            command.args(["--nproc-per-node", flag]);
        }
        command.args(["--", "sh", "-c", PRINT_ENV]);
        pod(&mut command, &[("PET_NPROC_PER_NODE", var)]);
        let done = run(command);
        assert!(done.status.success(), "{flag:?} {var:?}: {}", done.stderr);
        assert_eq!(ranks_started(&done.stdout), want, "{flag:?} {var:?}");
    }
    // `gpu` where the driver shows none: an error naming the variable, or the flag.
    if gpus == 0 {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
        command.args(["--", "true"]);
        pod(&mut command, &[("PET_NPROC_PER_NODE", "gpu")]);
        let done = run(command);
        assert_eq!(done.status.code(), Some(2), "{}", done.stderr);
        assert!(
            done.stderr.contains("PET_NPROC_PER_NODE=\"gpu\"") && done.stderr.contains("GPU"),
            "{}",
            done.stderr
        );
        let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
        command.args(["--nproc-per-node", "gpu", "--", "true"]);
        pod(&mut command, &[]);
        let done = run(command);
        assert_eq!(done.status.code(), Some(2), "{}", done.stderr);
        assert!(done.stderr.contains("--nproc-per-node"), "{}", done.stderr);
    }
}

#[test]
fn multi_node_without_master_is_refused() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "0"]);
    command.args(["--master-addr", "10.1.2.3", "--", "true"]);
    let done = run(command);
    assert_eq!(done.status.code(), Some(2));
    assert!(
        done.stderr
            .contains("--nnodes 2 needs --master-addr and --master-port"),
        "{}",
        done.stderr
    );
    assert!(done.stdout.is_empty());
}

#[test]
fn output_lines_are_prefixed_and_never_torn() {
    // Each rank writes 300 long lines to stdout and 300 to stderr, concurrently, and a last
    // line without a newline; every forwarded line must be whole and carry its own rank.
    let pad = "x".repeat(200);
    let script = format!("pad={pad}")
        + r#"
        i=0
        while [ $i -lt 300 ]; do
            echo "out $i of $RANK $pad"
            echo "err $i of $RANK $pad" >&2
            i=$((i + 1))
        done
        printf "unterminated $RANK""#;
    let done = run(ddprun(3, &script));
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    for (text, kind) in [(&done.stdout, "out"), (&done.stderr, "err")] {
        let mut counts = [0usize; 3];
        for line in text.lines().filter(|line| !line.starts_with("[ddprun]")) {
            let rest = line
                .strip_prefix("[rank ")
                .unwrap_or_else(|| panic!("unprefixed: {line:?}"));
            let (rank, body) = rest.split_once("] ").unwrap();
            let rank: usize = rank.parse().unwrap();
            if body == format!("unterminated {rank}") {
                assert_eq!(kind, "out");
                continue;
            }
            let words: Vec<&str> = body.split(' ').collect();
            assert_eq!(words.len(), 5, "torn line: {line:?}");
            assert_eq!(words[0], kind, "{line:?}");
            assert_eq!(
                words[3],
                rank.to_string(),
                "line carries another rank's prefix: {line:?}"
            );
            assert_eq!(
                words[1],
                counts[rank].to_string(),
                "lines of one rank in order: {line:?}"
            );
            assert_eq!(words[4], pad, "{line:?}");
            counts[rank] += 1;
        }
        assert_eq!(counts, [300; 3], "{kind}");
    }
    for rank in 0..3 {
        assert!(done
            .stdout
            .contains(&format!("[rank {rank}] unterminated {rank}\n")));
    }
}

/// The processes that hold a TCP socket listening on `port` (from `/proc/net/tcp*` and every
/// process's descriptors).
fn listening_pids(port: u16) -> Vec<u32> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields[1].rsplit(':').next().unwrap();
            if u16::from_str_radix(local_port, 16) == Ok(port) && fields[3] == "0A" {
                inodes.push(format!("socket:[{}]", fields[9]));
            }
        }
    }
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|link| inodes.iter().any(|i| link.as_os_str() == i.as_str()))
        });
        if holds {
            pids.push(pid);
        }
    }
    pids
}

/// Whether a PyTorch `TCPStore` answers on `port` (VALIDATE, then PING echoed).
fn torch_store_answers(port: u16) -> bool {
    use std::io::Write;
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut hello = vec![0u8];
    hello.extend(0x3C85_F7CEu32.to_le_bytes());
    hello.push(13);
    hello.extend(4242u32.to_le_bytes());
    let mut echo = [0u8; 4];
    s.write_all(&hello).is_ok() && s.read_exact(&mut echo).is_ok() && echo == 4242u32.to_le_bytes()
}

/// Two jobs at once get different ports, and each port is held from the moment ddprun chose it,
/// by ddprun itself, which hosts the rendezvous store there (a PyTorch TCPStore, as torchrun's
/// agent does) and says so to every rank (`TORCHELASTIC_USE_AGENT_STORE=True`): while the job
/// runs nobody else can bind the port, and no rank needs to (ddprun used to probe a free port,
/// close it, and leave rank 0 to bind it again, a window in which another job could take it;
/// then it handed rank 0 the bound socket, which a PyTorch rank 0 cannot use).
#[test]
fn two_jobs_at_once_get_different_ports_that_ddprun_holds() {
    // Each job's ranks print what they were told, then keep running, so both jobs are alive
    // while the ports are checked. No rank gets a socket of ddprun's.
    let script = r#"echo "port $MASTER_PORT agent store $TORCHELASTIC_USE_AGENT_STORE fd ${DDP_STORE_FD:-none}"; sleep 3"#;
    let jobs: Vec<Guarded> = (0..2)
        .map(|_| {
            Guarded::spawn(
                ddprun(2, script)
                    .env("DDP_STORE_FD", "9")
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null()),
                DEADLINE,
            )
        })
        .collect();
    let mut ports = Vec::new();
    for mut job in jobs {
        let mut out = BufReader::new(job.stdout.take().unwrap());
        let mut seen = Vec::new();
        while seen.len() < 2 {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the job ended early");
            let (_, told) = line.trim().split_once("] port ").unwrap();
            seen.push(told.to_string());
        }
        assert_eq!(seen[0], seen[1], "both ranks are told the same");
        let (port, rest) = seen[0].split_once(' ').unwrap();
        assert_eq!(rest, "agent store True fd none", "{seen:?}");
        ports.push((port.parse::<u16>().unwrap(), job));
    }
    assert_ne!(
        ports[0].0, ports[1].0,
        "two concurrent jobs got the same port"
    );
    for (port, job) in &ports {
        let err = TcpListener::bind(("0.0.0.0", *port))
            .expect_err("MASTER_PORT is free while the job runs: nothing holds it");
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::AddrInUse,
            "port {port}: {err}"
        );
        assert_eq!(
            listening_pids(*port),
            [job.id()],
            "port {port} is held by ddprun (pid {}) alone",
            job.id()
        );
        assert!(
            torch_store_answers(*port),
            "no PyTorch store on port {port}"
        );
    }
    for (_, job) in ports {
        assert!(job.wait().success());
    }
}

#[test]
fn sigterm_to_ddprun_is_forwarded_to_the_ranks() {
    let script = r#"trap 'echo "rank $RANK got TERM"; exit 0' TERM; echo ready; sleep 30 & wait"#;
    let mut command = ddprun(2, script);
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null());
    let mut child = Guarded::spawn(&mut command, DEADLINE);
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let stderr = collect(child.stderr.take().unwrap());
    let mut seen = String::new();
    for _ in 0..2 {
        stdout.read_line(&mut seen).unwrap();
    }
    assert_eq!(seen.matches("ready").count(), 2, "{seen}");
    // SAFETY: kill has no memory-safety preconditions; the pid is our live child's.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait();
    let stderr = stderr.join().unwrap();
    assert_eq!(
        status.code(),
        Some(128 + libc::SIGTERM),
        "stderr:\n{stderr}"
    );
    for rank in 0..2 {
        assert!(
            rest.contains(&format!("[rank {rank}] rank {rank} got TERM")),
            "{rest}"
        );
    }
    assert!(
        tail(&stderr, 1).contains("interrupted by SIGTERM"),
        "{stderr}"
    );
    assert!(child.elapsed() < STOPPED_EARLY, "{:?}", child.elapsed());
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("rank1-ignores-term");
    // Rank 0 fails only once rank 1 ignores SIGTERM.
    let script = format!(
        r#"trap "" TERM; if [ "$RANK" = 0 ]; then {}; exit 5; fi; echo yes > {}; sleep 30"#,
        wait_for_file(&ready),
        ready.display()
    );
    let done = run(ddprun(2, &script));
    assert_eq!(done.status.code(), Some(5), "stderr:\n{}", done.stderr);
    assert!(
        done.stderr.contains("grace period of 500ms over"),
        "{}",
        done.stderr
    );
    // `sleep` inherits the ignored SIGTERM, so only SIGKILL ends it: after the 0.5 s grace.
    assert!(
        done.elapsed >= Duration::from_millis(500),
        "{:?}",
        done.elapsed
    );
    assert!(done.elapsed < STOPPED_EARLY, "{:?}", done.elapsed);
    assert!(root_cause(&done.stderr).contains("rank 0 (local rank 0) exited with code 5"));
}

#[test]
fn stopping_a_rank_also_stops_what_it_started() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("grandchild.pid");
    // Rank 1 fails once rank 0's child is running.
    let script = format!(
        r#"if [ "$RANK" = 1 ]; then {}; exit 7; fi; sleep 30 & echo $! > {}; wait"#,
        wait_for_file(&pidfile),
        pidfile.display()
    );
    let done = run(ddprun(2, &script));
    assert_eq!(done.status.code(), Some(7), "stderr:\n{}", done.stderr);
    let pid = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .to_string();
    // Gone, or a zombie nobody has reaped yet: either way no longer running.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let running = state
        .rsplit_once(") ")
        .is_some_and(|(_, rest)| !rest.starts_with('Z'));
    assert!(
        !running,
        "rank 0's child `sleep 30` (pid {pid}) outlived the job: {state}"
    );
}

#[test]
fn missing_program_is_a_clear_error() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--nproc-per-node",
        "2",
        "--",
        "/nonexistent/ddprun-test-program",
    ]);
    let done = run(command);
    assert_eq!(done.status.code(), Some(1));
    assert!(
        done.stderr
            .contains("could not start rank 0 (`/nonexistent/ddprun-test-program`)"),
        "{}",
        done.stderr
    );
}

/// `--max-restarts 0` (the default, given explicitly here) is today's behaviour: the first
/// failure ends the job with the failed rank's code, and nothing starts again.
#[test]
fn max_restarts_zero_never_restarts() {
    let done = run(ddprun_with(
        &["--max-restarts", "0"],
        2,
        r#"echo "attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"
           if [ "$RANK" = 1 ]; then exit 3; fi; sleep 30"#,
    ));
    assert_eq!(done.status.code(), Some(3), "stderr:\n{}", done.stderr);
    assert!(done.elapsed < STOPPED_EARLY, "{:?}", done.elapsed);
    assert_eq!(
        done.stdout.matches("attempt 0 of 0").count(),
        2,
        "one attempt of each rank:\n{}",
        done.stdout
    );
    assert!(!done.stdout.contains("attempt 1"), "{}", done.stdout);
    assert!(!done.stderr.contains("restart"), "{}", done.stderr);
    let last = root_cause(&done.stderr);
    assert!(
        last.contains("job failed. Root cause") && last.contains("exited with code 3"),
        "{last}"
    );
}

/// With restarts left, a failure restarts all ranks (TORCHELASTIC_RESTART_COUNT counts them);
/// a rank that fails every time uses the budget up, and the job ends as without restarts: the
/// last failure's code and root cause.
#[test]
fn restarts_until_the_budget_is_used_up() {
    let done = run(ddprun_with(
        &["--max-restarts", "2"],
        2,
        r#"echo "attempt $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT"
           if [ "$RANK" = 1 ]; then exit 3; fi; sleep 30"#,
    ));
    assert_eq!(done.status.code(), Some(3), "stderr:\n{}", done.stderr);
    assert!(done.elapsed < STOPPED_EARLY, "{:?}", done.elapsed);
    for k in 0..3 {
        assert!(
            done.stdout.contains(&format!("[rank 1] attempt {k} ")),
            "attempt {k}:\n{}",
            done.stdout
        );
    }
    assert!(!done.stdout.contains("attempt 3"), "{}", done.stdout);
    for k in 1..=2 {
        assert!(
            done.stderr.contains(&format!(
                "rank 1 failed (exited with code 3); restarting all 2 ranks (restart {k} of 2)"
            )),
            "{}",
            done.stderr
        );
    }
    assert!(
        done.stderr.contains("all 2 restarts are used up"),
        "{}",
        done.stderr
    );
    let last = root_cause(&done.stderr);
    assert!(
        last.contains("exited with code 3")
            && last.contains("(in the attempt after 2 restarts, the last one allowed)"),
        "{last}"
    );
}

/// A rank that fails only on the first attempt: one restart, exit 0.
#[test]
fn a_restart_that_succeeds_gives_zero() {
    let done = run(ddprun_with(
        &["--max-restarts", "3"],
        2,
        r#"if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 0 ]; then kill -9 $$; fi
           if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then sleep 30; fi; echo "rank $RANK done""#,
    ));
    assert!(done.status.success(), "stderr:\n{}", done.stderr);
    assert!(
        done.stderr
            .contains("rank 0 failed (killed by SIGKILL); restarting all 2 ranks (restart 1 of 3)"),
        "{}",
        done.stderr
    );
    assert!(
        done.stderr.contains("1 of 3 restarts used"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("Root cause"), "{}", done.stderr);
    assert!(
        done.stdout.contains("[rank 1] rank 1 done"),
        "{}",
        done.stdout
    );
}

// ---------------------------------------------------------------------------------------------
// Real ranks: comm's `ddp-comm-peer` (all-reduces in a loop, an error file on failure that names
// the rank its process group blames).

/// ddprun of `nproc` ranks of `ddp-comm-peer` all-reducing forever, with `env` (NAME=VALUE).
fn peers(nproc: usize, env: &[&str]) -> Command {
    peers_with_grace("0.5", nproc, env)
}

/// [`peers`] with the grace period `grace` (seconds).
fn peers_with_grace(grace: &str, nproc: usize, env: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--grace-period",
        grace,
        "--nproc-per-node",
        &nproc.to_string(),
        "--",
        "env",
    ]);
    command.args(["PEER_STEPS=0", "PEER_ELEMS=1000", "PEER_SLEEP_MS=20"]);
    command.args(env);
    command.arg(common::workspace_bin("ddp-comm-peer"));
    common::clear_launcher_env(&mut command);
    command
}

/// Rank 1 of 3 freezes (SIGSTOP after step 3). Ranks 0 and 2 time out naming it
/// (DDP_PEER_TIMEOUT) and exit first; rank 1 ends only when ddprun kills it. The root cause
/// names rank 1, the rank the failure is about, not the first rank to exit; the box's second
/// line quotes that first exit, and ddprun exits with its code (rank 1's SIGKILL was ddprun's).
/// The stopped rank can neither write a flight record nor handle SIGTERM: ddprun kills it at
/// once rather than after the default grace period (5 s), so the box comes within 4.5 s of
/// the survivors' timeout (3 s; it came after 3 + 2.5 + 5 s before).
#[test]
fn a_frozen_rank_is_the_root_cause_not_the_first_rank_to_exit() {
    let done = run(peers_with_grace(
        "5",
        3,
        &["DDP_PEER_TIMEOUT=3", "PEER_STOP_RANK=1", "PEER_STOP_STEP=3"],
    ));
    assert!(
        done.elapsed < Duration::from_millis(7500),
        "the box came {:?} after the start:\n{}",
        done.elapsed,
        done.stderr
    );
    assert!(
        done.stderr.contains("rank 1 is stopped (process ")
            && done.stderr.contains("killing it at once"),
        "{}",
        done.stderr
    );
    assert!(
        done.stdout
            .contains("rank 1 stops itself (SIGSTOP) at step 3"),
        "{}",
        done.stdout
    );
    let last = root_cause(&done.stderr);
    let lines: Vec<&str> = last.lines().collect();
    assert!(
        lines[1].starts_with("  rank 1 (local rank 1) is the rank at fault: the error of rank ")
            && lines[1].contains(
                "rank 1 was still running when the launcher stopped the ranks: killed by SIGKILL"
            ),
        "the headline names the frozen rank:\n{last}"
    );
    let first = lines[2]
        .strip_prefix("  first to fail: rank ")
        .unwrap_or_else(|| panic!("the second line quotes the first exit:\n{last}"));
    assert!(
        first == "0 (local rank 0) exited with code 3"
            || first == "2 (local rank 2) exited with code 3",
        "{last}"
    );
    assert!(
        last.contains("rank 1 is unresponsive"),
        "the first rank's error says why:\n{last}"
    );
    assert_eq!(done.status.code(), Some(3), "stderr:\n{}", done.stderr);
}

/// Rank 1 of 3 exits with an error (code 7 after step 3); the others lose it. The root cause is
/// rank 1 with its code and its own words, with no second line (the first rank to fail is the
/// rank at fault), and ddprun exits with rank 1's code.
#[test]
fn a_rank_that_exits_with_an_error_is_the_root_cause() {
    let done = run(peers(3, &["PEER_EXIT_RANK=1", "PEER_EXIT_STEP=3"]));
    assert_eq!(done.status.code(), Some(7), "stderr:\n{}", done.stderr);
    let last = root_cause(&done.stderr);
    let lines: Vec<&str> = last.lines().collect();
    assert_eq!(
        lines[1],
        "  rank 1 (local rank 1) exited with code 7; it was the first rank to fail, and the \
         other ranks were stopped",
        "{last}"
    );
    assert!(!last.contains("first to fail:"), "{last}");
    assert_eq!(lines[2], "  its error:", "{last}");
    assert!(
        last.contains("\n    rank 1 exits with code 7 at step 3 (PEER_EXIT_RANK)\n"),
        "{last}"
    );
    assert!(done.elapsed < STOPPED_EARLY, "{:?}", done.elapsed);
}

// ---------------------------------------------------------------------------------------------
// Several nodes: two ddpruns on this host as node 0 and node 1, their ranks running comm's
// `ddp-comm-peer` (all-reduces in a loop).

/// A port P such that P and P + 1 (the launchers' store) were both free just now.
fn two_free_ports() -> u16 {
    for _ in 0..50 {
        let a = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if port < u16::MAX && TcpListener::bind(("0.0.0.0", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports");
}

/// Node `node`'s ddprun of a 2-node job of one rank per node on 127.0.0.1:`port`, with
/// `--max-restarts restarts`, its rank running `ddp-comm-peer` with `env` (NAME=VALUE).
fn node(node: usize, port: u16, restarts: usize, env: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--grace-period",
        "0.5",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
    ]);
    command.args([
        "--node-rank",
        &node.to_string(),
        "--master-addr",
        "127.0.0.1",
    ]);
    command.args(["--master-port", &port.to_string()]);
    command.args(["--max-restarts", &restarts.to_string(), "--", "env"]);
    command.args(["PEER_ELEMS=1000", "PEER_SLEEP_MS=20", "DDP_PEER_TIMEOUT=3"]);
    command.args(env);
    command.arg(common::workspace_bin("ddp-comm-peer"));
    common::clear_launcher_env(&mut command);
    command.env("DDP_JOB_ID", format!("multinode-{port}"));
    command
}

/// Rank 1 (node 1) fails at step 5 of the first attempt: both launchers restart their ranks
/// once, together (restart count 1 on both), and the job ends with exit 0 on both nodes.
#[test]
fn two_nodes_restart_together_when_a_rank_fails() {
    let port = two_free_ports();
    let env = ["PEER_STEPS=12", "PEER_EXIT_RANK=1", "PEER_EXIT_STEP=5"];
    let nodes = [start(node(0, port, 1, &env)), start(node(1, port, 1, &env))];
    let [a, b] = nodes.map(Running::finish);
    for (n, done) in [&a, &b].into_iter().enumerate() {
        assert!(
            done.status.success(),
            "node {n}: {}\nstdout:\n{}\nstderr:\n{}",
            done.status,
            done.stdout,
            done.stderr
        );
        assert!(
            done.stderr.contains("(restart 1 of 1)"),
            "node {n}:\n{}",
            done.stderr
        );
        assert!(
            !done.stderr.contains("(restart 2"),
            "node {n}:\n{}",
            done.stderr
        );
        assert!(
            done.stdout
                .contains(&format!("[rank {n}] rank {n} done (attempt 1)")),
            "node {n}:\n{}",
            done.stdout
        );
    }
    assert!(
        b.stdout.contains("rank 1 exits with code 7 at step 5"),
        "{}",
        b.stdout
    );
    eprintln!(
        "both nodes restarted once and finished in {:?} and {:?}",
        a.elapsed, b.elapsed
    );
}

/// Rank 1 fails on every attempt: after the one restart allowed, both nodes fail; node 1 with
/// its rank's failure, node 0 quoting it.
#[test]
fn two_nodes_fail_together_when_the_restarts_are_used_up() {
    let port = two_free_ports();
    let env = [
        "PEER_STEPS=0",
        "PEER_EXIT_RANK=1",
        "PEER_EXIT_STEP=3",
        "PEER_EXIT_ALWAYS=1",
    ];
    let nodes = [start(node(0, port, 1, &env)), start(node(1, port, 1, &env))];
    let [a, b] = nodes.map(Running::finish);
    assert!(
        !a.status.success() && !b.status.success(),
        "{:?} {:?}",
        a.status,
        b.status
    );
    assert!(a.elapsed < STOPPED_EARLY && b.elapsed < STOPPED_EARLY);
    for (n, done) in [&a, &b].into_iter().enumerate() {
        assert!(
            done.stderr.contains("(restart 1 of 1)"),
            "node {n}:\n{}",
            done.stderr
        );
        assert!(done.stderr.contains("rank 1"), "node {n}:\n{}", done.stderr);
    }
}

/// Node 1's launcher is killed (SIGKILL; its rank dies with it) while the job runs: node 0's
/// launcher names node 1 and exits non-zero instead of waiting for it forever.
#[test]
fn a_killed_launcher_is_named_by_the_other_node() {
    let port = two_free_ports();
    let env = ["PEER_STEPS=0"];
    let a = start(node(0, port, 1, &env));
    let b = start(node(1, port, 1, &env));
    std::thread::sleep(Duration::from_secs(3));
    assert!(b.child.try_wait().is_none(), "node 1 ended early");
    // SAFETY: kill(2) on the pid of our own child.
    unsafe { libc::kill(b.child.id() as i32, libc::SIGKILL) };
    let killed = std::time::Instant::now();
    let a = a.finish();
    drop(b.finish());
    assert!(!a.status.success(), "node 0 succeeded:\n{}", a.stderr);
    assert!(
        a.stderr.contains("node 1 has not been heard from"),
        "node 0 does not name node 1:\n{}",
        a.stderr
    );
    assert!(
        killed.elapsed() < Duration::from_secs(30),
        "{:?}",
        killed.elapsed()
    );
    eprintln!("node 0 named node 1 {:?} after the kill", killed.elapsed());
}
