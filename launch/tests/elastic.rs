//! `ddprun --nnodes MIN:MAX`, with comm's `ddp-elastic-peer` as the ranks (all-reduces and the
//! commit vote of an elastic group, one line per step): a failed rank is restarted alone and
//! rejoins while the other ranks go on; a frozen rank that takes the job below its minimum
//! makes the launcher restart the whole job as a new round. A rank killed after the job's last
//! step is restarted, finds the job over and exits 0, and every agent says the job succeeded
//! (node 0's, which hosts the store, waits for the other agents to see the end, but not for an
//! agent that died hard). Every rank killed at once: the restarted ranks found a new round;
//! a rank slow to start its group is waited for. Every run has a deadline.

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
        let lines = common::output_lines(&mut child);
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
    elastic_node_with(&[], node, range, nproc, port, restarts, env)
}

/// [`elastic_node`] with more of ddprun's `flags`.
fn elastic_node_with(
    flags: &[&str],
    node: usize,
    range: &str,
    nproc: usize,
    port: u16,
    restarts: usize,
    env: &[&str],
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(flags);
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
    // torchrun's count: the restarted rank is restart 1 of the budget, and sees it; the
    // store keys stay the round's (it rejoined, healed).
    let node1 = &done[1].1;
    for said in [
        "(restart 1 of 1 of this launcher; TORCHELASTIC_RESTART_COUNT=1)",
        "elastic slot 1 starts: restart count 0, round 0",
        "elastic slot 1 starts: restart count 1, round 0",
        "all ranks finished; 1 of 1 restarts used (1 rank restarted alone to rejoin the elastic \
         job, 0 restarts of the whole job)",
    ] {
        assert!(node1.contains(said), "no {said:?} in:\n{node1}");
    }
    assert!(
        done[0]
            .1
            .contains("all ranks finished; 0 of 1 restarts used"),
        "{}",
        done[0].1
    );
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

/// Three agents of a `2:3` job at `port`, one rank each, with `restarts` and the ranks' `env`,
/// run to their end: each one's exit status and output.
fn three_agents_to_the_end(
    port: u16,
    restarts: usize,
    env: &[&str],
) -> Vec<(std::process::ExitStatus, String)> {
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(elastic_node(n, "2:3", 1, port, restarts, env)))
        .collect();
    agents.iter_mut().map(Agent::finish).collect()
}

