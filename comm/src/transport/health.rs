//! [`GroupHealth`]: whether a group has failed and why, shared by its communication thread and
//! every reader, writer and liveness thread; and how the group decides *who failed first*.
//!
//! Any thread that sees the group break (a reader at EOF, an I/O error, a malformed frame or an
//! ABORT; a writer that cannot send; the liveness thread; a collective that fails) marks the
//! whole group failed ([`GroupHealth::fail`]): the first error is kept as the root cause, every
//! waiter is woken ([`GroupHealth::failed_signal`]), and the failure hooks the mesh registered
//! run (they put an ABORT carrying the cause on every link and wake writers waiting for credit).
//!
//! Attribution. When rank k is killed, every survivor sees its sockets to k close, and it may
//! also see the sockets of *other* ranks close: rank j that failed because of k exits too, and
//! its close can reach a survivor before the survivor's own reader of k's socket has run (two
//! cores, many threads). Blaming whichever socket event comes first would then send the user to
//! the wrong machine. So a lost connection is only *evidence* ([`GroupHealth::peer_lost`]): the
//! group waits a short grace period ([`crate::ProcessGroup::loss_grace`], 400 ms; none in an
//! elastic job) for an ABORT frame that explains it, and an
//! ABORT (which names the rank its sender blames, itself decided the same way) settles the
//! matter at once. A rank that fails always gets its ABORTs onto the wire before its collective
//! returns the error to the caller (`Mesh::flush_aborts`), so a process that exits right after
//! an error has still explained itself, and the bytes of the ABORT precede its close on every
//! socket (a reader reads the ABORT before it sees the end of the stream). Without an ABORT by
//! the end of the grace period, the first connection lost is the root cause. Waits that find a
//! link gone wait for this verdict too ([`GroupHealth::verdict`]), so every error a caller sees
//! carries the group's one root cause.
//!
//! The first failure of any group of the process is also noted for the error file a failing
//! rank leaves its launcher (`launcher/contract.rs`): the rank it blames travels there.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};

use crate::error::CommError;

/// Something to do when the group fails, given its root cause.
type FailureHook = Box<dyn Fn(&CommError) + Send + Sync>;

/// A group's failure state and progress counters.
pub(crate) struct GroupHealth {
    rank: usize,
    /// How long a lost connection waits for an ABORT that explains it (see the module's notes
    /// on attribution).
    grace: Duration,
    failed: AtomicBool,
    /// The group is being dropped: connections closing now are expected, not failures.
    closing: AtomicBool,
    /// The root cause, once failed.
    error: Mutex<Option<CommError>>,
    /// Dropped on failure: every receiver of `failed_rx` then reports "disconnected", which
    /// wakes every wait that selects on it.
    failed_tx: Mutex<Option<Sender<()>>>,
    failed_rx: Receiver<()>,
    /// Run once, on failure (see [`GroupHealth::on_failure`]).
    hooks: Mutex<Vec<FailureHook>>,
    /// Connections lost (closed, reset, stuck), before or after the group failed, in the order
    /// seen: the evidence from which [`GroupHealth::peer_lost`] picks a root cause if no ABORT
    /// explains it.
    lost: Mutex<Vec<CommError>>,
    /// Peers that sent an ABORT: alive when their group failed (a rank that fails sends one
    /// to every peer, then half-closes the link), so their lost connection is not a death.
    aborted: Mutex<Vec<usize>>,
    /// Counts frames received and collectives finished: [`crate::Work::wait`]'s evidence that
    /// the group is still making progress.
    pub progress: AtomicU64,
    /// DATA frames read from the socket straight into a posted receive (`Mesh::recv_into`).
    pub landed: AtomicU64,
}

impl GroupHealth {
    /// The health of a group, as seen by `rank`: not failed, not closing. A lost connection
    /// waits `grace` for an ABORT that explains it.
    pub fn new(rank: usize, grace: Duration) -> GroupHealth {
        let (failed_tx, failed_rx) = crossbeam_channel::bounded(1);
        GroupHealth {
            rank,
            grace,
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            error: Mutex::new(None),
            failed_tx: Mutex::new(Some(failed_tx)),
            failed_rx,
            hooks: Mutex::new(Vec::new()),
            lost: Mutex::new(Vec::new()),
            aborted: Mutex::new(Vec::new()),
            progress: AtomicU64::new(0),
            landed: AtomicU64::new(0),
        }
    }

    /// Registers `hook`, run with the root cause when the group fails (from the thread that
    /// fails it, so a hook must not block).
    pub fn on_failure(&self, hook: FailureHook) {
        self.hooks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(hook);
    }

    /// A channel that disconnects when the group fails: select on it to be woken by a failure.
    pub fn failed_signal(&self) -> &Receiver<()> {
        &self.failed_rx
    }

