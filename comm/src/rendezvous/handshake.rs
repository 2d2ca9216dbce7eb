//! Reaching the other side of a connection: connecting with retries and backoff until a
//! deadline, and the handshake every connection starts with (store and peer connections alike;
//! the format is in `wire.rs`): who this rank is ([`Identity`]), what it checks of the other
//! side (token, world size, job id), and the accepting side's refusal with a reason.

use std::io;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::clock::remaining;
use crate::error::CommError;
use crate::wire::{self, Hello, HelloKind};

/// Longest a single handshake may take once connected.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
