//! [`ShardedDataParallel`]: data parallelism with the optimizer state (ZeRO stage 1), and also
//! the averaged gradients (stage 2), split across ranks, as DeepSpeed's ZeRO and PyTorch's
//! `ZeroRedundancyOptimizer` do (Rajbhandari et al., SC 2020).
//!
//! # The shard layout
//!
//! The trainable parameters, in burn's visiting order, form one flat `f32` vector of P
//! elements. It is cut into buckets: contiguous ranges of at most `bucket_cap_mb` (a parameter
//! may straddle two buckets). Rank r owns chunk `chunk_range(len, N, r)` of every bucket: the
//! balanced element-wise split of the process group's reduce-scatter, which gives the first
//! `len % N` ranks one element more. A rank's shard is its chunks of all buckets, in bucket
//! order: about P / N elements, never more than P / N + (number of buckets). The layout depends
//! only on the parameter list, the world size and the bucket size, so it is the same on every
//! rank and in every run.
//!
//! # A step
//!
//! 1. Every rank packs its local gradients, bucket by bucket, and reduce-scatters each bucket:
//!    rank r receives the sum over ranks of its chunk, adds it to its shard of the gradient,
//!    and divides by N once at the step. The sums are the process group's, in its fixed
//!    reduction order: over shared memory (and for small buffers over TCP) every element is
//!    summed in rank order, as in the DDP all-reduce, so the averaged gradient is bit-identical
//!    to DDP's; a large TCP ring starts each chunk's sum at another rank than the DDP bucket's
//!    ring does, which at 3 or more ranks can change the last bit (at 2 ranks a sum of two is
//!    the same either way).
//! 2. Each rank steps its shard with [`ShardOptimizer`], element for element burn's own Adam or
//!    SGD, keeping the optimizer state of its shard only.
//! 3. One all-gather of the updated shards (each padded to the longest) gives every rank the
//!    whole parameter vector, which is loaded into the module: replicas stay bit-identical.
//!
//! Reduce-scatter plus all-gather move the same bytes as DDP's all-reduce (a ring all-reduce
//! *is* a reduce-scatter followed by an all-gather), so sharding costs no extra communication.
//!
//! Before the buckets, one small all-reduce carries a presence count per parameter and the
//! failure slots: a parameter that got no gradient on any rank is skipped as burn's optimizer
//! skips it (its state and step count stay), and a rank that fails locally (an unreadable
//! gradient, replaced parameters) makes every rank return an error that names it, before any
//! parameter changes.
//!
//! # Stages
//!
//! * Stage 1: the local gradient is packed into a persistent buffer of P elements;
//!   [`accumulate`](ShardedDataParallel::accumulate) (PyTorch's `no_sync`) adds micro-steps
//!   into it without communication; the step reduce-scatters it. Optimizer state: 1/N.
//! * Stage 2: every micro-step is reduce-scattered at once, bucket by bucket straight from
//!   burn's gradients (at most two buckets in flight), and added into the rank's shard of the
//!   gradient: no gradient buffer of P elements persists. Optimizer state and gradients: 1/N.
//!   With accumulation the sum over ranks is taken per micro-step, so the rounding differs
//!   from DDP's (which sums micro-steps locally first) in the last bits.
//!
//! Gradient compression is not offered with sharding, and the parameters must be `f32` (a
//! half-precision parameter would be stepped in `f32` here but in its own type by burn).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::config::Config;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::DType;
use ddp_comm::{chunk_range, ProcessGroup, ReduceOp, Work};

use crate::config::DdpConfig;
use crate::ddp::{peer_failed, DistributedDataParallel};
use crate::params::{load_with, read_pieces, take_grad, ParamInfo};
use crate::shard_optim::ShardOptimizer;
use crate::zero_state::{
    check_shards_agree, decode, encode, shard_report, ShardHeader, StateHeader,
};
use crate::DdpError;

