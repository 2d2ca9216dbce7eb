//! Times training steps (forward, backward, Adam) of the models on burn's CPU backend.
//!
//! ```text
//! cargo run --release -p ddp-models --example step_time [steps]
//! ```
//!
//! Besides the step itself it times what a data-parallel wrapper adds around it on one rank:
//! taking every gradient out as flat `f32` and putting it back. Each line ends with a
//! fingerprint of the trained parameters: run the example twice to check that the same seed
//! gives bit-identical training in separate processes.

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp_models::{Classifier, MnistCnnConfig, MnistMlpConfig, PimaMlpConfig};

/// The device of the timed steps: burn's CPU backend, recording gradients.
fn device() -> Device {
    Device::flex().autodiff()
}

/// The trainers' global allocator (see apps/Cargo.toml), so that the times are theirs.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Per-phase times of one step.
#[derive(Default, Clone, Copy)]
struct Phases {
    forward: Duration,
    backward: Duration,
    flatten: Duration,
    optim: Duration,
}

/// Takes every gradient out as `Vec<f32>` and registers it again, as a DDP wrapper would
/// around its all-reduce.
fn flat_round_trip<M: Module>(model: &M, grads: GradientsParams) -> GradientsParams {
    struct RoundTrip {
        grads: GradientsParams,
    }
    impl ModuleVisitor for RoundTrip {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let shape = g.dims();
                let device = g.device();
                let flat = g.into_data().try_into_vec::<f32>().unwrap();
                let back = Tensor::<D>::from_data(TensorData::new(flat, shape), &device);
                self.grads.register::<D>(param.id, back);
            }
        }
    }
    let mut visitor = RoundTrip { grads };
    model.visit(&mut visitor);
    visitor.grads
}

fn time_steps<M, const D: usize>(
    name: &str,
    mut model: M,
    input: Tensor<D>,
    targets: Tensor<1, Int>,
    steps: usize,
) where
    M: Module + Classifier<D>,
{
    let mut optim = AdamConfig::new().init();
    let mut samples = Vec::new();
    for step in 0..steps + 2 {
        let t0 = Instant::now();
        let (loss, _) = model.loss(input.clone(), targets.clone());
        let _ = loss.clone().into_scalar::<f32>();
        let t1 = Instant::now();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let t2 = Instant::now();
        let grads = flat_round_trip(&model, grads);
        let t3 = Instant::now();
        model = optim.step(1e-3, model, grads);
        let t4 = Instant::now();
        if step >= 2 {
            samples.push(Phases {
                forward: t1 - t0,
                backward: t2 - t1,
                flatten: t3 - t2,
                optim: t4 - t3,
            });
        }
    }
    let median = |f: fn(&Phases) -> Duration| {
        let mut v: Vec<Duration> = samples.iter().map(f).collect();
        v.sort();
        v[v.len() / 2].as_secs_f64() * 1e3
    };
    let total = {
        let mut v: Vec<Duration> = samples
            .iter()
            .map(|p| p.forward + p.backward + p.flatten + p.optim)
            .collect();
        v.sort();
        (v[v.len() / 2].as_secs_f64() * 1e3, v[0].as_secs_f64() * 1e3)
    };
    println!(
        "{name:<12} step {:>7.2} (min {:>7.2})  forward {:>7.2}  backward {:>7.2}  grads->Vec->grads {:>5.2}  adam {:>5.2}  params fnv {:016x}",
        total.0,
        total.1,
        median(|p| p.forward),
        median(|p| p.backward),
        median(|p| p.flatten),
        median(|p| p.optim),
        fingerprint(&model),
    );
}

/// FNV-1a over the little-endian bytes of every parameter: equal across processes exactly when
/// the parameters are bit-identical.
fn fingerprint<M: Module>(model: &M) -> u64 {
    ddp_comm::bytes::fnv1a(&ddp_models::safetensors_bytes(model).unwrap())
}

fn images(n: usize, device: &Device) -> (Tensor<4>, Tensor<1, Int>) {
    let pixels: Vec<f32> = (0..n * 784)
        .map(|i| ((i * 31 % 97) as f32 / 97.0) - 0.5)
        .collect();
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 10).collect();
    (
        Tensor::from_data(TensorData::new(pixels, [n, 1, 28, 28]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

fn main() {
    let steps: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let device = device();
    device.seed(0);
    println!("median of {steps} steps after 2 warm-up steps; times in ms");
    for batch in [64, 32] {
        let (x, y) = images(batch, &device);
        let cnn = MnistCnnConfig::new().init(&device);
        time_steps(&format!("cnn b={batch}"), cnn, x.clone(), y.clone(), steps);
        let mlp = MnistMlpConfig::new().init(&device);
        time_steps(&format!("mlp b={batch}"), mlp, x, y, steps);
    }
    let rows: Vec<f32> = (0..32 * 8)
        .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
        .collect();
    let labels: Vec<i64> = (0..32).map(|i| i % 2).collect();
    let pima = PimaMlpConfig::new().init(&device);
    time_steps(
        "pima b=32",
        pima,
        Tensor::from_data(TensorData::new(rows, [32, 8]), &device),
        Tensor::from_data(TensorData::new(labels, [32]), &device),
        steps,
    );
}
