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
//! `PEER_OP` (`all_reduce` (default), `barrier`, or `digest`: an all-reduce (sum) of
//! `PEER_ELEMS` values of [`peer_value`] (`PEER_VALUES=float`, the default for `digest`, or
//! `int`: small integers, whose sums are exact in any order), printing `rank R step N digest H`
//! with H the FNV-1a hash of the result's bytes, in hex). Rank 0 hosts the store on
//! the listening socket its launcher (or test) hands it through `DDP_STORE_FD`, when it has one
//! (`ddp_comm::elastic::STORE_FD_ENV`), so that a test needs no free-port guess.
//!
//! `PEER_SECONDS=S` (with `PEER_STEPS=0`): steps until S seconds have passed since the group
//! formed, on any rank's clock; the ranks agree on the last step through a one-float all-reduce
//! (max) after each step, so every rank runs the same number of collectives.
//!
//! `PEER_EXIT_RANK=R` with `PEER_EXIT_STEP=N`: rank R exits with code 7 after step N (on the
//! first attempt only, unless `PEER_EXIT_ALWAYS=1`). `PEER_STOP_RANK=R` with `PEER_STOP_STEP=N`:
//! rank R stops itself with SIGSTOP after step N (a frozen rank: its sockets stay open, it sends
//! nothing).
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

/// Element `i` of `rank`'s input for `PEER_OP=digest`: from a splitmix64 of (rank, i), a float
/// in [-1, 1) or (`ints`) an integer in -8..8. Tests compute the expected sums from the same
/// formula.
pub fn peer_value(rank: usize, i: usize, ints: bool) -> f32 {
    let mut z = ((rank as u64) << 40 ^ i as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    if ints {
        (z % 16) as f32 - 8.0
    } else {
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn main() {
    let steps = var("PEER_STEPS", 20);
    let elems = var("PEER_ELEMS", 100_000) as usize;
    let sleep = Duration::from_millis(var("PEER_SLEEP_MS", 0));
    let op = std::env::var("PEER_OP").unwrap_or_else(|_| "all_reduce".into());
    let pg = match ProcessGroup::from_env() {
        Ok(pg) => pg,
        Err(e) => {
            println!("error: {e}");
            ddp_comm::elastic::record_error(&e.to_string());
            std::process::exit(3);
        }
    };
    let rank = pg.rank();
    let world = pg.world_size();
    let attempt = var(ddp_comm::elastic::RESTART_COUNT_ENV, 0);
    let exit_at = (std::env::var("PEER_EXIT_RANK").ok() == Some(rank.to_string())
        && (attempt == 0 || std::env::var("PEER_EXIT_ALWAYS").is_ok_and(|v| v == "1")))
    .then(|| var("PEER_EXIT_STEP", 0));
    let stop_at = (std::env::var("PEER_STOP_RANK").ok() == Some(rank.to_string()))
        .then(|| var("PEER_STOP_STEP", 0));
    let seconds = std::env::var("PEER_SECONDS")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map(Duration::from_secs_f64);
    let started = std::time::Instant::now();
    let mut step = 0u64;
    while steps == 0 || step < steps {
        let result = if op == "barrier" {
            pg.barrier()
        } else if op == "digest" {
            let ints = std::env::var("PEER_VALUES").is_ok_and(|v| v == "int");
            let buf: Vec<f32> = (0..elems).map(|i| peer_value(rank, i, ints)).collect();
            pg.all_reduce(buf, ReduceOp::Sum).map(|out| {
                let hash = ddp_comm::hash::fnv1a(bytemuck::cast_slice(&out));
                println!("rank {rank} step {step} digest {hash:016x}");
            })
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
        // Time's up on some rank's clock: every rank stops after this step.
        let result = result.and_then(|()| match seconds {
            None => Ok(false),
            Some(s) => {
                let over = f32::from(u8::from(started.elapsed() >= s));
                pg.all_reduce(vec![over], ReduceOp::Max).map(|v| v[0] > 0.0)
            }
        });
        let last = match result {
            Ok(last) => {
                println!("rank {rank} step {step} ok");
                last
            }
            Err(e) => {
                let blamed = e
                    .peer()
                    .map_or_else(|| "nobody".to_string(), |p| format!("rank {p}"));
                println!("rank {rank} error (blames {blamed}): {e}");
                ddp_comm::elastic::record_error(&e.to_string());
                let _ = std::io::stdout().flush();
                std::process::exit(3);
            }
        };
        let _ = std::io::stdout().flush();
        if last {
            break;
        }
        if exit_at == Some(step) {
            println!("rank {rank} exits with code 7 at step {step} (PEER_EXIT_RANK)");
            let _ = std::io::stdout().flush();
            std::process::exit(7);
        }
        if stop_at == Some(step) {
            println!("rank {rank} stops itself (SIGSTOP) at step {step} (PEER_STOP_RANK)");
            let _ = std::io::stdout().flush();
            // SAFETY: kill(2) of this very process; it only sends a signal.
            unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGSTOP) };
        }
        step += 1;
        if std::env::var("PEER_SLEEP_RANK").map_or(true, |r| r == rank.to_string()) {
            std::thread::sleep(sleep);
        }
    }
    println!("rank {rank} done (attempt {attempt})");
}
