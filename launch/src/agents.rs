//! Restarts across nodes: the launchers ("agents", as torchrun calls its per-node launchers) of
//! a job on several nodes agree through a store on when to restart and when the job is over.
//!
//! # How
//!
//! With `--nnodes` above 1 and `--max-restarts` above 0, node 0's launcher hosts a ddp-comm
//! store (`ddp_comm::StoreHost`) on `MASTER_PORT + 1` for the launchers (the ranks keep their
//! own rendezvous on `MASTER_PORT`, hosted by rank 0 each round), and every launcher, node 0's
//! too, connects to it. Keys:
//!
//! * `round`: the current round, 0 at the start; round r runs the ranks with
//!   `TORCHELASTIC_RESTART_COUNT=r`.
//! * `fail/<r>`, `failure/<r>`: the first launcher whose ranks fail in round r wins the atomic
//!   `add("fail/<r>", 1)`, writes what failed to `failure/<r>` and moves `round` to r + 1; a
//!   launcher that loses the race (its ranks failed *because* of the first failure, as ranks of
//!   a broken group do) reads the winner's description instead. So every launcher restarts
//!   exactly once per round, all with the same count, and all quote the same first failure.
//! * `done/<r>`: launchers whose ranks all succeeded in round r. A launcher whose ranks are done
//!   waits until every node's are (the job succeeded) or the round moves on (a rank elsewhere
//!   failed after ours finished: ours must start again, since the new round needs them).
//! * `beat/<node>`: each launcher adds 1 every [`BEAT`] from a thread of its own, over a store
//!   connection of its own (a call of the launcher's loop, such as reading another node's
//!   failure, may block for up to [`CALL`]; sharing one connection, whose calls are serialised,
//!   would silence the beats meanwhile and get this node declared lost). A node whose counter
//!   stops moving for [`SILENCE`] has lost its launcher (killed, its host down): every other
//!   launcher stops its ranks and fails, naming that node. A launcher that loses its connection
//!   to node 0's store fails naming node 0.
//! * `left`: launchers that saw the job end; node 0 keeps the store up until all have (or for at
//!   most [`LINGER`]), so that none is left asking a store that is gone.
//!
//! A watcher thread polls `round` and the beats every [`BEAT`] and publishes what it saw; the
//! launcher's loop, which polls its ranks every 10 ms, reads that, so a restart decided on
//! another node reaches this node's ranks within about half a second.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ddp_comm::{Store, StoreHost};

use crate::error::LaunchError;

/// How often a launcher beats and looks at the store.
const BEAT: Duration = Duration::from_millis(500);
/// A node whose launcher has not beaten for this long is lost.
const SILENCE: Duration = Duration::from_secs(10);
/// How long launchers wait for the store of node 0 (and node 0 for the others' first beat).
const CONNECT: Duration = Duration::from_secs(300);
/// Deadline of one store call.
const CALL: Duration = Duration::from_secs(30);
/// Longest node 0 keeps the store up after the job ended, for the other launchers to see it.
const LINGER: Duration = Duration::from_secs(10);

/// The agents' clock: [`BEAT`], [`SILENCE`], [`CONNECT`], [`CALL`] and [`LINGER`] by default
/// (tests shorten them).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub beat: Duration,
    pub silence: Duration,
    pub connect: Duration,
    pub call: Duration,
    pub linger: Duration,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            beat: BEAT,
            silence: SILENCE,
            connect: CONNECT,
            call: CALL,
            linger: LINGER,
        }
    }
}

/// What the watcher thread saw last.
struct Seen {
    round: AtomicU64,
    /// Why the job cannot go on: a node lost, the store gone.
    lost: Mutex<Option<String>>,
    stop: AtomicBool,
}

/// This node's launcher in the group of launchers.
pub(crate) struct Agents {
    /// The launcher loop's connection (the watcher thread has one of its own).
    store: Store,
    node: usize,
    nnodes: usize,
    seen: Arc<Seen>,
    timing: Timing,
    watcher: Option<JoinHandle<()>>,
    /// Node 0's store (dropped last).
    host: Option<StoreHost>,
}

fn store_error(what: &str, e: ddp_comm::CommError) -> LaunchError {
    LaunchError::Agents {
        message: format!("{what}: {e}"),
    }
}

