//! [`TorchStoreHost`]: a server of PyTorch's `TCPStore` protocol, what torchrun's elastic agent
//! hosts for its workers. ddprun (`ddp-launch`) hosts one on `MASTER_PORT` and tells every rank
//! so with `TORCHELASTIC_USE_AGENT_STORE=True`, as torchrun does: a PyTorch program's
//! `init_process_group` (env://) then connects to it as a client on every rank, rank 0
//! included, and ddp-comm's ranks rendezvous through it the same way (`torch_store.rs`, the
//! client). No rank binds `MASTER_PORT`, and the launcher holds it from the moment it chose it.
//!
//! # What it answers
//!
//! The queries of torch 2.x (the wire format is in `torch_store.rs`; requests are read by
//! `torch_store_request.rs`), each as torch's default server (`TCPStoreLibUvBackend.cpp`, the
//! libuv one) answers it:
//!
//! - A connection must open with `VALIDATE` and the magic number; anything else closes it.
//! - `PING n`: echoes `n`. `SET`, `APPEND` (to the value, or a new one), `MULTI_SET`,
//!   `QUEUE_PUSH`: no answer. `ADD k n`: the new value as an `i64`, kept as decimal text (an
//!   `ADD` to a value that is not a number closes the connection, as torch's exception does).
//! - `GET k`: the value (empty for a missing key: clients `WAIT` first); `MULTI_GET`: one value
//!   per key. `COMPARE_SET k expected desired`: sets when the value is `expected` (an empty
//!   `expected` matches a missing key) and answers the value after the operation (`expected`
//!   itself for a missing key that did not match, as torch does).
//! - `CHECK keys`: `0` when every key is set (a key with a non-empty queue counts), else `1`.
//!   `WAIT keys`: `0` (STOP_WAITING) at once when every key is set, else the connection waits
//!   for the missing ones and gets its `0` when the last is set (by any connection's `SET`,
//!   `ADD`, `APPEND`, `COMPARE_SET` or `MULTI_SET`; a `QUEUE_PUSH` wakes one waiter of its key).
//!   `CANCEL_WAIT` ends a wait and answers `1` (WAIT_CANCELED), waiting or not.
//! - `GETNUMKEYS`: the number of keys, `i64`. `DELETE_KEY k`: how many were deleted (0 or 1),
//!   `i64`. `QUEUE_POP k`: the queue's length as an `i64`, then its first value if any (popped);
//!   `QUEUE_LEN k`: the length. A queue emptied by its last pop is gone (torch keeps an empty
//!   one: no answer tells them apart).
//! - `LIST_KEYS`: the number of keys as an `i64`, then each key as a string (the map's keys,
//!   not the queues', in no fixed order, as torch's hash map gives them).
//! - `BARRIER k n`: adds one to the counter `k` (as `ADD`, without waking anyone); when it
//!   reaches `n`, answers `0` (STOP_WAITING) and wakes every connection waiting on `k` (the
//!   earlier callers); else the connection waits on `k` as after a `WAIT`.
//!
//! # How
//!
//! One thread serves every connection, with `poll(2)` over non-blocking sockets, as torch's
//! libuv loop does, so that a `WAIT` costs no thread: a waiting connection is a set of missing
//! keys, and every change of a key looks at the waiting connections. Each connection has an
//! input buffer (a request is executed once it is whole; `torch_store_request.rs` says how many
//! bytes it still needs, so a large value arriving in pieces is not re-read every time; the
//! whole requests of a burst are executed from a cursor and removed together, see
//! [`Conn::compact`]) and an output buffer, written as the socket takes it. A second socket (a socket pair) wakes the
//! thread when the host is dropped.
//!
//! # Limits
//!
//! Nothing a client sends can make the server allocate without bound, panic or hold a resource
//! forever. Requests are bounded as `torch_store_request.rs` says. One byte budget
//! ([`BUDGET`]) bounds everything the server holds for its clients: keys, values and queued
//! values with their per-entry overhead, every connection's input and output buffers, the keys
//! its WAIT waits for (`torch_store_server/execute.rs` says how it is counted, and how a
//! quarter is kept for answers and small requests). A request that would pass it closes its
//! connection; an answer that would pass it waits until others have drained theirs. One
//! answer is at most `MAX_ANSWER_BYTES` (64 MiB); a connection whose unread answers pass
//! [`OUTPUT_HIGH_WATER`] is not read from until they drain; at most [`MAX_CONNECTIONS`] are
//! open (fewer when the process may open fewer descriptors). Deadlines: the first query within
//! [`FIRST_QUERY_DEADLINE`] of connecting, a request begun must be whole (and answered) within
//! [`REQUEST_DEADLINE`], answers must be taken within [`WRITE_DEADLINE`], and, while more than
//! half of the connections allowed are open, a validated connection that waits on no key may
//! stay silent for [`IDLE_DEADLINE`]; a connection past one is closed. (Idle connections are
//! closed only when the room is needed: torch's client does not reconnect, and a rank may
//! rightly keep its connection unused for hours; idle clients in their thousands must not
//! keep the others out.) A connection that sends what the protocol does not allow is closed and the
//! reason logged (`tracing`), naming its peer; the others go on.
//!
//! Descriptors: the server raises the process's soft `RLIMIT_NOFILE` to its hard limit when it
//! starts (ddprun's store must outlive clients that come and go, and 1024 is a common soft
//! limit), and an `accept` that fails never stops the listener: a failure of the connection
//! being accepted (`ECONNABORTED`) is skipped, and a shortage (`EMFILE`, `ENFILE`, `ENOBUFS`)
//! is logged (once, then every [`ACCEPT_LOG_INTERVAL`]) and the listener left alone for
//! [`ACCEPT_BACKOFF`] while the other connections are served, then accepting goes on.

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::rendezvous::torch_store::STOP_WAITING;
use crate::rendezvous::torch_store_request::{parse, Parsed};

