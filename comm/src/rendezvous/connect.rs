//! The full mesh of peer connections a group starts with: each rank listens, publishes its
//! address in the store, connects to every lower rank and accepts every higher one, each with a
//! handshake (`handshake.rs`); a stray or foreign connection is refused, never taken for a peer.
//! `transport/mesh.rs` runs the mesh once it stands.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::clock::remaining;
use crate::error::CommError;
use crate::rendezvous::handshake::{
    connect_retry, handshake_accept, handshake_connect, Identity, HANDSHAKE_TIMEOUT,
};
use crate::rendezvous::store::Store;
use crate::wire::HelloKind;

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
    store: &Store,
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
    store: &Store,
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
