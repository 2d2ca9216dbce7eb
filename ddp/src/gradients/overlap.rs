//! Gradient all-reduces started while backward runs (PyTorch DDP's autograd hooks), for burn's
//! CPU backend with autodiff.
//!
//! burn 0.22 has no public hook that fires when a parameter's gradient is ready (its own
//! gradient-sync registration feeds a process-local server whose all-reduce the CPU backend
//! lacks; docs/burn-notes.md). So the wrapper makes its own: [`OverlapState::hook_model`] gives
//! a copy of the model whose trainable parameters are `ddp_grad_hook(param, carrier)`
//! (`overlap_ops.rs`), an identity whose backward step runs once the parameter's gradient is
//! complete, hands it over and passes it on to the parameter. The forward pass runs on the
//! copy; the gradients land on the model's own parameters, so `from_grads`, the checks and the
//! optimizer work on the model as without overlap, and the model code is unchanged.
//!
//! When a hook fires, it hands the gradient it takes from burn (no copy) to the wrapper's
//! gradient pipeline (`pipeline.rs`), the same one `sync` feeds from `GradientsParams`: the
//! same buckets in the same order, so the sums are the same bits as without overlap. A bucket
//! whose last gradient arrived is submitted at once, but only after every earlier bucket:
//! buckets go out in the same order on every rank, whatever order the hooks fire in. Buckets
//! with a parameter whose hook never fired (no gradient on this rank this step) wait for the
//! sync after backward, which hands over what `GradientsParams` holds.
//!
//! A hook sees the uses of its parameter in its own copy only. The loss may reach the
//! parameter by other paths too: a term on the model's own parameter (an L2 penalty read from
//! `model`), a second copy from `prepare` (siamese inputs: each copy has its own hooks), a
//! layer of the model run outside the copy. burn adds those pieces on the parameter itself,
//! and the pipeline adds them to what the hook handed over, so the bucket carries the whole
//! gradient, as without overlap. The pieces are only known at the end of backward: the first
//! overlapped pass holds every bucket until then and learns which parameters get such pieces,
//! and later passes hold the buckets of those (`pipeline.rs`, "late" parameters). A path that
//! appears later, after its bucket went out, fails the step on every rank, naming the
//! parameter ([`DdpError::LateGradient`]); the retried step holds that bucket too.
//!
//! Where a hook fires is set by its carrier's depth (see `overlap_ops.rs`). The first overlapped
//! step measures the depth D of the loss (a probe on the loss) with every hook at depth 1 (no
//! overlap yet); afterwards trainable parameter t of n (visiting order: for most models the
//! order of the forward pass) gets depth `t * D / n`, so the last layers' hooks fire early in
//! backward and the first layers' late. A model whose fields are not in forward order still
//! gets correct results, with less overlap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};

use crate::gradients::host_buf::HostBuf;
use crate::gradients::host_carrier::HostCarrier;
use crate::gradients::overlap_ops::{DepthProbe, GradHook, OverlapOps};
use crate::gradients::pipeline::Pipeline;
use crate::params::ParamInfo;
use crate::DdpError;

/// The overlap machinery of one wrapper.
pub(crate) struct OverlapState {
    /// Shared with each step's hooks (no copy per step).
    params: Arc<[ParamInfo]>,
    /// The wrapper's gradient pipeline, which the hooks hand their gradients to.
    pipeline: Arc<Mutex<Pipeline<HostCarrier>>>,
    /// The loss depth measured by the first overlapped pass.
    loss_depth: Arc<Mutex<Option<usize>>>,
    /// Whether the hooks take the gradients (only inside an overlapped backward): disarmed,
    /// they pass them on to the parameters and read nothing.
    armed: Arc<AtomicBool>,
    /// Whether the model of the coming pass was hooked.
    prepared: bool,
}

