//! How one part of a bucket travels on the host: [`HostCarrier`], the gradient pipeline's
//! carrier (`pipeline.rs`, `carrier.rs`) for host buffers and the process group, and the one
//! place where a buffer is submitted and where its result is taken back. The built-in modes
//! are [`Reduction`]'s variants (all-reduce in a wire type, ZeRO's reduce-scatter), run part by
//! part; a communication hook (PowerSGD, a user's own: `comm_hook.rs`) takes whole buckets
//! instead, through `gradients/hook_buckets.rs`, when one is installed.

use std::ops::Range;
use std::sync::Arc;

use burn::optim::GradientsParams;
use burn::tensor::Device;
use ddp_comm::{ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};

use crate::config::Compression;
use crate::gradients::carrier::Carrier;
use crate::gradients::hook_buckets::{HookFlight, Hooked};
use crate::gradients::host_buf::HostBuf;
use crate::params::{put_grad, take_grad, ParamInfo};
use crate::DdpError;

/// The pipeline's carrier on the host: buffers in host memory (burn's own, or ours), each
/// part reduced by `reduction` through `pg`, or, with a communication hook installed, each
/// bucket averaged by the hook.
pub(crate) struct HostCarrier {
    /// The process group.
    pub pg: Arc<ProcessGroup>,
    /// What each part's collective is (without a hook).
    pub reduction: Reduction,
    /// The communication hook, when one is installed: it replaces `reduction`.
    pub hook: Option<Hooked>,
}

impl Carrier for HostCarrier {
    type Buf = HostBuf;
    type Flight = Flight;

    fn take(
        &mut self,
        grads: &mut GradientsParams,
        info: &ParamInfo,
    ) -> Result<Option<HostBuf>, DdpError> {
        take_grad(grads, info)
    }

    fn len(&self, buf: &HostBuf) -> usize {
        buf.len()
    }

    fn zeros(&mut self, len: usize) -> HostBuf {
        HostBuf::zeros(len)
    }

    fn write(&mut self, buf: &mut HostBuf, at: usize, grad: HostBuf, add: bool) {
        let grad = grad.as_ref();
        let dst = &mut buf.as_mut()[at..at + grad.len()];
        if add {
            dst.iter_mut().zip(grad).for_each(|(d, s)| *d += s);
        } else {
            dst.copy_from_slice(grad);
        }
    }

    fn submit(&mut self, part: usize, buf: HostBuf) -> (Flight, u64) {
        match self.hook.as_mut() {
            Some(hooked) => {
                let (flight, bytes) = hooked.submit(&self.pg, part, buf);
                (Flight::Hooked(flight), bytes)
            }
            None => self.reduction.submit(&self.pg, buf),
        }
    }

    fn launch(&mut self) -> Result<Option<DdpError>, DdpError> {
        // Every part went to the hook: a submit that failed is this rank's failure.
        Ok(self.hook.as_mut().and_then(Hooked::take_submit_error))
    }

    fn local_wait_failures(&self) -> bool {
        self.hook.is_some()
    }

    fn end_cycle(&mut self, ok: bool) {
        if let Some(hooked) = self.hook.as_mut() {
            hooked.end_step(ok);
        }
    }

    fn wait(&mut self, flight: Flight) -> Result<HostBuf, DdpError> {
        match (flight, self.hook.as_mut()) {
            (Flight::Hooked(flight), Some(hooked)) => hooked.wait(&self.pg, flight),
            (Flight::Hooked(_), None) => Err(DdpError::Config(
                "a bucket went to a communication hook that is no longer installed".into(),
            )),
            (flight, _) => flight.wait(),
        }
    }

    fn averages(&self) -> bool {
        self.hook.is_some() || matches!(self.reduction, Reduction::AllReduce(_))
    }

    fn divided(&mut self, mut buf: HostBuf, denom: f32) -> HostBuf {
        // x / 1 is x: an averaged part goes back to burn without a pass over it.
        if denom != 1.0 {
            buf.as_mut().iter_mut().for_each(|x| *x /= denom);
        }
        buf
    }

