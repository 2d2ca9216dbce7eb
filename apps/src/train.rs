//! The training loop shared by `train-mnist` and `train-pima`: a plain burn loop with the few
//! lines DDP adds (wrap the model, set the sampler's epoch, sync the gradients), an exact
//! evaluation over every test sample once, checkpoints and metrics on rank 0.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use burn::module::AutodiffModule;
use burn::optim::momentum::MomentumConfig;
use burn::optim::GradientsParams;
use burn::optim::{AdamConfig, Optimizer, SgdConfig};
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ElementConversion;
use ddp::{Compression, DdpConfig, DistributedDataParallel, SyncPhase, SyncSpan, SyncStats};
use ddp_comm::{CollectiveRecord, ProcessGroup, ReduceOp};
use ddp_data::{
    Batch, BatchSource, DataLoader, DistributedSampler, LoaderConfig, ShardLoader,
    ShardLoaderConfig, ShardSet,
};
use ddp_models::Classifier;
use serde::Serialize;
use serde_json::json;

use crate::checkpoint::{self, CheckpointMeta};
use crate::metrics::{EpochMetrics, MetricsWriter};
use crate::options::{CompressionKind, OptimizerKind, TrainConfig};
use crate::trace::{Tracer, Track};

type Bytes = BinBytesRecorder<FullPrecisionSettings>;

/// What a finished run reports (rank 0 prints it; every rank returns it).
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// Model name.
    pub model: String,
    /// World size.
    pub world_size: usize,
    /// Epochs completed (including those before a resume).
    pub epochs: usize,
    /// Optimizer steps completed.
    pub steps: u64,
    /// Test accuracy after the last epoch.
    pub test_accuracy: f64,
    /// Correctly classified test samples after the last epoch.
    pub test_correct: u64,
    /// Test samples evaluated (each exactly once).
    pub test_total: u64,
    /// Mean training loss of the last epoch.
    pub train_loss: f64,
    /// Training samples per second over this run, all ranks together.
    pub samples_per_sec: f64,
    /// Seconds spent in gradient synchronisation on this rank (pack + wait + unpack).
    pub comm_seconds: f64,
    /// Of which: copying gradients into buckets and submitting them.
    pub pack_seconds: f64,
    /// Of which: blocked waiting for all-reduces.
    pub wait_seconds: f64,
    /// Of which: turning reduced buckets back into gradient tensors.
    pub unpack_seconds: f64,
    /// Wall time of this process's run, in seconds.
    pub wall_seconds: f64,
    /// Peak resident memory of each rank in MiB, in rank order.
    pub peak_rss_mib: Vec<f64>,
    /// Final parameters hash (FNV-1a of the f32 values), for reproducibility checks.
    pub params_hash: String,
    /// The checkpoint written last, if any.
    pub checkpoint: Option<PathBuf>,
    /// The safetensors export, if any.
    pub export: Option<PathBuf>,
    /// The metrics directory, if any.
    pub metrics_dir: Option<PathBuf>,
}

/// A model, its data and its name: what a trainer hands to [`train`].
pub struct Task<M, S> {
    /// Short model name, stored in checkpoints (`cnn`, `mlp`, `pima-mlp`).
    pub name: String,
    /// The freshly initialised model (rank 0's values win at the start).
    pub model: M,
    /// Training set.
    pub train: Data<S>,
    /// Test set.
    pub test: Data<S>,
}

/// Where a split's samples come from.
pub enum Data<S> {
    /// The whole split in memory, served by [`DataLoader`] over a [`DistributedSampler`].
    Memory(Arc<S>),
    /// Safetensors shards on disk, streamed by [`ShardLoader`] (each rank reads its shards).
    Shards(ShardSet),
}

impl<S> From<Arc<S>> for Data<S> {
    fn from(set: Arc<S>) -> Data<S> {
        Data::Memory(set)
    }
}

/// One rank's batches of a split, epoch after epoch, from memory or from shards.
enum Feed<B: Backend, S, const D: usize> {
    Memory {
        loader: DataLoader<B, S, D>,
        sampler: DistributedSampler,
    },
    Shards {
        loader: ShardLoader<D>,
        device: B::Device,
    },
}

