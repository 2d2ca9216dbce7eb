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
//! When a hook fires (`ready`), the gradient is copied into its bucket's buffer (the buckets
//! and their order are the wrapper's, so the sums are the same bits as without overlap). A
//! bucket whose last gradient arrived is submitted to the communication thread at once, but
//! only after every earlier bucket: buckets go out in the same order on every rank, whatever
//! order the hooks fire in. Buckets with a parameter whose hook never fired (no gradient on
//! this rank this step) wait for `sync`, which packs them from `GradientsParams` as today.
//!
//! Where a hook fires is set by its carrier's depth (see `overlap_ops.rs`). The first overlapped
//! step measures the depth D of the loss (a probe on the loss) with every hook at depth 1 (no
//! overlap yet); afterwards trainable parameter t of n (visiting order: for most models the
//! order of the forward pass) gets depth `t * D / n`, so the last layers' hooks fire early in
//! backward and the first layers' late. A model whose fields are not in forward order still
//! gets correct results, with less overlap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, Tensor, TensorData};
use ddp_comm::ProcessGroup;

use crate::buckets::{submit_bucket, Bucket, InFlight};
use crate::config::Compression;
use crate::overlap_ops::{DepthProbe, GradHook, OverlapOps};
use crate::params::{to_f32, ParamInfo};
use crate::DdpError;

/// A bucket submitted during backward: its all-reduce, and when its packing started and ended.
pub(crate) struct Early {
    /// The all-reduce in flight.
    pub work: InFlight,
    /// When its packing started, were its gradients packed in one go: its submission minus
    /// the time the hooks spent packing it (they pack each gradient as it comes).
    pub pack_start: Instant,
    /// When it was submitted.
    pub submitted: Instant,
}

/// What an overlapped backward pass did, for the sync that follows.
pub(crate) struct Disarmed {
    /// The bucket buffers, back.
    pub buffers: Vec<Vec<f32>>,
    /// The buckets submitted during the pass: a prefix of the bucket order.
    pub early: Vec<Early>,
    /// The first gradient that could not be read.
    pub error: Option<DdpError>,
    /// Which parameters' gradients are in the buffers already (by parameter index).
    pub packed: Vec<bool>,
    /// Bytes submitted.
    pub bytes: u64,
}

/// What the hooks share with the wrapper during one overlapped backward pass.
struct Step {
    /// Whether the buffers start afresh (no micro-step accumulated since the last sync).
    fresh: bool,
    /// The bucket buffers, lent by the wrapper for the pass.
    buffers: Vec<Vec<f32>>,
    /// Gradients still missing per bucket.
    pending: Vec<usize>,
    /// The next bucket to submit.
    next: usize,
    /// Buckets submitted so far, in order.
    early: Vec<Early>,
    /// Time spent packing each bucket so far.
    pack_time: Vec<Duration>,
    /// A gradient that could not be read: the bucket goes out with its failure slots raised.
    failed: Vec<bool>,
    /// The first such error, for this rank's own result.
    error: Option<DdpError>,
    /// Which parameters' gradients the hooks packed (by parameter index).
    packed: Vec<bool>,
    /// Bytes submitted.
    bytes: u64,
}

/// The overlap machinery of one wrapper.
pub(crate) struct OverlapState {
    pg: Arc<ProcessGroup>,
    /// Shared with each step's hooks (no copy per step).
    params: Arc<[ParamInfo]>,
    buckets: Arc<[Bucket]>,
    /// For each parameter: its bucket and slot (`None`: not trainable).
    place: Arc<[Option<(usize, usize)>]>,
    compression: Compression,
    /// The loss depth measured by the first overlapped pass.
    loss_depth: Arc<Mutex<Option<usize>>>,
    /// Whether the hooks read, pack and submit (only inside `DistributedDataParallel::
    /// backward`): disarmed, they copy nothing.
    armed: Arc<AtomicBool>,
    step: Arc<Mutex<Step>>,
    /// Whether the model of the coming pass was hooked.
    prepared: bool,
}

