//! [`NcclWork`], the handle of a submitted NCCL collective, and what a group and its handles
//! share ([`Communicator`]): the NCCL communicator, its CUDA stream, the group's first failure,
//! and the TCP process group's health.
//!
//! Waiting. NCCL itself hangs when a peer dies. [`NcclWork::wait`] polls the collective's
//! event, the TCP group and `ncclCommGetAsyncError` ([`wait_loop`]) and gives up at the group's
//! deadline, aborting the communicator so that the stuck kernels end.
//!
//! Blame ([`settle`]). NCCL does not say which rank is at fault, and the rank that notices
//! first is usually a healthy one: its collective times out, or NCCL reports a remote error,
//! because a peer is gone. The TCP process group does know (its sockets see a process die at
//! once, its heartbeats see one freeze, and a failing rank sends an ABORT that names the rank
//! it blames). So the NCCL layer and the TCP group share one verdict:
//!
//! - an error of this rank's own (a CUDA error, NCCL's internal or usage errors) fails the TCP
//!   group with that cause: every peer gets an ABORT naming this rank;
//! - a failure that points elsewhere (NCCL's remote or system error, or the deadline) first
//!   asks the TCP group for its verdict (waiting for it a moment, as lost connections do) and
//!   reports the rank the group blames; only when the group saw nothing wrong does this rank's
//!   own account (the timeout) go to the peers;
//! - while waiting, a failure of the TCP group (a peer's ABORT, a lost connection) ends the wait
//!   at once, with the group's root cause, instead of at this rank's own deadline.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

use super::api::{NcclLibrary, NcclResult, RawComm};
use super::library::{guard, CUDA_VAR, NCCL_VAR};
use crate::error::CommError;
use crate::transport::health::GroupHealth;

/// The communicator and what changes with every collective.
pub(super) struct CommState {
    /// Null once destroyed or aborted.
    pub comm: RawComm,
    /// Number of the next collective (for messages).
    pub seq: u64,
    /// The first failure; every later collective fails with it.
    pub failed: Option<CommError>,
}

// SAFETY: the raw communicator is only used under the mutex that owns this state (NCCL
// communicators may be used from any thread, one at a time).
unsafe impl Send for CommState {}

/// What the group and its [`NcclWork`] handles share: the communicator on this rank's GPU.
pub(super) struct Communicator {
    pub rank: usize,
    pub world_size: usize,
    /// The CUDA device ordinal.
    pub ordinal: usize,
    /// The deadline of every wait.
    pub timeout: Duration,
    pub nccl: &'static NcclLibrary,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// The TCP process group's health (`None` at world size 1).
    pub group: Option<Arc<GroupHealth>>,
    pub state: Mutex<CommState>,
}

/// A failure seen on the device, before it is blamed on a rank (see [`settle`]).
#[derive(Debug, Clone)]
pub(crate) enum Seen {
    /// This rank's own (a CUDA error, NCCL's internal or usage errors).
    Local(CommError),
    /// One that points at another rank: NCCL's remote or system errors, the deadline.
    Elsewhere(CommError),
    /// The TCP group failed (its root cause).
    Group(CommError),
}

/// Turns a failure seen on the device into the error to report, sharing it with the TCP group
/// (see the module documentation): a local one fails the group with this rank as the cause;
/// one that points elsewhere takes the group's verdict, and fails the group with this rank's
/// account only when the group saw nothing.
pub(crate) fn settle(seen: Seen, group: Option<&GroupHealth>) -> CommError {
    let Some(group) = group else {
        return match seen {
            Seen::Local(e) | Seen::Elsewhere(e) | Seen::Group(e) => e,
        };
    };
    match seen {
        Seen::Group(root) => root,
        Seen::Local(cause) => {
            group.fail(cause.clone());
            group.error().unwrap_or(cause)
        }
        Seen::Elsewhere(account) => {
            let root = group.verdict(account.clone());
            group.fail(root.clone());
            group.error().unwrap_or(root)
        }
    }
}

/// What one look at a collective in flight finds.
#[derive(Debug, Clone)]
pub(crate) enum Progress {
    /// It has finished.
    Done,
    /// Not yet.
    Pending,
    /// It failed (not yet blamed).
    Failed(Seen),
}

