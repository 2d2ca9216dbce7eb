//! The wire format: everything ddp-comm puts on a socket, in one place.
//!
//! All integers are little-endian. Every length read from a socket is checked against a cap
//! before anything is allocated, so a stray or hostile peer can cause an error, never a panic or
//! a huge allocation.
//!
//! # Handshake (every connection: store and peer)
//!
//! The connecting side sends a HELLO, the accepting side answers with an ACCEPT (its own HELLO
//! fields) or a REJECT carrying the reason as text, then closes. Layout (34 bytes + text):
//!
//! ```text
//! offset size field
//!  0     4    magic         b"DDPC"
//!  4     2    version       PROTOCOL_VERSION (3: credits)
//!  6     1    kind          1 HELLO to the store, 2 HELLO to a peer, 3 ACCEPT, 4 REJECT
//!  7     1    reserved      0
//!  8     16   job id        peers: random, made by rank 0 and published in the store (or
//!                           derived from DDP_JOB_ID when the launcher sets it); store: derived
//!                           from DDP_JOB_ID, all zero when it is not set
//! 24     4    rank          the sender's rank
//! 28     4    world size    the sender's world size
//! 32     2    text length   at most 4096
//! 34     n    text          HELLO/ACCEPT: the token (DDP_TOKEN, empty if none); REJECT: reason
//! ```
//!
//! The acceptor checks magic, version, kind, token, job id, world size and rank; any mismatch is
//! answered with a REJECT (and a `tracing::warn!` on the acceptor), so a stray or foreign
//! connection is refused and never mistaken for a peer. The connector checks the ACCEPT the same
//! way. The token travels in clear text: it keeps jobs apart, it is not a security boundary.
//!
//! # Peer frames (after the handshake, on each peer connection)
//!
//! Every message is a 32-byte header followed by `payload length` bytes:
//!
//! ```text
//! offset size field
//!  0     4    marker        b"DDPF" (catches a desynchronised stream at once)
//!  4     1    kind          1 DATA, 2 ABORT, 3 GOODBYE, 4 HEARTBEAT, 5 CREDIT
//!  5     1    op            1 all_reduce, 2 broadcast, 3 all_gather, 4 reduce_scatter, 5 barrier,
//!                           6 start-up barrier (ends every group's start-up; not numbered)
//!  6     1    dtype         1 f32, 2 f64, 3 bf16, 4 f16, 5 i32, 6 i64, 7 u8
//!  7     1    reserved      0
//!  8     4    arg           reduce op (1 sum, 2 avg, 3 min, 4 max) or broadcast root;
//!                           in an ABORT, the rank the sender blames (0xFFFFFFFF: none);
//!                           in a CREDIT, the number of DATA frames granted
//! 12     4    payload len   bytes that follow; at most the segment size (DATA) or 64 KiB (ABORT)
//! 16     8    seq           the collective's sequence number in the group (0, 1, 2, ...)
//! 24     8    count         elements in the collective's input buffer
//! ```
//!
//! A collective sends one or more DATA frames per peer link: each carries the collective's full
//! fingerprint (op, seq, dtype, count, arg) and one segment of raw element bytes (native
//! little-endian layout). The receiver compares the fingerprint with the collective it is
//! running and fails at once on any difference, naming both ("rank 1 is in all_reduce #57 (4096
//! f32, sum), rank 0 sent broadcast #57 (10 f32, root 0)"); it also checks that the payload has
//! exactly the length its algorithm expects. The per-frame overhead is 32 bytes per segment
//! (0.003% at 1 MiB segments).
//!
//! ABORT carries the sender's error message as UTF-8 text: the sender failed and every later
//! frame would be meaningless; the header's `arg` names the rank the sender blames (u32::MAX:
//! none) and the receiver fails with `rank K failed first (reported by rank X: <text>)`. GOODBYE (no
//! payload) says the sender dropped its group cleanly; the connection's close after it is not an
//! error, but waiting for data from that peer afterwards is. HEARTBEAT (no payload) says only
//! "still alive": every link carries one every `DDP_PEER_TIMEOUT / 5` from a thread of its own,
//! and a peer from which no frame at all arrives for `DDP_PEER_TIMEOUT` is declared dead.
//!
//! CREDIT (no payload) is flow control: on each link a sender may have at most
//! `LINK_CREDITS` (16) DATA frames that the receiver has not yet consumed; the receiver grants
//! more with a CREDIT frame (`arg` = frames granted) as its algorithm consumes them, in batches
//! of half that. A receiver thus never holds more than 16 segments per peer, whatever the peer
//! does: a peer that sends beyond its credits is a protocol error naming it. Control frames
//! (ABORT, GOODBYE, HEARTBEAT, CREDIT) need no credit, so liveness never waits on flow control.
//!
//! # Rendezvous store (after the handshake, on a store connection)
//!
//! Request: `cmd u8` (1 SET, 2 GET, 3 WAIT, 4 ADD, 5 CHECK), `key count u16`, `timeout ms u32`
//! (GET and WAIT), `number i64` (ADD's delta), then each key as `length u16` + UTF-8 bytes (at
//! most 1024 keys of at most 1024 bytes), then `value length u32` + bytes (SET; at most 16 MiB).
//!
//! Response: `status u8` (0 OK, 1 TIMEOUT, 2 ERROR), `number i64` (ADD's new value, CHECK's
//! 0/1), `data length u32` + bytes (GET's value, the missing keys of a TIMEOUT, or an ERROR's
//! message; at most 16 MiB).

