//! The NCCL backend (feature `nccl`): collectives on CUDA device buffers through NVIDIA's NCCL,
//! for one process per GPU, next to the TCP [`ProcessGroup`](crate::ProcessGroup) that the ranks already form.
//!
//! ```no_run
//! use ddp_comm::nccl::{load_cuda_libraries, NcclGroup};
//! use ddp_comm::{ProcessGroup, ReduceOp};
//!
//! let pg = ProcessGroup::from_env()?;          // TCP group: rendezvous and store
//! eprintln!("{}", load_cuda_libraries(false, true)?); // which libcuda and libnccl, from where
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
//! - **Loading.** Nothing of CUDA is linked, so this builds on machines without a CUDA toolkit.
//!   The driver (`libcuda.so.1`), NVRTC (`libnvrtc.so.12`) and NCCL (`libnccl.so.2`) are found
//!   as files under the names their packages and NVIDIA's pip wheels give them, in
//!   `LD_LIBRARY_PATH`, the active Python environment's `site-packages/nvidia/*/lib` and the
//!   system folders (`search.rs`), with no symlink made by hand. NCCL is opened from that file
//!   (`api.rs`); the driver and NVRTC are loaded from it before cudarc opens them by soname, and
//!   `dladdr` says which file cudarc really uses (`library.rs`). [`load_cuda_libraries`] does
//!   it all up front and returns the line that names each file; a missing library is an error
//!   naming it, the names tried and the folders searched, never a panic.
//! - **Device.** Rank `LOCAL_RANK` uses GPU `LOCAL_RANK` (its primary context, the one burn's
//!   CUDA backend also uses, so device pointers are shared). Fewer visible GPUs than local
//!   ranks is an error, except that a process that sees exactly one GPU through
//!   `CUDA_VISIBLE_DEVICES` uses it (launchers that give each rank its own GPU that way).
//!   [`check_same_gpu`] refuses a model on another GPU.
//! - **Creation.** Every rank first opens its GPU, then the ranks all-gather through the TCP
//!   group whether that worked, so that a rank without a GPU fails every rank at once instead of
//!   leaving the others waiting inside NCCL. Rank 0 then creates NCCL's unique id and publishes
//!   it in the rendezvous store (key `ddp/nccl/unique_id/<n>`, n counting the NCCL groups made
//!   from this process group); every rank announces itself (`ddp/nccl/<n>/arrived/<rank>`) and
//!   creates its communicator non-blocking, polling it against the TCP group's `timeout`: on
//!   expiry it is aborted and the error names the ranks that never arrived (`init.rs`).
//! - **Operations.** Every collective is enqueued on the group's own CUDA stream and returns at
//!   once with an [`NcclWork`]; [`NcclWork::wait`] blocks the host until the stream has passed
//!   the collective. Buffers are cudarc [`CudaSlice`](cudarc::driver::CudaSlice)s: cudarc's event tracking makes our stream
//!   wait for earlier work on a buffer made on another stream, and later users of the buffer wait
//!   for the collective. For buffers owned by someone else (burn's tensors) there are
//!   [`NcclGroup::submit_all_reduce_ptr`] and [`NcclGroup::submit_broadcast_ptr`], where the
//!   caller keeps those promises itself.
//! - **Failure.** NCCL itself hangs when a peer dies. [`NcclWork::wait`] polls its event, the
//!   TCP group and `ncclCommGetAsyncError`, and gives up at the group's deadline (the TCP
//!   group's `timeout`): it aborts the communicator (so that the stuck kernels end) and fails,
//!   and every later collective of the group fails at once with that first error. NCCL does not
//!   say which peer is at fault; the TCP group does, and the two share one verdict (`work.rs`):
//!   a rank's own device error fails its TCP group (its peers then blame it, and stop waiting at
//!   once), and an error that points at a peer takes the TCP group's verdict.
//!
//! NCCL has no barrier: [`NcclGroup::barrier`] all-reduces one value and waits for it. Collectives
//! carry no fingerprint on the wire (NCCL sends raw data), so every rank must submit the same
//! collectives with the same lengths in the same order; a mismatch hangs until the deadline or
//! garbles data, as with any NCCL program.
//!
//! Where things are: `search.rs` (where the libraries are), `dl.rs` (the dynamic loader),
//! `api.rs` (NCCL's functions, opened from the file found), `library.rs` (loading the driver,
//! NVRTC and NCCL, and the line that names them), `device.rs` (which GPU, opening it),
//! `init.rs` (creating a communicator under a deadline), `work.rs` ([`NcclWork`], the
//! communicator it waits on, and blame), `group.rs` ([`NcclGroup`]: creation and the
//! collectives).

mod api;
mod device;
mod dl;
mod group;
mod init;
mod library;
mod search;
mod work;

pub use api::{NcclLibrary, NcclResult};
pub use device::{check_same_gpu, describe_gpu, gradients_through_nccl, pick_device};
pub use dl::SharedLib;
pub use group::{DeviceBytes, NcclGroup};
pub use library::{
    device_count, driver_present, load_cuda_libraries, load_cuda_libraries_in, load_library_in,
    nccl_present, nccl_version, CudaLibraries, LoadedLibrary,
};
pub use search::{
    find_candidates, search_dirs, Candidate, CudaLibrary, NotFound, SearchDir, SearchEnv,
    SYSTEM_DIRS,
};
pub use work::NcclWork;
