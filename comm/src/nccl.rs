//! The NCCL backend (feature `nccl`): collectives on CUDA device buffers through NVIDIA's NCCL,
//! for one process per GPU, next to the TCP [`ProcessGroup`] that the ranks already form.
//!
//! ```no_run
//! use ddp_comm::nccl::NcclGroup;
//! use ddp_comm::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;          // TCP group: rendezvous and store
//! let nccl = NcclGroup::new(&pg)?;             // GPU LOCAL_RANK, NCCL id through the store
//! let grads = nccl.to_device(&[1.0f32, 2.0, 3.0])?;
//! let work = nccl.submit_all_reduce(grads, ReduceOp::Avg); // async, on NCCL's own stream
//! let grads = work.wait()?;                    // the same device buffer, reduced in place
//! println!("{:?}", nccl.to_host(&grads)?);
//! # Ok::<(), ddp_comm::CommError>(())
//! ```
//!
//! How it works:
//!
//! - **Loading.** Nothing of CUDA is linked: cudarc opens `libcuda` and `libnccl` when first
//!   used (its `dynamic-loading` feature), so this builds on machines without a CUDA toolkit.
//!   cudarc panics when a library is missing; [`NcclGroup::new`] checks for both first
//!   ([`driver_present`], [`nccl_present`]) and turns absence into a [`CommError`] that says what
//!   is missing.
//! - **Device.** Rank `LOCAL_RANK` uses GPU `LOCAL_RANK` (its primary context, the one burn's
//!   CUDA backend also uses, so device pointers are shared). Fewer visible GPUs than local
//!   ranks is an error, except that a process that sees exactly one GPU through
//!   `CUDA_VISIBLE_DEVICES` uses it (launchers that give each rank its own GPU that way).
//! - **Creation.** Every rank first opens its GPU, then the ranks all-gather through the TCP
//!   group whether that worked, so that a rank without a GPU fails every rank at once instead of
//!   leaving the others waiting inside NCCL. Rank 0 then creates NCCL's unique id and publishes
//!   it in the rendezvous store (key `ddp/nccl/unique_id/<n>`, n counting the NCCL groups made
//!   from this process group); the others read it, and all call `ncclCommInitRank`.
//! - **Operations.** Every collective is enqueued on the group's own CUDA stream and returns at
//!   once with an [`NcclWork`]; [`NcclWork::wait`] blocks the host until the stream has passed
//!   the collective. Buffers are cudarc [`CudaSlice`]s: cudarc's event tracking makes our stream
//!   wait for earlier work on a buffer made on another stream, and later users of the buffer wait
//!   for the collective. For buffers owned by someone else (burn's tensors) there is
//!   [`NcclGroup::submit_all_reduce_ptr`], where the caller keeps those promises itself.
//! - **Failure.** NCCL itself hangs when a peer dies. [`NcclWork::wait`] polls its event and
//!   `ncclCommGetAsyncError`, and gives up at the group's deadline (the TCP group's `timeout`):
//!   it aborts the communicator (so that the stuck kernels end) and fails, and every later
//!   collective of the group fails at once with that first error. NCCL does not say which peer
//!   is missing; the TCP group (whose sockets see a dead process at once) usually does.
//!
//! NCCL has no barrier: [`NcclGroup::barrier`] all-reduces one value and waits for it. Collectives
//! carry no fingerprint on the wire (NCCL sends raw data), so every rank must submit the same
//! collectives with the same lengths in the same order; a mismatch hangs until the deadline or
//! garbles data, as with any NCCL program.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use cudarc::nccl::sys as nc;

use crate::{chunk_range, CommError, DType, Element, ProcessGroup, ReduceOp};

/// The variable named in setup errors about the GPU or the driver.
const CUDA_VAR: &str = "CUDA";
/// The variable named in setup and run-time errors about NCCL.
const NCCL_VAR: &str = "NCCL";

/// Whether the NVIDIA driver library (`libcuda.so`) can be loaded. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library and closes it again.
    catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false)
}

/// Whether the NCCL library can be loaded under a name cudarc looks for (`libnccl.so`, ...).
/// Never panics.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library and closes it again.
    catch_unwind(|| unsafe { nc::is_culib_present() }).unwrap_or(false)
}

