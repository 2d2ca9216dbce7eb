//! Where every rank is: the ranks' flight records (`ddp_comm::flight`) merged into a hang report.
//! The launcher asks the ranks for fresh records with SIGUSR1 (only ranks that said they handle
//! it, through the marker file their process group leaves), before it stops them after a
//! failure, when it is interrupted (a user who interrupts a job has usually found it hanging),
//! and when it receives SIGUSR1 itself.

use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use crate::config::LaunchConfig;
use crate::output::notice;
use crate::ranks::Rank;

/// How long the launcher waits for the ranks' flight records after asking with SIGUSR1 (their
/// liveness threads answer within a second).
const FLIGHT_WAIT: Duration = Duration::from_millis(2500);

/// Sends SIGUSR1 to every running rank that handles it (it left the marker of a process group
/// with a trace directory) and is not stopped, and waits up to [`FLIGHT_WAIT`] until each has written a fresh flight
/// record, written one on its failure, or exited. Returns the hang report (empty when no rank
/// was asked).
pub(crate) fn ask_for_flight_records(ranks: &mut [Rank], dir: &Path) -> String {
    let asked_at = ddp_comm::flight::now_us();
    let mut asked = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        // A stopped rank cannot answer before the wait is over (see `frozen.rs`).
        if r.exit.is_none()
            && dir.join(ddp_comm::flight::handler_marker(r.rank)).exists()
            && !crate::frozen::is_stopped(r.child.id())
        {
            // Only the rank itself: what it started may not handle SIGUSR1.
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(r.child.id() as libc::pid_t, libc::SIGUSR1) };
            asked.push(i);
        }
    }
    if asked.is_empty() {
        return String::new();
    }
    let deadline = Instant::now() + FLIGHT_WAIT;
    loop {
        let (dumps, _) = ddp_comm::flight::read_dumps(dir);
        let answered = |r: &mut Rank| {
            // (`try_wait` keeps the status for the watch loop's own look.)
            dumps
                .iter()
                .any(|d| d.rank == r.rank && (d.written_us >= asked_at || d.reason == "failure"))
                || r.exit.is_some()
                || matches!(r.child.try_wait(), Ok(Some(_)))
        };
        let all = asked.iter().all(|&i| answered(&mut ranks[i]));
        if all || Instant::now() >= deadline {
            let world = ranks.iter().map(|r| r.rank + 1).max().unwrap_or(0);
            return ddp_comm::flight::hang_report(&dumps, world);
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The hang report of this node's ranks from whatever flight records they left.
pub(crate) fn hang_report_of(dir: &Path, config: &LaunchConfig) -> Option<String> {
    let (mut dumps, _) = ddp_comm::flight::read_dumps(dir);
    let local: Vec<usize> = (0..config.nproc_per_node)
        .map(|l| config.global_rank(l))
        .collect();
    dumps.retain(|d| local.contains(&d.rank));
    if dumps.is_empty() {
        return None;
    }
    let report = ddp_comm::flight::hang_report(&dumps, config.world_size());
    // Ranks of other nodes are not ours to report as missing.
    let report: Vec<&str> = report
        .lines()
        .filter(|l| !l.contains("left no flight record") || config.nnodes == 1)
        .collect();
    Some(report.join("\n"))
}

/// Prints a hang report as the launcher's notices.
pub(crate) fn print_hang_report(report: &str, dir: &Path) {
    if report.trim().is_empty() {
        return;
    }
    notice(&format!("flight records (in {}):", dir.display()));
    for line in report.lines() {
        notice(&format!("  {line}"));
    }
}
