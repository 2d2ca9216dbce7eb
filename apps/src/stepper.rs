//! The trainers' optimizer step, either way `--zero-stage` asks for: plain DDP (stage 0:
//! `DistributedDataParallel` averages the gradients, burn's optimizer steps the whole model on
//! every rank) or sharded (stages 1 and 2: `ShardedDataParallel` reduce-scatters the gradients
//! and steps this rank's shard with the same Adam or SGD math). Checkpoints and resume follow:
//! burn's optimizer record for stage 0, the consolidated sharded state for stages 1 and 2
//! (resumable at another world size).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Tensor;
use ddp::{
    CommHookKind, Compression, DdpConfig, DdpError, DistributedDataParallel, FusedAdam, FusedAdamW,
    Position, ProcessGroup, Resumed, RunId, ShardOptimizer, ShardedAdamConfig, ShardedAdamWConfig,
    ShardedDataParallel, ShardedSgdConfig, SyncSpan, SyncStats, ZeroConfig, ZeroStage,
};

use crate::options::{CompressionKind, OptimizerKind, TrainConfig};

/// The optimizer step of a run.
// One per process, never moved in a loop: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Stepper {
    /// Stage 0: DDP and burn's optimizer.
    Ddp {
        ddp: DistributedDataParallel,
        optim: ModuleOptimizer,
    },
    /// Stages 1 and 2.
    Zero(ShardedDataParallel),
}

/// burn's optimizer for `cfg` (stage 0), as the trainers have always used it: Adam with
/// PyTorch's epsilon (1e-8), or SGD with `--momentum` (burn's dampening). Adam is
/// [`FusedAdam`]: burn's Adam bit for bit, with burn's record, in one pass over memory on the
/// CPU backend.
pub(crate) fn burn_optimizer(cfg: &TrainConfig) -> ModuleOptimizer {
    match cfg.optimizer {
        OptimizerKind::Adam => FusedAdam::init(&ShardedAdamConfig::new().with_epsilon(1e-8)),
        OptimizerKind::Adamw => FusedAdamW::init(&ShardedAdamWConfig::new()),
        OptimizerKind::Sgd => {
            let momentum = (cfg.momentum > 0.0)
                .then(|| burn::optim::momentum::MomentumConfig::new().with_momentum(cfg.momentum));
            burn::optim::SgdConfig::new().with_momentum(momentum).init()
        }
    }
}

/// DDP's settings for `cfg` (stage 0): buckets, wire type, communication hook, overlap and
/// clipping.
pub(crate) fn ddp_config(cfg: &TrainConfig) -> DdpConfig {
    DdpConfig {
        bucket_cap_mb: cfg.bucket_cap_mb,
        compression: match cfg.compression {
            CompressionKind::None => Compression::None,
            CompressionKind::Bf16 => Compression::Bf16,
            CompressionKind::F16 => Compression::F16,
        },
        comm_hook: cfg.ddp_comm_hook(),
        overlap: cfg.overlap,
        max_grad_norm: cfg.max_grad_norm,
        ..DdpConfig::default()
    }
}

/// ZeRO's settings for `cfg` (`None`: stage 0, plain DDP).
pub(crate) fn zero_config(cfg: &TrainConfig) -> Option<ZeroConfig> {
    let stage = match cfg.zero_stage {
        0 => return None,
        1 => ZeroStage::One,
        _ => ZeroStage::Two,
    };
    Some(
        ZeroConfig::new(stage)
            .with_bucket_cap_mb(cfg.bucket_cap_mb)
            .with_overlap(cfg.overlap)
            .with_max_grad_norm(cfg.max_grad_norm),
    )
}

/// The sharded optimizer with the same math as [`burn_optimizer`].
pub(crate) fn shard_optimizer(cfg: &TrainConfig) -> ShardOptimizer {
    match cfg.optimizer {
        OptimizerKind::Adam => ShardOptimizer::Adam(ShardedAdamConfig::new().with_epsilon(1e-8)),
        OptimizerKind::Adamw => ShardOptimizer::AdamW(ShardedAdamWConfig::new()),
        OptimizerKind::Sgd => ShardOptimizer::Sgd(
            ShardedSgdConfig::new().with_momentum((cfg.momentum > 0.0).then_some(cfg.momentum)),
        ),
    }
}

/// Restores the model (and, at stage 0, burn's optimizer) from the checkpoint at `path`; also
/// returns the state [`Stepper::new`] loads after wrapping: at stage 0 this rank's
/// communication hook state (PowerSGD's), at stages 1 and 2 the consolidated optimizer state.
pub(crate) fn resume<M: Module>(
    cfg: &TrainConfig,
    pg: &ProcessGroup,
    path: &Path,
    run: &RunId,
    model: M,
    optim: ModuleOptimizer,
) -> Result<(Resumed<M>, Option<Vec<u8>>), DdpError> {
    if cfg.zero_stage == 0 {
        return ddp::resume(pg, path, run, model, optim).map(|mut r| {
            let hook_state = r.comm_hook_state.take();
            (r, hook_state)
        });
    }
    let r = ddp::resume_sharded(pg, path, run, model)?;
    let resumed = Resumed {
        model: r.model,
        optim,
        meta: r.meta,
        mismatch: r.mismatch,
        comm_hook_state: None,
    };
    Ok((resumed, r.optim_state))
}

