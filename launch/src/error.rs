//! What a launch ends with: [`LaunchReport`] when every rank succeeded, [`LaunchError`] when not,
//! with [`RankFailure`] for a failed rank (the first to fail, and the rank its error blames),
//! [`RankExit`] for how a rank's process ended.

use std::fmt;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::ExitStatus;

#[cfg(doc)]
use ddp_comm::elastic::record_error;

/// How a rank's process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankExit {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal.
    Signal(i32),
}

impl RankExit {
    /// How a process that ended with `status` ended.
    pub(crate) fn from_status(status: ExitStatus) -> RankExit {
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

/// A failed job: the first rank that failed (exited non-zero or was killed by a signal), and,
/// when its error blames another rank, that rank: the rank the failure is about, which the
/// launcher reports as the root cause ([`RankFailure::culprit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// Global rank (`RANK`) of the first rank to fail.
    pub rank: usize,
    /// Its rank on this node (`LOCAL_RANK`).
    pub local_rank: usize,
    /// How it ended.
    pub exit: RankExit,
    /// Its error in its own words: the message of the error file it wrote
    /// (`TORCHELASTIC_ERROR_FILE`, see [`record_error`]), else its last lines of output that look
    /// like an error (or its last lines).
    pub message: Option<String>,
    /// The rank its error blames, when that is another rank: the rank whose process group
    /// failure it reports (a rank that died, froze or went silent, as `CommError::peer` names
    /// it; from its error file, see [`ddp_comm::elastic::read_error_file`]). A rank that fails
    /// because of another often exits first: this is the rank the failure is about.
    pub blamed: Option<BlamedRank>,
    /// Where every local rank was when the job failed, merged from their flight records
    /// ([`ddp_comm::flight::hang_report`]); `None` when no rank left one.
    pub hang_report: Option<String>,
    /// The directory with the flight records and error files (kept after a failure).
    pub trace_dir: Option<PathBuf>,
    /// How many restarts of the budget the launcher had used before this failure (see
    /// [`crate::LaunchConfig::max_restarts`]; in an elastic job, ranks restarted alone count).
    pub restarts: usize,
}

/// The rank a failure is about when it is not the first rank to fail (see
/// [`RankFailure::blamed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlamedRank {
    /// Global rank.
    pub rank: usize,
    /// Its rank on this node, when it runs on this node (`None`: on another node).
    pub local_rank: Option<usize>,
    /// How it ended, when it runs on this node.
    pub exit: Option<RankExit>,
    /// Whether it was still running when the launcher stopped the ranks (so that `exit` is the
    /// launcher's doing, as for a frozen rank), rather than having ended on its own.
    pub stopped: bool,
}

impl RankFailure {
    /// The rank the failure is about: the blamed rank, else the first rank to fail.
    pub fn culprit(&self) -> usize {
        self.blamed.as_ref().map_or(self.rank, |b| b.rank)
    }

    /// The headline of the failure: which rank it is about and why that one.
    fn headline(&self) -> String {
        let first = format!(
            "rank {} (local rank {}) {}",
            self.rank, self.local_rank, self.exit
        );
        let Some(b) = &self.blamed else {
            return format!(
                "{first}; it was the first rank to fail, and the other ranks were stopped"
            );
        };
        let why = format!(
            "the error of rank {}, the first rank to fail, blames it",
            self.rank
        );
        match (b.local_rank, b.exit) {
            (Some(local), Some(exit)) if !b.stopped => format!(
                "rank {} (local rank {local}) {exit}; {why}, and the other ranks were stopped",
                b.rank
            ),
            (Some(local), Some(exit)) => format!(
                "rank {} (local rank {local}) is the rank at fault: {why} (rank {} was still \
                 running when the launcher stopped the ranks: {})",
                b.rank,
                b.rank,
                exit.without_hint()
            ),
            (Some(local), None) => format!(
                "rank {} (local rank {local}) is the rank at fault: {why}",
                b.rank
            ),
            (None, _) => format!(
                "rank {} (on another node) is the rank at fault: {why}, and this node's ranks \
                 were stopped",
                b.rank
            ),
        }
    }

    /// The first rank to fail in one line, for the root cause's second line when the headline
    /// names another (`None` otherwise).
    pub fn first_failure(&self) -> Option<String> {
        self.blamed.as_ref().map(|_| {
            format!(
                "first to fail: rank {} (local rank {}) {}",
                self.rank, self.local_rank, self.exit
            )
        })
    }

