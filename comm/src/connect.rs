//! Connecting: retries with backoff, the handshakes of store and peer connections, and the
//! full mesh of peer connections a group starts with (each rank listens, publishes its address
//! in the store, connects to every lower rank and accepts every higher one; a stray or foreign
//! connection is refused, never taken for a peer). `transport.rs` runs the mesh once it stands.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::transport::remaining;
use crate::wire::{self, Hello, HelloKind};

/// Longest a single handshake may take once connected.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Connecting and handshakes

/// Connects to `host:port`, retrying (with backoff) until `deadline`. The error names the
/// address and the last failure.
pub(crate) fn connect_retry(
    rank: usize,
    what: &str,
    host: &str,
    port: u16,
    deadline: Instant,
) -> Result<TcpStream, CommError> {
    let start = Instant::now();
    let mut backoff = Duration::from_millis(10);
    let mut last_error = String::from("no attempt made");
    loop {
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = remaining(deadline)
                        .clamp(Duration::from_millis(50), Duration::from_secs(5));
                    match TcpStream::connect_timeout(&addr, left) {
                        Ok(s) => return Ok(s),
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve {host:?}: {e}"),
        }
        if Instant::now() >= deadline {
            return Err(CommError::Connect {
                rank,
                what: what.to_string(),
                addr: format!("{host}:{port}"),
                waited: start.elapsed(),
                last_error,
            });
        }
        std::thread::sleep(backoff.min(remaining(deadline)));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

/// Who this rank is, as its handshakes say it.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub rank: usize,
    pub world: usize,
    pub job_id: [u8; 16],
    pub token: Option<String>,
}

impl Identity {
    pub fn hello(&self, kind: HelloKind) -> Hello {
        Hello {
            kind,
            job_id: self.job_id,
            rank: self.rank as u32,
            world: self.world as u32,
            text: self.token.clone().unwrap_or_default(),
        }
    }

    /// Checks the token, world size and (if `check_job`) job id of a handshake from the other
    /// side; the error is the reason to give.
    pub fn check(&self, h: &Hello, check_job: bool) -> Result<(), String> {
        match (&self.token, h.text.as_str()) {
            (None, "") => {}
            (None, _) => {
                return Err("the connecting side presents a token but this rank has none (is DDP_TOKEN set on every rank?)".into())
            }
            (Some(_), "") => {
                return Err("the other side presents no token but this rank requires one (DDP_TOKEN)".into())
            }
            (Some(mine), theirs) => {
                if !wire::tokens_equal(mine, theirs) {
                    return Err("token mismatch (DDP_TOKEN differs)".into());
                }
            }
        }
        if h.world as usize != self.world {
            return Err(format!(
                "world size mismatch: the other side (rank {}) has world size {}, this side has {}",
                h.rank, h.world, self.world
            ));
        }
        if h.rank as usize >= self.world {
            return Err(format!(
                "rank {} is not below the world size {}",
                h.rank, self.world
            ));
        }
        if check_job && h.job_id != self.job_id {
            return Err(format!(
                "job id mismatch: the other side (rank {}) is in job {}, this side is in job {} \
                 (a process of another job? is DDP_JOB_ID the same on every rank?)",
                h.rank,
                wire::job_id_hex(&h.job_id),
                wire::job_id_hex(&self.job_id)
            ));
        }
        Ok(())
    }
}

fn describe_handshake_error(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            "no handshake arrived in time".to_string()
        }
        io::ErrorKind::UnexpectedEof => {
            "the other side closed the connection during the handshake".to_string()
        }
        _ => e.to_string(),
    }
}

/// Connecting side: sends `hello`, returns the acceptor's ACCEPT, or the reason it failed.
pub(crate) fn handshake_connect(
    stream: &mut TcpStream,
    hello: &Hello,
    deadline: Instant,
) -> Result<Hello, String> {
    let t = remaining(deadline).clamp(Duration::from_millis(100), HANDSHAKE_TIMEOUT);
    stream
        .set_read_timeout(Some(t))
        .map_err(|e| e.to_string())?;
    hello
        .write(stream)
        .map_err(|e| format!("sending the handshake: {e}"))?;
    let reply = Hello::read(stream).map_err(|e| describe_handshake_error(&e))?;
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    match reply.kind {
        HelloKind::Accept => Ok(reply),
        HelloKind::Reject => Err(format!("refused: {}", reply.text)),
        k => Err(format!("unexpected handshake reply {k:?}")),
    }
}

