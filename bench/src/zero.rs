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
//!
//! With `--overlap-pairs` ([`overlap_pairs`], `cargo xtask bench-overlap`) a stage-0 run
//! alternates its steps with and without overlap instead, and rank 0 prints one line
//! `OVERLAP_PAIRS {json}` ([`OverlapPairs`]).

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

use ddp_apps::options::HookKind;

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

/// What rank 0 prints for `ddp-zero-bench --overlap-pairs` ([`overlap_pairs`]): one DDP run
/// (stage 0) whose timed steps alternate between the all-reduces during backward (the forward
/// pass on `prepare`'s hooked copy) and after it (on the model itself), in the order on, off,
/// off, on, on, off, ..., so that both are timed in the same processes, on the same memory,
/// under the same load, and neither always follows the other. On this kind of shared 2-core
/// machine the same configuration's step time moves by up to 15 % from one pair of processes
/// to the next, more than overlap changes it on one host; within one run it does not.
#[derive(Debug, Serialize)]
pub struct OverlapPairs {
    /// The model.
    pub model: String,
    /// Ranks.
    pub world: usize,
    /// Timed pairs (one step each way).
    pub pairs: usize,
    /// Median step time (the slowest rank's) with the all-reduces during backward, seconds.
    pub on_step_s: f64,
    /// Median step time (the slowest rank's) with the all-reduces after backward, seconds.
    pub off_step_s: f64,
    /// The median over the pairs of (step after backward / step during backward): the
    /// speed-up overlap gives.
    pub speedup: f64,
    /// Rank 0's synchronisation after backward per step with overlap (what it left to wait
    /// for), seconds.
    pub on_sync_s: f64,
    /// Rank 0's synchronisation after backward per step without overlap (pack + wait +
    /// unpack: what overlap can hide), seconds.
    pub off_sync_s: f64,
    /// Rank 0's backward itself per step without overlap (the compute overlap hides the
    /// all-reduces behind), seconds.
    pub off_backward_s: f64,
    /// Rank 0's backward per step with overlap (longer than without by the hooks' work and
    /// by the communication's CPU time where the cores are all busy), seconds.
    pub on_backward_s: f64,
    /// All-reduces started during backward per step with overlap (rank 0): 0 would mean the
    /// hooks never fired.
    pub buckets_during_backward: f64,
}

/// Runs one rank of the benchmark; rank 0 returns the result.
pub fn run(args: &ZeroBenchArgs) -> Result<Option<ZeroBenchResult>> {
    Ok(report(args)?.map(|r| r.result))
}

/// [`run`], with the backward's own time: what `ddp-zero-bench` prints.
pub fn report(args: &ZeroBenchArgs) -> Result<Option<ZeroBenchReport>> {
    match measure(args, false)? {
        Some(Measured::Report(report)) => Ok(Some(report)),
        Some(Measured::Pairs(_)) => bail!("a paired run was measured for a report"),
        None => Ok(None),
    }
}

/// One rank of a run whose steps alternate with and without overlap (see [`OverlapPairs`]):
/// stage 0, `--overlap` not false, `--steps` even; rank 0 returns the result.
pub fn overlap_pairs(args: &ZeroBenchArgs) -> Result<Option<OverlapPairs>> {
    if args.stage != 0 || args.overlap == Some(false) {
        bail!("--overlap-pairs times plain DDP (--stage 0) with and without --overlap");
    }
    if !args.steps.is_multiple_of(2) || args.warmup < 2 {
        bail!("--overlap-pairs needs an even --steps and --warmup 2 or more (one step each way)");
    }
    match measure(args, true)? {
        Some(Measured::Pairs(pairs)) => Ok(Some(pairs)),
        Some(Measured::Report(_)) => bail!("a report was measured for a paired run"),
        None => Ok(None),
    }
}

/// What [`measure`] gives rank 0.
enum Measured {
    Report(ZeroBenchReport),
    Pairs(OverlapPairs),
}

/// One rank of [`report`] (`pairs` false) or [`overlap_pairs`].
fn measure(args: &ZeroBenchArgs, pairs: bool) -> Result<Option<Measured>> {
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
            run_model(args, pg, &device, model, pairs)
        }
        "deep" => {
            let model = DeepMlpConfig::new().with_hidden(args.hidden).init(&device);
            run_model(args, pg, &device, model, pairs)
        }
        "cnn" => run_model(
            args,
            pg,
            &device,
            MnistCnnConfig::new().init(&device),
            pairs,
        ),
        other => bail!("--model {other}: expected mlp, deep or cnn"),
    }
}

/// Adam's learning rate in every configuration.
const LR: f64 = 1e-4;
/// Adam's epsilon in every configuration.
const EPS: f32 = 1e-8;

/// Whether step `t` of a paired run (counted from the first timed step) runs with overlap: on,
/// off, off, on, on, off, ... (the warm-up steps alternate on, off).
fn paired_on(t: usize) -> bool {
    (t / 2 + t).is_multiple_of(2)
}

