//! Which processes of a rank are stopped (`SIGSTOP`, `SIGTSTP`, a debugger's stop): a frozen
//! rank, as the other ranks name it.
//!
//! A stopped process runs no signal handler until it is continued: it writes no flight record
//! when asked (`SIGUSR1`), and a `SIGTERM` stays pending until `SIGKILL` ends the grace
//! period. Waiting for either would only delay the root-cause box (by the flight-record wait
//! and the whole grace period: 2.5 s and 5 s by default). So the launcher
//! asks no stopped process for its record, and kills a stopped process at once instead of
//! giving it a grace period; the rank's other processes get the usual `SIGTERM`.
//!
//! Linux only (the state is read from `/proc/<pid>/stat`); elsewhere no process counts as
//! stopped, and the launcher waits as before.

/// Whether process `pid` is stopped (state `T`, or `t`: stopped by a tracer).
pub(crate) fn is_stopped(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _)| state == 'T' || state == 't')
}

/// The stopped processes of process group `pgid` (a rank's group: the rank and everything it
/// started).
pub(crate) fn stopped_in_group(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            stat(pid).is_some_and(|(state, group)| group == pgid && (state == 'T' || state == 't'))
        })
        .collect()
}

/// The state letter and process group of `pid`, from `/proc/<pid>/stat` (`pid (comm) S ppid
/// pgrp ...`; the command name may hold spaces and parentheses, so fields count from the last
/// `)`).
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(") ")?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let pgrp = fields.nth(1)?.parse().ok()?;
    Some((state, pgrp))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;
    use std::time::{Duration, Instant};

    /// A sleeping process is not stopped; after `SIGSTOP` it is, alone in its group.
    #[test]
    fn a_stopped_process_is_seen_stopped() {
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!is_stopped(pid));
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !is_stopped(pid) {
            assert!(Instant::now() < deadline, "not stopped within 5 s");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(stopped_in_group(pid), vec![pid]);
        let _ = child.kill();
        let _ = child.wait();
        assert!(!is_stopped(pid), "a reaped process is no longer there");
    }
}