use std::fmt;
use std::io::{self, Read, Write};

use crate::collectives::element::{DType, ReduceOp};

/// Magic bytes that open every handshake.
pub(crate) const MAGIC: [u8; 4] = *b"DDPC";
/// Version of this wire format; both sides must have the same.
pub(crate) const PROTOCOL_VERSION: u16 = 3;
/// Longest token a handshake may carry.
pub const MAX_TOKEN_BYTES: usize = 1024;
/// Longest text (token or reject reason) a handshake may carry.
const MAX_HELLO_TEXT: usize = 4096;
/// Fixed part of a handshake message.
const HELLO_BYTES: usize = 34;
/// Marker that opens every peer frame.
const FRAME_MARKER: [u8; 4] = *b"DDPF";
/// Size of a peer frame header.
pub(crate) const HEADER_BYTES: usize = 32;
/// Longest ABORT message.
pub(crate) const MAX_ABORT_BYTES: usize = 64 << 10;
/// Store limits.
const MAX_STORE_KEYS: usize = 1024;
const MAX_STORE_KEY_BYTES: usize = 1024;
/// Longest value the store accepts or returns.
pub(crate) const MAX_STORE_VALUE_BYTES: usize = 16 << 20;

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

// ---------------------------------------------------------------------------------------------
// Handshake

/// What a handshake message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HelloKind {
    /// A client of the rendezvous store says hello.
    Store = 1,
    /// A rank says hello to a peer.
    Peer = 2,
    /// The acceptor agrees; its own fields follow.
    Accept = 3,
    /// The acceptor refuses; the text is the reason.
    Reject = 4,
}

