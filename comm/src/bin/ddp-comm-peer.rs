//! Test helper: joins a process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
//! MASTER_PORT, DDP_TIMEOUT, ...) and runs collectives in a loop, printing one line per step
//! (`rank R step N ok`) and, on failure, `rank R error (blames rank K): <message>` before
//! exiting with code 3.
//!
//! Used by comm's integration tests (a rank killed with SIGKILL, ...) and handy for trying a
//! launcher: `ddprun --nproc-per-node 3 ddp-comm-peer`.
//!
//! Variables of its own: `PEER_STEPS` (default 20; 0 runs until an error), `PEER_ELEMS`
//! (all-reduce length, default 100000), `PEER_SLEEP_MS` (pause between steps, default 0;
//! with `PEER_SLEEP_RANK=R` only rank R pauses: a rank in a long step),
//! `PEER_OP` (`all_reduce` (default) or `barrier`), `PEER_LISTEN_FD` (rank 0 only: an inherited,
//! already bound listening socket to host the store on, so that a test needs no free-port guess).
//!
//! The error line names the rank the error blames (`CommError::peer`): `rank R error (blames
//! rank K): <message>`, or `(blames nobody)`.

use std::io::Write;
use std::time::Duration;

use ddp_comm::{ProcessGroup, ReduceOp};

fn var(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let steps = var("PEER_STEPS", 20);
    let elems = var("PEER_ELEMS", 100_000) as usize;
    let sleep = Duration::from_millis(var("PEER_SLEEP_MS", 0));
    let op = std::env::var("PEER_OP").unwrap_or_else(|_| "all_reduce".into());
    let mut builder = ProcessGroup::builder();
    if let Some(fd) = std::env::var("PEER_LISTEN_FD")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        use std::os::fd::FromRawFd;
        // SAFETY: the parent passed this descriptor (a bound, listening TCP socket) for this
        // process to own; nothing else in this process uses it.
        builder = builder.master_listener(unsafe { std::net::TcpListener::from_raw_fd(fd) });
    }
    let pg = match builder.build() {
        Ok(pg) => pg,
        Err(e) => {
            println!("error: {e}");
            ddp_comm::launch::record_error(&e.to_string());
            std::process::exit(3);
        }
    };
    let rank = pg.rank();
    let world = pg.world_size();
    let mut step = 0u64;
    while steps == 0 || step < steps {
        let result = if op == "barrier" {
            pg.barrier()
        } else {
            let buf: Vec<f32> = (0..elems).map(|i| (i % 7) as f32 + rank as f32).collect();
            pg.all_reduce(buf, ReduceOp::Sum).map(|out| {
                let want = |i: usize| (world * (i % 7)) as f32 + (world * (world - 1) / 2) as f32;
                if let Some((i, v)) = out.iter().enumerate().find(|(i, v)| **v != want(*i)) {
                    println!(
                        "rank {rank} error: wrong value {v} at {i}, expected {}",
                        want(i)
                    );
                    std::process::exit(4);
                }
            })
        };
        match result {
            Ok(()) => println!("rank {rank} step {step} ok"),
            Err(e) => {
                let blamed = e
                    .peer()
                    .map_or_else(|| "nobody".to_string(), |p| format!("rank {p}"));
                println!("rank {rank} error (blames {blamed}): {e}");
                ddp_comm::launch::record_error(&e.to_string());
                let _ = std::io::stdout().flush();
                std::process::exit(3);
            }
        }
        let _ = std::io::stdout().flush();
        step += 1;
        if std::env::var("PEER_SLEEP_RANK").map_or(true, |r| r == rank.to_string()) {
            std::thread::sleep(sleep);
        }
    }
    println!("rank {rank} done");
}