/// The number of GPUs the NVIDIA driver makes visible to this process (after
/// `CUDA_VISIBLE_DEVICES`); a clear error when there is no driver. Never panics.
pub fn device_count() -> Result<usize, CommError> {
    check_driver().map_err(|m| CommError::config(CUDA_VAR, m))
}

/// The NCCL library's version as `(major, minor, patch)`; an error when it cannot be loaded.
pub fn nccl_version() -> Result<(u32, u32, u32), CommError> {
    if !nccl_present() {
        return Err(CommError::config(NCCL_VAR, nccl_missing_message()));
    }
    let mut code: std::ffi::c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    let r = guard(|| unsafe { nc::ncclGetVersion(&mut code) })
        .map_err(|m| CommError::config(NCCL_VAR, m))?;
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(CommError::config(
            NCCL_VAR,
            format!("ncclGetVersion failed: {}", nccl_error_text(r, None)),
        ));
    }
    let code = code.max(0) as u32;
    // NCCL >= 2.9 encodes the version as major * 10000 + minor * 100 + patch.
    Ok((code / 10000, (code / 100) % 100, code % 100))
}

/// Loads the driver, initialises it and counts the devices, as text errors for the caller to
/// wrap.
fn check_driver() -> Result<usize, String> {
    if !driver_present() {
        return Err(
            "no NVIDIA driver found: libcuda.so could not be loaded (is this a machine with an \
             NVIDIA GPU and its driver installed? is the driver's library folder on the loader \
             path?)"
                .into(),
        );
    }
    let count = guard(CudaContext::device_count)?
        .map_err(|e| format!("the NVIDIA driver is installed but cuInit failed: {e}"))?;
    Ok(count.max(0) as usize)
}

/// What to tell a user whose NCCL cannot be loaded.
fn nccl_missing_message() -> String {
    let mut message = String::from(
        "the NCCL library could not be loaded: cudarc looks for libnccl.so (and a few versioned \
         names) on the loader path; install NCCL (for example the libnccl2 and libnccl-dev \
         packages) or add its lib folder to LD_LIBRARY_PATH",
    );
    if dlopen_works("libnccl.so.2") {
        message.push_str(
            "; libnccl.so.2 is loadable, but not under the name libnccl.so: make a symlink named \
             libnccl.so to it in a folder on LD_LIBRARY_PATH (pip's nvidia-nccl-cu12 package \
             ships only libnccl.so.2)",
        );
    }
    message
}

/// Whether `name` can be opened by the dynamic loader.
fn dlopen_works(name: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: dlopen with a valid C string; the handle is closed at once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            false
        } else {
            libc::dlclose(handle);
            true
        }
    }
}

/// Runs `f`, turning a panic (cudarc panics on a missing library or symbol) into an error.
fn guard<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        format!("the CUDA/NCCL bindings panicked: {what}")
    })
}

/// The GPU ordinal for a rank: `local_rank` when every local rank has a GPU of its own; 0 when
/// the process sees exactly one GPU because `CUDA_VISIBLE_DEVICES` names one (a launcher gave
/// each rank its own); otherwise an error that says how many GPUs and ranks there are.
pub fn pick_device(
    local_rank: usize,
    local_world_size: usize,
    visible: usize,
    cuda_visible_devices: Option<&str>,
) -> Result<usize, String> {
    let mask = cuda_visible_devices
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
        .unwrap_or_default();
    if visible == 0 {
        return Err(format!(
            "the NVIDIA driver is loaded but reports no GPU{mask}"
        ));
    }
    if local_rank < visible && local_world_size <= visible {
        return Ok(local_rank);
    }
    let one_named = cuda_visible_devices
        .is_some_and(|v| v.split(',').filter(|d| !d.trim().is_empty()).count() == 1);
    if visible == 1 && one_named {
        return Ok(0);
    }
    Err(format!(
        "{local_world_size} local rank(s) on this host but only {visible} GPU(s) visible{mask}: \
         LOCAL_RANK {local_rank} has no GPU of its own (start at most {visible} rank(s) per host, \
         or give each rank one GPU through CUDA_VISIBLE_DEVICES)"
    ))
}

/// NCCL's data type for ours.
fn nccl_dtype(dtype: DType) -> nc::ncclDataType_t {
    match dtype {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::F64 => nc::ncclDataType_t::ncclFloat64,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        DType::F16 => nc::ncclDataType_t::ncclFloat16,
        DType::I32 => nc::ncclDataType_t::ncclInt32,
        DType::I64 => nc::ncclDataType_t::ncclInt64,
        DType::U8 => nc::ncclDataType_t::ncclUint8,
    }
}

