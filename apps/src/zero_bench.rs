//! `ddp-zero-bench`: what ZeRO sharding saves and costs, one rank of one configuration per
//! process (`cargo xtask bench-zero` runs it under `ddprun` for every world size and stage).
//!
//! The model is the MNIST MLP made wide (784 → `hidden` → 10; 64000 hidden units give 50.9 M
//! parameters), so that Adam's state (8 bytes per parameter) dominates a rank's memory. Each
//! rank trains `warmup + steps` steps on its own synthetic batch with Adam, either plain DDP
//! (stage 0: `DistributedDataParallel` and `ddp::FusedAdam`, the trainers' Adam; with
//! `DDP_BENCH_ADAM=burn` in the environment burn's own `Adam`, whose steps are the same bit for
//! bit, so that `bench-zero` can time both in one run) or `ShardedDataParallel` (stages 1, 2).
//! A step's time is the slowest rank's (all-gathered), from a barrier to the end of the
//! optimizer step; the median over the timed steps is reported.
//!
//! Rank 0 prints one line `ZERO_BENCH {json}` with, per rank: the optimizer state and the
//! gradient buffers the wrapper keeps between steps (bytes, from the layout), the peak resident
//! memory (`getrusage`'s maximum RSS, the whole process), and the bytes handed to collectives
//! per step with the bytes a ring sends per rank for them (all-reduce of B: 2(N-1)/N·B;
//! reduce-scatter of B: (N-1)/N·B; all-gather of N blocks of S: (N-1)·S).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp::{
    CommHookKind, Compression, DdpConfig, DistributedDataParallel, FusedAdam, PowerSgdConfig,
    ProcessGroup, ReduceOp, ShardOptimizer, ShardedAdamConfig, ShardedDataParallel, ZeroConfig,
    ZeroStage,
};
use ddp_models::{Classifier, DeepMlpConfig, MnistCnnConfig, MnistMlpConfig};
use serde::Serialize;

use crate::options::HookKind;

/// Settings of one measurement.
#[derive(Debug, Clone, clap::Args)]
pub struct ZeroBenchArgs {
    /// ZeRO stage: 0 (plain DDP), 1 or 2.
    #[arg(long, default_value_t = 0)]
    pub stage: u8,
    /// Hidden units of the MLP (784 → hidden → 10).
    #[arg(long, default_value_t = 64000)]
    pub hidden: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// The model: `mlp` (784 → hidden → 10), `deep` (784 → 4 × `hidden` → 10, the overlap
    /// benchmark's) or `cnn` (the MNIST CNN).
    #[arg(long, default_value = "mlp")]
    pub model: String,
    /// Start the all-reduces (stage 0) or reduce-scatters (stages 1, 2) during backward
    /// (`DdpConfig::overlap`, `ZeroConfig::overlap`); `--overlap false` turns it off
    /// [default: DDP's default].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub overlap: Option<bool>,
    /// The bucket size in MiB (DDP's and ZeRO's).
    #[arg(long, default_value_t = 25.0)]
    pub bucket_cap_mb: f64,
    /// How stage 0 averages each bucket (`cargo xtask bench-powersgd`): all-reduce in f32
    /// (`none`), bf16 or f16, or PowerSGD (`powersgd`).
    #[arg(long, value_enum, default_value = "none")]
    pub comm_hook: HookKind,
    /// With `--comm-hook powersgd`: the rank of each gradient's approximation.
    #[arg(long, default_value_t = 1)]
    pub powersgd_rank: usize,
    /// With `--comm-hook powersgd`: steps all-reduced plain first (warm-up steps included).
    #[arg(long, default_value_t = 1000)]
    pub powersgd_start: u64,
}

/// What rank 0 prints.
#[derive(Debug, Serialize)]
pub struct ZeroBenchResult {
    /// The stage.
    pub stage: u8,
    /// Ranks.
    pub world: usize,
    /// Trainable parameters.
    pub params: usize,
    /// Adam state each rank keeps (rank 0's), bytes.
    pub optimizer_bytes: usize,
    /// Gradient buffers each rank keeps between steps (rank 0's), bytes.
    pub gradient_bytes: usize,
    /// Peak RSS of every rank, MiB.
    pub peak_rss_mib: Vec<f64>,
    /// Median step time (slowest rank), seconds.
    pub step_s: f64,
    /// Bytes rank 0 handed to collectives per step.
    pub collective_bytes: u64,
    /// Bytes a ring sends per rank per step for those collectives.
    pub ring_sent_bytes: u64,
    /// A sharded step's phases on rank 0, seconds per step: gradients packed and
    /// reduce-scattered, the shard's update, parameters all-gathered and loaded.
    pub phases_s: Option<[f64; 3]>,
    /// The model.
    pub model: String,
    /// Whether the all-reduces ran during backward.
    pub overlap: bool,
    /// Rank 0's gradient synchronisation after backward per step (DDP: pack + wait + unpack),
    /// seconds: what overlap shortens.
    pub sync_s: Option<f64>,
    /// Bytes rank 0's network interfaces other than `lo` sent per timed step (DDP only;
    /// `/proc/net/dev` of its network namespace, TCP/IP headers included): the wire's figure
    /// where each rank has a namespace of its own, as `bench-powersgd` runs it.
    pub wire_bytes_per_step: Option<f64>,
}

