//! [`ElasticGroup`]: a process group whose membership changes while the job runs. Ranks leave
//! (they died, froze, or were cut off) and the survivors go on at the smaller world without
//! exiting; processes join (a launcher restarted a dead rank, or a new node came) and the world
//! grows at the next step boundary. The decisions are `membership/records.rs`'s; this file makes them
//! through the rendezvous store and forms each generation's process group.
//!
//! # How
//!
//! The store must outlive every rank: the launcher's (ddprun hosts a PyTorch `TCPStore`,
//! `TORCHELASTIC_USE_AGENT_STORE=True`); when the node that hosts it is lost, the survivors
//! move it to another node's standby store (`failover.rs`). Its keys, under the attempt's prefix and `elastic/`:
//!
//! * `terms`: what every process must share (job id, MIN:MAX, the program's `compat`); a
//!   process that differs is refused naming the field, and the job is not disturbed.
//! * `joins`, `join/<n>`: join requests, numbered by an atomic add.
//! * `gen/latest`, `gen/<g>`: the generations, decided once each by whoever holds the lease
//!   `g<g>/decider/<lease>` (an atomic add; the founding one too, `membership/founding.rs`);
//!   `g<g>/report/<slot>`: the survivors' reports when generation g
//!   ends; `done`: the job finished. With a secret (`DDP_TOKEN`) every record is sealed with
//!   it and one that fails the check is ignored (`elastic_seal.rs`): a stranger at the store
//!   can neither end the job, nor break a generation, nor join it.
//!
//! Each generation's process group is a new group of its own (its keys under `pg<g>/`, its job
//! id `<DDP_JOB_ID>-gen<g>`, new connections and shared-memory segments), so no straggler of an
//! old generation can reach a new one. The old group is dropped on a thread of its own: its
//! shutdown may wait for a frozen peer, and the survivors must not.
//!
//! # What a step costs
//!
//! Nothing in the store. Every step ends with [`ElasticGroup::should_commit`], one all-reduce
//! of one integer on the group's own transport (tens of microseconds over shared memory),
//! which is the commit vote of `membership/records.rs` and carries whether processes wait to join:
//! rank 0 alone looks at the store for them, every [`ElasticConfig::poll`], on a thread of its
//! own. So every member learns of a join at the same step boundary.
//!
//! # When something fails
//!
//! A collective that fails (a peer closed its connections: at once after a kill, as an
//! elastic group waits no grace for an ABORT that would explain the loss; a peer
//! silent for `DDP_PEER_TIMEOUT`: a frozen one) or a vote that fails sends every survivor to
//! [`ElasticGroup::reform`] (`membership/reform.rs`): it reports its step, a decider holding a
//! lease decides the next generation once every member has reported or been named by a
//! survivor (the root cause of its error, or any connection it lost: the ranks of a node die
//! together, and each error blames one) or has stopped beating in the store for the peer
//! timeout (`membership/beat.rs`: a busy member beats on and is waited for), and everyone forms
//! the new group. A second failure during all this (a member dead after its report, a joiner
//! dead once admitted, the decider dead before it published) starts another round; a member
//! left out (it reported too late) joins again as a new process would, and is healed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::collectives::element::ReduceOp;
use crate::config::GroupConfig;
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::launcher::env::{process_env, resolve, Explicit, Lookup};
use crate::membership::beat::{Beat, Liveness, StartupBeats};
use crate::membership::poller::Poller;
use crate::membership::records::{Generation, JobTerms, JoinRequest, Member};
use crate::membership::seal::{open, present, read_record, seal, seal_json};
use crate::membership::standby::{MovedStore, Standbys};
use crate::rendezvous::store::Store;
use crate::rendezvous::torch_store::agent_key_prefix;
use crate::transport::liveness::StartupWatch;

use crate::launcher::vars::LAST_CALL_ENV;
pub use crate::launcher::vars::{ELASTIC_ENV, ELASTIC_ROUND_ENV};

/// How long the founding waits for more processes once `MIN` have registered, unless `MAX`
/// have (torchrun's "last call").
pub const DEFAULT_LAST_CALL: Duration = Duration::from_secs(2);

/// How often rank 0 looks for processes waiting to join.
pub const DEFAULT_POLL: Duration = Duration::from_millis(100);

/// Deadline of one store call of the membership.
const CALL: Duration = Duration::from_secs(30);

