//! The collective algorithms over TCP, each one function over the mesh's `send` and `recv`
//! (`transport/mesh.rs`). Which transport carries a collective (these, shared memory, or both in the
//! hierarchical form) is decided in `collectives/dispatch.rs`.
//!
//! # Ring all-reduce (large buffers)
//!
//! The N ranks form a ring: rank r sends to r+1 and receives from r-1 (mod N). The buffer is cut
//! into N chunks of nearly equal length ([`chunk_range`]), and every chunk into segments of
//! `segment_bytes` (1 MiB by default). The all-reduce is a reduce-scatter followed by an
//! all-gather, N-1 steps each (Gloo's `allreduce_ring_chunked` has the same shape):
//!
//! * Reduce-scatter, step s = 0..N-2: rank r sends chunk (r - s) to the right and receives chunk
//!   (r - s - 1) from the left, adding its own values to it. The chunk it receives at step s is
//!   the one it sends at step s+1, so after N-1 steps chunk (r + 1) holds the contributions of
//!   all N ranks, at rank r.
//! * All-gather, step t = 0..N-2: rank r sends the finished chunk (r + 1 - t) to the right and
//!   receives the finished chunk (r - t) from the left, which it forwards at the next step.
//!
//! Each byte crosses each link 2(N-1)/N times, the minimum for any all-reduce, whatever N is.
//!
//! The pipeline works segment by segment, not chunk by chunk: as soon as rank r has received and
//! reduced segment k of a chunk, it queues that segment for the right neighbour (the writer thread
//! of that link sends it while this thread receives and reduces segment k+1). Sends and receives
//! on the two ring links are thus in flight together with the reduction, and the ring does not
//! wait for whole chunks.
//!
//! No segment is copied in user space on its way: a segment goes out from where it lies in the
//! caller's buffer (lent to the link's writer thread, which sends it with one `sendmsg`), a
//! segment of the reduce-scatter lands in a pool buffer and is reduced into the caller's buffer
//! in place (`mine = incoming + mine`, one pass), and a segment of the all-gather is read from
//! the socket straight into the caller's buffer (a receive posted to the link's reader thread
//! before the frame arrives; a copy only when the frame came first). The memory lent to the
//! transport threads is accounted for ([`Ctx::lending`]): a collective returns only once they
//! are done with it, on errors too. Why the algorithms never write what is still lent is told
//! at [`ring_reduce_scatter`].
//!
//! The reduction order of every element is fixed: chunk c is summed as
//! ((x_c + x_{c+1}) + x_{c+2}) + ... + x_{c-1} (ranks mod N), for every run with the same world
//! size, length and segment size; and every rank ends up with the bytes computed once by the
//! owning rank, so results are bit-identical across runs and across ranks. `Avg` divides the
//! finished chunk once, at its owner, before the all-gather.
//!
//! # Direct exchange over the full mesh (small buffers)
//!
//! A ring needs 2(N-1) dependent message latencies; for small buffers latency dominates. Up to
//! `small_allreduce_bytes` (by default 256 KiB / (N - 1): 256 KiB at 2 ranks, 85 KiB at 4, as the
//! bench measured; `DDP_SMALL_ALLREDUCE_BYTES` overrides it)
//! every rank sends its whole buffer to every other rank at once, then reduces all N contributions
//! in rank order 0, 1, ..., N-1: one message latency, (N-1)x the bytes, and again the same bits
//! on every rank. The same direct pattern serves small reduce-scatters (each rank gets only its
//! chunk from everyone), all-gathers, broadcasts (the root sends to everyone) and the barrier.
//!
//! # Other collectives
//!
//! * Reduce-scatter (large): the reduce-scatter half of the ring, shifted by one chunk so that
//!   rank r ends with chunk r.
//! * All-gather (large): the all-gather half of the ring over the N input blocks.
//! * Broadcast (large): a pipelined chain root -> root+1 -> ... -> root-1, segment by segment;
//!   every rank forwards a segment as soon as it has it, so the time is about one buffer transfer
//!   plus N-2 segment transfers.
//!
//! Every frame carries the collective's fingerprint, and `recv` checks it and the payload's
//! length; any mismatch fails the collective at once (see `wire.rs`).

