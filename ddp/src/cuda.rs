//! The gradient path on the GPU (feature `cuda`): when the model runs on a CUDA device of burn's
//! cubecl backend (`Device::cuda(i)`), gradients never leave the device.
//!
//! A step is the fixed sequence of `device_step.rs` ([`run_device_step`]), which this file
//! fills with burn's CUDA tensors and NCCL ([`CudaStep`]):
//!
//! 1. **Pack** every bucket with burn tensor ops on the device: each gradient flattened (a
//!    parameter without a gradient contributes zeros), the presence slots and the two failure
//!    slots, concatenated into one flat tensor (`Tensor::cat`); with accumulated micro-steps,
//!    added to the accumulator; with compression, divided by the world size and cast to
//!    bf16/f16. The flat tensor's primitive is a `CubeTensor` (burn 0.22's
//!    `Tensor::try_into_primitive::<Cube>`, feature `extension`); its memory's raw
//!    `CUdeviceptr` comes from cubecl's `Client::get_resource::<CudaServer>` (cubecl-runtime 0.11
//!    `client.rs:467` → cubecl-cuda's `GpuResource::ptr`, the handle's offset applied), which
//!    also makes the client's stream wait for the one that wrote it.
//! 2. **One synchronisation**: `Client::sync` waits until burn's stream has produced every
//!    bucket (once per step, not once per bucket).
//! 3. **Hand every bucket to NCCL**, in order: [`NcclGroup::submit_all_reduce_ptr`] enqueues the
//!    in-place all-reduces back to back on NCCL's stream. A bucket that could not be packed is
//!    replaced by a stand-in of the same length and element type carrying only this rank's
//!    raised failure slots ([`NcclGroup::submit_all_reduce_bytes`]), so the sequence never
//!    breaks.
//! 4. **Wait** for each ([`ddp_comm::nccl::NcclWork::wait`]: the host waits for NCCL's stream,
//!    so burn's later kernels see the reduced values).
//! 5. **Read the slots once**: every bucket's presence and failure slots, concatenated on the
//!    device, come to the host in one transfer; a raised failure slot fails the step
//!    ([`DdpError::PeerFailed`]). Then each present gradient is a slice of its bucket's flat
//!    tensor divided by the world size (micro-steps are summed, as PyTorch's `no_sync`),
//!    reshaped and registered again.
//!
//! Buffers (`BatchNorm`'s running statistics) and the parameters at wrap time are broadcast from
//! rank 0 on the device too ([`DevicePath::broadcast_module`]): flattened and concatenated with
//! burn ops, broadcast in place by NCCL ([`NcclGroup::submit_broadcast_ptr`]), sliced back.
//!
//! burn and cudarc share the device's primary context (cubecl-cuda retains it, as does
//! cudarc's `CudaContext::new`), so the pointer is valid in NCCL's context. The model's GPU must
//! be NCCL's: [`DevicePath::detect`] refuses another one, naming both.
//!
//! This path is type-checked in CI (`DOCS_RS=1`, no LLVM download); on a GPU it has run at one
//! rank only (`DDP_NCCL=1`, one H200: docs/gpu.md), not yet between ranks; its sequence of
//! collectives is tested on the CPU through `device_step.rs`'s fake. Other devices (flex, or
//! other cubecl runtimes) take the host path. `DDP_NCCL=0` in the environment (on every rank)
//! forces the host path on CUDA too; `DDP_NCCL=1` takes this path at one rank as well, to check
//! it on one GPU ([`ddp_comm::nccl::gradients_through_nccl`]).

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Cube, DispatchDevice};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use ddp_comm::nccl::{check_same_gpu, DeviceBytes, NcclGroup, NcclWork};
use ddp_comm::{DType, ProcessGroup, ReduceOp};
use half::{bf16, f16};

use super::{peer_failed, DistributedDataParallel, SyncPhase};
use crate::config::Compression;
use crate::device_step::{run_device_step, DeviceStep, Slots};
use crate::params::{put_grad_tensor, take_grad_tensor, to_f32, ParamKind};
use crate::DdpError;

