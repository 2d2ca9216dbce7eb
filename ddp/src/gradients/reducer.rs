//! The [`Reducer`]: what both wrappers ([`crate::DistributedDataParallel`] and
//! [`crate::ShardedDataParallel`]) do with a gradient before their own last step, in one type
//! each owns, as PyTorch's c10d `Reducer` is owned by its DDP.
//!
//! At construction it checks that every rank holds the same parameter list (`agree.rs`), lays
//! out the buckets (`buckets.rs`), builds the gradient pipeline with its carrier (the host's,
//! `host_carrier.rs`, all-reducing for DDP or reduce-scattering for ZeRO; or, on a CUDA device
//! with NCCL, the device path of `device_path.rs`) and starts every replica from rank 0's
//! values. At every step it does what comes before the gradients (`begin_sync`: the parameter
//! check, the buffer broadcast, the periodic replica check), runs backward with the overlap
//! hooks armed when the model came from [`Reducer::prepare`], accumulates micro-steps, and, for
//! DDP, drives the pipeline to the averaged gradients (`all_reduce`, the loop described in
//! `ddp.rs`). ZeRO drives the same pipeline to its own chunks (`zero/sharded.rs`).
//!
//! The settings it needs are `ReducerSettings` (`config.rs`), taken from
//! [`crate::DdpConfig`] or from [`crate::ZeroConfig`].

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use ddp_comm::bytes::fnv1a;
use ddp_comm::ProcessGroup;

use crate::config::{Compression, ReducerSettings};
use crate::gradients::agree::{broadcast_values, diverged_ranks, verify_same_params, Start};
use crate::gradients::buckets::{plan_buckets, Bucket, Layout, Part};
use crate::gradients::carrier::Carrier;
#[cfg(feature = "cuda")]
use crate::gradients::device_path::DevicePath;
use crate::gradients::hook_buckets::Hooked;
use crate::gradients::host_carrier::{HostCarrier, Reduction};
use crate::gradients::overlap::{lock, OverlapState};
use crate::gradients::pipeline::{Done, Pipeline};
use crate::gradients::stats::{SyncPhase, SyncSpan, SyncStats};
use crate::hooks::comm_hook::{bucket_descs, DynHook};
use crate::params::{
    check_dtypes, check_ranks, flatten_where, load_where, param_ids, param_infos, ParamInfo,
    ParamKind,
};
use crate::DdpError;

/// The checks, buffer broadcast, bucket pipeline, overlap and carrier choice of one wrapper
/// (see the module documentation).
pub(crate) struct Reducer {
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
    settings: ReducerSettings,
    stats: SyncStats,
    /// `Some` while [`record_spans`](Self::record_spans) is on: the spans since the last take.
    spans: Option<Vec<SyncSpan>>,
    /// Set when gradients are all-reduced on the GPU through NCCL.
    #[cfg(feature = "cuda")]
    device_path: Option<DevicePath>,
    /// Set with overlap on more than one rank: the hooks of `prepare`.
    overlap: Option<OverlapState>,
    /// The last backward pass's start and end.
    backward_span: Option<(Instant, Instant)>,
}

impl Reducer {
    /// Checks the settings and that every rank has the same parameter list (names, shapes,
    /// dtypes, which are buffers), lays out the buckets and the pipeline whose carrier reduces
    /// each part by `reduction`, and starts the replicas as `start` says (rank 0's values
    /// broadcast, or known identical already); returns the (possibly overwritten) module.
    /// Every rank of `pg` calls it at the same point.
    pub(crate) fn new<M: Module>(
        model: M,
        pg: Arc<ProcessGroup>,
        settings: ReducerSettings,
        reduction: Reduction,
        start: Start,
    ) -> Result<(M, Self), DdpError> {
        if !(settings.bucket_cap_mb > 0.0 && settings.first_bucket_mb > 0.0) {
            return Err(DdpError::Config(format!(
                "bucket sizes must be positive (bucket_cap_mb = {}, first_bucket_mb = {})",
                settings.bucket_cap_mb, settings.first_bucket_mb
            )));
        }
        if settings.check_replicas_every == Some(0) {
            return Err(DdpError::Config(
                "check_replicas_every must be at least 1".into(),
            ));
        }
        let params = param_infos(&model);
        check_ranks(&params)?;
        check_dtypes(&params)?;
        verify_same_params(&pg, &params)?;

        let has_buffers = params.iter().any(|p| p.kind == ParamKind::Buffer);
        let params: Arc<[ParamInfo]> = params.into();
        let layout: Arc<Layout> = Arc::new(plan_buckets(&params, &settings));
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
        let device_path = DevicePath::detect(&pg, &device, &params, &layout, settings.compression)?;

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
        let overlap = (settings.overlap && pg.world_size() > 1 && !buckets.is_empty())
            .then(|| OverlapState::new(Arc::clone(&params), Arc::clone(&pipeline)));
        #[cfg(feature = "cuda")]
        let overlap = overlap.filter(|_| device_path.is_none());
        Ok((
            model,
            Self {
                pg,
                params,
                has_buffers,
                buckets,
                pipeline,
                micro_steps: 0,
                syncs: 0,
                device,
                settings,
                stats: SyncStats::default(),
                spans: None,
                #[cfg(feature = "cuda")]
                device_path,
                overlap,
                backward_span: None,
            },
        ))
    }

