//! [`launch`]: the whole launcher, as a loop over attempts (see the crate documentation for
//! what happens in each step).
//!
//! The restart loop. Attempt k (k = 0 is the first start) runs all local ranks with
//! `TORCHELASTIC_RESTART_COUNT=k` until they have all ended (`attempt.rs`). When every rank
//! succeeded, the job is done. When a rank failed (the others were already stopped: `SIGTERM`,
//! then `SIGKILL` after the grace period, and everything they started killed) and fewer than
//! `max_restarts` restarts were used, and no `SIGINT`/`SIGTERM` reached the launcher meanwhile
//! (a user who stops the job means it), the launcher starts all local ranks again as a new
//! rendezvous round: a new store on a fresh free `MASTER_PORT` on a single node (the same port
//! and store, emptied, when the port was given; see `rendezvous.rs`) and a new `DDP_JOB_ID`, so
//! that a straggler of the old group can neither reach the new store nor pass the new group's
//! handshake. Files of the old attempt in the trace directory are cleared first, so the new
//! attempt's report is its own. Any other ending (a failure with the
//! budget spent, an interruption, a launcher error) ends the job with that attempt's result,
//! exactly as without restarts. On several nodes the launchers agree on every round through
//! node 0's store (`agents.rs`) and meet again at the fixed `MASTER_PORT`.
//!
//! An elastic job (`--nnodes MIN:MAX`) restarts a failed rank alone, within the same budget
//! (`attempt.rs`), and its launchers do not coordinate rounds through a store of their own:
//! the ranks agree on their membership through the rendezvous store
//! (`ddp_comm::ElasticGroup`), and a round ends only when the job falls below its minimum
//! (every surviving rank exits with `ELASTIC_STOP_EXIT`, and every launcher that sees it
//! starts its ranks again in the next round, whose store keys are new). Node 0's launcher
//! hosts that store: when its own ranks are gone for good it keeps the store up until the job
//! is over on the other nodes, and then until every other node's launcher has seen the end
//! (`ddp_comm::AgentWatch`: each registers in the store, beats, and says when it leaves), so
//! that a rank another launcher restarts after the last step still finds the store, reads that
//! the job is over and exits 0. It waits at most [`ELASTIC_LINGER`] after the end, and not for
//! a launcher whose beat stopped ([`ddp_comm::AGENT_SILENCE`]: its node died hard). When every
//! other launcher that registered is gone and at least one died hard, while no rank of this
//! node is alive or this node's ranks alone are below the job's minimum, nobody is left to run
//! or end the job: node 0's launcher stops its ranks and exits with
//! [`LaunchError::ElasticAgentsLost`] naming those nodes, instead of hosting, or starting new
//! rounds, for nodes that are gone (so within the silence of their death). Every other node's
//! launcher hosts an empty standby store and publishes it in node 0's: when node 0 is lost (its
//! launcher and the store with it), the ranks move the store to the lowest live standby
//! (`ddp_comm`'s `failover.rs`), the other launchers' presence follows them there, and the
//! launcher whose standby it is hosts it from then on as node 0's did
//! (`take_over_the_store`) and keeps a redirect at the job's first address ([`keep_redirect`]),
//! through which a node 0 started again, or any agent given that address, finds the job; a new
//! round after the move starts its ranks at the moved store.
//!
//! Restarts are counted as torchrun counts them: `TORCHELASTIC_RESTART_COUNT` is the restarts
//! of the budget used before the process started, a rank restarted alone in an elastic job
//! included (so a rank restarted alone once sees 1); the store keys of an elastic round follow
//! the round instead (`DDP_ELASTIC_ROUND`, [`ddp_comm::ELASTIC_ROUND_ENV`]).

use std::cell::RefCell;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ddp_comm::{
    AgentPresence, AgentWatch, MovedStore, Redirect, TorchStoreHost, AGENT_BEAT, AGENT_SILENCE,
};

use crate::agents::Agents;
use crate::attempt::{run_attempt, Ending, Outcome};
use crate::config::{attempt_job_id, LaunchConfig};
use crate::error::{signal_name, LaunchError, LaunchReport, RankFailure};
use crate::output::notice;
use crate::ranks::Attempt;
use crate::rendezvous::{AttemptStore, Rendezvous};
use crate::report::failure_line;
use crate::signals::SignalForwarding;