    /// The exit code that stands for this failure: the culprit's own, when it runs here and
    /// ended on its own with a failure, else the first rank's.
    fn exit_to_report(&self) -> RankExit {
        match &self.blamed {
            Some(BlamedRank {
                exit: Some(exit),
                stopped: false,
                ..
            }) if !exit.success() => *exit,
            _ => self.exit,
        }
    }
}

/// Every local rank's ending, in local rank order, returned when all ranks succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchReport {
    /// The `MASTER_PORT` the ranks were given (the picked one on a single node).
    pub master_port: u16,
    /// How each local rank ended (in the last attempt).
    pub exits: Vec<RankExit>,
    /// How many restarts of the budget were used: the restarts of every local rank before the
    /// attempt that succeeded and, in an elastic job, the ranks restarted alone.
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
    /// An environment variable that gives a setting's default (torchrun's `PET_*`) has a value
    /// that cannot be used.
    #[error("{var}={value:?}: {why}")]
    Variable {
        /// The variable, e.g. `PET_NPROC_PER_NODE`.
        var: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it and what to do instead.
        why: String,
    },
    /// [`crate::spawn`] was asked to start ranks by a process that already is a rank of a
    /// launched job.
    #[error(
        "this process is already rank {rank} of {world_size} (started by {launcher}), so it \
         cannot start ranks of its own: {hint}"
    )]
    AlreadyARank {
        /// Its rank.
        rank: usize,
        /// Its world size.
        world_size: usize,
        /// The launcher whose variables say so (`torchrun`, `open-mpi`, `slurm`, ...).
        launcher: String,
        /// What to do instead.
        hint: String,
    },
    /// The launcher variables of this process are invalid (see `ddp_comm::GroupConfig::from_env`).
    #[error("{0}")]
    Environment(String),
    /// No free port could be found (or served) for the rendezvous store.
    #[error("could not bind a free port for the rendezvous store on {addr}: {source}")]
    FreePort {
        /// The address that was tried.
        addr: String,
        /// The error from binding.
        #[source]
        source: io::Error,
    },
    /// The given port could not be bound (or served) for the rendezvous store.
    #[error(
        "could not host the rendezvous store on {addr} port {port}: {source} (is another job or \
         a leftover process holding it? give another --master-port)"
    )]
    StorePort {
        /// The address that was tried.
        addr: String,
        /// The port (`--master-port`).
        port: u16,
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
    /// A rank failed; the others were stopped. This names the root cause: the rank the first
    /// failure's error blames, else the first rank to fail.
    #[error("{}", .0.headline())]
    RankFailed(Box<RankFailure>),
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
    /// An elastic job on several nodes whose store this launcher hosts: every other node's
    /// launcher has left or gone silent, `nodes` silent for `silence` (killed, or their hosts
    /// down or cut off), and no rank of this node is alive, or its ranks alone are below the
    /// job's minimum (they were stopped): nobody is left to run or end the job, so this
    /// launcher stops hosting its store and exits.
    #[error(
        "the launchers (ddprun) of nodes {nodes:?} have been silent for {silence:?} (killed, or \
         their hosts are down or cut off) and no other node's launcher is left: this node \
         cannot run the elastic job alone; no longer hosting its store"
    )]
    ElasticAgentsLost {
        /// The nodes whose launchers went silent.
        nodes: Vec<usize>,
        /// How long a launcher must be silent to be gone (`ddp_comm::AGENT_SILENCE`).
        silence: std::time::Duration,
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
    /// killed; the blamed rank's when it failed on its own, else the first rank's), 128 + signal
    /// when interrupted, 2 for a bad configuration, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::RankFailed(failure) => match failure.exit_to_report().shell_code() {
                code @ 1..=255 => code,
                _ => 1,
            },
            LaunchError::Interrupted { signal } => 128 + signal,
            LaunchError::NoCommand
            | LaunchError::Zero { .. }
            | LaunchError::NodeRankOutOfRange { .. }
            | LaunchError::MultiNodeNeedsMaster { .. }
            | LaunchError::Variable { .. }
            | LaunchError::AlreadyARank { .. }
            | LaunchError::Environment(_) => 2,
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
