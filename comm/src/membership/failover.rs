//! The move of an elastic job's store when the node that hosts it is lost (issue 61): the
//! survivors carry on in a standby store (`standby.rs`) instead of ending with the store's
//! host.
//!
//! # How
//!
//! A re-form whose store call fails ([`ElasticGroup::reform`]) asks whether the store is lost:
//! the error is the store's own (a connection closed or refused) and nothing accepts a
//! connection at its address any more. Then this survivor [moves](ElasticGroup::move_store):
//!
//! 1. It picks the new store as every survivor does, from the standby list it kept: the lowest
//!    node's standby not lost yet that accepts a connection (`standby.rs`, `connect_first`).
//! 2. It seeds there what the membership needs to go on, each with a compare-and-set or a
//!    counter raised to a value (never lowered), so that whoever writes first wins and the
//!    writes of all survivors agree: the job's terms, the generation it leaves, `gen/latest`
//!    and the join counter. Each record is sealed with the job's secret, as in the old store.
//! 3. It points its configuration at the new store (the next generations' groups, the
//!    look-out and its beat, restarted there, all follow) and the re-form starts over in the
//!    new store from the generation it leaves: the lost node's ranks never report nor beat
//!    there, and the survivors name them (their connections are gone), so the decider drops
//!    them after a few beats' grace, as after any death.
//!
//! The step in flight is dropped alike everywhere (the ranks of the lost node took part in it),
//! as after any death: no step is lost or repeated. A second failure during the move (the
//! chosen standby's node dies too) fails a store call in the new store, and the survivor moves
//! on to the next standby the same way.

use std::time::Instant;

use crate::error::CommError;
use crate::membership::group::ElasticGroup;
use crate::membership::records::Generation;
use crate::membership::seal::seal_json;
use crate::membership::standby::{connect_first, raise_to, reachable, PROBE};

/// Deadline of one store call of the membership.
const CALL: std::time::Duration = std::time::Duration::from_secs(30);

impl ElasticGroup {
    /// Whether `error`, from a call on this process's store, says that the store is lost and
    /// a standby is left to move to: it is an error of the store's connection, nothing accepts
    /// a connection at the store's address (within a couple of seconds), and a standby not
    /// lost yet is known. A store that is up but refused a call is not lost: the error stands;
    /// so does the error of a move that found no standby left.
    pub(super) fn store_lost(&self, error: &CommError) -> bool {
        let base = &self.config.base;
        let of_the_store = match error {
            CommError::Store { addr, .. } | CommError::Connect { addr, .. } => {
                *addr == self.store.address()
            }
            _ => false,
        };
        let standbys = self.standbys.lock().unwrap_or_else(|p| p.into_inner());
        let one_left = standbys
            .iter()
            .any(|s| !self.lost_stores.contains(&s.address()));
        of_the_store && one_left && !reachable(&base.master_addr, base.master_port)
    }

    /// Moves this process to the new store and seeds it with `left` (the generation this
    /// process leaves), see the module documentation. An error names the lost store and the
    /// standbys tried when none accepts.
    pub(super) fn move_store(&mut self, left: &Generation) -> Result<(), CommError> {
        let started = Instant::now();
        let old = self.store.address().to_string();
        if !self.lost_stores.contains(&old) {
            self.lost_stores.push(old.clone());
        }
        let standbys = self
            .standbys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let prefix = self.store.key_prefix().to_string();
        let slot = self.me.slot;
        let Some((standby, store)) =
            connect_first(&standbys, &mut self.lost_stores, slot, &prefix, CALL)
        else {
            return Err(CommError::Store {
                rank: slot,
                addr: old,
                message: format!(
                    "the elastic job's store is lost, and no standby store is left to move it \
                     to (standbys known: {:?}; lost: {:?})",
                    standbys
                        .iter()
                        .map(|s| format!("node {} at {}", s.node, s.address()))
                        .collect::<Vec<_>>(),
                    self.lost_stores
                ),
            });
        };
        tracing::warn!(
            "elastic: slot {slot} lost the store at {old}; moving to node {}'s standby at {}",
            standby.node,
            standby.address()
        );
        self.store = store;
        self.config.base.master_addr = standby.host.clone();
        self.config.base.master_port = standby.port;
        // The standby accepted a connection a moment ago: one refused now means that its node
        // died meanwhile (a second failure during the move), and the others must not wait for
        // this survivor longer than their arrival grace (beat.rs, `ARRIVAL`), so the beat's
        // connection is tried for one probe, not a store call's deadline: then this survivor
        // moves on to the next standby, as the others do.
        self.beat_again(Instant::now() + PROBE)?;
        self.seed(left)?;
        tracing::warn!(
            "elastic: slot {slot} moved the store to node {}'s standby at {} in {} ms",
            standby.node,
            standby.address(),
            started.elapsed().as_millis()
        );
        Ok(())
    }

    /// Seeds the new store with what the membership needs, as every survivor does (the first
    /// write wins; see the module documentation).
    fn seed(&self, left: &Generation) -> Result<(), CommError> {
        let secret = self.secret();
        let terms = self.config.terms();
        self.store
            .compare_set("terms", b"", &seal_json(secret, "terms", &terms))?;
        raise_to(&self.store, "terms/claim", 1)?;
        let key = format!("gen/{}", left.number);
        self.store
            .compare_set(&key, b"", &seal_json(secret, &key, left))?;
        raise_to(&self.store, "joins", left.joins_seen as i64)?;
        raise_to(&self.store, "gen/latest", left.number as i64)
    }
}
