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
//!   `QUEUE_LEN k`: the length.
//!
//! # How
//!
//! One thread serves every connection, with `poll(2)` over non-blocking sockets, as torch's
//! libuv loop does, so that a `WAIT` costs no thread: a waiting connection is a set of missing
//! keys, and every change of a key looks at the waiting connections. Each connection has an
//! input buffer (a request is executed once it is whole; `torch_store_request.rs` says how many
//! bytes it still needs, so a large value arriving in pieces is not re-read every time) and an
//! output buffer, written as the socket takes it. A second socket (a socket pair) wakes the
//! thread when the host is dropped.
//!
//! # Limits
//!
//! Nothing a client sends can make the server allocate without bound, panic or hold a resource
//! forever: requests are bounded as `torch_store_request.rs` says; the store holds at most
//! [`MAX_STORE_BYTES`] of keys and values (a request that would pass it closes its
//! connection); one answer is at most [`MAX_ANSWER_BYTES`] (a `MULTI_GET` of a larger total
//! closes its connection); a connection whose unread answers pass [`OUTPUT_HIGH_WATER`] is not
//! read from until they drain; at most [`MAX_CONNECTIONS`] are open. Deadlines: the first query
//! within [`FIRST_QUERY_DEADLINE`] of connecting, a request begun must be whole within
//! [`REQUEST_DEADLINE`], answers must be taken within [`WRITE_DEADLINE`]; a connection past one
//! is closed. A connection that sends what the protocol does not allow is closed and the reason
//! logged (`tracing`); the others go on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::torch_store::{
    CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED,
};
use crate::torch_store_request::{parse, Parsed, Request};

/// The most bytes of keys and values the store holds.
pub(crate) const MAX_STORE_BYTES: usize = 512 << 20;
/// The longest answer to one request.
pub(crate) const MAX_ANSWER_BYTES: usize = 64 << 20;
/// Unread answers above which a connection's requests wait.
const OUTPUT_HIGH_WATER: usize = 4 << 20;
/// The most connections open at once.
pub(crate) const MAX_CONNECTIONS: usize = 16384;
/// How long a new connection may take to send its first query.
pub(crate) const FIRST_QUERY_DEADLINE: Duration = Duration::from_secs(30);
/// How long a request may take to arrive whole once it has begun.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// How long answers may wait for a client that does not read them.
pub(crate) const WRITE_DEADLINE: Duration = Duration::from_secs(60);
/// Bytes read from a socket at once.
const READ_CHUNK: usize = 64 << 10;
/// How often the loop wakes without events, to look at the deadlines.
const TICK: Duration = Duration::from_millis(500);

/// The bounds of a server: the constants above, shorter in tests.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub store_bytes: usize,
    pub first_query: Duration,
    pub request: Duration,
    pub write: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            store_bytes: MAX_STORE_BYTES,
            first_query: FIRST_QUERY_DEADLINE,
            request: REQUEST_DEADLINE,
            write: WRITE_DEADLINE,
        }
    }
}

/// The keys, values and queues of the store.
struct Data {
    map: HashMap<Vec<u8>, Vec<u8>>,
    queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Bytes of keys and values held (map and queues), and the most allowed.
    bytes: usize,
    max_bytes: usize,
}

impl Data {
    /// Whether `key` is set, or has a non-empty queue (what CHECK and WAIT look for).
    fn present(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Makes room for `add` more bytes after `remove` are freed, or says why not.
    fn account(&mut self, remove: usize, add: usize) -> Result<(), String> {
        let after = self.bytes.saturating_sub(remove).saturating_add(add);
        if after > self.max_bytes {
            return Err(format!(
                "the store would hold {after} bytes of keys and values (at most {})",
                self.max_bytes
            ));
        }
        self.bytes = after;
        Ok(())
    }

    fn set(&mut self, key: &[u8], value: Vec<u8>) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| key.len() + v.len());
        self.account(old, key.len() + value.len())?;
        self.map.insert(key.to_vec(), value);
        Ok(())
    }
}

/// What the server thread and the host share.
struct Shared {
    data: Mutex<Data>,
    stop: AtomicBool,
    /// Clears asked for and clears done ([`TorchStoreHost::clear`]).
    clears: Mutex<(u64, u64)>,
    cleared: Condvar,
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
    /// chose its address and port) until the host is dropped.
    pub fn start(listener: TcpListener) -> io::Result<TorchStoreHost> {
        TorchStoreHost::start_with(listener, Limits::default())
    }

