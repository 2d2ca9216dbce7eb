//! [`ProcessGroup`]: a group of ranks that run collectives together, its communication thread
//! that runs them in submission order, and the submit and blocking forms of every collective.
//! Joining is `join.rs`; the handles are `work.rs`; the choice of transport per collective is
//! `collectives/dispatch.rs`.

use std::net::TcpListener;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;

use crate::collectives::algorithms::Ctx;
use crate::collectives::dispatch::{self, Transports};
use crate::collectives::element::{DType, Element, ReduceOp};
use crate::config::{GroupConfig, DEFAULT_LOSS_GRACE};
use crate::error::CommError;
use crate::flight::{CollectiveRecord, FlightRecorder};
use crate::join::join;
use crate::launcher::contract::inherited_store_listener;
use crate::launcher::env::process_env;
use crate::rendezvous::store::Store;
use crate::rendezvous::store_server::StoreServer;
use crate::transport::health::GroupHealth;
use crate::transport::liveness::StartupWatch;
use crate::transport::mesh::Mesh;
use crate::transport::shm::ShmGroup;
use crate::wire::{OpDesc, OpKind};
use crate::work::Work;

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
    /// See [`ProcessGroup::loss_grace`].
    loss_grace: Duration,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    store: Option<Store>,
    _server: Option<StoreServer>,
    /// The mesh's health (failure, progress), for [`Work`] handles.
    health: Option<Arc<GroupHealth>>,
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

/// A collective queued for the communication thread.
type Job = Box<dyn FnOnce(&mut CollectiveRunner) + Send>;

/// The communication thread's state: it numbers the group's collectives and runs them, one at a
/// time, over the group's transports.
struct CollectiveRunner {
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

impl CollectiveRunner {
    /// The start-up barrier (not numbered; its frames carry [`OpKind::Join`]).
    fn join(&mut self) -> Result<(), CommError> {
        let seq = self.seq;
        let result = self.run(OpKind::Join, DType::U8, 0, 0, dispatch::barrier);
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
        f: impl FnOnce(&Transports) -> Result<R, CommError>,
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

    /// [`CollectiveRunner::run`] once the collective is numbered.
    fn run_desc<R>(
        &mut self,
        desc: OpDesc,
        f: impl FnOnce(&Transports) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let rank = self.mesh.rank;
        if let Some(cause) = self.mesh.health().error() {
            return Err(CommError::GroupFailed {
                rank,
                op: desc.to_string(),
                cause: Box::new(cause),
            });
        }
        let transports = Transports {
            tcp: Ctx {
                mesh: &self.mesh,
                desc,
                segment_bytes: self.segment_bytes,
                small_bytes: self.small_bytes,
                members: &self.members,
                me: rank,
            },
            shm: self.shm.as_ref(),
        };
        let result = match catch_unwind(AssertUnwindSafe(|| f(&transports))) {
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
            let health = self.mesh.health();
            health.fail(cause.clone());
            let root = health.error().unwrap_or(cause);
            self.mesh.flush_aborts();
            CommError::Collective {
                rank,
                op: desc.to_string(),
                cause: Box::new(root),
            }
        })
    }
}

impl ProcessGroup {
    /// Joins the group described by the environment (see [`GroupConfig::from_env`]). With no
    /// variables set this is a group of one process that needs no sockets. Rank 0 hosts the
    /// store on the listening socket its launcher handed it, if any
    /// ([`crate::launcher::contract::STORE_FD_ENV`]).
    pub fn from_env() -> Result<ProcessGroup, CommError> {
        let config = GroupConfig::from_env()?;
        tracing::info!(
            "rank {} of {} (local rank {} of {}), found through {}'s variables; rank 0 at {}:{}",
            config.rank,
            config.world_size,
            config.local_rank,
            config.local_world_size,
            config.launcher,
            config.master_addr,
            config.master_port
        );
        let listener = inherited_store_listener(&config, &process_env)?;
        ProcessGroup::init(config, listener, DEFAULT_LOSS_GRACE, None)
    }

    /// Joins the group described by `config`.
    pub fn with_config(config: GroupConfig) -> Result<ProcessGroup, CommError> {
        ProcessGroup::init(config, None, DEFAULT_LOSS_GRACE, None)
    }

