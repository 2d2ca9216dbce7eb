//! The TCP transport: [`Mesh`], the running connections of one rank to all its peers (built by
//! `connect.rs`), with one reader and one writer thread per connection (`reader.rs`,
//! `writer.rs`), credit-based flow control (`link.rs`), liveness (`liveness.rs`) and failure
//! propagation (`health.rs`). It knows nothing of algorithms: they see only [`Mesh::send`],
//! [`Mesh::recv`] and their zero-copy forms.
//!
//! The communication thread waits on one peer's channel and on the group's failure signal at
//! once, with the group's deadline, so no wait can outlive the deadline or miss a failure
//! elsewhere; a wait that finds a link gone reports the group's root cause once the group has
//! settled who failed first (`health.rs`).
//!
//! Memory lent by the communication thread. A writer sends a DATA frame either from a pool
//! buffer it owns ([`Mesh::send`]) or straight from the running collective's buffer
//! ([`Mesh::send_lent`]); a reader reads a DATA payload into a pool buffer, or straight into the
//! collective's buffer when the communication thread posted a receive for that very frame before
//! it arrived ([`Mesh::recv_into`]). Each such use is a loan counted per link, and a collective
//! ends with [`Mesh::settle`], which waits until every loan is back, so the caller's buffer is
//! never freed or changed under a thread; after a failure a thread stuck in a system call on a
//! stuck peer's socket is freed by shutting the socket down.
//!
//! Clean shutdown: each writer sends a GOODBYE frame after its queue and half-closes its socket;
//! a reader that sees GOODBYE half-closes its side in answer, so both readers reach EOF at once
//! and the connection is closed without resets. A peer's close without GOODBYE is a failure.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{select, unbounded, Receiver, Sender};

use crate::clock::remaining;
use crate::collectives::element::Element;
use crate::error::CommError;
use crate::flight::FlightRecorder;
use crate::transport::buffers::{BufferPool, PooledBuf};
use crate::transport::health::GroupHealth;
use crate::transport::link::{
    Credits, Incoming, Loans, Outgoing, Payload, Post, PostSlot, LINK_CREDITS,
};
use crate::transport::liveness::{
    heartbeat_interval, start_liveness, LastHeard, Silence, WatchedPeer,
};
use crate::transport::reader::{reader_loop, ReaderLink};
use crate::transport::writer::{writer_loop, WriterLink};
use crate::wire::{Header, OpDesc};

/// Longest the shutdown of a group waits for its peers to close their side.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Longest a failed rank waits for its writers to put the ABORT frames on the wire.
pub(crate) const ABORT_FLUSH: Duration = Duration::from_secs(2);

/// The connection to one peer, with its threads.
struct Link {
    tx: Sender<Outgoing>,
    rx: Receiver<Incoming>,
    stream: TcpStream,
    goodbye: Arc<AtomicBool>,
    /// When the last frame from the peer arrived.
    heard: Arc<LastHeard>,
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
    health: Arc<GroupHealth>,
    timeout: Duration,
    /// Disconnected once every reader and writer thread has ended.
    threads_done: Receiver<()>,
    pool: Arc<BufferPool>,
    /// The liveness thread, and the sender whose drop stops it.
    liveness: Option<(Sender<()>, JoinHandle<()>)>,
    peer_timeout: Duration,
}

