//! The standby stores of an elastic job on several nodes: where its store goes when the node
//! that hosts it is lost (issue 61).
//!
//! # How
//!
//! Every launcher of the job other than node 0's (which hosts the store) hosts an empty store
//! of its own, a standby, with the same protections, and publishes where it listens in the job's
//! store before anything can fail: `standby/<node>` under the agents' prefix (`agents.rs`), a
//! [`Standby`] record sealed with the job's secret (`seal.rs`), then raises `standby/top` (one past the
//! highest node that published) and adds 1 to `standby/changes`. Every rank and launcher keeps
//! the list in memory, refreshed from a thread of its own whenever `standby/changes` moved
//! ([`StandbyReader`]), so that it still knows it once the store is gone; a launcher that
//! follows the job to a standby publishes its own there again, so that the list lives on in
//! the new store.
//!
//! When the store is lost, every survivor picks the new one with the same rule and without a
//! store to agree in ([`connect_first`]): the standby of the lowest node, among those not
//! lost already, that accepts a connection. A dead node's standby refuses at once, so a second
//! failure during the move makes everyone go on to the next one, and a survivor that reached a
//! standby just before its node died loses that store too and moves on the same way: all
//! converge on the lowest live standby. (A survivor cut off from a standby the others reach
//! moves alone and waits in vain there until its re-form's deadline, which ends it with an
//! error naming that store: survivors never go on in two stores unseen.)
//!
//! A record that fails the secret check is a stranger's and is passed over: nobody moves the
//! job to a store of a stranger's choosing.

use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::CommError;
use crate::membership::seal::{open, read, seal_json};
use crate::rendezvous::store::Store;
use crate::rendezvous::torch_store::agent_key_prefix;
use crate::rendezvous::torch_store_server::TorchStoreHost;

/// How long a survivor tries to reach one standby (or the lost store, to tell it is lost).
pub(crate) const PROBE: Duration = Duration::from_secs(1);

/// The most node numbers a reader looks at (`standby/top` is a counter anyone can raise).
const MOST_NODES: i64 = 4096;

/// Deadline of one store call of a reader.
const CALL: Duration = Duration::from_secs(10);

/// Where node `node`'s launcher hosts its standby store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standby {
    /// The node.
    pub node: usize,
    /// The address the other nodes reach it at (the one its launcher reaches the store from).
    pub host: String,
    /// Its port.
    pub port: u16,
}

impl Standby {
    /// `host:port`, as [`Store::address`] says it.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// Where an elastic job's store went on after the node that hosted it was lost: the record a
/// launcher's [`Redirect`](crate::Redirect) writes at the job's original address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedStore {
    /// The host of the store now.
    pub host: String,
    /// Its port.
    pub port: u16,
    /// The job's round (`DDP_ELASTIC_ROUND`), whose keys its ranks use.
    pub round: u32,
}

/// The key of a [`MovedStore`] record, under the agents' prefix (`redirect.rs`).
pub(crate) const MOVED_KEY: &str = "moved";

/// The `moved` record in `store` (connected under the agents' prefix) that passes the check of
/// `secret`, if there is one.
pub(crate) fn read_moved(
    store: &Store,
    secret: Option<&str>,
) -> Result<Option<MovedStore>, CommError> {
    if !store.check(&[MOVED_KEY])? {
        return Ok(None);
    }
    read(store, secret, MOVED_KEY, CALL, true)
}

/// The standby list as a process keeps it: refreshed by a thread, read at a move.
pub(crate) type Standbys = Arc<Mutex<Vec<Standby>>>;

/// The key of a standby record, as sealed (the same whatever prefix the store adds).
fn record_key(node: usize) -> String {
    format!("standby/{node}")
}

/// Publishes `standby` in the store at `store`, whose calls put `under` in front of the keys
/// (so that the result lands under the agents' prefix): its record, sealed with `secret`; then
/// `standby/top`; then `standby/changes` (see the module documentation).
pub(crate) fn publish(
    store: &Store,
    under: &str,
    standby: &Standby,
    secret: Option<&str>,
) -> Result<(), CommError> {
    let key = record_key(standby.node);
    store.set(&format!("{under}{key}"), &seal_json(secret, &key, standby))?;
    raise_to(
        store,
        &format!("{under}standby/top"),
        standby.node as i64 + 1,
    )?;
    store.add(&format!("{under}standby/changes"), 1)?;
    Ok(())
}

