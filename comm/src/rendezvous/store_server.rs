//! The rendezvous store's server: a small TCP key-value store hosted by rank 0 (like PyTorch's
//! `TCPStore`), or by a launcher ([`StoreHost`]). Its client is [`crate::Store`] (`store.rs`).
//!
//! The ranks use it while the group forms: rank 0 publishes the job id and its tuning, every rank
//! publishes the address it listens on, and each rank waits for the addresses it needs.
//!
//! One thread per client connection; waits happen here (a condition variable and the request's
//! deadline), so a client never polls. Every connection starts with the handshake of
//! `handshake.rs`; a client of another job, with another token or world size, is refused.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::clock::remaining;
use crate::error::CommError;
use crate::rendezvous::handshake::{handshake_accept, Identity, HANDSHAKE_TIMEOUT};
use crate::wire::{self, Hello, HelloKind, StoreCmd, StoreRequest, StoreResponse, StoreStatus};

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
/// [`crate::Store::connect_host`]; dropping it stops it and closes their connections.
pub struct StoreHost {
    _server: StoreServer,
}

impl StoreHost {
    /// Listens on every interface at `port` for the `clients` clients of job `job` (a name that
    /// every client gives too; `DDP_TOKEN`, when set, must match as well).
    pub fn start(port: u16, clients: usize, job: &str) -> Result<StoreHost, CommError> {
        let token = crate::launcher::vars::job_token();
        let job_id = wire::job_id_from_name(job);
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
    let check = |h: &Hello| {
        if h.kind != HelloKind::Store {
            return Err(format!("expected a store handshake, got {:?}", h.kind));
        }
        me.check(h, true)
    };
    let timeout = HANDSHAKE_TIMEOUT;
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
