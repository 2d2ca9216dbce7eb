//! Elastic membership: [`ElasticGroup`](crate::ElasticGroup), a group whose ranks leave and
//! join while the job runs, through the launcher's store (`group.rs`; its re-form in rounds
//! that survive a second failure, `reform.rs`; the founding decision under a lease,
//! `founding.rs`; each process's beat in the store, `beat.rs`; test hooks, `hooks.rs`; the
//! move of its store to a standby when the node that hosts it is lost, `failover.rs`, to the
//! standby stores that every other node's launcher keeps, `standby.rs`, and the way back to it
//! from the job's first address, `redirect.rs`); its records and
//! decisions, who is in each generation and from which step it continues (`records.rs`, whose
//! items are public here); and the launchers of an elastic job in its store (`agents.rs`:
//! [`AgentPresence`](crate::AgentPresence), [`AgentWatch`](crate::AgentWatch)).

pub(crate) mod agents;
pub(crate) mod beat;
pub(crate) mod failover;
pub(crate) mod founding;
pub(crate) mod group;
pub(crate) mod hooks;
pub(crate) mod poller;
pub(crate) mod records;
pub(crate) mod redirect;
pub(crate) mod reform;
pub(crate) mod seal;
pub(crate) mod standby;

pub use records::*;
