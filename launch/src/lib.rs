//! The `ddprun` launcher: start the local ranks of a job, forward their output, and stop them
//! all when one fails.
//!
//! [`launch`] is the whole launcher; `src/bin/ddprun.rs` only parses arguments into a
//! [`LaunchConfig`] and calls it. What it does, in order:
//!
//! 1. Checks the configuration and, on a single node with no port given, picks a free port for
//!    the rendezvous store (bind port 0, read the port the kernel chose, close), so that two jobs
//!    on one host need no configuration.
//! 2. Starts `nproc_per_node` copies of the command, each with the variables that
//!    `torchrun` sets (see [`rank_env`]) and in a process group of its own, so that stopping a
//!    rank stops everything it started. Their standard input is `/dev/null`. On Linux each rank
//!    also gets `SIGKILL` if the launcher dies without stopping it (`PR_SET_PDEATHSIG`).
//! 3. Forwards every line a rank writes to stdout or stderr to the launcher's stdout or stderr,
//!    prefixed with `[rank R] `, one reader thread per stream, whole lines at a time.
//! 4. Watches the ranks. The first rank that exits non-zero or is killed by a signal is the root
//!    cause: the launcher sends `SIGTERM` to the process groups of the others, `SIGKILL` to
//!    whatever is left after the grace period, and returns [`LaunchError::RankFailed`] naming
//!    that rank, how it ended, its own error message (from the error file it wrote, see
//!    [`record_error`], else its last lines of output that look like an error) and where every
//!    rank was (the hang report merged from their flight records, see [`ddp_comm::flight`]). A
//!    `SIGINT` or `SIGTERM` sent to the launcher is forwarded to every rank the same way (a
//!    second one kills at once), and gives [`LaunchError::Interrupted`]; before forwarding it,
//!    the launcher asks the ranks for their flight records (SIGUSR1) and prints the hang report,
//!    since a user who interrupts a job has usually found it hanging. A `SIGUSR1` sent to the
//!    launcher prints the hang report and lets the job go on.
//!
//!    Each rank gets `DDP_TRACE_DIR` (the launcher's own value, else a directory of its own under
//!    the temporary directory, removed after a successful job) and `TORCHELASTIC_ERROR_FILE`
//!    (`<dir>/error-rank<R>.json`, as torchrun sets it). SIGUSR1 goes only to ranks that have
//!    said they handle it (a process group with a trace directory leaves a marker file), since
//!    its default action ends a process.
//! 5. When every rank has exited 0, returns `Ok` with each rank's status.
//! 6. With [`LaunchConfig::max_restarts`] above 0 (`ddprun --max-restarts N`, torchrun's flag),
//!    a failure does not end the job while restarts are left: once the old ranks are stopped as
//!    in step 4, all local ranks start again as a new rendezvous round (a fresh `MASTER_PORT` on
//!    a single node, the same one when given; a new `DDP_JOB_ID`), with
//!    `TORCHELASTIC_RESTART_COUNT` counting the restarts (0 on the first start) and
//!    `TORCHELASTIC_MAX_RESTARTS` set, as torchrun sets them; a trainer with checkpoints resumes
//!    from its last one. A `SIGINT`/`SIGTERM` to the launcher never leads to a restart. On
//!    several nodes the launchers coordinate through a store that node 0's launcher hosts on
//!    `MASTER_PORT + 1` (`agents.rs`): the first node whose ranks fail in a round moves every
//!    node to the next round, so all restart together with the same count and all quote the
//!    same first failure; a node whose ranks finished waits for the others (and joins a restart
//!    if one comes); a node whose launcher dies is named by the others, which stop their ranks.
//!
//! Unix only: it relies on process groups and signals.
#![cfg(unix)]
#![warn(missing_docs)]

mod agents;

pub use ddp_comm::elastic::{
    finish, record_error, ERROR_FILE_ENV, MAX_RESTARTS_ENV, RESTART_COUNT_ENV,
};

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::{mpsc, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often the launcher looks at its ranks and at pending signals.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How long the launcher waits, after the last rank exited, for the output of processes that the
/// ranks left behind to drain before it stops reading.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Lines of each rank's output kept for the root-cause report.
const TAIL_LINES: usize = 40;

/// How long the launcher waits for the ranks' flight records after asking with SIGUSR1 (their
/// liveness threads answer within a second).
const FLIGHT_WAIT: Duration = Duration::from_millis(2500);

/// The grace period between `SIGTERM` and `SIGKILL` when no other is configured.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5);

/// The rendezvous address used on a single node when none is given.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// What to launch and how: the equivalent of `ddprun`'s command line.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Ranks to start on this node (`--nproc-per-node`), at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job (`--nnodes`), at least 1.
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// Address of the node that runs rank 0, where the rendezvous store listens. Required when
    /// `nnodes > 1`; on a single node it defaults to [`DEFAULT_MASTER_ADDR`].
    pub master_addr: Option<String>,
    /// Port of the rendezvous store. Required when `nnodes > 1`; on a single node a free port is
    /// picked when it is `None`.
    pub master_port: Option<u16>,
    /// An identifier shared by all ranks of the job, exported as `DDP_JOB_ID`. When `None`, a
    /// single-node launch generates one and a multi-node launch exports none (every node would
    /// generate a different one); an inherited `DDP_JOB_ID` is then passed through unchanged.
    pub job_id: Option<String>,
    /// The program and its arguments, run once per local rank. Must not be empty.
    pub command: Vec<OsString>,
    /// Time between `SIGTERM` and `SIGKILL` when stopping ranks.
    pub grace_period: Duration,
    /// Whether to forward `SIGINT` and `SIGTERM` received by this process to the ranks. The
    /// handlers are installed for the duration of [`launch`] and the previous ones restored.
    pub forward_signals: bool,
    /// How many times to restart all local ranks after one failed (`--max-restarts`); 0, the
    /// default, stops the job at the first failure. A `SIGINT`/`SIGTERM` to the launcher never
    /// leads to a restart. See [`launch`] for what a restart does.
    pub max_restarts: usize,
}

