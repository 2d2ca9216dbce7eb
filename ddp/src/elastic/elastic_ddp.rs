//! [`ElasticDdp`]: data parallelism whose ranks may leave and join while the job runs, for a
//! user's own loop: one call per step ([`ElasticDdp::step`]) says whether the step was
//! committed or gives the new membership (torchft's `Manager` is the model).
//!
//! What a step does, on top of [`DistributedDataParallel`] (or [`ShardedDataParallel`]):
//! backward and the gradient collectives as always, then the commit vote of
//! [`ddp_comm::ElasticGroup::should_commit`] (one all-reduce of one integer), then the optimizer
//! step. With no elastic setting none of this runs: the loop uses the wrappers as before.
//!
//! When a collective fails (a rank died or froze) the survivors re-form the group at the
//! smaller world without exiting (`ddp_comm::ElasticGroup::reform`), agree on the last step
//! that every one of them can reach, and go on from memory: a step whose averaged gradients
//! some survivor committed is applied by every survivor (each holds those gradients: the vote
//! promises it); a step nobody committed is dropped by every survivor. No checkpoint is read.
//! When processes wait to join, every member stops at the same step boundary (the vote says
//! so), and the new group heals the joiners from rank 0, a survivor: the weights as raw `f32`
//! (the wrapper's broadcast of rank 0's values, in place), rank 0's burn parameter ids with
//! burn's optimizer record (DDP) or the resharded optimizer state (ZeRO, `elastic/reshard.rs`),
//! and the run's [`Progress`] (step, epoch, position in the epoch, and bytes of the caller's
//! own: its RNG state, its loss sums), all over the group's own transport. A heal that fails
//! in the group (a joiner died during it) changes no survivor's committed state: the heal
//! works on a clone of the model sharing its tensors, and the survivors re-form again without
//! the dead one; a rank being healed whose heal fails returns the error (it holds part of
//! rank 0's state at most).
//!
//! ZeRO keeps each step's starting point until the vote (the wrapper steps into a second set of
//! buffers, reused from step to step: `ShardedDataParallel::keep_starting_points`): a failure
//! in the middle of a sharded step leaves each rank's shard updated or not, so dropping the
//! step needs it. The shard of a rank that died is lost with it: every parameter with a lost
//! element starts its optimizer again (moments zero and step count 0 together, on every rank:
//! `elastic/reshard.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, Tensor};
use ddp_comm::membership::Left;
use ddp_comm::{CommError, Continue, ElasticGroup, ProcessGroup, StepStatus, Vote};

use crate::config::{CommHookKind, DdpConfig};
use crate::ddp::DistributedDataParallel;
use crate::elastic::heal_hooks::HealScope;
use crate::elastic::reshard::reshard;
use crate::gradients::agree::Start;
use crate::gradients::stats::SyncStats;
use crate::optim::shard_optim::ShardOptimizer;
use crate::params::param_ids;
use crate::zero::{ShardedDataParallel, ZeroConfig};
use crate::DdpError;

/// Where an elastic run stands after its last committed step: what a joining rank receives
/// from rank 0. The loop says what it will be after each step ([`ElasticDdp::step`]'s
/// `after`); it becomes the run's only once the step is committed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    /// Optimizer steps committed.
    pub step: u64,
    /// The epoch in progress.
    pub epoch: u64,
    /// The position in the epoch (for an elastic sampler, such as ddp-data's
    /// `ElasticSampler`: the samples of the epoch trained; after a step, its
    /// `ElasticStep::next`, which is right also for the epoch's last, shorter step).
    pub position: u64,
    /// Bytes of the caller's own (its RNG state, its loss sums, ...).
    pub extra: Vec<u8>,
}

/// How the optimizer step is taken, kept to rebuild the wrapper for every generation.
pub enum ElasticOptimizer {
    /// [`DistributedDataParallel`] averages the gradients, burn's optimizer steps every rank's
    /// whole model.
    Ddp {
        /// The wrapper's settings.
        config: DdpConfig,
        /// burn's optimizer (its state travels to joiners as burn's record).
        optim: ModuleOptimizer,
    },
    /// [`ShardedDataParallel`] (ZeRO stage 1 or 2).
    Zero {
        /// The wrapper's settings.
        config: ZeroConfig,
        /// The sharded optimizer.
        optimizer: ShardOptimizer,
    },
}

/// What [`ElasticDdp::step`] says.
#[derive(Debug)]
pub enum Outcome {
    /// The step was committed on every rank; nothing changed.
    Committed,
    /// The membership changed at this step: the step was committed when
    /// [`Membership::dropped`] is `false` (and [`Membership::healed`] too: a healed rank took
    /// rank 0's state instead), dropped on every rank alike otherwise; the world may have
    /// another size. Plan the next step from [`ElasticDdp::progress`] and the new rank and
    /// world size, either way.
    Changed(Membership),
    /// The job finished while this rank was re-forming (others ended it): stop. This is not
    /// how a loop ends otherwise: every rank plans from the same committed progress, so every
    /// rank sees the data end at the same step, leaves its loop there and calls
    /// [`ElasticDdp::finish`].
    Finished,
}

