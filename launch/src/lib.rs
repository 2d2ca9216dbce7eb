//! The `ddprun` launcher: start the local ranks of a job, forward their output, and stop them
//! all when one fails.
//!
//! [`launch`] is the whole launcher; `src/bin/ddprun.rs` only parses arguments into a
//! [`LaunchConfig`], calls it, and prints [`root_cause_box`] when a rank failed. What it does,
//! in order:
//!
//! 1. Checks the configuration and hosts the rendezvous store, as torchrun's agent does: a
//!    PyTorch `TCPStore` ([`ddp_comm::TorchStoreHost`]) on `MASTER_PORT` (on node 0; on a single
//!    node with no port given, a free port it binds itself), which every rank reaches as a
//!    client (`TORCHELASTIC_USE_AGENT_STORE=True`): a PyTorch program's `init_process_group`
//!    as well as ddp-comm's ranks. No rank binds the port, two jobs on one host need no
//!    configuration, and no other process can take the port between the launcher's choice and
//!    the ranks' rendezvous.
//! 2. Starts `nproc_per_node` copies of the command, each with the variables that
//!    `torchrun` sets (see [`rank_env`]) and in a process group of its own, so that stopping a
//!    rank stops everything it started. Their standard input is `/dev/null`. On Linux each rank
//!    also gets `SIGKILL` if the launcher dies without stopping it (`PR_SET_PDEATHSIG`).
//! 3. Forwards every line a rank writes to stdout or stderr to the launcher's stdout or stderr,
//!    prefixed with `[rank R] `, one reader thread per stream, whole lines at a time.
//! 4. Watches the ranks. When a rank exits non-zero or is killed by a signal, the launcher sends
//!    `SIGTERM` to the process groups of the others, `SIGKILL` to whatever is left after the
//!    grace period, and returns [`LaunchError::RankFailed`] naming the root cause: the rank the
//!    first failure's error blames (a rank that froze, died or went silent, as its process
//!    group named it in its error file, see [`record_error`]), else that first rank; how it
//!    ended, the first rank's own error message (from its error file, else its last lines of
//!    output that look like an error) and where every rank was (the hang report merged from
//!    their flight records, see [`ddp_comm::flight`]). A
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
//!    in step 4, all local ranks start again as a new rendezvous round (a new store on a fresh
//!    `MASTER_PORT` on a single node, the same port and store, emptied, when the port was given;
//!    a new `DDP_JOB_ID`), with `TORCHELASTIC_RESTART_COUNT` counting the restarts (0 on the
//!    first start) and
//!    `TORCHELASTIC_MAX_RESTARTS` set, as torchrun sets them; a trainer with checkpoints resumes
//!    from its last one. A `SIGINT`/`SIGTERM` to the launcher never leads to a restart. On
//!    several nodes the launchers coordinate through a store that node 0's launcher hosts on
//!    `MASTER_PORT + 1` (`agents.rs`): the first node whose ranks fail in a round moves every
//!    node to the next round, so all restart together with the same count and all quote the
//!    same first failure; a node whose ranks finished waits for the others (and joins a restart
//!    if one comes); a node whose launcher dies is named by the others, which stop their ranks.
//!
//! [`spawn`] is the same for a program that starts its own ranks (PyTorch's `mp.spawn`): it
//! runs this very program as the local ranks of a one-node job.
//!
//! Where things are: `launch.rs` (the restart loop, steps 1 and 6), `attempt.rs` (one attempt:
//! the watch loop, steps 2 to 5), `ranks.rs` (the ranks' processes), `output.rs` (forwarding
//! their output), `signals.rs` (the launcher's own signals), `rendezvous.rs` (the master
//! address and port), `report.rs` (the root cause and its box), `hang.rs` (where every rank
//! is), `agents.rs` (several nodes), `config.rs` ([`LaunchConfig`], each rank's environment),
//! `error.rs` ([`LaunchError`], [`RankFailure`], [`RankExit`]), `pet.rs` (ddprun's defaults from
//! torchrun's `PET_*` variables), `node_rank.rs` (torchrun's c10d rendezvous: node ranks without `--node-rank`),
//! `devices.rs` (the CPUs and GPUs that `--nproc-per-node auto`,
//! `cpu` and `gpu` count), `spawn.rs` ([`spawn`]).
//!
//! Unix only: it relies on process groups and signals.
#![cfg(unix)]
#![warn(missing_docs)]

mod agents;
mod attempt;
mod config;
mod devices;
mod error;
mod frozen;
mod hang;
mod launch;
mod node_rank;
mod output;
mod pet;
mod ranks;
mod rdzv_conf;
mod rendezvous;
mod report;
mod signals;
mod spawn;

pub use config::{rank_env, LaunchConfig, DEFAULT_GRACE_PERIOD, DEFAULT_MASTER_ADDR};
pub use ddp_comm::elastic::{
    finish, record_error, ERROR_FILE_ENV, MAX_RESTARTS_ENV, RESTART_COUNT_ENV,
};
pub use devices::nproc_per_node;
pub use error::{signal_name, BlamedRank, LaunchError, LaunchReport, RankExit, RankFailure};
pub use launch::launch;
pub use node_rank::{parse_endpoint, DEFAULT_RDZV_PORT};
pub use pet::{rdzv_backend, GivenFlags, PetDefaults};
pub use rdzv_conf::{parse_rdzv_conf, RdzvConf};
pub use rendezvous::bind_free_port;
pub use report::root_cause_box;
pub use spawn::{spawn, SpawnOptions};

/// The README's code blocks, compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
