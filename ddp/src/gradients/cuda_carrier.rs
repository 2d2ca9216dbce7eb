//! [`CudaCarrier`]: the gradient pipeline's carrier (`pipeline.rs`, `carrier.rs`) on the GPU
//! (feature `cuda`): a part's buffer is a flat `f32` tensor on the CUDA device of burn's
//! cubecl backend, and its all-reduce runs in place in that memory through NCCL, so gradients
//! never leave the device.
//!
//! # How a part travels
//!
//! - **Packing** is burn tensor ops on the device: a large gradient is adopted whole (burn's
//!   own tensor becomes the part, no copy), the gradients of a shared part are written into a
//!   zero tensor at their offsets (`slice_assign`), a later micro-step's are added there.
//! - **Submission is held back.** burn's kernels run asynchronously on burn's stream and NCCL
//!   runs on its own, so a part may go to NCCL only once burn's stream has produced it. Rather
//!   than synchronise once per part, [`Carrier::submit`] only keeps the part (divided by the
//!   world size and cast to bf16/f16 with compression), and [`Carrier::launch`], called by the
//!   pipeline once every part of the step is in, waits for burn's stream **once** and then
//!   enqueues every part's in-place all-reduce on NCCL's stream, back to back, in part order.
//! - Each part's memory is exposed to NCCL as its raw `CUdeviceptr`: the flat tensor's
//!   primitive is a `CubeTensor` (burn 0.22's `Tensor::try_into_primitive::<Cube>`, feature
//!   `extension`), and cubecl's `Client::get_resource::<CudaServer>` (cubecl-runtime 0.11
//!   `client.rs:467` → cubecl-cuda's `GpuResource::ptr`, the handle's offset applied) gives the
//!   address and a binding that keeps the memory allocated until NCCL is done. burn and cudarc
//!   share the device's primary context (cubecl-cuda retains it, as does cudarc's
//!   `CudaContext::new`), so the pointer is valid in NCCL's context. A tensor whose memory is
//!   shared with another tensor (burn's autodiff may hand the same buffer to two parameters) is
//!   copied first: the all-reduce writes in place.
//! - [`Carrier::wait`] waits for NCCL's stream (so burn's later kernels see the reduced values)
//!   and casts a compressed part back to `f32`.
//!
//! NCCL matches collectives by their order only (no tag): if one rank skipped a part, its next
//! one would be summed with the peers' skipped one. So a part this rank could not expose, or
//! every part when burn's stream could not be synchronised, is replaced by a **stand-in** of
//! the same length and element type (zeros copied from the host), and the failure is handed
//! back to the pipeline, whose control all-reduce (presence and failure counts, over the
//! process group) then fails the step on every rank, naming this one.

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use burn::backend::Cube;
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use burn_fusion::stream::StreamId;
use burn_fusion::{Client as FusionClient, NoOp};
use burn_ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;
use ddp_comm::nccl::{DeviceBytes, NcclGroup, NcclWork};
use ddp_comm::{DType, ReduceOp};

use crate::config::Compression;
use crate::gradients::carrier::Carrier;
use crate::params::{put_grad_tensor, take_grad_tensor, ParamInfo};
use crate::DdpError;

/// The CUDA runtime's compute server, whose storage gives the raw device address.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// A flat device tensor's memory, for NCCL: its address, length, element type, what keeps it
/// bound, and the client that the one synchronisation waits on.
pub(crate) struct Exposed {
    /// The raw device address of the first element.
    pub ptr: u64,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
    /// What keeps the memory bound until NCCL is done with it.
    pub keep: Box<dyn Any>,
    /// burn's compute client of the tensor.
    pub client: cubecl::client::Client,
}

/// A flat tensor taken out of burn's fusion for NCCL: the cubecl tensor that owns the memory
/// NCCL reads and writes, and the fusion client to give it back to (burn's `fusion` feature
/// wraps the cubecl backend: `burn::backend::Cube` is `Fusion<CubeBackend>`).
pub(crate) struct Resolved {
    cube: CubeTensor,
    fusion: FusionClient<FusionCubeRuntime>,
}

impl Resolved {
    /// The tensor again as a burn tensor of the (fused) device, holding what NCCL wrote: the
    /// cubecl memory is registered with the fusion client as a new tensor, the way burn's own
    /// `float_from_data` registers a fresh buffer.
    pub(crate) fn into_tensor(self) -> Tensor<1> {
        let Resolved { cube, fusion } = self;
        let shape = cube.meta.shape().clone();
        let dtype = cube.dtype;
        let handle = <CubeBackend as BackendIr>::float_tensor_handle(cube);
        let desc = InitOperationIr::create(shape, dtype, || fusion.register_tensor_handle(handle));
        let fused = fusion
            .register(
                StreamId::current(),
                OperationIr::Init(desc),
                NoOp::<CubeBackend>::new(),
            )
            .output();
        Tensor::from_primitive::<Cube>(fused)
    }
}