/// NCCL's reduction for ours (`Avg` is NCCL's `ncclAvg`).
fn nccl_op(op: ReduceOp) -> nc::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nc::ncclRedOp_t::ncclAvg,
        ReduceOp::Min => nc::ncclRedOp_t::ncclMin,
        ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
    }
}

/// NCCL's description of `result`, plus the communicator's last error message when there is one.
fn nccl_error_text(result: nc::ncclResult_t, comm: Option<nc::ncclComm_t>) -> String {
    // SAFETY: both return static (or communicator-owned) NUL-terminated strings or null.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let mut message = format!(
        "{result:?} ({})",
        guard(|| text(unsafe { nc::ncclGetErrorString(result) })).unwrap_or_default()
    );
    if let Some(comm) = comm.filter(|c| !c.is_null()) {
        let last = guard(|| text(unsafe { nc::ncclGetLastError(comm) })).unwrap_or_default();
        if !last.is_empty() {
            message.push_str(": ");
            message.push_str(&last);
        }
    }
    message
}

/// Ok for `ncclSuccess` (and `ncclInProgress`, which blocking communicators do not return).
fn check(result: nc::ncclResult_t) -> Result<(), nc::ncclResult_t> {
    match result {
        nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(other),
    }
}

/// The communicator and what changes with every collective.
struct State {
    /// Null once destroyed or aborted.
    comm: nc::ncclComm_t,
    /// Number of the next collective (for messages).
    seq: u64,
    /// The first failure; every later collective fails with it.
    failed: Option<CommError>,
}

// SAFETY: the raw communicator is only used under the mutex that owns this state (NCCL
// communicators may be used from any thread, one at a time).
unsafe impl Send for State {}

