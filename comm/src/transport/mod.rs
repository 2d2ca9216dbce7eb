//! The transports. Over TCP: the running mesh of connections to every peer (`mesh.rs`), what a
//! link's threads share (`link.rs`: messages, credits, lent memory), the threads themselves
//! (`reader.rs`, `writer.rs`), heartbeats (`liveness.rs`), a group's failure and who failed
//! first (`health.rs`) and recycled segment buffers (`buffers.rs`). Over shared memory: which
//! ranks share a host (`topology.rs`) and the shared-memory transport (`shm.rs`).

pub(crate) mod buffers;
pub(crate) mod health;
pub(crate) mod link;
pub(crate) mod liveness;
pub(crate) mod mesh;
pub(crate) mod reader;
pub(crate) mod shm;
pub(crate) mod topology;
pub(crate) mod writer;
