//! [`DistributedDataParallel`]: keeps replicas of a burn module identical across ranks by
//! averaging gradients after every backward pass.
//!
//! How a step goes (the same on every rank, so the collectives line up):
//!
//! 1. The caller runs forward and `loss.backward()` and turns the result into burn's
//!    `GradientsParams`, as in any burn loop.
//! 2. [`DistributedDataParallel::sync`] hands the gradients to the gradient pipeline
//!    (`pipeline.rs`), bucket by bucket: the buckets hold the parameters in reverse visiting
//!    order (the order in which backward produces them) under PyTorch's rule (`buckets.rs`:
//!    a bucket closes once it holds `bucket_cap_mb`, the first one `first_bucket_mb`). A large
//!    gradient travels in burn's own buffer, small ones are copied into a shared one; each
//!    bucket's all-reduces go to the process group's communication thread as soon as it is
//!    packed, so packing bucket k+1 overlaps the all-reduce of bucket k. The all-reduce
//!    averages (the sum over ranks, each finished chunk divided by the world size by the rank
//!    that finished it: `ReduceOp::Avg`). One small all-reduce of every parameter's presence
//!    and of the failure slots follows the last bucket.
//! 3. It then waits for the buckets in submission order; unpacking bucket k (building
//!    tensors, without a copy where the buffer was burn's) overlaps the all-reduce of the
//!    buckets after it.
//! 4. A parameter that got no gradient on this rank contributes zeros and no presence; it
//!    gets the averaged gradient back if any rank produced one, and stays absent otherwise, so
//!    the optimizer sees the same gradient set on every rank.
//!
//! Before that, `sync` checks that the module still holds the parameters (burn ids) the wrapper
//! was created with, and broadcasts the module's buffers (float tensors that require no
//! gradient: `BatchNorm`'s running statistics, frozen parameters) from rank 0, like PyTorch's
//! `broadcast_buffers=True`; buffers never travel as gradients.
//!
//! Gradient accumulation follows PyTorch's `no_sync`: [`DistributedDataParallel::accumulate`]
//! adds micro-step gradients locally, and the next `sync` returns their **sum** averaged over
//! ranks. Divide the loss by the number of micro-steps to get the gradient of the mean over all
//! their samples.
//!
//! burn 0.22's autodiff offers no public hook that fires when one parameter's gradient is
//! ready (docs/burn-notes.md). With [`DdpConfig::overlap`] (on by default), `prepare` and
//! [`DistributedDataParallel::backward`] make such hooks (`overlap.rs`): each bucket's
//! all-reduce then starts during backward, as in PyTorch. Without them (`with_overlap(false)`,
//! or a loop that calls `sync` on the gradients of a plain `loss.backward()`) communication
//! starts after backward returns and overlaps packing and unpacking only.
//!
//! A communication hook ([`DdpConfig::comm_hook`]'s PowerSGD, or a user's own through
//! [`DistributedDataParallel::register_comm_hook`]) replaces step 2's per-part all-reduce and
//! step 3's division: the pipeline still packs and submits part by part, and the hook gets
//! each bucket whole as soon as its last part is in (`gradients/hook_buckets.rs`), and gives back the
//! average.
//!
//! Reproducibility: the bucket layout depends only on the parameter list and the config, and the
//! process group reduces every element in a fixed order, so the same seed gives bit-identical
//! runs, and every replica receives bit-identical gradients.

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use ddp_comm::ProcessGroup;

use crate::config::{CommHookKind, DdpConfig};
use crate::gradients::agree::Start;
use crate::gradients::host_carrier::Reduction;
use crate::gradients::reducer::Reducer;
use crate::gradients::stats::{SyncSpan, SyncStats};
use crate::hooks::comm_hook::{CommHook, DynHook};
use crate::hooks::powersgd::PowerSgd;
use crate::optim::clip::clip_replicated;
use crate::params::ParamInfo;
use crate::DdpError;

/// Data parallelism for any burn [`Module`]: construction makes every replica equal to
/// rank 0's, and [`sync`](Self::sync) averages gradients across ranks before the optimizer step.
///
/// ```text
/// let (model, mut ddp) = DistributedDataParallel::new(model, pg, DdpConfig::default())?;
/// for (images, labels) in loader {
///     let loss = model.loss(images, labels);
///     let grads = GradientsParams::from_grads(loss.backward(), &model);
///     let grads = ddp.sync(&model, grads)?;      // the one added line
///     model = optim.step(lr, model, grads);
/// }
/// ```
pub struct DistributedDataParallel {
    /// The checks, buffer broadcast, bucket pipeline, overlap and carrier (all-reducing).
    reducer: Reducer,
    config: DdpConfig,
    /// The total norm of the last step's averaged gradient, before clipping (with
    /// `max_grad_norm` only).
    grad_norm: Option<f32>,
}