const MIB: f64 = 1024.0 * 1024.0;

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
    /// Largest bucket of the reduce-scatter, in MiB (default 25, like DDP's `bucket_cap_mb`).
    #[config(default = 25.0)]
    pub bucket_cap_mb: f64,
    /// When `Some(k)`, every k-th step first checks that the replicas hold bit-identical
    /// parameters (see [`DistributedDataParallel::check_replicas`]).
    #[config(default = "None")]
    pub check_replicas_every: Option<u64>,
    /// Whether every step overwrites the module's buffers (BatchNorm's running statistics)
    /// with rank 0's, as DDP's `broadcast_buffers`.
    #[config(default = true)]
    pub broadcast_buffers: bool,
}

/// Bytes held by the sharded state of one rank, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardMemory {
    /// Elements of the flat trainable parameter vector (P).
    pub params: usize,
    /// Elements of this rank's shard.
    pub shard: usize,
    /// Elements of the longest shard of any rank: what every rank hands to the all-gather.
    pub longest_shard: usize,
    /// Bytes of optimizer state this rank keeps (moments of its shard).
    pub optimizer_bytes: usize,
    /// Bytes of gradient buffers this rank keeps between steps (stage 1: the full local
    /// gradient; stage 2: its shard).
    pub gradient_bytes: usize,
}

/// Time and volume of the sharded steps since the last
/// [`take_stats`](ShardedDataParallel::take_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ZeroStats {
    /// Steps taken.
    pub steps: u64,
    /// Packing gradients and waiting for the reduce-scatters.
    pub reduce: Duration,
    /// The optimizer update of the shard.
    pub update: Duration,
    /// The all-gather of the parameters and loading them into the module.
    pub gather: Duration,
    /// Elements this rank handed to collectives, times their size (the buffers of the
    /// reduce-scatters and the all-gather, as DDP counts its all-reduce buffers).
    pub bytes: u64,
}

/// A bucket: a contiguous range of the flat parameter vector and this rank's chunk of it.
#[derive(Debug, Clone)]
struct Bucket {
    /// The bucket's range in the flat vector.
    range: Range<usize>,
    /// This rank's chunk, in flat coordinates.
    mine: Range<usize>,
    /// Where this rank's chunk starts in its shard.
    shard_offset: usize,
}

/// Data parallelism with sharded optimizer state (and gradients): replaces both
/// [`DistributedDataParallel`] and burn's optimizer in the loop.
///
/// ```text
/// let adam = ShardOptimizer::Adam(ShardedAdamConfig::new());
/// let (mut model, mut zero) =
///     ShardedDataParallel::new(model, pg, ZeroConfig::new(ZeroStage::Two), adam)?;
/// for (x, y) in loader {
///     let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
///     model = zero.step(lr, model, grads)?;
/// }
/// ```
pub struct ShardedDataParallel {
    /// The parameter list, the checks and the buffer broadcast (without gradient buckets).
    ddp: DistributedDataParallel,
    stage: ZeroStage,
    optimizer: ShardOptimizer,
    /// Indices of the trainable parameters in `ddp.params()`, and each one's flat offset.
    trainable: Vec<usize>,
    offsets: Vec<usize>,
    /// Elements of each trainable parameter.
    numels: Vec<usize>,
    /// P: elements of the flat trainable vector.
    total: usize,
    /// Largest bucket, in elements.
    cap: usize,
    buckets: Vec<Bucket>,
    /// Every rank's buckets (`plans[rank]` is `buckets`): where each rank's chunks lie.
    plans: Vec<Vec<Bucket>>,
    /// The pieces of this rank's shard as (visiting index, element range in the parameter),
    /// in shard order.
    pieces: Vec<(usize, Range<usize>)>,
    /// Elements of this rank's shard, and the longest shard of any rank.
    shard_len: usize,
    max_shard_len: usize,
    /// Step count of every trainable parameter (burn's per-parameter Adam `time`).
    times: Vec<u64>,
    /// The optimizer's state vectors over this rank's shard.
    state: Vec<Vec<f32>>,
    /// Stage 1: the local gradient sum since the last step (P elements, or empty before the
    /// first micro-step). Stage 2: the sum over ranks of this rank's shard (shard_len).
    grad: Vec<f32>,
    /// Local presence of each trainable parameter's gradient since the last step.
    presence: Vec<f32>,
    micro_steps: usize,
    stats: ZeroStats,
    /// Steps taken, the ones of a loaded state included: recorded in the saved states, so
    /// that shard files of different checkpoints are told apart.
    steps: u64,
    /// This run's id, the same on every rank (rank 0's, broadcast at construction; a loaded
    /// state's run once loaded): recorded in the saved states, so that another run's shard
    /// files are told apart.
    run: u64,
}

