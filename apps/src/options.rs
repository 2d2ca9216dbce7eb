//! The trainers' settings: command-line flags (clap) over a TOML config file over defaults.
//!
//! Every setting is an `Option` in [`TrainArgs`], which is both the clap parser and the TOML
//! schema (kebab-case keys, the flags' names), so precedence is a plain field-by-field merge:
//! a flag given on the command line wins, then the config file's value, then the trainer's
//! default.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::schedule::{LrSchedule, ScheduleKind};

/// The optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OptimizerKind {
    /// Adam (β = 0.9, 0.999; ε = 1e-8).
    Adam,
    /// AdamW with PyTorch's defaults (β = 0.9, 0.999; ε = 1e-8; decoupled weight decay 0.01).
    Adamw,
    /// SGD with momentum (`--momentum`).
    Sgd,
}

/// How the learning rate grows with the world size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LrScaling {
    /// The same learning rate at every world size.
    None,
    /// `lr × world_size` (Goyal et al.).
    Linear,
    /// `lr × √world_size`.
    Sqrt,
}

/// The compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// burn's flex CPU backend.
    Cpu,
    /// burn-cuda on the GPU of `LOCAL_RANK` (needs a build with the `cuda` feature).
    Cuda,
    /// burn's wgpu backend (Vulkan, Metal or DX12; on a machine without a GPU, Mesa's lavapipe
    /// gives a Vulkan device on the CPU): wgpu's default adapter, shared by the ranks of a
    /// host (needs a build with the `wgpu` feature). Gradients go through the host path.
    Wgpu,
    /// burn's wgpu backend on the Vulkan API only (Linux, Windows, Android; Mesa's lavapipe on
    /// a machine without a GPU): `--backend wgpu` that fails, naming Vulkan, where no Vulkan
    /// device is found instead of falling back to another API (needs the `wgpu` feature).
    Vulkan,
    /// burn's wgpu backend on Apple's Metal API (macOS, iOS; needs the `wgpu` feature). On any
    /// other system, an error naming the backend.
    Metal,
}

impl BackendKind {
    /// Whether this backend is one of burn's wgpu backends (`wgpu`, `vulkan`, `metal`).
    pub fn is_wgpu(self) -> bool {
        matches!(self, Self::Wgpu | Self::Vulkan | Self::Metal)
    }

    /// The cargo feature of `ddp-apps` that compiles this backend in (`None` for the CPU,
    /// which every build has).
    pub fn feature(self) -> Option<&'static str> {
        match self {
            Self::Cpu => None,
            Self::Cuda => Some("cuda"),
            Self::Wgpu | Self::Vulkan | Self::Metal => Some("wgpu"),
        }
    }

    /// The error of a trainer `program` built without this backend's feature: it names the
    /// feature and the commands that build the trainer with it.
    pub fn missing_feature_error(self, program: &str) -> String {
        let feature = self.feature().unwrap_or("none");
        let network = match self {
            Self::Cuda => " (burn's CUDA build downloads an LLVM bundle once: docs/gpu.md)",
            _ => "",
        };
        let name = self.name();
        // The tasks that build a trainer with the feature its `--backend` needs.
        let task = match program {
            "train-mnist" | "train-pima" => {
                format!(", or let the task build it: `cargo xtask {program} --backend {name}`")
            }
            _ => String::new(),
        };
        format!(
            "--backend {name}: this {program} was built without the cargo feature \
             `ddp-apps/{feature}`; build it with `cargo build --release --features \
             ddp-apps/{feature} --bin {program}` (the binary lands in target/release){task}\
             {network}"
        )
    }

    /// The name `--backend` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
            Self::Wgpu => "wgpu",
            Self::Vulkan => "vulkan",
            Self::Metal => "metal",
        }
    }
}

/// Where the trainer reads its data from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataFormat {
    /// The whole data set in every rank's memory (MNIST: the IDX files).
    Memory,
    /// Safetensors shards with an index (`--data-dir` holds `train/` and `test/`, as written by
    /// `cargo xtask make-shards` or `import-h5`), streamed: each rank reads only its shards.
    Shards,
}

/// Gradient compression on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompressionKind {
    /// f32.
    None,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