impl DistributedDataParallel {
    /// Checks that every rank has the same parameter list (names, shapes, dtypes, which are
    /// buffers), then broadcasts rank 0's parameter and buffer values so that all replicas start
    /// identical, and returns the (possibly overwritten) module with the wrapper.
    ///
    /// Load any record (`load_record`) before wrapping: burn gives loaded parameters new ids,
    /// and [`sync`](Self::sync) fails on a module whose ids are not the ones seen here.
    ///
    /// Every rank of `pg` must call this at the same point. A mismatch fails on every rank,
    /// naming the first rank that differs from rank 0 and the first differing parameter.
    pub fn new<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: DdpConfig,
    ) -> Result<(M, Self), DdpError> {
        Self::with_start(model, pg, config, Start::Broadcast)
    }

    /// [`new`](Self::new) for replicas whose parameters are known to be identical already
    /// (`Start::Identical`: an elastic generation of survivors only), or as `new`.
    pub(crate) fn with_start<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: DdpConfig,
        start: Start,
    ) -> Result<(M, Self), DdpError> {
        // The built-in hook, its settings checked before any collective.
        let hook: Option<Box<dyn DynHook>> = match &config.comm_hook {
            CommHookKind::AllReduce => None,
            CommHookKind::PowerSgd(settings) => Some(Box::new(PowerSgd::new(settings.clone())?)),
        };
        let reduction = Reduction::AllReduce(config.compression);
        let (model, reducer) = Reducer::new(model, pg, (&config).into(), reduction, start)?;
        let mut ddp = Self {
            reducer,
            config,
            grad_norm: None,
        };
        if let Some(hook) = hook {
            ddp.reducer.install_hook(hook)?;
        }
        Ok((model, ddp))
    }

    /// Installs a communication hook of the user's own (PyTorch's `register_comm_hook`): from
    /// the next sync on, `hook` averages each bucket instead of the built-in all-reduce (see
    /// [`CommHook`] for the calls it gets and what it must return). Overlap
    /// ([`DdpConfig::overlap`]) works with it: each bucket goes to the hook during backward
    /// as soon as it is complete. Every rank must install an equal hook at the same point.
    ///
    /// Refused (as PyTorch does) when a hook is installed already ([`DdpConfig::comm_hook`]
    /// or an earlier call), and where hooks do not run: with [`DdpConfig::compression`] other
    /// than `None` (itself the bf16/f16 hook), when gradients are all-reduced on the GPU
    /// through NCCL, and under [`crate::ShardedDataParallel`] (ZeRO reduce-scatters). A hook
    /// that refuses the buckets in [`CommHook::bind`] is refused with its error.
    pub fn register_comm_hook<H: CommHook>(&mut self, hook: H) -> Result<(), DdpError> {
        self.reducer.install_hook(Box::new(hook))
    }

    /// This rank's communication hook state ([`CommHook::state`]: PowerSGD's step count,
    /// error feedback and Q), to save beside a checkpoint; `None` without a hook or for a hook
    /// without state. The state is this rank's own (PowerSGD's error feedback differs between
    /// ranks): save every rank's.
    pub fn comm_hook_state(&self) -> Option<Vec<u8>> {
        self.reducer.comm_hook_state()
    }

    /// Restores a state [`comm_hook_state`](Self::comm_hook_state) returned on this rank (`name`
    /// says where the bytes came from, for the error), so that training continues bit for bit
    /// as if uninterrupted. Refused, naming `name`, without a hook or when the hook refuses
    /// the bytes.
    pub fn load_comm_hook_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        self.reducer.load_comm_hook_state(bytes, name)
    }

    /// The process group the gradients travel through.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        self.reducer.process_group()
    }

    /// The parameter list every rank agreed on, in visiting order, frozen parameters and
    /// buffers included ([`ParamInfo::kind`] tells them apart).
    pub fn params(&self) -> &[ParamInfo] {
        self.reducer.params()
    }

    /// The parameter names of each bucket, in bucket (= communication) order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        self.reducer.bucket_layout()
    }

    /// The settings in force.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// Whether gradients are all-reduced on the GPU through NCCL (feature `cuda`, burn's CUDA
    /// backend, more than one rank or `DDP_NCCL=1`) rather than through the host and the
    /// process group. At one rank the path then runs whole (NCCL's all-reduce of one rank
    /// changes nothing), to check it on one GPU.
    pub fn gradients_on_device(&self) -> bool {
        self.reducer.gradients_on_device()
    }

    /// Statistics gathered since the last call, then reset.
    pub fn take_stats(&mut self) -> SyncStats {
        self.reducer.take_stats()
    }

    /// Turns the recording of per-bucket [`SyncSpan`]s on or off (off by default: then a sync
    /// records nothing beyond [`SyncStats`]). When
    /// [`gradients_on_device`](Self::gradients_on_device), the spans are the host's view of
    /// asynchronous GPU work (launches and waits).
    pub fn record_spans(&mut self, on: bool) {
        self.reducer.record_spans(on)
    }

    /// The spans recorded since the last call (empty when recording is off).
    pub fn take_spans(&mut self) -> Vec<SyncSpan> {
        self.reducer.take_spans()
    }

    /// Runs `loss.backward()`, collects the gradients of `model` and [`sync`](Self::sync)s them.
    ///
    /// With [`DdpConfig::overlap`] and a model from [`prepare`](Self::prepare), the buffers
    /// are broadcast (and replicas checked) first, and each bucket's all-reduce starts while
    /// backward is still computing the gradients of earlier layers; the result is the same,
    /// bit for bit.
    pub fn backward<M: Module>(
        &mut self,
        model: &M,
        loss: Tensor<1>,
    ) -> Result<GradientsParams, DdpError> {
        if !self.reducer.prepared() {
            let grads = self.reducer.timed_backward(model, loss);
            return self.sync(model, grads);
        }
        let (grads, local_error) = self.reducer.overlapped_backward(model, loss)?;
        let grads = self.reducer.all_reduce(grads, local_error, true)?;
        self.clipped(grads)
    }

    /// A copy of `model` for the forward pass of the next [`backward`](Self::backward), whose
    /// trainable parameters report their gradients as soon as they are complete, when
    /// [`DdpConfig::overlap`] is on (and more than one rank trains on burn's CPU backend with
    /// autodiff); otherwise a plain clone. Run the forward pass on the copy only; the
    /// gradients land on `model`'s own parameters:
    ///
    /// ```text
    /// let hooked = ddp.prepare(&model);
    /// let loss = hooked.loss(x, y);
    /// let grads = ddp.backward(&model, loss)?;   // all-reduces overlap backward
    /// model = optim.step(lr, model, grads);
    /// ```
    ///
    /// The copy's parameters keep their ids and values; only their autodiff graph differs
    /// (see the `overlap` module). A loss of the copy that goes through `loss.backward()`
    /// and [`sync`](Self::sync) (or [`accumulate`](Self::accumulate)) trains as without
    /// overlap.
    ///
    /// The loss may also reach the parameters outside the copy: a term on `model`'s own
    /// parameters (an L2 penalty), two copies in one step, a layer of `model` run directly.
    /// Every such piece is added to the gradient before its bucket goes out, so the result is
    /// the gradient without overlap (see [`late_gradient_params`](Self::late_gradient_params)
    /// for the buckets this holds back); a path that first appears after its bucket went
    /// out fails the step on every rank with [`DdpError::LateGradient`], and the step can be
    /// run again.
    pub fn prepare<M: Module>(&mut self, model: &M) -> M {
        self.reducer.prepare(model)
    }

    /// Why the all-reduces of `model`'s gradients cannot start during backward, or `None`
    /// when [`prepare`](Self::prepare) and [`backward`](Self::backward) do start them (with
    /// [`DdpConfig::overlap`], more than one rank, gradients through the host, burn's CPU
    /// backend with autodiff). For banners: [`SyncStats::buckets_during_backward`] counts what
    /// really went out during backward.
    pub fn why_no_overlap<M: Module>(&self, model: &M) -> Option<&'static str> {
        self.reducer.why_no_overlap(model)
    }

    /// When the last [`backward`](Self::backward) ran its backward pass (start and end), for
    /// traces: with overlap, the bucket all-reduces that ran inside it were hidden.
    pub fn last_backward(&self) -> Option<(Instant, Instant)> {
        self.reducer.last_backward()
    }

    /// The loss depth the overlap measured on its first pass (`None` before it, or without
    /// overlap): where the hooks fire is derived from it.
    pub fn overlap_depth(&self) -> Option<usize> {
        self.reducer.overlap_depth()
    }

    /// The trainable parameters whose buckets wait for the end of an overlapped backward
    /// because the loss was seen to reach them outside the hooked use of the copy from
    /// [`prepare`](Self::prepare) (a term on the model's own parameter, two prepared copies in
    /// one step): their gradients are summed whole before they go out, as without overlap, at
    /// the cost of that overlap. Empty without overlap or before the first overlapped pass.
    pub fn late_gradient_params(&self) -> Vec<String> {
        self.reducer.late_gradient_params()
    }

    /// Gradient accumulation without communication (PyTorch's `with model.no_sync():`): adds
    /// this micro-step's gradients to local buffers. The next [`sync`](Self::sync) adds its own
    /// gradients, all-reduces the **sum** of the micro-steps once and divides by the world size
    /// only, as PyTorch does: to train on the mean over all k micro-batches, divide each
    /// micro-step's loss by k, as in PyTorch.
    ///
    /// A gradient that cannot be read as `f32` is an error naming the parameter; so are
    /// gradients for parameters the wrapper does not know (the module's parameters were
    /// replaced after wrapping, e.g. by `load_record`). After an error the accumulated
    /// gradients are unspecified: start the step again with a new wrapper.
    pub fn accumulate(&mut self, grads: GradientsParams) -> Result<(), DdpError> {
        self.reducer.accumulate(grads)
    }

    /// Averages gradients across ranks: adds `grads` to anything accumulated since the last
    /// sync (a sum, as PyTorch's `no_sync`), all-reduces bucket by bucket, and returns the sum
    /// over micro-steps averaged over ranks, ready for `optim.step`. With mean-reduced losses
    /// and no accumulation, N ranks with batch b take the same step as one process with batch
    /// N·b over the same samples; with k micro-steps whose losses are divided by k, the same
    /// as one process with batch k·N·b.
    ///
    /// Before the gradients, it checks that `model` still holds the parameters the wrapper
    /// was created with ([`DdpError::ParamsChanged`] otherwise) and broadcasts the module's
    /// buffers (burn's `RunningState`s: `BatchNorm` running statistics) from rank 0 unless
    /// [`DdpConfig::broadcast_buffers`] is off, so that every replica continues with rank 0's.
    /// Buffers are overwritten in place through `&M` (a `RunningState`'s value is shared
    /// between clones of the module).
    ///
    /// **Failures are collective.** Whatever fails on one rank only (a gradient that cannot be
    /// read, gradients of unknown parameters, parameters replaced after wrapping) fails this
    /// sync on every rank: the failing rank still takes part in every collective, and each
    /// bucket carries a failure count and the failing rank, so the others return
    /// [`DdpError::PeerFailed`] naming it while the failing rank returns its own error. No rank
    /// ever steps with a partial sum. After an error, do not apply the step.
    pub fn sync<M: Module>(
        &mut self,
        model: &M,
        grads: GradientsParams,
    ) -> Result<GradientsParams, DdpError> {
        let local_error = self.reducer.begin_sync(model)?;
        let grads = self.reducer.all_reduce(grads, local_error, false)?;
        self.clipped(grads)
    }

    /// With [`DdpConfig::max_grad_norm`], clips the averaged `grads` to it (`optim/clip.rs`)
    /// and keeps the norm for [`grad_norm`](Self::grad_norm).
    fn clipped(&mut self, mut grads: GradientsParams) -> Result<GradientsParams, DdpError> {
        if let Some(max_norm) = self.config.max_grad_norm {
            let r = &self.reducer;
            let world = r.process_group().world_size();
            let norm = clip_replicated(
                &mut grads,
                r.params(),
                &r.layout(),
                world,
                r.device(),
                max_norm,
            )?;
            self.grad_norm = Some(norm);
        }
        Ok(grads)
    }

    /// The global 2-norm of the last step's averaged gradient before clipping (PyTorch's
    /// `clip_grad_norm_` returns it, for logging), the same on every rank; `None` unless
    /// [`DdpConfig::max_grad_norm`] is set.
    pub fn grad_norm(&self) -> Option<f32> {
        self.grad_norm
    }

    /// Checks that every replica holds bit-identical trainable parameters: a hash of each
    /// rank's parameters is all-gathered and compared. Every rank must call it at the same
    /// point.
    ///
    /// On a difference it fails on every rank with [`DdpError::ReplicaDiverged`]: when a strict
    /// majority of ranks agree, it names the ranks outside the majority (rank 0 included if it
    /// is one of them); otherwise (two ranks, or a tie) it cannot tell which replica is wrong
    /// and names the ranks whose parameters differ from rank 0's, saying so.
    ///
    /// Buffers (`BatchNorm` running statistics) are not compared: each rank updates them from
    /// its own batch during the forward pass, and [`sync`](Self::sync) makes them equal by
    /// broadcasting rank 0's.
    pub fn check_replicas<M: Module>(&self, model: &M) -> Result<(), DdpError> {
        self.reducer.check_replicas(model)
    }
}
