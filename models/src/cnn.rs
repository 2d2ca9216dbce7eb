//! The MNIST CNN of PyTorch's `examples/mnist/main.py`, layer for layer.
//!
//! ```text
//! [B,1,28,28] conv1 3x3 → [B,32,26,26] relu → conv2 3x3 → [B,64,24,24] relu
//!   → max-pool 2 → [B,64,12,12] dropout(0.25) → flatten [B,9216]
//!   → fc1 → [B,128] relu → dropout(0.5) → fc2 → [B,10] → log-softmax
//! ```
//!
//! 1,199,882 parameters, the same count as PyTorch's `Net`. The loss is the negative
//! log-likelihood of the log-softmax output, as in the tutorial (`F.nll_loss`).

use burn::config::Config;
use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::Device;
use burn::tensor::{Int, Tensor};

use crate::classifier::{correct_argmax, nll_loss, Classifier};
use crate::ops;
use crate::params::materialize;

/// Configuration of [`MnistCnn`]. The defaults are the PyTorch tutorial's; set the dropout
/// probabilities to `0.0` where a test needs a deterministic forward pass.
#[derive(Config, Debug)]
pub struct MnistCnnConfig {
    /// Number of classes (outputs of `fc2`).
    #[config(default = 10)]
    pub num_classes: usize,
    /// Dropout probability after the max-pool (`dropout1`).
    #[config(default = 0.25)]
    pub dropout1: f64,
    /// Dropout probability after `fc1` (`dropout2`).
    #[config(default = 0.5)]
    pub dropout2: f64,
}

/// The MNIST CNN. Field names are PyTorch's, so parameter paths are `conv1.weight`, ...,
/// `fc2.bias`. Input `[batch, 1, 28, 28]`, output log-probabilities `[batch, num_classes]`.
#[derive(Module, Debug)]
pub struct MnistCnn {
    /// 1 → 32 channels, 3x3, stride 1, no padding.
    pub conv1: Conv2d,
    /// 32 → 64 channels, 3x3, stride 1, no padding.
    pub conv2: Conv2d,
    /// 2x2 max-pool, stride 2.
    pub pool: MaxPool2d,
    /// Dropout after the pool.
    pub dropout1: Dropout,
    /// 9216 → 128.
    pub fc1: Linear,
    /// Dropout after `fc1`.
    pub dropout2: Dropout,
    /// 128 → `num_classes`.
    pub fc2: Linear,
}

impl MnistCnnConfig {
    /// Builds the model on `device` with burn's default initialisation (the same uniform
    /// bounds as PyTorch's defaults), drawing every parameter now, in visiting order.
    pub fn init(&self, device: &Device) -> MnistCnn {
        let model = MnistCnn {
            conv1: Conv2dConfig::new([1, 32], [3, 3]).init(device),
            conv2: Conv2dConfig::new([32, 64], [3, 3]).init(device),
            pool: MaxPool2dConfig::new([2, 2]).init(),
            dropout1: DropoutConfig::new(self.dropout1).init(),
            fc1: LinearConfig::new(9216, 128).init(device),
            dropout2: DropoutConfig::new(self.dropout2).init(),
            fc2: LinearConfig::new(128, self.num_classes).init(device),
        };
        materialize(model)
    }
}

impl MnistCnn {
    /// Log-probabilities `[batch, num_classes]` for images `[batch, 1, 28, 28]`.
    ///
    /// Dropout is active only on an autodiff backend (training); on the inner backend
    /// (`model.valid()`) it is the identity, like PyTorch's `model.eval()`. The convolutions,
    /// the pool and the dropouts go through [`FastOps`](crate::FastOps) (the CPU backend's own kernels,
    /// burn's elsewhere).
    ///
    /// # Panics
    ///
    /// If the input is not `[batch, 1, 28, 28]`.
    pub fn forward(&self, images: Tensor<4>) -> Tensor<2> {
        let [_, channels, height, width] = images.dims();
        assert!(
            channels == 1 && height == 28 && width == 28,
            "MnistCnn expects images [batch, 1, 28, 28], got {:?}",
            images.dims()
        );
        let x = relu(ops::conv2d(images, &self.conv1));
        let x = relu(ops::conv2d(x, &self.conv2));
        let x = ops::max_pool2d(x, &self.pool);
        let x = ops::dropout(x, &self.dropout1);
        let x = x.flatten::<2>(1, 3);
        let x = relu(self.fc1.forward(x));
        let x = ops::dropout(x, &self.dropout2);
        log_softmax(self.fc2.forward(x), 1)
    }

    /// Mean negative log-likelihood over the batch (shape `[1]`) and the log-probabilities.
    pub fn loss(&self, images: Tensor<4>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
        let log_probs = self.forward(images);
        (nll_loss(log_probs.clone(), targets), log_probs)
    }
}

impl Classifier<4> for MnistCnn {
    fn forward(&self, input: Tensor<4>) -> Tensor<2> {
        MnistCnn::forward(self, input)
    }

    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        nll_loss(output, targets)
    }

    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
        correct_argmax(output, targets)
    }
}