/// What the group and its [`NcclWork`] handles share.
struct Inner {
    rank: usize,
    world_size: usize,
    ordinal: usize,
    timeout: Duration,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<State>,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records `cause` as the group's failure (unless one is recorded already), aborts the
    /// communicator so that its kernels end, and returns the error for `op`.
    fn fail(&self, state: &mut State, op: &str, cause: CommError) -> CommError {
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
    fn refused(&self, state: &State, op: &str) -> Option<CommError> {
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

impl Drop for Inner {
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
    inner: Option<Arc<Inner>>,
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
    fn ready(op: String, value: Result<T, CommError>) -> NcclWork<T> {
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
    /// [`NcclGroup::submit_all_reduce_ptr`], whose memory must stay untouched until `wait`.
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

    fn map<U>(self, f: impl FnOnce(T) -> U) -> NcclWork<U> {
        NcclWork {
            inner: self.inner,
            event: self.event,
            value: self.value.map(f),
            op: self.op,
        }
    }
}

/// A NCCL communicator over the ranks of a [`ProcessGroup`], one GPU per rank (GPU
/// `LOCAL_RANK`), with its own CUDA stream. See the [module documentation](self).
///
/// `NcclGroup` is `Send + Sync`; collectives submitted from several threads are serialised, but
/// as with the TCP group every rank must submit the same collectives in the same order.
/// Dropping it waits (up to the deadline) for submitted collectives, then destroys the
/// communicator.
pub struct NcclGroup {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.inner.rank)
            .field("world_size", &self.inner.world_size)
            .field("device", &self.inner.ordinal)
            .finish()
    }
}

/// Opens this rank's GPU: driver, NCCL library, device choice, context and stream.
fn open_device(
    local_rank: usize,
    local_world_size: usize,
) -> Result<(Arc<CudaContext>, Arc<CudaStream>, usize), String> {
    let visible = check_driver()?;
    if !nccl_present() {
        return Err(nccl_missing_message());
    }
    let mask = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = pick_device(local_rank, local_world_size, visible, mask.as_deref())?;
    let ctx = guard(|| CudaContext::new(ordinal))?
        .map_err(|e| format!("cannot open GPU {ordinal}: {e:?}"))?;
    let stream = guard(|| ctx.new_stream())?
        .map_err(|e| format!("cannot create a CUDA stream on GPU {ordinal}: {e:?}"))?;
    Ok((ctx, stream, ordinal))
}

impl NcclGroup {
    /// Creates the NCCL communicator of `pg`'s ranks on GPU `LOCAL_RANK`. Every rank of `pg`
    /// must call it at the same point (it runs an all-gather on `pg` and uses its store).
    ///
    /// Fails with a clear error, on every rank, when any rank has no NVIDIA driver, no GPU of
    /// its own or no loadable NCCL library; never panics for those. The deadline of later
    /// collectives is `pg`'s `timeout`.
    pub fn new(pg: &ProcessGroup) -> Result<NcclGroup, CommError> {
        let (rank, world) = (pg.rank(), pg.world_size());
        let opened = open_device(pg.local_rank(), pg.local_world_size());
        if world > 1 {
            // Nobody enters NCCL unless everybody can.
            let flags = pg.all_gather(vec![u8::from(opened.is_err())])?;
            let failed: Vec<String> = (0..world)
                .filter(|&r| flags[r] != 0 && r != rank)
                .map(|r| r.to_string())
                .collect();
            if opened.is_ok() && !failed.is_empty() {
                return Err(CommError::config(
                    CUDA_VAR,
                    format!(
                        "rank {rank}: rank(s) {} could not open their GPU or load NCCL (see \
                         their errors); no NCCL communicator was created",
                        failed.join(", ")
                    ),
                ));
            }
        }
        let (ctx, stream, ordinal) = opened
            .map_err(|message| CommError::config(CUDA_VAR, format!("rank {rank}: {message}")))?;

        let id = exchange_unique_id(pg)?;
        ctx.bind_to_thread().map_err(|e| {
            CommError::config(
                CUDA_VAR,
                format!("rank {rank}: cannot use GPU {ordinal}: {e:?}"),
            )
        })?;
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: comm receives the new communicator; id is the job's unique id; rank < world.
        let r = guard(|| unsafe {
            nc::ncclCommInitRank(
                &mut comm,
                world as std::ffi::c_int,
                id,
                rank as std::ffi::c_int,
            )
        })
        .map_err(|m| CommError::config(NCCL_VAR, format!("rank {rank}: {m}")))?;
        if let Err(code) = check(r) {
            return Err(CommError::config(
                NCCL_VAR,
                format!(
                    "rank {rank}: ncclCommInitRank ({world} ranks, GPU {ordinal}) failed: {}",
                    nccl_error_text(code, None)
                ),
            ));
        }
        tracing::debug!("rank {rank}: NCCL communicator of {world} ranks on GPU {ordinal}");
        Ok(NcclGroup {
            inner: Arc::new(Inner {
                rank,
                world_size: world,
                ordinal,
                timeout: pg.config().timeout,
                ctx,
                stream,
                state: Mutex::new(State {
                    comm,
                    seq: 0,
                    failed: None,
                }),
            }),
        })
    }

    /// This process's rank (the same as in the process group).
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// The CUDA device ordinal this rank uses.
    pub fn device_ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The CUDA context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream the collectives run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// How long [`NcclWork::wait`] waits before it declares the group failed.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    /// Copies `host` to a new buffer on this rank's GPU (on the group's stream).
    pub fn to_device<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CommError> {
        self.inner
            .stream
            .clone_htod(host)
            .map_err(|e| self.cuda_error("copying to the GPU", e))
    }

    /// Copies `buf` back to the host, after everything queued on the group's stream.
    pub fn to_host<T: DeviceRepr>(&self, buf: &CudaSlice<T>) -> Result<Vec<T>, CommError> {
        let out = self
            .inner
            .stream
            .clone_dtoh(buf)
            .map_err(|e| self.cuda_error("copying from the GPU", e))?;
        self.inner
            .stream
            .synchronize()
            .map_err(|e| self.cuda_error("copying from the GPU", e))?;
        Ok(out)
    }

    fn cuda_error(&self, what: &str, e: cudarc::driver::DriverError) -> CommError {
        CommError::config(
            CUDA_VAR,
            format!(
                "rank {}: {what} on GPU {}: {e:?}",
                self.inner.rank, self.inner.ordinal
            ),
        )
    }

    /// Enqueues one collective: numbers it, refuses it when the group failed, runs `f` (which
    /// calls NCCL on the stream) and records the event that [`NcclWork::wait`] waits for.
    fn launch<T>(
        &self,
        kind: &str,
        count: usize,
        dtype: DType,
        extra: &str,
        mut value: T,
        f: impl FnOnce(&mut T, &Arc<CudaStream>, nc::ncclComm_t) -> Result<(), String>,
    ) -> NcclWork<T> {
        let inner = &self.inner;
        let mut state = inner.lock();
        let op = format!("nccl {kind} #{} ({count} {dtype}{extra})", state.seq);
        state.seq += 1;
        if let Some(e) = inner.refused(&state, &op) {
            return NcclWork::ready(op, Err(e));
        }
        if let Err(e) = inner.ctx.bind_to_thread() {
            let cause =
                CommError::config(CUDA_VAR, format!("binding GPU {}: {e:?}", inner.ordinal));
            let e = inner.fail(&mut state, &op, cause);
            return NcclWork::ready(op, Err(e));
        }
        let comm = state.comm;
        let launched = guard(|| f(&mut value, &inner.stream, comm)).and_then(|r| r);
        if let Err(message) = launched {
            let e = inner.fail(&mut state, &op, CommError::config(NCCL_VAR, message));
            return NcclWork::ready(op, Err(e));
        }
        match inner.stream.record_event(None) {
            Ok(event) => NcclWork {
                inner: Some(inner.clone()),
                event: Some(event),
                value: Ok(value),
                op,
            },
            Err(e) => {
                let cause = CommError::config(CUDA_VAR, format!("recording an event: {e:?}"));
                let e = inner.fail(&mut state, &op, cause);
                NcclWork::ready(op, Err(e))
            }
        }
    }

    /// A new buffer of `len` elements for a collective to fill completely (empty for 0).
    fn alloc_result<T: DeviceRepr>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, cudarc::driver::DriverError> {
        if len == 0 {
            return self.inner.stream.null();
        }
        // SAFETY: the collective writes every element before anyone can read it (readers
        // wait for its event through cudarc's event tracking, or for `wait`).
        unsafe { self.inner.stream.alloc::<T>(len) }
    }

    /// An argument error that every rank detects alike (the group stays usable).
    fn invalid<T>(&self, op: &str, message: String) -> NcclWork<T> {
        NcclWork::ready(
            format!("nccl {op}"),
            Err(CommError::InvalidArgument {
                rank: self.inner.rank,
                op: format!("nccl {op}"),
                message,
            }),
        )
    }

    /// Queues an all-reduce of `buf` in place (same length on every rank).
    pub fn submit_all_reduce<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> NcclWork<CudaSlice<T>> {
        let count = buf.len();
        let extra = format!(", {}", op.name());
        self.launch(
            "all_reduce",
            count,
            T::DTYPE,
            &extra,
            buf,
            |buf, stream, comm| {
                if count == 0 {
                    return Ok(());
                }
                let (ptr, _record) = buf.device_ptr_mut(stream);
                // SAFETY: ptr holds count elements of T on this device; in place is allowed.
                let r = unsafe {
                    nc::ncclAllReduce(
                        ptr as *const c_void,
                        ptr as *mut c_void,
                        count,
                        nccl_dtype(T::DTYPE),
                        nccl_op(op),
                        comm,
                        stream.cu_stream() as nc::cudaStream_t,
                    )
                };
                check(r)
                    .map_err(|code| format!("ncclAllReduce: {}", nccl_error_text(code, Some(comm))))
            },
        )
    }

    /// Queues an all-reduce of `count` elements of `dtype` at the raw device address `ptr`, in
    /// place; `keep` is handed back by [`NcclWork::wait`] (pass what keeps the memory alive).
    ///
    /// This is the door for buffers that cudarc does not own, such as the memory of a burn
    /// tensor on the CUDA backend.
    ///
    /// # Safety
    ///
    /// `ptr` must address at least `count` elements of `dtype` on this group's device, in its
    /// primary context; whatever produced them must have finished (synchronise the producing
    /// stream first), and nothing may read or write them until `wait` has returned.
    pub unsafe fn submit_all_reduce_ptr<K>(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        keep: K,
    ) -> NcclWork<K> {
        let extra = format!(", {}", op.name());
        self.launch(
            "all_reduce",
            count,
            dtype,
            &extra,
            keep,
            |_, stream, comm| {
                if count == 0 {
                    return Ok(());
                }
                // SAFETY: the caller's promises above.
                let r = unsafe {
                    nc::ncclAllReduce(
                        ptr as *const c_void,
                        ptr as *mut c_void,
                        count,
                        nccl_dtype(dtype),
                        nccl_op(op),
                        comm,
                        stream.cu_stream() as nc::cudaStream_t,
                    )
                };
                check(r)
                    .map_err(|code| format!("ncclAllReduce: {}", nccl_error_text(code, Some(comm))))
            },
        )
    }

    /// Queues a broadcast of `root`'s `buf` to every rank, in place (same length everywhere).
    pub fn submit_broadcast<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        root: usize,
    ) -> NcclWork<CudaSlice<T>> {
        let world = self.inner.world_size;
        if root >= world {
            return self.invalid(
                "broadcast",
                format!("root {root} is not below the world size {world}"),
            );
        }
        let count = buf.len();
        let extra = format!(", root {root}");
        self.launch(
            "broadcast",
            count,
            T::DTYPE,
            &extra,
            buf,
            |buf, stream, comm| {
                if count == 0 {
                    return Ok(());
                }
                let (ptr, _record) = buf.device_ptr_mut(stream);
                // SAFETY: ptr holds count elements of T on this device; in place is allowed.
                let r = unsafe {
                    nc::ncclBroadcast(
                        ptr as *const c_void,
                        ptr as *mut c_void,
                        count,
                        nccl_dtype(T::DTYPE),
                        root as std::ffi::c_int,
                        comm,
                        stream.cu_stream() as nc::cudaStream_t,
                    )
                };
                check(r)
                    .map_err(|code| format!("ncclBroadcast: {}", nccl_error_text(code, Some(comm))))
            },
        )
    }

    /// Queues an all-gather: every rank passes a buffer of the same length; the result is a new
    /// buffer with all of them concatenated in rank order.
    pub fn submit_all_gather<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
    ) -> NcclWork<CudaSlice<T>> {
        let count = buf.len();
        let total = count * self.inner.world_size;
        let out = match self.alloc_result::<T>(total) {
            Ok(out) => out,
            Err(e) => {
                return NcclWork::ready(
                    "nccl all_gather".into(),
                    Err(self.cuda_error("allocating the all_gather result", e)),
                )
            }
        };
        self.launch(
            "all_gather",
            count,
            T::DTYPE,
            "",
            (buf, out),
            |(buf, out), stream, comm| {
                if count == 0 {
                    return Ok(());
                }
                let (src, _read) = buf.device_ptr(stream);
                let (dst, _write) = out.device_ptr_mut(stream);
                // SAFETY: src holds count elements, dst world * count.
                let r = unsafe {
                    nc::ncclAllGather(
                        src as *const c_void,
                        dst as *mut c_void,
                        count,
                        nccl_dtype(T::DTYPE),
                        comm,
                        stream.cu_stream() as nc::cudaStream_t,
                    )
                };
                check(r)
                    .map_err(|code| format!("ncclAllGather: {}", nccl_error_text(code, Some(comm))))
            },
        )
        .map(|(_, out)| out)
    }

