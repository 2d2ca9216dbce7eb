//! The re-form of an elastic group ([`ElasticGroup::reform`]) as rounds that survive a second
//! failure (issue 57 item 5): a rank killed during the re-form, a joiner killed before its group
//! formed, the decider killed before it published, a survivor merely busy.
//!
//! # How
//!
//! A re-form is a sequence of rounds, each deciding and forming the next generation number:
//!
//! 1. Every survivor reports in the generation that ended (its step, whom its error blames,
//!    the connections it lost).
//! 2. The next generation is decided under a *lease*: whoever wins the add on
//!    `g<n>/decider/<lease>` names itself there and decides; everyone else waits for
//!    `gen/<n>`, watching the decider's beat (`beat.rs`). A decider silent for the peer timeout
//!    has died: the waiters race for the next lease, and its winner decides without it. A
//!    decision is published once (the first add on `g<n>/publish`), so a late decider that
//!    was merely slow publishes nothing and follows the published one.
//! 3. The decider waits for every member until it reported, withdrew (a joiner whose group did
//!    not form), was named by a survivor (its error's root cause or a connection lost: a node's
//!    ranks die together) and did not beat for 300 ms, or went silent for the peer timeout. A
//!    member that beats is busy, not dead, and is waited for (up to the re-form's deadline).
//! 4. The members meet at `g<n>/ready/<slot>` before forming the group: a member that went
//!    silent instead (killed after its report, a joiner killed once admitted) fails the round
//!    naming it, and so does a group that does not form; the survivors then report in the
//!    generation that did not form and the next round decides without the member.
//!
//! Every wait is bounded by the re-form's deadline (`DDP_CONNECT_TIMEOUT` from its start), and
//! the rounds stop below MIN ([`CommError::ElasticStopped`]). A member that finished the job
//! (`done`, [`ElasticGroup::finish`]) committed its last step: a re-form that finds it, at a
//! round's start, while it decides or waits for the members, or below MIN, ends with
//! `Ok(None)` (the job is over), not with an error. That happens when a member's last vote
//! failed (a peer killed right after the last step, its connection reset before its last bytes
//! arrived) while the others committed it and finished: without it the survivor, alone below
//! MIN, failed the job that had just ended. The store must outlive the job
//! (the launcher's). When the node that hosts it is lost, the re-form moves to a standby store
//! and starts over there from the generation it leaves (`failover.rs`); any other error of the
//! store ends the re-form.

use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::membership::beat::{Liveness, NAMED_GRACE};
use crate::membership::group::{Change, Continue, ElasticGroup, StepStatus};
use crate::membership::hooks::die_at;
use crate::membership::records::{decide_next, Generation, Left, Member, Report};
use crate::membership::seal::{present, read, read_record, seal, seal_json};

/// Deadline of one store call of the membership.
const CALL: Duration = Duration::from_secs(30);

/// How often a re-form looks at the store while it waits.
const POLL: Duration = Duration::from_millis(10);

/// Where a re-form stands between its rounds: the generation left, whom this process blames
/// and why, the members whose connections it lost, and whether the job grows.
struct Round {
    prev: Generation,
    blamed: Option<usize>,
    why: String,
    lost: Vec<usize>,
    growth: bool,
}

/// Why a round ended without a group: the slot to blame, if known, and why in words.
pub(crate) struct Failed {
    pub(crate) blamed: Option<usize>,
    pub(crate) why: String,
}

