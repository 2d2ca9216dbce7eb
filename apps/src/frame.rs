//! The frame of every training run, around its step loop: what both loops share. A run is
//! [`crate::fit::train`]: the step loop of a fixed membership (`train.rs`: epochs of batches
//! over a [`ddp_data::DistributedSampler`]) or of an elastic one (`elastic.rs`: steps handed
//! out from one position while ranks leave and join), each starting from a checkpoint when
//! [`checkpoint_to_resume`] says so, evaluating every test sample once per epoch
//! ([`local_eval`], summed across ranks), and ending in [`finish`] (the parameters' hash, the
//! export, the last line and the JSON summary). Both loops fill one [`RunSummary`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use burn::module::Module;
use ddp_comm::ProcessGroup;
use ddp_data::{Batch, ShardSet};
use ddp_models::Classifier;
use serde::Serialize;

use crate::options::TrainConfig;

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
    /// Training samples per second over this run, all ranks together (`train-gpt`: tokens).
    pub samples_per_sec: f64,
    /// Seconds spent in gradient synchronisation on this rank (pack + wait + unpack).
    pub comm_seconds: f64,
    /// Of which: copying gradients into buckets and submitting them.
    pub pack_seconds: f64,
    /// Of which: blocked waiting for all-reduces.
    pub wait_seconds: f64,
    /// Of which: turning reduced buckets back into gradient tensors.
    pub unpack_seconds: f64,
    /// Gradient buckets all-reduced on this rank (DDP: every bucket of every step).
    pub buckets: u64,
    /// Of which: all-reduces started during backward (`--overlap`, the default); 0 where overlap
    /// is off or cannot run.
    pub buckets_during_backward: u64,
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

/// A model, its data and its name: what a trainer hands to [`crate::fit::train`].
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
    /// The whole split in memory, served by [`ddp_data::DataLoader`] over a [`ddp_data::DistributedSampler`].
    Memory(Arc<S>),
    /// Safetensors shards on disk, streamed by [`ddp_data::ShardLoader`] (each rank reads its shards).
    Shards(ShardSet),
}

impl<S> From<Arc<S>> for Data<S> {
    fn from(set: Arc<S>) -> Data<S> {
        Data::Memory(set)
    }
}

/// Prints on rank 0, or on every rank with `--verbose`.
pub(crate) struct Say {
    /// Whether this process prints.
    pub(crate) on: bool,
}

impl Say {
    /// Prints `text` as a line when this process prints.
    pub(crate) fn line(&self, text: impl AsRef<str>) {
        if self.on {
            println!("{}", text.as_ref());
        }
    }
}