/// A change of membership, as a rank sees it.
#[derive(Debug, Clone)]
pub struct Membership {
    /// The generation of the job (1 is the founding one).
    pub generation: u64,
    /// This rank in it.
    pub rank: usize,
    /// Its world size.
    pub world_size: usize,
    /// Slots that joined.
    pub joined: Vec<usize>,
    /// Ranks of the old generation that left, and why.
    pub left: Vec<Left>,
    /// Whether the step in flight was dropped (its samples are trained again).
    pub dropped: bool,
    /// Whether this rank was healed from rank 0 (it joined, or was left out and came back).
    pub healed: bool,
    /// The optimizer-state elements lost with the ranks that left (ZeRO only); each parameter
    /// with a lost element starts its optimizer again as a whole (moments and step count).
    pub lost_state: usize,
}

/// The wrapper of the current generation.
// One per run, never moved in a loop: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Wrapped {
    Ddp(DistributedDataParallel),
    Zero(ShardedDataParallel),
}

/// A step that finished on this rank but whose vote did not complete: applied if another
/// survivor committed it, dropped otherwise.
enum Finished<M> {
    /// DDP: the averaged gradients, not yet applied.
    Ddp {
        grads: GradientsParams,
        lr: f64,
        after: Progress,
    },
    /// ZeRO: the stepped model and this rank's shard after the step.
    Zero {
        model: M,
        shard: Vec<u8>,
        after: Progress,
    },
}

/// An elastic data-parallel run: the membership, the model, the optimizer and the run's
/// committed [`Progress`]. See the module documentation.
///
/// A whole program under `ddprun --nnodes MIN:MAX` (the repository's `docs/guide.md`, section 9,
/// says what each part means): it joins (`Ok(None)`: the job finished before it could), plans
/// every step from the committed [`Progress`] with ddp-data's `ElasticSampler` (whose
/// `ElasticStep::next` is the position after the step), rolls over to the next epoch on every
/// rank alike, stops after the last one and says so ([`finish`](Self::finish)).
///
/// ```no_run
/// use burn::module::Module;
/// use burn::nn::{Linear, LinearConfig};
/// use burn::optim::AdamConfig;
/// use burn::tensor::{Device, Tensor, TensorData};
/// use ddp::{DdpConfig, ElasticConfig, ElasticDdp, ElasticGroup, ElasticOptimizer, Outcome, Progress};
/// use ddp_data::ElasticSampler;
///
/// #[derive(Module, Debug)]
/// struct Model {
///     fc: Linear,
/// }
///
/// /// Your data: the samples `indices` as inputs and targets.
/// fn batch(indices: &[usize], device: &Device) -> (Tensor<2>, Tensor<2>) {
///     let x: Vec<f32> = indices.iter().flat_map(|&i| [i as f32 / 1000.0, 1.0]).collect();
///     let y: Vec<f32> = indices.iter().map(|&i| i as f32 / 500.0).collect();
///     let n = indices.len();
///     let x = Tensor::from_data(TensorData::new(x, [n, 2]), device);
///     (x, Tensor::from_data(TensorData::new(y, [n, 1]), device))
/// }
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     let device = Device::flex().autodiff();
///     let (epochs, lr, batch_size) = (2, 1e-3, 8);
///     // What every rank must share, one `name = value` per line: a process with another value
///     // is refused at join, naming the setting and both values, and the job goes on.
///     let compat = format!("model = linear 2-1\nlr = {lr}\nbatch size = {batch_size}");
///     let config = ElasticConfig::from_env(&compat)?.ok_or("not under ddprun --nnodes MIN:MAX")?;
///     let Some(group) = ElasticGroup::join(config)? else {
///         return Ok(()); // the job finished before this process could join: nothing to do
///     };
///     let model = Model { fc: LinearConfig::new(2, 1).init(&device) };
///     let optim = AdamConfig::new().init();
///     let optimizer = ElasticOptimizer::Ddp { config: DdpConfig::new(), optim };
///     let mut run = ElasticDdp::start(group, model, optimizer, Progress::default())?;
///     let mut sampler = ElasticSampler::new(1000, batch_size)?;
///     let mut order = sampler.order();
///     loop {
///         let p = run.progress().clone(); // plan every step from the committed progress
///         if sampler.epoch() != p.epoch {
///             sampler.set_epoch(p.epoch);
///             order = sampler.order();
///         }
///         let (rank, world) = (run.rank(), run.world_size());
///         let Some(share) = sampler.step(&order, p.position as usize, world, rank) else {
///             if p.epoch + 1 == epochs {
///                 break; // the last epoch is over: on every rank at the same step
///             }
///             run.set_progress(Progress { epoch: p.epoch + 1, position: 0, ..p });
///             continue;
///         };
///         let (x, y) = batch(&share.indices, &device);
///         let loss = (run.prepare().fc.forward(x) - y).powi_scalar(2).mean();
///         let loss = loss.mul_scalar(share.loss_scale); // the step's mean over its samples
///         let after = Progress { step: p.step + 1, position: share.next as u64, ..p };
///         match run.step(lr, loss, after)? {
///             Outcome::Committed => {}
///             // Committed unless `dropped`; plan the next step from `progress()` either way.
///             Outcome::Changed(m) => println!("generation {}: world {}", m.generation, m.world_size),
///             Outcome::Finished => break, // others ended the job while this rank re-formed
///         }
///     }
///     let _model = run.finish()?; // the job is over: a process that joins from now on exits
///     Ok(())
/// }
/// ```
pub struct ElasticDdp<M: Module> {
    group: ElasticGroup,
    model: Option<M>,
    wrapped: Option<Wrapped>,
    optimizer: ElasticOptimizer,
    progress: Progress,
    /// Processes waiting to join are admitted only once this step is committed.
    joins_from: u64,
    /// When this rank finished its last committed step.
    committed_at: Option<SystemTime>,
    /// Time spent in the commit vote, all steps together.
    vote_time: Duration,
    /// Steps whose backward pass was skipped: the group had failed before it began.
    backwards_skipped: u64,
    /// The communication statistics of the wrappers of ended generations, not taken yet.
    banked: SyncStats,
}

