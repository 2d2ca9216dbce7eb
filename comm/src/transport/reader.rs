//! The reader thread of a link: drains the peer's socket frame by frame into a channel for the
//! communication thread, and turns everything that is not data into the group's state.
//!
//! Why a thread per link: a rank must notice a peer's socket closing, or an ABORT frame, *while
//! it waits on some other peer* (rank 1 waiting on rank 0 in a ring must still learn at once
//! that rank 3 died). On EOF, an I/O error, a malformed frame or an ABORT, the reader marks the
//! whole group failed (`health.rs`; a lost connection is evidence for the attribution there).
//! It checks every header and every length before it reads a payload, stamps the link's
//! liveness with every frame header and every [`STAMP_BYTES`] of a payload (a long frame on a
//! slow link is progress, not silence: see `liveness.rs`), counts the peer's DATA frames against the credit this rank gave
//! (a peer that ignores flow control is named in a protocol error), raises this rank's own send
//! credit on a CREDIT frame, and answers a GOODBYE by half-closing its side, so that both
//! readers reach EOF and the connection closes without resets.
//!
//! A DATA payload goes into a pool buffer, or straight into the running collective's buffer
//! when the communication thread posted a receive for that very frame before it arrived
//! (`Mesh::recv_into`: the post names the link's frame number, the collective and the length,
//! and only the reader that takes it out of its slot writes to it).