/// Polls `look` until the collective is done, it fails, the TCP group fails, or `timeout`
/// passes (then `timed_out` describes it); yields, then sleeps briefly, between looks.
pub(crate) fn wait_loop(
    timeout: Duration,
    group: Option<&GroupHealth>,
    mut look: impl FnMut() -> Progress,
    timed_out: impl FnOnce() -> CommError,
) -> Result<(), Seen> {
    let start = Instant::now();
    let mut polls: u32 = 0;
    loop {
        match look() {
            Progress::Done => return Ok(()),
            Progress::Failed(seen) => return Err(seen),
            Progress::Pending => {}
        }
        if let Some(root) = group.and_then(GroupHealth::error) {
            return Err(Seen::Group(root));
        }
        if start.elapsed() >= timeout {
            return Err(Seen::Elsewhere(timed_out()));
        }
        polls = polls.saturating_add(1);
        if polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(if polls < 2000 { 20 } else { 200 }));
        }
    }
}

impl Communicator {
    /// The communicator's state, locked.
    pub fn lock(&self) -> MutexGuard<'_, CommState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the failure `seen` (unless one is recorded already), aborts the communicator so
    /// that its kernels end, shares the failure with the TCP group ([`settle`]) and returns the
    /// error for `op`.
    pub fn fail(&self, state: &mut CommState, op: &str, seen: Seen) -> CommError {
        self.abort(state);
        let cause = match &state.failed {
            Some(first) => first.clone(),
            None => {
                let cause = settle(seen, self.group.as_deref());
                state.failed = Some(cause.clone());
                cause
            }
        };
        CommError::Collective {
            rank: self.rank,
            op: op.to_string(),
            cause: Box::new(cause),
        }
    }

    /// Aborts the communicator, if still live.
    fn abort(&self, state: &mut CommState) {
        if !state.comm.is_null() {
            let comm = std::mem::replace(&mut state.comm, std::ptr::null_mut());
            let nccl = self.nccl;
            let _ = guard(|| nccl.abort(comm));
        }
    }

    /// The error for `op` when the group failed earlier.
    pub fn refused(&self, state: &CommState, op: &str) -> Option<CommError> {
        let cause = state.failed.clone().or_else(|| {
            state
                .comm
                .is_null()
                .then_some(CommError::ShutDown { rank: self.rank })
        })?;
        Some(CommError::GroupFailed {
            rank: self.rank,
            op: op.to_string(),
            cause: Box::new(cause),
        })
    }

    /// The failure NCCL's `code` stands for: this rank's own, or one pointing elsewhere.
    pub fn nccl_failure(&self, code: NcclResult, comm: RawComm, what: &str) -> Seen {
        let text = self.nccl.error_text(code, Some(comm));
        let message = format!("rank {}: {what}: {text}", self.rank);
        let error = CommError::config(NCCL_VAR, message);
        if code.points_elsewhere() {
            Seen::Elsewhere(error)
        } else {
            Seen::Local(error)
        }
    }

    /// After a non-blocking NCCL call answered `ncclInProgress`: waits (up to the deadline)
    /// until NCCL has finished enqueueing it, since nothing else may be called on the
    /// communicator before, and an event recorded earlier would not follow the collective.
    pub fn settle_enqueue(&self, state: &mut CommState, op: &str) -> Result<(), CommError> {
        let comm = state.comm;
        let nccl = self.nccl;
        let result = wait_loop(
            self.timeout,
            self.group.as_deref(),
            || match nccl.async_error(comm) {
                NcclResult::SUCCESS => Progress::Done,
                NcclResult::IN_PROGRESS => Progress::Pending,
                code => Progress::Failed(self.nccl_failure(code, comm, "enqueueing")),
            },
            || self.timeout_error("enqueueing the collective"),
        );
        result.map_err(|seen| self.fail(state, op, seen))
    }

    /// The account of a wait that reached the deadline.
    fn timeout_error(&self, what: &str) -> CommError {
        CommError::config(
            NCCL_VAR,
            format!(
                "rank {} waited {:?} for {what} on GPU {}: a peer has probably died, stalled \
                 or submitted different collectives, and the TCP group saw no rank fail; the \
                 communicator is aborted",
                self.rank, self.timeout, self.ordinal
            ),
        )
    }

