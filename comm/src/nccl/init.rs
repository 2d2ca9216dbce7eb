//! Creating a NCCL communicator under a deadline ([`init_with_deadline`]).
//!
//! `ncclCommInitRank` blocks until every rank has called it: a rank that never arrives (it
//! crashed after the TCP group formed, or hangs opening its GPU) leaves the others blocked
//! forever, with no error and no way to say who is missing. So every rank creates its
//! communicator non-blocking (`ncclCommInitRankConfig` with `blocking = 0`), which returns at
//! once, and polls `ncclCommGetAsyncError` until the state leaves `ncclInProgress`. When the
//! group's deadline (its `timeout`) passes first, the rank aborts its half-made communicator
//! (`ncclCommAbort`, which ends NCCL's bootstrap threads) and fails with an error naming the
//! ranks that did not arrive: each rank announces itself in the store just before it enters
//! NCCL (`group.rs`), so the store knows who did.
//!
//! The NCCL calls go through [`InitOps`], a seam that the tests fill with a fake communicator
//! (the deadline and abort logic run on the CPU there); [`NcclLibrary`] is the real one.

use std::time::{Duration, Instant};

use super::api::{NcclLibrary, NcclResult, RawComm, UniqueId};

/// The NCCL calls that creating a communicator makes.
pub(crate) trait InitOps {
    /// The communicator handle.
    type Comm: Copy;
    /// Starts creating this rank's communicator (non-blocking).
    fn start(&self) -> (NcclResult, Self::Comm);
    /// The communicator's state (`ncclCommGetAsyncError`).
    fn state(&self, comm: Self::Comm) -> NcclResult;
    /// Aborts the communicator (`ncclCommAbort`).
    fn abort(&self, comm: Self::Comm);
    /// NCCL's description of `result` (with the communicator's last error, if any).
    fn describe(&self, result: NcclResult, comm: Option<Self::Comm>) -> String;
    /// Whether `comm` is a communicator at all (NCCL may leave it null on an early error).
    fn is_null(&self, comm: Self::Comm) -> bool;
}

/// The real NCCL, creating the communicator of `rank` among `world` with `id`.
pub(crate) struct RealInit<'a> {
    /// The library.
    pub nccl: &'a NcclLibrary,
    /// Number of ranks.
    pub world: usize,
    /// This rank.
    pub rank: usize,
    /// Rank 0's unique id.
    pub id: UniqueId,
}

impl InitOps for RealInit<'_> {
    type Comm = RawComm;

    fn start(&self) -> (NcclResult, RawComm) {
        self.nccl
            .init_rank_nonblocking(self.world, self.id, self.rank)
    }

    fn state(&self, comm: RawComm) -> NcclResult {
        self.nccl.async_error(comm)
    }

    fn abort(&self, comm: RawComm) {
        self.nccl.abort(comm);
    }

    fn describe(&self, result: NcclResult, comm: Option<RawComm>) -> String {
        self.nccl.error_text(result, comm)
    }

    fn is_null(&self, comm: RawComm) -> bool {
        comm.is_null()
    }
}

/// Why a communicator could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InitFailure {
    /// NCCL reported an error (its text).
    Nccl(String),
    /// The deadline passed; the communicator was aborted. `missing`: the ranks that never
    /// arrived (empty when every rank did, so NCCL itself could not connect them).
    Deadline {
        /// How long this rank waited.
        waited: Duration,
        /// The ranks the store never saw arrive.
        missing: Vec<usize>,
    },
}

