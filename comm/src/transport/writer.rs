//! The writer thread of a link: sends, in order, what the communication thread and the liveness
//! thread queue for one peer.
//!
//! Why a thread per link: sends are queued and return at once, so the communication thread can
//! receive and reduce segment k+1 while segment k is still on the wire to the right neighbour,
//! and two ranks sending to each other can never deadlock on full socket buffers (every reader
//! keeps draining).
//!
//! Flow control: a DATA frame goes out only with credit (at most `LINK_CREDITS` frames the peer
//! has not consumed; see `wire.rs`, CREDIT). A writer waiting for credit does not block the
//! communication thread (sends are queued); it sends the credits this rank owes the peer (they
//! must not wait behind its data: two writers would wait for each other), and sends heartbeats
//! itself, so that a peer slow to consume (a long step) never takes this rank for dead. After a
//! failure the writer drops its queued DATA frames and sends only the ABORT; on a clean
//! shutdown it sends GOODBYE after its queue and half-closes the socket.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Receiver;

use crate::error::CommError;
use crate::transport::health::GroupHealth;
use crate::transport::link::{Credits, Outgoing, LINK_CREDITS};
use crate::wire::{self, FrameKind, Header};

/// What the writer thread of the link to `peer` works with.
pub(crate) struct WriterLink {
    pub rank: usize,
    pub peer: usize,
    pub health: Arc<GroupHealth>,
    /// Set by the link's reader when the peer said GOODBYE.
    pub goodbye: Arc<AtomicBool>,
    /// Credits the peer granted us (raised by the reader, spent here) and credits we owe it.
    pub credits: Arc<Credits>,
    /// The socket's write timeout (a peer that stops reading), for the error message.
    pub timeout: Duration,
    /// How often to send a heartbeat while waiting for credit.
    pub heartbeat_every: Duration,
}

/// The writer of one link: sends what the communication and liveness threads queue, in order.
/// A DATA frame first waits for credit (see `wire.rs`, CREDIT); while it waits, the writer sends
/// a heartbeat itself every `interval`, so that a peer that is slow to consume (a long step)
/// never takes this rank for dead.
pub(crate) fn writer_loop(mut stream: TcpStream, link: WriterLink, rx: Receiver<Outgoing>) {
    let WriterLink {
        rank,
        peer,
        health,
        goodbye,
        credits,
        timeout,
        heartbeat_every: interval,
    } = link;
    let heartbeat = Header::control(FrameKind::Heartbeat, 0);
    let mut sent: u64 = 0;
    // Sends the credits granted to the peer since the last CREDIT frame, if any.
    let send_grants = |stream: &mut TcpStream| -> io::Result<()> {
        let frames = credits.to_grant.swap(0, Ordering::AcqRel);
        if frames == 0 {
            return Ok(());
        }
        let mut header = Header::control(FrameKind::Credit, 0);
        header.arg = frames.min(u64::from(u32::MAX)) as u32;
        wire::write_frame(stream, &header, &[])
    };
    // Waits until DATA frame number `sent + 1` has credit: Ok(false) if the group failed
    // meanwhile (the frame is dropped), an error if a heartbeat could not be written.
    let wait_for_credit_slow = |stream: &mut TcpStream, sent: u64| -> io::Result<bool> {
        loop {
            send_grants(stream)?;
            {
                let granted = credits.granted.lock().unwrap_or_else(|p| p.into_inner());
                if sent < LINK_CREDITS + *granted {
                    return Ok(true);
                }
                // (Closing is no reason to drop data: frames queued before the group was
                // dropped still go out, before the GOODBYE, as the peer consumes them.)
                if health.is_failed() {
                    return Ok(false);
                }
                // A peer that said GOODBYE grants nothing more: it left while this rank still
                // had data for it (the caller reports that).
                if goodbye.load(Ordering::Acquire) {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        format!("rank {peer} said goodbye"),
                    ));
                }
                let (granted, waited) = credits
                    .changed
                    .wait_timeout(granted, interval)
                    .unwrap_or_else(|p| p.into_inner());
                if sent < LINK_CREDITS + *granted {
                    return Ok(true);
                }
                if !waited.timed_out() {
                    continue;
                }
            }
            if health.is_failed() {
                return Ok(false);
            }
            wire::write_frame(stream, &heartbeat, &[])?;
        }
    };
    let wait_for_credit = |stream: &mut TcpStream, sent: u64| -> io::Result<bool> {
        if sent < LINK_CREDITS + *credits.granted.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(true);
        }
        credits.waiting.store(true, Ordering::Release);
        let waited = wait_for_credit_slow(stream, sent);
        credits.waiting.store(false, Ordering::Release);
        waited
    };
    for msg in rx.iter() {
        let data = matches!(msg, Outgoing::Data(..));
        let written = match msg {
            Outgoing::Data(header, payload) => {
                if health.is_failed() {
                    continue; // the protocol is over; only the ABORT matters now
                }
                match wait_for_credit(&mut stream, sent) {
                    Ok(true) => {
                        sent += 1;
                        wire::send_frame(&stream, &header, payload.as_bytes())
                    }
                    Ok(false) => continue,
                    Err(e) => Err(e),
                }
            }
            // A peer that said GOODBYE reads nothing more (its reader answered by shutting our
            // direction down): heartbeats and credits for it are moot, and not an error.
            Outgoing::Heartbeat | Outgoing::Credit
                if health.is_failed() || goodbye.load(Ordering::Acquire) =>
            {
                continue
            }
            Outgoing::Heartbeat => wire::write_frame(&mut stream, &heartbeat, &[]),
            Outgoing::Credit => send_grants(&mut stream),
            Outgoing::Abort(text, blamed) => {
                let bytes = text.as_bytes();
                let bytes = &bytes[..bytes.len().min(wire::MAX_ABORT_BYTES)];
                let mut header = Header::control(FrameKind::Abort, bytes.len());
                header.arg = blamed.map_or(u32::MAX, |r| r.min(u32::MAX as usize - 1) as u32);
                let _ = wire::write_frame(&mut stream, &header, bytes);
                break;
            }
            Outgoing::Goodbye => {
                let _ =
                    wire::write_frame(&mut stream, &Header::control(FrameKind::Goodbye, 0), &[]);
                break;
            }
        };
        if let Err(e) = written {
            // A heartbeat or credit that raced with the peer's GOODBYE: the peer left after
            // receiving everything it needed from us, so this is the end of the link, no failure.
            // (DATA for a departed peer is: it left while this rank still needed it.)
            let quiet = !data && goodbye.load(Ordering::Acquire);
            if !quiet && !health.is_closing() {
                let err = if goodbye.load(Ordering::Acquire) {
                    CommError::PeerLeft { rank, peer }
                } else {
                    match e.kind() {
                        io::ErrorKind::BrokenPipe
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted => CommError::PeerClosed { rank, peer },
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CommError::PeerIo {
                            rank,
                            peer,
                            message: format!(
                                "sending to rank {peer} made no progress for {timeout:?} (is rank {peer} stuck?)"
                            ),
                        },
                        _ => CommError::PeerIo {
                            rank,
                            peer,
                            message: format!("sending to rank {peer}: {e}"),
                        },
                    }
                };
                match err {
                    CommError::PeerLeft { .. } => health.fail(err),
                    _ => health.peer_lost(err),
                }
            }
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Write);
}