impl<B: Backend, S: BatchSource<D> + 'static, const D: usize> Feed<B, S, D> {
    /// The training feed (`eval` false: shuffled, padded) or the evaluation feed (`eval` true:
    /// every sample once across ranks) of `data`, cut to `limit` samples.
    fn new(
        data: Data<S>,
        cfg: &TrainConfig,
        (world, rank): (usize, usize),
        device: B::Device,
        eval: bool,
        limit: Option<usize>,
    ) -> Result<Self> {
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
                Feed::Shards { loader, device }
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

    /// Batches this rank takes per epoch.
    fn num_batches(&self) -> usize {
        match self {
            Feed::Memory { loader, sampler } => loader.num_batches(sampler.num_samples()),
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
    fn batches(&self) -> Result<Box<dyn Iterator<Item = Result<Batch<B, D>>> + '_>> {
        Ok(match self {
            Feed::Memory { loader, sampler } => Box::new(loader.iter(sampler.indices())?.map(Ok)),
            Feed::Shards { loader, device } => Box::new(
                loader
                    .iter()?
                    .map(move |b| Ok(b.map_err(anyhow::Error::from)?.into_tensors(device))),
            ),
        })
    }
}

/// Trains `task` with the settings in `cfg` on every rank of `pg`.
pub fn train<B, M, S, const D: usize>(
    cfg: &TrainConfig,
    pg: Arc<ProcessGroup>,
    device: B::Device,
    task: Task<M, S>,
) -> Result<RunSummary>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Classifier<B, D>,
    M::InnerModule: Classifier<B::InnerBackend, D>,
    S: BatchSource<D> + 'static,
{
    match cfg.optimizer {
        OptimizerKind::Adam => {
            let optim = AdamConfig::new().with_epsilon(1e-8).init::<B, M>();
            run(cfg, pg, device, task, optim)
        }
        OptimizerKind::Sgd => {
            let momentum =
                (cfg.momentum > 0.0).then(|| MomentumConfig::new().with_momentum(cfg.momentum));
            let optim = SgdConfig::new().with_momentum(momentum).init::<B, M>();
            run(cfg, pg, device, task, optim)
        }
    }
}

/// Prints on rank 0, or on every rank with `--verbose`.
struct Say {
    on: bool,
}

impl Say {
    fn line(&self, text: impl AsRef<str>) {
        if self.on {
            println!("{}", text.as_ref());
        }
    }
}

fn run<B, M, S, O, const D: usize>(
    cfg: &TrainConfig,
    pg: Arc<ProcessGroup>,
    device: B::Device,
    task: Task<M, S>,
    mut optim: O,
) -> Result<RunSummary>
where
    B: AutodiffBackend,
    M: AutodiffModule<B> + Classifier<B, D>,
    M::InnerModule: Classifier<B::InnerBackend, D>,
    S: BatchSource<D> + 'static,
    O: Optimizer<M, B>,
{
    let started = Instant::now();
    let (rank, world) = (pg.rank(), pg.world_size());
    let say = Say {
        on: rank == 0 || cfg.verbose,
    };
    let lr = cfg.scaled_lr(world);
    let Task {
        name,
        mut model,
        train,
        test,
    } = task;

    // Resume: every rank reads the checkpoint (rank 0's values are broadcast anyway).
    let mut start_epoch = 0;
    let mut step: u64 = 0;
    if cfg.resume {
        let dir = cfg
            .checkpoint_dir
            .as_ref()
            .context("--resume needs --checkpoint-dir")?;
        let path = checkpoint::checkpoint_path(dir);
        if path.exists() {
            let ck = checkpoint::load(&path)?;
            if ck.meta.model != name {
                bail!(
                    "{} holds a `{}` model, this run trains `{name}`",
                    path.display(),
                    ck.meta.model
                );
            }
            let record = Recorder::<B>::load(&Bytes::default(), ck.model, &device)
                .with_context(|| format!("{}: model record", path.display()))?;
            model = model.load_record(record);
            let record = Recorder::<B>::load(&Bytes::default(), ck.optim, &device)
                .with_context(|| format!("{}: optimizer record", path.display()))?;
            optim = optim.load_record(record);
            start_epoch = ck.meta.epoch;
            step = ck.meta.step;
            say.line(format!(
                "resuming from {} (epoch {}, step {})",
                path.display(),
                start_epoch,
                step
            ));
        } else {
            say.line(format!(
                "no checkpoint at {}: starting fresh",
                path.display()
            ));
        }
    }

    let ddp_config = DdpConfig {
        bucket_cap_mb: cfg.bucket_cap_mb,
        compression: match cfg.compression {
            CompressionKind::None => Compression::None,
            CompressionKind::Bf16 => Compression::Bf16,
            CompressionKind::F16 => Compression::F16,
        },
        ..DdpConfig::default()
    };
    let (wrapped, mut ddp) = DistributedDataParallel::new(model, pg.clone(), ddp_config)?;
    model = wrapped;

    let ranks = (world, rank);
    let mut train_feed =
        Feed::<B, S, D>::new(train, cfg, ranks, device.clone(), false, cfg.train_samples)?;
    let test_feed = Feed::<B::InnerBackend, S, D>::new(
        test,
        cfg,
        ranks,
        device.clone(),
        true,
        cfg.test_samples,
    )?;
    let (train_len, test_len) = (train_feed.len(), test_feed.len());
    let steps_per_epoch = train_feed.num_batches();

    say.line(format!(
        "training {name}: world {world}, {train_len} training samples ({} per rank, {} steps per \
         epoch), {test_len} test samples, batch {} per rank, lr {lr:e} ({:?} scaling), {:?}, \
         {} epochs from epoch {}",
        train_feed.num_samples(),
        steps_per_epoch,
        cfg.batch_size,
        cfg.lr_scaling,
        cfg.optimizer,
        cfg.epochs,
        start_epoch + 1
    ));

    let mut metrics = match (&cfg.metrics_dir, rank) {
        (Some(dir), 0) => Some(MetricsWriter::create(dir)?),
        _ => None,
    };
    let mut summary = RunSummary {
        model: name.clone(),
        world_size: world,
        epochs: start_epoch,
        steps: step,
        test_accuracy: 0.0,
        test_correct: 0,
        test_total: 0,
        train_loss: f64::NAN,
        samples_per_sec: 0.0,
        comm_seconds: 0.0,
        pack_seconds: 0.0,
        wait_seconds: 0.0,
        unpack_seconds: 0.0,
        wall_seconds: 0.0,
        peak_rss_mib: Vec::new(),
        params_hash: String::new(),
        checkpoint: None,
        export: None,
        metrics_dir: cfg.metrics_dir.clone(),
    };
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
        B::seed(&device, mix(cfg.seed, epoch as u64, rank as u64));
        let epoch_start = Instant::now();
        let bar = progress_bar(rank == 0, steps_per_epoch as u64, epoch + 1);
        let mut loss_sum = 0.0;
        let mut batches = 0usize;
        let mut epoch_samples = 0u64;
        let mut epoch_comm = SyncStats::default();
        let mut interval = Interval::new();
        let mut feed = train_feed.batches()?;
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
            let (loss, _) = model.loss(batch.inputs, batch.targets);
            let loss_value: f64 = loss.clone().into_scalar().elem();
            let t_backward = Instant::now();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let t_sync = Instant::now();
            ddp.record_spans(traced);
            let grads = ddp.sync(&model, grads)?;
            let t_optim = Instant::now();
            model = optim.step(lr, model, grads);
            let t_end = Instant::now();
            step += 1;
            batches += 1;
            epoch_samples += n as u64;
            loss_sum += loss_value;
            if let (true, Some(tracer)) = (traced, tracer.as_mut()) {
                let marks = [t_data, t_forward, t_backward, t_sync, t_optim, t_end];
                trace_step(tracer, step, marks, ddp.take_spans(), &pg.flight_records());
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
                let comm = ddp.take_stats();
                add_stats(&mut epoch_comm, &comm);
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
                    "epoch {} step {step} ({batches}/{steps_per_epoch}) loss {loss_value:.4}",
                    epoch + 1
                ));
            }
        }
        drop(feed);
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        let elapsed = epoch_start.elapsed();
        train_time += elapsed;
        samples_done += epoch_samples;
        let mut comm = ddp.take_stats();
        add_stats(&mut comm, &epoch_comm);
        summary.comm_seconds += comm.total().as_secs_f64();
        summary.pack_seconds += comm.pack.as_secs_f64();
        summary.wait_seconds += comm.wait.as_secs_f64();
        summary.unpack_seconds += comm.unpack.as_secs_f64();

        let (correct, total, test_loss) = evaluate::<B, M, S, D>(&model, &test_feed, &pg)?;
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
        if let (Some(dir), 0) = (&cfg.checkpoint_dir, rank) {
            let meta = CheckpointMeta {
                epoch: epoch + 1,
                step,
                seed: cfg.seed,
                world_size: world,
                model: name.clone(),
                model_len: 0,
                optim_len: 0,
                sha256: String::new(),
            };
            let model_bytes =
                Recorder::<B>::record(&Bytes::default(), model.clone().into_record(), ())?;
            let optim_bytes = Recorder::<B>::record(&Bytes::default(), optim.to_record(), ())?;
            summary.checkpoint = Some(checkpoint::save(dir, meta, &model_bytes, &optim_bytes)?);
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
    let flat = ddp::flatten_params::<B, M>(&model)?;
    summary.params_hash = format!("{:016x}", fnv1a_f32(&flat));
    if let (Some(path), 0) = (&cfg.export, rank) {
        ddp_models::export_safetensors::<B, M>(&model, path)
            .with_context(|| format!("exporting weights to {}", path.display()))?;
        summary.export = Some(path.clone());
    }
    // Also makes sure nobody leaves before rank 0 has written its files.
    summary.peak_rss_mib = pg.all_gather(vec![peak_rss_mib()])?;
    summary.wall_seconds = started.elapsed().as_secs_f64();
    say.line(format!(
        "done: {} epochs, {} steps, test accuracy {:.2}% ({}/{}), {:.0} samples/s, {:.1} s{}{}{}",
        summary.epochs,
        summary.steps,
        100.0 * summary.test_accuracy,
        summary.test_correct,
        summary.test_total,
        summary.samples_per_sec,
        summary.wall_seconds,
        summary
            .checkpoint
            .as_ref()
            .map(|p| format!("; checkpoint {}", p.display()))
            .unwrap_or_default(),
        summary
            .export
            .as_ref()
            .map(|p| format!("; weights {}", p.display()))
            .unwrap_or_default(),
        summary
            .metrics_dir
            .as_ref()
            .map(|p| format!("; metrics {}", p.display()))
            .unwrap_or_default(),
    ));
    if cfg.json && (rank == 0 || cfg.verbose) {
        println!("DDP_SUMMARY {}", serde_json::to_string(&summary)?);
    }
    Ok(summary)
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

/// Adds `b`'s counts and times to `a`.
fn add_stats(a: &mut SyncStats, b: &SyncStats) {
    a.steps += b.steps;
    a.pack += b.pack;
    a.wait += b.wait;
    a.unpack += b.unpack;
    a.bytes += b.bytes;
}

/// Records one step's spans: the loop's phases from `marks` (data, forward, backward, sync,
/// optimizer, end) and DDP's per-bucket spans, the all-reduces on the communication track. The
/// all-reduces' times are the communication thread's own (start and end of the collective)
/// from the process group's flight recorder `flight`; when it does not hold this sync's
/// buckets, DDP's view (submission or previous end, to the wait's return) stands in.
fn trace_step(
    tracer: &mut Tracer,
    step: u64,
    marks: [Instant; 6],
    spans: Vec<SyncSpan>,
    flight: &[CollectiveRecord],
) {
    let [data, forward, backward, sync, optimizer, end] = marks;
    let args = json!({ "step": step });
    tracer.span(Track::Training, "step", data, end, args.clone());
    for (name, start, stop) in [
        ("data", data, forward),
        ("forward", forward, backward),
        ("backward", backward, sync),
        ("sync", sync, optimizer),
        ("optimizer", optimizer, end),
    ] {
        tracer.span(Track::Training, name, start, stop, args.clone());
    }
    // The sync's all-reduces are the last ones the group ran (nothing else ran since).
    let reduces: Vec<&SyncSpan> = spans
        .iter()
        .filter(|s| s.phase == SyncPhase::AllReduce)
        .collect();
    let all: Vec<&CollectiveRecord> = flight.iter().filter(|r| r.op == "all_reduce").collect();
    let recorded = &all[all.len().saturating_sub(reduces.len())..];
    let from_flight = recorded.len() == reduces.len()
        && recorded.iter().zip(&reduces).all(|(r, s)| {
            r.count == s.elements as u64 && r.started_us.is_some() && r.finished_us.is_some()
        });
    for s in &spans {
        let (track, name) = match s.phase {
            SyncPhase::Pack => (Track::Training, "pack"),
            SyncPhase::Wait => (Track::Training, "wait"),
            SyncPhase::Unpack => (Track::Training, "unpack"),
            SyncPhase::AllReduce if from_flight => continue,
            SyncPhase::AllReduce => (Track::Communication, "all_reduce"),
        };
        let args = json!({ "step": step, "bucket": s.bucket, "elements": s.elements });
        tracer.span(track, name, s.start, s.end, args);
    }
    if from_flight {
        for (bucket, r) in recorded.iter().enumerate() {
            let args = json!({
                "step": step,
                "bucket": bucket,
                "elements": r.count,
                "dtype": r.dtype,
                "seq": r.seq,
                "queued_us": r.queued_us,
            });
            let (start, end) = (r.started_us.unwrap_or(0), r.finished_us.unwrap_or(0));
            tracer.span_us(Track::Communication, "all_reduce", start, end, args);
        }
    }
}

/// Correct predictions, samples and mean loss over the whole test set: each rank evaluates its
/// exact (unpadded) share, and the counts are summed across ranks.
fn evaluate<B, M, S, const D: usize>(
    model: &M,
    feed: &Feed<B::InnerBackend, S, D>,
    pg: &ProcessGroup,
) -> Result<(u64, u64, f64)>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    M::InnerModule: Classifier<B::InnerBackend, D>,
    S: BatchSource<D> + 'static,
{
    let eval = model.valid();
    let (mut correct, mut total, mut loss_sum) = (0f64, 0f64, 0f64);
    for batch in feed.batches()? {
        let batch = batch?;
        let n = batch.targets.dims()[0] as f64;
        let (loss, output) = eval.loss(batch.inputs, batch.targets.clone());
        let loss: f64 = loss.into_scalar().elem();
        correct += eval.correct(&output, &batch.targets) as f64;
        total += n;
        loss_sum += loss * n;
    }
    let sums = pg.all_reduce(vec![correct, total, loss_sum], ReduceOp::Sum)?;
    Ok((sums[0] as u64, sums[1] as u64, sums[2] / sums[1].max(1.0)))
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

/// This process's peak resident set size in MiB (Linux `ru_maxrss` is in KiB).
fn peak_rss_mib() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return f64::NAN;
    }
    usage.ru_maxrss as f64 / 1024.0
}

