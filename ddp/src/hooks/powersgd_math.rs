//! The dense arithmetic of PowerSGD (`powersgd.rs`): the three products of one power
//! iteration, Gram-Schmidt orthogonalisation, and the seeded normal numbers Q starts from.
//!
//! Matrices are row-major `f32` slices. Every routine sums in one fixed order that depends only
//! on the shapes, so that all ranks, running the same binary on the same all-reduced inputs,
//! produce the same bits: the replicas stay identical without another collective. Sums that
//! are reductions (a dot product, a norm) run over 16 independent lanes, which the compiler
//! turns into vector instructions (a strictly sequential sum cannot be vectorised without
//! reordering), and are then added in a fixed pairwise order.

/// Lanes of the vectorised dot product.
const LANES: usize = 16;

/// `sum_i a[i] * b[i]`, in 16 lanes added pairwise at the end (a fixed order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

/// `out[j] += s * x[j]`.
fn axpy(out: &mut [f32], s: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o += s * v;
    }
}

/// The columns of `q` (`cols × r`, row-major) as `r` contiguous rows (`r × cols`).
fn transpose(q: &[f32], cols: usize, r: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; r * cols];
    for j in 0..cols {
        for k in 0..r {
            t[k * cols + j] = q[j * r + k];
        }
    }
    t
}

/// `p = m · q`: `m` is `rows × cols`, `q` is `cols × r`, `p` is `rows × r`. PowerSGD's
/// projection of a gradient onto the `r` directions of Q (each entry one dot product of a row
/// of the gradient with a column of Q).
pub(crate) fn project(m: &[f32], rows: usize, cols: usize, q: &[f32], r: usize, p: &mut [f32]) {
    debug_assert_eq!(
        (m.len(), q.len(), p.len()),
        (rows * cols, cols * r, rows * r)
    );
    let qt = transpose(q, cols, r);
    for (i, row) in m.chunks_exact(cols).enumerate() {
        for k in 0..r {
            p[i * r + k] = dot(row, &qt[k * cols..(k + 1) * cols]);
        }
    }
}

/// `q = mᵀ · p`: `m` is `rows × cols`, `p` is `rows × r`, `q` is `cols × r`. PowerSGD's
/// second half of a power iteration. Accumulated row by row of `m` (each row scaled by its
/// entries of `p` and added to the `r` columns of the result), which reads `m` once, in
/// order, and vectorises without reordering any sum.
pub(crate) fn back_project(
    m: &[f32],
    rows: usize,
    cols: usize,
    p: &[f32],
    r: usize,
    q: &mut [f32],
) {
    debug_assert_eq!(
        (m.len(), p.len(), q.len()),
        (rows * cols, rows * r, cols * r)
    );
    let mut qt = vec![0.0f32; r * cols];
    for (i, row) in m.chunks_exact(cols).enumerate() {
        for k in 0..r {
            axpy(&mut qt[k * cols..(k + 1) * cols], p[i * r + k], row);
        }
    }
    for j in 0..cols {
        for k in 0..r {
            q[j * r + k] = qt[k * cols + j];
        }
    }
}

/// `m = p · qᵀ`: `p` is `rows × r`, `q` is `cols × r`, `m` is `rows × cols`: the low-rank
/// approximation written over the gradient. Each row is the sum over `k` (in order) of `q`'s
/// column `k` scaled by `p[i, k]`.
pub(crate) fn expand(p: &[f32], rows: usize, q: &[f32], cols: usize, r: usize, m: &mut [f32]) {
    debug_assert_eq!(
        (m.len(), p.len(), q.len()),
        (rows * cols, rows * r, cols * r)
    );
    let qt = transpose(q, cols, r);
    for (i, row) in m.chunks_exact_mut(cols).enumerate() {
        row.fill(0.0);
        for k in 0..r {
            axpy(row, p[i * r + k], &qt[k * cols..(k + 1) * cols]);
        }
    }
}

