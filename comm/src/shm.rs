//! The shared-memory transport: the collectives of ranks that share one host, through memory
//! every rank maps, instead of TCP through the kernel; and the topology it finds (which ranks
//! share a host), which also drives the hierarchical all-reduce across hosts (`algorithms.rs`).
//!
//! # Setting up (`ShmGroup::setup`, while the group forms)
//!
//! Every rank creates one anonymous segment (`memfd_create`: it has no name, so a killed job
//! leaves nothing behind; it is gone when the last process holding it exits) and publishes in the
//! store its host identity (host name plus the kernel's boot id, or `GroupBuilder::host_id`), its
//! pid and the descriptor's number. The ranks with the same identity form a *host*; hosts are
//! ordered by their lowest rank, which is the host's *leader*. A rank maps the segment of every
//! other rank of its host through `/proc/<pid>/fd/<n>` and checks the segment's header (magic,
//! job id, rank): sharing a host is *confirmed by mapping*, never guessed from
//! `LOCAL_WORLD_SIZE`. Every rank then publishes whether it mapped all of its host's ranks, and
//! the group uses shared memory only if every rank did (every rank reads every verdict, so all
//! reach the same answer). One host: shared memory carries every collective. Several hosts, some
//! with two or more ranks: shared memory inside each host, TCP between the leaders
//! (hierarchical). One rank per host: TCP alone. `DDP_TRANSPORT=tcp` turns shared memory off,
//! `shm` makes a failure to set it up an error, `auto` (the default) falls back to TCP.
//!
//! # The segment
//!
//! A header (magic, job id, rank, world), then two *slots* (double buffering), each a control
//! block and `slot_bytes` of data. A slot's control block holds two counters, `copied` and
//! `reduced`, each with a count of the peers asleep on it, and the fingerprint (the 32-byte frame
//! header of `wire.rs`) of the collective that last wrote the slot.
//!
//! # The protocol (every collective, piece by piece)
//!
//! A collective is cut into pieces of at most `slot_bytes`; the host's ranks number pieces with
//! one counter, the *epoch* e = 1, 2, 3, ..., and piece e uses slot e mod 2 on every rank. For a
//! piece, a rank writes into its own slot what the peers will read, then stores the fingerprint
//! and, with release ordering, `copied = e`; it waits (acquire) until every peer's `copied` is at
//! least e and checks each peer's fingerprint against its own (a mismatch fails at once, naming
//! both collectives, as on TCP). Then it reads what it needs straight out of the peers' slots.
//!
//! Why no closing barrier is needed: a rank writes slot b again only for piece e + 2, after it
//! has seen every peer's `copied = e + 1`; a peer sets that only after it finished reading piece
//! e (program order). So the two slots alternate safely with a single wait per piece (two for
//! a large all-reduce, below).
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
//!   copies all blocks. Reduce-scatter: everyone writes, rank r reduces its chunk. Barrier: one
//!   empty piece.
//!
//! Waiting spins briefly (when the host's ranks do not outnumber its cores; else it yields its
//! core for up to 2 ms, to the rank whose work it waits for), then parks on the counter with a
//! futex (`FUTEX_WAIT` on the shared page; the writer wakes sleepers after its
//! release store, and only when the sleeper count says there are any), so that ranks that
//! outnumber the cores give their core to the rank that works instead of spinning. Every wait
//! checks the group's failure state (a dead peer is still detected by its TCP link and
//! heartbeats, which stay up), whether the peer it waits for has left the group (its GOODBYE
//! arrived over TCP), and the group's deadline at least every few milliseconds, and names the
//! peer it waits for.

use std::ffi::CString;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::algorithms::chunk_range;
use crate::element::{Element, ReduceOp};
use crate::error::CommError;
use crate::store::Store;
use crate::transport::Mesh;
use crate::wire::{Header, OpDesc, HEADER_BYTES};

const MAGIC: [u8; 8] = *b"DDPSHM02";
/// Offset of slot b's control block: `copied` at +0, the fingerprint at +8, `copied`'s sleeper
/// count at +64, `reduced` at +128 and its sleeper count at +192 (each on its own cache line).
const CONTROL_OFFSET: usize = 256;
const CONTROL_BYTES: usize = 256;
/// Where slot 0's data begins (page aligned, so every element type is aligned).
const DATA_OFFSET: usize = 4096;
/// The data bytes per slot. Small enough that a piece, the peers' parts of it and the
/// accumulator stay in a core's L2 (1 MiB here): on the development machine 512 KiB to 1 MiB
/// pieces all-reduce 16 MiB at 2 ranks about 2.5x faster than 4 MiB pieces.
pub(crate) const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// Pieces up to this size are all-reduced in one shot.
const ONE_SHOT_BYTES: usize = 64 << 10;
/// The reduction's block: the accumulator of one block stays in L1.
const REDUCE_BLOCK_BYTES: usize = 16 << 10;
/// How long a parked waiter sleeps at most before it checks the group's state again.
const PARK_STEP: Duration = Duration::from_millis(5);