/// How each gradient bucket is averaged across ranks (`--comm-hook`, PyTorch's
/// `register_comm_hook`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HookKind {
    /// All-reduce in f32 (PyTorch's default).
    None,
    /// All-reduce in bfloat16 (PyTorch's `bf16_compress_hook`; the same as `--compression bf16`).
    Bf16,
    /// All-reduce in IEEE half (PyTorch's `fp16_compress_hook`; the same as `--compression f16`).
    F16,
    /// PowerSGD low-rank compression with error feedback (PyTorch's `powerSGD_hook`):
    /// `--powersgd-rank`, `--powersgd-start`.
    Powersgd,
}

/// Flags shared by `train-mnist` and `train-pima`; each may also come from `--config FILE`.
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct TrainArgs {
    /// TOML file with any of these settings (kebab-case keys, as the flags); flags override it.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Number of epochs.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Batch size per rank.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Base learning rate (before world-size scaling).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Optimizer.
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerKind>,
    /// Momentum of SGD.
    #[arg(long)]
    pub momentum: Option<f64>,
    /// Clip the averaged gradient to this global 2-norm (PyTorch's `clip_grad_norm_`; the
    /// same bits at every ZeRO stage).
    #[arg(long)]
    pub max_grad_norm: Option<f32>,
    /// Learning-rate scaling with world size.
    #[arg(long, value_enum)]
    pub lr_scaling: Option<LrScaling>,
    /// Learning-rate schedule over the steps (`constant`, or `cosine`: linear warm-up, then
    /// cosine decay to `--min-lr`).
    #[arg(long, value_enum)]
    pub lr_schedule: Option<ScheduleKind>,
    /// Steps of linear warm-up of `--lr-schedule cosine` (default 0).
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// The step at which `--lr-schedule cosine` reaches `--min-lr`, counted from the start,
    /// warm-up included (nanoGPT's `lr_decay_iters`; default `--max-steps`).
    #[arg(long)]
    pub decay_steps: Option<u64>,
    /// The floor of `--lr-schedule cosine` (default `--lr` / 10), not scaled with the world.
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Seed of initialisation, shuffling and dropout.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Compute backend.
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Compute threads per rank (0: burn's default, all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Data-loader worker threads per rank (0: batches built in the training thread).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Gradient bucket size in MiB.
    #[arg(long)]
    pub bucket_cap_mb: Option<f64>,
    /// Gradient compression on the wire (the older spelling of `--comm-hook none|bf16|f16`).
    #[arg(long, value_enum)]
    pub compression: Option<CompressionKind>,
    /// How each gradient bucket is averaged: all-reduce in f32 (`none`, the default), in bf16
    /// or f16, or PowerSGD's low-rank compression (`powersgd`; plain DDP only, without
    /// --zero-stage or --elastic).
    #[arg(long, value_enum)]
    pub comm_hook: Option<HookKind>,
    /// With `--comm-hook powersgd`: the rank R of each gradient's approximation (default 1,
    /// PyTorch's).
    #[arg(long, value_name = "R")]
    pub powersgd_rank: Option<usize>,
    /// With `--comm-hook powersgd`: steps all-reduced plain before compression starts
    /// (default 1000, PyTorch's; PyTorch suggests about 10 % of the training steps).
    #[arg(long, value_name = "K")]
    pub powersgd_start: Option<u64>,
    /// ZeRO stage: 0 = plain DDP (every rank keeps the whole optimizer state), 1 = the
    /// optimizer state sharded across ranks, 2 = optimizer state and gradients sharded.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero_stage: Option<u8>,
    /// Start each gradient bucket's all-reduce (with --zero-stage, its reduce-scatter) during
    /// backward, as soon as its gradients are complete (PyTorch DDP's overlap; results are
    /// bit-identical either way). On by default; `--overlap false` starts them after backward.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub overlap: Option<bool>,
    /// Drop each epoch's last partial training batch, like PyTorch's `DataLoader(drop_last=True)`:
    /// every step then has the same batch shape, and a GPU backend compiles and tunes its
    /// kernels for one shape only. On by default on the GPU backends (`cuda`, `wgpu`, `vulkan`,
    /// `metal`), off on `cpu` (PyTorch's default); `--drop-last false` keeps the partial batch.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub drop_last: Option<bool>,
    /// Directory of the data set (MNIST: where the four files are or will be downloaded;
    /// with `--data-format shards`, the folder holding `train/` and `test/`).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// How the data set is read: all in memory (default) or streamed from shards.
    #[arg(long, value_enum)]
    pub data_format: Option<DataFormat>,
    /// With `--data-format shards`: shards read ahead by each rank (default 2).
    #[arg(long)]
    pub prefetch_shards: Option<usize>,
    /// Directory of checkpoints (written by rank 0 every epoch and at the end, and every
    /// `--checkpoint-every` steps). Under `ddprun --max-restarts` (or torchrun), a restarted
    /// rank (TORCHELASTIC_RESTART_COUNT above 0) resumes from it as if given `--resume`.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Also write a checkpoint every STEPS global steps in the middle of an epoch (rank 0,
    /// atomically); a resumed run continues with the next batch and, with nothing else changed,
    /// ends bit-identical to an uninterrupted run. Needs `--checkpoint-dir`.
    ///
    /// Test hook (for the restart tests, not for users): with the environment variable
    /// DDP_TEST_KILL_AT_STEP=K, on the first attempt (TORCHELASTIC_RESTART_COUNT unset or 0) the
    /// rank DDP_TEST_KILL_RANK (default: the last rank) kills itself with SIGKILL right after
    /// global step K (and its checkpoint, if any).
    #[arg(long, value_name = "STEPS")]
    pub checkpoint_every: Option<u64>,
    /// Continue from the checkpoint in the checkpoint directory. It is rank 0 that reads it and
    /// sends it to the other ranks, so nodes need no shared file system.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub resume: Option<bool>,
    /// Resume even from a checkpoint written with another world size or seed (an error
    /// otherwise, since the data order and dropout masks would not continue that run); a
    /// warning says what differs.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub allow_mismatched_checkpoint: Option<bool>,
    /// Directory of metrics (CSV and TensorBoard event files).
    #[arg(long)]
    pub metrics_dir: Option<PathBuf>,
    /// Where to write the final weights as safetensors with PyTorch's names.
    #[arg(long)]
    pub export: Option<PathBuf>,
    /// Steps between progress lines and TensorBoard points (default 50).
    #[arg(long)]
    pub log_interval: Option<usize>,
    /// Stop after this many optimizer steps in total (for short runs).
    #[arg(long)]
    pub max_steps: Option<u64>,
    /// Use only the first N training samples.
    #[arg(long)]
    pub train_samples: Option<usize>,
    /// Use only the first N test samples.
    #[arg(long)]
    pub test_samples: Option<usize>,
    /// Let every rank print, not only rank 0.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub verbose: Option<bool>,
    /// Directory for Chrome trace event files of a window of steps (`trace-rank<R>.json` per
    /// rank; open them in <https://ui.perfetto.dev>).
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// With `--trace-dir`: the global steps traced, `A..B` (from 1, B excluded; default 10..15).
    #[arg(long)]
    pub trace_steps: Option<String>,
    /// Print a JSON summary line at the end (for scripts).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub json: Option<bool>,
    /// Elastic membership: `MIN:MAX` ranks; ranks may leave and join while the job runs (the
    /// survivors go on from memory, a joiner is healed from rank 0). Needs the launcher's
    /// store (ddprun); `ddprun --nnodes MIN:MAX` implies it [default: DDP_ELASTIC].
    #[arg(long, value_name = "MIN:MAX")]
    pub elastic: Option<String>,
}

macro_rules! merge_fields {
    ($over:expr, $under:expr; $($f:ident),*) => {
        TrainArgs { config: $over.config.clone(), $($f: $over.$f.clone().or($under.$f.clone())),* }
    };
}

impl TrainArgs {
    /// `self`'s values where given, else `under`'s.
    pub fn or(&self, under: &TrainArgs) -> TrainArgs {
        merge_fields!(self, under; epochs, batch_size, lr, optimizer, momentum, max_grad_norm,
            lr_scaling, lr_schedule, warmup_steps, decay_steps, min_lr, seed,
            backend, threads, workers, bucket_cap_mb, compression, comm_hook, powersgd_rank,
            powersgd_start, zero_stage, overlap, drop_last, data_dir, data_format,
            prefetch_shards, checkpoint_dir, checkpoint_every,
            resume, allow_mismatched_checkpoint, metrics_dir, export, log_interval, max_steps, train_samples, test_samples,
            verbose, json, trace_dir, trace_steps, elastic)
    }

    /// Reads a TOML config file; unknown keys are errors naming the file.
    pub fn from_file(path: &Path) -> Result<TrainArgs> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Flags over the config file (when `--config` is given) over `defaults`, resolved.
    pub fn resolve(&self, defaults: &TrainArgs) -> Result<TrainConfig> {
        let file = match &self.config {
            Some(path) => TrainArgs::from_file(path)?,
            None => TrainArgs::default(),
        };
        let a = self.or(&file).or(defaults);
        let need =
            |name: &str| anyhow::anyhow!("no value for `{name}` (no flag, config or default)");
        let (comm_hook, compression) = resolve_hook(a.comm_hook, a.compression)?;
        if comm_hook != HookKind::Powersgd
            && (a.powersgd_rank.is_some() || a.powersgd_start.is_some())
        {
            bail!("--powersgd-rank and --powersgd-start need --comm-hook powersgd");
        }
        let mut cfg = TrainConfig {
            epochs: a.epochs.ok_or_else(|| need("epochs"))?,
            batch_size: a.batch_size.ok_or_else(|| need("batch-size"))?,
            lr: a.lr.ok_or_else(|| need("lr"))?,
            optimizer: a.optimizer.unwrap_or(OptimizerKind::Adam),
            momentum: a.momentum.unwrap_or(0.9),
            max_grad_norm: a.max_grad_norm,
            lr_scaling: a.lr_scaling.unwrap_or(LrScaling::None),
            schedule: resolve_schedule(&a)?,
            seed: a.seed.unwrap_or(0),
            backend: a.backend.unwrap_or(BackendKind::Cpu),
            threads: a.threads.unwrap_or(0),
            workers: a.workers.unwrap_or(1),
            bucket_cap_mb: a.bucket_cap_mb.unwrap_or(25.0),
            compression,
            comm_hook,
            powersgd_rank: a.powersgd_rank.unwrap_or(1),
            powersgd_start: a.powersgd_start.unwrap_or(1000),
            zero_stage: a.zero_stage.unwrap_or(0),
            overlap: a.overlap.unwrap_or(ddp::DdpConfig::new().overlap),
            drop_last: a
                .drop_last
                .unwrap_or(a.backend.unwrap_or(BackendKind::Cpu) != BackendKind::Cpu),
            data_dir: a.data_dir,
            data_format: a.data_format.unwrap_or(DataFormat::Memory),
            prefetch_shards: a.prefetch_shards.unwrap_or(2),
            checkpoint_dir: a.checkpoint_dir,
            checkpoint_every: a.checkpoint_every,
            resume: a.resume.unwrap_or(false),
            allow_mismatched_checkpoint: a.allow_mismatched_checkpoint.unwrap_or(false),
            metrics_dir: a.metrics_dir,
            export: a.export,
            log_interval: a.log_interval.unwrap_or(50).max(1),
            max_steps: a.max_steps,
            train_samples: a.train_samples,
            test_samples: a.test_samples,
            verbose: a.verbose.unwrap_or(false),
            json: a.json.unwrap_or(false),
            trace_dir: a.trace_dir,
            trace_steps: crate::trace::parse_steps(a.trace_steps.as_deref().unwrap_or("10..15"))
                .context("--trace-steps")?,
            elastic: a.elastic,
        };
        if let Some(range) = &cfg.elastic {
            if ddp_comm::parse_range(range).is_none() {
                bail!("--elastic {range:?}: expected MIN:MAX with 1 <= MIN <= MAX");
            }
        }
        // Whether the run is elastic is asked here, once: the flag, else the launcher's
        // variable (checked by the elastic group, which names it).
        cfg.elastic = cfg.elastic.or_else(ddp_comm::elastic::elastic_range);
        if cfg.batch_size == 0 {
            bail!("batch-size must be at least 1");
        }
        if cfg.lr.is_nan() || cfg.lr <= 0.0 {
            bail!("lr must be positive (got {})", cfg.lr);
        }
        if cfg.prefetch_shards == 0 {
            bail!("prefetch-shards must be at least 1");
        }
        if cfg.data_format == DataFormat::Shards && cfg.data_dir.is_none() {
            bail!("--data-format shards needs --data-dir (the folder holding train/ and test/)");
        }
        if cfg.resume && cfg.checkpoint_dir.is_none() {
            bail!("--resume needs --checkpoint-dir");
        }
        if cfg.zero_stage > 2 {
            bail!("zero-stage must be 0, 1 or 2 (got {})", cfg.zero_stage);
        }
        if cfg.zero_stage > 0 && cfg.compression != CompressionKind::None {
            bail!(
                "--compression {:?} cannot be combined with --zero-stage {}: sharded training \
                 reduce-scatters f32 gradients",
                cfg.compression,
                cfg.zero_stage
            );
        }
        if cfg.comm_hook == HookKind::Powersgd {
            if cfg.zero_stage > 0 {
                bail!(
                    "--comm-hook powersgd cannot be combined with --zero-stage {}: sharded \
                     training reduce-scatters f32 gradients",
                    cfg.zero_stage
                );
            }
            if cfg.elastic.is_some() {
                bail!(
                    "--comm-hook powersgd cannot be combined with --elastic: its state (error \
                     feedback, Q) is each rank's own and does not survive a change of members"
                );
            }
            ddp::PowerSgdConfig::from(&cfg)
                .validate()
                .map_err(|e| anyhow::anyhow!("--powersgd-rank/--powersgd-start: {e}"))?;
        }
        if cfg.checkpoint_every == Some(0) {
            bail!("checkpoint-every must be at least 1 step");
        }
        if cfg.checkpoint_every.is_some() && cfg.checkpoint_dir.is_none() {
            bail!("--checkpoint-every needs --checkpoint-dir");
        }
        Ok(cfg)
    }
}

/// The schedule `a` asks for: `constant` unless `--lr-schedule cosine`, whose decay ends at
/// `--decay-steps` (else `--max-steps`) and whose floor is `--min-lr` (else `--lr` / 10).
fn resolve_schedule(a: &TrainArgs) -> Result<LrSchedule> {
    let kind = a.lr_schedule.unwrap_or(ScheduleKind::Constant);
    if kind == ScheduleKind::Constant {
        if a.warmup_steps.is_some() || a.decay_steps.is_some() || a.min_lr.is_some() {
            bail!("--warmup-steps, --decay-steps and --min-lr need --lr-schedule cosine");
        }
        return Ok(LrSchedule::constant());
    }
    let warmup_steps = a.warmup_steps.unwrap_or(0);
    let decay_steps = a.decay_steps.or(a.max_steps).context(
        "--lr-schedule cosine needs --decay-steps (or --max-steps): the step where the decay ends",
    )?;
    if decay_steps <= warmup_steps {
        bail!("--decay-steps ({decay_steps}) must be larger than --warmup-steps ({warmup_steps})");
    }
    let lr = a.lr.unwrap_or(f64::NAN);
    let min_lr = a.min_lr.unwrap_or(lr / 10.0);
    if !(0.0..=lr).contains(&min_lr) {
        bail!("--min-lr must be between 0 and --lr (got {min_lr}, lr {lr})");
    }
    Ok(LrSchedule {
        kind,
        warmup_steps,
        decay_steps,
        min_lr,
    })
}

/// Resolved settings of a training run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Number of epochs.
    pub epochs: usize,
    /// Batch size per rank.
    pub batch_size: usize,
    /// Base learning rate.
    pub lr: f64,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// SGD momentum.
    pub momentum: f64,
    /// Global-norm gradient clipping, if any.
    pub max_grad_norm: Option<f32>,
    /// Learning-rate scaling with world size.
    pub lr_scaling: LrScaling,
    /// Learning-rate schedule over the steps.
    pub schedule: LrSchedule,
    /// Seed.
    pub seed: u64,
    /// Backend.
    pub backend: BackendKind,
    /// Compute threads per rank (0 = default).
    pub threads: usize,
    /// Loader workers per rank.
    pub workers: usize,
    /// Gradient bucket size in MiB.
    pub bucket_cap_mb: f64,
    /// Gradient compression (bf16/f16 also when given as `--comm-hook`).
    pub compression: CompressionKind,
    /// The communication hook (`none`, `bf16` and `f16` agree with `compression`).
    pub comm_hook: HookKind,
    /// PowerSGD's rank.
    pub powersgd_rank: usize,
    /// Steps before PowerSGD compresses.
    pub powersgd_start: u64,
    /// ZeRO stage (0 = plain DDP).
    pub zero_stage: u8,
    /// All-reduces (ZeRO: reduce-scatters) during backward (on by default).
    pub overlap: bool,
    /// Each epoch's last partial training batch dropped (on by default on the GPU backends).
    pub drop_last: bool,
    /// Data directory.
    pub data_dir: Option<PathBuf>,
    /// In memory or streamed from shards.
    pub data_format: DataFormat,
    /// Shards read ahead (shards format).
    pub prefetch_shards: usize,
    /// Checkpoint directory.
    pub checkpoint_dir: Option<PathBuf>,
    /// Global steps between mid-epoch checkpoints, if any.
    pub checkpoint_every: Option<u64>,
    /// Resume from the checkpoint directory.
    pub resume: bool,
    /// Resume from a checkpoint of another world size or seed (with a warning).
    pub allow_mismatched_checkpoint: bool,
    /// Metrics directory.
    pub metrics_dir: Option<PathBuf>,
    /// safetensors export path.
    pub export: Option<PathBuf>,
    /// Steps between progress lines.
    pub log_interval: usize,
    /// Total step limit.
    pub max_steps: Option<u64>,
    /// Training subset size.
    pub train_samples: Option<usize>,
    /// Test subset size.
    pub test_samples: Option<usize>,
    /// Every rank prints.
    pub verbose: bool,
    /// Print a JSON summary.
    pub json: bool,
    /// Where each rank writes its Chrome trace, if anywhere.
    pub trace_dir: Option<PathBuf>,
    /// The traced steps (global, from 1, end excluded).
    pub trace_steps: std::ops::Range<u64>,
    /// `--elastic MIN:MAX`, else `DDP_ELASTIC` (read once, when the settings are resolved):
    /// elastic membership; `None`: a fixed one (see [`TrainConfig::elastic_range`]).
    pub elastic: Option<String>,
}