/// Locks, recovering from a panic on another thread (the state is plain data).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OverlapState {
    /// The machinery for the wrapper's parameter list and gradient pipeline.
    pub(crate) fn new(
        params: Arc<[ParamInfo]>,
        pipeline: Arc<Mutex<Pipeline<HostCarrier>>>,
    ) -> Self {
        Self {
            params,
            pipeline,
            loss_depth: Arc::new(Mutex::new(None)),
            armed: Arc::new(AtomicBool::new(false)),
            prepared: false,
        }
    }

    /// Whether the last [`hook_model`](Self::hook_model) hooked a model that has not been
    /// through backward yet.
    pub(crate) fn prepared(&self) -> bool {
        self.prepared
    }

    /// A copy of `model` (on `device`, burn's CPU backend with autodiff) whose trainable
    /// parameters are their hooked values; `model` itself is unchanged, and its parameters
    /// receive the gradients the hooks do not take. Before the depth is known every hook sits
    /// at depth 1.
    pub(crate) fn hook_model<M: Module>(&mut self, model: &M, device: &Device) -> M {
        let depth = *lock(&self.loss_depth);
        let n = self.params.iter().filter(|p| p.trainable()).count().max(1);
        let depth_of = |t: usize| depth.map_or(0, |d| t * d / n);
        let max_depth = (0..n).map(depth_of).max().unwrap_or(0);
        // One chain of carriers: carriers[k] has depth k.
        let mut carriers = Vec::with_capacity(max_depth + 1);
        // Untracked: a carrier only sets its hook's depth (burn derives a node's depth from
        // every parent, tracked or not) and is no part of the backward pass.
        let mut c = Tensor::<1>::zeros([1], device);
        carriers.push(c.clone());
        for _ in 0..max_depth {
            c = c.add_scalar(0.0);
            carriers.push(c.clone());
        }
        let pipeline = Arc::clone(&self.pipeline);
        let params = Arc::clone(&self.params);
        // The hook's gradient, taken from burn (not copied): it becomes its part's buffer, or
        // is copied into it, and burn's gradient container never holds it.
        let sink = Arc::new(move |index: usize, data: Option<TensorData>| {
            let info = &params[index];
            let grad = match data {
                Some(d) => HostBuf::from_data(d, &info.name, "gradient", info.numel()).map(Some),
                None => Err(DdpError::Conversion {
                    name: info.name.clone(),
                    what: "gradient",
                    reason: "the backend could not read it".into(),
                }),
            };
            lock(&pipeline).deliver(index, grad);
        });
        let mut hooker = Hooker {
            params: &self.params,
            carriers: &carriers,
            depth_of: &depth_of,
            armed: &self.armed,
            sink,
            index: 0,
            trainable: 0,
        };
        let hooked = model.clone().map(&mut hooker);
        self.prepared = true;
        hooked
    }

    /// Arms the hooks for one backward pass (the pipeline's micro-step has begun) and, before
    /// the depth is known, wraps `loss` in the depth probe.
    pub(crate) fn arm(&mut self, loss: Tensor<1>) -> Tensor<1> {
        self.armed.store(true, Ordering::Release);
        if lock(&self.loss_depth).is_some() {
            return loss;
        }
        let depth = Arc::clone(&self.loss_depth);
        let probe = DepthProbe {
            sink: Arc::new(move |d| {
                *lock(&depth) = Some(d);
            }),
        };
        Tensor::from_dispatch(Dispatch::ddp_depth_probe(loss.into_dispatch(), probe))
    }

    /// Disarms the hooks after the pass.
    pub(crate) fn disarm(&mut self) {
        self.prepared = false;
        self.armed.store(false, Ordering::Release);
    }

    /// The loss depth measured so far (`None` before the first overlapped pass).
    pub(crate) fn loss_depth(&self) -> Option<usize> {
        *lock(&self.loss_depth)
    }
}

/// Maps trainable parameters to their hooked values.
struct Hooker<'a> {
    params: &'a [ParamInfo],
    carriers: &'a [Tensor<1>],
    depth_of: &'a dyn Fn(usize) -> usize,
    armed: &'a Arc<AtomicBool>,
    sink: Arc<dyn Fn(usize, Option<TensorData>) + Send + Sync>,
    /// Visiting index of the next float tensor.
    index: usize,
    /// Trainable parameters seen so far.
    trainable: usize,
}

impl ModuleMapper for Hooker<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let index = self.index;
        self.index += 1;
        if !self.params.get(index).is_some_and(ParamInfo::trainable) {
            return param;
        }
        let t = self.trainable;
        self.trainable += 1;
        let (id, tensor, mapper) = param.consume();
        let carrier = self.carriers[(self.depth_of)(t).min(self.carriers.len() - 1)].clone();
        let hook = GradHook {
            index,
            armed: Arc::clone(self.armed),
            sink: Arc::clone(&self.sink),
        };
        let hooked = Tensor::from_dispatch(Dispatch::ddp_grad_hook(
            tensor.into_dispatch(),
            carrier.into_dispatch(),
            hook,
        ));
        Param::from_mapped_value(id, hooked, mapper)
    }
}
