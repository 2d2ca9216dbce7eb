//! The models of ddp-rs as plain burn modules: the MNIST CNN of PyTorch's `examples/mnist`, a
//! 784-256-10 MLP for MNIST, a small MLP for the Pima Indians diabetes table, and a small
//! character-level GPT ([`Gpt`], nanoGPT's layout).
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

mod classifier;
mod cnn;
mod cpu_ops;
mod deep_mlp;
mod gpt;
mod mlp;
pub mod ops;
mod params;
mod pima;

pub use classifier::{correct_argmax, cross_entropy, nll_loss, Classifier};
pub use cnn::{MnistCnn, MnistCnnConfig};
pub use deep_mlp::{DeepMlp, DeepMlpConfig};
pub use gpt::{Block, CausalSelfAttention, Gpt, GptConfig, LayerNorm, Mlp};
pub use mlp::{MnistMlp, MnistMlpConfig};
pub use ops::FastOps;
pub use params::{
    export_safetensors, materialize, param_specs, safetensors_bytes, ExportError, ParamSpec,
    SAFETENSORS_METADATA,
};
pub use pima::{PimaMlp, PimaMlpConfig};

/// The README's example, compiled and run as a doctest.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
