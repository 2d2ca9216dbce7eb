//! A small GPT: a decoder-only transformer for character-level language modelling, laid out as
//! nanoGPT's (GPT-2's) `model.py` with dropout 0 by default.
//!
//! Token and position embeddings are added; `n_layer` pre-LayerNorm blocks follow, each
//! `x + attn(ln_1(x))` then `x + mlp(ln_2(x))`, where `attn` is causal multi-head
//! self-attention (one `c_attn` projection to queries, keys and values, `c_proj` back) and
//! `mlp` is `c_fc` (4× wider), exact (erf) GELU, `c_proj`; a final `ln_f`; and the output head
//! is the token embedding itself (weight tying): `logits = h · wteᵀ`. Parameter paths are
//! nanoGPT's without its `transformer.` prefix (`wte.weight`, `h.0.attn.c_attn.weight`,
//! `ln_f.bias`), so [`crate::export_safetensors`] writes a file that a PyTorch module with the
//! same attribute names loads. The default sizes (6 layers, 6 heads, 384 wide, 256 tokens of
//! context) give `10,745,856 + 384·vocab` parameters: 10.78 M for a vocabulary of 90
//! characters ([`GptConfig::num_params`]).

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Initializer};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor};

use crate::classifier::{correct_argmax, cross_entropy, Classifier};
use crate::params::materialize;

/// Configuration of [`Gpt`].
#[derive(Config, Debug)]
pub struct GptConfig {
    /// Distinct tokens (characters).
    pub vocab_size: usize,
    /// Longest context, in tokens (positions of the position embedding).
    #[config(default = 256)]
    pub block_size: usize,
    /// Transformer blocks.
    #[config(default = 6)]
    pub n_layer: usize,
    /// Attention heads per block (must divide `n_embd`).
    #[config(default = 6)]
    pub n_head: usize,
    /// Width of the residual stream.
    #[config(default = 384)]
    pub n_embd: usize,
    /// Dropout probability after the embeddings, on the attention weights and on both
    /// residual branches (nanoGPT's places); 0 turns it off.
    #[config(default = 0.0)]
    pub dropout: f64,
}

/// The GPT. Input: token ids `[batch, time]` (`time <= block_size`); output: logits of the
/// next token at every position, `[batch · time, vocab_size]` (row `b · time + t`).
#[derive(Module, Debug)]
pub struct Gpt {
    /// Token embedding `[vocab_size, n_embd]`, also the output head.
    pub wte: Embedding,
    /// Position embedding `[block_size, n_embd]`.
    pub wpe: Embedding,
    /// Dropout after the embeddings.
    pub drop: Dropout,
    /// The transformer blocks (`h.0`, `h.1`, ...).
    pub h: Vec<Block>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm,
}

/// One pre-LayerNorm transformer block.
#[derive(Module, Debug)]
pub struct Block {
    /// LayerNorm before attention.
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// LayerNorm before the MLP.
    pub ln_2: LayerNorm,
    /// The MLP.
    pub mlp: Mlp,
}

/// Causal multi-head self-attention.
#[derive(Module, Debug)]
pub struct CausalSelfAttention {
    /// `n_embd` → `3 · n_embd`: queries, keys, values.
    pub c_attn: Linear,
    /// `n_embd` → `n_embd`.
    pub c_proj: Linear,
    /// Dropout on the attention weights.
    pub attn_dropout: Dropout,
    /// Dropout on the output.
    pub resid_dropout: Dropout,
    /// Heads.
    pub n_head: usize,
}

/// The block's MLP: `n_embd` → `4 · n_embd` → GELU → `n_embd`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// The widening projection.
    pub c_fc: Linear,
    /// The narrowing projection.
    pub c_proj: Linear,
    /// Dropout on the output.
    pub dropout: Dropout,
}

/// LayerNorm over the last dimension with PyTorch's parameter names (`weight`, `bias`) and
/// epsilon (1e-5); burn's own calls them `gamma` and `beta`.
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// Scale, initially ones.
    pub weight: Param<Tensor<1>>,
    /// Shift, initially zeros.
    pub bias: Param<Tensor<1>>,
}

