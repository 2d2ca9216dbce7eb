//! The parameter list of any burn module with PyTorch names, its export to safetensors in
//! PyTorch's layouts, and [`materialize`], which draws every parameter at once.
//!
//! burn's derived `Module::visit` calls `enter_module(field, "Struct:Type")` before descending
//! into a field and `exit_module` after it (`Option` fields are transparent, `Vec` elements are
//! entered by index), then `visit_float` for each parameter. Joining the entered names with
//! dots gives PyTorch's `state_dict` keys when the field names are PyTorch's attribute names.
//!
//! Layouts: burn's `Linear` keeps its weight as `[in, out]` (it computes `x W + b`), PyTorch's as
//! `[out, in]` (`x Wᵀ + b`), so the export transposes every `Linear` weight. burn's `Conv2d`
//! weight is `[out, in / groups, kh, kw]`, PyTorch's layout, and is written as is. Biases are
//! vectors in both.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, DType, Int, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// The metadata written into every exported file's header. `format: pt` is what Hugging Face's
/// `safetensors.torch.save_file` writes; loaders use it to know the layouts are PyTorch's.
pub const SAFETENSORS_METADATA: &[(&str, &str)] = &[("format", "pt")];

/// One float parameter of a module.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// The PyTorch `state_dict` key: the module path joined with dots (`conv1.weight`).
    pub name: String,
    /// burn's id of the parameter: the key of its gradient and optimizer state. Random per
    /// process (burn draws it from the OS RNG), so never compare ids across processes.
    pub id: ParamId,
    /// The shape as burn stores it.
    pub shape: Vec<usize>,
    /// `true` for the weight of a burn `Linear` layer, stored `[in, out]` by burn and
    /// `[out, in]` by PyTorch.
    pub linear_weight: bool,
    /// burn's element type of the tensor.
    pub dtype: DType,
    /// Whether the tensor requires a gradient (on an autodiff backend). `false` for module
    /// state that is not trained by gradients: burn's `RunningState` (`BatchNorm`'s
    /// `running_mean` and `running_var`), which burn visits as a float parameter, and frozen
    /// parameters. PyTorch would call most of these buffers. Always `false` on a backend
    /// without autodiff.
    pub require_grad: bool,
}

impl ParamSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The shape as PyTorch stores it (a `Linear` weight's two dimensions swapped).
    pub fn pytorch_shape(&self) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if self.linear_weight {
            shape.reverse();
        }
        shape
    }
}

/// Lists the float parameters of `module` in burn's visiting order (the field order of the
/// structs, the same in every process for the same model type) with PyTorch names, burn
/// shapes, ids, element types and whether each requires a gradient. Integer and boolean
/// parameters are not listed. This is the one module-path walker of the workspace: the `ddp`
/// crate builds its parameter list from it.
pub fn param_specs<M: Module>(module: &M) -> Vec<ParamSpec> {
    let mut walker = Walker::new(false);
    module.visit(&mut walker);
    walker.specs
}

