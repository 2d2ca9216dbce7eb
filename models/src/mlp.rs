//! A two-layer perceptron for MNIST: 784 → 256 → 10 with a ReLU between, trained with
//! cross-entropy on its logits (PyTorch: `nn.Linear(784, 256)`, `F.relu`, `nn.Linear(256, 10)`,
//! `F.cross_entropy`). 203,530 parameters.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::Device;
use burn::tensor::{Int, Tensor};

use crate::classifier::{correct_argmax, cross_entropy, Classifier};
use crate::params::materialize;

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
pub struct MnistMlp {
    /// `input` → `hidden`.
    pub fc1: Linear,
    /// `hidden` → `num_classes`.
    pub fc2: Linear,
}

impl MnistMlpConfig {
    /// Builds the model on `device`, drawing every parameter now, in visiting order.
    pub fn init(&self, device: &Device) -> MnistMlp {
        let model = MnistMlp {
            fc1: LinearConfig::new(self.input, self.hidden).init(device),
            fc2: LinearConfig::new(self.hidden, self.num_classes).init(device),
        };
        materialize(model)
    }
}

impl MnistMlp {
    /// Logits `[batch, num_classes]` for a batch of any rank whose first dimension is the
    /// batch: `[batch, 1, 28, 28]` images or `[batch, 784]` rows are flattened alike.
    ///
    /// # Panics
    ///
    /// If the elements per sample differ from the configured input size.
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<2> {
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
        input: Tensor<D>,
        targets: Tensor<1, Int>,
    ) -> (Tensor<1>, Tensor<2>) {
        let logits = self.forward(input);
        (cross_entropy(logits.clone(), targets), logits)
    }
}

/// The trainer-facing view takes MNIST images `[batch, 1, 28, 28]`, like [`MnistCnn`]'s, so a
/// trainer can swap one model for the other; call the inherent methods for `[batch, 784]` rows.
///
/// [`MnistCnn`]: crate::MnistCnn
impl Classifier<4> for MnistMlp {
    fn forward(&self, input: Tensor<4>) -> Tensor<2> {
        MnistMlp::forward(self, input)
    }

    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        cross_entropy(output, targets)
    }

    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
        correct_argmax(output, targets)
    }
}