/// Raises the counter at `key` to `n` at least, atomically (compare-and-set), so that the
/// highest value written wins whatever the order of the writers.
pub(crate) fn raise_to(store: &Store, key: &str, n: i64) -> Result<(), CommError> {
    for _ in 0..100 {
        let now = store.add(key, 0)?;
        if now >= n {
            return Ok(());
        }
        store.compare_set(key, now.to_string().as_bytes(), n.to_string().as_bytes())?;
    }
    Err(CommError::Store {
        rank: 0,
        addr: store.address().to_string(),
        message: format!("the counter {key:?} changed under 100 tries to raise it to {n}"),
    })
}

/// A process's reader of the standby list (see the module documentation).
pub(crate) struct StandbyReader {
    /// What the calls put in front of the keys to reach the agents' prefix.
    under: String,
    secret: Option<String>,
    /// `standby/changes` at the last read.
    changes: Option<i64>,
}

impl StandbyReader {
    /// A reader through a store whose calls must put `under` in front of the keys to reach
    /// the agents' prefix (`agents.rs`, where the records are): the whole prefix on a store
    /// without one of its own, nothing on a store whose prefix it is.
    pub(crate) fn new(under: &str, secret: Option<String>) -> StandbyReader {
        StandbyReader {
            under: under.to_string(),
            secret,
            changes: None,
        }
    }

    /// Reads the list again into `list` when `standby/changes` moved since the last read: the
    /// records found replace those of the same nodes; the others stay.
    pub(crate) fn refresh(
        &mut self,
        store: &Store,
        list: &Mutex<Vec<Standby>>,
    ) -> Result<(), CommError> {
        let under = &self.under;
        let changes = store.add(&format!("{under}standby/changes"), 0)?;
        if self.changes == Some(changes) {
            return Ok(());
        }
        let top = store
            .add(&format!("{under}standby/top"), 0)?
            .clamp(0, MOST_NODES);
        let mut found = Vec::new();
        for node in 1..top as usize {
            let key = record_key(node);
            let wire = format!("{under}{key}");
            if !store.check(&[&wire])? {
                continue;
            }
            let bytes = store.get_timeout(&wire, CALL)?;
            // A record that fails the check is a stranger's: passed over.
            let Ok(body) = open(self.secret.as_deref(), &key, &bytes) else {
                continue;
            };
            if let Ok(s) = serde_json::from_slice::<Standby>(body) {
                if s.node == node {
                    found.push(s);
                }
            }
        }
        // Merged by node, the newest record winning: a store the list was never published in
        // (a standby the job just moved to) takes nothing away.
        let mut list = list.lock().unwrap_or_else(|p| p.into_inner());
        for s in found {
            list.retain(|known| known.node != s.node);
            list.push(s);
        }
        list.sort_by_key(|s| s.node);
        self.changes = Some(changes);
        Ok(())
    }
}

/// Whether the ranks of an elastic job moved their store to `standby`, a launcher's standby
/// store: it holds keys of theirs (under torch's worker prefix), as no standby does before.
pub fn ranks_moved_to(standby: &TorchStoreHost) -> bool {
    let ranks = agent_key_prefix(0);
    let ranks = ranks.trim_end_matches("0/").to_string();
    standby.keys().iter().any(|k| k.starts_with(&ranks))
}

/// Whether a PyTorch store answers at `host:port`: something accepts a TCP connection within
/// [`PROBE`] (a refused one says no at once), and a store there answers the protocol's
/// handshake (VALIDATE, PING). The handshake is not idle: a process being killed closes its
/// connections first and may still hold its listening socket for a moment, so that a bare
/// connect would find a store that is gone (seen: a survivor that saw its connection to a
/// dying standby close, probed, was accepted, and stopped instead of moving on).
pub(crate) fn reachable(host: &str, port: u16) -> bool {
    let Ok(addrs) = (host, port).to_socket_addrs() else {
        return false;
    };
    if !addrs
        .into_iter()
        .any(|a| TcpStream::connect_timeout(&a, PROBE).is_ok())
    {
        return false;
    }
    Store::connect_torch(0, host, port, String::new(), Instant::now() + PROBE, PROBE).is_ok()
}

