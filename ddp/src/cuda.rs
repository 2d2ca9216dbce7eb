//! The gradient path on the GPU (feature `cuda`): when the model runs on a CUDA device of burn's
//! cubecl backend (`Device::cuda(i)`), gradients never leave the device.
//!
//! Per bucket, as on the host path and in the same order:
//!
//! 1. **Pack** with burn tensor ops on the device: each gradient flattened (a parameter without
//!    a gradient contributes zeros), then the presence slots, concatenated into one flat tensor
//!    (`Tensor::cat`, one kernel); with accumulated micro-steps, added to the accumulator; with
//!    compression, cast to bf16/f16.
//! 2. **Hand the buffer to NCCL**: the flat tensor's primitive is a `CubeTensor` (burn 0.22's
//!    `Tensor::try_into_primitive::<Cube>`, feature `extension`); its memory's raw
//!    `CUdeviceptr` comes from cubecl's `Client::get_resource::<CudaServer>` (cubecl-runtime 0.11
//!    `client.rs:467` → cubecl-cuda's `GpuResource::ptr`, the handle's offset applied).
//!    `Client::sync` then waits until burn's stream has produced it, and
//!    [`NcclGroup::submit_all_reduce_ptr`] enqueues the
//!    in-place all-reduce on NCCL's stream. Packing the next bucket (burn's stream) overlaps this
//!    bucket's all-reduce (NCCL's stream).
//! 3. **Unpack** after [`ddp_comm::nccl::NcclWork::wait`] (the host waits for NCCL's stream, so
//!    burn's later kernels see the reduced values): the presence slots are read to the host (one
//!    value per parameter), and each present gradient is a slice of the flat tensor divided by
//!    the world size (micro-steps are summed, as PyTorch's `no_sync`), reshaped and registered
//!    again. Presence slots that cannot be read are an error naming the bucket's parameters.
//!
//! burn and cudarc share the device's primary context (cubecl-cuda retains it, as does
//! cudarc's `CudaContext::new`), so the pointer is valid in NCCL's context.
//!
//! This path is type-checked in CI (`DOCS_RS=1`, no LLVM download) but has not run on a GPU
//! with burn 0.22 yet (docs/gpu.md). Other devices (flex, or other cubecl runtimes) take the host
//! path. `DDP_NCCL=0` in the environment (on every rank) forces the host path on CUDA too.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use burn::backend::{Cube, DispatchDevice};
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor, TensorData};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use ddp_comm::nccl::{NcclGroup, NcclWork};
use ddp_comm::{DType, ProcessGroup, ReduceOp};

use super::{peer_failed, DistributedDataParallel, SyncPhase};
use crate::config::Compression;
use crate::params::{put_grad_tensor, take_grad_tensor, to_f32};
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

/// Whether `device` (with or without autodiff) is a CUDA device of burn's cubecl backend.
fn is_cuda(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        DispatchDevice::Cube(cubecl::Device::Cuda(_))
    )
}

impl DevicePath {
    /// The device path when the model is on a CUDA device, the group has more than one rank
    /// and `DDP_NCCL` is not `0`: creates the NCCL communicator (a collective on `pg`, so every
    /// rank calls this at the same point). `None` otherwise.
    pub(super) fn detect(
        pg: &ProcessGroup,
        device: &Device,
        buckets: usize,
    ) -> Result<Option<Self>, DdpError> {
        if !is_cuda(device) || pg.world_size() == 1 {
            return Ok(None);
        }
        if std::env::var("DDP_NCCL").is_ok_and(|v| v.trim() == "0") {
            return Ok(None);
        }
        let nccl = NcclGroup::new(pg).map_err(|e| {
            DdpError::Config(format!(
                "cannot all-reduce gradients through NCCL: {e} (set DDP_NCCL=0 on every rank to \
                 all-reduce them through the host and TCP instead)"
            ))
        })?;
        Ok(Some(DevicePath {
            nccl: Arc::new(nccl),
            acc: (0..buckets).map(|_| None).collect(),
        }))
    }