use std::ops::Range;

use crate::collectives::element::{Element, ReduceOp};
use crate::error::CommError;
use crate::transport::buffers::PooledBuf;
use crate::transport::mesh::Mesh;
use crate::wire::OpDesc;

/// The balanced split of `len` elements into `world` chunks: chunk `index` of
/// `chunk_range(len, world, index)`. The first `len % world` chunks are one element longer.
///
/// `reduce_scatter` returns chunk `rank` of the reduced buffer.
///
/// # Panics
///
/// If `world` is 0 or `index >= world`.
pub fn chunk_range(len: usize, world: usize, index: usize) -> Range<usize> {
    assert!(
        world > 0 && index < world,
        "chunk_range: index {index} of world {world}"
    );
    let base = len / world;
    let extra = len % world;
    let start = index * base + index.min(extra);
    start..start + base + usize::from(index < extra)
}

/// Everything an algorithm needs: the mesh, the fingerprint of the running collective, tuning,
/// and who takes part: `members` (global ranks; every rank of the group, or the hosts' leaders in
/// a hierarchical collective). The algorithms speak of ranks as indices into `members`:
/// `index()` is ours, `size()` their number, and `send`/`recv` map an index to the global rank.
pub(crate) struct Ctx<'a> {
    pub mesh: &'a Mesh,
    pub desc: OpDesc,
    pub segment_bytes: usize,
    pub small_bytes: usize,
    /// The global ranks taking part, in ring order.
    pub members: &'a [usize],
    /// Our index in `members`.
    pub me: usize,
}

impl Ctx<'_> {
    /// Our index among the members.
    fn index(&self) -> usize {
        self.me
    }
    /// The number of members.
    fn size(&self) -> usize {
        self.members.len()
    }
    fn right(&self) -> usize {
        (self.index() + 1) % self.size()
    }
    fn left(&self) -> usize {
        (self.index() + self.size() - 1) % self.size()
    }
    fn seg_elems<T>(&self) -> usize {
        (self.segment_bytes / std::mem::size_of::<T>()).max(1)
    }
    /// Queues a copy of `data` to `peer` (the caller may change `data` at once).
    fn send<T: Element>(&self, peer: usize, data: &[T]) -> Result<(), CommError> {
        self.mesh
            .send(self.members[peer], &self.desc, self.mesh.copy_of(data))
    }
    /// Queues `data` to `peer`, sent from where it lies (no copy).
    ///
    /// # Safety
    ///
    /// `data` must stay alive and unmodified until the collective settles ([`Ctx::lending`]).
    unsafe fn lend<T: Element>(&self, peer: usize, data: &[T]) -> Result<(), CommError> {
        // SAFETY: passed on to the caller.
        unsafe {
            self.mesh
                .send_lent(self.members[peer], &self.desc, bytemuck::cast_slice(data))
        }
    }
    fn recv<T: Element>(&self, peer: usize, elems: usize) -> Result<PooledBuf, CommError> {
        self.mesh.recv(
            self.members[peer],
            &self.desc,
            elems * std::mem::size_of::<T>(),
        )
    }
    /// Receives the next frame from `peer` into `dst`, straight from the socket when it can.
    ///
    /// # Safety
    ///
    /// After an error, `dst` must stay alive and untouched until the collective settles
    /// ([`Ctx::lending`]).
    unsafe fn recv_into<T: Element>(&self, peer: usize, dst: &mut [T]) -> Result<(), CommError> {
        // SAFETY: passed on to the caller.
        unsafe {
            self.mesh.recv_into(
                self.members[peer],
                &self.desc,
                bytemuck::cast_slice_mut(dst),
            )
        }
    }
    /// Runs `f`, the TCP part of a collective that lends memory to the transport
    /// ([`Ctx::lend`], [`Ctx::recv_into`]), and waits until the transport is done with it
    /// ([`Mesh::settle`]), whatever `f` returned: only then may that memory be used or freed, so
    /// every buffer `f` lends must outlive this call.
    fn lending<R>(&self, f: impl FnOnce() -> Result<R, CommError>) -> Result<R, CommError> {
        match f() {
            Ok(v) => self.mesh.settle(&self.desc, Ok(())).map(|()| v),
            Err(e) => Err(self
                .mesh
                .settle(&self.desc, Err(e))
                .expect_err("settling an error returns it")),
        }
    }
    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size()).filter(move |&p| p != self.index())
    }
    /// The same collective over TCP among `members` (we are `members[me]`), e.g. the leaders.
    pub(crate) fn over<'b>(&'b self, members: &'b [usize], me: usize) -> Ctx<'b> {
        Ctx {
            mesh: self.mesh,
            desc: self.desc,
            segment_bytes: self.segment_bytes,
            small_bytes: self.small_bytes,
            members,
            me,
        }
    }
}

