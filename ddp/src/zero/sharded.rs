//! [`ShardedDataParallel`]: data parallelism with the optimizer state (ZeRO stage 1), and also
//! the averaged gradients (stage 2), split across ranks, as DeepSpeed's ZeRO and PyTorch's
//! `ZeroRedundancyOptimizer` do (Rajbhandari et al., SC 2020).
//!
//! # The shard layout
//!
//! The gradients travel in DDP's buckets, through DDP's gradient pipeline (`pipeline.rs`),
//! with a reduce-scatter in place of the all-reduce: rank r owns chunk `chunk_range(len, N,
//! r)` of every part of every bucket (`zero/layout.rs`), the balanced split of the
//! reduce-scatter. The layout depends only on the parameter list, the bucket sizes and the
//! world size, so it is the same on every rank and in every run. Saved states do not depend on
//! it: the consolidated state is laid out as the trainable parameters in visiting order.
//!
//! # A step
//!
//! 1. Every rank hands its gradients to the pipeline, which reduce-scatters each bucket's parts
//!    as soon as the bucket is complete: with [`prepare`](ShardedDataParallel::prepare) and
//!    [`backward_step`](ShardedDataParallel::backward_step), during backward, each gradient
//!    taken from burn as its hook fires and released once its part has left, so burn's full
//!    gradient never exists all at once (PyTorch's "set grads to None after the reduce",
//!    DeepSpeed's gradient partitioning in its backward hooks). A large gradient is reduced in
//!    its own memory, and what is kept of it is this rank's chunk, where the reduce-scatter
//!    left it (the rest of its pages go back to the system at once). The sums are the process
//!    group's, in its fixed reduction order: over shared memory (and for small buffers over
//!    TCP) every element is summed in rank order, as in the DDP all-reduce, so the averaged
//!    gradient is bit-identical to DDP's; a large TCP ring starts each chunk's sum at another
//!    rank than the all-reduce's ring does, which at 3 or more ranks can change the last bit (at
//!    2 ranks a sum of two is the same either way).
//! 2. The pipeline's last collective, a small all-reduce, carries each parameter's presence and
//!    the failure slots: a parameter that got no gradient on any rank is skipped as burn's
//!    optimizer skips it (its state and step count stay), and a rank that fails locally (an
//!    unreadable gradient, replaced parameters) makes every rank return an error that names
//!    it, before any parameter changes.
//! 3. The trainable parameters' memory is taken out of the module (without a copy where the
//!    module holds it alone), each rank steps its chunks in it with [`ShardOptimizer`], element
//!    for element burn's own Adam or SGD, and each part's all-gather writes every rank's updated
//!    chunk into it, in place; the memory goes back into the module. Updating part k+1
//!    overlaps the all-gather of part k. Replicas stay bit-identical.
//!
//! Reduce-scatter plus all-gather move the same bytes as DDP's all-reduce (a ring all-reduce
//! *is* a reduce-scatter followed by an all-gather), so sharding costs no extra communication.
//!
//! # Stages
//!
//! * Stage 1: [`accumulate`](ShardedDataParallel::accumulate) (PyTorch's `no_sync`) sums
//!   micro-steps into the pipeline's buffers (the full local gradient) without communication;
//!   the step reduce-scatters them. Optimizer state: 1/N.
//! * Stage 2: every micro-step is reduce-scattered at once and added into the rank's chunks:
//!   no gradient buffer of P elements persists. Optimizer state and gradients: 1/N. With
//!   accumulation the sum over ranks is taken per micro-step, so the rounding differs from
//!   DDP's (which sums micro-steps locally first) in the last bits.
//!
//! Gradient compression is not offered with sharding, and the parameters must be `f32` (a
//! half-precision parameter would be stepped in `f32` here but in its own type by burn).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};
use ddp_comm::ProcessGroup;

use crate::config::{Compression, DdpConfig, ReducerSettings};
use crate::gradients::agree::Start;
use crate::gradients::buckets::{Layout, ADOPT_BYTES};
use crate::gradients::host_buf::HostBuf;
use crate::gradients::host_carrier::Reduction;
use crate::gradients::overlap::lock;
use crate::gradients::pipeline::Done;
use crate::gradients::reducer::Reducer;
use crate::optim::clip::{norm_and_factor, sum_of_squares};
use crate::optim::shard_optim::ShardOptimizer;
use crate::params::{put_values, take_values, ParamInfo};
use crate::zero::keep::{step_from, StartingPoint};
use crate::zero::layout::{plan_shards, release_outside, ShardLayout};
use crate::zero::state::{
    check_shards_agree, decode, encode, shard_report, ShardHeader, StateHeader, SHARD_LAYOUT,
};
use crate::DdpError;

/// How much of the training state is split across ranks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum ZeroStage {
    /// ZeRO stage 1: the optimizer state.
    One,
    /// ZeRO stage 2: the optimizer state and the averaged gradients.
    Two,
}