/// Orthonormalises the `r` columns of `a` (`rows × r`, row-major) in place by Gram-Schmidt,
/// PyTorch's `_orthogonalize_gram_schmidt`: for each column in order, divide it by its norm
/// (plus `epsilon` when `epsilon > 0`), then subtract its projection from every later column.
///
/// Why Gram-Schmidt and not a library QR (PyTorch uses LAPACK's Householder QR for rank > 2):
/// its order of operations is fixed here, so every rank computes the same bits; its columns
/// span the same spaces as QR's and differ from them at most in sign, which PowerSGD's result
/// `P Pᵀ M` does not see. Norms and projections are summed in `f64` (a sum of squares in `f32`
/// loses digits on long columns).
///
/// With `epsilon == 0`, a column whose norm is exactly zero (a gradient that vanished) becomes
/// zeros: what PyTorch's code means to do in that case ("recover the values from NaNs to 0s"),
/// instead of dividing by zero. A zero column then contributes nothing to the approximation.
pub(crate) fn orthogonalize(a: &mut [f32], rows: usize, r: usize, epsilon: f32) {
    debug_assert_eq!(a.len(), rows * r);
    for i in 0..r {
        let norm = (0..rows)
            .map(|k| f64::from(a[k * r + i]).powi(2))
            .sum::<f64>()
            .sqrt() as f32;
        if epsilon == 0.0 && norm == 0.0 {
            (0..rows).for_each(|k| a[k * r + i] = 0.0);
        } else {
            let div = if epsilon == 0.0 { norm } else { norm + epsilon };
            (0..rows).for_each(|k| a[k * r + i] /= div);
        }
        for j in i + 1..r {
            let proj = (0..rows)
                .map(|k| f64::from(a[k * r + i]) * f64::from(a[k * r + j]))
                .sum::<f64>() as f32;
            (0..rows).for_each(|k| a[k * r + j] -= proj * a[k * r + i]);
        }
    }
}

