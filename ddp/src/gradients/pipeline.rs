//! The gradient pipeline, PyTorch's `Reducer`: the one object between where gradients come
//! from (overlap's hooks during backward, burn's `GradientsParams` after it) and the process
//! group, driven by every mode: DDP's `sync` and `accumulate`, its overlapped `backward`, ZeRO
//! stages 1 and 2, and the GPU path. The layout is `buckets.rs`'s; where the buffers live and
//! how a part's collective runs is a [`Carrier`]'s (`carrier.rs`): host buffers through the
//! process group (`host_carrier.rs`, where the per-part collective is chosen: all-reduce in a wire
//! type, or reduce-scatter), or device tensors through NCCL (`cuda_carrier.rs`).
//!
//! # The loop
//!
//! A cycle runs from the first micro-step after a sync to the next sync. In each micro-step
//! every trainable parameter's gradient is handed over once ([`Pipeline::deliver`]), as a hook
//! fires or from `GradientsParams` ([`Pipeline::deliver_from`]), in any order:
//!
//! 1. The gradient goes into its part's buffer. A part that is one gradient takes burn's buffer
//!    itself, without a copy (adopted); in a shared part it is copied to its offset. In a later
//!    micro-step of the cycle it is added instead (PyTorch's `no_sync` sum).
//! 2. In the micro-step that ends the cycle (`begin(true)`), once every gradient of a part is
//!    in, the part is submitted, but only after every earlier part: the collectives go out in
//!    bucket order, part by part, on every rank, whatever order the gradients come in. A large
//!    gradient is a part of its own, so it leaves as soon as it is complete, not when the last
//!    gradient of its bucket is: communication never waits for a gradient it does not carry.
//!    A parameter without a gradient on this rank holds its part (and every later one) back
//!    until `deliver_from` says it has none; its slot stays zero.
//!
//!    A parameter can receive its gradient in more than one piece: an overlapped backward
//!    hands over what its hook saw (the uses of one prepared copy), and burn leaves what came
//!    by other paths (a term on the model's own parameter, a second prepared copy, which has
//!    a hook of its own) on the parameter, where `deliver_from` finds it. Every piece is
//!    added to the parameter's slot, as burn adds them without overlap, so the part carries
//!    the parameter's whole gradient — provided the part had not gone out yet. To make sure
//!    of that, a parameter seen to get a second piece is marked *late* for good, and in an
//!    overlapped micro-step ([`Pipeline::hold`]) every part with a late parameter waits for
//!    `deliver_from` (the end of backward), as does every part on the first overlapped pass
//!    (before any path is known). In a held part the pieces are summed apart and added to
//!    the part (to earlier micro-steps' sum, when accumulating) in one addition, as without
//!    overlap. A piece that arrives after its part went out anyway (a path the loss never
//!    took before) cannot be sent any more without splitting the parameter's sum, nor added
//!    with the same rounding to a slot that holds earlier micro-steps' sum: it is a local
//!    failure naming the parameter ([`DdpError::LateGradient`]), which fails the step on every
//!    rank through the control below; the next step holds the part.
//! 3. [`Pipeline::finish`] submits what is left (a carrier that holds submissions back, the
//!    GPU path's, sends them all now, after one synchronisation), then one small **control**
//!    all-reduce over the process group: how
//!    many micro-steps had a gradient of each parameter on each rank (presence), how many
//!    ranks failed locally and the sum of their ranks plus one. It is the step's last
//!    collective on every rank, so the sequence of collectives never depends on a rank's own
//!    gradients or failures: a rank that fails still sends every part (zeros where it has
//!    nothing) and raises the failure slots. Then the parts are waited for in order, each
//!    handed to the caller as it completes (unpacking one overlaps the collectives of the
//!    later ones), and the control decides: a failure anywhere fails the step on every rank
//!    (the failing rank returns its own error, the others [`DdpError::PeerFailed`] naming it),
//!    and a parameter no rank had a gradient for stays absent, as burn's optimizer expects.
//!    With a communication hook the control follows the waits instead: a hook's `wait` can
//!    fail on one rank only (a user's check of the result), and that failure must reach the
//!    others before any of them steps. The carrier learns the outcome last
//!    ([`Carrier::end_cycle`]: a hook's `end_step`, or its `discard_step` after a failure).
//!
//! Buffers are taken by the collectives and come back as results: nothing of a cycle is kept
//! once it finished, so a rank holds one copy of each gradient at most, and none once its part
//! has been handed on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::optim::GradientsParams;
use ddp_comm::{ProcessGroup, ReduceOp};