/// How an elastic rank joins its job.
#[derive(Debug, Clone)]
pub struct ElasticConfig {
    /// The least number of ranks the job runs with; below it the job stops.
    pub min: usize,
    /// The most.
    pub max: usize,
    /// This process's slot: its launch `RANK`, kept across restarts.
    pub slot: usize,
    /// What every rank must share, in words (the model's name and parameter list, ...): a
    /// process with another is refused naming both. Written as settings, one `name = value`
    /// per line (`model = mlp (...)`, `lr = 0.001`, ...), a refusal names the first setting
    /// that differs and both its values.
    pub compat: String,
    /// See [`DEFAULT_LAST_CALL`].
    pub last_call: Duration,
    /// See [`DEFAULT_POLL`].
    pub poll: Duration,
    /// The store's address, the deadlines, the transport and the job id of every generation's
    /// group (its rank and world size are each generation's).
    pub base: GroupConfig,
}

impl ElasticConfig {
    /// The terms a process of this configuration joins on (the job, MIN:MAX, `compat`).
    pub(super) fn terms(&self) -> JobTerms {
        JobTerms {
            job_id: self.base.job_id.clone(),
            min: self.min,
            max: self.max,
            compat: self.compat.clone(),
        }
    }

    /// The configuration the environment gives, `None` without [`ELASTIC_ENV`]: the slot is
    /// `RANK`, the round [`ELASTIC_ROUND_ENV`] (else `TORCHELASTIC_RESTART_COUNT`), the store
    /// the launcher's at `MASTER_ADDR:MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`: required, since the store must outlive every
    /// rank). The last call is [`LAST_CALL_ENV`](crate::elastic::LAST_CALL_ENV)'s, else
    /// [`DEFAULT_LAST_CALL`]. `compat` is the program's (see [`ElasticConfig::compat`]).
    pub fn from_env(compat: &str) -> Result<Option<ElasticConfig>, CommError> {
        ElasticConfig::from_vars(compat, &process_env)
    }

    /// [`ElasticConfig::from_env`] through `lookup`.
    pub fn from_vars(compat: &str, lookup: Lookup) -> Result<Option<ElasticConfig>, CommError> {
        let Some(range) = lookup(ELASTIC_ENV).filter(|v| !v.trim().is_empty()) else {
            return Ok(None);
        };
        let (min, max) = parse_range(&range).ok_or_else(|| {
            CommError::config(
                ELASTIC_ENV,
                format!("{ELASTIC_ENV}={range:?}: expected MIN:MAX with 1 <= MIN <= MAX"),
            )
        })?;
        let mut base = resolve(&Explicit::default(), lookup)?;
        if let Some(round) = lookup(ELASTIC_ROUND_ENV).filter(|v| !v.trim().is_empty()) {
            let round = round.trim().parse::<u32>().map_err(|_| {
                CommError::config(
                    ELASTIC_ROUND_ENV,
                    format!("{ELASTIC_ROUND_ENV}={round:?}: expected a round number (0, 1, ...)"),
                )
            })?;
            base.torch_agent_store = base.torch_agent_store.map(|_| round);
        }
        let last_call = match lookup(LAST_CALL_ENV).filter(|v| !v.trim().is_empty()) {
            None => DEFAULT_LAST_CALL,
            Some(text) => text
                .trim()
                .parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| {
                    CommError::config(
                        LAST_CALL_ENV,
                        format!("{LAST_CALL_ENV}={text:?}: expected seconds (2, 0.5, 60, ...)"),
                    )
                })?,
        };
        if base.torch_agent_store.is_none() {
            return Err(CommError::config(
                ELASTIC_ENV,
                format!(
                    "{ELASTIC_ENV} needs a rendezvous store that outlives every rank: run under \
                     ddprun (or host a store outside the ranks and set \
                     {}=True)",
                    crate::launcher::contract::USE_AGENT_STORE_ENV
                ),
            ));
        }
        Ok(Some(ElasticConfig {
            min,
            max,
            slot: base.rank,
            compat: compat.to_string(),
            last_call,
            poll: DEFAULT_POLL,
            base,
        }))
    }
}

/// `MIN:MAX` (or a single count, MIN = MAX) with `1 <= MIN <= MAX`.
pub fn parse_range(text: &str) -> Option<(usize, usize)> {
    let (min, max) = match text.split_once(':') {
        Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
        None => {
            let n = text.trim().parse().ok()?;
            (n, n)
        }
    };
    (1 <= min && min <= max).then_some((min, max))
}