/// The CUDA runtime's compute server, whose storage gives the raw device address.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// A bucket's flat tensor in flight, with what keeps its memory bound until NCCL is done.
type Flight = NcclWork<(Tensor<1>, Box<dyn Any>)>;

/// The NCCL communicator and the per-bucket accumulators of the device path.
pub(super) struct DevicePath {
    nccl: Arc<NcclGroup>,
    /// The packed sum of the micro-steps accumulated since the last sync, per bucket.
    acc: Vec<Option<Tensor<1>>>,
}

/// The CUDA ordinal of `device` (with or without autodiff) when it is a CUDA device of burn's
/// cubecl backend.
fn cuda_index(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Cuda(cuda)) => Some(cuda.index),
        _ => None,
    }
}

/// A flat device tensor's memory, for NCCL: its address, length, element type, what keeps it
/// bound, and the client that the one synchronisation waits on.
struct Exposed {
    ptr: u64,
    count: usize,
    dtype: DType,
    keep: Box<dyn Any>,
    client: cubecl::client::Client,
}

/// Exposes `flat`'s memory (see [`Exposed`]); `what` names it in errors.
fn expose(flat: &Tensor<1>, what: &str) -> Result<Exposed, DdpError> {
    let unsupported = |reason: String| DdpError::UnsupportedParam {
        name: what.to_string(),
        reason,
    };
    let cube = flat
        .clone()
        .try_into_primitive::<Cube>()
        .map_err(|e| unsupported(format!("the packed values are not a cubecl tensor: {e:?}")))?;
    let dtype = match cube.dtype {
        burn::tensor::DType::F32 => DType::F32,
        burn::tensor::DType::BF16 => DType::BF16,
        burn::tensor::DType::F16 => DType::F16,
        other => return Err(unsupported(format!("element type {other:?}"))),
    };
    if !cube.is_contiguous() {
        return Err(unsupported("the packed values are not contiguous".into()));
    }
    let count = cube.meta.shape().num_elements();
    let resource = cube
        .client
        .get_resource::<CudaServer>(cube.handle.clone())
        .map_err(|e| unsupported(format!("cubecl cannot expose its buffer: {e:?}")))?;
    Ok(Exposed {
        ptr: resource.resource().ptr,
        count,
        dtype,
        keep: Box::new(resource),
        client: cube.client.clone(),
    })
}

/// Waits until `client`'s stream has produced everything queued so far.
fn sync_client(client: &cubecl::client::Client) -> Result<(), DdpError> {
    cubecl::future::block_on(client.sync()).map_err(|e| DdpError::UnsupportedParam {
        name: "the packed gradients".into(),
        reason: format!("synchronising burn's CUDA stream: {e:?}"),
    })
}

impl DevicePath {
    /// The device path when the model is on a CUDA device and
    /// [`ddp_comm::nccl::gradients_through_nccl`] says so (more than one rank and `DDP_NCCL`
    /// not `0`, or `DDP_NCCL=1`): creates the NCCL communicator (a collective on `pg`, so every
    /// rank calls this at the same point) and checks that the model's GPU is NCCL's. `None`
    /// otherwise.
    pub(super) fn detect(
        pg: &ProcessGroup,
        device: &Device,
        buckets: usize,
    ) -> Result<Option<Self>, DdpError> {
        let Some(model_gpu) = cuda_index(device) else {
            return Ok(None);
        };
        if !ddp_comm::nccl::gradients_through_nccl(pg.world_size()) {
            return Ok(None);
        }
        let nccl = NcclGroup::new(pg).map_err(|e| {
            DdpError::Config(format!(
                "cannot all-reduce gradients through NCCL: {e} (set DDP_NCCL=0 on every rank to \
                 all-reduce them through the host and TCP instead)"
            ))
        })?;
        let mask = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        // Every rank checks (a local error), then all agree, so that none goes on alone.
        let local = check_same_gpu(
            model_gpu,
            nccl.device_ordinal(),
            pg.local_rank(),
            mask.as_deref(),
        );
        let flags = pg.all_gather(vec![u8::from(local.is_err())])?;
        if let Err(message) = local {
            return Err(DdpError::Config(format!("rank {}: {message}", pg.rank())));
        }
        if let Some(other) = flags.iter().position(|&f| f != 0) {
            return Err(DdpError::Config(format!(
                "rank {other}'s model is not on its NCCL GPU (see its error); no rank trains"
            )));
        }
        Ok(Some(DevicePath {
            nccl: Arc::new(nccl),
            acc: (0..buckets).map(|_| None).collect(),
        }))
    }

