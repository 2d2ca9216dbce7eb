//! One attempt of a launch: start every local rank, watch them until all have ended, and say
//! how the attempt ended ([`run_attempt`]; steps 2 to 5 of the crate documentation).
//!
//! The watch loop looks, every [`POLL_INTERVAL`], at four things in turn: the other nodes'
//! launchers (a restart decided elsewhere, a node lost), the launcher's own signals, the ranks,
//! and the grace period.
//!
//! In an elastic job (`--nnodes MIN:MAX`) a rank that fails is not a failure of the attempt:
//! it is restarted alone, with the same variables, while the attempt's restart budget lasts
//! (it rejoins the running job and is healed from a live peer), and otherwise left dead (the
//! job goes on without it). Only a rank that says the job fell below its minimum
//! ([`ddp_comm::elastic::ELASTIC_STOP_EXIT`]) fails the attempt and stops the others, so that
//! the job restarts from its last checkpoint as a new round, as without elasticity. The first rank that fails on its own is the first failure: the others
//! are asked for their flight records and stopped (`SIGTERM`, then `SIGKILL` once the grace
//! period is over, and everything they started with them). Every rank is reaped before any is
//! signalled within one look, so a rank that ended in the same look as the first failure is
//! known to have ended on its own, not because the launcher stopped it.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::config::LaunchConfig;
use crate::error::{signal_name, LaunchError, LaunchReport, RankExit, RankFailure};
use crate::hang::{ask_for_flight_records, hang_report_of, print_hang_report};
use crate::output::notice;
use crate::ranks::{poll_exit, start_rank, start_ranks, stop_running, Attempt, Rank};
use crate::report::diagnose;
use crate::signals::SignalForwarding;

/// How often the launcher looks at its ranks and at pending signals.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How long the launcher waits, after the last rank exited, for the output of processes that the
/// ranks left behind to drain before it stops reading.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How an attempt ended.
pub(crate) enum Ending {
    /// Every local rank exited 0.
    Succeeded(LaunchReport),
    /// A local rank failed; the others were stopped.
    RankFailed(Box<RankFailure>),
    /// Another node's launcher moved the job to the next round; this node's ranks were stopped.
    RestartRequested,
    /// The launch cannot go on: the launcher was interrupted, another node was lost, a rank
    /// could not be started or waited for.
    Error(LaunchError),
}

/// An attempt's ending, and whether the launcher received `SIGINT`/`SIGTERM` meanwhile (then no
/// restart may follow).
pub(crate) struct Outcome {
    pub ending: Ending,
    pub signalled: bool,
    /// Ranks restarted alone in an elastic job.
    pub rank_restarts: usize,
}

/// What the other nodes' launchers say, asked once per look: `Some(Ok(()))` a restart was
/// decided elsewhere, `Some(Err(why))` the job cannot go on, `None` nothing new.
pub(crate) type OtherNodes<'a> = &'a dyn Fn() -> Option<Result<(), String>>;

/// Starts the local ranks of `attempt` once, watches them until all have ended and reports how.
/// In an elastic job up to `rank_budget` failed ranks are restarted alone.
pub(crate) fn run_attempt(
    config: &LaunchConfig,
    attempt: Attempt<'_>,
    mut signals: Option<&mut SignalForwarding>,
    other_nodes: OtherNodes,
    rank_budget: usize,
) -> Outcome {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let ranks = match start_ranks(config, &attempt, &done_tx) {
        Ok(ranks) => ranks,
        Err(error) => {
            return Outcome {
                ending: Ending::Error(error),
                signalled: false,
                rank_restarts: 0,
            }
        }
    };
    let mut watch = Watch::new(config, ranks, &attempt);
    if config.min_nnodes.is_some() {
        watch.elastic = Some(Elastic {
            budget: rank_budget,
            restarted: 0,
            done_tx,
            lost: Vec::new(),
        });
    } else {
        drop(done_tx);
    }
    loop {
        watch.look_at_other_nodes(other_nodes);
        watch.look_at_signals(signals.as_deref_mut());
        watch.look_at_ranks();
        if watch.all_ended() {
            break;
        }
        watch.look_at_grace_period();
        thread::sleep(POLL_INTERVAL);
    }
    watch.kill_leftovers();
    let rank_restarts = watch.elastic.as_ref().map_or(0, |e| e.restarted);
    let lost = watch.elastic.take().map(|e| e.lost).unwrap_or_default();
    drain_output(&done_rx);
    let mut outcome = watch.outcome(lost.first().copied());
    outcome.rank_restarts = rank_restarts;
    outcome
}

/// Waits (at most [`DRAIN_TIMEOUT`]) until every output forwarder has seen its stream close.
fn drain_output(done: &mpsc::Receiver<()>) {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match done.recv_timeout(left) {
            Ok(()) => continue,
            Err(_) => break, // all forwarders done (disconnected) or out of time
        }
    }
}