impl<M: Module> ElasticDdp<M> {
    /// Wraps `model` in the group's first generation. A founding rank starts from rank 0's
    /// weights (the wrapper broadcasts them) and `progress`; a rank that joined a running job
    /// is healed from rank 0 instead (weights, optimizer state, progress). Every member of the
    /// generation calls it at the same point.
    ///
    /// Refused before any collective, with the reason: PowerSGD ([`DdpConfig::comm_hook`]).
    /// Its error feedback is each rank's own residual of the compressed gradients: a lost rank
    /// takes its part of the gradient along, a joiner has none (and another step count, hence
    /// other collectives), and a new generation would start a fresh hook.
    pub fn start(
        group: ElasticGroup,
        model: M,
        optimizer: ElasticOptimizer,
        progress: Progress,
    ) -> Result<ElasticDdp<M>, DdpError> {
        refuse_stateful_hook(&optimizer)?;
        let healed = group.joined_running();
        let mut run = ElasticDdp {
            group,
            model: Some(model),
            wrapped: None,
            banked: SyncStats::default(),
            optimizer,
            progress,
            joins_from: 0,
            committed_at: None,
            vote_time: Duration::ZERO,
            backwards_skipped: 0,
        };
        match run.heal_and_wrap(healed, None) {
            Ok(_) => Ok(run),
            Err(e) if healed => {
                let generation = run.group.generation().number;
                Err(heal_failed(generation, run.group.rank(), e))
            }
            Err(e) => Err(e),
        }
    }

    /// The model of the last committed step.
    pub fn model(&self) -> &M {
        self.model
            .as_ref()
            .expect("the model is back after every call")
    }

    /// When (the wall clock) this rank finished its last committed step, `None` before the
    /// first: to time a run. A step after which processes join returns only once the group has
    /// re-formed and healed them, so the time [`step`](Self::step) returns is not the step's.
    pub fn committed_at(&self) -> Option<SystemTime> {
        self.committed_at
    }

    /// The time this rank has spent in the commit vote (one all-reduce of one integer after
    /// each step's gradient collectives), all steps together: what the elastic setting adds
    /// to a step where nothing fails.
    pub fn vote_time(&self) -> Duration {
        self.vote_time
    }

    /// Steps whose backward pass this rank skipped because the group had already failed when
    /// [`step`](Self::step) was called (the step was dropped, as a failed collective drops it):
    /// a survivor of a death during the forward pass goes to the re-form at once.
    pub fn backwards_skipped(&self) -> u64 {
        self.backwards_skipped
    }

    /// The communication statistics since the last call, every generation's wrapper together
    /// (a sharded step's as [`SyncStats::from`] gives them): what
    /// [`DistributedDataParallel::take_stats`] says of one wrapper.
    pub fn take_stats(&mut self) -> SyncStats {
        let mut stats = std::mem::take(&mut self.banked);
        stats.add(&self.wrapper_stats());
        stats
    }

    /// The current wrapper's statistics since they were last taken (none without a wrapper).
    fn wrapper_stats(&mut self) -> SyncStats {
        match self.wrapped.as_mut() {
            Some(Wrapped::Ddp(ddp)) => ddp.take_stats(),
            Some(Wrapped::Zero(zero)) => zero.take_stats().into(),
            None => SyncStats::default(),
        }
    }

    /// The run's progress after its last committed step.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Replaces the run's progress (on every rank alike, outside a step: after a resume, at an
    /// epoch's end).
    pub fn set_progress(&mut self, progress: Progress) {
        self.progress = progress;
    }