    /// Blocks until `event` has completed, NCCL reports an error, the TCP group fails, or the
    /// deadline passes.
    fn wait_event(&self, event: &CudaEvent, op: &str) -> Result<(), CommError> {
        let result = wait_loop(
            self.timeout,
            self.group.as_deref(),
            || {
                match event.try_is_complete() {
                    Ok(true) => return Progress::Done,
                    Ok(false) => {}
                    Err(e) => {
                        let cause = CommError::config(
                            CUDA_VAR,
                            format!(
                                "rank {}: CUDA error on GPU {}: {e:?}",
                                self.rank, self.ordinal
                            ),
                        );
                        return Progress::Failed(Seen::Local(cause));
                    }
                }
                let state = self.lock();
                if let Some(e) = self.refused(&state, op) {
                    return Progress::Failed(Seen::Group(e));
                }
                match self.nccl.async_error(state.comm) {
                    code if code.is_error() => {
                        Progress::Failed(self.nccl_failure(code, state.comm, "NCCL reported"))
                    }
                    _ => Progress::Pending,
                }
            },
            || self.timeout_error("the collective to finish"),
        );
        result.map_err(|seen| {
            let mut state = self.lock();
            if let Seen::Group(refused @ CommError::GroupFailed { .. }) = &seen {
                return refused.clone();
            }
            self.fail(&mut state, op, seen)
        })
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if state.comm.is_null() {
            return;
        }
        let comm = std::mem::replace(&mut state.comm, std::ptr::null_mut());
        let (ctx, stream, timeout, nccl) = (
            self.ctx.clone(),
            self.stream.clone(),
            self.timeout,
            self.nccl,
        );
        let _ = guard(move || {
            let _ = ctx.bind_to_thread();
            // Let submitted work finish and flush (bounded), then destroy; abort if it does not.
            let start = Instant::now();
            let drained = match stream.record_event(None) {
                Ok(event) => loop {
                    match event.try_is_complete() {
                        Ok(true) => break true,
                        Ok(false) if start.elapsed() < timeout => {
                            std::thread::sleep(Duration::from_micros(100))
                        }
                        _ => break false,
                    }
                },
                Err(_) => false,
            };
            let finalized = drained
                && !nccl.finalize(comm).is_error()
                && loop {
                    match nccl.async_error(comm) {
                        NcclResult::SUCCESS => break true,
                        NcclResult::IN_PROGRESS if start.elapsed() < timeout => {
                            std::thread::sleep(Duration::from_micros(100))
                        }
                        _ => break false,
                    }
                };
            if finalized {
                let _ = nccl.destroy(comm);
            } else {
                nccl.abort(comm);
            }
        });
    }
}

/// The handle of a submitted NCCL collective; [`NcclWork::wait`] gives back the result.
///
/// Dropping it without waiting is fine: the collective still runs, and cudarc's event tracking
/// keeps later users of the buffer behind it.
#[must_use = "a collective's result is only safe to read after wait()"]
pub struct NcclWork<T> {
    inner: Option<Arc<Communicator>>,
    event: Option<CudaEvent>,
    value: Result<T, CommError>,
    op: String,
}

