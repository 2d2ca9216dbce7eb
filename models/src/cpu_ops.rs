//! [`FastOps`] kernels for burn's CPU backend (`Flex`), `f32`, NCHW.
//!
//! burn-flex computes a convolution's gradients through generic fallbacks (a transposed
//! convolution for the input gradient, permuted copies for the weight gradient) that spend
//! most of their time in strided index iteration and copies rather than in its gemm. The
//! kernels here keep every operand contiguous and put the arithmetic into one gemm per image
//! (the `gemm` crate, the one burn-flex uses for its matmul), with an im2col buffer that is
//! allocated once per thread and reused.
//!
//! Work is spread over rayon's global pool one image (or one image plane) at a time, so
//! `--threads` sizes it. Every reduction over images (the weight and bias gradients) sums
//! fixed partial results in a fixed order, so a given thread count gives bit-identical
//! results run after run.
//!
//! Anything else (other dtypes, groups) goes to burn's own ops.

use std::cell::RefCell;

use burn::backend::flex::FlexTensor;
use burn::backend::ops::{ConvOptions, FloatTensorOps, IntTensorOps, ModuleOps};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Distribution, FloatDType, IntDType, Shape, TensorData};
use rayon::prelude::*;

use crate::ops::FastOps;

thread_local! {
    /// This thread's im2col / column-gradient buffer, grown to the largest image seen.
    static COLUMNS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's column buffer, at least `len` long (contents unspecified).
fn with_columns<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    COLUMNS.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        f(&mut buf[..len])
    })
}

/// The contiguous `f32` elements of `t` (copied into a contiguous tensor first if it is a
/// strided view).
fn contiguous(t: FlexTensor) -> FlexTensor {
    if t.is_contiguous() {
        t
    } else {
        t.to_contiguous()
    }
}

/// The elements of a contiguous `f32` tensor, in row-major order.
fn values(t: &FlexTensor) -> &[f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("values: the tensor was made contiguous");
    &t.storage::<f32>()[start..end]
}

/// A new `f32` tensor of `shape` owning `data`.
fn tensor(data: Vec<f32>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape.to_vec()))
}

/// Geometry of one convolution: input `[c, h, w]` per image, kernel `[kh, kw]`, output
/// `[oh, ow]` per output channel.
#[derive(Clone, Copy, Debug)]
struct ConvGeom {
    c: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    ph: usize,
    pw: usize,
    dh: usize,
    dw: usize,
    oh: usize,
    ow: usize,
}

impl ConvGeom {
    /// The geometry of `x` `[n, c, h, w]` convolved with `weight` `[co, c, kh, kw]`.
    fn new(x: &[usize], weight: &[usize], options: &ConvOptions<2>) -> Self {
        let [sh, sw] = options.stride;
        // Symmetric padding only (the caller checked): the begin of each (begin, end) pair.
        let [(ph, _), (pw, _)] = options.padding;
        let [dh, dw] = options.dilation;
        let (h, w, kh, kw) = (x[2], x[3], weight[2], weight[3]);
        let out = |size: usize, k: usize, s: usize, p: usize, d: usize| {
            (size + 2 * p - d * (k - 1) - 1) / s + 1
        };
        Self {
            c: x[1],
            h,
            w,
            kh,
            kw,
            sh,
            sw,
            ph,
            pw,
            dh,
            dw,
            oh: out(h, kh, sh, ph, dh),
            ow: out(w, kw, sw, pw, dw),
        }
    }

    /// Rows of the column matrix: `c * kh * kw`, the weight's inner size.
    fn k(&self) -> usize {
        self.c * self.kh * self.kw
    }

    /// Columns of the column matrix: output pixels per channel.
    fn p(&self) -> usize {
        self.oh * self.ow
    }

    /// Whether the column matrix is the image itself (1x1 kernel, stride 1, no padding).
    fn identity_columns(&self) -> bool {
        self.kh == 1 && self.kw == 1 && self.sh == 1 && self.sw == 1 && self.ph == 0 && self.pw == 0
    }

    /// For kernel column offset `j`: the output columns `lo..hi` whose input column
    /// `ox * sw + j * dw - pw` lies inside the image.
    fn valid_columns(&self, j: usize) -> (usize, usize) {
        let off = (j * self.dw) as isize - self.pw as isize;
        let lo = if off < 0 {
            ((-off) as usize).div_ceil(self.sw)
        } else {
            0
        };
        let last = self.w as isize - 1 - off;
        let hi = if last < 0 {
            0
        } else {
            (last as usize / self.sw + 1).min(self.ow)
        };
        (lo.min(hi), hi)
    }
}

