//! [`NcclGroup`]: the NCCL communicator of a process group's ranks, made through the TCP group
//! (every rank opens its GPU, the ranks agree through an all-gather that all could, rank 0's
//! NCCL unique id travels through the store, and the communicator is created under the group's
//! deadline, `init.rs`), and its collectives, each enqueued on the group's own CUDA stream.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};

use super::api::{ok, NcclLibrary, NcclResult, RawComm, RawStream, UniqueId};
use super::device::{open_device, OpenedDevice};
use super::init::{init_with_deadline, RealInit};
use super::library::{guard, CUDA_VAR, NCCL_VAR};
use super::work::{CommState, Communicator, NcclWork, Seen};
use crate::collectives::algorithms::chunk_range;
use crate::collectives::element::{DType, Element, ReduceOp};
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::rendezvous::store::Store;

/// How often a rank polls NCCL while its communicator is being created.
const INIT_POLL: Duration = Duration::from_millis(2);

/// A device buffer of bytes (the result of [`NcclGroup::submit_all_reduce_bytes`]), kept alive
/// until its collective has finished.
pub struct DeviceBytes(pub CudaSlice<u8>);

impl std::fmt::Debug for DeviceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBytes({} bytes)", self.0.len())
    }
}

/// What one NCCL call of a collective returned: `Ok` with `SUCCESS` or `IN_PROGRESS`, or the
/// error code and the function's name.
type Launched = Result<NcclResult, (NcclResult, &'static str)>;

/// A NCCL communicator over the ranks of a [`ProcessGroup`], one GPU per rank (GPU
/// `LOCAL_RANK`), with its own CUDA stream. See the [module documentation](super).
///
/// `NcclGroup` is `Send + Sync`; collectives submitted from several threads are serialised, but
/// as with the TCP group every rank must submit the same collectives in the same order.
/// Dropping it waits (up to the deadline) for submitted collectives, then destroys the
/// communicator.
pub struct NcclGroup {
    inner: Arc<Communicator>,
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
        let OpenedDevice {
            ctx,
            stream,
            ordinal,
            nccl,
        } = opened
            .map_err(|message| CommError::config(CUDA_VAR, format!("rank {rank}: {message}")))?;

        // The n-th NCCL group made from this process group uses the n-th keys (every rank makes
        // them in the same order).
        let n = match pg.store() {
            Some(store) => store.add(&format!("ddp/nccl/groups/{rank}"), 1)?,
            None => 0,
        };
        let id = exchange_unique_id(pg, nccl, n)?;
        ctx.bind_to_thread().map_err(|e| {
            CommError::config(
                CUDA_VAR,
                format!("rank {rank}: cannot use GPU {ordinal}: {e:?}"),
            )
        })?;
        if let Some(store) = pg.store() {
            // Who arrived: the deadline's error names the ranks that did not.
            store.set(&arrived_key(n, rank), b"1")?;
        }
        let init = RealInit {
            nccl,
            world,
            rank,
            id,
        };
        let timeout = pg.config().timeout;
        let missing = || match pg.store() {
            Some(store) => missing_ranks(store, n, world),
            None => Vec::new(),
        };
        let comm = init_with_deadline(&init, timeout, INIT_POLL, &missing).map_err(|failure| {
            CommError::config(
                NCCL_VAR,
                format!("rank {rank} ({world} ranks, GPU {ordinal}): {failure}"),
            )
        })?;
        tracing::debug!("rank {rank}: NCCL communicator of {world} ranks on GPU {ordinal}");
        Ok(NcclGroup {
            inner: Arc::new(Communicator {
                rank,
                world_size: world,
                ordinal,
                timeout,
                nccl,
                ctx,
                stream,
                group: pg.health().cloned(),
                state: Mutex::new(CommState {
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

    /// Gives up on the group from this rank, with `reason` as the cause: aborts the
    /// communicator (every later collective here fails with `reason`) and fails the TCP process
    /// group naming this rank, so that the peers stop waiting for it at once. For a failure
    /// that no collective can carry any more. Returns the error this rank reports.
    pub fn abandon(&self, reason: &str) -> CommError {
        let inner = &self.inner;
        let mut state = inner.lock();
        let cause = CommError::config(NCCL_VAR, format!("rank {}: {reason}", inner.rank));
        inner.fail(&mut state, "abandoned", Seen::Local(cause))
    }

    /// The NCCL library in use.
    pub fn library(&self) -> &'static NcclLibrary {
        self.inner.nccl
    }

    /// Enqueues one collective: numbers it, refuses it when the group failed, runs `f` (which
    /// calls NCCL on the stream), waits for a non-blocking enqueue to finish, and records the
    /// event that [`NcclWork::wait`] waits for.
    fn launch<T>(
        &self,
        kind: &str,
        count: usize,
        dtype: DType,
        extra: &str,
        mut value: T,
        f: impl FnOnce(&mut T, &Arc<CudaStream>, RawComm, &NcclLibrary) -> Launched,
    ) -> NcclWork<T> {
        let inner = &self.inner;
        let mut state = inner.lock();
        let op = format!("nccl {kind} #{} ({count} {dtype}{extra})", state.seq);
        state.seq += 1;
        if let Some(e) = inner.refused(&state, &op) {
            return NcclWork::ready(op, Err(e));
        }
        if let Err(e) = inner.ctx.bind_to_thread() {
            let cause = CommError::config(
                CUDA_VAR,
                format!("rank {}: binding GPU {}: {e:?}", inner.rank, inner.ordinal),
            );
            let e = inner.fail(&mut state, &op, Seen::Local(cause));
            return NcclWork::ready(op, Err(e));
        }
        let comm = state.comm;
        let nccl = inner.nccl;
        let launched = match guard(|| f(&mut value, &inner.stream, comm, nccl)) {
            Ok(Ok(code)) => Ok(code),
            Ok(Err((code, name))) => Err(inner.nccl_failure(code, comm, name)),
            Err(panic) => Err(Seen::Local(CommError::config(NCCL_VAR, panic))),
        };
        match launched {
            Err(seen) => {
                let e = inner.fail(&mut state, &op, seen);
                return NcclWork::ready(op, Err(e));
            }
            Ok(NcclResult::IN_PROGRESS) => {
                if let Err(e) = inner.settle_enqueue(&mut state, &op) {
                    return NcclWork::ready(op, Err(e));
                }
            }
            Ok(_) => {}
        }
        match inner.stream.record_event(None) {
            Ok(event) => NcclWork::launched(inner.clone(), event, value, op),
            Err(e) => {
                let cause = CommError::config(
                    CUDA_VAR,
                    format!("rank {}: recording an event: {e:?}", inner.rank),
                );
                let e = inner.fail(&mut state, &op, Seen::Local(cause));
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
            |buf, stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                let (ptr, _record) = buf.device_ptr_mut(stream);
                // SAFETY: ptr holds count elements of T on this device; in place is allowed.
                let r =
                    unsafe { nccl.all_reduce(ptr, ptr, count, T::DTYPE, op, comm, raw(stream)) };
                ok(r).map_err(|code| (code, "ncclAllReduce"))
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
            |_, stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                // SAFETY: the caller's promises above.
                let r = unsafe { nccl.all_reduce(ptr, ptr, count, dtype, op, comm, raw(stream)) };
                ok(r).map_err(|code| (code, "ncclAllReduce"))
            },
        )
    }

    /// Queues a broadcast of `root`'s `count` elements of `dtype` at the raw device address
    /// `ptr`, in place; `keep` is handed back by [`NcclWork::wait`].
    ///
    /// # Safety
    ///
    /// As for [`NcclGroup::submit_all_reduce_ptr`].
    pub unsafe fn submit_broadcast_ptr<K>(
        &self,
        ptr: u64,
        count: usize,
        dtype: DType,
        root: usize,
        keep: K,
    ) -> NcclWork<K> {
        let world = self.inner.world_size;
        if root >= world {
            return self.invalid(
                "broadcast",
                format!("root {root} is not below the world size {world}"),
            );
        }
        let extra = format!(", root {root}");
        self.launch(
            "broadcast",
            count,
            dtype,
            &extra,
            keep,
            |_, stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                // SAFETY: the caller's promises above.
                let r = unsafe { nccl.broadcast(ptr, ptr, count, dtype, root, comm, raw(stream)) };
                ok(r).map_err(|code| (code, "ncclBroadcast"))
            },
        )
    }

    /// Queues an in-place all-reduce of `host`'s bytes, copied to a new device buffer and read
    /// as elements of `dtype` (its length must be a multiple of the element size). For a rank
    /// that must still take part in a collective whose own buffer it could not produce (the
    /// device sync path's stand-in for a failed bucket).
    pub fn submit_all_reduce_bytes(
        &self,
        host: &[u8],
        dtype: DType,
        op: ReduceOp,
    ) -> NcclWork<DeviceBytes> {
        self.submit_bytes(host, dtype, Err(op))
    }

    /// Queues an in-place broadcast from `root` of `host`'s bytes, copied to a new device buffer
    /// and read as elements of `dtype`; see [`NcclGroup::submit_all_reduce_bytes`].
    pub fn submit_broadcast_bytes(
        &self,
        host: &[u8],
        dtype: DType,
        root: usize,
    ) -> NcclWork<DeviceBytes> {
        self.submit_bytes(host, dtype, Ok(root))
    }

    /// [`NcclGroup::submit_all_reduce_bytes`] (`Err(op)`) or
    /// [`NcclGroup::submit_broadcast_bytes`] (`Ok(root)`).
    fn submit_bytes(
        &self,
        host: &[u8],
        dtype: DType,
        what: Result<usize, ReduceOp>,
    ) -> NcclWork<DeviceBytes> {
        let (kind, extra) = match what {
            Ok(root) => ("broadcast", format!(", root {root}")),
            Err(op) => ("all_reduce", format!(", {}", op.name())),
        };
        if !host.len().is_multiple_of(dtype.size()) {
            let message = format!("{} bytes are no whole number of {dtype}", host.len());
            return self.invalid(kind, message);
        }
        match what {
            Ok(root) if root >= self.inner.world_size => {
                let world = self.inner.world_size;
                let message = format!("root {root} is not below the world size {world}");
                return self.invalid(kind, message);
            }
            _ => {}
        }
        let buf = match self.to_device(host) {
            Ok(buf) => buf,
            Err(e) => return NcclWork::ready(format!("nccl {kind}"), Err(e)),
        };
        let count = host.len() / dtype.size();
        self.launch(
            kind,
            count,
            dtype,
            &extra,
            buf,
            |buf, stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                let (ptr, _record) = buf.device_ptr_mut(stream);
                // SAFETY: ptr holds count elements of dtype (its bytes); in place is allowed.
                let r = unsafe {
                    match what {
                        Ok(root) => nccl.broadcast(ptr, ptr, count, dtype, root, comm, raw(stream)),
                        Err(op) => nccl.all_reduce(ptr, ptr, count, dtype, op, comm, raw(stream)),
                    }
                };
                let name = if what.is_ok() {
                    "ncclBroadcast"
                } else {
                    "ncclAllReduce"
                };
                ok(r).map_err(|code| (code, name))
            },
        )
        .map(DeviceBytes)
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
            |buf, stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                let (ptr, _record) = buf.device_ptr_mut(stream);
                // SAFETY: ptr holds count elements of T on this device; in place is allowed.
                let r =
                    unsafe { nccl.broadcast(ptr, ptr, count, T::DTYPE, root, comm, raw(stream)) };
                ok(r).map_err(|code| (code, "ncclBroadcast"))
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
            |(buf, out), stream, comm, nccl| {
                if count == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                let (src, _read) = buf.device_ptr(stream);
                let (dst, _write) = out.device_ptr_mut(stream);
                // SAFETY: src holds count elements, dst world * count.
                let r = unsafe { nccl.all_gather(src, dst, count, T::DTYPE, comm, raw(stream)) };
                ok(r).map_err(|code| (code, "ncclAllGather"))
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
        let size = T::DTYPE.size() as u64;
        self.launch(
            "reduce_scatter",
            len,
            T::DTYPE,
            &extra,
            (buf, out),
            |(buf, out), stream, comm, nccl| {
                if len == 0 {
                    return Ok(NcclResult::SUCCESS);
                }
                let (src, _read) = buf.device_ptr(stream);
                let (dst, _write) = out.device_ptr_mut(stream);
                let s = raw(stream);
                if len.is_multiple_of(world) {
                    // SAFETY: src holds len elements, dst len / world.
                    let r = unsafe {
                        nccl.reduce_scatter(src, dst, len / world, T::DTYPE, op, comm, s)
                    };
                    return ok(r).map_err(|code| (code, "ncclReduceScatter"));
                }
                ok(nccl.group_start()).map_err(|code| (code, "ncclGroupStart"))?;
                let mut first_error = None;
                for r in 0..world {
                    let chunk = chunk_range(len, world, r);
                    if chunk.is_empty() {
                        continue;
                    }
                    let recv = if r == rank { dst } else { 0 };
                    // SAFETY: the chunk lies inside src; recv holds it on the root.
                    let result = unsafe {
                        nccl.reduce(
                            src + chunk.start as u64 * size,
                            recv,
                            chunk.len(),
                            T::DTYPE,
                            op,
                            r,
                            comm,
                            s,
                        )
                    };
                    if let Err(code) = ok(result) {
                        first_error.get_or_insert((code, "ncclReduce"));
                    }
                }
                // Closes the group opened above, whatever happened inside it.
                let end = ok(nccl.group_end()).map_err(|code| (code, "ncclGroupEnd"));
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

/// The raw handle of a cudarc stream, for NCCL.
fn raw(stream: &CudaStream) -> RawStream {
    stream.cu_stream() as RawStream
}

/// The store key rank `rank` sets just before it enters the creation of NCCL group `n`.
fn arrived_key(n: i64, rank: usize) -> String {
    format!("ddp/nccl/{n}/arrived/{rank}")
}

/// The ranks that have not announced (in `store`) that they entered the creation of NCCL
/// group `n` of `world` ranks. A rank whose key cannot be checked counts as arrived (the
/// error must not name a rank without evidence).
fn missing_ranks(store: &Store, n: i64, world: usize) -> Vec<usize> {
    (0..world)
        .filter(|&r| matches!(store.check(&[arrived_key(n, r).as_str()]), Ok(false)))
        .collect()
}

/// Rank 0 creates NCCL's unique id for NCCL group `n` and publishes it in `pg`'s store; the
/// others read it.
fn exchange_unique_id(
    pg: &ProcessGroup,
    nccl: &NcclLibrary,
    n: i64,
) -> Result<UniqueId, CommError> {
    let rank = pg.rank();
    let create = || -> Result<UniqueId, String> {
        nccl.unique_id()
            .map_err(|code| format!("ncclGetUniqueId failed: {}", nccl.error_text(code, None)))
    };
    let Some(store) = pg.store() else {
        // World size 1: nobody to share it with.
        return create().map_err(|m| CommError::config(NCCL_VAR, format!("rank {rank}: {m}")));
    };
    let key = format!("ddp/nccl/unique_id/{n}");
    if rank == 0 {
        match create() {
            Ok(id) => {
                store.set(&key, &id.internal)?;
                Ok(id)
            }
            Err(m) => {
                // Tell the others at once instead of letting them wait for the key (never 128
                // bytes, the length of an id).
                let mut text = format!("error: {m}");
                if text.len() == 128 {
                    text.push('.');
                }
                let _ = store.set(&key, text.as_bytes());
                Err(CommError::config(NCCL_VAR, format!("rank 0: {m}")))
            }
        }
    } else {
        let bytes = store.get(&key)?;
        let Ok(internal) = <[u8; 128]>::try_from(bytes.as_slice()) else {
            return Err(CommError::config(
                NCCL_VAR,
                format!(
                    "rank {rank}: rank 0 could not create the NCCL id: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            ));
        };
        Ok(UniqueId { internal })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::library::{device_count, driver_present};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// Two ranks of a real TCP group: only rank 0 announces that it entered the creation of
    /// NCCL group 3; the store names rank 1 as missing, and nobody once both have.
    #[test]
    fn the_store_names_the_ranks_that_did_not_arrive() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut listener = Some(listener);
        let timeout = Duration::from_secs(20);
        std::thread::scope(|s| {
            for rank in 0..2 {
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
                s.spawn(move || {
                    let pg = b.build().unwrap();
                    let store = pg.store().unwrap();
                    if rank == 0 {
                        store.set(&arrived_key(3, 0), b"1").unwrap();
                        assert_eq!(missing_ranks(store, 3, 2), [1]);
                        assert_eq!(missing_ranks(store, 4, 2), [0, 1]);
                    }
                    pg.barrier().unwrap();
                    if rank == 1 {
                        store.set(&arrived_key(3, 1), b"1").unwrap();
                    }
                    pg.barrier().unwrap();
                    assert_eq!(missing_ranks(store, 3, 2), Vec::<usize>::new());
                    pg.barrier().unwrap();
                });
            }
        });
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
}
