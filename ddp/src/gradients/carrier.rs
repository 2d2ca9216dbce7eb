//! [`Carrier`]: what the gradient pipeline (`pipeline.rs`) needs from the memory its buffers
//! live in and the communicator that reduces them, so that one loop drives every path: host
//! buffers through the process group (`host_carrier.rs`, every CPU mode and ZeRO), device
//! tensors through NCCL (`cuda_carrier.rs`, the GPU path).

use std::ops::Range;

use burn::optim::GradientsParams;
use burn::tensor::Device;

use crate::params::ParamInfo;
use crate::DdpError;

/// Buffers and collectives of one path of the pipeline.
pub(crate) trait Carrier {
    /// A gradient as taken from burn, and a part's buffer (flat `f32`).
    type Buf;
    /// A part's collective in flight.
    type Flight;

    /// Takes the gradient of `info` out of `grads` (`None`: it has none this step; `Err`: it
    /// cannot be read, a local failure naming it).
    fn take(
        &mut self,
        grads: &mut GradientsParams,
        info: &ParamInfo,
    ) -> Result<Option<Self::Buf>, DdpError>;

    /// Elements of `buf`.
    fn len(&self, buf: &Self::Buf) -> usize;

    /// A buffer of `len` zeros.
    fn zeros(&mut self, len: usize) -> Self::Buf;

    /// Writes `grad` into `buf` from element `at` on, or adds it there (`add`: a later
    /// micro-step's).
    fn write(&mut self, buf: &mut Self::Buf, at: usize, grad: Self::Buf, add: bool);

    /// Submits the collective of part `part`'s buffer; returns it with the bytes it hands to
    /// the communicator. A carrier may hold submissions back until [`launch`](Self::launch).
    fn submit(&mut self, part: usize, buf: Self::Buf) -> (Self::Flight, u64);

    /// Called once every part of the cycle was submitted, before the control all-reduce: a
    /// carrier that holds submissions back sends them now, in order. `Ok(Some(e))`: a local
    /// failure the control must carry to the other ranks (every collective still went out);
    /// `Err`: a failure no collective can carry any more (the carrier has failed the group,
    /// so that the peers stop too).
    fn launch(&mut self) -> Result<Option<DdpError>, DdpError>;

    /// Waits for a part's collective and returns the buffer with its result.
    fn wait(&mut self, flight: Self::Flight) -> Result<Self::Buf, DdpError>;

    /// Whether a failure in [`wait`](Self::wait) can be this rank's alone (a communication
    /// hook's error): then the control all-reduce goes after the waits, so that it carries
    /// such a failure to the other ranks, and a `wait` error other than a collective's is a
    /// local failure of the step. Otherwise (`false`) the control goes out before the waits,
    /// overlapping them.
    fn local_wait_failures(&self) -> bool {
        false
    }

    /// Called once the cycle's outcome is known, the same on every rank: `ok` when the step
    /// succeeded everywhere.
    fn end_cycle(&mut self, ok: bool) {
        let _ = ok;
    }

    /// Whether the results are averages over the ranks already (a hook's, an all-reduce's:
    /// `ReduceOp::Avg` in f32, compressed buffers divided before it) rather than sums.
    fn averages(&self) -> bool;

    /// `buf` divided by `denom`, in place where it can be (a part that is one gradient).
    fn divided(&mut self, buf: Self::Buf, denom: f32) -> Self::Buf;

    /// Elements `range` of `buf`, divided by `denom` (a gradient of a shared part).
    fn slice_divided(&mut self, buf: &Self::Buf, range: Range<usize>, denom: f32) -> Self::Buf;

    /// Registers `buf` as the gradient of `info` in `grads`, in the parameter's shape and
    /// element type, on `device` (the model's).
    fn put(
        &mut self,
        grads: &mut GradientsParams,
        info: &ParamInfo,
        buf: Self::Buf,
        device: &Device,
    );
}