/// im2col: lays one image `x` `[c, h, w]` out as the column matrix `cols` `[c*kh*kw, oh*ow]`.
///
/// Row `(ci*kh + i)*kw + j` holds, for every output pixel `(oy, ox)`, the input pixel that
/// kernel tap `(i, j)` of channel `ci` sees there (zero in the padding). The weight
/// `[co, c, kh, kw]` read as `[co, c*kh*kw]` times this matrix is the convolution. Each row
/// is written one output row at a time as a copy of an input row segment (a plain
/// `copy_from_slice` for stride 1), with the padded ends zero-filled.
fn im2col(x: &[f32], g: &ConvGeom, cols: &mut [f32]) {
    let p = g.p();
    let mut rows = cols.chunks_exact_mut(p);
    for ci in 0..g.c {
        let plane = &x[ci * g.h * g.w..(ci + 1) * g.h * g.w];
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = rows.next().expect("im2col: cols has k rows");
                let (lo, hi) = g.valid_columns(j);
                let off = (j * g.dw) as isize - g.pw as isize;
                for (oy, dst) in row.chunks_exact_mut(g.ow).enumerate() {
                    let iy = (oy * g.sh + i * g.dh) as isize - g.ph as isize;
                    if iy < 0 || iy >= g.h as isize || lo >= hi {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &plane[iy as usize * g.w..(iy as usize + 1) * g.w];
                    dst[..lo].fill(0.0);
                    dst[hi..].fill(0.0);
                    let first = (lo * g.sw) as isize + off;
                    if g.sw == 1 {
                        let first = first as usize;
                        dst[lo..hi].copy_from_slice(&src[first..first + (hi - lo)]);
                    } else {
                        for (k, d) in dst[lo..hi].iter_mut().enumerate() {
                            *d = src[first as usize + k * g.sw];
                        }
                    }
                }
            }
        }
    }
}

/// col2im: the adjoint of [`im2col`]. Adds every entry of the column-gradient matrix `cols`
/// `[c*kh*kw, oh*ow]` into the input pixel it was read from, giving the image gradient `dx`
/// `[c, h, w]` (which must be zero on entry). Padding entries are dropped. Taps that read the
/// same pixel are summed in a fixed order (row by row), so the result is deterministic.
fn col2im(cols: &[f32], g: &ConvGeom, dx: &mut [f32]) {
    let p = g.p();
    let mut rows = cols.chunks_exact(p);
    for ci in 0..g.c {
        let plane = &mut dx[ci * g.h * g.w..(ci + 1) * g.h * g.w];
        for i in 0..g.kh {
            for j in 0..g.kw {
                let row = rows.next().expect("col2im: cols has k rows");
                let (lo, hi) = g.valid_columns(j);
                if lo >= hi {
                    continue;
                }
                let off = (j * g.dw) as isize - g.pw as isize;
                for (oy, src) in row.chunks_exact(g.ow).enumerate() {
                    let iy = (oy * g.sh + i * g.dh) as isize - g.ph as isize;
                    if iy < 0 || iy >= g.h as isize {
                        continue;
                    }
                    let dst = &mut plane[iy as usize * g.w..(iy as usize + 1) * g.w];
                    let first = ((lo * g.sw) as isize + off) as usize;
                    if g.sw == 1 {
                        for (d, s) in dst[first..first + (hi - lo)].iter_mut().zip(&src[lo..hi]) {
                            *d += *s;
                        }
                    } else {
                        for (k, s) in src[lo..hi].iter().enumerate() {
                            dst[first + k * g.sw] += *s;
                        }
                    }
                }
            }
        }
    }
}

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]` on row-major or transposed views, through the
/// `gemm` crate on this thread. Each operand is given by its pointer and its row and column
/// strides (in elements); `accumulate` adds to `dst` instead of overwriting it.
///
/// # Safety
///
/// Every `(row, column)` of every operand, at its strides, must lie inside its allocation,
/// and `dst` must not overlap `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_strides: (isize, isize),
    accumulate: bool,
    lhs: *const f32,
    lhs_strides: (isize, isize),
    rhs: *const f32,
    rhs_strides: (isize, isize),
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_strides.1,
            dst_strides.0,
            accumulate,
            lhs,
            lhs_strides.1,
            lhs_strides.0,
            rhs,
            rhs_strides.1,
            rhs_strides.0,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Convolution forward, `y[b] = W · im2col(x[b]) + bias` for every image `b`.
