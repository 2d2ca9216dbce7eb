//! Sharded training (`ShardedDataParallel`, ZeRO stages 1 and 2) against the DDP wrapper with
//! burn's own optimizers, the independent reference: one thread per rank, each with its own
//! process group.
//!
//! - stages 1 and 2 end bit-identical to DDP + burn's `Adam`, `AdamW` and `Sgd` (Nesterov
//!   momentum, weight decay) at world sizes 1 to 4, over shared memory and TCP, with a parameter count
//!   (226) that no world size of 3 or 4 divides, buckets small enough that parameters straddle
//!   them, and a layer that gets no gradient in some steps; replicas stay bit-identical;
//! - accumulation (`no_sync`): stage 1 bit-identical to DDP's, stage 2 within 1e-5 with SGD (it
//!   sums over ranks per micro-step, then over micro-steps: another rounding order);
//! - a local failure fails the step on every rank naming the rank, and changes nothing (the
//!   optimizer state and step counts, byte for byte, and the next step); a peer that died is
//!   named by the survivors;
//! - the consolidated optimizer state resumes at another world size and continues
//!   bit-identically; through a checkpoint file too;
//! - each rank saves and reloads its own shard; shard files of different checkpoints (one
//!   rank's older: a crash during a save) or of another run are refused on every rank, naming
//!   the rank and the steps, and nothing is loaded;
//! - consolidating hands no rank more than one shard at a time;
//! - each rank's optimizer state is 1/N of the whole, the gradient too at stage 2;
//! - with overlap (`prepare` and `backward_step`: the reduce-scatters start during backward
//!   from DDP's hooks, each gradient taken from burn and released as its bucket leaves) stages
//!   1 and 2 still end bit-identical to DDP, also when a parameter has a gradient on some ranks
//!   only (every rank issues the same collectives);
//! - global-norm clipping: stages 1 and 2 with `max_grad_norm` end bit-identical to DDP with it
//!   (the same norm every step), and a clipped step matches the formula computed by hand from
//!   burn's own gradients.

use std::time::Duration;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    decay::WeightDecayConfig, AdamConfig, AdamWConfig, GradientsParams, ModuleOptimizer, SgdConfig,
};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use ddp::{
    flatten_params, load_flat_params, resume_sharded, save_sharded_checkpoint, DdpConfig, DdpError,
    DistributedDataParallel, Position, RunId, ShardOptimizer, ShardedAdamConfig,
    ShardedAdamWConfig, ShardedDataParallel, ShardedSgdConfig, ZeroConfig, ZeroStage,
};
use ddp_comm::Transport;

use crate::common;
use common::{device, run_ranks, run_ranks_over};

const IN: usize = 13;
const HIDDEN: usize = 9;
const OUT: usize = 5;
/// Trainable elements: 13*9+9 + 9*5+5 + 9*5+5.
const PARAMS: usize = 226;

/// A small net with odd sizes; `extra` is used only in some steps.
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
    extra: Linear,
}

impl Net {
    /// The net with deterministic values (the same on every rank unless `rank_offset`).
    fn new(rank_offset: f32) -> Net {
        let device = device();
        let net = Net {
            a: LinearConfig::new(IN, HIDDEN).init(&device),
            b: LinearConfig::new(HIDDEN, OUT).init(&device),
            extra: LinearConfig::new(HIDDEN, OUT).init(&device),
        };
        let values: Vec<f32> = (0..PARAMS)
            .map(|i| ((i * 37 + 11) % 101) as f32 / 101.0 - 0.5 + rank_offset)
            .collect();
        load_flat_params(net, &values).unwrap()
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>, use_extra: bool) -> Tensor<1> {
        let h = relu(self.a.forward(x));
        let mut out = self.b.forward(h.clone());
        if use_extra {
            out = out + self.extra.forward(h);
        }
        (out - y).powi_scalar(2).mean()
    }
}

/// Samples of (step, micro-step, rank): 3 rows each, from a fixed formula.
fn data(step: usize, micro: usize, rank: usize) -> (Tensor<2>, Tensor<2>) {
    let seed = step * 1000 + micro * 100 + rank * 10;
    let x: Vec<f32> = (0..3 * IN)
        .map(|i| (((seed + i) * 7919) % 97) as f32 / 48.0 - 1.0)
        .collect();
    let y: Vec<f32> = (0..3 * OUT)
        .map(|i| (((seed + i) * 104_729) % 89) as f32 / 44.0 - 1.0)
        .collect();
    let device = device();
    (
        Tensor::from_data(TensorData::new(x, [3, IN]), &device),
        Tensor::from_data(TensorData::new(y, [3, OUT]), &device),
    )
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    Adam,
    /// Decoupled weight decay 0.01, PyTorch's defaults.
    AdamW,
    /// Nesterov momentum, dampening 0 is not burn's default: use burn's default (0.1), and
    /// weight decay.
    Sgd,
}

