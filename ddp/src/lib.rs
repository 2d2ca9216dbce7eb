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

pub mod checkpoint;
mod config;
mod ddp;
mod elastic;
mod error;
mod gradients;
mod hooks;
pub mod kernel_cache;
mod optim;
mod params;
mod resume;
#[cfg(test)]
mod test_ranks;
mod zero;

pub use crate::config::{CommHookKind, Compression, DdpConfig};
pub use crate::ddp::DistributedDataParallel;
pub use crate::gradients::stats::{SyncPhase, SyncSpan, SyncStats};
pub use crate::hooks::comm_hook::{BucketDesc, CommHook, GradBuffer, GradSlot};
pub use elastic::elastic_ddp::{ElasticDdp, ElasticOptimizer, Membership, Outcome, Progress};
pub use elastic::heal_hooks::{set_heal_hooks, HealHooks};
pub use error::DdpError;
pub use hooks::powersgd::{PowerSgd, PowerSgdFlight};
pub use hooks::powersgd_config::PowerSgdConfig;
pub use optim::fused_adam::{FusedAdam, FusedAdamW};
pub use optim::shard_optim::{
    ShardOptimizer, ShardedAdamConfig, ShardedAdamWConfig, ShardedSgdConfig,
};
pub use params::{flatten_params, load_flat_params, param_infos, ParamInfo, ParamKind};
pub use resume::{
    fetch, resume, resume_sharded, save_checkpoint, save_ddp_checkpoint, save_sharded_checkpoint,
    Position, Resumed, ResumedSharded, RunId,
};
pub use zero::{ShardMemory, ShardedDataParallel, ZeroConfig, ZeroStage, ZeroStats};

// What a user's program needs from the communication layer, so that `ddp` is its one
// dependency besides burn.
pub use ddp_comm::{CommError, ElasticConfig, ElasticGroup, ProcessGroup, ReduceOp};

#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