    /// The NCCL communicator.
    pub(super) fn nccl(&self) -> &Arc<NcclGroup> {
        &self.nccl
    }

    /// Broadcasts rank 0's values of the float tensors of `module` that `keep` accepts (by
    /// visiting index) to every rank, on the device, and returns the module with them (ids,
    /// element types and gradient requirements kept). A collective: every rank calls it with
    /// the same module layout.
    pub(super) fn broadcast_module<M: Module>(
        &self,
        module: M,
        keep: &dyn Fn(usize) -> bool,
    ) -> Result<M, DdpError> {
        struct Reader<'a> {
            keep: &'a dyn Fn(usize) -> bool,
            parts: Vec<Tensor<1>>,
            index: usize,
        }
        impl ModuleVisitor for Reader<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let index = self.index;
                self.index += 1;
                if (self.keep)(index) {
                    let t = param.val();
                    let n: usize = t.dims().iter().product();
                    let t = t.reshape([n]);
                    let t = if t.dtype() == burn::tensor::DType::F32 {
                        t
                    } else {
                        t.cast(FloatDType::F32)
                    };
                    self.parts.push(t);
                }
            }
        }
        let mut reader = Reader {
            keep,
            parts: Vec::new(),
            index: 0,
        };
        module.visit(&mut reader);
        if reader.parts.is_empty() {
            return Ok(module);
        }
        let flat = Tensor::cat(reader.parts, 0);
        let exposed = expose(&flat, "the broadcast parameters")?;
        sync_client(&exposed.client)?;
        // SAFETY: `ptr` addresses `count` f32 in the device's primary context, produced (sync
        // above); `flat` and `keep` hold the memory until `wait` returns.
        let (flat, _keep) = unsafe {
            self.nccl.submit_broadcast_ptr(
                exposed.ptr,
                exposed.count,
                exposed.dtype,
                0,
                (flat, exposed.keep),
            )
        }
        .wait()?;

        struct Writer<'a> {
            keep: &'a dyn Fn(usize) -> bool,
            flat: Tensor<1>,
            offset: usize,
            index: usize,
        }
        impl ModuleMapper for Writer<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let (id, tensor, mapper) = param.consume();
                let index = self.index;
                self.index += 1;
                if !(self.keep)(index) {
                    return Param::from_mapped_value(id, tensor, mapper);
                }
                let shape = tensor.dims();
                let n: usize = shape.iter().product();
                let values = self.flat.clone().narrow(0, self.offset, n);
                self.offset += n;
                let values = match tensor.dtype() {
                    burn::tensor::DType::F16 => values.cast(FloatDType::F16),
                    burn::tensor::DType::BF16 => values.cast(FloatDType::BF16),
                    _ => values,
                };
                let fresh = values
                    .reshape(shape)
                    .set_require_grad(tensor.is_require_grad());
                Param::from_mapped_value(id, fresh, mapper)
            }
        }
        Ok(module.map(&mut Writer {
            keep,
            flat,
            offset: 0,
            index: 0,
        }))
    }
}

impl DistributedDataParallel {
    /// [`accumulate`](Self::accumulate) on the device path.
    pub(super) fn accumulate_on_device(
        &mut self,
        mut grads: GradientsParams,
    ) -> Result<(), DdpError> {
        let start = Instant::now();
        for b in 0..self.buckets.len() {
            let flat = self.pack_on_device(b, &mut grads);
            if let Some(dp) = self.device_path.as_mut() {
                dp.acc[b] = Some(flat);
            }
        }
        self.micro_steps += 1;
        self.stats.pack += start.elapsed();
        self.check_no_unknown_grads(&grads)
    }

