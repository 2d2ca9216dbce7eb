//! Global-norm gradient clipping (PyTorch's `clip_grad_norm_`, and FSDP's over shards), the
//! same bits in DDP and in ZeRO.
//!
//! PyTorch's definition: the total norm is the 2-norm of all the parameters' gradients taken
//! together, `sqrt(Σ g²)`; when it exceeds `max_norm`, every gradient is multiplied by
//! `max_norm / (total + 1e-6)` (the coefficient clamped at 1, so nothing is scaled up).
//!
//! How the sum is taken, and why: DDP holds the whole averaged gradient on every rank, ZeRO
//! only its shard, and a sum of floats depends on its order. So both take it in one order
//! that ZeRO can compute from shards: the squares, exact in `f64` (an `f32` has 24 significant
//! bits, its square 48 of `f64`'s 53), are summed in `f64` one chunk at a time, a chunk being
//! what ZeRO gives one rank of one communication part (`zero/layout.rs`: rank r's chunk
//! `chunk_range(part.len, world, r)` of part j); the chunk sums are then added part by part,
//! and within a part rank by rank. A ZeRO rank sums its own chunks and one small all-gather of
//! the chunk sums (one `f64` per part) gives every rank all of them; a DDP rank sums every
//! rank's chunks itself, from the whole gradient, with no communication. Either way the same
//! numbers are added in the same order: the same total, the same coefficient, the same `f32`
//! product `g * coefficient` for every element, so a ZeRO run with clipping steps as DDP with
//! clipping does, bit for bit. The order depends on the world size and the bucket layout, as
//! any reduction does; the total differs from PyTorch's (which sums per-tensor `f32` norms) by
//! rounding only.

use burn::optim::GradientsParams;
use burn::tensor::Device;
use ddp_comm::chunk_range;

use crate::gradients::buckets::Layout;
use crate::gradients::host_buf::HostBuf;
use crate::params::{put_grad, take_grad, ParamInfo};
use crate::DdpError;

/// `Σ x²` of `values`, in `f64`, in order.
pub(crate) fn sum_of_squares(values: &[f32]) -> f64 {
    values.iter().fold(0.0f64, |sum, &x| {
        let x = x as f64;
        sum + x * x
    })
}

/// The total norm from the chunk sums `sums(part, rank)` (added part by part, rank by rank),
/// and the factor every gradient is multiplied by: `None` when the norm is within `max_norm`
/// (PyTorch multiplies by the clamped coefficient 1, which changes nothing).
pub(crate) fn norm_and_factor(
    parts: usize,
    world: usize,
    sums: impl Fn(usize, usize) -> f64,
    max_norm: f32,
) -> (f64, Option<f32>) {
    let mut total = 0.0f64;
    for part in 0..parts {
        for rank in 0..world {
            total += sums(part, rank);
        }
    }
    let norm = total.sqrt();
    let coefficient = max_norm as f64 / (norm + 1e-6);
    (norm, (coefficient < 1.0).then_some(coefficient as f32))
}

/// Clips the averaged gradients `grads` of DDP (the same on every rank) to `max_norm`, in the
/// order described in the module documentation for `world` ranks and `layout`, and returns the
/// total norm before clipping. The gradients are read on the host (burn's memory taken
/// without a copy on the CPU backend; a copy from a GPU) and put back on `device`.
pub(crate) fn clip_replicated(
    grads: &mut GradientsParams,
    params: &[ParamInfo],
    layout: &Layout,
    world: usize,
    device: &Device,
    max_norm: f32,
) -> Result<f32, DdpError> {
    let mut values: Vec<Option<HostBuf>> = Vec::with_capacity(params.len());
    for info in params {
        values.push(take_grad(grads, info)?);
    }
    // One chunk's sum: its pieces (a parameter's elements inside the chunk) in part order;
    // padding and parameters without a gradient are zeros, which add nothing.
    let chunk_sum = |part: usize, rank: usize| {
        let part = &layout.parts[part];
        let range = chunk_range(part.len, world, rank);
        let mut sum = 0.0f64;
        for (&p, &off) in part.params.iter().zip(&part.offsets) {
            let Some(g) = values[p].as_ref() else {
                continue;
            };
            let (lo, hi) = (range.start.max(off), range.end.min(off + g.as_ref().len()));
            if lo < hi {
                sum += sum_of_squares(&g.as_ref()[lo - off..hi - off]);
            }
        }
        sum
    };
    let (norm, factor) = norm_and_factor(layout.parts.len(), world, chunk_sum, max_norm);
    for (info, g) in params.iter().zip(values) {
        if let Some(mut g) = g {
            if let Some(factor) = factor {
                g.as_mut().iter_mut().for_each(|x| *x *= factor);
            }
            put_grad(grads, info, g, device);
        }
    }
    Ok(norm as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_the_limit_nothing_is_scaled_and_above_it_the_norm_becomes_the_limit() {
        // 3-4-5: one part, two ranks' chunks holding 9 and 16.
        let sums = |_, rank| if rank == 0 { 9.0 } else { 16.0 };
        let (norm, factor) = norm_and_factor(1, 2, sums, 6.0);
        assert_eq!(norm, 5.0);
        assert_eq!(factor, None, "6 / (5 + 1e-6) > 1: clamped at 1");
        // At the limit itself PyTorch still multiplies, by 5 / (5 + 1e-6).
        let (_, factor) = norm_and_factor(1, 2, sums, 5.0);
        assert_eq!(factor, Some((5.0 / (5.0 + 1e-6)) as f32));
        let (norm, factor) = norm_and_factor(1, 2, sums, 1.0);
        assert_eq!(norm, 5.0);
        let factor = factor.unwrap();
        assert!(
            (factor as f64 - 1.0 / (5.0 + 1e-6)).abs() < 1e-7,
            "{factor}"
        );
    }

    #[test]
    fn squares_are_summed_exactly_for_small_sets() {
        // 2^-12 squared is 2^-24: f32 would lose it next to 1, f64 keeps it.
        let tiny = 2f32.powi(-12);
        assert_eq!(sum_of_squares(&[1.0, tiny]), 1.0 + 2f64.powi(-24));
        assert_eq!(sum_of_squares(&[]), 0.0);
    }
}