impl LaunchConfig {
    /// A single-node configuration running `command` as `nproc_per_node` ranks, with the
    /// defaults: free port, default grace period, signals forwarded.
    pub fn new(nproc_per_node: usize, command: Vec<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node,
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            job_id: None,
            command,
            grace_period: DEFAULT_GRACE_PERIOD,
            forward_signals: true,
            max_restarts: 0,
        }
    }

    /// Total number of ranks in the job: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// Global rank of this node's local rank `local_rank`: `node_rank * nproc_per_node +
    /// local_rank`.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc_per_node + local_rank
    }
}

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl RankExit {
    fn from_status(status: ExitStatus) -> RankExit {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(signal)) => RankExit::Signal(signal),
            // Neither code nor signal: only possible for stopped/continued processes, which
            // `wait` does not report without WUNTRACED. Treat it as a failure all the same.
            (None, None) => RankExit::Code(-1),
        }
    }

    /// Whether the rank succeeded (exit code 0).
    pub fn success(self) -> bool {
        self == RankExit::Code(0)
    }

    /// The ending in words without the likely cause that [`Display`](fmt::Display) adds to a
    /// signal: for ranks that the launcher itself stopped.
    pub fn without_hint(self) -> String {
        match self {
            RankExit::Code(_) => self.to_string(),
            RankExit::Signal(signal) => format!("killed by {}", signal_name(signal)),
        }
    }

    /// The exit code a shell would report for this ending: the code itself, or 128 + signal.
    pub fn shell_code(self) -> i32 {
        match self {
            RankExit::Code(code) => code,
            RankExit::Signal(signal) => 128 + signal,
        }
    }
}

impl fmt::Display for RankExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            RankExit::Code(code) => write!(f, "exited with code {code}"),
            RankExit::Signal(signal) => {
                write!(f, "killed by {}", signal_name(signal))?;
                match signal {
                    libc::SIGKILL => write!(f, ", possibly out of memory (see `dmesg`)"),
                    libc::SIGSEGV => write!(f, " (segmentation fault)"),
                    libc::SIGBUS => write!(f, " (bus error)"),
                    libc::SIGABRT => write!(f, " (aborted, e.g. by a failed assertion)"),
                    _ => Ok(()),
                }
            }
        }
    }
}

/// The first rank that failed, which the launcher reports as the root cause of the job's failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank (`RANK`).
    pub rank: usize,
    /// Rank on this node (`LOCAL_RANK`).
    pub local_rank: usize,
    /// How it ended.
    pub exit: RankExit,
    /// Its error in its own words: the message of the error file it wrote
    /// (`TORCHELASTIC_ERROR_FILE`, see [`record_error`]), else its last lines of output that look
    /// like an error (or its last lines).
    pub message: Option<String>,
    /// Where every local rank was when the job failed, merged from their flight records
    /// ([`ddp_comm::flight::hang_report`]); `None` when no rank left one.
    pub hang_report: Option<String>,
    /// The directory with the flight records and error files (kept after a failure).
    pub trace_dir: Option<PathBuf>,
    /// How many times the launcher had restarted the ranks before this failure (see
    /// [`LaunchConfig::max_restarts`]).
    pub restarts: usize,
}

/// Every local rank's ending, in local rank order, returned when all ranks succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchReport {
    /// The `MASTER_PORT` the ranks were given (the picked one on a single node).
    pub master_port: u16,
    /// How each local rank ended (in the last attempt).
    pub exits: Vec<RankExit>,
    /// How many times the ranks were restarted before the attempt that succeeded.
    pub restarts: usize,
}

/// Why a launch did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// No command to run was given.
    #[error("no command given: usage is `ddprun --nproc-per-node N -- CMD ARGS...`")]
    NoCommand,
    /// `nproc_per_node` or `nnodes` was 0.
    #[error("{what} must be at least 1")]
    Zero {
        /// The setting, e.g. `--nproc-per-node`.
        what: &'static str,
    },
    /// `node_rank` is not below `nnodes`.
    #[error("--node-rank {node_rank} is out of range for --nnodes {nnodes} (0 to {})", nnodes - 1)]
    NodeRankOutOfRange {
        /// The node rank given.
        node_rank: usize,
        /// The number of nodes given.
        nnodes: usize,
    },
    /// A multi-node launch lacks the rendezvous address or port.
    #[error(
        "--nnodes {nnodes} needs --master-addr and --master-port: the address and a free port of \
         the node with --node-rank 0, the same on every node"
    )]
    MultiNodeNeedsMaster {
        /// The number of nodes given.
        nnodes: usize,
    },
    /// No free port could be found for the rendezvous store.
    #[error("could not find a free port for the rendezvous store on {addr}: {source}")]
    FreePort {
        /// The address that was probed.
        addr: String,
        /// The error from binding.
        #[source]
        source: io::Error,
    },
    /// A rank's process could not be started (the ranks already started were killed).
    #[error("could not start rank {rank} (`{program}`): {source}")]
    Spawn {
        /// Global rank that failed to start.
        rank: usize,
        /// The program, as given.
        program: String,
        /// The error from `spawn`.
        #[source]
        source: io::Error,
    },
    /// Installing the `SIGINT`/`SIGTERM` handlers failed.
    #[error("could not install the signal handler for {}: {source}", signal_name(*signal))]
    SignalHandler {
        /// The signal.
        signal: i32,
        /// The error from `sigaction`.
        #[source]
        source: io::Error,
    },
    /// Waiting for a rank failed (the ranks were killed).
    #[error("could not wait for rank {rank}: {source}")]
    Wait {
        /// Global rank.
        rank: usize,
        /// The error from `wait`.
        #[source]
        source: io::Error,
    },
    /// A rank failed; the others were stopped. This names the first failure: the root cause.
    #[error(
        "rank {} (local rank {}) {}; it was the first rank to fail, and the other ranks were stopped",
        .0.rank, .0.local_rank, .0.exit
    )]
    RankFailed(RankFailure),
    /// The launcher received a signal and stopped the ranks.
    #[error("interrupted by {}; the ranks were stopped", signal_name(*signal))]
    Interrupted {
        /// The signal received.
        signal: i32,
    },
    /// Several nodes: the launchers could not coordinate (a node's launcher lost, node 0's store
    /// unreachable); this node's ranks were stopped.
    #[error("{message}; this node's ranks were stopped")]
    Agents {
        /// What happened, naming the node.
        message: String,
    },
    /// Several nodes: a rank of another node failed and every restart was used; this node's
    /// ranks were stopped.
    #[error("the job failed on another node and all {max_restarts} restarts are used up: {first_failure}")]
    FailedElsewhere {
        /// `--max-restarts`.
        max_restarts: usize,
        /// The failure as that node's launcher described it.
        first_failure: String,
    },
}

