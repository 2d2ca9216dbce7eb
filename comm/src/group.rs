//! [`ProcessGroup`]: joining a group (rendezvous), the communication thread that runs the
//! collectives in submission order, and [`Work`] handles.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::algorithms::{self, Ctx};
use crate::config::{GroupBuilder, GroupConfig};
use crate::connect::{connect_mesh, Identity};
use crate::element::{DType, Element, ReduceOp};
use crate::error::CommError;
use crate::flight::{CollectiveRecord, FlightRecorder};
use crate::shm::ShmGroup;
use crate::store::{Store, StoreServer};
use crate::transport::{remaining, Mesh, Shared, STALL_MARGIN};
use crate::wire::{self, OpDesc, OpKind};

const JOB_ID_KEY: &str = "ddp/job_id";
const TUNING_KEY: &str = "ddp/tuning";

/// A group of processes that run collectives together (like `torch.distributed`'s default
/// process group).
///
/// Every rank must submit the same collectives in the same order; the group's single
/// communication thread runs them first in, first out. Submit from one thread (or otherwise keep
/// the order the same on every rank): a difference is detected and fails the group, naming both
/// collectives.
///
/// `ProcessGroup` is `Send + Sync`. Dropping it finishes the queued collectives, says goodbye to
/// the peers and joins its threads.
pub struct ProcessGroup {
    config: GroupConfig,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    store: Option<Store>,
    _server: Option<StoreServer>,
    /// The mesh's shared state (failure, progress), for [`Work`] handles.
    shared: Option<Arc<Shared>>,
    /// The last collectives (`None` at world size 1).
    flight: Option<Arc<FlightRecorder>>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.config.rank)
            .field("world_size", &self.config.world_size)
            .finish()
    }
}

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// The state of the communication thread.
struct Engine {
    mesh: Mesh,
    seq: u64,
    segment_bytes: usize,
    small_bytes: usize,
    flight: Arc<FlightRecorder>,
    /// The flight-recorder index of the job being run (set by the job, taken by `run`).
    record: Option<u64>,
    /// Shared memory between the ranks of this host, when some share it (alone when every rank
    /// does; with TCP between hosts otherwise).
    shm: Option<ShmGroup>,
    /// Every rank of the group, `0..world`: the members of a collective over all of them.
    members: Vec<usize>,
}

impl Engine {
    /// The start-up barrier (not numbered; its frames carry [`OpKind::Join`]).
    fn join(&mut self) -> Result<(), CommError> {
        let seq = self.seq;
        let result = self.run(OpKind::Join, DType::U8, 0, 0, algorithms::barrier);
        self.seq = seq;
        result
    }

    /// Runs one collective: numbers it, refuses it if the group already failed, and turns any
    /// error (or panic) into a failure of the whole group.
    fn run<R>(
        &mut self,
        op: OpKind,
        dtype: DType,
        count: usize,
        arg: u32,
        f: impl FnOnce(&Ctx) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let desc = OpDesc {
            op,
            seq: self.seq,
            dtype,
            count: count as u64,
            arg,
        };
        self.seq += 1;
        let record = self.record.take();
        if let Some(i) = record {
            self.flight.start(i, desc.seq);
        }
        let result = self.run_desc(desc, f);
        if let Some(i) = record {
            self.flight
                .finish(i, result.as_ref().err().map(|e| e.to_string()));
        }
        if result.is_err() {
            self.flight.dump("failure");
        }
        result
    }

    /// [`Engine::run`] once the collective is numbered.
    fn run_desc<R>(
        &mut self,
        desc: OpDesc,
        f: impl FnOnce(&Ctx) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let rank = self.mesh.rank;
        if let Some(cause) = self.mesh.shared().error() {
            return Err(CommError::GroupFailed {
                rank,
                op: desc.to_string(),
                cause: Box::new(cause),
            });
        }
        let cx = Ctx {
            mesh: &self.mesh,
            desc,
            segment_bytes: self.segment_bytes,
            small_bytes: self.small_bytes,
            shm: self.shm.as_ref(),
            members: &self.members,
            me: rank,
        };
        let result = match catch_unwind(AssertUnwindSafe(|| f(&cx))) {
            Ok(r) => r,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                Err(CommError::Internal {
                    rank,
                    message: format!("panic in {desc}: {what}"),
                })
            }
        };
        result.map_err(|cause| {
            // The first failure of the group is its root cause (a lost link may have been
            // explained by a peer's ABORT naming an earlier one); report that, and make sure the
            // peers have been told before the caller (who may exit at once) sees the error.
            let shared = self.mesh.shared();
            shared.fail(cause.clone());
            let root = shared.error().unwrap_or(cause);
            self.mesh.flush_aborts();
            CommError::Collective {
                rank,
                op: desc.to_string(),
                cause: Box::new(root),
            }
        })
    }
}

