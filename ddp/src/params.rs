//! Parameter bookkeeping: the fixed list of a module's float tensors (name, id, shape, whether
//! trained by gradients) in burn's visiting order, moving gradients between burn's
//! `GradientsParams` and flat `f32` slices, and reading or overwriting values as flat `f32`.
//!
//! burn's tensors carry their rank `D` as a const generic, while a parameter list is only known
//! at run time; [`with_rank!`] turns the recorded rank back into a const generic (ranks 1 to 6,
//! which covers every layer burn ships).
//!
//! **Buffers.** burn has no separate notion of a buffer: `BatchNorm`'s `running_mean` and
//! `running_var` are `RunningState<Tensor>`s, which burn 0.22 hands to `ModuleVisitor` and
//! `ModuleMapper` as float `Param`s (`Param::initialized(id, value)`, burn-core
//! `module/param/running.rs`) whose tensor does not require a gradient. The list therefore
//! marks every float tensor that does not require a gradient as not [`ParamInfo::trainable`]:
//! running statistics and frozen parameters. Those never travel as gradients; the wrapper
//! broadcasts them from rank 0 instead, as PyTorch's `broadcast_buffers=True` does.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

use crate::DdpError;

/// One float tensor of a module, as every rank must see it.
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
    /// Whether it requires a gradient. `false` for buffers: burn's `RunningState`
    /// (`BatchNorm`'s running statistics) and frozen parameters, which are broadcast from rank
    /// 0 at every sync instead of being averaged.
    pub trainable: bool,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The line that describes this parameter in the cross-rank comparison.
    pub(crate) fn describe(&self) -> String {
        let kind = if self.trainable { "" } else { " buffer" };
        format!("{} {:?} {}{kind}", self.name, self.shape, self.dtype)
    }
}

/// Lists the float tensors of `module` in burn's visiting order (the same on every rank for
/// the same module type), with their PyTorch-style names, through the workspace's one
/// module-path walker, [`ddp_models::param_specs`].
pub fn param_infos<M: Module>(module: &M) -> Vec<ParamInfo> {
    ddp_models::param_specs(module)
        .into_iter()
        .map(|spec| ParamInfo {
            name: spec.name,
            id: spec.id,
            shape: spec.shape,
            dtype: format!("{:?}", spec.dtype),
            trainable: spec.require_grad,
        })
        .collect()
}

/// The ids of `module`'s float tensors in visiting order, without reading any value.
pub(crate) fn param_ids<M: Module>(module: &M) -> Vec<ParamId> {
    struct Ids(Vec<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.id);
        }
    }
    let mut ids = Ids(Vec::new());
    module.visit(&mut ids);
    ids.0
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
/// no gradient this step. A gradient that cannot be read as `f32` values of the parameter's
/// size is an error naming the parameter, never an empty or zero gradient.
pub(crate) fn take_grad(
    grads: &mut GradientsParams,
    info: &ParamInfo,
) -> Result<Option<Vec<f32>>, DdpError> {
    let data: Option<TensorData> = with_rank!(info.shape.len(), D => {
        grads.remove::<D>(info.id).map(|t| t.into_data())
    }, None);
    data.map(|d| to_f32(d, &info.name, "gradient", info.numel()))
        .transpose()
}

/// `data` as `numel` flat `f32` values, or an error naming `name`.
pub(crate) fn to_f32(
    data: TensorData,
    name: &str,
    what: &'static str,
    numel: usize,
) -> Result<Vec<f32>, DdpError> {
    let values = data
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| DdpError::Conversion {
            name: name.to_string(),
            what,
            reason: format!("{e:?}"),
        })?;
    if values.len() != numel {
        return Err(DdpError::Conversion {
            name: name.to_string(),
            what,
            reason: format!("{} values, expected {numel}", values.len()),
        });
    }
    Ok(values)
}

/// Puts a flat `f32` gradient back for `info`, on `device` (the device without autodiff, where
/// burn keeps gradients).
pub(crate) fn put_grad(
    grads: &mut GradientsParams,
    info: &ParamInfo,
    values: Vec<f32>,
    device: &Device,
) {
    let data = TensorData::new(values, info.shape.clone());
    with_rank!(info.shape.len(), D => {
        grads.register::<D>(info.id, Tensor::from_data(data, device))
    }, ())
}

