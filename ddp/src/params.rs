//! Parameter bookkeeping: the fixed list of a module's float parameters (name, id, shape) in
//! burn's visiting order, moving gradients between burn's `GradientsParams` and flat `f32`
//! slices, and reading or overwriting parameter values as flat `f32`.
//!
//! burn's tensors carry their rank `D` as a const generic, while a parameter list is only known
//! at run time; [`with_rank!`] turns the recorded rank back into a const generic (ranks 1 to 6,
//! which covers every layer burn ships).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};

use crate::DdpError;

/// One float parameter of a module, as every rank must see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// The module path, dot separated like PyTorch's `state_dict` keys (`conv1.weight`).
    pub name: String,
    /// burn's id of the parameter (the key of its gradient).
    pub id: ParamId,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// burn's element type of the parameter, as text (`F32`).
    pub dtype: String,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The line that describes this parameter in the cross-rank comparison.
    pub(crate) fn describe(&self) -> String {
        format!("{} {:?} {}", self.name, self.shape, self.dtype)
    }
}

/// Lists the float parameters of `module` in burn's visiting order (the same on every rank for
/// the same module type), with their PyTorch-style names.
pub fn param_infos<B: Backend, M: Module<B>>(module: &M) -> Vec<ParamInfo> {
    struct Lister {
        path: Vec<String>,
        out: Vec<ParamInfo>,
    }
    impl<B: Backend> ModuleVisitor<B> for Lister {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            self.out.push(ParamInfo {
                name: self.path.join("."),
                id: param.id,
                shape: value.dims().to_vec(),
                dtype: format!("{:?}", value.dtype()),
            });
        }
    }
    let mut lister = Lister {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut lister);
    lister.out
}

/// Calls `$body` with `$d` bound as a const generic equal to the runtime rank `$rank`.
macro_rules! with_rank {
    ($rank:expr, $d:ident => $body:expr, $unsupported:expr) => {
        match $rank {
            1 => {
                const $d: usize = 1;
                $body
            }
            2 => {
                const $d: usize = 2;
                $body
            }
            3 => {
                const $d: usize = 3;
                $body
            }
            4 => {
                const $d: usize = 4;
                $body
            }
            5 => {
                const $d: usize = 5;
                $body
            }
            6 => {
                const $d: usize = 6;
                $body
            }
            _ => $unsupported,
        }
    };
}

/// Checks that every parameter's rank is one [`with_rank!`] handles.
pub(crate) fn check_ranks(infos: &[ParamInfo]) -> Result<(), DdpError> {
    match infos
        .iter()
        .find(|p| p.shape.is_empty() || p.shape.len() > 6)
    {
        Some(p) => Err(DdpError::UnsupportedParam {
            name: p.name.clone(),
            reason: format!("rank {} (supported: 1 to 6)", p.shape.len()),
        }),
        None => Ok(()),
    }
}

/// Takes the gradient of `info` out of `grads` as flat `f32`, or `None` when the parameter got
/// no gradient this step.
pub(crate) fn take_grad<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    info: &ParamInfo,
) -> Option<Vec<f32>> {
    let data: Option<TensorData> = with_rank!(info.shape.len(), D => {
        grads.remove::<B::InnerBackend, D>(info.id).map(|t| t.into_data())
    }, None);
    data.map(|d| d.convert::<f32>().into_vec::<f32>().unwrap_or_default())
}

/// Puts a flat `f32` gradient back for `info`, on `device`.
pub(crate) fn put_grad<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    info: &ParamInfo,
    values: Vec<f32>,
    device: &B::Device,
) {
    let data = TensorData::new(values, info.shape.clone());
    with_rank!(info.shape.len(), D => {
        grads.register::<B::InnerBackend, D>(info.id, Tensor::from_data(data, device))
    }, ())
}

/// Takes the gradient of `info` out of `grads` as a flat tensor on its device (no copy to the
/// host), or `None` when the parameter got no gradient this step.
#[cfg(feature = "cuda")]
pub(crate) fn take_grad_tensor<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    info: &ParamInfo,
) -> Option<Tensor<B::InnerBackend, 1>> {
    with_rank!(info.shape.len(), D => {
        grads.remove::<B::InnerBackend, D>(info.id).map(|t| t.reshape([info.numel()]))
    }, None)
}

/// Puts a flat gradient tensor back for `info`, in the parameter's shape.
#[cfg(feature = "cuda")]
pub(crate) fn put_grad_tensor<B: AutodiffBackend>(
    grads: &mut GradientsParams,
    info: &ParamInfo,
    flat: Tensor<B::InnerBackend, 1>,
) {
    let shape = burn::tensor::Shape::from(info.shape.clone());
    with_rank!(info.shape.len(), D => {
        grads.register::<B::InnerBackend, D>(info.id, flat.reshape(shape))
    }, ())
}

/// Reads every float parameter of `module` into one flat `f32` vector, in visiting order.
pub fn flatten_params<B: Backend, M: Module<B>>(module: &M) -> Vec<f32> {
    struct Reader(Vec<f32>);
    impl<B: Backend> ModuleVisitor<B> for Reader {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0
                .extend_from_slice(data.as_slice::<f32>().unwrap_or_default());
        }
    }
    let mut reader = Reader(Vec::new());
    module.visit(&mut reader);
    reader.0
}

/// Overwrites every float parameter of `module` from a flat `f32` vector laid out as
/// [`flatten_params`] lays it out, keeping parameter ids and whether each requires a gradient.
/// `flat` must hold exactly the module's number of float elements.
pub fn load_flat_params<B: Backend, M: Module<B>>(module: M, flat: &[f32]) -> M {
    struct Writer<'a> {
        flat: &'a [f32],
        offset: usize,
    }
    impl<B: Backend> ModuleMapper<B> for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let shape = tensor.dims();
            let n: usize = shape.iter().product();
            let values = self.flat[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let require_grad = tensor.is_require_grad();
            let fresh = Tensor::<B, D>::from_data(TensorData::new(values, shape), &tensor.device())
                .set_require_grad(require_grad);
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    module.map(&mut Writer { flat, offset: 0 })
}

/// FNV-1a over bytes: a stable 64-bit fingerprint (not cryptographic; it only has to differ
/// when replicas differ, and be the same on every platform).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}
