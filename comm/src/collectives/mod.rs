//! The collectives: ring, direct exchange and chain over TCP (`algorithms.rs`), the same
//! collectives over shared memory (`shm_algorithms.rs`), which transport carries each
//! collective and the hierarchical forms across hosts (`dispatch.rs`), and the element types
//! with their reduction kernels (`element.rs`: [`Element`](crate::Element),
//! [`DType`](crate::DType), [`ReduceOp`](crate::ReduceOp)).

pub(crate) mod algorithms;
pub(crate) mod dispatch;
pub(crate) mod element;
pub(crate) mod shm_algorithms;
