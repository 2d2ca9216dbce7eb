//! The learning-rate schedule of the trainers (`--lr-schedule`): constant, or nanoGPT's linear
//! warm-up then cosine decay to a floor.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// The shape of the learning rate over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScheduleKind {
    /// The same learning rate at every step (the trainers' default).
    Constant,
    /// Linear warm-up over `--warmup-steps`, then cosine decay to `--min-lr` at step
    /// `--decay-steps`, `--min-lr` after (nanoGPT's `get_lr`).
    Cosine,
}

/// A learning-rate schedule: what [`LrSchedule::lr`] needs besides the peak rate and the step.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LrSchedule {
    /// Constant or cosine.
    pub kind: ScheduleKind,
    /// Steps of linear warm-up (cosine only).
    pub warmup_steps: u64,
    /// The step at which the cosine reaches `min_lr`, counted from the start of the run,
    /// warm-up included (nanoGPT's `lr_decay_iters`; cosine only).
    pub decay_steps: u64,
    /// The floor of the cosine, a learning rate (not scaled with the world size).
    pub min_lr: f64,
}

impl LrSchedule {
    /// The constant schedule (every step at the peak rate).
    pub fn constant() -> LrSchedule {
        LrSchedule {
            kind: ScheduleKind::Constant,
            warmup_steps: 0,
            decay_steps: 0,
            min_lr: 0.0,
        }
    }

    /// The learning rate of step `step` (counted from 0: the step about to be taken, which is
    /// the number of steps already done) for the peak rate `peak`.
    ///
    /// nanoGPT's `get_lr`, as a pure function of the global step so that a resumed run (whose
    /// checkpoint restores the step) continues the schedule where it stopped, and every rank,
    /// joiners included, computes the same rate without exchanging it:
    ///
    /// - warm-up, `step < warmup`: `peak · (step + 1) / (warmup + 1)`, a straight line that
    ///   starts above zero (the first step already moves) and stays below `peak`;
    /// - decay, `warmup <= step <= decay`: `min + c · (peak − min)` with
    ///   `c = ½ (1 + cos(π r))` and `r = (step − warmup) / (decay − warmup)` going from 0 to
    ///   1, so the rate leaves `peak` with zero slope and lands on `min` with zero slope;
    /// - after, `step > decay`: `min`.
    pub fn lr(&self, peak: f64, step: u64) -> f64 {
        if self.kind == ScheduleKind::Constant {
            return peak;
        }
        let (warmup, decay) = (self.warmup_steps, self.decay_steps);
        if step < warmup {
            return peak * (step + 1) as f64 / (warmup + 1) as f64;
        }
        if step > decay {
            return self.min_lr;
        }
        let ratio = (step - warmup) as f64 / decay.saturating_sub(warmup).max(1) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (peak - self.min_lr)
    }

    /// The schedule in words, for the first line and the elastic job terms: `constant`, or
    /// `cosine (warm-up 100 steps, to 1e-4 at step 5000)`.
    pub fn describe(&self) -> String {
        match self.kind {
            ScheduleKind::Constant => "constant".into(),
            ScheduleKind::Cosine => format!(
                "cosine (warm-up {} steps, to {:e} at step {})",
                self.warmup_steps, self.min_lr, self.decay_steps
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine(warmup: u64, decay: u64, min_lr: f64) -> LrSchedule {
        LrSchedule {
            kind: ScheduleKind::Cosine,
            warmup_steps: warmup,
            decay_steps: decay,
            min_lr,
        }
    }

    /// Warm-up 3, decay to 0.1 at step 7, peak 1: the values worked out by hand.
    /// Warm-up: (s+1)/4 = 0.25, 0.5, 0.75. Decay r = (s−3)/4 at s = 3..7 is 0, ¼, ½, ¾, 1;
    /// ½(1+cos πr) = 1, (2+√2)/4, ½, (2−√2)/4, 0; times 0.9 plus 0.1. After: 0.1.
    #[test]
    fn cosine_matches_the_closed_form_worked_by_hand() {
        let s = cosine(3, 7, 0.1);
        let r2 = std::f64::consts::SQRT_2;
        let expected = [
            0.25,
            0.5,
            0.75,
            1.0,
            0.1 + 0.9 * (2.0 + r2) / 4.0,
            0.1 + 0.9 * 0.5,
            0.1 + 0.9 * (2.0 - r2) / 4.0,
            0.1,
            0.1,
            0.1,
        ];
        for (step, want) in expected.iter().enumerate() {
            let got = s.lr(1.0, step as u64);
            assert!((got - want).abs() < 1e-12, "step {step}: {got} vs {want}");
        }
        // The peak scales the warm-up and the decay but not the floor.
        assert!((s.lr(2.0, 0) - 0.5).abs() < 1e-12);
        assert!((s.lr(2.0, 5) - (0.1 + 1.9 * 0.5)).abs() < 1e-12);
        assert_eq!(s.lr(2.0, 100), 0.1);
    }

    #[test]
    fn no_warm_up_starts_at_the_peak_and_constant_never_moves() {
        let s = cosine(0, 4, 0.0);
        assert_eq!(s.lr(3.0, 0), 3.0);
        assert!((s.lr(3.0, 2) - 1.5).abs() < 1e-12);
        assert_eq!(s.lr(3.0, 4), 0.0);
        let c = LrSchedule::constant();
        assert!((0..1000).all(|step| c.lr(3.0, step) == 3.0));
    }
}
