//! The rendezvous store: a small TCP key-value server hosted by rank 0 (like PyTorch's
//! `TCPStore`), and [`Store`], its client.
//!
//! The ranks use it while the group forms: rank 0 publishes the job id and its tuning, every rank
//! publishes the address it listens on, and each rank waits for the addresses it needs. It stays
//! available to users through [`crate::ProcessGroup::store`] for small coordination (keys of your
//! own should use a prefix other than `ddp/`).
//!
//! The server runs one thread per client connection; waits happen on the server (a condition
//! variable and a deadline), so a client never polls. Every client call has a deadline; a lost
//! connection is an error naming the store's address.
//!
//! Under torchrun with `TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's agent already hosts a
//! PyTorch `TCPStore` on `MASTER_ADDR:MASTER_PORT`: no rank hosts this server, and [`Store`]
//! speaks torch's protocol instead (`torch_store.rs`), with the same calls.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::connect::{connect_retry, handshake_accept, handshake_connect, Identity};
use crate::error::CommError;
use crate::torch_store::TorchConn;
use crate::transport::remaining;
use crate::wire::{
    HelloKind, StoreCmd, StoreRequest, StoreResponse, StoreStatus, MAX_STORE_VALUE_BYTES,
};

/// Extra time a client waits for a response beyond the request's own deadline.
const RESPONSE_MARGIN: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Server

struct ServerState {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    stop: AtomicBool,
    /// Clones of the open client connections (to shut them down when the server stops).
    conns: Mutex<HashMap<u64, TcpStream>>,
    me: Identity,
}

/// The store server (rank 0). Dropping it stops it and closes its client connections.
pub(crate) struct StoreServer {
    state: Arc<ServerState>,
    /// A second handle of the accepting thread's listening socket, to stop its `accept`.
    listening: TcpListener,
    acceptor: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on all interfaces at `port` (or uses `listener`) and serves clients of a job of
    /// `world` ranks presenting `token`.
    pub fn start(
        listener: Option<TcpListener>,
        master_addr: &str,
        port: u16,
        world: usize,
        token: Option<String>,
        job_id: [u8; 16],
    ) -> Result<StoreServer, CommError> {
        let listener = match listener {
            Some(l) => l,
            None => {
                // Listen on every interface, as PyTorch does, in the address family of MASTER_ADDR.
                let v6 = master_addr
                    .parse::<std::net::IpAddr>()
                    .map(|ip| ip.is_ipv6())
                    .unwrap_or(false);
                let bind: SocketAddr = if v6 {
                    (std::net::Ipv6Addr::UNSPECIFIED, port).into()
                } else {
                    (std::net::Ipv4Addr::UNSPECIFIED, port).into()
                };
                TcpListener::bind(bind).map_err(|e| {
                    if e.kind() == io::ErrorKind::AddrInUse {
                        CommError::AddrInUse {
                            addr: bind.to_string(),
                            port,
                        }
                    } else {
                        CommError::Listen {
                            rank: 0,
                            what: "the rendezvous store".into(),
                            addr: bind.to_string(),
                            message: e.to_string(),
                        }
                    }
                })?
            }
        };
        let listening = listener.try_clone().map_err(|e| CommError::Listen {
            rank: 0,
            what: "the rendezvous store".into(),
            addr: format!("port {port}"),
            message: e.to_string(),
        })?;
        let state = Arc::new(ServerState {
            map: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            me: Identity {
                rank: 0,
                world,
                job_id,
                token,
            },
        });
        let st = state.clone();
        let acceptor = std::thread::Builder::new()
            .name("ddp-store".into())
            .spawn(move || accept_loop(listener, st))
            .map_err(|e| CommError::Internal {
                rank: 0,
                message: format!("cannot start the store thread: {e}"),
            })?;
        Ok(StoreServer {
            state,
            listening,
            acceptor: Some(acceptor),
        })
    }
}

/// A rendezvous store hosted outside any process group, for launchers: with `ddprun
/// --nnodes N --max-restarts K`, node 0's launcher hosts one and every node's launcher
/// coordinates restarts through it (`ddp-launch`). Clients reach it with
/// [`Store::connect_host`]; dropping it stops it and closes their connections.
pub struct StoreHost {
    _server: StoreServer,
}

