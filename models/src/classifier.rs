//! The trainers' view of a classification model ([`Classifier`]) and the losses and accuracy
//! count the models share.

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

    /// The mean loss (shape `[1]`) of `output`, rows that [`forward`](Self::forward) gave,
    /// against their `targets`: a trainer that ran a padded batch (every batch of one shape,
    /// so that a GPU backend tunes its kernels once) takes the loss of the real rows alone.
    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1>;

    /// The mean loss over the batch (shape `[1]`) and the model's output for the batch:
    /// [`forward`](Self::forward), then [`output_loss`](Self::output_loss).
    fn loss(&self, input: Tensor<D>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
        let output = self.forward(input);
        (self.output_loss(output.clone(), targets), output)
    }

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
pub(crate) fn count_true(mask: Tensor<1, Bool>) -> usize {
    let count: i64 = mask.int().sum().into_scalar::<i64>();
    count as usize
}
