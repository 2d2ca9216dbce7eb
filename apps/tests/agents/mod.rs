//! What the tests that run several `ddprun` agents of one elastic job share
//! (`elastic.rs`, `store_failover.rs`): an agent whose output is read line by line as it
//! comes, the trainer it runs, and what a rank that trained a whole epoch says. The test crate
//! declares `mod common;` beside it.

#![allow(dead_code)] // each test binary uses a subset

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common::Guarded;

/// One `ddprun` agent, its output read line by line as it comes.
pub struct Agent {
    pub child: Guarded,
    pub lines: mpsc::Receiver<String>,
    pub seen: Vec<String>,
}

impl Agent {
    /// Spawns `command` (its output piped here) under `deadline` (`Guarded`).
    pub fn start(command: &mut Command, deadline: Duration) -> Agent {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = Guarded::spawn(command, deadline);
        let lines = crate::common::output_lines(&mut child);
        Agent {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until one contains `what`; panics with the output past `deadline`.
    pub fn wait_for(&mut self, what: &str, deadline: Instant) -> String {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with {what:?} in time; output:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for the agent to exit; returns its success and all its output.
    pub fn finish(&mut self) -> (bool, Vec<String>) {
        let status = self.child.wait();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            self.seen.push(line);
        }
        (status.success(), self.seen.clone())
    }

    /// Kills the agent and its rank together, as a node that dies (`SIGKILL`, the agent
    /// first: a store it hosts goes first); returns when, in ms since the epoch.
    pub fn kill_node(&self) -> u128 {
        let trainer = trainer_of(self.child.id());
        let at = now_ms();
        for pid in [self.child.id(), trainer] {
            // SAFETY: kill has no memory-safety preconditions.
            assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        }
        at
    }
}

/// A free TCP port on this host (bound and released: node 0's agent binds it right after).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Milliseconds since the Unix epoch, as the trainers print them.
pub fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// The pid of the trainer `ddprun` (process `agent_pid`) runs, from `/proc`.
pub fn trainer_of(agent_pid: u32) -> u32 {
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let Some((comm, rest)) = stat.split_once(") ") else {
            continue;
        };
        let ppid: u32 = rest.split_whitespace().nth(1).unwrap().parse().unwrap();
        if ppid == agent_pid && comm.ends_with("(train-mnist") {
            return pid;
        }
    }
    panic!("no train-mnist under ddprun {agent_pid}")
}

/// The JSON after `marker` on the last line that has it.
pub fn json_after(lines: &[String], marker: &str) -> Value {
    let line = lines
        .iter()
        .rev()
        .find_map(|l| l.split_once(marker).map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no {marker} in:\n{}", lines.join("\n")));
    serde_json::from_str(&line).unwrap()
}

/// The number after the last `key` in `line`.
pub fn number_after(line: &str, key: &str) -> u128 {
    let (_, rest) = line.rsplit_once(key).unwrap();
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// Checks what a rank that trained the whole epoch says: every step committed once, in
/// order, from 1; each of the epoch's `samples` trained exactly once.
pub fn check_whole_epoch(summary: &Value, samples: u64, who: &str) {
    assert_eq!(summary["steps_repeated"], 0, "{who}: {summary}");
    assert_eq!(summary["steps_in_order"], true, "{who}: {summary}");
    assert_eq!(summary["first_step"], 1, "{who}: {summary}");
    let epoch = &summary["epochs"][0];
    assert_eq!(
        epoch["min_count"], 1,
        "{who}: a sample not trained once: {summary}"
    );
    assert_eq!(
        epoch["max_count"], 1,
        "{who}: a sample trained twice: {summary}"
    );
    assert_eq!(epoch["trained"], samples, "{who}: {summary}");
}