    /// `broadcast_buffers` on the device path: rank 0's buffers reach every rank through NCCL,
    /// without the host. With `readable == false` (this rank's module no longer matches the
    /// parameter list) the rank still takes part, with zeros of the agreed length, and loads
    /// nothing; its sync fails anyway.
    pub(super) fn broadcast_buffers_on_device<M: Module>(
        &self,
        model: &M,
        readable: bool,
    ) -> Result<(), DdpError> {
        let Some(dp) = self.device_path.as_ref() else {
            return Ok(());
        };
        let is_buffer = |i: usize| self.params[i].kind == ParamKind::Buffer;
        if !readable {
            let len: usize = self
                .params
                .iter()
                .filter(|p| p.kind == ParamKind::Buffer)
                .map(|p| p.numel())
                .sum();
            let zeros = vec![0u8; len * DType::F32.size()];
            dp.nccl()
                .submit_broadcast_bytes(&zeros, DType::F32, 0)
                .wait()?;
            return Ok(());
        }
        // burn's RunningState keeps the forward pass's update pending until it is synchronised
        // (`valid`); mapping a clone then writes through to `model`'s RunningStates.
        drop(model.valid());
        drop(dp.broadcast_module(model.clone(), &is_buffer)?);
        Ok(())
    }

    /// [`sync`](Self::sync) on the device path (world size above 1), as `device_step.rs`'s
    /// sequence. `local_error`: what already failed on this rank; like the host path, this rank
    /// still takes part in every bucket's all-reduce and raises its failure slots, so that
    /// every other rank fails this sync too ([`DdpError::PeerFailed`]).
    pub(super) fn sync_on_device(
        &mut self,
        mut grads: GradientsParams,
        local_error: Option<DdpError>,
    ) -> Result<GradientsParams, DdpError> {
        let world = self.pg.world_size();
        // Micro-steps are summed (PyTorch's no_sync); only ranks are averaged (compressed
        // buckets were divided before the all-reduce).
        let denom = match self.config.compression {
            Compression::None => world as f32,
            Compression::Bf16 | Compression::F16 => 1.0,
        };
        let buckets = self.buckets.len();
        let syncs = self.syncs;
        let start = Instant::now();
        let nccl = match self.device_path.as_ref() {
            Some(dp) => dp.nccl().clone(),
            None => {
                return Err(DdpError::Config(
                    "the device path has no communicator".into(),
                ))
            }
        };
        let result = {
            let mut step = CudaStep {
                ddp: self,
                nccl,
                grads: &mut grads,
                denom,
                client: None,
                packed_at: Vec::new(),
                previous_end: start,
            };
            run_device_step(&mut step, buckets, local_error, |failed, ranks| {
                peer_failed(syncs, failed, ranks, world)
            })
        };
        self.micro_steps = 0;
        result?;
        self.stats.steps += 1;
        Ok(grads)
    }

    /// Bucket `b`'s gradients and presence slots as one flat f32 tensor on the device, added to
    /// the bucket's accumulator when micro-steps were accumulated.
    fn pack_on_device(&mut self, b: usize, grads: &mut GradientsParams) -> Tensor<1> {
        let bucket = &self.buckets[b];
        let mut parts = Vec::with_capacity(bucket.params.len() + 1);
        let mut presence = vec![0.0f32; bucket.params.len()];
        for (slot, &p) in bucket.params.iter().enumerate() {
            let info = &self.params[p];
            match take_grad_tensor(grads, info) {
                Some(g) => {
                    presence[slot] = 1.0;
                    parts.push(g);
                }
                None => parts.push(Tensor::zeros([info.numel()], &self.device)),
            }
        }
        let n = presence.len();
        parts.push(Tensor::from_data(
            TensorData::new(presence, [n]),
            &self.device,
        ));
        let flat = Tensor::cat(parts, 0);
        let previous = match self.device_path.as_mut() {
            Some(dp) if self.micro_steps > 0 => dp.acc[b].take(),
            _ => None,
        };
        match previous {
            Some(acc) => acc + flat,
            None => flat,
        }
    }
}

/// A bucket packed on the device and exposed to NCCL.
struct Packed {
    flat: Tensor<1>,
    exposed: Exposed,
    start: Instant,
}