/// `--comm-hook` and its older spelling `--compression` (either may be given, both only when
/// they agree) as the hook and the wire type.
fn resolve_hook(
    hook: Option<HookKind>,
    compression: Option<CompressionKind>,
) -> Result<(HookKind, CompressionKind)> {
    let as_hook = |c: CompressionKind| match c {
        CompressionKind::None => HookKind::None,
        CompressionKind::Bf16 => HookKind::Bf16,
        CompressionKind::F16 => HookKind::F16,
    };
    let hook = match (hook, compression) {
        (Some(h), Some(c)) if h != as_hook(c) => bail!(
            "--comm-hook {h:?} and --compression {c:?} disagree (--compression is the older \
             spelling of --comm-hook none|bf16|f16: give one)"
        ),
        (Some(h), _) => h,
        (None, c) => as_hook(c.unwrap_or(CompressionKind::None)),
    };
    let compression = match hook {
        HookKind::Bf16 => CompressionKind::Bf16,
        HookKind::F16 => CompressionKind::F16,
        HookKind::None | HookKind::Powersgd => CompressionKind::None,
    };
    Ok((hook, compression))
}

/// PowerSGD's settings of a run: PyTorch's defaults with `--powersgd-rank` and
/// `--powersgd-start`.
impl From<&TrainConfig> for ddp::PowerSgdConfig {
    fn from(cfg: &TrainConfig) -> ddp::PowerSgdConfig {
        ddp::PowerSgdConfig::new()
            .with_matrix_approximation_rank(cfg.powersgd_rank)
            .with_start_powersgd_iter(cfg.powersgd_start)
    }
}

