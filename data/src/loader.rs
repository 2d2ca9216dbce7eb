//! `DataLoader`: turns a list of dataset indices (a sampler's, usually) into batches of burn
//! tensors, optionally built ahead by worker threads.
//!
//! How it works: the indices are cut into consecutive batches (the last one short, or dropped
//! with `drop_last`). With `num_workers = 0` each batch is built in the calling thread when it is
//! asked for. With `N > 0` workers, worker `w` builds batches `w, w + N, w + 2N, ...` into its own
//! bounded channel, `prefetch` batches deep, and the consumer takes batch `i` from worker
//! `i % N`: batches come out in index order whatever `N` is, and at most `N * prefetch` batches
//! wait in memory. Workers build plain CPU data ([`CpuBatch`]: `Vec<f32>`, `Vec<i64>`, a shape),
//! because tensors of some backends are not `Send`; the consumer thread turns each into tensors
//! on the loader's device. Dropping the iterator early stops the workers.

use std::sync::Arc;
use std::thread::JoinHandle;

use burn::tensor::{Device, Int, Tensor, TensorData};
use crossbeam_channel::{bounded, Receiver};

use crate::{BatchSource, DataError, Mnist, Pima};

/// Batch size, worker threads, prefetch depth and `drop_last` of a [`DataLoader`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Samples per batch (default 64). Must be at least 1.
    pub batch_size: usize,
    /// Threads building batches ahead (default 0: batches are built in the calling thread).
    pub num_workers: usize,
    /// Batches each worker may hold ready (default 2). Must be at least 1.
    pub prefetch: usize,
    /// Drops the last batch when it is short (default false).
    pub drop_last: bool,
}

impl Default for LoaderConfig {
    fn default() -> Self {
        LoaderConfig {
            batch_size: 64,
            num_workers: 0,
            prefetch: 2,
            drop_last: false,
        }
    }
}

/// A batch as plain CPU data: `inputs` row-major with shape `shape` (batch first), the labels
/// in `targets` (one a sample, or [`BatchSource::targets_per_sample`] each, sample after
/// sample). What workers build and send.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuBatch<const D: usize> {
    /// The features, normalised, row-major.
    pub inputs: Vec<f32>,
    /// The shape of `inputs`, batch dimension first.
    pub shape: [usize; D],
    /// The labels, sample after sample.
    pub targets: Vec<i64>,
}

impl<const D: usize> CpuBatch<D> {
    /// Builds the batch of the samples at `indices` (which must be below `dataset.len()`).
    pub fn build<S: BatchSource<D> + ?Sized>(dataset: &S, indices: &[usize]) -> CpuBatch<D> {
        let shape = dataset.batch_shape(indices.len());
        let item: usize = dataset.batch_shape(1)[1..].iter().product();
        let per_sample = dataset.targets_per_sample();
        let mut inputs = vec![0f32; item * indices.len()];
        let mut targets = vec![0i64; per_sample * indices.len()];
        for ((&i, out), labels) in indices
            .iter()
            .zip(inputs.chunks_exact_mut(item.max(1)))
            .zip(targets.chunks_exact_mut(per_sample.max(1)))
        {
            dataset.write_sample_targets(i, out, labels);
        }
        CpuBatch {
            inputs,
            shape,
            targets,
        }
    }

    /// Moves the batch into tensors on `device`.
    pub fn into_tensors(self, device: &Device) -> Batch<D> {
        let n = self.targets.len();
        Batch {
            inputs: Tensor::from_data(TensorData::new(self.inputs, self.shape), device),
            targets: Tensor::from_data(TensorData::new(self.targets, [n]), device),
        }
    }
}

/// A batch of tensors: `inputs` of rank `D`, batch first, and `targets` of shape `[batch]`.
#[derive(Debug, Clone)]
pub struct Batch<const D: usize> {
    /// The features (MNIST `[B, 1, 28, 28]`, Pima `[B, 8]`), `f32`, normalised.
    pub inputs: Tensor<D>,
    /// The class labels, `[B]` (`[B · k]` for a source with `k` targets a sample).
    pub targets: Tensor<1, Int>,
}

/// Batches of a dataset on a device. Build one, then call [`iter`](Self::iter) once per epoch
/// with that epoch's indices.
pub struct DataLoader<S, const D: usize> {
    dataset: Arc<S>,
    config: LoaderConfig,
    device: Device,
}

// By hand, so that neither needs `S: Clone` or `S: Debug`.
impl<S, const D: usize> Clone for DataLoader<S, D> {
    fn clone(&self) -> Self {
        DataLoader {
            dataset: self.dataset.clone(),
            config: self.config,
            device: self.device.clone(),
        }
    }
}

impl<S, const D: usize> std::fmt::Debug for DataLoader<S, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("config", &self.config)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A loader of MNIST images `[B, 1, 28, 28]`.
pub type MnistLoader = DataLoader<Mnist, 4>;
/// A loader of Pima features `[B, 8]`.
pub type PimaLoader = DataLoader<Pima, 2>;