/// Accepting side: reads a HELLO, runs `check` on it, answers ACCEPT (`reply`) or REJECT. A
/// refusal is logged with `tracing::warn!` and returned as the reason.
pub(crate) fn handshake_accept(
    stream: &TcpStream,
    timeout: Duration,
    what: &str,
    reply: &Hello,
    check: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<Hello, String> {
    let from = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "an unknown address".into());
    let mut stream = stream;
    let result = (|| {
        stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(100))))
            .map_err(|e| e.to_string())?;
        let hello = Hello::read(&mut stream).map_err(|e| describe_handshake_error(&e))?;
        if let Err(reason) = check(&hello) {
            let reject = Hello {
                kind: HelloKind::Reject,
                job_id: reply.job_id,
                rank: reply.rank,
                world: reply.world,
                text: reason.clone(),
            };
            let _ = reject.write(&mut stream);
            return Err(reason);
        }
        reply
            .write(&mut stream)
            .map_err(|e| format!("sending the handshake reply: {e}"))?;
        stream.set_read_timeout(None).map_err(|e| e.to_string())?;
        Ok(hello)
    })();
    if let Err(reason) = &result {
        tracing::warn!("{what} refused a connection from {from}: {reason}");
    }
    result
}

// ---------------------------------------------------------------------------------------------
// Building the mesh

/// Store keys under which each rank publishes its listening address.
pub(crate) fn addr_key(rank: usize) -> String {
    format!("ddp/addr/{rank}")
}

/// Connects this rank to every other rank: rank r connects to ranks below it and accepts
/// connections from ranks above it, each with a handshake. Returns the streams indexed by peer
/// rank (`None` at this rank's index).
///
/// Where a rank listens: rank 0 on every interface, advertising `MASTER_ADDR` (which every rank
/// reaches by definition, whatever this host believes its own name resolves to); the others on
/// `local_ip`, the address of their connection to the store (the interface that routes to rank
/// 0).
pub(crate) fn connect_mesh(
    me: &Identity,
    store: &crate::store::Store,
    local_ip: std::net::IpAddr,
    master_addr: &str,
    deadline: Instant,
) -> Result<Vec<Option<TcpStream>>, CommError> {
    let rank = me.rank;
    let (bind_ip, host) = if rank == 0 {
        let any: std::net::IpAddr = if local_ip.is_ipv6() {
            std::net::Ipv6Addr::UNSPECIFIED.into()
        } else {
            std::net::Ipv4Addr::UNSPECIFIED.into()
        };
        (any, master_addr.to_string())
    } else {
        (local_ip, local_ip.to_string())
    };
    let listen_err = |e: io::Error| CommError::Listen {
        rank,
        what: "peer connections".into(),
        addr: format!("{bind_ip}:0"),
        message: e.to_string(),
    };
    let listener = TcpListener::bind((bind_ip, 0)).map_err(listen_err)?;
    let listen_addr = listener.local_addr().map_err(listen_err)?;
    // "HOST PORT" (HOST may be a name or an IPv6 address, so no "host:port").
    let published = format!("{host} {}", listen_addr.port());
    store.set(&addr_key(rank), published.as_bytes())?;

    let higher = me.world - rank - 1;
    let mut streams: Vec<Option<TcpStream>> = (0..me.world).map(|_| None).collect();
    let give_up = AtomicBool::new(false);
    let accepted = std::thread::scope(|scope| -> Result<Vec<(usize, TcpStream)>, CommError> {
        let acceptor =
            scope.spawn(|| accept_peers(me, &listener, listen_addr, higher, deadline, &give_up));
        // Connect to every lower rank, in order.
        let mut result = Ok(());
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            match connect_peer(me, store, peer, deadline) {
                Ok(s) => *slot = Some(s),
                Err(e) => {
                    give_up.store(true, Ordering::Release);
                    result = Err(e);
                    break;
                }
            }
        }
        let accepted = acceptor.join().unwrap_or_else(|_| {
            Err(CommError::Internal {
                rank,
                message: "peer acceptor thread panicked".into(),
            })
        });
        result?;
        accepted
    })?;
    for (peer, s) in accepted {
        streams[peer] = Some(s);
    }
    Ok(streams)
}

fn connect_peer(
    me: &Identity,
    store: &crate::store::Store,
    peer: usize,
    deadline: Instant,
) -> Result<TcpStream, CommError> {
    let raw = store.get_timeout(&addr_key(peer), remaining(deadline))?;
    let published = String::from_utf8_lossy(&raw).into_owned();
    let parsed = published
        .rsplit_once(' ')
        .and_then(|(host, port)| Some((host.to_string(), port.parse::<u16>().ok()?)));
    let (host, port) = parsed.ok_or_else(|| CommError::Store {
        rank: me.rank,
        addr: store.address().to_string(),
        message: format!("rank {peer} published an invalid address {published:?}"),
    })?;
    let text = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let what = format!("rank {peer}");
    let mut stream = connect_retry(me.rank, &what, &host, port, deadline)?;
    let reply =
        handshake_connect(&mut stream, &me.hello(HelloKind::Peer), deadline).map_err(|reason| {
            CommError::Handshake {
                rank: me.rank,
                what: what.clone(),
                addr: text.clone(),
                reason,
            }
        })?;
    let check = me.check(&reply, true).and_then(|()| {
        if reply.rank as usize == peer {
            Ok(())
        } else {
            Err(format!(
                "expected rank {peer} at {text}, found rank {}",
                reply.rank
            ))
        }
    });
    if let Err(reason) = check {
        tracing::warn!(
            "rank {} refused the connection to {text}: {reason}",
            me.rank
        );
        return Err(CommError::Handshake {
            rank: me.rank,
            what,
            addr: text,
            reason,
        });
    }
    Ok(stream)
}

