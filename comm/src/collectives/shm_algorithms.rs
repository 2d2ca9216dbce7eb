//! The collectives of the ranks of one host over shared memory (`shm.rs`, the transport: one
//! slot per rank, pieces of at most a slot, a wait per piece). Each is one function: the pieces
//! of the caller's buffer go through the slots one by one, and every piece checks the
//! collective's fingerprint on every peer.
//!
//! * All-reduce, large pieces (DeepSpeed's CPU shared-memory all-reduce has this shape): rank r
//!   copies into its slot only the parts of the piece that the *other* ranks reduce, then reduces
//!   its own chunk r of the piece ([`chunk_range`]), reading every rank's contribution in rank
//!   order 0, 1, ..., N-1 (its own straight from the caller's buffer), block by block so that
//!   the accumulator stays in L1; it writes the result into the caller's buffer and into its
//!   slot and stores `reduced = e`; after every peer's `reduced` reaches e, it copies the peers'
//!   finished chunks. Each rank reads N/N of the piece and writes 1/N: the work is split N ways.
//! * All-reduce, small pieces (up to 64 KiB): one shot: every rank reduces the whole piece from
//!   every slot, in the same rank order: one wait instead of two.
//! * Both give every element the sum ((x_0 + x_1) + x_2) + ... in rank order, whoever computes
//!   it, so results are bit-identical across runs, ranks and piece sizes. `Avg` divides once.
//! * Broadcast: the root writes, the others copy. All-gather: everyone writes its block, everyone
//!   copies all blocks (in place, of the reduce-scatter's chunks: the same per piece of the
//!   longest chunk). Reduce-scatter: everyone writes, rank r reduces its chunk in place.
//!   Barrier: one empty piece.
//!
//! The hierarchical collectives across hosts (`collectives/dispatch.rs`) use these inside each host.

use std::ops::Range;

use crate::collectives::algorithms::chunk_range;
use crate::collectives::element::{Element, ReduceOp};
use crate::error::CommError;
use crate::transport::mesh::Mesh;
use crate::transport::shm::ShmGroup;
use crate::wire::OpDesc;

/// Pieces up to this size are all-reduced in one shot.
const ONE_SHOT_BYTES: usize = 64 << 10;
/// The reduction's block: the accumulator of one block stays in L1.
const REDUCE_BLOCK_BYTES: usize = 16 << 10;

/// The pieces of `0..len` elements, each at most `piece` long; at least one (possibly empty),
/// so that every collective synchronises and checks fingerprints at least once.
fn pieces(len: usize, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let n = len.div_ceil(piece).max(1);
    (0..n).map(move |i| i * piece..((i + 1) * piece).min(len))
}

/// All-reduce over the shared memory of this host (see the module documentation: two-phase for
/// large pieces, one shot for small ones; local rank order for every element either way).
pub(crate) fn all_reduce<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let acc_op = op.accumulator();
    let (me, world) = (shm.me(), shm.local_world());
    let block = (REDUCE_BLOCK_BYTES / std::mem::size_of::<T>()).max(1);
    let mut scratch: Vec<T> = Vec::new();
    for piece in pieces(buf.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let n = piece.len();
        let data = &mut buf[piece];
        let one_shot = n * std::mem::size_of::<T>() <= ONE_SHOT_BYTES;
        // Ours to reduce: the whole piece in one shot, else chunk `me`. The peers read the rest
        // out of our slot, so only the rest is copied in.
        let mine = if one_shot {
            0..n
        } else {
            chunk_range(n, world, me)
        };
        // SAFETY: our slot; peers read it only after `copied` = epoch below.
        unsafe {
            if one_shot {
                shm.own_slot::<T>(slot, 0, n).copy_from_slice(data);
            } else {
                shm.own_slot::<T>(slot, 0, mine.start)
                    .copy_from_slice(&data[..mine.start]);
                shm.own_slot::<T>(slot, mine.end, n - mine.end)
                    .copy_from_slice(&data[mine.end..]);
            }
        }
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;

        // Reduce `mine`, block by block, every rank's contribution in rank order (ours from
        // `data`), into `data` (and, in two phases, our slot for the peers to copy).
        scratch.resize(block.min(mine.len()), T::zeroed());
        let mut at = mine.start;
        while at < mine.end {
            let b = at..(at + block).min(mine.end);
            let acc = &mut scratch[..b.len()];
            for r in 0..world {
                let src: &[T] = if r == me {
                    &data[b.clone()]
                } else {
                    // SAFETY: every rank's slot holds piece `epoch` outside the chunk its owner
                    // reduces, and nobody writes it until every rank has published epoch + 1.
                    unsafe { shm.slot::<T>(r, slot, b.start, b.len()) }
                };
                if r == 0 {
                    acc.copy_from_slice(src);
                } else {
                    T::reduce_into(acc_op, acc, src);
                }
            }
            if op == ReduceOp::Avg {
                T::divide(acc, world);
            }
            data[b.clone()].copy_from_slice(acc);
            if !one_shot {
                // SAFETY: our own chunk; peers read it only after `reduced` = epoch.
                unsafe { shm.own_slot::<T>(slot, b.start, b.len()) }.copy_from_slice(acc);
            }
            at = b.end;
        }
        if one_shot {
            continue;
        }
        shm.signal(slot, epoch, true);
        shm.wait_peers(mesh, slot, epoch, true, desc)?;
        for r in (0..world).filter(|&r| r != me) {
            let c = chunk_range(n, world, r);
            // SAFETY: rank r finished chunk c of its slot before its release store.
            data[c.clone()].copy_from_slice(unsafe { shm.slot::<T>(r, slot, c.start, c.len()) });
        }
    }
    Ok(())
}

