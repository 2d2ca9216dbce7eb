//! A small MLP for the Pima Indians diabetes table: 8 features → hidden layers with ReLU → one
//! logit, trained with binary cross-entropy on the logit.
//!
//! Why one logit and binary cross-entropy rather than two classes and cross-entropy: the task
//! is binary, and a softmax over two logits `(a, b)` is exactly `sigmoid(b - a)`, so the second
//! output only adds parameters that the loss cannot tell apart. One logit with a numerically
//! stable `BCEWithLogits` is what a PyTorch user writes for this table (the widely copied
//! PyTorch Pima tutorial is 8 → 12 → 8 → 1 with a sigmoid and `BCELoss`; the default hidden
//! sizes here are that network's), and the exported weights load into such a model.
//!
//! Parameter paths: `hidden.0.weight`, `hidden.0.bias`, `hidden.1.weight`, ...,
//! `output.weight`, `output.bias`: PyTorch's names for a module with
//! `self.hidden = nn.ModuleList([...])` and `self.output = nn.Linear(...)`.

use burn::config::Config;
use burn::module::Module;
use burn::nn::loss::BinaryCrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::Device;
use burn::tensor::{Int, Tensor};

use crate::classifier::{count_true, Classifier};
use crate::params::materialize;

/// Configuration of [`PimaMlp`].
#[derive(Config, Debug)]
pub struct PimaMlpConfig {
    /// Input features per row (the table has 8).
    #[config(default = 8)]
    pub input: usize,
    /// Widths of the hidden layers, in order; each is followed by a ReLU.
    #[config(default = "vec![12, 8]")]
    pub hidden: Vec<usize>,
}

/// The Pima MLP. Input `[batch, 8]` (normalised features), output one logit per row
/// `[batch, 1]`: `sigmoid(logit)` is the predicted probability of diabetes.
#[derive(Module, Debug)]
pub struct PimaMlp {
    /// The hidden layers, each followed by a ReLU.
    pub hidden: Vec<Linear>,
    /// Last hidden width (or the input width without hidden layers) → 1 logit.
    pub output: Linear,
}

impl PimaMlpConfig {
    /// Builds the model on `device`, drawing every parameter now, in visiting order.
    pub fn init(&self, device: &Device) -> PimaMlp {
        let mut width = self.input;
        let mut hidden = Vec::with_capacity(self.hidden.len());
        for &next in &self.hidden {
            hidden.push(LinearConfig::new(width, next).init(device));
            width = next;
        }
        let model = PimaMlp {
            hidden,
            output: LinearConfig::new(width, 1).init(device),
        };
        materialize(model)
    }
}

impl PimaMlp {
    /// One logit per row, `[batch, 1]`, for rows `[batch, input]`.
    pub fn forward(&self, rows: Tensor<2>) -> Tensor<2> {
        let x = self
            .hidden
            .iter()
            .fold(rows, |x, layer| relu(layer.forward(x)));
        self.output.forward(x)
    }

    /// Mean binary cross-entropy with logits over the batch (shape `[1]`) and the logits
    /// `[batch, 1]`. `targets` are `0` or `1`, one per row.
    pub fn loss(&self, rows: Tensor<2>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
        let logits = self.forward(rows);
        (
            Classifier::output_loss(self, logits.clone(), targets),
            logits,
        )
    }
}

impl Classifier<2> for PimaMlp {
    fn forward(&self, input: Tensor<2>) -> Tensor<2> {
        PimaMlp::forward(self, input)
    }

    /// Binary cross-entropy of the logits.
    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        let bce = BinaryCrossEntropyLossConfig::new()
            .with_logits(true)
            .init(&output.device());
        bce.forward(output.squeeze_dim::<1>(1), targets)
    }

    /// A row is predicted positive when its logit is above 0 (probability above 0.5).
    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
        let predicted = output.clone().squeeze_dim::<1>(1).greater_elem(0.0).int();
        count_true(predicted.equal(targets.clone()))
    }
}
