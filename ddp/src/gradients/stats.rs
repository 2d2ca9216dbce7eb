//! What a [`DistributedDataParallel`](crate::DistributedDataParallel) reports about its
//! gradient synchronisation: counters and times ([`SyncStats`]) and, when recording, the timed
//! phases of every bucket ([`SyncSpan`]) for timelines.

use std::time::{Duration, Instant};

/// Time and volume spent in gradient synchronisation since the last
/// [`DistributedDataParallel::take_stats`](crate::DistributedDataParallel::take_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SyncStats {
    /// Number of synchronised steps.
    pub steps: u64,
    /// Time spent copying gradients into buckets (and submitting them).
    pub pack: Duration,
    /// Time spent blocked waiting for all-reduces to finish.
    pub wait: Duration,
    /// Time spent turning reduced buckets back into gradient tensors.
    pub unpack: Duration,
    /// Bytes all-reduced (as sent on the wire, after compression).
    pub bytes: u64,
    /// Bucket all-reduces across ranks (none at world size 1).
    pub buckets: u64,
    /// Of which: started during backward, by the hooks of [`DdpConfig::overlap`](crate::DdpConfig::overlap) (0 where
    /// overlap is off: see [`DistributedDataParallel::why_no_overlap`](crate::DistributedDataParallel::why_no_overlap)).
    pub buckets_during_backward: u64,
}

impl SyncStats {
    /// Total time the synchronisation added to the caller's step.
    pub fn total(&self) -> Duration {
        self.pack + self.wait + self.unpack
    }

    /// Adds `other`'s counts and times to these.
    pub fn add(&mut self, other: &SyncStats) {
        self.steps += other.steps;
        self.pack += other.pack;
        self.wait += other.wait;
        self.unpack += other.unpack;
        self.bytes += other.bytes;
        self.buckets += other.buckets;
        self.buckets_during_backward += other.buckets_during_backward;
    }
}

/// A phase of [`DistributedDataParallel::sync`](crate::DistributedDataParallel::sync), for timelines (see
/// [`DistributedDataParallel::record_spans`](crate::DistributedDataParallel::record_spans)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPhase {
    /// Packing one part of a bucket (copying gradients into its buffer, or taking burn's) and
    /// submitting its all-reduce.
    Pack,
    /// One part's all-reduce as the caller sees it: from its submission (or the end of the
    /// previous one's, the communication thread running them one after another) until `wait`
    /// returned it. The process group's flight recorder has the communication thread's own
    /// start and end.
    AllReduce,
    /// The caller blocked waiting for one part's all-reduce.
    Wait,
    /// Turning one reduced part back into gradient tensors.
    Unpack,
}

/// One timed phase of one bucket in a [`DistributedDataParallel::sync`](crate::DistributedDataParallel::sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncSpan {
    /// What was done.
    pub phase: SyncPhase,
    /// The bucket (communication order) of the part.
    pub bucket: usize,
    /// Elements of the part's all-reduce (on the GPU path: the bucket's, with its presence
    /// and failure slots).
    pub elements: usize,
    /// When it started.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}