impl LaunchError {
    /// The exit code `ddprun` should exit with: the failed rank's code (128 + signal when it was
    /// killed), 128 + signal when interrupted, 2 for a bad configuration, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::RankFailed(failure) => match failure.exit.shell_code() {
                code @ 1..=255 => code,
                _ => 1,
            },
            LaunchError::Interrupted { signal } => 128 + signal,
            LaunchError::NoCommand
            | LaunchError::Zero { .. }
            | LaunchError::NodeRankOutOfRange { .. }
            | LaunchError::MultiNodeNeedsMaster { .. } => 2,
            _ => 1,
        }
    }
}

/// The name of a signal, e.g. `SIGKILL`, or `signal 42` for one without a common name.
pub fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
}

/// Asks the kernel for a free TCP port on `addr` (bind to port 0, read the port, close).
///
/// The port is free when this returns; nothing holds it afterwards, so another process could
/// take it before the rendezvous store binds it, which on a single host is rare enough.
pub fn free_port(addr: Ipv4Addr) -> Result<u16, LaunchError> {
    let probe = |addr: Ipv4Addr| TcpListener::bind((addr, 0)).and_then(|l| l.local_addr());
    probe(addr)
        .map(|local| local.port())
        .map_err(|source| LaunchError::FreePort {
            addr: addr.to_string(),
            source,
        })
}

/// The environment variables that local rank `local_rank` is started with on attempt `restart`
/// (0 for the first start): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `GROUP_RANK` (the node rank, as torchrun names it), `MASTER_ADDR`, `MASTER_PORT`,
/// [`RESTART_COUNT_ENV`] and [`MAX_RESTARTS_ENV`], and `DDP_JOB_ID` when `job_id` is given.
pub fn rank_env(
    config: &LaunchConfig,
    local_rank: usize,
    master_addr: &str,
    master_port: u16,
    job_id: Option<&str>,
    restart: usize,
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("RANK", config.global_rank(local_rank).to_string()),
        ("WORLD_SIZE", config.world_size().to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string()),
        ("GROUP_RANK", config.node_rank.to_string()),
        ("MASTER_ADDR", master_addr.to_string()),
        ("MASTER_PORT", master_port.to_string()),
        (RESTART_COUNT_ENV, restart.to_string()),
        (MAX_RESTARTS_ENV, config.max_restarts.to_string()),
    ];
    if let Some(id) = job_id {
        env.push(("DDP_JOB_ID", id.to_string()));
    }
    env
}

/// The job id of attempt `restart`: the configured id (an inherited `DDP_JOB_ID` on several
/// nodes) on the first attempt and that id with `-restart<k>` appended on restart `k`, so that
/// every node that restarts as often derives the same one; on a single node without a
/// configured id, a freshly generated one per attempt. `None` on several nodes without any id.
fn attempt_job_id(config: &LaunchConfig, restart: usize, port: u16) -> Option<String> {
    let base = match &config.job_id {
        Some(id) => Some(id.clone()),
        None if config.nnodes == 1 => return Some(generate_job_id(port)),
        None => std::env::var("DDP_JOB_ID").ok().filter(|id| !id.is_empty()),
    };
    match (base, restart) {
        (Some(id), 0) => Some(id),
        (Some(id), k) => Some(format!("{id}-restart{k}")),
        // Nothing to pass; the ranks inherit nothing either (restart 0 keeps today's behaviour).
        (None, _) => None,
    }
}

