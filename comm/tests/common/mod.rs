//! Helpers shared by the integration tests: groups of threads on 127.0.0.1, deterministic data.
#![allow(dead_code)]

use std::net::TcpListener;
use std::time::Duration;

use ddp_comm::{GroupBuilder, ProcessGroup};

/// Timeouts short enough that a broken test fails fast.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `f(rank, group)` on `world` threads that each join a group on 127.0.0.1 (rank 0 hosts
/// the store on a listener bound to port 0, so tests never collide). `tune` adjusts every rank's
/// builder. Returns the results in rank order.
pub fn run_group<R: Send>(
    world: usize,
    tune: impl Fn(usize, GroupBuilder) -> GroupBuilder + Sync,
    f: impl Fn(usize, ProcessGroup) -> R + Sync,
) -> Vec<R> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mut b = ProcessGroup::builder()
                    .no_env()
                    .rank(rank)
                    .world_size(world)
                    .master_addr("127.0.0.1")
                    .master_port(port)
                    .timeout(TIMEOUT)
                    .connect_timeout(TIMEOUT);
                if rank == 0 {
                    b = b.master_listener(listener.take().unwrap());
                }
                let b = tune(rank, b);
                let f = &f;
                s.spawn(move || {
                    let pg = b
                        .build()
                        .unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
                    f(rank, pg)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Like [`run_group`], but hands `f` the result of `build()` (which may be an error).
pub fn try_group<R: Send>(
    world: usize,
    tune: impl Fn(usize, GroupBuilder) -> GroupBuilder + Sync,
    f: impl Fn(usize, Result<ProcessGroup, ddp_comm::CommError>) -> R + Sync,
) -> Vec<R> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let mut b = ProcessGroup::builder()
                    .no_env()
                    .rank(rank)
                    .world_size(world)
                    .master_addr("127.0.0.1")
                    .master_port(port)
                    .timeout(TIMEOUT)
                    .connect_timeout(TIMEOUT);
                if rank == 0 {
                    b = b.master_listener(listener.take().unwrap());
                }
                let b = tune(rank, b);
                let f = &f;
                s.spawn(move || f(rank, b.build()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A float in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

/// A port nothing listens on (bound, read and released).
pub fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
