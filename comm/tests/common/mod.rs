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
    try_group(world, tune, |rank, built| {
        let pg = built.unwrap_or_else(|e| panic!("rank {rank} could not join: {e}"));
        f(rank, pg)
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

/// A port on 127.0.0.1 that refuses connections for as long as the returned guard lives: a
/// socket bound to it but not listening holds it, so no other process can take it meanwhile (a
/// port merely bound and released could be reused by anyone before the test connects).
pub fn refusing_port() -> (std::os::fd::OwnedFd, u16) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns; the address structs are
    // fully initialised before use.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let guard = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        addr.sin_port = 0;
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let rc = libc::bind(fd, &addr as *const _ as *const libc::sockaddr, len);
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        let mut bound: libc::sockaddr_in = std::mem::zeroed();
        let mut blen = len;
        let rc = libc::getsockname(fd, &mut bound as *mut _ as *mut libc::sockaddr, &mut blen);
        assert_eq!(rc, 0, "getsockname: {}", std::io::Error::last_os_error());
        (guard, u16::from_be(bound.sin_port))
    }
}