/// Broadcast from this host's rank with local index `root` over shared memory: per piece the
/// root writes, everyone else copies.
pub(crate) fn broadcast<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
    root: usize,
) -> Result<(), CommError> {
    let me = shm.me();
    for piece in pieces(buf.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let data = &mut buf[piece];
        if me == root {
            // SAFETY: our slot, as in all_reduce.
            unsafe { shm.own_slot::<T>(slot, 0, data.len()) }.copy_from_slice(data);
        }
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        if me != root {
            // SAFETY: the root's slot holds the piece until everyone publishes epoch + 1.
            data.copy_from_slice(unsafe { shm.slot::<T>(root, slot, 0, data.len()) });
        }
    }
    Ok(())
}

/// All-gather over shared memory (one host): per piece of the input, everyone writes its block
/// and copies everyone's. Returns the N inputs, rank by rank.
pub(crate) fn all_gather<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    input: &[T],
) -> Result<Vec<T>, CommError> {
    let (world, len) = (shm.local_world(), input.len());
    let mut out = vec![T::zeroed(); len * world];
    for piece in pieces(len, shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let n = piece.len();
        // SAFETY: our slot, as in all_reduce.
        unsafe { shm.own_slot::<T>(slot, 0, n) }.copy_from_slice(&input[piece.clone()]);
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        for r in 0..world {
            let dst = r * len + piece.start;
            // SAFETY: rank r's slot holds its piece until everyone publishes epoch + 1.
            out[dst..dst + n].copy_from_slice(unsafe { shm.slot::<T>(r, slot, 0, n) });
        }
    }
    Ok(out)
}

/// Reduce-scatter over shared memory (one host): per piece everyone writes the piece; rank r
/// reduces, in rank order, the part of the piece that falls in its chunk, straight into `buf`
/// (its copy of the piece is in its slot). Leaves chunk `rank` reduced in place; the rest of
/// `buf` is left as it was.
pub(crate) fn reduce_scatter_in_place<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let acc_op = op.accumulator();
    let (me, world) = (shm.me(), shm.local_world());
    let mine = chunk_range(buf.len(), world, me);
    for piece in pieces(buf.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        // SAFETY: our slot, as in all_reduce.
        unsafe { shm.own_slot::<T>(slot, 0, piece.len()) }.copy_from_slice(&buf[piece.clone()]);
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        let lo = mine.start.max(piece.start);
        let hi = mine.end.min(piece.end);
        if lo >= hi {
            continue;
        }
        let at = lo - piece.start;
        let dst = &mut buf[lo..hi];
        // SAFETY: every slot holds piece `epoch` until everyone publishes epoch + 1.
        dst.copy_from_slice(unsafe { shm.slot::<T>(0, slot, at, hi - lo) });
        for r in 1..world {
            T::reduce_into(acc_op, dst, unsafe { shm.slot::<T>(r, slot, at, hi - lo) });
        }
        if op == ReduceOp::Avg {
            T::divide(dst, world);
        }
    }
    Ok(())
}

/// All-gather of the reduce-scatter's chunks over shared memory (one host), in place: every
/// rank holds its chunk `chunk_range(len, N, rank)` of `buf`; per piece of the longest chunk,
/// everyone writes that piece of its chunk (one element shorter, or empty, for the shorter
/// chunks) and copies the peers'.
pub(crate) fn all_gather_chunks<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
) -> Result<(), CommError> {
    let (me, world, len) = (shm.me(), shm.local_world(), buf.len());
    let longest = chunk_range(len, world, 0).len();
    // Piece `p` of chunk `c`, in `buf`'s coordinates.
    let part = |c: usize, p: &Range<usize>| {
        let chunk = chunk_range(len, world, c);
        (chunk.start + p.start).min(chunk.end)..(chunk.start + p.end).min(chunk.end)
    };
    for piece in pieces(longest, shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let own = part(me, &piece);
        // SAFETY: our slot, as in all_reduce.
        unsafe { shm.own_slot::<T>(slot, 0, own.len()) }.copy_from_slice(&buf[own]);
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        for r in (0..world).filter(|&r| r != me) {
            let theirs = part(r, &piece);
            let n = theirs.len();
            // SAFETY: rank r's slot holds its piece until everyone publishes epoch + 1.
            buf[theirs].copy_from_slice(unsafe { shm.slot::<T>(r, slot, 0, n) });
        }
    }
    Ok(())
}

/// A barrier of this host's ranks over shared memory: one empty piece.
pub(crate) fn barrier(shm: &ShmGroup, mesh: &Mesh, desc: &OpDesc) -> Result<(), CommError> {
    let (epoch, slot) = shm.next_piece();
    shm.publish(slot, epoch, desc);
    shm.wait_peers(mesh, slot, epoch, false, desc)
}