use crate::gradients::buckets::{Layout, Place};
use crate::gradients::carrier::Carrier;
use crate::params::ParamInfo;
use crate::DdpError;

/// A part whose collective completed, handed to [`Pipeline::finish`]'s caller.
pub(crate) struct Done<B> {
    /// The part (an index into the layout's parts).
    pub part: usize,
    /// Its buffer, with the result (DDP: the average over ranks, or the sum where the carrier
    /// does not average; ZeRO: this rank's chunk summed,
    /// in place).
    pub buf: B,
    /// When its packing started (its submission minus the time spent packing it) and when it
    /// was submitted.
    pub packed: (Instant, Instant),
    /// When the caller started waiting for it and when the wait returned.
    pub waited: (Instant, Instant),
}

/// A part's collective in flight.
struct Submitted<F> {
    part: usize,
    flight: F,
    packed: (Instant, Instant),
}

/// The pipeline of one wrapper (see the module documentation).
pub(crate) struct Pipeline<C: Carrier> {
    /// The control all-reduce's group.
    pg: Arc<ProcessGroup>,
    params: Arc<[ParamInfo]>,
    layout: Arc<Layout>,
    carrier: C,
    /// Per part: its buffer in this cycle (`None` until its first gradient).
    bufs: Vec<Option<C::Buf>>,
    /// Per parameter: whether its slot holds a gradient of this cycle (the next is added).
    written: Vec<bool>,
    /// Per parameter: micro-steps of this cycle in which this rank had its gradient.
    presence: Vec<f32>,
    /// Per parameter: handed over in this micro-step.
    delivered: Vec<bool>,
    /// Per parameter: seen to receive a piece of its gradient besides its first (a path
    /// outside its hook); its part waits for the end of an overlapped backward from then on.
    late: Vec<bool>,
    /// Per part: gradients of this micro-step not handed over yet, plus one while the part
    /// is held for the end of backward.
    pending: Vec<usize>,
    /// Per part: held for the end of backward in this micro-step ([`hold`](Self::hold)).
    held: Vec<bool>,
    /// Per parameter: its slot held a sum of earlier micro-steps when this one began.
    prior: Vec<bool>,
    /// Per parameter: it had a gradient in this micro-step (counted in `presence`).
    present: Vec<bool>,
    /// Per parameter of a held part: the pieces of its gradient in this micro-step, summed
    /// apart (as burn sums them on the parameter) until the part is released.
    stash: Vec<Option<C::Buf>>,
    /// Whether complete parts go out at once (the micro-step that ends the cycle).
    communicate: bool,
    /// The next part to submit.
    next: usize,
    submitted: Vec<Submitted<C::Flight>>,
    /// Per part: time spent packing it in this micro-step.
    pack_time: Vec<Duration>,
    /// This rank's first local failure in this cycle.
    error: Option<DdpError>,
    /// Bytes handed to collectives since the last [`take_bytes`](Self::take_bytes).
    bytes: u64,
}

impl<C: Carrier> Pipeline<C> {
    /// The pipeline of `params` laid out as `layout`, each part carried by `carrier`, the
    /// control all-reduce through `pg`.
    pub(crate) fn new(
        pg: Arc<ProcessGroup>,
        params: Arc<[ParamInfo]>,
        layout: Arc<Layout>,
        carrier: C,
    ) -> Pipeline<C> {
        let (n, parts) = (params.len(), layout.parts.len());
        Pipeline {
            pg,
            params,
            layout,
            carrier,
            bufs: (0..parts).map(|_| None).collect(),
            written: vec![false; n],
            presence: vec![0.0; n],
            delivered: vec![false; n],
            late: vec![false; n],
            pending: vec![0; parts],
            held: vec![false; parts],
            prior: vec![false; n],
            present: vec![false; n],
            stash: (0..n).map(|_| None).collect(),
            communicate: false,
            next: 0,
            submitted: Vec::new(),
            pack_time: vec![Duration::ZERO; parts],
            error: None,
            bytes: 0,
        }
    }

