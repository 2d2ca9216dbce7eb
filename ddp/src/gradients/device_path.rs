//! The gradient path on the GPU (feature `cuda`): when the model runs on a CUDA device of burn's
//! cubecl backend (`Device::cuda(i)`), gradients never leave the device.
//!
//! The step is the gradient pipeline's (`pipeline.rs`), as on the host: the same bucket layout
//! and parts, the same submit/complete loop (`Reducer::reduce`, `reducer.rs`), the same
//! control all-reduce over the process group that carries presence and failures. Only the
//! carrier differs: [`CudaCarrier`] (`cuda_carrier.rs`) keeps each part as a flat tensor on
//! the device and all-reduces it in place through NCCL, after one synchronisation of burn's
//! stream per step. This file creates the NCCL communicator and that pipeline
//! ([`DevicePath::detect`]), and broadcasts parameters and buffers from rank 0 on the device
//! ([`DevicePath::broadcast_module`]): flattened and concatenated with burn ops, broadcast in
//! place by NCCL ([`NcclGroup::submit_broadcast_ptr`]), sliced back.
//!
//! The model's GPU must be NCCL's: [`DevicePath::detect`] refuses another one, naming both.
//! This path is type-checked in CI (`DOCS_RS=1`, no LLVM download); on a GPU it has run at one
//! rank only (`DDP_NCCL=1`: docs/gpu.md), not yet between ranks; its loop is the host path's,
//! tested on the CPU. Other devices (flex, or other cubecl runtimes) take the host path.
//! `DDP_NCCL=0` in the environment (on every rank) forces the host path on CUDA too;
//! `DDP_NCCL=1` takes this path at one rank as well, to check it on one GPU
//! ([`ddp_comm::nccl::gradients_through_nccl`]).

use std::sync::Arc;

use burn::backend::DispatchDevice;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Device, FloatDType, Tensor};
use ddp_comm::nccl::{check_same_gpu, NcclGroup};
use ddp_comm::{DType, ProcessGroup};

use crate::config::Compression;
use crate::gradients::buckets::Layout;
use crate::gradients::cuda_carrier::{expose, sync_client, CudaCarrier};
use crate::gradients::pipeline::Pipeline;
use crate::params::{ParamInfo, ParamKind};
use crate::DdpError;

/// The NCCL communicator and the gradient pipeline of the device path.
pub(crate) struct DevicePath {
    nccl: Arc<NcclGroup>,
    pipeline: Pipeline<CudaCarrier>,
}

/// The CUDA ordinal of `device` (with or without autodiff) when it is a CUDA device of burn's
/// cubecl backend.
fn cuda_index(device: &Device) -> Option<usize> {
    match device.clone().inner().as_dispatch() {
        DispatchDevice::Cube(cubecl::Device::Cuda(cuda)) => Some(cuda.index),
        _ => None,
    }
}

impl DevicePath {
    /// The device path when the model is on a CUDA device and
    /// [`ddp_comm::nccl::gradients_through_nccl`] says so (more than one rank and `DDP_NCCL`
    /// not `0`, or `DDP_NCCL=1`): creates the NCCL communicator (a collective on `pg`, so every
    /// rank calls this at the same point) and checks that the model's GPU is NCCL's; the
    /// gradients of `params` then travel in `layout`'s parts, in the wire type of
    /// `compression`. `None` otherwise.
    pub(crate) fn detect(
        pg: &Arc<ProcessGroup>,
        device: &Device,
        params: &Arc<[ParamInfo]>,
        layout: &Arc<Layout>,
        compression: Compression,
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
        let mask = ddp_comm::elastic::visible_devices();
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
        let nccl = Arc::new(nccl);
        let carrier = CudaCarrier::new(Arc::clone(&nccl), device.clone(), compression);
        let pipeline = Pipeline::new(
            Arc::clone(pg),
            Arc::clone(params),
            Arc::clone(layout),
            carrier,
        );
        Ok(Some(DevicePath { nccl, pipeline }))
    }

    /// The gradient pipeline.
    pub(crate) fn pipeline(&mut self) -> &mut Pipeline<CudaCarrier> {
        &mut self.pipeline
    }

    /// The NCCL communicator.
    pub(crate) fn nccl(&self) -> &Arc<NcclGroup> {
        &self.nccl
    }

    /// Broadcasts rank 0's values of the float tensors of `module` that `keep` accepts (by
    /// visiting index) to every rank, on the device, and returns the module with them (ids,
    /// element types and gradient requirements kept). A collective: every rank calls it with
    /// the same module layout.
    pub(crate) fn broadcast_module<M: Module>(
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
                    // NCCL reads the memory of the inner (non-autodiff) tensor.
                    let t = param.val().inner();
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
        let (resolved, exposed) = expose(Tensor::cat(reader.parts, 0), "the broadcast parameters")?;
        sync_client(&exposed.client)?;
        // SAFETY: `ptr` addresses `count` f32 in the device's primary context, produced (sync
        // above); `resolved` and `keep` hold the memory until `wait` returns.
        let (resolved, _keep) = unsafe {
            self.nccl.submit_broadcast_ptr(
                exposed.ptr,
                exposed.count,
                exposed.dtype,
                0,
                (resolved, exposed.keep),
            )
        }
        .wait()?;
        let flat = resolved.into_tensor();

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
                // Back on the autodiff device when the module records gradients.
                let values = if tensor.is_autodiff() {
                    values.autodiff()
                } else {
                    values
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

    /// The module's buffers from rank 0 through NCCL, without the host (PyTorch's
    /// `broadcast_buffers=True` on the device). With `readable == false` (this rank's module
    /// no longer matches the parameter list `params`) the rank still takes part, with zeros of
    /// the agreed length, and loads nothing; its sync fails anyway.
    pub(crate) fn broadcast_buffers<M: Module>(
        &self,
        params: &[ParamInfo],
        model: &M,
        readable: bool,
    ) -> Result<(), DdpError> {
        let is_buffer = |i: usize| params[i].kind == ParamKind::Buffer;
        if !readable {
            let len: usize = params
                .iter()
                .filter(|p| p.kind == ParamKind::Buffer)
                .map(|p| p.numel())
                .sum();
            let zeros = vec![0u8; len * DType::F32.size()];
            self.nccl()
                .submit_broadcast_bytes(&zeros, DType::F32, 0)
                .wait()?;
            return Ok(());
        }
        // burn's RunningState keeps the forward pass's update pending until it is synchronised
        // (`valid`); mapping a clone then writes through to `model`'s RunningStates.
        drop(model.valid());
        drop(self.broadcast_module(model.clone(), &is_buffer)?);
        Ok(())
    }
}