/// Takes the gradient of `info` out of `grads` as a flat tensor on its device (no copy to the
/// host), or `None` when the parameter got no gradient this step.
#[cfg(feature = "cuda")]
pub(crate) fn take_grad_tensor(grads: &mut GradientsParams, info: &ParamInfo) -> Option<Tensor<1>> {
    with_rank!(info.shape.len(), D => {
        grads.remove::<D>(info.id).map(|t| t.reshape([info.numel()]))
    }, None)
}

/// Puts a flat gradient tensor back for `info`, in the parameter's shape.
#[cfg(feature = "cuda")]
pub(crate) fn put_grad_tensor(grads: &mut GradientsParams, info: &ParamInfo, flat: Tensor<1>) {
    let shape = burn::tensor::Shape::from(info.shape.clone());
    with_rank!(info.shape.len(), D => {
        grads.register::<D>(info.id, flat.reshape(shape))
    }, ())
}

/// Reads every float tensor of `module` into one flat `f32` vector, in visiting order
/// (trainable parameters and buffers alike). A tensor that cannot be read as `f32` is an error
/// naming it.
pub fn flatten_params<M: Module>(module: &M) -> Result<Vec<f32>, DdpError> {
    flatten_where(module, |_| true)
}

/// Reads the float tensors of `module` for which `keep(requires_grad)` holds into one flat
/// `f32` vector, in visiting order.
pub(crate) fn flatten_where<M: Module>(
    module: &M,
    keep: fn(bool) -> bool,
) -> Result<Vec<f32>, DdpError> {
    struct Reader {
        keep: fn(bool) -> bool,
        out: Vec<f32>,
        index: usize,
        error: Option<(usize, String)>,
    }
    impl ModuleVisitor for Reader {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if self.error.is_some() {
                return;
            }
            let value = param.val();
            if !(self.keep)(value.is_require_grad()) {
                return;
            }
            match value.into_data().convert::<f32>().as_slice::<f32>() {
                Ok(values) => self.out.extend_from_slice(values),
                Err(e) => self.error = Some((index, format!("{e:?}"))),
            }
        }
    }
    let mut reader = Reader {
        keep,
        out: Vec::new(),
        index: 0,
        error: None,
    };
    module.visit(&mut reader);
    match reader.error {
        None => Ok(reader.out),
        Some((index, reason)) => Err(DdpError::Conversion {
            name: param_infos(module)
                .get(index)
                .map_or_else(|| format!("#{index}"), |p| p.name.clone()),
            what: "values",
            reason,
        }),
    }
}

/// Overwrites every float tensor of `module` from a flat `f32` vector laid out as
/// [`flatten_params`] lays it out, keeping parameter ids and whether each requires a gradient.
/// `flat` must hold exactly the module's number of float elements; otherwise the module is
/// returned unchanged with an error.
pub fn load_flat_params<M: Module>(module: M, flat: &[f32]) -> Result<M, DdpError> {
    load_where(module, flat, |_| true)
}

/// Overwrites the float tensors of `module` for which `keep(requires_grad)` holds from `flat`.
pub(crate) fn load_where<M: Module>(
    module: M,
    flat: &[f32],
    keep: fn(bool) -> bool,
) -> Result<M, DdpError> {
    let expected: usize = param_infos(&module)
        .iter()
        .filter(|p| keep(p.trainable))
        .map(ParamInfo::numel)
        .sum();
    if flat.len() != expected {
        return Err(DdpError::Config(format!(
            "{} values given for a module with {expected} float elements",
            flat.len()
        )));
    }
    struct Writer<'a> {
        keep: fn(bool) -> bool,
        flat: &'a [f32],
        offset: usize,
    }
    impl ModuleMapper for Writer<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let require_grad = tensor.is_require_grad();
            if !(self.keep)(require_grad) {
                return Param::from_mapped_value(id, tensor, mapper);
            }
            let shape = tensor.dims();
            let n: usize = shape.iter().product();
            let Some(values) = self.flat.get(self.offset..self.offset + n) else {
                // Cannot happen after the length check (the same walk); stay unchanged.
                self.offset = usize::MAX / 2;
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let values = values.to_vec();
            self.offset += n;
            let fresh = Tensor::<D>::from_data(TensorData::new(values, shape), &tensor.device())
                .set_require_grad(require_grad);
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    let mut writer = Writer {
        keep,
        flat,
        offset: 0,
    };
    let module = module.map(&mut writer);
    if writer.offset != flat.len() {
        return Err(DdpError::Config(format!(
            "the module's float tensors did not match the {} values given",
            flat.len()
        )));
    }
    Ok(module)
}