mod execute;

use execute::{answer_bytes, execute, Data, Wake, CONNECTION_OVERHEAD, WAIT_KEY_OVERHEAD};

/// The most bytes the server holds for its clients: data, buffers and waits together.
pub(crate) const BUDGET: usize = 256 << 20;
/// Unread answers above which a connection's requests wait.
const OUTPUT_HIGH_WATER: usize = 4 << 20;
/// The most connections open at once.
pub(crate) const MAX_CONNECTIONS: usize = 16384;
/// Descriptors kept for the rest of the process when the connections are capped by the
/// descriptor limit.
const SPARE_DESCRIPTORS: usize = 64;
/// How long a new connection may take to send its first query.
pub(crate) const FIRST_QUERY_DEADLINE: Duration = Duration::from_secs(30);
/// How long a request may take to arrive whole (and be answered) once it has begun.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// How long answers may wait for a client that does not read them.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(60);
/// How long a validated connection that waits on no key may send nothing, while more than
/// half of the connections allowed are open.
pub(crate) const IDLE_DEADLINE: Duration = Duration::from_secs(60);
/// How long the listener is left alone after `accept` found no descriptor (or no memory).
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often a persisting `accept` failure is logged again.
const ACCEPT_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Bytes read from a socket at once; input and output buffers are shrunk back to this size
/// once a larger request or answer is done with.
const READ_CHUNK: usize = 64 << 10;
/// How often the loop wakes without events, to look at the deadlines.
const TICK: Duration = Duration::from_millis(500);
/// How often it wakes while an answer waits for the budget (which others' writes free).
const HELD_BACK_TICK: Duration = Duration::from_millis(5);

/// The bounds of a server: the constants above, others in tests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub budget: usize,
    pub first_query: Duration,
    pub request: Duration,
    pub write: Duration,
    pub idle: Duration,
    /// Open connections above which idle ones are closed (`None`: half of those allowed).
    pub idle_above: Option<usize>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            budget: BUDGET,
            first_query: FIRST_QUERY_DEADLINE,
            request: REQUEST_DEADLINE,
            write: WRITE_DEADLINE,
            idle: IDLE_DEADLINE,
            idle_above: None,
        }
    }
}