impl ElasticGroup {
    /// Ends the current generation and joins the next (see the module documentation):
    /// reports `status` (and the rank `cause` blames, if any), lets the decider decide, and
    /// forms the new group, in as many rounds as failures during the re-form take. Drop every
    /// handle of the old group ([`group`](Self::group)) first: the last one shuts it down.
    /// Returns the new generation as this process sees it; [`CommError::ElasticStopped`] when
    /// fewer than MIN ranks remain (the error names the ranks lost); `Ok(None)` when the job
    /// finished meanwhile.
    pub fn reform(
        &mut self,
        status: StepStatus,
        cause: Option<&CommError>,
    ) -> Result<Option<Change>, CommError> {
        let deadline = Instant::now() + self.config.base.connect_timeout;
        let prev = self.generation.clone();
        tracing::debug!(
            "elastic: slot {} leaves generation {}: {cause:?}",
            self.me.slot,
            prev.number
        );
        let my_rank = prev.rank_of(self.me.slot, self.me.incarnation);
        let blamed = cause
            .and_then(CommError::peer)
            .filter(|&p| Some(p) != my_rank)
            .and_then(|p| prev.members.get(p))
            .map(|m| m.slot);
        let why = match cause {
            Some(e) => e.to_string(),
            None => "processes wait to join".to_string(),
        };
        // Every member whose connection this rank lost (a node's ranks die together; the
        // report blames one), written before the report, so that the decider finds it with it.
        let lost: Vec<usize> = self.pg.as_ref().map_or_else(Vec::new, |pg| {
            pg.lost_peers()
                .into_iter()
                .filter_map(|r| prev.members.get(r).map(|m| m.slot))
                .collect()
        });
        // The old group goes away on a thread of its own (see `group.rs`).
        if let Some(p) = self.poller.take() {
            p.stop();
        }
        if let Some(pg) = self.pg.take() {
            let _ = std::thread::Builder::new()
                .name("ddp-elastic-drop".into())
                .spawn(move || drop(pg));
        }
        let mut round = Round {
            prev,
            blamed,
            why,
            lost,
            growth: cause.is_none(),
        };
        let mut outcome = self.rounds(status, &mut round, deadline);
        loop {
            match outcome {
                // The store's node is lost: carry on in a standby store (`failover.rs`); one
                // lost during the move is moved from the same way.
                Err(e) if self.store_lost(&e) => {
                    tracing::warn!("elastic: slot {}: {e}", self.me.slot);
                    outcome = self
                        .move_store(&round.prev)
                        .and_then(|()| self.rounds(status, &mut round, deadline));
                }
                other => return other,
            }
        }
    }

    /// The rounds of [`reform`](Self::reform) in the current store, from `round`, which they
    /// keep up to date (a move to another store starts over from it).
    fn rounds(
        &mut self,
        status: StepStatus,
        round: &mut Round,
        deadline: Instant,
    ) -> Result<Option<Change>, CommError> {
        let mut live = Liveness::new(self.config.base.peer_timeout);
        loop {
            if self.job_done()? {
                return Ok(None);
            }
            let prev = round.prev.clone();
            let g = prev.number;
            let next = g + 1;
            let report = Report {
                incarnation: self.me.incarnation,
                committed: status.committed,
                finished: status.finished.then_some(status.committed + 1),
                blamed: round.blamed,
                why: round.why.clone(),
            };
            for (key, record) in [
                (format!("g{g}/lost/{}", self.me.slot), to_json(&round.lost)),
                (format!("g{g}/report/{}", self.me.slot), to_json(&report)),
            ] {
                self.store.set(&key, &seal(self.secret(), &key, &record))?;
            }
            die_at(self.me.slot, "reported");
            let reason = match round.growth {
                true => "growth".to_string(),
                false => format!("slot {} saw: {}", self.me.slot, round.why),
            };
            let generation = self.next_generation(&prev, &reason, &mut live, deadline)?;
            if let Some(why) = &generation.failed {
                if self.job_done()? {
                    return Ok(None);
                }
                return Err(self.below_min(why));
            }
            let Some(rank) = generation.rank_of(self.me.slot, self.me.incarnation) else {
                // Left out (it reported after the decision): join again, to be healed.
                tracing::warn!(
                    "elastic: slot {} was left out of generation {next}; joining again",
                    self.me.slot
                );
                self.generation = generation;
                return match self.admission(deadline)? {
                    None => Ok(None),
                    Some(rank) => Ok(Some(Change {
                        generation: self.generation.clone(),
                        rank,
                        action: Continue::Keep,
                        healed: true,
                    })),
                };
            };
            let action = if status.committed == generation.step {
                match status.finished {
                    true => Continue::DropFinished,
                    false => Continue::Keep,
                }
            } else if status.committed + 1 == generation.step && status.finished {
                Continue::ApplyFinished
            } else {
                return Err(CommError::Internal {
                    rank,
                    message: format!(
                        "elastic: generation {next} continues from step {} but slot {} \
                         committed step {} (finished the next: {})",
                        generation.step, self.me.slot, status.committed, status.finished
                    ),
                });
            };
            match self.form_next(generation.clone(), &mut live, deadline)? {
                Ok(()) => {
                    tracing::debug!("elastic: slot {} formed generation {next}", self.me.slot);
                    return Ok(Some(Change {
                        generation,
                        rank,
                        action,
                        healed: false,
                    }));
                }
                Err(failed) => {
                    tracing::warn!(
                        "elastic: slot {} starts another round: {}",
                        self.me.slot,
                        failed.why
                    );
                    round.blamed = failed.blamed;
                    round.why = failed.why;
                    round.lost = Vec::new();
                    round.growth = false;
                    round.prev = generation;
                }
            }
        }
    }