impl Opt {
    fn burn(self) -> ModuleOptimizer {
        match self {
            Opt::Adam => AdamConfig::new().init(),
            Opt::AdamW => AdamWConfig::new()
                .with_epsilon(1e-8)
                .with_weight_decay(0.01)
                .init(),
            Opt::Sgd => SgdConfig::new()
                .with_momentum(Some(MomentumConfig {
                    momentum: 0.9,
                    dampening: 0.1,
                    nesterov: true,
                }))
                .with_weight_decay(Some(WeightDecayConfig { penalty: 0.01 }))
                .init(),
        }
    }

    fn sharded(self) -> ShardOptimizer {
        match self {
            Opt::Adam => ShardOptimizer::Adam(ShardedAdamConfig::new()),
            Opt::AdamW => ShardOptimizer::AdamW(ShardedAdamWConfig::new()),
            Opt::Sgd => ShardOptimizer::Sgd(
                ShardedSgdConfig::new()
                    .with_momentum(Some(0.9))
                    .with_dampening(0.1)
                    .with_nesterov(true)
                    .with_weight_decay(Some(0.01)),
            ),
        }
    }
}

const LR: f64 = 0.05;
/// Buckets of 50 elements: parameters straddle them.
const SMALL_BUCKETS_MB: f64 = 50.0 * 4.0 / (1024.0 * 1024.0);

/// Whether the `extra` layer is used at `step` (never in steps 1 and 4 of 0..6).
fn uses_extra(step: usize) -> bool {
    step % 3 != 1
}

/// Trains `steps` steps with `micro` micro-steps each on `world` ranks and returns every
/// rank's final parameters: DDP + burn's optimizer when `stage` is `None`.
fn train(
    world: usize,
    stage: Option<ZeroStage>,
    opt: Opt,
    micro: usize,
    steps: usize,
    transport: Transport,
) -> Vec<Vec<f32>> {
    run_ranks_over(world, transport, |pg| {
        let rank = pg.rank();
        let model = Net::new(rank as f32); // other ranks start elsewhere: the broadcast fixes it
        let grads_of = |model: &Net, step: usize, m: usize| {
            let (x, y) = data(step, m, rank);
            let loss = model.loss(x, y, uses_extra(step)).div_scalar(micro as f32);
            GradientsParams::from_grads(loss.backward(), model)
        };
        match stage {
            None => {
                let config = DdpConfig::new()
                    .with_bucket_cap_mb(SMALL_BUCKETS_MB)
                    .with_first_bucket_mb(SMALL_BUCKETS_MB);
                let (mut model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
                let mut optim = opt.burn();
                for step in 0..steps {
                    for m in 0..micro - 1 {
                        ddp.accumulate(grads_of(&model, step, m)).unwrap();
                    }
                    let grads = ddp.sync(&model, grads_of(&model, step, micro - 1)).unwrap();
                    model = optim.step(LR, model, grads);
                }
                flatten_params(&model).unwrap()
            }
            Some(stage) => {
                let config = ZeroConfig::new(stage)
                    .with_bucket_cap_mb(SMALL_BUCKETS_MB)
                    .with_first_bucket_mb(SMALL_BUCKETS_MB);
                let (mut model, mut zero) =
                    ShardedDataParallel::new(model, pg, config, opt.sharded()).unwrap();
                for step in 0..steps {
                    for m in 0..micro - 1 {
                        zero.accumulate(&model, grads_of(&model, step, m)).unwrap();
                    }
                    let grads = grads_of(&model, step, micro - 1);
                    model = zero.step(LR, model, grads).unwrap();
                }
                flatten_params(&model).unwrap()
            }
        }
    })
}

fn assert_bit_identical(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let differ = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits());
    assert!(
        differ.is_none(),
        "{what}: element {} differs: {} vs {}",
        differ.unwrap(),
        a[differ.unwrap()],
        b[differ.unwrap()]
    );
}

fn assert_replicas_equal(ranks: &[Vec<f32>], what: &str) {
    for (r, p) in ranks.iter().enumerate() {
        assert_bit_identical(&ranks[0], p, &format!("{what}: rank {r} against rank 0"));
    }
}

#[test]
fn stages_1_and_2_equal_ddp_bit_for_bit_at_world_sizes_1_to_4() {
    for world in 1..=4 {
        for opt in [Opt::Adam, Opt::AdamW, Opt::Sgd] {
            let ddp = train(world, None, opt, 1, 6, Transport::Auto);
            assert_replicas_equal(&ddp, "ddp");
            // The runs move: the reference is not the initial model.
            let start = flatten_params(&Net::new(0.0)).unwrap();
            assert!(ddp[0].iter().zip(&start).any(|(a, b)| a != b));
            for stage in [ZeroStage::One, ZeroStage::Two] {
                let what = format!("world {world}, {opt:?}, {stage:?}");
                let zero = train(world, Some(stage), opt, 1, 6, Transport::Auto);
                assert_replicas_equal(&zero, &what);
                assert_bit_identical(&zero[0], &ddp[0], &what);
            }
        }
    }
}

#[test]
fn over_tcp_the_sharded_step_equals_ddp_too() {
    for world in [2, 3] {
        let ddp = train(world, None, Opt::Adam, 1, 4, Transport::Tcp);
        let zero = train(world, Some(ZeroStage::Two), Opt::Adam, 1, 4, Transport::Tcp);
        assert_replicas_equal(&zero, "tcp");
        assert_bit_identical(&zero[0], &ddp[0], &format!("tcp, world {world}"));
    }
}

