//! The shared-memory transport of the ranks that share one host: collectives through memory
//! every rank maps, instead of TCP through the kernel. It knows nothing of algorithms: they
//! (`shm_algorithms.rs`) see a slot per rank to write, the peers' slots to read, and a wait per
//! piece ([`ShmGroup::publish`], [`ShmGroup::wait_peers`]).
//!
//! # Setting up (`ShmGroup::setup`, while the group forms)
//!
//! Every rank creates one anonymous segment (`memfd_create`: it has no name, so a killed job
//! leaves nothing behind; it is gone when the last process holding it exits) and publishes in the
//! store its host identity (host name plus the kernel's boot id, or `GroupBuilder::host_id`), its
//! pid and the descriptor's number. The identities make the [`Topology`] (`topology.rs`: hosts
//! and their leaders). A rank maps the segment of every other rank of its host through
//! `/proc/<pid>/fd/<n>` and checks the segment's header (magic, job id, rank): sharing a host is
//! *confirmed by mapping*, never guessed from `LOCAL_WORLD_SIZE`. Every rank then publishes
//! whether it mapped all of its host's ranks, and the group uses shared memory only if every
//! rank did (every rank reads every verdict, so all reach the same answer). One host: shared
//! memory carries every collective. Several hosts, some with two or more ranks: shared memory
//! inside each host, TCP between the leaders (hierarchical, `collectives/dispatch.rs`). One rank per host:
//! TCP alone. `DDP_TRANSPORT=tcp` turns shared memory off, `shm` makes a failure to set it up an
//! error, `auto` (the default) falls back to TCP.
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
//! a large all-reduce, which also waits on the `reduced` counters).
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
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::clock::remaining;
use crate::config::Transport;
use crate::error::CommError;
use crate::rendezvous::store::Store;
use crate::transport::mesh::Mesh;
use crate::transport::topology::{host_identity, Topology};
use crate::wire::{Header, OpDesc, HEADER_BYTES};

const MAGIC: [u8; 8] = *b"DDPSHM02";
/// Offset of slot b's control block: `copied` at +0, the fingerprint at +8, `copied`'s sleeper
/// count at +64, `reduced` at +128 and its sleeper count at +192 (each on its own cache line).
const CONTROL_OFFSET: usize = 256;
const CONTROL_BYTES: usize = 256;
/// Where slot 0's data begins (page aligned, so every element type is aligned).
const DATA_OFFSET: usize = 4096;
/// The data bytes per slot. Small enough that a piece, the peers' parts of it and the
/// accumulator stay in a core's L2 (1 MiB here); larger pieces measured slower
/// (`cargo xtask bench-allreduce`, docs/results.md).
pub(crate) const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// How long a parked waiter sleeps at most before it checks the group's state again.
const PARK_STEP: Duration = Duration::from_millis(5);

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
    topology: Topology,
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

/// Who sets up shared memory, and how (the arguments of [`ShmGroup::setup`]).
pub(crate) struct ShmSetup<'a> {
    pub rank: usize,
    pub world: usize,
    pub job_id: &'a [u8; 16],
    pub transport: Transport,
    /// `DDP_HOST_ID`, else [`host_identity`].
    pub host_id: Option<&'a str>,
    /// The group's deadline of every wait (here: on a peer's counter).
    pub timeout: Duration,
    /// The group's start-up deadline (here: the store exchanges).
    pub deadline: Instant,
}