/// A handshake message (see the module documentation for the layout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    pub kind: HelloKind,
    pub job_id: [u8; 16],
    pub rank: u32,
    pub world: u32,
    /// Token (HELLO/ACCEPT) or reason (REJECT).
    pub text: String,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let text = self.text.as_bytes();
        let text = &text[..text.len().min(MAX_HELLO_TEXT)];
        let mut out = Vec::with_capacity(HELLO_BYTES + text.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.push(self.kind as u8);
        out.push(0);
        out.extend_from_slice(&self.job_id);
        out.extend_from_slice(&self.rank.to_le_bytes());
        out.extend_from_slice(&self.world.to_le_bytes());
        out.extend_from_slice(&(text.len() as u16).to_le_bytes());
        out.extend_from_slice(text);
        out
    }

    pub fn write(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.encode())?;
        w.flush()
    }

    /// Reads and checks the framing of a handshake message. The error text says what was wrong
    /// ("bad magic bytes ...", "protocol version 7, this build speaks 1").
    pub fn read(r: &mut impl Read) -> io::Result<Hello> {
        let mut fixed = [0u8; HELLO_BYTES];
        // Check the magic on its own first, so that a short foreign greeting is recognised.
        r.read_exact(&mut fixed[..4])?;
        if fixed[..4] != MAGIC {
            // Printable bytes are shown as text too: "HTTP" says at once that a web server or
            // proxy answered.
            let text = if fixed[..4].iter().all(|b| b.is_ascii_graphic()) {
                format!(" = {:?}", String::from_utf8_lossy(&fixed[..4]))
            } else {
                String::new()
            };
            return Err(invalid(format!(
                "bad magic bytes {:02x?}{text} (not a ddp-comm connection: another service \
                 answered on that address and port)",
                &fixed[..4]
            )));
        }
        r.read_exact(&mut fixed[4..])?;
        let version = u16::from_le_bytes([fixed[4], fixed[5]]);
        if version != PROTOCOL_VERSION {
            return Err(invalid(format!(
                "the other side speaks ddp-comm protocol version {version}, this build speaks {PROTOCOL_VERSION}"
            )));
        }
        let kind = match fixed[6] {
            1 => HelloKind::Store,
            2 => HelloKind::Peer,
            3 => HelloKind::Accept,
            4 => HelloKind::Reject,
            k => return Err(invalid(format!("unknown handshake kind {k}"))),
        };
        let mut job_id = [0u8; 16];
        job_id.copy_from_slice(&fixed[8..24]);
        let rank = u32::from_le_bytes(fixed[24..28].try_into().unwrap());
        let world = u32::from_le_bytes(fixed[28..32].try_into().unwrap());
        let len = u16::from_le_bytes([fixed[32], fixed[33]]) as usize;
        if len > MAX_HELLO_TEXT {
            return Err(invalid(format!(
                "handshake text of {len} bytes (at most {MAX_HELLO_TEXT})"
            )));
        }
        let mut text = vec![0u8; len];
        r.read_exact(&mut text)?;
        let text = String::from_utf8(text).map_err(|_| invalid("handshake text is not UTF-8"))?;
        Ok(Hello {
            kind,
            job_id,
            rank,
            world,
            text,
        })
    }
}

/// Formats a job id as 32 hex digits.
pub(crate) fn job_id_hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses 32 hex digits into a job id.
pub(crate) fn parse_job_id(hex: &str) -> Option<[u8; 16]> {
    let hex = hex.trim();
    if hex.len() != 32 || !hex.is_ascii() {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(id)
}

/// Compares two tokens in time independent of where they differ.
pub(crate) fn tokens_equal(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

// ---------------------------------------------------------------------------------------------
// Peer frames

/// What a peer frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    Data = 1,
    Abort = 2,
    Goodbye = 3,
    Heartbeat = 4,
    Credit = 5,
}

/// The collective a DATA frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    ReduceScatter = 4,
    Barrier = 5,
    /// The barrier that ends the group's start-up (not a user collective).
    Join = 6,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Barrier => "barrier",
            OpKind::Join => "start-up barrier",
        }
    }

    fn from_wire(b: u8) -> Option<OpKind> {
        Some(match b {
            1 => OpKind::AllReduce,
            2 => OpKind::Broadcast,
            3 => OpKind::AllGather,
            4 => OpKind::ReduceScatter,
            5 => OpKind::Barrier,
            6 => OpKind::Join,
            _ => return None,
        })
    }
}

/// The fingerprint of one collective: what every DATA frame of it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub op: OpKind,
    pub seq: u64,
    pub dtype: DType,
    pub count: u64,
    /// Reduce op (all_reduce, reduce_scatter), root (broadcast), 0 otherwise.
    pub arg: u32,
}

