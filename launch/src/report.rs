//! The root cause of a failed job: which rank failed first, its error in its own words, the rank
//! its error blames ([`diagnose`]), and the box `ddprun` ends with ([`root_cause_box`]).
//!
//! Why the blamed rank: the first rank to exit is often not the one at fault. When rank 1 of 3
//! freezes, ranks 0 and 2 time out naming rank 1 and exit, and rank 1 only ends when the
//! launcher stops it; when rank 1 dies, rank 0 may notice and exit within the same poll of the
//! launcher. A rank whose process group failed writes the rank the failure blames into its
//! error file (`ddp_comm::elastic::record_error`); the box headlines that rank and quotes the
//! first exit on its second line.

use std::path::Path;

use ddp_comm::elastic::read_error_file;

use crate::config::LaunchConfig;
use crate::error::{BlamedRank, LaunchError, RankFailure};
use crate::output::error_lines;
use crate::ranks::{error_file, Rank};

/// The failure of `first`, the first local rank to fail, once every rank has ended: its error
/// (its error file in `trace_dir`, else its output's last error lines) and the rank that error
/// blames, with how that rank ended when it is one of `ranks`.
pub(crate) fn diagnose(
    first: &Rank,
    ranks: &[Rank],
    config: &LaunchConfig,
    trace_dir: &Path,
) -> RankFailure {
    let exit = first.exit.expect("a failed rank has ended");
    let record = read_error_file(&error_file(trace_dir, first.rank));
    let message = record
        .as_ref()
        .map(|r| r.message.clone())
        .or_else(|| error_lines(&first.tail));
    let blamed = record
        .and_then(|r| r.blamed_rank)
        .filter(|&b| b != first.rank && b < config.world_size())
        .map(|b| {
            let local = ranks.iter().find(|r| r.rank == b);
            BlamedRank {
                rank: b,
                local_rank: local.map(|r| r.local_rank),
                exit: local.and_then(|r| r.exit),
                stopped: local.is_some_and(|r| r.signalled),
            }
        });
    RankFailure {
        rank: first.rank,
        local_rank: first.local_rank,
        exit,
        message,
        blamed,
        hang_report: None,
        trace_dir: Some(trace_dir.to_path_buf()),
        restarts: 0,
    }
}

/// One line describing a failed rank, for the other nodes' launchers: the rank at fault, how
/// the first rank failed, and the line of its error that says why.
pub(crate) fn failure_line(failure: &RankFailure) -> String {
    let mut line = match &failure.blamed {
        Some(b) => format!(
            "rank {} (blamed by rank {}, which {})",
            b.rank,
            failure.rank,
            failure.exit.without_hint()
        ),
        None => format!("rank {} {}", failure.rank, failure.exit.without_hint()),
    };
    let message = failure.message.as_deref().and_then(|m| {
        let lines: Vec<&str> = m.lines().filter(|l| !l.trim().is_empty()).collect();
        let error = lines
            .iter()
            .find(|l| l.to_ascii_lowercase().contains("error"));
        error.or(lines.last()).copied()
    });
    if let Some(message) = message {
        line.push_str(": ");
        line.push_str(message);
    }
    line
}

/// The box that ends `ddprun`'s output when a rank failed (`None` for other errors), framed so
/// that it stands out after the ranks' output: the rank the failure is about and how it ended
/// (the first line), the first rank to fail when that is another (the second line), its error
/// in its own words, and where every local rank was (the hang report).
///
/// ```text
/// ==============================================================================
/// ddprun: job failed. Root cause:
///   rank 1 (local rank 1) is the rank at fault: the error of rank 0, the first rank to fail, ...
///   first to fail: rank 0 (local rank 0) exited with code 3
///   rank 0's error:
///     rank 0: all_reduce #12 (100000 f32, sum) failed: rank 1 is unresponsive: ...
///   where the ranks were (flight records in /tmp/ddprun-...):
///     ...
/// ==============================================================================
/// ```
pub fn root_cause_box(error: &LaunchError) -> Option<String> {
    let LaunchError::RankFailed(failure) = error else {
        return None;
    };
    let rule = "=".repeat(78);
    let mut text = format!("{rule}\nddprun: job failed. Root cause:\n  {error}\n");
    if let Some(first) = failure.first_failure() {
        text += &format!("  {first}\n");
    }
    match failure.restarts {
        0 => {}
        1 => text += "  (in the attempt after 1 restart, the last one allowed)\n",
        n => text += &format!("  (in the attempt after {n} restarts, the last one allowed)\n"),
    }
    let indent = |block: &str| {
        block
            .lines()
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    };
    if let Some(message) = &failure.message {
        let whose = match failure.blamed {
            Some(_) => format!("rank {}'s error", failure.rank),
            None => "its error".to_string(),
        };
        text += &format!("  {whose}:\n{}", indent(message));
    }
    if let Some(report) = &failure.hang_report {
        let dir = failure
            .trace_dir
            .as_ref()
            .map(|d| format!(" (flight records in {})", d.display()))
            .unwrap_or_default();
        text += &format!("  where the ranks were{dir}:\n{}", indent(report));
    }
    Some(text + &rule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RankExit;

    fn failure(blamed: Option<BlamedRank>) -> RankFailure {
        RankFailure {
            rank: 0,
            local_rank: 0,
            exit: RankExit::Code(3),
            message: Some("rank 0: all_reduce #4 failed: rank 1 is unresponsive".into()),
            blamed,
            hang_report: None,
            trace_dir: None,
            restarts: 0,
        }
    }

    #[test]
    fn the_box_headlines_the_blamed_rank_and_quotes_the_first_failure_second() {
        let frozen = BlamedRank {
            rank: 1,
            local_rank: Some(1),
            exit: Some(RankExit::Signal(libc::SIGKILL)),
            stopped: true,
        };
        let error = LaunchError::RankFailed(Box::new(failure(Some(frozen))));
        let text = root_cause_box(&error).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[2].starts_with("  rank 1 (local rank 1) is the rank at fault"),
            "{text}"
        );
        assert_eq!(
            lines[3],
            "  first to fail: rank 0 (local rank 0) exited with code 3"
        );
        assert_eq!(lines[4], "  rank 0's error:");
        // The first rank's code: rank 1's SIGKILL was the launcher's doing.
        assert_eq!(error.exit_code(), 3);

        // A blamed rank that failed on its own gives its own code.
        let died = BlamedRank {
            rank: 1,
            local_rank: Some(1),
            exit: Some(RankExit::Code(7)),
            stopped: false,
        };
        let error = LaunchError::RankFailed(Box::new(failure(Some(died))));
        assert!(error
            .to_string()
            .starts_with("rank 1 (local rank 1) exited with code 7; the error of rank 0"));
        assert_eq!(error.exit_code(), 7);

        // No blame: the first failure is the headline, and there is no second line.
        let error = LaunchError::RankFailed(Box::new(failure(None)));
        let text = root_cause_box(&error).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[2].starts_with("  rank 0 (local rank 0) exited with code 3; it was the first"),
            "{text}"
        );
        assert_eq!(lines[3], "  its error:");
        assert_eq!(
            failure_line(&failure(None)),
            "rank 0 exited with code 3: rank 0: all_reduce #4 failed: rank 1 is unresponsive"
        );
    }
}
