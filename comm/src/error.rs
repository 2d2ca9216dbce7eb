//! [`CommError`]: every failure of the crate, with messages that name the rank, the peer, the
//! collective, the variable or the address involved; and `StoreCallError`, why one call of a
//! store client failed, before the client names it with its address.

use std::time::Duration;

/// An error of the process group, the rendezvous store or a collective.
///
/// Every message names who is involved: this rank, the peer rank, the collective (kind and
/// sequence number), the environment variable or the address. Errors are `Clone` so that a failed
/// group can hand the same root cause to every later operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// A configuration value (environment variable or builder setting) is missing or invalid.
    #[error("invalid configuration: {var}: {message}")]
    Config {
        /// The variable (`RANK`, `MASTER_PORT`, ...) or builder setting (`rank`, ...) at fault.
        var: String,
        /// What is wrong with it, including the offending value.
        message: String,
    },
    /// A collective was called with arguments that cannot work (root out of range, ...).
    #[error("rank {rank}: invalid argument to {op}: {message}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The collective, e.g. `broadcast #3 (10 f32, root 7)`.
        op: String,
        /// What is wrong.
        message: String,
    },
    /// The master port is taken by another process.
    #[error(
        "rank 0 cannot host the rendezvous store on {addr}: address already in use \
         (another job or a leftover process holds MASTER_PORT {port}; choose another port)"
    )]
    AddrInUse {
        /// The address rank 0 tried to listen on.
        addr: String,
        /// The port (MASTER_PORT).
        port: u16,
    },
    /// Listening on a socket failed for a reason other than "address in use".
    #[error("rank {rank}: cannot listen on {addr} for {what}: {message}")]
    Listen {
        /// This rank.
        rank: usize,
        /// What the socket was for ("the rendezvous store", "peer connections").
        what: String,
        /// The address.
        addr: String,
        /// The operating system's error.
        message: String,
    },
    /// Connecting did not succeed before the connect deadline.
    #[error("rank {rank}: could not connect to {what} at {addr} within {waited:?} (last error: {last_error})")]
    Connect {
        /// This rank.
        rank: usize,
        /// What it tried to reach ("the rendezvous store", "rank 3").
        what: String,
        /// The address it tried.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last error seen while retrying.
        last_error: String,
    },
    /// The connection handshake failed or the other side refused it.
    #[error("rank {rank}: handshake with {what} at {addr} failed: {reason}")]
    Handshake {
        /// This rank.
        rank: usize,
        /// The other side ("the rendezvous store", "rank 2").
        what: String,
        /// The other side's address.
        addr: String,
        /// Why (bad magic bytes, version, job id, token, world size, ...).
        reason: String,
    },
    /// Peers that should have connected to this rank did not before the connect deadline.
    #[error(
        "rank {rank} waited {waited:?} on {addr} for rank(s) {peers} to connect; they never did \
         (did they start, with the same MASTER_ADDR, MASTER_PORT, world size and token?)"
    )]
    PeersMissing {
        /// This rank.
        rank: usize,
        /// The ranks that did not connect, e.g. `3, 4`.
        peers: String,
        /// The address this rank listened on.
        addr: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The rendezvous store failed or answered with an error.
    #[error("rank {rank}: rendezvous store at {addr}: {message}")]
    Store {
        /// This rank.
        rank: usize,
        /// The store's address.
        addr: String,
        /// What went wrong.
        message: String,
    },
    /// Waiting for keys in the rendezvous store passed its deadline.
    #[error("rank {rank}: timed out after {timeout:?} waiting for store key(s) {keys} at {addr}")]
    StoreTimeout {
        /// This rank.
        rank: usize,
        /// The store's address.
        addr: String,
        /// The keys still missing.
        keys: String,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A peer's connection closed without a clean goodbye (the process died or was killed).
    #[error(
        "connection between rank {rank} and rank {peer} closed unexpectedly \
         (rank {peer} exited, crashed or was killed)"
    )]
    PeerClosed {
        /// This rank.
        rank: usize,
        /// The peer whose connection closed.
        peer: usize,
    },
    /// A peer shut its process group down cleanly while this rank still needed it.
    #[error(
        "rank {peer} left the group (dropped its ProcessGroup) while rank {rank} still needed it"
    )]
    PeerLeft {
        /// This rank.
        rank: usize,
        /// The peer that left.
        peer: usize,
    },
    /// Reading from or writing to a peer failed.
    #[error("rank {rank}: I/O error on the connection to rank {peer}: {message}")]
    PeerIo {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// The operating system's error.
        message: String,
    },
    /// A peer failed and told this rank why (an ABORT frame). The message leads with the rank
    /// the peer blamed (the first rank to fail, as the peer saw it) and says who reported it.
    #[error("{}", abort_message(*.peer, *.blamed, .cause))]
    PeerAborted {
        /// This rank.
        rank: usize,
        /// The peer that aborted.
        peer: usize,
        /// The rank the peer blamed for its failure, if any (the rank that died, stayed silent,
        /// ...; may be `peer` itself or this rank).
        blamed: Option<usize>,
        /// The peer's own error message.
        cause: String,
    },
    /// Nothing arrived from a peer, not even a heartbeat, for the liveness deadline
    /// (`DDP_PEER_TIMEOUT`): it is frozen (stopped, swapping, stuck in the kernel) or the network
    /// between the two is cut.
    #[error(
        "rank {peer} is unresponsive: nothing, not even a heartbeat, arrived from it at rank {rank} for {silent_for:.1?} (DDP_PEER_TIMEOUT); the process is frozen or stopped, or the network between rank {rank} and rank {peer} is cut"
    )]
    PeerSilent {
        /// This rank.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// How long it has been silent.
        silent_for: Duration,
    },
    /// A peer stayed silent past the deadline.
    #[error("rank {rank} timed out after {timeout:?} waiting for rank {peer} in {op}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// The collective, e.g. `all_reduce #57 (4096 f32, sum)`.
        op: String,
        /// The deadline that passed.
        timeout: Duration,
    },
    /// A peer is running a different collective (kind, sequence number, type, length or
    /// argument) than this rank.
    #[error("rank {rank} is in {ours}, rank {peer} sent {theirs}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// This rank's collective.
        ours: String,
        /// The collective the peer's message belongs to.
        theirs: String,
    },
    /// A peer sent bytes that break the wire protocol.
    #[error("rank {rank}: protocol error from rank {peer}: {message}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// What was wrong.
        message: String,
    },
    /// A collective failed; `cause` says why.
    #[error("rank {rank}: {op} failed: {cause}")]
    Collective {
        /// This rank.
        rank: usize,
        /// The collective, e.g. `all_reduce #57 (4096 f32, sum)`.
        op: String,
        /// The root cause.
        cause: Box<CommError>,
    },
    /// [`crate::Work::wait_timeout`]'s deadline passed, or [`crate::Work::wait`] saw the group
    /// make no progress for longer than its deadline allows. The collective itself goes on (its
    /// result is dropped); the group is not failed by this.
    #[error("rank {rank}: {op} did not complete within {waited:?}")]
    WaitTimeout {
        /// This rank.
        rank: usize,
        /// The collective, e.g. `all_reduce of 4096 f32`.
        op: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// A collective was not run because the group had already failed.
    #[error("rank {rank}: cannot run {op}: the process group failed earlier: {cause}")]
    GroupFailed {
        /// This rank.
        rank: usize,
        /// The collective that was refused.
        op: String,
        /// The first failure of the group.
        cause: Box<CommError>,
    },
    /// The group's communication thread is gone (the group was dropped or panicked).
    #[error("rank {rank}: the process group is shut down")]
    ShutDown {
        /// This rank.
        rank: usize,
    },
    /// An elastic job refused this process (`membership/group.rs`): another job, another world
    /// range, another model, or the job at its maximum. The job itself goes on.
    #[error("slot {slot} on {host} was refused by the elastic job at {addr}: {reason}")]
    ElasticRefused {
        /// This process's slot (its launch `RANK`).
        slot: usize,
        /// This process's host.
        host: String,
        /// The job's store.
        addr: String,
        /// Why, naming both values of the field that differs.
        reason: String,
    },
    /// An elastic job stopped: fewer ranks remain than its minimum (the message names the
    /// ranks lost). The launcher restarts the job from its last checkpoint if its restarts
    /// allow (see [`crate::launcher::contract::finish`]).
    #[error("slot {slot}: the elastic job stops: {message}")]
    ElasticStopped {
        /// This process's slot.
        slot: usize,
        /// Why, naming the ranks lost.
        message: String,
    },
    /// A bug in ddp-comm (for example a panic on the communication thread).
    #[error("rank {rank}: internal error in ddp-comm: {message}")]
    Internal {
        /// This rank.
        rank: usize,
        /// What happened.
        message: String,
    },
}

