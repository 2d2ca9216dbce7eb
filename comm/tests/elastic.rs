//! Elastic membership with real processes (`ddp-elastic-peer`) around a store hosted here, as
//! ddprun hosts it: survivors of a kill go on at the smaller world within a second, a
//! restarted process rejoins at a step boundary, a frozen rank is removed after the peer
//! timeout, a process of another job or world is refused while the job goes on, and below its
//! minimum the job stops naming the ranks lost; a second failure during a re-form (a joiner
//! killed mid-heal, a second rank killed, the decider killed) starts another round and a busy
//! survivor is waited for; when every rank dies at once, the restarted ones found a new round
//! of the job among themselves. Every wait has a deadline.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ddp_comm::TorchStoreHost;

/// One peer process; killed when dropped.
struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    /// Reads lines until one contains `what` (returns it) or `deadline` passes (panics with
    /// everything read).
    fn wait_for(&mut self, what: &str, deadline: Instant) -> String {
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
                    "no line with {what:?} in time; lines:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Waits for the exit and drains the output (deadline `deadline`).
    fn finish(&mut self, deadline: Instant) -> (std::process::ExitStatus, Vec<String>) {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
                    self.seen.push(line);
                }
                return (status, self.seen.clone());
            }
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            assert!(
                Instant::now() < deadline,
                "no exit in time; lines:\n{}",
                self.seen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A job: the store and what every peer shares.
struct Job {
    store: TorchStoreHost,
    range: String,
    job_id: String,
}

impl Job {
    fn new(range: &str) -> Job {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let store = TorchStoreHost::start(listener).unwrap();
        Job {
            job_id: format!("elastic-test-{}", store.port()),
            store,
            range: range.into(),
        }
    }

    fn spawn(&self, slot: usize, env: &[(&str, &str)]) -> Peer {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddp-elastic-peer"));
        for var in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "DDP_TRANSPORT",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("RANK", slot.to_string())
            .env("WORLD_SIZE", "3")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.store.port().to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .env("TORCHELASTIC_RESTART_COUNT", "0")
            .env("DDP_ELASTIC", &self.range)
            .env("DDP_JOB_ID", &self.job_id)
            .env("DDP_PEER_TIMEOUT", "2")
            .env("DDP_CONNECT_TIMEOUT", "60")
            .env("RUST_LOG", "warn");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
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
        Peer {
            child,
            lines,
            seen: Vec::new(),
        }
    }
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// The number after `key` in `line` (`... key 12 ...`).
fn field(line: &str, key: &str) -> u128 {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == key {
            return words.next().unwrap().parse().unwrap();
        }
    }
    panic!("no {key} in {line:?}")
}

/// The committed steps a peer printed, in order.
fn steps(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter(|l| l.contains(" step ") && !l.contains("reformed"))
        .map(|l| field(l, "step") as u64)
        .collect()
}

/// Every step from `from` to `to` once, in order.
fn check_each_once(steps: &[u64], from: u64, to: u64, who: &str) {
    let want: Vec<u64> = (from..=to).collect();
    assert_eq!(steps, want, "{who} committed these steps");
}

/// kill -9 of one rank of three: the survivors' next step comes within a second, no step is
/// committed twice or skipped on any survivor; the slot restarted rejoins at a step boundary
/// and the world is back at three; everyone ends at the same step.
#[test]
fn survivors_go_on_and_a_restarted_rank_rejoins() {
    let job = Job::new("2:3");
    let env = [("PEER_STEPS", "150"), ("PEER_SLEEP_MS", "20")];
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 20 ", deadline);
    }
    let killed_at = now_ms();
    peers[1].child.kill().unwrap();
    let mut after = Vec::new();
    for s in [0, 2] {
        let line = peers[s].wait_for("reformed gen 2", deadline);
        assert!(line.contains("world 2"), "{line}");
        // A survivor fails the generation at the first connection lost, without the 400 ms a
        // plain group waits for an ABORT that would explain it (`health.rs`).
        assert_eq!(field(&line, "grace_ms"), 0, "{line}");
        let next = peers[s].wait_for(" world 2 step ", deadline);
        after.push(field(&next, "at") - killed_at);
    }
    assert!(
        after.iter().all(|&ms| ms < 1000),
        "the survivors' next steps came {after:?} ms after the kill"
    );
    // The launcher restarts slot 1: it joins at a step boundary.
    let mut back = job.spawn(1, &env);
    let joined = back.wait_for("healed true", deadline);
    assert!(joined.contains("world 3"), "{joined}");
    let from = field(&joined, "from") as u64;
    for s in [0, 2] {
        peers[s].wait_for(" world 3 step ", deadline);
    }
    let (status, lines) = back.finish(deadline);
    assert!(status.success(), "{}", lines.join("\n"));
    check_each_once(&steps(&lines), from + 1, 150, "the rejoined slot 1");
    for s in [0, 2] {
        let (status, lines) = peers[s].finish(deadline);
        assert!(status.success(), "{}", lines.join("\n"));
        check_each_once(&steps(&lines), 1, 150, &format!("slot {s}"));
    }
}