/// The longest node 0's launcher keeps an elastic job's store up after the job is over, for
/// the other nodes' launchers to see the end (see the module documentation).
pub(crate) const ELASTIC_LINGER: Duration = Duration::from_secs(60);

/// How long another node's launcher of an elastic job tries to reach node 0's store to
/// register there.
const REGISTER_BY: Duration = Duration::from_secs(300);

/// Runs the job described by `config` on this node and waits for it; see the crate
/// documentation for what happens on the way. Returns when every local rank has ended and its
/// output has been forwarded, after restarting the ranks up to `config.max_restarts` times.
pub fn launch(config: &LaunchConfig) -> Result<LaunchReport, LaunchError> {
    check(config)?;
    let rendezvous = Rendezvous::settle(config)?;
    let store = rendezvous.first_store()?;
    let hosts = store._host.is_some();
    let config = &crate::node_rank::assign(config, &rendezvous.addr, store.port, hosts)?;
    let mut job = Job::start(config, rendezvous, store)?;
    loop {
        let outcome = job.run_attempt();
        match job.next_round(outcome) {
            Ok(None) => continue,
            Ok(Some(report)) => {
                job.end(false);
                return Ok(report);
            }
            Err(error) => {
                // A user who stops the job means it: no waiting for the other nodes.
                let interrupted = matches!(error, LaunchError::Interrupted { .. });
                job.end(interrupted);
                return Err(error);
            }
        }
    }
}

/// What a launch keeps from one attempt to the next.
struct Job<'a> {
    config: &'a LaunchConfig,
    program: &'a OsString,
    args: &'a [OsString],
    rendezvous: Rendezvous,
    /// This attempt's port, and the store this launcher hosts on it (node 0).
    store: AttemptStore,
    job_id: Option<String>,
    signals: Option<SignalForwarding>,
    /// Several nodes with restarts: this node's launcher among the others.
    agents: Option<Agents>,
    /// The ranks' flight records and error files, and whether it is the launcher's own (removed
    /// after a successful job) rather than the user's `DDP_TRACE_DIR`.
    trace_dir: (PathBuf, bool),
    /// Restarts of every local rank so far (rounds).
    restarts: usize,
    /// Ranks restarted alone so far (an elastic job), from the same budget.
    rank_restarts: usize,
    /// An elastic job on several nodes, on a node other than 0: this launcher in node 0's
    /// store, until it is dropped (see the module documentation).
    presence: Option<AgentPresence>,
    /// A `SIGINT`/`SIGTERM` ended this launcher's hosting of the store for the other nodes.
    stopped_hosting: bool,
    /// An elastic job on several nodes whose store this launcher hosts: the other nodes'
    /// launchers as the store shows them, looked at throughout the job (every look of the
    /// watch loop), so that a launcher's silence counts from its last beat.
    watch: RefCell<Option<AgentWatch>>,
    /// The job's secret, the user's `DDP_TOKEN` (the ranks inherit it), with which an elastic
    /// job's records are sealed (see [`job_secret`]).
    token: Option<String>,
    /// An elastic job on several nodes, on a node other than 0: this launcher's standby store,
    /// where the ranks move the job's store if node 0 is lost (see the module documentation).
    standby: Option<TorchStoreHost>,
    /// The port of the job's first store (node 0's), where a redirect points at the store
    /// once it moved here.
    first_port: u16,
    /// Once the ranks moved the job's store to this launcher's standby: the `moved` record it
    /// keeps at the job's first address (see [`keep_redirect`]).
    redirect: RefCell<Option<Redirect>>,
    /// A launcher that hosts the store at the job's first address (node 0 started again after
    /// its node was lost), once a `moved` record there says where the job went: its presence
    /// in the moved store, and that store's address (see [`follow_moved_job`]).
    follower: RefCell<Option<(AgentPresence, (String, u16))>>,
}

