//! The founding decision of an elastic job (generation 1) under a lease, as a re-form's
//! (`reform.rs`), so that the death of the process that won it does not fail the job; and the
//! founding of a *new round* of a running job whose last generation is lost whole.
//!
//! # How
//!
//! Every process that finds no generation yet races for the lease `g1/decider/<lease>` (an
//! atomic add, from lease 0); the winner names itself at `g1/decider/<lease>/who` and decides
//! (`ElasticGroup::found`: it waits for `MAX` processes, or `MIN` and the last call, then
//! publishes generation 1); everyone else waits for `gen/latest` to move, watching the named
//! decider's beat (`beat.rs`). A decider silent for the peer timeout (or a lease nobody named
//! within it: its winner died in between) has died: the waiters race for the next lease, and
//! its winner founds the job without the dead deciders, whose join requests it leaves out (a
//! generation that named them would fail to form). Generation 1 is published once (the first
//! add on `g1/publish`), so a decider that was merely frozen and comes back publishes nothing
//! and follows the published one. Every wait is bounded by the join's deadline.
//!
//! # A new round
//!
//! A process waiting to join a running job is admitted by its members: at a step boundary
//! (rank 0's look-out sees the request) or by a re-form's decider. When every member was
//! killed at once (an OOM, a node-wide fault, a bad batch that ends every rank), nobody is
//! left to do either: every restarted rank used to wait out its connect deadline (300 s),
//! fail, be restarted and wait again, spending the job's restarts on a decider that no longer
//! existed. So a waiting process also watches the latest generation, every [`LOOK`]
//! ([`ElasticGroup::lost_generation`]), and takes it for lost when no member of it is left:
//!
//! - a member whose slot its launcher restarted (a request of another process of the same slot
//!   waits: a slot has one process at a time) is dead once its beat has not moved for
//!   [`NAMED_GRACE`], as a re-form drops a member a survivor named;
//! - a member that itself waits to join (its own request is pending: it withdrew from a group
//!   that did not form) runs nothing;
//! - any other member is dead once silent for the peer timeout.
//!
//! Then the waiting processes found the next generation number among themselves, exactly as
//! at founding: the same lease (under that generation's keys, which a re-form's deciders use
//! too, so that a member that was only slow and decides after all publishes nothing: each
//! generation is published once), the same wait (`MAX` of them, or `MIN` and the last call),
//! counting only the requests since the lost generation of processes that beat. The
//! generation is marked `new_round` (`records.rs::decide_new_round`): its members are not
//! healed from a peer (none holds the job's state) but resume from the job's last checkpoint,
//! as a job restarted below its minimum does, or from the start without one (the program's
//! part). Since the launchers restart the killed ranks at once, the first two signs come
//! within a fraction of a second: the new round trains again after its last call plus the
//! checkpoint's load, not after the peer timeout, and no restart is spent waiting.

use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::membership::beat::{Liveness, NAMED_GRACE};
use crate::membership::group::ElasticGroup;
use crate::membership::hooks::die_at;
use crate::membership::records::{
    decide_founding, decide_new_round, Generation, JoinRequest, Member,
};
use crate::membership::seal::{present, read, seal_json};

/// Deadline of one store call of the membership.
const CALL: Duration = Duration::from_secs(30);

/// How often a waiter looks at the store.
const POLL: Duration = Duration::from_millis(20);

/// How often a waiting process looks whether the latest generation is lost.
const LOOK: Duration = Duration::from_millis(100);

/// A latest generation of which no member is left (see the module documentation).
pub(crate) struct Lost {
    /// The generation.
    pub(crate) prev: Generation,
    /// Its members known dead: a decider among them is gone at once.
    pub(crate) dead: Vec<Member>,
}

/// What a waiting process saw of the latest generation, between its looks.
#[derive(Default)]
pub(crate) struct LostWatch {
    /// The latest generation, read again when `gen/latest` moves.
    prev: Option<Generation>,
    /// The join requests registered since `prev` was decided, read so far.
    requests: Vec<(u64, JoinRequest)>,
    /// When it last looked.
    looked: Option<Instant>,
}