/// Two ranks of four die together (a node): each survivor's error blames the first, yet the
/// survivors go on at once, as each reports every connection it lost; without that, the
/// decider would wait for the unnamed one until the peer timeout + 2 s (4 s here).
#[test]
fn when_a_node_dies_the_survivors_go_on_without_waiting_for_the_timeout() {
    let job = Job::new("2:4");
    // Long sleeps between steps: the kills find the survivors outside any collective, so
    // both connections are lost before either survivor fails its step and reports.
    let env = [
        ("PEER_STEPS", "40"),
        ("PEER_SLEEP_MS", "200"),
        ("WORLD_SIZE", "4"),
    ];
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut peers: Vec<Peer> = (0..4).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 3 ", deadline);
    }
    // Both stopped first, so that neither can react to the other's death (a rank that sees a
    // death sends an ABORT, which would mark it alive); then slot 2 is killed first, so that
    // both survivors see its connection close first and blame it.
    for s in [2, 3] {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(peers[s].child.id() as i32, libc::SIGSTOP) };
    }
    let killed = Instant::now();
    peers[2].child.kill().unwrap();
    std::thread::sleep(Duration::from_millis(5));
    peers[3].child.kill().unwrap();
    for s in [0, 1] {
        let line = peers[s].wait_for("reformed gen 2", deadline);
        assert!(line.contains("world 2"), "{line}");
    }
    let took = killed.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "re-formed {took:?} after the kills (the peer timeout is 2 s)"
    );
    for s in [0, 1] {
        let (status, lines) = peers[s].finish(deadline);
        assert!(status.success(), "{}", lines.join("\n"));
        check_each_once(&steps(&lines), 1, 40, &format!("slot {s}"));
    }
}

/// A frozen (SIGSTOP) rank is removed after the peer timeout like a dead one; the job goes on.
#[test]
fn a_frozen_rank_is_removed_after_the_peer_timeout() {
    let job = Job::new("2:3");
    let env = [("PEER_STEPS", "60"), ("PEER_SLEEP_MS", "20")];
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 10 ", deadline);
    }
    let stopped = Instant::now();
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(peers[2].child.id() as i32, libc::SIGSTOP) };
    for s in [0, 1] {
        let line = peers[s].wait_for("reformed gen 2", deadline);
        assert!(line.contains("world 2"), "{line}");
        // A survivor fails the generation at the first connection lost, without the 400 ms a
        // plain group waits for an ABORT that would explain it (`health.rs`).
        assert_eq!(field(&line, "grace_ms"), 0, "{line}");
    }
    // Silence counts from the last frame heard: a heartbeat every 0.4 s (a fifth of the
    // timeout) is all the TCP link carries over shared memory, so the last one may precede the
    // stop by up to 0.4 s, more when the host is loaded; an elastic group then waits no grace.
    // Before 1.2 s, something other than the silence would have removed it.
    let took = stopped.elapsed();
    assert!(
        took >= Duration::from_millis(1200) && took < Duration::from_secs(6),
        "removed after {took:?} with DDP_PEER_TIMEOUT=2"
    );
    for s in [0, 1] {
        let (status, lines) = peers[s].finish(deadline);
        assert!(status.success(), "{}", lines.join("\n"));
        check_each_once(&steps(&lines), 1, 60, &format!("slot {s}"));
    }
}

