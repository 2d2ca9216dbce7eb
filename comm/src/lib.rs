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
//! Where things are (each file opens with how its part works and why):
//!
//! - the group: `group.rs` ([`ProcessGroup`] and its communication thread), `work.rs`
//!   ([`Work`]), `join.rs` (the steps of joining a group);
//! - configuration: `config.rs` ([`GroupConfig`], [`Transport`], the defaults), `env.rs`
//!   (torchrun's, Slurm's and the `DDP_*` variables, in order of precedence), `slurm.rs` (Slurm's
//!   node lists and task counts), `builder.rs` ([`GroupBuilder`]);
//! - rendezvous: `store_server.rs` (the store rank 0 hosts, [`StoreHost`]), `store.rs` (its
//!   client [`Store`]), `torch_store.rs` (the client side of PyTorch's `TCPStore` protocol, for
//!   torchrun's and ddprun's agent store), `torch_store_server.rs` (its server side,
//!   [`TorchStoreHost`], which ddprun hosts) and `torch_store_request.rs` (its requests, as the
//!   server reads them), `handshake.rs` (connecting with retries, the handshake of every
//!   connection), `connect.rs` (the full mesh of peer connections);
//! - the wire format: `wire.rs` (handshake, frame header, store protocol);
//! - the TCP transport: `transport.rs` (the running mesh of connections to every peer),
//!   `link.rs` (what a link's threads share: messages, credits, lent memory), `reader.rs` and
//!   `writer.rs` (a link's threads), `liveness.rs` (heartbeats), `health.rs` (a group's
//!   failure and who failed first), `buffers.rs` (recycled segment buffers);
//! - shared memory: `topology.rs` (which ranks share a host), `shm.rs` (the shared-memory
//!   transport);
//! - the algorithms: `algorithms.rs` (ring, direct exchange and chain over TCP),
//!   `shm_algorithms.rs` (the same collectives over shared memory), `collectives.rs` (which
//!   transport carries each collective, and the hierarchical forms across hosts);
//! - `element.rs`: [`Element`], [`DType`], [`ReduceOp`] and the reduction kernels;
//! - `error.rs`: [`CommError`];
//! - `flight.rs`: the flight recorder (the last collectives, dumped on failure, timeout or
//!   SIGUSR1) and the hang report merged from the ranks' dumps;
//! - `elastic.rs`: what a rank shares with its launcher (ddprun in `ddp-launch`, or torchrun):
//!   the error file, the restart variables, the agent-store variable, the store socket a
//!   launcher may hand rank 0;
//! - elastic membership: `elastic_group.rs` ([`ElasticGroup`]: a group whose ranks leave and
//!   join while the job runs, through the launcher's store), `membership.rs` (its records and
//!   decisions: who is in each generation, from which step it continues), `elastic_agents.rs`
//!   (the launchers of an elastic job in its store: [`AgentPresence`], [`AgentWatch`], so that
//!   node 0's launcher keeps the store until every other launcher has seen the job's end);
//! - `clock.rs`: deadlines and wall-clock stamps; `hash.rs`: FNV-1a; `size.rs`: byte sizes as
//!   people write them;
//! - `nccl/` (feature `nccl`): `nccl::NcclGroup`, collectives on CUDA buffers through NCCL.
#![warn(missing_docs)]

mod algorithms;
mod buffers;
mod builder;
mod clock;
mod collectives;
mod config;
mod connect;
pub mod elastic;
mod elastic_agents;
mod elastic_group;
mod elastic_poller;
mod elastic_seal;
mod element;
mod env;
pub use env::LAUNCHER_ENV;
mod error;
pub mod flight;
mod group;
mod handshake;
pub mod hash;
mod health;
mod join;
mod kubeflow;
mod link;
mod liveness;
pub mod membership;
#[cfg(feature = "nccl")]
pub mod nccl;
mod reader;
mod shm;
mod shm_algorithms;
pub mod size;
mod slurm;
mod store;
mod store_server;
mod topology;
mod torch_store;
mod torch_store_request;
mod torch_store_server;
mod transport;
mod wire;
#[cfg(test)]
mod wire_fuzz;
mod work;
mod writer;

pub use algorithms::chunk_range;
pub use builder::GroupBuilder;
pub use config::{
    default_small_allreduce_bytes, GroupConfig, Transport, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MASTER_PORT, DEFAULT_PEER_TIMEOUT, DEFAULT_SEGMENT_BYTES,
    DEFAULT_SMALL_ALLREDUCE_BYTES, DEFAULT_TIMEOUT, MAX_SEGMENT_BYTES,
};
pub use elastic_agents::{
    next_node_rank, AgentPresence, AgentWatch, AGENTS_PREFIX, AGENT_BEAT, AGENT_SILENCE,
};
pub use elastic_group::{
    elastic_job_state, parse_range, Change, Continue, ElasticConfig, ElasticGroup, StepStatus,
    Vote, DEFAULT_LAST_CALL, DEFAULT_POLL, ELASTIC_ENV, ELASTIC_ROUND_ENV,
};
pub use element::{DType, Element, ReduceOp};
pub use error::CommError;
pub use flight::{CollectiveRecord, RecordState, FLIGHT_RECORDS};
pub use group::ProcessGroup;
pub use slurm::first_host;
pub use store::Store;
pub use store_server::StoreHost;
pub use torch_store_server::TorchStoreHost;
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