impl StoreHost {
    /// Listens on every interface at `port` for the `clients` clients of job `job` (a name that
    /// every client gives too; `DDP_TOKEN`, when set, must match as well).
    pub fn start(port: u16, clients: usize, job: &str) -> Result<StoreHost, CommError> {
        let token = std::env::var("DDP_TOKEN").ok().filter(|t| !t.is_empty());
        let job_id = crate::wire::job_id_from_name(job);
        Ok(StoreHost {
            _server: StoreServer::start(None, "0.0.0.0", port, clients, token, job_id)?,
        })
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        self.state.changed.notify_all();
        // Stop the blocking accept: on Linux, shutting a listening socket down wakes every
        // thread blocked in accept() on it with EINVAL, and the loop sees `stop`. (Not a
        // connection of our own to wake it: a firewall or a lossy loopback can drop that
        // connection, and then accept, and this drop, would wait forever.)
        // SAFETY: shutdown on a descriptor we own; it changes the socket's state only.
        unsafe {
            libc::shutdown(self.listening.as_raw_fd(), libc::SHUT_RDWR);
        }
        for c in self
            .state
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

fn accept_loop(listener: TcpListener, state: Arc<ServerState>) {
    for (id, conn) in listener.incoming().enumerate() {
        if state.stop.load(Ordering::Acquire) {
            break;
        }
        let Ok(stream) = conn else { continue };
        let id = id as u64;
        if let Ok(clone) = stream.try_clone() {
            state
                .conns
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, clone);
        }
        let st = state.clone();
        let _ = std::thread::Builder::new()
            .name("ddp-store-conn".into())
            .spawn(move || {
                serve_client(&stream, &st);
                let _ = stream.shutdown(Shutdown::Both);
                st.conns
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
            });
    }
}

fn serve_client(mut stream: &TcpStream, state: &ServerState) {
    let me = &state.me;
    let reply = me.hello(HelloKind::Accept);
    let check = |h: &crate::wire::Hello| {
        if h.kind != HelloKind::Store {
            return Err(format!("expected a store handshake, got {:?}", h.kind));
        }
        me.check(h, true)
    };
    let timeout = crate::connect::HANDSHAKE_TIMEOUT;
    if handshake_accept(stream, timeout, "the rendezvous store", &reply, check).is_err() {
        return;
    }
    let _ = stream.set_nodelay(true);
    loop {
        let req = match StoreRequest::read(&mut stream) {
            Ok(r) => r,
            Err(e) => {
                if e.kind() == io::ErrorKind::InvalidData && !state.stop.load(Ordering::Acquire) {
                    tracing::warn!("rendezvous store: bad request, closing the connection: {e}");
                }
                return;
            }
        };
        let resp = handle(state, req);
        if resp.write(&mut stream).is_err() {
            return;
        }
    }
}

fn ok(num: i64, data: Vec<u8>) -> StoreResponse {
    StoreResponse {
        status: StoreStatus::Ok,
        num,
        data,
    }
}

fn handle(state: &ServerState, req: StoreRequest) -> StoreResponse {
    let mut map = state.map.lock().unwrap_or_else(|p| p.into_inner());
    match req.cmd {
        StoreCmd::Set => {
            let Some(key) = req.keys.first() else {
                return error("SET needs a key");
            };
            map.insert(key.clone(), req.value);
            state.changed.notify_all();
            ok(0, Vec::new())
        }
        StoreCmd::Add => {
            let Some(key) = req.keys.first() else {
                return error("ADD needs a key");
            };
            let current = match map.get(key) {
                None => 0,
                Some(v) => match std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                {
                    Some(n) => n,
                    None => {
                        return error(&format!("ADD on key {key:?}, whose value is not a number"))
                    }
                },
            };
            let new = current.wrapping_add(req.num);
            map.insert(key.clone(), new.to_string().into_bytes());
            state.changed.notify_all();
            ok(new, Vec::new())
        }
        StoreCmd::Check => {
            let all = req.keys.iter().all(|k| map.contains_key(k));
            ok(all as i64, Vec::new())
        }
        StoreCmd::Get | StoreCmd::Wait => {
            let deadline = Instant::now() + Duration::from_millis(req.timeout_ms as u64);
            loop {
                let missing: Vec<&String> =
                    req.keys.iter().filter(|k| !map.contains_key(*k)).collect();
                if missing.is_empty() {
                    break;
                }
                let left = remaining(deadline);
                if left.is_zero() || state.stop.load(Ordering::Acquire) {
                    let names: Vec<String> = missing.iter().map(|k| format!("{k:?}")).collect();
                    return StoreResponse {
                        status: StoreStatus::Timeout,
                        num: 0,
                        data: names.join(", ").into_bytes(),
                    };
                }
                map = state
                    .changed
                    .wait_timeout(map, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            if req.cmd == StoreCmd::Get {
                let value = req
                    .keys
                    .first()
                    .and_then(|k| map.get(k))
                    .cloned()
                    .unwrap_or_default();
                ok(0, value)
            } else {
                ok(0, Vec::new())
            }
        }
    }
}

fn error(msg: &str) -> StoreResponse {
    StoreResponse {
        status: StoreStatus::Error,
        num: 0,
        data: msg.as_bytes().to_vec(),
    }
}

// ---------------------------------------------------------------------------------------------
// Client

/// Why one store call failed, before it is named with the store's address and rank.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The connection failed (closed, reset, no answer in time): it may be out of step now and
    /// is never used again.
    Io(io::Error),
    /// The server's bytes made no sense; the connection is dropped too.
    Protocol(String),
    /// Keys not set before the deadline (the missing ones, or empty if the server does not
    /// say); the connection stays usable.
    Timeout(String),
    /// The server (or this client) refused the request; the connection stays usable.
    Refused(String),
}

impl From<io::Error> for CallError {
    fn from(e: io::Error) -> CallError {
        CallError::Io(e)
    }
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Io(e) => match e.kind() {
                io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                    write!(f, "lost the connection (did the store's host exit?)")
                }
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    write!(f, "no response in time")
                }
                _ => write!(f, "{e}"),
            },
            CallError::Protocol(m) => write!(f, "unexpected answer: {m}"),
            CallError::Timeout(keys) => write!(f, "timed out waiting for {keys}"),
            CallError::Refused(m) => write!(f, "{m}"),
        }
    }
}

