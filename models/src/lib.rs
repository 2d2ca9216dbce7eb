//! The models of ddp-rs as plain burn modules: the MNIST CNN of PyTorch's `examples/mnist`, a
//! 784-256-10 MLP for MNIST, and a small MLP for the Pima Indians diabetes table.
//!
//! Each model is a `#[derive(Module)]` struct built from a `#[derive(Config)]` struct with
//! `.init(device)`, exactly like burn's own layers. Nothing here knows about distribution: a
//! distributed wrapper sees these models only through burn's `Module` trait.
//!
//! Two things every model guarantees, which burn's layers alone do not:
//!
//! - **Eager, seeded initialisation.** burn draws a parameter's initial values lazily, at its
//!   first use, and a clone taken before that first use draws its own, different values under
//!   the same parameter id. Every `init` here draws all parameters at once, in visiting order
//!   (see [`materialize`]), so `device.seed(s)` followed by `init` gives the same weights
//!   in every process.
//! - **PyTorch names.** The field names are PyTorch's attribute names, so burn's module paths
//!   are PyTorch's `state_dict` keys (`conv1.weight`, `fc2.bias`); [`param_specs`] lists them
//!   and [`export_safetensors`] writes a file that `torch`'s `load_state_dict` accepts.
//!
//! ```
//! use burn::tensor::{Device, Int, Tensor};
//! use ddp_models::{Classifier, MnistCnnConfig};
//!
//! let device = Device::flex().autodiff();
//! device.seed(42);
//! let model = MnistCnnConfig::new().init(&device);
//! let images = Tensor::<4>::zeros([2, 1, 28, 28], &device);
//! let targets = Tensor::<1, Int>::from_ints([3, 7], &device);
//! let (loss, log_probs) = model.loss(images, targets.clone());
//! assert_eq!(log_probs.dims(), [2, 10]);
//! let _grads = loss.backward();
//! assert!(model.correct(&log_probs, &targets) <= 2);
//! ```
#![warn(missing_docs)]

mod cnn;
mod cpu_ops;
mod mlp;
pub mod ops;
mod params;
mod pima;

pub use cnn::{MnistCnn, MnistCnnConfig};
pub use mlp::{MnistMlp, MnistMlpConfig};
pub use ops::FastOps;
pub use params::{
    export_safetensors, param_specs, safetensors_bytes, ExportError, ParamSpec,
    SAFETENSORS_METADATA,
};
pub use pima::{PimaMlp, PimaMlpConfig};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Int, Tensor};

/// What a trainer needs from a classification model whose input batches have rank `D`
/// (`4` for MNIST images `[batch, 1, 28, 28]`, `2` for table rows `[batch, features]`).
///
/// Targets are class indices, one per sample (`0..10` for MNIST, `0` or `1` for Pima).
pub trait Classifier<const D: usize> {
    /// The model's output for a batch, `[batch, outputs]`: log-probabilities, logits or a
    /// single logit, as each model documents.
    fn forward(&self, input: Tensor<D>) -> Tensor<2>;

    /// The mean loss over the batch (shape `[1]`) and the model's output for the batch.
    fn loss(&self, input: Tensor<D>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>);

    /// How many samples of the batch `output` predicts correctly.
    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize;
}

/// Negative log-likelihood, averaged over the batch, like PyTorch's `F.nll_loss`:
/// `-mean_i log_probs[i, targets[i]]`. Shapes: `[batch, classes]`, `[batch]` → `[1]`.
pub fn nll_loss(log_probs: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    log_probs
        .gather(1, targets.unsqueeze_dim::<2>(1))
        .mean()
        .neg()
}

/// Cross-entropy from logits, averaged over the batch, like PyTorch's `F.cross_entropy`:
/// `nll_loss(log_softmax(logits))`. Shapes: `[batch, classes]`, `[batch]` → `[1]`.
pub fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    nll_loss(log_softmax(logits, 1), targets)
}

/// Number of rows of `scores` (`[batch, classes]`: logits, probabilities or log-probabilities)
/// whose largest entry is at the target class.
pub fn correct_argmax(scores: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
    let predicted = scores.clone().argmax(1).squeeze_dim::<1>(1);
    count_true(predicted.equal(targets.clone()))
}

/// Counts the `true` entries of a boolean tensor.
fn count_true(mask: Tensor<1, Bool>) -> usize {
    let count: i64 = mask.int().sum().into_scalar::<i64>();
    count as usize
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

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