    fn slice_divided(&mut self, buf: &HostBuf, range: Range<usize>, denom: f32) -> HostBuf {
        let slice = &buf.as_ref()[range];
        let slice: Vec<f32> = if denom == 1.0 {
            slice.to_vec()
        } else {
            slice.iter().map(|x| x / denom).collect()
        };
        slice.into()
    }

    fn put(
        &mut self,
        grads: &mut GradientsParams,
        info: &ParamInfo,
        buf: HostBuf,
        device: &Device,
    ) {
        put_grad(grads, info, buf, device);
    }
}

/// What is done with each part's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduction {
    /// DDP: every rank gets the average over ranks of the whole buffer, all-reduced in the
    /// given wire type. In f32 the collective averages (`ReduceOp::Avg`: the same sum, then
    /// each finished chunk divided by the world size once, by the rank that finished it, while
    /// it is in cache), so the division is neither a pass of its own nor on the training
    /// thread after backward, and its bits are those of the sum divided by the world size.
    /// Compressed buffers are divided by the world size first, so that partial sums stay
    /// within the largest gradient (f16 tops out at 65504).
    AllReduce(Compression),
    /// ZeRO: rank r gets the sum over ranks of its chunk `chunk_range(len, N, r)`, written in
    /// place into its buffer (the rest of the buffer is left unspecified).
    ReduceScatter,
}

/// A part's collective in flight.
pub(crate) enum Flight {
    /// An `f32` collective on the buffer itself.
    F32(Work<HostBuf>),
    /// A bf16 all-reduce, and the `f32` buffer its result goes back into.
    Bf16(Work<Vec<bf16>>, HostBuf),
    /// An f16 all-reduce, and the `f32` buffer its result goes back into.
    F16(Work<Vec<f16>>, HostBuf),
    /// A part of a bucket handed to the communication hook (waited for through the carrier).
    Hooked(HookFlight),
}

impl Reduction {
    /// Submits `buf`'s collective; returns it with the bytes handed to the process group.
    pub(crate) fn submit(self, pg: &ProcessGroup, mut buf: HostBuf) -> (Flight, u64) {
        let len = buf.len() as u64;
        let compressed = |buf: &mut HostBuf| {
            let scale = 1.0 / pg.world_size() as f32;
            buf.as_mut().iter_mut().for_each(|x| *x *= scale);
        };
        match self {
            Reduction::AllReduce(Compression::None) => (
                Flight::F32(pg.submit_all_reduce_in_place(buf, ReduceOp::Avg)),
                4 * len,
            ),
            Reduction::AllReduce(Compression::Bf16) => {
                compressed(&mut buf);
                let wire = buf.as_ref().iter().map(|&x| bf16::from_f32(x)).collect();
                (
                    Flight::Bf16(pg.submit_all_reduce(wire, ReduceOp::Sum), buf),
                    2 * len,
                )
            }
            Reduction::AllReduce(Compression::F16) => {
                compressed(&mut buf);
                let wire = buf.as_ref().iter().map(|&x| f16::from_f32(x)).collect();
                (
                    Flight::F16(pg.submit_all_reduce(wire, ReduceOp::Sum), buf),
                    2 * len,
                )
            }
            Reduction::ReduceScatter => (
                Flight::F32(pg.submit_reduce_scatter_in_place(buf, ReduceOp::Sum)),
                4 * len,
            ),
        }
    }
}

impl Flight {
    /// Waits for the collective and returns the buffer with its result, in `f32`.
    pub(crate) fn wait(self) -> Result<HostBuf, DdpError> {
        match self {
            Flight::F32(w) => Ok(w.wait()?),
            Flight::Bf16(w, mut buf) => {
                let v = w.wait()?;
                buf.as_mut()
                    .iter_mut()
                    .zip(v)
                    .for_each(|(d, s)| *d = s.to_f32());
                Ok(buf)
            }
            Flight::F16(w, mut buf) => {
                let v = w.wait()?;
                buf.as_mut()
                    .iter_mut()
                    .zip(v)
                    .for_each(|(d, s)| *d = s.to_f32());
                Ok(buf)
            }
            Flight::Hooked(_) => Err(DdpError::Config(
                "a hooked bucket's part is waited for through its carrier".into(),
            )),
        }
    }
}