fn accept_peers(
    me: &Identity,
    listener: &TcpListener,
    listen_addr: SocketAddr,
    count: usize,
    deadline: Instant,
    give_up: &AtomicBool,
) -> Result<Vec<(usize, TcpStream)>, CommError> {
    let start = Instant::now();
    let mut got: Vec<(usize, TcpStream)> = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::Listen {
            rank: me.rank,
            what: "peer connections".into(),
            addr: listen_addr.to_string(),
            message: e.to_string(),
        })?;
    let what = format!("rank {} (listening on {listen_addr})", me.rank);
    while got.len() < count {
        match listener.accept() {
            Ok((stream, _)) => {
                if stream.set_nonblocking(false).is_err() {
                    continue;
                }
                let taken: Vec<usize> = got.iter().map(|(r, _)| *r).collect();
                let timeout = remaining(deadline).min(HANDSHAKE_TIMEOUT);
                let reply = me.hello(HelloKind::Accept);
                let result = handshake_accept(&stream, timeout, &what, &reply, |h| {
                    if h.kind != HelloKind::Peer {
                        return Err(format!("expected a peer handshake, got {:?}", h.kind));
                    }
                    me.check(h, true)?;
                    let r = h.rank as usize;
                    if r <= me.rank {
                        return Err(format!(
                            "rank {r} should not connect to rank {} (lower ranks accept)",
                            me.rank
                        ));
                    }
                    if taken.contains(&r) {
                        return Err(format!(
                            "rank {r} is already connected (two processes with rank {r}?)"
                        ));
                    }
                    Ok(())
                });
                if let Ok(h) = result {
                    got.push((h.rank as usize, stream));
                }
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                if Instant::now() >= deadline || give_up.load(Ordering::Acquire) {
                    let missing: Vec<String> = (me.rank + 1..me.world)
                        .filter(|r| !got.iter().any(|(g, _)| g == r))
                        .map(|r| r.to_string())
                        .collect();
                    return Err(CommError::PeersMissing {
                        rank: me.rank,
                        peers: missing.join(", "),
                        addr: listen_addr.to_string(),
                        waited: start.elapsed(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                return Err(CommError::Listen {
                    rank: me.rank,
                    what: "peer connections".into(),
                    addr: listen_addr.to_string(),
                    message: e.to_string(),
                })
            }
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn stray_and_foreign_connections_are_refused_not_taken_for_peers() {
        let me = Identity {
            rank: 0,
            world: 2,
            job_id: [1; 16],
            token: Some("t".into()),
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let give_up = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        std::thread::scope(|s| {
            let acceptor = s.spawn(|| accept_peers(&me, &listener, addr, 1, deadline, &give_up));
            // Not ddp-comm at all.
            let mut g = TcpStream::connect(addr).unwrap();
            g.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let mut sink = Vec::new();
            g.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = g.read_to_end(&mut sink);
            // Another job, a wrong token, a wrong world size, a rank that must not connect.
            let cases = [
                (1, 2, [2u8; 16], "t", "job id mismatch"),
                (1, 2, [1; 16], "x", "token mismatch"),
                (1, 3, [1; 16], "t", "world size mismatch"),
                (0, 2, [1; 16], "t", "should not connect"),
            ];
            for (rank, world, job_id, token, why) in cases {
                let other = Identity {
                    rank,
                    world,
                    job_id,
                    token: Some(token.into()),
                };
                let mut f = TcpStream::connect(addr).unwrap();
                let err =
                    handshake_connect(&mut f, &other.hello(HelloKind::Peer), deadline).unwrap_err();
                assert!(err.contains("refused") && err.contains(why), "{err}");
            }
            // The real peer is still accepted.
            let good = Identity {
                rank: 1,
                world: 2,
                job_id: [1; 16],
                token: Some("t".into()),
            };
            let mut p = TcpStream::connect(addr).unwrap();
            let reply = handshake_connect(&mut p, &good.hello(HelloKind::Peer), deadline).unwrap();
            assert_eq!((reply.kind, reply.rank), (HelloKind::Accept, 0));
            let got = acceptor.join().unwrap().unwrap();
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].0, 1);
        });
    }

    #[test]
    fn missing_peers_are_named() {
        let me = Identity {
            rank: 1,
            world: 4,
            job_id: [1; 16],
            token: None,
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        let err =
            accept_peers(&me, &listener, addr, 2, deadline, &AtomicBool::new(false)).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rank(s) 2, 3") && msg.contains(&addr.to_string()),
            "{msg}"
        );
    }
}