/// A process of another job, another world range, another program or another setting (the
/// program's `compat` as settings, one `name = value` per line, as the trainers write it: here
/// another `lr`, other buckets) is refused, naming the field or the setting with both values,
/// and the job it knocked at goes on undisturbed.
#[test]
fn an_incompatible_process_is_refused_while_the_job_goes_on() {
    let job = Job::new("2:3");
    let settings = "model = peer\nlr = 0.001 (not scaled)\nbuckets = 25 MiB";
    let env = [
        ("PEER_STEPS", "80"),
        ("PEER_SLEEP_MS", "20"),
        ("PEER_COMPAT", settings),
    ];
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut peers: Vec<Peer> = (0..2).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    let other_lr = "model = peer\nlr = 0.002 (not scaled)\nbuckets = 25 MiB";
    let other_buckets = "model = peer\nlr = 0.001 (not scaled)\nbuckets = 4 MiB";
    for (extra, said) in [
        (
            vec![("DDP_JOB_ID", "another-job"), ("PEER_COMPAT", settings)],
            "job another-job",
        ),
        (
            vec![("DDP_ELASTIC", "2:4"), ("PEER_COMPAT", settings)],
            "incompatible world",
        ),
        (vec![("PEER_COMPAT", "mlp")], "another model"),
        (
            vec![("PEER_COMPAT", other_lr)],
            "lr is 0.002 (not scaled) in this process, the job runs with 0.001 (not scaled)",
        ),
        (
            vec![("PEER_COMPAT", other_buckets)],
            "buckets is 4 MiB in this process, the job runs with 25 MiB",
        ),
    ] {
        let mut stranger = job.spawn(2, &extra);
        let (status, lines) = stranger.finish(deadline);
        assert_eq!(status.code(), Some(1), "{}", lines.join("\n"));
        let all = lines.join("\n");
        assert!(all.contains("refused") && all.contains(said), "{all}");
    }
    for (s, p) in peers.iter_mut().enumerate() {
        let (status, lines) = p.finish(deadline);
        assert!(status.success(), "{}", lines.join("\n"));
        assert!(
            !lines.iter().any(|l| l.contains("reformed")),
            "{}",
            lines.join("\n")
        );
        check_each_once(&steps(&lines), 1, 80, &format!("slot {s}"));
    }
}

/// Below its minimum the job stops on every survivor, naming the rank lost, with the exit code
/// a launcher restarts the whole job on.
#[test]
fn below_the_minimum_the_job_stops_naming_the_ranks_lost() {
    let job = Job::new("3:3");
    let env = [("PEER_STEPS", "1000"), ("PEER_SLEEP_MS", "20")];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    peers[0].child.kill().unwrap();
    for s in [1, 2] {
        let (status, lines) = peers[s].finish(deadline);
        let all = lines.join("\n");
        assert_eq!(
            status.code(),
            Some(i32::from(ddp_comm::elastic::ELASTIC_STOP_EXIT)),
            "{all}"
        );
        assert!(
            all.contains("minimum of 3") && all.contains("rank 0 (slot 0"),
            "{all}"
        );
    }
}

// A second failure during a membership change (issue 57 item 5): the change becomes another
// round, and the job goes on while MIN members remain.

/// The first line with `what` in a finished peer's output.
fn line_with<'a>(lines: &'a [String], what: &str) -> &'a str {
    lines
        .iter()
        .find(|l| l.contains(what))
        .unwrap_or_else(|| panic!("no line with {what:?}; lines:\n{}", lines.join("\n")))
}

