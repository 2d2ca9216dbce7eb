//! Element types ([`Element`], [`DType`]) and reductions ([`ReduceOp`]).
//!
//! The reduction kernels work on whole slices (`dst[i] = dst[i] op src[i]`) in plain loops that
//! the compiler vectorises; `bf16` and `f16` are widened to `f32` in blocks, reduced, and
//! narrowed back (one rounding per reduction step).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// A reduction of [`crate::ProcessGroup::all_reduce`] and
/// [`crate::ProcessGroup::reduce_scatter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum (integers wrap on overflow).
    Sum,
    /// Sum divided by the world size (integer division, truncating, for integer types).
    Avg,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
}

impl ReduceOp {
    /// The name used in messages: `sum`, `avg`, `min`, `max`.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    /// The operation that accumulates contributions: `Sum` for `Avg` (every algorithm sums,
    /// then divides once by the number of contributions, at the one place that finishes the
    /// result), the operation itself otherwise.
    pub(crate) fn accumulator(self) -> ReduceOp {
        match self {
            ReduceOp::Avg => ReduceOp::Sum,
            op => op,
        }
    }

    pub(crate) fn to_wire(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
        }
    }

    pub(crate) fn from_wire(v: u32) -> Option<ReduceOp> {
        Some(match v {
            1 => ReduceOp::Sum,
            2 => ReduceOp::Avg,
            3 => ReduceOp::Min,
            4 => ReduceOp::Max,
            _ => return None,
        })
    }
}

/// The element type of a buffer; one byte on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`
    F32,
    /// `f64`
    F64,
    /// `half::bf16`
    BF16,
    /// `half::f16`
    F16,
    /// `i32`
    I32,
    /// `i64`
    I64,
    /// `u8`
    U8,
}

impl DType {
    /// The type's name as written in messages (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// The byte that stands for this type on the wire.
    pub fn to_wire(self) -> u8 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
            DType::BF16 => 3,
            DType::F16 => 4,
            DType::I32 => 5,
            DType::I64 => 6,
            DType::U8 => 7,
        }
    }

    /// The type a wire byte stands for, if any.
    pub fn from_wire(b: u8) -> Option<DType> {
        Some(match b {
            1 => DType::F32,
            2 => DType::F64,
            3 => DType::BF16,
            4 => DType::F16,
            5 => DType::I32,
            6 => DType::I64,
            7 => DType::U8,
            _ => return None,
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A type the collectives can carry: `f32`, `f64`, `half::bf16`, `half::f16`, `i32`, `i64`, `u8`.
///
/// Alignment is at most 8 bytes (receive buffers are 8-byte aligned).
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The wire tag of the type.
    const DTYPE: DType;

    /// `dst[i] = dst[i] op src[i]` for every `i`, where `op` is `Sum` (also used for `Avg`),
    /// `Min` or `Max`. The slices have the same length.
    fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[Self]);

    /// Divides every element by `n` (the last step of `Avg`).
    fn divide(buf: &mut [Self], n: usize);
}

macro_rules! float_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                assert_eq!(dst.len(), src.len());
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d += *s;
                        }
                    }
                    ReduceOp::Min => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = if *s < *d { *s } else { *d };
                        }
                    }
                    ReduceOp::Max => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = if *s > *d { *s } else { *d };
                        }
                    }
                }
            }
            fn divide(buf: &mut [Self], n: usize) {
                let n = n as $t;
                for x in buf.iter_mut() {
                    *x /= n;
                }
            }
        }
    };
}

macro_rules! int_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                assert_eq!(dst.len(), src.len());
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = d.wrapping_add(*s);
                        }
                    }
                    ReduceOp::Min => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = (*d).min(*s);
                        }
                    }
                    ReduceOp::Max => {
                        for (d, s) in dst.iter_mut().zip(src) {
                            *d = (*d).max(*s);
                        }
                    }
                }
            }
            fn divide(buf: &mut [Self], n: usize) {
                if n == 0 {
                    return;
                }
                match <$t>::try_from(n) {
                    Ok(d) => {
                        for x in buf.iter_mut() {
                            *x /= d;
                        }
                    }
                    // A world larger than the type's range (u8 beyond 255 ranks).
                    Err(_) => {
                        for x in buf.iter_mut() {
                            *x = (*x as i128 / n as i128) as $t;
                        }
                    }
                }
            }
        }
    };
}

