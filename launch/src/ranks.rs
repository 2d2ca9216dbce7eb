//! The local ranks' processes: starting them ([`start_ranks`]), signalling them and reaping them.
//!
//! Each rank runs the command with the variables that torchrun sets ([`rank_env`]), in a
//! process group of its own (so that stopping a rank stops everything it started), with its
//! standard input on `/dev/null`, its output forwarded line by line (`output.rs`), and on Linux
//! `SIGKILL` if the launcher dies without stopping it (`PR_SET_PDEATHSIG`). The rendezvous store
//! is the launcher's (`rendezvous.rs`): no rank binds `MASTER_PORT`, and none inherits a socket
//! of the launcher's.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};

use ddp_comm::elastic::{ERROR_FILE_ENV, RESTART_COUNT_ENV, STORE_FD_ENV};
use ddp_comm::flight::TRACE_DIR_ENV;

use crate::config::{rank_env, LaunchConfig};
use crate::error::{signal_name, LaunchError, RankExit};
use crate::output::{forward_lines, notice, Stream, Tail, TAIL_LINES};

/// One local rank's process.
pub(crate) struct Rank {
    /// Global rank.
    pub rank: usize,
    pub local_rank: usize,
    pub child: Child,
    /// How it ended, once reaped.
    pub exit: Option<RankExit>,
    /// Whether the launcher sent it a stop signal (SIGTERM, SIGKILL or a forwarded one) while
    /// it was running: an ending seen after that may be the launcher's doing.
    pub signalled: bool,
    /// Its last lines of output.
    pub tail: Tail,
}

/// What differs between the attempts of one launch.
#[derive(Clone, Copy)]
pub(crate) struct Attempt<'a> {
    pub program: &'a OsString,
    pub args: &'a [OsString],
    pub master_addr: &'a str,
    pub master_port: u16,
    pub job_id: Option<&'a str>,
    /// Restarts of every local rank before this attempt (0 on the first): the round.
    pub restart: usize,
    /// Restarts of the budget used before this attempt, an elastic job's ranks restarted alone
    /// included: the ranks' `TORCHELASTIC_RESTART_COUNT` (torchrun's count).
    pub restarts_used: usize,
    pub trace_dir: &'a Path,
    /// Where an elastic job's store is now, when it moved off `master_addr:master_port` (the
    /// store's node was lost; `ddp_comm::AgentPresence::moved_to`): a rank restarted alone is
    /// given that address.
    pub store_now: &'a dyn Fn() -> Option<(String, u16)>,
}

/// `<dir>/error-rank<R>.json`: where rank `rank` records its fatal error.
pub(crate) fn error_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("error-rank{rank}.json"))
}

/// Starts every local rank of `attempt`, each with two threads forwarding its output (they
/// send on `done` when their stream closes). If a rank cannot start, the ranks already started
/// are killed.
pub(crate) fn start_ranks(
    config: &LaunchConfig,
    attempt: &Attempt<'_>,
    done: &mpsc::Sender<()>,
) -> Result<Vec<Rank>, LaunchError> {
    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        match start_rank(config, attempt, local_rank, attempt.restarts_used, done) {
            Ok(rank) => ranks.push(rank),
            Err(error) => {
                for started in &mut ranks {
                    started.signal_group(libc::SIGKILL);
                    let _ = started.child.wait();
                }
                return Err(error);
            }
        }
    }
    Ok(ranks)
}

/// Starts local rank `local_rank` (also alone: an elastic job's restart of one rank) with
/// `TORCHELASTIC_RESTART_COUNT=restart_count`. A [`STORE_FD_ENV`] this launcher inherited is
/// not passed on: the descriptor is not the ranks' (and is closed on exec anyway).
pub(crate) fn start_rank(
    config: &LaunchConfig,
    attempt: &Attempt<'_>,
    local_rank: usize,
    restart_count: usize,
    done: &mpsc::Sender<()>,
) -> Result<Rank, LaunchError> {
    let rank = config.global_rank(local_rank);
    let mut command = Command::new(attempt.program);
    command
        .args(attempt.args)
        .envs(rank_env(
            config,
            local_rank,
            attempt.master_addr,
            attempt.master_port,
            attempt.job_id,
            attempt.restart,
        ))
        .env(RESTART_COUNT_ENV, restart_count.to_string())
        .env(TRACE_DIR_ENV, attempt.trace_dir)
        .env(ERROR_FILE_ENV, error_file(attempt.trace_dir, rank))
        .env_remove(STORE_FD_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    die_with_parent(&mut command);
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        rank,
        program: attempt.program.to_string_lossy().into_owned(),
        source,
    })?;
    let prefix = format!("[rank {rank}] ");
    let tail: Tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    if let Some(out) = child.stdout.take() {
        forward_lines(
            out,
            prefix.clone(),
            (Stream::Stdout, tail.clone()),
            done.clone(),
        );
    }
    if let Some(err) = child.stderr.take() {
        forward_lines(err, prefix, (Stream::Stderr, tail.clone()), done.clone());
    }
    Ok(Rank {
        rank,
        local_rank,
        child,
        exit: None,
        signalled: false,
        tail,
    })
}

impl Rank {
    /// Sends `signal` to the rank's process group (the rank and everything it started).
    pub fn signal_group(&self, signal: i32) {
        // The group id is the rank's pid (`process_group(0)`). ESRCH (all gone) is fine.
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(-pgid, signal) };
    }
}

/// Sends `signal` to the process group of every rank that has not ended yet; a process of
/// the group that is stopped (a frozen rank: it would handle no other signal before the grace
/// period ends) gets `SIGKILL` at once instead (see `frozen.rs`).
pub(crate) fn stop_running(ranks: &mut [Rank], signal: i32) {
    for rank in ranks.iter_mut().filter(|rank| rank.exit.is_none()) {
        if signal != libc::SIGKILL {
            for pid in crate::frozen::stopped_in_group(rank.child.id()) {
                notice(&format!(
                    "rank {} is stopped (process {pid}, SIGSTOP): it cannot handle {}; killing \
                     it at once",
                    rank.rank,
                    signal_name(signal)
                ));
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        rank.signal_group(signal);
        rank.signalled = true;
    }
}

/// Reaps `rank` if it has ended since the last look, records and returns how it ended. A failing
/// `wait` (impossible for a child we own) is kept in `wait_error` and the rank killed, so that the
/// launcher never hangs on it.
pub(crate) fn poll_exit(rank: &mut Rank, wait_error: &mut Option<LaunchError>) -> Option<RankExit> {
    if rank.exit.is_some() {
        return None;
    }
    let exit = match rank.child.try_wait() {
        Ok(Some(status)) => RankExit::from_status(status),
        Ok(None) => return None,
        Err(source) => {
            wait_error.get_or_insert(LaunchError::Wait {
                rank: rank.rank,
                source,
            });
            rank.signal_group(libc::SIGKILL);
            let _ = rank.child.wait();
            RankExit::Signal(libc::SIGKILL)
        }
    };
    rank.exit = Some(exit);
    Some(exit)
}

/// Makes the child receive SIGKILL when the launcher dies before stopping it (Linux only).
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl, getppid and _exit are async-signal-safe, and the closure allocates nothing.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher may have died between fork and prctl.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    };
}

/// Nothing to do where `PR_SET_PDEATHSIG` does not exist.
#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut Command) {}
