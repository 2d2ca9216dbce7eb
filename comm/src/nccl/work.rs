//! [`NcclWork`], the handle of a submitted NCCL collective, and what a group and its handles
//! share ([`Communicator`]): the NCCL communicator, its CUDA stream, and the group's first
//! failure. NCCL itself hangs when a peer dies; [`NcclWork::wait`] polls the collective's event
//! and `ncclCommGetAsyncError` and gives up at the group's deadline, aborting the communicator
//! so that the stuck kernels end.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys as nc;

use super::library::{check, guard, nccl_error_text, CUDA_VAR, NCCL_VAR};
use crate::error::CommError;

/// The communicator and what changes with every collective.
pub(super) struct CommState {
    /// Null once destroyed or aborted.
    pub comm: nc::ncclComm_t,
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
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub state: Mutex<CommState>,
}

impl Communicator {
    /// The communicator's state, locked.
    pub fn lock(&self) -> MutexGuard<'_, CommState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `cause` as the group's failure (unless one is recorded already), aborts the
    /// communicator so that its kernels end, and returns the error for `op`.
    pub fn fail(&self, state: &mut CommState, op: &str, cause: CommError) -> CommError {
        if state.failed.is_none() {
            state.failed = Some(cause.clone());
        }
        if !state.comm.is_null() {
            let comm = std::mem::replace(&mut state.comm, std::ptr::null_mut());
            // SAFETY: comm is a live communicator, never used again.
            let _ = guard(|| unsafe { nc::ncclCommAbort(comm) });
        }
        CommError::Collective {
            rank: self.rank,
            op: op.to_string(),
            cause: Box::new(cause),
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

    /// Blocks until `event` has completed, NCCL reports an error, or the deadline passes.
    fn wait_event(&self, event: &CudaEvent, op: &str) -> Result<(), CommError> {
        let start = Instant::now();
        let mut polls: u32 = 0;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let mut state = self.lock();
                    let cause = CommError::config(CUDA_VAR, format!("CUDA error: {e:?}"));
                    return Err(self.fail(&mut state, op, cause));
                }
            }
            {
                let mut state = self.lock();
                if let Some(e) = self.refused(&state, op) {
                    return Err(e);
                }
                let mut async_error = nc::ncclResult_t::ncclSuccess;
                // SAFETY: comm is live (checked by `refused`); writes one enum.
                let r =
                    guard(|| unsafe { nc::ncclCommGetAsyncError(state.comm, &mut async_error) });
                let bad = match r {
                    Ok(r) if check(r).is_err() => Some(r),
                    Ok(_) if check(async_error).is_err() => Some(async_error),
                    Ok(_) => None,
                    Err(m) => {
                        let cause = CommError::config(NCCL_VAR, m);
                        return Err(self.fail(&mut state, op, cause));
                    }
                };
                if let Some(code) = bad {
                    let message = format!(
                        "NCCL reported an error (a peer may have died): {}",
                        nccl_error_text(code, Some(state.comm))
                    );
                    return Err(self.fail(&mut state, op, CommError::config(NCCL_VAR, message)));
                }
                if start.elapsed() >= self.timeout {
                    let message = format!(
                        "rank {} waited {:?} for the collective to finish on GPU {}; a peer has \
                         probably died, stalled or submitted different collectives (NCCL does \
                         not say which rank); the communicator is aborted",
                        self.rank, self.timeout, self.ordinal
                    );
                    return Err(self.fail(&mut state, op, CommError::config(NCCL_VAR, message)));
                }
            }
            polls = polls.saturating_add(1);
            if polls < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(if polls < 2000 { 20 } else { 200 }));
            }
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if state.comm.is_null() {
            return;
        }
        let comm = std::mem::replace(&mut state.comm, std::ptr::null_mut());
        let ctx = self.ctx.clone();
        let stream = self.stream.clone();
        let timeout = self.timeout;
        let _ = guard(move || {
            let _ = ctx.bind_to_thread();
            // Let submitted work finish (bounded), then destroy; abort if it does not.
            let done = match stream.record_event(None) {
                Ok(event) => {
                    let start = Instant::now();
                    loop {
                        match event.try_is_complete() {
                            Ok(true) => break true,
                            Ok(false) if start.elapsed() < timeout => {
                                std::thread::sleep(Duration::from_micros(100))
                            }
                            _ => break false,
                        }
                    }
                }
                Err(_) => false,
            };
            // SAFETY: comm is live and used by nothing else any more.
            unsafe {
                if done {
                    nc::ncclCommDestroy(comm);
                } else {
                    nc::ncclCommAbort(comm);
                }
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
    /// what was handed in to keep alive), or the error. Never blocks past the group's deadline.
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
