//! Liveness on a loaded host: the default liveness deadline (`DDP_PEER_TIMEOUT`, 7 s) must not
//! take a busy rank for a dead one. Four real ranks (`ddp-comm-peer`) pinned to two cores
//! all-reduce 256 MiB back to back, over shared memory and over TCP, for three times the
//! deadline and more; no rank may see a liveness error (or any error). The other side of the
//! promise (a frozen rank or a cut link is named within 10 s) is in `processes.rs`.
//!
//! A test binary of its own, so that this load (4 processes, about 1 GiB each) never runs beside
//! the timed tests of `processes.rs`; its two tests take turns.

mod peers;

use std::net::TcpListener;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ddp_comm::DEFAULT_PEER_TIMEOUT;
use peers::{spawn_peer, Peer, Spec};

/// The two tests take turns: each is the load.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Restricts the calling thread, and so every process it starts from now on, to the first two
/// CPUs it may run on; returns how many it got (1 on a one-core machine).
fn pin_to_two_cores() -> usize {
    // SAFETY: plain system calls on a zeroed cpu_set_t of the calling thread (pid 0).
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        assert_eq!(libc::sched_getaffinity(0, size, &mut allowed), 0);
        let mut two: libc::cpu_set_t = std::mem::zeroed();
        let mut got = 0;
        for cpu in 0..libc::CPU_SETSIZE as usize {
            if got < 2 && libc::CPU_ISSET(cpu, &allowed) {
                libc::CPU_SET(cpu, &mut two);
                got += 1;
            }
        }
        assert_eq!(libc::sched_setaffinity(0, size, &two), 0);
        got
    }
}

/// Runs 4 ranks on 2 cores all-reducing 256 MiB over `transport` with the default liveness
/// deadline until three deadlines and a second have passed; every rank must finish without an
/// error, after at least 2 all-reduces (the load was real).
fn busy_ranks_are_never_taken_for_dead(transport: &str) {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let cores = pin_to_two_cores();
    let window = DEFAULT_PEER_TIMEOUT * 3 + Duration::from_secs(1);
    let seconds = window.as_secs_f64().to_string();
    let env = [
        ("DDP_TRANSPORT", transport),
        ("PEER_SECONDS", seconds.as_str()),
        // The default segments (1 MiB), as a user's job has them, instead of the tests' 64 KiB.
        ("DDP_SEGMENT_BYTES", "1048576"),
        ("DDP_TIMEOUT", "120"),
    ];
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let spec = Spec {
        world: 4,
        op: "all_reduce",
        elems: 64 << 20, // 256 MiB of f32
        sleep_ms: 0,
        master: ("127.0.0.1", listener.local_addr().unwrap().port()),
        env: &env,
    };
    let fd = listener.as_raw_fd();
    let started = Instant::now();
    let mut peers: Vec<Peer> = (0..4)
        .map(|rank| spawn_peer(&spec, rank, (rank == 0).then_some(fd), None))
        .collect();
    let deadline = started + window + Duration::from_secs(180);
    let mut steps = Vec::new();
    for (rank, p) in peers.iter_mut().enumerate() {
        let mut ok = 0;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = p.lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!("rank {rank} did not finish within {:?}", deadline - started)
            });
            assert!(
                !line.contains("error"),
                "rank {rank} ({transport}, {cores} cores, after {:?}): {line}",
                started.elapsed()
            );
            if line.starts_with(&format!("rank {rank} step ")) && line.ends_with(" ok") {
                ok += 1;
            }
            if line.starts_with(&format!("rank {rank} done")) {
                break;
            }
        }
        let status = p.exit_status_by(deadline, rank);
        assert!(status.success(), "rank {rank} exited with {status}");
        steps.push(ok);
    }
    let took = started.elapsed();
    assert!(took >= window, "the run took {took:?}");
    assert!(
        steps.iter().all(|&n| n >= 2),
        "every rank must have all-reduced 256 MiB at least twice: {steps:?}"
    );
    eprintln!(
        "{transport}: 4 ranks on {cores} cores, {} all-reduces of 256 MiB each in {took:?} \
         (liveness deadline {DEFAULT_PEER_TIMEOUT:?}): no false alarm",
        steps[0]
    );
}

#[test]
fn four_ranks_on_two_cores_all_reducing_256_mib_over_shared_memory_are_never_taken_for_dead() {
    busy_ranks_are_never_taken_for_dead("shm");
}

#[test]
fn four_ranks_on_two_cores_all_reducing_256_mib_over_tcp_are_never_taken_for_dead() {
    busy_ranks_are_never_taken_for_dead("tcp");
}
