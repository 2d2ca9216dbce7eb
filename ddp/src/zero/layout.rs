//! ZeRO's shard layout (`sharded.rs`): which elements of the trainable parameters each rank
//! steps, derived from the bucket layout every mode shares (`buckets.rs`).
//!
//! Rank r owns chunk `chunk_range(len, N, r)` of every part (a part is one collective: one
//! large gradient, or several small ones side by side), exactly the chunk the part's
//! reduce-scatter leaves summed on it, and the chunk it hands to the part's all-gather. A
//! rank's shard is its chunks of all parts, in communication order: about P / N elements,
//! never more than P / N + (number of parts). A chunk is cut at parameter boundaries into
//! pieces, the unit of the optimizer's update. The layout depends only on the parameter list,
//! the bucket sizes and the world size, so it is the same on every rank and in every run.

use std::ops::Range;

use ddp_comm::chunk_range;

use crate::gradients::buckets::Layout;
use crate::params::ParamInfo;

/// One rank's chunk of one part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// The part (an index into the layout's parts).
    pub part: usize,
    /// Its range in the part's buffer.
    pub range: Range<usize>,
    /// Where it starts in the rank's shard.
    pub shard: usize,
    /// Its pieces (a range of the rank's pieces).
    pub pieces: Range<usize>,
}

/// A chunk's elements of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    /// The parameter (visiting index).
    pub param: usize,
    /// Its elements (of the flattened parameter).
    pub range: Range<usize>,
    /// Where they lie in the rank's shard.
    pub shard: usize,
}

/// Every rank's chunks and pieces.
#[derive(Debug, Clone)]
pub(crate) struct ShardLayout {
    /// Per rank: its chunk of every part, in communication order.
    pub chunks: Vec<Vec<Chunk>>,
    /// Per rank: the pieces of its chunks, in shard order.
    pub pieces: Vec<Vec<Piece>>,
    /// Per rank: elements of its shard.
    pub lens: Vec<usize>,
}

impl ShardLayout {
    /// The longest shard of any rank.
    pub fn longest(&self) -> usize {
        self.lens.iter().copied().max().unwrap_or(0)
    }
}

/// The shards of `world` ranks over `layout` (see the module documentation).
pub(crate) fn plan_shards(layout: &Layout, params: &[ParamInfo], world: usize) -> ShardLayout {
    let mut shards = ShardLayout {
        chunks: Vec::with_capacity(world),
        pieces: Vec::with_capacity(world),
        lens: Vec::with_capacity(world),
    };
    for rank in 0..world {
        let (mut chunks, mut pieces, mut len) = (Vec::new(), Vec::new(), 0);
        for (j, part) in layout.parts.iter().enumerate() {
            let range = chunk_range(part.len, world, rank);
            let first = pieces.len();
            for (&p, &off) in part.params.iter().zip(&part.offsets) {
                let end = off + params[p].numel();
                let (lo, hi) = (range.start.max(off), range.end.min(end));
                if lo < hi {
                    pieces.push(Piece {
                        param: p,
                        range: lo - off..hi - off,
                        shard: len + (lo - range.start),
                    });
                }
            }
            chunks.push(Chunk {
                part: j,
                range: range.clone(),
                shard: len,
                pieces: first..pieces.len(),
            });
            len += range.len();
        }
        shards.chunks.push(chunks);
        shards.pieces.push(pieces);
        shards.lens.push(len);
    }
    shards
}

/// Gives the memory of `buf` outside `keep` back to the operating system, where whole pages
/// lie outside it (Linux: `madvise(MADV_DONTNEED)`; elsewhere nothing happens). `buf` keeps
/// its length, and its elements outside `keep` are unspecified afterwards (zero on Linux):
/// what a large reduce-scatter leaves of a rank's chunk is kept where it lies, without the
/// copy (and the moment of twice the memory) that keeping only the chunk would take.
pub(crate) fn release_outside(buf: &mut [f32], keep: Range<usize>) {
    #[cfg(target_os = "linux")]
    {
        let page = 4096usize;
        let base = buf.as_mut_ptr() as usize;
        let end = base + 4 * buf.len();
        let (keep_start, keep_end) = (base + 4 * keep.start, base + 4 * keep.end);
        for (lo, hi) in [(base, keep_start), (keep_end, end)] {
            // Whole pages only: the partial pages at the ends may hold other data.
            let (lo, hi) = (lo.next_multiple_of(page), hi / page * page);
            if lo < hi {
                // SAFETY: [lo, hi) lies inside `buf`, which this call borrows mutably, in
                // private anonymous memory (the allocator's); the pages read as zero
                // afterwards, and nothing reads them as anything else.
                unsafe {
                    libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED);
                }
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (buf, keep);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DdpConfig;
    use crate::gradients::buckets::plan_buckets;
    use crate::params::ParamKind;

    fn info(name: &str, numel: usize) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            id: burn::module::ParamId::new(),
            shape: vec![numel],
            dtype: burn::tensor::DType::F32,
            kind: ParamKind::Trainable,
        }
    }

    #[test]
    fn shards_cover_every_element_once_and_are_balanced() {
        let big = crate::gradients::buckets::ADOPT_BYTES / 4 + 1;
        let params = vec![
            info("a", 10),
            info("b", big),
            info("c", 7),
            info("d", 3),
            info("e", 1),
        ];
        for (cap_mb, world) in [(1e-5, 3), (25.0, 4), (1e-4, 2), (25.0, 1), (25.0, 5)] {
            let config = DdpConfig {
                bucket_cap_mb: cap_mb,
                first_bucket_mb: cap_mb,
                ..DdpConfig::default()
            };
            let layout = plan_buckets(&params, &(&config).into());
            let shards = plan_shards(&layout, &params, world);
            let mut owner: Vec<Vec<usize>> =
                params.iter().map(|p| vec![usize::MAX; p.numel()]).collect();
            for r in 0..world {
                let mut at = 0;
                for piece in &shards.pieces[r] {
                    assert_eq!(piece.shard, at, "pieces are in shard order");
                    at += piece.range.len();
                    for e in piece.range.clone() {
                        assert_eq!(owner[piece.param][e], usize::MAX, "owned twice");
                        owner[piece.param][e] = r;
                    }
                }
                assert_eq!(at, shards.lens[r]);
            }
            assert!(owner.iter().flatten().all(|&o| o < world));
            let (lo, hi) = (
                shards.lens.iter().min().unwrap(),
                shards.lens.iter().max().unwrap(),
            );
            assert!(hi - lo <= layout.parts.len(), "{:?}", shards.lens);
        }
    }

    #[test]
    fn released_pages_read_as_zero_and_the_kept_range_is_untouched() {
        let n = 10 * 4096;
        let mut buf: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
        let keep = 3000..9000;
        release_outside(&mut buf, keep.clone());
        assert!(keep.clone().all(|i| buf[i] == i as f32 + 1.0));
        if cfg!(target_os = "linux") {
            // Somewhere outside, whole pages were given back.
            assert!(buf[keep.end + 2048..].contains(&0.0));
        }
    }
}
