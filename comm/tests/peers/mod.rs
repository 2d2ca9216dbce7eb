//! Running `ddp-comm-peer` processes for the process tests (`processes.rs`, `liveness.rs`):
//! start them with torchrun's variables, read their lines, and check who they blame.

#![allow(dead_code)] // each test binary uses a subset

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// One running `ddp-comm-peer`; killed when dropped, so a failing test leaves no process behind.
pub struct Peer {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
}

impl Peer {
    /// Waits for the process to exit, at most until `deadline` (then panics, naming `rank`).
    pub fn exit_status_by(&mut self, deadline: Instant, rank: usize) -> std::process::ExitStatus {
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rank {rank} did not exit in time"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `world` peers running `op` in a loop forever (pausing `sleep_ms` between steps), each
/// with torchrun's variables. Rank 0 hosts the store on a listener bound here and inherited as
/// descriptor 3, so no port can be taken by someone else in between.
pub fn start(world: usize, op: &str, elems: usize, sleep_ms: u64) -> Vec<Peer> {
    start_with(world, op, elems, sleep_ms, &[])
}

/// [`start`] with extra variables `env` (over the defaults of [`spawn_peer`]).
pub fn start_with(
    world: usize,
    op: &str,
    elems: usize,
    sleep_ms: u64,
    env: &[(&str, &str)],
) -> Vec<Peer> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let fd = listener.as_raw_fd();
    let spec = Spec {
        world,
        op,
        elems,
        sleep_ms,
        master: ("127.0.0.1", port),
        env,
    };
    (0..world)
        .map(|rank| spawn_peer(&spec, rank, (rank == 0).then_some(fd), None))
        .collect()
}

/// What every peer of a test runs.
pub struct Spec<'a> {
    pub world: usize,
    pub op: &'a str,
    pub elems: usize,
    pub sleep_ms: u64,
    pub master: (&'a str, u16),
    /// Extra variables (they override the defaults below).
    pub env: &'a [(&'a str, &'a str)],
}

/// Starts one `ddp-comm-peer` as `rank` of `spec`: rank 0 gets `listen_fd` (a bound listener) as
/// descriptor 3 when given; `netns` runs it inside that network namespace (`ip netns exec`,
/// which execs the peer in place: the child's pid is the peer's).
pub fn spawn_peer(spec: &Spec, rank: usize, listen_fd: Option<i32>, netns: Option<&str>) -> Peer {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_ddp-comm-peer")]);
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_ddp-comm-peer")),
    };
    for var in [
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "DDP_TOKEN",
        "DDP_SEGMENT_BYTES",
        "DDP_SMALL_ALLREDUCE_BYTES",
        "DDP_PEER_TIMEOUT",
        "DDP_TRACE_DIR",
        "DDP_STORE_FD",
        "PEER_SLEEP_RANK",
        "DDP_TRANSPORT",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", spec.world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", spec.world.to_string())
        .env("MASTER_ADDR", spec.master.0)
        .env("MASTER_PORT", spec.master.1.to_string())
        // A long deadline: the failure must be detected from the closed socket.
        .env("DDP_TIMEOUT", "60")
        .env("DDP_CONNECT_TIMEOUT", "20")
        .env("DDP_SEGMENT_BYTES", "65536")
        .env("PEER_STEPS", "0")
        .env("PEER_OP", spec.op)
        .env("PEER_ELEMS", spec.elems.to_string())
        .env("PEER_SLEEP_MS", spec.sleep_ms.to_string())
        .envs(spec.env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(fd) = listen_fd {
        cmd.env("DDP_STORE_FD", "3");
        // SAFETY: dup2 and fcntl are async-signal-safe; they give the child the listener as
        // descriptor 3 without close-on-exec (dup2 onto itself keeps the flag, hence the
        // fcntl).
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 || libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().expect("start ddp-comm-peer");
    let out = child.stdout.take().unwrap();
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    Peer { child, lines }
}

/// Waits until every peer has reported `steps` successful steps.
pub fn wait_for_steps(peers: &[Peer], steps: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    for (rank, p) in peers.iter().enumerate() {
        let mut ok = 0;
        while ok < steps {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = p
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("rank {rank} did not report {steps} steps"));
            assert!(!line.contains("error"), "rank {rank}: {line}");
            if line.contains(" ok") {
                ok += 1;
            }
        }
    }
}

/// Kills `victim` with SIGKILL and checks that every other peer exits with an error that blames
/// exactly the victim within 10 seconds. Returns the slowest survivor's detection time.
pub fn kill_and_check(mut peers: Vec<Peer>, victim: usize) -> Duration {
    peers[victim].child.kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let _ = peers[victim].child.wait();
    let blames: Vec<Option<usize>> = (0..peers.len())
        .map(|r| (r != victim).then_some(victim))
        .collect();
    expect_blame(&mut peers, &blames, killed_at, Duration::from_secs(10))
}

/// Checks that every peer `r` with `blames[r] == Some(k)` prints an error blaming exactly rank
/// `k` and exits with code 3 within `limit` of `since`. Returns the slowest detection time.
pub fn expect_blame(
    peers: &mut [Peer],
    blames: &[Option<usize>],
    since: Instant,
    limit: Duration,
) -> Duration {
    let mut slowest = Duration::ZERO;
    for (rank, p) in peers.iter_mut().enumerate() {
        let Some(victim) = blames[rank] else { continue };
        // Read lines until the error line (or the deadline).
        let deadline = since + limit;
        let error = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.lines.recv_timeout(left) {
                Ok(line) if line.contains("error") => break line,
                Ok(_) => continue,
                Err(_) => panic!(
                    "rank {rank} did not fail within {limit:?} (expected it to name rank {victim})"
                ),
            }
        };
        slowest = slowest.max(since.elapsed());
        let status = loop {
            if let Some(s) = p.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline + Duration::from_secs(5) {
                panic!("rank {rank} did not exit after: {error}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.code(), Some(3), "rank {rank}: {error}");
        // The peer prints the rank its error blames (`CommError::peer`) before the message:
        // it must be the victim, not a rank that failed because of it.
        assert!(
            error.starts_with(&format!("rank {rank} error (blames rank {victim}): ")),
            "rank {rank} does not blame rank {victim}: {error}"
        );
        // And the message itself leads the user to the victim.
        assert!(
            error.contains(&format!("rank {victim} ")),
            "rank {rank}: {error}"
        );
    }
    slowest
}