impl Mesh {
    /// Starts a reader and a writer thread on each connection. `max_frame` caps the payload of a
    /// DATA frame a peer may send; `timeout` is the deadline of every wait; `silence` how a
    /// silent peer is judged (`liveness.rs`); `loss_grace` how long a lost connection waits for
    /// an ABORT that explains it (`health.rs`).
    pub fn start(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        timeout: Duration,
        silence: Silence,
        loss_grace: Duration,
        max_frame: usize,
        flight: Arc<FlightRecorder>,
    ) -> Result<Mesh, CommError> {
        let world = streams.len();
        let peer_timeout = silence.peer_timeout;
        let health = Arc::new(GroupHealth::new(rank, loss_grace));
        let pool = BufferPool::new();
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
            let heard = Arc::new(LastHeard::new());
            let credits = Arc::new(Credits::default());
            let granted = Arc::new(AtomicU64::new(0));
            let post: PostSlot = Arc::new(Mutex::new(None));
            let loans = Arc::new(Loans::default());
            // On failure: wake the writer if it waits for credit, and queue the ABORT.
            let (abort_tx, waiting) = (tx.clone(), credits.clone());
            health.on_failure(Box::new(move |err: &CommError| {
                waiting.wake();
                let _ = abort_tx.send(Outgoing::Abort(err.to_string(), err.peer()));
            }));
            let writer = WriterLink {
                rank,
                peer,
                health: health.clone(),
                goodbye: goodbye.clone(),
                credits: credits.clone(),
                timeout,
                heartbeat_every: heartbeat_interval(peer_timeout),
            };
            let w_stream = stream.try_clone().map_err(|e| io_err(peer, e))?;
            let done = done_tx.clone();
            let writer = std::thread::Builder::new()
                .name(format!("ddp-w{rank}->{peer}"))
                .spawn(move || {
                    writer_loop(w_stream, writer, wrx);
                    drop(done);
                })
                .map_err(|e| io_err(peer, e))?;
            let reader = ReaderLink {
                rank,
                peer,
                health: health.clone(),
                goodbye: goodbye.clone(),
                heard: heard.clone(),
                credits: credits.clone(),
                granted: granted.clone(),
                post: post.clone(),
                pool: pool.clone(),
                max_frame,
            };
            let r_stream = stream.try_clone().map_err(|e| io_err(peer, e))?;
            let done = done_tx.clone();
            let reader = std::thread::Builder::new()
                .name(format!("ddp-r{rank}<-{peer}"))
                .spawn(move || {
                    reader_loop(r_stream, reader, rtx);
                    drop(done);
                })
                .map_err(|e| io_err(peer, e))?;
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
        let watched = links
            .iter()
            .enumerate()
            .filter_map(|(peer, l)| {
                l.as_ref().map(|l| WatchedPeer {
                    peer,
                    writer: l.tx.clone(),
                    heard: l.heard.clone(),
                    goodbye: l.goodbye.clone(),
                })
            })
            .collect();
        let liveness = start_liveness(rank, watched, &health, silence, flight)?;
        Ok(Mesh {
            rank,
            world,
            links,
            health,
            timeout,
            threads_done,
            pool,
            liveness: Some(liveness),
            peer_timeout,
        })
    }

    /// A buffer holding a copy of `s`, from the mesh's pool.
    pub fn copy_of<T: Element>(&self, s: &[T]) -> PooledBuf {
        self.pool.copy_of(s)
    }

    /// The group's health (failure, progress), shared with the link threads.
    pub fn health(&self) -> &Arc<GroupHealth> {
        &self.health
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
        if let Some(e) = self.health.error() {
            return e;
        }
        if self.link(peer).goodbye.load(Ordering::Acquire) {
            CommError::PeerLeft {
                rank: self.rank,
                peer,
            }
        } else {
            self.health.verdict(CommError::PeerClosed {
                rank: self.rank,
                peer,
            })
        }
    }

    /// Whether nothing has come from the peer of `link` for three heartbeat intervals: a live
    /// peer's liveness thread would have sent three heartbeats, and its reader would have read
    /// whatever this rank sent, so it is frozen, dead or cut off. After a failure, nothing is
    /// waited for on such a link (see [`Mesh::flush_aborts`] and [`Mesh::settle`]): its socket is
    /// shut down at once, so that the error reaches the caller within the liveness deadline's
    /// promise instead of seconds later.
    fn presumed_dead(&self, link: &Link) -> bool {
        !link.goodbye.load(Ordering::Acquire)
            && link.heard.silent_for() >= heartbeat_interval(self.peer_timeout) * 3
    }