/// The handle of a submitted collective; [`Work::wait`] gives back the result.
///
/// Dropping a `Work` without waiting is fine: the collective still runs.
pub struct Work<T> {
    rx: Receiver<Result<T, CommError>>,
    rank: usize,
    /// What was submitted, e.g. `all_reduce of 4096 f32`, for a timeout's message.
    what: String,
    /// The group's progress counter and deadline (`None` for a result known at submission).
    progress: Option<(Arc<Shared>, Duration)>,
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
    fn ready(rank: usize, result: Result<T, CommError>) -> Work<T> {
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
        let Some((shared, timeout)) = self.progress.clone() else {
            return self.finish(self.rx.recv().ok());
        };
        let stall_limit = timeout + STALL_MARGIN;
        let start = Instant::now();
        let mut seen = shared.progress.load(Ordering::Relaxed);
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
            let now = shared.progress.load(Ordering::Relaxed);
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

fn new_job_id() -> [u8; 16] {
    // RandomState is seeded from the operating system's randomness; mix in time and pid so that
    // two ids never collide even if that seeding were weak.
    let mut id = [0u8; 16];
    for (i, half) in id.chunks_mut(8).enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u32(std::process::id());
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    id
}

impl ProcessGroup {
    /// Joins the group described by the environment (see [`GroupConfig::from_env`]). With no
    /// variables set this is a group of one process that needs no sockets.
    pub fn from_env() -> Result<ProcessGroup, CommError> {
        ProcessGroup::init(GroupConfig::from_env()?, None)
    }

    /// A builder for explicit values; anything not given comes from the environment.
    pub fn builder() -> GroupBuilder {
        GroupBuilder::default()
    }

    /// Joins the group described by `config`.
    pub fn with_config(config: GroupConfig) -> Result<ProcessGroup, CommError> {
        ProcessGroup::init(config, None)
    }

    pub(crate) fn init(
        config: GroupConfig,
        listener: Option<TcpListener>,
    ) -> Result<ProcessGroup, CommError> {
        if config.rank >= config.world_size {
            return Err(CommError::config(
                "rank",
                format!(
                    "rank {} must be less than the world size {}",
                    config.rank, config.world_size
                ),
            ));
        }
        if config.world_size == 1 {
            return Ok(ProcessGroup {
                config,
                jobs: None,
                thread: None,
                store: None,
                _server: None,
                shared: None,
                flight: None,
            });
        }
        if config.master_port == 0 && listener.is_none() {
            return Err(CommError::config(
                "MASTER_PORT",
                "port 0 cannot be reached by the other ranks",
            ));
        }
        let rank = config.rank;
        let deadline = Instant::now() + config.connect_timeout;

        // 1. Rank 0 hosts the store; every rank (rank 0 too) connects to it. With a launcher's job
        // name, the store handshake carries its hash, so processes of other jobs are refused.
        // Under torchrun's agent store nobody hosts one: every rank connects to the agent's
        // PyTorch TCPStore, which has no handshake of ours, so the job id is agreed through the
        // store alone (step 2) and first checked by the peers' handshakes (step 3).
        let named_job = config.job_id.as_deref().map(wire::job_id_from_name);
        let server = if rank == 0 && config.torch_agent_store.is_none() {
            Some(StoreServer::start(
                listener,
                &config.master_addr,
                config.master_port,
                config.world_size,
                config.token.clone(),
                named_job.unwrap_or([0; 16]),
            )?)
        } else {
            None
        };
        let mut me = Identity {
            rank,
            world: config.world_size,
            job_id: named_job.unwrap_or([0; 16]),
            token: config.token.clone(),
        };
        let store = match config.torch_agent_store {
            None => Store::connect(
                &me,
                &config.master_addr,
                config.master_port,
                deadline,
                config.timeout,
            )?,
            Some(restart) => Store::connect_torch(
                rank,
                &config.master_addr,
                config.master_port,
                crate::torch_store::agent_key_prefix(restart),
                deadline,
                config.timeout,
            )?,
        };

        // 2. Rank 0 publishes the job id and the tuning; the others adopt them.
        let (segment_bytes, small_bytes) = if rank == 0 {
            me.job_id = named_job.unwrap_or_else(new_job_id);
            store.set(
                TUNING_KEY,
                format!("{} {}", config.segment_bytes, config.small_allreduce_bytes).as_bytes(),
            )?;
            store.set(JOB_ID_KEY, wire::job_id_hex(&me.job_id).as_bytes())?;
            (config.segment_bytes, config.small_allreduce_bytes)
        } else {
            let raw = store.get_timeout(JOB_ID_KEY, remaining(deadline))?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            me.job_id = wire::parse_job_id(&text).ok_or_else(|| CommError::Store {
                rank,
                addr: store.address().to_string(),
                message: format!("invalid job id {text:?} in the store"),
            })?;
            let raw = store.get_timeout(TUNING_KEY, remaining(deadline))?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            let mut parts = text.split_whitespace().map(|p| p.parse::<usize>());
            match (parts.next(), parts.next()) {
                (Some(Ok(seg)), Some(Ok(small)))
                    if seg > 0 && seg <= crate::config::MAX_SEGMENT_BYTES =>
                {
                    if (seg, small) != (config.segment_bytes, config.small_allreduce_bytes) {
                        tracing::debug!(
                            "rank {rank}: using rank 0's segment size {seg} and small-buffer threshold {small}"
                        );
                    }
                    (seg, small)
                }
                _ => {
                    return Err(CommError::Store {
                        rank,
                        addr: store.address().to_string(),
                        message: format!("invalid tuning {text:?} in the store"),
                    })
                }
            }
        };
        let joined = store.add(&format!("ddp/joined/{rank}"), 1)?;
        if joined != 1 {
            return Err(CommError::config(
                "RANK",
                format!(
                    "two processes claim rank {rank} in the job at {}",
                    store.address()
                ),
            ));
        }

        // 3. The full mesh of peer connections, then its threads.
        let local_ip = store.local_addr().ip();
        let streams = connect_mesh(&me, &store, local_ip, &config.master_addr, deadline)?;
        let max_frame = segment_bytes.max(8);
        let flight = FlightRecorder::new(rank, config.world_size, config.trace_dir.clone());
        let mesh = Mesh::start(
            rank,
            streams,
            config.timeout,
            config.peer_timeout,
            max_frame,
            flight.clone(),
        )?;
        tracing::debug!(
            "rank {rank}: joined a group of {} (job {})",
            config.world_size,
            wire::job_id_hex(&me.job_id)
        );

        // 4. Shared memory between the ranks that share a host (all of them: it carries every
        // collective; some: hierarchical, with TCP between hosts; none: TCP alone). Every rank
        // reaches the same verdict through the store.
        let shm = ShmGroup::setup(
            &store,
            rank,
            config.world_size,
            &me.job_id,
            config.transport,
            config.host_id.as_deref(),
            config.timeout,
            deadline,
        )?;

        // 5. A barrier over the mesh: nobody returns before everyone is connected, so rank 0 may
        // drop the group (and the store) at once without stranding a rank still starting up.
        let mut engine = Engine {
            mesh,
            seq: 0,
            segment_bytes,
            small_bytes,
            flight: flight.clone(),
            record: None,
            shm,
            members: (0..config.world_size).collect(),
        };
        engine.join()?;

        // 6. The communication thread.
        let shared = engine.mesh.shared().clone();
        let (jobs, rx) = crossbeam_channel::unbounded::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("ddp-comm-{rank}"))
            .spawn(move || {
                for job in rx.iter() {
                    job(&mut engine);
                }
                // Dropping the engine closes the mesh (GOODBYE to every peer).
            })
            .map_err(|e| CommError::Internal {
                rank,
                message: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(ProcessGroup {
            config,
            jobs: Some(jobs),
            thread: Some(thread),
            store: Some(store),
            _server: server,
            shared: Some(shared),
            flight: Some(flight),
        })
    }

    /// The group's flight recorder: its last [`crate::FLIGHT_RECORDS`] collectives, oldest
    /// first, with their sequence numbers, states and wall-clock times (empty at world size 1,
    /// where nothing is communicated). Also written to `DDP_TRACE_DIR` on a failure, a
    /// timeout or SIGUSR1 (see [`crate::flight`]).
    pub fn flight_records(&self) -> Vec<CollectiveRecord> {
        self.flight
            .as_ref()
            .map(|f| f.records())
            .unwrap_or_default()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.config.rank
    }

    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.config.world_size
    }

    /// Rank among the processes on this node.
    pub fn local_rank(&self) -> usize {
        self.config.local_rank
    }

    /// Number of processes on this node.
    pub fn local_world_size(&self) -> usize {
        self.config.local_world_size
    }

    /// The configuration the group was built from.
    pub fn config(&self) -> &GroupConfig {
        &self.config
    }

    /// The rendezvous store client (`None` at world size 1).
    pub fn store(&self) -> Option<&Store> {
        self.store.as_ref()
    }

    /// Queues `f` for the communication thread; `what` describes it for a wait's timeout.
    /// `op`, `dtype` and `count` go to the flight recorder.
    fn submit<R: Send + 'static>(
        &self,
        what: String,
        (op, dtype, count): (OpKind, DType, usize),
        f: impl FnOnce(&mut Engine) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let rank = self.rank();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let record = self
            .flight
            .as_ref()
            .map(|fl| fl.queue(op.name(), dtype.name(), count));
        let job: Job = Box::new(move |engine| {
            engine.record = record;
            let _ = tx.send(f(engine));
            engine
                .mesh
                .shared()
                .progress
                .fetch_add(1, Ordering::Relaxed);
        });
        match (&self.jobs, &self.shared) {
            (Some(jobs), Some(shared)) if jobs.send(job).is_ok() => Work {
                rx,
                rank,
                what,
                progress: Some((shared.clone(), self.config.timeout)),
                flight: self.flight.clone(),
            },
            _ => Work::ready(rank, Err(CommError::ShutDown { rank })),
        }
    }

    /// Queues an all-reduce of `buf` with `op`; the result has the same length on every rank.
    pub fn submit_all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("all_reduce of {} {}", buf.len(), T::DTYPE);
        let rec = (OpKind::AllReduce, T::DTYPE, buf.len());
        self.submit(what, rec, move |e| {
            e.run(OpKind::AllReduce, T::DTYPE, buf.len(), op.to_wire(), |cx| {
                algorithms::all_reduce(cx, &mut buf, op)
            })?;
            Ok(buf)
        })
    }