    /// [`TorchStoreHost::start`] with other bounds.
    pub(crate) fn start_with(listener: TcpListener, limits: Limits) -> io::Result<TorchStoreHost> {
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let (wake, woken) = UnixStream::pair()?;
        woken.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            data: Mutex::new(Data {
                map: HashMap::new(),
                queues: HashMap::new(),
                bytes: 0,
                max_bytes: limits.store_bytes,
            }),
            stop: AtomicBool::new(false),
            clears: Mutex::new((0, 0)),
            cleared: Condvar::new(),
        });
        let server = Server {
            listener,
            woken,
            shared: shared.clone(),
            conns: Vec::new(),
            port,
            limits,
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
        let data = self.shared.data.lock().unwrap_or_else(|p| p.into_inner());
        data.map.get(key.as_bytes()).cloned()
    }

    /// The keys it holds now, sorted (lossily decoded: keys are bytes on the wire).
    pub fn keys(&self) -> Vec<String> {
        let data = self.shared.data.lock().unwrap_or_else(|p| p.into_inner());
        let mut keys: Vec<String> = data
            .map
            .keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        keys.sort();
        keys
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
    input: Vec<u8>,
    /// Bytes the request at the front of `input` needs before it is worth parsing again.
    need: usize,
    output: Vec<u8>,
    /// Bytes of `output` already written.
    written: usize,
    validated: bool,
    opened: Instant,
    /// When the incomplete request at the front of `input` began to arrive.
    partial_since: Option<Instant>,
    /// When `output` last became non-empty or was last written to the socket.
    write_progress: Instant,
    /// The keys a WAIT still waits for.
    waiting: Option<HashSet<Vec<u8>>>,
    /// Why it is to be closed.
    closing: Option<String>,
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
            need: 1,
            output: Vec::new(),
            written: 0,
            validated: false,
            opened: now,
            partial_since: None,
            write_progress: now,
            waiting: None,
            closing: None,
        }
    }

    fn pending(&self) -> usize {
        self.output.len() - self.written
    }

    /// Whether to read from it: not while its answers pile up, or a request is whole.
    fn wants_input(&self) -> bool {
        self.closing.is_none() && self.pending() < OUTPUT_HIGH_WATER && self.input.len() < self.need
    }

    fn close(&mut self, why: impl Into<String>) {
        if self.closing.is_none() {
            self.closing = Some(why.into());
        }
    }

    /// Queues `bytes` as an answer.
    fn answer(&mut self, bytes: &[u8]) {
        if self.pending() == 0 {
            self.write_progress = Instant::now();
        }
        self.output.extend_from_slice(bytes);
    }

    /// Reads what the socket has (bounded per call); end of stream or an error closes it.
    fn read_some(&mut self) {
        let mut chunk = [0u8; READ_CHUNK];
        for _ in 0..16 {
            if !self.wants_input() {
                return;
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return self.close(""),
                Ok(n) => self.input.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.close(format!("reading failed: {e}")),
            }
        }
    }

    /// Writes what the socket takes of the pending answers.
    fn flush(&mut self) {
        while self.pending() > 0 && self.closing.is_none() {
            match self.stream.write(&self.output[self.written..]) {
                Ok(0) => self.close("the connection closed"),
                Ok(n) => {
                    self.written += n;
                    self.write_progress = Instant::now();
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => self.close(format!("writing failed: {e}")),
            }
        }
        if self.pending() == 0 {
            self.output.clear();
            self.written = 0;
        }
    }

    /// Closes it when one of its deadlines has passed.
    fn check_deadlines(&mut self, now: Instant, limits: &Limits) {
        if !self.validated && now - self.opened > limits.first_query {
            self.close(format!(
                "no VALIDATE within {:?} of connecting",
                limits.first_query
            ));
        } else if self.partial_since.is_some_and(|t| now - t > limits.request) {
            self.close(format!(
                "a request of {} bytes so far was not whole within {:?}",
                self.input.len(),
                limits.request
            ));
        } else if self.pending() > 0 && now - self.write_progress > limits.write {
            self.close(format!(
                "{} bytes of answers not read within {:?}",
                self.pending(),
                limits.write
            ));
        }
    }
}

/// A change of the store that may end other connections' waits.
enum Wake {
    /// These keys were set.
    Set(Vec<Vec<u8>>),
    /// A value was pushed to this key's queue: one waiter of it wakes.
    Pushed(Vec<u8>),
    None,
}

/// The server thread's state.
struct Server {
    listener: TcpListener,
    woken: UnixStream,
    shared: Arc<Shared>,
    conns: Vec<Conn>,
    port: u16,
    limits: Limits,
}

