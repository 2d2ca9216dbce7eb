//! A two-layer perceptron for MNIST: 784 → 256 → 10 with a ReLU between, trained with
//! cross-entropy on its logits (PyTorch: `nn.Linear(784, 256)`, `F.relu`, `nn.Linear(256, 10)`,
//! `F.cross_entropy`). 203,530 parameters.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::{correct_argmax, cross_entropy, materialize, Classifier};

/// Configuration of [`MnistMlp`].
#[derive(Config, Debug)]
pub struct MnistMlpConfig {
    /// Input features per sample (28 × 28 pixels).
    #[config(default = 784)]
    pub input: usize,
    /// Width of the hidden layer.
    #[config(default = 256)]
    pub hidden: usize,
    /// Number of classes.
    #[config(default = 10)]
    pub num_classes: usize,
}

/// The MNIST MLP. Parameter paths `fc1.weight`, `fc1.bias`, `fc2.weight`, `fc2.bias`.
/// Output: logits `[batch, num_classes]`.
#[derive(Module, Debug)]
pub struct MnistMlp<B: Backend> {
    /// `input` → `hidden`.
    pub fc1: Linear<B>,
    /// `hidden` → `num_classes`.
    pub fc2: Linear<B>,
}

impl MnistMlpConfig {
    /// Builds the model on `device`, drawing every parameter now, in visiting order.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MnistMlp<B> {
        let model = MnistMlp {
            fc1: LinearConfig::new(self.input, self.hidden).init(device),
            fc2: LinearConfig::new(self.hidden, self.num_classes).init(device),
        };
        materialize(model)
    }
}

impl<B: Backend> MnistMlp<B> {
    /// Logits `[batch, num_classes]` for a batch of any rank whose first dimension is the
    /// batch: `[batch, 1, 28, 28]` images or `[batch, 784]` rows are flattened alike.
    ///
    /// # Panics
    ///
    /// If the elements per sample differ from the configured input size.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, 2> {
        let dims = input.dims();
        let batch = dims[0];
        let features: usize = dims[1..].iter().product();
        let expected = self.fc1.weight.dims()[0];
        assert!(
            features == expected,
            "MnistMlp expects {expected} features per sample, got input {dims:?}"
        );
        let x = input.reshape([batch, features]);
        let x = relu(self.fc1.forward(x));
        self.fc2.forward(x)
    }

    /// Mean cross-entropy over the batch (shape `[1]`) and the logits.
    pub fn loss<const D: usize>(
        &self,
        input: Tensor<B, D>,
        targets: Tensor<B, 1, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 2>) {
        let logits = self.forward(input);
        (cross_entropy(logits.clone(), targets), logits)
    }
}

/// The trainer-facing view takes MNIST images `[batch, 1, 28, 28]`, like [`MnistCnn`]'s, so a
/// trainer can swap one model for the other; call the inherent methods for `[batch, 784]` rows.
///
/// [`MnistCnn`]: crate::MnistCnn
impl<B: Backend> Classifier<B, 4> for MnistMlp<B> {
    fn forward(&self, input: Tensor<B, 4>) -> Tensor<B, 2> {
        MnistMlp::forward(self, input)
    }

    fn loss(
        &self,
        input: Tensor<B, 4>,
        targets: Tensor<B, 1, Int>,
    ) -> (Tensor<B, 1>, Tensor<B, 2>) {
        MnistMlp::loss(self, input, targets)
    }

    fn correct(&self, output: &Tensor<B, 2>, targets: &Tensor<B, 1, Int>) -> usize {
        correct_argmax(output, targets)
    }
}
