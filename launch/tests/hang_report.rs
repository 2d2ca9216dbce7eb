//! The launcher library against real ranks (comm's `ddp-comm-peer` helper binary): the
//! root-cause report of a failed job.

#[path = "../../apps/tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use ddp_launch::{launch, root_cause_box, LaunchConfig, LaunchError};

/// The launcher's root cause quotes the failed rank's own error (from the error file it wrote)
/// and says where every rank was: rank 2 is in a long step (alive: heartbeats flow) and never
/// enters all_reduce #1, in which ranks 0 and 1 time out (DDP_TIMEOUT=3).
#[test]
fn the_launcher_quotes_the_error_and_reports_who_never_entered() {
    let command = [
        "env",
        "DDP_TIMEOUT=3",
        "PEER_STEPS=0",
        "PEER_ELEMS=1000",
        "PEER_SLEEP_MS=30000",
        "PEER_SLEEP_RANK=2",
    ];
    let peer = common::workspace_bin("ddp-comm-peer");
    let mut argv: Vec<std::ffi::OsString> = command.iter().map(Into::into).collect();
    argv.push(peer.into());
    let mut config = LaunchConfig::new(3, argv);
    config.grace_period = Duration::from_secs(1);
    config.forward_signals = false; // tests share the process: no signal handlers
    let started = Instant::now();
    let error = launch(&config).expect_err("a rank fails");
    let the_box = root_cause_box(&error).expect("a failed rank has a root-cause box");
    assert!(
        the_box
            .lines()
            .nth(2)
            .is_some_and(|l| l.starts_with("  rank 2 (local rank 2) is the rank at fault")),
        "{the_box}"
    );
    let LaunchError::RankFailed(failure) = error else {
        panic!("expected a failed rank, got {error:?}");
    };
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
    if let Some(dir) = &failure.trace_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    assert!(failure.rank < 2, "{failure:?}");
    // The failure is about rank 2, which the first rank's error blames (it was still running, in
    // its long step, when the launcher stopped the ranks).
    let blamed = failure.blamed.clone().expect("the error names rank 2");
    assert_eq!(
        (blamed.rank, blamed.local_rank, blamed.stopped),
        (2, Some(2), true),
        "{failure:?}"
    );
    assert_eq!(failure.culprit(), 2);
    let message = failure.message.clone().unwrap_or_default();
    assert!(
        message.contains("all_reduce #1") && message.contains("rank 2"),
        "the root cause quotes the rank's error: {failure:?}"
    );
    let report = failure.hang_report.clone().unwrap_or_default();
    assert!(
        report
            .lines()
            .any(|l| l == "rank 2 last completed all_reduce #0 and never entered #1"),
        "{report}"
    );
    for rank in [0, 1] {
        assert!(
            report.lines().any(|l| {
                (l.starts_with(&format!("rank {rank} ")) || l.starts_with("ranks 0, 1 "))
                    && l.contains("all_reduce #1")
            }),
            "rank {rank} is reported in all_reduce #1: {report}"
        );
    }
}