/// The connection under a [`Store`]: to ddp-comm's own server, or to a PyTorch `TCPStore`.
enum Conn {
    Ddp(TcpStream),
    Torch(TorchConn),
}

/// A client of the rendezvous store (like PyTorch's `TCPStore`): `set`, `get`, `wait`, `add`,
/// `check`, each with a deadline (the group's `timeout` unless given).
///
/// It talks to ddp-comm's own store (hosted by rank 0) or, under torchrun with
/// `TORCHELASTIC_USE_AGENT_STORE=True`, to the PyTorch `TCPStore` that torchrun's agent hosts
/// (see `torch_store.rs`); then every key is put under torch's worker prefix
/// `/worker/attempt_{TORCHELASTIC_RESTART_COUNT}/`, as torch's own workers do.
///
/// Calls from several threads are serialised. Keys under `ddp/` are used by ddp-comm itself.
pub struct Store {
    conn: Mutex<Option<Conn>>,
    addr: String,
    local: SocketAddr,
    rank: usize,
    timeout: Duration,
    /// Put in front of every key on the wire (empty for ddp-comm's own store).
    prefix: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl Store {
    /// Connects (retrying until `deadline`) and shakes hands with ddp-comm's store at
    /// `host:port`.
    pub(crate) fn connect(
        me: &Identity,
        host: &str,
        port: u16,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Store, CommError> {
        let addr = format!("{host}:{port}");
        let what = "the rendezvous store";
        let mut stream = connect_retry(me.rank, what, host, port, deadline)?;
        let reply = handshake_connect(&mut stream, &me.hello(HelloKind::Store), deadline).map_err(
            |reason| CommError::Handshake {
                rank: me.rank,
                what: what.into(),
                addr: addr.clone(),
                reason,
            },
        )?;
        if let Err(reason) = me.check(&reply, true) {
            tracing::warn!(
                "rank {} refused the rendezvous store at {addr}: {reason}",
                me.rank
            );
            return Err(CommError::Handshake {
                rank: me.rank,
                what: what.into(),
                addr,
                reason,
            });
        }
        let _ = stream.set_nodelay(true);
        let local = stream.local_addr().map_err(|e| CommError::Store {
            rank: me.rank,
            addr: addr.clone(),
            message: e.to_string(),
        })?;
        Ok(Store {
            conn: Mutex::new(Some(Conn::Ddp(stream))),
            addr,
            local,
            rank: me.rank,
            timeout,
            prefix: String::new(),
        })
    }

    /// Connects (retrying until `deadline`) to a [`StoreHost`] at `host:port` as client `index`
    /// of `clients`, of job `job`; every call then has the deadline `timeout`.
    pub fn connect_host(
        host: &str,
        port: u16,
        index: usize,
        clients: usize,
        job: &str,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Store, CommError> {
        let me = Identity {
            rank: index,
            world: clients,
            job_id: crate::wire::job_id_from_name(job),
            token: std::env::var("DDP_TOKEN").ok().filter(|t| !t.is_empty()),
        };
        Store::connect(&me, host, port, deadline, timeout)
    }

    /// Connects (retrying until `deadline`) to a PyTorch `TCPStore` at `host:port` (torchrun's
    /// agent store) and starts its protocol (VALIDATE, PING). Every key is sent as
    /// `prefix + key`.
    pub(crate) fn connect_torch(
        rank: usize,
        host: &str,
        port: u16,
        prefix: String,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Store, CommError> {
        let addr = format!("{host}:{port}");
        let what = "torchrun's agent store (a PyTorch TCPStore)";
        let stream = connect_retry(rank, what, host, port, deadline)?;
        let err = |message: String| CommError::Store {
            rank,
            addr: addr.clone(),
            message,
        };
        let local = stream.local_addr().map_err(|e| err(e.to_string()))?;
        let start_deadline = deadline.max(Instant::now() + Duration::from_secs(1));
        let conn = TorchConn::start(
            stream,
            std::process::id(),
            timeout + RESPONSE_MARGIN,
            start_deadline,
        )
        .map_err(|e| {
            err(format!(
                "PyTorch TCPStore handshake (VALIDATE, PING) failed: {e}"
            ))
        })?;
        Ok(Store {
            conn: Mutex::new(Some(Conn::Torch(conn))),
            addr,
            local,
            rank,
            timeout,
            prefix,
        })
    }

    /// The store's address, `host:port`.
    pub fn address(&self) -> &str {
        &self.addr
    }

    /// The default deadline of `get` and `wait`.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The prefix put in front of every key on the wire: empty for ddp-comm's own store,
    /// `//worker/attempt_{N}/` on torchrun's agent store (torch's `TCPStore` `/`, then the
    /// `PrefixStore` of torch's own workers).
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// This side's address of the connection to the store (its IP is the interface that
    /// reaches the store's host; peers listen on it).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Runs one call on the connection: a failure that may leave the connection out of step
    /// drops it (later calls fail at once), and every error names the store and this rank.
    /// `keys` and `timeout` describe a timeout.
    fn call<R>(
        &self,
        keys: &[&str],
        timeout: Duration,
        f: impl FnOnce(&mut Conn) -> Result<R, CallError>,
    ) -> Result<R, CommError> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = guard.as_mut() else {
            return Err(self.err("the connection was lost earlier".into()));
        };
        match f(conn) {
            Ok(r) => Ok(r),
            Err(CallError::Timeout(missing)) => Err(CommError::StoreTimeout {
                rank: self.rank,
                addr: self.addr.clone(),
                keys: if missing.is_empty() {
                    let names: Vec<String> = keys.iter().map(|k| format!("{k:?}")).collect();
                    names.join(", ")
                } else {
                    missing
                },
                timeout,
            }),
            Err(e @ CallError::Refused(_)) => Err(self.err(e.to_string())),
            Err(e) => {
                *guard = None;
                Err(self.err(e.to_string()))
            }
        }
    }

    /// Sends one request to ddp-comm's own server and reads its response (waiting up to `wait`
    /// plus a margin); a status other than OK becomes the matching [`CallError`].
    fn ddp_request(
        stream: &mut TcpStream,
        req: StoreRequest,
        wait: Duration,
    ) -> Result<StoreResponse, CallError> {
        stream.set_read_timeout(Some(wait + RESPONSE_MARGIN))?;
        stream.set_write_timeout(Some(wait + RESPONSE_MARGIN))?;
        req.write(stream)?;
        let resp = StoreResponse::read(stream)?;
        match resp.status {
            StoreStatus::Ok => Ok(resp),
            StoreStatus::Timeout => Err(CallError::Timeout(
                String::from_utf8_lossy(&resp.data).into_owned(),
            )),
            StoreStatus::Error => Err(CallError::Refused(
                String::from_utf8_lossy(&resp.data).into_owned(),
            )),
        }
    }

    fn err(&self, message: String) -> CommError {
        CommError::Store {
            rank: self.rank,
            addr: self.addr.clone(),
            message,
        }
    }

    /// The key as it travels: the prefix, then the key.
    fn wire(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn check_key(&self, key: &str) -> Result<(), CommError> {
        if key.len() > 1024 {
            return Err(self.err(format!("key of {} bytes (at most 1024)", key.len())));
        }
        Ok(())
    }

    fn millis(d: Duration) -> u32 {
        d.as_millis().min(u32::MAX as u128) as u32
    }

    fn ddp_req(cmd: StoreCmd, timeout: Duration, num: i64, keys: &[&str]) -> StoreRequest {
        StoreRequest {
            cmd,
            timeout_ms: Self::millis(timeout),
            num,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            value: Vec::new(),
        }
    }

    /// Sets `key` to `value` (at most 16 MiB), waking everyone waiting for it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.check_key(key)?;
        if value.len() > MAX_STORE_VALUE_BYTES {
            return Err(self.err(format!(
                "value of {} bytes for key {key:?} (at most {MAX_STORE_VALUE_BYTES})",
                value.len()
            )));
        }
        self.call(&[key], self.timeout, |conn| match conn {
            Conn::Ddp(s) => {
                let mut req = Self::ddp_req(StoreCmd::Set, Duration::ZERO, 0, &[key]);
                req.value = value.to_vec();
                Self::ddp_request(s, req, self.timeout).map(|_| ())
            }
            Conn::Torch(t) => t.set(&self.wire(key), value),
        })
    }

    /// Gets `key`'s value, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        self.get_timeout(key, self.timeout)
    }

    /// Gets `key`'s value, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.check_key(key)?;
        self.call(&[key], timeout, |conn| match conn {
            Conn::Ddp(s) => {
                let req = Self::ddp_req(StoreCmd::Get, timeout, 0, &[key]);
                Self::ddp_request(s, req, timeout).map(|r| r.data)
            }
            Conn::Torch(t) => t.get(&self.wire(key), timeout),
        })
    }

    /// Waits up to the store's timeout until every key in `keys` is set.
    pub fn wait(&self, keys: &[&str]) -> Result<(), CommError> {
        self.wait_timeout(keys, self.timeout)
    }

    /// Waits up to `timeout` until every key in `keys` is set.
    pub fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        for k in keys {
            self.check_key(k)?;
        }
        if keys.len() > 1024 {
            return Err(self.err(format!("{} keys in one wait (at most 1024)", keys.len())));
        }
        self.call(keys, timeout, |conn| match conn {
            Conn::Ddp(s) => {
                let req = Self::ddp_req(StoreCmd::Wait, timeout, 0, keys);
                Self::ddp_request(s, req, timeout).map(|_| ())
            }
            Conn::Torch(t) => {
                let wire: Vec<String> = keys.iter().map(|k| self.wire(k)).collect();
                let wire: Vec<&str> = wire.iter().map(String::as_str).collect();
                t.wait(&wire, timeout)
            }
        })
    }

