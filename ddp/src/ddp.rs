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
//! each bucket whole as soon as its last part is in (`hook_carrier.rs`), and gives back the
//! average.
//!
//! Reproducibility: the bucket layout depends only on the parameter list and the config, and the
//! process group reduces every element in a fixed order, so the same seed gives bit-identical
//! runs, and every replica receives bit-identical gradients.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use ddp_comm::ProcessGroup;

use ddp_comm::bytes::fnv1a;

use crate::agree::{broadcast_values, diverged_ranks, verify_same_params, Start};
use crate::buckets::{plan_buckets, Bucket, Layout, Part};
use crate::carrier::Carrier;
use crate::clip::clip_replicated;
use crate::comm_hook::{bucket_descs, CommHook, DynHook};
use crate::config::{CommHookKind, Compression, DdpConfig};
use crate::hook_carrier::Hooked;
use crate::overlap::{lock, OverlapState};
use crate::params::{
    check_dtypes, check_ranks, flatten_where, load_where, param_ids, param_infos, ParamInfo,
    ParamKind,
};
use crate::pipeline::{Done, Pipeline};
use crate::powersgd::PowerSgd;
use crate::reduction::{HostCarrier, Reduction};
use crate::sync_stats::{SyncPhase, SyncSpan, SyncStats};
use crate::DdpError;