    /// Says the group is being dropped: lost connections from now on are expected.
    pub fn set_closing(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Whether the group is being dropped.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// A connection was lost (`err` is [`CommError::PeerClosed`], [`CommError::PeerIo`] or
    /// [`CommError::PeerSilent`]): evidence, not yet a verdict. Waits up to the grace period for
    /// the group to fail for a better-explained reason (an ABORT naming an earlier root cause);
    /// if none comes, fails the group with the first connection lost. Blocks the calling thread
    /// (a reader, writer or liveness thread that is ending anyway) for at most the grace period.
    /// Recorded even after the group failed: when several peers die together (a node), the
    /// later losses are what [`lost_peers`](Self::lost_peers) tells an elastic job.
    pub fn peer_lost(&self, err: CommError) {
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(err);
        if self.is_failed() {
            return;
        }
        // Disconnected (returns at once) as soon as the group fails.
        let _ = self.failed_rx.recv_timeout(self.grace);
        if self.is_failed() {
            return;
        }
        let first = self.lost.lock().unwrap_or_else(|p| p.into_inner())[0].clone();
        self.fail(first);
    }

    /// `peer` sent an ABORT (before the reader fails the group with it): it was alive.
    pub fn peer_aborted(&self, peer: usize) {
        self.aborted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(peer);
    }

    /// The peers whose connections were lost (closed, reset or silent), in the order seen,
    /// each once, less those that sent an ABORT (its frame precedes the close on the same
    /// link, so it is read first); the losses expected while the group closes are not among
    /// them.
    pub fn lost_peers(&self) -> Vec<usize> {
        let aborted = self
            .aborted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut peers = Vec::new();
        for err in self.lost.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if let Some(p) = err
                .peer()
                .filter(|p| !peers.contains(p) && !aborted.contains(p))
            {
                peers.push(p);
            }
        }
        peers
    }

    /// Waits until the group has failed (at most a little longer than the grace period of a
    /// lost connection) and returns its root cause, or `fallback` if it did not fail.
    pub fn verdict(&self, fallback: CommError) -> CommError {
        let _ = self
            .failed_rx
            .recv_timeout(self.grace + Duration::from_secs(1));
        self.error().unwrap_or(fallback)
    }

    /// Whether the group has failed.
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The group's first error, if it failed.
    pub fn error(&self) -> Option<CommError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Marks the group failed with `err` as root cause (the first error wins), wakes every
    /// waiter and runs the failure hooks (an ABORT carrying the cause to every peer).
    pub fn fail(&self, err: CommError) {
        {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_some() {
                return;
            }
            tracing::error!("rank {}: process group failed: {err}", self.rank);
            *slot = Some(err.clone());
            self.failed.store(true, Ordering::Release);
        }
        crate::launcher::contract::note_group_failure(err.peer());
        self.failed_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        for hook in self.hooks.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            hook(&err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn closed(peer: usize) -> CommError {
        CommError::PeerClosed { rank: 0, peer }
    }

    #[test]
    fn lost_peers_are_listed_after_the_failure_unless_they_sent_an_abort() {
        let health = GroupHealth::new(0, Duration::ZERO);
        health.peer_lost(closed(3));
        assert!(health.is_failed());
        // Rank 1 failed too: its ABORT, then its half-close. Rank 2 died after the failure.
        health.peer_aborted(1);
        health.peer_lost(closed(1));
        health.peer_lost(closed(2));
        health.peer_lost(closed(3));
        assert_eq!(health.lost_peers(), vec![3, 2]);
    }

    /// `peer_lost` on a thread of its own; its return (bounded wait) means the verdict is in.
    fn lose(health: &Arc<GroupHealth>, peer: usize) -> crossbeam_channel::Receiver<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let h = health.clone();
        std::thread::spawn(move || {
            h.peer_lost(closed(peer));
            let _ = tx.send(());
        });
        rx
    }

    #[test]
    fn without_a_grace_the_first_connection_lost_fails_the_group_at_once() {
        // A grace of a minute would keep `peer_lost` waiting past this test's deadline.
        let health = Arc::new(GroupHealth::new(0, Duration::ZERO));
        lose(&health, 2)
            .recv_timeout(Duration::from_secs(10))
            .expect("peer_lost returned");
        assert_eq!(health.error(), Some(closed(2)));
    }

    #[test]
    fn within_the_grace_an_abort_names_the_root_cause() {
        let health = Arc::new(GroupHealth::new(0, Duration::from_secs(60)));
        let returned = lose(&health, 2);
        // Still waiting for an explanation (the grace is a minute).
        assert!(returned.recv_timeout(Duration::from_millis(200)).is_err());
        assert!(!health.is_failed());
        // An ABORT blaming rank 1 arrives: it is the root cause, and the wait ends.
        health.fail(closed(1));
        returned
            .recv_timeout(Duration::from_secs(10))
            .expect("peer_lost returned");
        assert_eq!(health.error(), Some(closed(1)));
    }
}