/// Settings of [`ShardedDataParallel`], a burn `Config`.
#[derive(Config, Debug, PartialEq)]
pub struct ZeroConfig {
    /// What is sharded.
    pub stage: ZeroStage,
    /// Largest bucket in MiB (default 25, DDP's `bucket_cap_mb`: the buckets are DDP's).
    #[config(default = 25.0)]
    pub bucket_cap_mb: f64,
    /// Size of the first bucket in MiB (default 1, DDP's `first_bucket_mb`).
    #[config(default = 1.0)]
    pub first_bucket_mb: f64,
    /// When `Some(k)`, every k-th step first checks that the replicas hold bit-identical
    /// parameters (see [`DistributedDataParallel::check_replicas`](crate::DistributedDataParallel::check_replicas)).
    #[config(default = "None")]
    pub check_replicas_every: Option<u64>,
    /// Whether every step overwrites the module's buffers (BatchNorm's running statistics)
    /// with rank 0's, as DDP's `broadcast_buffers`.
    #[config(default = true)]
    pub broadcast_buffers: bool,
    /// Reduce-scatter each bucket during backward, from the hooks of
    /// [`prepare`](ShardedDataParallel::prepare) (DDP's [`DdpConfig::overlap`], the same
    /// default): with [`backward_step`](ShardedDataParallel::backward_step) each gradient is
    /// released as its bucket leaves.
    #[config(default = "DdpConfig::new().overlap")]
    pub overlap: bool,
    /// Clip the averaged gradient to this global 2-norm before the update
    /// ([`DdpConfig::max_grad_norm`]: the norm from the shards' squared sums and one small
    /// all-gather, the same bits as DDP with clipping); `None`: no clipping.
    #[config(default = "None")]
    pub max_grad_norm: Option<f32>,
}

impl From<&ZeroConfig> for ReducerSettings {
    fn from(config: &ZeroConfig) -> Self {
        Self {
            bucket_cap_mb: config.bucket_cap_mb,
            first_bucket_mb: config.first_bucket_mb,
            compression: Compression::None,
            check_replicas_every: config.check_replicas_every,
            broadcast_buffers: config.broadcast_buffers,
            overlap: config.overlap,
        }
    }
}

/// Bytes held by the sharded state of one rank, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardMemory {
    /// Elements of the flat trainable parameter vector (P).
    pub params: usize,
    /// Elements of this rank's shard.
    pub shard: usize,
    /// Elements of the longest shard of any rank.
    pub longest_shard: usize,
    /// Bytes of optimizer state this rank keeps (moments of its shard).
    pub optimizer_bytes: usize,
    /// Bytes of gradient buffers this rank keeps between micro-steps (stage 1: the full local
    /// gradient, which it sums when accumulating; stage 2: its shard).
    pub gradient_bytes: usize,
}

/// Time and volume of the sharded steps since the last
/// [`take_stats`](ShardedDataParallel::take_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ZeroStats {
    /// Steps taken.
    pub steps: u64,
    /// Packing gradients and waiting for the reduce-scatters (after backward, where they
    /// started during it).
    pub reduce: Duration,
    /// The optimizer update of the shard.
    pub update: Duration,
    /// The all-gathers of the parameters (what of them the updates did not hide) and putting
    /// them back into the module.
    pub gather: Duration,
    /// Elements this rank handed to collectives, times their size (the buffers of the
    /// reduce-scatters and the all-gathers, as DDP counts its all-reduce buffers).
    pub bytes: u64,
    /// Buckets whose reduce-scatters started during backward ([`ZeroConfig::overlap`]).
    pub buckets_during_backward: u64,
}

impl From<ZeroStats> for crate::SyncStats {
    /// A sharded step's statistics as DDP's: its reduce-scatters and all-gathers (packing
    /// included) as `wait`, its shard update as `unpack`.
    fn from(z: ZeroStats) -> crate::SyncStats {
        crate::SyncStats {
            steps: z.steps,
            wait: z.reduce + z.gather,
            unpack: z.update,
            bytes: z.bytes,
            buckets_during_backward: z.buckets_during_backward,
            ..crate::SyncStats::default()
        }
    }
}

/// This rank's chunk of a part's gradient, summed over ranks: `buf[at..at + len]`, where the
/// reduce-scatter left it (a large part's buffer keeps its length, its other pages released).
struct Held {
    buf: HostBuf,
    at: usize,
}