    /// The layout.
    pub(crate) fn layout(&self) -> &Arc<Layout> {
        &self.layout
    }

    /// The carrier.
    pub(crate) fn carrier(&mut self) -> &mut C {
        &mut self.carrier
    }

    /// Starts a micro-step: `communicate` when it ends the cycle (its buckets go out as they
    /// complete), not for an accumulation micro-step (gradients are only summed).
    pub(crate) fn begin(&mut self, communicate: bool) {
        self.delivered.fill(false);
        for (pending, part) in self.pending.iter_mut().zip(&self.layout.parts) {
            *pending = part.params.len();
        }
        self.held.fill(false);
        self.prior.copy_from_slice(&self.written);
        self.present.fill(false);
        self.stash.iter_mut().for_each(|s| *s = None);
        self.communicate = communicate;
        self.next = 0;
        self.submitted.clear();
        self.pack_time.fill(Duration::ZERO);
    }

    /// Holds parts of this micro-step back until [`deliver_from`](Self::deliver_from) (the end
    /// of an overlapped backward): every part when `all` (the first overlapped pass, before
    /// any path of the loss is known), else the parts with a late parameter (one seen to get a
    /// piece of its gradient outside its hook). Call it after [`begin`](Self::begin).
    pub(crate) fn hold(&mut self, all: bool) {
        for (j, part) in self.layout.parts.iter().enumerate() {
            if all || part.params.iter().any(|&p| self.late[p]) {
                self.held[j] = true;
                self.pending[j] += 1;
            }
        }
    }