impl fmt::Display for OpDesc {
    /// `all_reduce #57 (4096 f32, sum)`, `broadcast #3 (10 u8, root 0)`, `barrier #9`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.op == OpKind::Join {
            return f.write_str(self.op.name());
        }
        write!(f, "{} #{}", self.op.name(), self.seq)?;
        match self.op {
            OpKind::Barrier | OpKind::Join => Ok(()),
            OpKind::AllReduce | OpKind::ReduceScatter => {
                let op = ReduceOp::from_wire(self.arg).map(|o| o.name().to_string());
                let op = op.unwrap_or_else(|| format!("reduce op {}", self.arg));
                write!(f, " ({} {}, {})", self.count, self.dtype, op)
            }
            OpKind::Broadcast => write!(f, " ({} {}, root {})", self.count, self.dtype, self.arg),
            OpKind::AllGather => write!(f, " ({} {} per rank)", self.count, self.dtype),
        }
    }
}

/// A peer frame header (see the module documentation for the layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub kind: FrameKind,
    pub op: u8,
    pub dtype: u8,
    pub arg: u32,
    pub payload_len: u32,
    pub seq: u64,
    pub count: u64,
}

impl Header {
    /// The header of a DATA frame of collective `d`.
    pub fn data(d: &OpDesc, payload_len: usize) -> Header {
        Header {
            kind: FrameKind::Data,
            op: d.op as u8,
            dtype: d.dtype.to_wire(),
            arg: d.arg,
            payload_len: payload_len as u32,
            seq: d.seq,
            count: d.count,
        }
    }

    /// The header of a control frame (ABORT or GOODBYE).
    pub fn control(kind: FrameKind, payload_len: usize) -> Header {
        Header {
            kind,
            op: 0,
            dtype: 0,
            arg: 0,
            payload_len: payload_len as u32,
            seq: 0,
            count: 0,
        }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[..4].copy_from_slice(&FRAME_MARKER);
        b[4] = self.kind as u8;
        b[5] = self.op;
        b[6] = self.dtype;
        b[8..12].copy_from_slice(&self.arg.to_le_bytes());
        b[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b[24..32].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    /// Decodes a header; the error says what is wrong with it.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        if b[..4] != FRAME_MARKER {
            return Err(format!(
                "frame does not start with the marker \"DDPF\" (got {:02x?}): the stream is out of step",
                &b[..4]
            ));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Goodbye,
            4 => FrameKind::Heartbeat,
            5 => FrameKind::Credit,
            k => return Err(format!("unknown frame kind {k}")),
        };
        Ok(Header {
            kind,
            op: b[5],
            dtype: b[6],
            arg: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            payload_len: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            seq: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            count: u64::from_le_bytes(b[24..32].try_into().unwrap()),
        })
    }

    /// The collective a DATA header belongs to, if its op and dtype are known.
    pub fn desc(&self) -> Option<OpDesc> {
        Some(OpDesc {
            op: OpKind::from_wire(self.op)?,
            seq: self.seq,
            dtype: DType::from_wire(self.dtype)?,
            count: self.count,
            arg: self.arg,
        })
    }

    /// Describes the collective of a DATA header, even a malformed one.
    pub fn describe(&self) -> String {
        match self.desc() {
            Some(d) => d.to_string(),
            None => format!(
                "an unknown collective (op {}, dtype {}, #{}, {} elements)",
                self.op, self.dtype, self.seq, self.count
            ),
        }
    }
}

/// Payloads up to this size are copied behind their header and sent with one system call.
const COALESCE_BYTES: usize = 64 << 10;

/// Writes a header and its payload. Small frames go out in one write; large ones as header then
/// payload (one extra small packet per segment). Plain writes, not `writev`: std sends with
/// `MSG_NOSIGNAL`, so a closed peer is an `EPIPE` error and never a `SIGPIPE`, even in a host
/// process that does not ignore that signal.
pub(crate) fn write_frame(w: &mut impl Write, header: &Header, payload: &[u8]) -> io::Result<()> {
    let head = header.encode();
    if payload.len() <= COALESCE_BYTES {
        let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
        frame.extend_from_slice(&head);
        frame.extend_from_slice(payload);
        w.write_all(&frame)
    } else {
        w.write_all(&head)?;
        w.write_all(payload)
    }
}

