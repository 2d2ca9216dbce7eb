//! ddp-apps: the pieces behind the binaries (`train-mnist`, `train-pima`, `train-gpt`,
//! `ddp-allreduce-bench`): settings, the shared training loop (checkpoints through `ddp`'s), its
//! elastic variant (`elastic.rs`), metrics. The
//! binaries themselves only parse arguments and wire these and the library crates together.

#![warn(missing_docs)]

pub mod alloc;
pub mod elastic;
pub mod fit;
mod frame;
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub mod gpu;
pub mod metrics;
pub mod options;
pub mod schedule;
pub mod spawn;
mod stepper;
pub mod trace;
pub mod train;
mod warm_up;
