//! The user's elastic program (`user-elastic`) as docs/guide.md section 9 runs it: three
//! `ddprun --nnodes 2:3` agents on this host, one rank each; one rank is killed (SIGKILL) in the
//! middle of the run, its agent restarts it, it rejoins healed, and every agent exits 0 with
//! every rank holding the same parameters. And the guide's loop is this program's, line for
//! line. Every process runs under a deadline.

use std::net::TcpListener;
use std::path::Path;
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
        let lines = common::output_lines(&mut child);
        Agent {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until one contains `what`; panics with the output past the deadline.
    fn wait_for(&mut self, what: &str) {
        let deadline = Instant::now() + DEADLINE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(what) {
                        return;
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

/// The pid of the `user-elastic` that `parent` started, once there is one.
fn child_of(parent: u32) -> Option<u32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((comm, rest)) = stat.split_once(") ") else {
            continue;
        };
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        if ppid == parent && comm.ends_with("(user-elastic") {
            return Some(pid);
        }
    }
    None
}

/// Three agents, node 1's rank killed once the job runs: it is restarted, rejoins healed, and
/// the job ends on every node with exit 0 and the same parameters on every rank.
#[test]
fn the_guides_elastic_program_survives_a_kill_under_three_agents() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut agents: Vec<Agent> = (0..3)
        .map(|node| {
            let mut command = Command::new(common::workspace_bin("ddprun"));
            common::clear_launcher_env(&mut command);
            command
                .args(["--nnodes", "2:3", "--nproc-per-node", "1", "--node-rank"])
                .arg(node.to_string())
                .args(["--master-addr", "127.0.0.1", "--master-port"])
                .arg(port.to_string())
                .args(["--max-restarts", "1", "--grace-period", "0.5", "--"])
                .arg(env!("CARGO_BIN_EXE_user-elastic"))
                .args(["--samples", "120000", "--epochs", "2"]);
            Agent::start(command)
        })
        .collect();
    // Kill node 1's rank once it has trained a while (at world 3: every agent's rank is in).
    agents[1].wait_for("slot 1: step 1000 at world 3");
    let victim = child_of(agents[1].child.id()).expect("node 1's user-elastic");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    let done: Vec<(std::process::ExitStatus, String)> =
        agents.iter_mut().map(Agent::finish).collect();
    let all = || {
        done.iter()
            .enumerate()
            .map(|(n, (s, t))| format!("--- node {n} ({s}):\n{t}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    for (n, (status, _)) in done.iter().enumerate() {
        assert!(status.success(), "node {n} failed\n{}", all());
    }
    assert!(
        done[1]
            .1
            .contains("restarting it alone to rejoin the elastic job"),
        "{}",
        all()
    );
    // Each rank's last line: `rank R (slot S) done: STEPS steps, world W, parameters fnv H`.
    let ends: Vec<String> = done
        .iter()
        .map(|(_, text)| {
            let line = text
                .lines()
                .rfind(|l| l.contains(") done: "))
                .unwrap_or_else(|| panic!("a rank did not finish\n{}", all()));
            line.split(") done: ").nth(1).unwrap().to_string()
        })
        .collect();
    assert!(ends.iter().all(|e| *e == ends[0]), "{ends:?}\n{}", all());
    assert!(ends[0].contains("world 3"), "{ends:?}\n{}", all());
    for n in [0, 2] {
        assert!(
            done[n].1.contains("dropped: "),
            "node {n} saw no change of membership\n{}",
            all()
        );
    }
}

/// docs/guide.md section 9's loop is this program's: every line of the guide's code block
/// is in `src/elastic.rs`, in the same order (between its `// guide:` marks).
#[test]
fn the_guides_elastic_loop_is_the_programs() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("../docs/guide.md")).unwrap();
    let program = std::fs::read_to_string(root.join("src/elastic.rs")).unwrap();
    let marked = program
        .split("// guide: begin")
        .nth(1)
        .and_then(|rest| rest.split("// guide: end").next())
        .expect("src/elastic.rs marks the guide's part");
    let section = guide
        .split("## 9. Elastic training")
        .nth(1)
        .expect("the guide has section 9, Elastic training");
    let block = section
        .split("```rust")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .and_then(|b| b.split_once('\n').map(|(_, code)| code))
        .expect("section 9 holds a rust block");
    let program_lines: Vec<&str> = marked.lines().map(str::trim).collect();
    let mut at = 0;
    for line in block.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match program_lines[at..].iter().position(|l| *l == line) {
            Some(i) => at += i + 1,
            None => panic!("the guide's line {line:?} is not in src/elastic.rs (in this order)"),
        }
    }
    assert!(at > 0);
}