    /// The generation after `prev`, decided here when this process wins a decider's lease,
    /// else read once published (see the module documentation: a decider silent for the peer
    /// timeout is replaced by the winner of the next lease, who decides without it).
    fn next_generation(
        &self,
        prev: &Generation,
        reason: &str,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<Generation, CommError> {
        let next = prev.number + 1;
        let key = format!("gen/{next}");
        // Deciders that went silent before publishing: their reports do not count.
        let mut dead: Vec<Member> = Vec::new();
        let mut lease = 0u64;
        loop {
            let claim = format!("g{next}/decider/{lease}");
            let who_key = format!("{claim}/who");
            if self.store.add(&claim, 1)? == 1 {
                self.store
                    .set(&who_key, &seal_json(self.secret(), &who_key, &self.me))?;
                if next == 2 && lease == 0 {
                    die_at(self.me.slot, "deciding");
                }
                self.decide(prev, &dead, reason, live, deadline)?;
            }
            let watching = Instant::now();
            loop {
                if present(&self.store, self.secret(), &key)? {
                    return read_record(&self.store, self.secret(), &key, CALL);
                }
                let decider: Option<Member> = match present(&self.store, self.secret(), &who_key)? {
                    true => read(&self.store, self.secret(), &who_key, CALL, true)?,
                    false => None,
                };
                if Instant::now() > deadline {
                    return Err(CommError::StoreTimeout {
                        rank: self.me.slot,
                        addr: self.store.address().to_string(),
                        keys: format!(
                            "generation {next}, decided by {} (lease {lease})",
                            decider.map_or("nobody".to_string(), |m| format!("slot {}", m.slot))
                        ),
                        timeout: self.config.base.connect_timeout,
                    });
                }
                let gone = match &decider {
                    Some(m) if *m == self.me => false,
                    Some(m) => !live.alive(&self.store, m)?,
                    // The lease's winner died before it named itself.
                    None => watching.elapsed() > self.config.base.peer_timeout,
                };
                if gone {
                    tracing::warn!(
                        "elastic: the decider of generation {next} ({}) went silent before \
                         publishing it; slot {} races for its lease",
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

    /// The decision of the generation after `prev` (this process holds the lease): waits until
    /// every member reported, withdrew, was named by a survivor (its error's root cause, or a
    /// connection it lost), or went silent for the peer timeout (`dead`: silent deciders), or
    /// until `deadline`; then publishes, unless another decider published first.
    fn decide(
        &self,
        prev: &Generation,
        dead: &[Member],
        reason: &str,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let g = prev.number;
        let mut reports: Vec<(usize, Report)> = Vec::new();
        // The slots whose connections the reporters lost (written before each report).
        let mut lost: Vec<usize> = Vec::new();
        let mut withdrawn: Vec<usize> = Vec::new();
        loop {
            for m in &prev.members {
                if reports.iter().any(|(s, _)| *s == m.slot) || withdrawn.contains(&m.slot) {
                    continue;
                }
                let key = format!("g{g}/report/{}", m.slot);
                if present(&self.store, self.secret(), &key)? {
                    reports.push((m.slot, read_record(&self.store, self.secret(), &key, CALL)?));
                    let key = format!("g{g}/lost/{}", m.slot);
                    if present(&self.store, self.secret(), &key)? {
                        let slots: Vec<usize> =
                            read_record(&self.store, self.secret(), &key, CALL)?;
                        lost.extend(slots);
                    }
                } else if present(
                    &self.store,
                    self.secret(),
                    &format!("g{g}/withdrawn/{}", m.slot),
                )? {
                    withdrawn.push(m.slot);
                }
            }
            let settled = |m: &Member| {
                dead.contains(m)
                    || withdrawn.contains(&m.slot)
                    || reports
                        .iter()
                        .any(|(s, r)| *s == m.slot && r.incarnation == m.incarnation)
            };
            let named = |m: &Member| {
                lost.contains(&m.slot) || reports.iter().any(|(_, r)| r.blamed == Some(m.slot))
            };
            let mut waiting = Vec::new();
            for m in prev.members.iter().filter(|m| !settled(m)) {
                if live.alive(&self.store, m)? {
                    waiting.push(m);
                }
            }
            // The job finished meanwhile: decide now (the next round ends the re-form).
            if waiting.is_empty() || self.job_done()? {
                break;
            }
            // Everyone else is named as failed: a rank named by mistake (its connections closed
            // while it was busy) shows it is alive by beating within the grace.
            if waiting
                .iter()
                .all(|m| named(m) && live.still_for(m, NAMED_GRACE))
            {
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(
                    "elastic: generation {} is decided without slots {:?}: they beat but did not \
                     report before the re-form's deadline",
                    g + 1,
                    waiting.iter().map(|m| m.slot).collect::<Vec<_>>()
                );
                break;
            }
            std::thread::sleep(POLL);
        }
        reports.retain(|(s, r)| {
            !dead
                .iter()
                .any(|m| m.slot == *s && m.incarnation == r.incarnation)
        });
        let mut requests = Vec::new();
        let count = self.store.add("joins", 0)?.max(0) as u64;
        for n in prev.joins_seen + 1..=count {
            let key = format!("join/{n}");
            if let Some(request) = read(&self.store, self.secret(), &key, CALL, true)? {
                requests.push((n, request));
            }
        }
        let next = decide_next(
            prev,
            &reports,
            &requests,
            (self.config.min, self.config.max),
            reason,
        );
        if self.store.add(&format!("g{}/publish", next.number), 1)? != 1 {
            tracing::warn!(
                "elastic: slot {} decided generation {} after another decider published it",
                self.me.slot,
                next.number
            );
            return Ok(());
        }
        for Left { slot, rank, why } in &next.left {
            tracing::warn!("elastic: rank {rank} (slot {slot}) left: {why}");
        }
        self.publish(&next)
    }

    /// Whether a member finished the job (`done`, written by [`ElasticGroup::finish`]).
    fn job_done(&self) -> Result<bool, CommError> {
        present(&self.store, self.secret(), "done")
    }

    /// Forms `generation` (this process is a member) once every other member is ready to
    /// (`g<n>/ready/<slot>`). `Ok(Err)`: a member went silent instead, or the group did not
    /// form; the caller starts another round. `Err`: the store failed.
    pub(crate) fn form_next(
        &mut self,
        generation: Generation,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<Result<(), Failed>, CommError> {
        let n = generation.number;
        let key = format!("g{n}/ready/{}", self.me.slot);
        self.store.set(&key, &seal(self.secret(), &key, b"1"))?;
        loop {
            let mut waiting = None;
            for (rank, m) in generation.members.iter().enumerate() {
                if *m == self.me
                    || present(
                        &self.store,
                        self.secret(),
                        &format!("g{n}/ready/{}", m.slot),
                    )?
                {
                    continue;
                }
                if !live.alive(&self.store, m)? {
                    return Ok(Err(Failed {
                        blamed: Some(m.slot),
                        why: format!(
                            "rank {rank} (slot {}) of generation {n} went silent before its \
                             group formed",
                            m.slot
                        ),
                    }));
                }
                waiting = Some(m.slot);
            }
            let Some(slot) = waiting else { break };
            if self.job_done()? {
                return Ok(Err(Failed {
                    blamed: None,
                    why: format!("the job finished while generation {n} formed"),
                }));
            }
            if Instant::now() > deadline {
                return Ok(Err(Failed {
                    blamed: Some(slot),
                    why: format!(
                        "slot {slot} did not come to form generation {n} before the re-form's \
                         deadline"
                    ),
                }));
            }
            std::thread::sleep(POLL);
        }
        let members = generation.members.clone();
        let until = Instant::now() + self.formation_timeout(&generation);
        Ok(self.form(generation, until).map_err(|e| Failed {
            blamed: e.peer().and_then(|p| members.get(p)).map(|m| m.slot),
            why: format!("generation {n} did not form: {e}"),
        }))
    }
}

fn to_json<T: serde::Serialize>(value: &T) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}