    /// The NCCL communicator.
    pub(super) fn nccl(&self) -> &Arc<NcclGroup> {
        &self.nccl
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

    /// [`sync`](Self::sync) on the device path (world size above 1). `local_error`: what
    /// already failed on this rank; like the host path, this rank still takes part in every
    /// bucket's all-reduce and raises the bucket's failure slots, so that every other rank
    /// fails this sync too ([`DdpError::PeerFailed`]).
    pub(super) fn sync_on_device(
        &mut self,
        mut grads: GradientsParams,
        mut local_error: Option<DdpError>,
    ) -> Result<GradientsParams, DdpError> {
        let pack_start = Instant::now();
        let mut in_flight: Vec<Result<Flight, DdpError>> = Vec::new();
        let mut submitted = Vec::with_capacity(self.buckets.len());
        let last = self.buckets.len().saturating_sub(1);
        let world = self.pg.world_size() as f32;
        for b in 0..self.buckets.len() {
            let bucket_start = Instant::now();
            let flat = self.pack_on_device(b, &mut grads);
            if b == last {
                // Every known gradient is taken now: what is left belongs to unknown ids.
                if let Err(e) = self.check_no_unknown_grads(&grads) {
                    local_error.get_or_insert(e);
                }
            }
            // Compressed buckets are divided by the world size before the all-reduce, so that
            // no partial sum exceeds the largest gradient (f16 tops out at 65504); presence
            // slots stay non-zero exactly where some rank had a gradient.
            let flat = match self.config.compression {
                Compression::None => flat,
                Compression::Bf16 | Compression::F16 => flat.div_scalar(world),
            };
            let failed = local_error.is_some();
            let failure = [
                if failed { 1.0f32 } else { 0.0 },
                if failed {
                    (self.pg.rank() + 1) as f32
                } else {
                    0.0
                },
            ];
            let flat = Tensor::cat(
                vec![
                    flat,
                    Tensor::from_data(TensorData::new(failure.to_vec(), [2]), &self.device),
                ],
                0,
            );
            let flat = match self.config.compression {
                Compression::None => flat,
                Compression::Bf16 => flat.cast(FloatDType::BF16),
                Compression::F16 => flat.cast(FloatDType::F16),
            };
            let width = match self.config.compression {
                Compression::None => 4,
                Compression::Bf16 | Compression::F16 => 2,
            };
            self.stats.bytes += (self.buckets[b].len() * width) as u64;
            in_flight.push(self.submit_on_device(b, flat));
            let now = Instant::now();
            submitted.push(now);
            self.span(SyncPhase::Pack, b, bucket_start, now);
        }
        self.stats.pack += pack_start.elapsed();

        // Micro-steps are summed (PyTorch's no_sync); only ranks are averaged (compressed
        // buckets were divided before the all-reduce).
        let denom = match self.config.compression {
            Compression::None => world,
            Compression::Bf16 | Compression::F16 => 1.0,
        };
        self.micro_steps = 0;
        let mut comm_error = None;
        let mut peer_failure: Option<(f32, f32)> = None;
        let mut previous_end = pack_start;
        for (b, work) in in_flight.into_iter().enumerate() {
            let wait_start = Instant::now();
            let result = work.and_then(|w| w.wait().map_err(DdpError::from));
            let wait_end = Instant::now();
            self.stats.wait += wait_end - wait_start;
            // The host's view: kernels run asynchronously on the GPU's streams.
            self.span(SyncPhase::Wait, b, wait_start, wait_end);
            self.span(
                SyncPhase::AllReduce,
                b,
                submitted[b].max(previous_end),
                wait_end,
            );
            previous_end = wait_end;
            match result {
                Ok((flat, _resource)) => {
                    let apply = local_error.is_none() && peer_failure.is_none();
                    match self.unpack_on_device(b, flat, &mut grads, denom, apply) {
                        Ok(Some(failure)) => {
                            peer_failure.get_or_insert(failure);
                        }
                        Ok(None) => {}
                        Err(e) => {
                            local_error.get_or_insert(e);
                        }
                    }
                    let unpack_end = Instant::now();
                    self.stats.unpack += unpack_end - wait_end;
                    self.span(SyncPhase::Unpack, b, wait_end, unpack_end);
                }
                // Keep waiting for the rest so that no buffer is left in NCCL's hands.
                Err(e) => {
                    comm_error.get_or_insert(e);
                }
            }
        }
        if let Some(e) = comm_error.or(local_error) {
            return Err(e);
        }
        if let Some((failed, ranks)) = peer_failure {
            return Err(peer_failed(self.syncs, failed, ranks, self.pg.world_size()));
        }
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

    /// Hands bucket `b`'s flat tensor to NCCL for an in-place sum across ranks.
    fn submit_on_device(&self, b: usize, flat: Tensor<1>) -> Result<Flight, DdpError> {
        let unsupported = |reason: String| DdpError::UnsupportedParam {
            name: format!("gradient bucket {b}"),
            reason,
        };
        let Some(dp) = self.device_path.as_ref() else {
            return Err(unsupported("no NCCL communicator".into()));
        };
        let cube = flat.clone().try_into_primitive::<Cube>().map_err(|e| {
            unsupported(format!(
                "the packed gradients are not a cubecl tensor: {e:?}"
            ))
        })?;
        let dtype = match cube.dtype {
            burn::tensor::DType::F32 => DType::F32,
            burn::tensor::DType::BF16 => DType::BF16,
            burn::tensor::DType::F16 => DType::F16,
            other => return Err(unsupported(format!("element type {other:?}"))),
        };
        if !cube.is_contiguous() {
            return Err(unsupported(
                "the packed gradients are not contiguous".into(),
            ));
        }
        let count = cube.meta.shape().num_elements();
        // The raw device address (offset applied) and a binding that keeps the memory alive;
        // then wait until burn's stream has written it.
        let resource = cube
            .client
            .get_resource::<CudaServer>(cube.handle.clone())
            .map_err(|e| unsupported(format!("cubecl cannot expose its buffer: {e:?}")))?;
        cubecl::future::block_on(cube.client.sync())
            .map_err(|e| unsupported(format!("synchronising burn's CUDA stream: {e:?}")))?;
        let ptr = resource.resource().ptr;
        let keep: Box<dyn Any> = Box::new(resource);
        // SAFETY: `ptr` addresses `count` elements of `dtype` in the device's primary context;
        // burn's stream has finished writing them (sync above); `flat` and `keep` hold the
        // memory until `wait` returns, and nothing else uses `flat` (a fresh tensor of ours)
        // before then.
        Ok(unsafe {
            dp.nccl()
                .submit_all_reduce_ptr(ptr, count, dtype, ReduceOp::Sum, (flat, keep))
        })
    }

    /// Registers the averaged gradients of bucket `b` from its reduced flat tensor, when
    /// `apply` and no rank raised the bucket's failure slots; returns those slots (how many
    /// ranks failed, the sum of their ranks plus one) when one did.
    fn unpack_on_device(
        &self,
        b: usize,
        flat: Tensor<1>,
        grads: &mut GradientsParams,
        denom: f32,
        apply: bool,
    ) -> Result<Option<(f32, f32)>, DdpError> {
        let bucket = &self.buckets[b];
        let flat = if flat.dtype() == burn::tensor::DType::F32 {
            flat
        } else {
            flat.cast(FloatDType::F32)
        };
        let names = bucket
            .params
            .iter()
            .map(|&p| self.params[p].name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let slots = bucket.params.len() + 2;
        let slots = to_f32(
            flat.clone().narrow(0, bucket.grad_len, slots).into_data(),
            &names,
            "presence and failure slots",
            slots,
        )?;
        let (presence, failure) = slots.split_at(bucket.params.len());
        if failure[0] > 0.0 {
            return Ok(Some((failure[0], failure[1])));
        }
        if !apply {
            return Ok(None);
        }
        for (slot, (&p, &off)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
            if presence[slot] == 0.0 {
                continue; // no rank produced a gradient for this parameter
            }
            let info = &self.params[p];
            let g = flat.clone().narrow(0, off, info.numel()).div_scalar(denom);
            put_grad_tensor(grads, info, g);
        }
        Ok(None)
    }
}