/// Locks, recovering from a panic on another thread (the state is plain data).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl OverlapState {
    /// The machinery for the wrapper's parameter list and buckets.
    pub(crate) fn new(
        pg: Arc<ProcessGroup>,
        params: &[ParamInfo],
        buckets: &[Bucket],
        compression: Compression,
    ) -> Self {
        let mut place = vec![None; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for (slot, &p) in bucket.params.iter().enumerate() {
                place[p] = Some((b, slot));
            }
        }
        Self {
            pg,
            params: params.into(),
            buckets: buckets.into(),
            place: place.into(),
            compression,
            loss_depth: Arc::new(Mutex::new(None)),
            armed: Arc::new(AtomicBool::new(false)),
            step: Arc::new(Mutex::new(Step {
                fresh: true,
                buffers: Vec::new(),
                pending: Vec::new(),
                next: 0,
                early: Vec::new(),
                pack_time: Vec::new(),
                failed: Vec::new(),
                error: None,
                packed: Vec::new(),
                bytes: 0,
            })),
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
    /// receive the gradients. Before the depth is known every hook sits at depth 1.
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
        let shared = Arc::clone(&self.step);
        let places = Arc::clone(&self.place);
        let params = Arc::clone(&self.params);
        let buckets = Arc::clone(&self.buckets);
        let (pg, compression) = (Arc::clone(&self.pg), self.compression);
        let sink = Arc::new(move |index: usize, data: Option<TensorData>| {
            let mut step = lock(&shared);
            let Some((b, slot)) = places[index] else {
                return;
            };
            let (name, numel) = (&params[index].name, params[index].numel());
            let start = Instant::now();
            let values = match data {
                Some(d) => to_f32(d, name, "gradient", numel),
                None => Err(DdpError::Conversion {
                    name: name.clone(),
                    what: "gradient",
                    reason: "the backend could not read it".into(),
                }),
            };
            let bucket = &buckets[b];
            match values {
                Ok(g) => {
                    let off = bucket.offsets[slot];
                    let fresh = step.fresh;
                    let buf = &mut step.buffers[b];
                    let dst = &mut buf[off..off + g.len()];
                    if fresh {
                        dst.copy_from_slice(&g);
                    } else {
                        dst.iter_mut().zip(&g).for_each(|(d, s)| *d += s);
                    }
                    buf[bucket.grad_len + slot] += 1.0;
                }
                Err(e) => {
                    step.failed[b] = true;
                    step.error.get_or_insert(e);
                }
            }
            step.packed[index] = true;
            step.pack_time[b] += start.elapsed();
            step.pending[b] -= 1;
            // Submit, in bucket order, every bucket that is complete.
            while step.next < buckets.len() && step.pending[step.next] == 0 {
                let k = step.next;
                let failed = step.failed[k];
                let mut buf = std::mem::take(&mut step.buffers[k]);
                let (work, bytes) = submit_bucket(&pg, &mut buf, &buckets[k], failed, compression);
                step.buffers[k] = buf;
                step.bytes += bytes;
                let submitted = Instant::now();
                let pack_start = submitted
                    .checked_sub(step.pack_time[k])
                    .unwrap_or(submitted);
                step.early.push(Early {
                    work,
                    pack_start,
                    submitted,
                });
                step.next += 1;
            }
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

    /// Arms the hooks for one backward pass: lends the bucket buffers (`fresh`: no micro-step
    /// accumulated in them) and, before the depth is known, wraps `loss` in the depth probe.
    pub(crate) fn arm(
        &mut self,
        mut buffers: Vec<Vec<f32>>,
        fresh: bool,
        loss: Tensor<1>,
    ) -> Tensor<1> {
        if fresh {
            // The hooks copy into their slots; whatever `sync` packs later goes onto zeros.
            buffers.iter_mut().for_each(|b| b.fill(0.0));
        }
        let n = self.buckets.len();
        let mut pending = vec![0; n];
        for (b, bucket) in self.buckets.iter().enumerate() {
            pending[b] = bucket.params.len();
        }
        {
            let mut step = lock(&self.step);
            step.fresh = fresh;
            step.buffers = buffers;
            step.pending = pending;
            step.next = 0;
            step.early.clear();
            step.pack_time = vec![Duration::ZERO; n];
            step.failed = vec![false; n];
            step.error = None;
            step.packed = vec![false; self.params.len()];
            step.bytes = 0;
        }
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

    /// Disarms the hooks after the pass and returns what it did.
    pub(crate) fn disarm(&mut self) -> Disarmed {
        self.prepared = false;
        self.armed.store(false, Ordering::Release);
        let mut step = lock(&self.step);
        Disarmed {
            buffers: std::mem::take(&mut step.buffers),
            early: std::mem::take(&mut step.early),
            error: step.error.take(),
            packed: std::mem::take(&mut step.packed),
            bytes: step.bytes,
        }
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