    /// After a failure: waits (at most [`ABORT_FLUSH`]) until every writer has put its ABORT on
    /// the wire, so that a process that exits right after the error has still told every peer
    /// why. Writers end after their ABORT; a writer stuck on a full socket ends at its write
    /// timeout, which this does not wait for, and one stuck on the socket of a peer presumed dead
    /// ([`Mesh::presumed_dead`]: it would read nothing anyway) is freed at once by shutting that
    /// socket down.
    pub fn flush_aborts(&self) {
        let deadline = Instant::now() + ABORT_FLUSH;
        let mut shut = vec![false; self.links.len()];
        while Instant::now() < deadline {
            let mut pending = false;
            for (peer, link) in self.links.iter().enumerate() {
                let Some(link) = link else { continue };
                if link.writer.as_ref().is_none_or(|w| w.is_finished()) {
                    continue;
                }
                pending = true;
                if !shut[peer] && self.presumed_dead(link) {
                    let _ = link.stream.shutdown(Shutdown::Both);
                    shut[peer] = true;
                }
            }
            if !pending {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Queues one DATA frame of collective `desc` to `peer`; returns at once.
    pub fn send(&self, peer: usize, desc: &OpDesc, payload: PooledBuf) -> Result<(), CommError> {
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
        if let Some(e) = self.health.error() {
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
    pub fn recv(
        &self,
        peer: usize,
        desc: &OpDesc,
        expected_len: usize,
    ) -> Result<PooledBuf, CommError> {
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
            recv(self.health.failed_signal()) -> _ => {
                return Err(self.health.error().unwrap_or(CommError::Internal {
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
    /// [`ABORT_FLUSH`] later (at once where the peer is presumed dead, [`Mesh::presumed_dead`])
    /// is blocked in a send to or a receive from a stuck peer, and shutting that link's socket
    /// down ends the blocked call at once (a shut-down socket fails every send and ends every
    /// receive), so every loan comes back promptly.
    /// Returns `outcome`, or the timeout.
    pub fn settle(&self, desc: &OpDesc, outcome: Result<(), CommError>) -> Result<(), CommError> {
        if let Err(e) = &outcome {
            self.health.fail(e.clone());
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
                if self.health.is_failed() {
                    let since = *failed_at.get_or_insert(now);
                    if !shut && (now >= since + ABORT_FLUSH || self.presumed_dead(link)) {
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
                    self.health.fail(err);
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
        self.links
            .iter()
            .flatten()
            .any(|l| !l.goodbye.load(Ordering::Acquire) && l.heard.silent_for() > self.peer_timeout)
    }
}

impl Drop for Mesh {
    /// Clean shutdown: GOODBYE to every peer (unless the group failed: then the ABORTs are
    /// already queued), then wait briefly for the writers to finish and for the peers to close
    /// their side, then close whatever is left (a stuck peer cannot hold this up).
    fn drop(&mut self) {
        self.health.set_closing();
        if let Some((stop, thread)) = self.liveness.take() {
            drop(stop);
            let _ = thread.join();
        }
        for link in self.links.iter().flatten() {
            let _ = link.tx.send(Outgoing::Goodbye);
        }
        // Wait for the threads: CLOSE_GRACE at most, but longer (up to the group's deadline)
        // while a writer still waits for credit to deliver frames queued before the drop and
        // every peer is alive (heard from within the peer timeout): a peer busy in a long step
        // consumes them later, and must get them.
        let start = Instant::now();
        loop {
            let now = Instant::now();
            let waiting_for_credit = self
                .links
                .iter()
                .flatten()
                .any(|l| l.credits.waiting.load(Ordering::Acquire));
            let extend = waiting_for_credit
                && !self.health.is_failed()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collectives::element::DType;
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
        mesh_with_liveness(rank, streams, timeout, Duration::from_secs(10))
    }

    fn mesh_with_liveness(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        timeout: Duration,
        peer_timeout: Duration,
    ) -> Mesh {
        let flight = FlightRecorder::new(rank, 2, None);
        Mesh::start(
            rank,
            streams,
            timeout,
            Silence::of(peer_timeout),
            crate::config::DEFAULT_LOSS_GRACE,
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
        assert_eq!(m0.health().landed.load(Ordering::Relaxed), 1);

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
        assert_eq!(m0.health().landed.load(Ordering::Relaxed), 1);

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
            m0.health().error().is_none(),
            "the group failed: {:?}",
            m0.health().error()
        );
    }

    /// Liveness counts bytes, not frames: one 4 MiB frame that takes 3.2 s to arrive (64 KiB
    /// every 50 ms, as over a slow or congested link), with no other frame meanwhile, keeps a
    /// peer with a 1 s liveness deadline alive, and arrives whole. (A peer was declared silent
    /// after a frame's header, mid-payload, when only headers were stamped.)
    #[test]
    fn a_long_frame_on_a_slow_link_is_progress_not_silence() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let m0 = mesh_with_liveness(
            0,
            vec![None, Some(a)],
            Duration::from_secs(30),
            Duration::from_secs(1),
        );
        let data: Vec<u8> = (0..4u32 << 20).map(|i| (i * 13 % 251) as u8).collect();
        let started = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| {
                use std::io::Write;
                peer.write_all(&Header::data(&desc(0), data.len()).encode())
                    .unwrap();
                for piece in data.chunks(64 << 10) {
                    std::thread::sleep(Duration::from_millis(50));
                    peer.write_all(piece).unwrap();
                }
            });
            let got = m0.recv(1, &desc(0), data.len());
            let got = got.unwrap_or_else(|e| panic!("after {:?}: {e}", started.elapsed()));
            assert!(got.as_bytes() == &data[..]);
        });
        assert!(started.elapsed() >= Duration::from_secs(3));
        assert!(m0.health().error().is_none(), "{:?}", m0.health().error());
        drop(peer);
    }

    /// Rank 0 lends 64 MiB to its writer for rank 1, a bare socket that never reads (so the
    /// writer blocks in `sendmsg` on the full socket), and which sends heartbeats or not
    /// (`alive`); then the group fails, and this returns how long the settle took.
    fn settle_with_a_writer_stuck_on_a_full_socket(alive: bool) -> Duration {
        let (m0, peer) = rank_0_and_socket(Duration::from_secs(120));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            if alive {
                s.spawn(|| {
                    let heartbeat = Header::control(crate::wire::FrameKind::Heartbeat, 0);
                    while !stop.load(Ordering::Relaxed) {
                        if crate::wire::write_frame(&mut &peer, &heartbeat, &[]).is_err() {
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                });
            }
            let data = vec![3u8; 64 << 20];
            // 64 frames of 1 MiB: the first 16 have credit, far more than the socket buffers
            // hold.
            for chunk in data.chunks(1 << 20) {
                // SAFETY: `data` outlives the settle below.
                unsafe { m0.send_lent(1, &desc(0), chunk).unwrap() };
            }
            // Past three heartbeat intervals (1.5 s at the 10 s peer timeout).
            std::thread::sleep(Duration::from_secs(2));
            let started = Instant::now();
            let err = CommError::Internal {
                rank: 0,
                message: "test failure".into(),
            };
            let settled = m0.settle(&desc(0), Err(err));
            let took = started.elapsed();
            assert!(settled.is_err());
            stop.store(true, Ordering::Relaxed);
            drop(data);
            took
        })
    }

    /// A lent send to a live peer that never reads (it sends heartbeats): once the group fails,
    /// the writer blocked in `sendmsg` on the full socket gives the memory back within a few
    /// seconds (the link is shut down after the ABORT had its chance), not at the write timeout.
    #[test]
    fn a_failed_group_takes_back_memory_lent_to_a_writer_stuck_on_a_full_socket() {
        let took = settle_with_a_writer_stuck_on_a_full_socket(true);
        assert!(
            took >= ABORT_FLUSH && took < ABORT_FLUSH + Duration::from_secs(5),
            "settling took {took:?}"
        );
    }

    /// The same with a peer that has sent nothing for three heartbeat intervals (frozen, dead or
    /// cut off): the ABORT would never be read, so the link is shut down at once, and the
    /// memory comes back long before [`ABORT_FLUSH`].
    #[test]
    fn memory_lent_to_a_writer_stuck_on_a_silent_peer_comes_back_at_once() {
        let took = settle_with_a_writer_stuck_on_a_full_socket(false);
        assert!(took < ABORT_FLUSH / 4, "settling took {took:?}");
    }
}
