//! [`FusedAdam`] and [`FusedAdamW`]: burn's Adam and AdamW, computed in one pass over each
//! parameter's memory on burn's CPU backend.
//!
//! burn's `Adam` steps a parameter with about a dozen tensor operations (scale the moments,
//! add, square, root, divide, subtract), each of which reads and writes the whole tensor and
//! allocates its result: on the 50.9 M-parameter MLP that is 0.34 s of a 0.52 s DDP step on
//! one core. The arithmetic per element is the same few multiplications wherever it is done,
//! so this optimizer takes the parameter, its gradient and both moments out of burn without a
//! copy (a tensor's bytes, `HostBuf`), runs the element loop of the sharded optimizer
//! ([`ShardOptimizer::Adam`], the same `f32` operations in burn's order, no fused
//! multiply-add) once over them, and gives the memory back to burn as the new tensors. The
//! results are bit-identical to burn's Adam, and so is the state: it is burn's own
//! `AdamState`, so the optimizer's record (checkpoints, the elastic heal) is burn's record
//! byte for byte, and either optimizer loads the other's.
//!
//! Off burn's CPU backend (a GPU tensor would have to cross to the host) or for other element
//! types it hands the step to burn's `Adam` built from the same settings.

use burn::backend::DispatchDevice;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::{
    Adam, AdamConfig, AdamState, AdamW, AdamWConfig, AdamWState, AdaptiveMomentumState,
    LearningRate, ModuleOptimizer, Optimizer,
};
use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::gradients::host_buf::HostBuf;
use crate::optim::shard_optim::{ShardOptimizer, ShardedAdamConfig, ShardedAdamWConfig};

/// burn's Adam in one pass over memory on the CPU (see the module documentation): a drop-in
/// for `AdamConfig::init()` with the same steps, bit for bit, and the same record.
///
/// ```
/// use burn::optim::ModuleOptimizer;
/// use ddp::{FusedAdam, ShardedAdamConfig};
///
/// let optim: ModuleOptimizer = FusedAdam::new(&ShardedAdamConfig::new().with_epsilon(1e-8)).into();
/// # let _ = optim;
/// ```
#[derive(Clone)]
pub struct FusedAdam {
    /// The element loop.
    math: ShardOptimizer,
    /// burn's Adam with the same settings, for tensors off the CPU backend.
    burn: Adam,
}

impl FusedAdam {
    /// Adam with `config`'s settings (burn's defaults: β 0.9 and 0.999, ε 1e-5).
    pub fn new(config: &ShardedAdamConfig) -> FusedAdam {
        let burn = AdamConfig::new()
            .with_beta_1(config.beta_1)
            .with_beta_2(config.beta_2)
            .with_epsilon(config.epsilon)
            .with_weight_decay(config.weight_decay.map(WeightDecayConfig::new))
            .build();
        FusedAdam {
            math: ShardOptimizer::Adam(config.clone()),
            burn,
        }
    }

    /// The optimizer for a whole module (burn's `ModuleOptimizer`, as `AdamConfig::init`
    /// returns it).
    pub fn init(config: &ShardedAdamConfig) -> ModuleOptimizer {
        ModuleOptimizer::from(FusedAdam::new(config))
    }
}

/// Whether `tensor` lives in host memory that `HostBuf` can take over: burn's CPU backend and
/// `f32`.
fn on_host<const D: usize>(tensor: &Tensor<D>) -> bool {
    tensor.dtype() == DType::F32
        && matches!(
            tensor.device().inner().as_dispatch(),
            DispatchDevice::Flex(_)
        )
}

/// `data`'s `n` values, burn's memory taken over when it holds them alone.
fn values(data: TensorData, n: usize) -> HostBuf {
    // Only called on f32 tensors of `n` elements (checked by the caller), for which
    // `HostBuf::from_data` cannot fail.
    HostBuf::from_data(data, "Adam", "values", n).expect("an f32 tensor of n elements")
}

/// What [`fused_step`] hands back when it cannot take a step: the inputs, untouched, for
/// burn's own optimizer.
type NotFused<const D: usize> = (Tensor<D>, Tensor<D>, Option<AdaptiveMomentumState<D>>);