/// [`measure`] for one model.
fn run_model<M: Module + Classifier<4>>(
    args: &ZeroBenchArgs,
    pg: Arc<ProcessGroup>,
    device: &Device,
    model: M,
    pairs: bool,
) -> Result<Option<Measured>> {
    let (rank, world) = (pg.rank(), pg.world_size());
    // A fixed synthetic batch per rank (the figures do not depend on the values).
    let x: Vec<f32> = (0..args.batch * 784)
        .map(|i| ((i * 7919 + rank * 104_729) % 255) as f32 / 255.0)
        .collect();
    let y: Vec<i64> = (0..args.batch).map(|i| ((i + rank) % 10) as i64).collect();
    let inputs = Tensor::<4>::from_data(TensorData::new(x, [args.batch, 1, 28, 28]), device);
    let targets = Tensor::<1, Int>::from_data(TensorData::new(y, [args.batch]), device);
    if pairs {
        let warmup = args.warmup;
        let hooked = |step: usize| match step.checked_sub(warmup) {
            Some(t) => paired_on(t),
            None => step.is_multiple_of(2),
        };
        let run = ddp_steps(args, &pg, model, &inputs, &targets, true, hooked)?;
        let times = run.steps.iter().map(|s| s.time).collect();
        let slowest = pg.all_reduce(times, ReduceOp::Max)?;
        if rank != 0 {
            return Ok(None);
        }
        return Ok(Some(Measured::Pairs(paired_figures(
            args, world, &run, &slowest,
        ))));
    }
    let (mut sync_s, mut backward_s) = (None, None);
    let mut wire_bytes_per_step = None;
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
        let run = ddp_steps(args, &pg, model, &inputs, &targets, overlap, |_| true)?;
        times = run.steps.iter().map(|s| s.time).collect();
        wire_bytes_per_step = run.wire_bytes_per_step;
        params = run.params;
        // burn's Adam: two f32 moments per trainable element.
        optimizer_bytes = 8 * params;
        let per_step =
            |f: &dyn Fn(&DdpStep) -> f64| run.steps.iter().map(f).sum::<f64>() / args.steps as f64;
        let sync = per_step(&|s| s.sync);
        sync_s = Some(sync);
        backward_s = Some(per_step(&|s| s.backward_call - s.sync).max(0.0));
        collective_bytes = run.collective_bytes;
        // DDP's pipeline keeps no buffer between steps: each gradient goes back to burn.
        gradient_bytes = 0;
        ring_sent_bytes = 2 * (n - 1) * collective_bytes / n;
    } else {
        let stage = if args.stage == 1 {
            ZeroStage::One
        } else {
            ZeroStage::Two
        };
        let adam = ShardOptimizer::Adam(ShardedAdamConfig::new().with_epsilon(EPS));
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
            model = zero.backward_step(LR, model, loss)?;
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
    let rss = pg.all_gather(vec![ddp_apps::train::peak_rss_mib()])?;
    if rank != 0 {
        return Ok(None);
    }
    let result = ZeroBenchResult {
        stage: args.stage,
        world,
        params,
        optimizer_bytes,
        gradient_bytes,
        peak_rss_mib: rss,
        step_s: median(slowest),
        collective_bytes,
        ring_sent_bytes,
        phases_s: phases,
        model: args.model.clone(),
        overlap,
        sync_s,
        wire_bytes_per_step,
    };
    Ok(Some(Measured::Report(ZeroBenchReport {
        result,
        backward_s,
    })))
}

/// One DDP step's figures on this rank.
struct DdpStep {
    /// From the barrier to the end of the optimizer step, seconds.
    time: f64,
    /// The wrapper's synchronisation after backward (pack + wait + unpack), seconds.
    sync: f64,
    /// The `backward` call (backward itself and the sync), seconds.
    backward_call: f64,
    /// Whether the forward pass ran on `prepare`'s hooked copy.
    hooked: bool,
    /// All-reduces started during backward.
    during: u64,
}

/// The timed steps of [`ddp_steps`] and what the run handed to collectives.
struct DdpRun {
    steps: Vec<DdpStep>,
    /// Trainable parameters.
    params: usize,
    /// Bytes handed to collectives per timed step.
    collective_bytes: u64,
    /// Bytes sent by the network interfaces other than `lo` per timed step.
    wire_bytes_per_step: Option<f64>,
}

