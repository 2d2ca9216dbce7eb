//! Liveness: a thread of each group sends a HEARTBEAT on every link every `peer_timeout / 5`
//! (20 ms to 500 ms) and, as often, looks at when each peer was last heard from ([`LastHeard`],
//! stamped by the link's reader with every frame header and every 256 KiB of a payload). A peer
//! silent for `peer_timeout` (no byte at all: its own liveness thread would have sent many
//! heartbeats) is lost ([`CommError::PeerSilent`], through `GroupHealth::peer_lost` like a
//! closed socket).
//!
//! Why a thread of its own: liveness must not depend on the training loop. A rank busy in a long
//! step keeps sending heartbeats and is never declared dead; a rank that is frozen (SIGSTOP, a
//! hung kernel call) or cut off by the network sends nothing, and is named within
//! `peer_timeout` plus a tick instead of at the collective deadline (minutes). A peer that is
//! alive but never enters a collective (a desync) is still caught by the collective deadline.
//!
//! Why a heartbeat never waits behind data for long: it is queued to the link's writer, behind
//! the DATA frames already queued, but a live link needs no heartbeat while data moves. The
//! peer's reader stamps every header and every 256 KiB of payload it reads, so a large transfer
//! is itself the proof of life (even a single 64 MiB frame on a slow link). Data stops moving
//! only when the writer waits for credit (the peer is busy: the writer then sends heartbeats
//! itself, `writer.rs`) or when the peer's kernel takes nothing more (the peer's reader, which
//! reads whatever arrives, is not running: frozen, or the network is cut). Over shared memory the
//! link carries nothing but the heartbeats, and a peer busy reducing still runs its own liveness
//! thread. So silence means a frozen process or a dead network, not a busy one.
//!
//! The default deadline ([`crate::config::DEFAULT_PEER_TIMEOUT`], 7 s) names a frozen rank or a
//! cut link within about 8 s (deadline, a tick, the attribution grace of `health.rs`), and is
//! not shorter because of lossy networks: TCP retransmits a lost segment 0.2, 0.6, 1.4, 3.0 and
//! 6.2 s after it was sent (the retransmission timer doubles from its 200 ms floor), and
//! everything behind it waits. With 10 % loss, one lost segment in ten thousand is lost four
//! more times and stalls its connection for 6.2 s, with nothing wrong; 7 s outlasts that stall
//! plus a heartbeat interval, and the next one (12.6 s) takes a sixth loss in a row.
//!
//! The same thread answers SIGUSR1 by dumping the flight recorder (see [`crate::flight`]), and
//! dumps it once more when the group fails.
//!
//! # While the group starts
//!
//! A peer's links are made before its threads run: a peer that starts slowly (many ranks on
//! few cores, a process swapping, GPU processes compiling kernels) can be connected and yet
//! send nothing for longer than the peer timeout, and failing the whole start-up for it costs
//! every member a restart. A group whose creator knows its members by another sign of life
//! gives a [`StartupWatch`] (an elastic generation's: each member's beat in the store,
//! `membership/beat.rs`): until the start-up barrier has passed, a peer silent on its link
//! for half the peer timeout is *asked about* there, and one silent for the whole peer
//! timeout is lost only when that other sign says it is dead too (or has not answered yet). A
//! peer that is alive but slow is waited for, up to the start-up's own deadline; a dead one
//! is still named within the peer timeout of its last sign of life, a closed socket at once.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::error::CommError;
use crate::flight::FlightRecorder;
use crate::transport::health::GroupHealth;
use crate::transport::link::Outgoing;

/// When the last frame from a peer arrived.
pub(crate) struct LastHeard {
    origin: Instant,
    /// Milliseconds from `origin` to the last frame (0: none yet, so a peer that never sends
    /// anything is silent since the link was made).
    at_ms: AtomicU64,
}

impl LastHeard {
    /// A link just made: heard from "now".
    pub fn new() -> LastHeard {
        LastHeard {
            origin: Instant::now(),
            at_ms: AtomicU64::new(0),
        }
    }

    /// A frame arrived.
    pub fn stamp(&self) {
        let now = self.origin.elapsed().as_millis() as u64;
        self.at_ms.store(now, Ordering::Relaxed);
    }

    /// How long since the last frame.
    pub fn silent_for(&self) -> Duration {
        let now = self.origin.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.at_ms.load(Ordering::Relaxed)))
    }
}

/// A peer the liveness thread watches.
pub(crate) struct WatchedPeer {
    pub peer: usize,
    /// Its link's writer queue, for the heartbeats.
    pub writer: Sender<Outgoing>,
    pub heard: Arc<LastHeard>,
    /// Set when it said GOODBYE: silence is then expected.
    pub goodbye: Arc<AtomicBool>,
}

impl WatchedPeer {
    /// Whether the peer has been silent for longer than `limit` without saying goodbye.
    pub fn is_silent(&self, limit: Duration) -> bool {
        !self.goodbye.load(Ordering::Acquire) && self.heard.silent_for() > limit
    }
}

/// What another source than the links says of each peer while a group starts (see the module
/// documentation): the liveness thread asks about a peer silent on its link, the group's
/// creator answers through [`StartupWatch::answer`], and [`StartupWatch::started`] ends it.
pub(crate) struct StartupWatch {
    /// Per rank: [`UNASKED`], [`ASKED`], [`ALIVE`] or [`DEAD`].
    states: Vec<AtomicU8>,
    /// Set once the start-up barrier passed: from then on, silence is judged by the link alone.
    done: AtomicBool,
    /// Test hook: how long this process waits with its links made before it runs them.
    pub(crate) hold: Option<Duration>,
}