/// The gradient path on the GPU through NCCL (feature `cuda`), a child module so that it can
/// use the bucket layout.
#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod cuda;

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
    pg: Arc<ProcessGroup>,
    params: Arc<[ParamInfo]>,
    /// Whether the module has buffers (`RunningState`s) to broadcast at every sync.
    has_buffers: bool,
    /// The layout's buckets (the host and device pipelines share the layout).
    buckets: Vec<Bucket>,
    /// The gradient pipeline, shared with the overlap hooks.
    pipeline: Arc<Mutex<Pipeline<HostCarrier>>>,
    /// Micro-steps accumulated in the pipeline since the last sync.
    micro_steps: usize,
    syncs: u64,
    device: Device,
    config: DdpConfig,
    stats: SyncStats,
    /// `Some` while [`record_spans`](Self::record_spans) is on: the spans since the last take.
    spans: Option<Vec<SyncSpan>>,
    /// Set when gradients are all-reduced on the GPU through NCCL.
    #[cfg(feature = "cuda")]
    device_path: Option<cuda::DevicePath>,
    /// Set with [`DdpConfig::overlap`] on more than one rank: the hooks of `prepare`.
    overlap: Option<OverlapState>,
    /// The last overlapped backward pass's start and end.
    /// The total norm of the last step's averaged gradient, before clipping (with
    /// `max_grad_norm` only).
    grad_norm: Option<f32>,
    backward_span: Option<(Instant, Instant)>,
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
        let reduction = Reduction::AllReduce(config.compression);
        Self::with_reduction(model, pg, config, reduction, Start::Broadcast)
    }

    /// [`new`](Self::new) for replicas whose parameters are known to be identical already
    /// (`Start::Identical`: an elastic generation of survivors only), or as `new`.
    pub(crate) fn with_start<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: DdpConfig,
        start: Start,
    ) -> Result<(M, Self), DdpError> {
        let reduction = Reduction::AllReduce(config.compression);
        Self::with_reduction(model, pg, config, reduction, start)
    }

    /// [`with_start`](Self::with_start), with each part of a bucket carried by `reduction`:
    /// for [`crate::ShardedDataParallel`], which keeps the parameter list, the checks, the
    /// buffer broadcast, the pipeline and the hooks of this wrapper, and reduce-scatters.
    pub(crate) fn with_reduction<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        config: DdpConfig,
        reduction: Reduction,
        start: Start,
    ) -> Result<(M, Self), DdpError> {
        if !(config.bucket_cap_mb > 0.0 && config.first_bucket_mb > 0.0) {
            return Err(DdpError::Config(format!(
                "bucket sizes must be positive (bucket_cap_mb = {}, first_bucket_mb = {})",
                config.bucket_cap_mb, config.first_bucket_mb
            )));
        }
        if config.check_replicas_every == Some(0) {
            return Err(DdpError::Config(
                "check_replicas_every must be at least 1".into(),
            ));
        }
        // The built-in hook, its settings checked before any collective.
        let hook: Option<Box<dyn DynHook>> = match &config.comm_hook {
            CommHookKind::AllReduce => None,
            CommHookKind::PowerSgd(settings) => Some(Box::new(PowerSgd::new(settings.clone())?)),
        };
        let params = param_infos(&model);
        check_ranks(&params)?;
        check_dtypes(&params)?;
        verify_same_params(&pg, &params)?;

        let has_buffers = params.iter().any(|p| p.kind == ParamKind::Buffer);
        let params: Arc<[ParamInfo]> = params.into();
        let layout: Arc<Layout> = Arc::new(plan_buckets(&params, &config));
        let buckets = layout.buckets.clone();
        let carrier = HostCarrier {
            pg: Arc::clone(&pg),
            reduction,
            hook: None,
        };
        let pipeline = Arc::new(Mutex::new(Pipeline::new(
            Arc::clone(&pg),
            Arc::clone(&params),
            Arc::clone(&layout),
            carrier,
        )));
        // Gradients live on the device without autodiff.
        let device = model
            .devices()
            .into_iter()
            .next()
            .unwrap_or_default()
            .inner();
        #[cfg(feature = "cuda")]
        let device_path =
            cuda::DevicePath::detect(&pg, &device, &params, &layout, config.compression)?;

        // On the GPU path rank 0's values reach every rank through NCCL, on the device (at one
        // rank too, when DDP_NCCL=1 asks for the path: so that one GPU runs all of it).
        #[cfg(feature = "cuda")]
        let on_device = device_path.is_some();
        #[cfg(not(feature = "cuda"))]
        let on_device = false;
        let mut model = model;
        if (pg.world_size() > 1 || on_device) && params.iter().any(|p| start.sends(p)) {
            // Merge any pending RunningState update into its value before reading it.
            drop(model.valid());
            #[cfg(feature = "cuda")]
            if let Some(dp) = device_path.as_ref() {
                model = dp.broadcast_module(model, &|i| start.sends(&params[i]))?;
            }
            if !on_device {
                model = broadcast_values(&pg, model, &params, start)?;
            }
        }
        let overlap = (config.overlap && pg.world_size() > 1 && !buckets.is_empty())
            .then(|| OverlapState::new(Arc::clone(&params), Arc::clone(&pipeline)));
        #[cfg(feature = "cuda")]
        let overlap = overlap.filter(|_| device_path.is_none());
        let mut ddp = Self {
            pg,
            params,
            has_buffers,
            buckets,
            pipeline,
            micro_steps: 0,
            syncs: 0,
            device,
            config,
            stats: SyncStats::default(),
            spans: None,
            #[cfg(feature = "cuda")]
            device_path,
            overlap,
            backward_span: None,
            grad_norm: None,
        };
        if let Some(hook) = hook {
            ddp.install_hook(hook)?;
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
        self.install_hook(Box::new(hook))
    }

    /// Binds `hook` to the buckets and hands it to the pipeline's carrier (see
    /// [`register_comm_hook`](Self::register_comm_hook) for what is refused).
    fn install_hook(&mut self, mut hook: Box<dyn DynHook>) -> Result<(), DdpError> {
        let refuse = |why: String| Err(DdpError::Config(format!("communication hook: {why}")));
        if self.gradients_on_device() {
            return refuse(
                "hooks run on the host path, and this wrapper all-reduces gradients on the GPU \
                 through NCCL"
                    .into(),
            );
        }
        let mut pipeline = lock(&self.pipeline);
        let layout = Arc::clone(pipeline.layout());
        let carrier = pipeline.carrier();
        match carrier.reduction {
            Reduction::ReduceScatter => {
                return refuse(
                    "a hook averages whole buckets, and ZeRO (ShardedDataParallel) \
                     reduce-scatters them: the two cannot be combined"
                        .into(),
                )
            }
            Reduction::AllReduce(c @ (Compression::Bf16 | Compression::F16)) => {
                return refuse(format!(
                    "DdpConfig::compression {c:?} is itself a hook (PyTorch's \
                     bf16/fp16_compress_hook); set it to None to install another"
                ))
            }
            Reduction::AllReduce(Compression::None) => {}
        }
        if carrier.hook.is_some() {
            return refuse(
                "one is installed already (DdpConfig::comm_hook or an earlier \
                 register_comm_hook); a wrapper has one"
                    .into(),
            );
        }
        hook.bind(&bucket_descs(&layout, &self.params))?;
        carrier.hook = Some(Hooked::new(hook, layout));
        Ok(())
    }

    /// Whether a communication hook is installed.
    fn hooked(&self) -> bool {
        lock(&self.pipeline).carrier().hook.is_some()
    }

    /// This rank's communication hook state ([`CommHook::state`]: PowerSGD's step count,
    /// error feedback and Q), to save beside a checkpoint; `None` without a hook or for a hook
    /// without state. The state is this rank's own (PowerSGD's error feedback differs between
    /// ranks): save every rank's.
    pub fn comm_hook_state(&self) -> Option<Vec<u8>> {
        let mut pipeline = lock(&self.pipeline);
        let hooked = pipeline.carrier().hook.as_ref()?;
        hooked.hook().state()
    }

    /// Restores a state [`comm_hook_state`](Self::comm_hook_state) returned on this rank (`name`
    /// says where the bytes came from, for the error), so that training continues bit for bit
    /// as if uninterrupted. Refused, naming `name`, without a hook or when the hook refuses
    /// the bytes.
    pub fn load_comm_hook_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let mut pipeline = lock(&self.pipeline);
        match pipeline.carrier().hook.as_mut() {
            Some(hooked) => hooked.hook_mut().load_state(bytes, name),
            None => Err(DdpError::Checkpoint(format!(
                "{name}: holds a communication hook state, but this wrapper has no hook"
            ))),
        }
    }

    /// The process group the gradients travel through.
    pub fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// The parameter list every rank agreed on, in visiting order, frozen parameters and
    /// buffers included ([`ParamInfo::kind`] tells them apart).
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// The parameter names of each bucket, in bucket (= communication) order.
    pub fn bucket_layout(&self) -> Vec<Vec<String>> {
        self.buckets
            .iter()
            .map(|b| {
                b.params
                    .iter()
                    .map(|&i| self.params[i].name.clone())
                    .collect()
            })
            .collect()
    }

    /// The settings in force.
    pub fn config(&self) -> &DdpConfig {
        &self.config
    }

    /// How many syncs were begun (the number in [`DdpError::PeerFailed`]).
    pub(crate) fn syncs(&self) -> u64 {
        self.syncs
    }

    /// Whether gradients are all-reduced on the GPU through NCCL (feature `cuda`, burn's CUDA
    /// backend, more than one rank or `DDP_NCCL=1`) rather than through the host and the
    /// process group. At one rank the path then runs whole (NCCL's all-reduce of one rank
    /// changes nothing), to check it on one GPU.
    pub fn gradients_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device_path.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Statistics gathered since the last call, then reset.
    pub fn take_stats(&mut self) -> SyncStats {
        std::mem::take(&mut self.stats)
    }

    /// Turns the recording of per-bucket [`SyncSpan`]s on or off (off by default: then a sync
    /// records nothing beyond [`SyncStats`]). When
    /// [`gradients_on_device`](Self::gradients_on_device), the spans are the host's view of
    /// asynchronous GPU work (launches and waits).
    pub fn record_spans(&mut self, on: bool) {
        self.spans = on.then(|| self.spans.take().unwrap_or_default());
    }

    /// The spans recorded since the last call (empty when recording is off).
    pub fn take_spans(&mut self) -> Vec<SyncSpan> {
        self.spans.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Records one span of a part of `elements` elements of bucket `bucket` when recording is
    /// on.
    fn part_span(
        &mut self,
        phase: SyncPhase,
        bucket: usize,
        elements: usize,
        start: Instant,
        end: Instant,
    ) {
        if let Some(spans) = self.spans.as_mut() {
            spans.push(SyncSpan {
                phase,
                bucket,
                elements,
                start,
                end,
            });
        }
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
        if !self.prepared() {
            let grads = self.timed_backward(model, loss);
            return self.sync(model, grads);
        }
        let (grads, local_error) = self.overlapped_backward(model, loss)?;
        let grads = self.sync_rest(grads, local_error, true)?;
        self.clipped(grads)
    }

    /// The start of an overlapped sync: every collective of the sync but the gradients' (the
    /// buffer broadcast, the replica check) comes first, so that the buckets submitted during
    /// backward are the step's only collectives until it ends, on every rank; then backward
    /// runs with the hooks armed, handing each gradient to the pipeline as it is complete.
    /// Returns what burn left in its gradients and this rank's local failure so far.
    pub(crate) fn overlapped_backward<M: Module>(
        &mut self,
        model: &M,
        loss: Tensor<1>,
    ) -> Result<(GradientsParams, Option<DdpError>), DdpError> {
        let local_error = self.begin_sync(model)?;
        let overlap = self.overlap.as_mut().expect("hooked by prepare");
        {
            let mut pipeline = lock(&self.pipeline);
            pipeline.begin(true);
            // The first pass learns the loss's paths (which parameters get pieces of their
            // gradient outside their hooks): every part waits for the end of backward; later
            // passes hold only the parts of such parameters.
            pipeline.hold(overlap.loss_depth().is_none());
        }
        let loss = overlap.arm(loss);
        let start = Instant::now();
        let grads = loss.backward();
        self.backward_span = Some((start, Instant::now()));
        let overlap = self.overlap.as_mut().expect("hooked by prepare");
        overlap.disarm();
        self.stats.buckets_during_backward += lock(&self.pipeline).buckets_submitted() as u64;
        Ok((GradientsParams::from_grads(grads, model), local_error))
    }

    /// `loss.backward()` and `model`'s gradients, the pass timed for
    /// [`last_backward`](Self::last_backward).
    pub(crate) fn timed_backward<M: Module>(
        &mut self,
        model: &M,
        loss: Tensor<1>,
    ) -> GradientsParams {
        let start = Instant::now();
        let grads = loss.backward();
        self.backward_span = Some((start, Instant::now()));
        GradientsParams::from_grads(grads, model)
    }

    /// Whether the model of the coming backward was hooked by [`prepare`](Self::prepare).
    pub(crate) fn prepared(&self) -> bool {
        self.overlap.as_ref().is_some_and(OverlapState::prepared)
    }

    /// The gradient pipeline.
    pub(crate) fn pipeline(&self) -> &Arc<Mutex<Pipeline<HostCarrier>>> {
        &self.pipeline
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
        if self.why_no_overlap(model).is_some() {
            return model.clone();
        }
        match (self.overlap.as_mut(), model.devices().into_iter().next()) {
            (Some(overlap), Some(device)) => overlap.hook_model(model, &device),
            _ => model.clone(),
        }
    }

    /// Why the all-reduces of `model`'s gradients cannot start during backward, or `None`
    /// when [`prepare`](Self::prepare) and [`backward`](Self::backward) do start them (with
    /// [`DdpConfig::overlap`], more than one rank, gradients through the host, burn's CPU
    /// backend with autodiff). For banners: [`SyncStats::buckets_during_backward`] counts what
    /// really went out during backward.
    pub fn why_no_overlap<M: Module>(&self, model: &M) -> Option<&'static str> {
        if !self.config.overlap {
            return Some("DdpConfig::overlap is not set");
        }
        if self.pg.world_size() == 1 {
            return Some("one rank, nothing to all-reduce");
        }
        if self.gradients_on_device() {
            return Some("gradients are all-reduced on the GPU through NCCL, after backward");
        }
        if self.overlap.is_none() {
            return Some("no trainable parameters");
        }
        let on_cpu_autodiff = model.devices().into_iter().next().is_some_and(|device| {
            device.is_autodiff()
                && matches!(
                    device.inner().as_dispatch(),
                    burn::backend::DispatchDevice::Flex(_)
                )
        });
        (!on_cpu_autodiff).then_some("the model is not on burn's CPU backend with autodiff")
    }

    /// When the last [`backward`](Self::backward) ran its backward pass (start and end), for
    /// traces: with overlap, the bucket all-reduces that ran inside it were hidden.
    pub fn last_backward(&self) -> Option<(Instant, Instant)> {
        self.backward_span
    }

    /// The loss depth the overlap measured on its first pass (`None` before it, or without
    /// overlap): where the hooks fire is derived from it.
    pub fn overlap_depth(&self) -> Option<usize> {
        self.overlap.as_ref().and_then(OverlapState::loss_depth)
    }

    /// The trainable parameters whose buckets wait for the end of an overlapped backward
    /// because the loss was seen to reach them outside the hooked use of the copy from
    /// [`prepare`](Self::prepare) (a term on the model's own parameter, two prepared copies in
    /// one step): their gradients are summed whole before they go out, as without overlap, at
    /// the cost of that overlap. Empty without overlap or before the first overlapped pass.
    pub fn late_gradient_params(&self) -> Vec<String> {
        lock(&self.pipeline)
            .late_params()
            .map(|info| info.name.clone())
            .collect()
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
    pub fn accumulate(&mut self, mut grads: GradientsParams) -> Result<(), DdpError> {
        let start = Instant::now();
        #[cfg(feature = "cuda")]
        let on_device = self
            .device_path
            .as_mut()
            .map(|dp| dp.pipeline().accumulate(&mut grads));
        #[cfg(not(feature = "cuda"))]
        let on_device: Option<Option<DdpError>> = None;
        let error = match on_device {
            Some(error) => error,
            None => lock(&self.pipeline).accumulate(&mut grads),
        };
        self.micro_steps += 1;
        self.stats.pack += start.elapsed();
        error.map_or(Ok(()), Err)
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
        let local_error = self.begin_sync(model)?;
        let grads = self.sync_rest(grads, local_error, false)?;
        self.clipped(grads)
    }

    /// With [`DdpConfig::max_grad_norm`], clips the averaged `grads` to it (`clip.rs`) and
    /// keeps the norm for [`grad_norm`](Self::grad_norm).
    fn clipped(&mut self, mut grads: GradientsParams) -> Result<GradientsParams, DdpError> {
        if let Some(max_norm) = self.config.max_grad_norm {
            let layout = Arc::clone(lock(&self.pipeline).layout());
            let world = self.pg.world_size();
            let norm = clip_replicated(
                &mut grads,
                &self.params,
                &layout,
                world,
                &self.device,
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

    /// The gradient part of a sync, after [`begin_sync`](Self::begin_sync): hands `grads` to
    /// the pipeline (after the hooks' gradients, when `begun` by an overlapped backward), which
    /// submits the buckets not yet submitted and the control all-reduce; waits for every part
    /// in order, unpacking each as it completes, and registers the averaged gradients.
    fn sync_rest(
        &mut self,
        mut grads: GradientsParams,
        local_error: Option<DdpError>,
        begun: bool,
    ) -> Result<GradientsParams, DdpError> {
        let one_rank = self.pg.world_size() == 1 && !self.gradients_on_device();
        if one_rank && self.micro_steps == 0 && !begun && !self.hooked() {
            // Averaging over one rank and one micro-step is the identity: skip the copies.
            // (The gradients are not taken out here, so unknown ones cannot be told apart;
            // with one rank there is no other rank to disagree with.)
            if let Some(e) = local_error {
                return Err(e);
            }
            self.stats.steps += 1;
            return Ok(grads);
        }
        if self.pg.world_size() > 1 || self.gradients_on_device() {
            self.stats.buckets += self.buckets.len() as u64;
        }
        #[cfg(feature = "cuda")]
        if let Some(mut dp) = self.device_path.take() {
            let reduced = self.reduce(dp.pipeline(), &mut grads, local_error, begun);
            self.device_path = Some(dp);
            reduced?;
            self.stats.steps += 1;
            return Ok(grads);
        }
        let pipeline = Arc::clone(&self.pipeline);
        let mut pipeline = lock(&pipeline);
        self.reduce(&mut pipeline, &mut grads, local_error, begun)?;
        self.stats.steps += 1;
        Ok(grads)
    }

    /// The one submit/complete loop of every DDP path (host or device, plain or overlapped):
    /// hands `grads` to `pipeline` (after the hooks' gradients, when `begun`), which submits
    /// the parts not yet submitted and the control all-reduce; unpacks each part as its
    /// collective completes, in order, into averaged gradients; registers in `grads` those that
    /// some rank had.
    fn reduce<C: Carrier>(
        &mut self,
        pipeline: &mut Pipeline<C>,
        grads: &mut GradientsParams,
        local_error: Option<DdpError>,
        begun: bool,
    ) -> Result<(), DdpError> {
        if !begun {
            pipeline.begin(true);
        }
        if let Some(e) = local_error {
            pipeline.fail(e);
        }
        let pack_start = Instant::now();
        pipeline.deliver_from(grads);
        self.stats.pack += pack_start.elapsed();

        // Micro-steps are summed (PyTorch's no_sync); only ranks are averaged (compressed
        // buckets were divided before the all-reduce, a hook returns the average).
        let denom = if pipeline.carrier().averages() {
            1.0
        } else {
            self.pg.world_size() as f32
        };
        self.micro_steps = 0;
        let layout = Arc::clone(pipeline.layout());
        let mut averaged: Vec<Option<C::Buf>> = (0..self.params.len()).map(|_| None).collect();
        let mut previous_end = pack_start;
        let presence = pipeline.finish(self.syncs, |carrier, done: Done<C::Buf>| {
            let part = &layout.parts[done.part];
            let (b, elements) = (part.bucket, part.len);
            let (wait_start, wait_end) = done.waited;
            self.stats.wait += wait_end - wait_start;
            self.part_span(SyncPhase::Pack, b, elements, done.packed.0, done.packed.1);
            self.part_span(SyncPhase::Wait, b, elements, wait_start, wait_end);
            let reduce_start = done.packed.1.max(previous_end);
            self.part_span(SyncPhase::AllReduce, b, elements, reduce_start, wait_end);
            previous_end = wait_end;
            unpack(carrier, part, done.buf, denom, &mut averaged);
            let unpack_end = Instant::now();
            self.stats.unpack += unpack_end - wait_end;
            self.part_span(SyncPhase::Unpack, b, elements, wait_end, unpack_end);
        });
        self.stats.bytes += pipeline.take_bytes();
        let presence = presence?;
        let carrier = pipeline.carrier();
        for (p, values) in averaged.into_iter().enumerate() {
            if let Some(values) = values.filter(|_| presence[p] > 0.0) {
                carrier.put(grads, &self.params[p], values, &self.device);
            }
        }
        Ok(())
    }

    /// What every sync does before the gradients (a collective): checks that `model` holds the
    /// wrapper's parameters, broadcasts the buffers and, when due, checks the replicas; counts
    /// the sync. Returns this rank's local failure, which the caller must still carry through
    /// its collectives (so that the other ranks learn of it), or a collective error.
    pub(crate) fn begin_sync<M: Module>(
        &mut self,
        model: &M,
    ) -> Result<Option<DdpError>, DdpError> {
        let mut local_error = self.check_same_params(model).err();
        let buffers = self.broadcast_buffers(model, local_error.is_none());
        if let Err(e) = buffers {
            // A failed broadcast is a collective failure (every rank sees it); a buffer that
            // could not be updated is local and travels with the buckets below.
            match e {
                DdpError::Comm(_) => return Err(e),
                other => {
                    local_error.get_or_insert(other);
                }
            }
        }
        if let Some(every) = self.config.check_replicas_every {
            if (self.syncs + 1).is_multiple_of(every) {
                let checked = self.check_replicas(model);
                if let Err(e) = checked {
                    return Err(local_error.unwrap_or(e));
                }
            }
        }
        self.syncs += 1;
        Ok(local_error)
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
        let flat = flatten_where(model, &|i| self.params[i].kind != ParamKind::Buffer)?;
        let hash = fnv1a(bytemuck::cast_slice(&flat)) as i64;
        let all = self.pg.all_gather(vec![hash])?;
        match diverged_ranks(&all) {
            None => Ok(()),
            Some((ranks, against_majority)) => Err(DdpError::ReplicaDiverged {
                sync: self.syncs,
                ranks,
                world: all.len(),
                against_majority,
            }),
        }
    }

    /// Fails when `model`'s float tensors are not (by burn id) the ones the wrapper was created
    /// with, naming the first that changed.
    pub(crate) fn check_same_params<M: Module>(&self, model: &M) -> Result<(), DdpError> {
        let ids = param_ids(model);
        if let Some(i) = (0..self.params.len()).find(|&i| ids.get(i) != Some(&self.params[i].id)) {
            return Err(DdpError::ParamsChanged {
                name: self.params[i].name.clone(),
                detail: if ids.len() == self.params.len() {
                    "its burn ParamId changed".into()
                } else {
                    format!(
                        "the module has {} float tensors, the wrapper {}",
                        ids.len(),
                        self.params.len()
                    )
                },
            });
        }
        if ids.len() != self.params.len() {
            return Err(DdpError::ParamsChanged {
                name: "?".into(),
                detail: format!(
                    "the module has {} float tensors, the wrapper {}",
                    ids.len(),
                    self.params.len()
                ),
            });
        }
        Ok(())
    }

    /// Overwrites the module's buffers with rank 0's (PyTorch's `broadcast_buffers=True`).
    /// A collective: every rank calls it from `sync`. With `readable == false` (this rank's
    /// module no longer matches the parameter list) the rank still takes part, sending zeros
    /// of the agreed length and loading nothing; its sync fails anyway.
    fn broadcast_buffers<M: Module>(&self, model: &M, readable: bool) -> Result<(), DdpError> {
        let one_rank = self.pg.world_size() == 1 && !self.gradients_on_device();
        if one_rank || !self.has_buffers || !self.config.broadcast_buffers {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if self.device_path.is_some() {
            return self.broadcast_buffers_on_device(model, readable);
        }
        let is_buffer = |i: usize| self.params[i].kind == ParamKind::Buffer;
        let len: usize = self
            .params
            .iter()
            .filter(|p| p.kind == ParamKind::Buffer)
            .map(ParamInfo::numel)
            .sum();
        let local = if readable {
            // burn's RunningState keeps the forward pass's update pending per thread until it
            // is synchronised, and visitors see the value before it; `valid` synchronises it
            // (in place: the state is shared between clones).
            drop(model.valid());
            match flatten_where(model, &is_buffer) {
                Ok(v) if v.len() == len => Ok(v),
                Ok(v) => Err(DdpError::Config(format!(
                    "the module's buffers hold {} values, the wrapper expected {len}",
                    v.len()
                ))),
                Err(e) => Err(e),
            }
        } else {
            Ok(vec![0.0; len])
        };
        let (local, read_error) = match local {
            Ok(v) => (v, None),
            Err(e) => (vec![0.0; len], Some(e)),
        };
        let shared = self.pg.broadcast(local.clone(), 0)?;
        if let Some(e) = read_error {
            return Err(e);
        }
        if !readable || self.pg.rank() == 0 || same_bits(&local, &shared) {
            return Ok(());
        }
        // Mapping a clone writes through to `model`'s RunningStates (their value is shared).
        drop(load_where(model.clone(), &shared, &is_buffer)?);
        let now = flatten_where(model, &is_buffer)?;
        if same_bits(&now, &shared) {
            return Ok(());
        }
        // Name the first buffer that did not take rank 0's values.
        let mut offset = 0;
        for info in self.params.iter().filter(|p| p.kind == ParamKind::Buffer) {
            let range = offset..offset + info.numel();
            offset = range.end;
            if !same_bits(&now[range.clone()], &shared[range]) {
                return Err(DdpError::BufferNotShared {
                    name: info.name.clone(),
                });
            }
        }
        Err(DdpError::BufferNotShared { name: "?".into() })
    }
}

/// Turns a part's reduced buffer into averaged gradients (`averaged[p]` for each parameter p
/// of the part): a part that is one gradient is divided in place and becomes it (burn's buffer
/// goes back to burn); the parameters of a shared part get their slices, divided.
fn unpack<C: Carrier>(
    carrier: &mut C,
    part: &Part,
    buf: C::Buf,
    denom: f32,
    averaged: &mut [Option<C::Buf>],
) {
    if let ([p], true) = (part.params.as_slice(), carrier.len(&buf) == part.len) {
        averaged[*p] = Some(carrier.divided(buf, denom));
        return;
    }
    for (k, (&p, &off)) in part.params.iter().zip(&part.offsets).enumerate() {
        let end = part.offsets.get(k + 1).copied().unwrap_or(part.len);
        averaged[p] = Some(carrier.slice_divided(&buf, off..end, denom));
    }
}

/// Whether two slices hold the same values bit for bit.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