impl ElasticGroup {
    /// Waits until the next generation exists, deciding it when this process wins a lease
    /// (see the module documentation): generation 1 without `lost`, else a new round after
    /// `lost`; or until the job is done or `deadline` has passed (the caller tells which).
    /// `live` watches the deciders' beats.
    pub(crate) fn await_founding(
        &mut self,
        lost: Option<&Lost>,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let g = lost.map_or(1, |l| l.prev.number + 1);
        // Deciders of earlier leases that went silent before they published.
        let mut dead: Vec<Member> = Vec::new();
        let mut lease = 0u64;
        loop {
            let claim = format!("g{g}/decider/{lease}");
            let who_key = format!("{claim}/who");
            if self.store.add(&claim, 1)? == 1 {
                self.store
                    .set(&who_key, &seal_json(self.secret(), &who_key, &self.me))?;
                if lease == 0 {
                    die_at(
                        self.me.slot,
                        if lost.is_some() {
                            "refounding"
                        } else {
                            "founding"
                        },
                    );
                }
                return self.found(lost.map(|l| &l.prev), &dead, live, deadline);
            }
            let watching = Instant::now();
            loop {
                if self.store.add("gen/latest", 0)?.max(0) as u64 >= g
                    || present(&self.store, self.secret(), "done")?
                    || self.saw_move()
                    || Instant::now() > deadline
                {
                    return Ok(());
                }
                let decider: Option<Member> = match present(&self.store, self.secret(), &who_key)? {
                    true => read(&self.store, self.secret(), &who_key, CALL, true)?,
                    false => None,
                };
                let gone = match &decider {
                    // A member of the lost generation (a re-form's decider, killed with the
                    // others) is known dead already.
                    Some(m) if lost.is_some_and(|l| l.dead.contains(m)) => true,
                    Some(m) => !live.alive(&self.store, m)?,
                    // The lease's winner died before it named itself.
                    None => watching.elapsed() > self.config.base.peer_timeout,
                };
                if gone {
                    tracing::warn!(
                        "elastic: the decider of generation {g} ({}) went silent before \
                         publishing it; slot {} races for the next lease",
                        decider
                            .as_ref()
                            .map_or("unnamed".to_string(), |m| format!("slot {}", m.slot)),
                        self.me.slot
                    );
                    dead.extend(decider);
                    lease += 1;
                    break;
                }
                std::thread::sleep(POLL);
            }
        }
    }