impl<'a> Job<'a> {
    /// Step 1, after the configuration was checked and the rendezvous settled (the first
    /// attempt's port bound and its store hosted, on node 0; the node rank taken there when
    /// it was to come from it): installs the signal handlers and joins the other nodes'
    /// launchers.
    fn start(
        config: &'a LaunchConfig,
        rendezvous: Rendezvous,
        store: AttemptStore,
    ) -> Result<Job<'a>, LaunchError> {
        let (program, args) = check(config)?;
        let master_port = store.port;
        let job_id = attempt_job_id(config, 0, master_port);
        let signals = match config.forward_signals {
            true => Some(SignalForwarding::install()?),
            false => None,
        };
        let agents = join_agents(config, &rendezvous.addr, master_port, job_id.as_deref())?;
        let trace_dir = trace_dir(job_id.as_deref());
        let elsewhere = config.min_nnodes.is_some() && store._host.is_none();
        let standby = match elsewhere && config.nnodes > 1 {
            true => Some(rendezvous.standby()?),
            false => None,
        };
        let token = job_secret(config);
        let presence = match elsewhere {
            true => Some(
                AgentPresence::start(
                    config.node_rank,
                    (&rendezvous.addr, master_port),
                    AGENT_BEAT,
                    Instant::now() + REGISTER_BY,
                    standby
                        .as_ref()
                        .map(|s| (config.local_addr.clone(), s.port())),
                    token.clone(),
                )
                .map_err(|e| LaunchError::Agents {
                    message: e.to_string(),
                })?,
            ),
            false => None,
        };
        let hosts = store._host.is_some();
        let watch = (config.min_nnodes.is_some() && config.nnodes > 1 && hosts)
            .then(|| AgentWatch::new(config.nnodes, AGENT_SILENCE));
        Ok(Job {
            config,
            program,
            args,
            rendezvous,
            store,
            job_id,
            signals,
            agents,
            trace_dir,
            restarts: 0,
            rank_restarts: 0,
            presence,
            stopped_hosting: false,
            watch: RefCell::new(watch),
            token,
            standby,
            first_port: master_port,
            redirect: RefCell::new(None),
            follower: RefCell::new(None),
        })
    }

    /// Steps 2 to 5, once: every local rank of this round, until all have ended.
    fn run_attempt(&mut self) -> Outcome {
        clear_trace_files(&self.trace_dir.0);
        let (presence, follower) = (self.presence.as_ref(), &self.follower);
        let store_now = move || {
            presence.and_then(AgentPresence::moved_to).or_else(|| {
                let follower = follower.borrow();
                let (p, at) = follower.as_ref()?;
                Some(p.moved_to().unwrap_or_else(|| at.clone()))
            })
        };
        // A new round after the job's store moved (its node was lost) starts where it is now.
        let moved = store_now();
        let (master_addr, master_port) = match &moved {
            Some((addr, port)) => (addr.as_str(), *port),
            None => (self.rendezvous.addr.as_str(), self.store.port),
        };
        let first = (self.rendezvous.addr.as_str(), self.first_port);
        let round = self.restarts as u32;
        let (redirect, token) = (&self.redirect, self.token.as_deref());
        let ours = self.standby.as_ref().or(self.store._host.as_ref());
        let redirect_now = || keep_redirect(redirect, presence, ours, first, round, token);
        redirect_now();
        let attempt = Attempt {
            program: self.program,
            args: self.args,
            master_addr,
            master_port,
            job_id: self.job_id.as_deref(),
            restart: self.restarts,
            restarts_used: self.restarts_used(),
            trace_dir: &self.trace_dir.0,
            store_now: &store_now,
        };
        let round = self.restarts as u64;
        let agents = self.agents.as_ref();
        let (watch, host) = (&self.watch, self.store._host.as_ref());
        let alone_below_min = self.alone_below_min();
        let node = self.config.node_rank;
        let other_nodes = || -> Option<Result<(), String>> {
            redirect_now();
            follow_moved_job(follower, host, node, token);
            if let (Some(w), Some(host)) = (watch.borrow_mut().as_mut(), host) {
                // Every other launcher gone, and this node's ranks cannot run the job alone:
                // they could only wait for nodes that are gone.
                if w.present(host).is_empty() && !w.lost().is_empty() && alone_below_min {
                    let lost = LaunchError::ElasticAgentsLost {
                        nodes: w.lost().to_vec(),
                        silence: w.silence(),
                    };
                    return Some(Err(lost.to_string()));
                }
            }
            let a = agents?;
            if let Some(why) = a.lost() {
                return Some(Err(why));
            }
            (a.round() > round).then_some(Ok(()))
        };
        let budget = self.restarts_left();
        let outcome = run_attempt(
            self.config,
            attempt,
            self.signals.as_mut(),
            &other_nodes,
            budget,
        );
        self.rank_restarts += outcome.rank_restarts;
        let mut outcome = outcome;
        if !matches!(outcome.ending, Ending::Succeeded(_)) {
            if let Err(error) = self.host_until_the_job_is_over() {
                outcome.ending = Ending::Error(error);
            }
        }
        outcome
    }

    /// Restarts of the budget used so far (rounds and single ranks together): torchrun's
    /// `TORCHELASTIC_RESTART_COUNT` for the ranks started next.
    fn restarts_used(&self) -> usize {
        self.restarts + self.rank_restarts
    }

    /// Restarts left of the budget (rounds and single ranks together).
    fn restarts_left(&self) -> usize {
        self.config
            .max_restarts
            .saturating_sub(self.restarts_used())
    }

    /// What the restarts used were, for the last line: `"1 of 2 restarts used"`, with `(N
    /// ranks restarted alone ...)` in an elastic job that restarted some.
    fn restarts_said(&self) -> String {
        let mut said = format!(
            "{} of {} restarts used",
            self.restarts_used(),
            self.config.max_restarts
        );
        if self.rank_restarts > 0 {
            let ranks = match self.rank_restarts {
                1 => "1 rank".to_string(),
                n => format!("{n} ranks"),
            };
            said.push_str(&format!(
                " ({ranks} restarted alone to rejoin the elastic job, {} restarts of the whole \
                 job)",
                self.restarts
            ));
        }
        said
    }

    /// The job is over for this launcher (its ranks are gone for good): another node's
    /// launcher of an elastic job says so in node 0's store; node 0's keeps its store until
    /// every other node's launcher has seen the end (not when the launcher was `interrupted`).
    fn end(&mut self, interrupted: bool) {
        drop(self.presence.take());
        drop(self.follower.borrow_mut().take());
        if !interrupted {
            self.host_until_every_node_saw_the_end();
        }
    }

    /// An elastic job on several nodes whose store this launcher hosts: its ranks are gone, but
    /// the other nodes' may still run; keep the store up until the job finished or stopped,
    /// or no other node's launcher is left to end it (or this launcher is told to stop:
    /// returns `Ok(false)` then). When every other launcher that registered has left or gone
    /// silent ([`AGENT_SILENCE`]) and at least one went silent (its node died hard), nobody is
    /// left to run or end the job: [`LaunchError::ElasticAgentsLost`], so that this launcher
    /// exits instead of restarting ranks that could only wait for nodes that are gone.
    fn host_until_the_job_is_over(&mut self) -> Result<bool, LaunchError> {
        self.take_over_the_store();
        if !self.agent_watch() {
            return Ok(true);
        }
        let round = self.restarts as u32;
        let mut said = false;
        loop {
            let Some(host) = self.store._host.as_ref() else {
                return Ok(true);
            };
            if ddp_comm::elastic_job_state(host, round, self.token.as_deref()).is_some() {
                return Ok(true);
            }
            let mut guard = self.watch.borrow_mut();
            let Some(watch) = guard.as_mut() else {
                return Ok(true);
            };
            if watch.present(host).is_empty() {
                if !watch.lost().is_empty() {
                    return Err(LaunchError::ElasticAgentsLost {
                        nodes: watch.lost().to_vec(),
                        silence: watch.silence(),
                    });
                }
                if said {
                    notice("no other node's launcher is left; no longer hosting the store");
                }
                return Ok(true);
            }
            drop(guard);
            if !said {
                said = true;
                notice(
                    "this node's ranks are gone; hosting the store until the elastic job is over",
                );
            }
            if self.signalled("no longer hosting the store") {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// At the end of an elastic job on several nodes whose store this launcher hosts: keeps
    /// the store up until the job is over (`host_until_the_job_is_over`) and then until every
    /// other node's launcher that registered has left (it has seen the end, and none of its
    /// ranks will use the store again) or gone silent, for at most [`ELASTIC_LINGER`] after
    /// the end.
    fn host_until_every_node_saw_the_end(&mut self) {
        match self.host_until_the_job_is_over() {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                notice(&error.to_string());
                return;
            }
        }
        if !self.agent_watch() {
            return;
        }
        let until = Instant::now() + ELASTIC_LINGER;
        let mut said = false;
        loop {
            let Some(host) = self.store._host.as_ref() else {
                return;
            };
            let present = match self.watch.borrow_mut().as_mut() {
                Some(watch) => watch.present(host),
                None => return,
            };
            if present.is_empty() {
                return;
            }
            if Instant::now() >= until {
                notice(&format!(
                    "the launchers of nodes {present:?} have not seen the end of the elastic job \
                     within {ELASTIC_LINGER:?}; no longer hosting the store"
                ));
                return;
            }
            if !said {
                said = true;
                notice(&format!(
                    "the elastic job is over; hosting the store until the launchers of nodes \
                     {present:?} have seen it (at most {ELASTIC_LINGER:?})"
                ));
            }
            if self.signalled("no longer hosting the store") {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// When the ranks moved the job's store to this launcher's standby (node 0 was lost: the
    /// standby holds their keys), this launcher hosts it from now on as node 0's did: it keeps
    /// it up until the job is over and every other launcher, whose presence followed the
    /// ranks there, has seen the end.
    fn take_over_the_store(&mut self) {
        let moved = self.store._host.is_none()
            && self.standby.as_ref().is_some_and(ddp_comm::ranks_moved_to);
        if !moved {
            return;
        }
        let Some(host) = self.standby.take() else {
            return;
        };
        notice(&format!(
            "the elastic job's store moved to this node's standby (port {}): node 0 is lost; \
             hosting it until the job is over",
            host.port()
        ));
        self.store = AttemptStore {
            port: host.port(),
            _host: Some(host),
        };
        *self.watch.borrow_mut() = Some(AgentWatch::new(self.config.nnodes, AGENT_SILENCE));
    }

    /// Whether this launcher watches the other nodes' launchers: it hosts the store of an
    /// elastic job on several nodes and was not told to stop.
    fn agent_watch(&self) -> bool {
        self.watch.borrow().is_some() && self.store._host.is_some() && !self.stopped_hosting
    }

    /// Whether this node's ranks alone are below the elastic job's minimum.
    fn alone_below_min(&self) -> bool {
        self.config
            .elastic_ranks()
            .is_some_and(|(min, _)| self.config.nproc_per_node < min)
    }

    /// Before a new round of an elastic job whose store this launcher hosts, when this node's
    /// ranks alone are below the job's minimum: waits until another node's launcher shows
    /// that it is alive (its beat moves: within [`AGENT_BEAT`]), or until every other launcher
    /// that registered has left or gone silent (at most [`AGENT_SILENCE`]); then, with at
    /// least one gone silent, the new round could only wait for nodes that are gone:
    /// [`LaunchError::ElasticAgentsLost`].
    fn other_nodes_alive(&mut self) -> Result<(), LaunchError> {
        if !self.alone_below_min() || !self.agent_watch() {
            return Ok(());
        }
        let since = Instant::now();
        loop {
            let Some(host) = self.store._host.as_ref() else {
                return Ok(());
            };
            let mut guard = self.watch.borrow_mut();
            let Some(watch) = guard.as_mut() else {
                return Ok(());
            };
            let present = watch.present(host);
            if watch.last_moved().is_some_and(|t| t > since) {
                return Ok(());
            }
            if present.is_empty() {
                return match watch.lost() {
                    [] => Ok(()),
                    lost => Err(LaunchError::ElasticAgentsLost {
                        nodes: lost.to_vec(),
                        silence: watch.silence(),
                    }),
                };
            }
            drop(guard);
            self.refuse_if_signalled()?;
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether a `SIGINT`/`SIGTERM` reached the launcher (it says so, and that it stops
    /// `what`).
    fn signalled(&mut self, what: &str) -> bool {
        match self.signals.as_mut().and_then(SignalForwarding::take) {
            Some(signal) => {
                notice(&format!("received {}; {what}", signal_name(signal)));
                self.stopped_hosting = true;
                true
            }
            None => false,
        }
    }

    /// Step 6: after an attempt, the job's report (`Ok(Some)`), its error, or `Ok(None)`: a
    /// restart, prepared (new port and job id).
    fn next_round(&mut self, outcome: Outcome) -> Result<Option<LaunchReport>, LaunchError> {
        let Outcome {
            ending, signalled, ..
        } = outcome;
        if !signalled {
            if let Some(first) = self.failure_elsewhere(&ending)? {
                self.restart_for_failure_elsewhere(first)?;
                return Ok(None);
            }
        }
        match ending {
            Ending::RankFailed(failure) if !signalled && self.restarts_left() > 0 => {
                self.other_nodes_alive()?;
                self.restart_after(&failure)?;
                Ok(None)
            }
            Ending::RankFailed(mut failure) => {
                if self.config.max_restarts > 0 && !signalled {
                    notice(&format!(
                        "rank {} failed and all {} restarts are used up; the job failed",
                        failure.culprit(),
                        self.config.max_restarts
                    ));
                }
                failure.restarts = self.restarts_used();
                Err(LaunchError::RankFailed(failure))
            }
            Ending::Succeeded(mut report) => {
                let (dir, own) = &self.trace_dir;
                if *own {
                    let _ = std::fs::remove_dir_all(dir);
                }
                if self.config.max_restarts > 0 {
                    notice(&format!("all ranks finished; {}", self.restarts_said()));
                }
                report.restarts = self.restarts_used();
                Ok(Some(report))
            }
            Ending::RestartRequested => Err(LaunchError::Agents {
                message: "another node's launcher asked for a restart after a stop signal".into(),
            }),
            Ending::Error(error) => Err(error),
        }
    }

    /// Several nodes: settles the round with the other launchers. A local failure is announced
    /// (the first node to announce a round's failure moves everyone on); a stop for a failure
    /// elsewhere, or a success here while a rank elsewhere failed, restarts as well. Returns the
    /// other node's failure that makes this node restart, if any.
    fn failure_elsewhere(&self, ending: &Ending) -> Result<Option<String>, LaunchError> {
        let Some(a) = &self.agents else {
            return Ok(None);
        };
        let round = self.restarts as u64;
        Ok(match ending {
            Ending::RankFailed(failure) => {
                let first = a.announce_failure(round, &failure_line(failure))?;
                let ours = format!("node {}: ", self.config.node_rank);
                (!first.starts_with(&ours)).then_some(first)
            }
            Ending::RestartRequested => Some(a.failure_of(round)?),
            Ending::Succeeded(_) if !a.finish_round(round)? => Some(a.failure_of(round)?),
            _ => None,
        })
    }

    /// Restarts this node's ranks because a rank of another node failed (`first`, as that
    /// node's launcher described it), or fails when the restarts are used up.
    fn restart_for_failure_elsewhere(&mut self, first: String) -> Result<(), LaunchError> {
        if self.restarts_left() == 0 {
            notice(&format!("the job failed on another node: {first}"));
            return Err(LaunchError::FailedElsewhere {
                max_restarts: self.config.max_restarts,
                first_failure: first,
            });
        }
        self.renew_store(self.restarts as u64)?;
        self.restarts += 1;
        notice(&format!(
            "{first}; restarting this node's {} ranks (restart {} of {})",
            self.config.nproc_per_node,
            self.restarts_used(),
            self.config.max_restarts
        ));
        self.refuse_if_signalled()?;
        self.job_id = attempt_job_id(self.config, self.restarts, self.store.port);
        Ok(())
    }

    /// Restarts every local rank after this node's `failure`.
    fn restart_after(&mut self, failure: &RankFailure) -> Result<(), LaunchError> {
        let round = self.restarts as u64;
        self.restarts += 1;
        let whose = if self.config.nnodes > 1 {
            "every node's"
        } else {
            "all"
        };
        let why = match &failure.blamed {
            Some(b) => format!(
                "rank {} failed (rank {} {}, and its error blames rank {})",
                b.rank,
                failure.rank,
                failure.exit.without_hint(),
                b.rank
            ),
            None => format!(
                "rank {} failed ({})",
                failure.rank,
                failure.exit.without_hint()
            ),
        };
        notice(&format!(
            "{why}; restarting {whose} {} ranks (restart {} of {})",
            self.config.nproc_per_node,
            self.restarts_used(),
            self.config.max_restarts
        ));
        if let Some(message) = &failure.message {
            notice(&format!("rank {}'s error:", failure.rank));
            for line in message.lines() {
                notice(&format!("  {line}"));
            }
        }
        // A stop request that arrived while the old group was going away.
        self.refuse_if_signalled()?;
        self.renew_store(round)?;
        self.job_id = attempt_job_id(self.config, self.restarts, self.store.port);
        Ok(())
    }

    /// Once every rank of round `round` has ended (on every node: the launchers agree on it),
    /// gives the next round a store of its own (`rendezvous.rs`): node 0's launcher renews its
    /// store, and only then do the other nodes' launchers go on to start their ranks.
    fn renew_store(&mut self, round: u64) -> Result<(), LaunchError> {
        let (rendezvous, store) = (&self.rendezvous, &mut self.store);
        // An elastic round's keys are its own (the round is in their prefix), and the other
        // nodes' ranks may still be ending: a given port's store is kept as it is.
        let keep = self.config.min_nnodes.is_some();
        match &self.agents {
            Some(a) => a.wait_stopped(round, || rendezvous.renew(store, keep)),
            None => rendezvous.renew(store, keep),
        }
    }

    /// A `SIGINT`/`SIGTERM` received since the last look ends the job instead of a restart.
    fn refuse_if_signalled(&mut self) -> Result<(), LaunchError> {
        if let Some(signal) = self.signals.as_mut().and_then(SignalForwarding::take) {
            notice(&format!("received {}; not restarting", signal_name(signal)));
            return Err(LaunchError::Interrupted { signal });
        }
        Ok(())
    }
}

/// The command to run, after checking the configuration's counts.
fn check(config: &LaunchConfig) -> Result<(&OsString, &[OsString]), LaunchError> {
    let (program, args) = config.command.split_first().ok_or(LaunchError::NoCommand)?;
    if config.nproc_per_node == 0 {
        return Err(LaunchError::Zero {
            what: "--nproc-per-node",
        });
    }
    if config.nnodes == 0 {
        return Err(LaunchError::Zero { what: "--nnodes" });
    }
    if config
        .min_nnodes
        .is_some_and(|min| min == 0 || min > config.nnodes)
    {
        return Err(LaunchError::Zero {
            what: "--nnodes MIN (1 <= MIN <= MAX)",
        });
    }
    if config.node_rank_at_rendezvous
        && (config.min_nnodes.is_none() || config.master_addr.is_none())
    {
        return Err(LaunchError::Environment(
            "--rdzv-backend c10d without --node-rank takes the node rank at the rendezvous: it \
             needs an elastic job (--nnodes MIN:MAX with MIN < MAX) and --rdzv-endpoint \
             HOST:PORT; else give --node-rank"
                .into(),
        ));
    }
    if config.node_rank >= config.nnodes {
        return Err(LaunchError::NodeRankOutOfRange {
            node_rank: config.node_rank,
            nnodes: config.nnodes,
        });
    }
    Ok((program, args))
}

/// Several nodes with restarts: the launchers coordinate through node 0's store on the port
/// after `master_port` (see `agents.rs`); a job name keeps other jobs' launchers out.
fn join_agents(
    config: &LaunchConfig,
    master_addr: &str,
    master_port: u16,
    job_id: Option<&str>,
) -> Result<Option<Agents>, LaunchError> {
    if config.nnodes == 1 || config.max_restarts == 0 || config.min_nnodes.is_some() {
        return Ok(None);
    }
    let port = master_port.checked_add(1).ok_or(LaunchError::Agents {
        message: format!("--master-port {master_port}: the launchers' store needs the next port"),
    })?;
    let name = job_id.map_or_else(
        || format!("ddprun-{master_addr}:{master_port}"),
        str::to_string,
    );
    Agents::join(config.node_rank, config.nnodes, master_addr, port, &name).map(Some)
}

/// When the ranks moved the job's store to this launcher's standby (`ours`: the standby, or the
/// store it hosts since it took it over; its `presence` followed them there), keeps a `moved`
/// record at the job's `first` address ([`Redirect`], sealed with `secret`) that points at the
/// store and `round`, so that a node 0 restarted there, or any agent or rank started later with
/// that address, finds the job (see `ddp_comm`'s `redirect.rs`). Nothing before a move, nor on
/// a launcher whose standby the job did not move to.
fn keep_redirect(
    redirect: &RefCell<Option<Redirect>>,
    presence: Option<&AgentPresence>,
    ours: Option<&TorchStoreHost>,
    first: (&str, u16),
    round: u32,
    secret: Option<&str>,
) {
    let Some((host, port)) = presence.and_then(AgentPresence::moved_to) else {
        return;
    };
    let to = MovedStore { host, port, round };
    let mut redirect = redirect.borrow_mut();
    if let Some(r) = redirect.as_ref() {
        r.point(to);
        return;
    }
    if !ours.is_some_and(|s| s.port() == port && ddp_comm::ranks_moved_to(s)) {
        return;
    }
    match Redirect::start(first, to.clone(), secret.map(str::to_string)) {
        Ok(r) => {
            notice(&format!(
                "the elastic job's store moved to this node's standby at {}:{port}; a store \
                 restarted at its first address {}:{} will be told so",
                to.host, first.0, first.1
            ));
            *redirect = Some(r);
        }
        Err(e) => notice(&format!(
            "cannot keep a redirect at the job's first address: {e}"
        )),
    }
}

/// A launcher that hosts the store at the job's first address (`host`: node 0 started again
/// after its node was lost, or the next agent on a c10d endpoint's host), once the agent that
/// hosts the moved store wrote a `moved` record there ([`ddp_comm::moved_record`], sealed with
/// `secret`): registers and beats in the moved store as node `node`'s launcher
/// ([`AgentPresence`]), so that its ranks restarted alone and its next rounds are given that
/// store, and its host waits for this launcher at the end as for any other. Its own ranks
/// follow the record by themselves. Once.
fn follow_moved_job(
    follower: &RefCell<Option<(AgentPresence, (String, u16))>>,
    host: Option<&TorchStoreHost>,
    node: usize,
    secret: Option<&str>,
) {
    if follower.borrow().is_some() {
        return;
    }
    let Some(to) = host.and_then(|h| ddp_comm::moved_record(h, secret)) else {
        return;
    };
    let at = (to.host.as_str(), to.port);
    let secret = secret.map(str::to_string);
    let by = Instant::now() + REGISTER_BY;
    match AgentPresence::start(node, at, AGENT_BEAT, by, None, secret) {
        Ok(presence) => {
            notice(&format!(
                "the elastic job's store moved to {}:{} while this node was away; following it \
                 there",
                to.host, to.port
            ));
            *follower.borrow_mut() = Some((presence, (to.host, to.port)));
        }
        Err(e) => notice(&format!("cannot follow the job to its moved store: {e}")),
    }
}

/// The secret that seals an elastic job's records in the store (ddp-comm's `elastic_seal.rs`):
/// the user's `DDP_TOKEN`, the same on every node (the ranks inherit it). An elastic job
/// without one is told that anyone who reaches its store can disturb it: no launcher can make
/// a secret for it, since the agents that join later must know it too.
fn job_secret(config: &LaunchConfig) -> Option<String> {
    let token = ddp_comm::elastic::job_token();
    if token.is_none() && config.min_nnodes.is_some() {
        notice(
            "DDP_TOKEN is not set: the elastic job's records in the store are not sealed, and \
             anyone who reaches MASTER_PORT can end it or make it re-form; set DDP_TOKEN to a \
             secret, the same on every node",
        );
    }
    token
}

/// The ranks' trace directory: the user's `DDP_TRACE_DIR`, else one of the launcher's own under
/// the temporary directory (the second value says which).
fn trace_dir(job_id: Option<&str>) -> (PathBuf, bool) {
    match std::env::var_os(ddp_comm::flight::TRACE_DIR_ENV) {
        Some(d) if !d.is_empty() => (PathBuf::from(d), false),
        _ => {
            let name = format!("ddprun-{}-{}", std::process::id(), job_id.unwrap_or("job"));
            (std::env::temp_dir().join(name), true)
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RankExit;
    use std::net::Ipv4Addr;
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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
        config.master_port = Some(
            crate::rendezvous::bind_free_port(Ipv4Addr::UNSPECIFIED.into())
                .and_then(|l| {
                    l.local_addr().map_err(|e| LaunchError::FreePort {
                        addr: "0.0.0.0".into(),
                        source: e,
                    })
                })
                .unwrap()
                .port(),
        );
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