/// A bucket's all-reduce in flight: the real one, or the stand-in of a bucket this rank could
/// not pack.
enum CudaWork {
    Bucket(Box<Flight>),
    StandIn(NcclWork<DeviceBytes>),
}

/// One sync of the device path, for [`run_device_step`].
struct CudaStep<'a> {
    ddp: &'a mut DistributedDataParallel,
    nccl: Arc<NcclGroup>,
    grads: &'a mut GradientsParams,
    denom: f32,
    /// burn's client, from the first bucket packed: the one synchronisation waits on it.
    client: Option<cubecl::client::Client>,
    /// When each bucket was submitted (for the all-reduce spans).
    packed_at: Vec<Instant>,
    previous_end: Instant,
}

impl DeviceStep for CudaStep<'_> {
    type Packed = Packed;
    type Work = CudaWork;
    type Reduced = Option<Tensor<1>>;

    fn pack(&mut self, b: usize, failed: bool) -> Result<Packed, DdpError> {
        let start = Instant::now();
        let ddp = &mut *self.ddp;
        let flat = ddp.pack_on_device(b, self.grads);
        if b + 1 == ddp.buckets.len() {
            // Every known gradient is taken now: what is left belongs to unknown ids.
            ddp.check_no_unknown_grads(self.grads)?;
        }
        let world = ddp.pg.world_size() as f32;
        // Compressed buckets are divided by the world size before the all-reduce, so that no
        // partial sum exceeds the largest gradient (f16 tops out at 65504); presence slots
        // stay non-zero exactly where some rank had a gradient.
        let flat = match ddp.config.compression {
            Compression::None => flat,
            Compression::Bf16 | Compression::F16 => flat.div_scalar(world),
        };
        let failure = failure_slots(failed, ddp.pg.rank());
        let flat = Tensor::cat(
            vec![
                flat,
                Tensor::from_data(TensorData::new(failure.to_vec(), [2]), &ddp.device),
            ],
            0,
        );
        let flat = match ddp.config.compression {
            Compression::None => flat,
            Compression::Bf16 => flat.cast(FloatDType::BF16),
            Compression::F16 => flat.cast(FloatDType::F16),
        };
        let exposed = expose(&flat, &format!("gradient bucket {b}"))?;
        ddp.stats.bytes += (exposed.count * exposed.dtype.size()) as u64;
        ddp.stats.pack += start.elapsed();
        self.client.get_or_insert_with(|| exposed.client.clone());
        Ok(Packed {
            flat,
            exposed,
            start,
        })
    }

    fn sync(&mut self) -> Result<(), DdpError> {
        match &self.client {
            Some(client) => sync_client(client),
            None => Ok(()),
        }
    }

    fn submit(&mut self, b: usize, packed: Packed) -> CudaWork {
        let Packed {
            flat,
            exposed,
            start,
        } = packed;
        // SAFETY: `ptr` addresses `count` elements of `dtype` in the device's primary context;
        // burn's stream has produced them (the step's one sync); `flat` and `keep` hold the
        // memory until `wait` returns, and nothing else uses `flat` (a fresh tensor of ours)
        // before then.
        let work = unsafe {
            self.nccl.submit_all_reduce_ptr(
                exposed.ptr,
                exposed.count,
                exposed.dtype,
                ReduceOp::Sum,
                (flat, exposed.keep),
            )
        };
        let now = Instant::now();
        self.packed_at.push(now);
        self.ddp.span(SyncPhase::Pack, b, start, now);
        CudaWork::Bucket(Box::new(work))
    }

    fn submit_failed(&mut self, b: usize) -> Result<CudaWork, DdpError> {
        let len = self.ddp.buckets[b].len();
        let mut values = vec![0.0f32; len];
        values[len - 2..].copy_from_slice(&failure_slots(true, self.ddp.pg.rank()));
        let (bytes, dtype): (Vec<u8>, DType) = match self.ddp.config.compression {
            Compression::None => (bytemuck::cast_slice(&values).to_vec(), DType::F32),
            Compression::Bf16 => {
                let v: Vec<u16> = values
                    .iter()
                    .map(|&x| bf16::from_f32(x).to_bits())
                    .collect();
                (bytemuck::cast_slice(&v).to_vec(), DType::BF16)
            }
            Compression::F16 => {
                let v: Vec<u16> = values.iter().map(|&x| f16::from_f32(x).to_bits()).collect();
                (bytemuck::cast_slice(&v).to_vec(), DType::F16)
            }
        };
        let work = self
            .nccl
            .submit_all_reduce_bytes(&bytes, dtype, ReduceOp::Sum);
        self.packed_at.push(Instant::now());
        Ok(CudaWork::StandIn(work))
    }

    fn wait(&mut self, b: usize, work: CudaWork) -> Result<Option<Tensor<1>>, DdpError> {
        let wait_start = Instant::now();
        let result = match work {
            CudaWork::Bucket(w) => w.wait().map(|(flat, _keep)| Some(flat)),
            CudaWork::StandIn(w) => w.wait().map(|_| None),
        };
        let wait_end = Instant::now();
        self.ddp.stats.wait += wait_end - wait_start;
        // The host's view: kernels run asynchronously on the GPU's streams.
        self.ddp.span(SyncPhase::Wait, b, wait_start, wait_end);
        let submitted = self.packed_at.get(b).copied().unwrap_or(wait_start);
        self.ddp.span(
            SyncPhase::AllReduce,
            b,
            submitted.max(self.previous_end),
            wait_end,
        );
        self.previous_end = wait_end;
        Ok(result?)
    }

    fn read_slots(&mut self, reduced: &[Option<Tensor<1>>]) -> Result<Vec<Slots>, DdpError> {
        let ddp = &*self.ddp;
        let mut parts = Vec::with_capacity(reduced.len());
        for (b, flat) in reduced.iter().enumerate() {
            let bucket = &ddp.buckets[b];
            let flat = flat.clone().ok_or_else(|| {
                DdpError::Config(format!("bucket {b} has no reduced values to read"))
            })?;
            let slots = flat.narrow(0, bucket.grad_len, bucket.params.len() + 2);
            parts.push(if slots.dtype() == burn::tensor::DType::F32 {
                slots
            } else {
                slots.cast(FloatDType::F32)
            });
        }
        let total: usize = ddp.buckets.iter().map(|b| b.params.len() + 2).sum();
        // One transfer to the host for the whole step.
        let values = to_f32(
            Tensor::cat(parts, 0).into_data(),
            "every bucket",
            "presence and failure slots",
            total,
        )?;
        let mut at = 0;
        Ok(ddp
            .buckets
            .iter()
            .map(|bucket| {
                let n = bucket.params.len();
                let slots = Slots {
                    presence: values[at..at + n].to_vec(),
                    failed: values[at + n],
                    ranks: values[at + n + 1],
                };
                at += n + 2;
                slots
            })
            .collect())
    }

    fn unpack(&mut self, b: usize, reduced: Option<Tensor<1>>, presence: &[f32]) {
        let Some(flat) = reduced else { return };
        let start = Instant::now();
        let flat = if flat.dtype() == burn::tensor::DType::F32 {
            flat
        } else {
            flat.cast(FloatDType::F32)
        };
        let ddp = &mut *self.ddp;
        let bucket = &ddp.buckets[b];
        for (slot, (&p, &off)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
            if presence[slot] == 0.0 {
                continue; // no rank produced a gradient for this parameter
            }
            let info = &ddp.params[p];
            let g = flat
                .clone()
                .narrow(0, off, info.numel())
                .div_scalar(self.denom);
            put_grad_tensor(self.grads, info, g);
        }
        let end = Instant::now();
        ddp.stats.unpack += end - start;
        ddp.span(SyncPhase::Unpack, b, start, end);
    }

    fn abandon(&mut self, error: &DdpError) {
        let _ = self.nccl.abandon(&error.to_string());
    }
}

/// A bucket's failure slots: raised (1, rank + 1) when this rank failed, zeros otherwise.
fn failure_slots(failed: bool, rank: usize) -> [f32; 2] {
    if failed {
        [1.0, (rank + 1) as f32]
    } else {
        [0.0, 0.0]
    }
}