/// Removes the files a previous run or attempt left in the trace directory (flight records,
/// error files, handler markers), which would be taken for this attempt's.
fn clear_trace_files(trace_dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(trace_dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("flight-rank")
                || name.starts_with("error-rank")
                || name.starts_with(ddp_comm::flight::HANDLER_MARKER)
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let _ = std::fs::create_dir_all(trace_dir);
}

/// Runs the job described by `config` on this node and waits for it; see the module
/// documentation for what happens on the way. Returns when every local rank has ended and its
/// output has been forwarded, after restarting the ranks up to `config.max_restarts` times.
pub fn launch(config: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    // 1. Check the configuration and settle the rendezvous address.
    let (program, args) = config.command.split_first().ok_or(LaunchError::NoCommand)?;
    if config.nproc_per_node == 0 {
        return Err(LaunchError::Zero {
            what: "--nproc-per-node",
        });
    }
    if config.nnodes == 0 {
        return Err(LaunchError::Zero { what: "--nnodes" });
    }
    if config.node_rank >= config.nnodes {
        return Err(LaunchError::NodeRankOutOfRange {
            node_rank: config.node_rank,
            nnodes: config.nnodes,
        });
    }
    let (master_addr, fixed_port) = match (&config.master_addr, config.master_port) {
        (Some(addr), Some(port)) => (addr.clone(), Some(port)),
        _ if config.nnodes > 1 => {
            return Err(LaunchError::MultiNodeNeedsMaster {
                nnodes: config.nnodes,
            })
        }
        (addr, port) => {
            let addr = addr
                .clone()
                .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string());
            (addr, port)
        }
    };
    // The store may bind any interface; a port free on all of them is free on each.
    let pick_port = || fixed_port.map_or_else(|| free_port(Ipv4Addr::UNSPECIFIED), Ok);
    let mut master_port = pick_port()?;
    let mut job_id = attempt_job_id(config, 0, master_port);

    let mut signals = if config.forward_signals {
        Some(SignalForwarding::install()?)
    } else {
        None
    };
    // Several nodes with restarts: the launchers coordinate through node 0's store on the next
    // port (see agents.rs); a job name keeps other jobs' launchers out.
    let agents = if config.nnodes > 1 && config.max_restarts > 0 {
        let port = master_port.checked_add(1).ok_or(LaunchError::Agents {
            message: format!(
                "--master-port {master_port}: the launchers' store needs the next port"
            ),
        })?;
        let name = job_id
            .clone()
            .unwrap_or_else(|| format!("ddprun-{master_addr}:{master_port}"));
        Some(agents::Agents::join(
            config.node_rank,
            config.nnodes,
            &master_addr,
            port,
            &name,
        )?)
    } else {
        None
    };
    // The ranks' flight records and error files: the user's DDP_TRACE_DIR, else our own.
    let (trace_dir, own_trace_dir) = match std::env::var_os(ddp_comm::flight::TRACE_DIR_ENV) {
        Some(d) if !d.is_empty() => (PathBuf::from(d), false),
        _ => {
            let name = format!(
                "ddprun-{}-{}",
                std::process::id(),
                job_id.as_deref().unwrap_or("job")
            );
            (std::env::temp_dir().join(name), true)
        }
    };

    // 2. to 5., once per attempt: the restart loop. Attempt k (k = 0 is the first start) runs
    // all local ranks with TORCHELASTIC_RESTART_COUNT=k until they have all ended. When every
    // rank succeeded, the job is done. When a rank failed (the others were already stopped:
    // SIGTERM, then SIGKILL after the grace period, and everything they started killed) and
    // fewer than `max_restarts` restarts were used, and no SIGINT/SIGTERM reached the launcher
    // meanwhile (a user who stops the job means it), the launcher starts all local ranks again
    // as a new rendezvous round: a fresh free MASTER_PORT on a single node (the same one when it
    // was given) and a new DDP_JOB_ID, so that a straggler of the old group can neither reach the
    // new store nor pass the new group's handshake. Files of the old attempt in the trace
    // directory are cleared first, so the new attempt's report is its own. Any other ending (a
    // failure with the budget spent, an interruption, a launcher error) ends the job with that
    // attempt's result, exactly as without restarts. On several nodes the launchers agree on
    // every round through node 0's store (agents.rs) and meet again at the fixed MASTER_PORT.
    let mut restarts = 0;
    loop {
        clear_trace_files(&trace_dir);
        let attempt = Attempt {
            program,
            args,
            master_addr: &master_addr,
            master_port,
            job_id: job_id.as_deref(),
            restart: restarts,
            trace_dir: &trace_dir,
        };
        let round = restarts as u64;
        let stop_check = || -> Option<Result<(), String>> {
            let a = agents.as_ref()?;
            if let Some(why) = a.lost() {
                return Some(Err(why));
            }
            (a.round() > round).then_some(Ok(()))
        };
        let (mut result, signalled) = run_attempt(config, &attempt, signals.as_mut(), &stop_check);
        // Several nodes: settle the round with the other launchers. A local failure is
        // announced (the first node to announce a round's failure moves everyone on); a stop
        // for a failure elsewhere, or a success here while a rank elsewhere failed, restarts
        // as well, quoting the other node's failure.
        if let (Some(a), false) = (agents.as_ref(), signalled) {
            let elsewhere = match &result {
                Err(LaunchError::RankFailed(failure)) => {
                    let first = a.announce_failure(round, &failure_line(failure))?;
                    (!first.starts_with(&format!("node {}: ", config.node_rank))).then_some(first)
                }
                Err(LaunchError::Agents { message }) if message == RESTART_REQUESTED => {
                    Some(a.failure_of(round)?)
                }
                Ok(_) if !a.finish_round(round)? => Some(a.failure_of(round)?),
                _ => None,
            };
            if let Some(first) = elsewhere {
                if restarts >= config.max_restarts {
                    notice(&format!("the job failed on another node: {first}"));
                    return Err(LaunchError::FailedElsewhere {
                        max_restarts: config.max_restarts,
                        first_failure: first,
                    });
                }
                a.wait_stopped(round)?;
                restarts += 1;
                notice(&format!(
                    "{first}; restarting this node's {} ranks (restart {restarts} of {})",
                    config.nproc_per_node, config.max_restarts
                ));
                if let Some(signal) = signals.as_mut().and_then(SignalForwarding::take) {
                    notice(&format!("received {}; not restarting", signal_name(signal)));
                    return Err(LaunchError::Interrupted { signal });
                }
                job_id = attempt_job_id(config, restarts, master_port);
                continue;
            }
            if let Err(LaunchError::RankFailed(failure)) = &mut result {
                failure.restarts = restarts;
            }
        }
        match result {
            Err(LaunchError::RankFailed(failure))
                if !signalled && restarts < config.max_restarts =>
            {
                restarts += 1;
                let whose = if config.nnodes > 1 {
                    "every node's"
                } else {
                    "all"
                };
                notice(&format!(
                    "rank {} failed ({}); restarting {whose} {} ranks (restart {restarts} of {})",
                    failure.rank,
                    failure.exit.without_hint(),
                    config.nproc_per_node,
                    config.max_restarts
                ));
                if let Some(message) = &failure.message {
                    notice(&format!("rank {}'s error:", failure.rank));
                    for line in message.lines() {
                        notice(&format!("  {line}"));
                    }
                }
                // A stop request that arrived while the old group was going away.
                if let Some(signal) = signals.as_mut().and_then(SignalForwarding::take) {
                    notice(&format!("received {}; not restarting", signal_name(signal)));
                    return Err(LaunchError::Interrupted { signal });
                }
                if let Some(a) = &agents {
                    a.wait_stopped(round)?;
                }
                master_port = pick_port()?;
                job_id = attempt_job_id(config, restarts, master_port);
            }
            Err(LaunchError::RankFailed(mut failure)) => {
                if config.max_restarts > 0 && !signalled {
                    notice(&format!(
                        "rank {} failed and all {} restarts are used up; the job failed",
                        failure.rank, config.max_restarts
                    ));
                }
                failure.restarts = restarts;
                return Err(LaunchError::RankFailed(failure));
            }
            Err(error) => return Err(error),
            Ok(mut report) => {
                if own_trace_dir {
                    let _ = std::fs::remove_dir_all(&trace_dir);
                }
                if config.max_restarts > 0 {
                    notice(&format!(
                        "all ranks finished; {restarts} of {} restarts used",
                        config.max_restarts
                    ));
                }
                report.restarts = restarts;
                return Ok(report);
            }
        }
    }
}

