//! The TCP transport, once the mesh of peer connections stands (`connect.rs` builds it): one
//! reader and one writer thread per connection, credit-based flow control, liveness, and failure
//! propagation. It knows nothing of algorithms: they see only [`Mesh::send`] and [`Mesh::recv`].
//!
//! Flow control: a writer sends a DATA frame only with credit (at most [`LINK_CREDITS`] frames
//! that the peer has not consumed; see `wire.rs`, CREDIT), and the communication thread grants
//! the peer more as it consumes the peer's frames, so no peer can make this rank hold more than
//! 16 segments per link, and a peer that tries is named in a protocol error. A writer waiting
//! for credit does not block the communication thread (sends are queued), sends the credits this
//! rank owes the peer (they must not wait behind its data: two writers would wait for each
//! other), and sends heartbeats itself.
//!
//! Why a reader thread per peer: a rank must notice a peer's socket closing, or an ABORT frame,
//! *while it waits on some other peer* (rank 1 waiting on rank 0 in a ring must still learn at
//! once that rank 3 died). Each reader drains its socket into a channel and, on EOF, an I/O error,
//! a malformed frame or an ABORT, marks the whole group failed ([`Shared::fail`]): the first
//! error is kept as the root cause, every waiter is woken, and an ABORT frame carrying the cause
//! goes to every peer. The communication thread waits on one peer's channel and on the failure
//! signal at once, with the group's deadline, so no wait can outlive the deadline or miss a
//! failure elsewhere.
//!
//! Why a writer thread per peer: sends are queued and return at once, so the communication thread
//! can receive and reduce segment k+1 while segment k is still on the wire to the right
//! neighbour, and two ranks sending to each other can never deadlock on full socket buffers
//! (every reader keeps draining). After a failure a writer drops its queued data frames and sends
//! only the ABORT.
//!
//! Who failed first (attribution). When rank k is killed, every survivor sees its sockets to k
//! close, and it may also see the sockets of *other* ranks close: rank j that failed because of
//! k exits too, and its close can reach a survivor before the survivor's own reader of k's socket
//! has run (two cores, many threads). Blaming whichever socket event comes first would then send
//! the user to the wrong machine. So a lost connection is only *evidence* ([`Shared::peer_lost`]):
//! the group waits a short grace period ([`LOSS_GRACE`]) for an ABORT frame that explains it,
//! and an ABORT (which names the rank its sender blames, itself decided the same way) settles the
//! matter at once. A rank that fails always gets its ABORTs onto the wire before its collective
//! returns the error to the caller ([`Mesh::flush_aborts`]), so a process that exits right after
//! an error has still explained itself, and the bytes of the ABORT precede its close on every
//! socket (a reader reads the ABORT before it sees the end of the stream). Without an ABORT by the
//! end of the grace period, the first connection lost is the root cause. Waits that find a link
//! gone wait for this verdict too ([`Mesh::recv`], [`Mesh::send`]), so every error a caller
//! sees carries the group's one root cause.
//!
//! Memory lent by the communication thread. A writer sends a DATA frame either from a pool
//! buffer it owns ([`Mesh::send`]) or straight from the running collective's buffer
//! ([`Mesh::send_lent`]); a reader reads a DATA payload into a pool buffer, or straight into the
//! collective's buffer when the communication thread posted a receive for that very frame before
//! it arrived ([`Mesh::recv_into`]: the post names the link's frame number, the collective and
//! the length, and only the reader that takes it out of its slot writes to it). Each such use is
//! a loan counted per link, and a collective ends with [`Mesh::settle`], which waits until every
//! loan is back, so the caller's buffer is never freed or changed under a thread; after a
//! failure a thread stuck in a system call on a stuck peer's socket is freed by shutting the
//! socket down.
//!
//! Clean shutdown: each writer sends a GOODBYE frame after its queue and half-closes its socket;
//! a reader that sees GOODBYE half-closes its side in answer, so both readers reach EOF at once
//! and the connection is closed without resets. A peer's close without GOODBYE is a failure.

use std::io::{self, BufReader, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, unbounded, Receiver, Sender};

use crate::element::Element;
use crate::error::CommError;
use crate::flight::FlightRecorder;
use crate::wire::{self, FrameKind, Header, OpDesc, HEADER_BYTES};

/// Longest the shutdown of a group waits for its peers to close their side.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long a lost connection waits for an ABORT frame that explains it before it is taken as
/// the root cause itself (see the module's notes on attribution).
pub(crate) const LOSS_GRACE: Duration = Duration::from_millis(400);
/// Longest a failed rank waits for its writers to put the ABORT frames on the wire.
const ABORT_FLUSH: Duration = Duration::from_secs(2);
/// How much longer than the group's deadline [`crate::Work::wait`] lets a group sit without
/// progress: enough for a collective's own deadline, the attribution and the ABORT flush to
/// report first.
pub(crate) const STALL_MARGIN: Duration = Duration::from_secs(5);

/// DATA frames a rank may have on a link that the receiver has not consumed yet (see `wire.rs`,
/// CREDIT): what bounds the memory a peer can make a rank hold, 16 segments per link (16 MiB at
/// the default 1 MiB segments), and still enough to keep a pipelined ring busy.
pub(crate) const LINK_CREDITS: u64 = 16;

/// A link's flow control. `granted`: the credits the peer has granted us beyond the first
/// [`LINK_CREDITS`], raised by the link's reader on every CREDIT frame and waited on by its
/// writer before each DATA frame. `to_grant`: credits the communication thread has granted the
/// peer that the writer has yet to send; they must not wait behind DATA frames queued to the
/// writer (two writers each waiting for the other's credit would deadlock), so the writer sends
/// them whenever it looks: on a nudge through its queue, and while it waits for credit itself.
struct Credits {
    granted: Mutex<u64>,
    changed: Condvar,
    to_grant: AtomicU64,
}

impl Credits {
    fn grant(&self, frames: u64) {
        *self.granted.lock().unwrap_or_else(|p| p.into_inner()) += frames;
        self.changed.notify_all();
    }
}

/// Time left until `deadline` (zero if passed).
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

// ---------------------------------------------------------------------------------------------
// Buffers

/// Buffers at least this many bytes long go back to their pool when dropped.
const POOL_MIN_BYTES: usize = 32 << 10;
/// Most buffers a pool keeps.
const POOL_CAPACITY: usize = 16;

/// Recycled buffer storage, so that segments do not pay for fresh (zeroed, page-faulting)
/// memory every time: a reader takes its receive buffer from here, and every large [`Buf`]
/// returns here when dropped (after a writer sent it, or after the algorithm consumed it).
pub(crate) struct Pool {
    tx: Sender<Vec<u64>>,
    rx: Receiver<Vec<u64>>,
}

