//! A gradient's path from burn to the averaged result, as PyTorch's c10d `Reducer` takes it:
//! the parameter checks and the start from rank 0's values (`agree.rs`), the bucket layout
//! (`buckets.rs`), the pipeline that packs, submits and unpacks the buckets' parts
//! (`pipeline.rs`) through a carrier (`carrier.rs`: on the host `host_carrier.rs` with its
//! buffers `host_buf.rs`, on the GPU `cuda_carrier.rs` and `device_path.rs`), the assembly of
//! whole buckets for communication hooks (`hook_buckets.rs`), the hooks that start buckets
//! during backward (`overlap.rs`, `overlap_ops.rs`), what a sync measures (`stats.rs`), and the
//! [`Reducer`](reducer::Reducer) that owns all of it for both wrappers (`reducer.rs`).

pub(crate) mod agree;
pub(crate) mod buckets;
pub(crate) mod carrier;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_carrier;
#[cfg(feature = "cuda")]
pub(crate) mod device_path;
pub(crate) mod hook_buckets;
pub(crate) mod host_buf;
pub(crate) mod host_carrier;
pub(crate) mod overlap;
pub(crate) mod overlap_ops;
pub(crate) mod pipeline;
pub(crate) mod reducer;
pub(crate) mod stats;