    /// The parameters seen to get a piece of their gradient outside their hook, whose parts
    /// wait for the end of an overlapped backward.
    pub(crate) fn late_params(&self) -> impl Iterator<Item = &ParamInfo> + '_ {
        self.params
            .iter()
            .zip(&self.late)
            .filter_map(|(info, &late)| late.then_some(info))
    }

    /// Records a local failure of this cycle (the first one is kept and reported).
    pub(crate) fn fail(&mut self, error: DdpError) {
        self.error.get_or_insert(error);
    }

    /// Takes this cycle's local failure, if any (an accumulation micro-step reports it at
    /// once).
    pub(crate) fn take_error(&mut self) -> Option<DdpError> {
        self.error.take()
    }

    /// How many buckets went out whole so far in this micro-step.
    pub(crate) fn buckets_submitted(&self) -> usize {
        match self.layout.parts.get(self.next) {
            Some(next) => next.bucket,
            None => self.layout.buckets.len(),
        }
    }

    /// Bytes handed to collectives since the last call.
    pub(crate) fn take_bytes(&mut self) -> u64 {
        std::mem::take(&mut self.bytes)
    }

    /// An accumulation micro-step (PyTorch's `no_sync`): every gradient of `grads` is added to
    /// its part's buffer, nothing is communicated. Returns this rank's local failure.
    pub(crate) fn accumulate(&mut self, grads: &mut GradientsParams) -> Option<DdpError> {
        self.begin(false);
        self.deliver_from(grads);
        self.take_error()
    }

    /// Hands over parameter `p`'s gradient of this micro-step (`Ok(None)`: it has none on this
    /// rank; `Err`: it could not be read, a local failure), and submits every bucket that is
    /// now complete, in order. The first delivery of a parameter in a micro-step completes its
    /// share of the part; a further one is another piece of the same gradient (see the module
    /// documentation), which makes the parameter late. Frozen parameters and buffers are
    /// ignored.
    pub(crate) fn deliver(&mut self, p: usize, grad: Result<Option<C::Buf>, DdpError>) {
        let Some(place) = self.layout.place.get(p).copied().flatten() else {
            return;
        };
        let first = !std::mem::replace(&mut self.delivered[p], true);
        if !first {
            self.late[p] = true;
        }
        let start = Instant::now();
        match grad {
            Ok(Some(g)) => self.take_piece(p, place, g, first),
            Ok(None) => {}
            Err(e) => self.fail(e),
        }
        self.pack_time[place.part] += start.elapsed();
        if first {
            self.pending[place.part] -= 1;
            self.submit_ready();
        }
    }

    /// One piece of parameter `p`'s gradient in this micro-step (`first`: the first delivery).
    /// In a held part the pieces are summed apart and packed when the part is released, so
    /// that the sum of earlier micro-steps gets this micro-step's whole gradient in one
    /// addition, as without overlap. Otherwise the first piece is packed at once, and a
    /// further one is added to it while that gives the same bits: not once the part went out
    /// (the sum cannot be completed, and a collective for the piece alone would round
    /// differently), nor where the slot held earlier micro-steps' sum (added piece by piece,
    /// it would round differently); there it is a local failure naming the parameter.
    fn take_piece(&mut self, p: usize, place: Place, g: C::Buf, first: bool) {
        if !std::mem::replace(&mut self.present[p], true) {
            self.presence[p] += 1.0;
        }
        if self.held[place.part] {
            match self.stash[p].as_mut() {
                Some(sum) => self.carrier.write(sum, 0, g, true),
                None => self.stash[p] = Some(g),
            }
            return;
        }
        if !first && (place.part < self.next || self.prior[p]) {
            return self.fail(DdpError::LateGradient {
                name: self.params[p].name.clone(),
            });
        }
        self.pack(p, place, g);
    }

    /// Writes `g` into parameter `p`'s slot of its part (added to what the slot holds from
    /// this cycle). A part that is this one gradient takes burn's buffer itself.
    fn pack(&mut self, p: usize, place: Place, g: C::Buf) {
        let part = &self.layout.parts[place.part];
        let slot = &mut self.bufs[place.part];
        if slot.is_none() && part.params.len() == 1 && self.carrier.len(&g) == part.len {
            // The part is this one gradient: burn's buffer becomes the part's.
            *slot = Some(g);
        } else {
            let mut buf = match slot.take() {
                Some(buf) => buf,
                None => self.carrier.zeros(part.len),
            };
            self.carrier
                .write(&mut buf, place.offset, g, self.written[p]);
            self.bufs[place.part] = Some(buf);
        }
        self.written[p] = true;
    }

    /// Submits, in order, every part from the next one on that is complete (when this
    /// micro-step communicates).
    fn submit_ready(&mut self) {
        if self.communicate {
            while self.next < self.layout.parts.len() && self.pending[self.next] == 0 {
                self.submit_part();
            }
        }
    }

    /// Hands over, from `grads`, every gradient of this micro-step, in part order (so that
    /// packing a part overlaps the collectives of the earlier ones), and releases each held
    /// part once its gradients are in: a parameter not handed over yet is delivered; one whose
    /// hook had it may still have a piece on the parameter (a path outside the hooked copy),
    /// which is added. Gradients that belong to parameters the wrapper does not know are a
    /// local failure.
    pub(crate) fn deliver_from(&mut self, grads: &mut GradientsParams) {
        let layout = Arc::clone(&self.layout);
        for (j, part) in layout.parts.iter().enumerate() {
            for &p in &part.params {
                let info = &self.params[p];
                if !self.delivered[p] {
                    let grad = self.carrier.take(grads, info);
                    self.deliver(p, grad);
                } else if let Some(piece) = self.carrier.take(grads, info).transpose() {
                    self.deliver(p, piece.map(Some));
                }
            }
            if std::mem::take(&mut self.held[j]) {
                // Released: each parameter's summed pieces go into the part.
                let start = Instant::now();
                for &p in &part.params {
                    if let (Some(sum), Some(place)) = (self.stash[p].take(), layout.place[p]) {
                        self.pack(p, place, sum);
                    }
                }
                self.pack_time[j] += start.elapsed();
                self.pending[j] -= 1;
                self.submit_ready();
            }
        }
        if !grads.is_empty() {
            self.fail(DdpError::ParamsChanged {
                name: "?".into(),
                detail: format!(
                    "{} gradients belong to parameters with ids the wrapper does not know",
                    grads.len()
                ),
            });
        }
    }

    /// Submits the next part (as zeros when nobody wrote it).
    fn submit_part(&mut self) {
        let j = self.next;
        let buf = match self.bufs[j].take() {
            Some(buf) => buf,
            None => self.carrier.zeros(self.layout.parts[j].len),
        };
        let (flight, bytes) = self.carrier.submit(j, buf);
        self.bytes += bytes;
        let now = Instant::now();
        let start = now.checked_sub(self.pack_time[j]).unwrap_or(now);
        self.submitted.push(Submitted {
            part: j,
            flight,
            packed: (start, now),
        });
        self.next += 1;
    }

    /// Ends the cycle (see the module documentation): submits the buckets still held back and
    /// the control all-reduce, hands each part to `done` (with the carrier, to unpack it) as
    /// its collective completes, in order, and returns the presence of every parameter summed over ranks and micro-steps
    /// (`0` where no rank had a gradient), or the step's error, the same on every rank: this
    /// rank's own failure, [`DdpError::PeerFailed`] (naming sync number `sync`), or a
    /// collective's error. After an error the parts handed to `done` must not be used.
    pub(crate) fn finish(
        &mut self,
        sync: u64,
        mut done: impl FnMut(&mut C, Done<C::Buf>),
    ) -> Result<Vec<f32>, DdpError> {
        while self.next < self.layout.parts.len() {
            self.submit_part();
        }
        match self.carrier.launch() {
            Ok(None) => {}
            Ok(Some(e)) => self.fail(e),
            Err(e) => {
                // The group is failed: the peers stop at their next wait.
                self.submitted.clear();
                self.written.fill(false);
                self.presence = vec![0.0; self.params.len()];
                self.error = None;
                self.carrier.end_cycle(false);
                return Err(e);
            }
        }
        // Where a wait can fail on this rank alone (a communication hook's error), the control
        // follows the waits, so that it carries that failure too; otherwise it goes first and
        // flies while the parts are waited for.
        let late_control = self.carrier.local_wait_failures();
        let mut control = (!late_control).then(|| self.submit_control());

        let mut comm_error = None;
        for s in std::mem::take(&mut self.submitted) {
            let wait_start = Instant::now();
            let result = self.carrier.wait(s.flight);
            let waited = (wait_start, Instant::now());
            match result {
                Ok(buf) if comm_error.is_none() => done(
                    &mut self.carrier,
                    Done {
                        part: s.part,
                        buf,
                        packed: s.packed,
                        waited,
                    },
                ),
                Ok(_) => {}
                // This rank's own failure (a hook's error): the control carries it.
                Err(e) if late_control && !matches!(e, DdpError::Comm(_)) => self.fail(e),
                // Keep waiting for the rest, so that no buffer is left with the process group.
                Err(e) => {
                    comm_error.get_or_insert(e);
                }
            }
        }
        let control = match control.take() {
            Some(control) => control,
            None => self.submit_control(),
        }
        .wait();
        // The cycle is over whatever happened: the next one starts afresh.
        self.written.fill(false);
        self.presence = vec![0.0; self.params.len()];
        let local = self.error.take();
        let outcome = (|| {
            let mut sums = control?;
            if let Some(e) = comm_error {
                return Err(e);
            }
            if let Some(e) = local {
                return Err(e);
            }
            let ranks = sums.pop().unwrap_or(0.0);
            let count = sums.pop().unwrap_or(0.0);
            if count > 0.0 {
                return Err(peer_failed(sync, count, ranks, self.pg.world_size()));
            }
            Ok(sums)
        })();
        self.carrier.end_cycle(outcome.is_ok());
        outcome
    }

    /// Submits the control all-reduce: this cycle's presence of every parameter, and the
    /// failure slots (1 and this rank plus one when this rank failed, zeros otherwise).
    fn submit_control(&mut self) -> ddp_comm::Work<Vec<f32>> {
        let failed = self.error.is_some();
        let mut control = std::mem::take(&mut self.presence);
        control.push(if failed { 1.0 } else { 0.0 });
        control.push(if failed {
            (self.pg.rank() + 1) as f32
        } else {
            0.0
        });
        self.bytes += 4 * control.len() as u64;
        self.pg.submit_all_reduce(control, ReduceOp::Sum)
    }
}