impl ShmGroup {
    /// Sets up shared memory for the group, as the module documentation says, in four steps:
    /// our segment, everyone's entry (the hosts), our host's segments mapped, and the verdict
    /// every rank agrees on. `Ok(None)` when the group uses TCP alone (`DDP_TRANSPORT=tcp`, one
    /// rank per host, a segment that could not be mapped with `auto`).
    pub(crate) fn setup(store: &Store, s: &ShmSetup) -> Result<Option<ShmGroup>, CommError> {
        let (rank, world) = (s.rank, s.world);
        if s.transport == Transport::Tcp || world < 2 {
            return Ok(None);
        }
        let slot_bytes = DEFAULT_SLOT_BYTES;
        let len = DATA_OFFSET + 2 * slot_bytes;
        let host = s.host_id.map_or_else(host_identity, str::to_string);

        let (file, own) = create_segment(rank, world, s.job_id, len)?;
        // "pid fd len host" (the host last: it may contain spaces).
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let entry = format!("{} {fd} {len} {host}", std::process::id());
        store.set(&format!("ddp/shm/{rank}"), entry.as_bytes())?;
        let mut entries: Vec<String> = vec![entry; world];
        for peer in (0..world).filter(|&p| p != rank) {
            let raw = store.get_timeout(&format!("ddp/shm/{peer}"), remaining(s.deadline))?;
            entries[peer] = String::from_utf8_lossy(&raw).into_owned();
        }
        let hosts: Vec<String> = entries
            .iter()
            .map(|e| e.splitn(4, ' ').nth(3).unwrap_or("").to_string())
            .collect();
        let topology = Topology::from_hosts(&hosts);
        let members = topology.host_ranks(rank);

        // Our host's segments, ours included; the first reason one cannot be used.
        let mut maps: Vec<Mapping> = Vec::with_capacity(members.len());
        let mut own = Some(own);
        let mut why_not: Option<String> = None;
        for &peer in &members {
            if peer == rank {
                maps.extend(own.take());
                continue;
            }
            match map_peer(&entries[peer], peer, s.job_id, len, rank) {
                Ok(m) => maps.push(m),
                Err(reason) => {
                    why_not.get_or_insert(format!("rank {peer}: {reason}"));
                }
            }
        }
        if let Some(reason) = agree(store, s, &topology, why_not)? {
            tracing::debug!("rank {rank}: TCP carries the collectives ({reason})");
            return Ok(None);
        }
        if topology.is_flat() {
            tracing::debug!("rank {rank}: shared memory carries the collectives");
        } else {
            tracing::debug!(
                "rank {rank}: {} hosts: shared memory inside each (ours: ranks {members:?}), TCP between the leaders {:?}",
                topology.leaders().len(),
                topology.leaders()
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
        let me = members
            .iter()
            .position(|&r| r == rank)
            .expect("we are a member");
        Ok(Some(ShmGroup {
            rank,
            me,
            members,
            topology,
            slot_bytes,
            maps,
            _fd: file,
            epoch: std::cell::Cell::new(0),
            timeout: s.timeout,
            spin,
            yield_for,
        }))
    }

    /// The group's topology (hosts and their leaders).
    pub(crate) fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The index of global `rank` among this host's ranks (`None`: another host).
    pub(crate) fn local_index(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }

    /// Our index among this host's ranks (0: we lead the host).
    pub(crate) fn me(&self) -> usize {
        self.me
    }

    /// The number of ranks on this host.
    pub(crate) fn local_world(&self) -> usize {
        self.members.len()
    }

    /// Whether this rank leads its host.
    pub(crate) fn is_leader(&self) -> bool {
        self.me == 0
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
    pub(crate) unsafe fn slot<T>(&self, i: usize, slot: usize, start: usize, len: usize) -> &[T] {
        std::slice::from_raw_parts(self.slot_ptr::<T>(i, slot).add(start), len)
    }

    /// Our own slot, to write into.
    ///
    /// # Safety
    /// As [`ShmGroup::slot`], and nobody may read the range while the slice lives. The memory is
    /// the mapping's, shared with other processes, not data owned through `&self`: hence a
    /// mutable slice from a shared reference.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn own_slot<T>(&self, slot: usize, start: usize, len: usize) -> &mut [T] {
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
    pub(crate) fn next_piece(&self) -> (u64, usize) {
        let epoch = self.epoch.get() + 1;
        self.epoch.set(epoch);
        (epoch, (epoch % 2) as usize)
    }

    /// Stores our `copied` (or `reduced`) counter of `slot` and wakes its sleepers, if any.
    pub(crate) fn signal(&self, slot: usize, epoch: u64, reduced: bool) {
        let (counter, sleepers) = self.counter(self.me, slot, reduced);
        // SeqCst on both sides (here and in `wait_one`): either the sleeper sees the new value
        // before it sleeps, or we see its sleeper count and wake it.
        counter.store(epoch, Ordering::SeqCst);
        if sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(counter);
        }
    }

    /// Publishes that our slot holds piece `epoch` of collective `desc`.
    pub(crate) fn publish(&self, slot: usize, epoch: u64, desc: &OpDesc) {
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
    pub(crate) fn wait_peers(
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
            if mesh.health().is_failed() {
                if let Some(e) = mesh.health().error() {
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

    /// The elements of `T` that fit in one slot: the size of a piece.
    pub(crate) fn piece_elems<T>(&self) -> usize {
        (self.slot_bytes / std::mem::size_of::<T>()).max(1)
    }
}

/// Creates this rank's segment (an anonymous memfd of `len` bytes), maps it and writes its
/// header (magic, job id, rank, world).
fn create_segment(
    rank: usize,
    world: usize,
    job_id: &[u8; 16],
    len: usize,
) -> Result<(std::fs::File, Mapping), CommError> {
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
    Ok((file, own))
}

/// The verdict every rank reaches alike: publishes whether this rank could map its host's
/// segments (`why_not`: the first reason it could not) and reads every rank's. `Ok(None)`:
/// shared memory for all; `Ok(Some(reason))`: TCP alone for all (a rank could not map, or no
/// two ranks share a host); an error when some rank could not map and `DDP_TRANSPORT=shm`.
fn agree(
    store: &Store,
    s: &ShmSetup,
    topology: &Topology,
    mut why_not: Option<String>,
) -> Result<Option<String>, CommError> {
    let rank = s.rank;
    store.set(
        &format!("ddp/shm/ok/{rank}"),
        why_not.as_deref().unwrap_or("ok").as_bytes(),
    )?;
    for peer in (0..s.world).filter(|&p| p != rank) {
        let raw = store.get_timeout(&format!("ddp/shm/ok/{peer}"), remaining(s.deadline))?;
        if raw != b"ok" && why_not.is_none() {
            why_not = Some(format!(
                "rank {peer} could not map its host's segments: {}",
                String::from_utf8_lossy(&raw)
            ));
        }
    }
    if let Some(reason) = why_not {
        if s.transport == Transport::Shm {
            return Err(CommError::config(
                "DDP_TRANSPORT",
                format!("DDP_TRANSPORT=shm, but rank {rank} cannot use shared memory: {reason}"),
            ));
        }
        return Ok(Some(reason));
    }
    if topology.one_rank_per_host() {
        return Ok(Some("one rank per host".into()));
    }
    Ok(None)
}

fn sys_err(rank: usize, what: &str) -> CommError {
    CommError::Internal {
        rank,
        message: format!("shared memory: {what}: {}", std::io::Error::last_os_error()),
    }
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