impl<S, const D: usize> DataLoader<S, D>
where
    S: BatchSource<D> + 'static,
{
    /// A loader over `dataset` producing tensors on `device`. Errors when the batch size or the
    /// prefetch depth is 0.
    pub fn new(
        dataset: Arc<S>,
        config: LoaderConfig,
        device: Device,
    ) -> Result<DataLoader<S, D>, DataError> {
        if config.batch_size == 0 {
            return Err(DataError::InvalidArgument(
                "batch_size must be at least 1".into(),
            ));
        }
        if config.prefetch == 0 {
            return Err(DataError::InvalidArgument(
                "prefetch must be at least 1".into(),
            ));
        }
        Ok(DataLoader {
            dataset,
            config,
            device,
        })
    }

    /// The dataset.
    pub fn dataset(&self) -> &Arc<S> {
        &self.dataset
    }

    /// The configuration.
    pub fn config(&self) -> LoaderConfig {
        self.config
    }

    /// The number of batches [`iter`](Self::iter) yields for `num_indices` indices.
    pub fn num_batches(&self, num_indices: usize) -> usize {
        if self.config.drop_last {
            num_indices / self.config.batch_size
        } else {
            num_indices.div_ceil(self.config.batch_size)
        }
    }

    /// The batches of the samples at `indices`, in that order (typically
    /// `sampler.indices()`). Errors when an index is beyond the dataset.
    pub fn iter(&self, indices: Vec<usize>) -> Result<BatchIter<S, D>, DataError> {
        let len = self.dataset.len();
        if let Some((pos, &i)) = indices.iter().enumerate().find(|(_, &i)| i >= len) {
            return Err(DataError::InvalidArgument(format!(
                "index {i} at position {pos} is beyond the dataset of {len} samples"
            )));
        }
        let num_batches = self.num_batches(indices.len());
        let indices = Arc::new(indices);
        let batch_size = self.config.batch_size;
        let mut receivers = Vec::new();
        let mut workers = Vec::new();
        let n = self.config.num_workers.min(num_batches);
        for w in 0..n {
            let (tx, rx) = bounded(self.config.prefetch);
            let (dataset, indices) = (self.dataset.clone(), indices.clone());
            let handle = std::thread::Builder::new()
                .name(format!("ddp-data-loader-{w}"))
                .spawn(move || {
                    for b in (w..num_batches).step_by(n) {
                        let end = ((b + 1) * batch_size).min(indices.len());
                        let batch = CpuBatch::build(&*dataset, &indices[b * batch_size..end]);
                        if tx.send(batch).is_err() {
                            return; // the iterator was dropped
                        }
                    }
                })
                .map_err(|e| DataError::Io {
                    path: "<loader worker thread>".into(),
                    source: e,
                })?;
            receivers.push(rx);
            workers.push(handle);
        }
        Ok(BatchIter {
            dataset: self.dataset.clone(),
            indices,
            batch_size,
            next: 0,
            num_batches,
            receivers,
            workers,
            device: self.device.clone(),
        })
    }
}

/// The batches of one pass, from [`DataLoader::iter`].
pub struct BatchIter<S, const D: usize> {
    dataset: Arc<S>,
    indices: Arc<Vec<usize>>,
    batch_size: usize,
    next: usize,
    num_batches: usize,
    receivers: Vec<Receiver<CpuBatch<D>>>,
    workers: Vec<JoinHandle<()>>,
    device: Device,
}

impl<S, const D: usize> BatchIter<S, D>
where
    S: BatchSource<D>,
{
    /// The next batch as CPU data, without making tensors.
    pub fn next_cpu(&mut self) -> Option<CpuBatch<D>> {
        if self.next == self.num_batches {
            return None;
        }
        let b = self.next;
        self.next += 1;
        if self.receivers.is_empty() {
            let end = ((b + 1) * self.batch_size).min(self.indices.len());
            return Some(CpuBatch::build(
                &*self.dataset,
                &self.indices[b * self.batch_size..end],
            ));
        }
        let w = b % self.receivers.len();
        match self.receivers[w].recv() {
            Ok(batch) => Some(batch),
            Err(_) => {
                // The worker ended before sending this batch: it panicked. Pass its panic on.
                let handle = self.workers.remove(w);
                self.receivers.clear();
                match handle.join() {
                    Err(panic) => std::panic::resume_unwind(panic),
                    Ok(()) => panic!("ddp-data loader worker {w} stopped before batch {b}"),
                }
            }
        }
    }
}

impl<S, const D: usize> Iterator for BatchIter<S, D>
where
    S: BatchSource<D>,
{
    type Item = Batch<D>;

    fn next(&mut self) -> Option<Batch<D>> {
        let batch = self.next_cpu()?;
        Some(batch.into_tensors(&self.device))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.num_batches - self.next;
        (left, Some(left))
    }
}

impl<S, const D: usize> ExactSizeIterator for BatchIter<S, D> where S: BatchSource<D> {}

impl<S, const D: usize> Drop for BatchIter<S, D> {
    fn drop(&mut self) {
        // Closing the channels makes blocked workers' sends fail, so they return.
        self.receivers.clear();
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}
