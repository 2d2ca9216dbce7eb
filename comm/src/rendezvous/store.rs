//! [`Store`], the client of the rendezvous store (like PyTorch's `TCPStore`): `set`, `get`,
//! `wait`, `add`, `check`, each with a deadline. Every client call has a deadline; a lost
//! connection is an error naming the store's address.
//!
//! It talks to ddp-comm's own server (`store_server.rs`, hosted by rank 0) or, under torchrun
//! with `TORCHELASTIC_USE_AGENT_STORE=True`, to the PyTorch `TCPStore` that torchrun's agent
//! already hosts on `MASTER_ADDR:MASTER_PORT`, speaking torch's protocol (`torch_store.rs`)
//! with the same calls. It stays available to users through [`crate::ProcessGroup::store`] for
//! small coordination (keys of your own should use a prefix other than `ddp/`).

use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{CommError, StoreCallError};
use crate::rendezvous::handshake::{connect_retry, handshake_connect, Identity};
use crate::rendezvous::torch_store::TorchConn;
use crate::wire::{
    self, HelloKind, StoreCmd, StoreRequest, StoreResponse, StoreStatus, MAX_STORE_VALUE_BYTES,
};

/// Extra time a client waits for a response beyond the request's own deadline.
const RESPONSE_MARGIN: Duration = Duration::from_secs(10);

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

    /// Connects (retrying until `deadline`) to a [`StoreHost`](crate::StoreHost) at `host:port` as client `index`
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
            job_id: wire::job_id_from_name(job),
            token: crate::launcher::vars::job_token(),
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

    /// A second connection of `rank` to the PyTorch store this one talks to, on `host:port`,
    /// with the same key prefix: a socket of its own, for a thread whose calls must not wait
    /// behind this connection's (a beat, a look-out). `timeout` bounds the connect and each call.
    pub(crate) fn torch_connection_of_its_own(
        &self,
        rank: usize,
        host: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<Store, CommError> {
        let prefix = self.key_prefix().to_string();
        Store::connect_torch(rank, host, port, prefix, Instant::now() + timeout, timeout)
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
        f: impl FnOnce(&mut Conn) -> Result<R, StoreCallError>,
    ) -> Result<R, CommError> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let Some(conn) = guard.as_mut() else {
            return Err(self.err("the connection was lost earlier".into()));
        };
        match f(conn) {
            Ok(r) => Ok(r),
            Err(StoreCallError::Timeout(missing)) => Err(CommError::StoreTimeout {
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
            Err(e @ StoreCallError::Refused(_)) => Err(self.err(e.to_string())),
            Err(e) => {
                *guard = None;
                Err(self.err(e.to_string()))
            }
        }
    }

    /// Sends one request to ddp-comm's own server and reads its response (waiting up to `wait`
    /// plus a margin); a status other than OK becomes the matching [`StoreCallError`].
    fn ddp_request(
        stream: &mut TcpStream,
        req: StoreRequest,
        wait: Duration,
    ) -> Result<StoreResponse, StoreCallError> {
        stream.set_read_timeout(Some(wait + RESPONSE_MARGIN))?;
        stream.set_write_timeout(Some(wait + RESPONSE_MARGIN))?;
        req.write(stream)?;
        let resp = StoreResponse::read(stream)?;
        match resp.status {
            StoreStatus::Ok => Ok(resp),
            StoreStatus::Timeout => Err(StoreCallError::Timeout(
                String::from_utf8_lossy(&resp.data).into_owned(),
            )),
            StoreStatus::Error => Err(StoreCallError::Refused(
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

    /// Sets `key` to `desired` if its value is `expected` (an empty `expected` matches a
    /// missing key), atomically; returns the value after the call. PyTorch's `TCPStore` only
    /// (ddp-comm's own store has no such call: an error).
    pub(crate) fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, CommError> {
        self.check_key(key)?;
        self.call(&[key], self.timeout, |conn| match conn {
            Conn::Ddp(_) => Err(StoreCallError::Refused(
                "compare_set needs a PyTorch TCPStore".into(),
            )),
            Conn::Torch(t) => t.compare_set(&self.wire(key), expected, desired),
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
    use crate::rendezvous::store_server::StoreServer;
    use std::net::TcpListener;

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