/// Data parallelism with sharded optimizer state (and gradients): replaces both
/// [`DistributedDataParallel`](crate::DistributedDataParallel) and burn's optimizer in the loop.
///
/// ```text
/// let adam = ShardOptimizer::Adam(ShardedAdamConfig::new());
/// let config = ZeroConfig::new(ZeroStage::Two); // overlap on by default, as DDP's
/// let (mut model, mut zero) = ShardedDataParallel::new(model, pg, config, adam)?;
/// for (x, y) in loader {
///     let loss = zero.prepare(&model).loss(x, y);   // the hooked copy lives for the forward
///     model = zero.backward_step(lr, model, loss)?;
/// }
/// ```
pub struct ShardedDataParallel {
    /// The parameter list, the checks, the buffer broadcast, the pipeline and the hooks
    /// (reduce-scattering).
    reducer: Reducer,
    stage: ZeroStage,
    optimizer: ShardOptimizer,
    layout: Arc<Layout>,
    shards: ShardLayout,
    /// For each parameter (visiting index) that is trained: its offset in the flat trainable
    /// vector (the consolidated state's layout) and its index among the trainable ones.
    flat: Vec<Option<(usize, usize)>>,
    /// P: elements of the flat trainable vector.
    total: usize,
    /// Step count of every trainable parameter (burn's per-parameter Adam `time`).
    times: Vec<u64>,
    /// The optimizer's state vectors over this rank's shard.
    state: Vec<Vec<f32>>,
    /// Per part: this rank's chunk of the gradient summed over ranks since the last step.
    grad: Vec<Option<Held>>,
    /// Per parameter: its presence summed over ranks and micro-steps since the last step.
    present: Vec<f32>,
    micro_steps: usize,
    stats: ZeroStats,
    /// Steps taken, the ones of a loaded state included: recorded in the saved states, so
    /// that shard files of different checkpoints are told apart.
    steps: u64,
    /// This run's id, the same on every rank (rank 0's, broadcast at construction; a loaded
    /// state's run once loaded): recorded in the saved states, so that another run's shard
    /// files are told apart.
    run: u64,
    /// Whether a step keeps its starting point until [`commit_step`](Self::commit_step) or
    /// [`roll_back`](Self::roll_back) (elastic runs).
    keep: bool,
    /// The last step's starting point, while `keep`.
    previous: Option<StartingPoint>,
    /// A committed step's starting point: the buffers the next step writes into.
    spare: Option<StartingPoint>,
    /// [`ZeroConfig::max_grad_norm`].
    max_grad_norm: Option<f32>,
    /// The last step's gradient norm before clipping (with `max_grad_norm` only).
    grad_norm: Option<f32>,
}

