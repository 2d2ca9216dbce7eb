//! The wrapper's settings: [`DdpConfig`], the wire type of gradients, [`Compression`], and
//! the built-in communication hook, [`CommHookKind`].

use burn::config::Config;
use serde::{Deserialize, Serialize};

use crate::hooks::powersgd_config::PowerSgdConfig;

/// Element type of the gradient all-reduce.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum Compression {
    /// All-reduce in `f32` (exact averaging up to float rounding); the default.
    None,
    /// Convert each bucket to `bf16` before the all-reduce and back after: half the bytes, about
    /// three significant decimal digits. Gradients are divided by the world size first (like
    /// PyTorch's fp16 compression hook), so no partial sum exceeds the largest gradient.
    Bf16,
    /// Convert each bucket to `f16` before the all-reduce and back after: half the bytes, more
    /// mantissa than bf16 but a range of about ±65504, which the division by the world size
    /// before the all-reduce keeps partial sums inside.
    F16,
}

/// The built-in communication hook that averages each bucket (PyTorch's
/// `register_comm_hook` with one of its `ddp_comm_hooks`). A user's own hook is installed with
/// [`DistributedDataParallel::register_comm_hook`](crate::DistributedDataParallel::register_comm_hook)
/// instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub enum CommHookKind {
    /// All-reduce each part of a bucket in [`DdpConfig::compression`]'s wire type and divide by
    /// the world size: PyTorch's default, `bf16_compress_hook` or `fp16_compress_hook`. The
    /// default; no hook object runs (the fast path).
    #[default]
    AllReduce,
    /// PowerSGD ([`PowerSgd`](crate::PowerSgd), PyTorch's `powerSGD_hook`) with these settings.
    /// Needs [`DdpConfig::compression`] `None` and gradients through the host (not ZeRO, not
    /// the GPU path through NCCL).
    PowerSgd(PowerSgdConfig),
}

/// Settings of [`DistributedDataParallel`](crate::DistributedDataParallel), a burn `Config` (builder methods `with_*`, saved
/// and loaded as JSON with the run's other configs); `DdpConfig::new()` (= `default()`) matches
/// PyTorch's defaults.
#[derive(Config, Debug, PartialEq)]
pub struct DdpConfig {
    /// Target size of a gradient bucket in MiB (PyTorch's `bucket_cap_mb`, default 25).
    #[config(default = 25.0)]
    pub bucket_cap_mb: f64,
    /// Size of the first bucket in MiB (default 1), so that communication starts early.
    #[config(default = 1.0)]
    pub first_bucket_mb: f64,
    /// Element type on the wire for gradients.
    #[config(default = "Compression::None")]
    pub compression: Compression,
    /// The built-in communication hook (default: all-reduce, in `compression`'s wire type).
    #[config(default = "CommHookKind::AllReduce")]
    pub comm_hook: CommHookKind,
    /// When `Some(k)`, every k-th call of [`DistributedDataParallel::sync`](crate::DistributedDataParallel::sync) first checks that all
    /// replicas hold bit-identical parameters (trainable and frozen), and fails naming the
    /// ranks that diverged (see [`DistributedDataParallel::check_replicas`](crate::DistributedDataParallel::check_replicas)).
    #[config(default = "None")]
    pub check_replicas_every: Option<u64>,
    /// Whether every sync overwrites the module's buffers (burn's `RunningState`s: BatchNorm's
    /// running statistics) with rank 0's, as PyTorch's `broadcast_buffers=True` (the default).
    /// Off, each rank keeps the statistics of its own batches.
    #[config(default = true)]
    pub broadcast_buffers: bool,
    /// Start each bucket's all-reduce while backward runs, as PyTorch DDP's autograd hooks do:
    /// the loop calls [`DistributedDataParallel::prepare`](crate::DistributedDataParallel::prepare)
    /// on the model before the forward pass and
    /// [`DistributedDataParallel::backward`](crate::DistributedDataParallel::backward) on the
    /// loss (burn's CPU backend with autodiff; elsewhere it has no effect). Results are
    /// bit-identical either way. On by default (`cargo xtask bench-overlap`: it is faster or
    /// as fast for every model and link measured); `with_overlap(false)` starts the
    /// all-reduces after backward. A loop that never calls `prepare` does not overlap.
    #[config(default = true)]
    pub overlap: bool,
    /// Clip the averaged gradient to this global 2-norm, as PyTorch's
    /// `clip_grad_norm_(model.parameters(), max_norm)` after DDP's average: when the norm of
    /// all the gradients taken together exceeds it, each is multiplied by
    /// `max_norm / (norm + 1e-6)`. [`DistributedDataParallel::grad_norm`](crate::DistributedDataParallel::grad_norm)
    /// gives the norm before clipping; ZeRO's [`ZeroConfig`](crate::ZeroConfig) has the same
    /// setting, with the same bits. `None` (the default): no clipping.
    #[config(default = "None")]
    pub max_grad_norm: Option<f32>,
}

// burn's `Config` derive re-emits an enum without the `#[default]` helper attribute, so the
// default is written out.
#[allow(clippy::derivable_impls)]
impl Default for Compression {
    fn default() -> Self {
        Compression::None
    }
}

impl Default for DdpConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The settings the `Reducer` (`gradients/reducer.rs`) needs, shared by [`DdpConfig`] and [`crate::ZeroConfig`]
/// (which have the same fields for them, with the same defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ReducerSettings {
    /// Largest bucket in MiB (PyTorch's `bucket_cap_mb`).
    pub(crate) bucket_cap_mb: f64,
    /// Size of the first bucket in MiB.
    pub(crate) first_bucket_mb: f64,
    /// Element type of the all-reduce (`None` under ZeRO).
    pub(crate) compression: Compression,
    /// Every k-th sync checks that the replicas are identical.
    pub(crate) check_replicas_every: Option<u64>,
    /// Whether every sync broadcasts rank 0's buffers.
    pub(crate) broadcast_buffers: bool,
    /// Whether buckets start during backward.
    pub(crate) overlap: bool,
}

impl From<&DdpConfig> for ReducerSettings {
    fn from(config: &DdpConfig) -> Self {
        Self {
            bucket_cap_mb: config.bucket_cap_mb,
            first_bucket_mb: config.first_bucket_mb,
            compression: config.compression,
            check_replicas_every: config.check_replicas_every,
            broadcast_buffers: config.broadcast_buffers,
            overlap: config.overlap,
        }
    }
}
