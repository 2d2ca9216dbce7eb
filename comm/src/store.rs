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

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::transport::{connect_retry, handshake_accept, handshake_connect, remaining, Identity};
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
    local: SocketAddr,
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
        let local = listener.local_addr().map_err(|e| CommError::Listen {
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
            local,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        self.state.changed.notify_all();
        // Wake the blocking accept with a connection of our own.
        let ip = match self.local.ip() {
            std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
                std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
            }
            std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
                std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
            }
            ip => ip,
        };
        let _ = TcpStream::connect_timeout(
            &SocketAddr::new(ip, self.local.port()),
            Duration::from_secs(1),
        );
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
    let timeout = crate::transport::HANDSHAKE_TIMEOUT;
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

/// A client of the rendezvous store (like PyTorch's `TCPStore`): `set`, `get`, `wait`, `add`,
/// `check`, each with a deadline (the group's `timeout` unless given).
///
/// Calls from several threads are serialised. Keys under `ddp/` are used by ddp-comm itself.
pub struct Store {
    conn: Mutex<Option<TcpStream>>,
    addr: String,
    local: SocketAddr,
    rank: usize,
    timeout: Duration,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .finish()
    }
}

impl Store {
    /// Connects (retrying until `deadline`) and shakes hands with the store at `host:port`.
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
            conn: Mutex::new(Some(stream)),
            addr,
            local,
            rank: me.rank,
            timeout,
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

    /// This side's address of the connection to the store (its IP is the interface that
    /// reaches rank 0; peers listen on it).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    fn request(&self, req: StoreRequest, wait: Duration) -> Result<StoreResponse, CommError> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(stream) = guard.as_mut() else {
            return Err(self.err("the connection was lost earlier".into()));
        };
        let result = (|| -> io::Result<StoreResponse> {
            stream.set_read_timeout(Some(wait + RESPONSE_MARGIN))?;
            stream.set_write_timeout(Some(wait + RESPONSE_MARGIN))?;
            req.write(stream)?;
            StoreResponse::read(stream)
        })();
        match result {
            Ok(r) => Ok(r),
            Err(e) => {
                // The stream may be out of step now; never use it again.
                *guard = None;
                let what = match e.kind() {
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                        "lost the connection (did rank 0 exit?)".to_string()
                    }
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        "no response in time".to_string()
                    }
                    _ => e.to_string(),
                };
                Err(self.err(what))
            }
        }
    }

    fn err(&self, message: String) -> CommError {
        CommError::Store {
            rank: self.rank,
            addr: self.addr.clone(),
            message,
        }
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

    fn expect_ok(
        &self,
        resp: StoreResponse,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<StoreResponse, CommError> {
        match resp.status {
            StoreStatus::Ok => Ok(resp),
            StoreStatus::Timeout => Err(CommError::StoreTimeout {
                rank: self.rank,
                addr: self.addr.clone(),
                keys: if resp.data.is_empty() {
                    keys.join(", ")
                } else {
                    String::from_utf8_lossy(&resp.data).into_owned()
                },
                timeout,
            }),
            StoreStatus::Error => Err(self.err(String::from_utf8_lossy(&resp.data).into_owned())),
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
        let req = StoreRequest {
            cmd: StoreCmd::Set,
            timeout_ms: 0,
            num: 0,
            keys: vec![key.to_string()],
            value: value.to_vec(),
        };
        let resp = self.request(req, self.timeout)?;
        self.expect_ok(resp, &[key], self.timeout).map(|_| ())
    }

    /// Gets `key`'s value, waiting up to the store's timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        self.get_timeout(key, self.timeout)
    }

    /// Gets `key`'s value, waiting up to `timeout` for it to be set.
    pub fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.check_key(key)?;
        let req = StoreRequest {
            cmd: StoreCmd::Get,
            timeout_ms: Self::millis(timeout),
            num: 0,
            keys: vec![key.to_string()],
            value: Vec::new(),
        };
        let resp = self.request(req, timeout)?;
        self.expect_ok(resp, &[key], timeout).map(|r| r.data)
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
        let req = StoreRequest {
            cmd: StoreCmd::Wait,
            timeout_ms: Self::millis(timeout),
            num: 0,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            value: Vec::new(),
        };
        let resp = self.request(req, timeout)?;
        self.expect_ok(resp, keys, timeout).map(|_| ())
    }

    /// Atomically adds `delta` to the integer stored at `key` (0 if unset) and returns the new
    /// value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        self.check_key(key)?;
        let req = StoreRequest {
            cmd: StoreCmd::Add,
            timeout_ms: 0,
            num: delta,
            keys: vec![key.to_string()],
            value: Vec::new(),
        };
        let resp = self.request(req, self.timeout)?;
        self.expect_ok(resp, &[key], self.timeout).map(|r| r.num)
    }

    /// Whether every key in `keys` is set (does not wait).
    pub fn check(&self, keys: &[&str]) -> Result<bool, CommError> {
        for k in keys {
            self.check_key(k)?;
        }
        let req = StoreRequest {
            cmd: StoreCmd::Check,
            timeout_ms: 0,
            num: 0,
            keys: keys.iter().map(|k| k.to_string()).collect(),
            value: Vec::new(),
        };
        let resp = self.request(req, self.timeout)?;
        self.expect_ok(resp, keys, self.timeout).map(|r| r.num != 0)
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