    /// Admits processes that wait to join only at the boundaries after step `step` is
    /// committed (default 0: at the first boundary after they asked): to grow at a planned
    /// step, or to replay a membership schedule (the same schedule gives the same bits). Every
    /// rank must set the same. Joiners that arrive while the group re-forms after a failure
    /// are admitted then, whatever this says.
    pub fn admit_joins_from(&mut self, step: u64) {
        self.joins_from = step;
    }

    /// The membership.
    pub fn elastic_group(&self) -> &ElasticGroup {
        &self.group
    }

    /// The current generation's process group (for evaluation, checkpoints: run them through
    /// [`collective`](Self::collective) so that a failure re-forms the group).
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        self.group.group()
    }

    /// This rank in the current generation.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The current generation's world size.
    pub fn world_size(&self) -> usize {
        self.group.world_size()
    }

    /// The DDP wrapper (`None` for ZeRO).
    pub fn ddp(&self) -> Option<&DistributedDataParallel> {
        match &self.wrapped {
            Some(Wrapped::Ddp(d)) => Some(d),
            _ => None,
        }
    }

    /// The ZeRO wrapper (`None` for DDP).
    pub fn zero(&self) -> Option<&ShardedDataParallel> {
        match &self.wrapped {
            Some(Wrapped::Zero(z)) => Some(z),
            _ => None,
        }
    }

    /// The ZeRO wrapper, to load a checkpoint's optimizer state (`None` for DDP).
    pub fn zero_mut(&mut self) -> Option<&mut ShardedDataParallel> {
        match &mut self.wrapped {
            Some(Wrapped::Zero(z)) => Some(z),
            _ => None,
        }
    }

    /// burn's optimizer (DDP only), for checkpoints.
    pub fn optim(&self) -> Option<&ModuleOptimizer> {
        match &self.optimizer {
            ElasticOptimizer::Ddp { optim, .. } => Some(optim),
            ElasticOptimizer::Zero { .. } => None,
        }
    }

    /// The model the next step's forward pass runs on: with overlap, a copy whose parameters
    /// report their gradients during backward (see [`DistributedDataParallel::prepare`]).
    pub fn prepare(&mut self) -> M {
        let model = self
            .model
            .as_ref()
            .expect("the model is back after every call");
        match self.wrapped.as_mut() {
            Some(Wrapped::Ddp(d)) => d.prepare(model),
            Some(Wrapped::Zero(z)) => z.prepare(model),
            None => model.clone(),
        }
    }

    /// One step: backward on `loss` (of the model [`prepare`](Self::prepare) or
    /// [`model`](Self::model) gave), the gradient collectives, the commit vote, the optimizer
    /// step with learning rate `lr`; the run's progress becomes `after` once the step is
    /// committed. A failure of the group re-forms it (see the module documentation) and says
    /// so ([`Outcome::Changed`]); so does a join. Errors that are not the group's (a gradient
    /// that cannot be read, the job below its minimum) are returned.
    pub fn step(&mut self, lr: f64, loss: Tensor<1>, after: Progress) -> Result<Outcome, DdpError> {
        let model = self
            .model
            .take()
            .expect("the model is back after every call");
        // The group failed while this step's forward pass ran (a peer died right after the
        // last commit, as a kill usually comes): its collectives would fail, so its backward
        // pass is not run. The step is dropped as a failed collective would drop it.
        if let Some(e) = self.group.group().failure() {
            drop(loss);
            self.model = Some(model);
            self.backwards_skipped += 1;
            return self.reform(false, Some(e), None);
        }
        match self.wrapped.as_mut().expect("wrapped between calls") {
            Wrapped::Ddp(ddp) => {
                let grads = match ddp.backward(&model, loss) {
                    Ok(grads) => grads,
                    Err(DdpError::Comm(e)) => {
                        self.model = Some(model);
                        return self.reform(false, Some(e), None);
                    }
                    Err(e) => {
                        self.model = Some(model);
                        return Err(e);
                    }
                };
                match timed_vote(&self.group, &mut self.vote_time) {
                    Ok(vote) => {
                        self.model = Some(self.apply_ddp(model, lr, grads));
                        self.progress = after;
                        self.committed_at = Some(SystemTime::now());
                        self.grow_if(vote)
                    }
                    Err(e) => {
                        self.model = Some(model);
                        let finished = Finished::Ddp { grads, lr, after };
                        self.reform(true, Some(e), Some(finished))
                    }
                }
            }
            Wrapped::Zero(zero) => match zero.try_backward_step(lr, model, loss) {
                Ok(stepped) => match timed_vote(&self.group, &mut self.vote_time) {
                    Ok(vote) => {
                        zero.commit_step();
                        self.model = Some(stepped);
                        self.progress = after;
                        self.committed_at = Some(SystemTime::now());
                        self.grow_if(vote)
                    }
                    Err(e) => {
                        // This rank's step, applied if a survivor committed it; the
                        // wrapper goes back to the starting point meanwhile.
                        let shard = zero.shard_state()?;
                        self.model = Some(zero.roll_back(stepped.clone())?);
                        let finished = Finished::Zero {
                            model: stepped,
                            shard,
                            after,
                        };
                        self.reform(true, Some(e), Some(finished))
                    }
                },
                Err((e, model)) => {
                    self.model = Some(model.ok_or_else(|| {
                        DdpError::Config(format!(
                            "elastic: the sharded step lost the model ({e}); it cannot go on"
                        ))
                    })?);
                    match e {
                        DdpError::Comm(e) => self.reform(false, Some(e), None),
                        e => Err(e),
                    }
                }
            },
        }
    }

    /// Runs `f` on the current group (an evaluation, a checkpoint): `Ok(Ok(result))`, or, when
    /// the group fails meanwhile, `Ok(Err(change))` once it has re-formed (no step was in
    /// flight: nothing is dropped); run `f` again then.
    pub fn collective<R>(
        &mut self,
        f: impl FnOnce(&Self) -> Result<R, DdpError>,
    ) -> Result<Result<R, Outcome>, DdpError> {
        match f(self) {
            Ok(r) => Ok(Ok(r)),
            Err(DdpError::Comm(e)) => self.reform(false, Some(e), None).map(Err),
            Err(e) => Err(e),
        }
    }

    /// Says the job is over (processes waiting to join exit) and returns the model.
    pub fn finish(mut self) -> Result<M, DdpError> {
        self.group.finish()?;
        Ok(self
            .model
            .take()
            .expect("the model is back after every call"))
    }

    /// burn's optimizer step of the DDP path.
    fn apply_ddp(&mut self, model: M, lr: f64, grads: GradientsParams) -> M {
        match &mut self.optimizer {
            ElasticOptimizer::Ddp { optim, .. } => optim.step(lr, model, grads),
            ElasticOptimizer::Zero { .. } => unreachable!("a DDP step under a ZeRO run"),
        }
    }

    /// After a committed step: re-forms to let waiting processes join when the vote says so.
    fn grow_if(&mut self, vote: Vote) -> Result<Outcome, DdpError> {
        match vote {
            Vote::CommitAndGrow if self.progress.step >= self.joins_from => {
                self.reform(false, None, None)
            }
            _ => Ok(Outcome::Committed),
        }
    }

    /// Ends the generation (see the module documentation): drops the wrapper (so that the old
    /// group's last handle is the membership's, which shuts it down on a thread of its own),
    /// re-forms, commits or drops the step in flight as decided, heals the joiners and wraps
    /// the model in the new group. `finished`: the step this rank finished but whose vote did
    /// not complete (the model and a ZeRO wrapper hold the committed state meanwhile).
    ///
    /// A heal that fails in the group (a joiner died while rank 0 sent it the state, or any
    /// member during the wrapper's broadcast or ZeRO's resharding) leaves a survivor's
    /// committed state as it was ([`heal_and_wrap`](Self::heal_and_wrap) gives it back): the
    /// survivor re-forms again, blaming the failure, in as many rounds as it takes, until a
    /// heal succeeds or the job is below its minimum. A rank being healed whose heal fails
    /// holds no consistent state and returns the error (its process exits; its agent may
    /// restart it, and it joins as a new process would).
    fn reform(
        &mut self,
        finished_step: bool,
        cause: Option<CommError>,
        finished: Option<Finished<M>>,
    ) -> Result<Outcome, DdpError> {
        let started = Instant::now();
        // This rank's shard of the committed state, cut for the old world (ZeRO).
        let mut shard = match self.wrapped.as_ref() {
            Some(Wrapped::Zero(z)) => Some(z.shard_state()?),
            _ => None,
        };
        let ended = self.wrapper_stats();
        self.banked.add(&ended);
        self.wrapped = None;
        let mut dropped = cause.is_some();
        let (mut finished_step, mut cause, mut finished) = (finished_step, cause, finished);
        loop {
            let status = StepStatus {
                committed: self.progress.step,
                finished: finished_step,
            };
            let Some(change) = self.group.reform(status, cause.as_ref())? else {
                // The job is over: a member finished, so it committed the last step. A step
                // this rank finished (its gradients averaged, only its commit vote lost) is
                // that step: a later one would have needed this rank, or a re-form with its
                // report. Applied here, this replica ends where the others' did.
                if let Some(f) = finished.take() {
                    self.apply_finished(f, &mut shard);
                }
                return Ok(Outcome::Finished);
            };
            tracing::debug!(
                "elastic re-form, rank {}: generation {} agreed in {:.3} s",
                change.rank,
                change.generation.number,
                started.elapsed().as_secs_f64()
            );
            match (change.action, finished.take()) {
                (Continue::ApplyFinished, Some(f)) => {
                    self.apply_finished(f, &mut shard);
                    dropped = false;
                }
                (Continue::ApplyFinished, None) => {
                    return Err(DdpError::Config(format!(
                        "elastic: generation {} applies step {} which this rank does not hold",
                        change.generation.number, change.generation.step
                    )))
                }
                // Dropped, or nothing was in flight: the committed state (ZeRO's wrapper went
                // back to the step's starting point already).
                _ => {}
            }
            if change.healed {
                shard = None;
            }
            let number = change.generation.number;
            let e = match self.heal_and_wrap(change.healed, shard.as_deref()) {
                Ok(lost) => {
                    return Ok(Outcome::Changed(Membership {
                        generation: number,
                        rank: change.rank,
                        world_size: change.generation.members.len(),
                        joined: change.generation.joined.clone(),
                        left: change.generation.left.clone(),
                        dropped: dropped && !change.healed,
                        healed: change.healed,
                        lost_state: lost,
                    }))
                }
                Err(e) if change.healed => return Err(heal_failed(number, change.rank, e)),
                Err(DdpError::Comm(e)) => e,
                Err(e) => return Err(e),
            };
            tracing::warn!(
                "elastic: the heal of generation {number} failed on rank {} ({e}); this rank \
                 keeps its committed state (step {}) and re-forms again",
                change.rank,
                self.progress.step
            );
            // Nothing is in flight any more: the step was applied or dropped above.
            (finished_step, cause) = (false, Some(e));
        }
    }

    /// Applies a step this rank finished but did not commit (its vote failed) once a survivor
    /// committed it: DDP's averaged gradients, or ZeRO's stepped model and this rank's shard
    /// after the step (`shard`, resharded by the next wrap).
    fn apply_finished(&mut self, finished: Finished<M>, shard: &mut Option<Vec<u8>>) {
        let after = match finished {
            Finished::Ddp { grads, lr, after } => {
                let model = self
                    .model
                    .take()
                    .expect("the model is back after every call");
                self.model = Some(self.apply_ddp(model, lr, grads));
                after
            }
            Finished::Zero {
                model,
                shard: stepped,
                after,
            } => {
                self.model = Some(model);
                *shard = Some(stepped);
                after
            }
        };
        self.progress = after;
        self.committed_at = Some(SystemTime::now());
    }

    /// In the current generation's group, every member at the same point: rank 0 sends the
    /// joiners (`healed` ranks) what they cannot get from the wrapper when the generation has
    /// joiners, everyone adopts rank 0's progress, and the model is wrapped (ZeRO: resharded
    /// from the survivors' old shards, `shard`). Returns the optimizer-state elements lost
    /// (ZeRO).
    ///
    /// How a joiner is healed, and why so: the weights travel as raw `f32` in the wrapper's own
    /// broadcast of rank 0's values (in place, in the parameters' memory, no record); before it,
    /// rank 0 sends its burn parameter ids (8 bytes a tensor), which the joiner adopts, so that
    /// burn's optimizer record, keyed by parameter id, applies to the joiner's model as it is
    /// (DDP: burn's optimizer state, the only part that must be serialised, since burn keeps it
    /// private; ZeRO's state is resharded from the survivors' shards instead). A model record
    /// would carry the weights a second time, encoded and decoded.
    ///
    /// A heal that fails leaves this rank's committed state in place, model and progress (the
    /// optimizer changes on a rank being healed only, a ZeRO shard is the caller's): the model
    /// goes into the
    /// heal as a clone that shares its tensors, so the heal's in-place broadcasts write into
    /// copies and never into the committed weights; the clone's cost is one copy of the values
    /// the heal sends (every weight when joiners come, the buffers otherwise), and none on a
    /// GPU, whose values are copied to the host for the broadcast anyway. So a survivor whose
    /// heal stopped halfway holds the weights it held before, the same as every other
    /// survivor's, and re-forms ([`reform`](Self::reform)).
    fn heal_and_wrap(&mut self, healed: bool, shard: Option<&[u8]>) -> Result<usize, DdpError> {
        let committed = self
            .model
            .clone()
            .expect("the model is back after every call");
        let progress = self.progress.clone();
        let result = self.try_heal_and_wrap(healed, shard);
        if result.is_err() {
            self.model = Some(committed);
            self.progress = progress;
            self.wrapped = None;
        }
        result
    }

    /// [`heal_and_wrap`](Self::heal_and_wrap)'s heal, which may lose the model on failure.
    fn try_heal_and_wrap(&mut self, healed: bool, shard: Option<&[u8]>) -> Result<usize, DdpError> {
        let pg = Arc::clone(self.group.group());
        let generation = self.group.generation();
        let has_joiners = generation.number > 1 && !generation.joined.is_empty();
        let rank0 = pg.rank() == 0;
        let mut model = self
            .model
            .take()
            .expect("the model is back after every call");
        // The program's hooks (its allocator) around the heal's large allocations.
        let _scope = (has_joiners || healed).then(HealScope::enter);
        let started = Instant::now();
        let my_rank = pg.rank();
        let phase = |what: &str| {
            tracing::debug!(
                "elastic re-form, rank {my_rank}: {what} at {:.3} s",
                started.elapsed().as_secs_f64()
            );
        };
        // The progress, and the sizes of what follows.
        let (ids, optim_bytes) = if rank0 && has_joiners {
            let ids: Vec<i64> = param_ids(&model).iter().map(|id| id.val() as i64).collect();
            let o = match &self.optimizer {
                ElasticOptimizer::Ddp { optim, .. } => Some(optim.into_bytes().map_err(|e| {
                    DdpError::Checkpoint(format!("encoding the optimizer record: {e:?}"))
                })?),
                ElasticOptimizer::Zero { .. } => None,
            };
            (ids, o)
        } else {
            (Vec::new(), None)
        };
        phase("optimizer record encoded");
        let p = &self.progress;
        let header = pg.broadcast(
            vec![
                p.step as i64,
                p.epoch as i64,
                p.position as i64,
                p.extra.len() as i64,
                ids.len() as i64,
                optim_bytes.as_ref().map_or(0, |b| b.len()) as i64,
            ],
            0,
        )?;
        let size = |i: usize| usize::try_from(header[i]).unwrap_or(0);
        let extra = if size(3) > 0 {
            pg.broadcast(
                if rank0 {
                    p.extra.clone()
                } else {
                    vec![0u8; size(3)]
                },
                0,
            )?
        } else {
            Vec::new()
        };
        self.progress = Progress {
            step: header[0] as u64,
            epoch: header[1] as u64,
            position: header[2] as u64,
            extra,
        };
        if size(4) > 0 {
            let ids = pg.broadcast(if rank0 { ids } else { vec![0i64; size(4)] }, 0)?;
            if healed {
                model = adopt_ids(model, &ids)?;
            }
        }
        phase("progress and ids sent");
        if size(5) > 0 {
            let bytes = broadcast_bytes(&pg, optim_bytes, size(5), healed)?;
            phase("optimizer record sent");
            if let (Some(bytes), ElasticOptimizer::Ddp { optim, .. }) = (bytes, &mut self.optimizer)
            {
                let fresh = std::mem::replace(optim, burn::optim::SgdConfig::new().init());
                *optim = fresh
                    .from_bytes(Bytes::from_bytes_vec(bytes))
                    .map_err(|e| {
                        DdpError::Checkpoint(format!("rank 0's optimizer record: {e:?}"))
                    })?;
            }
        }
        phase("optimizer record decoded");
        crate::elastic::heal_die::die_at(healed, "weights");
        let mut lost = 0;
        // Survivors alone hold the same parameters (a dropped step changed none, an applied
        // one all alike): they are not broadcast. Every member reads the same generation.
        let start = Start::identical_if(generation.number > 1 && !has_joiners);
        let (model, wrapped) = match &self.optimizer {
            ElasticOptimizer::Ddp { config, .. } => {
                let (model, ddp) =
                    DistributedDataParallel::with_start(model, pg, config.clone(), start)?;
                (model, Wrapped::Ddp(ddp))
            }
            ElasticOptimizer::Zero { config, optimizer } => {
                let (cfg, o) = (config.clone(), optimizer.clone());
                let (model, mut zero) = ShardedDataParallel::with_start(model, pg, cfg, o, start)?;
                zero.keep_starting_points();
                phase("ZeRO wrapper built");
                if generation.number > 1 {
                    lost = reshard(&mut zero, shard)?;
                    phase("optimizer state resharded");
                }
                (model, Wrapped::Zero(zero))
            }
        };
        phase("wrapped");
        self.model = Some(model);
        self.wrapped = Some(wrapped);
        Ok(lost)
    }
}