    /// Joins the group described by `config` (`join.rs`), then runs the start-up barrier and
    /// starts the communication thread; rank 0 hosts the store on `listener` when given. A
    /// lost connection waits `loss_grace` for an ABORT that explains it (`health.rs`); until
    /// the barrier passed, `startup` vouches for peers silent on their links (`liveness.rs`).
    pub(crate) fn init(
        config: GroupConfig,
        listener: Option<TcpListener>,
        loss_grace: Duration,
        startup: Option<Arc<StartupWatch>>,
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
                loss_grace,
                jobs: None,
                thread: None,
                store: None,
                _server: None,
                health: None,
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
        let joined = join(&config, listener, loss_grace, startup.clone())?;

        // A barrier over the mesh: nobody returns before everyone is connected, so rank 0 may
        // drop the group (and the store) at once without stranding a rank still starting up.
        let mut runner = CollectiveRunner {
            mesh: joined.mesh,
            seq: 0,
            segment_bytes: joined.segment_bytes,
            small_bytes: joined.small_bytes,
            flight: joined.flight.clone(),
            record: None,
            shm: joined.shm,
            members: (0..config.world_size).collect(),
        };
        runner.join()?;
        if let Some(startup) = &startup {
            startup.started();
        }

        // The communication thread.
        let health = runner.mesh.health().clone();
        let (jobs, rx) = crossbeam_channel::unbounded::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("ddp-comm-{rank}"))
            .spawn(move || {
                for job in rx.iter() {
                    job(&mut runner);
                }
                // Dropping the runner closes the mesh (GOODBYE to every peer).
            })
            .map_err(|e| CommError::Internal {
                rank,
                message: format!("cannot start the communication thread: {e}"),
            })?;
        Ok(ProcessGroup {
            config,
            loss_grace,
            jobs: Some(jobs),
            thread: Some(thread),
            store: Some(joined.store),
            _server: joined.server,
            health: Some(health),
            flight: Some(joined.flight),
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

    /// How long a lost connection (a peer's socket closed or reset, or a peer silent for the
    /// peer timeout) waits for an ABORT frame that explains it before the group fails with that
    /// connection as its root cause: 400 ms, for attribution (a rank that fails because of
    /// another's death may close its connections before this rank has read the dead one's,
    /// and the ABORT it sent first names the real cause). An elastic job's groups wait none:
    /// there every survivor reports to the store, and a rank named by mistake is kept because
    /// it reports ([`crate::ElasticGroup`]).
    pub fn loss_grace(&self) -> Duration {
        self.loss_grace
    }

    /// The group's root cause if it has already failed (a peer died, closed its connections or
    /// fell silent; a collective failed), `None` while it is healthy and at world size 1. A
    /// cheap check (an atomic load) that lets a training loop skip work whose collective would
    /// fail anyway: the elastic wrapper skips the backward pass of a step begun after a death.
    pub fn failure(&self) -> Option<CommError> {
        let health = self.health.as_ref()?;
        if health.is_failed() {
            health.error()
        } else {
            None
        }
    }

    /// The ranks whose connections to this one were lost (closed, reset, or silent past the
    /// peer timeout), in the order seen, before or after the group failed; empty while
    /// healthy and at world size 1. The group fails at the first; when several ranks die
    /// together (a node) the others follow, and an elastic job reports them all.
    pub fn lost_peers(&self) -> Vec<usize> {
        self.health
            .as_ref()
            .map_or_else(Vec::new, |h| h.lost_peers())
    }

    /// The group's failure state (`None` at world size 1), for the NCCL layer: it reports its
    /// own failures through it and watches it for its peers' (`nccl/work.rs`).
    #[cfg(feature = "nccl")]
    pub(crate) fn health(&self) -> Option<&Arc<GroupHealth>> {
        self.health.as_ref()
    }

    /// Queues `f` for the communication thread; `what` describes it for a wait's timeout.
    /// `op`, `dtype` and `count` go to the flight recorder.
    fn submit<R: Send + 'static>(
        &self,
        what: String,
        (op, dtype, count): (OpKind, DType, usize),
        f: impl FnOnce(&mut CollectiveRunner) -> Result<R, CommError> + Send + 'static,
    ) -> Work<R> {
        let rank = self.rank();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let record = self
            .flight
            .as_ref()
            .map(|fl| fl.queue(op.name(), dtype.name(), count));
        let job: Job = Box::new(move |runner| {
            runner.record = record;
            let _ = tx.send(f(runner));
            runner
                .mesh
                .health()
                .progress
                .fetch_add(1, Ordering::Relaxed);
        });
        match (&self.jobs, &self.health) {
            (Some(jobs), Some(health)) if jobs.send(job).is_ok() => Work::pending(
                rank,
                what,
                rx,
                health.clone(),
                self.config.timeout,
                self.flight.clone(),
            ),
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
            e.run(OpKind::AllReduce, T::DTYPE, buf.len(), op.to_wire(), |t| {
                dispatch::all_reduce(t, &mut buf, op)
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
            e.run(OpKind::Broadcast, T::DTYPE, buf.len(), root as u32, |t| {
                dispatch::broadcast(t, &mut buf, root)
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
            e.run(OpKind::AllGather, T::DTYPE, buf.len(), 0, |t| {
                dispatch::all_gather(t, &buf)
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
                |t| dispatch::reduce_scatter(t, &mut buf, op),
            )
        })
    }

    /// Queues an all-reduce of the caller's own buffer: `buf`, of any type that lends its
    /// elements as a slice (a `Vec<T>`, or a buffer that came from elsewhere, such as a burn
    /// tensor's memory), is reduced in place and comes back as it went, so a buffer of another
    /// library travels without a copy. Otherwise [`submit_all_reduce`](Self::submit_all_reduce).
    pub fn submit_all_reduce_in_place<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let len = buf.as_mut().len();
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("all_reduce of {len} {}", T::DTYPE);
        let rec = (OpKind::AllReduce, T::DTYPE, len);
        self.submit(what, rec, move |e| {
            e.run(OpKind::AllReduce, T::DTYPE, len, op.to_wire(), |t| {
                dispatch::all_reduce(t, buf.as_mut(), op)
            })?;
            Ok(buf)
        })
    }

    /// Queues a broadcast of `root`'s buffer into every rank's own `buf` (of any type that
    /// lends its elements as a slice, as [`submit_all_reduce_in_place`](Self::submit_all_reduce_in_place)).
    pub fn submit_broadcast_in_place<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        root: usize,
    ) -> Work<B> {
        let (world, len) = (self.world_size(), buf.as_mut().len());
        let what = format!("broadcast of {len} {} from rank {root}", T::DTYPE);
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
        let rec = (OpKind::Broadcast, T::DTYPE, len);
        self.submit(what, rec, move |e| {
            e.run(OpKind::Broadcast, T::DTYPE, len, root as u32, |t| {
                dispatch::broadcast(t, buf.as_mut(), root)
            })?;
            Ok(buf)
        })
    }

    /// Queues a reduce-scatter that keeps its result in the caller's `buf` (of any type that
    /// lends its elements as a slice): `buf` (same length on every rank) is reduced with `op`
    /// into this rank's chunk `chunk_range(len, world_size, rank)` of it, and comes back whole
    /// (the other chunks' contents unspecified). The same collective as
    /// [`submit_reduce_scatter`](Self::submit_reduce_scatter), without the copy of the chunk:
    /// for a caller that keeps the buffer, such as ZeRO's gradients.
    pub fn submit_reduce_scatter_in_place<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let len = buf.as_mut().len();
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("reduce_scatter of {len} {}", T::DTYPE);
        let rec = (OpKind::ReduceScatter, T::DTYPE, len);
        self.submit(what, rec, move |e| {
            e.run(OpKind::ReduceScatter, T::DTYPE, len, op.to_wire(), |t| {
                dispatch::reduce_scatter_in_place(t, buf.as_mut(), op)
            })?;
            Ok(buf)
        })
    }

    /// Queues the in-place all-gather of the reduce-scatter's chunks: every rank passes a
    /// buffer (of any type that lends its elements as a slice) of the same length holding its
    /// own chunk `chunk_range(len, world_size, rank)` (chunks differ by at most one element),
    /// and gets it back with every rank's chunk in its place (the second half of a ring
    /// all-reduce; the buffer is the result, no other is allocated).
    pub fn submit_all_gather_in_place<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
    ) -> Work<B> {
        let len = buf.as_mut().len();
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(buf));
        }
        let what = format!("all_gather in place of {len} {}", T::DTYPE);
        let rec = (OpKind::AllGather, T::DTYPE, len);
        // `arg` 1 tells it from the all-gather of equal blocks (arg 0) in the fingerprint.
        self.submit(what, rec, move |e| {
            e.run(OpKind::AllGather, T::DTYPE, len, 1, |t| {
                dispatch::all_gather_chunks(t, buf.as_mut())
            })?;
            Ok(buf)
        })
    }

    /// Queues a barrier: completes once every rank has reached it.
    pub fn submit_barrier(&self) -> Work<()> {
        if self.world_size() == 1 {
            return Work::ready(self.rank(), Ok(()));
        }
        let rec = (OpKind::Barrier, DType::U8, 0);
        self.submit("barrier".into(), rec, move |e| {
            e.run(OpKind::Barrier, DType::U8, 0, 0, dispatch::barrier)
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
