//! `ddp_models::ops::dropout` on an autodiff flex device (the CPU backend's counter-based mask)
//! and on a plain one: kept values scaled by exactly `1 / (1 - p)`, the kept fraction within a
//! few standard deviations of `1 - p` (on both halves of each 64-bit draw), the gradient equal
//! to the mask, the same mask for the same seed at any thread count, another mask for another
//! seed, and the identity where burn's `Dropout` is the identity.
//!
//! These tests seed and draw from flex's one global generator, so they hold a lock around
//! each seed-then-draw (this file is its own test process; nothing else draws here).

use std::sync::Mutex;

use burn::module::Param;
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::{Device, Tensor, TensorData};
use ddp_models::ops;

/// Serialises seeding and drawing from flex's global generator.
static RNG: Mutex<()> = Mutex::new(());

/// An odd length, so that the last pair of a draw and the last parallel chunk are partial.
const LEN: usize = 200_003;

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// `dropout(x)` of `x` = ones `[LEN]` after seeding with `seed`, on `threads` threads: the
/// output's values and the gradient of their sum with respect to `x`.
fn run(prob: f64, seed: u64, threads: usize) -> (Vec<f32>, Vec<f32>) {
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    in_pool(threads, || {
        let device = Device::flex().autodiff();
        device.seed(seed);
        let x = Tensor::<1>::from_data(TensorData::new(vec![1.0f32; LEN], [LEN]), &device)
            .require_grad();
        let y = ops::dropout(x.clone(), &DropoutConfig::new(prob).init());
        let grads = y.clone().sum().backward();
        let grad = x
            .grad(&grads)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        (y.into_data().try_to_vec::<f32>().unwrap(), grad)
    })
}

/// Fraction of nonzero values in `v`.
fn kept(v: impl Iterator<Item = f32>) -> f64 {
    let (mut n, mut k) = (0usize, 0usize);
    for x in v {
        n += 1;
        k += usize::from(x != 0.0);
    }
    k as f64 / n as f64
}

#[test]
fn mask_is_scaled_bernoulli_and_its_own_gradient() {
    for prob in [0.25, 0.5, 0.9] {
        let keep = 1.0 - prob;
        let scale = (1.0 / keep) as f32;
        let (y, grad) = run(prob, 7, 2);
        assert_eq!(y.len(), LEN);
        assert!(
            y.iter().all(|v| *v == 0.0 || *v == scale),
            "p={prob}: a value other than 0 and 1/(1-p)"
        );
        assert_eq!(grad, y, "p={prob}: the gradient is not the mask");
        // Kept fraction: within 5 standard deviations of 1 - p, overall and on the elements
        // decided by each half of the 64-bit draws (even and odd positions).
        for (what, fraction, n) in [
            ("all", kept(y.iter().copied()), LEN),
            ("even", kept(y.iter().copied().step_by(2)), LEN.div_ceil(2)),
            ("odd", kept(y.iter().copied().skip(1).step_by(2)), LEN / 2),
        ] {
            let sd = (keep * prob / n as f64).sqrt();
            assert!(
                (fraction - keep).abs() < 5.0 * sd,
                "p={prob}, {what}: kept {fraction}, expected {keep} ± {sd}"
            );
        }
        // Neighbours are independent: P(both kept) ≈ keep².
        let both = kept(y.windows(2).map(|w| w[0] * w[1]));
        let sd = (keep * keep * (1.0 - keep * keep) / LEN as f64).sqrt();
        assert!(
            (both - keep * keep).abs() < 6.0 * sd,
            "p={prob}: neighbours both kept {both}, expected {}",
            keep * keep
        );
    }
}

#[test]
fn same_seed_same_mask_at_any_thread_count_other_seed_other_mask() {
    let (one, _) = run(0.25, 11, 1);
    let (three, _) = run(0.25, 11, 3);
    assert_eq!(one, three, "the mask depends on the thread count");
    let (again, _) = run(0.25, 11, 2);
    assert_eq!(one, again, "the same seed gave another mask");
    let (other, _) = run(0.25, 12, 2);
    assert_ne!(one, other, "another seed gave the same mask");
    // Successive masks after one seeding differ too.
    let _guard = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::flex().autodiff();
    device.seed(11);
    let x = Tensor::<1>::ones([LEN], &device);
    let d: Dropout = DropoutConfig::new(0.25).init();
    let first = ops::dropout(x.clone(), &d).into_data();
    let second = ops::dropout(x, &d).into_data();
    assert_ne!(first, second, "two draws gave the same mask");
}

#[test]
fn identity_without_autodiff_or_probability_and_zero_at_one() {
    let device = Device::flex().autodiff();
    let values: Vec<f32> = (0..101).map(|i| i as f32 - 50.0).collect();
    let inner = Tensor::<1>::from_data(TensorData::new(values.clone(), [101]), &Device::flex());
    let out = ops::dropout(inner, &DropoutConfig::new(0.5).init());
    assert_eq!(out.into_data().try_to_vec::<f32>().unwrap(), values);
    let x = Tensor::<1>::from_data(TensorData::new(values.clone(), [101]), &device);
    let out = ops::dropout(x.clone(), &DropoutConfig::new(0.0).init());
    assert_eq!(out.into_data().try_to_vec::<f32>().unwrap(), values);
    // burn 0.22's DropoutConfig refuses 1.0; a layer built by hand can still hold it.
    let all = Dropout {
        prob: 1.0,
        training: Param::from_bool(true),
    };
    let out = ops::dropout(x.clone(), &all);
    assert!(out
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|v| *v == 0.0));
    // A layer out of training mode (burn 0.22's flag, set by `valid()`) is the identity.
    let off = Dropout {
        prob: 0.5,
        training: Param::from_bool(false),
    };
    let out = ops::dropout(x, &off);
    assert_eq!(out.into_data().try_to_vec::<f32>().unwrap(), values);
}
