//! Optimizer math of the library: the sharded optimizer ZeRO steps its shards with
//! (`shard_optim.rs`), burn optimizers that step with the same math in place
//! (`fused_adam.rs`), and global-norm gradient clipping, the same bits in every mode
//! (`clip.rs`).

pub(crate) mod clip;
pub(crate) mod fused_adam;
pub(crate) mod shard_optim;