/// Bytes sent so far by every network interface of this namespace except `lo`
/// (`/proc/net/dev`'s ninth field); `None` where it cannot be read.
fn tx_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/net/dev").ok()?;
    let mut total = 0u64;
    for line in text.lines().skip(2) {
        let (name, fields) = line.split_once(':')?;
        if name.trim() != "lo" {
            total += fields.split_whitespace().nth(8)?.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

/// What rank 0 prints: [`ZeroBenchResult`]'s fields and the backward's own time.
#[derive(Debug, Serialize)]
pub struct ZeroBenchReport {
    /// The measurement.
    #[serde(flatten)]
    pub result: ZeroBenchResult,
    /// Rank 0's backward itself per step (DDP: the time of `backward` less `sync_s`), seconds:
    /// with the all-reduces after backward, the compute that overlap can hide them behind.
    pub backward_s: Option<f64>,
}

/// Runs one rank of the benchmark; rank 0 returns the result.
pub fn run(args: &ZeroBenchArgs) -> Result<Option<ZeroBenchResult>> {
    Ok(report(args)?.map(|r| r.result))
}

/// [`run`], with the backward's own time: what `ddp-zero-bench` prints.
pub fn report(args: &ZeroBenchArgs) -> Result<Option<ZeroBenchReport>> {
    if args.stage > 2 || args.steps == 0 || args.batch == 0 {
        bail!("--stage must be 0, 1 or 2, --steps and --batch at least 1");
    }
    if args.stage > 0 && args.comm_hook != HookKind::None {
        bail!(
            "--comm-hook {:?} needs --stage 0 (ZeRO reduce-scatters f32 gradients)",
            args.comm_hook
        );
    }
    let pg = Arc::new(ProcessGroup::from_env()?);
    let device = Device::flex().autodiff();
    match args.model.as_str() {
        "mlp" => {
            let model = MnistMlpConfig::new().with_hidden(args.hidden).init(&device);
            run_model(args, pg, &device, model)
        }
        "deep" => {
            let model = DeepMlpConfig::new().with_hidden(args.hidden).init(&device);
            run_model(args, pg, &device, model)
        }
        "cnn" => run_model(args, pg, &device, MnistCnnConfig::new().init(&device)),
        other => bail!("--model {other}: expected mlp, deep or cnn"),
    }
}

/// [`report`] for one model.
fn run_model<M: Module + Classifier<4>>(
    args: &ZeroBenchArgs,
    pg: Arc<ProcessGroup>,
    device: &Device,
    model: M,
) -> Result<Option<ZeroBenchReport>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    // A fixed synthetic batch per rank (the figures do not depend on the values).
    let x: Vec<f32> = (0..args.batch * 784)
        .map(|i| ((i * 7919 + rank * 104_729) % 255) as f32 / 255.0)
        .collect();
    let y: Vec<i64> = (0..args.batch).map(|i| ((i + rank) % 10) as i64).collect();
    let inputs = Tensor::<4>::from_data(TensorData::new(x, [args.batch, 1, 28, 28]), device);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(y, [args.batch]), device);
    let lr = 1e-4;
    let eps = 1e-8;
    let (mut sync_s, mut backward_s) = (None, None);
    let (mut sent_before, mut wire_bytes_per_step) = (None, None);
    let overlap = args.overlap.unwrap_or(DdpConfig::new().overlap);

    let mut times = Vec::with_capacity(args.steps);
    let params;
    let optimizer_bytes;
    let gradient_bytes;
    let collective_bytes;
    let ring_sent_bytes;
    let mut phases = None;
    let n = world as u64;
    if args.stage == 0 {
        let (compression, comm_hook) = match args.comm_hook {
            HookKind::None => (Compression::None, CommHookKind::AllReduce),
            HookKind::Bf16 => (Compression::Bf16, CommHookKind::AllReduce),
            HookKind::F16 => (Compression::F16, CommHookKind::AllReduce),
            HookKind::Powersgd => (
                Compression::None,
                CommHookKind::PowerSgd(
                    PowerSgdConfig::new()
                        .with_matrix_approximation_rank(args.powersgd_rank)
                        .with_start_powersgd_iter(args.powersgd_start),
                ),
            ),
        };
        let config = DdpConfig::new()
            .with_overlap(overlap)
            .with_bucket_cap_mb(args.bucket_cap_mb)
            .with_compression(compression)
            .with_comm_hook(comm_hook);
        let (mut model, mut ddp) = DistributedDataParallel::new(model, pg.clone(), config)?;
        let mut optim = if std::env::var("DDP_BENCH_ADAM").is_ok_and(|v| v == "burn") {
            AdamConfig::new().with_epsilon(eps).init()
        } else {
            FusedAdam::init(&ShardedAdamConfig::new().with_epsilon(eps))
        };
        let mut backward_calls = 0.0;
        for step in 0..args.warmup + args.steps {
            pg.barrier()?;
            if step == args.warmup {
                ddp.take_stats();
                sent_before = tx_bytes();
            }
            let start = Instant::now();
            let hooked = ddp.prepare(&model);
            let (loss, _) = hooked.loss(inputs.clone(), targets.clone());
            let backward_start = Instant::now();
            let grads = ddp.backward(&model, loss)?;
            let backward_call = backward_start.elapsed().as_secs_f64();
            model = optim.step(lr, model, grads);
            if step >= args.warmup {
                times.push(start.elapsed().as_secs_f64());
                backward_calls += backward_call;
            }
        }
        pg.barrier()?;
        wire_bytes_per_step = sent_before
            .zip(tx_bytes())
            .map(|(a, b)| b.saturating_sub(a) as f64 / args.steps as f64);
        params = ddp
            .params()
            .iter()
            .filter(|p| p.trainable())
            .map(|p| p.numel())
            .sum();
        // burn's Adam: two f32 moments per trainable element.
        optimizer_bytes = 8 * params;
        let stats = ddp.take_stats();
        let sync = stats.total().as_secs_f64() / stats.steps.max(1) as f64;
        sync_s = Some(sync);
        backward_s = Some((backward_calls / args.steps.max(1) as f64 - sync).max(0.0));
        collective_bytes = stats.bytes / stats.steps.max(1);
        // DDP's pipeline keeps no buffer between steps: each gradient goes back to burn.
        gradient_bytes = 0;
        ring_sent_bytes = 2 * (n - 1) * collective_bytes / n;
    } else {
        let stage = if args.stage == 1 {
            ZeroStage::One
        } else {
            ZeroStage::Two
        };
        let adam = ShardOptimizer::Adam(ShardedAdamConfig::new().with_epsilon(eps));
        let config = ZeroConfig::new(stage)
            .with_overlap(overlap)
            .with_bucket_cap_mb(args.bucket_cap_mb);
        let (mut model, mut zero) = ShardedDataParallel::new(model, pg.clone(), config, adam)?;
        for step in 0..args.warmup + args.steps {
            pg.barrier()?;
            let start = Instant::now();
            // The hooked copy lives for the forward pass only: the step then updates the
            // parameters in their own memory.
            let (loss, _) = zero.prepare(&model).loss(inputs.clone(), targets.clone());
            model = zero.backward_step(lr, model, loss)?;
            if step >= args.warmup {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        let memory = zero.memory();
        params = memory.params;
        optimizer_bytes = memory.optimizer_bytes;
        gradient_bytes = memory.gradient_bytes;
        let stats = zero.take_stats();
        let per = |d: std::time::Duration| d.as_secs_f64() / stats.steps.max(1) as f64;
        phases = Some([per(stats.reduce), per(stats.update), per(stats.gather)]);
        collective_bytes = stats.bytes / stats.steps.max(1);
        // Reduce-scatter of the whole gradient, all-gather of the longest shard from each.
        let longest = memory.longest_shard as u64;
        ring_sent_bytes = (n - 1) * 4 * params as u64 / n + (n - 1) * 4 * longest;
    }
    // The slowest rank's time of every step.
    let slowest = pg.all_reduce(times, ReduceOp::Max)?;
    let rss = pg.all_gather(vec![crate::train::peak_rss_mib()])?;
    if rank != 0 {
        return Ok(None);
    }
    let mut sorted = slowest;
    sorted.sort_by(f64::total_cmp);
    let result = ZeroBenchResult {
        stage: args.stage,
        world,
        params,
        optimizer_bytes,
        gradient_bytes,
        peak_rss_mib: rss,
        step_s: sorted[sorted.len() / 2],
        collective_bytes,
        ring_sent_bytes,
        phases_s: phases,
        model: args.model.clone(),
        overlap,
        sync_s,
        wire_bytes_per_step,
    };
    Ok(Some(ZeroBenchReport { result, backward_s }))
}