    /// The founding decision (this process won its lease): waits until `MAX` processes
    /// registered, or `MIN` did and the last call passed, then publishes the generation after
    /// `prev` (generation 1 without it, else a new round: from the requests since `prev`, of
    /// processes that beat), unless another decider published it first. The requests of
    /// `dead` (deciders of earlier leases that went silent) do not count.
    fn found(
        &mut self,
        prev: Option<&Generation>,
        dead: &[Member],
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let g = prev.map_or(1, |p| p.number + 1);
        let first = prev.map_or(1, |p| p.joins_seen + 1);
        let mut dead = dead.to_vec();
        let mut requests: Vec<(u64, JoinRequest)> = Vec::new();
        let mut min_since: Option<Instant> = None;
        let alive = loop {
            let count = self.store.add("joins", 0)?.max(0) as u64;
            self.read_requests(&mut requests, first, count)?;
            let mut slots: Vec<usize> = requests
                .iter()
                .filter(|(_, r)| !dead.contains(&r.member))
                .map(|(_, r)| r.member.slot)
                .collect();
            slots.sort_unstable();
            slots.dedup();
            // The job went on in a store it moved to: no second job here (`redirect.rs`).
            if slots.len() < self.config.max && self.saw_move() {
                return Ok(());
            }
            let enough = slots.len() >= self.config.max
                || (slots.len() >= self.config.min
                    && min_since.get_or_insert_with(Instant::now).elapsed()
                        >= self.config.last_call);
            if enough {
                // A new round counts only processes that beat: one that died since it asked
                // would fail the group's formation. Below MIN again, it waits on.
                if prev.is_some() {
                    for (_, r) in &requests {
                        if !dead.contains(&r.member) && !live.alive(&self.store, &r.member)? {
                            dead.push(r.member.clone());
                        }
                    }
                }
                let alive: Vec<(u64, JoinRequest)> = requests
                    .iter()
                    .filter(|(_, r)| !dead.contains(&r.member))
                    .cloned()
                    .collect();
                let mut kept: Vec<usize> = alive.iter().map(|(_, r)| r.member.slot).collect();
                kept.sort_unstable();
                kept.dedup();
                if kept.len() >= self.config.min {
                    break alive;
                }
                min_since = None;
            }
            if Instant::now() > deadline {
                return Err(CommError::StoreTimeout {
                    rank: self.me.slot,
                    addr: self.store.address().to_string(),
                    keys: format!(
                        "join requests of at least {} processes (MIN; {} registered: slots \
                         {slots:?})",
                        self.config.min,
                        slots.len()
                    ),
                    timeout: self.config.base.connect_timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut generation = match prev {
            None => decide_founding(&alive, self.config.max),
            Some(prev) => decide_new_round(prev, &alive, self.config.max),
        };
        // The dead deciders' requests are seen too: no later generation admits them.
        generation.joins_seen = generation
            .joins_seen
            .max(requests.last().map_or(0, |(n, _)| *n));
        if self.saw_move() {
            return Ok(());
        }
        if self.store.add(&format!("g{g}/publish"), 1)? != 1 {
            tracing::warn!(
                "elastic: slot {} decided generation {g} after another decider published it",
                self.me.slot
            );
            return Ok(());
        }
        self.publish(&generation)
    }

    /// Reads the join requests from `first` up to `count` not yet in `requests` (which holds
    /// those read so far, in order).
    fn read_requests(
        &self,
        requests: &mut Vec<(u64, JoinRequest)>,
        first: u64,
        count: u64,
    ) -> Result<(), CommError> {
        let from = requests.last().map_or(first, |(n, _)| n + 1);
        for n in from..=count {
            let key = format!("join/{n}");
            // A request that fails the secret check is a stranger's: it joins nothing.
            if let Some(request) = read(&self.store, self.secret(), &key, CALL, true)? {
                requests.push((n, request));
            }
        }
        Ok(())
    }

    /// A watch of the latest generation for [`lost_generation`](Self::lost_generation), as a
    /// process that starts to wait has it.
    pub(crate) fn lost_watch(&self) -> LostWatch {
        LostWatch::default()
    }

    /// Whether generation `latest` (the latest published) is lost: no member of it is left
    /// to admit this waiting process (see the module documentation). Looks every [`LOOK`] at
    /// most (`None` between looks); `watch` keeps what it read, `live` the members' beats.
    pub(crate) fn lost_generation(
        &mut self,
        watch: &mut LostWatch,
        latest: u64,
        live: &mut Liveness,
    ) -> Result<Option<Lost>, CommError> {
        if latest == 0 || watch.looked.is_some_and(|t| t.elapsed() < LOOK) {
            return Ok(None);
        }
        watch.looked = Some(Instant::now());
        if watch.prev.as_ref().map(|g| g.number) != Some(latest) {
            watch.prev = Some(self.read_generation(latest)?);
            watch.requests.clear();
        }
        let prev = watch.prev.as_ref().expect("read above");
        if prev.failed.is_some() {
            return Ok(None);
        }
        let count = self.store.add("joins", 0)?.max(0) as u64;
        self.read_requests(&mut watch.requests, prev.joins_seen + 1, count)?;
        let pending = |m: &Member, same: bool| {
            watch.requests.iter().any(|(_, r)| {
                r.member.slot == m.slot && (r.member.incarnation == m.incarnation) == same
            })
        };
        // The members not replaced first, one store call while the first of them lives (the
        // common case: a job that runs, a joiner waiting for its step boundary); then every
        // replaced one at each look, so that their graces run together, not one after the
        // other (16 members took 16 graces, 5 s, before).
        let mut dead = Vec::new();
        for m in prev
            .members
            .iter()
            .filter(|m| !pending(m, true) && !pending(m, false))
        {
            if live.alive(&self.store, m)? {
                return Ok(None);
            }
            dead.push(m.clone());
        }
        let mut left = true;
        // A member waiting to join itself (its own request pending) runs nothing.
        for m in prev
            .members
            .iter()
            .filter(|m| !pending(m, true) && pending(m, false))
        {
            // `alive` first: `still_for` reads what it saw.
            if live.alive(&self.store, m)? && !live.still_for(m, NAMED_GRACE) {
                left = false;
            } else {
                dead.push(m.clone());
            }
        }
        Ok(left.then(|| Lost {
            prev: prev.clone(),
            dead,
        }))
    }
}