impl<T> std::fmt::Debug for NcclWork<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclWork")
            .field("op", &self.op)
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> NcclWork<T> {
    /// A collective enqueued on `inner`'s stream; `event` follows it.
    pub(super) fn launched(
        inner: Arc<Communicator>,
        event: CudaEvent,
        value: T,
        op: String,
    ) -> NcclWork<T> {
        NcclWork {
            inner: Some(inner),
            event: Some(event),
            value: Ok(value),
            op,
        }
    }

    /// A handle whose result is known at once (an error before anything was enqueued).
    pub(super) fn ready(op: String, value: Result<T, CommError>) -> NcclWork<T> {
        NcclWork {
            inner: None,
            event: None,
            value,
            op,
        }
    }

    /// Blocks the host until the collective has finished on the GPU and returns the buffer (or
    /// what was handed in to keep alive), or the error. Never blocks past the group's deadline;
    /// a failure of the TCP process group ends it at once.
    pub fn wait(self) -> Result<T, CommError> {
        let value = self.value?;
        if let (Some(inner), Some(event)) = (&self.inner, &self.event) {
            inner.wait_event(event, &self.op)?;
        }
        Ok(value)
    }

    /// Returns the buffer at once, without waiting for the GPU: work queued later on the group's
    /// stream, or on any stream that uses the buffer through cudarc (its event tracking), runs
    /// after the collective. An error of the collective itself then surfaces at the next
    /// [`NcclWork::wait`] of this group. For back-to-back collectives on one buffer (as
    /// benchmarks do); do not use it for works of
    /// [`super::NcclGroup::submit_all_reduce_ptr`], whose memory must stay untouched until `wait`.
    pub fn without_waiting(self) -> Result<T, CommError> {
        self.value
    }

    /// Whether the collective has finished on the GPU (so that [`NcclWork::wait`] returns at
    /// once). An error also counts as finished.
    pub fn is_completed(&self) -> bool {
        match &self.event {
            Some(event) if self.value.is_ok() => event.try_is_complete().unwrap_or(true),
            _ => true,
        }
    }

    /// The collective's description, e.g. `nccl all_reduce #3 (1024 f32, sum)`.
    pub fn op(&self) -> &str {
        &self.op
    }

    /// The same collective, its buffer mapped by `f`.
    pub(super) fn map<U>(self, f: impl FnOnce(T) -> U) -> NcclWork<U> {
        NcclWork {
            inner: self.inner,
            event: self.event,
            value: self.value.map(f),
            op: self.op,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ProcessGroup;

    /// Two ranks of a real TCP group (threads on 127.0.0.1), each given its group.
    fn two_ranks<R: Send>(f: impl Fn(usize, ProcessGroup) -> R + Sync) -> Vec<R> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut listener = Some(listener);
        let timeout = Duration::from_secs(20);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let mut b = ProcessGroup::builder()
                        .no_env()
                        .rank(rank)
                        .world_size(2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .timeout(timeout)
                        .connect_timeout(timeout);
                    if rank == 0 {
                        b = b.master_listener(listener.take().unwrap());
                    }
                    let f = &f;
                    s.spawn(move || f(rank, b.build().unwrap()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank 1's GPU fails (a local error); rank 0 waits on a collective that never ends. Rank
    /// 0's wait ends long before its own deadline, blaming rank 1, and rank 1 blames itself.
    #[test]
    fn a_local_device_error_reaches_the_peers_through_the_tcp_group() {
        let results = two_ranks(|rank, pg| {
            let health = pg.health().unwrap().clone();
            if rank == 1 {
                // Let rank 0 start waiting first.
                std::thread::sleep(Duration::from_millis(300));
                let cause = CommError::config(CUDA_VAR, "rank 1: CUDA error: illegal address");
                let e = settle(Seen::Local(cause), Some(&health));
                return (e, Duration::ZERO);
            }
            let start = Instant::now();
            let seen = wait_loop(
                Duration::from_secs(60),
                Some(&health),
                || Progress::Pending,
                || CommError::config(NCCL_VAR, "rank 0 timed out"),
            )
            .unwrap_err();
            (settle(seen, Some(&health)), start.elapsed())
        });
        let (e0, waited) = &results[0];
        assert!(*waited < Duration::from_secs(10), "{waited:?}");
        assert_eq!(e0.peer(), Some(1), "{e0}");
        assert!(e0.to_string().contains("illegal address"), "{e0}");
        let (e1, _) = &results[1];
        assert!(e1.to_string().contains("illegal address"), "{e1}");
        assert_eq!(e1.peer(), None, "rank 1 blames no peer: {e1}");
    }

    /// Rank 1 fails on its own; rank 0's NCCL reports a remote error a moment before rank 1's
    /// ABORT arrives. Rank 0 blames rank 1, as its TCP group does, not itself.
    #[test]
    fn a_remote_nccl_error_takes_the_tcp_groups_verdict() {
        let results = two_ranks(|rank, pg| {
            let health = pg.health().unwrap().clone();
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(300));
                let cause = CommError::config(CUDA_VAR, "rank 1: out of memory");
                return settle(Seen::Local(cause), Some(&health));
            }
            let account = CommError::config(NCCL_VAR, "rank 0: ncclRemoteError");
            settle(Seen::Elsewhere(account), Some(&health))
        });
        assert_eq!(results[0].peer(), Some(1), "{}", results[0]);
        assert!(
            results[0].to_string().contains("out of memory"),
            "{}",
            results[0]
        );
    }

    /// Nobody fails on the TCP side: the deadline ends the wait with this rank's account.
    #[test]
    fn the_deadline_ends_a_wait_that_nothing_else_ends() {
        let start = Instant::now();
        let seen = wait_loop(
            Duration::from_millis(200),
            None,
            || Progress::Pending,
            || CommError::config(NCCL_VAR, "rank 0 timed out"),
        )
        .unwrap_err();
        assert!(start.elapsed() >= Duration::from_millis(200));
        let Seen::Elsewhere(e) = seen else {
            panic!("{seen:?}")
        };
        assert!(e.to_string().contains("rank 0 timed out"), "{e}");
    }
}
