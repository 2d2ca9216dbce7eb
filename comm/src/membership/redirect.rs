//! The way back to an elastic job whose store moved (issue 61): a node 0 restarted after its
//! node was lost, or any agent or rank started later with the job's original address, finds
//! the job where it went on.
//!
//! # How
//!
//! Once the ranks moved the store to a launcher's standby (`failover.rs`), that launcher runs a
//! [`Redirect`]: a thread that looks at the job's original address every [`EVERY`] and, when a
//! store answers there (a node 0 restarted with the same command line hosts a fresh, empty one;
//! under torchrun's c10d rendezvous, the next agent on the endpoint's host does), writes the
//! record `moved` under the agents' prefix: a [`MovedStore`], where the store is now and which
//! round's keys the job uses, sealed with the job's secret. Nothing else is written there.
//!
//! Who reads it:
//! - a rank that joins at the original address ([`crate::ElasticGroup::join`]) looks for it
//!   while it waits to be admitted (every [`LOOK`], on a connection of its own), and follows it:
//!   it leaves the fresh store, joins the job in the moved one (its terms are checked there),
//!   and is healed as any joiner; a founding decider in the fresh store publishes no
//!   generation once the record is there, so a restarted node 0 whose ranks alone reach MIN
//!   does not start a second job, as long as the record comes before its last call ends (it
//!   comes within [`EVERY`] plus a connection);
//! - an agent that starts with the original address ([`crate::AgentPresence`]) registers and
//!   beats in the moved store, and gives its ranks that address when it restarts them or
//!   starts a new round; an agent that takes its node rank at the rendezvous
//!   ([`crate::next_node_rank`]) takes it from the moved store's counter, which the agents
//!   that followed the move raised to their node ranks.
//!
//! A record that fails the secret check is a stranger's and is not followed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::membership::agents::AGENTS_PREFIX;
use crate::membership::group::{claim_or_check_terms, ElasticGroup};
use crate::membership::seal::{open, seal_json};
use crate::membership::standby::{reachable, read_moved, MovedStore, MOVED_KEY as KEY, PROBE};
use crate::rendezvous::store::Store;
use crate::rendezvous::torch_store::agent_key_prefix;
use crate::rendezvous::torch_store_server::TorchStoreHost;

/// How often the launcher hosting a moved store looks at the job's original address.
pub(crate) const EVERY: Duration = Duration::from_millis(250);

/// How often a rank waiting to be admitted looks for a `moved` record.
pub(crate) const LOOK: Duration = Duration::from_millis(200);

/// Deadline of one store call of a redirect.
const CALL: Duration = Duration::from_secs(10);

/// The `moved` record in the store `host` hosts (a launcher started again at the job's first
/// address, which a [`Redirect`] told where the job went), if one passes the check of `secret`.
pub fn moved_record(host: &TorchStoreHost, secret: Option<&str>) -> Option<MovedStore> {
    let bytes = host.value(&format!("{AGENTS_PREFIX}{KEY}"))?;
    let body = open(secret, KEY, &bytes).ok()?;
    serde_json::from_slice(body).ok()
}

impl ElasticGroup {
    /// Whether a `moved` record waits at the address this process joined at, looked for at
    /// most every [`LOOK`] while it waits to be admitted (kept until it is followed).
    pub(super) fn saw_move(&mut self) -> bool {
        if self.moved_found.is_some() {
            return true;
        }
        let Some(at) = self.looked_at else {
            return false;
        };
        if at.elapsed() < LOOK {
            return false;
        }
        self.looked_at = Some(Instant::now());
        if self.look_store.is_none() {
            let base = &self.config.base;
            let by = Instant::now() + PROBE;
            let (host, port) = (&base.master_addr, base.master_port);
            self.look_store =
                Store::connect_torch(self.me.slot, host, port, AGENTS_PREFIX.into(), by, CALL).ok();
        }
        let Some(store) = &self.look_store else {
            return false;
        };
        match read_moved(store, self.secret()) {
            Ok(found) => self.moved_found = found,
            Err(_) => self.look_store = None,
        }
        self.moved_found.is_some()
    }

    /// The `moved` record found, taken to be followed.
    pub(super) fn moved_away(&mut self) -> Option<MovedStore> {
        match self.saw_move() {
            true => self.moved_found.take(),
            false => None,
        }
    }

    /// No more looking for a `moved` record: this process was admitted.
    pub(super) fn stop_looking(&mut self) {
        (self.looked_at, self.look_store, self.moved_found) = (None, None, None);
    }

    /// Leaves the store this process joined at for the one the job moved to (`to`): connects
    /// there under `to`'s round, checks the job's terms there, and beats there; the caller
    /// asks to join again. Looks no more.
    pub(super) fn follow_move(&mut self, to: MovedStore) -> Result<(), CommError> {
        self.stop_looking();
        let from = self.store.address().to_string();
        let slot = self.me.slot;
        tracing::warn!(
            "elastic: slot {slot} joined at {from}, where the job's store moved away: joining \
             it at {}:{} (round {})",
            to.host,
            to.port,
            to.round
        );
        let base = &mut self.config.base;
        base.master_addr = to.host;
        base.master_port = to.port;
        base.torch_agent_store = Some(to.round);
        let deadline = Instant::now() + base.connect_timeout;
        let prefix = format!("{}elastic/", agent_key_prefix(to.round));
        let (host, port) = (&base.master_addr, base.master_port);
        let store = Store::connect_torch(slot, host, port, prefix, deadline, CALL)?;
        claim_or_check_terms(&store, self.secret(), &self.config.terms(), &self.me)?;
        self.store = store;
        self.beat_again(Instant::now() + CALL)
    }
}