/// The survivors `slots` finish every step once, exit 0, and their first re-form after
/// `from_ms` (the wall clock of the last failure) reaches world `world`; returns the
/// milliseconds from `from_ms` to each one's next committed step.
fn survivors_finish(
    peers: &mut [Peer],
    slots: &[usize],
    steps_total: u64,
    world: usize,
    from_ms: u128,
    deadline: Instant,
) -> Vec<u128> {
    let mut after = Vec::new();
    for &s in slots {
        let (status, lines) = peers[s].finish(deadline);
        let all = lines.join("\n");
        assert!(status.success(), "slot {s}:\n{all}");
        check_each_once(&steps(&lines), 1, steps_total, &format!("slot {s}"));
        let last = lines
            .iter()
            .rfind(|l| l.contains("reformed gen"))
            .unwrap_or_else(|| panic!("slot {s} never re-formed:\n{all}"));
        assert!(
            last.contains(&format!("world {world} ")),
            "slot {s}: {last}\n{all}"
        );
        assert!(
            !all.contains("healed true"),
            "slot {s} was left out:\n{all}"
        );
        let next = lines
            .iter()
            .find(|l| l.contains(" step ") && !l.contains("reformed") && field(l, "at") > from_ms)
            .unwrap_or_else(|| panic!("slot {s}: no step after the failure:\n{all}"));
        after.push(field(next, "at") - from_ms);
    }
    after
}

/// A joiner killed once the generation that admits it is decided, before it formed its group
/// (mid-heal): the others start another round at once, re-form without it and train on.
#[test]
fn a_joiner_killed_mid_heal_leaves_the_others_training() {
    let job = Job::new("2:3");
    let env = [("PEER_STEPS", "150"), ("PEER_SLEEP_MS", "20")];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    peers[2].child.kill().unwrap();
    for s in [0, 1] {
        peers[s].wait_for("reformed gen 2", deadline);
    }
    let mut joiner = job.spawn(
        2,
        &[
            ("PEER_STEPS", "150"),
            ("DDP_TEST_ELASTIC_DIE", "2:admitted"),
        ],
    );
    let (status, lines) = joiner.finish(deadline);
    assert!(!status.success(), "{}", lines.join("\n"));
    let died = field(line_with(&lines, "kills it (admitted)"), "at");
    let after = survivors_finish(&mut peers, &[0, 1], 150, 2, died, deadline);
    eprintln!("the joiner died mid-heal; the survivors' next steps came {after:?} ms later");
    assert!(after.iter().all(|&ms| ms < 8000), "{after:?} ms");
}