impl Pool {
    pub fn new() -> Arc<Pool> {
        let (tx, rx) = crossbeam_channel::bounded(POOL_CAPACITY);
        Arc::new(Pool { tx, rx })
    }

    /// A buffer of `len` bytes with unspecified contents (the caller overwrites all of them).
    pub fn buf(self: &Arc<Self>, len: usize) -> Buf {
        let words = len.div_ceil(8);
        if len >= POOL_MIN_BYTES {
            if let Ok(mut v) = self.rx.try_recv() {
                if v.capacity() >= words {
                    v.resize(words, 0); // no work when the size repeats (the usual case)
                    return Buf {
                        words: v,
                        len,
                        pool: Some(self.clone()),
                    };
                }
            }
        }
        Buf {
            words: vec![0u64; words],
            len,
            pool: (len >= POOL_MIN_BYTES).then(|| self.clone()),
        }
    }

    /// A buffer holding a copy of `s`.
    pub fn copy_of<T: Element>(self: &Arc<Self>, s: &[T]) -> Buf {
        let bytes: &[u8] = bytemuck::cast_slice(s);
        let mut b = self.buf(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }
}

/// A byte buffer aligned to 8 bytes, so that it can be viewed as a slice of any [`Element`].
pub(crate) struct Buf {
    words: Vec<u64>,
    len: usize,
    pool: Option<Arc<Pool>>,
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            let _ = pool.tx.try_send(std::mem::take(&mut self.words));
        }
    }
}

impl Buf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }

    /// Views the bytes as elements; the length must be a multiple of the element size (the
    /// receiver checks every payload's length before this).
    pub fn as_slice<T: Element>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }
}

// ---------------------------------------------------------------------------------------------
// The running mesh

/// What the communication thread hands a writer thread.
enum Outgoing {
    Data(Header, Payload),
    /// The error text and the rank it blames.
    Abort(String, Option<usize>),
    Goodbye,
    /// "Still alive", from the liveness thread.
    Heartbeat,
    /// "Send the credits granted to the peer" (`Credits::to_grant`), from the communication
    /// thread.
    Credit,
}

/// What a reader thread hands the communication thread.
enum Incoming {
    /// A frame read into a pool buffer.
    Data(Header, Buf),
    /// A frame read straight into the posted receive's memory (see [`Mesh::recv_into`]); the
    /// reader checked that it belongs to the posted collective and has the posted length.
    Landed,
    Goodbye,
}

/// Memory of the running collective that a link's reader or writer thread uses without owning
/// it: the caller's buffer, sent from in place ([`Mesh::send_lent`]) or received into in place
/// ([`Mesh::recv_into`]). Counted per link until the thread is done with it;
/// [`Mesh::settle`] waits for the count to reach zero before the collective may return.
#[derive(Default)]
struct Loans {
    out: Mutex<u64>,
    returned: Condvar,
}

impl Loans {
    fn lend(self: &Arc<Self>) -> Loan {
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Loan(self.clone())
    }
}

/// One outstanding loan: dropping it returns it.
struct Loan(Arc<Loans>);

impl Drop for Loan {
    fn drop(&mut self) {
        let mut out = self.0.out.lock().unwrap_or_else(|p| p.into_inner());
        *out -= 1;
        if *out == 0 {
            self.0.returned.notify_all();
        }
    }
}

/// The bytes of a DATA frame: a pool buffer the writer owns, or memory lent by the
/// communication thread for as long as the loan is out ([`Mesh::send_lent`]).
enum Payload {
    Owned(Buf),
    Lent {
        ptr: *const u8,
        len: usize,
        _loan: Loan,
    },
}

// SAFETY: lent memory is only read, and its lender keeps it alive and unmodified until the loan
// is returned (the contract of `Mesh::send_lent`, enforced by `Mesh::settle`).
unsafe impl Send for Payload {}