    /// Queues a reduce-scatter: `buf` (same length on every rank) is reduced with `op`, and this
    /// rank gets a new buffer with chunk [`chunk_range`]`(len, world_size, rank)` of the result,
    /// as with the TCP group. Lengths that are a multiple of the world size use
    /// `ncclReduceScatter`; others one `ncclReduce` per chunk in a NCCL group call.
    pub fn submit_reduce_scatter<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> NcclWork<CudaSlice<T>> {
        let (rank, world) = (self.inner.rank, self.inner.world_size);
        let len = buf.len();
        let mine = chunk_range(len, world, rank);
        let out = match self.alloc_result::<T>(mine.len()) {
            Ok(out) => out,
            Err(e) => {
                return NcclWork::ready(
                    "nccl reduce_scatter".into(),
                    Err(self.cuda_error("allocating the reduce_scatter result", e)),
                )
            }
        };
        let extra = format!(", {}", op.name());
        let (dt, red) = (nccl_dtype(T::DTYPE), nccl_op(op));
        let size = T::DTYPE.size() as u64;
        self.launch(
            "reduce_scatter",
            len,
            T::DTYPE,
            &extra,
            (buf, out),
            |(buf, out), stream, comm| {
                let (src, _read) = buf.device_ptr(stream);
                let (dst, _write) = out.device_ptr_mut(stream);
                let s = stream.cu_stream() as nc::cudaStream_t;
                let err =
                    |name: &str, code| format!("{name}: {}", nccl_error_text(code, Some(comm)));
                if len == 0 {
                    return Ok(());
                }
                if len.is_multiple_of(world) {
                    // SAFETY: src holds len elements, dst len / world.
                    let r = unsafe {
                        nc::ncclReduceScatter(
                            src as *const c_void,
                            dst as *mut c_void,
                            len / world,
                            dt,
                            red,
                            comm,
                            s,
                        )
                    };
                    return check(r).map_err(|c| err("ncclReduceScatter", c));
                }
                // SAFETY: group start/end bracket the reduces below.
                check(unsafe { nc::ncclGroupStart() }).map_err(|c| err("ncclGroupStart", c))?;
                let mut first_error = None;
                for r in 0..world {
                    let chunk = chunk_range(len, world, r);
                    if chunk.is_empty() {
                        continue;
                    }
                    let recv = if r == rank {
                        dst as *mut c_void
                    } else {
                        std::ptr::null_mut()
                    };
                    // SAFETY: the chunk lies inside src; recv holds it on the root.
                    let result = unsafe {
                        nc::ncclReduce(
                            (src + chunk.start as u64 * size) as *const c_void,
                            recv,
                            chunk.len(),
                            dt,
                            red,
                            r as std::ffi::c_int,
                            comm,
                            s,
                        )
                    };
                    if let Err(c) = check(result) {
                        first_error.get_or_insert(err("ncclReduce", c));
                    }
                }
                // SAFETY: closes the group opened above.
                let end = check(unsafe { nc::ncclGroupEnd() }).map_err(|c| err("ncclGroupEnd", c));
                match first_error {
                    Some(e) => Err(e),
                    None => end,
                }
            },
        )
        .map(|(_, out)| out)
    }