/// The error of a rank being healed (a joiner, or a member left out and back) whose heal in
/// generation `generation` (as rank `rank`) failed with `e`: it holds part of rank 0's state at
/// most, so it must not train; its process exits, and its agent may restart it.
fn heal_failed(generation: u64, rank: usize, e: DdpError) -> DdpError {
    DdpError::Config(format!(
        "elastic: the heal of this rank (rank {rank} of generation {generation}) failed: {e}; \
         it holds no consistent state and cannot train, so it exits (its agent may restart \
         it: it joins again as a new process)"
    ))
}

/// Refuses a communication hook with state per rank (PowerSGD) under elastic training, with
/// the reason. Every generation builds a new wrapper, hence a new hook; carrying PowerSGD's
/// state into it cannot keep its promise either: its error feedback is each rank's own
/// residual (what its compressed gradients left out, to be sent in later steps), so a rank
/// that is lost takes its share of the gradient with it, a joiner has none, and a joiner's
/// step count (plain all-reduce or compressed) would differ from the survivors', which
/// mismatches their collectives. The trainers refuse `--comm-hook powersgd --elastic` for
/// the same reason; bf16/f16 compression (stateless) runs elastic.
pub(crate) fn refuse_stateful_hook(optimizer: &ElasticOptimizer) -> Result<(), DdpError> {
    match optimizer {
        ElasticOptimizer::Ddp { config, .. } => match config.comm_hook {
            CommHookKind::AllReduce => Ok(()),
            CommHookKind::PowerSgd(_) => Err(DdpError::Config(
                "PowerSGD (DdpConfig::comm_hook) cannot run under ElasticDdp: its error \
                 feedback is each rank's own residual of the compressed gradients, so a lost \
                 rank takes its part of the gradient along, a joiner has none, and every new \
                 generation would start a fresh hook (plain steps again, the residual \
                 dropped); use CommHookKind::AllReduce, or DdpConfig::compression Bf16/F16"
                    .into(),
            )),
        },
        ElasticOptimizer::Zero { .. } => Ok(()),
    }
}

