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
//! Where things are (each folder's module says what its files do; each file opens with how
//! its part works and why):
//!
//! - the group: `group.rs` ([`ProcessGroup`] and its communication thread), `work.rs`
//!   ([`Work`]), `join.rs` (the steps of joining a group), `builder.rs` ([`GroupBuilder`]),
//!   `config.rs` ([`GroupConfig`], [`Transport`], the defaults), `error.rs` ([`CommError`]),
//!   `flight.rs` (the flight recorder: the last collectives, dumped on failure, timeout or
//!   SIGUSR1, and the hang report merged from the ranks' dumps), `wire.rs` (the wire format:
//!   handshake, frame header, store protocol);
//! - `rendezvous/`: the stores (ddp-comm's own, and PyTorch's `TCPStore` protocol, client and
//!   server), the handshake, the full mesh of peer connections;
//! - `transport/`: TCP (the mesh, its links and their threads, heartbeats, failure) and shared
//!   memory;
//! - `collectives/`: the algorithms over TCP and shared memory, which transport carries each
//!   collective, [`Element`], [`DType`], [`ReduceOp`] and the reduction kernels;
//! - `launcher/`: the launchers' variables (torchrun, ddprun, Slurm, Open MPI, MPICH,
//!   Kubeflow), read in `env.rs`, and what a rank shares with its launcher ([`elastic`]);
//! - `membership/`: elastic membership ([`ElasticGroup`], its records and decisions, the
//!   launchers of an elastic job in its store);
//! - `clock.rs`: deadlines and wall-clock stamps; `hash.rs`: FNV-1a; `size.rs`: byte sizes as
//!   people write them;
//! - `nccl/` (feature `nccl`): `nccl::NcclGroup`, collectives on CUDA buffers through NCCL.
#![warn(missing_docs)]

mod builder;
mod clock;
mod collectives;
mod config;
mod error;
pub mod flight;
mod group;
pub mod hash;
mod join;
mod launcher;
pub mod membership;
#[cfg(feature = "nccl")]
pub mod nccl;
mod rendezvous;
pub mod size;
mod transport;
mod wire;
#[cfg(test)]
mod wire_fuzz;
mod work;

/// What a launched rank shares with its launcher (`launcher/contract.rs`; the name is the
/// module's first, kept for the code written against it).
pub use launcher::contract as elastic;

pub use builder::GroupBuilder;
pub use collectives::algorithms::chunk_range;
pub use collectives::element::{DType, Element, ReduceOp};
pub use config::{
    default_small_allreduce_bytes, GroupConfig, Transport, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MASTER_PORT, DEFAULT_PEER_TIMEOUT, DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_ALLREDUCE_BYTES, DEFAULT_TIMEOUT, MAX_SEGMENT_BYTES,
};
pub use error::CommError;
pub use flight::{CollectiveRecord, RecordState, FLIGHT_RECORDS};
pub use group::ProcessGroup;
pub use launcher::env::LAUNCHER_ENV;
pub use launcher::slurm::first_host;
pub use membership::agents::{
    next_node_rank, AgentPresence, AgentWatch, AGENTS_PREFIX, AGENT_BEAT, AGENT_SILENCE,
};
pub use membership::group::{
    elastic_job_state, parse_range, Change, Continue, ElasticConfig, ElasticGroup, StepStatus,
    Vote, DEFAULT_LAST_CALL, DEFAULT_POLL, ELASTIC_ENV, ELASTIC_ROUND_ENV,
};
pub use membership::redirect::{moved_record, Redirect};
pub use membership::standby::{ranks_moved_to, MovedStore, Standby};
pub use rendezvous::store::Store;
pub use rendezvous::store_server::StoreHost;
pub use rendezvous::torch_store_server::TorchStoreHost;
pub use wire::MAX_TOKEN_BYTES;
pub use work::Work;

/// The former home of [`hash`]'s FNV-1a and [`size`]'s byte sizes, kept so that code written
/// against it still builds; use [`hash`] and [`size`].
#[doc(hidden)]
pub mod bytes {
    pub use crate::hash::{fnv1a, fnv1a_from, FNV1A_OFFSET};
    pub use crate::size::{human_size, parse_size};
}

/// The README's code blocks, compiled (and run) as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