///
/// `W` is the weight read as `[co, c*kh*kw]`. Each image is one gemm
/// (`[co, k] · [k, oh*ow]`) writing straight into its slice of the NCHW output, which is
/// pre-filled with the bias; images run in parallel, each on its thread's column buffer.
fn conv2d_forward(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    co: usize,
    g: &ConvGeom,
) -> Vec<f32> {
    let (k, p) = (g.k(), g.p());
    let image = g.c * g.h * g.w;
    let mut out = vec![0.0f32; n * co * p];
    out.par_chunks_mut(co * p)
        .zip(x.par_chunks(image))
        .for_each(|(yb, xb)| {
            if let Some(bias) = bias {
                for (row, b) in yb.chunks_exact_mut(p).zip(bias) {
                    row.fill(*b);
                }
            }
            let mut run = |cols: &[f32]| {
                // SAFETY: yb is [co, p], weight [co, k], cols [k, p], all row-major, disjoint.
                unsafe {
                    gemm_f32(
                        co,
                        p,
                        k,
                        yb.as_mut_ptr(),
                        (p as isize, 1),
                        bias.is_some(),
                        weight.as_ptr(),
                        (k as isize, 1),
                        cols.as_ptr(),
                        (p as isize, 1),
                    )
                }
            };
            if g.identity_columns() {
                run(xb);
            } else {
                with_columns(k * p, |cols| {
                    im2col(xb, g, cols);
                    run(cols);
                });
            }
        });
    out
}

/// Splits `0..n` into at most `parts` contiguous ranges of near-equal length.
fn ranges(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts)
        .map(|i| (i * n / parts)..((i + 1) * n / parts))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Convolution weight gradient, `dW = Σ_b dy[b] · im2col(x[b])ᵀ` (`[co, p] · [p, k]`).
///
/// The batch is cut into one contiguous range of images per thread; each range accumulates
/// its own partial `dW` with one gemm per image (the column matrix read transposed through its
/// strides, no copy), and the partials are added in range order.
fn conv2d_weight_grad(x: &[f32], dy: &[f32], n: usize, co: usize, g: &ConvGeom) -> Vec<f32> {
    let (k, p) = (g.k(), g.p());
    let image = g.c * g.h * g.w;
    let partials: Vec<Vec<f32>> = ranges(n, rayon::current_num_threads())
        .into_par_iter()
        .map(|range| {
            let mut dw = vec![0.0f32; co * k];
            for b in range {
                let xb = &x[b * image..(b + 1) * image];
                let dyb = &dy[b * co * p..(b + 1) * co * p];
                let run = |cols: &[f32], dw: &mut [f32]| {
                    // SAFETY: dw is [co, k]; dyb [co, p]; cols [k, p] read as [p, k]
                    // through strides (1, p); all in bounds, dw disjoint from both.
                    unsafe {
                        gemm_f32(
                            co,
                            k,
                            p,
                            dw.as_mut_ptr(),
                            (k as isize, 1),
                            true,
                            dyb.as_ptr(),
                            (p as isize, 1),
                            cols.as_ptr(),
                            (1, p as isize),
                        )
                    }
                };
                if g.identity_columns() {
                    run(xb, &mut dw);
                } else {
                    with_columns(k * p, |cols| {
                        im2col(xb, g, cols);
                        run(cols, &mut dw);
                    });
                }
            }
            dw
        })
        .collect();
    let mut parts = partials.into_iter();
    let mut dw = parts.next().unwrap_or_else(|| vec![0.0; co * k]);
    for part in parts {
        for (a, b) in dw.iter_mut().zip(&part) {
            *a += *b;
        }
    }
    dw
}