    /// Queues a barrier (an all-reduce of one value); `wait` returns once every rank's GPU
    /// has reached it.
    pub fn submit_barrier(&self) -> NcclWork<()> {
        let buf = match self.inner.stream.alloc_zeros::<f32>(1) {
            Ok(buf) => buf,
            Err(e) => {
                return NcclWork::ready(
                    "nccl barrier".into(),
                    Err(self.cuda_error("allocating the barrier value", e)),
                )
            }
        };
        self.submit_all_reduce(buf, ReduceOp::Sum).map(|_| ())
    }

    /// All-reduce, blocking: `submit_all_reduce(buf, op).wait()`.
    pub fn all_reduce<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<CudaSlice<T>, CommError> {
        self.submit_all_reduce(buf, op).wait()
    }

    /// Broadcast, blocking: `submit_broadcast(buf, root).wait()`.
    pub fn broadcast<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        root: usize,
    ) -> Result<CudaSlice<T>, CommError> {
        self.submit_broadcast(buf, root).wait()
    }

    /// All-gather, blocking: `submit_all_gather(buf).wait()`.
    pub fn all_gather<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
    ) -> Result<CudaSlice<T>, CommError> {
        self.submit_all_gather(buf).wait()
    }

    /// Reduce-scatter, blocking: `submit_reduce_scatter(buf, op).wait()`.
    pub fn reduce_scatter<T: Element + DeviceRepr>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<CudaSlice<T>, CommError> {
        self.submit_reduce_scatter(buf, op).wait()
    }

    /// Barrier, blocking: `submit_barrier().wait()`.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.submit_barrier().wait()
    }
}