/// An elastic job's restarts of single ranks (see the module documentation).
struct Elastic {
    /// How many ranks may still be restarted alone in this attempt.
    budget: usize,
    /// How many were.
    restarted: usize,
    /// For the output forwarders of restarted ranks (dropped when the watch ends).
    done_tx: mpsc::Sender<()>,
    /// Indices (into the ranks) of ranks that failed with no restart left.
    lost: Vec<usize>,
}

/// The watch loop's state.
struct Watch<'a> {
    config: &'a LaunchConfig,
    ranks: Vec<Rank>,
    attempt: &'a Attempt<'a>,
    /// Index (into `ranks`) of the first rank that failed on its own.
    first_failure: Option<usize>,
    /// The `SIGINT`/`SIGTERM` the launcher forwarded to the ranks.
    interrupted: Option<i32>,
    /// When the ranks still running get `SIGKILL`.
    kill_at: Option<Instant>,
    wait_error: Option<LaunchError>,
    /// Whether a `SIGINT`/`SIGTERM` reached the launcher.
    signalled: bool,
    /// Several nodes: a restart decided by another node's launcher (Ok) or a node lost (Err).
    stopped_by_other_nodes: Option<Result<(), String>>,
    /// An elastic job's restarts of single ranks.
    elastic: Option<Elastic>,
}

