//! A deep perceptron for MNIST-shaped input: 784 → hidden → ... → hidden → 10 with a ReLU
//! after every hidden layer, trained with cross-entropy on its logits (PyTorch: a
//! `nn.Sequential` of `nn.Linear` and `nn.ReLU`). With 4 hidden layers of 2048 units it has
//! 14.2 M parameters: the benchmarks' model whose gradients (57 MB) take time to all-reduce and
//! are produced layer by layer during backward.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::Device;
use burn::tensor::{Int, Tensor};

use crate::classifier::{correct_argmax, cross_entropy, Classifier};
use crate::params::materialize;

/// Configuration of [`DeepMlp`].
#[derive(Config, Debug)]
pub struct DeepMlpConfig {
    /// Input features per sample (28 × 28 pixels).
    #[config(default = 784)]
    pub input: usize,
    /// Width of every hidden layer.
    #[config(default = 2048)]
    pub hidden: usize,
    /// Number of hidden layers (at least 1).
    #[config(default = 4)]
    pub layers: usize,
    /// Number of classes.
    #[config(default = 10)]
    pub num_classes: usize,
}

/// The deep MLP. Parameter paths `hidden.<i>.weight`, `hidden.<i>.bias`, `out.weight`,
/// `out.bias`. Output: logits `[batch, num_classes]`.
#[derive(Module, Debug)]
pub struct DeepMlp {
    /// The hidden layers, in order.
    pub hidden: Vec<Linear>,
    /// The output layer.
    pub out: Linear,
}

impl DeepMlpConfig {
    /// Builds the model on `device`, drawing every parameter now, in visiting order.
    pub fn init(&self, device: &Device) -> DeepMlp {
        let layers = self.layers.max(1);
        let hidden = (0..layers)
            .map(|i| {
                let inputs = if i == 0 { self.input } else { self.hidden };
                LinearConfig::new(inputs, self.hidden).init(device)
            })
            .collect();
        let out = LinearConfig::new(self.hidden, self.num_classes).init(device);
        materialize(DeepMlp { hidden, out })
    }
}

impl Classifier<4> for DeepMlp {
    /// Logits for MNIST images `[batch, 1, 28, 28]` (flattened).
    fn forward(&self, input: Tensor<4>) -> Tensor<2> {
        let [batch, c, h, w] = input.dims();
        let mut x = input.reshape([batch, c * h * w]);
        for layer in &self.hidden {
            x = relu(layer.forward(x));
        }
        self.out.forward(x)
    }

    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        cross_entropy(output, targets)
    }

    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
        correct_argmax(output, targets)
    }
}
