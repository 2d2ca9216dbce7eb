//! A communication hook on the host path ([`Hooked`]): the pipeline submits and waits part by
//! part, a hook ([`CommHook`](crate::CommHook)) takes and returns whole buckets; this file is
//! the adapter between the two, used by `host_carrier.rs`'s carrier when a hook is installed.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

use ddp_comm::ProcessGroup;

use crate::gradients::buckets::Layout;
use crate::gradients::host_buf::HostBuf;
use crate::hooks::comm_hook::DynHook;
use crate::DdpError;

/// A part of a hooked bucket in flight: its index in the layout's parts.
pub(crate) struct HookFlight {
    part: usize,
}

/// A bucket handed to the hook: its work, or the error its `submit` returned.
type Submitted = Result<Box<dyn Any + Send>, DdpError>;

/// The installed hook and what it holds between the pipeline's calls in one cycle.
pub(crate) struct Hooked {
    hook: Box<dyn DynHook>,
    layout: Arc<Layout>,
    /// Parts of the bucket being submitted, until its last one.
    held: Vec<HostBuf>,
    /// The buckets handed to the hook this cycle and not waited for yet, in order.
    works: VecDeque<Submitted>,
    /// The averaged parts of the bucket being waited for, in order.
    ready: VecDeque<HostBuf>,
    /// Whether the bucket being waited for failed (its later parts fail too).
    failed: bool,
    /// The first error a `submit` of this cycle returned: a local failure of the step, which
    /// the pipeline's control all-reduce carries to the other ranks.
    submit_error: Option<DdpError>,
}

impl Hooked {
    /// `hook`, bound to `layout`'s buckets by the caller.
    pub(crate) fn new(hook: Box<dyn DynHook>, layout: Arc<Layout>) -> Hooked {
        Hooked {
            hook,
            layout,
            held: Vec::new(),
            works: VecDeque::new(),
            ready: VecDeque::new(),
            failed: false,
            submit_error: None,
        }
    }

    /// The hook itself (its state for checkpoints).
    pub(crate) fn hook(&self) -> &dyn DynHook {
        self.hook.as_ref()
    }

    /// The hook itself, to restore its state.
    pub(crate) fn hook_mut(&mut self) -> &mut dyn DynHook {
        self.hook.as_mut()
    }

    /// Takes part `part`'s buffer. The pipeline submits parts in order, so a bucket's parts
    /// arrive one after another: they are held until the bucket's last one, and then the
    /// whole bucket goes to the hook's `submit`, which starts its collectives. Every rank
    /// submits the same parts in the same order, so the hook is called alike everywhere.
    /// Returns the bytes the hook hands to collectives (counted on the bucket's last part).
    pub(crate) fn submit(
        &mut self,
        pg: &ProcessGroup,
        part: usize,
        buf: HostBuf,
    ) -> (HookFlight, u64) {
        let bucket = self.layout.parts[part].bucket;
        let range = self.layout.buckets[bucket].parts.clone();
        if part == 0 {
            // A new cycle: nothing of a failed earlier one is kept.
            self.works.clear();
            self.ready.clear();
            self.failed = false;
            self.submit_error = None;
        }
        if part == range.start {
            self.held.clear();
        }
        self.held.push(buf);
        let mut bytes = 0;
        if part + 1 == range.end {
            let parts = std::mem::take(&mut self.held);
            let work = match self.hook.submit(pg, bucket, parts) {
                Ok((work, b)) => {
                    bytes = b;
                    Ok(work)
                }
                Err(e) => {
                    // The step's failure (the pipeline takes it before its control
                    // all-reduce); the bucket's wait fails with a pointer to it.
                    self.submit_error.get_or_insert(e);
                    Err(DdpError::Config(format!(
                        "communication hook: the submit of bucket {bucket} failed (the step's \
                         error says why)"
                    )))
                }
            };
            self.works.push_back(work);
        }
        (HookFlight { part }, bytes)
    }

    /// The first error a hook's `submit` returned in this cycle, if any.
    pub(crate) fn take_submit_error(&mut self) -> Option<DdpError> {
        self.submit_error.take()
    }

    /// Ends the cycle once its outcome is known on every rank: the hook's `end_step` when the
    /// step succeeded everywhere, its `discard_step` when it failed anywhere (no rank applies
    /// it, so the hook's state must be the one from before the step).
    pub(crate) fn end_step(&mut self, ok: bool) {
        if ok {
            self.hook.end_step();
        } else {
            self.hook.discard_step();
        }
    }

    /// Gives part `flight`'s averaged buffer back. On a bucket's first part, waits for the
    /// bucket's work (the hook's `wait`, which may run further collectives: the pipeline
    /// waits for the parts in order on every rank, so these too come alike) and checks that
    /// the hook returned a buffer of the right length for every part; the later parts are
    /// taken from what it returned. The hook's `end_step` (or `discard_step`) comes from
    /// [`end_step`](Self::end_step), once the step's outcome is known.
    pub(crate) fn wait(
        &mut self,
        pg: &ProcessGroup,
        flight: HookFlight,
    ) -> Result<HostBuf, DdpError> {
        let part = flight.part;
        let bucket = self.layout.parts[part].bucket;
        let range = self.layout.buckets[bucket].parts.clone();
        if part == range.start {
            self.ready.clear();
            self.failed = false;
            let work = self.works.pop_front().unwrap_or_else(|| {
                Err(DdpError::Config(format!(
                    "communication hook: bucket {bucket} was waited for but never submitted"
                )))
            });
            let done = work.and_then(|work| self.hook.wait(pg, work));
            match done.and_then(|parts| self.check(bucket, parts)) {
                Ok(parts) => self.ready = parts.into(),
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
        match self.ready.pop_front() {
            Some(buf) if !self.failed => Ok(buf),
            _ => Err(DdpError::Config(format!(
                "communication hook: bucket {bucket} failed"
            ))),
        }
    }

    /// Refuses a result that does not have the bucket's parts' lengths (the pipeline would
    /// unpack out of bounds), naming the bucket and the part.
    fn check(&self, bucket: usize, parts: Vec<HostBuf>) -> Result<Vec<HostBuf>, DdpError> {
        let want = &self.layout.parts[self.layout.buckets[bucket].parts.clone()];
        if parts.len() != want.len() {
            return Err(DdpError::Config(format!(
                "communication hook: bucket {bucket} came back with {} buffers, it has {} parts",
                parts.len(),
                want.len()
            )));
        }
        if let Some(k) = (0..want.len()).find(|&k| parts[k].len() != want[k].len) {
            return Err(DdpError::Config(format!(
                "communication hook: part {k} of bucket {bucket} came back with {} values, \
                 it has {}",
                parts[k].len(),
                want[k].len
            )));
        }
        Ok(parts)
    }
}