/// This process's peak resident set size in MiB (Linux `ru_maxrss` is in KiB).
pub fn peak_rss_mib() -> f64 {
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

/// The dropout seed of batch `batch` (from 0) of epoch `epoch` on rank `rank`: [`mix`] of the
/// first three mixed again with the batch, so that every step's masks can be drawn again
/// without drawing the steps before it.
pub(crate) fn step_seed(seed: u64, epoch: u64, rank: u64, batch: u64) -> u64 {
    ddp_data::sampler::splitmix64(
        mix(seed, epoch, rank) ^ batch.wrapping_mul(0x94d0_49bb_1331_11eb),
    )
}

/// FNV-1a of the values' little-endian bytes.
pub(crate) fn fnv1a_f32(values: &[f32]) -> u64 {
    values.iter().fold(ddp_comm::bytes::FNV1A_OFFSET, |h, v| {
        ddp_comm::bytes::fnv1a_from(h, &v.to_le_bytes())
    })
}

impl RunSummary {
    /// A summary of run `name` with nothing trained yet (the step loops fill it in).
    pub fn new(name: &str, world_size: usize, metrics_dir: Option<PathBuf>) -> RunSummary {
        RunSummary {
            model: name.to_string(),
            world_size,
            epochs: 0,
            steps: 0,
            test_accuracy: 0.0,
            test_correct: 0,
            test_total: 0,
            train_loss: f64::NAN,
            samples_per_sec: 0.0,
            comm_seconds: 0.0,
            pack_seconds: 0.0,
            wait_seconds: 0.0,
            unpack_seconds: 0.0,
            buckets: 0,
            buckets_during_backward: 0,
            wall_seconds: 0.0,
            peak_rss_mib: Vec::new(),
            params_hash: String::new(),
            checkpoint: None,
            export: None,
            metrics_dir,
        }
    }

    /// Adds a run's communication statistics (`comm`) to the summary's.
    pub fn add_comm(&mut self, comm: &ddp::SyncStats) {
        self.comm_seconds += comm.total().as_secs_f64();
        self.pack_seconds += comm.pack.as_secs_f64();
        self.wait_seconds += comm.wait.as_secs_f64();
        self.unpack_seconds += comm.unpack.as_secs_f64();
        self.buckets += comm.buckets;
        self.buckets_during_backward += comm.buckets_during_backward;
    }
}

/// The checkpoint a run starts from, if any: `--resume`, or a process its launcher
/// `restarted` (a restart count above 0; for an elastic run, the job's round) when the run has
/// a checkpoint directory. `None`: a fresh start.
pub(crate) fn checkpoint_to_resume(cfg: &TrainConfig, restarted: bool) -> Result<Option<PathBuf>> {
    if !(cfg.resume || restarted && cfg.checkpoint_dir.is_some()) {
        return Ok(None);
    }
    let dir = cfg
        .checkpoint_dir
        .as_ref()
        .context("--resume needs --checkpoint-dir")?;
    Ok(Some(ddp::checkpoint::checkpoint_path(dir)))
}

/// The batch size every evaluation batch is padded to ([`local_eval`]): the training batch on
/// a GPU backend (cubecl compiles and tunes each kernel per shape), none on the CPU.
pub(crate) fn eval_pad(cfg: &TrainConfig) -> Option<usize> {
    (cfg.backend != crate::options::BackendKind::Cpu).then_some(cfg.batch_size)
}

/// This rank's share of an evaluation, before the sum across ranks: correct predictions,
/// samples and the loss summed over samples, as `f64` (the all-reduce's element).
///
/// With `pad_to` (see [`eval_pad`]), a batch of fewer rows (the last, partial one) runs its
/// forward pass padded to `pad_to` rows with copies of its first row, and only the real rows'
/// outputs are counted and given a loss ([`Classifier::output_loss`]). Why: a cubecl device
/// (CUDA, wgpu) compiles and tunes its heavy kernels (convolutions, matmuls) once per shape,
/// and a batch of another shape costs every process whose kernel cache lacks it a tuning of its
/// own (seconds to minutes on a cold cache); padded, every evaluation batch has the training
/// batches' shape, tuned already. The rows of a batch are independent in evaluation (no
/// dropout, batch norm on its running statistics, attention within a row), so the real rows'
/// outputs are what the unpadded batch gives.
pub(crate) fn local_eval<M, const D: usize>(
    model: &M,
    batches: impl Iterator<Item = Result<Batch<D>>>,
    pad_to: Option<usize>,
) -> Result<[f64; 3]>
where
    M: Module + Classifier<D>,
{
    let eval = model.valid();
    let mut sums = [0f64; 3];
    for batch in batches {
        let batch = batch?;
        let n = batch.targets.dims()[0] as f64;
        let rows = batch.inputs.dims()[0];
        let (loss, output) = match pad_to {
            Some(full) if rows > 0 && rows < full => {
                let copies = batch.inputs.clone().slice(0..1).repeat_dim(0, full - rows);
                let output = eval.forward(burn::tensor::Tensor::cat(vec![batch.inputs, copies], 0));
                // Outputs per row: 1, or a row's positions (the GPT's tokens).
                let per_row = output.dims()[0] / full;
                let output = output.slice(0..rows * per_row);
                (
                    eval.output_loss(output.clone(), batch.targets.clone()),
                    output,
                )
            }
            _ => eval.loss(batch.inputs, batch.targets.clone()),
        };
        sums[0] += eval.correct(&output, &batch.targets) as f64;
        sums[1] += n;
        sums[2] += f64::from(loss.into_scalar::<f32>()) * n;
    }
    Ok(sums)
}

/// Correct predictions, samples and mean loss of the whole test set, from every rank's
/// [`local_eval`] summed across ranks.
pub(crate) fn sum_eval(
    pg: &ProcessGroup,
    local: [f64; 3],
) -> Result<(u64, u64, f64), ddp_comm::CommError> {
    let sums = pg.all_reduce(local.to_vec(), ddp_comm::ReduceOp::Sum)?;
    Ok((sums[0] as u64, sums[1] as u64, sums[2] / sums[1].max(1.0)))
}

/// What a step loop hands to [`finish`].
pub(crate) struct Ending<M> {
    /// The trained model.
    pub model: M,
    /// This process's rank at the end.
    pub rank: usize,
    /// The summary so far (everything but the hash, the export, the memory and the wall time).
    pub summary: RunSummary,
    /// What the last line says between the accuracy and the wall time (the plain loop: the
    /// samples/s; the elastic one: its membership changes).
    pub detail: String,
    /// The group whose ranks' peak memory goes into the summary (a collective after the
    /// export, so that no rank leaves before rank 0 has written its files); `None`: this
    /// process's alone (an elastic run, whose group is gone by now).
    pub group: Option<Arc<ProcessGroup>>,
    /// An elastic run's own JSON record (`DDP_ELASTIC_SUMMARY`, every rank), to which the
    /// summary is added.
    pub elastic_json: Option<serde_json::Map<String, serde_json::Value>>,
}

/// The end of every run: the parameters' hash, the safetensors export (rank 0), the ranks'
/// peak memory, the wall time since `started`, the last line (rank 0, or every rank with
/// `--verbose`), and with `--json` the summaries.
pub(crate) fn finish<M: Module>(
    cfg: &TrainConfig,
    started: Instant,
    end: Ending<M>,
) -> Result<RunSummary> {
    let Ending {
        model,
        rank,
        mut summary,
        detail,
        group,
        elastic_json,
    } = end;
    let flat = ddp::flatten_params(&model)?;
    summary.params_hash = format!("{:016x}", fnv1a_f32(&flat));
    if let (Some(path), 0) = (&cfg.export, rank) {
        ddp_models::export_safetensors(&model, path)
            .with_context(|| format!("exporting weights to {}", path.display()))?;
        summary.export = Some(path.clone());
    }
    summary.peak_rss_mib = match &group {
        Some(pg) => pg.all_gather(vec![peak_rss_mib()])?,
        None => vec![peak_rss_mib()],
    };
    summary.wall_seconds = started.elapsed().as_secs_f64();
    let say = Say {
        on: rank == 0 || cfg.verbose,
    };
    let path = |what: &str, p: &Option<PathBuf>| {
        p.as_ref()
            .map(|p| format!("; {what} {}", p.display()))
            .unwrap_or_default()
    };
    say.line(format!(
        "done: {} epochs, {} steps, test accuracy {:.2}% ({}/{}), {detail}, {:.1} s{}{}{}",
        summary.epochs,
        summary.steps,
        100.0 * summary.test_accuracy,
        summary.test_correct,
        summary.test_total,
        summary.wall_seconds,
        path("checkpoint", &summary.checkpoint),
        path("weights", &summary.export),
        path("metrics", &summary.metrics_dir),
    ));
    if cfg.json {
        if let Some(mut record) = elastic_json {
            record.insert("summary".into(), serde_json::to_value(&summary)?);
            println!("DDP_ELASTIC_SUMMARY {}", serde_json::Value::Object(record));
        }
        if say.on {
            println!("DDP_SUMMARY {}", serde_json::to_string(&summary)?);
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Int, Tensor, TensorData};
    use ddp_models::{GptConfig, MnistMlpConfig};

    /// `rows` inputs of `shape` (after the batch dimension) and `per_row` targets each,
    /// deterministic, on `device`.
    fn batch<const D: usize>(
        first: usize,
        rows: usize,
        shape: [usize; D],
        per_row: usize,
        classes: usize,
        device: &Device,
    ) -> Batch<D> {
        let each: usize = shape[1..].iter().product();
        let values: Vec<f32> = (0..rows * each)
            .map(|i| ((first * each + i) * 7919 % 101) as f32 / 10.0)
            .collect();
        let mut dims = shape;
        dims[0] = rows;
        let targets: Vec<i64> = (0..rows * per_row)
            .map(|i| ((first * per_row + i) * 31 % classes) as i64)
            .collect();
        Batch {
            inputs: Tensor::from_data(TensorData::new(values, dims), device),
            targets: Tensor::<1, Int>::from_data(
                TensorData::new(targets, [rows * per_row]),
                device,
            ),
        }
    }

    /// `local_eval` of `sizes`-row batches with `pad_to`, against the reference: the same
    /// samples one at a time, unpadded (another shape, each row on its own).
    fn check<M: Module + Classifier<D>, const D: usize>(
        model: &M,
        sizes: &[usize],
        shape: [usize; D],
        per_row: usize,
        classes: usize,
        device: &Device,
    ) {
        let mut batches = Vec::new();
        let mut first = 0;
        for &rows in sizes {
            batches.push(batch(first, rows, shape, per_row, classes, device));
            first += rows;
        }
        let singles: Vec<Batch<D>> = (0..first)
            .map(|i| batch(i, 1, shape, per_row, classes, device))
            .collect();
        let reference = local_eval(model, singles.into_iter().map(Ok), None).unwrap();
        let padded = local_eval(model, batches.into_iter().map(Ok), Some(sizes[0])).unwrap();
        assert_eq!(padded[0], reference[0], "correct predictions");
        assert_eq!(padded[1], (first * per_row) as f64, "samples counted");
        assert_eq!(padded[1], reference[1]);
        assert!(
            (padded[2] - reference[2]).abs() <= 1e-4 * reference[2].abs().max(1.0),
            "loss sums: padded {} vs one at a time {}",
            padded[2],
            reference[2]
        );
    }

    /// The last partial batch padded to the training batch's rows: the count, the samples and
    /// the loss are those of the real rows alone (an MLP on images; a GPT, whose rows each give
    /// several outputs and targets).
    #[test]
    fn a_padded_last_batch_counts_its_real_rows_alone() {
        let device = Device::flex();
        device.seed(5);
        let mlp = MnistMlpConfig::new().init(&device);
        check(&mlp, &[8, 8, 3], [8, 1, 28, 28], 1, 10, &device);
        let gpt = GptConfig::new(11)
            .with_block_size(8)
            .with_n_layer(1)
            .with_n_head(2)
            .with_n_embd(8)
            .init(&device);
        check(&gpt, &[4, 1], [4, 8], 8, 11, &device);
    }
}