/// The message of the `LaunchError::Agents` with which an attempt ends when another node's
/// launcher asked for a restart (internal: never returned by [`launch`]).
const RESTART_REQUESTED: &str = "restart requested by another node";

/// One line describing a failed rank, for the other nodes' launchers.
fn failure_line(failure: &RankFailure) -> String {
    let mut line = format!("rank {} {}", failure.rank, failure.exit.without_hint());
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

/// What differs between the attempts of one launch.
struct Attempt<'a> {
    program: &'a OsString,
    args: &'a [OsString],
    master_addr: &'a str,
    master_port: u16,
    job_id: Option<&'a str>,
    /// Restarts before this attempt (0 on the first).
    restart: usize,
    trace_dir: &'a Path,
}

/// Starts the local ranks once, watches them until all have ended and reports how: steps 2 to 5
/// of the module documentation. Also says whether the launcher received `SIGINT`/`SIGTERM`
/// meanwhile (then no restart may follow).
fn run_attempt(
    config: &LaunchConfig,
    attempt: &Attempt<'_>,
    mut signals: Option<&mut SignalForwarding>,
    stop_check: &dyn Fn() -> Option<Result<(), String>>,
) -> (Result<LaunchReport, LaunchError>, bool) {
    let trace_dir = attempt.trace_dir;
    let program = attempt.program;
    let master_port = attempt.master_port;
    // 2. and 3. Start the ranks, each with two reader threads forwarding its output.
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(config.nproc_per_node);
    for local_rank in 0..config.nproc_per_node {
        let rank = config.global_rank(local_rank);
        let mut command = Command::new(program);
        command
            .args(attempt.args)
            .envs(rank_env(
                config,
                local_rank,
                attempt.master_addr,
                master_port,
                attempt.job_id,
                attempt.restart,
            ))
            .env(ddp_comm::flight::TRACE_DIR_ENV, trace_dir)
            .env(ERROR_FILE_ENV, error_file(trace_dir, rank))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        die_with_parent(&mut command);
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(source) => {
                for started in &mut ranks {
                    started.signal_group(libc::SIGKILL);
                    let _ = started.child.wait();
                }
                let error = LaunchError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                };
                return (Err(error), false);
            }
        };
        let prefix = format!("[rank {rank}] ");
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        if let Some(out) = child.stdout.take() {
            let sink = (Stream::Stdout, tail.clone());
            forward_lines(out, prefix.clone(), sink, done_tx.clone());
        }
        if let Some(err) = child.stderr.take() {
            let sink = (Stream::Stderr, tail.clone());
            forward_lines(err, prefix, sink, done_tx.clone());
        }
        ranks.push(Rank {
            rank,
            local_rank,
            child,
            exit: None,
            tail,
        });
    }
    drop(done_tx);

    // 4. Watch the ranks until all have ended.
    let mut first_failure: Option<RankFailure> = None;
    let mut interrupted: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let mut wait_error: Option<LaunchError> = None;
    let mut signalled = false;
    // Several nodes: a restart decided by another node's launcher (Ok) or a node lost (Err).
    let mut stopped_by_agents: Option<Result<(), String>> = None;
    loop {
        if stopped_by_agents.is_none() && first_failure.is_none() && interrupted.is_none() {
            if let Some(stop) = stop_check() {
                notice(&match &stop {
                    Ok(()) => "a rank of another node failed; stopping this node's ranks".into(),
                    Err(why) => format!("{why}; stopping this node's ranks"),
                });
                stop_running(&mut ranks, libc::SIGTERM);
                kill_at = Some(Instant::now() + config.grace_period);
                stopped_by_agents = Some(stop);
            }
        }
        if signals.as_mut().is_some_and(|s| s.take_usr1()) {
            notice("received SIGUSR1: where each rank is");
            print_hang_report(&ask_for_flight_records(&mut ranks, trace_dir), trace_dir);
        }
        if let Some(signal) = signals.as_mut().and_then(|s| s.take()) {
            signalled = true;
            if interrupted.is_none() && first_failure.is_none() {
                interrupted = Some(signal);
                print_hang_report(&ask_for_flight_records(&mut ranks, trace_dir), trace_dir);
                notice(&format!(
                    "received {}; forwarding it to the ranks (SIGKILL in {:?}, or at once on a \
                     second signal)",
                    signal_name(signal),
                    config.grace_period
                ));
                stop_running(&mut ranks, signal);
                kill_at = Some(Instant::now() + config.grace_period);
            } else {
                notice(&format!(
                    "received {} while stopping; killing the ranks now",
                    signal_name(signal)
                ));
                stop_running(&mut ranks, libc::SIGKILL);
                kill_at = None;
            }
        }

        for index in 0..ranks.len() {
            let Some(exit) = poll_exit(&mut ranks[index], &mut wait_error) else {
                continue;
            };
            let (rank, local_rank) = (ranks[index].rank, ranks[index].local_rank);
            let stopping =
                first_failure.is_some() || interrupted.is_some() || stopped_by_agents.is_some();
            if exit.success() {
                continue;
            } else if stopping {
                notice(&format!("rank {rank} stopped: {}", exit.without_hint()));
            } else {
                first_failure = Some(RankFailure {
                    rank,
                    local_rank,
                    exit,
                    message: None,
                    hang_report: None,
                    trace_dir: None,
                    restarts: attempt.restart,
                });
                notice(&format!(
                    "rank {rank} {exit}; stopping the other ranks (SIGTERM, SIGKILL after {:?})",
                    config.grace_period
                ));
                // Where the others are, before they are stopped: the rank that never entered
                // the collective the others wait in is often the real story.
                ask_for_flight_records(&mut ranks, trace_dir);
                stop_running(&mut ranks, libc::SIGTERM);
                kill_at = Some(Instant::now() + config.grace_period);
            }
        }

        if wait_error.is_some() {
            stop_running(&mut ranks, libc::SIGKILL);
        }
        if ranks.iter().all(|rank| rank.exit.is_some()) {
            break;
        }
        if kill_at.is_some_and(|at| Instant::now() >= at) {
            notice(&format!(
                "grace period of {:?} over; killing the remaining ranks",
                config.grace_period
            ));
            stop_running(&mut ranks, libc::SIGKILL);
            kill_at = None;
        }
        thread::sleep(POLL_INTERVAL);
    }

    // 5. Kill what the ranks left behind in their process groups, let the output drain, report.
    for rank in &ranks {
        rank.signal_group(libc::SIGKILL);
    }
    let drain_deadline = Instant::now() + DRAIN_TIMEOUT;
    while let Some(left) = drain_deadline.checked_duration_since(Instant::now()) {
        match done_rx.recv_timeout(left) {
            Ok(()) => continue,
            Err(_) => break, // all readers done (disconnected) or out of time
        }
    }

    if let Some(error) = wait_error {
        return (Err(error), signalled);
    }
    match stopped_by_agents {
        Some(Ok(())) => {
            let message = RESTART_REQUESTED.to_string();
            return (Err(LaunchError::Agents { message }), signalled);
        }
        Some(Err(message)) => return (Err(LaunchError::Agents { message }), signalled),
        None => {}
    }
    if let Some(mut failure) = first_failure {
        let failed = ranks.iter().find(|r| r.rank == failure.rank);
        failure.message = read_error_file(&error_file(trace_dir, failure.rank))
            .or_else(|| failed.and_then(|r| error_lines(&r.tail)));
        failure.hang_report = hang_report_of(trace_dir, config);
        failure.trace_dir = Some(trace_dir.to_path_buf());
        return (Err(LaunchError::RankFailed(failure)), signalled);
    }
    if let Some(signal) = interrupted {
        return (Err(LaunchError::Interrupted { signal }), signalled);
    }
    let report = LaunchReport {
        master_port,
        exits: ranks
            .iter()
            .map(|rank| rank.exit.unwrap_or(RankExit::Code(-1)))
            .collect(),
        restarts: attempt.restart,
    };
    (Ok(report), signalled)
}

