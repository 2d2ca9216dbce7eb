//! The gradient step of the GPU path as a sequence of collectives ([`run_device_step`]), with
//! the device and NCCL behind a small seam ([`DeviceStep`]): `cuda.rs` fills it with burn's
//! CUDA tensors and NCCL, the tests with a fake communicator of several ranks.
//!
//! NCCL matches collectives by their order only: it carries no tag, so if one rank skips a
//! bucket, its next bucket is summed with the peers' skipped one (garbage when the lengths
//! agree, a hang when they do not). And a failure on one rank must fail the step on every rank,
//! as the host path's failure slots do. So the sequence is fixed, whatever fails locally:
//!
//! 1. every bucket is packed on the device (gradients, presence slots, and the two failure
//!    slots, raised once this rank has a local error);
//! 2. the host waits once for the device to have produced them all (one synchronisation per
//!    step, instead of one per bucket);
//! 3. every bucket's all-reduce is submitted, in bucket order; a bucket that could not be
//!    packed (or all of them, when the synchronisation failed) is replaced by a stand-in of the
//!    same length and element type that carries only this rank's raised failure slots, so the
//!    peers' sequence lines up and they learn of the failure. The last bucket is packed or
//!    replaced after every local error of the step, so it carries every failed rank's slots;
//! 4. every all-reduce is waited for, in order (an error here is collective: the NCCL group
//!    and the TCP group share it, see `ddp_comm::nccl`);
//! 5. a rank with a local error returns it; the others read every bucket's presence and
//!    failure slots in one transfer, return [`DdpError::PeerFailed`] if any rank raised them,
//!    and otherwise register the averaged gradients.
//!
//! Two failures cannot travel in the slots: a stand-in that cannot be submitted (the device is
//! gone), and slots that cannot be read back after the last collective. Then the rank abandons
//! the group ([`DeviceStep::abandon`]: the TCP group fails, naming it), so that the peers fail
//! at once, or at their next collective, instead of waiting for it.

use crate::DdpError;

/// A bucket's presence slots (one per parameter: how many ranks had a gradient) and failure
/// slots (how many ranks failed locally, and the sum of their ranks plus one), after the
/// all-reduce.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Slots {
    /// One per parameter of the bucket.
    pub presence: Vec<f32>,
    /// How many ranks raised their failure slots.
    pub failed: f32,
    /// The sum of their ranks plus one.
    pub ranks: f32,
}

/// What one rank's device step does, bucket by bucket (see the module documentation).
pub(crate) trait DeviceStep {
    /// A bucket packed on the device, ready for its all-reduce.
    type Packed;
    /// A bucket's all-reduce in flight.
    type Work;
    /// A bucket's reduced buffer.
    type Reduced;
    /// Packs bucket `b`, its failure slots raised when `failed`; an error is this rank's own.
    fn pack(&mut self, b: usize, failed: bool) -> Result<Self::Packed, DdpError>;
    /// Waits until the device has produced every packed bucket (once per step).
    fn sync(&mut self) -> Result<(), DdpError>;
    /// Submits bucket `b`'s all-reduce (a failure shows at its wait).
    fn submit(&mut self, b: usize, packed: Self::Packed) -> Self::Work;
    /// Submits, in bucket `b`'s place, an all-reduce of the same length and element type that
    /// carries only this rank's raised failure slots.
    fn submit_failed(&mut self, b: usize) -> Result<Self::Work, DdpError>;
    /// Waits for bucket `b`'s all-reduce.
    fn wait(&mut self, b: usize, work: Self::Work) -> Result<Self::Reduced, DdpError>;
    /// Reads every bucket's slots in one transfer to the host.
    fn read_slots(&mut self, reduced: &[Self::Reduced]) -> Result<Vec<Slots>, DdpError>;
    /// Registers bucket `b`'s averaged gradients, for the parameters `presence` marks.
    fn unpack(&mut self, b: usize, reduced: Self::Reduced, presence: &[f32]);
    /// Fails the process group with `error`, this rank its cause, for a failure that no
    /// collective of this step can carry any more.
    fn abandon(&mut self, error: &DdpError);
}