impl Server {
    /// The loop: poll, read, execute every whole request, wake waiters, write, enforce the
    /// deadlines, drop closed connections, accept new ones; until the host is dropped.
    fn run(mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        while !self.shared.stop.load(Ordering::Acquire) {
            self.clear_if_asked();
            fds.clear();
            let fd = |fd: i32, events: i16| libc::pollfd {
                fd,
                events,
                revents: 0,
            };
            fds.push(fd(self.listener.as_raw_fd(), libc::POLLIN));
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
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures, alive for the
            // call; poll writes only their `revents`.
            let n = unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    TICK.as_millis() as i32,
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
            for (i, c) in self.conns.iter_mut().enumerate() {
                let revents = fds[2 + i].revents;
                if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                    c.read_some();
                }
            }
            for i in 0..self.conns.len() {
                self.execute_requests(i);
            }
            let now = Instant::now();
            for c in &mut self.conns {
                c.flush();
                c.check_deadlines(now, &self.limits);
            }
            let port = self.port;
            self.conns.retain(|c| match &c.closing {
                None => true,
                Some(why) => {
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
                self.accept_all();
            }
        }
    }

    /// Does the clears asked for since the last look: closes every connection, empties the store.
    fn clear_if_asked(&mut self) {
        let mut clears = self.shared.clears.lock().unwrap_or_else(|p| p.into_inner());
        if clears.1 == clears.0 {
            return;
        }
        self.conns.clear();
        let mut data = self.shared.data.lock().unwrap_or_else(|p| p.into_inner());
        data.map.clear();
        data.queues.clear();
        data.bytes = 0;
        clears.1 = clears.0;
        self.shared.cleared.notify_all();
    }

    /// Accepts every pending connection (closing those beyond [`MAX_CONNECTIONS`]).
    fn accept_all(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, from)) => {
                    if self.conns.len() >= MAX_CONNECTIONS {
                        tracing::warn!(
                            "PyTorch store on port {}: refused {from}: {MAX_CONNECTIONS} \
                             connections are open",
                            self.port
                        );
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    self.conns.push(Conn::new(stream, Instant::now()));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                // Out of descriptors, say: try again at the next poll, after a pause, rather
                // than spin on a listener that stays readable.
                Err(e) => {
                    tracing::warn!("PyTorch store on port {}: accept failed: {e}", self.port);
                    std::thread::sleep(Duration::from_millis(10));
                    return;
                }
            }
        }
    }

    /// Executes the whole requests at the front of connection `i`'s input, in order, and wakes
    /// the waits they end.
    fn execute_requests(&mut self, i: usize) {
        loop {
            let c = &mut self.conns[i];
            if c.closing.is_some() || c.pending() >= OUTPUT_HIGH_WATER || c.input.len() < c.need {
                return;
            }
            let mut data = self.shared.data.lock().unwrap_or_else(|p| p.into_inner());
            let Conn {
                ref input,
                ref mut output,
                ref mut waiting,
                ref mut validated,
                ..
            } = *c;
            let (result, used) = match parse(input) {
                Parsed::Need(n) => {
                    c.need = n;
                    c.partial_since.get_or_insert_with(Instant::now);
                    return;
                }
                Parsed::Bad(why) => (Err(why), 0),
                Parsed::Done(request, used) => {
                    let before = output.len();
                    let r = execute(&mut data, &request, validated, waiting, output);
                    if output.len() > before && before == c.written {
                        c.write_progress = Instant::now();
                    }
                    (r, used)
                }
            };
            drop(data);
            c.input.drain(..used);
            c.need = 1;
            c.partial_since = None;
            match result {
                Err(why) => return c.close(why),
                Ok(wake) => self.wake(wake),
            }
        }
    }

    /// Ends the waits that `wake` completes.
    fn wake(&mut self, wake: Wake) {
        match wake {
            Wake::None => {}
            Wake::Set(keys) => {
                for c in &mut self.conns {
                    let Some(missing) = &mut c.waiting else {
                        continue;
                    };
                    for k in &keys {
                        missing.remove(k);
                    }
                    if missing.is_empty() {
                        c.waiting = None;
                        c.answer(&[STOP_WAITING]);
                    }
                }
            }
            Wake::Pushed(key) => {
                for c in &mut self.conns {
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
                    // One waiter of the key takes the pushed value.
                    return;
                }
            }
        }
    }
}