    /// Queues a broadcast of `root`'s `buf` to every rank (every rank passes a buffer of the
    /// same length; the non-roots' contents are overwritten).
    pub fn submit_broadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        let world = self.world_size();
        let what = format!("broadcast of {} {} from rank {root}", buf.len(), T::DTYPE);
        // A bad argument is this caller's mistake, not the group's: refused here, before it is
        // numbered or sent, and the group stays usable.
        if root >= world {
            return Work::ready(
                self.rank(),
                Err(CommError::InvalidArgument {
                    rank: self.rank(),
                    op: what,
                    message: format!("root {root} is not below the world size {world}"),
                }),
            );
        }
        if world == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let rec = (OpKind::Broadcast, T::DTYPE, buf.len());
        self.submit(what, rec, move |e| {
            e.run(OpKind::Broadcast, T::DTYPE, buf.len(), root as u32, |cx| {
                algorithms::broadcast(cx, &mut buf, root)
            })?;
            Ok(buf)
        })
    }

    /// Queues an all-gather: every rank passes a buffer of the same length; the result is all of
    /// them concatenated in rank order.
    pub fn submit_all_gather<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("all_gather of {} {}", buf.len(), T::DTYPE);
        let rec = (OpKind::AllGather, T::DTYPE, buf.len());
        self.submit(what, rec, move |e| {
            e.run(OpKind::AllGather, T::DTYPE, buf.len(), 0, |cx| {
                algorithms::all_gather(cx, &buf)
            })
        })
    }

    /// Queues a reduce-scatter: `buf` (same length on every rank) is reduced with `op` and this
    /// rank gets chunk `chunk_range(len, world_size, rank)` of the result.
    pub fn submit_reduce_scatter<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("reduce_scatter of {} {}", buf.len(), T::DTYPE);
        let rec = (OpKind::ReduceScatter, T::DTYPE, buf.len());
        self.submit(what, rec, move |e| {
            e.run(
                OpKind::ReduceScatter,
                T::DTYPE,
                buf.len(),
                op.to_wire(),
                |cx| algorithms::reduce_scatter(cx, &mut buf, op),
            )
        })
    }

    /// Queues a barrier: completes once every rank has reached it.
    pub fn submit_barrier(&self) -> Work<()> {
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(()));
        }
        let rec = (OpKind::Barrier, DType::U8, 0);
        self.submit("barrier".into(), rec, move |e| {
            e.run(OpKind::Barrier, DType::U8, 0, 0, algorithms::barrier)
        })
    }

    /// All-reduce, blocking: `submit_all_reduce(buf, op).wait()`.
    pub fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<Vec<T>, CommError> {
        self.submit_all_reduce(buf, op).wait()
    }

    /// Broadcast, blocking: `submit_broadcast(buf, root).wait()`.
    pub fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Result<Vec<T>, CommError> {
        self.submit_broadcast(buf, root).wait()
    }

    /// All-gather, blocking: `submit_all_gather(buf).wait()`.
    pub fn all_gather<T: Element>(&self, buf: Vec<T>) -> Result<Vec<T>, CommError> {
        self.submit_all_gather(buf).wait()
    }

    /// Reduce-scatter, blocking: `submit_reduce_scatter(buf, op).wait()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Result<Vec<T>, CommError> {
        self.submit_reduce_scatter(buf, op).wait()
    }

    /// Barrier, blocking: `submit_barrier().wait()`.
    pub fn barrier(&self) -> Result<(), CommError> {
        self.submit_barrier().wait()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Closing the queue lets the communication thread finish what was submitted, then close
        // the mesh cleanly.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
