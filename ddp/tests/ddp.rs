//! The observable contract of `DistributedDataParallel`, on the CPU backend, with one thread per
//! rank, each holding its own process group over loopback sockets.
//!
//! - N ranks with per-rank batch b take the same steps as one process with batch N·b over the
//!   same samples (SGD and Adam, CNN and MLP), within 1e-5 relative;
//! - all replicas are bit-identical after every step; two runs with one seed are bit-identical;
//! - bucket size changes results by float tolerance only; no_sync accumulation sums micro-step
//!   gradients like PyTorch (checked against a reference computed here with plain burn);
//! - BatchNorm's running statistics are broadcast from rank 0, never averaged as gradients,
//!   and cause no false replica-check alarm;
//! - different models on two ranks fail at construction, naming the rank and the parameter;
//!   diverged replicas are named without blaming rank 0 on a tie; parameters replaced after
//!   wrapping and unreadable gradients are errors naming the parameter.
//!
//! Inputs and initial weights come from explicit values drawn from a seeded mixer, never from
//! the backend's global RNG: the tests run in parallel threads, and a global RNG seeded in one
//! thread would be consumed by another.

use std::sync::Arc;

use burn::module::Module;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Int, Tensor, TensorData};
use ddp::{
    flatten_params, load_flat_params, param_infos, Compression, DdpConfig, DdpError,
    DistributedDataParallel, ParamKind,
};
use ddp_comm::{ProcessGroup, Transport};
use ddp_data::sampler::splitmix64;
use ddp_models::{Classifier, MnistCnnConfig, MnistMlpConfig};

use crate::common;
use common::{device, run_ranks, run_ranks_over};