/// Writes a header and its payload to a socket with one vectored system call per attempt
/// (`sendmsg` with `MSG_NOSIGNAL`: a closed peer is an `EPIPE` error, never a `SIGPIPE`), so a
/// segment's header never goes out as a packet of its own and the payload is sent straight
/// from the caller's buffer. Partial sends continue where they stopped; the socket's write
/// timeout surfaces as `WouldBlock`/`TimedOut`, as with `write_all`.
pub(crate) fn send_frame(
    stream: &std::net::TcpStream,
    header: &Header,
    payload: &[u8],
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let head = header.encode();
    let total = head.len() + payload.len();
    let mut done = 0usize;
    while done < total {
        let mut iov = [
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
            libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            },
        ];
        let mut n = 0;
        if done < head.len() {
            iov[n] = libc::iovec {
                iov_base: head[done..].as_ptr() as *mut libc::c_void,
                iov_len: head.len() - done,
            };
            n += 1;
        }
        let from = done.saturating_sub(head.len());
        if from < payload.len() {
            iov[n] = libc::iovec {
                iov_base: payload[from..].as_ptr() as *mut libc::c_void,
                iov_len: payload.len() - from,
            };
            n += 1;
        }
        // SAFETY: a zeroed msghdr with only the iovecs set; they point into `head` and
        // `payload`, which outlive the call.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = n as _;
            libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if sent < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if sent == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += sent as usize;
    }
    Ok(())
}

/// A job id derived from a launcher's job name (`DDP_JOB_ID`): the same on every rank, never
/// all zero (all zero means "no job id" in a HELLO to the store).
pub(crate) fn job_id_from_name(name: &str) -> [u8; 16] {
    use crate::hash::{fnv1a, fnv1a_from};
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&fnv1a(name.as_bytes()).to_le_bytes());
    id[8..].copy_from_slice(&fnv1a_from(0x6c62_272e_07bb_0142, name.as_bytes()).to_le_bytes());
    if id == [0; 16] {
        id[0] = 1;
    }
    id
}

// ---------------------------------------------------------------------------------------------
// Rendezvous store

/// A store command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreCmd {
    Set = 1,
    Get = 2,
    Wait = 3,
    Add = 4,
    Check = 5,
}

/// A request to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreRequest {
    pub cmd: StoreCmd,
    pub timeout_ms: u32,
    pub num: i64,
    pub keys: Vec<String>,
    pub value: Vec<u8>,
}

/// Status of a store response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreStatus {
    Ok = 0,
    Timeout = 1,
    Error = 2,
}

/// A response of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoreResponse {
    pub status: StoreStatus,
    pub num: i64,
    pub data: Vec<u8>,
}