/// Exposes `flat`'s memory (see [`Exposed`]) and returns what owns it, to be turned back into
/// a tensor with [`Resolved::into_tensor`] once NCCL is done. `what` names it in errors.
///
/// burn's fusion defers element-wise work: the fused tensor is first resolved (its pending
/// operations run on cubecl's stream, asynchronously) into the cubecl tensor that holds its
/// values. NCCL writes in place, so memory that another tensor shares (burn's autodiff may
/// hand the same buffer to two parameters) or that is not contiguous is copied first. The
/// caller synchronises cubecl's stream after exposing every part and before NCCL reads any.
pub(crate) fn expose(flat: Tensor<1>, what: &str) -> Result<(Resolved, Exposed), DdpError> {
    let unsupported = |reason: String| DdpError::UnsupportedParam {
        name: what.to_string(),
        reason,
    };
    let not_cube = |e| unsupported(format!("the packed values are not a cubecl tensor: {e:?}"));
    let fused = flat.try_into_primitive::<Cube>().map_err(not_cube)?;
    let fusion = fused.client.clone();
    let mut cube = fusion.resolve_tensor_float::<CubeBackend>(fused);
    if !cube.can_mut() || !cube.is_contiguous() {
        // A fresh, contiguous output that nothing else holds.
        cube = burn_cubecl::kernel::into_contiguous(cube.copy());
    }
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
    let exposed = Exposed {
        ptr: resource.resource().ptr,
        count,
        dtype,
        keep: Box::new(resource),
        client: cube.client.clone(),
    };
    Ok((Resolved { cube, fusion }, exposed))
}

/// Waits until `client`'s stream has produced everything queued so far.
pub(crate) fn sync_client(client: &cubecl::client::Client) -> Result<(), DdpError> {
    cubecl::future::block_on(client.sync()).map_err(|e| DdpError::UnsupportedParam {
        name: "the packed gradients".into(),
        reason: format!("synchronising burn's CUDA stream: {e:?}"),
    })
}

/// A part handed to NCCL: its all-reduce in place in the tensor's memory, or the stand-in of a
/// part this rank could not expose (zeros of the same length and element type).
enum Work {
    Part(Box<NcclWork<(Resolved, Box<dyn Any>)>>),
    StandIn(NcclWork<DeviceBytes>),
}

/// The pipeline's carrier on the GPU (see the module documentation).
pub(crate) struct CudaCarrier {
    nccl: Arc<NcclGroup>,
    device: Device,
    compression: Compression,
    /// Parts submitted since the last launch, in order (the index is the flight), in the wire
    /// type.
    held: Vec<(usize, Tensor<1>)>,
    /// Parts handed to NCCL, by flight, with their length.
    launched: Vec<Option<(Work, usize)>>,
}

impl CudaCarrier {
    /// The carrier of tensors on `device`, all-reduced through `nccl` in the wire type of
    /// `compression`.
    pub(crate) fn new(nccl: Arc<NcclGroup>, device: Device, compression: Compression) -> Self {
        CudaCarrier {
            nccl,
            device,
            compression,
            held: Vec::new(),
            launched: Vec::new(),
        }
    }

    /// The wire type's element.
    fn wire(&self) -> DType {
        match self.compression {
            Compression::None => DType::F32,
            Compression::Bf16 => DType::BF16,
            Compression::F16 => DType::F16,
        }
    }

    /// Hands an exposed part to NCCL: its in-place all-reduce, enqueued on NCCL's stream.
    fn hand_over(&self, resolved: Resolved, exposed: Exposed) -> Work {
        // SAFETY: `ptr` addresses `count` elements of `dtype` in the device's primary context;
        // burn's stream has produced them (the launch's one sync, after every part was
        // exposed); `resolved` and `keep` hold the memory until `wait` returns, and no other
        // tensor shares it (`expose` copied it otherwise).
        let work = unsafe {
            self.nccl.submit_all_reduce_ptr(
                exposed.ptr,
                exposed.count,
                exposed.dtype,
                ReduceOp::Sum,
                (resolved, exposed.keep),
            )
        };
        Work::Part(Box::new(work))
    }

    /// A stand-in all-reduce of `len` zeros in the wire type.
    fn stand_in(&self, len: usize) -> Work {
        let dtype = self.wire();
        let zeros = vec![0u8; len * dtype.size()];
        Work::StandIn(
            self.nccl
                .submit_all_reduce_bytes(&zeros, dtype, ReduceOp::Sum),
        )
    }
}

