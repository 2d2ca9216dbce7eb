//! Each member's beat in the store, and what a watcher makes of it. A thread of every elastic
//! process adds 1 to its own counter (`beat/<slot>-<incarnation>`) every 100 ms at most, on a store connection of its own, independent of the training loop: a process busy
//! in a long backward or a checkpoint write beats on; a dead or frozen one stops. A re-form
//! waits for a member as long as it beats, and drops it once it has been silent for the peer
//! timeout, so "busy" and "dead" are told apart by the process itself, not by a fixed wait.
//!
//! A beat whose connection fails while the store still answers connects again (`again`); when
//! the store is lost, the beat follows the job to the standby store it moves to, before the
//! main thread does, so that a busy member is still told from a dead one there.
//! The same thread keeps the process's list of standby stores (`standby.rs`) up to date, reading
//! it again when it changed, looked at on each of the first 50 beats (the agents publish their
//! standbys as the job starts) and on every tenth after: one store add a second while it does
//! not change.
//!
//! The counters are not sealed (an add cannot be): a stranger at the store can make a dead
//! member look alive, which delays a re-form up to its deadline, never breaks it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::GroupConfig;
use crate::error::CommError;
use crate::membership::agents::AGENTS_PREFIX;
use crate::membership::records::Member;
use crate::membership::standby::{connect_first, reachable, StandbyReader, Standbys, PROBE};
use crate::rendezvous::store::Store;
use crate::transport::liveness::StartupWatch;

/// Deadline of one store call of the beat.
const CALL: Duration = Duration::from_secs(30);

/// The key of `member`'s beat counter.
pub(crate) fn beat_key(member: &Member) -> String {
    format!("beat/{}-{:x}", member.slot, member.incarnation)
}

/// How often a process beats: a quarter of the peer timeout, between 20 and 100 ms (a few
/// store adds a second per process), so that a member named dead by mistake shows it is alive
/// within [`NAMED_GRACE`].
pub(crate) fn beat_every(peer_timeout: Duration) -> Duration {
    (peer_timeout / 4).clamp(Duration::from_millis(20), Duration::from_millis(100))
}

/// How long a decider watches a member that a survivor named dead (its error's cause, a
/// connection lost) before it drops it, unless its beat moves meanwhile: three beats.
pub(crate) const NAMED_GRACE: Duration = Duration::from_millis(300);

/// How long a watcher waits for a member's first beat in its store before it takes the member
/// for dead: a member beats from before it joins, so only one that has not arrived in a store
/// the job moved to (`failover.rs`) lacks a beat there, and one that lives follows the store
/// within a probe or two (`standby.rs`).
pub(crate) const ARRIVAL: Duration = Duration::from_secs(3);

/// A process's beat: a thread that adds to its counter every [`beat_every`]; it stops when
/// dropped.
pub(crate) struct Beat {
    stop: Arc<AtomicBool>,
}

impl Beat {
    /// Starts `me`'s beat, on a connection of its own to the store of `store` (at `base`'s
    /// address; connecting retries until `connect_by`), which also keeps `standbys` up to date.
    pub(crate) fn start(
        me: &Member,
        base: &GroupConfig,
        store: &Store,
        standbys: Standbys,
        connect_by: Instant,
    ) -> Result<Beat, CommError> {
        // No key prefix: the beat's key is under `store`'s, the standby list under the agents'.
        let mut own = Store::connect_torch(
            me.slot,
            &base.master_addr,
            base.master_port,
            String::new(),
            connect_by,
            CALL,
        )?;
        let key = format!("{}{}", store.key_prefix(), beat_key(me));
        let mut reader = StandbyReader::new(AGENTS_PREFIX, base.token.clone());
        let mut at = (base.master_addr.clone(), base.master_port);
        let every = beat_every(base.peer_timeout);
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let slot = me.slot;
        std::thread::Builder::new()
            .name("ddp-elastic-beat".into())
            .spawn(move || {
                let mut warned = false;
                let mut beats = 0u64;
                while !s.load(Ordering::Acquire) {
                    // Every beat for the first 50 (the agents publish their standbys as the
                    // job starts: a node lost in its first second finds them known), then
                    // every tenth.
                    if beats < 50 || beats.is_multiple_of(10) {
                        let _ = reader.refresh(&own, &standbys);
                    }
                    beats += 1;
                    if let Err(e) = own.add(&key, 1) {
                        if !warned {
                            warned = true;
                            tracing::warn!("elastic: slot {slot} cannot beat in the store: {e}");
                        }
                        if let Some((next, host, port)) = again(slot, &own, &at, &standbys) {
                            (own, at) = (next, (host, port));
                            warned = false;
                        }
                    }
                    let until = Instant::now() + every;
                    while Instant::now() < until && !s.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(10).min(every));
                    }
                }
            })
            .map_err(|e| CommError::Internal {
                rank: slot,
                message: format!("cannot start the elastic beat thread: {e}"),
            })?;
        Ok(Beat { stop })
    }
}

