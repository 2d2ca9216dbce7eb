//! The shared-memory transport: the collectives of ranks that share one host, through memory
//! every rank maps, instead of TCP through the kernel.
//!
//! # Setting up (`ShmGroup::setup`, while the group forms)
//!
//! Every rank creates one anonymous segment (`memfd_create`: it has no name, so a killed job
//! leaves nothing behind; it is gone when the last process holding it exits) and publishes in the
//! store its host identity (host name plus the kernel's boot id), its pid and the descriptor's
//! number. A rank maps a peer's segment through `/proc/<pid>/fd/<n>` only when the identities
//! match, and checks the segment's header (magic, job id, rank): sharing a host is *confirmed by
//! mapping*, never guessed from `LOCAL_WORLD_SIZE`. Every rank then publishes whether it mapped
//! all the others, and the group uses shared memory only if every rank did (for now only when all
//! ranks share one host; otherwise TCP carries everything). `DDP_TRANSPORT=tcp` turns it off,
//! `shm` makes a failure to set it up an error, `auto` (the default) falls back to TCP.
//!
//! # The segment
//!
//! A header (magic, job id, rank, world), then two *slots* (double buffering), each a control
//! block and `slot_bytes` of data. A slot's control block holds two counters, `copied` and
//! `reduced`, and the fingerprint (the 32-byte frame header of `wire.rs`) of the collective that
//! last wrote the slot.
//!
//! # The protocol (every collective, piece by piece)
//!
//! A collective is cut into pieces of at most `slot_bytes`; the group numbers pieces with one
//! counter, the *epoch* e = 1, 2, 3, ..., and piece e uses slot e mod 2 on every rank. For a
//! piece, a rank writes its input into its own slot, then stores the fingerprint and, with
//! release ordering, `copied = e`; it waits (acquire) until every peer's `copied` is at least e
//! and checks each peer's fingerprint against its own (a mismatch fails at once, naming both
//! collectives, as on TCP). Then it reads what it needs straight out of the peers' slots.
//!
//! Why no closing barrier is needed: a rank writes slot b again only for piece e + 2, after it
//! has seen every peer's `copied = e + 1`; a peer sets that only after it finished reading piece
//! e (program order). So the two slots alternate safely with a single wait per piece (two for
//! a large all-reduce, below).
//!
//! * All-reduce, large pieces (DeepSpeed's CPU shared-memory all-reduce has this shape): rank r
//!   reduces its chunk r of the piece ([`chunk_range`]) reading every rank's slot in rank order
//!   0, 1, ..., N-1, writes the result into the caller's buffer and into its own slot, stores
//!   `reduced = e`; after every peer's `reduced` reaches e, it copies the peers' finished chunks.
//!   Each rank reads N/N of the piece and writes 1/N: the work is split N ways.
//! * All-reduce, small pieces (up to `small_bytes`): one shot: every rank reduces the whole piece
//!   from every slot, in the same rank order: one wait instead of two.
//! * Both give every element the sum ((x_0 + x_1) + x_2) + ... in rank order, whoever computes
//!   it, so results are bit-identical across runs, ranks and piece sizes. `Avg` divides once.
//! * Broadcast: the root writes, the others copy. All-gather: everyone writes its block, everyone
//!   copies all blocks. Reduce-scatter: everyone writes, rank r reduces its chunk. Barrier: one
//!   empty piece.
//!
//! Waiting spins briefly, then yields, then sleeps in short steps (ranks may outnumber cores);
//! every wait checks the group's failure state (a dead peer is still detected by its TCP link
//! and heartbeats, which stay up) and the group's deadline, and names the peer it waits for.

use std::ffi::CString;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::algorithms::chunk_range;
use crate::element::{Element, ReduceOp};
use crate::error::CommError;
use crate::store::Store;
use crate::transport::Mesh;
use crate::wire::{Header, OpDesc, HEADER_BYTES};

const MAGIC: [u8; 8] = *b"DDPSHM01";
/// Offset of slot b's control block: `copied` at +0, the fingerprint at +8, `reduced` at +128
/// (its own cache line).
const CONTROL_OFFSET: usize = 256;
const CONTROL_BYTES: usize = 256;
/// Where slot 0's data begins (page aligned, so every element type is aligned).
const DATA_OFFSET: usize = 4096;
/// The default data bytes per slot.
pub(crate) const DEFAULT_SLOT_BYTES: usize = 4 << 20;
/// Pieces up to this size are all-reduced in one shot.
const ONE_SHOT_BYTES: usize = 64 << 10;