/// Convolution input gradient, `dx[b] = col2im(Wᵀ · dy[b])` (`[k, co] · [co, p]`).
///
/// One gemm per image into the thread's column buffer (the weight read transposed through its
/// strides), then [`col2im`] scatters the columns back onto the zeroed image gradient. No
/// transposed convolution, no flipped kernel copy.
fn conv2d_input_grad(weight: &[f32], dy: &[f32], n: usize, co: usize, g: &ConvGeom) -> Vec<f32> {
    let (k, p) = (g.k(), g.p());
    let image = g.c * g.h * g.w;
    let mut dx = vec![0.0f32; n * image];
    dx.par_chunks_mut(image)
        .zip(dy.par_chunks(co * p))
        .for_each(|(dxb, dyb)| {
            let run = |dst: &mut [f32]| {
                // SAFETY: dst is [k, p]; weight [co, k] read as [k, co] through strides
                // (1, k); dyb [co, p]; all in bounds, dst disjoint from both.
                unsafe {
                    gemm_f32(
                        k,
                        p,
                        co,
                        dst.as_mut_ptr(),
                        (p as isize, 1),
                        false,
                        weight.as_ptr(),
                        (1, k as isize),
                        dyb.as_ptr(),
                        (p as isize, 1),
                    )
                }
            };
            if g.identity_columns() {
                run(dxb);
            } else {
                with_columns(k * p, |cols| {
                    run(cols);
                    col2im(cols, g, dxb);
                });
            }
        });
    dx
}