/// One step of `math` (Adam or AdamW) over `tensor`'s memory, with `momentum` as burn keeps
/// it: the new parameter and moments, or the inputs back where the tensors are not `f32` on
/// burn's CPU backend (or AMSGrad's third moment is there), for burn's optimizer to step.
fn fused_step<const D: usize>(
    math: &ShardOptimizer,
    lr: LearningRate,
    tensor: Tensor<D>,
    grad: Tensor<D>,
    momentum: Option<AdaptiveMomentumState<D>>,
) -> Result<(Tensor<D>, AdaptiveMomentumState<D>), Box<NotFused<D>>> {
    let dims = tensor.dims();
    let fused = on_host(&tensor)
        && on_host(&grad)
        && grad.dims() == dims
        && momentum.as_ref().is_none_or(|m| {
            m.max_moment_2.is_none()
                && on_host(&m.moment_1)
                && on_host(&m.moment_2)
                && m.moment_1.dims() == dims
                && m.moment_2.dims() == dims
        });
    if !fused {
        return Err(Box::new((tensor, grad, momentum)));
    }
    let n = dims.iter().product();
    let device: Device = tensor.device();
    let mut param = values(tensor.into_data(), n);
    let grad = values(grad.into_data(), n);
    let (time, mut m, mut v) = match momentum {
        Some(s) => (
            s.time,
            values(s.moment_1.into_data(), n),
            values(s.moment_2.into_data(), n),
        ),
        None => (0, HostBuf::zeros(n), HostBuf::zeros(n)),
    };
    math.update(
        lr,
        time as u64,
        param.as_mut(),
        grad.as_ref(),
        &mut [m.as_mut(), v.as_mut()],
    );
    let tensor = |b: HostBuf| Tensor::<D>::from_data(b.into_data(dims.to_vec()), &device);
    let momentum = AdaptiveMomentumState::new(time + 1, tensor(m), tensor(v));
    Ok((tensor(param), momentum))
}

impl Optimizer for FusedAdam {
    type State<const D: usize> = AdamState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamState<D>>,
    ) -> (Tensor<D>, Option<AdamState<D>>) {
        match fused_step(&self.math, lr, tensor, grad, state.map(|s| s.momentum)) {
            Ok((tensor, momentum)) => (tensor, Some(AdamState::new(momentum))),
            Err(inputs) => {
                let (tensor, grad, momentum) = *inputs;
                self.burn
                    .step(lr, tensor, grad, momentum.map(AdamState::new))
            }
        }
    }

    fn to_device<const D: usize>(mut state: AdamState<D>, device: &Device) -> AdamState<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

/// burn's AdamW (decoupled weight decay) in one pass over memory on the CPU, as [`FusedAdam`]
/// is burn's Adam: a drop-in for `AdamWConfig::init()` with the same settings, the same steps
/// bit for bit and burn's own `AdamWState` as its record.
///
/// ```
/// use burn::optim::ModuleOptimizer;
/// use ddp::{FusedAdamW, ShardedAdamWConfig};
///
/// // PyTorch's AdamW defaults: β 0.9/0.999, ε 1e-8, weight decay 0.01.
/// let optim: ModuleOptimizer = FusedAdamW::init(&ShardedAdamWConfig::new());
/// # let _ = optim;
/// ```
#[derive(Clone)]
pub struct FusedAdamW {
    /// The element loop.
    math: ShardOptimizer,
    /// burn's AdamW with the same settings, for tensors off the CPU backend.
    burn: AdamW,
}

impl FusedAdamW {
    /// AdamW with `config`'s settings.
    pub fn new(config: &ShardedAdamWConfig) -> FusedAdamW {
        let burn = AdamWConfig::new()
            .with_beta_1(config.beta_1)
            .with_beta_2(config.beta_2)
            .with_epsilon(config.epsilon)
            .with_weight_decay(config.weight_decay)
            .build();
        FusedAdamW {
            math: ShardOptimizer::AdamW(config.clone()),
            burn,
        }
    }

    /// The optimizer for a whole module (burn's `ModuleOptimizer`, as `AdamWConfig::init`
    /// returns it).
    pub fn init(config: &ShardedAdamWConfig) -> ModuleOptimizer {
        ModuleOptimizer::from(FusedAdamW::new(config))
    }
}