/// The launcher's thread that keeps a `moved` record at the job's original address (see the
/// module documentation); stops when dropped.
pub struct Redirect {
    stop: Arc<AtomicBool>,
    to: Arc<Mutex<MovedStore>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Redirect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redirect").field("to", &self.to).finish()
    }
}

impl Redirect {
    /// Starts writing `to`, sealed with `secret`, into any store that answers at `original`
    /// (`(host, port)`, the job's first store), every 250 ms, until dropped.
    pub fn start(
        original: (&str, u16),
        to: MovedStore,
        secret: Option<String>,
    ) -> Result<Redirect, CommError> {
        let stop = Arc::new(AtomicBool::new(false));
        let to = Arc::new(Mutex::new(to));
        let (s, t) = (stop.clone(), to.clone());
        let (host, port) = (original.0.to_string(), original.1);
        let thread = std::thread::Builder::new()
            .name("ddprun-elastic-redirect".into())
            .spawn(move || keep_record(&host, port, &t, secret.as_deref(), &s))
            .map_err(|e| CommError::Internal {
                rank: 0,
                message: format!("cannot start the launcher's redirect thread: {e}"),
            })?;
        Ok(Redirect {
            stop,
            to,
            thread: Some(thread),
        })
    }

    /// Points the record at `to` from now on (a new round of the job in the same store).
    pub fn point(&self, to: MovedStore) {
        *self.to.lock().unwrap_or_else(|p| p.into_inner()) = to;
    }
}

impl Drop for Redirect {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The redirect's loop: connects to `host:port` whenever a store answers there (refused at
/// once while nothing listens), and writes the record there when it lacks it or holds another
/// one; a connection that fails is dropped and made again.
fn keep_record(
    host: &str,
    port: u16,
    to: &Mutex<MovedStore>,
    secret: Option<&str>,
    stop: &AtomicBool,
) {
    let mut conn: Option<Store> = None;
    while !stop.load(Ordering::Acquire) {
        if conn.is_none() && reachable(host, port) {
            let by = Instant::now() + PROBE;
            conn = Store::connect_torch(0, host, port, AGENTS_PREFIX.into(), by, CALL).ok();
        }
        if let Some(store) = &conn {
            let want = to.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let kept = match read_moved(store, secret) {
                Ok(have) if have.as_ref() == Some(&want) => true,
                Ok(_) => {
                    let written = store.set(KEY, &seal_json(secret, KEY, &want)).is_ok();
                    if written {
                        tracing::warn!(
                            "ddprun: a store answers at the elastic job's first address \
                             {host}:{port}; told it the job's store is at {}:{} (round {})",
                            want.host,
                            want.port,
                            want.round
                        );
                    }
                    written
                }
                Err(_) => false,
            };
            if !kept {
                conn = None;
            }
        }
        let until = Instant::now() + EVERY;
        while Instant::now() < until && !stop.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The `moved` record at `host:port`, if a store answers there within a probe and holds one
    /// that passes the check of `secret`; `None` otherwise (no store, none there, an error).
    fn look(host: &str, port: u16, secret: Option<&str>) -> Option<MovedStore> {
        let by = Instant::now() + PROBE;
        let store = Store::connect_torch(0, host, port, AGENTS_PREFIX.into(), by, CALL).ok()?;
        read_moved(&store, secret).ok().flatten()
    }

    fn moved(port: u16) -> MovedStore {
        MovedStore {
            host: "127.0.0.1".into(),
            port,
            round: 2,
        }
    }

    fn wait_for(what: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if what() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// Nothing at the original address at first; a store that comes up there later gets the
    /// record, readable with the job's secret and not with another; a store that comes up
    /// again (a second restart) gets it again, and a new round's record replaces the old one.
    #[test]
    fn a_store_that_comes_up_at_the_first_address_is_told_where_the_job_went() {
        let spot = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = spot.local_addr().unwrap().port();
        drop(spot);
        let redirect = Redirect::start(("127.0.0.1", port), moved(4242), Some("s".into())).unwrap();
        std::thread::sleep(EVERY * 2);
        let host = TorchStoreHost::start(TcpListener::bind(("127.0.0.1", port)).unwrap()).unwrap();
        assert!(
            wait_for(|| look("127.0.0.1", port, Some("s")).is_some()),
            "no record within 10 s"
        );
        assert_eq!(look("127.0.0.1", port, Some("s")), Some(moved(4242)));
        assert_eq!(moved_record(&host, Some("s")), Some(moved(4242)));
        assert_eq!(moved_record(&host, Some("another secret")), None);
        assert_eq!(look("127.0.0.1", port, Some("another secret")), None);
        drop(host);
        let host = TorchStoreHost::start(TcpListener::bind(("127.0.0.1", port)).unwrap()).unwrap();
        assert!(wait_for(|| look("127.0.0.1", port, Some("s")).is_some()));
        redirect.point(MovedStore {
            round: 3,
            ..moved(4242)
        });
        assert!(wait_for(
            || look("127.0.0.1", port, Some("s")).is_some_and(|m| m.round == 3)
        ));
        drop(redirect);
        drop(host);
    }
}
