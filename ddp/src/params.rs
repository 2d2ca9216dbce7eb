//! Parameter bookkeeping: the fixed list of a module's float tensors (name, id, shape, whether
//! trained by gradients) in burn's visiting order, moving gradients between burn's
//! `GradientsParams` and flat `f32` slices, and reading or overwriting values as flat `f32`.
//!
//! burn's tensors carry their rank `D` as a const generic, while a parameter list is only known
//! at run time; [`with_rank!`] turns the recorded rank back into a const generic (ranks 1 to 6,
//! which covers every layer burn ships).
//!
//! **Buffers and frozen parameters.** burn has no separate notion of a buffer: `BatchNorm`'s
//! `running_mean` and `running_var` are `RunningState<Tensor>`s, which burn 0.22 hands to
//! `ModuleVisitor` and `ModuleMapper` as float `Param`s (`Param::initialized(id, value)`,
//! burn-core `module/param/running.rs`) whose tensor does not require a gradient, exactly like a
//! frozen parameter (`set_require_grad(false)`, fine-tuning). They differ in one place:
//! `RunningState::map` forces the mapped value back to "no gradient", a `Param` keeps what the
//! mapper returns. So [`param_infos`] maps a clone of the module with a mapper that asks every
//! tensor to require a gradient and reads the result: what still requires none is a
//! [`ParamKind::Buffer`]; what did not before is [`ParamKind::Frozen`]. (Mapping a clone writes
//! the unchanged values back into the shared `RunningState`s; nothing else is touched.)
//! Buffers are broadcast from rank 0 at every sync, as PyTorch's `broadcast_buffers=True`
//! does; frozen parameters only at construction, like every parameter.
//!
//! **Element types.** Values and gradients travel as `f32`, which holds every `f16` and `bf16`
//! value exactly; tensors are rebuilt in their own element type, so a half-precision model
//! stays half precision on every rank. `f64` (and anything else) would be rounded, so it is
//! refused at construction with an error naming the parameter.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Tensor, TensorCreationOptions, TensorData};

use crate::gradients::host_buf::HostBuf;
use crate::DdpError;

/// What a float tensor of a module is to the wrapper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A parameter that requires a gradient: averaged across ranks at every sync.
    Trainable,
    /// A parameter that requires no gradient (frozen, e.g. a fine-tuned model's backbone):
    /// broadcast from rank 0 at construction, then left alone (checked by the replica check).
    Frozen,
    /// burn's `RunningState` (`BatchNorm`'s running statistics): updated by the forward pass
    /// on each rank, broadcast from rank 0 at every sync unless
    /// [`crate::DdpConfig::broadcast_buffers`] is off.
    Buffer,
}

/// One float tensor of a module, as every rank must see it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// The module path, dot separated like PyTorch's `state_dict` keys (`conv1.weight`).
    pub name: String,
    /// burn's id of the parameter (the key of its gradient).
    pub id: ParamId,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// burn's element type of the parameter.
    pub dtype: DType,
    /// Whether it is trained, frozen or a buffer.
    pub kind: ParamKind,
}

impl ParamInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether its gradient is averaged across ranks ([`ParamKind::Trainable`]).
    pub fn trainable(&self) -> bool {
        self.kind == ParamKind::Trainable
    }

    /// The line that describes this parameter in the cross-rank comparison.
    pub(crate) fn describe(&self) -> String {
        let kind = match self.kind {
            ParamKind::Trainable => "",
            ParamKind::Frozen => " frozen",
            ParamKind::Buffer => " buffer",
        };
        format!("{} {:?} {:?}{kind}", self.name, self.shape, self.dtype)
    }
}