/// Bytes per broadcast of [`broadcast_bytes`]: what a rank that does not keep them holds.
const CHUNK_BYTES: usize = 32 << 20;

/// The memory an in-place broadcast of [`broadcast_bytes`] runs on.
enum Held {
    /// Rank 0's bytes (burn's encoding, sent from where burn put them).
    Root(Bytes),
    /// A receiver's buffer: the whole message (kept) or one chunk (reused, discarded).
    Receiver(Vec<u8>),
}

/// A window of [`Held`] memory lent to one broadcast.
struct Window {
    held: Held,
    range: std::ops::Range<usize>,
}

impl AsMut<[u8]> for Window {
    fn as_mut(&mut self) -> &mut [u8] {
        match &mut self.held {
            Held::Root(b) => &mut b[self.range.clone()],
            Held::Receiver(v) => &mut v[self.range.clone()],
        }
    }
}

/// The group's commit vote, its time added to `total`.
fn timed_vote(group: &ElasticGroup, total: &mut Duration) -> Result<Vote, CommError> {
    let start = Instant::now();
    let vote = group.should_commit();
    *total += start.elapsed();
    vote
}

/// Sends rank 0's `bytes` (`len` of them, from the header) to every rank of `pg`, and returns
/// them where `keep` (a joiner), `None` elsewhere. A collective.
///
/// How, and why so: the message goes in broadcasts of [`CHUNK_BYTES`], each in place, so that
/// rank 0 sends from burn's own buffer (no copy), a rank that does not keep the message (a
/// survivor) receives every chunk into one reused chunk buffer instead of allocating the whole
/// state, and a joiner receives into one buffer whose pages are mapped before the first chunk
/// arrives ([`faulted`]): the shared-memory broadcast moves piece by piece in lock-step, so a
/// receiver that faults its pages in during it holds up every rank at every piece.
fn broadcast_bytes(
    pg: &ProcessGroup,
    bytes: Option<Bytes>,
    len: usize,
    keep: bool,
) -> Result<Option<Vec<u8>>, DdpError> {
    let mut held = match bytes {
        Some(b) if pg.rank() == 0 => {
            if b.len() != len {
                return Err(DdpError::Config(format!(
                    "elastic heal: rank 0 announced {len} optimizer bytes and holds {}",
                    b.len()
                )));
            }
            Held::Root(b)
        }
        _ if keep => Held::Receiver(faulted(len)),
        _ => Held::Receiver(faulted(len.min(CHUNK_BYTES))),
    };
    let whole = matches!(held, Held::Root(_)) || keep;
    let mut at = 0;
    while at < len {
        let n = (len - at).min(CHUNK_BYTES);
        let range = if whole { at..at + n } else { 0..n };
        let window = Window { held, range };
        held = pg.submit_broadcast_in_place(window, 0).wait()?.held;
        at += n;
    }
    Ok(match held {
        Held::Receiver(v) if keep => Some(v),
        _ => None,
    })
}