/// Nobody asked about the peer.
const UNASKED: u8 = 0;
/// The liveness thread asked about the peer (silent on its link for half the peer timeout).
const ASKED: u8 = 1;
/// The other source says the peer is alive.
const ALIVE: u8 = 2;
/// The other source says the peer is dead.
const DEAD: u8 = 3;

impl StartupWatch {
    /// A watch of a group of `world` ranks; `hold` is a test hook (see the field).
    pub(crate) fn new(world: usize, hold: Option<Duration>) -> StartupWatch {
        StartupWatch {
            states: (0..world).map(|_| AtomicU8::new(UNASKED)).collect(),
            done: AtomicBool::new(false),
            hold,
        }
    }

    /// The ranks asked about and not known dead, for the answering side; empty once started.
    pub(crate) fn asked(&self) -> Vec<usize> {
        if self.is_started() {
            return Vec::new();
        }
        (0..self.states.len())
            .filter(|&r| matches!(self.states[r].load(Ordering::Acquire), ASKED | ALIVE))
            .collect()
    }

    /// Says whether `rank` is alive, as the other source sees it.
    pub(crate) fn answer(&self, rank: usize, alive: bool) {
        if let Some(state) = self.states.get(rank) {
            state.store(if alive { ALIVE } else { DEAD }, Ordering::Release);
        }
    }

    /// The start-up barrier passed.
    pub(crate) fn started(&self) {
        self.done.store(true, Ordering::Release);
    }

    /// Whether the start-up barrier passed.
    pub(crate) fn is_started(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Asks about `rank` (a no-op once asked or answered).
    fn ask(&self, rank: usize) {
        if let Some(state) = self.states.get(rank) {
            let _ = state.compare_exchange(UNASKED, ASKED, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    /// Whether `rank`, silent on its link, is still to be waited for: the group is starting
    /// and the other source says it is alive.
    fn vouches(&self, rank: usize) -> bool {
        !self.is_started()
            && self
                .states
                .get(rank)
                .is_some_and(|s| s.load(Ordering::Acquire) == ALIVE)
    }
}

/// How often heartbeats go out, and how often the liveness thread looks for a silent peer: a
/// fifth of the peer timeout, 20 ms to 500 ms (so a silent peer is named at most half a second
/// after its deadline).
pub(crate) fn heartbeat_interval(peer_timeout: Duration) -> Duration {
    (peer_timeout / 5).clamp(Duration::from_millis(20), Duration::from_millis(500))
}

/// How a group judges a silent peer: the peer timeout, and while it starts, what another source
/// says (see the module documentation).
#[derive(Clone)]
pub(crate) struct Silence {
    /// A peer silent this long is lost (`DDP_PEER_TIMEOUT`).
    pub peer_timeout: Duration,
    /// What vouches for a peer while the group starts, if anything does.
    pub startup: Option<Arc<StartupWatch>>,
}

#[cfg(test)]
impl Silence {
    /// The peer timeout alone.
    pub(crate) fn of(peer_timeout: Duration) -> Silence {
        Silence {
            peer_timeout,
            startup: None,
        }
    }
}

/// Starts the liveness thread of `rank` over `watched` (see the module documentation). It ends
/// when the returned sender is dropped, when the group closes, or after the group failed (and
/// the flight record was dumped).
pub(crate) fn start_liveness(
    rank: usize,
    watched: Vec<WatchedPeer>,
    health: &Arc<GroupHealth>,
    silence: Silence,
    flight: Arc<FlightRecorder>,
) -> Result<(Sender<()>, JoinHandle<()>), CommError> {
    let Silence {
        peer_timeout,
        startup,
    } = silence;
    let interval = heartbeat_interval(peer_timeout);
    let health = health.clone();
    let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
    let thread = std::thread::Builder::new()
        .name(format!("ddp-live-{rank}"))
        .spawn(move || loop {
            if health.is_closing() {
                return;
            }
            if health.is_failed() {
                // The group failed, maybe while this rank was outside any collective (a peer
                // lost, an ABORT received): leave the record of where it was, since nothing
                // answers SIGUSR1 from now on.
                flight.dump("failure");
                return;
            }
            for w in &watched {
                let _ = w.writer.send(Outgoing::Heartbeat);
            }
            flight.poll_signal();
            if let Some(startup) = startup.as_ref().filter(|s| !s.is_started()) {
                for w in watched.iter().filter(|w| w.is_silent(peer_timeout / 2)) {
                    startup.ask(w.peer);
                }
            }
            let vouched = |peer: usize| startup.as_ref().is_some_and(|s| s.vouches(peer));
            if let Some(w) = watched
                .iter()
                .find(|w| w.is_silent(peer_timeout) && !vouched(w.peer))
            {
                health.peer_lost(CommError::PeerSilent {
                    rank,
                    peer: w.peer,
                    silent_for: w.heard.silent_for(),
                });
                return;
            }
            match stopped.recv_timeout(interval) {
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                _ => return, // the mesh is closing
            }
        })
        .map_err(|e| CommError::Internal {
            rank,
            message: format!("cannot start the liveness thread: {e}"),
        })?;
    Ok((stop, thread))
}