impl<'a> Watch<'a> {
    fn new(config: &'a LaunchConfig, ranks: Vec<Rank>, attempt: &'a Attempt<'a>) -> Watch<'a> {
        Watch {
            config,
            ranks,
            attempt,
            first_failure: None,
            interrupted: None,
            kill_at: None,
            wait_error: None,
            signalled: false,
            stopped_by_other_nodes: None,
            elastic: None,
        }
    }

    /// Whether the launcher is already stopping the ranks (for whatever reason).
    fn stopping(&self) -> bool {
        self.first_failure.is_some()
            || self.interrupted.is_some()
            || self.stopped_by_other_nodes.is_some()
    }

    /// Stops the running ranks with `SIGTERM` (or a forwarded `signal`), `SIGKILL` after the
    /// grace period.
    fn stop(&mut self, signal: i32) {
        stop_running(&mut self.ranks, signal);
        self.kill_at = Some(Instant::now() + self.config.grace_period);
    }

    fn all_ended(&self) -> bool {
        self.ranks.iter().all(|rank| rank.exit.is_some())
    }

    /// Another node's launcher decided a restart, or lost a node: stop this node's ranks.
    fn look_at_other_nodes(&mut self, other_nodes: OtherNodes) {
        if self.stopping() {
            return;
        }
        if let Some(stop) = other_nodes() {
            notice(&match &stop {
                Ok(()) => "a rank of another node failed; stopping this node's ranks".into(),
                Err(why) => format!("{why}; stopping this node's ranks"),
            });
            self.stop(libc::SIGTERM);
            self.stopped_by_other_nodes = Some(stop);
        }
    }

    /// `SIGUSR1`: print where every rank is. `SIGINT`/`SIGTERM`: print where every rank is and
    /// forward it; a second one kills at once.
    fn look_at_signals(&mut self, signals: Option<&mut SignalForwarding>) {
        let Some(signals) = signals else { return };
        let dir = self.attempt.trace_dir;
        if signals.take_usr1() {
            notice("received SIGUSR1: where each rank is");
            print_hang_report(&ask_for_flight_records(&mut self.ranks, dir), dir);
        }
        let Some(signal) = signals.take() else { return };
        self.signalled = true;
        if self.interrupted.is_none() && self.first_failure.is_none() {
            self.interrupted = Some(signal);
            print_hang_report(&ask_for_flight_records(&mut self.ranks, dir), dir);
            notice(&format!(
                "received {}; forwarding it to the ranks (SIGKILL in {:?}, or at once on a \
                 second signal)",
                signal_name(signal),
                self.config.grace_period
            ));
            self.stop(signal);
        } else {
            notice(&format!(
                "received {} while stopping; killing the ranks now",
                signal_name(signal)
            ));
            stop_running(&mut self.ranks, libc::SIGKILL);
            self.kill_at = None;
        }
    }

    /// Reaps every rank that ended since the last look, then decides: the first failure stops
    /// the others (after asking them where they are: the rank that never entered the collective
    /// the others wait in is often the real story).
    fn look_at_ranks(&mut self) {
        let ended: Vec<(usize, RankExit)> = (0..self.ranks.len())
            .filter_map(|i| poll_exit(&mut self.ranks[i], &mut self.wait_error).map(|e| (i, e)))
            .collect();
        for (i, exit) in ended {
            let (rank, local_rank) = (self.ranks[i].rank, self.ranks[i].local_rank);
            if exit.success() {
                continue;
            }
            if self.ranks[i].signalled {
                notice(&format!("rank {rank} stopped: {}", exit.without_hint()));
            } else if !self.stopping() && self.elastic_rank_ended(i, exit) {
                continue;
            } else if self.stopping() {
                notice(&format!(
                    "rank {rank} (local rank {local_rank}) {exit} as well"
                ));
            } else {
                self.first_failure = Some(i);
                notice(&format!(
                    "rank {rank} {exit}; stopping the other ranks (SIGTERM, SIGKILL after {:?})",
                    self.config.grace_period
                ));
                ask_for_flight_records(&mut self.ranks, self.attempt.trace_dir);
                self.stop(libc::SIGTERM);
            }
        }
        if self.wait_error.is_some() {
            stop_running(&mut self.ranks, libc::SIGKILL);
        }
    }

    /// In an elastic job, a rank that failed on its own while nothing is being stopped: restarts
    /// it alone while the budget lasts, or leaves it dead, and returns `true`; returns `false`
    /// (an ordinary failure: stop the others) when it says the job fell below its minimum, or
    /// the job is not elastic.
    fn elastic_rank_ended(&mut self, i: usize, exit: RankExit) -> bool {
        let Some(elastic) = self.elastic.as_mut() else {
            return false;
        };
        let rank = self.ranks[i].rank;
        let stop_code = i32::from(ddp_comm::elastic::ELASTIC_STOP_EXIT);
        if exit == RankExit::Code(stop_code) {
            notice(&format!(
                "rank {rank} {exit}: the elastic job fell below its minimum of ranks"
            ));
            return false;
        }
        if elastic.restarted >= elastic.budget {
            notice(&format!(
                "rank {rank} {exit}; no restart left: the elastic job goes on without it"
            ));
            elastic.lost.push(i);
            return true;
        }
        elastic.restarted += 1;
        let count = self.attempt.restarts_used + elastic.restarted;
        notice(&format!(
            "rank {rank} {exit}; restarting it alone to rejoin the elastic job (restart {count} \
             of {} of this launcher; {}={count})",
            self.config.max_restarts,
            ddp_comm::elastic::RESTART_COUNT_ENV
        ));
        let local_rank = self.ranks[i].local_rank;
        // After a move of the store (its node was lost), the rank joins where it is now.
        let moved = (self.attempt.store_now)();
        let attempt = match &moved {
            Some((addr, port)) => Attempt {
                master_addr: addr,
                master_port: *port,
                ..*self.attempt
            },
            None => *self.attempt,
        };
        match start_rank(self.config, &attempt, local_rank, count, &elastic.done_tx) {
            Ok(started) => self.ranks[i] = started,
            Err(error) => {
                notice(&format!("rank {rank} could not be restarted: {error}"));
                elastic.lost.push(i);
            }
        }
        true
    }

    /// Kills what is still running once the grace period is over.
    fn look_at_grace_period(&mut self) {
        if self.kill_at.is_some_and(|at| Instant::now() >= at) {
            notice(&format!(
                "grace period of {:?} over; killing the remaining ranks",
                self.config.grace_period
            ));
            stop_running(&mut self.ranks, libc::SIGKILL);
            self.kill_at = None;
        }
    }

    /// Kills what the ranks left behind in their process groups.
    fn kill_leftovers(&self) {
        for rank in &self.ranks {
            rank.signal_group(libc::SIGKILL);
        }
    }

    /// How the attempt ended, once every rank has: a launcher error first, then what the other
    /// nodes decided, then the first failure (diagnosed; in an elastic job, else the first rank
    /// `lost` for good), then an interruption, else success.
    fn outcome(mut self, lost: Option<usize>) -> Outcome {
        if self.first_failure.is_none() {
            self.first_failure = lost;
        }
        let (config, attempt) = (self.config, self.attempt);
        let ending = if let Some(error) = self.wait_error {
            Ending::Error(error)
        } else if let (Some(_), Some(signal)) = (&self.stopped_by_other_nodes, self.interrupted) {
            // A user's stop wins over a restart decided elsewhere.
            Ending::Error(LaunchError::Interrupted { signal })
        } else if let Some(stop) = self.stopped_by_other_nodes {
            match stop {
                Ok(()) => Ending::RestartRequested,
                Err(message) => Ending::Error(LaunchError::Agents { message }),
            }
        } else if let Some(i) = self.first_failure {
            let mut failure = diagnose(&self.ranks[i], &self.ranks, config, attempt.trace_dir);
            failure.hang_report = hang_report_of(attempt.trace_dir, config);
            failure.restarts = attempt.restart;
            Ending::RankFailed(Box::new(failure))
        } else if let Some(signal) = self.interrupted {
            Ending::Error(LaunchError::Interrupted { signal })
        } else {
            Ending::Succeeded(LaunchReport {
                master_port: attempt.master_port,
                exits: self
                    .ranks
                    .iter()
                    .map(|rank| rank.exit.unwrap_or(RankExit::Code(-1)))
                    .collect(),
                restarts: attempt.restart,
            })
        };
        Outcome {
            ending,
            signalled: self.signalled,
            rank_restarts: 0,
        }
    }
}