/// The sum of `v` in a fixed order that vectorises: eight running sums over the 8-element
/// chunks (one SIMD register), added together at the end with the tail.
fn sum_f32(v: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (acc, x) in lanes.iter_mut().zip(chunk) {
            *acc += *x;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Convolution bias gradient: the sum of `dy` `[n, co, p]` over images and pixels, per
/// channel, in a fixed order.
fn conv2d_bias_grad(dy: &[f32], n: usize, co: usize, p: usize) -> Vec<f32> {
    let mut db = vec![0.0f32; co];
    for b in 0..n {
        for (c, acc) in db.iter_mut().enumerate() {
            let start = (b * co + c) * p;
            *acc += sum_f32(&dy[start..start + p]);
        }
    }
    db
}

/// Elements per parallel task of [`dropout_mask`] (an even number).
const MASK_CHUNK: usize = 16 * 1024;

/// A dropout mask of `len` elements: each `scale` with probability `keep`, else 0.
///
/// burn samples a Bernoulli tensor through its generic distribution code (a ChaCha generator
/// drawing one `f64` per element, then a comparison and a multiplication by the scale), which
/// costs about as much as a convolution layer. Here the draws are counter-based instead:
/// element pair `j` takes the 64 bits of splitmix64's finaliser applied to
/// `seed + (j + 1) · γ` (γ the golden-ratio increment, as in splitmix64 itself), the low 32
/// bits deciding element `2j` and the high 32 bits element `2j + 1` (kept when below
/// `keep · 2³²`). splitmix64's outputs pass BigCrush, which is more than a dropout mask needs.
/// Since every element's draw depends only on the seed and its position, chunks fill in
/// parallel and the mask is the same at every thread count.
fn dropout_mask(len: usize, keep: f64, scale: f32, seed: u64) -> Vec<f32> {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
    let threshold = (keep * 4_294_967_296.0) as u64;
    let mut mask = vec![0.0f32; len];
    mask.par_chunks_mut(MASK_CHUNK)
        .enumerate()
        .for_each(|(chunk, out)| {
            let first_pair = (chunk * MASK_CHUNK / 2) as u64;
            for (j, pair) in out.chunks_mut(2).enumerate() {
                let mut z = seed.wrapping_add((first_pair + j as u64 + 1).wrapping_mul(GAMMA));
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                for (k, m) in pair.iter_mut().enumerate() {
                    let draw = (z >> (32 * k)) & 0xFFFF_FFFF;
                    *m = if draw < threshold { scale } else { 0.0 };
                }
            }
        });
    mask
}

/// Max-pool forward on one plane `[h, w]`: each output pixel is the largest input in its
/// window (padding excluded), with its flat index `y * w + x`; the first of equal maxima wins,
/// as in burn's kernel, so gradients go where burn's would.
fn max_pool_plane(x: &[f32], g: &PoolGeom, out: &mut [f32], idx: &mut [i64]) {
    for oy in 0..g.oh {
        for ox in 0..g.ow {
            let mut best = f32::NEG_INFINITY;
            let mut best_idx: i64 = -1;
            for i in 0..g.kh {
                let iy = (oy * g.sh + i * g.dh) as isize - g.ph as isize;
                if iy < 0 || iy >= g.h as isize {
                    continue;
                }
                for j in 0..g.kw {
                    let ix = (ox * g.sw + j * g.dw) as isize - g.pw as isize;
                    if ix < 0 || ix >= g.w as isize {
                        continue;
                    }
                    let at = iy as usize * g.w + ix as usize;
                    let v = x[at];
                    if best_idx < 0 || v > best {
                        best = v;
                        best_idx = at as i64;
                    }
                }
            }
            out[oy * g.ow + ox] = best;
            idx[oy * g.ow + ox] = best_idx;
        }
    }
}

/// Geometry of one max-pool over planes `[h, w]`.
#[derive(Clone, Copy, Debug)]
struct PoolGeom {
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    sh: usize,
    sw: usize,
    ph: usize,
    pw: usize,
    dh: usize,
    dw: usize,
    oh: usize,
    ow: usize,
}

impl PoolGeom {
    fn new(
        h: usize,
        w: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Option<Self> {
        let out = |size: usize, k: usize, s: usize, p: usize, d: usize| {
            let span = d * (k - 1) + 1;
            (size + 2 * p >= span).then(|| (size + 2 * p - span) / s + 1)
        };
        Some(Self {
            h,
            w,
            kh: kernel[0],
            kw: kernel[1],
            sh: stride[0],
            sw: stride[1],
            ph: padding[0],
            pw: padding[1],
            dh: dilation[0],
            dw: dilation[1],
            oh: out(h, kernel[0], stride[0], padding[0], dilation[0])?,
            ow: out(w, kernel[1], stride[1], padding[1], dilation[1])?,
        })
    }
}

/// Whether the kernels take this convolution: one group, symmetric padding.
fn plain(options: &ConvOptions<2>) -> bool {
    options.groups == 1 && options.padding.iter().all(|(begin, end)| begin == end)
}

/// Whether the fast kernels take these tensors: `f32`, rank 4.
fn f32_4d(tensors: &[&FlexTensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.shape().num_dims() == 4)
}

/// The forward convolution of [`FastOps::fast_conv2d`] and
/// [`FastOps::fast_conv2d_with_bias`] on flex: `conv2d_forward`, or burn's own where the kernels
/// do not apply.
fn conv2d(
    x: FlexTensor,
    weight: FlexTensor,
    bias: Option<FlexTensor>,
    options: ConvOptions<2>,
) -> FlexTensor {
    if !plain(&options)
        || !f32_4d(&[&x, &weight])
        || bias.as_ref().is_some_and(|b| b.dtype() != DType::F32)
    {
        return <Flex as ModuleOps<Flex>>::conv2d(x, weight, bias, options);
    }
    let (xs, ws) = (x.shape().to_vec(), weight.shape().to_vec());
    let g = ConvGeom::new(&xs, &ws, &options);
    let (x, weight) = (contiguous(x), contiguous(weight));
    let bias = bias.map(contiguous);
    let out = conv2d_forward(
        values(&x),
        values(&weight),
        bias.as_ref().map(values),
        xs[0],
        ws[0],
        &g,
    );
    tensor(out, &[xs[0], ws[0], g.oh, g.ow])
}

impl FastOps for Flex {
    fn fast_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        conv2d(x, weight, None, options)
    }

    fn fast_conv2d_with_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        conv2d(x, weight, Some(bias), options)
    }

    fn fast_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        if !plain(&options) || !f32_4d(&[&x, &weight, &output_grad]) {
            return <Flex as ModuleOps<Flex>>::conv2d_x_backward(x, weight, output_grad, options);
        }
        let (xs, ws) = (x.shape().to_vec(), weight.shape().to_vec());
        let g = ConvGeom::new(&xs, &ws, &options);
        let (weight, dy) = (contiguous(weight), contiguous(output_grad));
        let dx = conv2d_input_grad(values(&weight), values(&dy), xs[0], ws[0], &g);
        tensor(dx, &xs)
    }

    fn fast_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        if !plain(&options) || !f32_4d(&[&x, &weight, &output_grad]) {
            return <Flex as ModuleOps<Flex>>::conv2d_weight_backward(
                x,
                weight,
                output_grad,
                options,
            );
        }
        let (xs, ws) = (x.shape().to_vec(), weight.shape().to_vec());
        let g = ConvGeom::new(&xs, &ws, &options);
        let (x, dy) = (contiguous(x), contiguous(output_grad));
        let dw = conv2d_weight_grad(values(&x), values(&dy), xs[0], ws[0], &g);
        tensor(dw, &ws)
    }

    fn fast_conv2d_bias_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !f32_4d(&[&x, &output_grad]) || bias.dtype() != DType::F32 {
            return <Flex as ModuleOps<Flex>>::conv2d_bias_backward(x, bias, output_grad);
        }
        let ds = output_grad.shape().to_vec();
        let dy = contiguous(output_grad);
        let db = conv2d_bias_grad(values(&dy), ds[0], ds[1], ds[2] * ds[3]);
        tensor(db, &[ds[1]])
    }

    fn fast_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        let xs = x.shape().to_vec();
        let geom = f32_4d(&[&x])
            .then(|| PoolGeom::new(xs[2], xs[3], kernel_size, stride, padding, dilation))
            .flatten();
        let Some(g) = geom else {
            let out = <Flex as ModuleOps<Flex>>::max_pool2d_with_indices(
                x,
                kernel_size,
                stride,
                padding,
                dilation,
                false,
                IntDType::I64,
            );
            return (out.output, out.indices);
        };
        let x = contiguous(x);
        let planes = xs[0] * xs[1];
        let (plane_in, plane_out) = (g.h * g.w, g.oh * g.ow);
        let mut out = vec![0.0f32; planes * plane_out];
        let mut idx = vec![0i64; planes * plane_out];
        out.par_chunks_mut(plane_out)
            .zip(idx.par_chunks_mut(plane_out))
            .zip(values(&x).par_chunks(plane_in))
            .for_each(|((o, i), xp)| max_pool_plane(xp, &g, o, i));
        let shape = [xs[0], xs[1], g.oh, g.ow];
        (
            tensor(out, &shape),
            FlexTensor::from_data(TensorData::new(idx, shape.to_vec())),
        )
    }

    fn fast_max_pool2d_backward(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        if !f32_4d(&[&x, &output_grad]) || indices.dtype() != DType::I64 {
            return <Flex as ModuleOps<Flex>>::max_pool2d_with_indices_backward(
                x,
                kernel_size,
                stride,
                padding,
                dilation,
                false,
                output_grad,
                indices,
            )
            .x_grad;
        }
        let xs = x.shape().to_vec();
        let os = output_grad.shape().to_vec();
        let (plane_in, plane_out) = (xs[2] * xs[3], os[2] * os[3]);
        let dy = contiguous(output_grad);
        let indices = contiguous(indices);
        let (start, end) = indices
            .layout()
            .contiguous_offsets()
            .expect("indices made contiguous");
        let idx = &indices.storage::<i64>()[start..end];
        let mut dx = vec![0.0f32; xs[0] * xs[1] * plane_in];
        // Each plane's gradient goes only to its own plane: planes in parallel, each output
        // pixel's gradient added to the input pixel that was its maximum.
        dx.par_chunks_mut(plane_in)
            .zip(values(&dy).par_chunks(plane_out))
            .zip(idx.par_chunks(plane_out))
            .for_each(|((dxp, dyp), ip)| {
                for (g, &i) in dyp.iter().zip(ip) {
                    if i >= 0 {
                        dxp[i as usize] += *g;
                    }
                }
            });
        tensor(dx, &xs)
    }

    /// `dropout_mask` (this file), its seed two 32-bit draws from flex's seeded generator (so
    /// `Device::seed` fixes the mask, as it fixes burn's).
    fn fast_dropout_mask(like: FloatTensor<Self>, prob: f64) -> FloatTensor<Self> {
        let dtype: FloatDType = like.dtype().into();
        let device = like.device();
        let shape = like.shape();
        if dtype != FloatDType::F32 || !(0.0..1.0).contains(&prob) {
            let keep = 1.0 - prob;
            let mask = Flex::float_random(shape, Distribution::Bernoulli(keep), &device, dtype);
            return Flex::float_mul_scalar(mask, burn::tensor::Scalar::from(1.0 / keep));
        }
        let draws = Flex::int_random(
            Shape::new([2]),
            Distribution::Uniform(0.0, 4_294_967_296.0),
            &device,
            IntDType::I64,
        );
        let (start, end) = draws
            .layout()
            .contiguous_offsets()
            .expect("a new tensor is contiguous");
        let words = &draws.storage::<i64>()[start..end];
        let seed = ((words[0] as u64) << 32) ^ (words[1] as u64 & 0xFFFF_FFFF);
        let keep = 1.0 - prob;
        let dims = shape.to_vec();
        let mask = dropout_mask(shape.num_elements(), keep, (1.0 / keep) as f32, seed);
        tensor(mask, &dims)
    }
}