/// One local rank's process.
struct Rank {
    rank: usize,
    local_rank: usize,
    child: Child,
    exit: Option<RankExit>,
    /// Its last [`TAIL_LINES`] lines of output (both streams).
    tail: Arc<Mutex<VecDeque<String>>>,
}

/// `<dir>/error-rank<R>.json`: where rank `rank` records its fatal error.
fn error_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("error-rank{rank}.json"))
}

/// The message of an error file written by [`record_error`] (or by torchelastic's `@record`:
/// the same shape), if there is one.
fn read_error_file(path: &Path) -> Option<String> {
    let text = std::fs::read(path).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let message = &value["message"];
    let text = match message {
        serde_json::Value::String(s) => s.clone(),
        _ => message["message"].as_str()?.to_string(),
    };
    Some(text.trim().to_string()).filter(|t| !t.is_empty())
}

/// The lines of a rank's output tail that look like its error (`error`, `panicked`, `Error`
/// and what follows the first of them), else its last three lines.
fn error_lines(tail: &Mutex<VecDeque<String>>) -> Option<String> {
    let tail = tail.lock().unwrap_or_else(|p| p.into_inner());
    let lines: Vec<&String> = tail.iter().collect();
    let first = lines.iter().position(|l| {
        let l = l.to_ascii_lowercase();
        l.contains("error") || l.contains("panicked")
    });
    let chosen = match first {
        Some(i) => &lines[i..],
        None => &lines[lines.len().saturating_sub(3)..],
    };
    let text = chosen
        .iter()
        .map(|l| l.trim_end())
        .collect::<Vec<_>>()
        .join("\n");
    Some(text).filter(|t| !t.trim().is_empty())
}

