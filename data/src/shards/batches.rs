//! The batcher thread of a [`ShardLoader`](super::ShardLoader) ([`BatchJob`]: shuffle groups
//! of shards, batches in order, the rank's sample count cut exactly) and the iterator over what
//! it sends ([`ShardBatches`]).

use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Receiver;

use super::set::Shard;
use crate::loader::CpuBatch;
use crate::sampler::permutation;
use crate::DataError;

/// What the batcher thread does with the shards the reader sends.
pub(super) struct BatchJob<const D: usize> {
    /// Shards in one pass over the rank's list: a shuffle group never spans two passes, so
    /// that the samples beyond `target` (cut off) are all repeats from the wrap-around.
    pub pass_len: usize,
    pub target: usize,
    pub batch_size: usize,
    pub drop_last_batch: bool,
    pub group_shards: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub elems: usize,
    pub shape: [usize; D],
    pub table: Arc<[f32; 256]>,
}

impl<const D: usize> BatchJob<D> {
    /// Groups `group_shards` shards, shuffles their samples together, emits batches until
    /// `target` samples; `send` returns false when the consumer is gone.
    pub fn run(
        self,
        rx: Receiver<Result<Shard, DataError>>,
        mut send: impl FnMut(Result<CpuBatch<D>, DataError>) -> bool,
    ) {
        let mut emitted = 0usize;
        let mut inputs = Vec::with_capacity(self.batch_size * self.elems);
        let mut targets = Vec::with_capacity(self.batch_size);
        let mut group: Vec<Shard> = Vec::with_capacity(self.group_shards);
        let mut group_no = 0u64;
        let mut received = 0usize;
        while emitted < self.target {
            group.clear();
            while group.len() < self.group_shards {
                if received.is_multiple_of(self.pass_len) && !group.is_empty() {
                    break; // the end of a pass
                }
                match rx.recv() {
                    Ok(Ok(shard)) => {
                        received += 1;
                        group.push(shard);
                    }
                    Ok(Err(e)) => {
                        send(Err(e));
                        return;
                    }
                    Err(_) => break, // the reader has no more shards
                }
            }
            if group.is_empty() {
                break;
            }
            let refs: Vec<(u32, u32)> = group
                .iter()
                .enumerate()
                .flat_map(|(g, s)| (0..s.len() as u32).map(move |i| (g as u32, i)))
                .collect();
            let order = if self.shuffle {
                permutation(refs.len(), self.seed, group_no)
            } else {
                (0..refs.len()).collect()
            };
            group_no += 1;
            for pos in order {
                if emitted == self.target {
                    break;
                }
                let (g, i) = refs[pos];
                let shard = &group[g as usize];
                let i = i as usize;
                let pixels = &shard.pixels[i * self.elems..(i + 1) * self.elems];
                inputs.extend(pixels.iter().map(|&p| self.table[p as usize]));
                targets.push(i64::from(shard.labels[i]));
                emitted += 1;
                if targets.len() == self.batch_size
                    && !send(Ok(self.take(&mut inputs, &mut targets)))
                {
                    return;
                }
            }
        }
        if !targets.is_empty() && !self.drop_last_batch {
            send(Ok(self.take(&mut inputs, &mut targets)));
        }
    }

    fn take(&self, inputs: &mut Vec<f32>, targets: &mut Vec<i64>) -> CpuBatch<D> {
        let mut shape = self.shape;
        shape[0] = targets.len();
        CpuBatch {
            inputs: std::mem::replace(inputs, Vec::with_capacity(self.batch_size * self.elems)),
            shape,
            targets: std::mem::replace(targets, Vec::with_capacity(self.batch_size)),
        }
    }
}

/// The batches of one epoch of a [`ShardLoader`](super::ShardLoader), as CPU data (see
/// [`CpuBatch::into_tensors`]). An error (a bad shard) is yielded once, then the iterator ends.
/// Dropping it early stops the threads.
pub struct ShardBatches<const D: usize> {
    rx: Option<Receiver<Result<CpuBatch<D>, DataError>>>,
    threads: Vec<JoinHandle<()>>,
    next: usize,
    num_batches: usize,
    failed: bool,
}

impl<const D: usize> ShardBatches<D> {
    /// The batches of `num_batches` that `rx` delivers from `threads` (joined on drop).
    pub(super) fn new(
        rx: Receiver<Result<CpuBatch<D>, DataError>>,
        threads: Vec<JoinHandle<()>>,
        num_batches: usize,
    ) -> ShardBatches<D> {
        ShardBatches {
            rx: Some(rx),
            threads,
            next: 0,
            num_batches,
            failed: false,
        }
    }

    fn stop(&mut self) {
        self.rx = None; // the batcher's sends fail, it returns and drops the reader's receiver
        for handle in self.threads.drain(..) {
            if let Err(panic) = handle.join() {
                if !std::thread::panicking() {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
}

impl<const D: usize> Iterator for ShardBatches<D> {
    type Item = Result<CpuBatch<D>, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.next == self.num_batches {
            return None;
        }
        let got = self.rx.as_ref()?.recv();
        match got {
            Ok(Ok(batch)) => {
                self.next += 1;
                Some(Ok(batch))
            }
            Ok(Err(e)) => {
                self.failed = true;
                self.stop();
                Some(Err(e))
            }
            Err(_) => {
                // The batcher stopped early: a thread panicked (passed on by stop) or the
                // shards held fewer samples than the index says.
                self.failed = true;
                self.stop();
                Some(Err(DataError::InvalidArgument(format!(
                    "the shard stream ended after {} of {} batches",
                    self.next, self.num_batches
                ))))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = if self.failed {
            0
        } else {
            self.num_batches - self.next
        };
        (0, Some(left))
    }
}

impl<const D: usize> Drop for ShardBatches<D> {
    fn drop(&mut self) {
        self.stop();
    }
}
