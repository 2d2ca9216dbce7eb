//! The step loop of a fixed membership, shared by `train-mnist`, `train-pima` and `train-gpt`
//! (the frame around it, [`crate::fit::train`], also runs the elastic one): a plain burn loop
//! with the few lines DDP adds (wrap the model, set the sampler's epoch, sync the gradients), an
//! exact evaluation over every test sample once, checkpoints and metrics on rank 0; and
//! [`start`], what every trainer does first.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use ddp::{DdpError, Position, RunId, SyncStats};
use ddp_comm::ProcessGroup;
use ddp_data::{
    Batch, BatchSource, DataLoader, DistributedSampler, LoaderConfig, ShardLoader,
    ShardLoaderConfig,
};
use ddp_models::Classifier;

use crate::frame::{checkpoint_to_resume, eval_pad, local_eval, step_seed, sum_eval, Ending, Say};
pub use crate::frame::{peak_rss_mib, Data, RunSummary, Task};
use crate::metrics::{EpochMetrics, MetricsWriter};
use crate::options::TrainConfig;
use crate::stepper::{self, Stepper};
use crate::trace::{trace_step, Tracer};

/// One rank's batches of a split, epoch after epoch, from memory or from shards.
enum Feed<S, const D: usize> {
    Memory {
        loader: DataLoader<S, D>,
        sampler: DistributedSampler,
        batch_size: usize,
        drop_last: bool,
    },
    Shards {
        loader: ShardLoader<D>,
        device: Device,
        batch_size: usize,
        drop_last: bool,
    },
}

impl<S: BatchSource<D> + 'static, const D: usize> Feed<S, D> {
    /// The training feed (`eval` false: shuffled, padded) or the evaluation feed (`eval` true:
    /// every sample once across ranks) of `data`, cut to `limit` samples. The training feed
    /// drops each epoch's last partial batch with `cfg.drop_last`.
    fn new(
        data: Data<S>,
        cfg: &TrainConfig,
        (world, rank): (usize, usize),
        device: Device,
        eval: bool,
        limit: Option<usize>,
    ) -> Result<Self> {
        let (batch_size, drop_last) = (cfg.batch_size, cfg.drop_last && !eval);
        Ok(match data {
            Data::Memory(set) => {
                let len = limit.map_or(set.len(), |n| n.min(set.len()));
                let config = LoaderConfig {
                    batch_size: cfg.batch_size,
                    num_workers: cfg.workers,
                    ..LoaderConfig::default()
                };
                let sampler = if eval {
                    DistributedSampler::exact(len, world, rank)?
                } else {
                    DistributedSampler::new(len, world, rank)?.with_seed(cfg.seed)
                };
                Feed::Memory {
                    loader: DataLoader::new(set, config, device)?,
                    sampler,
                    batch_size,
                    drop_last,
                }
            }
            Data::Shards(set) => {
                let set = match limit {
                    Some(n) => set.limit(n)?,
                    None => set,
                };
                let config = ShardLoaderConfig {
                    batch_size: cfg.batch_size,
                    prefetch_shards: cfg.prefetch_shards,
                    seed: cfg.seed,
                    ..ShardLoaderConfig::default()
                };
                let loader = if eval {
                    ShardLoader::exact(set, world, rank, config)?
                } else {
                    ShardLoader::new(set, world, rank, config)?
                };
                Feed::Shards {
                    loader,
                    device,
                    batch_size,
                    drop_last,
                }
            }
        })
    }

    /// Samples in the (possibly cut) split.
    fn len(&self) -> usize {
        match self {
            Feed::Memory { sampler, .. } => sampler.dataset_len(),
            Feed::Shards { loader, .. } => loader.set().len(),
        }
    }

    /// Samples this rank visits per epoch.
    fn num_samples(&self) -> usize {
        match self {
            Feed::Memory { sampler, .. } => sampler.num_samples(),
            Feed::Shards { loader, .. } => loader.num_samples(),
        }
    }

    /// Batches this rank takes per epoch (with `drop_last`, the full ones only).
    fn num_batches(&self) -> usize {
        let (batch_size, drop_last) = match self {
            Feed::Memory {
                batch_size,
                drop_last,
                ..
            }
            | Feed::Shards {
                batch_size,
                drop_last,
                ..
            } => (*batch_size, *drop_last),
        };
        if drop_last {
            return self.num_samples() / batch_size.max(1);
        }
        match self {
            Feed::Memory {
                loader, sampler, ..
            } => loader.num_batches(sampler.num_samples()),
            Feed::Shards { loader, .. } => loader.num_batches(),
        }
    }

    fn set_epoch(&mut self, epoch: u64) {
        match self {
            Feed::Memory { sampler, .. } => sampler.set_epoch(epoch),
            Feed::Shards { loader, .. } => loader.set_epoch(epoch),
        }
    }

    /// The batches of the current epoch.
    fn batches(&self) -> Result<Box<dyn Iterator<Item = Result<Batch<D>>> + '_>> {
        self.batches_from(0)
    }

    /// The batches of the current epoch after the first `skip` (where a run resumed from a
    /// mid-epoch checkpoint continues). In memory the skipped samples are never built; from
    /// shards they are read (the shard order fixes which samples come next) but not turned into
    /// tensors.
    fn batches_from(&self, skip: usize) -> Result<Box<dyn Iterator<Item = Result<Batch<D>>> + '_>> {
        // With drop_last, the partial batch at the end is never built.
        let left = self.num_batches().saturating_sub(skip);
        Ok(match self {
            Feed::Memory {
                loader,
                sampler,
                batch_size,
                ..
            } => {
                let mut indices = sampler.indices();
                indices.drain(..skip.saturating_mul(*batch_size).min(indices.len()));
                Box::new(loader.iter(indices)?.take(left).map(Ok))
            }
            Feed::Shards { loader, device, .. } => Box::new(
                loader
                    .iter()?
                    .skip(skip)
                    .take(left)
                    .map(move |b| Ok(b.map_err(anyhow::Error::from)?.into_tensors(device))),
            ),
        })
    }
}

