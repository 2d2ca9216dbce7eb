//! What one link (the connection to one peer) is made of, shared by the communication thread
//! and the link's reader and writer threads: the messages they hand each other ([`Outgoing`],
//! [`Incoming`]), flow control ([`Credits`]), and the memory of the running collective that the
//! link's threads use without owning it ([`Loans`], [`Payload::Lent`], [`Post`]).

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};

use crate::transport::buffers::PooledBuf;
use crate::wire::{Header, OpDesc};

/// DATA frames a rank may have on a link that the receiver has not consumed yet (see `wire.rs`,
/// CREDIT): what bounds the memory a peer can make a rank hold, 16 segments per link (16 MiB at
/// the default 1 MiB segments), and still enough to keep a pipelined ring busy.
pub(crate) const LINK_CREDITS: u64 = 16;

/// A link's flow control. `granted`: the credits the peer has granted us beyond the first
/// [`LINK_CREDITS`], raised by the link's reader on every CREDIT frame and waited on by its
/// writer before each DATA frame. `to_grant`: credits the communication thread has granted the
/// peer that the writer has yet to send; they must not wait behind DATA frames queued to the
/// writer (two writers each waiting for the other's credit would deadlock), so the writer sends
/// them whenever it looks: on a nudge through its queue, and while it waits for credit itself.
#[derive(Default)]
pub(crate) struct Credits {
    pub granted: Mutex<u64>,
    pub changed: Condvar,
    pub to_grant: AtomicU64,
    /// Whether the writer waits for credit right now: a closing mesh waits for it (see
    /// `Mesh::drop`).
    pub waiting: AtomicBool,
}

impl Credits {
    /// The peer granted `frames` more (a CREDIT frame, read by the link's reader).
    pub fn grant(&self, frames: u64) {
        *self.granted.lock().unwrap_or_else(|p| p.into_inner()) += frames;
        self.changed.notify_all();
    }

    /// Wakes a writer waiting for credit, to look at the group's state (it failed).
    pub fn wake(&self) {
        self.changed.notify_all();
    }
}

/// What the communication thread hands a writer thread.
pub(crate) enum Outgoing {
    Data(Header, Payload),
    /// The error text and the rank it blames.
    Abort(String, Option<usize>),
    Goodbye,
    /// "Still alive", from the liveness thread.
    Heartbeat,
    /// "Send the credits granted to the peer" (`Credits::to_grant`), from the communication
    /// thread.
    Credit,
}

/// What a reader thread hands the communication thread.
pub(crate) enum Incoming {
    /// A frame read into a pool buffer.
    Data(Header, PooledBuf),
    /// A frame read straight into the posted receive's memory (see `Mesh::recv_into`); the
    /// reader checked that it belongs to the posted collective and has the posted length.
    Landed,
    Goodbye,
}

/// Memory of the running collective that a link's reader or writer thread uses without owning
/// it: the caller's buffer, sent from in place (`Mesh::send_lent`) or received into in place
/// (`Mesh::recv_into`). Counted per link until the thread is done with it;
/// `Mesh::settle` waits for the count to reach zero before the collective may return.
#[derive(Default)]
pub(crate) struct Loans {
    pub out: Mutex<u64>,
    pub returned: Condvar,
}

impl Loans {
    /// Counts one more loan, returned when the [`Loan`] drops.
    pub fn lend(self: &Arc<Self>) -> Loan {
        *self.out.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Loan(self.clone())
    }
}

/// One outstanding loan: dropping it returns it.
pub(crate) struct Loan(Arc<Loans>);

impl Drop for Loan {
    fn drop(&mut self) {
        let mut out = self.0.out.lock().unwrap_or_else(|p| p.into_inner());
        *out -= 1;
        if *out == 0 {
            self.0.returned.notify_all();
        }
    }
}

/// The bytes of a DATA frame: a pool buffer the writer owns, or memory lent by the
/// communication thread for as long as the loan is out (`Mesh::send_lent`).
pub(crate) enum Payload {
    Owned(PooledBuf),
    Lent {
        ptr: *const u8,
        len: usize,
        _loan: Loan,
    },
}

// SAFETY: lent memory is only read, and its lender keeps it alive and unmodified until the loan
// is returned (the contract of `Mesh::send_lent`, enforced by `Mesh::settle`).
unsafe impl Send for Payload {}

impl Payload {
    /// The frame's bytes, wherever they lie.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Owned(b) => b.as_bytes(),
            // SAFETY: see `unsafe impl Send for Payload`.
            Payload::Lent { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

/// A receive posted by the communication thread (`Mesh::recv_into`): the payload of the
/// link's DATA frame number `frame`, if it belongs to `desc` and has `len` bytes, goes straight
/// to `ptr` instead of into a pool buffer.
pub(crate) struct Post {
    pub frame: u64,
    pub desc: OpDesc,
    pub ptr: *mut u8,
    pub len: usize,
    pub _loan: Loan,
}

// SAFETY: the poster keeps the memory alive and untouched until the loan is returned (the
// contract of `Mesh::recv_into`, enforced by `Mesh::settle`); only the thread that takes the
// post out of its slot writes to it.
unsafe impl Send for Post {}

/// A link's slot for the receive posted by the communication thread, taken by the reader.
pub(crate) type PostSlot = Arc<Mutex<Option<Post>>>;