impl ShardedDataParallel {
    /// Checks that every rank has the same parameter list, broadcasts rank 0's values (as
    /// [`DistributedDataParallel::new`](crate::DistributedDataParallel::new)), lays out the shards and allocates this rank's
    /// optimizer state. Every rank calls it at the same point.
    pub fn new<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: ZeroConfig,
        optimizer: ShardOptimizer,
    ) -> Result<(M, Self), DdpError> {
        Self::with_start(model, pg, config, optimizer, Start::Broadcast)
    }

    /// [`new`](Self::new), or (`Start::Identical`) for replicas whose parameters are identical
    /// already: an elastic generation of survivors.
    pub(crate) fn with_start<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: ZeroConfig,
        optimizer: ShardOptimizer,
        start: Start,
    ) -> Result<(M, Self), DdpError> {
        let settings = ReducerSettings::from(&config);
        let reduction = Reduction::ReduceScatter;
        let (model, reducer) = Reducer::new(model, pg, settings, reduction, start)?;
        let params = reducer.params();
        if let Some(p) = params
            .iter()
            .find(|p| p.trainable() && p.dtype != DType::F32)
        {
            return Err(DdpError::UnsupportedParam {
                name: p.name.clone(),
                reason: format!(
                    "sharded training steps f32 parameters only (this one is {:?}); use \
                     DistributedDataParallel with burn's optimizer for half precision",
                    p.dtype
                ),
            });
        }
        let mut flat = vec![None; params.len()];
        let (mut total, mut trainable) = (0, 0);
        for (i, p) in params.iter().enumerate().filter(|(_, p)| p.trainable()) {
            flat[i] = Some((total, trainable));
            total += p.numel();
            trainable += 1;
        }
        let layout = reducer.layout();
        let shards = plan_shards(&layout, params, reducer.process_group().world_size());
        let shard_len = shards.lens[reducer.process_group().rank()];
        let state = vec![vec![0.0; shard_len]; optimizer.state_vectors()];
        let run = reducer
            .process_group()
            .broadcast(vec![new_run_id() as i64], 0)?[0] as u64;
        let zero = Self {
            stage: config.stage,
            optimizer,
            grad: (0..layout.parts.len()).map(|_| None).collect(),
            present: vec![0.0; params.len()],
            layout,
            shards,
            flat,
            total,
            times: vec![0; trainable],
            state,
            micro_steps: 0,
            stats: ZeroStats::default(),
            steps: 0,
            run,
            keep: false,
            previous: None,
            spare: None,
            max_grad_norm: config.max_grad_norm,
            grad_norm: None,
            reducer,
        };
        Ok((model, zero))
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        self.reducer.process_group()
    }

    /// The parameter list every rank agreed on (frozen parameters and buffers included).
    pub fn params(&self) -> &[ParamInfo] {
        self.reducer.params()
    }

    /// The parameter names of each bucket, in communication order (DDP's layout).
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_layout()
    }

    /// The stage in force.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The optimizer the shards are stepped with.
    pub fn optimizer(&self) -> &ShardOptimizer {
        &self.optimizer
    }

    /// This rank.
    fn rank(&self) -> usize {
        self.process_group().rank()
    }

    /// This rank's shard: the ranges of the flat trainable parameter vector (the trainable
    /// parameters in visiting order) it owns, in shard order (one per piece of a chunk; see
    /// the module documentation).
    pub fn shard_ranges(&self) -> Vec<Range<usize>> {
        self.flat_ranges(self.rank())
    }

    /// Rank `rank`'s pieces as ranges of the flat trainable vector, in shard order.
    fn flat_ranges(&self, rank: usize) -> Vec<Range<usize>> {
        self.shards.pieces[rank]
            .iter()
            .map(|piece| {
                let (offset, _) = self.flat[piece.param].expect("pieces are of trained parameters");
                offset + piece.range.start..offset + piece.range.end
            })
            .collect()
    }

    /// What this rank keeps, in elements and bytes.
    pub fn memory(&self) -> ShardMemory {
        let shard = self.shards.lens[self.rank()];
        let gradient_elems = match self.stage {
            ZeroStage::One => self.total,
            ZeroStage::Two => shard,
        };
        ShardMemory {
            params: self.total,
            shard,
            longest_shard: self.shards.longest(),
            optimizer_bytes: 4 * shard * self.optimizer.state_vectors(),
            gradient_bytes: 4 * gradient_elems,
        }
    }

    /// Statistics since the last call, then reset.
    pub fn take_stats(&mut self) -> ZeroStats {
        let ddp = self.reducer.take_stats();
        ZeroStats {
            buckets_during_backward: ddp.buckets_during_backward,
            ..std::mem::take(&mut self.stats)
        }
    }

    /// Checks that every replica holds bit-identical parameters
    /// ([`DistributedDataParallel::check_replicas`](crate::DistributedDataParallel::check_replicas)). A collective.
    pub fn check_replicas<M: Module>(&self, model: &M) -> Result<(), DdpError> {
        self.reducer.check_replicas(model)
    }

    /// A copy of `model` for the forward pass of the next
    /// [`backward_step`](Self::backward_step) whose trainable parameters hand their gradients
    /// over as soon as they are complete (with [`ZeroConfig::overlap`], as
    /// [`DistributedDataParallel::prepare`](crate::DistributedDataParallel::prepare)); otherwise a plain clone. Drop the copy once the
    /// loss is computed: while it lives, the module's parameters cannot be updated in their
    /// own memory (they are then copied).
    pub fn prepare<M: Module>(&mut self, model: &M) -> M {
        self.reducer.prepare(model)
    }

    /// When the last [`backward_step`](Self::backward_step) ran its backward pass (start and
    /// end), for traces.
    pub fn last_backward(&self) -> Option<(Instant, Instant)> {
        self.reducer.last_backward()
    }

    /// Why the reduce-scatters cannot start during backward, or `None` when they do
    /// ([`DistributedDataParallel::why_no_overlap`](crate::DistributedDataParallel::why_no_overlap)).
    pub fn why_no_overlap<M: Module>(&self, model: &M) -> Option<&'static str> {
        self.reducer.why_no_overlap(model)
    }

    /// Gradient accumulation (PyTorch's `no_sync`): stage 1 adds this micro-step's gradients
    /// into the local buffers, without communication; stage 2 reduce-scatters them at once and
    /// adds this rank's chunks (a collective: every rank calls it the same number of times).
    /// The next [`step`](Self::step) uses the sum over micro-steps, averaged over ranks.
    pub fn accumulate<M: Module>(
        &mut self,
        model: &M,
        mut grads: GradientsParams,
    ) -> Result<(), DdpError> {
        let start = Instant::now();
        let result = match self.stage {
            ZeroStage::One => {
                let error = lock(self.reducer.pipeline()).accumulate(&mut grads);
                error.map_or(Ok(()), Err)
            }
            ZeroStage::Two => {
                // A collective: local failures travel with it.
                let local = self.reducer.check_same_params(model).err();
                self.reduce(Some(grads), false, local)
            }
        };
        self.micro_steps += 1;
        self.stats.reduce += start.elapsed();
        result
    }

    /// One training step: averages `grads` (plus anything accumulated) across ranks, steps
    /// this rank's shard with learning rate `lr`, all-gathers the parameters and returns the
    /// updated module, the same on every rank. Every rank calls it at the same point.
    ///
    /// Before the gradients, as [`DistributedDataParallel::sync`](crate::DistributedDataParallel::sync) does, it checks that `model`
    /// holds the parameters it was created with and broadcasts rank 0's buffers. A failure on
    /// one rank fails the step on every rank ([`DdpError::PeerFailed`] names the rank) before
    /// any parameter or optimizer state changes.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, DdpError> {
        self.step_keeping(lr, model, grads).map_err(|(e, _)| e)
    }

    /// [`step`](Self::step) from the loss: runs backward on `loss` (of the model
    /// [`prepare`](Self::prepare) gave) and steps. With [`ZeroConfig::overlap`] each bucket is
    /// reduce-scattered during backward and each gradient released as its bucket leaves;
    /// without, it is `loss.backward()` and [`step`](Self::step). The same bits either way.
    pub fn backward_step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        loss: Tensor<1>,
    ) -> Result<M, DdpError> {
        self.try_backward_step(lr, model, loss).map_err(|(e, _)| e)
    }

    /// [`backward_step`](Self::backward_step) that gives the module back with the error where
    /// it still holds the step's starting point: a failure before the update, or one in the
    /// all-gather while [`keep_starting_points`](Self::keep_starting_points) is on.
    pub(crate) fn try_backward_step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        loss: Tensor<1>,
    ) -> Result<M, (DdpError, Option<M>)> {
        if !self.reducer.prepared() {
            let grads = self.reducer.timed_backward(&model, loss);
            return self.step_keeping(lr, model, grads);
        }
        let (grads, local) = match self.reducer.overlapped_backward(&model, loss) {
            Ok(done) => done,
            Err(e) => return Err((e, Some(model))),
        };
        let start = Instant::now();
        let reduced = self.reduce(Some(grads), true, local);
        self.stats.reduce += start.elapsed();
        match reduced {
            Ok(()) => self.update_and_gather(lr, model),
            Err(e) => Err((e, Some(model))),
        }
    }

    /// [`step`](Self::step), giving the module back with the error as
    /// [`try_backward_step`](Self::try_backward_step) does.
    fn step_keeping<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, (DdpError, Option<M>)> {
        let start = Instant::now();
        let reduced = self
            .reducer
            .begin_sync(&model)
            .and_then(|local| self.reduce(Some(grads), false, local));
        self.stats.reduce += start.elapsed();
        match reduced {
            Ok(()) => self.update_and_gather(lr, model),
            Err(e) => Err((e, Some(model))),
        }
    }

    /// From now on every step keeps its starting point until
    /// [`commit_step`](Self::commit_step) or [`roll_back`](Self::roll_back) (elastic runs:
    /// a step whose commit vote fails may have to be dropped). This rank then holds a second
    /// copy of the trainable parameters and of its optimizer state.
    pub(crate) fn keep_starting_points(&mut self) {
        self.keep = true;
    }

    /// The last step stands: its starting point's buffers become the next step's.
    pub(crate) fn commit_step(&mut self) {
        if let Some(previous) = self.previous.take() {
            self.spare = Some(previous);
        }
    }

    /// Drops the last step: `stepped` (the module it returned, or a clone of it) gets the
    /// starting point's parameter values back, and the optimizer state and step counts are the
    /// starting point's again. An error when no starting point is kept.
    pub(crate) fn roll_back<M: Module>(&mut self, stepped: M) -> Result<M, DdpError> {
        let previous = self.previous.take().ok_or_else(|| {
            DdpError::Config("ZeRO: no step to roll back (its starting point is not kept)".into())
        })?;
        let flat = &self.flat;
        let (model, _) = take_values(stepped, &|i| flat[i].is_some())?;
        self.state = previous.state;
        self.times = previous.times;
        self.steps = previous.steps;
        Ok(put_values(model, self.params(), previous.values))
    }

    /// Ends a micro-step in the pipeline (`begun`: by an overlapped backward, whose hooks
    /// delivered their gradients already): hands over `grads`, reduce-scatters what has not
    /// left yet and adds this rank's chunks into its gradient. On an error every rank fails,
    /// and the micro-steps accumulated so far are dropped.
    fn reduce(
        &mut self,
        grads: Option<GradientsParams>,
        begun: bool,
        local: Option<DdpError>,
    ) -> Result<(), DdpError> {
        let pipeline = Arc::clone(self.reducer.pipeline());
        let mut pipeline = lock(&pipeline);
        if !begun {
            pipeline.begin(true);
        }
        if let Some(e) = local {
            pipeline.fail(e);
        }
        if let Some(mut grads) = grads {
            pipeline.deliver_from(&mut grads);
        }
        let rank = self.rank();
        let (chunks, layout, held) = (&self.shards.chunks[rank], &self.layout, &mut self.grad);
        let presence = pipeline.finish(self.reducer.syncs(), |_, done: Done<HostBuf>| {
            let range = chunks[done.part].range.clone();
            let large = layout.parts[done.part].len * 4 >= ADOPT_BYTES;
            let mut buf = done.buf;
            let chunk = match &mut held[done.part] {
                Some(sum) => {
                    // A later micro-step: added into the first one's chunk.
                    let dst = &mut sum.buf.as_mut()[sum.at..sum.at + range.len()];
                    let src = &buf.as_ref()[range];
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
                    return;
                }
                slot => slot,
            };
            *chunk = Some(if large {
                release_outside(buf.as_mut(), range.clone());
                Held {
                    buf,
                    at: range.start,
                }
            } else {
                Held {
                    buf: buf.as_ref()[range].to_vec().into(),
                    at: 0,
                }
            });
        });
        self.stats.bytes += pipeline.take_bytes();
        match presence {
            Ok(presence) => {
                self.present
                    .iter_mut()
                    .zip(presence)
                    .for_each(|(p, q)| *p += q);
                Ok(())
            }
            Err(e) => {
                self.micro_steps = 0;
                self.grad.iter_mut().for_each(|g| *g = None);
                self.present.fill(0.0);
                Err(e)
            }
        }
    }

    /// Clips this rank's averaged chunks `grads` to the global norm `max_norm` (`clip.rs`:
    /// each chunk's squared sum, all-gathered, added part by part and rank by rank) and returns
    /// the norm before clipping, the same on every rank.
    fn clip_shard(&self, grads: &mut [Option<Held>], max_norm: f32) -> Result<f32, DdpError> {
        let (rank, world) = (self.rank(), self.process_group().world_size());
        let chunks = &self.shards.chunks[rank];
        let mine: Vec<f64> = chunks
            .iter()
            .zip(grads.iter())
            .map(|(chunk, held)| {
                held.as_ref().map_or(0.0, |h| {
                    sum_of_squares(&h.buf.as_ref()[h.at..h.at + chunk.range.len()])
                })
            })
            .collect();
        let all = self.process_group().all_gather(mine)?;
        let parts = chunks.len();
        let (norm, factor) = norm_and_factor(parts, world, |j, r| all[r * parts + j], max_norm);
        if let Some(factor) = factor {
            for (held, chunk) in grads.iter_mut().zip(chunks) {
                if let Some(h) = held {
                    let g = &mut h.buf.as_mut()[h.at..h.at + chunk.range.len()];
                    g.iter_mut().for_each(|x| *x *= factor);
                }
            }
        }
        Ok(norm as f32)
    }

    /// The global 2-norm of the last step's averaged gradient before clipping (the same on
    /// every rank, and as DDP's); `None` unless [`ZeroConfig::max_grad_norm`] is set.
    pub fn grad_norm(&self) -> Option<f32> {
        self.grad_norm
    }

    /// The end of a step, once this rank's chunks of the gradient are summed over ranks:
    /// takes the trainable parameters' memory out of `model`, steps this rank's chunks in it
    /// part by part and all-gathers each part in place (updating part k+1 overlaps the
    /// all-gather of part k), then puts the memory back into the module. While starting points
    /// are kept, the step writes into the spare buffers instead (`start_from`), and a failed
    /// all-gather gives the module back as it was. With [`ZeroConfig::max_grad_norm`] the chunks
    /// are clipped first (`clip_shard`).
    fn update_and_gather<M: Module>(
        &mut self,
        lr: f64,
        model: M,
    ) -> Result<M, (DdpError, Option<M>)> {
        let start = Instant::now();
        let (rank, world) = (self.rank(), self.process_group().world_size());
        let fresh = vec![0.0; self.present.len()];
        let present = std::mem::replace(&mut self.present, fresh);
        let mut grads = std::mem::take(&mut self.grad);
        self.grad = (0..self.layout.parts.len()).map(|_| None).collect();
        self.micro_steps = 0;
        let denom = world as f32;
        // Every chunk averaged first: clipping needs the whole gradient's norm before any part
        // is updated.
        for (held, chunk) in grads.iter_mut().zip(&self.shards.chunks[rank]) {
            if let Some(held) = held {
                let g = &mut held.buf.as_mut()[held.at..held.at + chunk.range.len()];
                g.iter_mut().for_each(|x| *x /= denom);
            }
        }
        if let Some(max_norm) = self.max_grad_norm {
            match self.clip_shard(&mut grads, max_norm) {
                Ok(norm) => self.grad_norm = Some(norm),
                Err(e) => return Err((e, Some(model))),
            }
        }
        let flat = &self.flat;
        let (model, mut values) =
            take_values(model, &|i| flat[i].is_some()).map_err(|e| (e, None))?;
        let kept = self.keep.then(|| self.start_from(&mut values));
        let pg = Arc::clone(self.process_group());
        let mut update = Duration::ZERO;
        let mut flights = Vec::with_capacity(self.layout.parts.len());
        for (j, part) in self.layout.parts.iter().enumerate() {
            let updating = Instant::now();
            let chunk = &self.shards.chunks[rank][j];
            let g = grads[j]
                .as_ref()
                .map(|held| &held.buf.as_ref()[held.at..held.at + chunk.range.len()]);
            for piece in &self.shards.pieces[rank][chunk.pieces.clone()] {
                let p = piece.param;
                let (s, n) = (piece.shard, piece.range.len());
                // The piece's averaged gradient and step count, unless nobody had one.
                let step = match (g, self.flat[p]) {
                    (Some(g), Some((_, k))) if present[p] > 0.0 => {
                        let at = s - chunk.shard;
                        Some((&g[at..at + n], self.times[k]))
                    }
                    _ => None,
                };
                let param =
                    &mut values[p].as_mut().expect("taken above").as_mut()[piece.range.clone()];
                let mut state: Vec<&mut [f32]> =
                    self.state.iter_mut().map(|v| &mut v[s..s + n]).collect();
                match (&kept, step) {
                    (None, Some((g, time))) => {
                        self.optimizer.update(lr, time, param, g, &mut state);
                    }
                    (None, None) => {}
                    (Some(kept), step) => {
                        let from = &kept.values[p].as_ref().expect("kept above").as_ref()
                            [piece.range.clone()];
                        let from_state: Vec<&[f32]> =
                            kept.state.iter().map(|v| &v[s..s + n]).collect();
                        let to = (param, state.as_mut_slice());
                        step_from(&self.optimizer, lr, step, (from, &from_state), to);
                    }
                }
            }
            grads[j] = None;
            // The part's all-gather, in the parameter's own memory when it is one.
            let buf = match part.params.as_slice() {
                [p] => values[*p].take().expect("taken above"),
                _ => {
                    let mut buf = vec![0.0; part.len];
                    for piece in &self.shards.pieces[rank][chunk.pieces.clone()] {
                        let k = part.params.iter().position(|&q| q == piece.param);
                        let off = part.offsets[k.expect("a piece of the part")];
                        let src = values[piece.param].as_ref().expect("taken above").as_ref();
                        buf[off + piece.range.start..off + piece.range.end]
                            .copy_from_slice(&src[piece.range.clone()]);
                    }
                    HostBuf::from(buf)
                }
            };
            self.stats.bytes += 4 * buf.len() as u64;
            update += updating.elapsed();
            flights.push(pg.submit_all_gather_in_place(buf));
        }
        for (count, t) in present.iter().zip(&self.flat) {
            if let (true, Some((_, k))) = (*count > 0.0, t) {
                self.times[*k] += 1;
            }
        }
        let mut gathered = Vec::with_capacity(flights.len());
        let mut error = None;
        for w in flights {
            match w.wait() {
                Ok(buf) => gathered.push(buf),
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = error {
            let model = kept.map(|kept| {
                self.state = kept.state;
                self.times = kept.times;
                self.steps = kept.steps;
                put_values(model, self.params(), kept.values)
            });
            return Err((e.into(), model));
        }
        for (part, buf) in self.layout.parts.iter().zip(gathered) {
            match part.params.as_slice() {
                [p] => values[*p] = Some(buf),
                _ => {
                    for (&p, &off) in part.params.iter().zip(&part.offsets) {
                        let dst = values[p].as_mut().expect("taken above").as_mut();
                        let n = dst.len();
                        dst.copy_from_slice(&buf.as_ref()[off..off + n]);
                    }
                }
            }
        }
        let model = put_values(model, self.params(), values);
        self.stats.update += update;
        self.stats.gather += start.elapsed().saturating_sub(update);
        self.stats.steps += 1;
        self.steps += 1;
        self.previous = kept;
        Ok(model)
    }

    /// Keeps the step's starting point (see [`StartingPoint`]): `values` (the parameters'
    /// memory taken out of the module) and the optimizer state become the kept ones, and the
    /// step goes on in the spare buffers (allocated on the first step): the update writes this
    /// rank's own ranges and state there from the kept ones (`step_from`), the all-gather the
    /// other ranks' ranges.
    fn start_from(&mut self, values: &mut Vec<Option<HostBuf>>) -> StartingPoint {
        let mut next = match self.spare.take() {
            Some(spare) => spare,
            None => StartingPoint {
                values: values
                    .iter()
                    .map(|v| v.as_ref().map(|v| HostBuf::zeros(v.len())))
                    .collect(),
                state: self.state.iter().map(|v| vec![0.0; v.len()]).collect(),
                times: Vec::new(),
                steps: 0,
            },
        };
        std::mem::swap(values, &mut next.values);
        std::mem::swap(&mut self.state, &mut next.state);
        next.times = self.times.clone();
        next.steps = self.steps;
        next
    }

    /// The header of this run's consolidated state (its optimizer, parameters, step counts).
    pub(crate) fn state_header(&self) -> StateHeader {
        StateHeader {
            optimizer: self.optimizer.name().into(),
            vectors: self.optimizer.state_vectors(),
            params: self
                .params()
                .iter()
                .filter(|p| p.trainable())
                .map(|p| (p.name.clone(), p.numel()))
                .collect(),
            times: self.times.clone(),
            step: self.steps,
            run: self.run,
            shard: None,
        }
    }

    /// This rank's shard of the optimizer state, encoded like the consolidated state with the
    /// shard's place in its header: what each rank saves on its own, without gathering (1/N of
    /// the state per rank). It loads back ([`load_shard_state`](Self::load_shard_state)) only
    /// into the same rank of a run with the same world size and layout; to change the world
    /// size, consolidate ([`consolidated_state`](Self::consolidated_state)).
    pub fn shard_state(&self) -> Result<Vec<u8>, DdpError> {
        encode(&self.shard_header(), &self.state)
    }

    /// Makes `state` (the optimizer's vectors over this rank's shard, in
    /// [`shard_ranges`](Self::shard_ranges) order) this rank's state, with the step counts and
    /// run of `header` (a state of the same parameters, checked by the caller).
    pub(crate) fn adopt_state(&mut self, state: Vec<Vec<f32>>, header: StateHeader) {
        self.state = state;
        self.times = header.times;
        self.steps = header.step;
        if header.run != 0 {
            self.run = header.run;
        }
    }

    /// Loads this rank's own shard written by [`shard_state`](Self::shard_state); another
    /// rank's, another world size's or layout's, or a consolidated state is an error naming
    /// the field. A collective: every rank calls it at the same point with its own file, and
    /// the shards load only together, when every rank's file is of the same run and step (one
    /// checkpoint). Otherwise every rank fails, naming the ranks out of line and their steps
    /// (a save that stopped part-way leaves one rank's file older), and nothing is changed.
    /// `name` names the source in errors.
    pub fn load_shard_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let decoded = decode(bytes, &self.shard_header(), name);
        let all = self
            .process_group()
            .all_gather(shard_report(decoded.as_ref().ok().map(|(h, _)| h)))?;
        let (header, vectors) = decoded?;
        check_shards_agree(&all, name)?;
        self.state = vectors;
        self.times = header.times;
        self.steps = header.step;
        self.run = header.run;
        Ok(())
    }

    /// The header of this rank's shard of the state.
    fn shard_header(&self) -> StateHeader {
        let mut header = self.state_header();
        header.shard = Some(ShardHeader {
            world: self.process_group().world_size(),
            rank: self.rank(),
            ranges: self
                .shard_ranges()
                .into_iter()
                .map(|r| (r.start, r.end))
                .collect(),
            layout: SHARD_LAYOUT,
        });
        header
    }

    /// The whole optimizer state in one piece (PyTorch's `consolidate_state_dict(to=0)`): rank
    /// 0 returns the encoded state, independent of the world size and the bucket layout, the
    /// others `None`. A collective: every rank calls it at the same point.
    ///
    /// Each rank's shard of each state vector travels in a broadcast from that rank (the
    /// process group has no gather to one rank): every rank receives it, but only rank 0 keeps
    /// it, so that the others never hold more than one shard at a time. Rank 0 briefly holds
    /// the whole state.
    pub fn consolidated_state(&self) -> Result<Option<Vec<u8>>, DdpError> {
        let pg = self.process_group();
        let (world, rank) = (pg.world_size(), pg.rank());
        let longest = self.shards.longest();
        let mut vectors = Vec::with_capacity(self.state.len());
        for v in &self.state {
            let mut full = if rank == 0 {
                vec![0.0; self.total]
            } else {
                Vec::new()
            };
            for r in 0..world {
                let mut block = if r == rank { v.clone() } else { Vec::new() };
                block.resize(longest, 0.0);
                let block = pg.broadcast(block, r)?;
                if rank != 0 {
                    continue;
                }
                for (range, piece) in self.flat_ranges(r).into_iter().zip(&self.shards.pieces[r]) {
                    full[range.clone()]
                        .copy_from_slice(&block[piece.shard..piece.shard + range.len()]);
                }
            }
            vectors.push(full);
        }
        if rank != 0 {
            return Ok(None);
        }
        encode(&self.state_header(), &vectors).map(Some)
    }

    /// Loads a consolidated state (from [`consolidated_state`](Self::consolidated_state), at
    /// any world size and bucket layout): this rank keeps its shard of it and every
    /// parameter's step count. Local: every rank calls it with the same bytes (e.g. from
    /// [`crate::resume_sharded`]). A state of another optimizer or parameter list is an error
    /// naming the field, and nothing is changed. `name` names the source in errors.
    pub fn load_consolidated(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let (header, vectors) = decode(bytes, &self.state_header(), name)?;
        let len = self.shards.lens[self.rank()];
        let ranges = self.shard_ranges();
        let mut state = vec![Vec::with_capacity(len); vectors.len()];
        for (dst, full) in state.iter_mut().zip(&vectors) {
            for range in &ranges {
                dst.extend_from_slice(&full[range.clone()]);
            }
        }
        self.state = state;
        self.times = header.times;
        self.steps = header.step;
        if header.run != 0 {
            // The same run, resumed (every rank loads the same bytes: the ranks still agree).
            self.run = header.run;
        }
        Ok(())
    }
}

/// A fresh run id: random (std's randomly keyed hasher over the time and the process id), never
/// 0 (which stands for "not recorded").
fn new_run_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish() | 1
}