impl Optimizer for FusedAdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, Option<AdamWState<D>>) {
        match fused_step(&self.math, lr, tensor, grad, state.map(|s| s.momentum)) {
            Ok((tensor, momentum)) => (tensor, Some(AdamWState::new(momentum))),
            Err(inputs) => {
                let (tensor, grad, momentum) = *inputs;
                self.burn
                    .step(lr, tensor, grad, momentum.map(AdamWState::new))
            }
        }
    }

    fn to_device<const D: usize>(mut state: AdamWState<D>, device: &Device) -> AdamWState<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{GradientsParams, ModuleOptimizer};

    use super::*;

    /// Every parameter's bits.
    fn bits(model: &Linear) -> Vec<u32> {
        let mut values = model.weight.val().into_data().try_to_vec::<f32>().unwrap();
        if let Some(b) = &model.bias {
            values.extend(b.val().into_data().try_to_vec::<f32>().unwrap());
        }
        values.into_iter().map(f32::to_bits).collect()
    }

    /// One step of `optim` on `model` with the loss of a batch drawn from `seed`.
    fn step(model: Linear, optim: &mut ModuleOptimizer, seed: u64) -> Linear {
        let device = Device::flex().autodiff();
        let x: Vec<f32> = (0..8 * 40u64)
            .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0 - 2.0)
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [8, 40]), &device);
        let loss = model.forward(x).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        optim.step(1e-2, model, grads)
    }

    /// Six steps of `FusedAdam` and of burn's `AdamConfig::init()` with the same settings,
    /// from the same weights and batches, give the same bits (with and without weight decay);
    /// and a record saved by burn's Adam after three steps, loaded into `FusedAdam`, goes on
    /// to the same bits as burn's six steps (and the other way round).
    #[test]
    fn fused_adam_steps_and_records_are_burns_bit_for_bit() {
        let device = Device::flex().autodiff();
        for decay in [None, Some(0.05)] {
            let config = ShardedAdamConfig::new()
                .with_epsilon(1e-8)
                .with_weight_decay(decay);
            let burn_optim = || {
                AdamConfig::new()
                    .with_epsilon(1e-8)
                    .with_weight_decay(decay.map(WeightDecayConfig::new))
                    .init()
            };
            let start = LinearConfig::new(40, 30).init(&device);
            assert!(
                on_host(&start.weight.val().inner()),
                "the test takes the fused path"
            );
            let (mut a, mut b) = (start.clone(), start.clone());
            let (mut oa, mut ob) = (burn_optim(), FusedAdam::init(&config));
            for s in 0..6 {
                a = step(a, &mut oa, s);
                b = step(b, &mut ob, s);
                assert_eq!(bits(&a), bits(&b), "step {s}, decay {decay:?}");
            }
            assert_ne!(bits(&a), bits(&start), "the steps moved the weights");
            for (first, second) in [(true, false), (false, true)] {
                let make = |fused: bool| {
                    if fused {
                        FusedAdam::init(&config)
                    } else {
                        burn_optim()
                    }
                };
                let (mut model, mut optim) = (start.clone(), make(first));
                for s in 0..3 {
                    model = step(model, &mut optim, s);
                }
                let mut optim = make(second).load_record(optim.to_record());
                for s in 3..6 {
                    model = step(model, &mut optim, s);
                }
                assert_eq!(bits(&model), bits(&a), "resumed, decay {decay:?}");
            }
        }
    }

    /// Six steps of `FusedAdamW` and of burn's `AdamWConfig::init()` with the same settings
    /// give the same bits (with decay, and without: rate 0 skips burn's multiplication), and
    /// burn's AdamW record resumes in `FusedAdamW` to the same bits.
    #[test]
    fn fused_adamw_steps_and_records_are_burns_bit_for_bit() {
        use burn::optim::AdamWConfig;
        let device = Device::flex().autodiff();
        for decay in [0.0f32, 0.01, 0.3] {
            let config = ShardedAdamWConfig::new().with_weight_decay(decay);
            let burn_optim = || {
                AdamWConfig::new()
                    .with_epsilon(1e-8)
                    .with_weight_decay(decay)
                    .init()
            };
            let start = LinearConfig::new(40, 30).init(&device);
            let (mut a, mut b) = (start.clone(), start.clone());
            let (mut oa, mut ob) = (burn_optim(), FusedAdamW::init(&config));
            for s in 0..6 {
                a = step(a, &mut oa, s);
                b = step(b, &mut ob, s);
                assert_eq!(bits(&a), bits(&b), "step {s}, decay {decay}");
            }
            assert_ne!(bits(&a), bits(&start), "the steps moved the weights");
            let (mut model, mut optim) = (start.clone(), burn_optim());
            for s in 0..3 {
                model = step(model, &mut optim, s);
            }
            let mut optim = FusedAdamW::init(&config).load_record(optim.to_record());
            for s in 3..6 {
                model = step(model, &mut optim, s);
            }
            assert_eq!(bits(&model), bits(&a), "resumed, decay {decay}");
        }
    }
}