float_element!(f32, DType::F32);
float_element!(f64, DType::F64);
int_element!(i32, DType::I32);
int_element!(i64, DType::I64);
int_element!(u8, DType::U8);

/// Block size of the widen-reduce-narrow loop for 16-bit floats.
const HALF_BLOCK: usize = 1024;

macro_rules! half_element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn reduce_into(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
                assert_eq!(dst.len(), src.len());
                let mut a = [0f32; HALF_BLOCK];
                let mut b = [0f32; HALF_BLOCK];
                for (dc, sc) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
                    let n = dc.len();
                    dc.convert_to_f32_slice(&mut a[..n]);
                    sc.convert_to_f32_slice(&mut b[..n]);
                    f32::reduce_into(op, &mut a[..n], &b[..n]);
                    dc.convert_from_f32_slice(&a[..n]);
                }
            }
            fn divide(buf: &mut [Self], n: usize) {
                let mut a = [0f32; HALF_BLOCK];
                for c in buf.chunks_mut(HALF_BLOCK) {
                    let k = c.len();
                    c.convert_to_f32_slice(&mut a[..k]);
                    f32::divide(&mut a[..k], n);
                    c.convert_from_f32_slice(&a[..k]);
                }
            }
        }
    };
}

half_element!(bf16, DType::BF16);
half_element!(f16, DType::F16);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_wire_round_trip() {
        for d in [
            DType::F32,
            DType::F64,
            DType::BF16,
            DType::F16,
            DType::I32,
            DType::I64,
            DType::U8,
        ] {
            assert_eq!(DType::from_wire(d.to_wire()), Some(d));
        }
        assert_eq!(DType::from_wire(0), None);
        assert_eq!(DType::from_wire(200), None);
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
            assert_eq!(ReduceOp::from_wire(op.to_wire()), Some(op));
        }
    }

    #[test]
    fn kernels() {
        let mut a = vec![1.0f32, 5.0, -2.0];
        f32::reduce_into(ReduceOp::Sum, &mut a, &[1.0, 1.0, 1.0]);
        assert_eq!(a, [2.0, 6.0, -1.0]);
        f32::reduce_into(ReduceOp::Min, &mut a, &[3.0, 3.0, 3.0]);
        assert_eq!(a, [2.0, 3.0, -1.0]);
        f32::reduce_into(ReduceOp::Max, &mut a, &[0.0, 4.0, 0.0]);
        assert_eq!(a, [2.0, 4.0, 0.0]);
        f32::divide(&mut a, 2);
        assert_eq!(a, [1.0, 2.0, 0.0]);

        // Longer than one conversion block; values exact in bf16.
        let mut h: Vec<bf16> = (0..3000)
            .map(|i| bf16::from_f32((i % 100) as f32))
            .collect();
        let ones = vec![bf16::from_f32(1.0); 3000];
        bf16::reduce_into(ReduceOp::Sum, &mut h, &ones);
        assert!(h
            .iter()
            .enumerate()
            .all(|(i, x)| x.to_f32() == (i % 100 + 1) as f32));
        bf16::reduce_into(ReduceOp::Max, &mut h, &vec![bf16::from_f32(50.0); 3000]);
        assert_eq!((h[2].to_f32(), h[2999].to_f32()), (50.0, 100.0));
        let mut g = vec![f16::from_f32(3.0); 5];
        f16::divide(&mut g, 2);
        assert_eq!(g[4].to_f32(), 1.5);

        let mut i = vec![7i64, i64::MAX];
        i64::reduce_into(ReduceOp::Sum, &mut i, &[-9, 1]);
        assert_eq!(i, [-2, i64::MIN]);
        i64::divide(&mut i, 2);
        assert_eq!(i[0], -1);
        let mut big = vec![255u8, 3];
        u8::divide(&mut big, 300);
        assert_eq!(big, [0, 0]);
        let mut u = vec![250u8];
        u8::reduce_into(ReduceOp::Sum, &mut u, &[10]);
        assert_eq!(u, [4]);
        u8::reduce_into(ReduceOp::Max, &mut u, &[9]);
        assert_eq!(u, [9]);
    }
}