/// Rank 0 creates NCCL's unique id and publishes it in `pg`'s store; the others read it.
fn exchange_unique_id(pg: &ProcessGroup) -> Result<nc::ncclUniqueId, CommError> {
    let rank = pg.rank();
    let create = || -> Result<nc::ncclUniqueId, String> {
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        // SAFETY: ncclGetUniqueId writes one id.
        let r = guard(|| unsafe { nc::ncclGetUniqueId(&mut id) })?;
        check(r)
            .map_err(|code| format!("ncclGetUniqueId failed: {}", nccl_error_text(code, None)))?;
        Ok(id)
    };
    let Some(store) = pg.store() else {
        // World size 1: nobody to share it with.
        return create().map_err(|m| CommError::config(NCCL_VAR, format!("rank {rank}: {m}")));
    };
    // The n-th NCCL group made from this process group uses the n-th key (every rank makes
    // them in the same order).
    let n = store.add(&format!("ddp/nccl/groups/{rank}"), 1)?;
    let key = format!("ddp/nccl/unique_id/{n}");
    if rank == 0 {
        match create() {
            Ok(id) => {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                store.set(&key, &bytes)?;
                Ok(id)
            }
            Err(m) => {
                // Tell the others at once instead of letting them wait for the key.
                let _ = store.set(&key, format!("error: {m}").as_bytes());
                Err(CommError::config(NCCL_VAR, format!("rank 0: {m}")))
            }
        }
    } else {
        let bytes = store.get(&key)?;
        if bytes.len() != 128 {
            return Err(CommError::config(
                NCCL_VAR,
                format!(
                    "rank {rank}: rank 0 could not create the NCCL id: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            ));
        }
        let mut id = nc::ncclUniqueId { internal: [0; 128] };
        for (d, s) in id.internal.iter_mut().zip(bytes) {
            *d = s as std::ffi::c_char;
        }
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_local_rank_gets_its_own_gpu() {
        assert_eq!(pick_device(0, 2, 2, None), Ok(0));
        assert_eq!(pick_device(1, 2, 4, None), Ok(1));
        assert_eq!(pick_device(3, 4, 4, Some("0,1,2,3")), Ok(3));
    }

    #[test]
    fn one_visible_gpu_per_process_is_used() {
        assert_eq!(pick_device(3, 4, 1, Some("3")), Ok(0));
    }

    #[test]
    fn fewer_gpus_than_local_ranks_is_a_clear_error() {
        let e = pick_device(2, 4, 2, None).unwrap_err();
        assert!(
            e.contains("4 local rank(s)") && e.contains("only 2 GPU(s)"),
            "{e}"
        );
        assert!(e.contains("LOCAL_RANK 2"), "{e}");
        // Even the ranks that would find a GPU refuse: the group could not form anyway.
        assert!(pick_device(0, 4, 2, None).is_err());
        let e = pick_device(0, 1, 0, Some("")).unwrap_err();
        assert!(e.contains("reports no GPU"), "{e}");
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        let pg = ProcessGroup::builder().no_env().build().unwrap();
        let result = catch_unwind(AssertUnwindSafe(|| NcclGroup::new(&pg)));
        let result = result.expect("NcclGroup::new must not panic");
        if !driver_present() {
            let e = result.unwrap_err().to_string();
            assert!(e.contains("no NVIDIA driver found"), "{e}");
            let e = device_count().unwrap_err().to_string();
            assert!(e.contains("no NVIDIA driver found"), "{e}");
        } else if let Err(e) = result {
            // A machine with a driver: whatever is missing must be said, not panicked.
            assert!(!e.to_string().is_empty());
        }
    }

    /// Two ranks (threads) of one TCP group: both get the group (and a correct all-reduce) on a
    /// machine with two GPUs and NCCL, and both fail with a clear error, without hanging,
    /// anywhere else.
    #[test]
    fn two_ranks_create_the_group_or_both_fail_clearly() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut listener = Some(listener);
        let timeout = Duration::from_secs(30);
        let results: Vec<Result<Vec<f32>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    let mut b = ProcessGroup::builder()
                        .no_env()
                        .rank(rank)
                        .world_size(2)
                        .local_rank(rank)
                        .local_world_size(2)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .timeout(timeout)
                        .connect_timeout(timeout);
                    if rank == 0 {
                        b = b.master_listener(listener.take().unwrap());
                    }
                    s.spawn(move || {
                        let pg = b.build().unwrap();
                        let text = |e: CommError| e.to_string();
                        let nccl = NcclGroup::new(&pg).map_err(text)?;
                        let buf = nccl.to_device(&[rank as f32 + 1.0; 4]).map_err(text)?;
                        let buf = nccl.all_reduce(buf, ReduceOp::Sum).map_err(text)?;
                        nccl.to_host(&buf).map_err(text)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        match (&results[0], &results[1]) {
            (Ok(a), Ok(b)) => {
                assert_eq!(a, &[3.0; 4]);
                assert_eq!(b, &[3.0; 4]);
            }
            (Err(a), Err(b)) => {
                if !driver_present() {
                    assert!(a.contains("rank 0: no NVIDIA driver found"), "{a}");
                    assert!(b.contains("rank 1: no NVIDIA driver found"), "{b}");
                }
            }
            other => panic!("one rank got the group, the other did not: {other:?}"),
        }
    }

    #[test]
    fn nccl_absence_is_reported_without_panicking() {
        if !nccl_present() {
            let e = nccl_version().unwrap_err().to_string();
            assert!(e.contains("NCCL library could not be loaded"), "{e}");
        }
    }
}