/// What the vote at the end of a step says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vote {
    /// Every rank finished the step: apply it.
    Commit,
    /// Apply it, then grow: processes wait to join ([`ElasticGroup::reform`] next).
    CommitAndGrow,
}

/// Where a rank stands when its generation ends, for [`ElasticGroup::reform`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStatus {
    /// The last step it applied for good (0 before the first).
    pub committed: u64,
    /// Whether it finished the step after `committed` (its collectives succeeded and it holds
    /// the result, not yet applied) while its vote did not complete.
    pub finished: bool,
}

/// What a survivor does with the step it finished but did not commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Continue {
    /// Nothing pending, or nothing to do: go on from the committed state.
    Keep,
    /// Another survivor committed it: apply it now.
    ApplyFinished,
    /// Nobody committed it: drop it (undo it where it was applied in part).
    DropFinished,
}

/// A new generation, as a member sees it.
#[derive(Debug, Clone)]
pub struct Change {
    /// The generation.
    pub generation: Generation,
    /// This process's rank in it.
    pub rank: usize,
    /// What to do with the step in flight.
    pub action: Continue,
    /// Whether this process joins with it and must be healed from rank 0 (weights, optimizer
    /// state, position), before anything else.
    pub healed: bool,
}

/// A process group whose membership changes while the job runs; see the module documentation.
pub struct ElasticGroup {
    pub(super) config: ElasticConfig,
    pub(super) me: Member,
    pub(super) store: Store,
    pub(super) generation: Generation,
    pub(super) pg: Option<Arc<ProcessGroup>>,
    /// Rank 0's look-out for join requests.
    pub(super) poller: Option<Poller>,
    /// Whether this process joined a running job (and must be healed) rather than founded it.
    pub(super) joined_running: bool,
    /// This process's beat in the store (`beat.rs`), from its join to its finish.
    pub(super) beat: Option<Beat>,
    /// The standby stores, kept up to date by the beat's thread (`standby.rs`).
    pub(super) standbys: Standbys,
    /// The addresses of the stores lost so far (`failover.rs`): never gone back to.
    pub(super) lost_stores: Vec<String>,
    /// While this process waits to be admitted: when it last looked for a `moved` record at
    /// the address it joined at (`redirect.rs`); `None` once it need not look any more.
    pub(super) looked_at: Option<Instant>,
    /// The connection it looks through (under the agents' prefix), made at the first look.
    pub(super) look_store: Option<Store>,
    /// The `moved` record it found, not followed yet.
    pub(super) moved_found: Option<MovedStore>,
}

impl std::fmt::Debug for ElasticGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticGroup")
            .field("slot", &self.me.slot)
            .field("generation", &self.generation.number)
            .field("members", &self.generation.slots())
            .finish()
    }
}

impl ElasticGroup {
    /// Joins the job: checks the job's terms, registers, and waits until a generation admits
    /// this process (the founding one, or a later one at a step boundary of the running job),
    /// then forms its group. `Ok(None)` when the job has already finished. A process the job
    /// refuses (another job, another MIN:MAX, another `compat`, the job at its maximum) gets
    /// [`CommError::ElasticRefused`] naming why; the job goes on.
    pub fn join(config: ElasticConfig) -> Result<Option<ElasticGroup>, CommError> {
        let base = &config.base;
        let restart = base.torch_agent_store.unwrap_or(0);
        let deadline = Instant::now() + base.connect_timeout;
        let store = Store::connect_torch(
            config.slot,
            &base.master_addr,
            base.master_port,
            format!("{}elastic/", agent_key_prefix(restart)),
            deadline,
            CALL,
        )?;
        let me = Member {
            slot: config.slot,
            incarnation: random_u64(),
            host: crate::transport::topology::host_identity()
                .split('/')
                .next()
                .unwrap_or_default()
                .to_string(),
        };
        let secret = base.token.as_deref();
        claim_or_check_terms(&store, secret, &config.terms(), &me)?;
        if present(&store, secret, "done")? {
            return Ok(None);
        }
        let standbys = Standbys::default();
        let beat = Beat::start(&me, base, &store, standbys.clone(), Instant::now() + CALL)?;
        let mut group = ElasticGroup {
            config,
            me,
            store,
            generation: Generation {
                number: 0,
                members: Vec::new(),
                step: 0,
                joined: Vec::new(),
                left: Vec::new(),
                joins_seen: 0,
                refused: Vec::new(),
                failed: None,
                reason: String::new(),
                new_round: false,
            },
            pg: None,
            poller: None,
            joined_running: false,
            beat: Some(beat),
            standbys,
            lost_stores: Vec::new(),
            looked_at: Some(Instant::now()),
            look_store: None,
            moved_found: None,
        };
        match group.admission(deadline)? {
            None => Ok(None),
            Some(_) => Ok(Some(group)),
        }
    }