/// Trains `task` with the settings in `cfg` on every rank of `pg`, a fixed membership (the
/// elastic loop is `elastic.rs`'s; [`crate::fit::train`] chooses).
pub(crate) fn run<M, S, const D: usize>(
    cfg: &TrainConfig,
    pg: Arc<ProcessGroup>,
    device: Device,
    task: Task<M, S>,
    started: Instant,
) -> Result<Ending<M>>
where
    M: Module + Classifier<D>,
    S: BatchSource<D> + 'static,
{
    let (rank, world) = (pg.rank(), pg.world_size());
    let say = Say {
        on: rank == 0 || cfg.verbose,
    };
    // The learning rate of the step last taken (the schedule's, a function of the step).
    let mut lr = cfg.scaled_lr(world);
    let Task {
        name,
        model,
        train,
        test,
    } = task;

    let restart = ddp_comm::elastic::restart_count();
    let start = resume(cfg, &pg, &say, &name, restart, model)?;
    let Start {
        epoch: start_epoch,
        batch: start_batch,
        loss_sum: start_loss_sum,
        mut step,
        saved_state,
        ..
    } = start;
    let (mut model, optim) = (start.model, start.optim);
    let kill_at = test_kill_step(rank, world, restart);

    let (wrapped, mut stepper) = Stepper::new(cfg, pg.clone(), model, optim, saved_state)?;
    model = wrapped;

    let ranks = (world, rank);
    let mut train_feed =
        Feed::<S, D>::new(train, cfg, ranks, device.clone(), false, cfg.train_samples)?;
    // Evaluation runs without autodiff (`model.valid()`), on the same hardware.
    let test_feed = Feed::<S, D>::new(
        test,
        cfg,
        ranks,
        device.clone().inner(),
        true,
        cfg.test_samples,
    )?;
    let (train_len, test_len) = (train_feed.len(), test_feed.len());
    let steps_per_epoch = train_feed.num_batches();

    say.line(format!(
        "training {name}: world {world} (launcher: {}; {} compute threads per rank), \
         {train_len} training samples ({} per rank, {} steps per epoch{}), {test_len} test \
         samples, batch {} per rank, {}, {}, {}, {} epochs from epoch {}",
        pg.config().launcher,
        rayon::current_num_threads(),
        train_feed.num_samples(),
        steps_per_epoch,
        match train_feed.num_samples() % cfg.batch_size {
            n if n > 0 && cfg.drop_last => format!("; the last partial batch of {n} dropped"),
            _ => String::new(),
        },
        cfg.batch_size,
        cfg.describe_lr(world),
        cfg.describe_optimizer(),
        stepper.describe(&model, cfg.overlap),
        cfg.epochs,
        start_epoch + 1
    ));

    let mut metrics = match (&cfg.metrics_dir, rank) {
        (Some(dir), 0) => Some(MetricsWriter::create(dir)?),
        _ => None,
    };
    let mut summary = RunSummary::new(&name, world, cfg.metrics_dir.clone());
    (summary.epochs, summary.steps) = (start_epoch, step);
    let mut tracer = match &cfg.trace_dir {
        Some(dir) => Some(Tracer::new(dir, rank, cfg.trace_steps.clone())?),
        None => None,
    };
    let mut train_time = Duration::ZERO;
    let mut samples_done: u64 = 0;
    let at_limit = |step: u64| cfg.max_steps.is_some_and(|m| step >= m);

    for epoch in start_epoch..cfg.epochs {
        if at_limit(step) {
            break;
        }
        train_feed.set_epoch(epoch as u64);
        // Dropout masks depend on (seed, epoch, rank) only, so a resumed run matches.
        // The batches of this epoch done before a resume (mid-epoch checkpoint).
        let skip = if epoch == start_epoch { start_batch } else { 0 };
        let epoch_start = Instant::now();
        let bar = progress_bar(rank == 0, steps_per_epoch as u64, epoch + 1);
        if let Some(bar) = &bar {
            bar.set_position(skip.min(steps_per_epoch) as u64);
        }
        let mut loss_sum = if skip > 0 { start_loss_sum } else { 0.0 };
        let mut batches = skip;
        let mut epoch_samples = 0u64;
        let mut epoch_comm = SyncStats::default();
        let mut interval = Interval::new();
        let mut feed = train_feed.batches_from(skip)?;
        loop {
            if at_limit(step) {
                break;
            }
            let traced = tracer.as_ref().is_some_and(|t| t.covers(step + 1));
            let t_data = Instant::now();
            let Some(batch) = feed.next() else {
                break;
            };
            let batch = batch?;
            let t_forward = Instant::now();
            let n = batch.targets.dims()[0];
            // Dropout masks depend on (seed, epoch, rank, batch) only, so that a run resumed in
            // the middle of an epoch draws the masks an uninterrupted run draws.
            device.seed(step_seed(
                cfg.seed,
                epoch as u64,
                rank as u64,
                batches as u64,
            ));
            // The forward pass on the copy `prepare` gives (hooked for overlap); the copy goes
            // with the statement, so that a sharded step updates the parameters in place.
            let (loss, _) = stepper.prepare(&model).loss(batch.inputs, batch.targets);
            let loss_value = f64::from(loss.clone().into_scalar::<f32>());
            let t_backward = Instant::now();
            lr = cfg.lr_at(world, step);
            let (stepped, t_sync, t_optim) = stepper.step(lr, model, loss, traced)?;
            model = stepped;
            let t_end = Instant::now();
            step += 1;
            if epoch == start_epoch && batches == skip {
                // On a GPU the first step compiles and tunes burn's kernels (or finds them in
                // the kernel cache): the figure a restart or a second job cares about.
                say.line(format!(
                    "first step done {:.1} s after the trainer started",
                    (t_end - started).as_secs_f64()
                ));
            }
            batches += 1;
            epoch_samples += n as u64;
            loss_sum += loss_value;
            if let (true, Some(tracer)) = (traced, tracer.as_mut()) {
                let marks = [t_data, t_forward, t_backward, t_sync, t_optim, t_end];
                trace_step(
                    tracer,
                    step,
                    marks,
                    stepper.take_spans(),
                    &pg.flight_records(),
                );
                if tracer.done_after(step) {
                    if let Some(path) = tracer.write()? {
                        say.line(format!(
                            "trace of steps {:?} in {}",
                            cfg.trace_steps,
                            path.display()
                        ));
                    }
                }
            }
            interval.add(loss_value, n);
            let at_interval = step.is_multiple_of(cfg.log_interval as u64);
            if at_interval {
                let comm = stepper.take_stats();
                epoch_comm.add(&comm);
                if let Some(m) = metrics.as_mut() {
                    m.write_scalars(step, &interval.scalars(lr, world, &comm))?;
                }
                interval = Interval::new();
            }
            if let Some(bar) = &bar {
                bar.inc(1);
                bar.set_message(format!("loss {loss_value:.4}"));
            } else if at_interval {
                say.line(format!(
                    "epoch {} step {step} ({batches}/{steps_per_epoch}) lr {lr:.4e} loss \
                     {loss_value:.6}",
                    epoch + 1
                ));
            }
            // A mid-epoch checkpoint (the epoch's end, or a stop at --max-steps, writes its own).
            let mid_epoch = batches < steps_per_epoch && !at_limit(step);
            if mid_epoch && cfg.checkpoint_every.is_some_and(|k| step.is_multiple_of(k)) {
                let position = (epoch, batches, loss_sum);
                let saved = save_checkpoint(cfg, &pg, &name, position, step, &model, &stepper)?;
                if let Some(path) = saved {
                    tracing::info!("step {step}: checkpoint {}", path.display());
                    summary.checkpoint = Some(path);
                }
            }
            if kill_at == Some(step) {
                eprintln!(
                    "test hook DDP_TEST_KILL_AT_STEP: rank {rank} kills itself after step {step}"
                );
                // SAFETY: raise has no memory-safety preconditions.
                unsafe { libc::raise(libc::SIGKILL) };
            }
        }
        drop(feed);
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        let elapsed = epoch_start.elapsed();
        train_time += elapsed;
        samples_done += epoch_samples;
        let mut comm = stepper.take_stats();
        comm.add(&epoch_comm);
        summary.add_comm(&comm);

        let local = local_eval(&model, test_feed.batches()?, eval_pad(cfg))?;
        let (correct, total, test_loss) = sum_eval(&pg, local)?;
        let accuracy = correct as f64 / total.max(1) as f64;
        let train_loss = loss_sum / batches.max(1) as f64;
        let samples_per_sec = (epoch_samples * world as u64) as f64 / elapsed.as_secs_f64();
        summary.epochs = epoch + 1;
        summary.steps = step;
        summary.test_accuracy = accuracy;
        summary.test_correct = correct;
        summary.test_total = total;
        summary.train_loss = train_loss;
        say.line(format!(
            "epoch {}: train loss {train_loss:.4}, test accuracy {:.2}% ({correct}/{total}), \
             test loss {test_loss:.4}, {samples_per_sec:.0} samples/s, {:.2} s in \
             communication ({:.1}% of {:.1} s)",
            epoch + 1,
            100.0 * accuracy,
            comm.total().as_secs_f64(),
            100.0 * comm.total().as_secs_f64() / elapsed.as_secs_f64(),
            elapsed.as_secs_f64()
        ));
        if let Some(m) = metrics.as_mut() {
            m.write(&EpochMetrics {
                epoch: epoch + 1,
                step,
                train_loss,
                test_accuracy: accuracy,
                test_loss,
                samples_per_sec,
                learning_rate: lr,
                comm_seconds: comm.total().as_secs_f64(),
            })?;
        }
        // An epoch cut short by --max-steps is saved as the mid-epoch position it is, so that a
        // resumed run finishes the epoch.
        let position = if batches < steps_per_epoch {
            (epoch, batches, loss_sum)
        } else {
            (epoch + 1, 0, 0.0)
        };
        if let Some(path) = save_checkpoint(cfg, &pg, &name, position, step, &model, &stepper)? {
            summary.checkpoint = Some(path);
        }
    }

    if let Some(tracer) = tracer.as_mut() {
        if let Some(path) = tracer.write()? {
            say.line(format!(
                "trace of steps {:?} (up to step {step}) in {}",
                cfg.trace_steps,
                path.display()
            ));
        }
    }
    summary.samples_per_sec = if train_time.is_zero() {
        0.0
    } else {
        (samples_done * world as u64) as f64 / train_time.as_secs_f64()
    };
    let detail = format!("{:.0} samples/s", summary.samples_per_sec);
    Ok(Ending {
        model,
        rank,
        summary,
        detail,
        group: Some(pg),
        elastic_json: None,
    })
}