impl Agents {
    /// Joins the launchers of the job: node 0 hosts their store on `port`, everyone connects
    /// (twice: once for the launcher's calls, once for the watcher's beats).
    pub fn join(
        node: usize,
        nnodes: usize,
        master_addr: &str,
        port: u16,
        job: &str,
    ) -> Result<Agents, LaunchError> {
        Agents::join_with(node, nnodes, master_addr, port, job, Timing::default())
    }

    /// [`Agents::join`] with the given clock.
    pub fn join_with(
        node: usize,
        nnodes: usize,
        master_addr: &str,
        port: u16,
        job: &str,
        timing: Timing,
    ) -> Result<Agents, LaunchError> {
        let host = if node == 0 {
            Some(
                StoreHost::start(port, nnodes, job)
                    .map_err(|e| store_error("hosting the launchers' store", e))?,
            )
        } else {
            None
        };
        let connect = || {
            Store::connect_host(
                master_addr,
                port,
                node,
                nnodes,
                job,
                Instant::now() + timing.connect,
                timing.call,
            )
            .map_err(|e| store_error("reaching the launchers' store of node 0", e))
        };
        let store = connect()?;
        let beats = connect()?;
        let seen = Arc::new(Seen {
            round: AtomicU64::new(0),
            lost: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let watcher = {
            let seen = seen.clone();
            std::thread::Builder::new()
                .name("ddprun-agents".into())
                .spawn(move || watch(&beats, &seen, node, nnodes, timing))
                .map_err(|e| LaunchError::Agents {
                    message: format!("cannot start the launchers' watcher thread: {e}"),
                })?
        };
        Ok(Agents {
            store,
            node,
            nnodes,
            seen,
            timing,
            watcher: Some(watcher),
            host,
        })
    }

    /// The latest round the watcher saw.
    pub fn round(&self) -> u64 {
        self.seen.round.load(Ordering::Acquire)
    }

    /// Why the job cannot go on (a node lost, node 0's store gone), if so.
    pub fn lost(&self) -> Option<String> {
        self.seen
            .lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Says that round `round` failed on this node (`what`): the first node to say so for a
    /// round moves every node to the next. Returns the round's first failure, ours or another's.
    pub fn announce_failure(&self, round: u64, what: &str) -> Result<String, LaunchError> {
        let first = self
            .store
            .add(&format!("fail/{round}"), 1)
            .map_err(|e| store_error("announcing a failure", e))?
            == 1;
        if first {
            let text = format!("node {}: {what}", self.node);
            self.store
                .set(&format!("failure/{round}"), text.as_bytes())
                .and_then(|()| self.store.add("round", 1))
                .map_err(|e| store_error("announcing a failure", e))?;
            self.seen.round.fetch_max(round + 1, Ordering::AcqRel);
            return Ok(text);
        }
        self.failure_of(round)
    }

    /// The first failure of round `round`, as its node described it.
    pub fn failure_of(&self, round: u64) -> Result<String, LaunchError> {
        self.store
            .get_timeout(&format!("failure/{round}"), self.timing.call)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .map_err(|e| store_error("reading another node's failure", e))
    }

    /// Before a restart: says this node's ranks of round `round` have ended and waits until
    /// every node's have; then node 0 runs `renew` (it renews the ranks' rendezvous store,
    /// which no rank of the old round can write to any more) and says so (`renewed/<r>`), and
    /// the other nodes wait for that before they start their ranks of the next round.
    pub fn wait_stopped(
        &self,
        round: u64,
        renew: impl FnOnce() -> Result<(), LaunchError>,
    ) -> Result<(), LaunchError> {
        self.count_and_wait(&format!("stopped/{round}"), None)?;
        let key = format!("renewed/{round}");
        if self.node == 0 {
            renew()?;
            return self
                .store
                .set(&key, b"1")
                .map_err(|e| store_error("saying the store is renewed", e));
        }
        let what = format!("waiting for node 0 to renew the ranks' store ({key})");
        loop {
            if let Some(why) = self.lost() {
                return Err(LaunchError::Agents { message: why });
            }
            if self
                .store
                .check(&[&key])
                .map_err(|e| store_error(&what, e))?
            {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// After this node's ranks all succeeded in round `round`: `Ok(true)` once every node's
    /// did, `Ok(false)` if the round moved on meanwhile (a rank elsewhere failed: restart).
    pub fn finish_round(&self, round: u64) -> Result<bool, LaunchError> {
        self.count_and_wait(&format!("done/{round}"), Some(round))
    }

    /// Adds this node to the counter `key`, then waits until every node has: `Ok(true)`; or,
    /// with `round`, until the round moves past it: `Ok(false)`. A lost node or store ends the
    /// wait with an error.
    fn count_and_wait(&self, key: &str, round: Option<u64>) -> Result<bool, LaunchError> {
        let what = format!("waiting for the other nodes ({key})");
        self.store.add(key, 1).map_err(|e| store_error(&what, e))?;
        loop {
            if let Some(why) = self.lost() {
                return Err(LaunchError::Agents { message: why });
            }
            if round.is_some_and(|r| self.round() > r) {
                return Ok(false);
            }
            let count = self.store.add(key, 0).map_err(|e| store_error(&what, e))?;
            if count >= self.nnodes as i64 {
                return Ok(true);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agents {
    /// Says this launcher is leaving; node 0 then waits (at most [`LINGER`]) for the others to
    /// leave before its store goes.
    fn drop(&mut self) {
        let _ = self.store.add("left", 1);
        if self.host.is_some() {
            let until = Instant::now() + self.timing.linger;
            while Instant::now() < until
                && self.lost().is_none()
                && self
                    .store
                    .add("left", 0)
                    .is_ok_and(|n| n < self.nnodes as i64)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        self.seen.stop.store(true, Ordering::Release);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
    }
}

/// The watcher thread, on a store connection of its own: beats, reads the round, and looks for
/// nodes whose launcher went silent.
fn watch(store: &Store, seen: &Seen, node: usize, nnodes: usize, timing: Timing) {
    let lose = |why: String| {
        seen.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(why);
    };
    // Per node: its last beat count and when it last moved (None: not heard from yet).
    let mut beats: Vec<(i64, Option<Instant>)> = vec![(0, None); nnodes];
    let started = Instant::now();
    while !seen.stop.load(Ordering::Acquire) {
        let polled = (|| -> Result<(), ddp_comm::CommError> {
            store.add(&format!("beat/{node}"), 1)?;
            let round = store.add("round", 0)?;
            seen.round.fetch_max(round.max(0) as u64, Ordering::AcqRel);
            for (other, beat) in beats.iter_mut().enumerate().filter(|(n, _)| *n != node) {
                let count = store.add(&format!("beat/{other}"), 0)?;
                if count != beat.0 {
                    *beat = (count, Some(Instant::now()));
                }
                let since = beat.1.unwrap_or(started);
                let limit = if beat.1.is_some() {
                    timing.silence
                } else {
                    timing.connect
                };
                if since.elapsed() > limit {
                    lose(format!(
                        "the launcher (ddprun) of node {other} has not been heard from for {:.0?}: \
                         it was killed, or its host is down or cut off",
                        since.elapsed()
                    ));
                }
            }
            Ok(())
        })();
        if let Err(e) = polled {
            if node == 0 {
                lose(format!("the launchers' store failed: {e}"));
            } else {
                lose(format!(
                    "lost the launchers' store on node 0 ({e}): node 0's launcher (ddprun) was \
                     killed, or its host is down or cut off"
                ));
            }
        }
        std::thread::sleep(timing.beat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launcher blocked in a long store call (reading a failure that never comes) keeps
    /// beating: its own connection is not the watcher's, so the other node does not take it
    /// for lost, even though the call lasts four times the silence that would.
    #[test]
    fn a_blocking_store_call_does_not_silence_the_beats() {
        let timing = Timing {
            beat: Duration::from_millis(50),
            silence: Duration::from_millis(500),
            connect: Duration::from_secs(10),
            call: Duration::from_secs(2),
            linger: Duration::from_secs(2),
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let job = "agents-test";
        let node0 = Agents::join_with(0, 2, "127.0.0.1", port, job, timing).unwrap();
        let node1 = Agents::join_with(1, 2, "127.0.0.1", port, job, timing).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let started = Instant::now();
        let blocked = node1.failure_of(0);
        assert!(blocked.is_err(), "no failure was announced: {blocked:?}");
        assert!(started.elapsed() >= timing.call, "{:?}", started.elapsed());
        assert_eq!(node0.lost(), None, "node 1 was taken for lost");
        assert_eq!(node1.lost(), None);
        // A node that really stops beating is still named.
        drop(node1);
        let deadline = Instant::now() + Duration::from_secs(5);
        while node0.lost().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let lost = node0.lost().expect("node 1's silence is noticed");
        assert!(lost.contains("node 1"), "{lost}");
    }
}
