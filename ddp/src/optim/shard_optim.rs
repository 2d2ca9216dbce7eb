//! The optimizer math of sharded training ([`crate::ShardedDataParallel`]): Adam, AdamW and SGD
//! (with momentum, Nesterov and weight decay) on flat `f32` slices, element for element the
//! arithmetic of burn 0.22's `Adam`, `AdamW` and `Sgd` (burn-optim `adam.rs`, `adamw.rs`,
//! `sgd.rs`, `momentum.rs`, `decay.rs`),
//! in the same order of operations and with the same `f32` roundings, so that a sharded run
//! takes the same steps as a DDP run with burn's optimizer.
//!
//! burn keeps an optimizer state per parameter and skips a parameter that got no gradient
//! (its state, Adam's step count included, stays as it was). The sharded optimizer keeps the
//! same: a step count per parameter (on every rank: one integer each), and moments for the
//! elements of this rank's shard only. [`ShardOptimizer::update`] updates one contiguous piece
//! of one parameter: the caller cuts the shard at parameter boundaries.

use burn::config::Config;

/// Adam's settings, with burn's `AdamConfig` defaults (which differ from PyTorch's in
/// `epsilon`: 1e-5 against 1e-8). Weight decay is burn's (and PyTorch Adam's) L2 penalty added
/// to the gradient, not AdamW's decoupled decay.
#[derive(Config, Debug, PartialEq)]
pub struct ShardedAdamConfig {
    /// Decay of the first moment.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Decay of the second moment.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to the square root of the second moment.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// L2 penalty: `grad += penalty * param` before the moments.
    #[config(default = "None")]
    pub weight_decay: Option<f32>,
}

/// AdamW's settings (decoupled weight decay, Loshchilov & Hutter), with PyTorch's
/// `torch.optim.AdamW` defaults: β 0.9 and 0.999, ε 1e-8, weight decay 0.01 (burn's
/// `AdamWConfig` defaults differ: ε 1e-5, weight decay 1e-4). The step is burn's `AdamW`
/// with the same settings, bit for bit: the parameter is first multiplied by
/// `1 - lr * weight_decay`, then moved by Adam's bias-corrected step. burn's `amsgrad` and
/// `cautious_weight_decay` variants are not offered.
#[derive(Config, Debug, PartialEq)]
pub struct ShardedAdamWConfig {
    /// Decay of the first moment.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// Decay of the second moment.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to the square root of the bias-corrected second moment.
    #[config(default = 1e-8)]
    pub epsilon: f32,
    /// Decoupled decay: each step multiplies the parameter by `1 - lr * weight_decay`.
    #[config(default = 0.01)]
    pub weight_decay: f32,
}

/// SGD's settings, with burn's `SgdConfig` and `MomentumConfig` defaults (burn's default
/// dampening is 0.1, PyTorch's 0).
#[derive(Config, Debug, PartialEq)]
pub struct ShardedSgdConfig {
    /// Momentum factor; `None`: plain SGD.
    #[config(default = "None")]
    pub momentum: Option<f64>,
    /// Dampening of the gradient in the velocity (used with momentum).
    #[config(default = 0.1)]
    pub dampening: f64,
    /// Nesterov momentum.
    #[config(default = false)]
    pub nesterov: bool,
    /// L2 penalty: `grad += penalty * param`.
    #[config(default = "None")]
    pub weight_decay: Option<f32>,
}

/// Which optimizer a sharded run steps its shard with.
#[derive(Debug, Clone, PartialEq)]
pub enum ShardOptimizer {
    /// burn's `Adam` (two moments per element: 8 bytes of state per parameter element).
    Adam(ShardedAdamConfig),
    /// burn's `AdamW` (decoupled weight decay; two moments per element, as Adam).
    AdamW(ShardedAdamWConfig),
    /// burn's `Sgd` (a velocity per element with momentum, no state without).
    Sgd(ShardedSgdConfig),
}