impl TrainConfig {
    /// The elastic range of this run: `--elastic`, else `DDP_ELASTIC` as it was when the
    /// settings were resolved; `None`: not elastic.
    pub fn elastic_range(&self) -> Option<String> {
        self.elastic.clone().filter(|v| !v.trim().is_empty())
    }

    /// The wrapper's communication hook setting ([`ddp::DdpConfig::comm_hook`]; bf16 and f16
    /// travel as [`ddp::DdpConfig::compression`]).
    pub fn ddp_comm_hook(&self) -> ddp::CommHookKind {
        match self.comm_hook {
            HookKind::Powersgd => ddp::CommHookKind::PowerSgd(self.into()),
            HookKind::None | HookKind::Bf16 | HookKind::F16 => ddp::CommHookKind::AllReduce,
        }
    }

    /// The learning rate after scaling for `world_size` ranks.
    pub fn scaled_lr(&self, world_size: usize) -> f64 {
        match self.lr_scaling {
            LrScaling::None => self.lr,
            LrScaling::Linear => self.lr * world_size as f64,
            LrScaling::Sqrt => self.lr * (world_size as f64).sqrt(),
        }
    }

    /// The learning rate of step `step` (from 0; the steps already done) at `world_size`
    /// ranks: the scaled rate through the schedule.
    pub fn lr_at(&self, world_size: usize, step: u64) -> f64 {
        self.schedule.lr(self.scaled_lr(world_size), step)
    }

