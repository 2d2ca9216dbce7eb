//! ddp-bench: what the benchmark binaries of ddp-rs share (not published; `cargo xtask
//! bench-allreduce`, `bench-nccl` and `bench-zero` build and run them).
//!
//! - `ddp-allreduce-bench`: `ProcessGroup::all_reduce` over TCP and shared memory, one size after
//!   another; `ddp-nccl-bench`: the same through NCCL on CUDA buffers (what they share:
//!   [`sizes`]);
//! - `ddp-zero-bench`: what ZeRO sharding saves and costs ([`zero`]).

#![warn(missing_docs)]

pub mod sizes;
pub mod zero;
