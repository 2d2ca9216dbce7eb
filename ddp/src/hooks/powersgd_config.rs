//! The settings of PowerSGD (`powersgd.rs`): PyTorch's `PowerSGDState` hyperparameters.

use serde::{Deserialize, Serialize};

use crate::DdpError;

/// Settings of [`PowerSgd`](crate::PowerSgd): PyTorch's `PowerSGDState` hyperparameters, with its defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PowerSgdConfig {
    /// Rank `r` of the approximation (PyTorch's `matrix_approximation_rank`, default 1): a
    /// compressed `n × m` gradient sends `(n + m)·r` numbers instead of `n·m`.
    pub matrix_approximation_rank: usize,
    /// Steps all-reduced plain before compression starts (PyTorch's `start_powerSGD_iter`,
    /// default 1000; PyTorch suggests about 10 % of the training steps).
    pub start_powersgd_iter: u64,
    /// A gradient is compressed only when this many times its compressed size is below its
    /// size (default 2).
    pub min_compression_rate: f64,
    /// Keep what compression lost on this rank and add it to the next gradient (default on).
    pub use_error_feedback: bool,
    /// Start each step's power iteration from the previous step's Q (default on); off, Q is
    /// drawn afresh every step.
    pub warm_start: bool,
    /// Added to each column's norm before dividing by it (default 0: a zero column stays zero).
    pub orthogonalization_epsilon: f32,
    /// Seed of the generator that draws Q, the same on every rank (default 0).
    pub random_seed: u64,
}

impl Default for PowerSgdConfig {
    fn default() -> Self {
        PowerSgdConfig {
            matrix_approximation_rank: 1,
            start_powersgd_iter: 1000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
        }
    }
}

impl PowerSgdConfig {
    /// PyTorch's defaults (rank 1, compression from step 1000).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`matrix_approximation_rank`](Self::matrix_approximation_rank).
    pub fn with_matrix_approximation_rank(mut self, rank: usize) -> Self {
        self.matrix_approximation_rank = rank;
        self
    }

    /// Sets [`start_powersgd_iter`](Self::start_powersgd_iter).
    pub fn with_start_powersgd_iter(mut self, steps: u64) -> Self {
        self.start_powersgd_iter = steps;
        self
    }

    /// Sets [`min_compression_rate`](Self::min_compression_rate).
    pub fn with_min_compression_rate(mut self, rate: f64) -> Self {
        self.min_compression_rate = rate;
        self
    }

    /// Sets [`use_error_feedback`](Self::use_error_feedback).
    pub fn with_use_error_feedback(mut self, on: bool) -> Self {
        self.use_error_feedback = on;
        self
    }

    /// Sets [`warm_start`](Self::warm_start).
    pub fn with_warm_start(mut self, on: bool) -> Self {
        self.warm_start = on;
        self
    }

    /// Sets [`orthogonalization_epsilon`](Self::orthogonalization_epsilon).
    pub fn with_orthogonalization_epsilon(mut self, epsilon: f32) -> Self {
        self.orthogonalization_epsilon = epsilon;
        self
    }

    /// Sets [`random_seed`](Self::random_seed).
    pub fn with_random_seed(mut self, seed: u64) -> Self {
        self.random_seed = seed;
        self
    }

    /// Refuses settings PowerSGD cannot run with, naming the field.
    pub fn validate(&self) -> Result<(), DdpError> {
        let bad = |what: String| Err(DdpError::Config(format!("PowerSGD: {what}")));
        if self.matrix_approximation_rank == 0 {
            return bad("matrix_approximation_rank must be at least 1".into());
        }
        if !(self.min_compression_rate.is_finite() && self.min_compression_rate >= 0.0) {
            return bad(format!(
                "min_compression_rate must be a finite number ≥ 0, not {}",
                self.min_compression_rate
            ));
        }
        let eps = self.orthogonalization_epsilon;
        if !(eps.is_finite() && eps >= 0.0) {
            return bad(format!(
                "orthogonalization_epsilon must be a finite number ≥ 0, not {eps}"
            ));
        }
        Ok(())
    }
}