/// A seed for (seed, epoch, rank): splitmix64's mixer of the three.
fn mix(seed: u64, epoch: u64, rank: u64) -> u64 {
    ddp_data::sampler::splitmix64(
        seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ rank.wrapping_mul(0xbf58_476d_1ce4_e5b9),
    )
}

/// FNV-1a of the values' little-endian bytes.
fn fnv1a_f32(values: &[f32]) -> u64 {
    values.iter().fold(ddp_comm::bytes::FNV1A_OFFSET, |h, v| {
        ddp_comm::bytes::fnv1a_from(h, &v.to_le_bytes())
    })
}

/// What [`start`] hands a trainer: its settings and its process group (and its GPU).
pub struct Started {
    /// The resolved settings.
    pub cfg: TrainConfig,
    /// The process group of this rank.
    pub pg: Arc<ProcessGroup>,
    /// This rank's GPU when `--backend cuda`.
    #[cfg(feature = "cuda")]
    pub cuda_device: Option<burn::backend::cuda::CudaDevice>,
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
    #[cfg(not(feature = "cuda"))]
    if cfg.backend == crate::options::BackendKind::Cuda {
        bail!("--backend cuda: this build has no CUDA support (build with --features cuda)");
    }
    let pg = Arc::new(ProcessGroup::from_env().context("joining the process group")?);
    tracing::info!(
        "rank {} of {} joined the process group (local rank {})",
        pg.rank(),
        pg.world_size(),
        pg.local_rank()
    );
    #[cfg(feature = "cuda")]
    let cuda_device = match cfg.backend {
        crate::options::BackendKind::Cuda => Some(crate::gpu::cuda_device(&pg)?),
        crate::options::BackendKind::Cpu => None,
    };
    set_compute_threads(threads_per_rank(cfg.threads, pg.local_world_size()))?;
    Ok(Started {
        cfg,
        pg,
        #[cfg(feature = "cuda")]
        cuda_device,
    })
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