/// Which transport carries a group's collectives (`DDP_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory when every rank shares one host (confirmed by mapping), else TCP.
    Auto,
    /// Always TCP.
    Tcp,
    /// Shared memory, or an error when it cannot be set up.
    Shm,
}

impl Transport {
    /// Parses a value of `DDP_TRANSPORT` (`auto` when unset or empty).
    pub(crate) fn parse(value: Option<&str>) -> Result<Transport, CommError> {
        match value {
            None => Ok(Transport::Auto),
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(Transport::Auto),
                "tcp" => Ok(Transport::Tcp),
                "shm" => Ok(Transport::Shm),
                _ => Err(CommError::config(
                    "DDP_TRANSPORT",
                    format!("DDP_TRANSPORT={v:?}: expected auto, tcp or shm"),
                )),
            },
        }
    }
}

/// One mapped segment (unmapped on drop).
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len come from a successful mmap and are unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// The shared-memory side of a group: every rank's segment, mapped.
pub(crate) struct ShmGroup {
    rank: usize,
    world: usize,
    slot_bytes: usize,
    maps: Vec<Mapping>,
    /// Our segment's descriptor, kept open while peers may still be mapping it.
    _fd: std::fs::File,
    epoch: std::cell::Cell<u64>,
    timeout: Duration,
}

// SAFETY: the mappings are plain memory shared with other processes; the group is used by one
// thread at a time (the communication thread), and cross-rank access follows the protocol above.
unsafe impl Send for ShmGroup {}

fn sys_err(rank: usize, what: &str) -> CommError {
    CommError::Internal {
        rank,
        message: format!("shared memory: {what}: {}", std::io::Error::last_os_error()),
    }
}

/// This host's identity: its name and the kernel's boot id (two containers may share a name).
fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most name.len() bytes.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    let host = if ok {
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        String::new()
    };
    format!("{host}/{}", boot.trim())
}

fn map_fd(fd: libc::c_int, len: usize, rank: usize) -> Result<Mapping, CommError> {
    // SAFETY: a shared read-write mapping of a descriptor of at least `len` bytes.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(sys_err(rank, "mmap"));
    }
    Ok(Mapping {
        ptr: ptr.cast(),
        len,
    })
}