/// The segments of `range`, each at most `seg` elements; always at least one (possibly empty)
/// segment, so that every step of every collective exchanges at least one frame and so checks
/// the fingerprint.
fn segments(range: Range<usize>, seg: usize) -> impl Iterator<Item = Range<usize>> {
    let n = range.len().div_ceil(seg).max(1);
    (0..n).map(move |i| {
        let s = range.start + i * seg;
        s..(s + seg).min(range.end)
    })
}

fn bytes_of<T>(len: usize) -> usize {
    len.saturating_mul(std::mem::size_of::<T>())
}

/// `mine = incoming op mine`: the ring's order of operands (the partial result that arrived
/// first, this rank's values second), written into `mine` in one pass over memory, block by
/// block through a buffer that stays in L1.
fn reduce_received<T: Element>(op: ReduceOp, mine: &mut [T], incoming: &[T]) {
    const BLOCK: usize = 2048;
    let mut acc = [T::zeroed(); BLOCK];
    for (m, i) in mine.chunks_mut(BLOCK).zip(incoming.chunks(BLOCK)) {
        let a = &mut acc[..m.len()];
        a.copy_from_slice(i);
        T::reduce_into(op, a, m);
        m.copy_from_slice(a);
    }
}

/// A collective's buffer seen through one raw pointer, for the algorithms that lend parts of
/// it to the transport ([`Ctx::lend`], [`Ctx::recv_into`]) while they work on other parts: a
/// segment handed to a writer thread and the one this thread reduces are disjoint views of the
/// same allocation, which references taken from one `&mut [T]` cannot express (each
/// `&mut buf[..]` would claim the whole slice).
#[derive(Clone, Copy)]
struct View<T> {
    ptr: *mut T,
    len: usize,
}

impl<T> View<T> {
    fn new(buf: &mut [T]) -> View<T> {
        View {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }
    }

    /// # Safety
    ///
    /// No thread may write `r` while the returned slice lives.
    unsafe fn get(&self, r: Range<usize>) -> &[T] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: in bounds; no writer by the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }

    /// # Safety
    ///
    /// No other thread may read or write `r` while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get_mut(&self, r: Range<usize>) -> &mut [T] {
        assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: in bounds; exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

// ---------------------------------------------------------------------------------------------
// all_reduce

/// Reduces `buf` across the members with `op`, in place: the direct exchange up to the
/// small-buffer threshold, the ring above it.
pub(crate) fn all_reduce<T: Element>(
    cx: &Ctx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    if bytes_of::<T>(buf.len()) <= cx.small_bytes {
        return cx.lending(|| direct_all_reduce(cx, buf, op));
    }
    let (len, n) = (buf.len(), cx.size());
    let view = View::new(buf);
    cx.lending(|| {
        ring_reduce_scatter(cx, view, op, 0, true)?;
        ring_all_gather(cx, view, |c| chunk_range(len, n, c), cx.index() + 1, true)
    })
}

