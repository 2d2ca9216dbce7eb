//! Real processes (the `ddp-comm-peer` helper binary): a rank killed with SIGKILL makes every
//! other rank fail within seconds, naming it.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

struct Peer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

/// Starts `world` peers running `op` in a loop forever (pausing `sleep_ms` between steps), each
/// with torchrun's variables.
fn start(world: usize, op: &str, elems: usize, sleep_ms: u64) -> Vec<Peer> {
    let port = common::closed_port();
    (0..world)
        .map(|rank| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddp-comm-peer"));
            for var in [
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "DDP_TOKEN",
                "DDP_SEGMENT_BYTES",
                "DDP_SMALL_ALLREDUCE_BYTES",
            ] {
                cmd.env_remove(var);
            }
            cmd.env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                // A long deadline: the failure must be detected from the closed socket.
                .env("DDP_TIMEOUT", "60")
                .env("DDP_CONNECT_TIMEOUT", "20")
                .env("DDP_SEGMENT_BYTES", "65536")
                .env("PEER_STEPS", "0")
                .env("PEER_OP", op)
                .env("PEER_ELEMS", elems.to_string())
                .env("PEER_SLEEP_MS", sleep_ms.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
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
        })
        .collect()
}

/// Waits until every peer has reported `steps` successful steps.
fn wait_for_steps(peers: &[Peer], steps: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
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

/// Kills `victim` with SIGKILL and checks that every other peer exits with an error naming it
/// within 10 seconds.
fn kill_and_check(mut peers: Vec<Peer>, victim: usize) {
    peers[victim].child.kill().unwrap(); // SIGKILL
    let killed_at = Instant::now();
    let _ = peers[victim].child.wait();
    for (rank, p) in peers.iter_mut().enumerate() {
        if rank == victim {
            continue;
        }
        // Read lines until the error line (or the deadline).
        let deadline = killed_at + Duration::from_secs(10);
        let error = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match p.lines.recv_timeout(left) {
                Ok(line) if line.contains("error") => break line,
                Ok(_) => continue,
                Err(_) => {
                    let _ = p.child.kill();
                    panic!("rank {rank} did not fail within 10 s of rank {victim}'s death");
                }
            }
        };
        let status = loop {
            if let Some(s) = p.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() > deadline {
                let _ = p.child.kill();
                panic!("rank {rank} did not exit after: {error}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.code(), Some(3), "rank {rank}: {error}");
        assert!(
            error.contains(&format!("rank {victim}")),
            "rank {rank} does not name rank {victim}: {error}"
        );
        eprintln!(
            "rank {rank} failed {:?} after the kill: {error}",
            killed_at.elapsed()
        );
    }
}

#[test]
fn sigkill_during_ring_all_reduce_is_named_by_every_rank() {
    // 300k f32 (1.2 MB) is above the small-buffer threshold: the ring runs, back to back, so
    // the kill lands in the middle of a collective.
    let peers = start(4, "all_reduce", 300_000, 0);
    wait_for_steps(&peers, 3);
    kill_and_check(peers, 2);
}

#[test]
fn sigkill_of_rank_0_during_barriers_is_named_by_every_rank() {
    // Rank 0 also hosts the rendezvous store: its death must not matter beyond its sockets.
    let peers = start(3, "barrier", 0, 5);
    wait_for_steps(&peers, 5);
    kill_and_check(peers, 0);
}