use std::io::{self, BufReader, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::Sender;

use crate::error::CommError;
use crate::transport::buffers::BufferPool;
use crate::transport::health::GroupHealth;
use crate::transport::link::{Credits, Incoming, PostSlot, LINK_CREDITS};
use crate::transport::liveness::LastHeard;
use crate::wire::{self, FrameKind, Header, HEADER_BYTES};

/// What the reader thread of the link to `peer` works with.
pub(crate) struct ReaderLink {
    pub rank: usize,
    pub peer: usize,
    pub health: Arc<GroupHealth>,
    /// Set here when the peer says GOODBYE.
    pub goodbye: Arc<AtomicBool>,
    /// Stamped with every frame that arrives.
    pub heard: Arc<LastHeard>,
    /// This rank's send credit, raised by the peer's CREDIT frames.
    pub credits: Arc<Credits>,
    /// Credits this rank granted the peer beyond the first [`LINK_CREDITS`].
    pub granted: Arc<AtomicU64>,
    /// The receive posted by the communication thread, if any.
    pub post: PostSlot,
    /// Where payloads land when no receive is posted.
    pub pool: Arc<BufferPool>,
    /// The largest DATA payload the peer may send (the segment size).
    pub max_frame: usize,
}

/// How much of a payload the reader reads between two liveness stamps.
const STAMP_BYTES: usize = 256 << 10;

/// Reads exactly `dst.len()` bytes, stamping `heard` after every [`STAMP_BYTES`] of them.
fn read_payload(reader: &mut impl Read, dst: &mut [u8], heard: &LastHeard) -> io::Result<()> {
    for piece in dst.chunks_mut(STAMP_BYTES) {
        reader.read_exact(piece)?;
        heard.stamp();
    }
    Ok(())
}

pub(crate) fn reader_loop(stream: TcpStream, link: ReaderLink, tx: Sender<Incoming>) {
    let ReaderLink {
        rank,
        peer,
        health,
        goodbye,
        heard,
        credits,
        granted,
        post,
        pool,
        max_frame,
    } = link;
    let mut received: u64 = 0;
    let mut reader = BufReader::with_capacity(64 << 10, &stream);
    let protocol = |message: String| CommError::Protocol {
        rank,
        peer,
        message,
    };
    let end: Option<CommError> = loop {
        let mut hb = [0u8; HEADER_BYTES];
        if let Err(e) = reader.read_exact(&mut hb) {
            break Some(read_error(rank, peer, e));
        }
        let header = match Header::decode(&hb) {
            Ok(h) => h,
            Err(msg) => break Some(protocol(msg)),
        };
        heard.stamp();
        let len = header.payload_len as usize;
        match header.kind {
            FrameKind::Data => {
                if len > max_frame {
                    break Some(protocol(format!(
                        "a frame of {len} bytes exceeds the limit of {max_frame} bytes"
                    )));
                }
                received += 1;
                if received > LINK_CREDITS + granted.load(Ordering::Acquire) && !health.is_failed()
                {
                    break Some(protocol(format!(
                        "rank {peer} sent more than {LINK_CREDITS} segments beyond what rank {rank} \
                         had consumed (it ignores flow control); rank {rank} stopped reading so \
                         that its memory stays bounded"
                    )));
                }
                // The communication thread's posted receive, if it waits for this very frame.
                let posted = post.lock().unwrap_or_else(|p| p.into_inner()).take_if(|p| {
                    p.frame == received && p.len == len && header.desc() == Some(p.desc)
                });
                let incoming = if let Some(p) = posted {
                    // SAFETY: the poster keeps this memory alive and untouched until the loan
                    // (dropped right after the read) is returned; nobody else took the post.
                    let dst = unsafe { std::slice::from_raw_parts_mut(p.ptr, p.len) };
                    let read = read_payload(&mut reader, dst, &heard);
                    drop(p);
                    if let Err(e) = read {
                        break Some(read_error(rank, peer, e));
                    }
                    health.landed.fetch_add(1, Ordering::Relaxed);
                    Incoming::Landed
                } else {
                    let mut buf = pool.buf(len);
                    if let Err(e) = read_payload(&mut reader, buf.as_bytes_mut(), &heard) {
                        break Some(read_error(rank, peer, e));
                    }
                    Incoming::Data(header, buf)
                };
                health.progress.fetch_add(1, Ordering::Relaxed);
                if health.is_failed() {
                    continue; // nobody will read it; keep draining until the peer closes
                }
                if tx.send(incoming).is_err() {
                    break None;
                }
            }
            FrameKind::Abort => {
                if len > wire::MAX_ABORT_BYTES {
                    break Some(protocol(format!("an ABORT message of {len} bytes")));
                }
                let mut text = vec![0u8; len];
                if let Err(e) = reader.read_exact(&mut text) {
                    break Some(read_error(rank, peer, e));
                }
                let cause = String::from_utf8_lossy(&text).into_owned();
                let blamed = (header.arg != u32::MAX).then_some(header.arg as usize);
                health.peer_aborted(peer);
                health.fail(CommError::PeerAborted {
                    rank,
                    peer,
                    blamed,
                    cause,
                });
            }
            FrameKind::Heartbeat => {
                if len != 0 {
                    break Some(protocol(format!(
                        "a HEARTBEAT with a payload of {len} bytes"
                    )));
                }
            }
            FrameKind::Credit => {
                if len != 0 {
                    break Some(protocol(format!("a CREDIT with a payload of {len} bytes")));
                }
                credits.grant(u64::from(header.arg));
            }
            FrameKind::Goodbye => {
                goodbye.store(true, Ordering::Release);
                let _ = tx.send(Incoming::Goodbye);
                // Answer the half-close so that the peer's reader reaches EOF too.
                let _ = stream.shutdown(Shutdown::Write);
            }
        }
    };
    if let Some(err) = end {
        let quiet = goodbye.load(Ordering::Acquire) || health.is_closing();
        if !quiet {
            match err {
                CommError::PeerClosed { .. } | CommError::PeerIo { .. } => health.peer_lost(err),
                _ => health.fail(err),
            }
        }
    }
}

fn read_error(rank: usize, peer: usize, e: io::Error) -> CommError {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted => CommError::PeerClosed { rank, peer },
        _ => CommError::PeerIo {
            rank,
            peer,
            message: format!("receiving from rank {peer}: {e}"),
        },
    }
}