impl ShardOptimizer {
    /// The optimizer's name in checkpoints and messages.
    pub fn name(&self) -> &'static str {
        match self {
            ShardOptimizer::Adam(_) => "adam",
            ShardOptimizer::AdamW(_) => "adamw",
            ShardOptimizer::Sgd(_) => "sgd",
        }
    }

    /// How many `f32` state vectors of the shard's length the optimizer keeps: Adam's two
    /// moments, SGD's velocity with momentum, none for plain SGD.
    pub fn state_vectors(&self) -> usize {
        match self {
            ShardOptimizer::Adam(_) | ShardOptimizer::AdamW(_) => 2,
            ShardOptimizer::Sgd(c) if c.momentum.is_some() => 1,
            ShardOptimizer::Sgd(_) => 0,
        }
    }

    /// One step for one piece of one parameter: `param`, its averaged gradient `grad`, and the
    /// piece's slices of the state vectors (`state[k]` is vector k). `time` is the parameter's
    /// step count *before* this step (0 for its first); the caller increments it afterwards.
    /// `param` is overwritten with the new values.
    ///
    /// The arithmetic mirrors burn's tensor operations one by one (each a separate `f32`
    /// rounding, no fused multiply-add): see the module documentation.
    pub(crate) fn update(
        &self,
        lr: f64,
        time: u64,
        param: &mut [f32],
        grad: &[f32],
        state: &mut [&mut [f32]],
    ) {
        // burn's `mul_scalar(lr)` on an f32 tensor multiplies by the scalar cast to f32.
        let lr_f64 = lr;
        let lr = lr as f32;
        match self {
            ShardOptimizer::Adam(c) => {
                let [m, v] = state else {
                    unreachable!("Adam keeps two state vectors")
                };
                let t = (time + 1) as i32;
                let bias_correction2_sqrt = (1.0 - c.beta_2.powi(t)).sqrt();
                let k = AdamConstants {
                    beta_1: c.beta_1,
                    beta_2: c.beta_2,
                    factor_1: 1.0 - c.beta_1,
                    factor_2: 1.0 - c.beta_2,
                    combined_factor: bias_correction2_sqrt / (1.0 - c.beta_1.powi(t)),
                    eps: c.epsilon * bias_correction2_sqrt,
                    lr,
                    penalty: c.weight_decay.unwrap_or(0.0),
                };
                // The branches are decided once per piece, so that the loop vectorizes.
                match (c.weight_decay.is_some(), time == 0) {
                    (false, true) => adam::<false, true>(&k, param, grad, m, v),
                    (false, false) => adam::<false, false>(&k, param, grad, m, v),
                    (true, true) => adam::<true, true>(&k, param, grad, m, v),
                    (true, false) => adam::<true, false>(&k, param, grad, m, v),
                }
            }
            ShardOptimizer::AdamW(c) => {
                let [m, v] = state else {
                    unreachable!("AdamW keeps two state vectors")
                };
                let t = (time + 1) as i32;
                // burn: `mul_scalar(1.0 - lr * weight_decay)` with the factor computed in f64,
                // skipped when the decay rate is 0.
                let decay_rate = lr_f64 * c.weight_decay as f64;
                let k = AdamWConstants {
                    beta_1: c.beta_1,
                    beta_2: c.beta_2,
                    factor_1: 1.0 - c.beta_1,
                    factor_2: 1.0 - c.beta_2,
                    correction_1: 1.0 - c.beta_1.powi(t),
                    correction_2: 1.0 - c.beta_2.powi(t),
                    eps: c.epsilon,
                    lr,
                    keep: (1.0 - decay_rate) as f32,
                };
                match (decay_rate != 0.0, time == 0) {
                    (false, true) => adamw::<false, true>(&k, param, grad, m, v),
                    (false, false) => adamw::<false, false>(&k, param, grad, m, v),
                    (true, true) => adamw::<true, true>(&k, param, grad, m, v),
                    (true, false) => adamw::<true, false>(&k, param, grad, m, v),
                }
            }
            ShardOptimizer::Sgd(c) => {
                let momentum = c.momentum.map(|m| m as f32);
                // `1.0 - dampening` is computed in f64 by burn, then cast by `mul_scalar`.
                let keep = (1.0 - c.dampening) as f32;
                for i in 0..param.len() {
                    let p = param[i];
                    let mut g = match c.weight_decay {
                        Some(penalty) => p * penalty + grad[i],
                        None => grad[i],
                    };
                    if let (Some(mu), [velocity]) = (momentum, &mut *state) {
                        let vel = if time == 0 {
                            g
                        } else {
                            g * keep + velocity[i] * mu
                        };
                        velocity[i] = vel;
                        g = if c.nesterov { vel * mu + g } else { vel };
                    }
                    param[i] = p - g * lr;
                }
            }
        }
    }
}