    /// Registers a join request and waits until a generation admits it, forming its group:
    /// `Some(rank)`; `None` when the job finished meanwhile. Tries to found generation 1 when
    /// none exists yet.
    pub(super) fn admission(&mut self, deadline: Instant) -> Result<Option<usize>, CommError> {
        // The generations published before this request cannot admit it: only the latest is
        // read of them (it may say that the job stopped). A store the job moved to holds no
        // older ones (`failover.rs` seeds the generation the survivors left).
        let mut seen = self.generation_before_request()?;
        let mut n = self.request_to_join()?;
        let mut live = Liveness::new(self.config.base.peer_timeout);
        let mut tried_founding = false;
        // The latest generation, watched for a loss of every member (`founding.rs`).
        let mut watch = self.lost_watch();
        loop {
            // Joined at an address the job's store moved away from (`redirect.rs`): join there.
            if let Some(to) = self.moved_away() {
                self.follow_move(to)?;
                seen = self.generation_before_request()?;
                n = self.request_to_join()?;
                live = Liveness::new(self.config.base.peer_timeout);
                watch = self.lost_watch();
                tried_founding = true;
                continue;
            }
            if present(&self.store, self.secret(), "done")? {
                return Ok(None);
            }
            let mut latest = self.store.add("gen/latest", 0)?.max(0) as u64;
            if latest == 0 && !tried_founding {
                tried_founding = true;
                self.await_founding(None, &mut live, deadline)?;
                latest = self.store.add("gen/latest", 0)?.max(0) as u64;
            }
            while seen < latest {
                seen += 1;
                let generation = self.read_generation(seen)?;
                if let Some(why) = &generation.failed {
                    return Err(self.below_min(why));
                }
                if let Some(rank) = generation.rank_of(self.me.slot, self.me.incarnation) {
                    let founded = generation.number == 1 || generation.new_round;
                    self.joined_running =
                        !founded && (generation.number > 1 || generation.step > 0);
                    self.stop_looking();
                    if !founded {
                        crate::membership::hooks::die_at(self.me.slot, "admitted");
                    }
                    match self.form_next(generation, &mut live, deadline)? {
                        Ok(()) => return Ok(Some(rank)),
                        // Another member died before the group formed: the others start
                        // another round without this joiner, which withdraws (so that they
                        // need not wait for it) and asks again. A founding or a new round
                        // whose group did not form is then lost whole, and the processes
                        // waiting found another round (`founding.rs`): no restart is spent.
                        Err(failed) => {
                            tracing::warn!(
                                "elastic: slot {} withdraws from generation {seen} and asks to \
                                 join again: {}",
                                self.me.slot,
                                failed.why
                            );
                            let key = format!("g{seen}/withdrawn/{}", self.me.slot);
                            self.store.set(&key, &seal(self.secret(), &key, b"1"))?;
                            n = self.request_to_join()?;
                        }
                    }
                    continue;
                }
                if let Some((_, why)) = generation.refused.iter().find(|(r, _)| *r == n) {
                    return Err(CommError::ElasticRefused {
                        slot: self.me.slot,
                        host: self.me.host.clone(),
                        addr: self.store.address().to_string(),
                        reason: why.clone(),
                    });
                }
            }
            // Nobody is left to admit this process: found a new round (`founding.rs`).
            if let Some(lost) = self.lost_generation(&mut watch, latest, &mut live)? {
                tracing::warn!(
                    "elastic: no member of generation {latest} is left (slots {:?}: dead or \
                     waiting to join); slot {} founds a new round with the processes waiting",
                    lost.prev.slots(),
                    self.me.slot
                );
                self.await_founding(Some(&lost), &mut live, deadline)?;
                continue;
            }
            if Instant::now() > deadline {
                return Err(CommError::StoreTimeout {
                    rank: self.me.slot,
                    addr: self.store.address().to_string(),
                    keys: format!(
                        "a generation that admits slot {} (join request {n}; generations up to \
                         {latest} did not)",
                        self.me.slot
                    ),
                    timeout: self.config.base.connect_timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts this process's beat again in its store (after the store changed: a move, a
    /// redirect), connecting until `connect_by`; the old beat stops first.
    pub(super) fn beat_again(&mut self, connect_by: Instant) -> Result<(), CommError> {
        self.beat = None;
        let standbys = self.standbys.clone();
        let beat = Beat::start(
            &self.me,
            &self.config.base,
            &self.store,
            standbys,
            connect_by,
        )?;
        self.beat = Some(beat);
        Ok(())
    }

    /// The generation before this process's join request: one before the latest published
    /// (0 when none is), from where its admission reads on.
    fn generation_before_request(&self) -> Result<u64, CommError> {
        let latest = self.store.add("gen/latest", 0)?.max(0) as u64;
        Ok(self.generation.number.max(latest.saturating_sub(1)))
    }

    /// Registers a join request of this process; returns its number.
    fn request_to_join(&self) -> Result<u64, CommError> {
        let n = self.store.add("joins", 1)? as u64;
        let request = JoinRequest {
            member: self.me.clone(),
        };
        let key = format!("join/{n}");
        self.store
            .set(&key, &seal_json(self.secret(), &key, &request))?;
        Ok(n)
    }

    /// Writes `generation`, then moves `gen/latest` to it.
    pub(super) fn publish(&self, generation: &Generation) -> Result<(), CommError> {
        let g = generation.number;
        let key = format!("gen/{g}");
        self.store
            .set(&key, &seal_json(self.secret(), &key, generation))?;
        self.store.add("gen/latest", 1)?;
        tracing::info!(
            "elastic: generation {g} ({}): slots {:?}, from step {}",
            generation.reason,
            generation.slots(),
            generation.step
        );
        Ok(())
    }

    pub(super) fn read_generation(&self, g: u64) -> Result<Generation, CommError> {
        read_record(&self.store, self.secret(), &format!("gen/{g}"), CALL)
    }

    /// The job's secret, which seals its records (`elastic_seal.rs`).
    pub(super) fn secret(&self) -> Option<&str> {
        self.config.base.token.as_deref()
    }

    /// How long the members of `generation` take at most to form its group: the connect
    /// deadline for the founding one and a new round (every process is starting), else twice
    /// the peer timeout plus 5 s (they are all running; one that does not come makes the next
    /// generation).
    pub(super) fn formation_timeout(&self, generation: &Generation) -> Duration {
        let base = &self.config.base;
        if generation.number <= 1 || generation.new_round {
            base.connect_timeout
        } else {
            (base.peer_timeout * 2 + Duration::from_secs(5)).min(base.connect_timeout)
        }
    }

    /// Forms `generation`'s process group (this process is a member) and, on its rank 0,
    /// starts the look-out for join requests.
    pub(super) fn form(
        &mut self,
        generation: Generation,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let rank = generation
            .rank_of(self.me.slot, self.me.incarnation)
            .expect("a member forms its group");
        let g = generation.number;
        let mut config = self.config.base.clone();
        config.rank = rank;
        config.world_size = generation.members.len();
        config.store_scope = Some(format!("elastic/pg{g}/"));
        config.job_id = self
            .config
            .base
            .job_id
            .as_ref()
            .map(|j| format!("{j}-gen{g}"));
        config.connect_timeout = deadline.saturating_duration_since(Instant::now());
        config.small_allreduce_bytes =
            crate::config::default_small_allreduce_bytes(config.world_size);
        // Until the start-up barrier passed, a member silent on its links is waited for while
        // it beats in the store (it starts slowly), as a re-form waits for a busy member
        // (`transport/liveness.rs`, `beat.rs`). The hold is a test hook, for the first
        // generation this process forms.
        let hold = match self.pg.is_none() && self.generation.number == 0 {
            true => crate::membership::hooks::hold_for(self.me.slot),
            false => None,
        };
        let watch = Arc::new(StartupWatch::new(generation.members.len(), hold));
        let answers = StartupBeats::start(
            self.me.slot,
            &self.config.base,
            &self.store,
            generation.members.clone(),
            watch.clone(),
        )?;
        // No grace after a lost connection: a survivor fails the generation at the first
        // connection lost (a kill is seen at once, not 400 ms later) and reports. Attribution
        // needs no wait here: who goes on is decided from the reports, and a rank named by
        // mistake is kept because it reports too (`decide`).
        let pg = ProcessGroup::init(config, None, Duration::ZERO, Some(watch));
        drop(answers);
        let pg = Arc::new(pg?);
        self.poller = if rank == 0 {
            Some(Poller::start(
                (self.config.slot, &self.config.base, self.config.poll),
                &self.store,
                generation.joins_seen,
            )?)
        } else {
            None
        };
        self.generation = generation;
        self.pg = Some(pg);
        Ok(())
    }

    /// The current generation's process group. Hold it only for a step: [`reform`](Self::reform)
    /// replaces it, and the old group shuts down once every holder has dropped it.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        self.pg.as_ref().expect("a member has a group")
    }

    /// The current generation.
    pub fn generation(&self) -> &Generation {
        &self.generation
    }

    /// This process's slot.
    pub fn slot(&self) -> usize {
        self.me.slot
    }

    /// This process's rank in the current generation.
    pub fn rank(&self) -> usize {
        self.group().rank()
    }

    /// The current generation's world size.
    pub fn world_size(&self) -> usize {
        self.generation.members.len()
    }

    /// The configuration.
    pub fn config(&self) -> &ElasticConfig {
        &self.config
    }

    /// Whether this process joined a running job (it must be healed from rank 0 before its
    /// first step) rather than founding it.
    pub fn joined_running(&self) -> bool {
        self.joined_running
    }

    /// The vote at the end of a step whose collectives all succeeded on this rank (torchft's
    /// `should_commit`): one all-reduce of one integer. `Ok`: every rank finished the step;
    /// apply it (and with [`Vote::CommitAndGrow`], then call [`reform`](Self::reform)). An
    /// error: do not apply it yet; call [`reform`](Self::reform) with `finished: true`.
    pub fn should_commit(&self) -> Result<Vote, CommError> {
        let waiting = self.poller.as_ref().is_some_and(Poller::waiting);
        let all = self
            .group()
            .all_reduce(vec![i64::from(waiting)], ReduceOp::Max)?;
        Ok(if all[0] > 0 {
            Vote::CommitAndGrow
        } else {
            Vote::Commit
        })
    }

    /// Says the job finished: processes still waiting to join, and any that arrives later (a
    /// rank restarted after the last step), get `Ok(None)` from [`join`](Self::join) and exit.
    /// Call it on every rank once training is over. Every member's call writes it: a member
    /// that finished has committed the last step, so the job is over, even when rank 0 died
    /// before its own call.
    pub fn finish(&mut self) -> Result<(), CommError> {
        if let Some(p) = self.poller.take() {
            p.stop();
        }
        self.beat = None;
        self.store.set("done", &seal(self.secret(), "done", b"1"))
    }

    /// The error of a job below its minimum, noted for the error file and the exit code the
    /// launcher reads (see [`crate::launcher::contract::finish`]).
    pub(super) fn below_min(&self, why: &str) -> CommError {
        crate::launcher::contract::note_elastic_stop();
        CommError::ElasticStopped {
            slot: self.me.slot,
            message: why.to_string(),
        }
    }
}

impl Drop for ElasticGroup {
    fn drop(&mut self) {
        if let Some(p) = self.poller.take() {
            p.stop();
        }
    }
}

/// Claims the job's terms in `store` for `terms` when nobody did yet, else checks them: a
/// process whose terms differ (another job, another MIN:MAX, another `compat`) is refused
/// ([`CommError::ElasticRefused`] naming `me` and why).
pub(super) fn claim_or_check_terms(
    store: &Store,
    secret: Option<&str>,
    terms: &JobTerms,
    me: &Member,
) -> Result<(), CommError> {
    if store.add("terms/claim", 1)? == 1 {
        return store.set("terms", &seal_json(secret, "terms", terms));
    }
    let job: JobTerms = read_record(store, secret, "terms", CALL)?;
    match job.refuse(terms) {
        None => Ok(()),
        Some(reason) => Err(CommError::ElasticRefused {
            slot: me.slot,
            host: me.host.clone(),
            addr: store.address().to_string(),
            reason,
        }),
    }
}

/// Where the elastic job of attempt `restart` stands, as the store `host` holds it (for the
/// launcher that hosts it): `None` while it runs (or has not started), `Some(Ok(()))` once it
/// finished, `Some(Err(why))` once it stopped below its minimum. Records that fail the check
/// of the job's `secret` (`DDP_TOKEN`) are taken for absent.
pub fn elastic_job_state(
    host: &crate::TorchStoreHost,
    restart: u32,
    secret: Option<&str>,
) -> Option<Result<(), String>> {
    let prefix = format!("{}elastic/", agent_key_prefix(restart));
    let value = |key: &str| {
        let bytes = host.value(&format!("{prefix}{key}"))?;
        open(secret, key, &bytes).ok().map(<[u8]>::to_vec)
    };
    if value("done").is_some() {
        return Some(Ok(()));
    }
    let latest: u64 = String::from_utf8(host.value(&format!("{prefix}gen/latest"))?)
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let generation: Generation = serde_json::from_slice(&value(&format!("gen/{latest}"))?).ok()?;
    generation.failed.map(Err)
}

/// A random 64-bit number (std's randomly keyed hasher over the time and the process id).
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_as_torchrun_writes_them() {
        assert_eq!(parse_range("2:3"), Some((2, 3)));
        assert_eq!(parse_range(" 1 : 4 "), Some((1, 4)));
        assert_eq!(parse_range("3"), Some((3, 3)));
        for bad in ["0:2", "3:2", "a:b", "", "2:"] {
            assert_eq!(parse_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn the_configuration_needs_the_variable_and_an_agent_store() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert!(ElasticConfig::from_vars("m", &vars(&[("RANK", "1")]))
            .unwrap()
            .is_none());
        let e = ElasticConfig::from_vars("m", &vars(&[("DDP_ELASTIC", "3:2")])).unwrap_err();
        assert!(e.to_string().contains("DDP_ELASTIC=\"3:2\""), "{e}");
        let e = ElasticConfig::from_vars(
            "m",
            &vars(&[
                ("DDP_ELASTIC", "2:3"),
                ("RANK", "1"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
            ]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("outlives every rank"), "{e}");
        let c = ElasticConfig::from_vars(
            "m",
            &vars(&[
                ("DDP_ELASTIC", "2:3"),
                ("RANK", "2"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((c.min, c.max, c.slot), (2, 3, 2));
        assert_eq!(c.last_call, DEFAULT_LAST_CALL);
    }

    /// `DDP_ELASTIC_LAST_CALL` sets the founding's last call; a value that is not seconds is
    /// an error naming the variable and the value.
    #[test]
    fn the_last_call_comes_from_its_variable() {
        let with = |last_call: &'static str| {
            let pairs = [
                ("DDP_ELASTIC", "1:2"),
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("DDP_ELASTIC_LAST_CALL", last_call),
            ];
            ElasticConfig::from_vars("m", &move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        let c = with("60").unwrap().unwrap();
        assert_eq!(c.last_call, Duration::from_secs(60));
        assert_eq!(
            with(" 0.5 ").unwrap().unwrap().last_call,
            Duration::from_millis(500)
        );
        for bad in ["-1", "soon", "1e400"] {
            let e = with(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("DDP_ELASTIC_LAST_CALL={bad:?}")), "{e}");
        }
    }

    /// The store keys' round is ddprun's `DDP_ELASTIC_ROUND` where given, not torchrun's
    /// restart count (which counts this rank's own restarts too).
    #[test]
    fn the_round_comes_from_ddprun_else_from_the_restart_count() {
        let with = |round: Option<&'static str>| {
            move |k: &str| {
                let pairs = [
                    ("DDP_ELASTIC", "2:3"),
                    ("RANK", "2"),
                    ("WORLD_SIZE", "3"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", "29500"),
                    ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                    ("TORCHELASTIC_RESTART_COUNT", "3"),
                ];
                match k {
                    "DDP_ELASTIC_ROUND" => round.map(str::to_string),
                    _ => pairs
                        .iter()
                        .find(|(n, _)| *n == k)
                        .map(|(_, v)| v.to_string()),
                }
            }
        };
        let round = |r| {
            ElasticConfig::from_vars("m", &with(r))
                .unwrap()
                .unwrap()
                .base
                .torch_agent_store
        };
        assert_eq!(round(None), Some(3));
        assert_eq!(round(Some("1")), Some(1));
        let e = ElasticConfig::from_vars("m", &with(Some("x"))).unwrap_err();
        assert!(e.to_string().contains("DDP_ELASTIC_ROUND=\"x\""), "{e}");
    }
}