impl StoreRequest {
    pub fn write(&self, w: &mut impl Write) -> io::Result<()> {
        let mut out = Vec::with_capacity(32 + self.value.len());
        out.push(self.cmd as u8);
        out.extend_from_slice(&(self.keys.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.timeout_ms.to_le_bytes());
        out.extend_from_slice(&self.num.to_le_bytes());
        for k in &self.keys {
            out.extend_from_slice(&(k.len() as u16).to_le_bytes());
            out.extend_from_slice(k.as_bytes());
        }
        out.extend_from_slice(&(self.value.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.value);
        w.write_all(&out)?;
        w.flush()
    }

    /// Reads a request, checking every length against its cap.
    pub fn read(r: &mut impl Read) -> io::Result<StoreRequest> {
        let mut fixed = [0u8; 15];
        r.read_exact(&mut fixed)?;
        let cmd = match fixed[0] {
            1 => StoreCmd::Set,
            2 => StoreCmd::Get,
            3 => StoreCmd::Wait,
            4 => StoreCmd::Add,
            5 => StoreCmd::Check,
            c => return Err(invalid(format!("unknown store command {c}"))),
        };
        let nkeys = u16::from_le_bytes([fixed[1], fixed[2]]) as usize;
        if nkeys > MAX_STORE_KEYS {
            return Err(invalid(format!(
                "{nkeys} keys in one request (at most {MAX_STORE_KEYS})"
            )));
        }
        let timeout_ms = u32::from_le_bytes(fixed[3..7].try_into().unwrap());
        let num = i64::from_le_bytes(fixed[7..15].try_into().unwrap());
        let mut keys = Vec::with_capacity(nkeys);
        for _ in 0..nkeys {
            let mut l = [0u8; 2];
            r.read_exact(&mut l)?;
            let len = u16::from_le_bytes(l) as usize;
            if len > MAX_STORE_KEY_BYTES {
                return Err(invalid(format!(
                    "a key of {len} bytes (at most {MAX_STORE_KEY_BYTES})"
                )));
            }
            let mut k = vec![0u8; len];
            r.read_exact(&mut k)?;
            keys.push(String::from_utf8(k).map_err(|_| invalid("a key is not UTF-8"))?);
        }
        let value = read_blob(r, MAX_STORE_VALUE_BYTES, "value")?;
        Ok(StoreRequest {
            cmd,
            timeout_ms,
            num,
            keys,
            value,
        })
    }
}

impl StoreResponse {
    pub fn write(&self, w: &mut impl Write) -> io::Result<()> {
        let mut out = Vec::with_capacity(13 + self.data.len());
        out.push(self.status as u8);
        out.extend_from_slice(&self.num.to_le_bytes());
        out.extend_from_slice(&(self.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.data);
        w.write_all(&out)?;
        w.flush()
    }

    pub fn read(r: &mut impl Read) -> io::Result<StoreResponse> {
        let mut fixed = [0u8; 9];
        r.read_exact(&mut fixed)?;
        let status = match fixed[0] {
            0 => StoreStatus::Ok,
            1 => StoreStatus::Timeout,
            2 => StoreStatus::Error,
            s => return Err(invalid(format!("unknown store response status {s}"))),
        };
        let num = i64::from_le_bytes(fixed[1..9].try_into().unwrap());
        let data = read_blob(r, MAX_STORE_VALUE_BYTES, "response")?;
        Ok(StoreResponse { status, num, data })
    }
}

fn read_blob(r: &mut impl Read, cap: usize, what: &str) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    r.read_exact(&mut l)?;
    let len = u32::from_le_bytes(l) as usize;
    if len > cap {
        return Err(invalid(format!("a {what} of {len} bytes (at most {cap})")));
    }
    let mut v = vec![0u8; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    /// A foreign greeting (here an HTTP proxy's answer) is named, with its bytes as text.
    #[test]
    fn a_foreign_greeting_is_shown_as_text() {
        let err = Hello::read(&mut &b"HTTP/1.1 400 Bad Request\r\n"[..]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("bad magic bytes [48, 54, 54, 50] = \"HTTP\""),
            "{msg}"
        );
        assert!(msg.contains("another service"), "{msg}");
        // Unprintable bytes are shown in hex only.
        let err = Hello::read(&mut &[0u8, 1, 2, 3, 4, 5][..]).unwrap_err();
        assert!(!err.to_string().contains(" = "), "{err}");
    }

    #[test]
    fn send_frame_puts_header_and_payload_on_the_socket_in_order() {
        // 3 MiB: more than a socket buffer takes at once, so the partial-send path runs.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tx = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut rx, _) = listener.accept().unwrap();
        let payload: Vec<u8> = (0..3usize << 20).map(|i| (i * 7 % 251) as u8).collect();
        let h = Header::control(FrameKind::Abort, payload.len());
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            rx.read_to_end(&mut got).unwrap();
            got
        });
        send_frame(&tx, &h, &payload).unwrap();
        send_frame(&tx, &Header::control(FrameKind::Goodbye, 0), &[]).unwrap();
        drop(tx);
        let got = reader.join().unwrap();
        assert_eq!(got.len(), 2 * HEADER_BYTES + payload.len());
        assert_eq!(
            Header::decode(&got[..HEADER_BYTES].try_into().unwrap()).unwrap(),
            h
        );
        assert!(got[HEADER_BYTES..HEADER_BYTES + payload.len()] == payload[..]);
        let tail = &got[HEADER_BYTES + payload.len()..];
        assert_eq!(
            Header::decode(tail.try_into().unwrap()).unwrap().kind,
            FrameKind::Goodbye
        );
    }

    use super::*;

    #[test]
    fn hello_round_trip_and_rejects() {
        let h = Hello {
            kind: HelloKind::Peer,
            job_id: [7; 16],
            rank: 3,
            world: 4,
            text: "tok".into(),
        };
        let bytes = h.encode();
        assert_eq!(bytes.len(), HELLO_BYTES + 3);
        assert_eq!(Hello::read(&mut &bytes[..]).unwrap(), h);

        let err = Hello::read(&mut &b"GET / HTTP/1.1\r\n\r\n"[..]).unwrap_err();
        assert!(err.to_string().contains("magic"), "{err}");
        let mut v2 = bytes.clone();
        v2[4] = 9;
        assert!(Hello::read(&mut &v2[..])
            .unwrap_err()
            .to_string()
            .contains("version 9"));
        let mut long = bytes.clone();
        long[32..34].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(Hello::read(&mut &long[..])
            .unwrap_err()
            .to_string()
            .contains("65535"));
        // Truncated input is an error, not a panic.
        for cut in 0..bytes.len() {
            assert!(Hello::read(&mut &bytes[..cut]).is_err());
        }
    }

    #[test]
    fn header_round_trip_and_description() {
        let d = OpDesc {
            op: OpKind::AllReduce,
            seq: 57,
            dtype: DType::F32,
            count: 4096,
            arg: ReduceOp::Sum.to_wire(),
        };
        let h = Header::data(&d, 100);
        let b = h.encode();
        let back = Header::decode(&b).unwrap();
        assert_eq!(back, h);
        assert_eq!(back.desc(), Some(d));
        assert_eq!(d.to_string(), "all_reduce #57 (4096 f32, sum)");
        let mut bad = b;
        bad[0] = b'X';
        assert!(Header::decode(&bad).unwrap_err().contains("marker"));
        let mut bad = b;
        bad[4] = 77;
        assert!(Header::decode(&bad).unwrap_err().contains("kind 77"));
        let mut odd = h;
        odd.op = 99;
        assert!(odd.describe().contains("unknown collective"));
    }

    #[test]
    fn frame_writing() {
        let mut out = Vec::new();
        let h = Header::control(FrameKind::Abort, 3);
        write_frame(&mut out, &h, b"abc").unwrap();
        write_frame(&mut out, &Header::control(FrameKind::Goodbye, 0), &[]).unwrap();
        assert_eq!(out.len(), 2 * HEADER_BYTES + 3);
        assert_eq!(&out[HEADER_BYTES..HEADER_BYTES + 3], b"abc");
    }

    #[test]
    fn store_messages_round_trip_and_caps() {
        let req = StoreRequest {
            cmd: StoreCmd::Wait,
            timeout_ms: 1500,
            num: -3,
            keys: vec!["a".into(), "bé".into()],
            value: vec![1, 2, 3],
        };
        let mut buf = Vec::new();
        req.write(&mut buf).unwrap();
        assert_eq!(StoreRequest::read(&mut &buf[..]).unwrap(), req);
        for cut in 0..buf.len() {
            assert!(StoreRequest::read(&mut &buf[..cut]).is_err());
        }
        // A value length far beyond the cap is refused before allocating.
        let mut huge = vec![1u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(StoreRequest::read(&mut &huge[..])
            .unwrap_err()
            .to_string()
            .contains("at most"));
        let resp = StoreResponse {
            status: StoreStatus::Timeout,
            num: 9,
            data: b"k".to_vec(),
        };
        let mut buf = Vec::new();
        resp.write(&mut buf).unwrap();
        assert_eq!(StoreResponse::read(&mut &buf[..]).unwrap(), resp);
    }

    #[test]
    fn job_ids_and_tokens() {
        assert_eq!(job_id_from_name("a"), job_id_from_name("a"));
        assert_ne!(job_id_from_name("a"), job_id_from_name("b"));
        assert_ne!(job_id_from_name(""), [0; 16]);
        let id = [0xab; 16];
        assert_eq!(parse_job_id(&job_id_hex(&id)), Some(id));
        assert_eq!(parse_job_id("zz"), None);
        assert!(tokens_equal("abc", "abc"));
        assert!(!tokens_equal("abc", "abd"));
        assert!(!tokens_equal("abc", "ab"));
    }
}