/// A buffer of `len` zero bytes whose pages are mapped already (written once; the kernel is
/// asked for huge pages for it, which makes that cheaper where virtual machines make each
/// page fault dear).
fn faulted(len: usize) -> Vec<u8> {
    const HUGE: usize = 2 << 20;
    let mut v: Vec<u8> = Vec::with_capacity(len);
    let start = (v.as_mut_ptr() as usize).next_multiple_of(HUGE);
    let end = (v.as_mut_ptr() as usize + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside `v`'s allocation, which nothing reads yet; the
        // advice changes no content, and a refusal (an old kernel, no huge pages) is harmless.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    v.resize(len, 0);
    v
}

/// Gives `model`'s float tensors rank 0's burn parameter ids (`ids`, in visiting order), so
/// that rank 0's optimizer record, keyed by id, applies to it. Values, element types and
/// whether each requires a gradient stay. A list of another length is an error naming both
/// counts (the join check compares the parameter lists, so it means a broken peer).
fn adopt_ids<M: Module>(model: M, ids: &[i64]) -> Result<M, DdpError> {
    struct Adopt<'a> {
        ids: &'a [i64],
        index: usize,
    }
    impl ModuleMapper for Adopt<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = self.ids[self.index];
            self.index += 1;
            let (_, value, mapper) = param.consume();
            Param::from_mapped_value(ParamId::from(id as u64), value, mapper)
        }
    }
    let own = param_ids(&model).len();
    if own != ids.len() {
        return Err(DdpError::ParamMismatch(format!(
            "elastic heal: rank 0 sent {} parameter ids, this joiner's model has {own} float \
             tensors",
            ids.len()
        )));
    }
    Ok(model.map(&mut Adopt { ids, index: 0 }))
}

#[cfg(test)]
mod tests;
