//! ddp-comm: the communication layer of ddp-rs. A [`ProcessGroup`] of N processes (ranks)
//! rendezvous through a small TCP store hosted by rank 0, connect to each other over TCP, and run
//! collectives: all-reduce (sum, avg, min, max), broadcast, all-gather, reduce-scatter and
//! barrier, over `f32`, `f64`, `bf16`, `f16`, `i32`, `i64` and `u8`.
//!
//! ```
//! use ddp_comm::{ProcessGroup, ReduceOp};
//!
//! // With no RANK / WORLD_SIZE (or Slurm) variables this is a group of one process.
//! let pg = ProcessGroup::builder().no_env().build()?;
//! let grads = pg.all_reduce(vec![1.0f32, 2.0, 3.0], ReduceOp::Avg)?;
//! assert_eq!(grads, [1.0, 2.0, 3.0]);
//! let work = pg.submit_all_reduce(vec![1i64, 2], ReduceOp::Sum); // async
//! assert_eq!(work.wait()?, [1, 2]);
//! # Ok::<(), ddp_comm::CommError>(())
//! ```
//!
//! Where things are:
//! - `config.rs`: [`GroupConfig`] (torchrun / Slurm variables) and [`GroupBuilder`];
//! - `store.rs`: the rendezvous store and its client [`Store`];
//! - `torch_store.rs`: the client side of PyTorch's `TCPStore` protocol, for torchrun's agent
//!   store (`TORCHELASTIC_USE_AGENT_STORE=True`);
//! - `wire.rs`: the wire format (handshake, frame header, store protocol);
//! - `shm.rs`: the shared-memory transport of the ranks that share a host, and the topology
//!   (hosts, leaders) behind the hierarchical all-reduce ([`Transport`]);
//! - `connect.rs`: connecting with retries, handshakes, the full mesh of peer connections;
//! - `transport.rs`: the running mesh: reader/writer threads, flow control (credits), liveness,
//!   failure propagation;
//! - `algorithms.rs`: the ring all-reduce, the hierarchical all-reduce and the other collectives;
//! - `group.rs`: [`ProcessGroup`], its communication thread and [`Work`];
//! - `flight.rs`: the flight recorder (the last collectives, dumped on failure, timeout or
//!   SIGUSR1) and the hang report merged from the ranks' dumps;
//! - `element.rs`: [`Element`], [`DType`], [`ReduceOp`] and the reduction kernels;
//! - `elastic.rs`: what a rank shares with its launcher (ddprun in `ddp-launch`, or torchrun):
//!   the error file, the restart variables;
//! - `nccl.rs` (feature `nccl`): `nccl::NcclGroup`, collectives on CUDA buffers through NCCL.
#![warn(missing_docs)]

mod algorithms;
pub mod bytes;
mod config;
mod connect;
pub mod elastic;
mod element;
mod error;
pub mod flight;
mod group;
#[cfg(feature = "nccl")]
pub mod nccl;
mod shm;
mod store;
mod torch_store;
mod transport;
mod wire;
#[cfg(test)]
mod wire_fuzz;

pub use algorithms::chunk_range;
pub use config::{
    default_small_allreduce_bytes, first_host, GroupBuilder, GroupConfig, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MASTER_PORT, DEFAULT_PEER_TIMEOUT, DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_ALLREDUCE_BYTES, DEFAULT_TIMEOUT, MAX_SEGMENT_BYTES,
};
pub use element::{DType, Element, ReduceOp};
pub use error::CommError;
pub use flight::{CollectiveRecord, RecordState, FLIGHT_RECORDS};
pub use group::{ProcessGroup, Work};
pub use shm::Transport;
pub use store::{Store, StoreHost};
pub use wire::MAX_TOKEN_BYTES;

/// The README's code blocks, compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