/// A uniform value in [-0.5, 0.5) for `(stream, i)`, from the seeded mixer.
fn uniform(stream: u64, i: u64) -> f32 {
    let h = splitmix64(stream.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ splitmix64(i));
    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// Deterministic initial values for every float tensor of `module`: weights uniform in
/// ±1/sqrt(fan_in) (burn's and PyTorch's scale), vectors small; drawn from stream `seed`.
/// Buffers get their own values too, so that a test sees whether they are overwritten.
fn seeded_values<M: Module>(module: &M, seed: u64) -> Vec<f32> {
    let mut out = Vec::new();
    for info in param_infos(module) {
        let fan_in: usize = match info.shape.len() {
            2 => info.shape[0],
            4 => info.shape[1..].iter().product(),
            _ => 100,
        };
        let scale = 2.0 / (fan_in as f32).sqrt();
        let base = out.len() as u64;
        out.extend((0..info.numel() as u64).map(|i| scale * uniform(seed, base + i)));
    }
    out
}

/// Deterministic synthetic MNIST-shaped samples: inputs `[n, 1, 28, 28]` and labels.
fn samples(start: usize, n: usize) -> (Vec<f32>, Vec<i64>) {
    let mut x = Vec::with_capacity(n * 784);
    let mut y = Vec::with_capacity(n);
    for i in start..start + n {
        let label = (i * 7 + 3) % 10;
        for p in 0..784 {
            let h = (i as u64 * 1_000_003 + p as u64 * 7919).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let noise = ((h >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            // A weak class signal in a band of pixels so that training makes progress.
            let signal = if p / 78 == label { 1.0 } else { 0.0 };
            x.push(signal + noise);
        }
        y.push(label as i64);
    }
    (x, y)
}

fn batch(start: usize, n: usize) -> (Tensor<4>, Tensor<1, Int>) {
    let device = device();
    let (x, y) = samples(start, n);
    (
        Tensor::from_data(TensorData::new(x, [n, 1, 28, 28]), &device),
        Tensor::from_data(TensorData::new(y, [n]), &device),
    )
}

#[derive(Clone, Copy, Debug)]
enum Net {
    Cnn,
    Mlp,
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    Adam,
}

/// How a run is set up.
#[derive(Clone, Copy, Debug)]
struct Run {
    net: Net,
    opt: Opt,
    world: usize,
    /// Samples per rank per optimizer step (split into `micro` micro-batches).
    batch: usize,
    steps: usize,
    micro: usize,
    bucket_cap_mb: f64,
    compression: Compression,
    /// How the ranks talk: shared memory (`Auto` on one host) or the TCP ring.
    transport: Transport,
}

impl Run {
    fn new(net: Net, opt: Opt, world: usize, batch: usize) -> Run {
        Run {
            net,
            opt,
            world,
            batch,
            steps: 20,
            micro: 1,
            bucket_cap_mb: 25.0,
            compression: Compression::None,
            transport: Transport::Auto,
        }
    }
}

/// The initial parameters every run starts from (rank 0's; other ranks start elsewhere and
/// must be overwritten by the broadcast).
fn initial(net: Net) -> Vec<f32> {
    let device = device();
    match net {
        Net::Cnn => seeded_values(&cnn(), 1),
        Net::Mlp => seeded_values(&MnistMlpConfig::new().init(&device), 1),
    }
}

/// The CNN without dropout (whose masks would come from the global RNG). Its initial values
/// are overwritten from [`initial`] before use.
fn cnn() -> ddp_models::MnistCnn {
    let device = device();
    MnistCnnConfig::new()
        .with_dropout1(0.0)
        .with_dropout2(0.0)
        .init(&device)
}

/// Trains on every rank; returns each rank's final parameters and, per step, whether all
/// replicas were bit-identical (checked with the wrapper's replica check).
fn train(run: Run, init: &[f32]) -> Vec<Vec<f32>> {
    run_ranks_over(run.world, run.transport, |pg| match run.net {
        Net::Cnn => train_rank(run, init, pg, cnn()),
        Net::Mlp => {
            let device = device();
            train_rank(run, init, pg, MnistMlpConfig::new().init(&device))
        }
    })
}

fn train_rank<M>(run: Run, init: &[f32], pg: Arc<ProcessGroup>, model: M) -> Vec<f32>
where
    M: Module + Classifier<4>,
{
    let rank = pg.rank();
    let start: Vec<f32> = if rank == 0 {
        init.to_vec()
    } else {
        init.iter().map(|v| v + 1.0).collect()
    };
    let model = load_flat_params(model, &start).unwrap();
    let config = DdpConfig {
        bucket_cap_mb: run.bucket_cap_mb,
        first_bucket_mb: run.bucket_cap_mb.min(1.0),
        compression: run.compression,
        check_replicas_every: Some(1),
        ..DdpConfig::default()
    };
    let (mut model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
    assert_eq!(
        flatten_params(&model).unwrap(),
        init,
        "rank {rank}: broadcast"
    );
    match run.opt {
        Opt::Sgd => {
            let optim = SgdConfig::new().init();
            steps(run, rank, &mut model, &mut ddp, optim, 0.02)
        }
        Opt::Adam => {
            let optim = AdamConfig::new().with_epsilon(1e-8).init();
            steps(run, rank, &mut model, &mut ddp, optim, 1e-3)
        }
    }
    // The replica check runs before each sync; check once more after the last step.
    ddp.check_replicas(&model).unwrap();
    flatten_params(&model).unwrap()
}

fn steps<M>(
    run: Run,
    rank: usize,
    model: &mut M,
    ddp: &mut DistributedDataParallel,
    mut optim: ModuleOptimizer,
    lr: f64,
) where
    M: Module + Classifier<4>,
{
    let micro_batch = run.batch / run.micro;
    for step in 0..run.steps {
        let base = step * run.world * run.batch + rank * run.batch;
        for m in 0..run.micro {
            let (x, y) = batch(base + m * micro_batch, micro_batch);
            let (loss, _) = model.loss(x, y);
            // As in PyTorch: accumulation sums micro-step gradients, so the loss is divided by
            // the number of micro-steps to get the gradient of the mean over all of them.
            let loss = loss.div_scalar(run.micro as f32);
            let grads = GradientsParams::from_grads(loss.backward(), &*model);
            if m + 1 < run.micro {
                ddp.accumulate(grads).unwrap();
            } else {
                let grads = ddp.sync(&*model, grads).unwrap();
                *model = optim.step(lr, model.clone(), grads);
            }
        }
    }
}

/// Largest |a - b| relative to the largest |a|.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// ||a - b|| / ||a|| (Euclidean).
fn norm_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn assert_replicas_identical(ranks: &[Vec<f32>]) {
    for (r, p) in ranks.iter().enumerate() {
        assert!(p == &ranks[0], "rank {r} differs from rank 0 bit-wise");
    }
}

fn equivalence(net: Net, opt: Opt, transport: Transport) {
    let init = initial(net);
    let b = 4;
    let single = train(Run::new(net, opt, 1, 6 * b), &init);
    assert!(
        rel_diff(&init, &single[0]) > 1e-4,
        "training did not move the parameters"
    );
    for world in [2, 3] {
        // The baseline batch covers the same samples: world·b per step at world 1 ...
        let reference = if world == 2 {
            train(Run::new(net, opt, 1, 2 * b), &init)
        } else {
            train(Run::new(net, opt, 1, 3 * b), &init)
        };
        let ranks = train(
            Run {
                transport,
                ..Run::new(net, opt, world, b)
            },
            &init,
        );
        assert_replicas_identical(&ranks);
        let d = rel_diff(&reference[0], &ranks[0]);
        let n = norm_rel_diff(&reference[0], &ranks[0]);
        eprintln!("{net:?}/{opt:?} {transport:?} world {world}: max-rel {d:e} norm-rel {n:e}");
        // Relative in the Euclidean norm, ||a - b|| / ||a||. Not element-wise: a few parameters
        // whose true gradient is ~0 pick up float noise of the summation order (which DDP
        // changes: per-rank means, then their mean), and Adam (dividing by sqrt(v)) and chaotic
        // SGD steps amplify it to more than 1e-5 in 1 to 127 elements out of 0.2M to 1.2M.
        assert!(
            n < 1e-5,
            "{net:?}/{opt:?} world {world}: relative difference {n}"
        );
    }
}

#[test]
fn mlp_sgd_world_2_and_3_match_one_process() {
    equivalence(Net::Mlp, Opt::Sgd, Transport::Auto);
}

#[test]
fn mlp_adam_world_2_and_3_match_one_process() {
    equivalence(Net::Mlp, Opt::Adam, Transport::Auto);
}

#[test]
fn cnn_sgd_world_2_and_3_match_one_process() {
    equivalence(Net::Cnn, Opt::Sgd, Transport::Auto);
}

#[test]
fn cnn_adam_world_2_and_3_match_one_process() {
    equivalence(Net::Cnn, Opt::Adam, Transport::Auto);
}

// The same equivalence over the TCP ring (`DDP_TRANSPORT=tcp`: what ranks on different hosts
// use) instead of shared memory.
#[test]
fn mlp_sgd_over_tcp_world_2_and_3_match_one_process() {
    equivalence(Net::Mlp, Opt::Sgd, Transport::Tcp);
}

#[test]
fn mlp_adam_over_tcp_world_2_and_3_match_one_process() {
    equivalence(Net::Mlp, Opt::Adam, Transport::Tcp);
}

#[test]
fn cnn_adam_over_tcp_world_2_and_3_match_one_process() {
    equivalence(Net::Cnn, Opt::Adam, Transport::Tcp);
}

#[test]
fn two_runs_with_one_seed_are_bit_identical() {
    let init = initial(Net::Mlp);
    for transport in [Transport::Auto, Transport::Tcp] {
        let run = Run {
            transport,
            ..Run::new(Net::Mlp, Opt::Adam, 2, 8)
        };
        let a = train(run, &init);
        let b = train(run, &init);
        assert_replicas_identical(&a);
        assert!(a[0] == b[0], "{transport:?}: two runs differ");
    }
}

#[test]
fn bucket_size_changes_results_by_float_tolerance_only() {
    let init = initial(Net::Mlp);
    let big = train(Run::new(Net::Mlp, Opt::Sgd, 2, 8), &init);
    let mut small = Run::new(Net::Mlp, Opt::Sgd, 2, 8);
    small.bucket_cap_mb = 0.05; // many buckets, several parameters split across them
    let small = train(small, &init);
    assert_replicas_identical(&small);
    let d = rel_diff(&big[0], &small[0]);
    assert!(d < 1e-6, "bucket size changed the result by {d}");
}

#[test]
fn no_sync_accumulation_equals_one_big_step() {
    let init = initial(Net::Mlp);
    let mut accumulated = Run::new(Net::Mlp, Opt::Sgd, 2, 12);
    accumulated.micro = 3; // three micro-batches of 4, one all-reduce
    let accumulated = train(accumulated, &init);
    let whole = train(Run::new(Net::Mlp, Opt::Sgd, 2, 12), &init);
    assert_replicas_identical(&accumulated);
    let d = rel_diff(&whole[0], &accumulated[0]);
    assert!(d < 1e-5, "accumulation differs from one step by {d}");
}

#[test]
fn bf16_compression_stays_close_and_replicas_identical() {
    let init = initial(Net::Mlp);
    let exact = train(Run::new(Net::Mlp, Opt::Sgd, 2, 8), &init);
    let mut run = Run::new(Net::Mlp, Opt::Sgd, 2, 8);
    run.compression = Compression::Bf16;
    let compressed = train(run, &init);
    assert_replicas_identical(&compressed);
    let d = rel_diff(&exact[0], &compressed[0]);
    assert!(d > 0.0, "bf16 changed nothing: was it used?");
    assert!(d < 1e-2, "bf16 drifted by {d}");
}

#[test]
fn different_models_fail_at_construction_naming_rank_and_parameter() {
    let errors = run_ranks(2, |pg| {
        let device = device();
        let result = if pg.rank() == 0 {
            DistributedDataParallel::new(
                MnistMlpConfig::new().init(&device),
                pg,
                DdpConfig::default(),
            )
            .map(|_| ())
        } else {
            DistributedDataParallel::new(
                MnistMlpConfig::new().with_hidden(128).init(&device),
                pg,
                DdpConfig::default(),
            )
            .map(|_| ())
        };
        result.unwrap_err().to_string()
    });
    for e in &errors {
        assert!(e.contains("rank 1 differs from rank 0"), "{e}");
        assert!(e.contains("fc1.weight"), "{e}");
    }
}

/// Runs the replica check on `world` ranks after rank `bad` changed its weights; returns each
/// rank's error text.
fn replica_check_errors(world: usize, bad: usize) -> Vec<String> {
    run_ranks(world, |pg| {
        let device = device();
        let model = MnistMlpConfig::new().init(&device);
        let values = seeded_values(&model, 3);
        let model = load_flat_params(model, &values).unwrap();
        let (model, ddp) =
            DistributedDataParallel::new(model, pg.clone(), DdpConfig::default()).unwrap();
        ddp.check_replicas(&model).unwrap();
        // Rank `bad` silently changes its weights.
        let model = if pg.rank() == bad {
            let flat: Vec<f32> = flatten_params(&model)
                .unwrap()
                .iter()
                .map(|v| v * 1.5)
                .collect();
            load_flat_params(model, &flat).unwrap()
        } else {
            model
        };
        match ddp.check_replicas(&model).unwrap_err() {
            e @ DdpError::ReplicaDiverged { .. } => e.to_string(),
            other => panic!("rank {}: unexpected error {other}", pg.rank()),
        }
    })
}

#[test]
fn diverged_replicas_are_detected_naming_the_rank() {
    // Three ranks: the two that agree are a majority, so the odd one is named, even rank 0.
    for bad in [2, 0] {
        for e in replica_check_errors(3, bad) {
            assert!(
                e.contains(&format!(
                    "rank(s) {bad} hold different parameters from the majority"
                )),
                "{e}"
            );
        }
    }
}

#[test]
fn diverged_replicas_at_world_2_blame_neither_rank() {
    // Two ranks: no majority. Whichever rank changed, the message says rank 1 differs from
    // rank 0 and that which one is wrong cannot be told; it never blames rank 0 alone.
    for bad in [0, 1] {
        for e in replica_check_errors(2, bad) {
            assert!(
                e.contains("rank(s) 1 hold different parameters from rank 0"),
                "{e}"
            );
            assert!(e.contains("cannot be told"), "{e}");
            assert!(!e.contains("majority ("), "{e}");
        }
    }
}

/// Every trainable parameter's gradient in `grads` as one flat vector, in visiting order.
fn grads_flat<M: Module>(model: &M, grads: &GradientsParams) -> Vec<f32> {
    let mut out = Vec::new();
    for info in param_infos(model).into_iter().filter(|p| p.trainable()) {
        let data = match info.shape.len() {
            1 => grads.get::<1>(info.id).map(|t| t.into_data()),
            2 => grads.get::<2>(info.id).map(|t| t.into_data()),
            4 => grads.get::<4>(info.id).map(|t| t.into_data()),
            d => panic!("rank {d} parameter"),
        };
        let data = data.unwrap_or_else(|| panic!("no gradient for {}", info.name));
        out.extend(data.try_to_vec::<f32>().unwrap());
    }
    out
}

/// The inverse of [`grads_flat`]: gradients registered under `model`'s parameter ids.
fn grads_from_flat<M: Module>(model: &M, flat: &[f32]) -> GradientsParams {
    let device = device();
    let mut grads = GradientsParams::new();
    let mut offset = 0;
    for info in param_infos(model).into_iter().filter(|p| p.trainable()) {
        let values = flat[offset..offset + info.numel()].to_vec();
        offset += info.numel();
        let data = TensorData::new(values, info.shape.clone());
        match info.shape.len() {
            1 => grads.register::<1>(info.id, Tensor::from_data(data, &device)),
            2 => grads.register::<2>(info.id, Tensor::from_data(data, &device)),
            4 => grads.register::<4>(info.id, Tensor::from_data(data, &device)),
            d => panic!("rank {d} parameter"),
        }
    }
    grads
}

#[test]
fn accumulate_sums_micro_steps_and_sync_averages_over_ranks_like_pytorch() {
    let (world, micro, mb) = (2, 3, 4);
    let device = device();
    let init = seeded_values(&MnistMlpConfig::new().init(&device), 5);
    let start = |rank: usize, m: usize| 1000 + (rank * micro + m) * mb;

    // Reference, PyTorch's semantics computed with plain burn in this thread: each micro-batch's
    // gradient separately, summed over micro-steps, then averaged over ranks by hand.
    let mut reference: Vec<f32> = Vec::new();
    for rank in 0..world {
        for m in 0..micro {
            let model = load_flat_params(MnistMlpConfig::new().init(&device), &init).unwrap();
            let (x, y) = batch(start(rank, m), mb);
            let (loss, _) = model.loss(x, y);
            let g = grads_flat(
                &model,
                &GradientsParams::from_grads(loss.backward(), &model),
            );
            if reference.is_empty() {
                reference = vec![0.0; g.len()];
            }
            reference.iter_mut().zip(&g).for_each(|(r, v)| *r += v);
        }
    }
    reference.iter_mut().for_each(|r| *r /= world as f32);

    let synced = run_ranks(world, |pg| {
        let rank = pg.rank();
        let model = MnistMlpConfig::new().init(&device);
        let model = load_flat_params(model, &init).unwrap();
        let (model, mut ddp) =
            DistributedDataParallel::new(model, pg, DdpConfig::default()).expect("wrapper");
        for m in 0..micro {
            let (x, y) = batch(start(rank, m), mb);
            let (loss, _) = model.loss(x, y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            if m + 1 < micro {
                ddp.accumulate(grads).unwrap();
            } else {
                let grads = ddp.sync(&model, grads).unwrap();
                return grads_flat(&model, &grads);
            }
        }
        unreachable!()
    });
    for (rank, g) in synced.iter().enumerate() {
        let n = norm_rel_diff(&reference, g);
        assert!(
            n < 1e-5,
            "rank {rank}: relative difference {n} from the reference"
        );
    }
    assert!(synced[0] == synced[1], "ranks received different gradients");
}

#[test]
fn parameters_replaced_after_wrapping_are_an_error_saying_what_to_do() {
    let errors = run_ranks(1, |pg| {
        let device = device();
        let model = MnistMlpConfig::new().init(&device);
        let (model, mut ddp) =
            DistributedDataParallel::new(model, pg, DdpConfig::default()).unwrap();
        // load_record after wrapping: every parameter takes the record's (different) id.
        let other = MnistMlpConfig::new().init(&device);
        let model = model.load_record(other.into_record());
        let (x, y) = batch(0, 4);
        let (loss, _) = model.loss(x.clone(), y.clone());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let on_sync = ddp.sync(&model, grads).unwrap_err();
        let (loss, _) = model.loss(x, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let on_accumulate = ddp.accumulate(grads).unwrap_err();
        (on_sync, on_accumulate)
    });
    let (on_sync, on_accumulate) = &errors[0];
    assert!(
        matches!(on_sync, DdpError::ParamsChanged { .. }),
        "{on_sync}"
    );
    let text = on_sync.to_string();
    assert!(text.contains("`fc1.weight`"), "{text}");
    assert!(text.contains("load the record before wrapping"), "{text}");
    assert!(
        matches!(on_accumulate, DdpError::ParamsChanged { .. }),
        "{on_accumulate}"
    );
    assert!(
        on_accumulate.to_string().contains("4 gradients"),
        "{on_accumulate}"
    );
}

#[test]
fn an_unreadable_gradient_is_an_error_naming_the_parameter() {
    let errors = run_ranks(2, |pg| {
        let device = device();
        let model = MnistMlpConfig::new().init(&device);
        let (model, mut ddp) =
            DistributedDataParallel::new(model, pg, DdpConfig::default()).unwrap();
        let (x, y) = batch(0, 4);
        let (loss, _) = model.loss(x, y);
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        // fc2.bias's gradient replaced by one of the wrong size.
        let bias = param_infos(&model)
            .into_iter()
            .find(|p| p.name == "fc2.bias")
            .unwrap();
        grads.register::<1>(bias.id, Tensor::zeros([3], &device));
        ddp.sync(&model, grads).unwrap_err().to_string()
    });
    for e in &errors {
        assert!(e.contains("gradient of parameter `fc2.bias`"), "{e}");
        assert!(e.contains("3 values, expected 10"), "{e}");
    }
}

/// A small network with a BatchNorm layer: 16 → 8 → BatchNorm → relu → 3.
#[derive(Module, Debug)]
struct BnNet {
    fc1: Linear,
    bn: BatchNorm,
    fc2: Linear,
}

impl BnNet {
    fn new() -> Self {
        let device = device();
        BnNet {
            fc1: LinearConfig::new(16, 8).init(&device),
            bn: BatchNormConfig::new(8).init(&device),
            fc2: LinearConfig::new(8, 3).init(&device),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
        let h = relu(self.bn.forward(self.fc1.forward(x)));
        ddp_models::cross_entropy(self.fc2.forward(h), y)
    }
}

/// Rank `rank`'s batch of step `step` for [`BnNet`]: 6 rows of 16 features, with a per-rank
/// offset so that the ranks' batch statistics differ.
fn bn_batch(rank: usize, step: usize) -> (Tensor<2>, Tensor<1, Int>) {
    let device = device();
    let stream = 100 + (step * 10 + rank) as u64;
    let x: Vec<f32> = (0..6 * 16)
        .map(|i| uniform(stream, i) + rank as f32)
        .collect();
    let y: Vec<i64> = (0..6).map(|i| ((i + step + rank) % 3) as i64).collect();
    (
        Tensor::from_data(TensorData::new(x, [6, 16]), &device),
        Tensor::from_data(TensorData::new(y, [6]), &device),
    )
}

/// Running mean and variance of `net`'s BatchNorm, concatenated.
fn running_stats(net: &BnNet) -> Vec<f32> {
    common::running_stats(&net.bn)
}

#[test]
fn batchnorm_running_stats_are_broadcast_from_rank_0_not_averaged() {
    let (world, steps, lr) = (2, 3, 0.1);
    let init = seeded_values(&BnNet::new(), 9);
    let infos = param_infos(&BnNet::new());
    let buffers: Vec<&str> = infos
        .iter()
        .filter(|p| p.kind == ParamKind::Buffer)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(buffers, ["bn.running_mean", "bn.running_var"]);

    // Reference, computed without DDP: the gradient is the mean of both ranks' gradients, and
    // the running statistics evolve with rank 0's batches only (PyTorch's broadcast_buffers:
    // rank 0's buffers are everyone's).
    let mut model = load_flat_params(BnNet::new(), &init).unwrap();
    let mut optim = SgdConfig::new().init();
    for step in 0..steps {
        let mut sum: Vec<f32> = Vec::new();
        for rank in 0..world {
            // Rank 1's pass runs on a separate copy (its own RunningState), so that only rank
            // 0's batch statistics reach `model`'s.
            let net = if rank == 0 {
                model.clone()
            } else {
                let flat = flatten_params(&model).unwrap();
                load_flat_params(BnNet::new(), &flat).unwrap()
            };
            let (x, y) = bn_batch(rank, step);
            let loss = net.loss(x, y);
            let g = grads_flat(&net, &GradientsParams::from_grads(loss.backward(), &net));
            if sum.is_empty() {
                sum = vec![0.0; g.len()];
            }
            sum.iter_mut()
                .zip(&g)
                .for_each(|(s, v)| *s += v / world as f32);
        }
        let grads = grads_from_flat(&model, &sum);
        model = optim.step(lr, model, grads);
    }
    drop(model.valid()); // merge the last pending running-state update
    let reference_params = flatten_params(&model).unwrap();
    let reference_stats = running_stats(&model);

    let ranks = run_ranks(world, |pg| {
        let rank = pg.rank();
        // Every rank but 0 starts elsewhere, buffers included.
        let start: Vec<f32> = init.iter().map(|v| v + rank as f32).collect();
        let model = load_flat_params(BnNet::new(), &start).unwrap();
        let config = DdpConfig {
            check_replicas_every: Some(1),
            ..DdpConfig::default()
        };
        let (mut model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
        let mut optim = SgdConfig::new().init();
        for step in 0..steps {
            let (x, y) = bn_batch(rank, step);
            let loss = model.loss(x, y);
            let grads = ddp.backward(&model, loss).expect("sync");
            for info in ddp.params().iter().filter(|p| p.kind == ParamKind::Buffer) {
                assert!(
                    grads.get::<1>(info.id).is_none(),
                    "{} travelled as a gradient",
                    info.name
                );
            }
            model = optim.step(lr, model, grads);
        }
        ddp.check_replicas(&model).unwrap();
        (flatten_params(&model).unwrap(), running_stats(&model))
    });
    let (params0, stats0) = &ranks[0];
    for (rank, (params, stats)) in ranks.iter().enumerate() {
        assert!(
            stats == stats0,
            "rank {rank}'s running stats differ from rank 0's"
        );
        assert!(
            params == params0,
            "rank {rank}'s parameters differ from rank 0's"
        );
    }
    let d = norm_rel_diff(&reference_stats, stats0);
    assert!(d < 1e-5, "running stats differ from the reference by {d}");
    let d = norm_rel_diff(&reference_params, params0);
    assert!(d < 1e-5, "parameters differ from the reference by {d}");
    // The statistics really moved (from the initial values) during training.
    let initial_stats = running_stats(&load_flat_params(BnNet::new(), &init).unwrap());
    assert!(norm_rel_diff(&initial_stats, stats0) > 1e-3);
}

#[test]
fn recorded_spans_cover_every_bucket_in_order() {
    use ddp::{SyncPhase, SyncSpan};
    let spans: Vec<(usize, Vec<SyncSpan>)> = run_ranks(2, |pg| {
        let model = MnistMlpConfig::new().init(&device());
        // A bucket per parameter, four: a cap of one element, which every parameter crosses.
        let one = 4.0 / (1024.0 * 1024.0);
        let config = DdpConfig {
            bucket_cap_mb: one,
            first_bucket_mb: one,
            ..DdpConfig::default()
        };
        let (model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
        let buckets = ddp.bucket_layout().len();
        let (x, y) = batch(0, 4);
        // Off by default: nothing recorded.
        let (loss, _) = model.loss(x.clone(), y.clone());
        ddp.backward(&model, loss).unwrap();
        assert!(ddp.take_spans().is_empty());
        ddp.record_spans(true);
        let (loss, _) = model.loss(x, y);
        ddp.backward(&model, loss).unwrap();
        let spans = ddp.take_spans();
        assert!(ddp.take_spans().is_empty(), "take_spans empties the record");
        (buckets, spans)
    });
    for (buckets, spans) in spans {
        assert_eq!(buckets, 4);
        for phase in [
            SyncPhase::Pack,
            SyncPhase::AllReduce,
            SyncPhase::Wait,
            SyncPhase::Unpack,
        ] {
            let of: Vec<&SyncSpan> = spans.iter().filter(|s| s.phase == phase).collect();
            let order: Vec<usize> = of.iter().map(|s| s.bucket).collect();
            assert_eq!(order, (0..buckets).collect::<Vec<_>>(), "{phase:?}");
            assert!(of.iter().all(|s| s.start <= s.end && s.elements > 0));
        }
        let at = |phase, b| {
            *spans
                .iter()
                .find(|s| s.phase == phase && s.bucket == b)
                .unwrap()
        };
        for b in 0..buckets {
            let (pack, reduce, wait, unpack) = (
                at(SyncPhase::Pack, b),
                at(SyncPhase::AllReduce, b),
                at(SyncPhase::Wait, b),
                at(SyncPhase::Unpack, b),
            );
            // Submitted at the end of packing; done when the wait returned; unpacked after.
            assert!(reduce.start >= pack.end && reduce.end == wait.end);
            assert!(unpack.start == wait.end);
            if b > 0 {
                // One communication thread: the all-reduces do not overlap.
                assert!(reduce.start >= at(SyncPhase::AllReduce, b - 1).end);
            }
        }
    }
}