/// The connection a beat goes on with after a call on `own` failed (which dropped it): a new
/// one to the same store while it still answers at `at` (a connection reset by the network, a
/// call past its deadline: without it a live member would stop beating for good and be taken
/// for dead at the next re-form); else, the store lost (nothing answers there), the standby the
/// ranks move to (`standby.rs`), so that a member busy while the store moves beats there before
/// its main thread moves, and is waited for, not dropped. `None` when neither answers: the
/// next beat tries again.
fn again(
    slot: usize,
    own: &Store,
    at: &(String, u16),
    standbys: &Standbys,
) -> Option<(Store, String, u16)> {
    if reachable(&at.0, at.1) {
        let by = Instant::now() + PROBE;
        let same = Store::connect_torch(slot, &at.0, at.1, String::new(), by, CALL).ok()?;
        return Some((same, at.0.clone(), at.1));
    }
    let list = standbys.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut lost = vec![own.address().to_string()];
    let (standby, next) = connect_first(&list, &mut lost, slot, "", CALL)?;
    Some((next, standby.host, standby.port))
}

impl Drop for Beat {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

/// What one watcher saw of the members' beats: each counter's last value and when it last
/// changed, on the watcher's own clock (no clocks are compared across hosts).
pub(crate) struct Liveness {
    silence: Duration,
    /// Per member: the counter's last value, when it last changed, when first looked at.
    seen: HashMap<(usize, u64), (i64, Instant, Instant)>,
}

impl Liveness {
    /// A watcher that takes a member silent for `silence` (the peer timeout) for dead.
    pub(crate) fn new(silence: Duration) -> Liveness {
        Liveness {
            silence,
            seen: HashMap::new(),
        }
    }

    /// Whether `member` beat less than the silence ago, as far as this watcher knows: its
    /// counter moved since the watcher's first look or changed within the silence. A member
    /// looked at for the first time is alive for the silence that follows, unless it never beat
    /// in this store: then for [`ARRIVAL`].
    pub(crate) fn alive(&mut self, store: &Store, member: &Member) -> Result<bool, CommError> {
        let value = store.add(&beat_key(member), 0)?;
        let now = Instant::now();
        let entry = self
            .seen
            .entry((member.slot, member.incarnation))
            .or_insert((value, now, now));
        if entry.0 != value {
            (entry.0, entry.1) = (value, now);
        }
        // Never beat in this store: it has not arrived (a store the job moved to), and a
        // member that lives beats there within a probe or two (`again`).
        if value == 0 && now.duration_since(entry.2) >= ARRIVAL {
            return Ok(false);
        }
        Ok(now.duration_since(entry.1) < self.silence)
    }