/// The store of the first standby in node order whose address is not in `lost` and that
/// accepts a connection, connected as `rank` with key `prefix` and call deadline `call`; each
/// standby tried in vain joins `lost`. `None` when none is left.
pub(crate) fn connect_first(
    standbys: &[Standby],
    lost: &mut Vec<String>,
    rank: usize,
    prefix: &str,
    call: Duration,
) -> Option<(Standby, Store)> {
    let mut order = standbys.to_vec();
    order.sort_by_key(|s| s.node);
    for s in order {
        let address = s.address();
        if lost.contains(&address) {
            continue;
        }
        if reachable(&s.host, s.port) {
            let by = Instant::now() + PROBE;
            match Store::connect_torch(rank, &s.host, s.port, prefix.to_string(), by, call) {
                Ok(store) => return Some((s, store)),
                Err(e) => tracing::warn!("elastic: node {}'s standby store: {e}", s.node),
            }
        }
        lost.push(address);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// The agents' prefix, as `agents.rs` has it.
    const PREFIX: &str = "/ddprun/agents/";

    fn host() -> TorchStoreHost {
        TorchStoreHost::start(TcpListener::bind("127.0.0.1:0").unwrap()).unwrap()
    }

    fn client(host: &TorchStoreHost, prefix: &str) -> Store {
        let by = Instant::now() + Duration::from_secs(5);
        Store::connect_torch(0, "127.0.0.1", host.port(), prefix.into(), by, CALL).unwrap()
    }

    fn standby(node: usize, port: u16) -> Standby {
        Standby {
            node,
            host: "127.0.0.1".into(),
            port,
        }
    }

    /// Published records are read back in node order; one that fails the secret check is
    /// passed over; the counter only rises.
    #[test]
    fn the_list_is_read_back_and_a_strangers_record_is_passed_over() {
        let store_host = host();
        let agents = client(&store_host, PREFIX);
        let plain = client(&store_host, "");
        publish(&agents, "", &standby(2, 2002), Some("s")).unwrap();
        publish(&plain, PREFIX, &standby(1, 2001), Some("s")).unwrap();
        publish(&agents, "", &standby(3, 2003), Some("not the job's")).unwrap();
        let list = Mutex::new(Vec::new());
        let mut reader = StandbyReader::new(PREFIX, Some("s".into()));
        reader.refresh(&plain, &list).unwrap();
        assert_eq!(*list.lock().unwrap(), [standby(1, 2001), standby(2, 2002)]);
        raise_to(&agents, "standby/top", 2).unwrap();
        assert_eq!(agents.add("standby/top", 0).unwrap(), 4, "never lowered");
        let mut other = StandbyReader::new("", Some("s".into()));
        let list2 = Mutex::new(Vec::new());
        other.refresh(&agents, &list2).unwrap();
        assert_eq!(*list.lock().unwrap(), *list2.lock().unwrap());
    }

    /// The first standby in node order that accepts a connection, past lost and dead ones.
    #[test]
    fn the_lowest_live_standby_is_chosen() {
        let (two, three) = (host(), host());
        let dead = TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_port = dead.local_addr().unwrap().port();
        drop(dead);
        let list = [
            standby(3, three.port()),
            standby(1, dead_port),
            standby(2, two.port()),
        ];
        let mut lost = Vec::new();
        let (s, _) = connect_first(&list, &mut lost, 0, "", CALL).unwrap();
        assert_eq!(s.node, 2);
        assert_eq!(lost, [format!("127.0.0.1:{dead_port}")]);
        lost.push(s.address());
        let (s, _) = connect_first(&list, &mut lost, 0, "", CALL).unwrap();
        assert_eq!(s.node, 3);
        drop(three);
        lost.clear();
        lost.push(format!("127.0.0.1:{}", two.port()));
        assert!(connect_first(&list, &mut lost, 0, "", CALL).is_none());
    }
}
