//! ZeRO stages 1 and 2: [`ShardedDataParallel`] (`sharded.rs`), the shard layout
//! (`layout.rs`), the consolidated and per-rank saved states (`state.rs`) and the starting
//! point an elastic step keeps (`keep.rs`).

pub(crate) mod keep;
pub(crate) mod layout;
pub(crate) mod sharded;
pub(crate) mod state;

pub use sharded::{ShardMemory, ShardedDataParallel, ZeroConfig, ZeroStage, ZeroStats};