    /// Binds `hook` to the buckets and hands it to the pipeline's carrier; refused as
    /// [`DistributedDataParallel::register_comm_hook`](crate::DistributedDataParallel::register_comm_hook)
    /// says.
    pub(crate) fn install_hook(&mut self, mut hook: Box<dyn DynHook>) -> Result<(), DdpError> {
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
    pub(crate) fn hooked(&self) -> bool {
        lock(&self.pipeline).carrier().hook.is_some()
    }

    /// [`DistributedDataParallel::comm_hook_state`](crate::DistributedDataParallel::comm_hook_state).
    pub(crate) fn comm_hook_state(&self) -> Option<Vec<u8>> {
        let mut pipeline = lock(&self.pipeline);
        let hooked = pipeline.carrier().hook.as_ref()?;
        hooked.hook().state()
    }

    /// [`DistributedDataParallel::load_comm_hook_state`](crate::DistributedDataParallel::load_comm_hook_state).
    pub(crate) fn load_comm_hook_state(
        &mut self,
        bytes: &[u8],
        name: &str,
    ) -> Result<(), DdpError> {
        let mut pipeline = lock(&self.pipeline);
        match pipeline.carrier().hook.as_mut() {
            Some(hooked) => hooked.hook_mut().load_state(bytes, name),
            None => Err(DdpError::Checkpoint(format!(
                "{name}: holds a communication hook state, but this wrapper has no hook"
            ))),
        }
    }

    /// [`DistributedDataParallel::process_group`](crate::DistributedDataParallel::process_group).
    pub(crate) fn process_group(&self) -> &Arc<ProcessGroup> {
        &self.pg
    }

    /// [`DistributedDataParallel::params`](crate::DistributedDataParallel::params).
    pub(crate) fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// [`DistributedDataParallel::bucket_layout`](crate::DistributedDataParallel::bucket_layout).
    pub(crate) fn bucket_layout(&self) -> Vec<Vec<String>> {
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

    /// How many syncs were begun (the number in [`DdpError::PeerFailed`]).
    pub(crate) fn syncs(&self) -> u64 {
        self.syncs
    }

    /// The bucket layout (the parts every carrier reduces).
    pub(crate) fn layout(&self) -> Arc<Layout> {
        Arc::clone(lock(&self.pipeline).layout())
    }

    /// The device the gradients live on (the model's, without autodiff).
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// [`DistributedDataParallel::gradients_on_device`](crate::DistributedDataParallel::gradients_on_device).
    pub(crate) fn gradients_on_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.device_path.is_some()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// [`DistributedDataParallel::take_stats`](crate::DistributedDataParallel::take_stats).
    pub(crate) fn take_stats(&mut self) -> SyncStats {
        std::mem::take(&mut self.stats)
    }

    /// [`DistributedDataParallel::record_spans`](crate::DistributedDataParallel::record_spans).
    pub(crate) fn record_spans(&mut self, on: bool) {
        self.spans = on.then(|| self.spans.take().unwrap_or_default());
    }

    /// [`DistributedDataParallel::take_spans`](crate::DistributedDataParallel::take_spans).
    pub(crate) fn take_spans(&mut self) -> Vec<SyncSpan> {
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

    /// [`DistributedDataParallel::prepare`](crate::DistributedDataParallel::prepare).
    pub(crate) fn prepare<M: Module>(&mut self, model: &M) -> M {
        if self.why_no_overlap(model).is_some() {
            return model.clone();
        }
        match (self.overlap.as_mut(), model.devices().into_iter().next()) {
            (Some(overlap), Some(device)) => overlap.hook_model(model, &device),
            _ => model.clone(),
        }
    }

    /// [`DistributedDataParallel::why_no_overlap`](crate::DistributedDataParallel::why_no_overlap).
    pub(crate) fn why_no_overlap<M: Module>(&self, model: &M) -> Option<&'static str> {
        if !self.settings.overlap {
            return Some("overlap is off (DdpConfig::overlap or ZeroConfig::overlap)");
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

    /// [`DistributedDataParallel::last_backward`](crate::DistributedDataParallel::last_backward).
    pub(crate) fn last_backward(&self) -> Option<(Instant, Instant)> {
        self.backward_span
    }

    /// [`DistributedDataParallel::overlap_depth`](crate::DistributedDataParallel::overlap_depth).
    pub(crate) fn overlap_depth(&self) -> Option<usize> {
        self.overlap.as_ref().and_then(OverlapState::loss_depth)
    }

    /// [`DistributedDataParallel::late_gradient_params`](crate::DistributedDataParallel::late_gradient_params).
    pub(crate) fn late_gradient_params(&self) -> Vec<String> {
        lock(&self.pipeline)
            .late_params()
            .map(|info| info.name.clone())
            .collect()
    }

    /// [`DistributedDataParallel::accumulate`](crate::DistributedDataParallel::accumulate).
    pub(crate) fn accumulate(&mut self, mut grads: GradientsParams) -> Result<(), DdpError> {
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

    /// The gradient part of a sync, after [`begin_sync`](Self::begin_sync): hands `grads` to
    /// the pipeline (after the hooks' gradients, when `begun` by an overlapped backward), which
    /// submits the buckets not yet submitted and the control all-reduce; waits for every part
    /// in order, unpacking each as it completes, and registers the averaged gradients.
    pub(crate) fn all_reduce(
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
        if let Some(every) = self.settings.check_replicas_every {
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

    /// [`DistributedDataParallel::check_replicas`](crate::DistributedDataParallel::check_replicas).
    pub(crate) fn check_replicas<M: Module>(&self, model: &M) -> Result<(), DdpError> {
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
        if one_rank || !self.has_buffers || !self.settings.broadcast_buffers {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Some(dp) = self.device_path.as_ref() {
            return dp.broadcast_buffers(&self.params, model, readable);
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