/// The error of a sync that failed on other ranks: `failed` ranks reported a local failure, the
/// sum of their ranks plus one is `ranks` (so a single one is named exactly; f32 holds integers
/// exactly up to 2^24).
pub(crate) fn peer_failed(sync: u64, failed: f32, ranks: f32, world: usize) -> DdpError {
    let count = failed.round() as usize;
    let rank = ranks.round() - 1.0;
    let named = (count == 1 && rank >= 0.0 && (rank as usize) < world && ranks.fract() == 0.0)
        .then_some(rank as usize);
    DdpError::PeerFailed {
        sync,
        count,
        rank: named,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Compression, DdpConfig};
    use crate::gradients::buckets::plan_buckets;
    use crate::gradients::host_buf::HostBuf;
    use crate::gradients::host_carrier::{HostCarrier, Reduction};
    use crate::params::ParamKind;
    use crate::test_ranks::two_ranks;
    use burn::tensor::Device;

    #[test]
    fn a_peer_failure_names_the_rank_when_exactly_one_failed() {
        let named = |failed, ranks| match peer_failed(3, failed, ranks, 4) {
            DdpError::PeerFailed { sync, count, rank } => (sync, count, rank),
            other => panic!("{other}"),
        };
        // Rank 2 alone: the rank slot holds 2 + 1.
        assert_eq!(named(1.0, 3.0), (3, 1, Some(2)));
        // Ranks 0 and 3: two failures, no single rank to name.
        assert_eq!(named(2.0, 5.0), (3, 2, None));
        // A rank slot that names no rank of the group is not trusted.
        assert_eq!(named(1.0, 9.0), (3, 1, None));
        let text = peer_failed(3, 1.0, 3.0, 4).to_string();
        assert!(
            text.contains("sync #3") && text.contains("rank 2 failed"),
            "{text}"
        );
    }

    fn info(name: &str, numel: usize) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            id: burn::module::ParamId::new(),
            shape: vec![numel],
            dtype: burn::tensor::DType::F32,
            kind: ParamKind::Trainable,
        }
    }

    /// A pipeline of one rank over two parameters: a large one (a part of its own) and a
    /// small one.
    fn one_rank(reduction: Reduction) -> (Pipeline<HostCarrier>, usize) {
        let big = crate::gradients::buckets::ADOPT_BYTES / 4 + 3;
        let params: Arc<[ParamInfo]> = vec![info("big", big), info("small", 5)].into();
        let layout = plan_buckets(&params, &(&DdpConfig::default()).into());
        let pg = ProcessGroup::builder()
            .no_env()
            .rank(0)
            .world_size(1)
            .build()
            .expect("a group of one");
        let pg = Arc::new(pg);
        (
            Pipeline::new(
                Arc::clone(&pg),
                params,
                Arc::new(layout),
                HostCarrier {
                    pg,
                    reduction,
                    hook: None,
                },
            ),
            big,
        )
    }

    /// A large gradient travels in burn's own buffer: the buffer the collective hands back is
    /// the one delivered (no copy), with its values; a small one is packed with a copy.
    #[test]
    fn a_large_gradient_is_adopted_without_a_copy() {
        for reduction in [
            Reduction::AllReduce(Compression::None),
            Reduction::ReduceScatter,
        ] {
            let (mut pipeline, big) = one_rank(reduction);
            pipeline.begin(true);
            let grad: Vec<f32> = (0..big).map(|i| i as f32 * 0.5).collect();
            let (ptr, expected) = (grad.as_ptr(), grad.clone());
            pipeline.deliver(0, Ok(Some(grad.into())));
            pipeline.deliver(1, Ok(Some(vec![1.0; 5].into())));
            let mut parts = Vec::new();
            let presence = pipeline.finish(1, |_, d| parts.push(d)).unwrap();
            assert_eq!(presence, vec![1.0, 1.0]);
            let big_part = pipeline.layout().place[0].unwrap().part;
            let got = parts.iter().find(|d| d.part == big_part).unwrap();
            assert_eq!(
                got.buf.as_ptr(),
                ptr,
                "{reduction:?}: the gradient was copied"
            );
            assert_eq!(got.buf.as_ref(), expected);
        }
    }

    /// Accumulation adds into the adopted buffer; a parameter absent in every micro-step
    /// stays absent (presence 0), one absent in some has the sum of the others.
    #[test]
    fn micro_steps_add_up_and_presence_counts_them() {
        let (mut pipeline, big) = one_rank(Reduction::AllReduce(Compression::None));
        pipeline.begin(false);
        pipeline.deliver(0, Ok(Some(vec![1.0; big].into())));
        pipeline.deliver(1, Ok(None));
        assert_eq!(pipeline.buckets_submitted(), 0, "no_sync: nothing goes out");
        pipeline.begin(true);
        pipeline.deliver(1, Ok(None));
        pipeline.deliver(0, Ok(Some(vec![2.0; big].into())));
        let mut sums = Vec::new();
        let presence = pipeline
            .finish(1, |_, d| sums.push(d.buf.as_ref()[0]))
            .unwrap();
        assert_eq!(presence, vec![2.0, 0.0]);
        assert!(sums.contains(&3.0), "{sums:?}");
    }

    /// A local failure still sends every part and fails the step with this rank's own error;
    /// the next cycle starts clean.
    #[test]
    fn a_local_failure_is_reported_after_every_collective() {
        let (mut pipeline, big) = one_rank(Reduction::AllReduce(Compression::None));
        pipeline.begin(true);
        pipeline.deliver(0, Ok(Some(vec![1.0; big].into())));
        pipeline.deliver(
            1,
            Err(DdpError::Conversion {
                name: "small".into(),
                what: "gradient",
                reason: "test".into(),
            }),
        );
        let mut parts = 0;
        let e = pipeline
            .finish(1, |_, _| parts += 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("small"), "{e}");
        assert_eq!(parts, 2, "every part went out and came back");
        pipeline.begin(true);
        pipeline.deliver(0, Ok(Some(vec![1.0; big].into())));
        pipeline.deliver(1, Ok(Some(vec![1.0; 5].into())));
        assert_eq!(pipeline.finish(1, |_, _| {}).unwrap(), vec![1.0, 1.0]);
    }

    /// A carrier that holds every submission back until `launch`, as the GPU path's does (one
    /// synchronisation per step), over the host carrier; its launch can fail locally, after
    /// which it still sends every part (zeros), as the GPU path's stand-ins do.
    struct HeldCarrier {
        host: HostCarrier,
        held: Vec<(usize, HostBuf)>,
        launched: Vec<Option<crate::gradients::host_carrier::Flight>>,
        /// Parts submitted to the process group so far, in order.
        sent: Vec<usize>,
        fail_launch: bool,
    }

    impl Carrier for HeldCarrier {
        type Buf = HostBuf;
        type Flight = usize;

        fn take(
            &mut self,
            grads: &mut GradientsParams,
            info: &ParamInfo,
        ) -> Result<Option<HostBuf>, DdpError> {
            self.host.take(grads, info)
        }
        fn len(&self, buf: &HostBuf) -> usize {
            buf.len()
        }
        fn zeros(&mut self, len: usize) -> HostBuf {
            HostBuf::zeros(len)
        }
        fn write(&mut self, buf: &mut HostBuf, at: usize, grad: HostBuf, add: bool) {
            self.host.write(buf, at, grad, add)
        }
        fn submit(&mut self, part: usize, buf: HostBuf) -> (usize, u64) {
            self.held.push((part, buf));
            (self.held.len() - 1, 0)
        }
        fn launch(&mut self) -> Result<Option<DdpError>, DdpError> {
            let error = self
                .fail_launch
                .then(|| DdpError::Config("launch failed".into()));
            self.launched.clear();
            for (part, buf) in std::mem::take(&mut self.held) {
                let buf = if error.is_some() {
                    HostBuf::zeros(buf.len())
                } else {
                    buf
                };
                self.sent.push(part);
                let (flight, _) = self.host.submit(part, buf);
                self.launched.push(Some(flight));
            }
            Ok(error)
        }
        fn wait(&mut self, flight: usize) -> Result<HostBuf, DdpError> {
            match self.launched[flight].take() {
                Some(flight) => flight.wait(),
                None => Err(DdpError::Config(format!("flight {flight} waited twice"))),
            }
        }
        fn averages(&self) -> bool {
            self.host.averages()
        }
        fn divided(&mut self, buf: HostBuf, denom: f32) -> HostBuf {
            self.host.divided(buf, denom)
        }
        fn slice_divided(
            &mut self,
            buf: &HostBuf,
            range: std::ops::Range<usize>,
            d: f32,
        ) -> HostBuf {
            self.host.slice_divided(buf, range, d)
        }
        fn put(&mut self, g: &mut GradientsParams, i: &ParamInfo, b: HostBuf, d: &Device) {
            self.host.put(g, i, b, d)
        }
    }

    /// One step of a held-back pipeline on `pg` (the large parameter and the small one), rank
    /// r's gradients all r + 1, its launch failing on `failing`: the parts' results in part order,
    /// the parts sent before `finish` and in it, and the step's outcome.
    fn held_step(pg: Arc<ProcessGroup>, failing: Option<usize>) -> HeldOutcome {
        let big = crate::gradients::buckets::ADOPT_BYTES / 4 + 3;
        let params: Arc<[ParamInfo]> = vec![info("big", big), info("small", 5)].into();
        let layout = Arc::new(plan_buckets(&params, &(&DdpConfig::default()).into()));
        let rank = pg.rank();
        let carrier = HeldCarrier {
            host: HostCarrier {
                pg: Arc::clone(&pg),
                reduction: Reduction::AllReduce(Compression::None),
                hook: None,
            },
            held: Vec::new(),
            launched: Vec::new(),
            sent: Vec::new(),
            fail_launch: failing == Some(rank),
        };
        let mut pipeline = Pipeline::new(pg, params, layout, carrier);
        pipeline.begin(true);
        let value = (rank + 1) as f32;
        pipeline.deliver(1, Ok(Some(vec![value; 5].into())));
        pipeline.deliver(0, Ok(Some(vec![value; big].into())));
        let sent_before_finish = pipeline.carrier().sent.len();
        let mut sums = Vec::new();
        let result = pipeline.finish(7, |_, d| sums.push((d.part, d.buf.as_ref()[0])));
        HeldOutcome {
            sums,
            sent_before_finish,
            sent: pipeline.carrier().sent.clone(),
            result: result.map_err(|e| e.to_string()),
        }
    }

    struct HeldOutcome {
        sums: Vec<(usize, f32)>,
        sent_before_finish: usize,
        sent: Vec<usize>,
        result: Result<Vec<f32>, String>,
    }

    /// A carrier that holds parts back (the GPU path's) sends them all at `finish`, in part
    /// order, and every rank gets the sums.
    #[test]
    fn held_back_parts_go_out_in_order_at_launch() {
        for outcome in two_ranks(|pg| held_step(pg, None)) {
            assert_eq!(
                outcome.sent_before_finish, 0,
                "nothing leaves before the launch"
            );
            assert_eq!(outcome.sent, vec![0, 1]);
            // (1 + 2) / 2 on both parts (the host carrier's all-reduce averages), handed over
            // in part order.
            assert_eq!(outcome.sums, vec![(0, 1.5), (1, 1.5)]);
            assert_eq!(outcome.result, Ok(vec![2.0, 2.0]));
        }
    }

    /// A launch that fails on rank 1 (the GPU path's failed synchronisation) still sends every
    /// part; rank 1 returns its own error and rank 0 learns of it from the control all-reduce,
    /// naming rank 1.
    #[test]
    fn a_failed_launch_fails_the_step_on_every_rank() {
        let outcomes = two_ranks(|pg| held_step(pg, Some(1)));
        for outcome in &outcomes {
            assert_eq!(outcome.sent, vec![0, 1], "every part went out");
        }
        let own = outcomes[1].result.as_ref().unwrap_err();
        assert!(own.contains("launch failed"), "{own}");
        let peer = outcomes[0].result.as_ref().unwrap_err();
        assert!(
            peer.contains("sync #7") && peer.contains("rank 1 failed"),
            "{peer}"
        );
    }
}