/// Every agent's exit status and output, for a failed assertion.
fn transcript(done: &[(std::process::ExitStatus, String)]) -> String {
    done.iter()
        .enumerate()
        .map(|(n, (s, t))| format!("--- node {n} ({s}):\n{t}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Three agents of a `2:3` job, one rank each; a rank kills itself (SIGKILL) right after it
/// committed the job's last step, before it says the job finished, some milliseconds after
/// the others finished: its agent restarts it, it finds the job over (`ElasticGroup::join`
/// gives `Ok(None)`) and exits 0, and every agent exits 0, node 0's too, which hosts the store
/// and keeps it until the other agents have seen the end. Repeated with the victim on every
/// node (node 0's rank is the founding rank 0: the survivors say the job finished without it)
/// and delays from 0 to 500 ms (24 runs), across the window in which node 0's agent used to
/// drop the store while the restarted rank was still to come.
#[test]
fn a_rank_killed_after_the_last_step_finds_the_job_over_and_every_agent_succeeds() {
    // 24 runs: each victim with each delay (0.6 s a run here).
    let delays = [0, 10, 30, 60, 100, 200, 300, 500];
    let runs: Vec<(usize, u64)> = (0..24).map(|i| ([2, 0, 1][i % 3], delays[i % 8])).collect();
    let started = Instant::now();
    for (run, &(victim, delay)) in runs.iter().enumerate() {
        let port = free_port();
        let die = [
            "PEER_STEPS=15".to_string(),
            format!("PEER_DIE_AFTER_LAST={victim}"),
            format!("PEER_DIE_DELAY_MS={delay}"),
            // A failure shows in seconds, not after the default connect timeout.
            "DDP_CONNECT_TIMEOUT=8".to_string(),
        ];
        let env: Vec<&str> = die.iter().map(String::as_str).collect();
        let done = three_agents_to_the_end(port, 1, &env);
        let all = || transcript(&done);
        let what = format!("run {run} (slot {victim} dies {delay} ms after the last step)");
        for (n, (status, _)) in done.iter().enumerate() {
            assert!(status.success(), "{what}: node {n} failed\n{}", all());
        }
        let text = &done[victim].1;
        for said in [
            format!("elastic slot {victim} kills itself after the last step"),
            "restarting it alone to rejoin the elastic job".to_string(),
            format!("elastic slot {victim} arrived after the end"),
            "all ranks finished; 1 of 1 restarts used".to_string(),
        ] {
            assert!(text.contains(&said), "{what}: no {said:?}\n{}", all());
        }
    }
    eprintln!(
        "{} runs, every agent exited 0, in {:.1} s",
        runs.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Three agents of a `2:3` job, one rank each; one rank's last commit vote fails after it took
/// part in it (`PEER_LOSE_LAST_VOTE`: as when a peer killed right after the last step reset its
/// connection before its last bytes arrived), while the other two commit the last step and
/// finish: the rank's re-form finds the job over and it finishes too, and every agent exits 0.
/// Before, the re-form waited for the finished ranks to go silent, found itself alone below
/// MIN and failed the job that had ended (seen once in the test above under load). Each slot
/// in turn (slot 0 is the founding rank 0).
#[test]
fn a_rank_whose_last_vote_failed_finds_the_job_over() {
    for victim in 0..3 {
        let port = free_port();
        let lose = format!("PEER_LOSE_LAST_VOTE={victim}");
        let env = ["PEER_STEPS=10", &lose, "DDP_CONNECT_TIMEOUT=20"];
        let started = Instant::now();
        let done = three_agents_to_the_end(port, 0, &env);
        let all = || transcript(&done);
        for (n, (status, text)) in done.iter().enumerate() {
            assert!(
                status.success(),
                "slot {victim}'s vote lost: node {n} failed\n{}",
                all()
            );
            assert!(!text.contains("elastic error"), "node {n}\n{}", all());
            assert!(
                text.contains(&format!("elastic slot {n} done")),
                "{}",
                all()
            );
            let last = format!("elastic slot {n} gen 1 rank {n} world 3 step 10 ");
            assert_eq!(text.contains(&last), n != victim, "node {n}\n{}", all());
        }
        eprintln!(
            "slot {victim}'s last vote lost: every agent exited 0 in {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// Three agents of a `2:3` job, one rank each; the three ranks are killed together (an OOM,
/// a node-wide fault): each agent restarts its rank alone, and the restarted ranks, finding
/// nobody of the last generation left to admit them, found a new round among themselves
/// (from step 0: these ranks keep no checkpoint) and finish the job; every agent exits 0
/// with one restart used. Before, each restarted rank waited its connect deadline for a
/// generation that no decider was left to make, failed, and spent the next restart alike.
#[test]
fn every_rank_killed_together_the_restarted_ranks_found_a_new_round() {
    let port = free_port();
    let env = ["PEER_STEPS=80", "DDP_CONNECT_TIMEOUT=30"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(elastic_node(n, "2:3", 1, port, 1, &env)))
        .collect();
    agents[0].wait_for("step 20 ");
    let ranks: Vec<u32> = agents
        .iter()
        .flat_map(|a| children(a.child.id(), "ddp-elastic-peer"))
        .collect();
    assert_eq!(ranks.len(), 3, "{ranks:?}");
    for pid in ranks {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let killed = Instant::now();
    let done: Vec<(std::process::ExitStatus, String)> =
        agents.iter_mut().map(Agent::finish).collect();
    let all = || transcript(&done);
    for (n, (status, text)) in done.iter().enumerate() {
        assert!(status.success(), "node {n} failed\n{}", all());
        for said in [
            "restarting it alone to rejoin the elastic job".to_string(),
            format!("elastic slot {n} new round gen "),
            format!("elastic slot {n} done"),
            "all ranks finished; 1 of 1 restarts used".to_string(),
        ] {
            assert!(text.contains(&said), "node {n}: no {said:?}\n{}", all());
        }
    }
    eprintln!(
        "every rank killed; the job finished {:.1} s later",
        killed.elapsed().as_secs_f64()
    );
}

/// Three agents of a `2:3` job, one rank each; slot 2's rank starts its group slowly: held 10 s
/// with its connections to the others made (`DDP_TEST_ELASTIC_HOLD`; five times the peer
/// timeout of 2 s), while its beat in the store goes on, as a rank loading or compiling on a
/// crowded host. The others wait for it, since it beats: generation 1 forms with all three,
/// the job finishes at world 3, and no rank is restarted. Before, the others' start-up barrier
/// failed on its 2 s of silence ("rank 2 is unresponsive") and every rank was restarted.
#[test]
fn a_slow_starter_is_waited_for_and_generation_1_forms_with_it() {
    let port = free_port();
    let env = [
        "PEER_STEPS=20",
        "DDP_TEST_ELASTIC_HOLD=2:10000",
        "DDP_CONNECT_TIMEOUT=30",
    ];
    let started = Instant::now();
    let done = three_agents_to_the_end(port, 1, &env);
    let all = || transcript(&done);
    for (n, (status, text)) in done.iter().enumerate() {
        assert!(status.success(), "node {n} failed\n{}", all());
        assert!(
            !text.contains("restarting"),
            "node {n} restarted\n{}",
            all()
        );
        let last = format!("elastic slot {n} gen 1 rank {n} world 3 step 20 ");
        assert!(text.contains(&last), "node {n}: no {last:?}\n{}", all());
    }
    assert!(
        done[2].1.contains("holds its group's start for 10000 ms"),
        "{}",
        all()
    );
    let took = started.elapsed();
    eprintln!("generation 1 formed with a rank held 10 s; the job took {took:?}");
    assert!(
        took >= Duration::from_secs(10),
        "{took:?}: the hold did not happen"
    );
}

/// Node 2's agent dies hard (SIGKILL; its rank goes with it) while the job runs: the other two
/// finish the job at world 2, and node 0's agent, which hosts the store, does not wait for the
/// dead agent to see the end beyond its silence (`ddp_comm::AGENT_SILENCE`, 10 s).
#[test]
fn node_0_does_not_wait_for_an_agent_that_died_hard() {
    let port = free_port();
    let env = ["PEER_STEPS=150"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(elastic_node(n, "2:3", 1, port, 1, &env)))
        .collect();
    agents[0].wait_for("step 20 ");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agents[2].child.id() as i32, libc::SIGKILL) };
    agents[0].wait_for("step 150 ");
    let finished = Instant::now();
    let (status, text) = agents[0].finish();
    let took = finished.elapsed();
    assert!(status.success(), "{status}\n{text}");
    assert!(
        took < Duration::from_secs(20),
        "node 0 took {took:?} after its last step\n{text}"
    );
    let (status, text) = agents[1].finish();
    assert!(status.success(), "{status}\n{text}");
}

/// The agents of nodes 1 and 2 die hard (SIGKILL, their ranks too) while the job runs: node
/// 0's rank falls below the minimum of 2 and exits saying so, and node 0's agent, which hosts
/// the store, does not start a new round whose rank could only wait for nodes that are gone:
/// once their silence passes (`ddp_comm::AGENT_SILENCE`, 10 s) it exits non-zero naming them.
/// (Before, it restarted the rank, which waited for the others until its connect deadline,
/// on every restart of the budget.)
#[test]
fn node_0_exits_when_every_other_agent_died_hard() {
    let port = free_port();
    let env = ["PEER_STEPS=100000", "DDP_CONNECT_TIMEOUT=30"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(elastic_node(n, "2:3", 1, port, 1, &env)))
        .collect();
    agents[0].wait_for("step 20 ");
    for agent in &agents[1..] {
        let ranks = children(agent.child.id(), "ddp-elastic-peer");
        for pid in std::iter::once(agent.child.id()).chain(ranks) {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
    let killed = Instant::now();
    let (status, text) = agents[0].finish();
    let took = killed.elapsed();
    assert!(!status.success(), "{status}\n{text}");
    assert!(
        text.contains("the launchers (ddprun) of nodes [1, 2] have been silent for 10s"),
        "{text}"
    );
    assert!(!text.contains("restarting"), "a new round started:\n{text}");
    assert!(
        took < Duration::from_secs(20),
        "node 0 took {took:?} after the other agents died\n{text}"
    );
}

/// An agent of a `2:3` job started as torchrun's users start one: no node rank, the rendezvous
/// endpoint, torchrun's c10d backend and the job's id, as flags or as Kubeflow's `PET_*`
/// variables (`pet`).
fn c10d_agent(port: u16, pet: bool, env: &[&str]) -> Command {
    c10d_agent_of(port, pet, "2:3", env)
}

/// [`c10d_agent`] of a `range` job.
fn c10d_agent_of(port: u16, pet: bool, range: &str, env: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(["--grace-period", "0.5", "--nproc-per-node", "1"]);
    let endpoint = format!("127.0.0.1:{port}");
    if pet {
        command.envs([
            ("PET_NNODES", range),
            ("PET_RDZV_BACKEND", "c10d"),
            ("PET_RDZV_ENDPOINT", endpoint.as_str()),
            ("PET_RDZV_ID", "c10d-test"),
        ]);
    } else {
        command.args(["--nnodes", range, "--rdzv-backend", "c10d"]);
        command.args(["--rdzv-endpoint", &endpoint, "--rdzv-id", "c10d-test"]);
    }
    command
        .args(["--max-restarts", "1", "--", "env"])
        .args(["PEER_SLEEP_MS=20", "DDP_PEER_TIMEOUT=2"])
        .args(env)
        .arg(common::workspace_bin("ddp-elastic-peer"));
    command
}

/// Three agents started with the same command line (two with torchrun's flags, one with the
/// `PET_*` variables), as torchrun's c10d rendezvous and Kubeflow's elastic policy start them:
/// the first hosts the store (node 0), the other two find the port taken and take node ranks
/// 1 and 2 from the store; the job forms at world 3. The agent of node 2 is then killed (with
/// its rank): the other two finish the job, as with node ranks given.
#[test]
fn three_agents_with_one_command_line_train_and_finish() {
    let port = free_port();
    let env = ["PEER_STEPS=150"];
    let mut agents = vec![Agent::start(c10d_agent(port, false, &env))];
    let first = agents[0].wait_for("node rank ");
    assert!(first.contains("whose store this agent hosts"), "{first}");
    agents.push(Agent::start(c10d_agent(port, true, &env)));
    agents.push(Agent::start(c10d_agent(port, false, &env)));
    let node = |said: &str| {
        let rank = said.split("node rank ").nth(1).unwrap();
        rank.split(' ').next().unwrap().to_string()
    };
    let mut nodes = vec![node(&first)];
    for agent in &mut agents[1..] {
        nodes.push(node(&agent.wait_for("node rank ")));
    }
    let mut sorted = nodes.clone();
    sorted.sort();
    assert_eq!(sorted, ["0", "1", "2"], "{nodes:?}");
    assert_eq!(nodes[0], "0", "the first agent hosts");
    agents[0].wait_for(" world 3 step ");
    let victim = nodes.iter().position(|n| n == "2").unwrap();
    let ranks = children(agents[victim].child.id(), "ddp-elastic-peer");
    for pid in std::iter::once(agents[victim].child.id()).chain(ranks) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    for (i, agent) in agents.iter_mut().enumerate() {
        if i == victim {
            continue;
        }
        let (status, text) = agent.finish();
        assert!(
            status.success(),
            "agent {i} (node {}): {status}\n{text}",
            nodes[i]
        );
        assert!(text.contains("step 150 "), "{text}");
    }
}

/// A bare PyTorch `TCPStore` client (its wire protocol: VALIDATE, then SET and ADD), as anyone
/// who reaches `MASTER_PORT` may run one: a stranger to the job.
struct Stranger(std::net::TcpStream);

impl Stranger {
    fn connect(port: u16) -> Stranger {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => panic!("no store at {port}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut s = Stranger(stream);
        let mut hello = vec![0u8];
        hello.extend(0x3C85_F7CEu32.to_le_bytes());
        s.send(&hello);
        s
    }

    fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.0.write_all(bytes).unwrap();
    }

    fn with_key(query: u8, key: &str) -> Vec<u8> {
        let mut m = vec![query];
        m.extend((key.len() as u64).to_le_bytes());
        m.extend(key.as_bytes());
        m
    }

    fn set(&mut self, key: &str, value: &[u8]) {
        let mut m = Stranger::with_key(1, key);
        m.extend((value.len() as u64).to_le_bytes());
        m.extend(value);
        self.send(&m);
    }

    fn add(&mut self, key: &str, delta: i64) -> i64 {
        use std::io::Read;
        let mut m = Stranger::with_key(4, key);
        m.extend(delta.to_le_bytes());
        self.send(&m);
        let mut answer = [0u8; 8];
        self.0.read_exact(&mut answer).unwrap();
        i64::from_le_bytes(answer)
    }
}

/// A stranger reaches the store of a one-node elastic job (2 ranks, `1:2` nodes: up to 4)
/// while it trains, and makes every attack the records allowed: it says the job is done,
/// writes garbage where the next generations' records go, and sends a join request of a
/// plausible fourth process every 100 ms (which, admitted, would be healed with rank 0's
/// weights). The records carry the seal of the job's secret (`DDP_TOKEN`), so the ranks ignore
/// all of it: the job trains to its last step at world 2 without re-forming, and ddprun exits
/// 0. (Without `DDP_TOKEN`, as before: the stranger's request was admitted, the job re-formed
/// for a process that never came, and both ranks failed.)
#[test]
fn a_stranger_at_the_store_leaves_the_job_training() {
    let port = free_port();
    let mut command = elastic_node(0, "1:2", 2, port, 0, &["PEER_STEPS=150"]);
    command.env("DDP_TOKEN", "the job's secret");
    let mut agent = Agent::start(command);
    agent.wait_for("step 5 ");
    let mut stranger = Stranger::connect(port);
    let prefix = "//worker/attempt_0/elastic/";
    for round in 0..20 {
        stranger.set(&format!("{prefix}done"), b"1");
        for g in 2..5 {
            stranger.set(&format!("{prefix}gen/{g}"), b"{garbage");
        }
        let n = stranger.add(&format!("{prefix}joins"), 1);
        let request =
            format!("{{\"member\":{{\"slot\":3,\"incarnation\":{round},\"host\":\"stranger\"}}}}");
        stranger.set(&format!("{prefix}join/{n}"), request.as_bytes());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, text) = agent.finish();
    assert!(status.success(), "{status}\n{text}");
    assert!(text.contains("world 2 step 150 "), "{text}");
    assert!(!text.contains("reformed"), "the job re-formed:\n{text}");
}

/// Kills an agent and its ranks together (`SIGKILL`, the agent first), as a node that dies.
fn kill_node(agent: &Agent) {
    let ranks = children(agent.child.id(), "ddp-elastic-peer");
    for pid in std::iter::once(agent.child.id()).chain(ranks) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// Node `node`'s agent of an elastic job whose records are sealed (`DDP_TOKEN`); node 1's
/// says that the other nodes reach it at 127.0.0.2 (`--local-addr`, a loopback address of its
/// own), where its standby store is published.
fn sealed_node(node: usize, range: &str, nproc: usize, port: u16, env: &[&str]) -> Command {
    let flags: &[&str] = match node {
        1 => &["--local-addr", "127.0.0.2"],
        _ => &[],
    };
    let mut command = elastic_node_with(flags, node, range, nproc, port, 1, env);
    command.env("DDP_TOKEN", "redirect-test-secret");
    command
}

/// Node 0's agent, which hosts the store, dies hard with its rank (`2:3`, one rank each): the
/// others move the store to node 1's standby and go on at world 2. Node 0's agent is then
/// started again with its command line: it hosts a fresh store at the job's first address,
/// node 1's agent writes there where the job went (`ddp_comm::Redirect`), node 0's rank follows
/// it, joins the job where it is and is healed, and the job finishes at world 3, every agent
/// exiting 0. (Before, the restarted rank waited alone in the fresh store until its connect
/// deadline.)
#[test]
fn a_node_0_started_again_after_its_store_moved_finds_the_job() {
    let port = free_port();
    let env = ["PEER_STEPS=400", "DDP_CONNECT_TIMEOUT=30"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(sealed_node(n, "2:3", 1, port, &env)))
        .collect();
    agents[0].wait_for("step 40 ");
    kill_node(&agents[0]);
    let (status, _) = agents[0].finish();
    assert!(!status.success(), "node 0 was killed");
    agents[1].wait_for("world 2 from");
    let restarted = Instant::now();
    agents[0] = Agent::start(sealed_node(0, "2:3", 1, port, &env));
    let healed = agents[0].wait_for("healed true");
    println!(
        "node 0 started again: healed in the moved job {} ms after its start",
        restarted.elapsed().as_millis()
    );
    assert!(healed.contains(" world 3 "), "{healed}");
    let done: Vec<(std::process::ExitStatus, String)> =
        agents.iter_mut().map(Agent::finish).collect();
    for (n, (status, text)) in done.iter().enumerate() {
        assert!(status.success(), "node {n}: {status}\n{text}");
        assert!(text.contains("step 400 "), "node {n}:\n{text}");
    }
    assert!(
        done[0]
            .1
            .contains("while this node was away; following it there"),
        "node 0's agent did not follow the job:\n{}",
        done[0].1
    );
    assert!(
        done[1].1.contains("standby at 127.0.0.2:"),
        "node 1's standby is not where --local-addr says:\n{}",
        done[1].1
    );
    assert!(
        done[1].1.contains("will be told so"),
        "node 1's agent did not keep a redirect:\n{}",
        done[1].1
    );
    let last = |text: &str| {
        text.lines()
            .rev()
            .find(|l| l.contains(" step 400 "))
            .unwrap_or_default()
            .to_string()
    };
    for (n, (_, text)) in done.iter().enumerate() {
        assert!(last(text).contains(" world 3 "), "node {n}: {}", last(text));
    }
}

/// Node 0 dies hard with its ranks (`2:3`, two ranks each: MIN is 4 ranks): the others move the
/// store to node 1's standby and go on at world 4. Then one of node 2's ranks freezes: the
/// job falls below its minimum, every rank left exits saying so, and nodes 1 and 2 start the
/// job again as a new round, whose ranks meet in the moved store (node 1's agent hosts it
/// from then on) and finish at world 4. (Before, the new round's ranks were sent to the first
/// address, where nothing listens any more.)
#[test]
fn a_new_round_after_the_store_moved_starts_where_it_is() {
    let port = free_port();
    let env = ["PEER_STEPS=150", "DDP_CONNECT_TIMEOUT=30"];
    let mut agents: Vec<Agent> = (0..3)
        .map(|n| Agent::start(sealed_node(n, "2:3", 2, port, &env)))
        .collect();
    agents[0].wait_for("step 40 ");
    kill_node(&agents[0]);
    agents[1].wait_for("world 4 from");
    let peers = children(agents[2].child.id(), "ddp-elastic-peer");
    assert_eq!(peers.len(), 2, "{peers:?}");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(peers[0] as i32, libc::SIGSTOP) };
    for n in [1, 2] {
        let (status, text) = agents[n].finish();
        assert!(status.success(), "node {n}: {status}\n{text}");
        for said in [
            "fell below its minimum",
            "(restart 1 of 1)",
            "restart count 1, round 1",
            " world 4 step 150 ",
        ] {
            assert!(text.contains(said), "node {n}: no {said:?} in:\n{text}");
        }
    }
}

/// torchrun's c10d rendezvous (`2:4`, no node ranks): the agent that hosts the store (node 0)
/// dies hard with its rank, and the two others move the store to node 1's standby and go on.
/// Two agents are then started with the same command line: the first binds the endpoint's port
/// again and hosts a fresh store there (node 0); the second finds the port taken and asks that
/// store for a node rank, which says where the job went (`ddp_comm::Redirect`): it takes node
/// rank 3 from the moved store's counter (not 1, a live node's), and both agents' ranks join
/// the job where it is; it finishes at world 4, every agent exiting 0.
#[test]
fn agents_started_after_the_store_moved_find_the_job_through_the_endpoint() {
    let port = free_port();
    let env = ["PEER_STEPS=400", "DDP_CONNECT_TIMEOUT=30"];
    let agent = |env: &[&str]| {
        let mut command = c10d_agent_of(port, false, "2:4", env);
        command.env("DDP_TOKEN", "redirect-test-secret");
        Agent::start(command)
    };
    let mut agents = vec![agent(&env)];
    agents[0].wait_for("whose store this agent hosts");
    agents.push(agent(&env));
    agents.push(agent(&env));
    for a in &mut agents[1..] {
        a.wait_for("node rank ");
    }
    agents[0].wait_for(" world 3 step 40 ");
    kill_node(&agents[0]);
    let _ = agents[0].finish();
    agents[1].wait_for("world 2 from");
    agents[0] = agent(&env);
    agents[0].wait_for("whose store this agent hosts");
    // The moved store's host looks at the first address every 250 ms.
    std::thread::sleep(Duration::from_millis(1000));
    agents.push(agent(&env));
    let rank = agents[3].wait_for("node rank ");
    assert!(rank.contains("node rank 3 of at most 4"), "{rank}");
    let done: Vec<(std::process::ExitStatus, String)> =
        agents.iter_mut().map(Agent::finish).collect();
    for (n, (status, text)) in done.iter().enumerate() {
        assert!(status.success(), "agent {n}: {status}\n{text}");
        assert!(text.contains(" world 4 step 400 "), "agent {n}:\n{text}");
    }
    for n in [0, 3] {
        assert!(
            done[n].1.contains("healed true"),
            "agent {n}:\n{}",
            done[n].1
        );
    }
}
