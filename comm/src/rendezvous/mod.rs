//! Rendezvous: how ranks find each other before any collective. ddp-comm's own store
//! (`store_server.rs`, [`StoreHost`](crate::StoreHost), which rank 0 hosts, and its client
//! `store.rs`), PyTorch's `TCPStore` protocol (`torch_store.rs`, the client of torchrun's and
//! ddprun's agent store; `torch_store_server.rs`, [`TorchStoreHost`](crate::TorchStoreHost),
//! the server ddprun hosts, with `torch_store_request.rs`, its requests as the server reads
//! them), connecting with retries and the handshake of every connection (`handshake.rs`), and
//! the full mesh of peer connections (`connect.rs`).

pub(crate) mod connect;
pub(crate) mod handshake;
pub(crate) mod store;
pub(crate) mod store_server;
pub(crate) mod torch_store;
pub(crate) mod torch_store_request;
pub(crate) mod torch_store_server;