/// Where a run starts: a fresh model and optimizer, or what a checkpoint holds.
struct Start<M> {
    model: M,
    optim: ModuleOptimizer,
    /// Epochs completed.
    epoch: usize,
    /// Batches of the next epoch done (a mid-epoch checkpoint).
    batch: usize,
    /// This rank's loss sum over those batches.
    loss_sum: f64,
    /// Optimizer steps completed.
    step: u64,
    /// The state [`Stepper::new`] loads, with the file it came from.
    saved_state: Option<(Vec<u8>, String)>,
}

/// The start of a run: fresh, or resumed from the checkpoint [`checkpoint_to_resume`] names
/// (with `--resume`, or in a process its launcher restarted, `restart` > 0). Rank 0 reads the
/// checkpoint and broadcasts it, so that the other ranks (on other nodes perhaps) need no
/// access to the file.
fn resume<M: Module>(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    say: &Say,
    name: &str,
    restart: usize,
    model: M,
) -> Result<Start<M>> {
    let rank = pg.rank();
    let mut start = Start {
        model,
        optim: stepper::burn_optimizer(cfg),
        epoch: 0,
        batch: 0,
        loss_sum: 0.0,
        step: 0,
        saved_state: None,
    };
    let Some(path) = checkpoint_to_resume(cfg, restart > 0)? else {
        return Ok(start);
    };
    if !cfg.resume {
        say.line(format!(
            "restart {restart} of the job ({}={restart}): resuming from {}",
            ddp_comm::elastic::RESTART_COUNT_ENV,
            cfg.checkpoint_dir.as_deref().unwrap_or(&path).display()
        ));
    }
    let run = run_id(cfg, name);
    let resumed = match stepper::resume(cfg, pg, &path, &run, start.model, start.optim) {
        Err(DdpError::CheckpointMismatch { path, what }) => bail!(
            "{path} was written by a run with {what}: resuming would not continue that run \
             (another data order and other dropout masks); pass \
             --allow-mismatched-checkpoint to resume from it anyway"
        ),
        other => other?,
    };
    let (resumed, state) = resumed;
    start.saved_state = state.map(|bytes| (bytes, path.display().to_string()));
    (start.model, start.optim) = (resumed.model, resumed.optim);
    if let Some(what) = &resumed.mismatch {
        tracing::warn!(
            "{} was written by a run with {what}; resuming anyway",
            path.display()
        );
        say.line(format!(
            "warning: {} was written by a run with {what}; resuming anyway \
             (--allow-mismatched-checkpoint)",
            path.display()
        ));
    }
    let Some(meta) = resumed.meta else {
        say.line(format!(
            "no checkpoint at {}: starting fresh",
            path.display()
        ));
        return Ok(start);
    };
    start.epoch = meta.epoch;
    start.batch = usize::try_from(meta.batch_in_epoch).unwrap_or(usize::MAX);
    start.loss_sum = meta.epoch_loss_sums.get(rank).copied().unwrap_or(0.0);
    start.step = meta.step;
    if start.batch > 0 {
        say.line(format!(
            "resuming from {} (mid-epoch: step {}, epoch {} continues after its batch {})",
            path.display(),
            start.step,
            start.epoch + 1,
            start.batch
        ));
    } else {
        say.line(format!(
            "resuming from {} (epoch {}, step {})",
            path.display(),
            start.epoch,
            start.step
        ));
    }
    Ok(start)
}