/// Lists the float tensors of `module` in burn's visiting order (the field order of the
/// structs: the same on every rank for the same module type), named like PyTorch's
/// `state_dict` keys: burn's derived `visit` calls `enter_module(field, ..)` before a field
/// and `exit_module` after it (`Option` is transparent, `Vec` elements are entered by index),
/// so the entered names joined with dots are the path. Integer and boolean tensors are not
/// listed. See the module documentation for how buffers and frozen parameters are told apart.
pub fn param_infos<M: Module>(module: &M) -> Vec<ParamInfo> {
    /// Asks every float tensor to require a gradient (`RunningState` refuses).
    struct AllTrainable;
    impl ModuleMapper for AllTrainable {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            Param::from_mapped_value(id, value.set_require_grad(true), mapper)
        }
    }
    let mut infos = visited_infos(module);
    // A tensor the mapper could not make trainable is a RunningState. (On a device without
    // autodiff nothing can require a gradient, and every tensor counts as a buffer.)
    if infos.iter().any(|p| p.kind == ParamKind::Frozen) {
        let probe = module.clone().map(&mut AllTrainable);
        for (info, probed) in infos.iter_mut().zip(visited_infos(&probe)) {
            if probed.kind == ParamKind::Frozen {
                info.kind = ParamKind::Buffer;
            }
        }
    }
    infos
}

/// The float tensors of `module` in visiting order as one visit sees them: buffers are not
/// told apart from frozen parameters yet ([`param_infos`] does that, with a probe that maps a
/// clone of the module; what needs only names, shapes or counts calls this).
fn visited_infos<M: Module>(module: &M) -> Vec<ParamInfo> {
    struct Walker {
        path: Vec<String>,
        out: Vec<ParamInfo>,
    }
    impl ModuleVisitor for Walker {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val();
            self.out.push(ParamInfo {
                name: self.path.join("."),
                id: param.id,
                shape: value.dims().to_vec(),
                dtype: value.dtype(),
                kind: if value.is_require_grad() {
                    ParamKind::Trainable
                } else {
                    ParamKind::Frozen
                },
            });
        }
    }
    let mut walker = Walker {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut walker);
    walker.out
}