impl ShardedDataParallel {
    /// Checks that every rank has the same parameter list, broadcasts rank 0's values (as
    /// [`DistributedDataParallel::new`]), lays out the shards and allocates this rank's
    /// optimizer state. Every rank calls it at the same point.
    pub fn new<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: ZeroConfig,
        optimizer: ShardOptimizer,
    ) -> Result<(M, Self), DdpError> {
        if config.bucket_cap_mb.is_nan() || config.bucket_cap_mb <= 0.0 {
            return Err(DdpError::Config(format!(
                "bucket_cap_mb must be positive (it is {})",
                config.bucket_cap_mb
            )));
        }
        let ddp_config = DdpConfig::new()
            .with_check_replicas_every(config.check_replicas_every)
            .with_broadcast_buffers(config.broadcast_buffers);
        let (model, ddp) = DistributedDataParallel::with_buckets(model, pg, ddp_config, false)?;
        let params = ddp.params();
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
        let trainable: Vec<usize> = (0..params.len())
            .filter(|&i| params[i].trainable())
            .collect();
        let mut offsets = Vec::with_capacity(trainable.len());
        let mut total = 0;
        for &i in &trainable {
            offsets.push(total);
            total += params[i].numel();
        }
        let (world, rank) = (ddp.process_group().world_size(), ddp.process_group().rank());
        let cap = ((config.bucket_cap_mb * MIB / 4.0) as usize).max(world);
        let plans: Vec<Vec<Bucket>> = (0..world)
            .map(|r| plan_shards(total, cap, world, r))
            .collect();
        let buckets = plans[rank].clone();
        let len_of = |plan: &[Bucket]| plan.iter().map(|b| b.mine.len()).sum::<usize>();
        let shard_len = len_of(&buckets);
        let max_shard_len = plans.iter().map(|p| len_of(p)).max().unwrap_or(0);
        let mut pieces = Vec::new();
        for b in &buckets {
            let mut at = b.mine.start;
            while at < b.mine.end {
                let k = offsets.partition_point(|&o| o <= at) - 1;
                let end = (offsets[k] + params[trainable[k]].numel()).min(b.mine.end);
                pieces.push((trainable[k], at - offsets[k]..end - offsets[k]));
                at = end;
            }
        }
        let state = vec![vec![0.0; shard_len]; optimizer.state_vectors()];
        let run = ddp
            .process_group()
            .broadcast(vec![new_run_id() as i64], 0)?[0] as u64;
        let numels = trainable.iter().map(|&i| params[i].numel()).collect();
        let zero = Self {
            numels,
            cap,
            ddp,
            stage: config.stage,
            optimizer,
            presence: vec![0.0; trainable.len()],
            times: vec![0; trainable.len()],
            trainable,
            offsets,
            total,
            buckets,
            plans,
            pieces,
            shard_len,
            max_shard_len,
            state,
            grad: Vec::new(),
            micro_steps: 0,
            stats: ZeroStats::default(),
            steps: 0,
            run,
        };
        Ok((model, zero))
    }

    /// The process group.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        self.ddp.process_group()
    }

    /// The parameter list every rank agreed on (frozen parameters and buffers included).
    pub fn params(&self) -> &[ParamInfo] {
        self.ddp.params()
    }

    /// The stage in force.
    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The optimizer the shards are stepped with.
    pub fn optimizer(&self) -> &ShardOptimizer {
        &self.optimizer
    }

    /// This rank's shard: the ranges of the flat trainable parameter vector it owns, in shard
    /// order (one per bucket; see the module documentation).
    pub fn shard_ranges(&self) -> Vec<Range<usize>> {
        self.buckets.iter().map(|b| b.mine.clone()).collect()
    }

    /// What this rank keeps, in elements and bytes.
    pub fn memory(&self) -> ShardMemory {
        let gradient_elems = match self.stage {
            ZeroStage::One => self.total,
            ZeroStage::Two => self.shard_len,
        };
        ShardMemory {
            params: self.total,
            shard: self.shard_len,
            longest_shard: self.max_shard_len,
            optimizer_bytes: 4 * self.shard_len * self.optimizer.state_vectors(),
            gradient_bytes: 4 * gradient_elems,
        }
    }

    /// Statistics since the last call, then reset.
    pub fn take_stats(&mut self) -> ZeroStats {
        std::mem::take(&mut self.stats)
    }

    /// Checks that every replica holds bit-identical parameters
    /// ([`DistributedDataParallel::check_replicas`]). A collective.
    pub fn check_replicas<M: Module>(&self, model: &M) -> Result<(), DdpError> {
        self.ddp.check_replicas(model)
    }

    /// Gradient accumulation (PyTorch's `no_sync`): stage 1 adds this micro-step's gradients
    /// into the local buffer, without communication; stage 2 reduce-scatters them at once and
    /// adds this rank's shard (a collective: every rank calls it the same number of times).
    /// The next [`step`](Self::step) uses the sum over micro-steps, averaged over ranks.
    pub fn accumulate<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<(), DdpError> {
        let start = Instant::now();
        let result = match self.stage {
            ZeroStage::One => self.pack_local(grads),
            ZeroStage::Two => {
                // A collective: local failures must travel with it.
                let local = self.ddp.check_same_params(model).err();
                let taken = self.take_all(grads);
                let (grads, local) = match (taken, local) {
                    (Ok(g), None) => (g, None),
                    (Ok(g), Some(e)) => (g, Some(e)),
                    (Err(e), _) => (Vec::new(), Some(e)),
                };
                self.exchange_failures(local, false)?;
                self.reduce_scatter_from(&GradSource::Params(&grads))
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
    /// Before the gradients, as [`DistributedDataParallel::sync`] does, it checks that `model`
    /// holds the parameters it was created with and broadcasts rank 0's buffers. A failure on
    /// one rank fails the step on every rank ([`DdpError::PeerFailed`] names the rank) before
    /// any parameter or optimizer state changes.
    pub fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        grads: GradientsParams,
    ) -> Result<M, DdpError> {
        let start = Instant::now();
        let mut local = self.ddp.begin_sync(&model)?;
        let taken = self.take_all(grads);
        let grads = match taken {
            Ok(g) => g,
            Err(e) => {
                local.get_or_insert(e);
                Vec::new()
            }
        };
        // Stage 1 with accumulated micro-steps adds this one to its buffer; otherwise the
        // gradients are reduce-scattered straight from burn's tensors.
        let from_buffer = self.stage == ZeroStage::One && self.micro_steps > 0;
        if from_buffer && local.is_none() {
            self.add_local(&grads);
        }
        let present = self.exchange_failures(local, true)?;
        // The averaged gradient of this rank's shard.
        let world = self.process_group().world_size();
        if from_buffer {
            let local = std::mem::take(&mut self.grad);
            self.reduce_scatter_from(&GradSource::Flat(&local))?;
        } else {
            self.reduce_scatter_from(&GradSource::Params(&grads))?;
        }
        drop(grads);
        let mut avg = std::mem::take(&mut self.grad);
        let denom = world as f32;
        avg.iter_mut().for_each(|x| *x /= denom);
        self.micro_steps = 0;
        self.presence.fill(0.0);
        let reduced = Instant::now();
        self.stats.reduce += reduced - start;

        // Step the shard, parameter piece by parameter piece: only this rank's pieces of the
        // parameters are read.
        let mut shard = read_pieces(&model, &self.pieces)?;
        for b in &self.buckets {
            let mut at = b.mine.start;
            while at < b.mine.end {
                // The trainable parameter holding flat element `at`.
                let p = self.offsets.partition_point(|&o| o <= at) - 1;
                let end = (self.offsets[p] + self.numels[p]).min(b.mine.end);
                let s = b.shard_offset + (at - b.mine.start);
                let n = end - at;
                if present[p] > 0.0 {
                    let mut state: Vec<&mut [f32]> =
                        self.state.iter_mut().map(|v| &mut v[s..s + n]).collect();
                    self.optimizer.update(
                        lr,
                        self.times[p],
                        &mut shard[s..s + n],
                        &avg[s..s + n],
                        &mut state,
                    );
                }
                at = end;
            }
        }
        for (t, &count) in self.times.iter_mut().zip(&present) {
            if count > 0.0 {
                *t += 1;
            }
        }
        drop(avg);
        let updated = Instant::now();
        self.stats.update += updated - reduced;

        // Every rank's updated shard, into every replica: each parameter is assembled from
        // the ranks' blocks and becomes a new tensor (one copy).
        shard.resize(self.max_shard_len, 0.0);
        self.stats.bytes += 4 * shard.len() as u64;
        let all = self.process_group().all_gather(shard)?;
        let keep = |i: usize| self.trainable.binary_search(&i).is_ok();
        let model = load_with(model, &keep, &mut |index, n| {
            let k = self.trainable.binary_search(&index).ok()?;
            Some(self.assemble(&all, self.offsets[k], n))
        });
        self.stats.gather += updated.elapsed();
        self.stats.steps += 1;
        self.steps += 1;
        Ok(model)
    }

    /// The flat range `offset..offset + n` of the parameters from the all-gathered blocks
    /// `all` (rank r's shard at `r * max_shard_len`).
    fn assemble(&self, all: &[f32], offset: usize, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        let mut at = offset;
        while at < offset + n {
            let b = at / self.cap;
            let Some(plan) = self.plans.iter().position(|p| p[b].mine.contains(&at)) else {
                unreachable!("every element has an owner (plan_shards)")
            };
            let chunk = &self.plans[plan][b];
            let end = chunk.mine.end.min(offset + n);
            let src = plan * self.max_shard_len + chunk.shard_offset + (at - chunk.mine.start);
            out.extend_from_slice(&all[src..src + (end - at)]);
            at = end;
        }
        out
    }

    /// The header of this run's consolidated state (its optimizer, parameters, step counts).
    fn state_header(&self) -> StateHeader {
        StateHeader {
            optimizer: self.optimizer.name().into(),
            vectors: self.optimizer.state_vectors(),
            params: self
                .trainable
                .iter()
                .map(|&i| (self.params()[i].name.clone(), self.params()[i].numel()))
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
            rank: self.process_group().rank(),
            ranges: self
                .buckets
                .iter()
                .map(|b| (b.mine.start, b.mine.end))
                .collect(),
        });
        header
    }

    /// The whole optimizer state in one piece (PyTorch's `consolidate_state_dict(to=0)`): rank
    /// 0 returns the encoded state, independent of the world size, the others `None`. A
    /// collective: every rank calls it at the same point.
    ///
    /// Each rank's shard of each state vector travels in a broadcast from that rank (the
    /// process group has no gather to one rank): every rank receives it, but only rank 0 keeps
    /// it, so that the others never hold more than one shard at a time. Rank 0 briefly holds
    /// the whole state.
    pub fn consolidated_state(&self) -> Result<Option<Vec<u8>>, DdpError> {
        let pg = self.process_group();
        let (world, rank) = (pg.world_size(), pg.rank());
        let mut vectors = Vec::with_capacity(self.state.len());
        for v in &self.state {
            let mut full = if rank == 0 {
                vec![0.0; self.total]
            } else {
                Vec::new()
            };
            for r in 0..world {
                let mut block = if r == rank { v.clone() } else { Vec::new() };
                block.resize(self.max_shard_len, 0.0);
                let block = pg.broadcast(block, r)?;
                if rank != 0 {
                    continue;
                }
                let mut offset = 0;
                for b in &self.plans[r] {
                    full[b.mine.clone()].copy_from_slice(&block[offset..offset + b.mine.len()]);
                    offset += b.mine.len();
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
    /// any world size): this rank keeps its shard of it and every parameter's step count.
    /// Local: every rank calls it with the same bytes (e.g. from [`crate::resume_sharded`]).
    /// A state of another optimizer or parameter list is an error naming the field, and
    /// nothing is changed. `name` names the source in errors.
    pub fn load_consolidated(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let (header, vectors) = decode(bytes, &self.state_header(), name)?;
        let mut state = vec![Vec::with_capacity(self.shard_len); vectors.len()];
        for (dst, full) in state.iter_mut().zip(&vectors) {
            for b in &self.buckets {
                dst.extend_from_slice(&full[b.mine.clone()]);
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

    /// Takes every trainable parameter's gradient out of `grads` (`None`: no gradient this
    /// micro-step) and records local presence; gradients of unknown parameters are an error.
    fn take_all(&mut self, mut grads: GradientsParams) -> Result<Vec<Option<Vec<f32>>>, DdpError> {
        let mut out = Vec::with_capacity(self.trainable.len());
        for (k, &i) in self.trainable.iter().enumerate() {
            let g = take_grad(&mut grads, &self.ddp.params()[i])?;
            if g.is_some() {
                self.presence[k] = 1.0;
            }
            out.push(g);
        }
        if !grads.is_empty() {
            return Err(DdpError::ParamsChanged {
                name: "?".into(),
                detail: format!(
                    "{} gradients belong to parameters with ids the wrapper does not know",
                    grads.len()
                ),
            });
        }
        Ok(out)
    }

    /// Stage 1's `accumulate`: adds the gradients into the local buffer.
    fn pack_local(&mut self, grads: GradientsParams) -> Result<(), DdpError> {
        let grads = self.take_all(grads)?;
        self.add_local(&grads);
        Ok(())
    }

    /// Adds per-parameter gradients into stage 1's local buffer of P elements.
    fn add_local(&mut self, grads: &[Option<Vec<f32>>]) {
        if self.grad.len() != self.total {
            self.grad = vec![0.0; self.total];
        }
        for (g, &off) in grads.iter().zip(&self.offsets) {
            if let Some(g) = g {
                let dst = &mut self.grad[off..off + g.len()];
                if self.micro_steps == 0 {
                    dst.copy_from_slice(g);
                } else {
                    dst.iter_mut().zip(g).for_each(|(d, s)| *d += s);
                }
            }
        }
    }

    /// One small all-reduce of the local presence counts (when `with_presence`) and the
    /// failure slots. Returns the presence of every trainable parameter summed over ranks, or
    /// the error every rank returns when some rank failed: its own, or [`DdpError::PeerFailed`].
    fn exchange_failures(
        &mut self,
        local: Option<DdpError>,
        with_presence: bool,
    ) -> Result<Vec<f32>, DdpError> {
        let mut header = if with_presence {
            self.presence.clone()
        } else {
            Vec::new()
        };
        let failed = local.is_some();
        let rank = self.process_group().rank();
        header.push(if failed { 1.0 } else { 0.0 });
        header.push(if failed { (rank + 1) as f32 } else { 0.0 });
        self.stats.bytes += 4 * header.len() as u64;
        let mut sums = self.process_group().all_reduce(header, ReduceOp::Sum)?;
        let ranks = sums.pop().unwrap_or(0.0);
        let count = sums.pop().unwrap_or(0.0);
        if let Some(e) = local {
            self.micro_steps = 0;
            self.grad.clear();
            self.presence.fill(0.0);
            return Err(e);
        }
        if count > 0.0 {
            self.micro_steps = 0;
            self.grad.clear();
            self.presence.fill(0.0);
            let world = self.process_group().world_size();
            return Err(peer_failed(self.ddp.syncs(), count, ranks, world));
        }
        Ok(sums)
    }

    /// Reduce-scatters the local gradient bucket by bucket (at most two buckets in flight)
    /// and adds this rank's chunks into its shard of the gradient (`self.grad`, created on the
    /// first call since the last step).
    fn reduce_scatter_from(&mut self, source: &GradSource) -> Result<(), DdpError> {
        if self.grad.len() != self.shard_len {
            self.grad = vec![0.0; self.shard_len];
        }
        let pg = Arc::clone(self.process_group());
        let mut pending: Option<(usize, Work<Vec<f32>>)> = None;
        let mut first_error = None;
        for k in 0..=self.buckets.len() {
            if k < self.buckets.len() {
                let range = self.buckets[k].range.clone();
                let mut buf = vec![0.0; range.len()];
                self.fill(source, range, &mut buf);
                self.stats.bytes += 4 * buf.len() as u64;
                let work = pg.submit_reduce_scatter(buf, ReduceOp::Sum);
                if let Some((j, w)) = pending.replace((k, work)) {
                    if let Err(e) = self.add_chunk(j, w) {
                        first_error.get_or_insert(e);
                    }
                }
            } else if let Some((j, w)) = pending.take() {
                if let Err(e) = self.add_chunk(j, w) {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Waits for bucket `k`'s reduce-scatter and adds the chunk into the shard's gradient.
    fn add_chunk(&mut self, k: usize, work: Work<Vec<f32>>) -> Result<(), DdpError> {
        let chunk = work.wait()?;
        let b = &self.buckets[k];
        if chunk.len() != b.mine.len() {
            return Err(DdpError::Config(format!(
                "bucket {k}: the reduce-scatter returned {} elements, this rank's chunk has {}",
                chunk.len(),
                b.mine.len()
            )));
        }
        let dst = &mut self.grad[b.shard_offset..b.shard_offset + chunk.len()];
        dst.iter_mut().zip(&chunk).for_each(|(d, s)| *d += s);
        Ok(())
    }

    /// Copies the flat range `range` of the local gradient into `dst` (zeros where a
    /// parameter got no gradient).
    fn fill(&self, source: &GradSource, range: Range<usize>, dst: &mut [f32]) {
        match source {
            GradSource::Flat(flat) => {
                if flat.is_empty() {
                    dst.fill(0.0);
                } else {
                    dst.copy_from_slice(&flat[range]);
                }
            }
            GradSource::Params(grads) => {
                let mut at = range.start;
                while at < range.end {
                    let p = self.offsets.partition_point(|&o| o <= at) - 1;
                    let start = self.offsets[p];
                    let end = (start + self.numels[p]).min(range.end);
                    let out = &mut dst[at - range.start..end - range.start];
                    match &grads[p] {
                        Some(g) => out.copy_from_slice(&g[at - start..end - start]),
                        None => out.fill(0.0),
                    }
                    at = end;
                }
            }
        }
    }
}

/// Where the local gradient of a step comes from.
enum GradSource<'a> {
    /// Stage 1's flat buffer (empty: no gradient at all).
    Flat(&'a [f32]),
    /// Each trainable parameter's gradient, as taken from burn's `GradientsParams`.
    Params(&'a [Option<Vec<f32>>]),
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

/// The buckets of a flat vector of `total` elements (contiguous ranges of at most `cap`
/// elements) and the chunk rank `rank` of `world` owns in each: `chunk_range`, the
/// reduce-scatter's split.
fn plan_shards(total: usize, cap: usize, world: usize, rank: usize) -> Vec<Bucket> {
    let mut buckets = Vec::new();
    let mut shard_offset = 0;
    let mut start = 0;
    while start < total {
        let end = (start + cap).min(total);
        let chunk = chunk_range(end - start, world, rank);
        let mine = start + chunk.start..start + chunk.end;
        buckets.push(Bucket {
            range: start..end,
            mine: mine.clone(),
            shard_offset,
        });
        shard_offset += mine.len();
        start = end;
    }
    buckets
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_every_element_once_and_are_balanced() {
        for (total, cap, world) in [(10, 4, 3), (1, 25, 4), (1000, 64, 4), (7, 100, 2)] {
            let mut owner = vec![usize::MAX; total];
            let mut lens = Vec::new();
            for r in 0..world {
                let mut len = 0;
                for b in plan_shards(total, cap, world, r) {
                    assert!(b.range.len() <= cap);
                    assert_eq!(b.shard_offset, len);
                    for e in b.mine.clone() {
                        assert_eq!(owner[e], usize::MAX, "element {e} owned twice");
                        owner[e] = r;
                    }
                    len += b.mine.len();
                }
                lens.push(len);
            }
            assert!(owner.iter().all(|&o| o < world), "{total} {cap} {world}");
            let buckets = total.div_ceil(cap);
            let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
            assert!(hi - lo <= buckets, "{lens:?}");
            assert_eq!(lens.iter().sum::<usize>(), total);
        }
    }
}