#[test]
fn accumulation_matches_ddp_no_sync() {
    for world in [2, 3] {
        let ddp = train(world, None, Opt::Adam, 3, 4, Transport::Auto);
        let one = train(
            world,
            Some(ZeroStage::One),
            Opt::Adam,
            3,
            4,
            Transport::Auto,
        );
        assert_bit_identical(&one[0], &ddp[0], &format!("stage 1, world {world}"));
        // Stage 2 sums over ranks per micro-step: another rounding order. Compared with SGD,
        // where a rounding difference stays a rounding difference (Adam divides by the root of
        // the second moment, which turns the last bit of a near-zero gradient into a visible
        // step difference).
        let ddp_sgd = train(world, None, Opt::Sgd, 3, 4, Transport::Auto);
        let two = train(world, Some(ZeroStage::Two), Opt::Sgd, 3, 4, Transport::Auto);
        assert_replicas_equal(&two, "stage 2 accumulation");
        let worst = two[0]
            .iter()
            .zip(&ddp_sgd[0])
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "stage 2, world {world}: relative {worst}");
    }
}

#[test]
fn a_local_failure_fails_the_step_on_every_rank_and_changes_nothing() {
    let results = run_ranks(3, |pg| {
        let rank = pg.rank();
        let config = ZeroConfig::new(ZeroStage::Two);
        let (mut model, mut zero) =
            ShardedDataParallel::new(Net::new(0.0), pg, config, Opt::Adam.sharded()).unwrap();
        // One good step first, so that there are moments and step counts to lose.
        let (x, y) = data(0, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        model = zero.step(LR, model, grads).unwrap();
        let before = flatten_params(&model).unwrap();
        // What a step changes: this rank's optimizer state and every parameter's step count
        // (and, through them, the next step, checked below).
        let state_before = zero.shard_state().unwrap();
        let (x, y) = data(0, 1, rank);
        let grads = if rank == 1 {
            // Gradients of another module: ids the wrapper does not know.
            let other = Net::new(0.0);
            GradientsParams::from_grads(other.loss(x, y, true).backward(), &other)
        } else {
            GradientsParams::from_grads(model.loss(x, y, true).backward(), &model)
        };
        let failed = zero.step(LR, model.clone(), grads);
        let state_after = zero.shard_state().unwrap();
        assert!(
            state_after == state_before,
            "rank {rank}: a failed step changes no optimizer state or step count"
        );
        // The next step works on every rank.
        let (x, y) = data(1, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        let next = zero
            .step(LR, model.clone(), grads)
            .map(|m| flatten_params(&m).unwrap());
        // The same two good steps by a wrapper that never saw the failure: the failed step
        // left no optimizer state, step count or gradient behind.
        let pg = zero.process_group().clone();
        let (model, mut fresh) = ShardedDataParallel::new(
            Net::new(0.0),
            pg,
            ZeroConfig::new(ZeroStage::Two),
            Opt::Adam.sharded(),
        )
        .unwrap();
        let (x, y) = data(0, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        let model = fresh.step(LR, model, grads).unwrap();
        let (x, y) = data(1, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        let reference = flatten_params(&fresh.step(LR, model, grads).unwrap()).unwrap();
        assert_bit_identical(
            next.as_ref().unwrap(),
            &reference,
            "the step after a failure",
        );
        (rank, failed.err(), before, next)
    });
    for (rank, error, before, next) in results {
        match (rank, error) {
            (1, Some(DdpError::ParamsChanged { .. })) => {}
            (_, Some(DdpError::PeerFailed { rank: Some(1), .. })) if rank != 1 => {}
            (r, other) => panic!("rank {r}: {other:?}"),
        }
        let next = next.expect("the step after a failure works");
        assert!(next.iter().zip(&before).any(|(a, b)| a != b));
    }
}

#[test]
fn a_dead_peer_is_named_by_the_survivors() {
    let results = run_ranks_over(2, Transport::Tcp, |pg| {
        let rank = pg.rank();
        let config = ZeroConfig::new(ZeroStage::Two);
        let (mut model, mut zero) =
            ShardedDataParallel::new(Net::new(0.0), pg, config, Opt::Adam.sharded()).unwrap();
        let (x, y) = data(0, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        model = zero.step(LR, model, grads).unwrap();
        if rank == 1 {
            // Rank 1 dies: its process group (and its sockets) go away mid-training.
            drop(zero);
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
        let (x, y) = data(1, 0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
        Some(zero.step(LR, model, grads).err())
    });
    let error = results[0]
        .as_ref()
        .unwrap()
        .as_ref()
        .expect("rank 0 must fail");
    match error {
        DdpError::Comm(e) => assert!(e.to_string().contains("rank 1 left"), "{e}"),
        other => panic!("{other}"),
    }
}

/// Trains `steps` steps (Adam, stage 2) on `world` ranks from `start` (parameters and an
/// optional consolidated state); returns rank 0's parameters and the consolidated state.
fn continue_from(
    world: usize,
    start: &[f32],
    state: Option<&[u8]>,
    steps: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<u8>) {
    let out = run_ranks(world, |pg| {
        let model = load_flat_params(Net::new(0.0), start).unwrap();
        let config = ZeroConfig::new(ZeroStage::Two).with_bucket_cap_mb(SMALL_BUCKETS_MB);
        let (mut model, mut zero) =
            ShardedDataParallel::new(model, pg, config, Opt::Adam.sharded()).unwrap();
        if let Some(bytes) = state {
            zero.load_consolidated(bytes, "test state").unwrap();
        }
        for step in steps.clone() {
            // The test trains at world 1 only (and moves the state through 3 ranks without a
            // step): other world sizes would average other per-rank means.
            assert_eq!(world, 1, "train at world 1 only");
            let (x, y) = data(step, 0, 0);
            let loss = model.loss(x, y, uses_extra(step));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = zero.step(LR, model, grads).unwrap();
        }
        (
            flatten_params(&model).unwrap(),
            zero.consolidated_state().unwrap(),
        )
    });
    let (params, state) = out.into_iter().next().unwrap();
    (params, state.expect("rank 0 returns the state"))
}

#[test]
fn a_consolidated_state_resumes_at_another_world_size() {
    let start = flatten_params(&Net::new(0.0)).unwrap();
    // Uninterrupted: 4 steps on 1 rank.
    let (straight, _) = continue_from(1, &start, None, 0..4);
    // 2 steps on 1 rank, then the consolidated state moves through 3 ranks (each takes its
    // shard, and consolidating gives the same bytes back), then 2 more steps on 1 rank.
    let (half, state) = continue_from(1, &start, None, 0..2);
    let (same, through_3) = continue_from(3, &half, Some(&state), 0..0);
    assert_bit_identical(&same, &half, "no step, no change");
    assert_eq!(
        through_3, state,
        "consolidation at 3 ranks gives the same state"
    );
    let (resumed, _) = continue_from(1, &half, Some(&through_3), 2..4);
    assert_bit_identical(&resumed, &straight, "resumed after a world-size change");
    // Without the state, Adam would start its moments afresh and end elsewhere.
    let (fresh, _) = continue_from(1, &half, None, 2..4);
    assert!(fresh.iter().zip(&straight).any(|(a, b)| a != b));
}

#[test]
fn a_sharded_checkpoint_file_resumes_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let run = RunId {
        model: "net".into(),
        seed: 1,
        allow_mismatch: true,
    };
    let position = Position {
        epoch: 1,
        batch_in_epoch: 0,
        step: 2,
        loss_sum: 0.0,
    };
    // 2 ranks train 2 steps and save.
    let saved = run_ranks(2, |pg| {
        let config = ZeroConfig::new(ZeroStage::One);
        let (mut model, mut zero) =
            ShardedDataParallel::new(Net::new(0.0), pg.clone(), config, Opt::Adam.sharded())
                .unwrap();
        for step in 0..2 {
            let (x, y) = data(step, 0, pg.rank());
            let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
            model = zero.step(LR, model, grads).unwrap();
        }
        save_sharded_checkpoint(&pg, dir.path(), &run, &position, &model, &zero).unwrap();
        (
            flatten_params(&model).unwrap(),
            zero.consolidated_state().unwrap(),
        )
    });
    let path = ddp::checkpoint::checkpoint_path(dir.path());
    // 3 ranks resume it: the model's values and the optimizer state come back.
    let resumed = run_ranks(3, |pg| {
        let r = resume_sharded(&pg, &path, &run, Net::new(5.0)).unwrap();
        assert!(r.mismatch.as_deref().unwrap().contains("world size 2"));
        let config = ZeroConfig::new(ZeroStage::Two);
        let (model, mut zero) =
            ShardedDataParallel::new(r.model, pg, config, Opt::Adam.sharded()).unwrap();
        zero.load_consolidated(&r.optim_state.unwrap(), &path.display().to_string())
            .unwrap();
        (
            flatten_params(&model).unwrap(),
            zero.consolidated_state().unwrap(),
        )
    });
    assert_bit_identical(&resumed[0].0, &saved[0].0, "resumed parameters");
    assert_eq!(resumed[0].1, saved[0].1, "resumed optimizer state");
    // A state of another optimizer is refused, naming the field.
    let sgd = run_ranks(1, |pg| {
        let (_, mut zero) = ShardedDataParallel::new(
            Net::new(0.0),
            pg,
            ZeroConfig::new(ZeroStage::One),
            Opt::Sgd.sharded(),
        )
        .unwrap();
        zero.load_consolidated(saved[0].1.as_ref().unwrap(), "ck")
            .unwrap_err()
            .to_string()
    });
    assert!(sgd[0].contains("`optimizer`"), "{}", sgd[0]);
}

#[test]
fn each_rank_saves_and_reloads_its_own_shard() {
    let start = flatten_params(&Net::new(0.0)).unwrap();
    let out = run_ranks(3, |pg| {
        let model = load_flat_params(Net::new(0.0), &start).unwrap();
        let config = ZeroConfig::new(ZeroStage::Two).with_bucket_cap_mb(SMALL_BUCKETS_MB);
        let (mut model, mut zero) =
            ShardedDataParallel::new(model, pg.clone(), config.clone(), Opt::Adam.sharded())
                .unwrap();
        for step in 0..2 {
            let (x, y) = data(step, 0, pg.rank());
            let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
            model = zero.step(LR, model, grads).unwrap();
        }
        let mine = zero.shard_state().unwrap();
        let consolidated = zero.consolidated_state().unwrap();
        // A fresh wrapper takes this rank's shard back: the same consolidated state.
        let (_, mut fresh) =
            ShardedDataParallel::new(model, pg.clone(), config, Opt::Adam.sharded()).unwrap();
        fresh.load_shard_state(&mine, "mine").unwrap();
        let again = fresh.consolidated_state().unwrap();
        // A shard is not a consolidated state: refused, naming the field.
        let refused = fresh
            .load_consolidated(&mine, "mine")
            .unwrap_err()
            .to_string();
        (mine.len(), consolidated, again, refused)
    });
    let total: usize = out.iter().map(|o| o.0).sum();
    let (_, consolidated, again, refused) = &out[0];
    assert_eq!(again, consolidated, "a reloaded shard gives the same state");
    assert!(refused.contains("field `shard`"), "{refused}");
    // Each shard is about a third of the whole (plus its header).
    let whole = consolidated.as_ref().unwrap().len();
    assert!(out.iter().all(|o| o.0 < whole / 2), "{total} vs {whole}");
}

/// Trains `steps` steps of Adam at stage 2 on 3 ranks from `Net::new(offset)` and returns each
/// rank's shard file after every step (index k: after k + 1 steps).
fn shard_files(offset: f32, steps: usize) -> Vec<Vec<Vec<u8>>> {
    run_ranks(3, |pg| {
        let config = ZeroConfig::new(ZeroStage::Two).with_bucket_cap_mb(SMALL_BUCKETS_MB);
        let (mut model, mut zero) =
            ShardedDataParallel::new(Net::new(offset), pg.clone(), config, Opt::Adam.sharded())
                .unwrap();
        let mut files = Vec::new();
        for step in 0..steps {
            let (x, y) = data(step, 0, pg.rank());
            let grads = GradientsParams::from_grads(model.loss(x, y, true).backward(), &model);
            model = zero.step(LR, model, grads).unwrap();
            files.push(zero.shard_state().unwrap());
        }
        files
    })
}

#[test]
fn a_stale_or_foreign_shard_is_refused_on_every_rank() {
    // files[rank][k]: rank's shard after k + 1 steps.
    let files = shard_files(0.0, 3);
    // Another run of the same model and layout: its shards fit, but are not this run's.
    let foreign = shard_files(0.25, 3);
    let out = run_ranks(3, |pg| {
        let rank = pg.rank();
        let config = ZeroConfig::new(ZeroStage::Two).with_bucket_cap_mb(SMALL_BUCKETS_MB);
        let (_, mut zero) =
            ShardedDataParallel::new(Net::new(0.0), pg.clone(), config, Opt::Adam.sharded())
                .unwrap();
        let untouched = zero.shard_state().unwrap();
        let name = format!("shard-{rank}.bin");
        // A crash during the save of step 3: rank 1's file is still step 2's.
        let stale = if rank == 1 {
            &files[rank][1]
        } else {
            &files[rank][2]
        };
        let stale = zero
            .load_shard_state(stale, &name)
            .map_err(|e| e.to_string());
        let after_stale = zero.shard_state().unwrap();
        // Rank 2's file is the other run's step 3.
        let mixed = if rank == 2 {
            &foreign[rank][2]
        } else {
            &files[rank][2]
        };
        let mixed = zero
            .load_shard_state(mixed, &name)
            .map_err(|e| e.to_string());
        let after_foreign = zero.shard_state().unwrap();
        // One checkpoint's files: loaded, and saved again they are the same bytes.
        zero.load_shard_state(&files[rank][2], &name).unwrap();
        let loaded = zero.shard_state().unwrap();
        (
            stale.err(),
            mixed.err(),
            untouched == after_stale && untouched == after_foreign,
            loaded == files[rank][2],
        )
    });
    for (rank, (stale, foreign, unchanged, loaded)) in out.into_iter().enumerate() {
        let stale = stale.unwrap_or_else(|| panic!("rank {rank} loaded a stale shard"));
        assert!(
            stale.contains("rank 1") && stale.contains("step 2") && stale.contains("step 3"),
            "rank {rank}: {stale}"
        );
        let foreign = foreign.unwrap_or_else(|| panic!("rank {rank} loaded a foreign shard"));
        assert!(
            foreign.contains("rank 2") && foreign.contains("another run"),
            "rank {rank}: {foreign}"
        );
        if rank == 1 {
            // The stale rank names its own file too.
            assert!(stale.contains("shard-1.bin"), "rank {rank}: {stale}");
        }
        assert!(unchanged, "rank {rank}: a refused load changed the state");
        assert!(loaded, "rank {rank}: one checkpoint's shards load");
    }
}

#[test]
fn consolidating_hands_no_rank_more_than_one_shard_at_a_time() {
    let out = run_ranks(3, |pg| {
        let config = ZeroConfig::new(ZeroStage::One);
        let (_, zero) =
            ShardedDataParallel::new(Net::new(0.0), pg.clone(), config, Opt::Adam.sharded())
                .unwrap();
        let last = pg.flight_records().last().and_then(|r| r.seq);
        let state = zero.consolidated_state().unwrap();
        // What each collective handed this rank, in elements (an all-gather: every rank's).
        let received: Vec<u64> = pg
            .flight_records()
            .iter()
            .filter(|r| r.seq > last)
            .map(|r| match r.op.as_str() {
                "all_gather" => r.count * 3,
                _ => r.count,
            })
            .collect();
        (
            zero.memory().longest_shard as u64,
            received,
            state.is_some(),
        )
    });
    for (rank, (longest, received, has_state)) in out.into_iter().enumerate() {
        assert_eq!(has_state, rank == 0, "rank 0 alone returns the state");
        assert!(
            !received.is_empty(),
            "rank {rank}: consolidating communicates"
        );
        assert!(
            received.iter().all(|&n| n <= longest),
            "rank {rank}: a collective handed it {received:?} elements, a shard is {longest}"
        );
    }
}

#[test]
fn each_rank_keeps_a_quarter_of_the_state_at_four_ranks() {
    let memories = run_ranks(4, |pg| {
        let one = ShardedDataParallel::new(
            Net::new(0.0),
            pg.clone(),
            ZeroConfig::new(ZeroStage::One),
            Opt::Adam.sharded(),
        )
        .unwrap()
        .1
        .memory();
        let two = ShardedDataParallel::new(
            Net::new(0.0),
            pg,
            ZeroConfig::new(ZeroStage::Two),
            Opt::Adam.sharded(),
        )
        .unwrap()
        .1
        .memory();
        (one, two)
    });
    let shards: Vec<usize> = memories.iter().map(|(one, _)| one.shard).collect();
    // 226 = 57 + 57 + 56 + 56: balanced, every element owned once.
    assert_eq!(shards, vec![57, 57, 56, 56]);
    for (one, two) in &memories {
        assert_eq!(one.params, PARAMS);
        assert_eq!(one.optimizer_bytes, 2 * 4 * one.shard);
        assert_eq!(one.gradient_bytes, 4 * PARAMS);
        assert_eq!(two.gradient_bytes, 4 * two.shard);
    }
}

/// `steps` steps of `stage` with overlap on `world` ranks: the forward pass on the copy
/// `prepare` hooks, `backward_step` reduce-scatters during backward; `aux_on` says which ranks
/// add the loss of the `extra` layer in a step (`None`: `uses_extra`, the same on every rank).
/// Returns every rank's parameters and, per step, how many buckets left during backward.
fn train_overlapped(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    steps: usize,
    transport: Transport,
    aux_on: Option<&(dyn Fn(usize, usize) -> bool + Sync)>,
) -> Vec<(Vec<f32>, Vec<u64>)> {
    run_ranks_over(world, transport, |pg| {
        let rank = pg.rank();
        let config = ZeroConfig::new(stage)
            .with_bucket_cap_mb(SMALL_BUCKETS_MB)
            .with_first_bucket_mb(SMALL_BUCKETS_MB)
            .with_overlap(true);
        let (mut model, mut zero) =
            ShardedDataParallel::new(Net::new(rank as f32), pg, config, opt.sharded()).unwrap();
        if world > 1 {
            assert_eq!(zero.why_no_overlap(&model), None, "overlap is on");
        }
        let mut early = Vec::new();
        for step in 0..steps {
            let (x, y) = data(step, 0, rank);
            let extra = aux_on.map_or(uses_extra(step), |f| f(step, rank));
            // The hooked copy lives for the forward pass only.
            let loss = zero.prepare(&model).loss(x, y, extra);
            model = zero
                .backward_step(LR, model, loss)
                .unwrap_or_else(|e| panic!("rank {rank}, step {step}: {e}"));
            early.push(zero.take_stats().buckets_during_backward);
        }
        (flatten_params(&model).unwrap(), early)
    })
}

/// DDP without overlap, with `aux_on` deciding per step and rank whether `extra` is used.
fn train_ddp_aux(
    world: usize,
    opt: Opt,
    steps: usize,
    transport: Transport,
    aux_on: &(dyn Fn(usize, usize) -> bool + Sync),
) -> Vec<Vec<f32>> {
    run_ranks_over(world, transport, |pg| {
        let rank = pg.rank();
        let config = DdpConfig::new()
            .with_bucket_cap_mb(SMALL_BUCKETS_MB)
            .with_first_bucket_mb(SMALL_BUCKETS_MB);
        let (mut model, mut ddp) =
            DistributedDataParallel::new(Net::new(rank as f32), pg, config).unwrap();
        let mut optim = opt.burn();
        for step in 0..steps {
            let (x, y) = data(step, 0, rank);
            let loss = model.loss(x, y, aux_on(step, rank));
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = ddp.sync(&model, grads).unwrap();
            model = optim.step(LR, model, grads);
        }
        flatten_params(&model).unwrap()
    })
}

#[test]
fn with_overlap_stages_1_and_2_equal_ddp_bit_for_bit() {
    for (world, transport) in [
        (1, Transport::Auto),
        (2, Transport::Auto),
        (3, Transport::Auto),
        (2, Transport::Tcp),
    ] {
        for opt in [Opt::Adam, Opt::Sgd] {
            let ddp = train(world, None, opt, 1, 6, transport);
            for stage in [ZeroStage::One, ZeroStage::Two] {
                let what = format!("{transport:?}, world {world}, {opt:?}, {stage:?}, overlap");
                let out = train_overlapped(world, stage, opt, 6, transport, None);
                let zero: Vec<Vec<f32>> = out.iter().map(|(p, _)| p.clone()).collect();
                assert_replicas_equal(&zero, &what);
                assert_bit_identical(&zero[0], &ddp[0], &what);
                if world > 1 {
                    // After the first step (which measures the graph's depth), buckets leave
                    // during backward, except in the steps without `extra`: declared last, it
                    // leads bucket 0, which waits for the end of backward without a gradient
                    // (and every bucket after it).
                    for (r, (_, early)) in out.iter().enumerate() {
                        let expected: Vec<bool> = (1..6).map(uses_extra).collect();
                        let seen: Vec<bool> = early[1..].iter().map(|&n| n > 0).collect();
                        assert_eq!(seen, expected, "{what}, rank {r}: {early:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn with_overlap_a_gradient_on_some_ranks_only_still_equals_ddp() {
    // `extra` has a gradient on rank 1 only in even steps, on no rank in odd ones: its bucket
    // waits for the end of backward on the other ranks, and rank 1's goes out during it.
    let aux_on = |step: usize, rank: usize| step.is_multiple_of(2) && rank == 1;
    for (world, transport) in [(2, Transport::Auto), (3, Transport::Tcp)] {
        let ddp = train_ddp_aux(world, Opt::Adam, 4, transport, &aux_on);
        let start = flatten_params(&Net::new(0.0)).unwrap();
        let extra = PARAMS - (HIDDEN * OUT + OUT)..PARAMS;
        assert!(
            ddp[0][extra.clone()]
                .iter()
                .zip(&start[extra])
                .any(|(a, b)| a != b),
            "rank 1's gradient of `extra` reaches every replica"
        );
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let what = format!("{transport:?}, world {world}, {stage:?}");
            let out = train_overlapped(world, stage, Opt::Adam, 4, transport, Some(&aux_on));
            let zero: Vec<Vec<f32>> = out.into_iter().map(|(p, _)| p).collect();
            assert_replicas_equal(&zero, &what);
            assert_bit_identical(&zero[0], &ddp[0], &what);
        }
    }
}

/// Trains 6 steps on `world` ranks with Adam and global-norm clipping at `max_norm`: DDP with
/// burn's Adam when `stage` is `None`, else ZeRO. Returns every rank's final parameters and
/// the norm reported at each step.
fn train_clipped(
    world: usize,
    stage: Option<ZeroStage>,
    max_norm: Option<f32>,
) -> Vec<(Vec<f32>, Vec<Option<f32>>)> {
    run_ranks(world, |pg| {
        let rank = pg.rank();
        let model = Net::new(rank as f32);
        let grads_of = |model: &Net, step: usize| {
            let (x, y) = data(step, 0, rank);
            let loss = model.loss(x, y, uses_extra(step));
            GradientsParams::from_grads(loss.backward(), model)
        };
        let mut norms = Vec::new();
        match stage {
            None => {
                let config = DdpConfig::new()
                    .with_bucket_cap_mb(SMALL_BUCKETS_MB)
                    .with_first_bucket_mb(SMALL_BUCKETS_MB)
                    .with_max_grad_norm(max_norm);
                let (mut model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
                let mut optim = Opt::Adam.burn();
                for step in 0..6 {
                    let grads = ddp.sync(&model, grads_of(&model, step)).unwrap();
                    norms.push(ddp.grad_norm());
                    model = optim.step(LR, model, grads);
                }
                (flatten_params(&model).unwrap(), norms)
            }
            Some(stage) => {
                let config = ZeroConfig::new(stage)
                    .with_bucket_cap_mb(SMALL_BUCKETS_MB)
                    .with_first_bucket_mb(SMALL_BUCKETS_MB)
                    .with_max_grad_norm(max_norm);
                let (mut model, mut zero) =
                    ShardedDataParallel::new(model, pg, config, Opt::Adam.sharded()).unwrap();
                for step in 0..6 {
                    let grads = grads_of(&model, step);
                    model = zero.step(LR, model, grads).unwrap();
                    norms.push(zero.grad_norm());
                }
                (flatten_params(&model).unwrap(), norms)
            }
        }
    })
}

#[test]
fn with_clipping_stages_1_and_2_equal_ddp_bit_for_bit() {
    const MAX: f32 = 0.3;
    for world in 1..=3 {
        let ddp = train_clipped(world, None, Some(MAX));
        let params: Vec<Vec<f32>> = ddp.iter().map(|(p, _)| p.clone()).collect();
        assert_replicas_equal(&params, "ddp, clipped");
        let norms = &ddp[0].1;
        assert!(norms.iter().all(Option::is_some), "a norm every step");
        assert!(
            norms.iter().any(|n| n.unwrap() > MAX),
            "some steps are clipped: {norms:?}"
        );
        for (r, (_, n)) in ddp.iter().enumerate() {
            assert_eq!(n, norms, "rank {r}'s norms");
        }
        let plain = train_clipped(world, None, None);
        assert!(plain[0].1.iter().all(Option::is_none));
        assert_ne!(plain[0].0, ddp[0].0, "clipping changed the run");
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let what = format!("world {world}, {stage:?}, clipped");
            let zero = train_clipped(world, Some(stage), Some(MAX));
            let zero_params: Vec<Vec<f32>> = zero.iter().map(|(p, _)| p.clone()).collect();
            assert_replicas_equal(&zero_params, &what);
            assert_bit_identical(&zero[0].0, &ddp[0].0, &what);
            let bits =
                |n: &[Option<f32>]| n.iter().map(|x| x.unwrap().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&zero[0].1), bits(norms), "{what}: the norms");
        }
    }
}

/// The gradient of `net` in `grads`, flat in visiting order (zeros for a missing one).
fn grad_values(net: &Net, grads: &GradientsParams) -> Vec<f32> {
    let mut out = Vec::new();
    for layer in [&net.a, &net.b, &net.extra] {
        let w = grads
            .get::<2>(layer.weight.id)
            .map(|g| g.into_data().try_to_vec::<f32>().unwrap());
        out.extend(w.unwrap_or_else(|| vec![0.0; layer.weight.val().dims().iter().product()]));
        let bias = layer.bias.as_ref().unwrap();
        let b = grads
            .get::<1>(bias.id)
            .map(|g| g.into_data().try_to_vec::<f32>().unwrap());
        out.extend(b.unwrap_or_else(|| vec![0.0; bias.val().dims()[0]]));
    }
    out
}

/// One clipped SGD step at two ranks, in DDP and ZeRO 2, against the formula computed by hand
/// in f64 from burn's own gradients of each rank's batch: the average, its 2-norm, the factor
/// `max / (norm + 1e-6)`, `p - lr * factor * g`.
#[test]
fn a_clipped_step_matches_the_formula() {
    const MAX: f32 = 0.05;
    let start = flatten_params(&Net::new(0.0)).unwrap();
    let per_rank: Vec<Vec<f64>> = (0..2)
        .map(|rank| {
            let net = Net::new(0.0);
            let (x, y) = data(0, 0, rank);
            let grads = GradientsParams::from_grads(net.loss(x, y, true).backward(), &net);
            grad_values(&net, &grads)
                .into_iter()
                .map(f64::from)
                .collect()
        })
        .collect();
    let avg: Vec<f64> = (0..PARAMS)
        .map(|i| (per_rank[0][i] + per_rank[1][i]) / 2.0)
        .collect();
    let norm = avg.iter().map(|g| g * g).sum::<f64>().sqrt();
    let factor = MAX as f64 / (norm + 1e-6);
    assert!(factor < 0.5, "the step is clipped (norm {norm})");
    let expected: Vec<f64> = (0..PARAMS)
        .map(|i| start[i] as f64 - LR * factor * avg[i])
        .collect();
    for stage in [None, Some(ZeroStage::Two)] {
        let got = run_ranks(2, |pg| {
            let rank = pg.rank();
            let net = Net::new(0.0);
            let (x, y) = data(0, 0, rank);
            let sgd = || SgdConfig::new().init();
            match stage {
                None => {
                    let config = DdpConfig::new().with_max_grad_norm(Some(MAX));
                    let (net, mut ddp) = DistributedDataParallel::new(net, pg, config).unwrap();
                    let grads = GradientsParams::from_grads(net.loss(x, y, true).backward(), &net);
                    let grads = ddp.sync(&net, grads).unwrap();
                    let net = sgd().step(LR, net, grads);
                    (flatten_params(&net).unwrap(), ddp.grad_norm().unwrap())
                }
                Some(stage) => {
                    let config = ZeroConfig::new(stage).with_max_grad_norm(Some(MAX));
                    let sgd = ShardOptimizer::Sgd(ShardedSgdConfig::new());
                    let (net, mut zero) = ShardedDataParallel::new(net, pg, config, sgd).unwrap();
                    let grads = GradientsParams::from_grads(net.loss(x, y, true).backward(), &net);
                    let net = zero.step(LR, net, grads).unwrap();
                    (flatten_params(&net).unwrap(), zero.grad_norm().unwrap())
                }
            }
        });
        let (params, reported) = &got[0];
        assert!(
            (*reported as f64 - norm).abs() <= 1e-6 * norm,
            "{stage:?}: norm {reported} vs {norm}"
        );
        for (i, (&p, &e)) in params.iter().zip(&expected).enumerate() {
            assert!(
                (p as f64 - e).abs() < 1e-6,
                "{stage:?}: element {i}: {p} vs {e}"
            );
        }
    }
}