impl Payload {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Owned(b) => b.as_bytes(),
            // SAFETY: see `unsafe impl Send for Payload`.
            Payload::Lent { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

/// A receive posted by the communication thread ([`Mesh::recv_into`]): the payload of the
/// link's DATA frame number `frame`, if it belongs to `desc` and has `len` bytes, goes straight
/// to `ptr` instead of into a pool buffer.
struct Post {
    frame: u64,
    desc: OpDesc,
    ptr: *mut u8,
    len: usize,
    _loan: Loan,
}

// SAFETY: the poster keeps the memory alive and untouched until the loan is returned (the
// contract of `Mesh::recv_into`, enforced by `Mesh::settle`); only the thread that takes the
// post out of its slot writes to it.
unsafe impl Send for Post {}

/// A link's slot for the receive posted by the communication thread, taken by the reader.
type PostSlot = Arc<Mutex<Option<Post>>>;

/// State shared by the communication thread and every reader and writer thread of a group.
pub(crate) struct Shared {
    rank: usize,
    failed: AtomicBool,
    closing: AtomicBool,
    error: Mutex<Option<CommError>>,
    /// Dropped on failure: every `abort_rx` then reports "disconnected", which wakes all waits.
    abort_tx: Mutex<Option<Sender<()>>>,
    abort_rx: Receiver<()>,
    writers: Mutex<Vec<Sender<Outgoing>>>,
    /// Every link's send credits: woken on failure, so that a writer waiting for credit moves
    /// on to the ABORT at once.
    credits: Mutex<Vec<Arc<Credits>>>,
    /// Connections lost (closed, reset, stuck) before the group failed, in the order seen: the
    /// evidence from which [`Shared::peer_lost`] picks a root cause if no ABORT explains it.
    lost: Mutex<Vec<CommError>>,
    /// Writers waiting for credit right now: a closing mesh waits for them (see `Mesh::drop`).
    waiting_for_credit: AtomicU64,
    /// Counts frames received and collectives finished: [`crate::Work::wait`]'s evidence that
    /// the group is still making progress.
    pub progress: AtomicU64,
    /// DATA frames read from the socket straight into a posted receive ([`Mesh::recv_into`]).
    pub landed: AtomicU64,
    /// Time origin of the links' `heard` stamps.
    epoch: Instant,
}

impl Shared {
    fn new(rank: usize) -> Shared {
        let (abort_tx, abort_rx) = crossbeam_channel::bounded(1);
        Shared {
            rank,
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            error: Mutex::new(None),
            abort_tx: Mutex::new(Some(abort_tx)),
            abort_rx,
            writers: Mutex::new(Vec::new()),
            credits: Mutex::new(Vec::new()),
            lost: Mutex::new(Vec::new()),
            waiting_for_credit: AtomicU64::new(0),
            progress: AtomicU64::new(0),
            landed: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// A connection was lost (`err` is [`CommError::PeerClosed`], [`CommError::PeerIo`] or
    /// [`CommError::PeerSilent`]):
    /// evidence, not yet a verdict. Waits up to [`LOSS_GRACE`] for the group to fail for a
    /// better-explained reason (an ABORT naming an earlier root cause); if none comes, fails the
    /// group with the first connection lost. Blocks the calling thread (a reader or writer that
    /// is ending anyway) for at most the grace period.
    fn peer_lost(&self, err: CommError) {
        if self.is_failed() {
            return;
        }
        self.lost
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(err);
        // Disconnected (returns at once) as soon as the group fails.
        let _ = self.abort_rx.recv_timeout(LOSS_GRACE);
        if self.is_failed() {
            return;
        }
        let first = self.lost.lock().unwrap_or_else(|p| p.into_inner())[0].clone();
        self.fail(first);
    }

    /// Waits until the group has failed (at most a little longer than the grace period of a
    /// lost connection) and returns its root cause, or `fallback` if it did not fail.
    fn verdict(&self, fallback: CommError) -> CommError {
        let _ = self
            .abort_rx
            .recv_timeout(LOSS_GRACE + Duration::from_secs(1));
        self.error().unwrap_or(fallback)
    }

    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The group's first error, if it failed.
    pub fn error(&self) -> Option<CommError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Marks the group failed with `err` as root cause (the first error wins), wakes every
    /// waiter and sends an ABORT carrying the cause to every peer.
    pub fn fail(&self, err: CommError) {
        {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_some() {
                return;
            }
            tracing::error!("rank {}: process group failed: {err}", self.rank);
            *slot = Some(err.clone());
            self.failed.store(true, Ordering::Release);
        }
        self.abort_tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        for c in self
            .credits
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            c.changed.notify_all();
        }
        let text = err.to_string();
        let blamed = err.peer();
        for w in self
            .writers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = w.send(Outgoing::Abort(text.clone(), blamed));
        }
    }
}

struct Link {
    tx: Sender<Outgoing>,
    rx: Receiver<Incoming>,
    stream: TcpStream,
    goodbye: Arc<AtomicBool>,
    /// When the last frame from the peer arrived, in ms since `Shared::epoch`.
    heard: Arc<AtomicU64>,
    /// DATA frames from the peer that the communication thread consumed.
    consumed: AtomicU64,
    /// Credits granted to the peer so far beyond the first [`LINK_CREDITS`] (raised before each
    /// CREDIT frame is queued; the reader checks the peer against it).
    granted: Arc<AtomicU64>,
    /// The link's flow control (the writer sends `to_grant`).
    credits: Arc<Credits>,
    /// The receive posted for the link's reader, if any.
    post: PostSlot,
    /// The running collective's memory that the link's threads are using.
    loans: Arc<Loans>,
    writer: Option<JoinHandle<()>>,
    reader: Option<JoinHandle<()>>,
}

/// The connections of one rank to all its peers, with their threads.
pub(crate) struct Mesh {
    pub rank: usize,
    pub world: usize,
    links: Vec<Option<Link>>,
    shared: Arc<Shared>,
    timeout: Duration,
    /// Disconnected once every reader and writer thread has ended.
    threads_done: Receiver<()>,
    pool: Arc<Pool>,
    /// The liveness thread, and the sender whose drop stops it.
    liveness: Option<(Sender<()>, JoinHandle<()>)>,
    peer_timeout: Duration,
}

impl Mesh {
    /// Starts a reader and a writer thread on each connection. `max_frame` caps the payload of a
    /// DATA frame a peer may send; `timeout` is the deadline of every wait.
    pub fn start(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        timeout: Duration,
        peer_timeout: Duration,
        max_frame: usize,
        flight: Arc<FlightRecorder>,
    ) -> Result<Mesh, CommError> {
        let world = streams.len();
        let shared = Arc::new(Shared::new(rank));
        let pool = Pool::new();
        let (done_tx, threads_done) = crossbeam_channel::bounded::<()>(0);
        let mut links = Vec::with_capacity(world);
        let io_err = |peer: usize, e: io::Error| CommError::PeerIo {
            rank,
            peer,
            message: format!("setting up the connection: {e}"),
        };
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                links.push(None);
                continue;
            };
            stream.set_nodelay(true).map_err(|e| io_err(peer, e))?;
            stream
                .set_write_timeout(Some(timeout))
                .map_err(|e| io_err(peer, e))?;
            stream.set_read_timeout(None).map_err(|e| io_err(peer, e))?;
            let (tx, wrx) = unbounded();
            let (rtx, rx) = unbounded();
            let goodbye = Arc::new(AtomicBool::new(false));
            let heard = Arc::new(AtomicU64::new(0));
            let credits = Arc::new(Credits {
                granted: Mutex::new(0),
                changed: Condvar::new(),
                to_grant: AtomicU64::new(0),
            });
            let granted = Arc::new(AtomicU64::new(0));
            let post: PostSlot = Arc::new(Mutex::new(None));
            let loans = Arc::new(Loans::default());
            shared.credits.lock().unwrap().push(credits.clone());
            let w_stream = stream.try_clone().map_err(|e| io_err(peer, e))?;
            let r_stream = stream.try_clone().map_err(|e| io_err(peer, e))?;
            let (sh, gb, done, cr) = (
                shared.clone(),
                goodbye.clone(),
                done_tx.clone(),
                credits.clone(),
            );
            let writer = std::thread::Builder::new()
                .name(format!("ddp-w{rank}->{peer}"))
                .spawn(move || {
                    let side = LinkSide {
                        rank,
                        peer,
                        shared: sh,
                        goodbye: gb,
                        heard: None,
                        credits: cr,
                        granted: None,
                        post: None,
                    };
                    writer_loop(
                        w_stream,
                        side,
                        wrx,
                        timeout,
                        heartbeat_interval(peer_timeout),
                    );
                    drop(done);
                })
                .map_err(|e| io_err(peer, e))?;
            let (sh, gb, done, pl, hd, cr, gr, po) = (
                shared.clone(),
                goodbye.clone(),
                done_tx.clone(),
                pool.clone(),
                heard.clone(),
                credits.clone(),
                granted.clone(),
                post.clone(),
            );
            let reader = std::thread::Builder::new()
                .name(format!("ddp-r{rank}<-{peer}"))
                .spawn(move || {
                    let side = LinkSide {
                        rank,
                        peer,
                        shared: sh,
                        goodbye: gb,
                        heard: Some(hd),
                        credits: cr,
                        granted: Some(gr),
                        post: Some(po),
                    };
                    reader_loop(r_stream, side, rtx, pl, max_frame);
                    drop(done);
                })
                .map_err(|e| io_err(peer, e))?;
            shared.writers.lock().unwrap().push(tx.clone());
            links.push(Some(Link {
                tx,
                rx,
                stream,
                goodbye,
                heard,
                consumed: AtomicU64::new(0),
                granted,
                credits,
                post,
                loans,
                writer: Some(writer),
                reader: Some(reader),
            }));
        }
        let liveness = start_liveness(rank, &links, &shared, peer_timeout, flight)?;
        Ok(Mesh {
            rank,
            world,
            links,
            shared,
            timeout,
            threads_done,
            pool,
            liveness: Some(liveness),
            peer_timeout,
        })
    }