/// Checks that every parameter's element type travels exactly through `f32`.
pub(crate) fn check_dtypes(infos: &[ParamInfo]) -> Result<(), DdpError> {
    match infos
        .iter()
        .find(|p| !matches!(p.dtype, DType::F32 | DType::F16 | DType::BF16))
    {
        Some(p) => Err(DdpError::UnsupportedParam {
            name: p.name.clone(),
            reason: format!(
                "element type {:?}: values and gradients are averaged in f32, which holds f32, \
                 f16 and bf16 exactly but would round this one (cast the model to f32, f16 or \
                 bf16)",
                p.dtype
            ),
        }),
        None => Ok(()),
    }
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

/// Takes the gradient of `info` out of `grads` as flat `f32` (burn's memory, without a copy,
/// when it is `f32` and `grads` held it alone), or `None` when the parameter got no gradient
/// this step. A gradient that cannot be read as `f32` values of the parameter's size is an
/// error naming the parameter, never an empty or zero gradient.
pub(crate) fn take_grad(
    grads: &mut GradientsParams,
    info: &ParamInfo,
) -> Result<Option<HostBuf>, DdpError> {
    let data: Option<TensorData> = with_rank!(info.shape.len(), D => {
        grads.remove::<D>(info.id).map(|t| t.into_data())
    }, None);
    data.map(|d| HostBuf::from_data(d, &info.name, "gradient", info.numel()))
        .transpose()
}

/// Puts a flat `f32` gradient back for `info`, on `device` (the device without autodiff, where
/// burn keeps gradients), in the parameter's element type (an `f32` one without a copy).
pub(crate) fn put_grad(
    grads: &mut GradientsParams,
    info: &ParamInfo,
    values: HostBuf,
    device: &Device,
) {
    let data = values.into_data(info.shape.clone());
    let options = TensorCreationOptions::new(device.clone()).with_dtype(info.dtype);
    with_rank!(info.shape.len(), D => {
        grads.register::<D>(info.id, Tensor::from_data(data, options))
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

/// Puts a flat gradient tensor back for `info`, in the parameter's shape and element type.
#[cfg(feature = "cuda")]
pub(crate) fn put_grad_tensor(grads: &mut GradientsParams, info: &ParamInfo, flat: Tensor<1>) {
    use burn::tensor::FloatDType;
    let shape = burn::tensor::Shape::from(info.shape.clone());
    let flat = match info.dtype {
        DType::F16 if flat.dtype() != DType::F16 => flat.cast(FloatDType::F16),
        DType::BF16 if flat.dtype() != DType::BF16 => flat.cast(FloatDType::BF16),
        _ => flat,
    };
    with_rank!(info.shape.len(), D => {
        grads.register::<D>(info.id, flat.reshape(shape))
    }, ())
}

/// Reads every float tensor of `module` into one flat `f32` vector, in visiting order
/// (trainable parameters, frozen ones and buffers alike). A tensor that cannot be read as `f32`
/// is an error naming it.
pub fn flatten_params<M: Module>(module: &M) -> Result<Vec<f32>, DdpError> {
    flatten_where(module, &|_| true)
}

/// Reads the float tensors of `module` whose visiting index `keep` accepts into one flat `f32`
/// vector, in visiting order.
pub(crate) fn flatten_where<M: Module>(
    module: &M,
    keep: &dyn Fn(usize) -> bool,
) -> Result<Vec<f32>, DdpError> {
    struct Reader<'a> {
        keep: &'a dyn Fn(usize) -> bool,
        out: Vec<f32>,
        index: usize,
        error: Option<(usize, String)>,
    }
    impl ModuleVisitor for Reader<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let index = self.index;
            self.index += 1;
            if self.error.is_some() || !(self.keep)(index) {
                return;
            }
            match param.val().into_data().convert::<f32>().as_slice::<f32>() {
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
        Some((index, reason)) => Err(unreadable_values(module, index, reason)),
    }
}

/// The error for float tensor `index` of `module` (visiting order) whose values could not be
/// read as `f32`, naming it.
fn unreadable_values<M: Module>(module: &M, index: usize, reason: String) -> DdpError {
    DdpError::Conversion {
        name: visited_infos(module)
            .get(index)
            .map_or_else(|| format!("#{index}"), |p| p.name.clone()),
        what: "values",
        reason,
    }
}

/// Overwrites every float tensor of `module` from a flat `f32` vector laid out as
/// [`flatten_params`] lays it out, keeping parameter ids, element types and whether each
/// requires a gradient. `flat` must hold exactly the module's number of float elements;
/// otherwise the module is returned unchanged with an error.
pub fn load_flat_params<M: Module>(module: M, flat: &[f32]) -> Result<M, DdpError> {
    load_where(module, flat, &|_| true)
}

/// Overwrites the float tensors of `module` whose visiting index `keep` accepts from `flat`.
pub(crate) fn load_where<M: Module>(
    module: M,
    flat: &[f32],
    keep: &dyn Fn(usize) -> bool,
) -> Result<M, DdpError> {
    let expected: usize = visited_infos(&module)
        .iter()
        .enumerate()
        .filter(|(i, _)| keep(*i))
        .map(|(_, p)| p.numel())
        .sum();
    if flat.len() != expected {
        return Err(DdpError::Config(format!(
            "{} values given for a module with {expected} float elements",
            flat.len()
        )));
    }
    let mut offset = 0;
    let module = load_with(module, keep, &mut |_, n| {
        let values = flat.get(offset..offset + n).map(<[f32]>::to_vec);
        offset += n;
        values
    });
    if offset != flat.len() {
        return Err(DdpError::Config(format!(
            "the module's float tensors did not match the {} values given",
            flat.len()
        )));
    }
    Ok(module)
}

/// Overwrites the float tensors of `module` whose visiting index `keep` accepts with the values
/// `produce(index, numel)` returns (`None`: the tensor stays as it is), keeping parameter ids,
/// element types and whether each requires a gradient.
pub(crate) fn load_with<M: Module>(
    module: M,
    keep: &dyn Fn(usize) -> bool,
    produce: &mut dyn FnMut(usize, usize) -> Option<Vec<f32>>,
) -> M {
    struct Writer<'a> {
        keep: &'a dyn Fn(usize) -> bool,
        produce: &'a mut dyn FnMut(usize, usize) -> Option<Vec<f32>>,
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
            let Some(values) = (self.produce)(index, n).filter(|v| v.len() == n) else {
                return Param::from_mapped_value(id, tensor, mapper);
            };
            let options = TensorCreationOptions::new(tensor.device()).with_dtype(tensor.dtype());
            let fresh = Tensor::<D>::from_data(TensorData::new(values, shape), options)
                .set_require_grad(tensor.is_require_grad());
            Param::from_mapped_value(id, fresh, mapper)
        }
    }
    module.map(&mut Writer {
        keep,
        produce,
        index: 0,
    })
}

/// Takes the values of the float tensors of `module` that `take` accepts (by visiting index)
/// out of it, as flat `f32`, leaving a one-element placeholder in their place until
/// [`put_values`] puts them back: for updating parameters in their own memory (ZeRO's step
/// and all-gather). Where the module holds burn's tensor alone (no clone of the module, no
/// autodiff graph still using it), burn's CPU backend hands its memory over without a copy;
/// otherwise it is copied. Returns the module and each tensor's values (`None` for the
/// others), or an error naming a tensor that could not be read (the module is then lost, as
/// a step that fails half-way loses it).
pub(crate) fn take_values<M: Module>(
    module: M,
    take: &dyn Fn(usize) -> bool,
) -> Result<(M, Vec<Option<HostBuf>>), DdpError> {
    struct Taker<'a> {
        take: &'a dyn Fn(usize) -> bool,
        path: Vec<String>,
        out: Vec<Option<HostBuf>>,
        error: Option<DdpError>,
    }
    impl ModuleMapper for Taker<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.out.len();
            if !(self.take)(index) || self.error.is_some() {
                self.out.push(None);
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let device = tensor.device();
            let numel = tensor.shape().num_elements();
            let name = self.path.join(".");
            match HostBuf::from_data(tensor.into_data(), &name, "values", numel) {
                Ok(values) => self.out.push(Some(values)),
                Err(e) => {
                    self.error = Some(e);
                    self.out.push(None);
                }
            }
            Param::from_mapped_value(id, Tensor::zeros([1; D], &device), mapper)
        }
    }
    let mut taker = Taker {
        take,
        path: Vec::new(),
        out: Vec::new(),
        error: None,
    };
    let module = module.map(&mut taker);
    match taker.error {
        Some(e) => Err(e),
        None => Ok((module, taker.out)),
    }
}

/// Puts values taken by [`take_values`] back into `module`, as tensors of the shapes and
/// element types in `infos`, requiring a gradient where [`ParamKind::Trainable`] (an `f32`
/// tensor's memory is the buffer's, no copy); tensors with `None` are left as they are.
pub(crate) fn put_values<M: Module>(
    module: M,
    infos: &[ParamInfo],
    values: Vec<Option<HostBuf>>,
) -> M {
    struct Putter<'a> {
        infos: &'a [ParamInfo],
        values: std::vec::IntoIter<Option<HostBuf>>,
        index: usize,
    }
    impl ModuleMapper for Putter<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.index;
            self.index += 1;
            let (Some(Some(values)), Some(info)) = (self.values.next(), self.infos.get(index))
            else {
                return param;
            };
            let (id, placeholder, mapper) = param.consume();
            let options = TensorCreationOptions::new(placeholder.device()).with_dtype(info.dtype);
            let data = values.into_data(info.shape.clone());
            let tensor = Tensor::<D>::from_data(data, options)
                .set_require_grad(info.kind == ParamKind::Trainable);
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    module.map(&mut Putter {
        infos,
        values: values.into_iter(),
        index: 0,
    })
}