/// Raises this process's soft limit of open descriptors (`RLIMIT_NOFILE`) to its hard limit
/// (to `/proc/sys/fs/nr_open` when the hard one is unlimited), and returns the soft limit in
/// force afterwards: a store that many clients reach must not run out of descriptors at the
/// usual soft limit of 1024 while the system allows more.
pub(crate) fn raise_descriptor_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit structure, which `limit` is.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut want = limit.rlim_max;
    if want == libc::RLIM_INFINITY {
        want = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(1 << 20);
    }
    if limit.rlim_cur >= want {
        return Ok(limit.rlim_cur);
    }
    let raised = libc::rlimit {
        rlim_cur: want,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: setrlimit reads one rlimit structure, which `raised` is.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(want)
}

/// What the server thread and the host share.
struct Shared {
    data: Mutex<Data>,
    stop: AtomicBool,
    /// Clears asked for and clears done ([`TorchStoreHost::clear`]).
    clears: Mutex<(u64, u64)>,
    cleared: Condvar,
    /// Bytes of input moved to the front of their buffers, once executed requests are
    /// removed: at most the bytes read (each byte moves at most once), which a test checks.
    moved: AtomicU64,
}

impl Shared {
    fn data(&self) -> MutexGuard<'_, Data> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A PyTorch `TCPStore` server on a listening socket (see the module documentation), served by
/// a thread of its own until it is dropped; dropping it closes every connection.
pub struct TorchStoreHost {
    port: u16,
    shared: Arc<Shared>,
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TorchStoreHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchStoreHost")
            .field("port", &self.port)
            .finish()
    }
}

impl TorchStoreHost {
    /// Serves PyTorch's `TCPStore` protocol on `listener` (bound and listening; the caller
    /// chose its address and port) until the host is dropped. Raises the process's soft limit
    /// of open descriptors to its hard limit first (see the module documentation).
    pub fn start(listener: TcpListener) -> io::Result<TorchStoreHost> {
        TorchStoreHost::start_with(listener, Limits::default())
    }

