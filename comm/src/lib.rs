//! ddp-comm: process group, rendezvous and collectives (placeholder; see docs/comm-api.md).
pub mod launch;