impl GptConfig {
    /// Builds the model on `device`, drawing every parameter now, in visiting order:
    /// embeddings from N(0, 0.02²) (nanoGPT's; burn's default N(0, 1) would start the tied
    /// head's logits far from uniform), the linear layers as burn's (PyTorch's) default.
    ///
    /// # Panics
    ///
    /// If `n_head` does not divide `n_embd`, or a size is 0.
    pub fn init(&self, device: &Device) -> Gpt {
        assert!(
            self.n_head > 0 && self.n_embd > 0 && self.n_embd.is_multiple_of(self.n_head),
            "GptConfig: n_head ({}) must divide n_embd ({})",
            self.n_head,
            self.n_embd
        );
        assert!(
            self.vocab_size > 0 && self.block_size > 0,
            "GptConfig: empty vocabulary or block"
        );
        let c = self.n_embd;
        let embedding = |n: usize| {
            EmbeddingConfig::new(n, c)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        let dropout = || DropoutConfig::new(self.dropout).init();
        let block = || Block {
            ln_1: LayerNorm::new(c, device),
            attn: CausalSelfAttention {
                c_attn: LinearConfig::new(c, 3 * c).init(device),
                c_proj: LinearConfig::new(c, c).init(device),
                attn_dropout: dropout(),
                resid_dropout: dropout(),
                n_head: self.n_head,
            },
            ln_2: LayerNorm::new(c, device),
            mlp: Mlp {
                c_fc: LinearConfig::new(c, 4 * c).init(device),
                c_proj: LinearConfig::new(4 * c, c).init(device),
                dropout: dropout(),
            },
        };
        let model = Gpt {
            wte: embedding(self.vocab_size),
            wpe: embedding(self.block_size),
            drop: dropout(),
            h: (0..self.n_layer).map(|_| block()).collect(),
            ln_f: LayerNorm::new(c, device),
        };
        materialize(model)
    }

    /// The number of parameters of the model this config builds, from the sizes: the two
    /// embeddings `(V + T)·C`, per block two LayerNorms `4C`, `c_attn` `3C² + 3C`, the
    /// attention's `c_proj` `C² + C`, the MLP `4C² + 4C + 4C² + C`, so `12C² + 13C`; the final
    /// LayerNorm `2C`; the head is the token embedding and adds nothing.
    pub fn num_params(&self) -> usize {
        let c = self.n_embd;
        (self.vocab_size + self.block_size) * c + self.n_layer * (12 * c * c + 13 * c) + 2 * c
    }
}

impl LayerNorm {
    fn new(width: usize, device: &Device) -> LayerNorm {
        LayerNorm {
            weight: Initializer::Ones.init([width], device),
            bias: Initializer::Zeros.init([width], device),
        }
    }

    /// `(x − mean) / √(var + 1e-5) · weight + bias` over the last dimension (biased variance,
    /// as PyTorch's `nn.LayerNorm`).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let centered = x.clone() - x.mean_dim(2);
        let var = centered.clone().square().mean_dim(2);
        let normed = centered / var.add_scalar(1e-5).sqrt();
        normed * self.weight.val().unsqueeze::<3>() + self.bias.val().unsqueeze::<3>()
    }
}

impl CausalSelfAttention {
    /// `[batch, time, n_embd]` → the same shape. Position `t` attends to positions `0..=t`
    /// only: the scores of later positions get −∞ before the softmax, so a later token cannot
    /// change an earlier output.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, c] = x.dims();
        let (h, d) = (self.n_head, c / self.n_head);
        let qkv = self.c_attn.forward(x);
        // [batch, time, C] → [batch, head, time, head size].
        let heads = |i: usize| {
            qkv.clone()
                .narrow(2, i * c, c)
                .reshape([b, t, h, d])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (heads(0), heads(1), heads(2));
        // burn's `tril_mask(.., 0)` is true outside the lower triangle: at j > i, the future.
        let future: Tensor<2, Bool> = Tensor::tril_mask([t, t], 0, &q.device());
        let causal = Tensor::<2>::zeros([t, t], &q.device()).mask_fill(future, f32::NEG_INFINITY);
        let scores = q
            .matmul(k.swap_dims(2, 3))
            .mul_scalar(1.0 / (d as f64).sqrt())
            + causal.unsqueeze::<4>();
        let weights = self.attn_dropout.forward(softmax(scores, 3));
        let y = weights.matmul(v).swap_dims(1, 2).reshape([b, t, c]);
        self.resid_dropout.forward(self.c_proj.forward(y))
    }
}

impl Mlp {
    /// `[batch, time, n_embd]` → the same shape.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = gelu(self.c_fc.forward(x));
        self.dropout.forward(self.c_proj.forward(x))
    }
}

impl Block {
    /// `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x));
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

impl Gpt {
    /// Logits `[batch · time, vocab_size]` of the next token after each prefix of `tokens`
    /// (`[batch, time]`).
    ///
    /// # Panics
    ///
    /// If `time` exceeds the block size.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        let [b, t] = tokens.dims();
        let [block, c] = self.wpe.weight.dims();
        assert!(t <= block, "Gpt: {t} tokens exceed the block size {block}");
        let positions = Tensor::<1, Int>::arange(0..t as i64, &tokens.device()).unsqueeze::<2>();
        let mut x = self
            .drop
            .forward(self.wte.forward(tokens) + self.wpe.forward(positions));
        for block in &self.h {
            x = block.forward(x);
        }
        let x = self.ln_f.forward(x).reshape([b * t, c]);
        x.matmul(self.wte.weight.val().transpose())
    }

