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

use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::membership::beat::Liveness;
use crate::membership::group::ElasticGroup;
use crate::membership::hooks::die_at;
use crate::membership::records::Member;
use crate::membership::seal::{present, read, seal_json};

/// Deadline of one store call of the membership.
const CALL: Duration = Duration::from_secs(30);

/// How often a waiter looks at the store.
const POLL: Duration = Duration::from_millis(20);

impl ElasticGroup {
    /// Waits until generation 1 exists, founding it when this process wins a lease (see the
    /// module documentation), or until the job is done or `deadline` has passed (the caller
    /// tells which). `live` watches the deciders' beats.
    pub(crate) fn await_founding(
        &mut self,
        live: &mut Liveness,
        deadline: Instant,
    ) -> Result<(), CommError> {
        // Deciders of earlier leases that went silent before they published.
        let mut dead: Vec<Member> = Vec::new();
        let mut lease = 0u64;
        loop {
            let claim = format!("g1/decider/{lease}");
            let who_key = format!("{claim}/who");
            if self.store.add(&claim, 1)? == 1 {
                self.store
                    .set(&who_key, &seal_json(self.secret(), &who_key, &self.me))?;
                if lease == 0 {
                    die_at(self.me.slot, "founding");
                }
                return self.found(&dead, deadline);
            }
            let watching = Instant::now();
            loop {
                if self.store.add("gen/latest", 0)? > 0
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
                    Some(m) => !live.alive(&self.store, m)?,
                    // The lease's winner died before it named itself.
                    None => watching.elapsed() > self.config.base.peer_timeout,
                };
                if gone {
                    tracing::warn!(
                        "elastic: the founding decider ({}) went silent before publishing \
                         generation 1; slot {} races for the next lease",
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
}