impl Stepper {
    /// Wraps `model` for `cfg`'s stage and loads `saved_state` (from [`resume`]), naming
    /// `source` in errors: a DDP run with PowerSGD its hook state (ignored without a hook), a
    /// sharded run its consolidated optimizer state.
    pub(crate) fn new<M: Module>(
        cfg: &TrainConfig,
        pg: Arc<ProcessGroup>,
        model: M,
        optim: ModuleOptimizer,
        saved_state: Option<(Vec<u8>, String)>,
    ) -> Result<(M, Stepper), DdpError> {
        let Some(config) = zero_config(cfg) else {
            let (model, mut ddp) = DistributedDataParallel::new(model, pg, ddp_config(cfg))?;
            let hooked = matches!(ddp.config().comm_hook, CommHookKind::PowerSgd(_));
            if let Some((bytes, source)) = saved_state.filter(|_| hooked) {
                ddp.load_comm_hook_state(&bytes, &source)?;
            }
            return Ok((model, Stepper::Ddp { ddp, optim }));
        };
        let (model, mut zero) = ShardedDataParallel::new(model, pg, config, shard_optimizer(cfg))?;
        if let Some((bytes, source)) = saved_state {
            zero.load_consolidated(&bytes, &source)?;
        }
        Ok((model, Stepper::Zero(zero)))
    }

    /// What the first line says about the step of `model`: `DDP` or `ZeRO stage N`, with
    /// `--overlap` (the default) whether the collectives really start during backward (and
    /// why not where they cannot).
    pub(crate) fn describe<M: Module>(&self, model: &M, overlap: bool) -> String {
        let (what, why_not, during) = match self {
            Stepper::Ddp { ddp, .. } => (
                match &ddp.config().comm_hook {
                    CommHookKind::PowerSgd(c) => format!(
                        "DDP with PowerSGD (rank {}, compressing from step {})",
                        c.matrix_approximation_rank, c.start_powersgd_iter
                    ),
                    CommHookKind::AllReduce if ddp.gradients_on_device() => {
                        "DDP, gradients all-reduced on the GPU through NCCL".to_string()
                    }
                    CommHookKind::AllReduce => "DDP".to_string(),
                },
                ddp.why_no_overlap(model),
                "all-reduces during backward",
            ),
            Stepper::Zero(z) => {
                let m = z.memory();
                let what = format!(
                    "ZeRO stage {} (this rank steps {} of {} parameters, {:.1} MiB of \
                     optimizer state)",
                    match z.stage() {
                        ZeroStage::One => 1,
                        ZeroStage::Two => 2,
                    },
                    m.shard,
                    m.params,
                    m.optimizer_bytes as f64 / (1024.0 * 1024.0)
                );
                (
                    what,
                    z.why_no_overlap(model),
                    "reduce-scatters during backward",
                )
            }
        };
        match (overlap, why_not) {
            (false, _) => what,
            (true, None) => format!("{what} ({during})"),
            (true, Some(why)) => format!("{what} (no overlap: {why})"),
        }
    }

    /// The model the forward pass runs on: with `--overlap`, a copy whose parameters report
    /// their gradients during backward (`DistributedDataParallel::prepare`,
    /// `ShardedDataParallel::prepare`); otherwise a clone of `model`. Drop it once the loss is
    /// computed.
    pub(crate) fn prepare<M: Module>(&mut self, model: &M) -> M {
        match self {
            Stepper::Ddp { ddp, .. } => ddp.prepare(model),
            Stepper::Zero(zero) => zero.prepare(model),
        }
    }

    /// Runs backward on `loss` (of the model [`prepare`](Self::prepare) gave), averages the
    /// gradients across ranks and steps `model`; also returns when backward ended and when
    /// the optimizer step began (for the trace: a sharded step's reduce-scatter, update and
    /// all-gather are one span, the sync).
    pub(crate) fn step<M: Module>(
        &mut self,
        lr: f64,
        model: M,
        loss: Tensor<1>,
        traced: bool,
    ) -> Result<(M, Instant, Instant), DdpError> {
        match self {
            Stepper::Ddp { ddp, optim } => {
                ddp.record_spans(traced);
                let grads = ddp.backward(&model, loss)?;
                let t_optim = Instant::now();
                let t_sync = ddp.last_backward().map_or(t_optim, |(_, end)| end);
                Ok((optim.step(lr, model, grads), t_sync, t_optim))
            }
            Stepper::Zero(zero) => {
                let model = zero.backward_step(lr, model, loss)?;
                let t_optim = Instant::now();
                let t_sync = zero.last_backward().map_or(t_optim, |(_, end)| end);
                Ok((model, t_sync, t_optim))
            }
        }
    }

    /// Communication statistics since the last call. A sharded step reports its
    /// reduce-scatters and all-gather (packing included) as `wait` and its shard update as
    /// `unpack`.
    pub(crate) fn take_stats(&mut self) -> SyncStats {
        match self {
            Stepper::Ddp { ddp, .. } => ddp.take_stats(),
            Stepper::Zero(zero) => zero.take_stats().into(),
        }
    }

    /// The per-bucket spans of the traced steps (DDP only).
    pub(crate) fn take_spans(&mut self) -> Vec<SyncSpan> {
        match self {
            Stepper::Ddp { ddp, .. } => ddp.take_spans(),
            Stepper::Zero(_) => Vec::new(),
        }
    }

    /// Saves a checkpoint into `dir` (every rank calls it; rank 0 writes).
    pub(crate) fn save<M: Module>(
        &self,
        pg: &ProcessGroup,
        dir: &Path,
        run: &RunId,
        position: &Position,
        model: &M,
    ) -> Result<Option<PathBuf>, DdpError> {
        match self {
            Stepper::Ddp { ddp, optim } => {
                ddp::save_ddp_checkpoint(pg, dir, run, position, model, optim, ddp)
            }
            Stepper::Zero(zero) => {
                ddp::save_sharded_checkpoint(pg, dir, run, position, model, zero)
            }
        }
    }
}
