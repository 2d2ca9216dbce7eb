//! Elastic training: [`ElasticDdp`](elastic_ddp::ElasticDdp), which keeps a job going as ranks
//! leave and join (`elastic_ddp.rs`), ZeRO's re-sharding of the optimizer state for a new
//! world (`reshard.rs`), the hooks a user's program runs around a heal (`heal_hooks.rs`), and the
//! test hook that kills a joiner in the middle of its heal (`heal_die.rs`).

pub(crate) mod elastic_ddp;
pub(crate) mod heal_die;
pub(crate) mod heal_hooks;
pub(crate) mod reshard;