/// Runs one step of `buckets` buckets through `step` (see the module documentation).
/// `local_error`: what already failed on this rank; `peer_failed` makes the error for raised
/// failure slots (count, sum of ranks plus one).
pub(crate) fn run_device_step<S: DeviceStep>(
    step: &mut S,
    buckets: usize,
    mut local_error: Option<DdpError>,
    peer_failed: impl Fn(f32, f32) -> DdpError,
) -> Result<(), DdpError> {
    let mut packed = Vec::with_capacity(buckets);
    for b in 0..buckets {
        match step.pack(b, local_error.is_some()) {
            Ok(p) => packed.push(Some(p)),
            Err(e) => {
                local_error.get_or_insert(e);
                packed.push(None);
            }
        }
    }
    if let Err(e) = step.sync() {
        local_error.get_or_insert(e);
        // What the device produced cannot be trusted: stand-ins for every bucket.
        packed.iter_mut().for_each(|p| *p = None);
    }
    let mut works = Vec::with_capacity(buckets);
    for (b, p) in packed.into_iter().enumerate() {
        let work = match p {
            Some(p) => step.submit(b, p),
            None => match step.submit_failed(b) {
                Ok(work) => work,
                Err(e) => {
                    let e = local_error.unwrap_or(e);
                    step.abandon(&e);
                    return Err(e);
                }
            },
        };
        works.push(work);
    }
    let mut reduced = Vec::with_capacity(buckets);
    let mut comm_error = None;
    for (b, work) in works.into_iter().enumerate() {
        // Keep waiting after an error, so that no buffer is left in the communicator's hands.
        match step.wait(b, work) {
            Ok(r) => reduced.push(r),
            Err(e) => {
                comm_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = comm_error.or(local_error) {
        return Err(e);
    }
    let slots = match step.read_slots(&reduced) {
        Ok(slots) if slots.len() == buckets => slots,
        Ok(slots) => {
            let e = DdpError::Config(format!(
                "read the slots of {} buckets, expected {buckets}",
                slots.len()
            ));
            step.abandon(&e);
            return Err(e);
        }
        Err(e) => {
            step.abandon(&e);
            return Err(e);
        }
    };
    let worst = slots
        .iter()
        .filter(|s| s.failed > 0.0)
        .max_by(|a, b| a.failed.total_cmp(&b.failed));
    if let Some(s) = worst {
        return Err(peer_failed(s.failed, s.ranks));
    }
    for (b, (r, s)) in reduced.into_iter().zip(slots).enumerate() {
        step.unpack(b, r, &s.presence);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};

    /// How long a rank of the fake waits for its peers' matching collective: NCCL would wait
    /// forever; the fake reports it as a hang.
    const HANG: Duration = Duration::from_secs(3);

    /// One collective of the fake communicator: each rank's (bucket, buffer) in the order of
    /// submission, as NCCL matches them.
    #[derive(Default)]
    struct Round {
        sent: Vec<Option<(usize, Vec<f32>)>>,
    }

    /// A fake NCCL for `world` ranks (threads): the k-th submission of every rank forms the
    /// k-th collective, whose result is the element-wise sum; different lengths are reported
    /// as a mismatch (a hang or garbage with NCCL), a missing rank as a hang after [`HANG`].
    struct FakeNccl {
        world: usize,
        rounds: Mutex<Vec<Round>>,
        done: Condvar,
    }

    impl FakeNccl {
        fn new(world: usize) -> FakeNccl {
            FakeNccl {
                world,
                rounds: Mutex::new(Vec::new()),
                done: Condvar::new(),
            }
        }

        fn submit(&self, rank: usize, seq: usize, bucket: usize, buf: Vec<f32>) {
            let mut rounds = self.rounds.lock().unwrap();
            while rounds.len() <= seq {
                rounds.push(Round {
                    sent: vec![None; self.world],
                });
            }
            rounds[seq].sent[rank] = Some((bucket, buf));
            self.done.notify_all();
        }

        fn wait(&self, rank: usize, seq: usize) -> Result<Vec<f32>, String> {
            let start = Instant::now();
            let mut rounds = self.rounds.lock().unwrap();
            loop {
                if let Some(round) = rounds.get(seq) {
                    if round.sent.iter().all(Option::is_some) {
                        let sent: Vec<&(usize, Vec<f32>)> = round.sent.iter().flatten().collect();
                        let (b0, first) = sent[0];
                        for (r, (b, buf)) in sent.iter().enumerate() {
                            if buf.len() != first.len() || b != b0 {
                                return Err(format!(
                                    "collective #{seq}: rank 0 sent bucket {b0} ({} values), \
                                     rank {r} bucket {b} ({} values)",
                                    first.len(),
                                    buf.len()
                                ));
                            }
                        }
                        let mut sum = vec![0.0; first.len()];
                        for (_, buf) in &sent {
                            for (s, v) in sum.iter_mut().zip(buf) {
                                *s += v;
                            }
                        }
                        return Ok(sum);
                    }
                }
                let left = HANG.saturating_sub(start.elapsed());
                if left.is_zero() {
                    return Err(format!("rank {rank}: collective #{seq} hangs"));
                }
                rounds = self.done.wait_timeout(rounds, left).unwrap().0;
            }
        }
    }

    /// Where a fake rank fails.
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Fail {
        Nowhere,
        Pack(usize),
        Sync,
        StandIn,
        ReadSlots,
    }

    /// The layout: bucket b holds `PARAMS[b]` parameters of `LEN` values each.
    const PARAMS: [usize; 3] = [1, 3, 2];
    const LEN: usize = 4;

    /// A rank's gradient value: parameter p, element i.
    fn grad(rank: usize, p: usize, i: usize) -> f32 {
        (rank * 100 + p * 10 + i) as f32
    }

    /// One rank of the fake device step.
    struct FakeRank<'a> {
        rank: usize,
        nccl: &'a FakeNccl,
        fail: Fail,
        seq: usize,
        /// (bucket, length) of every submission, in order.
        submitted: Vec<(usize, usize)>,
        syncs: usize,
        reads: usize,
        abandoned: Option<String>,
        /// The averaged gradients registered, per parameter.
        applied: Vec<Option<Vec<f32>>>,
    }

    impl<'a> FakeRank<'a> {
        fn new(rank: usize, nccl: &'a FakeNccl, fail: Fail) -> FakeRank<'a> {
            FakeRank {
                rank,
                nccl,
                fail,
                seq: 0,
                submitted: Vec::new(),
                syncs: 0,
                reads: 0,
                abandoned: None,
                applied: vec![None; PARAMS.iter().sum()],
            }
        }

        fn first_param(b: usize) -> usize {
            PARAMS[..b].iter().sum()
        }

        fn bucket_len(b: usize) -> usize {
            PARAMS[b] * LEN + PARAMS[b] + 2
        }

        fn send(&mut self, b: usize, buf: Vec<f32>) -> usize {
            self.submitted.push((b, buf.len()));
            self.nccl.submit(self.rank, self.seq, b, buf);
            self.seq += 1;
            self.seq - 1
        }
    }

    impl DeviceStep for FakeRank<'_> {
        type Packed = Vec<f32>;
        type Work = usize;
        type Reduced = (usize, Vec<f32>);

        fn pack(&mut self, b: usize, failed: bool) -> Result<Vec<f32>, DdpError> {
            // A rank that cannot submit a stand-in first needs one: it cannot pack bucket 1.
            if self.fail == Fail::Pack(b) || (self.fail == Fail::StandIn && b == 1) {
                return Err(DdpError::Config(format!(
                    "rank {}: cannot pack bucket {b}",
                    self.rank
                )));
            }
            let mut buf = Vec::new();
            for p in 0..PARAMS[b] {
                let param = Self::first_param(b) + p;
                buf.extend((0..LEN).map(|i| grad(self.rank, param, i)));
            }
            buf.extend(std::iter::repeat_n(1.0, PARAMS[b]));
            let rank = (self.rank + 1) as f32;
            buf.extend(if failed { [1.0, rank] } else { [0.0, 0.0] });
            Ok(buf)
        }

        fn sync(&mut self) -> Result<(), DdpError> {
            self.syncs += 1;
            if self.fail == Fail::Sync {
                return Err(DdpError::Config(format!("rank {}: device lost", self.rank)));
            }
            Ok(())
        }

        fn submit(&mut self, b: usize, packed: Vec<f32>) -> usize {
            self.send(b, packed)
        }

        fn submit_failed(&mut self, b: usize) -> Result<usize, DdpError> {
            if self.fail == Fail::StandIn {
                return Err(DdpError::Config(format!("rank {}: no memory", self.rank)));
            }
            let mut buf = vec![0.0; Self::bucket_len(b)];
            let n = buf.len();
            buf[n - 2] = 1.0;
            buf[n - 1] = (self.rank + 1) as f32;
            Ok(self.send(b, buf))
        }

        fn wait(&mut self, b: usize, work: usize) -> Result<(usize, Vec<f32>), DdpError> {
            self.nccl
                .wait(self.rank, work)
                .map(|sum| (b, sum))
                .map_err(DdpError::Config)
        }

        fn read_slots(&mut self, reduced: &[(usize, Vec<f32>)]) -> Result<Vec<Slots>, DdpError> {
            self.reads += 1;
            if self.fail == Fail::ReadSlots {
                return Err(DdpError::Config(format!("rank {}: read failed", self.rank)));
            }
            Ok(reduced
                .iter()
                .map(|(b, sum)| {
                    let grads = PARAMS[*b] * LEN;
                    Slots {
                        presence: sum[grads..grads + PARAMS[*b]].to_vec(),
                        failed: sum[sum.len() - 2],
                        ranks: sum[sum.len() - 1],
                    }
                })
                .collect())
        }

        fn unpack(&mut self, b: usize, reduced: (usize, Vec<f32>), presence: &[f32]) {
            assert_eq!(reduced.0, b);
            let world = self.nccl.world as f32;
            for (p, &present) in presence.iter().enumerate() {
                if present > 0.0 {
                    let values = &reduced.1[p * LEN..(p + 1) * LEN];
                    self.applied[Self::first_param(b) + p] =
                        Some(values.iter().map(|v| v / world).collect());
                }
            }
        }

        fn abandon(&mut self, error: &DdpError) {
            self.abandoned = Some(error.to_string());
        }
    }

    /// What one rank ended with.
    struct Outcome {
        result: Result<(), DdpError>,
        submitted: Vec<(usize, usize)>,
        syncs: usize,
        reads: usize,
        abandoned: Option<String>,
        applied: Vec<Option<Vec<f32>>>,
    }

    /// Runs one step on `fails.len()` ranks (threads), rank r failing at `fails[r]`.
    fn step(fails: &[Fail]) -> Vec<Outcome> {
        let nccl = FakeNccl::new(fails.len());
        std::thread::scope(|s| {
            let handles: Vec<_> = fails
                .iter()
                .enumerate()
                .map(|(rank, &fail)| {
                    let nccl = &nccl;
                    s.spawn(move || {
                        let mut me = FakeRank::new(rank, nccl, fail);
                        let result = run_device_step(&mut me, PARAMS.len(), None, |f, r| {
                            let count = f.round() as usize;
                            DdpError::PeerFailed {
                                sync: 1,
                                count,
                                rank: (count == 1).then(|| r.round() as usize - 1),
                            }
                        });
                        Outcome {
                            result,
                            submitted: me.submitted,
                            syncs: me.syncs,
                            reads: me.reads,
                            abandoned: me.abandoned,
                            applied: me.applied,
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every bucket once, in order, at its own length.
    fn in_order() -> Vec<(usize, usize)> {
        (0..PARAMS.len())
            .map(|b| (b, FakeRank::bucket_len(b)))
            .collect()
    }

    #[test]
    fn without_failures_every_rank_gets_the_average_with_one_sync_and_one_read() {
        let outcomes = step(&[Fail::Nowhere; 3]);
        for (rank, o) in outcomes.iter().enumerate() {
            o.result.as_ref().unwrap();
            assert_eq!(o.submitted, in_order(), "rank {rank}");
            assert_eq!((o.syncs, o.reads), (1, 1), "rank {rank}");
            for p in 0..PARAMS.iter().sum::<usize>() {
                // The mean over ranks, computed from the values themselves.
                let want: Vec<f32> = (0..LEN)
                    .map(|i| (0..3).map(|r| grad(r, p, i)).sum::<f32>() / 3.0)
                    .collect();
                assert_eq!(o.applied[p].as_deref(), Some(want.as_slice()), "param {p}");
            }
        }
    }

    /// A rank that cannot pack its middle bucket still submits every bucket in order; every rank
    /// fails the step (the failing rank with its own error, the others naming it) and nobody
    /// registers a gradient.
    #[test]
    fn a_bucket_that_fails_to_pack_is_replaced_in_order_and_fails_every_rank() {
        let outcomes = step(&[Fail::Nowhere, Fail::Pack(1), Fail::Nowhere]);
        for (rank, o) in outcomes.iter().enumerate() {
            assert_eq!(o.submitted, in_order(), "rank {rank}");
            assert!(o.applied.iter().all(Option::is_none), "rank {rank}");
            let e = o.result.as_ref().unwrap_err().to_string();
            if rank == 1 {
                assert!(e.contains("rank 1: cannot pack bucket 1"), "{e}");
            } else {
                assert!(e.contains("rank 1 failed locally"), "rank {rank}: {e}");
            }
        }
    }

    #[test]
    fn a_failed_sync_replaces_every_bucket() {
        let outcomes = step(&[Fail::Sync, Fail::Nowhere]);
        assert!(outcomes[0]
            .result
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("device lost"));
        let e = outcomes[1].result.as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 0 failed locally"), "{e}");
        for o in &outcomes {
            assert_eq!(o.submitted, in_order());
        }
    }

    #[test]
    fn two_failed_ranks_are_counted_on_the_others() {
        let outcomes = step(&[Fail::Pack(2), Fail::Nowhere, Fail::Pack(0), Fail::Nowhere]);
        for rank in [1, 3] {
            let e = outcomes[rank].result.as_ref().unwrap_err().to_string();
            assert!(e.contains("2 ranks failed locally"), "rank {rank}: {e}");
        }
        for o in &outcomes {
            assert_eq!(o.submitted, in_order());
        }
    }

    /// A rank that cannot pack bucket 1 and cannot even submit its stand-in abandons the group
    /// with its first error (its peers then fail through the TCP group) and submits nothing
    /// more; the peer's next collective does not complete.
    #[test]
    fn a_stand_in_that_cannot_be_submitted_abandons_the_group() {
        let outcomes = step(&[Fail::Nowhere, Fail::StandIn]);
        let o = &outcomes[1];
        assert_eq!(o.submitted, in_order()[..1]);
        let e = o.result.as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1: cannot pack bucket 1"), "{e}");
        assert_eq!(o.abandoned.as_deref(), Some(e.as_str()));
        let e0 = outcomes[0].result.as_ref().unwrap_err().to_string();
        assert!(e0.contains("collective #1 hangs"), "{e0}");
        assert!(outcomes[0].applied.iter().all(Option::is_none));
    }

    /// Slots that cannot be read after the last collective: only abandoning the group tells the
    /// peers.
    #[test]
    fn slots_that_cannot_be_read_abandon_the_group() {
        let outcomes = step(&[Fail::Nowhere, Fail::ReadSlots]);
        assert!(outcomes[1].result.is_err());
        assert!(outcomes[1]
            .abandoned
            .as_deref()
            .unwrap()
            .contains("read failed"));
        assert!(outcomes[1].applied.iter().all(Option::is_none));
        assert!(outcomes[0].abandoned.is_none());
    }
}