/// Which transport carries a group's collectives (`DDP_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory between the ranks of each host (confirmed by mapping), TCP between hosts
    /// (hierarchical when there are several), TCP alone when no two ranks share a host.
    Auto,
    /// Always TCP.
    Tcp,
    /// As `Auto`, but a failure to set up shared memory is an error instead of a fall-back.
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

/// The shared-memory side of a group: the segments of every rank of this host, mapped, and the
/// group's topology (hosts and their leaders).
pub(crate) struct ShmGroup {
    /// Our global rank.
    rank: usize,
    /// Our index in `members`.
    me: usize,
    /// The global ranks of this host, ascending; `maps[i]` is `members[i]`'s segment.
    members: Vec<usize>,
    /// The leader (lowest global rank) of every host, hosts in the order of their leaders.
    leaders: Vec<usize>,
    /// For every global rank, the index of its host in `leaders`.
    host_of: Vec<usize>,
    slot_bytes: usize,
    maps: Vec<Mapping>,
    /// Our segment's descriptor, kept open while peers may still be mapping it.
    _fd: std::fs::File,
    epoch: std::cell::Cell<u64>,
    timeout: Duration,
    /// How long a wait spins before it yields.
    spin: Duration,
    /// How long a wait yields its core before it parks.
    yield_for: Duration,
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

/// The 32 bits of a counter that a futex watches: the low half (the counter only grows, by
/// less than 2^32 between two looks).
fn futex_word(counter: &AtomicU64) -> *const u32 {
    let low = if cfg!(target_endian = "big") { 1 } else { 0 };
    // SAFETY: an AtomicU64 is 8 bytes; its halves are 4-byte aligned.
    unsafe { (counter as *const AtomicU64 as *const u32).add(low) }
}

/// Sleeps until `counter` no longer holds `seen` (a wake) or `timeout` passes. Spurious returns
/// are fine: the caller looks again.
fn futex_wait(counter: &AtomicU64, seen: u64, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a 4-byte aligned word of a shared mapping (not private: the
    // sleepers are in other processes), with a relative timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(counter),
            libc::FUTEX_WAIT,
            seen as u32,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process asleep on `counter`.
fn futex_wake(counter: &AtomicU64) {
    // SAFETY: FUTEX_WAKE on a 4-byte aligned word of a shared mapping.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            futex_word(counter),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

impl ShmGroup {
    /// Sets up shared memory for the group, as the module documentation says: `Ok(None)` when
    /// the group uses TCP alone (`DDP_TRANSPORT=tcp`, one rank per host, a segment that could
    /// not be mapped with `auto`). Every rank reaches the same answer through the store.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn setup(
        store: &Store,
        rank: usize,
        world: usize,
        job_id: &[u8; 16],
        transport: Transport,
        host_id: Option<&str>,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Option<ShmGroup>, CommError> {
        if transport == Transport::Tcp || world < 2 {
            return Ok(None);
        }
        let slot_bytes = DEFAULT_SLOT_BYTES;
        let len = DATA_OFFSET + 2 * slot_bytes;
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let host = host_id.map_or_else(host_identity, str::to_string);

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
        // "pid fd len host" (the host last: it may contain spaces).
        let me = format!("{} {fd} {len} {host}", std::process::id());
        store.set(&format!("ddp/shm/{rank}"), me.as_bytes())?;

        // Every rank's entry: the hosts, then our host's segments mapped and checked.
        let mut entries: Vec<Option<String>> = vec![None; world];
        for peer in (0..world).filter(|&p| p != rank) {
            let raw = store.get_timeout(&format!("ddp/shm/{peer}"), remaining())?;
            entries[peer] = Some(String::from_utf8_lossy(&raw).into_owned());
        }
        let host_name = |r: usize| -> String {
            match &entries[r] {
                None => host.clone(),
                Some(text) => text.splitn(4, ' ').nth(3).unwrap_or("").to_string(),
            }
        };
        let names: Vec<String> = (0..world).map(host_name).collect();
        let mut leaders: Vec<usize> = Vec::new();
        let mut host_of = vec![0usize; world];
        for r in 0..world {
            match leaders.iter().position(|&l| names[l] == names[r]) {
                Some(h) => host_of[r] = h,
                None => {
                    host_of[r] = leaders.len();
                    leaders.push(r);
                }
            }
        }
        let members: Vec<usize> = (0..world)
            .filter(|&r| host_of[r] == host_of[rank])
            .collect();
        let mut maps: Vec<Option<Mapping>> = (0..members.len()).map(|_| None).collect();
        let mut why_not: Option<String> = None;
        for (i, &peer) in members.iter().enumerate() {
            if peer == rank {
                continue;
            }
            let text = entries[peer].as_deref().unwrap_or("");
            match map_peer(text, peer, job_id, len, rank) {
                Ok(m) => maps[i] = Some(m),
                Err(reason) => {
                    why_not.get_or_insert(format!("rank {peer}: {reason}"));
                }
            }
        }
        let me_index = members
            .iter()
            .position(|&r| r == rank)
            .expect("we are a member");
        maps[me_index] = Some(own);
        store.set(
            &format!("ddp/shm/ok/{rank}"),
            why_not.as_deref().unwrap_or("ok").as_bytes(),
        )?;
        for peer in (0..world).filter(|&p| p != rank) {
            let raw = store.get_timeout(&format!("ddp/shm/ok/{peer}"), remaining())?;
            if raw != b"ok" && why_not.is_none() {
                why_not = Some(format!(
                    "rank {peer} could not map its host's segments: {}",
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
        if leaders.len() == world {
            tracing::debug!("rank {rank}: one rank per host: TCP carries the collectives");
            return Ok(None);
        }
        if leaders.len() == 1 {
            tracing::debug!("rank {rank}: shared memory carries the collectives");
        } else {
            tracing::debug!(
                "rank {rank}: {} hosts: shared memory inside each (ours: ranks {members:?}), TCP between the leaders {leaders:?}",
                leaders.len()
            );
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // A core each: spin a little, then park. More ranks than cores: hand the core to the
        // rank that works (yield) for a while before parking, since a wake-up costs more.
        let (spin, yield_for) = if members.len() <= cores {
            (Duration::from_micros(50), Duration::ZERO)
        } else {
            (Duration::from_micros(2), Duration::from_millis(2))
        };
        Ok(Some(ShmGroup {
            rank,
            me: me_index,
            members,
            leaders,
            host_of,
            slot_bytes,
            maps: maps.into_iter().map(|m| m.expect("mapped")).collect(),
            _fd: file,
            epoch: std::cell::Cell::new(0),
            timeout,
            spin,
            yield_for,
        }))
    }

    /// Whether every rank of the group shares this host.
    pub(crate) fn is_flat(&self) -> bool {
        self.leaders.len() == 1
    }

    /// The hosts' leaders (lowest global rank of each host), in host order.
    pub(crate) fn leaders(&self) -> &[usize] {
        &self.leaders
    }

    /// The index of `rank`'s host in [`ShmGroup::leaders`].
    pub(crate) fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The index of global `rank` among this host's ranks (`None`: another host).
    pub(crate) fn local_index(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }

    /// Whether this rank leads its host.
    pub(crate) fn is_leader(&self) -> bool {
        self.me == 0
    }

    fn local_world(&self) -> usize {
        self.members.len()
    }

    /// Local peer `i`'s `copied` (or `reduced`) counter of `slot`, and its sleeper count.
    fn counter(&self, i: usize, slot: usize, reduced: bool) -> (&AtomicU64, &AtomicU32) {
        let off = CONTROL_OFFSET + slot * CONTROL_BYTES + if reduced { 128 } else { 0 };
        // SAFETY: within the mapping, 8-byte aligned, only ever accessed atomically.
        unsafe {
            let base = self.maps[i].ptr.add(off);
            (
                &*(base as *const AtomicU64),
                &*(base.add(64) as *const AtomicU32),
            )
        }
    }

    fn fingerprint(&self, i: usize, slot: usize) -> *mut u8 {
        // SAFETY: within the mapping.
        unsafe {
            self.maps[i]
                .ptr
                .add(CONTROL_OFFSET + slot * CONTROL_BYTES + 8)
        }
    }

    /// Slot `slot` of local peer `i`'s segment as `len` elements of `T` from element `start`.
    ///
    /// # Safety
    /// `(start + len) * size_of::<T>() <= slot_bytes`, and the protocol must guarantee that
    /// nobody writes the range while the slice lives.
    unsafe fn slot<T>(&self, i: usize, slot: usize, start: usize, len: usize) -> &[T] {
        std::slice::from_raw_parts(self.slot_ptr::<T>(i, slot).add(start), len)
    }

    /// Our own slot, to write into.
    ///
    /// # Safety
    /// As [`ShmGroup::slot`], and nobody may read the range while the slice lives. The memory is
    /// the mapping's, shared with other processes, not data owned through `&self`: hence a
    /// mutable slice from a shared reference.
    #[allow(clippy::mut_from_ref)]
    unsafe fn own_slot<T>(&self, slot: usize, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.slot_ptr::<T>(self.me, slot).add(start), len)
    }

    fn slot_ptr<T>(&self, i: usize, slot: usize) -> *mut T {
        // SAFETY: the data area lies within the mapping (DATA_OFFSET + 2 slots).
        unsafe {
            self.maps[i]
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

    /// Stores our `copied` (or `reduced`) counter of `slot` and wakes its sleepers, if any.
    fn signal(&self, slot: usize, epoch: u64, reduced: bool) {
        let (counter, sleepers) = self.counter(self.me, slot, reduced);
        // SeqCst on both sides (here and in `wait_one`): either the sleeper sees the new value
        // before it sleeps, or we see its sleeper count and wake it.
        counter.store(epoch, Ordering::SeqCst);
        if sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(counter);
        }
    }

    /// Publishes that our slot holds piece `epoch` of collective `desc`.
    fn publish(&self, slot: usize, epoch: u64, desc: &OpDesc) {
        let head = Header::data(desc, 0).encode();
        // SAFETY: the fingerprint area is ours and nobody reads it before `copied` says so.
        unsafe {
            std::ptr::copy_nonoverlapping(
                head.as_ptr(),
                self.fingerprint(self.me, slot),
                HEADER_BYTES,
            )
        };
        self.signal(slot, epoch, false);
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
        for i in (0..self.local_world()).filter(|&i| i != self.me) {
            let peer = self.members[i];
            self.wait_one(mesh, i, slot, epoch, reduced, desc)?;
            if !reduced {
                let mut head = [0u8; HEADER_BYTES];
                // SAFETY: the peer wrote it before its release store, which we acquired.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.fingerprint(i, slot),
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

    /// Waits for local peer `i`'s counter: spin, then park on a futex in steps of at most
    /// [`PARK_STEP`]; gives up on a group failure (the TCP links still watch every peer) or at
    /// the group's deadline.
    fn wait_one(
        &self,
        mesh: &Mesh,
        i: usize,
        slot: usize,
        epoch: u64,
        reduced: bool,
        desc: &OpDesc,
    ) -> Result<(), CommError> {
        let (counter, sleepers) = self.counter(i, slot, reduced);
        if counter.load(Ordering::Acquire) >= epoch {
            return Ok(());
        }
        let started = Instant::now();
        let mut tries: u32 = 0;
        loop {
            if counter.load(Ordering::Acquire) >= epoch {
                return Ok(());
            }
            tries = tries.wrapping_add(1);
            if !tries.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let waited = started.elapsed();
            if waited >= self.spin && waited < self.spin + self.yield_for {
                std::thread::yield_now();
            } else if waited >= self.spin {
                sleepers.fetch_add(1, Ordering::SeqCst);
                let seen = counter.load(Ordering::SeqCst);
                if seen < epoch {
                    futex_wait(counter, seen, PARK_STEP);
                }
                sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            if mesh.shared().is_failed() {
                if let Some(e) = mesh.shared().error() {
                    return Err(e);
                }
            }
            // A peer that left the group cleanly never moves its counter again (it published
            // what it had before its GOODBYE went out, hence the second look).
            if mesh.said_goodbye(self.members[i]) && counter.load(Ordering::Acquire) < epoch {
                return Err(CommError::PeerLeft {
                    rank: self.rank,
                    peer: self.members[i],
                });
            }
            if waited > self.timeout {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    peer: self.members[i],
                    op: desc.to_string(),
                    timeout: self.timeout,
                });
            }
        }
    }

    fn piece_elems<T>(&self) -> usize {
        (self.slot_bytes / std::mem::size_of::<T>()).max(1)
    }
}

/// Maps a peer's segment described by `text` ("pid fd len host"); the caller has checked that
/// the peer names our host.
fn map_peer(
    text: &str,
    peer: usize,
    job_id: &[u8; 16],
    len: usize,
    rank: usize,
) -> Result<Mapping, String> {
    let parts: Vec<&str> = text.splitn(4, ' ').collect();
    let [pid, fd, their_len, _host] = parts[..] else {
        return Err(format!("malformed shared-memory entry {text:?}"));
    };
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

/// All-reduce over the shared memory of this host (see the module documentation: two-phase for
/// large pieces, one shot for small ones; local rank order for every element either way).
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
    let (me, world) = (shm.me, shm.local_world());
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
    let me = shm.me;
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
/// reduces, in rank order, the part of the piece that falls in its chunk. Returns chunk `rank`.
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
    let (me, world) = (shm.me, shm.local_world());
    let mine = chunk_range(input.len(), world, me);
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

/// A barrier of this host's ranks over shared memory: one empty piece.
pub(crate) fn barrier(shm: &ShmGroup, mesh: &Mesh, desc: &OpDesc) -> Result<(), CommError> {
    let (epoch, slot) = shm.next_piece();
    shm.publish(slot, epoch, desc);
    shm.wait_peers(mesh, slot, epoch, false, desc)
}