impl ShmGroup {
    /// Sets up shared memory for the group, as the module documentation says: `Ok(None)` when
    /// the group uses TCP (`DDP_TRANSPORT=tcp`, ranks on several hosts, a segment that could not
    /// be mapped with `auto`). Every rank reaches the same answer through the store.
    pub(crate) fn setup(
        store: &Store,
        rank: usize,
        world: usize,
        job_id: &[u8; 16],
        transport: Transport,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Option<ShmGroup>, CommError> {
        if transport == Transport::Tcp || world < 2 {
            return Ok(None);
        }
        let slot_bytes = DEFAULT_SLOT_BYTES;
        let len = DATA_OFFSET + 2 * slot_bytes;
        let remaining = || deadline.saturating_duration_since(Instant::now());

        // Our segment.
        let name = CString::new("ddp-shm").expect("no NUL");
        // SAFETY: memfd_create with a valid name; the descriptor is owned by the File below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(sys_err(rank, "memfd_create"));
        }
        // SAFETY: fd is a fresh descriptor we own.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(len as u64).map_err(|e| CommError::Internal {
            rank,
            message: format!("shared memory: sizing a segment of {len} bytes: {e}"),
        })?;
        let own = map_fd(fd, len, rank)?;
        // SAFETY: the header lies within our fresh mapping.
        unsafe {
            let h = std::slice::from_raw_parts_mut(own.ptr, 40);
            h[..8].copy_from_slice(&MAGIC);
            h[8..24].copy_from_slice(job_id);
            h[24..32].copy_from_slice(&(rank as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(world as u64).to_le_bytes());
        }
        let me = format!("{} {} {fd} {len}", host_identity(), std::process::id());
        store.set(&format!("ddp/shm/{rank}"), me.as_bytes())?;

        // The peers' segments, mapped and checked when they say they share our host.
        let host = host_identity();
        let mut maps: Vec<Option<Mapping>> = (0..world).map(|_| None).collect();
        let mut why_not: Option<String> = None;
        for peer in (0..world).filter(|&p| p != rank) {
            let raw = store.get_timeout(&format!("ddp/shm/{peer}"), remaining())?;
            let text = String::from_utf8_lossy(&raw).into_owned();
            match map_peer(&text, &host, peer, job_id, len, rank) {
                Ok(m) => maps[peer] = Some(m),
                Err(reason) => {
                    why_not.get_or_insert(format!("rank {peer}: {reason}"));
                }
            }
        }
        maps[rank] = Some(own);
        store.set(
            &format!("ddp/shm/ok/{rank}"),
            why_not.as_deref().unwrap_or("ok").as_bytes(),
        )?;
        for peer in (0..world).filter(|&p| p != rank) {
            let raw = store.get_timeout(&format!("ddp/shm/ok/{peer}"), remaining())?;
            if raw != b"ok" && why_not.is_none() {
                why_not = Some(format!(
                    "rank {peer} could not map: {}",
                    String::from_utf8_lossy(&raw)
                ));
            }
        }
        if let Some(reason) = why_not {
            if transport == Transport::Shm {
                return Err(CommError::config(
                    "DDP_TRANSPORT",
                    format!(
                        "DDP_TRANSPORT=shm, but rank {rank} cannot use shared memory: {reason}"
                    ),
                ));
            }
            tracing::debug!("rank {rank}: TCP carries the collectives ({reason})");
            return Ok(None);
        }
        tracing::debug!("rank {rank}: shared memory carries the collectives");
        Ok(Some(ShmGroup {
            rank,
            world,
            slot_bytes,
            maps: maps.into_iter().map(|m| m.expect("mapped")).collect(),
            _fd: file,
            epoch: std::cell::Cell::new(0),
            timeout,
        }))
    }

    fn counter(&self, rank: usize, slot: usize, reduced: bool) -> &AtomicU64 {
        let off = CONTROL_OFFSET + slot * CONTROL_BYTES + if reduced { 128 } else { 0 };
        // SAFETY: within the mapping, 8-byte aligned, only ever accessed atomically.
        unsafe { &*(self.maps[rank].ptr.add(off) as *const AtomicU64) }
    }

    fn fingerprint(&self, rank: usize, slot: usize) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe {
            self.maps[rank]
                .ptr
                .add(CONTROL_OFFSET + slot * CONTROL_BYTES + 8)
        }
    }

    /// Slot `slot` of `rank`'s segment as `len` elements of `T` from element `start`.
    ///
    /// # Safety
    /// `(start + len) * size_of::<T>() <= slot_bytes`, and the protocol must guarantee that
    /// nobody writes the range while the slice lives.
    unsafe fn slot<T>(&self, rank: usize, slot: usize, start: usize, len: usize) -> &[T] {
        std::slice::from_raw_parts(self.slot_ptr::<T>(rank, slot).add(start), len)
    }

    /// Our own slot, to write into.
    ///
    /// # Safety
    /// As [`ShmGroup::slot`], and nobody may read the range while the slice lives. The memory is
    /// the mapping's, shared with other processes, not data owned through `&self`: hence a
    /// mutable slice from a shared reference.
    #[allow(clippy::mut_from_ref)]
    unsafe fn own_slot<T>(&self, slot: usize, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.slot_ptr::<T>(self.rank, slot).add(start), len)
    }

    fn slot_ptr<T>(&self, rank: usize, slot: usize) -> *mut T {
        // SAFETY: the data area lies within the mapping (DATA_OFFSET + 2 slots).
        unsafe {
            self.maps[rank]
                .ptr
                .add(DATA_OFFSET + slot * self.slot_bytes)
                .cast::<T>()
        }
    }

    /// Starts the next piece: its epoch and slot.
    fn next_piece(&self) -> (u64, usize) {
        let epoch = self.epoch.get() + 1;
        self.epoch.set(epoch);
        (epoch, (epoch % 2) as usize)
    }

    /// Publishes that our slot holds piece `epoch` of collective `desc`.
    fn publish(&self, slot: usize, epoch: u64, desc: &OpDesc) {
        let head = Header::data(desc, 0).encode();
        // SAFETY: the fingerprint area is ours and nobody reads it before `copied` says so.
        unsafe {
            std::ptr::copy_nonoverlapping(
                head.as_ptr(),
                self.fingerprint(self.rank, slot),
                HEADER_BYTES,
            )
        };
        self.counter(self.rank, slot, false)
            .store(epoch, Ordering::Release);
    }

    /// Waits until every peer's `copied` (or `reduced`) counter of `slot` reaches `epoch`,
    /// checking their fingerprints against `desc` after `copied`.
    fn wait_peers(
        &self,
        mesh: &Mesh,
        slot: usize,
        epoch: u64,
        reduced: bool,
        desc: &OpDesc,
    ) -> Result<(), CommError> {
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            self.wait_one(mesh, peer, slot, epoch, reduced, desc)?;
            if !reduced {
                let mut head = [0u8; HEADER_BYTES];
                // SAFETY: the peer wrote it before its release store, which we acquired.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.fingerprint(peer, slot),
                        head.as_mut_ptr(),
                        HEADER_BYTES,
                    )
                };
                let theirs = Header::decode(&head).map_err(|message| CommError::Protocol {
                    rank: self.rank,
                    peer,
                    message: format!("in {desc}, its shared-memory fingerprint: {message}"),
                })?;
                if theirs.desc().as_ref() != Some(desc) {
                    return Err(CommError::Mismatch {
                        rank: self.rank,
                        peer,
                        ours: desc.to_string(),
                        theirs: theirs.describe(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits for one peer's counter: spin, then yield, then sleep in short steps; gives up on a
    /// group failure (the TCP links still watch every peer) or at the group's deadline.
    fn wait_one(
        &self,
        mesh: &Mesh,
        peer: usize,
        slot: usize,
        epoch: u64,
        reduced: bool,
        desc: &OpDesc,
    ) -> Result<(), CommError> {
        let counter = self.counter(peer, slot, reduced);
        let mut tries: u32 = 0;
        let mut started: Option<Instant> = None;
        loop {
            if counter.load(Ordering::Acquire) >= epoch {
                return Ok(());
            }
            tries += 1;
            if tries < 128 {
                std::hint::spin_loop();
                continue;
            }
            if tries < 2048 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            if tries.is_multiple_of(64) {
                if let Some(e) = mesh.shared().error() {
                    return Err(e);
                }
                let since = *started.get_or_insert_with(Instant::now);
                if since.elapsed() > self.timeout {
                    return Err(CommError::Timeout {
                        rank: self.rank,
                        peer,
                        op: desc.to_string(),
                        timeout: self.timeout,
                    });
                }
            }
        }
    }

    fn piece_elems<T>(&self) -> usize {
        (self.slot_bytes / std::mem::size_of::<T>()).max(1)
    }
}

/// Maps a peer's segment described by `text` ("host pid fd len") if it shares our host.
fn map_peer(
    text: &str,
    host: &str,
    peer: usize,
    job_id: &[u8; 16],
    len: usize,
    rank: usize,
) -> Result<Mapping, String> {
    let parts: Vec<&str> = text.split(' ').collect();
    let [their_host, pid, fd, their_len] = parts[..] else {
        return Err(format!("malformed shared-memory entry {text:?}"));
    };
    if their_host != host {
        return Err(format!("on another host ({their_host})"));
    }
    if their_len.parse::<usize>().ok() != Some(len) {
        return Err(format!("segment of {their_len} bytes, expected {len}"));
    }
    let (pid, fd) = match (pid.parse::<u32>(), fd.parse::<i32>()) {
        (Ok(p), Ok(f)) => (p, f),
        _ => return Err(format!("malformed shared-memory entry {text:?}")),
    };
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {path}: {e}"))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size < len as u64 {
        return Err(format!("{path} has {size} bytes, expected {len}"));
    }
    let map =
        map_fd(std::os::fd::AsRawFd::as_raw_fd(&file), len, rank).map_err(|e| e.to_string())?;
    // SAFETY: the header lies within the mapping; the owner wrote it before publishing.
    let head = unsafe { std::slice::from_raw_parts(map.ptr, 40) };
    let ok = head[..8] == MAGIC
        && head[8..24] == job_id[..]
        && u64::from_le_bytes(head[24..32].try_into().expect("8 bytes")) == peer as u64;
    if !ok {
        return Err(format!("{path} is not rank {peer}'s segment of this job"));
    }
    Ok(map)
}

/// The pieces of `0..len` elements, each at most `piece` long; at least one (possibly empty),
/// so that every collective synchronises and checks fingerprints at least once.
fn pieces(len: usize, piece: usize) -> impl Iterator<Item = Range<usize>> {
    let n = len.div_ceil(piece).max(1);
    (0..n).map(move |i| i * piece..((i + 1) * piece).min(len))
}

/// All-reduce over shared memory (see the module documentation: two-phase for large pieces,
/// one shot for small ones; rank order 0..N-1 for every element either way).
pub(crate) fn all_reduce<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<(), CommError> {
    let acc_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let (rank, world) = (shm.rank, shm.world);
    for piece in pieces(buf.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let n = piece.len();
        let data = &mut buf[piece];
        // SAFETY: our slot; peers read it only after `copied` = epoch below.
        unsafe { shm.own_slot::<T>(slot, 0, n) }.copy_from_slice(data);
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        // Reduces `range` of the piece from every slot, in rank order, into `out`.
        let reduce = |out: &mut [T], range: Range<usize>| {
            // SAFETY: every rank's slot holds piece `epoch` and nobody writes it until every
            // rank has published piece epoch + 1.
            out.copy_from_slice(unsafe { shm.slot::<T>(0, slot, range.start, range.len()) });
            for r in 1..world {
                T::reduce_into(acc_op, out, unsafe {
                    shm.slot::<T>(r, slot, range.start, range.len())
                });
            }
            if op == ReduceOp::Avg {
                T::divide(out, world);
            }
        };
        if n * std::mem::size_of::<T>() <= ONE_SHOT_BYTES {
            reduce(data, 0..n);
            continue;
        }
        let mine = chunk_range(n, world, rank);
        reduce(&mut data[mine.clone()], mine.clone());
        // SAFETY: our own chunk; peers read it only after `reduced` = epoch.
        unsafe { shm.own_slot::<T>(slot, mine.start, mine.len()) }
            .copy_from_slice(&data[mine.clone()]);
        shm.counter(rank, slot, true)
            .store(epoch, Ordering::Release);
        shm.wait_peers(mesh, slot, epoch, true, desc)?;
        for r in (0..world).filter(|&r| r != rank) {
            let c = chunk_range(n, world, r);
            // SAFETY: rank r finished chunk c of its slot before its release store.
            data[c.clone()].copy_from_slice(unsafe { shm.slot::<T>(r, slot, c.start, c.len()) });
        }
    }
    Ok(())
}

/// Broadcast from `root` over shared memory: per piece the root writes, everyone else copies.
pub(crate) fn broadcast<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    buf: &mut [T],
    root: usize,
) -> Result<(), CommError> {
    let rank = shm.rank;
    for piece in pieces(buf.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        let data = &mut buf[piece];
        if rank == root {
            // SAFETY: our slot, as in all_reduce.
            unsafe { shm.own_slot::<T>(slot, 0, data.len()) }.copy_from_slice(data);
        }
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        if rank != root {
            // SAFETY: the root's slot holds the piece until everyone publishes epoch + 1.
            data.copy_from_slice(unsafe { shm.slot::<T>(root, slot, 0, data.len()) });
        }
    }
    Ok(())
}

/// All-gather over shared memory: per piece of the input, everyone writes its block and copies
/// everyone's. Returns the N inputs, rank by rank.
pub(crate) fn all_gather<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    input: &[T],
) -> Result<Vec<T>, CommError> {
    let (world, len) = (shm.world, input.len());
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

/// Reduce-scatter over shared memory: per piece everyone writes the piece; rank r reduces, in
/// rank order, the part of the piece that falls in its chunk. Returns chunk `rank`.
pub(crate) fn reduce_scatter<T: Element>(
    shm: &ShmGroup,
    mesh: &Mesh,
    desc: &OpDesc,
    input: &[T],
    op: ReduceOp,
) -> Result<Vec<T>, CommError> {
    let acc_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let (rank, world) = (shm.rank, shm.world);
    let mine = chunk_range(input.len(), world, rank);
    let mut out = input[mine.clone()].to_vec();
    for piece in pieces(input.len(), shm.piece_elems::<T>()) {
        let (epoch, slot) = shm.next_piece();
        // SAFETY: our slot, as in all_reduce.
        unsafe { shm.own_slot::<T>(slot, 0, piece.len()) }.copy_from_slice(&input[piece.clone()]);
        shm.publish(slot, epoch, desc);
        shm.wait_peers(mesh, slot, epoch, false, desc)?;
        let lo = mine.start.max(piece.start);
        let hi = mine.end.min(piece.end);
        if lo >= hi {
            continue;
        }
        let at = lo - piece.start;
        let dst = &mut out[lo - mine.start..hi - mine.start];
        // SAFETY: every slot holds piece `epoch` until everyone publishes epoch + 1.
        dst.copy_from_slice(unsafe { shm.slot::<T>(0, slot, at, hi - lo) });
        for r in 1..world {
            T::reduce_into(acc_op, dst, unsafe { shm.slot::<T>(r, slot, at, hi - lo) });
        }
        if op == ReduceOp::Avg {
            T::divide(dst, world);
        }
    }
    Ok(out)
}

/// A barrier over shared memory: one empty piece.
pub(crate) fn barrier(shm: &ShmGroup, mesh: &Mesh, desc: &OpDesc) -> Result<(), CommError> {
    let (epoch, slot) = shm.next_piece();
    shm.publish(slot, epoch, desc);
    shm.wait_peers(mesh, slot, epoch, false, desc)
}