/// A second rank dies during the re-form after the first loss (its report written, so it is
/// in the next generation): the survivors start another round and go on at world 2.
#[test]
fn a_second_rank_killed_during_the_re_form_leaves_the_others_training() {
    let job = Job::new("2:4");
    let env = [
        ("PEER_STEPS", "80"),
        ("PEER_SLEEP_MS", "20"),
        ("WORLD_SIZE", "4"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..4)
        .map(|s| {
            let mut env = env.to_vec();
            if s == 1 {
                env.push(("DDP_TEST_ELASTIC_DIE", "1:reported"));
            }
            job.spawn(s, &env)
        })
        .collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    peers[3].child.kill().unwrap();
    let (status, lines) = peers[1].finish(deadline);
    assert!(!status.success(), "{}", lines.join("\n"));
    let died = field(line_with(&lines, "kills it (reported)"), "at");
    let after = survivors_finish(&mut peers, &[0, 2], 80, 2, died, deadline);
    eprintln!("second death during the re-form; the survivors' next steps came {after:?} ms later");
    assert!(after.iter().all(|&ms| ms < 8000), "{after:?} ms");
}

/// The survivor that wins the decision of the next generation dies before it publishes it:
/// another survivor takes the decision over once the decider's beat stops, and the job goes on
/// at world 2.
#[test]
fn the_decider_killed_before_it_publishes_is_replaced() {
    let job = Job::new("2:4");
    let env = [
        ("PEER_STEPS", "80"),
        ("PEER_SLEEP_MS", "20"),
        ("WORLD_SIZE", "4"),
        ("DDP_TEST_ELASTIC_DIE", "any:deciding"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..4).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    peers[3].child.kill().unwrap();
    // The decider is whoever won the counter: find it by its exit.
    let mut decider = None;
    let mut died = 0;
    let until = Instant::now() + Duration::from_secs(20);
    while decider.is_none() {
        for (s, p) in peers.iter_mut().enumerate().take(3) {
            if p.child.try_wait().unwrap().is_some() {
                let (_, lines) = p.finish(deadline);
                died = field(line_with(&lines, "kills it (deciding)"), "at");
                decider = Some(s);
            }
        }
        assert!(Instant::now() < until, "no decider died");
        std::thread::sleep(Duration::from_millis(20));
    }
    let decider = decider.unwrap();
    let survivors: Vec<usize> = (0..3).filter(|&s| s != decider).collect();
    let after = survivors_finish(&mut peers, &survivors, 80, 2, died, deadline);
    eprintln!(
        "the decider (slot {decider}) died; the survivors' next steps came {after:?} ms later"
    );
    assert!(after.iter().all(|&ms| ms < 8000), "{after:?} ms");
}

/// A survivor busy for longer than the peer timeout + 2 s when the others re-form (a long
/// backward, a checkpoint write), its links and beat alive: it is waited for, not dropped.
#[test]
fn a_busy_survivor_is_waited_for_not_dropped() {
    let job = Job::new("2:3");
    let env = [
        ("PEER_STEPS", "60"),
        ("PEER_SLEEP_MS", "20"),
        ("PEER_BUSY_SLOT", "1"),
        ("PEER_BUSY_MS", "5000"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 5 ", deadline);
    }
    let killed = now_ms();
    peers[2].child.kill().unwrap();
    let busy = peers[1].wait_for("busy for", deadline);
    let after = survivors_finish(&mut peers, &[0, 1], 60, 2, killed, deadline);
    for (s, ms) in [0, 1].iter().zip(&after) {
        assert!(
            *ms >= 4500,
            "slot {s} stepped {ms} ms after the kill: {busy}"
        );
    }
    let lines = &peers[1].seen;
    assert!(
        line_with(lines, "reformed gen").contains("reformed gen 2 "),
        "{}",
        lines.join("\n")
    );
}

/// The process that wins the founding decision dies before it publishes generation 1: the
/// others take the decision over once its beat stops (the peer timeout, 2 s here), found the
/// job without it, and train every step at world 2; none waits for the connect deadline.
#[test]
fn the_founding_decider_killed_before_it_publishes_is_replaced() {
    let job = Job::new("2:3");
    let env = [
        ("PEER_STEPS", "30"),
        ("PEER_SLEEP_MS", "20"),
        ("DDP_CONNECT_TIMEOUT", "20"),
        ("DDP_TEST_ELASTIC_DIE", "any:founding"),
    ];
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    // The decider is whoever won the counter: find it by its exit.
    let mut decider = None;
    let mut died = 0;
    let until = Instant::now() + Duration::from_secs(20);
    while decider.is_none() {
        for (s, p) in peers.iter_mut().enumerate() {
            if p.child.try_wait().unwrap().is_some() {
                let (_, lines) = p.finish(deadline);
                died = field(line_with(&lines, "kills it (founding)"), "at");
                decider = Some(s);
            }
        }
        assert!(Instant::now() < until, "no founding decider died");
        std::thread::sleep(Duration::from_millis(20));
    }
    let decider = decider.unwrap();
    let mut first_steps = Vec::new();
    for s in (0..3).filter(|&s| s != decider) {
        let (status, lines) = peers[s].finish(deadline);
        let all = lines.join("\n");
        assert!(status.success(), "slot {s}:\n{all}");
        check_each_once(&steps(&lines), 1, 30, &format!("slot {s}"));
        let first = line_with(&lines, " step 1 at ");
        assert!(
            first.contains("gen 1 ") && first.contains("world 2 "),
            "slot {s}: {first}"
        );
        first_steps.push(field(first, "at") - died);
    }
    eprintln!(
        "the founding decider (slot {decider}) died; the others' first steps came \
         {first_steps:?} ms later"
    );
    assert!(
        first_steps.iter().all(|&ms| ms < 10_000),
        "{first_steps:?} ms"
    );
}

/// Every rank of a `2:3` job is killed at once (an OOM, a node-wide fault, a bad batch that
/// ends every rank), then each slot is started again, as its launcher restarts it: nobody of
/// the last generation is left to admit them, so they found a new round among themselves
/// (its members are not healed: they start from step 0, having no checkpoint) and train every
/// step. Their first step comes within seconds of their start: not after the peer timeout
/// (10 s here), nor the connect deadline that each restarted rank used to wait out.
#[test]
fn when_every_rank_dies_at_once_the_restarted_ones_found_a_new_round() {
    let job = Job::new("2:3");
    let env = [
        ("PEER_STEPS", "60"),
        ("PEER_SLEEP_MS", "20"),
        ("DDP_PEER_TIMEOUT", "10"),
        ("DDP_CONNECT_TIMEOUT", "30"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 20 ", deadline);
    }
    for p in &mut peers {
        p.child.kill().unwrap();
    }
    for p in &mut peers {
        p.child.wait().unwrap();
    }
    let restarted_at = now_ms();
    // As ddprun restarts a rank alone: its restart count, the job's round (its store keys).
    let restart = [
        ("TORCHELASTIC_RESTART_COUNT", "1"),
        ("DDP_ELASTIC_ROUND", "0"),
    ];
    let again_env = [&env[..], &restart[..]].concat();
    let mut again: Vec<Peer> = (0..3).map(|s| job.spawn(s, &again_env)).collect();
    let mut first_steps = Vec::new();
    for (s, p) in again.iter_mut().enumerate() {
        let round = p.wait_for(" new round gen ", deadline);
        assert!(
            round.contains("world 3") && field(&round, "gen") >= 2,
            "slot {s}: {round}"
        );
        let first = p.wait_for(" step 1 at ", deadline);
        first_steps.push(field(&first, "at") - restarted_at);
    }
    for (s, p) in again.iter_mut().enumerate() {
        let (status, lines) = p.finish(deadline);
        let all = lines.join("\n");
        assert!(status.success(), "slot {s}:\n{all}");
        assert!(!all.contains("healed true"), "slot {s} was healed:\n{all}");
        check_each_once(&steps(&lines), 1, 60, &format!("slot {s}"));
    }
    eprintln!(
        "every rank killed; the restarted ranks' first steps came {first_steps:?} ms after \
         their start"
    );
    assert!(
        first_steps.iter().all(|&ms| ms < 5_000),
        "{first_steps:?} ms: not within seconds of the restart"
    );
}

/// As above, and the restarted process that wins the decision of the new round dies before it
/// publishes it (`DDP_TEST_ELASTIC_DIE=any:refounding`): the other two take the decision over
/// once its beat stops (the peer timeout, 2 s here), found the round without it at world 2
/// and train every step.
#[test]
fn the_decider_of_a_new_round_killed_before_it_publishes_is_replaced() {
    let job = Job::new("2:3");
    let env = [
        ("PEER_STEPS", "40"),
        ("PEER_SLEEP_MS", "20"),
        ("DDP_CONNECT_TIMEOUT", "30"),
    ];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut peers: Vec<Peer> = (0..3).map(|s| job.spawn(s, &env)).collect();
    for p in &mut peers {
        p.wait_for("step 10 ", deadline);
    }
    for p in &mut peers {
        p.child.kill().unwrap();
        p.child.wait().unwrap();
    }
    let again_env = [
        &env[..],
        &[
            ("TORCHELASTIC_RESTART_COUNT", "1"),
            ("DDP_ELASTIC_ROUND", "0"),
            ("DDP_TEST_ELASTIC_DIE", "any:refounding"),
        ],
    ]
    .concat();
    let mut again: Vec<Peer> = (0..3).map(|s| job.spawn(s, &again_env)).collect();
    let mut decider = None;
    while decider.is_none() {
        for (s, p) in again.iter_mut().enumerate() {
            if p.child.try_wait().unwrap().is_some() {
                let (_, lines) = p.finish(deadline);
                line_with(&lines, "kills it (refounding)");
                decider = Some(s);
            }
        }
        assert!(
            Instant::now() < deadline,
            "no decider of the new round died"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let decider = decider.unwrap();
    for s in (0..3).filter(|&s| s != decider) {
        let (status, lines) = again[s].finish(deadline);
        let all = lines.join("\n");
        assert!(status.success(), "slot {s}:\n{all}");
        let round = line_with(&lines, " new round gen ");
        assert!(round.contains("world 2"), "slot {s}: {round}");
        check_each_once(&steps(&lines), 1, 40, &format!("slot {s}"));
    }
}
