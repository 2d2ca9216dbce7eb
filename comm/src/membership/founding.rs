//! The founding decision of an elastic job (generation 1) under a lease, as a re-form's
//! (`reform.rs`), so that the death of the process that won it does not fail the job.
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

use std::time::Instant;

use crate::error::CommError;
use crate::membership::beat::Liveness;
use crate::membership::group::ElasticGroup;
use crate::membership::hooks::die_at;
use crate::membership::records::Member;
use crate::membership::seal::{present, read, seal_json};

/// Deadline of one store call of the membership.
const CALL: std::time::Duration = std::time::Duration::from_secs(30);

/// Where a process stands in the founding decision.
pub(crate) struct FoundingLease {
    /// The lease raced for, or watched.
    number: u64,
    /// Whether this process has raced for it.
    raced: bool,
    /// Since when this process watches it.
    watching: Instant,
    /// Deciders of earlier leases that went silent before they published.
    dead: Vec<Member>,
}

impl FoundingLease {
    /// Lease 0, not raced for yet.
    pub(crate) fn new() -> FoundingLease {
        FoundingLease {
            number: 0,
            raced: false,
            watching: Instant::now(),
            dead: Vec::new(),
        }
    }
}

impl ElasticGroup {
    /// One look at the founding decision while no generation exists (see the module
    /// documentation): races for `lease` when this process has not yet, and founds the job when
    /// it wins; else watches its decider and, once it has gone silent, moves to the next lease
    /// (the caller calls again while no generation exists).
    pub(crate) fn found_under_lease(
        &mut self,
        lease: &mut FoundingLease,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let claim = format!("g1/decider/{}", lease.number);
        let who_key = format!("{claim}/who");
        if !lease.raced {
            lease.raced = true;
            lease.watching = Instant::now();
            if self.store.add(&claim, 1)? == 1 {
                self.store
                    .set(&who_key, &seal_json(self.secret(), &who_key, &self.me))?;
                if lease.number == 0 {
                    die_at(self.me.slot, "founding");
                }
                return self.found(&lease.dead, deadline);
            }
            return Ok(());
        }
        let decider: Option<Member> = match present(&self.store, self.secret(), &who_key)? {
            true => read(&self.store, self.secret(), &who_key, CALL, true)?,
            false => None,
        };
        let gone = match &decider {
            Some(m) if *m == self.me => false,
            Some(m) => !live.alive(&self.store, m)?,
            // The lease's winner died before it named itself.
            None => lease.watching.elapsed() > self.config.base.peer_timeout,
        };
        if gone {
            tracing::warn!(
                "elastic: the founding decider ({}) went silent before publishing generation \
                 1; slot {} races for the next lease",
                decider
                    .as_ref()
                    .map_or("unnamed".to_string(), |m| format!("slot {}", m.slot)),
                self.me.slot
            );
            lease.dead.extend(decider);
            lease.number += 1;
            lease.raced = false;
        }
        Ok(())
    }
}