    /// Whether `member` has been looked at ([`alive`](Self::alive)) for `watch` at least and
    /// its counter has not moved since the first look.
    pub(crate) fn still_for(&self, member: &Member, watch: Duration) -> bool {
        self.seen
            .get(&(member.slot, member.incarnation))
            .is_some_and(|&(_, changed, first)| changed == first && first.elapsed() >= watch)
    }
}

/// While an elastic generation's group starts: answers its [`StartupWatch`]'s questions about
/// members silent on their links from their beats in the store (`transport/liveness.rs`), so
/// that a member that is slow to start but beats is waited for, as a re-form waits for a busy
/// member, and one that stopped beating is lost within the peer timeout. A thread looks at the
/// members asked about every beat interval, on a connection of its own to the store made at
/// the first question (a start-up where every link speaks in time costs the store nothing);
/// it stops once the group started, or when dropped.
pub(crate) struct StartupBeats {
    stop: Arc<AtomicBool>,
}

impl StartupBeats {
    /// Starts answering `watch` about `members` (in rank order) for the process in `slot`,
    /// from the store of `store` at `base`'s address.
    pub(crate) fn start(
        slot: usize,
        base: &GroupConfig,
        store: &Store,
        members: Vec<Member>,
        watch: Arc<StartupWatch>,
    ) -> Result<StartupBeats, CommError> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let every = beat_every(base.peer_timeout);
        let mut live = Liveness::new(base.peer_timeout);
        let (host, port) = (base.master_addr.clone(), base.master_port);
        let prefix = store.key_prefix().to_string();
        let connect = move || {
            let by = Instant::now() + PROBE;
            Store::connect_torch(slot, &host, port, prefix.clone(), by, CALL)
        };
        std::thread::Builder::new()
            .name("ddp-elastic-startup".into())
            .spawn(move || {
                let mut own: Option<Store> = None;
                while !s.load(Ordering::Acquire) && !watch.is_started() {
                    let asked = watch.asked();
                    if !asked.is_empty() && own.is_none() {
                        own = connect().ok();
                    }
                    if let Some(store) = &own {
                        for rank in asked {
                            let Some(m) = members.get(rank) else { continue };
                            match live.alive(store, m) {
                                Ok(alive) => watch.answer(rank, alive),
                                // The connection failed: make another at the next look.
                                Err(_) => {
                                    own = None;
                                    break;
                                }
                            }
                        }
                    }
                    std::thread::sleep(every);
                }
            })
            .map_err(|e| CommError::Internal {
                rank: slot,
                message: format!("cannot start the elastic start-up watch: {e}"),
            })?;
        Ok(StartupBeats { stop })
    }
}

impl Drop for StartupBeats {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::torch_store_server::TorchStoreHost;
    use std::io::copy;
    use std::net::{Shutdown, TcpListener, TcpStream};
    use std::sync::Mutex;

    /// A TCP relay in front of `to`: every connection it accepts is piped to `to`; `cut` resets
    /// every connection open so far (both ends), as a network fault does, and later ones pass.
    struct Relay {
        port: u16,
        open: Arc<Mutex<Vec<TcpStream>>>,
    }

    impl Relay {
        fn start(to: u16) -> Relay {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let open = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
            let kept = open.clone();
            std::thread::spawn(move || {
                for client in listener.incoming() {
                    let Ok(client) = client else { return };
                    let Ok(server) = TcpStream::connect(("127.0.0.1", to)) else {
                        continue;
                    };
                    let mut list = kept.lock().unwrap();
                    list.push(client.try_clone().unwrap());
                    list.push(server.try_clone().unwrap());
                    let (mut c1, mut s1) =
                        (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let (mut c2, mut s2) = (client, server);
                    std::thread::spawn(move || {
                        let _ = copy(&mut c1, &mut s1);
                        let _ = s1.shutdown(Shutdown::Both);
                    });
                    std::thread::spawn(move || {
                        let _ = copy(&mut s2, &mut c2);
                        let _ = c2.shutdown(Shutdown::Both);
                    });
                }
            });
            Relay { port, open }
        }

        fn cut(&self) {
            for s in self.open.lock().unwrap().drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// The beat's counter as the store holds it.
    fn count(store: &Store, me: &Member) -> i64 {
        store.add(&beat_key(me), 0).unwrap()
    }

    /// A beat whose connection the network resets, the store still up, beats on over a new
    /// one: its counter keeps moving (before, it stopped for good, and the member would have
    /// been taken for dead at the next re-form).
    #[test]
    fn a_beat_whose_connection_is_reset_connects_again() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _host = TorchStoreHost::start(listener).unwrap();
        let relay = Relay::start(port);
        let by = Instant::now() + Duration::from_secs(5);
        let store = Store::connect_torch(0, "127.0.0.1", port, String::new(), by, CALL).unwrap();
        let base = GroupConfig {
            master_addr: "127.0.0.1".into(),
            master_port: relay.port,
            peer_timeout: Duration::from_millis(200),
            ..GroupConfig::default()
        };
        let me = Member {
            slot: 1,
            incarnation: 7,
            host: "here".into(),
        };
        let standbys = Standbys::default();
        let _beat = Beat::start(&me, &base, &store, standbys, by).unwrap();
        let moving = |from: i64| {
            let until = Instant::now() + Duration::from_secs(10);
            while Instant::now() < until {
                if count(&store, &me) >= from + 5 {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        };
        assert!(moving(0), "the beat never beat");
        relay.cut();
        // Past the beats that fail on the reset connection.
        std::thread::sleep(Duration::from_millis(300));
        let after = count(&store, &me);
        assert!(
            moving(after),
            "the beat stopped after its connection was reset (counter {after})"
        );
    }
}