/// Adam's per-step constants, computed as burn computes them.
struct AdamConstants {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    combined_factor: f32,
    eps: f32,
    lr: f32,
    penalty: f32,
}

/// burn's Adam over one piece: `DECAY` adds the L2 penalty to the gradient, `FIRST` is the
/// parameter's first step (moments start from the gradient alone).
fn adam<const DECAY: bool, const FIRST: bool>(
    k: &AdamConstants,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = param.len();
    let (grad, m, v) = (&grad[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let p = param[i];
        let g = if DECAY {
            p * k.penalty + grad[i]
        } else {
            grad[i]
        };
        let (m1, m2) = if FIRST {
            (g * k.factor_1, (g * g) * k.factor_2)
        } else {
            (
                m[i] * k.beta_1 + g * k.factor_1,
                v[i] * k.beta_2 + (g * g) * k.factor_2,
            )
        };
        m[i] = m1;
        v[i] = m2;
        let step = (m1 * k.combined_factor) / (m2.sqrt() + k.eps);
        param[i] = p - step * k.lr;
    }
}

/// AdamW's per-step constants, computed as burn's `AdamW` computes them.
struct AdamWConstants {
    beta_1: f32,
    beta_2: f32,
    factor_1: f32,
    factor_2: f32,
    /// `1 - beta_1^t`, the first moment's bias correction (divided by).
    correction_1: f32,
    /// `1 - beta_2^t`.
    correction_2: f32,
    eps: f32,
    lr: f32,
    /// `1 - lr * weight_decay`, what the parameter is multiplied by before the step.
    keep: f32,
}

/// burn's AdamW over one piece: the moments as Adam's, each corrected by its own division,
/// the step `m̂ / (√v̂ + ε)`; the parameter decayed (`DECAY`) by the multiplication burn does,
/// then moved by `lr` times the step. `FIRST` is the parameter's first step.
fn adamw<const DECAY: bool, const FIRST: bool>(
    k: &AdamWConstants,
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = param.len();
    let (grad, m, v) = (&grad[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let g = grad[i];
        let (m1, m2) = if FIRST {
            (g * k.factor_1, (g * g) * k.factor_2)
        } else {
            (
                m[i] * k.beta_1 + g * k.factor_1,
                v[i] * k.beta_2 + (g * g) * k.factor_2,
            )
        };
        m[i] = m1;
        v[i] = m2;
        let step = (m1 / k.correction_1) / ((m2 / k.correction_2).sqrt() + k.eps);
        let decayed = if DECAY { param[i] * k.keep } else { param[i] };
        param[i] = decayed - step * k.lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adam's first two steps on one element, computed by hand in f64 (the textbook formulas,
    /// not this code's f32 sequence): the results agree to f32 precision.
    #[test]
    fn adam_matches_the_textbook_formulas() {
        let opt = ShardOptimizer::Adam(ShardedAdamConfig::new());
        let (b1, b2, eps, lr) = (0.9f64, 0.999f64, 1e-5f64, 0.01f64);
        let mut p = [1.0f32];
        let (mut m, mut v) = ([0.0f32], [0.0f32]);
        let grads = [0.5f64, -0.25];
        let (mut pe, mut me, mut ve) = (1.0f64, 0.0f64, 0.0f64);
        for (t, &g) in grads.iter().enumerate() {
            opt.update(lr, t as u64, &mut p, &[g as f32], &mut [&mut m, &mut v]);
            me = b1 * me + (1.0 - b1) * g;
            ve = b2 * ve + (1.0 - b2) * g * g;
            let n = (t + 1) as i32;
            let (mh, vh) = (me / (1.0 - b1.powi(n)), ve / (1.0 - b2.powi(n)));
            pe -= lr * mh / (vh.sqrt() + eps);
            assert!(
                (p[0] as f64 - pe).abs() < 1e-6,
                "step {t}: {} vs {pe}",
                p[0]
            );
        }
    }

    /// AdamW's first three steps on two elements, against PyTorch's documented update rule
    /// written out in f64 (decay first, then the bias-corrected Adam step).
    #[test]
    fn adamw_matches_the_update_rule() {
        let opt = ShardOptimizer::AdamW(ShardedAdamWConfig::new().with_weight_decay(0.1));
        let (b1, b2, eps, wd, lr) = (0.9f64, 0.999f64, 1e-8f64, 0.1f64, 0.01f64);
        let mut p = [1.0f32, -2.0];
        let (mut m, mut v) = ([0.0f32; 2], [0.0f32; 2]);
        let mut pe = [1.0f64, -2.0];
        let (mut me, mut ve) = ([0.0f64; 2], [0.0f64; 2]);
        for (t, g) in [[0.5f64, 0.0], [-0.25, 3.0], [1.0, -1.0]]
            .iter()
            .enumerate()
        {
            let g32 = [g[0] as f32, g[1] as f32];
            opt.update(lr, t as u64, &mut p, &g32, &mut [&mut m, &mut v]);
            let n = (t + 1) as i32;
            for i in 0..2 {
                pe[i] *= 1.0 - lr * wd;
                me[i] = b1 * me[i] + (1.0 - b1) * g[i];
                ve[i] = b2 * ve[i] + (1.0 - b2) * g[i] * g[i];
                let (mh, vh) = (me[i] / (1.0 - b1.powi(n)), ve[i] / (1.0 - b2.powi(n)));
                pe[i] -= lr * mh / (vh.sqrt() + eps);
                assert!(
                    (p[i] as f64 - pe[i]).abs() < 1e-6,
                    "step {t}, element {i}: {} vs {}",
                    p[i],
                    pe[i]
                );
            }
        }
        // The decay is decoupled: a zero gradient still shrinks the weight (element 1, step
        // 0 moved only by the decay: -2 * (1 - 0.001)).
        assert_eq!(opt.state_vectors(), 2);
        assert_eq!(opt.name(), "adamw");
    }

    /// SGD with Nesterov momentum, dampening and weight decay, against PyTorch's documented
    /// update rule written out in f64.
    #[test]
    fn sgd_with_momentum_matches_the_update_rule() {
        let config = ShardedSgdConfig::new()
            .with_momentum(Some(0.9))
            .with_dampening(0.1)
            .with_nesterov(true)
            .with_weight_decay(Some(0.01));
        let opt = ShardOptimizer::Sgd(config);
        let mut p = [2.0f32];
        let mut vel = [0.0f32];
        let (mut pe, mut ve) = (2.0f64, 0.0f64);
        for (t, g) in [1.0f64, 0.5, -2.0].into_iter().enumerate() {
            opt.update(0.1, t as u64, &mut p, &[g as f32], &mut [&mut vel]);
            let d = g + 0.01 * pe;
            ve = if t == 0 { d } else { 0.9 * ve + 0.9 * d };
            let step = 0.9 * ve + d;
            pe -= 0.1 * step;
            assert!(
                (p[0] as f64 - pe).abs() < 1e-5,
                "step {t}: {} vs {pe}",
                p[0]
            );
        }
        assert_eq!(opt.state_vectors(), 1);
        assert_eq!(
            ShardOptimizer::Sgd(ShardedSgdConfig::new()).state_vectors(),
            0
        );
    }
}