/// What the TensorBoard curves show every `--log-interval` steps, gathered since the last point.
struct Interval {
    start: Instant,
    loss_sum: f64,
    steps: u64,
    samples: u64,
}

impl Interval {
    fn new() -> Interval {
        Interval {
            start: Instant::now(),
            loss_sum: 0.0,
            steps: 0,
            samples: 0,
        }
    }

    fn add(&mut self, loss: f64, samples: usize) {
        self.loss_sum += loss;
        self.steps += 1;
        self.samples += samples as u64;
    }

    /// The scalars of this interval: rank 0's mean loss, the learning rate, samples/s of all
    /// ranks together (assuming equal batches) and the time spent in gradient synchronisation.
    fn scalars(&self, lr: f64, world: usize, comm: &SyncStats) -> [(&'static str, f64); 5] {
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        let comm_secs = comm.total().as_secs_f64();
        [
            ("train/loss", self.loss_sum / self.steps.max(1) as f64),
            ("train/learning_rate", lr),
            (
                "train/samples_per_sec",
                (self.samples * world as u64) as f64 / secs,
            ),
            ("train/comm_seconds", comm_secs),
            ("train/comm_fraction", comm_secs / secs),
        ]
    }
}

fn progress_bar(rank0: bool, len: u64, epoch: usize) -> Option<indicatif::ProgressBar> {
    if !rank0 || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "epoch {prefix} [{bar:30}] {pos}/{len} {per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_prefix(epoch.to_string());
    Some(bar)
}

/// The test hook of `--checkpoint-every`'s documentation: the global step after which this
/// rank kills itself, when `DDP_TEST_KILL_AT_STEP` asks for it on this attempt and this rank
/// (`DDP_TEST_KILL_RANK`, default the last rank) and the launcher has not restarted the job.
fn test_kill_step(rank: usize, world: usize, restart: usize) -> Option<u64> {
    let step = std::env::var("DDP_TEST_KILL_AT_STEP")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let victim = match std::env::var("DDP_TEST_KILL_RANK") {
        Ok(r) => r.trim().parse().ok()?,
        Err(_) => world - 1,
    };
    (restart == 0 && rank == victim).then_some(step)
}

/// Writes a checkpoint of the run at `position` (epochs completed, batches of the next epoch
/// done, this rank's loss sum over them) after global step `step`, when the run has a
/// checkpoint directory: every rank takes part (`ddp::save_checkpoint`), rank 0 writes the
/// file atomically and returns its path.
fn save_checkpoint<M: Module>(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    name: &str,
    (epoch, batch_in_epoch, loss_sum): (usize, usize, f64),
    step: u64,
    model: &M,
    stepper: &Stepper,
) -> Result<Option<PathBuf>> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok(None);
    };
    let position = Position {
        epoch,
        batch_in_epoch,
        step,
        loss_sum,
    };
    Ok(stepper.save(pg, dir, &run_id(cfg, name), &position, model)?)
}

