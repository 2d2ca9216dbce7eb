//! How one part of a bucket travels: the seam between the gradient pipeline (`pipeline.rs`)
//! and the process group, the one place where a buffer is submitted and where its result is
//! taken back. PyTorch calls this a communication hook; the modes of this crate are
//! [`Reduction`]'s variants, and a new one (PowerSGD, another wire type) is a variant with its
//! arms here, without touching the loop.

use ddp_comm::{ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};

use crate::config::Compression;
use crate::host_buf::HostBuf;
use crate::DdpError;

/// What is done with each part's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reduction {
    /// DDP: every rank gets the sum over ranks of the whole buffer, all-reduced in the given
    /// wire type. Compressed buffers are divided by the world size first, so that partial sums
    /// stay within the largest gradient (f16 tops out at 65504).
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
                Flight::F32(pg.submit_all_reduce_in_place(buf, ReduceOp::Sum)),
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
        }
    }
}