/// The next number of the SplitMix64 sequence whose state is `state` (Steele, Lea and Flood,
/// 2014): a 64-bit counter advanced by the golden ratio and mixed. Small, fast, the same on
/// every platform, and its state is one `u64` that a checkpoint keeps.
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Fills `out` with standard normal numbers from the SplitMix64 sequence seeded with `seed`:
/// each number takes two draws, `u1 = (d1 >> 11) + 1` and `u2 = d2 >> 11` scaled by 2⁻⁵³ (so
/// `u1` in (0, 1], `u2` in [0, 1)), and is Box and Muller's `sqrt(-2 ln u1) · cos(2π u2)` in
/// `f64`, rounded to `f32`. PowerSGD's initial Q (PyTorch draws it with `torch.randn` after
/// seeding from its state's generator); the same seed gives the same numbers on every rank.
pub(crate) fn fill_normal(seed: u64, out: &mut [f32]) {
    let mut state = seed;
    let scale = 1.0 / (1u64 << 53) as f64;
    for x in out {
        let u1 = ((splitmix64(&mut state) >> 11) + 1) as f64 * scale;
        let u2 = (splitmix64(&mut state) >> 11) as f64 * scale;
        *x = ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `a` (`rows × cols`) times `b` (`cols × r`) in `f64`, the textbook triple loop.
    fn naive(a: &[f32], rows: usize, cols: usize, b: &[f32], r: usize) -> Vec<f64> {
        let mut out = vec![0.0; rows * r];
        for i in 0..rows {
            for k in 0..r {
                out[i * r + k] = (0..cols)
                    .map(|j| f64::from(a[i * cols + j]) * f64::from(b[j * r + k]))
                    .sum();
            }
        }
        out
    }

    fn numbers(seed: u64, n: usize) -> Vec<f32> {
        let mut v = vec![0.0; n];
        fill_normal(seed, &mut v);
        v
    }

    fn close(got: &[f32], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
                "entry {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn products_match_the_textbook_ones() {
        // 37 columns: two full chunks of 16 lanes and a remainder.
        let (rows, cols, r) = (5, 37, 3);
        let m = numbers(1, rows * cols);
        let q = numbers(2, cols * r);
        let mut p = vec![0.0; rows * r];
        project(&m, rows, cols, &q, r, &mut p);
        close(&p, &naive(&m, rows, cols, &q, r), 1e-5);

        // mᵀ p: the transpose of m as a cols × rows matrix.
        let mt: Vec<f32> = (0..cols)
            .flat_map(|j| (0..rows).map(move |i| (i, j)))
            .map(|(i, j)| m[i * cols + j])
            .collect();
        let mut back = vec![0.0; cols * r];
        back_project(&m, rows, cols, &p, r, &mut back);
        close(&back, &naive(&mt, cols, rows, &p, r), 1e-5);

        // p qᵀ: q's transpose as r × cols.
        let qt = transpose(&q, cols, r);
        let mut full = vec![0.0; rows * cols];
        expand(&p, rows, &q, cols, r, &mut full);
        close(&full, &naive(&p, rows, r, &qt, cols), 1e-5);
    }

    #[test]
    fn orthogonalized_columns_are_orthonormal_and_span_the_same_space() {
        let (rows, r) = (50, 4);
        let a = numbers(3, rows * r);
        let mut q = a.clone();
        orthogonalize(&mut q, rows, r, 0.0);
        for i in 0..r {
            for j in 0..r {
                let d: f64 = (0..rows)
                    .map(|k| f64::from(q[k * r + i]) * f64::from(q[k * r + j]))
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "columns {i}, {j}: {d}");
            }
        }
        // Gram-Schmidt keeps the span of the first i columns: column i of `a` has no part
        // outside the first i + 1 orthonormal columns, and column 0 keeps its direction.
        for i in 0..r {
            let mut rest: Vec<f64> = (0..rows).map(|k| f64::from(a[k * r + i])).collect();
            for c in 0..=i {
                let coef: f64 = (0..rows).map(|k| rest[k] * f64::from(q[k * r + c])).sum();
                (0..rows).for_each(|k| rest[k] -= coef * f64::from(q[k * r + c]));
            }
            let left: f64 = rest.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!(left < 1e-4, "column {i} leaves the span by {left}");
        }
        assert!(q[0] * a[0] > 0.0, "the first column keeps its sign");
    }

    #[test]
    fn a_zero_column_becomes_zeros_without_epsilon_and_stays_finite_with_it() {
        let (rows, r) = (6, 2);
        let mut a = vec![0.0f32; rows * r];
        orthogonalize(&mut a, rows, r, 0.0);
        assert!(a.iter().all(|&x| x == 0.0), "{a:?}");
        // A column parallel to the first one vanishes after the projection.
        let mut b: Vec<f32> = (0..rows)
            .flat_map(|k| [k as f32 + 1.0, 2.0 * (k as f32 + 1.0)])
            .collect();
        orthogonalize(&mut b, rows, r, 1e-8);
        assert!(b.iter().all(|x| x.is_finite()), "{b:?}");
        let norm0: f32 = (0..rows).map(|k| b[k * r] * b[k * r]).sum::<f32>().sqrt();
        assert!((norm0 - 1.0).abs() < 1e-5);
    }

    #[test]
    fn normal_numbers_are_seeded_and_standard() {
        assert_eq!(numbers(7, 100), numbers(7, 100));
        assert_ne!(numbers(7, 100), numbers(8, 100));
        let v = numbers(9, 100_000);
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / v.len() as f64;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }

    #[test]
    fn splitmix64_is_the_published_sequence() {
        // The first outputs for state 0 (Vigna's reference implementation, splitmix64.c).
        let mut s = 0;
        assert_eq!(splitmix64(&mut s), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(&mut s), 0x6E78_9E6A_A1B9_65F4);
    }
}