/// What identifies this run in its checkpoints.
fn run_id(cfg: &TrainConfig, name: &str) -> RunId {
    RunId {
        model: name.to_string(),
        seed: cfg.seed,
        allow_mismatch: cfg.allow_mismatched_checkpoint,
    }
}

/// What [`start`] hands a trainer: its settings, its process group and its device.
pub struct Started {
    /// The resolved settings.
    pub cfg: TrainConfig,
    /// The process group of this rank.
    pub pg: Arc<ProcessGroup>,
    /// Where this rank trains, recording gradients: burn's CPU backend (`Device::flex()`), or
    /// with `--backend cuda` the GPU of `LOCAL_RANK`.
    pub device: Device,
}

/// What every trainer does first: logging, settings (flags over `--config` over `defaults`),
/// the backend check, the process group from the environment, the GPU of `--backend cuda`, and
/// the compute threads.
pub fn start(
    args: &crate::options::TrainArgs,
    defaults: &crate::options::TrainArgs,
) -> Result<Started> {
    init_logging();
    let cfg = args.resolve(defaults)?;
    if cfg.zero_stage > 0 {
        // Sharding is for memory: large blocks back to the OS when freed (alloc.rs says why).
        let limit = crate::alloc::large_blocks_from_the_os();
        tracing::debug!(
            "ZeRO stage {}: mimalloc's large blocks: {limit:?}",
            cfg.zero_stage
        );
    }
    let built_in = |feature: &str| match feature {
        "cuda" => cfg!(feature = "cuda"),
        "wgpu" => cfg!(feature = "wgpu"),
        _ => true,
    };
    if cfg.backend.feature().is_some_and(|f| !built_in(f)) {
        let program = std::env::args_os()
            .next()
            .map(std::path::PathBuf::from)
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "trainer".to_string());
        bail!("{}", cfg.backend.missing_feature_error(&program));
    }
    // An elastic run forms its groups itself, once its model is built (`elastic.rs`).
    let elastic = cfg.elastic_range().is_some();
    let pg = Arc::new(match elastic {
        true => ProcessGroup::builder().no_env().build()?,
        false => ProcessGroup::from_env().context("joining the process group")?,
    });
    tracing::info!(
        "rank {} of {} joined the process group (local rank {})",
        pg.rank(),
        pg.world_size(),
        pg.local_rank()
    );
    let device = match cfg.backend {
        #[cfg(feature = "cuda")]
        crate::options::BackendKind::Cuda => crate::gpu::cuda_device(&pg)?,
        #[cfg(feature = "wgpu")]
        backend @ (crate::options::BackendKind::Wgpu
        | crate::options::BackendKind::Vulkan
        | crate::options::BackendKind::Metal) => crate::gpu::wgpu_device(&pg, backend)?,
        _ => Device::flex(),
    }
    .autodiff();
    let local_world = match elastic {
        true => ddp_comm::GroupConfig::from_env().map_or(1, |c| c.local_world_size),
        false => pg.local_world_size(),
    };
    set_compute_threads(threads_per_rank(cfg.threads, local_world))?;
    Ok(Started { cfg, pg, device })
}

/// Compute threads for this rank: `threads` when given, else the cores divided among the
/// local ranks (at least one), so that N ranks on one host do not oversubscribe it.
pub fn threads_per_rank(threads: usize, local_world_size: usize) -> usize {
    if threads > 0 {
        return threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_world_size.max(1)).max(1)
}

/// Sizes burn's CPU thread pool (rayon's global pool). Call before any tensor work.
pub fn set_compute_threads(threads: usize) -> Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("setting the compute thread pool")
}

/// Logging for the binaries: `RUST_LOG` drives tracing (warnings by default).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Colours only on a terminal: under ddprun, or redirected to a file, stderr is not one.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}
