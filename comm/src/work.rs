//! [`Work`]: the handle of a submitted collective, and the deadline of every wait on one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::error::CommError;
use crate::flight::FlightRecorder;
use crate::transport::health::GroupHealth;

/// How much longer than the group's deadline [`Work::wait`] lets a group sit without progress:
/// enough for a collective's own deadline, the attribution and the ABORT flush to report first.
const STALL_MARGIN: Duration = Duration::from_secs(5);

/// The handle of a submitted collective; [`Work::wait`] gives back the result.
///
/// Dropping a `Work` without waiting is fine: the collective still runs.
pub struct Work<T> {
    rx: Receiver<Result<T, CommError>>,
    rank: usize,
    /// What was submitted, e.g. `all_reduce of 4096 f32`, for a timeout's message.
    what: String,
    /// The group's progress counter and deadline (`None` for a result known at submission).
    progress: Option<(Arc<GroupHealth>, Duration)>,
    /// The group's flight recorder, dumped when a wait gives up.
    flight: Option<Arc<FlightRecorder>>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("rank", &self.rank)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    /// The handle of a collective queued for the communication thread, which sends its result
    /// on `rx`'s channel; `what` describes it for a timeout, `health` and `timeout` are the
    /// group's progress counter and deadline.
    pub(crate) fn pending(
        rank: usize,
        what: String,
        rx: Receiver<Result<T, CommError>>,
        health: Arc<GroupHealth>,
        timeout: Duration,
        flight: Option<Arc<FlightRecorder>>,
    ) -> Work<T> {
        Work {
            rx,
            rank,
            what,
            progress: Some((health, timeout)),
            flight,
        }
    }

    /// A handle whose result is known at submission.
    pub(crate) fn ready(rank: usize, result: Result<T, CommError>) -> Work<T> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = tx.send(result);
        Work {
            rx,
            rank,
            what: String::new(),
            progress: None,
            flight: None,
        }
    }

    /// The flight recorder's dump for a wait that gave up.
    fn timed_out(&self, op: String, waited: Duration) -> CommError {
        if let Some(f) = &self.flight {
            f.dump("timeout");
        }
        CommError::WaitTimeout {
            rank: self.rank,
            op,
            waited,
        }
    }

    /// Blocks until the collective has finished and returns its result: the buffer, or the
    /// error.
    ///
    /// Its deadline is progress, not total time: a long collective (or one queued behind
    /// others) that keeps moving bytes is waited for, but if the group receives nothing and
    /// finishes nothing for longer than the group's deadline (plus the few seconds a failure
    /// takes to be attributed), this returns [`CommError::WaitTimeout`]. The collective's own
    /// per-peer deadline normally fires first, with the better message; this one guarantees
    /// that no `wait` blocks forever, whatever happens.
    pub fn wait(self) -> Result<T, CommError> {
        let Some((health, timeout)) = self.progress.clone() else {
            return self.finish(self.rx.recv().ok());
        };
        let stall_limit = timeout + STALL_MARGIN;
        let start = Instant::now();
        let mut seen = health.progress.load(Ordering::Relaxed);
        let mut last_move = Instant::now();
        loop {
            match self
                .rx
                .recv_timeout(Duration::from_millis(250).min(stall_limit))
            {
                Ok(r) => return r,
                Err(RecvTimeoutError::Disconnected) => return self.finish(None),
                Err(RecvTimeoutError::Timeout) => {}
            }
            let now = health.progress.load(Ordering::Relaxed);
            if now != seen {
                seen = now;
                last_move = Instant::now();
            } else if last_move.elapsed() >= stall_limit {
                let op = format!(
                    "{} (no progress in the group for {:?})",
                    self.what,
                    last_move.elapsed()
                );
                return Err(self.timed_out(op, start.elapsed()));
            }
        }
    }

    /// Like [`Work::wait`], with a deadline of the caller's: past `timeout` it returns
    /// [`CommError::WaitTimeout`]. The collective is not cancelled (every rank must still run
    /// it) and its result is dropped when it completes.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T, CommError> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(RecvTimeoutError::Disconnected) => self.finish(None),
            Err(RecvTimeoutError::Timeout) => Err(self.timed_out(self.what.clone(), timeout)),
        }
    }

    fn finish(&self, r: Option<Result<T, CommError>>) -> Result<T, CommError> {
        r.unwrap_or(Err(CommError::ShutDown { rank: self.rank }))
    }

    /// Whether the collective has finished (so that [`Work::wait`] returns at once).
    pub fn is_completed(&self) -> bool {
        !self.rx.is_empty()
    }
}