impl std::fmt::Display for InitFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InitFailure::Nccl(text) => write!(f, "creating the NCCL communicator failed: {text}"),
            InitFailure::Deadline { waited, missing } if missing.is_empty() => write!(
                f,
                "the NCCL communicator was not ready after {waited:.1?} (the group's timeout) \
                 although every rank arrived: NCCL could not connect the ranks (run with \
                 NCCL_DEBUG=INFO; on several hosts check NCCL_SOCKET_IFNAME and that the hosts \
                 reach each other); it was aborted"
            ),
            InitFailure::Deadline { waited, missing } => write!(
                f,
                "the NCCL communicator was not ready after {waited:.1?} (the group's timeout): \
                 rank(s) {} never arrived (they did not reach ncclCommInitRank: crashed, or stuck \
                 before it; see their own output); it was aborted",
                missing
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Creates the communicator through `ops` and waits until it is ready, or fails: with NCCL's
/// error, or once `deadline` has passed, aborting it (see the module documentation).
/// `missing` is asked, only on expiry, which ranks never arrived. Polls every `poll`.
pub(crate) fn init_with_deadline<O: InitOps>(
    ops: &O,
    deadline: Duration,
    poll: Duration,
    missing: &dyn Fn() -> Vec<usize>,
) -> Result<O::Comm, InitFailure> {
    let start = Instant::now();
    let (result, comm) = ops.start();
    let live = !ops.is_null(comm);
    if result.is_error() {
        let text = ops.describe(result, live.then_some(comm));
        if live {
            ops.abort(comm);
        }
        return Err(InitFailure::Nccl(text));
    }
    if !live {
        return Err(InitFailure::Nccl(
            "ncclCommInitRankConfig returned no communicator".into(),
        ));
    }
    loop {
        let state = ops.state(comm);
        if state == NcclResult::SUCCESS {
            return Ok(comm);
        }
        if state.is_error() {
            let text = ops.describe(state, Some(comm));
            ops.abort(comm);
            return Err(InitFailure::Nccl(text));
        }
        let waited = start.elapsed();
        if waited >= deadline {
            ops.abort(comm);
            return Err(InitFailure::Deadline {
                waited,
                missing: missing(),
            });
        }
        std::thread::sleep(poll.min(deadline - waited));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// A communicator whose creation answers `states` in turn (the last one forever), and that
    /// records what was done to it.
    struct Fake {
        start: NcclResult,
        states: RefCell<Vec<NcclResult>>,
        polls: Cell<usize>,
        aborted: Cell<usize>,
    }

    impl Fake {
        fn new(start: NcclResult, states: &[NcclResult]) -> Fake {
            Fake {
                start,
                states: RefCell::new(states.to_vec()),
                polls: Cell::new(0),
                aborted: Cell::new(0),
            }
        }
    }

    impl InitOps for Fake {
        type Comm = u32;
        fn start(&self) -> (NcclResult, u32) {
            (self.start, 7)
        }
        fn state(&self, comm: u32) -> NcclResult {
            assert_eq!(comm, 7);
            assert_eq!(self.aborted.get(), 0, "polled after the abort");
            self.polls.set(self.polls.get() + 1);
            let mut states = self.states.borrow_mut();
            if states.len() > 1 {
                states.remove(0)
            } else {
                states[0]
            }
        }
        fn abort(&self, comm: u32) {
            assert_eq!(comm, 7);
            self.aborted.set(self.aborted.get() + 1);
        }
        fn describe(&self, result: NcclResult, _: Option<u32>) -> String {
            format!("{} (fake)", result.name())
        }
        fn is_null(&self, comm: u32) -> bool {
            comm == 0
        }
    }

    const POLL: Duration = Duration::from_millis(5);

    #[test]
    fn a_peer_that_never_arrives_ends_at_the_deadline_with_an_abort_naming_it() {
        let fake = Fake::new(NcclResult::IN_PROGRESS, &[NcclResult::IN_PROGRESS]);
        let start = Instant::now();
        let deadline = Duration::from_millis(300);
        let e = init_with_deadline(&fake, deadline, POLL, &|| vec![2, 3]).unwrap_err();
        let took = start.elapsed();
        assert!(took >= deadline, "{took:?}");
        assert!(took < deadline + Duration::from_secs(2), "{took:?}");
        assert_eq!(fake.aborted.get(), 1);
        assert!(fake.polls.get() > 1);
        let InitFailure::Deadline { missing, .. } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(missing, &[2, 3]);
        let text = e.to_string();
        assert!(text.contains("rank(s) 2, 3 never arrived"), "{text}");
        assert!(text.contains("aborted"), "{text}");
    }

    #[test]
    fn every_rank_arrived_but_nccl_never_connected() {
        let fake = Fake::new(NcclResult::IN_PROGRESS, &[NcclResult::IN_PROGRESS]);
        let e = init_with_deadline(&fake, Duration::from_millis(50), POLL, &Vec::new).unwrap_err();
        assert_eq!(fake.aborted.get(), 1);
        assert!(e.to_string().contains("every rank arrived"), "{e}");
    }

    #[test]
    fn a_communicator_ready_in_time_is_not_aborted() {
        let states = [
            NcclResult::IN_PROGRESS,
            NcclResult::IN_PROGRESS,
            NcclResult::SUCCESS,
        ];
        let fake = Fake::new(NcclResult::IN_PROGRESS, &states);
        let asked = Cell::new(false);
        let comm = init_with_deadline(&fake, Duration::from_secs(10), POLL, &|| {
            asked.set(true);
            vec![]
        })
        .unwrap();
        assert_eq!(comm, 7);
        assert_eq!(fake.aborted.get(), 0);
        assert_eq!(fake.polls.get(), 3);
        assert!(!asked.get(), "the store is only asked on expiry");
    }

    #[test]
    fn an_error_while_connecting_aborts_and_says_what_nccl_said() {
        let states = [NcclResult::IN_PROGRESS, NcclResult::SYSTEM_ERROR];
        let fake = Fake::new(NcclResult::IN_PROGRESS, &states);
        let e = init_with_deadline(&fake, Duration::from_secs(10), POLL, &Vec::new).unwrap_err();
        assert_eq!(fake.aborted.get(), 1);
        assert_eq!(e, InitFailure::Nccl("ncclSystemError (fake)".into()));
    }

    #[test]
    fn an_error_at_once_aborts_the_communicator_it_returned() {
        let fake = Fake::new(NcclResult::INVALID_ARGUMENT, &[NcclResult::SUCCESS]);
        let e = init_with_deadline(&fake, Duration::from_secs(10), POLL, &Vec::new).unwrap_err();
        assert_eq!(fake.aborted.get(), 1);
        assert_eq!(fake.polls.get(), 0);
        assert!(e.to_string().contains("ncclInvalidArgument"), "{e}");
    }
}