    /// [`TorchStoreHost::start`] with other bounds.
    pub(crate) fn start_with(listener: TcpListener, limits: Limits) -> io::Result<TorchStoreHost> {
        let port = listener.local_addr()?.port();
        let descriptors = match raise_descriptor_limit() {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(
                    "PyTorch store on port {port}: could not raise the descriptor limit: {e}"
                );
                1024
            }
        };
        let max_connections = MAX_CONNECTIONS
            .min((descriptors as usize).saturating_sub(SPARE_DESCRIPTORS))
            .max(16);
        let limits = Limits {
            idle_above: Some(limits.idle_above.unwrap_or(max_connections / 2)),
            ..limits
        };
        listener.set_nonblocking(true)?;
        let (wake, woken) = UnixStream::pair()?;
        woken.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            data: Mutex::new(Data::new(limits.budget)),
            stop: AtomicBool::new(false),
            clears: Mutex::new((0, 0)),
            cleared: Condvar::new(),
            moved: AtomicU64::new(0),
        });
        let server = Server {
            listener,
            woken,
            shared: shared.clone(),
            conns: Vec::new(),
            port,
            limits,
            max_connections,
            accept_paused_until: None,
            accept_failures: 0,
            accept_logged: None,
            held_back: false,
        };
        let thread = std::thread::Builder::new()
            .name("ddp-torch-store".into())
            .spawn(move || server.run())?;
        Ok(TorchStoreHost {
            port,
            shared,
            wake,
            thread: Some(thread),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Empties the store and closes every open connection, as if it were a new one on the same
    /// port: for a launcher between two attempts of a job, once every rank of the old attempt
    /// has ended (PyTorch's workers of a new attempt would otherwise read the old attempt's
    /// keys, as under torchrun's static rendezvous). Returns once done (an error if the server
    /// thread does not answer within 10 s).
    pub fn clear(&self) -> io::Result<()> {
        let mut clears = self.shared.clears.lock().unwrap_or_else(|p| p.into_inner());
        clears.0 += 1;
        let mine = clears.0;
        let _ = (&self.wake).write(&[1]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while clears.1 < mine {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the PyTorch store's thread did not clear the store within 10 s",
                ));
            }
            clears = self
                .shared
                .cleared
                .wait_timeout(clears, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// The value of `key` (as it travels on the wire: with its client's prefix), if set.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.data().map.get(key.as_bytes()).cloned()
    }

    /// The keys it holds now, sorted (lossily decoded: keys are bytes on the wire).
    pub fn keys(&self) -> Vec<String> {
        let data = self.shared.data();
        let mut keys: Vec<String> = data
            .map
            .keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        keys.sort();
        keys
    }

    /// The bytes it holds for its clients now, as counted against its budget: keys, values and
    /// queues with their overheads, and the connections' buffers and waits (see the module
    /// documentation).
    pub fn bytes_held(&self) -> usize {
        self.shared.data().used()
    }
}

impl Drop for TorchStoreHost {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = (&self.wake).write(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One client connection.
struct Conn {
    stream: TcpStream,
    peer: String,
    /// Bytes read; those before `start` are requests already executed (removed once per turn
    /// of the loop, not one request at a time: see `Conn::compact`).
    input: Vec<u8>,
    start: usize,
    /// Bytes the request at `start` needs (from `start`) before it is worth parsing again.
    need: usize,
    output: Vec<u8>,
    /// Bytes of `output` already written.
    written: usize,
    validated: bool,
    opened: Instant,
    /// Since when the request at `start` has been incomplete, or held back for the budget.
    partial_since: Option<Instant>,
    /// When `output` last became non-empty or was last written to the socket.
    write_progress: Instant,
    /// When it last sent a byte, had a request executed or took an answer.
    last_active: Instant,
    /// The keys a WAIT (or BARRIER) still waits for.
    waiting: Option<HashSet<Vec<u8>>>,
    /// Why it is to be closed.
    closing: Option<String>,
    /// The bytes it is counted for in the budget ([`Conn::charge`] when last counted).
    charged: usize,
}

impl Conn {
    fn new(stream: TcpStream, now: Instant) -> Conn {
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "an unknown peer".into(), |a| a.to_string());
        Conn {
            stream,
            peer,
            input: Vec::new(),
            start: 0,
            need: 1,
            output: Vec::new(),
            written: 0,
            validated: false,
            opened: now,
            partial_since: None,
            write_progress: now,
            last_active: now,
            waiting: None,
            closing: None,
            charged: 0,
        }
    }

    fn pending(&self) -> usize {
        self.output.len() - self.written
    }

    /// Bytes read and not yet executed.
    fn unparsed(&self) -> usize {
        self.input.len() - self.start
    }

    /// Whether to read from it: not while its answers pile up, or a request is whole.
    fn wants_input(&self) -> bool {
        self.closing.is_none() && self.pending() < OUTPUT_HIGH_WATER && self.unparsed() < self.need
    }

    fn close(&mut self, why: impl Into<String>) {
        if self.closing.is_none() {
            self.closing = Some(why.into());
        }
    }

    /// The bytes it holds now: its buffers (allocated), the keys it waits for, its state.
    fn charge(&self) -> usize {
        let waits = self.waiting.as_ref().map_or(0, |w| {
            w.iter().map(|k| WAIT_KEY_OVERHEAD + k.len()).sum::<usize>()
        });
        CONNECTION_OVERHEAD + self.input.capacity() + self.output.capacity() + waits
    }

    /// Queues `bytes` as an answer.
    fn answer(&mut self, bytes: &[u8]) {
        if self.pending() == 0 {
            self.write_progress = Instant::now();
        }
        self.output.extend_from_slice(bytes);
    }

    /// Removes the executed requests from the front of the input, moving what follows them
    /// (an incomplete request, at most) once, and gives back a buffer that a large request
    /// left much larger than what it holds. Returns the bytes moved.
    ///
    /// Why once per turn: removing each request as it is executed moves everything behind it
    /// every time, so a burst of n pipelined requests costs n times the burst (quadratic);
    /// executing from a cursor (`start`) and compacting after the burst moves each byte at
    /// most once.
    fn compact(&mut self) -> usize {
        let mut moved = 0;
        if self.start > 0 {
            moved = self.unparsed();
            self.input.drain(..self.start);
            self.start = 0;
        }
        if self.input.capacity() > READ_CHUNK && self.input.len() < self.input.capacity() / 4 {
            self.input.shrink_to(self.input.len().max(READ_CHUNK));
        }
        moved
    }

    /// Writes what the socket takes of the pending answers.
    fn flush(&mut self) {
        while self.pending() > 0 && self.closing.is_none() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => self.close("the connection closed"),
                Ok(n) => {
                    self.written += n;
                    self.write_progress = Instant::now();
                    self.last_active = self.write_progress;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.close(format!("writing failed: {e}")),
            }
        }
        if self.pending() == 0 {
            self.output.clear();
            self.written = 0;
            if self.output.capacity() > READ_CHUNK {
                self.output = Vec::new();
            }
        }
    }

    /// Closes it when one of its deadlines has passed (the idle one only when `crowded`).
    fn check_deadlines(&mut self, now: Instant, limits: &Limits, crowded: bool) {
        if !self.validated && now - self.opened > limits.first_query {
            self.close(format!(
                "no VALIDATE within {:?} of connecting",
                limits.first_query
            ));
        } else if self.partial_since.is_some_and(|t| now - t > limits.request) {
            self.close(format!(
                "a request of {} bytes so far was not whole (or not answered, for want of \
                 budget) within {:?}",
                self.unparsed(),
                limits.request
            ));
        } else if self.pending() > 0 && now - self.write_progress > limits.write {
            self.close(format!(
                "{} bytes of answers not read within {:?}",
                self.pending(),
                limits.write
            ));
        } else if crowded
            && self.validated
            && self.waiting.is_none()
            && self.unparsed() == 0
            && self.pending() == 0
            && now - self.last_active > limits.idle
        {
            self.close(format!(
                "idle for {:?} without waiting on a key, with more than {} connections open",
                limits.idle,
                limits.idle_above.unwrap_or(0)
            ));
        }
    }
}

/// The server thread's state.
struct Server {
    listener: TcpListener,
    woken: UnixStream,
    shared: Arc<Shared>,
    conns: Vec<Conn>,
    port: u16,
    limits: Limits,
    /// [`MAX_CONNECTIONS`], or fewer when the descriptor limit allows fewer.
    max_connections: usize,
    /// Until when the listener is left alone after `accept` found no descriptor.
    accept_paused_until: Option<Instant>,
    /// `accept` failures since the last one logged, and when that was.
    accept_failures: u64,
    accept_logged: Option<Instant>,
    /// Whether an answer waits for the budget: the loop then looks again soon, not at the
    /// next event or tick.
    held_back: bool,
}

impl Server {
    /// The loop: poll, read, execute every whole request, wake waiters, write, enforce the
    /// deadlines, drop closed connections, accept new ones; until the host is dropped.
    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !self.shared.stop.load(Ordering::Acquire) {
            self.clear_if_asked();
            let now = Instant::now();
            let listening = self.accept_paused_until.is_none_or(|t| now >= t);
            if listening {
                self.accept_paused_until = None;
            }
            fds.clear();
            let fd = |fd: i32, events: i16| libc::pollfd {
                fd,
                events,
                revents: 0,
            };
            // A listener left alone is not polled (fd -1 is skipped by poll).
            fds.push(fd(
                if listening {
                    self.listener.as_raw_fd()
                } else {
                    -1
                },
                libc::POLLIN,
            ));
            fds.push(fd(self.woken.as_raw_fd(), libc::POLLIN));
            for c in &self.conns {
                let mut events = 0;
                if c.wants_input() {
                    events |= libc::POLLIN;
                }
                if c.pending() > 0 {
                    events |= libc::POLLOUT;
                }
                fds.push(fd(c.stream.as_raw_fd(), events));
            }
            let timeout = if self.held_back {
                HELD_BACK_TICK
            } else if listening {
                TICK
            } else {
                ACCEPT_BACKOFF
            };
            self.held_back = false;
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures, alive for the
            // call; poll writes only their `revents`.
            let n = unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    timeout.as_millis() as i32,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::warn!("PyTorch store on port {}: poll failed: {e}", self.port);
                    std::thread::sleep(Duration::from_millis(10));
                }
                continue;
            }
            for i in 0..self.conns.len() {
                let revents = fds[2 + i].revents;
                if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    self.read(i);
                }
            }
            for i in 0..self.conns.len() {
                self.execute_requests(i);
            }
            let now = Instant::now();
            let shared = self.shared.clone();
            let mut data = shared.data();
            let crowded = self.conns.len() > self.limits.idle_above.unwrap_or(usize::MAX);
            for i in 0..self.conns.len() {
                self.conns[i].flush();
                self.conns[i].check_deadlines(now, &self.limits, crowded);
                self.resync(i, &mut data);
            }
            let port = self.port;
            self.conns.retain(|c| match &c.closing {
                None => true,
                Some(why) => {
                    data.buffers = data.buffers.saturating_sub(c.charged);
                    if !why.is_empty() {
                        tracing::warn!(
                            "PyTorch store on port {port}: closed the connection from {}: {why}",
                            c.peer
                        );
                    }
                    false
                }
            });
            if fds[1].revents != 0 {
                let mut sink = [0u8; 64];
                while matches!((&self.woken).read(&mut sink), Ok(n) if n > 0) {}
            }
            if fds[0].revents & libc::POLLIN != 0 {
                self.accept_all(&mut data);
            }
        }
    }

    /// Counts connection `i` anew in the budget.
    fn resync(&mut self, i: usize, data: &mut Data) {
        let c = &mut self.conns[i];
        let now = c.charge();
        data.buffers = data.buffers.saturating_sub(c.charged).saturating_add(now);
        c.charged = now;
    }

    /// Does the clears asked for since the last look: closes every connection, empties the store.
    fn clear_if_asked(&mut self) {
        let mut clears = self.shared.clears.lock().unwrap_or_else(|p| p.into_inner());
        if clears.1 == clears.0 {
            return;
        }
        self.conns.clear();
        let mut data = self.shared.data();
        data.clear();
        data.buffers = 0;
        clears.1 = clears.0;
        self.shared.cleared.notify_all();
    }

    /// Accepts every pending connection (closing those beyond the most allowed, or that the
    /// budget cannot hold). A failure never stops the listener (see the module documentation).
    fn accept_all(&mut self, data: &mut Data) {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    let full = self.conns.len() >= self.max_connections;
                    if full || data.used() + CONNECTION_OVERHEAD > data.budget {
                        tracing::warn!(
                            "PyTorch store on port {}: refused {from}: {}",
                            self.port,
                            if full {
                                format!("{} connections are open", self.conns.len())
                            } else {
                                format!("its budget of {} bytes is spent", data.budget)
                            }
                        );
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.conns.push(Conn::new(stream, Instant::now()));
                    self.resync(self.conns.len() - 1, data);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // The connection being accepted failed (reset before it was accepted, say):
                // the next one may be fine.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNABORTED | libc::EPROTO | libc::EPERM | libc::EINTR)
                    ) =>
                {
                    tracing::debug!("PyTorch store on port {}: accept: {e}", self.port);
                }
                // Out of descriptors or memory, say: log, leave the listener alone for a
                // moment (serving the other connections, some of which will close), go on.
                Err(e) => {
                    self.accept_failures += 1;
                    let now = Instant::now();
                    if self
                        .accept_logged
                        .is_none_or(|t| now - t >= ACCEPT_LOG_INTERVAL)
                    {
                        tracing::warn!(
                            "PyTorch store on port {}: accept failed ({} times since the last \
                             report): {e}; {} connections open; trying again in {:?}",
                            self.port,
                            self.accept_failures,
                            self.conns.len(),
                            ACCEPT_BACKOFF
                        );
                        self.accept_failures = 0;
                        self.accept_logged = Some(now);
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }

    /// Reads what connection `i`'s socket has (bounded per call); end of stream or an error
    /// closes it, and so does input that its budget cannot hold.
    fn read(&mut self, i: usize) {
        let mut chunk = [0u8; READ_CHUNK];
        let shared = self.shared.clone();
        for _ in 0..16 {
            let c = &mut self.conns[i];
            if !c.wants_input() {
                return;
            }
            match c.stream.read(&mut chunk) {
                Ok(0) => return c.close(""),
                Ok(n) => {
                    let mut data = shared.data();
                    if let Err(why) = self.take_input(i, &chunk[..n], &mut data) {
                        return self.conns[i].close(why);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return c.close(format!("reading failed: {e}")),
            }
        }
    }

    /// Appends `bytes` to connection `i`'s input if the budget holds them. The buffer grows at
    /// most to twice what it holds and never past the request's length once known, so that
    /// its capacity (what is counted) follows the bytes that arrived, not a length prefix.
    /// Input beyond [`READ_CHUNK`] (a large request) may use the part of the budget that data
    /// may use; the rest is kept for answers and small requests.
    fn take_input(&mut self, i: usize, bytes: &[u8], data: &mut Data) -> Result<(), String> {
        let c = &mut self.conns[i];
        let len = c.input.len();
        let wanted = len + bytes.len();
        let capacity = c.input.capacity();
        if wanted > capacity {
            let hint = (c.start + c.need).max(wanted);
            let target = wanted.max((capacity * 2).min(hint));
            let limit = if target > READ_CHUNK {
                data.bulk_limit()
            } else {
                data.budget
            };
            let after = data.used() + (target - capacity);
            if after > limit {
                return Err(format!(
                    "its request in progress would need {target} bytes of input, and the \
                     store's budget is spent: {} bytes held of the {limit} allowed \
                     ({} of data, {} of connections; budget {})",
                    data.used(),
                    data.bytes,
                    data.buffers,
                    data.budget
                ));
            }
            c.input.reserve_exact(target - len);
        }
        c.input.extend_from_slice(bytes);
        c.last_active = Instant::now();
        self.resync(i, data);
        Ok(())
    }

    /// Executes the whole requests of connection `i`'s input, in order, from its cursor, and
    /// wakes the waits they end; then compacts its input once. An answer that the budget
    /// cannot hold now waits (at most [`Limits::request`]) with its request.
    fn execute_requests(&mut self, i: usize) {
        let shared = self.shared.clone();
        let mut data = shared.data();
        loop {
            let c = &mut self.conns[i];
            if c.closing.is_some() || c.pending() >= OUTPUT_HIGH_WATER || c.unparsed() < c.need {
                break;
            }
            let Conn {
                ref input,
                start,
                ref mut output,
                ref mut waiting,
                ref mut validated,
                ..
            } = *c;
            let before = output.len();
            let (result, used) = match parse(&input[start..]) {
                Parsed::Need(n) => {
                    c.need = n;
                    c.partial_since.get_or_insert_with(Instant::now);
                    break;
                }
                Parsed::Bad(why) => (Err(why), 0),
                Parsed::Done(request, used) => match answer_bytes(&data, &request) {
                    Err(why) => (Err(why), used),
                    Ok(add) if data.used() + add > data.budget => {
                        c.partial_since.get_or_insert_with(Instant::now);
                        self.held_back = true;
                        break;
                    }
                    Ok(add) => {
                        output.reserve_exact(add);
                        let r = execute(&mut data, &request, validated, waiting, output);
                        (r, used)
                    }
                },
            };
            if output.len() > before && before == c.written {
                c.write_progress = Instant::now();
            }
            c.start += used;
            c.need = 1;
            c.partial_since = None;
            c.last_active = Instant::now();
            match result {
                Err(why) => {
                    c.close(why);
                    break;
                }
                Ok(wake) => {
                    self.resync(i, &mut data);
                    self.wake(wake, &mut data);
                }
            }
        }
        let moved = self.conns[i].compact();
        self.shared.moved.fetch_add(moved as u64, Ordering::Relaxed);
        self.resync(i, &mut data);
    }

    /// Ends the waits that `wake` completes.
    fn wake(&mut self, wake: Wake, data: &mut Data) {
        let mut woken = Vec::new();
        match wake {
            Wake::None => {}
            Wake::Set(keys) => {
                for (i, c) in self.conns.iter_mut().enumerate() {
                    let Some(missing) = &mut c.waiting else {
                        continue;
                    };
                    for k in &keys {
                        missing.remove(k);
                    }
                    if missing.is_empty() {
                        c.waiting = None;
                        c.answer(&[STOP_WAITING]);
                        woken.push(i);
                    }
                }
            }
            Wake::Pushed(key) => {
                for (i, c) in self.conns.iter_mut().enumerate() {
                    let Some(missing) = &mut c.waiting else {
                        continue;
                    };
                    if !missing.remove(&key) {
                        continue;
                    }
                    if missing.is_empty() {
                        c.waiting = None;
                        c.answer(&[STOP_WAITING]);
                    }
                    woken.push(i);
                    // One waiter of the key takes the pushed value.
                    break;
                }
            }
        }
        for i in woken {
            self.resync(i, data);
        }
    }
}

#[cfg(test)]
mod tests;