    /// The learning rate for `world_size` ranks and how it came about, for the trainers' first
    /// line: `lr 1e-3 (not scaled)`, `lr 2e-3 (--lr 1e-3 × 2 ranks, linear scaling)`.
    pub fn describe_lr(&self, world_size: usize) -> String {
        let lr = self.scaled_lr(world_size);
        let base = self.lr;
        let text = match self.lr_scaling {
            LrScaling::None => format!("lr {lr:e} (not scaled)"),
            LrScaling::Linear => {
                format!("lr {lr:e} (--lr {base:e} × {world_size} ranks, linear scaling)")
            }
            LrScaling::Sqrt => {
                format!("lr {lr:e} (--lr {base:e} × √{world_size} ranks, sqrt scaling)")
            }
        };
        match self.schedule.kind {
            ScheduleKind::Constant => text,
            ScheduleKind::Cosine => format!("{text}, schedule {}", self.schedule.describe()),
        }
    }

    /// The optimizer as the first line names it: `adam`, or `sgd (momentum 0.9)`, and the
    /// gradient clipping if any.
    pub fn describe_optimizer(&self) -> String {
        let name: String = match self.optimizer {
            OptimizerKind::Adam => "adam".into(),
            OptimizerKind::Adamw => "adamw (weight decay 0.01)".into(),
            OptimizerKind::Sgd if self.momentum > 0.0 => {
                format!("sgd (momentum {})", self.momentum)
            }
            OptimizerKind::Sgd => "sgd".into(),
        };
        match self.max_grad_norm {
            Some(max) => format!("{name}, gradients clipped at global norm {max}"),
            None => name,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    fn defaults() -> TrainArgs {
        TrainArgs {
            epochs: Some(3),
            batch_size: Some(64),
            lr: Some(1e-3),
            ..Default::default()
        }
    }

    #[test]
    fn a_backend_left_out_of_the_build_names_its_feature_and_the_commands() {
        let wgpu = BackendKind::Vulkan.missing_feature_error("train-mnist");
        assert!(wgpu.starts_with("--backend vulkan: "), "{wgpu}");
        assert!(wgpu.contains("`ddp-apps/wgpu`"), "{wgpu}");
        assert!(
            wgpu.contains("`cargo build --release --features ddp-apps/wgpu --bin train-mnist`"),
            "{wgpu}"
        );
        assert!(
            wgpu.contains("`cargo xtask train-mnist --backend vulkan`"),
            "{wgpu}"
        );
        // train-gpt has no task of its own: only the cargo command.
        let cuda = BackendKind::Cuda.missing_feature_error("train-gpt");
        assert!(
            cuda.contains("`cargo build --release --features ddp-apps/cuda --bin train-gpt`"),
            "{cuda}"
        );
        assert!(!cuda.contains("xtask"), "{cuda}");
        assert_eq!(BackendKind::Cpu.feature(), None);
        assert_eq!(BackendKind::Metal.feature(), Some("wgpu"));
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.toml");
        std::fs::write(&file, "epochs = 7\nbatch-size = 32\noptimizer = \"sgd\"\n").unwrap();
        let cli = Cli::parse_from([
            "t",
            "--config",
            file.to_str().unwrap(),
            "--batch-size",
            "16",
        ]);
        let cfg = cli.args.resolve(&defaults()).unwrap();
        assert_eq!(cfg.batch_size, 16); // flag
        assert_eq!(cfg.epochs, 7); // file
        assert_eq!(cfg.optimizer, OptimizerKind::Sgd); // file
        assert_eq!(cfg.lr, 1e-3); // default
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "epoch = 7\n").unwrap();
        let args = TrainArgs {
            config: Some(file.clone()),
            ..Default::default()
        };
        let err = format!("{:#}", args.resolve(&defaults()).unwrap_err());
        assert!(err.contains("bad.toml") && err.contains("epoch"), "{err}");
        let cli = Cli::parse_from(["t", "--batch-size", "0"]);
        assert!(cli.args.resolve(&defaults()).is_err());
    }

    #[test]
    fn comm_hook_flags_and_toml_keys() {
        let resolve = |flags: &[&str]| {
            let argv: Vec<&str> = std::iter::once("t").chain(flags.iter().copied()).collect();
            Cli::parse_from(argv).args.resolve(&defaults())
        };
        let cfg = resolve(&[]).unwrap();
        assert_eq!(
            (cfg.comm_hook, cfg.compression),
            (HookKind::None, CompressionKind::None)
        );
        assert_eq!(cfg.ddp_comm_hook(), ddp::CommHookKind::AllReduce);
        // bf16 either way, the older flag an alias.
        for flags in [&["--comm-hook", "bf16"][..], &["--compression", "bf16"][..]] {
            let cfg = resolve(flags).unwrap();
            assert_eq!(
                (cfg.comm_hook, cfg.compression),
                (HookKind::Bf16, CompressionKind::Bf16)
            );
        }
        let cfg = resolve(&[
            "--comm-hook",
            "powersgd",
            "--powersgd-rank",
            "4",
            "--powersgd-start",
            "7",
        ])
        .unwrap();
        assert_eq!(cfg.compression, CompressionKind::None);
        assert_eq!(
            cfg.ddp_comm_hook(),
            ddp::CommHookKind::PowerSgd(
                ddp::PowerSgdConfig::new()
                    .with_matrix_approximation_rank(4)
                    .with_start_powersgd_iter(7)
            )
        );
        let refused = |flags: &[&str], needle: &str| {
            let err = format!("{:#}", resolve(flags).unwrap_err());
            assert!(err.contains(needle), "{flags:?}: {err}");
        };
        refused(
            &["--comm-hook", "powersgd", "--compression", "bf16"],
            "disagree",
        );
        refused(&["--powersgd-rank", "4"], "need --comm-hook powersgd");
        refused(
            &["--comm-hook", "powersgd", "--zero-stage", "1"],
            "--zero-stage",
        );
        refused(
            &["--comm-hook", "powersgd", "--powersgd-rank", "0"],
            "matrix_approximation_rank",
        );
        // The same keys in the TOML file.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.toml");
        std::fs::write(
            &file,
            "comm-hook = \"powersgd\"\npowersgd-rank = 2\npowersgd-start = 3\n",
        )
        .unwrap();
        let cfg = resolve(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!(
            (cfg.comm_hook, cfg.powersgd_rank, cfg.powersgd_start),
            (HookKind::Powersgd, 2, 3)
        );
    }

    #[test]
    fn lr_scaling() {
        let mut cfg = Cli::parse_from(["t", "--lr-scaling", "linear"])
            .args
            .resolve(&defaults())
            .unwrap();
        assert_eq!(cfg.scaled_lr(4), 4e-3);
        cfg.lr_scaling = LrScaling::Sqrt;
        assert_eq!(cfg.scaled_lr(4), 2e-3);
    }

    #[test]
    fn the_first_line_names_the_learning_rate_and_optimizer_in_words() {
        let mut cfg = Cli::parse_from(["t", "--lr", "0.001"])
            .args
            .resolve(&defaults())
            .unwrap();
        assert_eq!(cfg.describe_lr(2), "lr 1e-3 (not scaled)");
        cfg.lr_scaling = LrScaling::Linear;
        assert_eq!(
            cfg.describe_lr(2),
            "lr 2e-3 (--lr 1e-3 × 2 ranks, linear scaling)"
        );
        cfg.lr_scaling = LrScaling::Sqrt;
        assert_eq!(
            cfg.describe_lr(4),
            "lr 2e-3 (--lr 1e-3 × √4 ranks, sqrt scaling)"
        );
        cfg.optimizer = OptimizerKind::Sgd;
        cfg.momentum = 0.9;
        assert_eq!(cfg.describe_optimizer(), "sgd (momentum 0.9)");
        cfg.optimizer = OptimizerKind::Adam;
        assert_eq!(cfg.describe_optimizer(), "adam");
    }
}