/// Sends copies (`buf` becomes the accumulator at once) and receives rank 0's contribution
/// straight into `buf`; run under [`Ctx::lending`].
fn direct_all_reduce<T: Element>(cx: &Ctx, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
    let seg = cx.seg_elems::<T>();
    let all = 0..buf.len();
    for p in cx.peers() {
        for s in segments(all.clone(), seg) {
            cx.send(p, &buf[s])?;
        }
    }
    // buf becomes the accumulator, starting with rank 0's contribution.
    let own = if cx.index() != 0 {
        buf.to_vec()
    } else {
        Vec::new()
    };
    if cx.index() != 0 {
        for s in segments(all.clone(), seg) {
            // SAFETY: `buf` outlives the `lending` this runs under, and is not touched again
            // after an error.
            unsafe { cx.recv_into(0, &mut buf[s])? };
        }
    }
    let acc_op = op.accumulator();
    for p in 1..cx.size() {
        if p == cx.index() {
            T::reduce_into(acc_op, buf, &own);
        } else {
            for s in segments(all.clone(), seg) {
                let b = cx.recv::<T>(p, s.len())?;
                T::reduce_into(acc_op, &mut buf[s], b.as_slice());
            }
        }
    }
    if op == ReduceOp::Avg {
        T::divide(buf, cx.size());
    }
    Ok(())
}

/// The reduce-scatter half of the ring. At step s rank r sends chunk (r + shift - s) and
/// receives chunk (r + shift - s - 1); it ends holding the finished chunk (r + shift + 1) (mod
/// N). With `send_final`, each finished segment is queued to the right at once (step 0 of the
/// all-gather that follows). Runs under [`Ctx::lending`], with `buf` outliving it.
///
/// Every segment goes out from where it lies in `buf` (lent), and a received segment is
/// reduced into `buf` in place. Why nothing this rank lends is written while the transport may
/// still read it: within the reduce-scatter each chunk is written once, before it is sent; a
/// chunk written later (by the all-gather, with its final value) was sent earlier only as a
/// partial result, and the final value depends on that partial result, so it cannot arrive
/// before the right neighbour has received it, i.e. before the writer thread is done with it.
fn ring_reduce_scatter<T: Element>(
    cx: &Ctx,
    buf: View<T>,
    op: ReduceOp,
    shift: usize,
    send_final: bool,
) -> Result<(), CommError> {
    let n = cx.size();
    let r = cx.index();
    let len = buf.len;
    let seg = cx.seg_elems::<T>();
    let (left, right) = (cx.left(), cx.right());
    let chunk = |c: usize| chunk_range(len, n, c % n);
    let acc_op = op.accumulator();

    for s in segments(chunk(r + shift), seg) {
        // SAFETY: see the function's documentation.
        unsafe { cx.lend(right, buf.get(s))? };
    }
    for step in 0..n - 1 {
        let c = (r + shift + 2 * n - step - 1) % n;
        let last = step == n - 2;
        for s in segments(chunk(c), seg) {
            let incoming = cx.recv::<T>(left, s.len())?;
            {
                // SAFETY: chunk c is not lent (see the function's documentation).
                let mine = unsafe { buf.get_mut(s.clone()) };
                reduce_received(acc_op, mine, incoming.as_slice());
                if last && op == ReduceOp::Avg {
                    T::divide(mine, n);
                }
            }
            if !last || send_final {
                // SAFETY: see the function's documentation.
                unsafe { cx.lend(right, buf.get(s))? };
            }
        }
    }
    Ok(())
}

