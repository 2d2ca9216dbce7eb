//! Which transport carries each collective, and the hierarchical collectives that use both.
//!
//! * Every rank on one host (shared memory set up, one host): the shared-memory algorithms
//!   (`shm_algorithms.rs`) carry every collective.
//! * No two ranks on one host, or shared memory off: the TCP algorithms (`algorithms.rs`).
//! * Several hosts, some shared: all-reduce, broadcast and barrier take the hierarchical forms
//!   below; all-gather and reduce-scatter go over TCP among all ranks.
//!
//! # Hierarchical all-reduce (ranks on several hosts)
//!
//! When some ranks share a host and the group spans several hosts (`topology.rs` finds out
//! which), an all-reduce runs in three phases: (1) the ranks of each host all-reduce over shared
//! memory (rank order inside the host), (2) the host's leader (its lowest rank) all-reduces the
//! host's sum with the other leaders over TCP, with the TCP algorithms over the leaders alone
//! (direct or ring by size; `Avg` divides by the whole group's size once, at the leaders),
//! (3) each leader broadcasts the result to its host over shared memory. Only one rank per host
//! sends over the network, and each host's bytes cross it once instead of once per rank. Every
//! rank ends with the bytes its leader computed, and the leaders with the same bytes (the TCP
//! algorithms are bit-identical across ranks), so results are bit-identical across ranks and
//! runs of the same topology; the order of the sum is: each host's ranks in rank order, then
//! the hosts as the TCP algorithm combines them (with exactly representable values, e.g.
//! integers, every topology gives the same bits).
//!
//! A broadcast goes inside the root's host from the root, then from the root's leader to the
//! other leaders over TCP, then inside every other host from its leader. A barrier: everyone of
//! every host in (shared memory), the leaders' barrier over TCP, everyone out (shared memory).

use crate::collectives::algorithms::{self, Ctx};
use crate::collectives::element::{Element, ReduceOp};
use crate::collectives::shm_algorithms as shm;
use crate::error::CommError;
use crate::transport::shm::ShmGroup;

/// The transports a collective may use: TCP among every rank of the group, and the shared memory
/// of this host when some ranks share it.
pub(crate) struct Transports<'a> {
    /// The TCP context over every rank of the group (`members` = `0..world`).
    pub tcp: Ctx<'a>,
    pub shm: Option<&'a ShmGroup>,
}

impl Transports<'_> {
    /// Shared memory, when it carries everything (one host).
    fn flat_shm(&self) -> Option<&ShmGroup> {
        self.shm.filter(|s| s.topology().is_flat())
    }

    /// The TCP context among the hosts' leaders (we are one of them).
    fn leaders<'b>(&'b self, s: &'b ShmGroup) -> Ctx<'b> {
        let topology = s.topology();
        let me = topology.host_of(self.tcp.mesh.rank);
        self.tcp.over(topology.leaders(), me)
    }
}

/// Reduces `buf` across every rank with `op`, in place.
pub(crate) fn all_reduce<T: Element>(
    t: &Transports,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let cx = &t.tcp;
    match t.shm {
        Some(s) if s.topology().is_flat() => shm::all_reduce(s, cx.mesh, &cx.desc, buf, op),
        Some(s) => {
            let acc_op = op.accumulator();
            shm::all_reduce(s, cx.mesh, &cx.desc, buf, acc_op)?;
            if s.is_leader() {
                algorithms::all_reduce(&t.leaders(s), buf, acc_op)?;
                if op == ReduceOp::Avg {
                    T::divide(buf, cx.mesh.world);
                }
            }
            shm::broadcast(s, cx.mesh, &cx.desc, buf, 0)
        }
        None => algorithms::all_reduce(cx, buf, op),
    }
}

/// Reduces `buf` across every rank and returns this rank's chunk, `chunk_range(len, N, rank)`.
pub(crate) fn reduce_scatter<T: Element>(
    t: &Transports,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<Vec<T>, CommError> {
    reduce_scatter_in_place(t, buf, op)?;
    let cx = &t.tcp;
    Ok(buf[algorithms::chunk_range(buf.len(), cx.mesh.world, cx.mesh.rank)].to_vec())
}

/// Reduces `buf` across every rank into this rank's chunk of it, `chunk_range(len, N, rank)`,
/// in place; the rest of `buf` is left unspecified.
pub(crate) fn reduce_scatter_in_place<T: Element>(
    t: &Transports,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let cx = &t.tcp;
    match t.flat_shm() {
        Some(s) => shm::reduce_scatter_in_place(s, cx.mesh, &cx.desc, buf, op),
        None => algorithms::reduce_scatter_in_place(cx, buf, op),
    }
}

/// Every rank's chunk `chunk_range(len, N, rank)` of `buf` into every rank's `buf`, in place
/// (the second half of a ring all-reduce).
pub(crate) fn all_gather_chunks<T: Element>(
    t: &Transports,
    buf: &mut [T],
) -> Result<(), CommError> {
    let cx = &t.tcp;
    match t.flat_shm() {
        Some(s) => shm::all_gather_chunks(s, cx.mesh, &cx.desc, buf),
        None => algorithms::all_gather_chunks(cx, buf),
    }
}

/// Concatenates every rank's `input` (equal lengths) in rank order.
pub(crate) fn all_gather<T: Element>(t: &Transports, input: &[T]) -> Result<Vec<T>, CommError> {
    let cx = &t.tcp;
    let (l, n) = (input.len(), cx.mesh.world);
    if l.checked_mul(n).is_none() {
        return Err(CommError::InvalidArgument {
            rank: cx.mesh.rank,
            op: cx.desc.to_string(),
            message: format!("{l} elements times {n} ranks overflows"),
        });
    }
    match t.flat_shm() {
        Some(s) => shm::all_gather(s, cx.mesh, &cx.desc, input),
        None => algorithms::all_gather(cx, input),
    }
}

/// Overwrites `buf` on every rank with `root`'s `buf`.
pub(crate) fn broadcast<T: Element>(
    t: &Transports,
    buf: &mut [T],
    root: usize,
) -> Result<(), CommError> {
    let cx = &t.tcp;
    let Some(s) = t.shm else {
        return algorithms::broadcast(cx, buf, root);
    };
    if s.topology().is_flat() {
        return shm::broadcast(s, cx.mesh, &cx.desc, buf, root);
    }
    let topology = s.topology();
    let (root_host, host) = (topology.host_of(root), topology.host_of(cx.mesh.rank));
    if let Some(local_root) = s.local_index(root) {
        shm::broadcast(s, cx.mesh, &cx.desc, buf, local_root)?;
    }
    if s.is_leader() {
        algorithms::broadcast(&t.leaders(s), buf, root_host)?;
    }
    if host != root_host {
        shm::broadcast(s, cx.mesh, &cx.desc, buf, 0)?;
    }
    Ok(())
}

/// Returns once every rank has entered the barrier.
pub(crate) fn barrier(t: &Transports) -> Result<(), CommError> {
    let cx = &t.tcp;
    let Some(s) = t.shm else {
        return algorithms::barrier(cx);
    };
    shm::barrier(s, cx.mesh, &cx.desc)?;
    if s.topology().is_flat() {
        return Ok(());
    }
    if s.is_leader() {
        algorithms::barrier(&t.leaders(s))?;
    }
    shm::barrier(s, cx.mesh, &cx.desc)
}
