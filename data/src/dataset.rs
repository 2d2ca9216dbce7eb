//! What every data set of the crate is: [`Dataset`] (a finite, indexable collection of samples)
//! and [`BatchSource`] (one that writes its samples straight into a batch, for the loader).

/// A finite, indexable collection of samples.
pub trait Dataset {
    /// One sample.
    type Item;

    /// Number of samples.
    fn len(&self) -> usize;

    /// The sample at `index`, or `None` when `index >= len()`.
    fn get(&self, index: usize) -> Option<Self::Item>;

    /// Whether the dataset holds no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dataset that writes its samples straight into a batch: features as normalised `f32`, the
/// label as `i64`. `D` is the rank of the batch's input tensor (4 for MNIST images
/// `[B, 1, 28, 28]`, 2 for Pima `[B, 8]`).
///
/// Implementations are shared between loader threads, hence `Send + Sync`.
pub trait BatchSource<const D: usize>: Dataset + Send + Sync {
    /// The shape of a batch of `batch` samples, batch dimension first.
    fn batch_shape(&self, batch: usize) -> [usize; D];

    /// Writes the features of sample `index` into `out` (whose length is the product of
    /// `batch_shape(1)`) and returns its label.
    ///
    /// # Panics
    /// When `index >= len()` or `out` has the wrong length; the loader checks indices first.
    fn write_sample(&self, index: usize, out: &mut [f32]) -> i64;

    /// Labels per sample: 1 for a classifier (the default); a sequence model's sample has one
    /// at every position (a window of text: the next character after each prefix).
    fn targets_per_sample(&self) -> usize {
        1
    }

    /// Writes the features of sample `index` into `out` and its `targets_per_sample()` labels
    /// into `targets`; the loader calls this one. The default writes [`write_sample`]'s label.
    ///
    /// [`write_sample`]: BatchSource::write_sample
    ///
    /// # Panics
    /// As [`write_sample`](BatchSource::write_sample), or when `targets` has the wrong length.
    fn write_sample_targets(&self, index: usize, out: &mut [f32], targets: &mut [i64]) {
        targets[0] = self.write_sample(index, out);
    }
}