/// Stage 0: `warmup + steps` DDP steps with Adam (`FusedAdam`, or burn's with
/// `DDP_BENCH_ADAM=burn`), the forward pass on `prepare`'s hooked copy at the steps where
/// `hooked(step)` holds and on the model itself elsewhere (`backward` then all-reduces after
/// backward); the timed steps' figures.
fn ddp_steps<M: Module + Classifier<4>>(
    args: &ZeroBenchArgs,
    pg: &Arc<ProcessGroup>,
    model: M,
    inputs: &Tensor<4>,
    targets: &Tensor<1, Int>,
    overlap: bool,
    hooked: impl Fn(usize) -> bool,
) -> Result<DdpRun> {
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
        AdamConfig::new().with_epsilon(EPS).init()
    } else {
        FusedAdam::init(&ShardedAdamConfig::new().with_epsilon(EPS))
    };
    let mut steps = Vec::with_capacity(args.steps);
    let (mut sent_before, mut bytes) = (None, 0);
    for step in 0..args.warmup + args.steps {
        pg.barrier()?;
        if step == args.warmup {
            sent_before = tx_bytes();
        }
        let start = Instant::now();
        let hook = hooked(step);
        let forward = if hook {
            ddp.prepare(&model)
        } else {
            model.clone()
        };
        let (loss, _) = forward.loss(inputs.clone(), targets.clone());
        let backward_start = Instant::now();
        let grads = ddp.backward(&model, loss)?;
        let backward_call = backward_start.elapsed().as_secs_f64();
        model = optim.step(LR, model, grads);
        let time = start.elapsed().as_secs_f64();
        let stats = ddp.take_stats();
        if step >= args.warmup {
            bytes += stats.bytes;
            steps.push(DdpStep {
                time,
                sync: stats.total().as_secs_f64(),
                backward_call,
                hooked: hook,
                during: stats.buckets_during_backward,
            });
        }
    }
    pg.barrier()?;
    let wire_bytes_per_step = sent_before
        .zip(tx_bytes())
        .map(|(a, b)| b.saturating_sub(a) as f64 / args.steps as f64);
    let params = ddp
        .params()
        .iter()
        .filter(|p| p.trainable())
        .map(|p| p.numel())
        .sum();
    Ok(DdpRun {
        steps,
        params,
        collective_bytes: bytes / args.steps as u64,
        wire_bytes_per_step,
    })
}

/// The median of `v` (the upper one of an even count; NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Rank 0's [`OverlapPairs`] from its paired run and every step's slowest time.
fn paired_figures(
    args: &ZeroBenchArgs,
    world: usize,
    run: &DdpRun,
    slowest: &[f64],
) -> OverlapPairs {
    // The median slowest-rank time of the steps with (`on`) or without overlap.
    let step_time = |on: bool| {
        let picked = run
            .steps
            .iter()
            .zip(slowest)
            .filter(|(s, _)| s.hooked == on);
        median(picked.map(|(_, t)| *t).collect())
    };
    let mean = |on: bool, f: &dyn Fn(&DdpStep) -> f64| {
        let picked: Vec<f64> = run.steps.iter().filter(|s| s.hooked == on).map(f).collect();
        picked.iter().sum::<f64>() / picked.len().max(1) as f64
    };
    // Pair k is timed steps 2k and 2k + 1, one of each kind.
    let ratios = (0..args.steps / 2)
        .map(|k| {
            let (a, b) = (2 * k, 2 * k + 1);
            let (on, off) = if run.steps[a].hooked { (a, b) } else { (b, a) };
            slowest[off] / slowest[on]
        })
        .collect();
    OverlapPairs {
        model: args.model.clone(),
        world,
        pairs: args.steps / 2,
        on_step_s: step_time(true),
        off_step_s: step_time(false),
        speedup: median(ratios),
        on_sync_s: mean(true, &|s| s.sync),
        off_sync_s: mean(false, &|s| s.sync),
        off_backward_s: mean(false, &|s| (s.backward_call - s.sync).max(0.0)),
        on_backward_s: mean(true, &|s| (s.backward_call - s.sync).max(0.0)),
        buckets_during_backward: mean(true, &|s| s.during as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order on, off, off, on, ...: every pair has one step of each kind, and neither kind
    /// always comes first.
    #[test]
    fn paired_steps_alternate_in_balanced_pairs() {
        let order: Vec<bool> = (0..8).map(paired_on).collect();
        assert_eq!(order, [true, false, false, true, true, false, false, true]);
    }

    /// The speed-up is the median of each pair's off / on, whichever came first in the pair.
    #[test]
    fn the_speed_up_is_the_median_over_pairs() {
        let step = |hooked| DdpStep {
            time: 0.0,
            sync: 0.0,
            backward_call: 0.0,
            hooked,
            during: 1,
        };
        let run = DdpRun {
            steps: (0..6).map(|t| step(paired_on(t))).collect(),
            params: 1,
            collective_bytes: 0,
            wire_bytes_per_step: None,
        };
        // Pairs (on, off), (off, on), (on, off): ratios 1.2, 1.5, 0.9.
        let slowest = [1.0, 1.2, 3.0, 2.0, 1.0, 0.9];
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: ZeroBenchArgs,
        }
        let args = <Cli as clap::Parser>::parse_from(["bench", "--steps", "6"]).args;
        let figures = paired_figures(&args, 2, &run, &slowest);
        assert_eq!(figures.pairs, 3);
        assert!((figures.speedup - 1.2).abs() < 1e-12, "{}", figures.speedup);
        assert_eq!(figures.on_step_s, 1.0);
        assert_eq!(figures.off_step_s, 1.2);
    }
}