/// The all-gather half of the ring over blocks `block(0..N)` of `buf`: rank r starts owning
/// block `own` (already sent to the right if `own_sent`); at step t it receives block
/// (own - t - 1) from the left, straight into `buf`, and forwards it from there, except at the
/// last step. Runs under [`Ctx::lending`], with `buf` outliving it: every block is written
/// once, by a receive, before it is lent (and blocks lent before the all-gather, see
/// [`ring_reduce_scatter`], are done with by the time their final value arrives).
fn ring_all_gather<T: Element>(
    cx: &Ctx,
    buf: View<T>,
    block: impl Fn(usize) -> Range<usize>,
    own: usize,
    own_sent: bool,
) -> Result<(), CommError> {
    let n = cx.size();
    let seg = cx.seg_elems::<T>();
    let (left, right) = (cx.left(), cx.right());
    if !own_sent {
        for s in segments(block(own % n), seg) {
            // SAFETY: see the function's documentation.
            unsafe { cx.lend(right, buf.get(s))? };
        }
    }
    for step in 0..n - 1 {
        let b = (own + 2 * n - step - 1) % n;
        let forward = step < n - 2;
        for s in segments(block(b), seg) {
            // SAFETY: see the function's documentation.
            unsafe {
                cx.recv_into(left, buf.get_mut(s.clone()))?;
                if forward {
                    cx.lend(right, buf.get(s))?;
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// reduce_scatter

/// Reduces `buf` across ranks into this rank's chunk of it, `chunk_range(len, N, rank)`, in
/// place (the rest of `buf` is left unspecified): the ring's reduce-scatter above the
/// small-buffer threshold, a direct exchange below it. The frames are the same either way, so
/// a rank that wants a copy of its chunk and one that keeps it in place
/// run the same collective (`collectives::reduce_scatter` copies the chunk out).
pub(crate) fn reduce_scatter_in_place<T: Element>(
    cx: &Ctx,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let n = cx.size();
    let r = cx.index();
    let len = buf.len();
    let mine = chunk_range(len, n, r);
    if bytes_of::<T>(len) > cx.small_bytes {
        // Shift by N-1 so that rank r ends with chunk r.
        let view = View::new(buf);
        return cx.lending(|| ring_reduce_scatter(cx, view, op, n - 1, false));
    }
    // Every rank sends each peer its chunk of `buf` (lent: `buf` is not written until the
    // collective settled) and accumulates its own chunk in `acc`, starting from rank 0's
    // contribution.
    let mut acc: Vec<T> = buf[mine.clone()].to_vec();
    let own = &buf[mine.clone()];
    let seg = cx.seg_elems::<T>();
    let local = |s: &Range<usize>| s.start - mine.start..s.end - mine.start;
    cx.lending(|| {
        for p in cx.peers() {
            for s in segments(chunk_range(len, n, p), seg) {
                // SAFETY: `buf` outlives the `lending` and is only read.
                unsafe { cx.lend(p, &buf[s])? };
            }
        }
        if r != 0 {
            for s in segments(mine.clone(), seg) {
                // SAFETY: `acc` outlives the `lending` and is not touched after an error.
                unsafe { cx.recv_into(0, &mut acc[local(&s)])? };
            }
        }
        let acc_op = op.accumulator();
        for p in 1..n {
            if p == r {
                T::reduce_into(acc_op, &mut acc, own);
            } else {
                for s in segments(mine.clone(), seg) {
                    let b = cx.recv::<T>(p, s.len())?;
                    T::reduce_into(acc_op, &mut acc[local(&s)], b.as_slice());
                }
            }
        }
        Ok(())
    })?;
    if op == ReduceOp::Avg {
        T::divide(&mut acc, n);
    }
    buf[mine].copy_from_slice(&acc);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// all_gather

/// Concatenates every member's `input` (equal lengths) in member order; the caller checked
/// that the total length fits in a `usize`.
pub(crate) fn all_gather<T: Element>(cx: &Ctx, input: &[T]) -> Result<Vec<T>, CommError> {
    let n = cx.size();
    let r = cx.index();
    let l = input.len();
    let total = l * n;
    let mut out = vec![T::zeroed(); total];
    out[r * l..(r + 1) * l].copy_from_slice(input);
    let block = |b: usize| b * l..(b + 1) * l;
    if bytes_of::<T>(total) > cx.small_bytes {
        let view = View::new(&mut out);
        cx.lending(|| ring_all_gather(cx, view, block, r, false))?;
        return Ok(out);
    }
    let seg = cx.seg_elems::<T>();
    cx.lending(|| {
        for p in cx.peers() {
            for s in segments(0..l, seg) {
                // SAFETY: `input` outlives the `lending` and is only read.
                unsafe { cx.lend(p, &input[s])? };
            }
        }
        for p in cx.peers() {
            for s in segments(block(p), seg) {
                // SAFETY: `out` outlives the `lending` and is not touched after an error.
                unsafe { cx.recv_into(p, &mut out[s])? };
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// The all-gather of a buffer cut into the reduce-scatter's chunks, in place: every member
/// holds its own chunk `chunk_range(len, N, index)` of `buf` (chunks differ by at most one
/// element), and ends with every member's chunk in its place. This is the second half of the
/// ring all-reduce: the ring above the small-buffer threshold, a direct exchange below it.
/// ZeRO's all-gather of updated parameters writes straight into the parameters' memory with it.
pub(crate) fn all_gather_chunks<T: Element>(cx: &Ctx, buf: &mut [T]) -> Result<(), CommError> {
    let (n, r, len) = (cx.size(), cx.index(), buf.len());
    let block = |c: usize| chunk_range(len, n, c);
    let view = View::new(buf);
    if bytes_of::<T>(len) > cx.small_bytes {
        return cx.lending(|| ring_all_gather(cx, view, block, r, false));
    }
    let seg = cx.seg_elems::<T>();
    cx.lending(|| {
        for p in cx.peers() {
            for s in segments(block(r), seg) {
                // SAFETY: our own chunk, only read until the collective settles.
                unsafe { cx.lend(p, view.get(s))? };
            }
        }
        for p in cx.peers() {
            for s in segments(block(p), seg) {
                // SAFETY: peer p's chunk, disjoint from ours (lent) and from every other
                // peer's; `buf` outlives the `lending` and is not touched after an error.
                unsafe { cx.recv_into(p, view.get_mut(s))? };
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// broadcast

/// Overwrites `buf` on every member with member `root`'s `buf`.
pub(crate) fn broadcast<T: Element>(cx: &Ctx, buf: &mut [T], root: usize) -> Result<(), CommError> {
    let n = cx.size();
    let r = cx.index();
    let seg = cx.seg_elems::<T>();
    let all = 0..buf.len();
    let small = bytes_of::<T>(buf.len()) <= cx.small_bytes;
    // Every segment is written at most once (by its receive) before it is lent, and `buf`
    // outlives the `lending`.
    let view = View::new(buf);
    cx.lending(|| {
        if small {
            for s in segments(all, seg) {
                // SAFETY: see above.
                unsafe {
                    if r == root {
                        for p in cx.peers() {
                            cx.lend(p, view.get(s.clone()))?;
                        }
                    } else {
                        cx.recv_into(root, view.get_mut(s))?;
                    }
                }
            }
            return Ok(());
        }
        // Pipelined chain root -> root+1 -> ... -> root-1.
        let position = (r + n - root) % n;
        let last = position == n - 1;
        for s in segments(all, seg) {
            // SAFETY: see above.
            unsafe {
                if position != 0 {
                    cx.recv_into(cx.left(), view.get_mut(s.clone()))?;
                }
                if !last {
                    cx.lend(cx.right(), view.get(s))?;
                }
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// barrier

/// Returns once every member has entered the barrier: an empty frame to and from every peer.
pub(crate) fn barrier(cx: &Ctx) -> Result<(), CommError> {
    for p in cx.peers() {
        cx.send::<u8>(p, &[])?;
    }
    for p in cx.peers() {
        cx.recv::<u8>(p, 0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_balanced_and_cover_everything() {
        for len in 0..40 {
            for world in 1..7 {
                let mut next = 0;
                for i in 0..world {
                    let c = chunk_range(len, world, i);
                    assert_eq!(c.start, next);
                    assert!(c.len() == len / world || c.len() == len / world + 1);
                    assert_eq!(c.len() == len / world + 1, i < len % world);
                    next = c.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(chunk_range(10, 3, 0), 0..4);
        assert_eq!(chunk_range(10, 3, 2), 7..10);
    }

    #[test]
    fn segments_cover_the_range() {
        let s: Vec<_> = segments(3..10, 3).collect();
        assert_eq!(s, vec![3..6, 6..9, 9..10]);
        let s: Vec<_> = segments(5..5, 3).collect();
        assert_eq!(s, vec![5..5]);
        let s: Vec<_> = segments(0..6, 3).collect();
        assert_eq!(s, vec![0..3, 3..6]);
    }
}