/// Appends a `u64` length and `bytes`.
fn put_vec(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Executes one request against the store, appending its answer to `out`; an `Err` closes the
/// connection (see the module documentation for each query).
fn execute(
    data: &mut Data,
    request: &Request<'_>,
    validated: &mut bool,
    waiting: &mut Option<HashSet<Vec<u8>>>,
    out: &mut Vec<u8>,
) -> Result<Wake, String> {
    if !*validated {
        return match request {
            Request::Validate(VALIDATION_MAGIC) => {
                *validated = true;
                Ok(Wake::None)
            }
            Request::Validate(magic) => Err(format!(
                "VALIDATE with {magic:#x}, not PyTorch's {VALIDATION_MAGIC:#x}"
            )),
            other => Err(format!(
                "{other:?} before VALIDATE (not a PyTorch TCPStore client?)"
            )),
        };
    }
    Ok(match request {
        Request::Validate(_) => return Err("a second VALIDATE".into()),
        Request::Ping(nonce) => {
            out.extend_from_slice(&nonce.to_le_bytes());
            Wake::None
        }
        Request::Set(k, v) => {
            data.set(k, v.to_vec())?;
            Wake::Set(vec![k.to_vec()])
        }
        Request::MultiSet(pairs) => {
            for (k, v) in pairs {
                data.set(k, v.to_vec())?;
            }
            Wake::Set(pairs.iter().map(|(k, _)| k.to_vec()).collect())
        }
        Request::Append(k, v) => {
            let mut value = data.map.get(*k).cloned().unwrap_or_default();
            if value.len() + v.len() > crate::wire::MAX_STORE_VALUE_BYTES {
                return Err(format!(
                    "APPEND would make a value of {} bytes (at most {})",
                    value.len() + v.len(),
                    crate::wire::MAX_STORE_VALUE_BYTES
                ));
            }
            value.extend_from_slice(v);
            data.set(k, value)?;
            Wake::Set(vec![k.to_vec()])
        }
        Request::Add(k, delta) => {
            let current = match data.map.get(*k) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.trim().parse::<i64>().ok())
                    .ok_or_else(|| {
                        format!(
                            "ADD to key {:?}, whose value is not a number",
                            String::from_utf8_lossy(k)
                        )
                    })?,
            };
            let new = current.wrapping_add(*delta);
            data.set(k, new.to_string().into_bytes())?;
            out.extend_from_slice(&new.to_le_bytes());
            Wake::Set(vec![k.to_vec()])
        }
        Request::CompareSet(k, expected, desired) => {
            let (answer, changed) = match data.map.get(*k) {
                None if expected.is_empty() => (desired.to_vec(), true),
                None => (expected.to_vec(), false),
                Some(current) if current.as_slice() == *expected => (desired.to_vec(), true),
                Some(current) => (current.clone(), false),
            };
            put_vec(out, &answer);
            if changed {
                data.set(k, answer)?;
                Wake::Set(vec![k.to_vec()])
            } else {
                Wake::None
            }
        }
        Request::Get(k) => {
            put_vec(out, data.map.get(*k).map_or(&[][..], Vec::as_slice));
            Wake::None
        }
        Request::MultiGet(keys) => {
            let total: usize = keys
                .iter()
                .map(|k| 8 + data.map.get(*k).map_or(0, Vec::len))
                .sum();
            if total > MAX_ANSWER_BYTES {
                return Err(format!(
                    "MULTI_GET of {} keys would answer {total} bytes (at most {MAX_ANSWER_BYTES})",
                    keys.len()
                ));
            }
            for k in keys {
                put_vec(out, data.map.get(*k).map_or(&[][..], Vec::as_slice));
            }
            Wake::None
        }
        Request::Check(keys) => {
            let ready = keys.iter().all(|k| data.present(k));
            out.push(if ready { CHECK_READY } else { CHECK_NOT_READY });
            Wake::None
        }
        Request::Wait(keys) => {
            let missing: HashSet<Vec<u8>> = keys
                .iter()
                .filter(|k| !data.present(k))
                .map(|k| k.to_vec())
                .collect();
            if missing.is_empty() {
                *waiting = None;
                out.push(STOP_WAITING);
            } else {
                *waiting = Some(missing);
            }
            Wake::None
        }
        Request::CancelWait => {
            *waiting = None;
            out.push(WAIT_CANCELED);
            Wake::None
        }
        Request::GetNumKeys => {
            out.extend_from_slice(&(data.map.len() as i64).to_le_bytes());
            Wake::None
        }
        Request::DeleteKey(k) => {
            let deleted = match data.map.remove(*k) {
                Some(v) => {
                    data.bytes = data.bytes.saturating_sub(k.len() + v.len());
                    1i64
                }
                None => 0,
            };
            out.extend_from_slice(&deleted.to_le_bytes());
            Wake::None
        }
        Request::QueuePush(k, v) => {
            data.account(0, k.len() + v.len())?;
            data.queues
                .entry(k.to_vec())
                .or_default()
                .push_back(v.to_vec());
            Wake::Pushed(k.to_vec())
        }
        Request::QueuePop(k) => {
            let queue = data.queues.get_mut(*k);
            let len = queue.as_ref().map_or(0, |q| q.len());
            out.extend_from_slice(&(len as i64).to_le_bytes());
            if let Some(v) = queue.and_then(VecDeque::pop_front) {
                data.bytes = data.bytes.saturating_sub(k.len() + v.len());
                put_vec(out, &v);
            }
            Wake::None
        }
        Request::QueueLen(k) => {
            let len = data.queues.get(*k).map_or(0, VecDeque::len);
            out.extend_from_slice(&(len as i64).to_le_bytes());
            Wake::None
        }
    })
}

#[cfg(test)]
mod tests;
