//! `ddp`: PyTorch-style DistributedDataParallel for any burn module.
//!
//! Construct a [`DistributedDataParallel`] from a model and a [`ddp_comm::ProcessGroup`]; it
//! checks that every rank holds the same parameter list and broadcasts rank 0's values. After
//! each backward pass, [`DistributedDataParallel::sync`] averages the gradients across ranks
//! with bucketed, asynchronous all-reduce, and the loop stays a burn loop.
//! [`ShardedDataParallel`] shards the optimizer state (ZeRO stage one) and the gradients
//! (stage two) instead, stepping each rank's shard with burn's Adam or SGD math. See the crate
//! README.

#![warn(missing_docs)]

mod agree;
mod buckets;
mod carrier;
pub mod checkpoint;
mod clip;
mod comm_hook;
mod config;
mod ddp;
// The pipeline's carrier on the GPU (device tensors through NCCL).
#[cfg(feature = "cuda")]
mod cuda_carrier;
mod elastic;
mod elastic_zero;
mod error;
mod fused_adam;
mod heal_hooks;
mod hook_carrier;
mod host_buf;
pub mod kernel_cache;
mod overlap;
mod overlap_ops;
mod params;
mod pipeline;
mod powersgd;
mod powersgd_config;
mod powersgd_math;
mod powersgd_state;
mod reduction;
mod resume;
mod shard_layout;
mod shard_optim;
mod sync_stats;
#[cfg(test)]
mod test_ranks;
mod zero;
mod zero_keep;
mod zero_state;

pub use crate::comm_hook::{BucketDesc, CommHook, GradBuffer, GradSlot};
pub use crate::config::{CommHookKind, Compression, DdpConfig};
pub use crate::ddp::DistributedDataParallel;
pub use crate::sync_stats::{SyncPhase, SyncSpan, SyncStats};
pub use elastic::{ElasticDdp, ElasticOptimizer, Membership, Outcome, Progress};
pub use error::DdpError;
pub use fused_adam::{FusedAdam, FusedAdamW};
pub use heal_hooks::{set_heal_hooks, HealHooks};
pub use params::{flatten_params, load_flat_params, param_infos, ParamInfo, ParamKind};
pub use powersgd::{PowerSgd, PowerSgdFlight};
pub use powersgd_config::PowerSgdConfig;
pub use resume::{
    fetch, resume, resume_sharded, save_checkpoint, save_ddp_checkpoint, save_sharded_checkpoint,
    Position, Resumed, ResumedSharded, RunId,
};
pub use shard_optim::{ShardOptimizer, ShardedAdamConfig, ShardedAdamWConfig, ShardedSgdConfig};
pub use zero::{ShardMemory, ShardedDataParallel, ZeroConfig, ZeroStage, ZeroStats};

// What a user's program needs from the communication layer, so that `ddp` is its one
// dependency besides burn.
pub use ddp_comm::{CommError, ElasticConfig, ElasticGroup, ProcessGroup, ReduceOp};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
