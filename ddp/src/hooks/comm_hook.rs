//! Communication hooks: how DDP averages one bucket of gradients across ranks (PyTorch's
//! `DistributedDataParallel.register_comm_hook`). The gradient pipeline (`pipeline.rs`) hands
//! each bucket to the hook as soon as the bucket is complete ([`CommHook::submit`]) and takes
//! the averaged bucket back, bucket by bucket, after the last one went out
//! ([`CommHook::wait`]). A hook keeps state across steps (PowerSGD's error feedback and Q)
//! and can save it in checkpoints.
//!
//! The built-ins ([`CommHookKind`](crate::CommHookKind), `DdpConfig::comm_hook`): the default
//! all-reduce (in `f32`, or in bf16/f16 with `DdpConfig::compression`: PyTorch's
//! `bf16_compress_hook`/`fp16_compress_hook`), which runs part by part without a hook object,
//! and [`PowerSgd`](crate::PowerSgd) (PyTorch's `powerSGD_hook`), a [`CommHook`].
//! [`DistributedDataParallel::register_comm_hook`](crate::DistributedDataParallel::register_comm_hook)
//! installs any other; `gradients/hook_buckets.rs` adapts the pipeline's parts to the hook's buckets.

use std::any::Any;

use ddp_comm::ProcessGroup;

use crate::gradients::buckets::Layout;
use crate::gradients::host_buf::HostBuf;
use crate::params::ParamInfo;
use crate::DdpError;

/// One of a bucket's flat `f32` buffers, as a hook receives and returns it: a large gradient
/// travels in burn's own memory (no copy), smaller ones packed into a buffer of ours. Read and
/// write it as a slice; hand it to the process group's in-place collectives as it is.
pub struct GradBuffer(pub(crate) HostBuf);

impl GradBuffer {
    /// `n` zeros.
    pub fn zeros(n: usize) -> GradBuffer {
        GradBuffer(HostBuf::zeros(n))
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }
}

impl std::fmt::Debug for GradBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GradBuffer({} f32)", self.len())
    }
}

impl AsRef<[f32]> for GradBuffer {
    fn as_ref(&self) -> &[f32] {
        self.0.as_ref()
    }
}

impl AsMut<[f32]> for GradBuffer {
    fn as_mut(&mut self) -> &mut [f32] {
        self.0.as_mut()
    }
}

impl From<Vec<f32>> for GradBuffer {
    fn from(v: Vec<f32>) -> GradBuffer {
        GradBuffer(HostBuf::from(v))
    }
}

/// Where one gradient of a bucket lies: its part (one of the bucket's buffers), its offset in
/// that buffer and its shape (row-major, as burn stores the parameter: a Linear weight is
/// `[in, out]`, a convolution's `[out, in, kernel...]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradSlot {
    /// The part, an index into the bucket's buffers.
    pub part: usize,
    /// Offset of its first element in that buffer.
    pub offset: usize,
    /// The parameter's shape.
    pub shape: Vec<usize>,
}

/// One bucket as a communication hook sees it: the lengths of its buffers (parts) and the
/// gradients they hold, in packing order (reverse visiting order, as backward produces them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketDesc {
    /// Elements of each part's buffer.
    pub part_lens: Vec<usize>,
    /// The bucket's gradients.
    pub grads: Vec<GradSlot>,
}