    /// Mean cross-entropy over every position (shape `[1]`) and the logits; `targets` are the
    /// next tokens, `[batch · time]` in the logits' row order.
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<1, Int>) -> (Tensor<1>, Tensor<2>) {
        let logits = self.forward(tokens);
        (cross_entropy(logits.clone(), targets), logits)
    }
}

/// The trainers' view: a batch of token windows `[batch, time]` as `f32` token ids (the
/// trainers' batches are float; ids below 2²⁴ are exact), each position one prediction of
/// the next token, so that the loss, the accuracy and the sample counts are per token.
impl Classifier<2> for Gpt {
    fn forward(&self, input: Tensor<2>) -> Tensor<2> {
        Gpt::forward(self, input.int())
    }

    fn output_loss(&self, output: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        cross_entropy(output, targets)
    }

    fn correct(&self, output: &Tensor<2>, targets: &Tensor<1, Int>) -> usize {
        correct_argmax(output, targets)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    fn tiny() -> GptConfig {
        GptConfig::new(11)
            .with_block_size(8)
            .with_n_layer(2)
            .with_n_head(2)
            .with_n_embd(8)
    }

    fn logits(model: &Gpt, tokens: &[i64], device: &Device) -> Vec<f32> {
        let t = tokens.len();
        let input = Tensor::<2, Int>::from_data(TensorData::new(tokens.to_vec(), [1, t]), device);
        let out = model.forward(input);
        assert_eq!(out.dims(), [t, 11]);
        out.into_data().try_to_vec::<f32>().unwrap()
    }

    /// Changing the token at position 5 leaves the logits of positions 0..5 bit-identical and
    /// changes those of 5 and later.
    #[test]
    fn a_later_token_does_not_change_earlier_logits() {
        let device = Device::flex();
        device.seed(3);
        let model = tiny().init(&device);
        let a = logits(&model, &[1, 2, 3, 4, 5, 6, 7, 8], &device);
        let b = logits(&model, &[1, 2, 3, 4, 5, 9, 7, 8], &device);
        assert_eq!(a[..5 * 11], b[..5 * 11]);
        for t in 5..8 {
            assert_ne!(
                a[t * 11..(t + 1) * 11],
                b[t * 11..(t + 1) * 11],
                "position {t}"
            );
        }
        // Batch rows are independent and laid out row after row.
        let two = Tensor::<2, Int>::from_data(
            TensorData::new(vec![1i64, 2, 3, 4, 1, 2, 3, 9], [2, 4]),
            &device,
        );
        let out = model.forward(two);
        assert_eq!(out.dims(), [8, 11]);
        let out = out.into_data().try_to_vec::<f32>().unwrap();
        let close = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-5);
        assert!(close(&out[..4 * 11], &a[..4 * 11]));
        assert!(close(&out[4 * 11..7 * 11], &a[..3 * 11]));
    }

    /// The head is the token embedding: one parameter, and the logits are the final hidden
    /// states times its transpose (changing the embedding changes the head).
    #[test]
    fn the_output_head_is_the_token_embedding() {
        let device = Device::flex();
        device.seed(4);
        let config = tiny();
        let model = config.init(&device);
        let specs = crate::param_specs(&model);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names.iter().filter(|n| n.starts_with("wte")).count(), 1);
        assert!(!names.iter().any(|n| n.contains("head")), "{names:?}");
        assert_eq!(names[0], "wte.weight");
        assert!(names.contains(&"h.1.attn.c_attn.weight"));
        assert!(names.contains(&"ln_f.bias"));
        // An independent count: the numbers of elements of every parameter, summed.
        let counted: usize = specs.iter().map(|s| s.numel()).sum();
        assert_eq!(counted, config.num_params());
        assert_eq!(counted, model.num_params());
        let defaults = GptConfig::new(90);
        assert_eq!(defaults.num_params(), 10_745_856 + 384 * 90);
        // Tying: the logits are ln_f(h) · wteᵀ, so with the token embedding zeroed every logit
        // is 0 (a separate head would still give ln_f's bias times its weights).
        let zeroed = Gpt {
            wte: Embedding {
                weight: Param::from_tensor(Tensor::zeros([11, 8], &device)),
            },
            ..model
        };
        let out = logits(&zeroed, &[1, 2, 3], &device);
        assert!(out.iter().all(|v| *v == 0.0), "{out:?}");
    }
}