/// Why an export failed.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// A parameter's values could not be read as `f32`.
    #[error("cannot read parameter {name} as f32: {reason}")]
    Data {
        /// The parameter's PyTorch name.
        name: String,
        /// burn's description of the problem.
        reason: String,
    },
    /// The safetensors encoder refused the tensors.
    #[error("cannot encode parameters as safetensors: {0}")]
    Encode(#[from] safetensors::SafeTensorError),
    /// Writing, syncing or renaming the file failed.
    #[error("cannot write {}: {source}", path.display())]
    Io {
        /// The file being written.
        path: PathBuf,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// Encodes every float parameter of `module` as a safetensors file image: PyTorch names,
/// PyTorch layouts (`Linear` weights transposed), `F32` little-endian whatever burn's float
/// type is, and [`SAFETENSORS_METADATA`] in the header.
pub fn safetensors_bytes<M: Module>(module: &M) -> Result<Vec<u8>, ExportError> {
    let mut walker = Walker::new(true);
    module.visit(&mut walker);
    let tensors = walker.specs.iter().zip(walker.values);
    let mut encoded = Vec::with_capacity(walker.specs.len());
    for (spec, values) in tensors {
        let values = values.map_err(|reason| ExportError::Data {
            name: spec.name.clone(),
            reason,
        })?;
        let values = if spec.linear_weight {
            transpose(&values, spec.shape[0], spec.shape[1])
        } else {
            values
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        encoded.push((spec.name.clone(), spec.pytorch_shape(), bytes));
    }
    let views = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|view| (name.as_str(), view))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = SAFETENSORS_METADATA
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    Ok(safetensors::serialize(views, Some(metadata))?)
}

/// Writes [`safetensors_bytes`] of `module` to `path` atomically: into a temporary file in the
/// same directory, synced to disk, then renamed over `path`, so a reader never sees a partial
/// file and a crash leaves the previous file intact.
pub fn export_safetensors<M: Module>(module: &M, path: &Path) -> Result<(), ExportError> {
    let bytes = safetensors_bytes(module)?;
    write_atomically(path, &bytes)
}

/// Writes `bytes` to a temporary sibling of `path`, syncs it, and renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ExportError> {
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{file_name}.{}.tmp", std::process::id()));
    let io_error = |source, at: &Path| ExportError::Io {
        path: at.to_path_buf(),
        source,
    };
    let written = fs::File::create(&tmp).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(io_error(source, &tmp));
    }
    fs::rename(&tmp, path).map_err(|source| {
        let _ = fs::remove_file(&tmp);
        io_error(source, path)
    })
}

/// `[rows, cols]` row-major → `[cols, rows]` row-major.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// Walks a module, keeping the path of entered fields and their container types.
struct Walker {
    /// `(field name, container type)` of each entered level.
    path: Vec<(String, String)>,
    specs: Vec<ParamSpec>,
    /// Whether to read the values too.
    read_values: bool,
    /// Each parameter's values as flat row-major `f32`, when `read_values`.
    values: Vec<Result<Vec<f32>, String>>,
}

impl Walker {
    fn new(read_values: bool) -> Self {
        Self {
            path: Vec::new(),
            specs: Vec::new(),
            read_values,
            values: Vec::new(),
        }
    }
}

impl ModuleVisitor for Walker {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path
            .push((name.to_string(), container_type.to_string()));
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        let name = self
            .path
            .iter()
            .map(|(field, _)| field.as_str())
            .collect::<Vec<_>>()
            .join(".");
        // burn's derived visit enters `weight` with the container type of the struct that
        // owns the field, so a Linear's weight arrives as ("weight", "Struct:Linear").
        let linear_weight = D == 2
            && matches!(self.path.last(), Some((field, owner)) if field == "weight" && owner == "Struct:Linear");
        self.specs.push(ParamSpec {
            name,
            id: param.id,
            shape: value.dims().to_vec(),
            linear_weight,
            dtype: value.dtype(),
            require_grad: value.is_require_grad(),
        });
        if self.read_values {
            let data = value.into_data().convert::<f32>();
            self.values
                .push(data.try_into_vec::<f32>().map_err(|e| format!("{e:?}")));
        }
    }
}

/// Draws the initial values of every parameter of `module` now, in burn's visiting order.
///
/// burn creates parameters lazily: the initializer runs at the first `Param::val()`, and a
/// clone taken before that runs its own initializer, giving different values under the same
/// `ParamId`. Calling this right after construction ties the values to the backend's RNG
/// state at that moment, which is what makes `device.seed` + `init` reproducible. (burn 0.22's
/// own `Module::materialize` is something else: it folds reparameterizations such as LoRA and
/// leaves lazy parameters lazy.) The models'
/// `init` functions call it; call it yourself for modules built from burn's layers directly.
pub fn materialize<M: Module>(module: M) -> M {
    struct Touch;
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            drop(param.val());
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            drop(param.val());
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            drop(param.val());
        }
    }
    module.visit(&mut Touch);
    module
}