    /// Atomically adds `delta` to the integer stored at `key` (0 if unset) and returns the new
    /// value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        self.check_key(key)?;
        self.call(&[key], self.timeout, |conn| match conn {
            Conn::Ddp(s) => {
                let req = Self::ddp_req(StoreCmd::Add, Duration::ZERO, delta, &[key]);
                Self::ddp_request(s, req, self.timeout).map(|r| r.num)
            }
            Conn::Torch(t) => t.add(&self.wire(key), delta),
        })
    }

    /// Whether every key in `keys` is set (does not wait).
    pub fn check(&self, keys: &[&str]) -> Result<bool, CommError> {
        for k in keys {
            self.check_key(k)?;
        }
        self.call(keys, self.timeout, |conn| match conn {
            Conn::Ddp(s) => {
                let req = Self::ddp_req(StoreCmd::Check, Duration::ZERO, 0, keys);
                Self::ddp_request(s, req, self.timeout).map(|r| r.num != 0)
            }
            Conn::Torch(t) => {
                let wire: Vec<String> = keys.iter().map(|k| self.wire(k)).collect();
                let wire: Vec<&str> = wire.iter().map(String::as_str).collect();
                t.check(&wire)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(rank: usize, token: Option<&str>) -> Identity {
        Identity {
            rank,
            world: 2,
            job_id: [0; 16],
            token: token.map(String::from),
        }
    }

    fn server(token: Option<&str>) -> (StoreServer, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (
            StoreServer::start(
                Some(l),
                "127.0.0.1",
                port,
                2,
                token.map(String::from),
                [0; 16],
            )
            .unwrap(),
            port,
        )
    }

    fn client(port: u16, rank: usize, token: Option<&str>) -> Result<Store, CommError> {
        let deadline = Instant::now() + Duration::from_secs(5);
        Store::connect(
            &id(rank, token),
            "127.0.0.1",
            port,
            deadline,
            Duration::from_secs(5),
        )
    }

    #[test]
    fn set_get_wait_add_check() {
        let (_server, port) = server(None);
        let a = client(port, 0, None).unwrap();
        let b = client(port, 1, None).unwrap();
        assert!(!a.check(&["k"]).unwrap());
        let waiter = std::thread::spawn(move || {
            b.wait(&["k", "j"]).unwrap();
            (b.get("k").unwrap(), b.add("n", 5).unwrap())
        });
        std::thread::sleep(Duration::from_millis(50));
        a.set("k", b"hello").unwrap();
        a.set("j", b"").unwrap();
        let (v, n) = waiter.join().unwrap();
        assert_eq!(v, b"hello");
        assert!(n == 5 || n == 7, "{n}");
        let n2 = a.add("n", 2).unwrap();
        assert!(n2 == 7 || n2 == 2, "{n2}");
        assert!(a.check(&["k", "j"]).unwrap());
        assert_eq!(a.add("n", 0).unwrap(), 7);
    }

    #[test]
    fn get_and_wait_time_out_naming_the_key() {
        let (_server, port) = server(None);
        let a = client(port, 0, None).unwrap();
        let t = Instant::now();
        let err = a
            .get_timeout("missing/key", Duration::from_millis(200))
            .unwrap_err();
        assert!(t.elapsed() >= Duration::from_millis(200));
        assert!(t.elapsed() < Duration::from_secs(3));
        let msg = err.to_string();
        assert!(
            msg.contains("missing/key") && msg.contains("timed out"),
            "{msg}"
        );
        a.set("x", b"1").unwrap();
        let err = a
            .wait_timeout(&["x", "y"], Duration::from_millis(50))
            .unwrap_err();
        assert!(
            err.to_string().contains("\"y\"") && !err.to_string().contains("\"x\""),
            "{err}"
        );
        // ADD on a non-number is an error, not a panic.
        assert!(a.add("x", 1).is_ok());
        a.set("s", b"abc").unwrap();
        assert!(a
            .add("s", 1)
            .unwrap_err()
            .to_string()
            .contains("not a number"));
    }

    #[test]
    fn wrong_token_and_world_size_are_refused() {
        let (_server, port) = server(Some("right"));
        let err = client(port, 1, Some("wrong")).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("token mismatch") && msg.contains(&port.to_string()),
            "{msg}"
        );
        let err = client(port, 1, None).unwrap_err();
        assert!(err.to_string().contains("token"), "{err}");
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut three = id(1, Some("right"));
        three.world = 3;
        let err = Store::connect(&three, "127.0.0.1", port, deadline, Duration::from_secs(1))
            .unwrap_err();
        assert!(err.to_string().contains("world size"), "{err}");
        assert!(client(port, 1, Some("right")).is_ok());
    }

    #[test]
    fn garbage_does_not_break_the_server() {
        use std::io::{Read, Write};
        let (_server, port) = server(None);
        let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut sink = Vec::new();
        let _ = raw.read_to_end(&mut sink); // the server closes the connection
        let a = client(port, 0, None).unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(a.get("k").unwrap(), b"v");
    }
}