/// A communication hook: averages one bucket of gradients across the ranks of a process group,
/// asynchronously, keeping what it needs from one step to the next.
///
/// Each step, for every bucket in order, the wrapper calls [`submit`](Self::submit) as soon as
/// the bucket is complete (during backward with overlap), then, once every bucket went out and
/// after its own small control all-reduce, [`wait`](Self::wait) for every bucket in the same
/// order, then [`end_step`](Self::end_step). Every rank makes the same calls in the same
/// order, so a hook that submits its collectives in `submit` and `wait` in an order that
/// depends only on the bucket and the step keeps the ranks' sequences of collectives equal
/// (the process group matches collectives by their order). The result must be the same bits on
/// every rank, or the replicas drift apart.
///
/// **Errors fail the step on every rank.** An error from `submit` or `wait` on one rank (a
/// hook that rejects non-finite values, say) is that rank's failure of the step: the wrapper
/// still waits for every other bucket, then its control all-reduce (after the hooks' waits)
/// carries the failure, so every rank's `sync` returns an error (the others
/// [`DdpError::PeerFailed`], naming the rank) and no replica steps; then every rank calls
/// [`discard_step`](Self::discard_step) instead of `end_step`. For the ranks' collectives
/// to stay in step, a hook must issue the same collectives whether or not it returns an
/// error: decide after the exchange (check the result in `wait`), never skip one on one rank.
pub trait CommHook: Send + 'static {
    /// One bucket's exchange in flight, from `submit` to `wait`.
    type Work: Send + 'static;

    /// Called once, when the hook is installed, with the wrapper's buckets in communication
    /// order (`submit`'s `bucket` indexes them). A hook that cannot handle them says why.
    fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError> {
        let _ = buckets;
        Ok(())
    }

    /// Starts averaging bucket `bucket`: `parts` are its buffers (lengths as in its
    /// [`BucketDesc`]) holding this rank's gradients, summed over the micro-steps since the
    /// last sync (zeros where this rank has none).
    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<GradBuffer>,
    ) -> Result<Self::Work, DdpError>;

    /// Completes a bucket's exchange: its buffers, holding the average over the ranks.
    fn wait(&mut self, pg: &ProcessGroup, work: Self::Work) -> Result<Vec<GradBuffer>, DdpError>;

    /// Bytes `work` hands to collectives (the wrapper's statistics); 0 if not counted.
    fn bytes(&self, work: &Self::Work) -> u64 {
        let _ = work;
        0
    }

    /// Called after every bucket of a step has been waited for, once the step succeeded on
    /// every rank.
    fn end_step(&mut self) {}

    /// Called instead of [`end_step`](Self::end_step) when the step failed on some rank (a
    /// hook's error, a gradient that could not be read, a peer's failure): no rank applies
    /// it, so a hook with state goes back to the state it had before the step's first
    /// `submit`, and the step can be run again as if it never ran. The default does nothing
    /// (right for a hook without state).
    fn discard_step(&mut self) {}

    /// This rank's state, to save in a checkpoint; `None` for a hook without state.
    fn state(&self) -> Option<Vec<u8>> {
        None
    }

    /// Restores a state [`state`](Self::state) returned (`name` says where it came from, for
    /// the error).
    fn load_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let _ = bytes;
        Err(DdpError::Checkpoint(format!(
            "{name}: holds a communication hook state, but this run's hook keeps none"
        )))
    }
}

/// A [`CommHook`] of any kind behind one object-safe interface (its work boxed), what the
/// pipeline holds.
pub(crate) trait DynHook: Send {
    fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError>;
    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<HostBuf>,
    ) -> Result<(Box<dyn Any + Send>, u64), DdpError>;
    fn wait(
        &mut self,
        pg: &ProcessGroup,
        work: Box<dyn Any + Send>,
    ) -> Result<Vec<HostBuf>, DdpError>;
    fn end_step(&mut self);
    fn discard_step(&mut self);
    fn state(&self) -> Option<Vec<u8>>;
    fn load_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError>;
}

impl<H: CommHook> DynHook for H {
    fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError> {
        CommHook::bind(self, buckets)
    }

    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<HostBuf>,
    ) -> Result<(Box<dyn Any + Send>, u64), DdpError> {
        let parts = parts.into_iter().map(GradBuffer).collect();
        let work = CommHook::submit(self, pg, bucket, parts)?;
        let bytes = CommHook::bytes(self, &work);
        Ok((Box::new(work), bytes))
    }

    fn wait(
        &mut self,
        pg: &ProcessGroup,
        work: Box<dyn Any + Send>,
    ) -> Result<Vec<HostBuf>, DdpError> {
        let work = work
            .downcast::<H::Work>()
            .expect("the pipeline waits for what this hook submitted");
        let parts = CommHook::wait(self, pg, *work)?;
        Ok(parts.into_iter().map(|b| b.0).collect())
    }

    fn end_step(&mut self) {
        CommHook::end_step(self)
    }

    fn discard_step(&mut self) {
        CommHook::discard_step(self)
    }

    fn state(&self) -> Option<Vec<u8>> {
        CommHook::state(self)
    }

    fn load_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        CommHook::load_state(self, bytes, name)
    }
}

/// The hooks' view of `layout`'s buckets.
pub(crate) fn bucket_descs(layout: &Layout, params: &[ParamInfo]) -> Vec<BucketDesc> {
    layout
        .buckets
        .iter()
        .map(|bucket| {
            let parts = &layout.parts[bucket.parts.clone()];
            let part_lens = parts.iter().map(|p| p.len).collect();
            let grads = parts
                .iter()
                .enumerate()
                .flat_map(|(k, part)| {
                    part.params
                        .iter()
                        .zip(&part.offsets)
                        .map(move |(&p, &offset)| GradSlot {
                            part: k,
                            offset,
                            shape: params[p].shape.clone(),
                        })
                })
                .collect();
            BucketDesc { part_lens, grads }
        })
        .collect()
}