/// The text of [`CommError::PeerAborted`]: "rank 2 failed first (reported by rank 3: ...)" when
/// the peer blamed another rank, "rank 3 failed: ..." when it failed on its own.
fn abort_message(peer: usize, blamed: Option<usize>, cause: &str) -> String {
    match blamed {
        Some(b) if b != peer => format!("rank {b} failed first (reported by rank {peer}: {cause})"),
        _ => format!("rank {peer} failed: {cause}"),
    }
}

impl CommError {
    /// The root cause: unwraps [`CommError::Collective`] and [`CommError::GroupFailed`].
    pub fn root_cause(&self) -> &CommError {
        match self {
            CommError::Collective { cause, .. } | CommError::GroupFailed { cause, .. } => {
                cause.root_cause()
            }
            other => other,
        }
    }

    /// The rank this error blames, if any: the rank that closed, stayed silent, sent a
    /// mismatched collective or broke the protocol; for an ABORT received from a peer, the rank
    /// that peer blamed (or the peer, if it blamed none).
    pub fn peer(&self) -> Option<usize> {
        match self.root_cause() {
            CommError::PeerAborted { peer, blamed, .. } => Some(blamed.unwrap_or(*peer)),
            CommError::PeerClosed { peer, .. }
            | CommError::PeerLeft { peer, .. }
            | CommError::PeerIo { peer, .. }
            | CommError::PeerSilent { peer, .. }
            | CommError::Timeout { peer, .. }
            | CommError::Mismatch { peer, .. }
            | CommError::Protocol { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    pub(crate) fn config(var: impl Into<String>, message: impl Into<String>) -> CommError {
        CommError::Config {
            var: var.into(),
            message: message.into(),
        }
    }
}

/// Why one store call failed, before it is named with the store's address and rank.
#[derive(Debug)]
pub(crate) enum StoreCallError {
    /// The connection failed (closed, reset, no answer in time): it may be out of step now and
    /// is never used again.
    Io(std::io::Error),
    /// The server's bytes made no sense; the connection is dropped too.
    Protocol(String),
    /// Keys not set before the deadline (the missing ones, or empty if the server does not
    /// say); the connection stays usable.
    Timeout(String),
    /// The server (or this client) refused the request; the connection stays usable.
    Refused(String),
}

impl From<std::io::Error> for StoreCallError {
    fn from(e: std::io::Error) -> StoreCallError {
        StoreCallError::Io(e)
    }
}

impl std::fmt::Display for StoreCallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreCallError::Io(e) => match e.kind() {
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                    write!(f, "lost the connection (did the store's host exit?)")
                }
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    write!(f, "no response in time")
                }
                _ => write!(f, "{e}"),
            },
            StoreCallError::Protocol(m) => write!(f, "unexpected answer: {m}"),
            StoreCallError::Timeout(keys) => write!(f, "timed out waiting for {keys}"),
            StoreCallError::Refused(m) => write!(f, "{m}"),
        }
    }
}