/// Sends SIGUSR1 to every running rank that handles it (it left the marker of a process group
/// with a trace directory) and waits up to [`FLIGHT_WAIT`] until each has written a fresh flight
/// record, written one on its failure, or exited. Returns the hang report (empty when no rank
/// was asked).
fn ask_for_flight_records(ranks: &mut [Rank], dir: &Path) -> String {
    let asked_at = ddp_comm::flight::now_us();
    let mut asked = Vec::new();
    for (i, r) in ranks.iter().enumerate() {
        if r.exit.is_none() && dir.join(ddp_comm::flight::handler_marker(r.rank)).exists() {
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
fn hang_report_of(dir: &Path, config: &LaunchConfig) -> Option<String> {
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
fn print_hang_report(report: &str, dir: &Path) {
    if report.trim().is_empty() {
        return;
    }
    notice(&format!("flight records (in {}):", dir.display()));
    for line in report.lines() {
        notice(&format!("  {line}"));
    }
}

impl Rank {
    /// Sends `signal` to the rank's process group (the rank and everything it started).
    fn signal_group(&self, signal: i32) {
        // The group id is the rank's pid (`process_group(0)`). ESRCH (all gone) is fine.
        let pgid = self.child.id() as libc::pid_t;
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(-pgid, signal) };
    }
}

/// Sends `signal` to the process group of every rank that has not ended yet.
fn stop_running(ranks: &mut [Rank], signal: i32) {
    for rank in ranks.iter().filter(|rank| rank.exit.is_none()) {
        rank.signal_group(signal);
    }
}

/// Reaps `rank` if it has ended since the last look, records and returns how it ended. A failing
/// `wait` (impossible for a child we own) is kept in `wait_error` and the rank killed, so that the
/// launcher never hangs on it.
fn poll_exit(rank: &mut Rank, wait_error: &mut Option<LaunchError>) -> Option<RankExit> {
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

/// A job id unique enough on one host: time, launcher pid and port.
fn generate_job_id(port: u16) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "ddprun-{:x}-{}-{port}",
        nanos & 0xffff_ffff_ffff,
        std::process::id()
    )
}

/// Which of the launcher's own streams a rank's stream is forwarded to.
#[derive(Clone, Copy)]
enum Stream {
    Stdout,
    Stderr,
}

/// Starts a thread that copies `source` line by line to the launcher's `stream`, each line
/// prefixed with `prefix` and written in one piece, keeps the last lines in `tail`, then sends on
/// `done` when `source` closes.
/// A last line without a newline gets one. Write errors (a closed stdout) are ignored and the
/// source is still drained, so that a rank never blocks on a full pipe.
fn forward_lines(
    source: impl Read + Send + 'static,
    prefix: String,
    (stream, tail): (Stream, Arc<Mutex<VecDeque<String>>>),
    done: mpsc::Sender<()>,
) {
    thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut line = Vec::with_capacity(256);
        let mut out = Vec::with_capacity(256);
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            {
                let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(String::from_utf8_lossy(&line).into_owned());
            }
            out.clear();
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            if !line.ends_with(b"\n") {
                out.push(b'\n');
            }
            let _ = match stream {
                Stream::Stdout => io::stdout().lock().write_all(&out),
                Stream::Stderr => io::stderr().lock().write_all(&out),
            };
        }
        let _ = done.send(());
    });
}

/// Prints one of the launcher's own messages to stderr.
fn notice(message: &str) {
    let _ = writeln!(io::stderr().lock(), "[ddprun] {message}");
}

