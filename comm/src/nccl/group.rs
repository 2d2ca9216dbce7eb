//! [`NcclGroup`]: the NCCL communicator of a process group's ranks, made through the TCP group
//! (every rank opens its GPU, the ranks agree through an all-gather that all could, rank 0's
//! NCCL unique id travels through the store), and its collectives, each enqueued on the group's
//! own CUDA stream.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::sys as nc;

use super::device::open_device;
use super::library::{check, guard, nccl_dtype, nccl_error_text, nccl_op, CUDA_VAR, NCCL_VAR};
use super::work::{CommState, Communicator, NcclWork};
use crate::algorithms::chunk_range;
use crate::element::{DType, Element, ReduceOp};
use crate::error::CommError;
use crate::group::ProcessGroup;

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
            inner: Arc::new(Communicator {
                rank,
                world_size: world,
                ordinal,
                timeout: pg.config().timeout,
                ctx,
                stream,
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
            Ok(event) => NcclWork::launched(inner.clone(), event, value, op),
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
    use crate::nccl::library::{device_count, driver_present};
    use std::panic::{catch_unwind, AssertUnwindSafe};

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
