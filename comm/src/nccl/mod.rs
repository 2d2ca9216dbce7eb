//! The NCCL backend (feature `nccl`): collectives on CUDA device buffers through NVIDIA's NCCL,
//! for one process per GPU, next to the TCP [`ProcessGroup`](crate::ProcessGroup) that the ranks already form.
//!
//! ```no_run
//! use ddp_comm::nccl::NcclGroup;
//! use ddp_comm::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;          // TCP group: rendezvous and store
//! let nccl = NcclGroup::new(&pg)?;             // GPU LOCAL_RANK, NCCL id through the store
//! let grads = nccl.to_device(&[1.0f32, 2.0, 3.0])?;
//! let work = nccl.submit_all_reduce(grads, ReduceOp::Avg); // async, on NCCL's own stream
//! let grads = work.wait()?;                    // the same device buffer, reduced in place
//! println!("{:?}", nccl.to_host(&grads)?);
//! # Ok::<(), ddp_comm::CommError>(())
//! ```
//!
//! How it works:
//!
//! - **Loading.** Nothing of CUDA is linked: cudarc opens `libcuda` and `libnccl` when first
//!   used (its `dynamic-loading` feature), so this builds on machines without a CUDA toolkit.
//!   cudarc panics when a library is missing; [`NcclGroup::new`] checks for both first
//!   ([`driver_present`], [`nccl_present`]) and turns absence into a [`CommError`](crate::CommError) that says what
//!   is missing.
//! - **Device.** Rank `LOCAL_RANK` uses GPU `LOCAL_RANK` (its primary context, the one burn's
//!   CUDA backend also uses, so device pointers are shared). Fewer visible GPUs than local
//!   ranks is an error, except that a process that sees exactly one GPU through
//!   `CUDA_VISIBLE_DEVICES` uses it (launchers that give each rank its own GPU that way).
//! - **Creation.** Every rank first opens its GPU, then the ranks all-gather through the TCP
//!   group whether that worked, so that a rank without a GPU fails every rank at once instead of
//!   leaving the others waiting inside NCCL. Rank 0 then creates NCCL's unique id and publishes
//!   it in the rendezvous store (key `ddp/nccl/unique_id/<n>`, n counting the NCCL groups made
//!   from this process group); the others read it, and all call `ncclCommInitRank`.
//! - **Operations.** Every collective is enqueued on the group's own CUDA stream and returns at
//!   once with an [`NcclWork`]; [`NcclWork::wait`] blocks the host until the stream has passed
//!   the collective. Buffers are cudarc [`CudaSlice`](cudarc::driver::CudaSlice)s: cudarc's event tracking makes our stream
//!   wait for earlier work on a buffer made on another stream, and later users of the buffer wait
//!   for the collective. For buffers owned by someone else (burn's tensors) there is
//!   [`NcclGroup::submit_all_reduce_ptr`], where the caller keeps those promises itself.
//! - **Failure.** NCCL itself hangs when a peer dies. [`NcclWork::wait`] polls its event and
//!   `ncclCommGetAsyncError`, and gives up at the group's deadline (the TCP group's `timeout`):
//!   it aborts the communicator (so that the stuck kernels end) and fails, and every later
//!   collective of the group fails at once with that first error. NCCL does not say which peer
//!   is missing; the TCP group (whose sockets see a dead process at once) usually does.
//!
//! NCCL has no barrier: [`NcclGroup::barrier`] all-reduces one value and waits for it. Collectives
//! carry no fingerprint on the wire (NCCL sends raw data), so every rank must submit the same
//! collectives with the same lengths in the same order; a mismatch hangs until the deadline or
//! garbles data, as with any NCCL program.
//!
//! Where things are: `library.rs` (loading the driver and NCCL, translating types and
//! results), `device.rs` (which GPU, opening it), `work.rs` ([`NcclWork`] and the communicator
//! it waits on), `group.rs` ([`NcclGroup`]: creation and the collectives).

mod device;
mod group;
mod library;
mod work;

pub use device::pick_device;
pub use group::NcclGroup;
pub use library::{device_count, driver_present, nccl_present, nccl_version};
pub use work::NcclWork;