impl Carrier for CudaCarrier {
    type Buf = Tensor<1>;
    type Flight = usize;

    fn take(
        &mut self,
        grads: &mut GradientsParams,
        info: &ParamInfo,
    ) -> Result<Option<Tensor<1>>, DdpError> {
        Ok(take_grad_tensor(grads, info).map(|g| {
            if g.dtype() == burn::tensor::DType::F32 {
                g
            } else {
                g.cast(FloatDType::F32)
            }
        }))
    }

    fn len(&self, buf: &Tensor<1>) -> usize {
        buf.dims()[0]
    }

    fn zeros(&mut self, len: usize) -> Tensor<1> {
        Tensor::zeros([len], &self.device)
    }

    fn write(&mut self, buf: &mut Tensor<1>, at: usize, grad: Tensor<1>, add: bool) {
        let range = at..at + grad.dims()[0];
        let values = if add {
            buf.clone().slice([range.clone()]) + grad
        } else {
            grad
        };
        *buf = buf.clone().slice_assign([range], values);
    }

    fn submit(&mut self, part: usize, buf: Tensor<1>) -> (usize, u64) {
        let world = self.nccl.world_size() as f32;
        let bytes = (buf.dims()[0] * self.wire().size()) as u64;
        // Compressed parts are divided by the world size before the all-reduce, so that no
        // partial sum exceeds the largest gradient (f16 tops out at 65504).
        let wire = match self.compression {
            Compression::None => buf,
            Compression::Bf16 => buf.div_scalar(world).cast(FloatDType::BF16),
            Compression::F16 => buf.div_scalar(world).cast(FloatDType::F16),
        };
        self.held.push((part, wire));
        (self.held.len() - 1, bytes)
    }

    fn launch(&mut self) -> Result<Option<DdpError>, DdpError> {
        let held = std::mem::take(&mut self.held);
        // First expose every part: resolving a fused tensor queues its pending kernels on
        // burn's stream, so the one synchronisation must come after the last of them.
        let mut error = None;
        let parts: Vec<(usize, Option<(Resolved, Exposed)>)> = held
            .into_iter()
            .map(|(part, flat)| {
                let len = flat.dims()[0];
                match expose(flat, &format!("gradient part {part}")) {
                    Ok(exposed) => (len, Some(exposed)),
                    Err(e) => {
                        error.get_or_insert(e);
                        (len, None)
                    }
                }
            })
            .collect();
        // The one synchronisation: burn's stream has produced every part.
        let synced = match parts.iter().find_map(|(_, p)| p.as_ref()) {
            Some((_, exposed)) => sync_client(&exposed.client),
            None => Ok(()),
        };
        let sync_failed = synced.is_err();
        if let Err(e) = synced {
            error.get_or_insert(e);
        }
        self.launched.clear();
        for (len, part) in parts {
            let work = match part {
                Some((resolved, exposed)) if !sync_failed => self.hand_over(resolved, exposed),
                _ => self.stand_in(len),
            };
            self.launched.push(Some((work, len)));
        }
        Ok(error)
    }

    fn wait(&mut self, flight: usize) -> Result<Tensor<1>, DdpError> {
        let Some((work, len)) = self.launched.get_mut(flight).and_then(Option::take) else {
            return Err(DdpError::Config(format!(
                "gradient flight {flight} was not launched"
            )));
        };
        match work {
            Work::Part(work) => {
                let (resolved, _keep) = work.wait()?;
                let flat = resolved.into_tensor();
                Ok(if flat.dtype() == burn::tensor::DType::F32 {
                    flat
                } else {
                    flat.cast(FloatDType::F32)
                })
            }
            Work::StandIn(work) => {
                work.wait()?;
                // Only a rank that failed sends a stand-in: its step fails, these zeros are
                // never used.
                Ok(Tensor::zeros([len], &self.device))
            }
        }
    }

    fn averages(&self) -> bool {
        // Compressed parts were divided by the world size before the all-reduce.
        self.compression != Compression::None
    }

    fn divided(&mut self, buf: Tensor<1>, denom: f32) -> Tensor<1> {
        buf.div_scalar(denom)
    }

    fn slice_divided(&mut self, buf: &Tensor<1>, range: Range<usize>, denom: f32) -> Tensor<1> {
        buf.clone().slice([range]).div_scalar(denom)
    }

    fn put(&mut self, grads: &mut GradientsParams, info: &ParamInfo, buf: Tensor<1>, _: &Device) {
        put_grad_tensor(grads, info, buf);
    }
}