    /// A buffer holding a copy of `s`, from the mesh's pool.
    pub fn copy_of<T: Element>(&self, s: &[T]) -> Buf {
        self.pool.copy_of(s)
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn link(&self, peer: usize) -> &Link {
        self.links[peer].as_ref().expect("no link to self")
    }

    /// Whether `peer` has said GOODBYE (dropped its group cleanly): it sends nothing more, and
    /// a collective that still waits for it will wait in vain (see `shm.rs`, where no frame
    /// tells the waiter so).
    pub fn said_goodbye(&self, peer: usize) -> bool {
        self.link(peer).goodbye.load(Ordering::Acquire)
    }

    /// The error to report when a link's thread is gone: the group's root cause, once the
    /// group has settled who failed first (a lost link waits for that verdict).
    fn gone(&self, peer: usize) -> CommError {
        if let Some(e) = self.shared.error() {
            return e;
        }
        if self.link(peer).goodbye.load(Ordering::Acquire) {
            CommError::PeerLeft {
                rank: self.rank,
                peer,
            }
        } else {
            self.shared.verdict(CommError::PeerClosed {
                rank: self.rank,
                peer,
            })
        }
    }

    /// After a failure: waits (at most [`ABORT_FLUSH`]) until every writer has put its ABORT on
    /// the wire, so that a process that exits right after the error has still told every peer
    /// why. Writers end after their ABORT; a writer stuck on a dead peer's full socket ends at
    /// its write timeout, which this does not wait for.
    pub fn flush_aborts(&self) {
        let deadline = Instant::now() + ABORT_FLUSH;
        while Instant::now() < deadline {
            let pending = self
                .links
                .iter()
                .flatten()
                .any(|l| l.writer.as_ref().is_some_and(|w| !w.is_finished()));
            if !pending {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Queues one DATA frame of collective `desc` to `peer`; returns at once.
    pub fn send(&self, peer: usize, desc: &OpDesc, payload: Buf) -> Result<(), CommError> {
        self.queue(peer, desc, Payload::Owned(payload))
    }

    /// Queues one DATA frame of collective `desc` to `peer` that the link's writer sends straight
    /// from `bytes`, without a copy; returns at once.
    ///
    /// # Safety
    ///
    /// `bytes` must stay alive and unmodified until [`Mesh::settle`] has returned: the writer
    /// reads them at some point before then.
    pub unsafe fn send_lent(
        &self,
        peer: usize,
        desc: &OpDesc,
        bytes: &[u8],
    ) -> Result<(), CommError> {
        let payload = Payload::Lent {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
            _loan: self.link(peer).loans.lend(),
        };
        self.queue(peer, desc, payload)
    }

    fn queue(&self, peer: usize, desc: &OpDesc, payload: Payload) -> Result<(), CommError> {
        if let Some(e) = self.shared.error() {
            return Err(e);
        }
        let header = Header::data(desc, payload.as_bytes().len());
        self.link(peer)
            .tx
            .send(Outgoing::Data(header, payload))
            .map_err(|_| self.gone(peer))
    }

    /// Waits (at most the group's timeout) for the next DATA frame from `peer`, which must belong
    /// to collective `desc` and carry exactly `expected_len` bytes.
    pub fn recv(&self, peer: usize, desc: &OpDesc, expected_len: usize) -> Result<Buf, CommError> {
        match self.next(peer, desc)? {
            Incoming::Data(header, buf) => {
                self.check(peer, desc, &header, buf.len(), expected_len)?;
                Ok(buf)
            }
            _ => Err(CommError::Internal {
                rank: self.rank,
                message: format!("a frame from rank {peer} landed with no receive posted"),
            }),
        }
    }

    /// Receives the next DATA frame from `peer`, which must belong to collective `desc` and
    /// carry exactly `dst.len()` bytes, into `dst`: the link's reader reads the payload from the
    /// socket straight into `dst` when the receive is posted before the frame arrives, and it
    /// is copied from a pool buffer otherwise.
    ///
    /// # Safety
    ///
    /// On an error the reader may still be writing to `dst`: `dst` must stay alive, and be
    /// neither read nor written, until [`Mesh::settle`] has returned.
    pub unsafe fn recv_into(
        &self,
        peer: usize,
        desc: &OpDesc,
        dst: &mut [u8],
    ) -> Result<(), CommError> {
        let link = self.link(peer);
        let frame = link.consumed.load(Ordering::Relaxed) + 1;
        *link.post.lock().unwrap_or_else(|p| p.into_inner()) = Some(Post {
            frame,
            desc: *desc,
            ptr: dst.as_mut_ptr(),
            len: dst.len(),
            _loan: link.loans.lend(),
        });
        let got = self.next(peer, desc);
        // Not wanted any more, unless the reader has taken it (then its loan is out until the
        // reader is done with `dst`).
        drop(link.post.lock().unwrap_or_else(|p| p.into_inner()).take());
        match got? {
            Incoming::Landed => Ok(()),
            Incoming::Data(header, buf) => {
                self.check(peer, desc, &header, buf.len(), dst.len())?;
                dst.copy_from_slice(buf.as_bytes());
                Ok(())
            }
            Incoming::Goodbye => unreachable!("`next` turns GOODBYE into an error"),
        }
    }

    /// Waits (at most the group's timeout) for the next frame from `peer` and counts it as
    /// consumed, granting the peer more credit.
    fn next(&self, peer: usize, desc: &OpDesc) -> Result<Incoming, CommError> {
        let link = self.link(peer);
        let deadline = Instant::now() + self.timeout;
        let msg = select! {
            recv(link.rx) -> msg => msg,
            recv(self.shared.abort_rx) -> _ => {
                return Err(self.shared.error().unwrap_or(CommError::Internal {
                    rank: self.rank,
                    message: "failure signalled without an error".into(),
                }))
            }
            default(remaining(deadline)) => {
                return Err(CommError::Timeout { rank: self.rank, peer, op: desc.to_string(), timeout: self.timeout })
            }
        };
        match msg {
            Ok(Incoming::Goodbye) => Err(CommError::PeerLeft {
                rank: self.rank,
                peer,
            }),
            Ok(frame) => {
                // Consumed: grant the peer more credit, half the window at a time.
                let consumed = link.consumed.fetch_add(1, Ordering::Relaxed) + 1;
                let granted = link.granted.load(Ordering::Relaxed);
                if consumed - granted >= LINK_CREDITS / 2 {
                    link.granted.store(consumed, Ordering::Release);
                    link.credits
                        .to_grant
                        .fetch_add(consumed - granted, Ordering::AcqRel);
                    let _ = link.tx.send(Outgoing::Credit);
                    link.credits.changed.notify_all(); // a writer waiting for credit sends it
                }
                Ok(frame)
            }
            Err(_) => Err(self.gone(peer)),
        }
    }

    /// Checks that a frame from `peer` belongs to `desc` and has the expected length.
    fn check(
        &self,
        peer: usize,
        desc: &OpDesc,
        header: &Header,
        len: usize,
        expected_len: usize,
    ) -> Result<(), CommError> {
        if header.desc().as_ref() != Some(desc) {
            return Err(CommError::Mismatch {
                rank: self.rank,
                peer,
                ours: desc.to_string(),
                theirs: header.describe(),
            });
        }
        if len != expected_len {
            return Err(CommError::Protocol {
                rank: self.rank,
                peer,
                message: format!(
                    "in {desc} rank {peer} sent a segment of {len} bytes where {expected_len} were expected \
                     (do all ranks use the same segment size?)"
                ),
            });
        }
        Ok(())
    }

    /// Ends the collective `desc` whose algorithm returned `outcome`: waits until every reader
    /// and writer thread is done with the memory the collective lent them
    /// ([`Mesh::send_lent`], [`Mesh::recv_into`]), so that the caller may reuse or free it.
    ///
    /// After a success, lent sends may still be on their way (a peer has yet to consume them):
    /// waits for them while the peers make progress, at most the group's timeout (then the
    /// group fails with a timeout naming the peer). After an error the group fails first (its
    /// writers drop their queued frames and send the ABORT); a thread that still holds a loan
    /// [`ABORT_FLUSH`] later is blocked in a send to or a receive from a stuck peer, and
    /// shutting that link's socket down ends the blocked call at once (a shut-down socket
    /// fails every send and ends every receive), so every loan comes back promptly.
    /// Returns `outcome`, or the timeout.
    pub fn settle(&self, desc: &OpDesc, outcome: Result<(), CommError>) -> Result<(), CommError> {
        if let Err(e) = &outcome {
            self.shared.fail(e.clone());
        }
        let start = Instant::now();
        let mut failed_at = None;
        let mut timed_out = None;
        for (peer, link) in self.links.iter().enumerate() {
            let Some(link) = link else { continue };
            let mut shut = false;
            let mut out = link.loans.out.lock().unwrap_or_else(|p| p.into_inner());
            while *out > 0 {
                let now = Instant::now();
                if self.shared.is_failed() {
                    let since = *failed_at.get_or_insert(now);
                    if !shut && now >= since + ABORT_FLUSH {
                        let _ = link.stream.shutdown(Shutdown::Both);
                        shut = true;
                    }
                    // Past this, a thread with a loan would be stuck between two system calls
                    // on a shut-down socket, which cannot happen: letting the caller free the
                    // memory it uses would be worse than stopping.
                    if now >= since + ABORT_FLUSH + CLOSE_GRACE * 5 {
                        eprintln!(
                            "rank {}: a transport thread of the link to rank {peer} kept memory of {desc} \
                             after its socket was shut down; aborting",
                            self.rank
                        );
                        std::process::abort();
                    }
                } else if now >= start + self.timeout {
                    let err = CommError::Timeout {
                        rank: self.rank,
                        peer,
                        op: format!("{desc} (sending to rank {peer})"),
                        timeout: self.timeout,
                    };
                    timed_out.get_or_insert(err.clone());
                    drop(out);
                    self.shared.fail(err);
                    out = link.loans.out.lock().unwrap_or_else(|p| p.into_inner());
                    continue;
                }
                out = link
                    .loans
                    .returned
                    .wait_timeout(out, Duration::from_millis(20))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        match timed_out {
            Some(e) if outcome.is_ok() => Err(e),
            _ => outcome,
        }
    }
}

impl Mesh {
    /// Whether a peer that has not said goodbye has been silent for the peer timeout.
    fn any_peer_silent(&self) -> bool {
        let now = self.shared.epoch.elapsed().as_millis() as u64;
        let limit = self.peer_timeout.as_millis() as u64;
        self.links.iter().flatten().any(|l| {
            !l.goodbye.load(Ordering::Acquire)
                && now.saturating_sub(l.heard.load(Ordering::Relaxed)) > limit
        })
    }
}

impl Drop for Mesh {
    /// Clean shutdown: GOODBYE to every peer (unless the group failed: then the ABORTs are
    /// already queued), then wait briefly for the writers to finish and for the peers to close
    /// their side, then close whatever is left (a stuck peer cannot hold this up).
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        if let Some((stop, thread)) = self.liveness.take() {
            drop(stop);
            let _ = thread.join();
        }
        for link in self.links.iter().flatten() {
            let _ = link.tx.send(Outgoing::Goodbye);
        }
        self.shared
            .writers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        // Wait for the threads: CLOSE_GRACE at most, but longer (up to the group's deadline)
        // while a writer still waits for credit to deliver frames queued before the drop and
        // every peer is alive (heard from within the peer timeout): a peer busy in a long step
        // consumes them later, and must get them.
        let start = Instant::now();
        loop {
            let now = Instant::now();
            let extend = self.shared.waiting_for_credit.load(Ordering::Acquire) > 0
                && !self.shared.is_failed()
                && now < start + self.timeout
                && !self.any_peer_silent();
            let end = if extend {
                now + Duration::from_millis(50)
            } else {
                start + self.timeout.min(CLOSE_GRACE)
            };
            match self.threads_done.recv_deadline(end) {
                Err(crossbeam_channel::RecvTimeoutError::Timeout) if !extend => break,
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                _ => {}
            }
        }
        for link in self.links.iter_mut().flatten() {
            let _ = link.stream.shutdown(Shutdown::Both);
            for thread in [link.writer.take(), link.reader.take()]
                .into_iter()
                .flatten()
            {
                let _ = thread.join();
            }
        }
    }
}

/// What a link's reader and writer threads share.
struct LinkSide {
    rank: usize,
    peer: usize,
    shared: Arc<Shared>,
    goodbye: Arc<AtomicBool>,
    /// The reader's: stamped with every frame that arrives.
    heard: Option<Arc<AtomicU64>>,
    /// Credits the peer granted us (raised by the reader, spent by the writer).
    credits: Arc<Credits>,
    /// The reader's: credits we granted the peer beyond the first [`LINK_CREDITS`].
    granted: Option<Arc<AtomicU64>>,
    /// The reader's: the receive posted by the communication thread.
    post: Option<PostSlot>,
}

/// How often heartbeats go out: a fifth of the peer timeout, 20 ms to 1 s.
fn heartbeat_interval(peer_timeout: Duration) -> Duration {
    (peer_timeout / 5).clamp(Duration::from_millis(20), Duration::from_secs(1))
}

/// Starts the liveness thread of a mesh: every `peer_timeout / 5` (20 ms to 1 s) it queues a
/// HEARTBEAT on every link and looks at when each peer was last heard from. A peer silent for
/// `peer_timeout` (no frame at all: its own liveness thread would have sent several) is lost
/// ([`CommError::PeerSilent`], through [`Shared::peer_lost`] like a closed socket).
///
/// Why a thread of its own: liveness must not depend on the training loop. A rank busy in a
/// long step keeps sending heartbeats and is never declared dead; a rank that is frozen
/// (SIGSTOP, a hung kernel call) or cut off by the network sends nothing, and is named within
/// `peer_timeout` instead of at the collective deadline (minutes). A peer that is alive but
/// never enters a collective (a desync) is still caught by the collective deadline.
///
/// The same thread answers SIGUSR1 by dumping the flight recorder (see [`crate::flight`]), and
/// dumps it once more when the group fails.
fn start_liveness(
    rank: usize,
    links: &[Option<Link>],
    shared: &Arc<Shared>,
    peer_timeout: Duration,
    flight: Arc<FlightRecorder>,
) -> Result<(Sender<()>, JoinHandle<()>), CommError> {
    let interval = heartbeat_interval(peer_timeout);
    // (peer, its writer's queue, when it was last heard from, whether it said goodbye)
    type Watched = (usize, Sender<Outgoing>, Arc<AtomicU64>, Arc<AtomicBool>);
    let watched: Vec<Watched> = links
        .iter()
        .enumerate()
        .filter_map(|(peer, l)| {
            l.as_ref()
                .map(|l| (peer, l.tx.clone(), l.heard.clone(), l.goodbye.clone()))
        })
        .collect();
    let shared = shared.clone();
    let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
    let limit = peer_timeout.as_millis() as u64;
    let thread = std::thread::Builder::new()
        .name(format!("ddp-live-{rank}"))
        .spawn(move || loop {
            if shared.closing.load(Ordering::Acquire) {
                return;
            }
            if shared.is_failed() {
                // The group failed, maybe while this rank was outside any collective (a peer
                // lost, an ABORT received): leave the record of where it was, since nothing
                // answers SIGUSR1 from now on.
                flight.dump("failure");
                return;
            }
            for (_, tx, _, _) in &watched {
                let _ = tx.send(Outgoing::Heartbeat);
            }
            flight.poll_signal();
            let now = shared.epoch.elapsed().as_millis() as u64;
            let silent = watched.iter().find(|(_, _, heard, goodbye)| {
                !goodbye.load(Ordering::Acquire)
                    && now.saturating_sub(heard.load(Ordering::Relaxed)) > limit
            });
            if let Some((peer, _, heard, _)) = silent {
                let silent_for = now.saturating_sub(heard.load(Ordering::Relaxed));
                shared.peer_lost(CommError::PeerSilent {
                    rank,
                    peer: *peer,
                    silent_for: Duration::from_millis(silent_for),
                });
                return;
            }
            match stopped.recv_timeout(interval) {
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                _ => return, // the mesh is closing
            }
        })
        .map_err(|e| CommError::Internal {
            rank,
            message: format!("cannot start the liveness thread: {e}"),
        })?;
    Ok((stop, thread))
}

/// The writer of one link: sends what the communication and liveness threads queue, in order.
/// A DATA frame first waits for credit (see `wire.rs`, CREDIT); while it waits, the writer sends
/// a heartbeat itself every `interval`, so that a peer that is slow to consume (a long step)
/// never takes this rank for dead.
fn writer_loop(
    mut stream: TcpStream,
    side: LinkSide,
    rx: Receiver<Outgoing>,
    timeout: Duration,
    interval: Duration,
) {
    let LinkSide {
        rank,
        peer,
        shared,
        goodbye,
        credits,
        ..
    } = side;
    let heartbeat = Header::control(FrameKind::Heartbeat, 0);
    let mut sent: u64 = 0;
    // Sends the credits granted to the peer since the last CREDIT frame, if any.
    let send_grants = |stream: &mut TcpStream| -> io::Result<()> {
        let frames = credits.to_grant.swap(0, Ordering::AcqRel);
        if frames == 0 {
            return Ok(());
        }
        let mut header = Header::control(FrameKind::Credit, 0);
        header.arg = frames.min(u64::from(u32::MAX)) as u32;
        wire::write_frame(stream, &header, &[])
    };
    // Waits until DATA frame number `sent + 1` has credit: Ok(false) if the group failed
    // meanwhile (the frame is dropped), an error if a heartbeat could not be written.
    let wait_for_credit_slow = |stream: &mut TcpStream, sent: u64| -> io::Result<bool> {
        loop {
            send_grants(stream)?;
            {
                let granted = credits.granted.lock().unwrap_or_else(|p| p.into_inner());
                if sent < LINK_CREDITS + *granted {
                    return Ok(true);
                }
                // (Closing is no reason to drop data: frames queued before the group was
                // dropped still go out, before the GOODBYE, as the peer consumes them.)
                if shared.is_failed() {
                    return Ok(false);
                }
                // A peer that said GOODBYE grants nothing more: it left while this rank still
                // had data for it (the caller reports that).
                if goodbye.load(Ordering::Acquire) {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        format!("rank {peer} said goodbye"),
                    ));
                }
                let (granted, waited) = credits
                    .changed
                    .wait_timeout(granted, interval)
                    .unwrap_or_else(|p| p.into_inner());
                if sent < LINK_CREDITS + *granted {
                    return Ok(true);
                }
                if !waited.timed_out() {
                    continue;
                }
            }
            if shared.is_failed() {
                return Ok(false);
            }
            wire::write_frame(stream, &heartbeat, &[])?;
        }
    };
    let wait_for_credit = |stream: &mut TcpStream, sent: u64| -> io::Result<bool> {
        if sent < LINK_CREDITS + *credits.granted.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(true);
        }
        shared.waiting_for_credit.fetch_add(1, Ordering::AcqRel);
        let waited = wait_for_credit_slow(stream, sent);
        shared.waiting_for_credit.fetch_sub(1, Ordering::AcqRel);
        waited
    };
    for msg in rx.iter() {
        let data = matches!(msg, Outgoing::Data(..));
        let written = match msg {
            Outgoing::Data(header, payload) => {
                if shared.is_failed() {
                    continue; // the protocol is over; only the ABORT matters now
                }
                match wait_for_credit(&mut stream, sent) {
                    Ok(true) => {
                        sent += 1;
                        wire::send_frame(&stream, &header, payload.as_bytes())
                    }
                    Ok(false) => continue,
                    Err(e) => Err(e),
                }
            }
            // A peer that said GOODBYE reads nothing more (its reader answered by shutting our
            // direction down): heartbeats and credits for it are moot, and not an error.
            Outgoing::Heartbeat | Outgoing::Credit
                if shared.is_failed() || goodbye.load(Ordering::Acquire) =>
            {
                continue
            }
            Outgoing::Heartbeat => wire::write_frame(&mut stream, &heartbeat, &[]),
            Outgoing::Credit => send_grants(&mut stream),
            Outgoing::Abort(text, blamed) => {
                let bytes = text.as_bytes();
                let bytes = &bytes[..bytes.len().min(wire::MAX_ABORT_BYTES)];
                let mut header = Header::control(FrameKind::Abort, bytes.len());
                header.arg = blamed.map_or(u32::MAX, |r| r.min(u32::MAX as usize - 1) as u32);
                let _ = wire::write_frame(&mut stream, &header, bytes);
                break;
            }
            Outgoing::Goodbye => {
                let _ =
                    wire::write_frame(&mut stream, &Header::control(FrameKind::Goodbye, 0), &[]);
                break;
            }
        };
        if let Err(e) = written {
            // A heartbeat or credit that raced with the peer's GOODBYE: the peer left after
            // receiving everything it needed from us, so this is the end of the link, no failure.
            // (DATA for a departed peer is: it left while this rank still needed it.)
            let quiet = !data && goodbye.load(Ordering::Acquire);
            if !quiet && !shared.closing.load(Ordering::Acquire) {
                let err = if goodbye.load(Ordering::Acquire) {
                    CommError::PeerLeft { rank, peer }
                } else {
                    match e.kind() {
                        io::ErrorKind::BrokenPipe
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted => CommError::PeerClosed { rank, peer },
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::PeerIo {
                            rank,
                            peer,
                            message: format!(
                                "sending to rank {peer} made no progress for {timeout:?} (is rank {peer} stuck?)"
                            ),
                        },
                        _ => CommError::PeerIo {
                            rank,
                            peer,
                            message: format!("sending to rank {peer}: {e}"),
                        },
                    }
                };
                match err {
                    CommError::PeerLeft { .. } => shared.fail(err),
                    _ => shared.peer_lost(err),
                }
            }
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
}

fn reader_loop(
    stream: TcpStream,
    side: LinkSide,
    tx: Sender<Incoming>,
    pool: Arc<Pool>,
    max_frame: usize,
) {
    let LinkSide {
        rank,
        peer,
        shared,
        goodbye,
        heard,
        credits,
        granted,
        post,
    } = side;
    let granted = granted.expect("a reader has the grant counter");
    let post = post.expect("a reader has the post slot");
    let mut received: u64 = 0;
    let mut reader = BufReader::with_capacity(64 << 10, &stream);
    let protocol = |message: String| CommError::Protocol {
        rank,
        peer,
        message,
    };
    let end: Option<CommError> = loop {
        let mut hb = [0u8; HEADER_BYTES];
        if let Err(e) = reader.read_exact(&mut hb) {
            break Some(read_error(rank, peer, e));
        }
        let header = match Header::decode(&hb) {
            Ok(h) => h,
            Err(msg) => break Some(protocol(msg)),
        };
        if let Some(heard) = &heard {
            heard.store(shared.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        let len = header.payload_len as usize;
        match header.kind {
            FrameKind::Data => {
                if len > max_frame {
                    break Some(protocol(format!(
                        "a frame of {len} bytes exceeds the limit of {max_frame} bytes"
                    )));
                }
                received += 1;
                if received > LINK_CREDITS + granted.load(Ordering::Acquire) && !shared.is_failed()
                {
                    break Some(protocol(format!(
                        "rank {peer} sent more than {LINK_CREDITS} segments beyond what rank {rank} \
                         had consumed (it ignores flow control); rank {rank} stopped reading so \
                         that its memory stays bounded"
                    )));
                }
                // The communication thread's posted receive, if it waits for this very frame.
                let posted = post.lock().unwrap_or_else(|p| p.into_inner()).take_if(|p| {
                    p.frame == received && p.len == len && header.desc() == Some(p.desc)
                });
                let incoming = if let Some(p) = posted {
                    // SAFETY: the poster keeps this memory alive and untouched until the loan
                    // (dropped right after the read) is returned; nobody else took the post.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.ptr, p.len) };
                    let read = reader.read_exact(dst);
                    drop(p);
                    if let Err(e) = read {
                        break Some(read_error(rank, peer, e));
                    }
                    shared.landed.fetch_add(1, Ordering::Relaxed);
                    Incoming::Landed
                } else {
                    let mut buf = pool.buf(len);
                    if let Err(e) = reader.read_exact(buf.as_bytes_mut()) {
                        break Some(read_error(rank, peer, e));
                    }
                    Incoming::Data(header, buf)
                };
                shared.progress.fetch_add(1, Ordering::Relaxed);
                if shared.is_failed() {
                    continue; // nobody will read it; keep draining until the peer closes
                }
                if tx.send(incoming).is_err() {
                    break None;
                }
            }
            FrameKind::Abort => {
                if len > wire::MAX_ABORT_BYTES {
                    break Some(protocol(format!("an ABORT message of {len} bytes")));
                }
                let mut text = vec![0u8; len];
                if let Err(e) = reader.read_exact(&mut text) {
                    break Some(read_error(rank, peer, e));
                }
                let cause = String::from_utf8_lossy(&text).into_owned();
                let blamed = (header.arg != u32::MAX).then_some(header.arg as usize);
                shared.fail(CommError::PeerAborted {
                    rank,
                    peer,
                    blamed,
                    cause,
                });
            }
            FrameKind::Heartbeat => {
                if len != 0 {
                    break Some(protocol(format!(
                        "a HEARTBEAT with a payload of {len} bytes"
                    )));
                }
            }
            FrameKind::Credit => {
                if len != 0 {
                    break Some(protocol(format!("a CREDIT with a payload of {len} bytes")));
                }
                credits.grant(u64::from(header.arg));
            }
            FrameKind::Goodbye => {
                goodbye.store(true, Ordering::Release);
                let _ = tx.send(Incoming::Goodbye);
                // Answer the half-close so that the peer's reader reaches EOF too.
                let _ = stream.shutdown(Shutdown::Write);
            }
        }
    };
    if let Some(err) = end {
        let quiet = goodbye.load(Ordering::Acquire) || shared.closing.load(Ordering::Acquire);
        if !quiet {
            match err {
                CommError::PeerClosed { .. } | CommError::PeerIo { .. } => shared.peer_lost(err),
                _ => shared.fail(err),
            }
        }
    }
}

fn read_error(rank: usize, peer: usize, e: io::Error) -> CommError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => CommError::PeerClosed { rank, peer },
        _ => CommError::PeerIo {
            rank,
            peer,
            message: format!("receiving from rank {peer}: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::element::DType;
    use crate::wire::OpKind;
    use std::net::TcpListener;

    /// Rank 0's mesh, and the other end of its one connection (to rank 1).
    fn rank_0_and_socket(timeout: Duration) -> (Mesh, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        (mesh(0, vec![None, Some(a)], timeout), b)
    }

    fn mesh(rank: usize, streams: Vec<Option<TcpStream>>, timeout: Duration) -> Mesh {
        let flight = FlightRecorder::new(rank, 2, None);
        Mesh::start(
            rank,
            streams,
            timeout,
            Duration::from_secs(10),
            64 << 20,
            flight,
        )
        .unwrap()
    }

    /// Two meshes (ranks 0 and 1) joined by one real TCP connection.
    fn pair(timeout: Duration) -> (Mesh, Mesh) {
        let (m0, b) = rank_0_and_socket(timeout);
        (m0, mesh(1, vec![Some(b), None], timeout))
    }

    fn desc(seq: u64) -> OpDesc {
        OpDesc {
            op: OpKind::Broadcast,
            seq,
            dtype: DType::U8,
            count: 0,
            arg: 0,
        }
    }

    /// A receive posted before its frame arrives gets the payload straight from the socket; one
    /// posted after gets a copy; both get the right bytes, and the sender's lent memory is
    /// settled once the receiver consumed it.
    #[test]
    fn a_posted_receive_lands_in_place_and_a_late_one_gets_a_copy() {
        let (m0, m1) = pair(Duration::from_secs(20));
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::thread::scope(|s| {
            // Posted first: rank 1 sends only 300 ms later.
            let receiver = s.spawn(|| {
                let mut dst = vec![0u8; data.len()];
                // SAFETY: `dst` outlives the settle below and is not touched before it.
                let r = unsafe { m0.recv_into(1, &desc(0), &mut dst) };
                m0.settle(&desc(0), r).unwrap();
                dst
            });
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: `data` is neither changed nor dropped before the settle.
            unsafe { m1.send_lent(0, &desc(0), &data).unwrap() };
            m1.settle(&desc(0), Ok(())).unwrap();
            assert!(receiver.join().unwrap() == data);
        });
        assert_eq!(m0.shared().landed.load(Ordering::Relaxed), 1);

        // The frame first: it waits in a pool buffer, and the receive copies it.
        // SAFETY: as above.
        unsafe { m1.send_lent(0, &desc(1), &data).unwrap() };
        std::thread::sleep(Duration::from_millis(300));
        let mut dst = vec![0u8; data.len()];
        // SAFETY: as above.
        let r = unsafe { m0.recv_into(1, &desc(1), &mut dst) };
        m0.settle(&desc(1), r).unwrap();
        m1.settle(&desc(1), Ok(())).unwrap();
        assert!(dst == data);
        assert_eq!(m0.shared().landed.load(Ordering::Relaxed), 1);

        // A frame of another collective is not taken by the posted receive: a mismatch.
        let other = vec![1u8; 10];
        // SAFETY: as above.
        unsafe { m1.send_lent(0, &desc(7), &other).unwrap() };
        let mut dst = vec![0u8; 10];
        // SAFETY: as above.
        let r = unsafe { m0.recv_into(1, &desc(2), &mut dst) };
        assert!(matches!(r, Err(CommError::Mismatch { .. })), "{r:?}");
        assert!(m0.settle(&desc(2), r).is_err());
        assert_eq!(dst, vec![0u8; 10]);
    }

    /// A peer that leaves (GOODBYE) right after sending frames this rank has not consumed yet:
    /// consuming them grants credit, and the CREDIT frame meets a connection the peer has closed
    /// (and whose sending side our reader shut down in answer to the GOODBYE). That ends the
    /// link, it is no failure: every frame arrives and the group stays healthy. (It was a
    /// failure, "rank 1 left the group while rank 0 still needed it", which a broadcast's root
    /// that finished first and dropped its group caused now and then.)
    #[test]
    fn credit_for_a_peer_that_said_goodbye_is_not_a_failure() {
        let (m0, m1) = pair(Duration::from_secs(20));
        let data: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        for seq in 0..LINK_CREDITS {
            m1.send(0, &desc(seq), m1.copy_of(&data)).unwrap();
        }
        drop(m1); // GOODBYE after the queued frames, then the socket closes
        std::thread::sleep(Duration::from_millis(300));
        for seq in 0..LINK_CREDITS {
            let got = m0.recv(1, &desc(seq), data.len()).unwrap();
            assert!(got.as_bytes() == &data[..], "frame {seq}");
        }
        // The CREDIT for the consumed frames is queued; give the writer time to try it.
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            m0.shared().error().is_none(),
            "the group failed: {:?}",
            m0.shared().error()
        );
    }

    /// A lent send to a peer that never reads: once the group fails, the writer blocked in
    /// `sendmsg` on the full socket gives the memory back within a few seconds (the link is shut
    /// down after the ABORT had its chance), not at the write timeout.
    #[test]
    fn a_failed_group_takes_back_memory_lent_to_a_writer_stuck_on_a_full_socket() {
        // Rank 1 is a bare socket that never reads.
        let (m0, peer) = rank_0_and_socket(Duration::from_secs(120));
        let data = vec![3u8; 64 << 20];
        // 64 frames of 1 MiB: the first 16 have credit, far more than the socket buffers hold.
        for chunk in data.chunks(1 << 20) {
            // SAFETY: `data` outlives the settle below.
            unsafe { m0.send_lent(1, &desc(0), chunk).unwrap() };
        }
        std::thread::sleep(Duration::from_millis(500));
        let started = Instant::now();
        let err = CommError::Internal {
            rank: 0,
            message: "test failure".into(),
        };
        let settled = m0.settle(&desc(0), Err(err));
        let took = started.elapsed();
        assert!(settled.is_err());
        assert!(
            took >= ABORT_FLUSH && took < ABORT_FLUSH + Duration::from_secs(5),
            "settling took {took:?}"
        );
        drop(data);
        drop(peer);
    }
}
