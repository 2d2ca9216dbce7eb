//! `ddprun --nnodes MIN:MAX`, with comm's `ddp-elastic-peer` as the ranks (all-reduces and the
//! commit vote of an elastic group, one line per step): a failed rank is restarted alone and
//! rejoins while the other ranks go on; a frozen rank that takes the job below its minimum
//! makes the launcher restart the whole job as a new round. Every run has a deadline.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[path = "../../apps/tests/common/mod.rs"]
mod common;
use common::Guarded;

const DEADLINE: Duration = Duration::from_secs(120);

/// A ddprun whose output lines come through a channel as they are written.
struct Agent {
    child: Guarded,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Agent {
    fn start(mut command: Command) -> Agent {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = Guarded::spawn(&mut command, DEADLINE);
        let (tx, lines) = mpsc::channel();
        for stream in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
        }
        Agent {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn wait_for(&mut self, what: &str) -> String {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Err(_) => panic!("no {what:?} in:\n{}", self.seen.join("\n")),
            }
        }
    }

    fn finish(&mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(line);
        }
        (status, self.seen.join("\n"))
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Node `node`'s ddprun of an elastic job (`range` nodes, `nproc` ranks each) at `port`.
fn elastic_node(
    node: usize,
    range: &str,
    nproc: usize,
    port: u16,
    restarts: usize,
    env: &[&str],
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command
        .args([
            "--grace-period",
            "0.5",
            "--nnodes",
            range,
            "--nproc-per-node",
        ])
        .arg(nproc.to_string())
        .args([
            "--node-rank",
            &node.to_string(),
            "--master-addr",
            "127.0.0.1",
        ])
        .args(["--master-port", &port.to_string()])
        .args(["--max-restarts", &restarts.to_string(), "--", "env"])
        .args(["PEER_SLEEP_MS=20", "DDP_PEER_TIMEOUT=2"])
        .args(env)
        .arg(common::workspace_bin("ddp-elastic-peer"));
    command
}

/// The pids of the processes `parent` started whose name starts with `name`.
fn children(parent: u32, name: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((comm, rest)) = stat.split_once(") ") else {
            continue;
        };
        let ppid: u32 = rest.split_whitespace().nth(1).unwrap().parse().unwrap();
        if ppid == parent
            && comm
                .split_once('(')
                .is_some_and(|(_, c)| name.starts_with(c))
        {
            found.push(pid);
        }
    }
    found
}

/// Three agents of a `2:3` job, one rank each: node 1's rank is killed; its agent restarts it
/// alone, it rejoins, the other ranks never stop, and every agent ends with exit 0.
#[test]
fn a_failed_rank_is_restarted_alone_and_rejoins() {
    let port = free_port();
    let env = ["PEER_STEPS=120"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(elastic_node(n, "2:3", 1, port, 1, &env)))
        .collect();
    agents[0].wait_for("step 20 ");
    let victim = children(agents[1].child.id(), "ddp-elastic-peer");
    assert_eq!(victim.len(), 1, "{victim:?}");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(victim[0] as i32, libc::SIGKILL) };
    let done: Vec<(std::process::ExitStatus, String)> =
        agents.iter_mut().map(Agent::finish).collect();
    for (n, (status, text)) in done.iter().enumerate() {
        assert!(status.success(), "node {n}: {status}\n{text}");
    }
    assert!(
        done[1].1.contains("restarting it alone to rejoin"),
        "{}",
        done[1].1
    );
    assert!(done[1].1.contains("healed true"), "{}", done[1].1);
    for n in [0, 2] {
        let text = &done[n].1;
        assert!(
            !text.contains("restarting"),
            "node {n} restarted something:\n{text}"
        );
        assert!(text.contains("reformed gen 2"), "{text}");
        assert!(text.contains("step 120 "), "{text}");
    }
}

/// One agent of a `1:2` job with two ranks (MIN 2 ranks): one rank is frozen (SIGSTOP); the
/// other removes it after the peer timeout, finds the job below its minimum and exits saying
/// so; the agent restarts the whole job as a new round (restart count 1), which finishes.
#[test]
fn below_its_minimum_the_job_restarts_as_a_new_round() {
    let port = free_port();
    let env = ["PEER_STEPS=60"];
    let mut agent = Agent::start(elastic_node(0, "1:2", 2, port, 1, &env));
    agent.wait_for("step 10 ");
    let peers = children(agent.child.id(), "ddp-elastic-peer");
    assert_eq!(peers.len(), 2, "{peers:?}");
    let frozen_at = Instant::now();
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(peers[1] as i32, libc::SIGSTOP) };
    agent.wait_for("fell below its minimum");
    // Silence counts from the last heartbeat heard (every 0.4 s, a fifth of the timeout; it
    // may precede the stop by that much, more on a loaded host), and an elastic group waits
    // no grace after it: before 1.2 s, something other than the silence removed the rank.
    let took = frozen_at.elapsed();
    assert!(
        took >= Duration::from_millis(1200),
        "{took:?} is too short for DDP_PEER_TIMEOUT=2"
    );
    let (status, text) = agent.finish();
    assert!(status.success(), "{status}\n{text}");
    assert!(text.contains("minimum of 2"), "{text}");
    assert!(text.contains("(restart 1 of 1)"), "{text}");
    assert!(text.contains("step 60 "), "{text}");
}