/// The last signal received by the handler.
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many signals the handler has received; each [`SignalForwarding`] remembers how many it
/// has seen, so that every launch running in this process sees every signal.
static SIGNAL_COUNT: AtomicUsize = AtomicUsize::new(0);
/// How many [`SignalForwarding`] guards are alive, and the handlers that were installed before
/// the first of them (restored when the last one drops).
static INSTALLED: Mutex<(usize, Vec<(i32, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

/// How many SIGUSR1 the handler has received (a request for the hang report, not a stop).
static USR1_COUNT: AtomicUsize = AtomicUsize::new(0);

extern "C" fn record_signal(signal: libc::c_int) {
    if signal == libc::SIGUSR1 {
        USR1_COUNT.fetch_add(1, Ordering::SeqCst);
        return;
    }
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// `SIGINT`, `SIGTERM` and `SIGUSR1` handlers that record the signal for the watch loop,
/// installed while any such guard lives; dropping the last one restores the previous handlers.
struct SignalForwarding {
    seen: usize,
    usr1_seen: usize,
}

impl SignalForwarding {
    const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1];

    fn install() -> Result<SignalForwarding, LaunchError> {
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if installed.0 == 0 {
            for signal in Self::SIGNALS {
                // SAFETY: a zeroed sigaction is valid; the handler only touches atomics, which is
                // async-signal-safe.
                let previous = unsafe {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as usize;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    let mut previous: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(signal, &action, &mut previous) != 0 {
                        let source = io::Error::last_os_error();
                        restore_handlers(&mut installed.1);
                        return Err(LaunchError::SignalHandler { signal, source });
                    }
                    previous
                };
                installed.1.push((signal, previous));
            }
        }
        installed.0 += 1;
        Ok(SignalForwarding {
            seen: SIGNAL_COUNT.load(Ordering::SeqCst),
            usr1_seen: USR1_COUNT.load(Ordering::SeqCst),
        })
    }

    /// Whether a SIGUSR1 arrived since the last call.
    fn take_usr1(&mut self) -> bool {
        let count = USR1_COUNT.load(Ordering::SeqCst);
        std::mem::replace(&mut self.usr1_seen, count) != count
    }

    /// The signal received since the last call, if any.
    fn take(&mut self) -> Option<i32> {
        let count = SIGNAL_COUNT.load(Ordering::SeqCst);
        if count == self.seen {
            return None;
        }
        self.seen = count;
        Some(LAST_SIGNAL.load(Ordering::SeqCst))
    }
}

impl Drop for SignalForwarding {
    fn drop(&mut self) {
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        installed.0 -= 1;
        if installed.0 == 0 {
            restore_handlers(&mut installed.1);
        }
    }
}

/// Puts back the signal handlers saved in `saved`, emptying it.
fn restore_handlers(saved: &mut Vec<(i32, libc::sigaction)>) {
    for (signal, previous) in saved.drain(..).rev() {
        // SAFETY: restores a sigaction obtained from the kernel.
        unsafe { libc::sigaction(signal, &previous, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty directory under the temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let dir = std::env::temp_dir()
                .join(format!("ddp-launch-{name}-{}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A launch of `nproc` ranks running `sh -c script sh DIR`: each rank records its
    /// environment in `DIR/attempt<TORCHELASTIC_RESTART_COUNT>-rank<RANK>` first.
    fn shell_job(nproc: usize, max_restarts: usize, dir: &Path, script: &str) -> LaunchConfig {
        let record = "echo \"$MASTER_PORT $DDP_JOB_ID $TORCHELASTIC_MAX_RESTARTS\" > \
                      \"$1/attempt$TORCHELASTIC_RESTART_COUNT-rank$RANK\"; ";
        let command = vec![
            "sh".into(),
            "-c".into(),
            format!("{record}{script}").into(),
            "sh".into(),
            dir.as_os_str().to_owned(),
        ];
        let mut config = LaunchConfig::new(nproc, command);
        config.max_restarts = max_restarts;
        config.forward_signals = false;
        config.grace_period = Duration::from_secs(2);
        config
    }

    fn recorded(dir: &Path, attempt: usize, rank: usize) -> Option<Vec<String>> {
        let text =
            std::fs::read_to_string(dir.join(format!("attempt{attempt}-rank{rank}"))).ok()?;
        Some(text.split_whitespace().map(str::to_string).collect())
    }

    /// Rank 1 fails on the first attempt only (rank 0 would wait for it): one restart, with a
    /// new port and job id, and the job succeeds.
    #[test]
    fn a_failure_restarts_all_ranks_in_a_new_round() {
        let dir = TempDir::new("restart");
        let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                        if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 30; fi; exit 0";
        let report = launch(&shell_job(2, 1, &dir.0, script)).expect("the restart succeeds");
        assert_eq!(report.restarts, 1);
        assert_eq!(report.exits, vec![RankExit::Code(0); 2]);
        let first = recorded(&dir.0, 0, 1).expect("attempt 0 of rank 1 ran");
        let second = recorded(&dir.0, 1, 1).expect("attempt 1 of rank 1 ran");
        assert!(recorded(&dir.0, 1, 0).is_some(), "attempt 1 of rank 0 ran");
        assert_eq!(first[2], "1", "TORCHELASTIC_MAX_RESTARTS");
        assert_ne!(first[0], second[0], "a new MASTER_PORT");
        assert_eq!(second[0], report.master_port.to_string());
        assert_ne!(first[1], second[1], "a new DDP_JOB_ID");
        assert!(recorded(&dir.0, 2, 1).is_none(), "no second restart");
    }

    /// With no restarts allowed, the first failure ends the job as it always did.
    #[test]
    fn no_restart_budget_stops_at_the_first_failure() {
        let dir = TempDir::new("norestart");
        let script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 30";
        let started = Instant::now();
        match launch(&shell_job(2, 0, &dir.0, script)) {
            Err(LaunchError::RankFailed(failure)) => {
                assert_eq!((failure.rank, failure.exit), (1, RankExit::Code(3)));
                assert_eq!(failure.restarts, 0);
            }
            other => panic!("expected rank 1's failure, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(20));
        assert_eq!(recorded(&dir.0, 0, 1).unwrap()[2], "0");
        assert!(recorded(&dir.0, 1, 1).is_none(), "no restart");
    }

    /// A rank that fails every time uses up the budget; the last failure is the error, with a
    /// job id per attempt derived from the given one.
    #[test]
    fn an_exhausted_budget_reports_the_last_failure() {
        let dir = TempDir::new("exhausted");
        let mut config = shell_job(1, 2, &dir.0, "exit 5");
        config.job_id = Some("myjob".into());
        config.master_port = Some(free_port(Ipv4Addr::UNSPECIFIED).unwrap());
        match launch(&config) {
            Err(error @ LaunchError::RankFailed(_)) => {
                assert_eq!(error.exit_code(), 5);
                let LaunchError::RankFailed(failure) = error else {
                    unreachable!()
                };
                assert_eq!(failure.restarts, 2);
            }
            other => panic!("expected a failure, got {other:?}"),
        }
        let ids: Vec<String> = (0..3)
            .map(|k| recorded(&dir.0, k, 0).expect("every attempt ran")[1].clone())
            .collect();
        assert_eq!(ids, ["myjob", "myjob-restart1", "myjob-restart2"]);
        let ports: Vec<String> = (0..3)
            .map(|k| recorded(&dir.0, k, 0).unwrap()[0].clone())
            .collect();
        assert!(ports.iter().all(|p| *p == ports[0]), "a given port is kept");
        assert!(recorded(&dir.0, 3, 0).is_none());
    }
}

/// The README's code blocks, compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
