//! The error type of the `ddp` crate (package `burn-ddp`).

/// What can go wrong in data-parallel training.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective failed (a peer died, timed out, or ran a different collective); the message
    /// names the rank and the collective.
    #[error(transparent)]
    Comm(#[from] ddp_comm::CommError),
    /// The ranks do not hold the same model: the message names the first rank that differs from
    /// rank 0 and the first differing parameter.
    #[error("parameter lists differ across ranks: {0}")]
    ParamMismatch(String),
    /// The replicas no longer hold identical trainable parameters.
    #[error("{}", diverged_message(*sync, ranks, *world, *against_majority))]
    ReplicaDiverged {
        /// How many syncs had completed when the check ran.
        sync: u64,
        /// The ranks whose parameters differ from the reference: from the majority when a
        /// strict majority of ranks agree, otherwise from rank 0 (with no majority, which
        /// replica is wrong cannot be told; rank 0 is only the point of comparison).
        ranks: Vec<usize>,
        /// The world size.
        world: usize,
        /// Whether `ranks` differ from a strict majority (`true`) or only from rank 0.
        against_majority: bool,
    },
    /// A parameter the wrapper cannot handle.
    #[error("parameter `{name}` is not supported: {reason}")]
    UnsupportedParam {
        /// The parameter's name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A gradient (or a parameter's values) could not be read as `f32`.
    #[error("cannot read the {what} of parameter `{name}` as f32: {reason}")]
    Conversion {
        /// The parameter's name.
        name: String,
        /// What was being read: `gradient`, `values`, `presence slots`.
        what: &'static str,
        /// burn's description of the problem.
        reason: String,
    },
    /// The module's parameters are no longer the ones the wrapper was created with: burn gives
    /// every parameter an id, and `load_record` (or rebuilding the module) replaces them, so the
    /// gradients of the new ids would silently not be averaged.
    #[error(
        "parameter `{name}` is not the one this DistributedDataParallel was created with ({detail}); \
         burn's `load_record` and rebuilding a module give parameters new ids: load the record \
         before wrapping the model, or create a new DistributedDataParallel after loading it"
    )]
    ParamsChanged {
        /// The first parameter whose id changed (or `?` when only the gradients tell).
        name: String,
        /// What differs.
        detail: String,
    },
    /// A module buffer (a float tensor without gradient) could not be overwritten with rank 0's
    /// values through the shared reference [`crate::DistributedDataParallel::sync`] receives.
    #[error(
        "buffer `{name}` differs from rank 0's and cannot be updated in place: only burn's \
         `RunningState` (BatchNorm's running statistics) shares its value between clones; a \
         `Param` without gradient must stay equal on every rank"
    )]
    BufferNotShared {
        /// The buffer's name.
        name: String,
    },
    /// This sync failed on other ranks (their own errors say why): no rank applies it.
    #[error("{}", peer_failed_message(*sync, *count, *rank))]
    PeerFailed {
        /// The number of the sync (1 for the first).
        sync: u64,
        /// How many ranks failed.
        count: usize,
        /// The failing rank, when exactly one failed.
        rank: Option<usize>,
    },
    /// A piece of a parameter's gradient reached the wrapper after the parameter's bucket had
    /// gone out during an overlapped backward ([`crate::DdpConfig::overlap`]), or after it was
    /// added to the sum of earlier micro-steps (which would round differently): the loss reached
    /// the parameter by a path outside the copy from `prepare` (a term on the model's own
    /// parameter, a second prepared copy) that earlier passes never took. The step fails on
    /// every rank (the others return [`DdpError::PeerFailed`]); the wrapper holds that
    /// parameter's bucket until backward ends from now on, so running the step again includes
    /// every piece.
    #[error(
        "parameter `{name}` received a piece of its gradient too late to be summed as without \
         overlap (its bucket had gone out during the overlapped backward, or held the sum of \
         earlier micro-steps already): the loss reaches it by a path outside the copy from \
         `prepare` (the model's own parameter, or a second prepared copy) that no earlier \
         pass took. Nothing was dropped: this step fails on every rank, and from now on this \
         parameter's bucket waits for the end of backward, so run the step again (or use \
         DdpConfig::with_overlap(false))"
    )]
    LateGradient {
        /// The parameter's name.
        name: String,
    },
    /// A checkpoint that cannot be written, read or loaded; the text names the file.
    #[error("{0}")]
    Checkpoint(String),
    /// A checkpoint written by a run with another world size or seed, which resuming would not
    /// continue (another data order, other dropout masks); `RunId::allow_mismatch` lets it
    /// through.
    #[error(
        "{path} was written by a run with {what}: resuming would not continue that run \
         (another data order and other dropout masks); allow a mismatched checkpoint \
         (RunId::allow_mismatch) to resume from it anyway"
    )]
    CheckpointMismatch {
        /// The checkpoint file.
        path: String,
        /// What differs, e.g. `world size 2 (this run: 1)`.
        what: String,
    },
    /// An invalid setting, or a buffer of the wrong length.
    #[error("invalid DDP configuration: {0}")]
    Config(String),
}

/// The text of [`DdpError::PeerFailed`].
fn peer_failed_message(sync: u64, count: usize, rank: Option<usize>) -> String {
    let who = match rank {
        Some(r) => format!("rank {r} failed"),
        None => format!("{count} ranks failed"),
    };
    format!(
        "gradient sync #{sync} failed on another rank: {who} locally (its own error says why); \
         the averaged gradients are incomplete, so no rank may apply this step"
    )
}

/// The text of [`DdpError::ReplicaDiverged`].
fn diverged_message(sync: u64, ranks: &[usize], world: usize, against_majority: bool) -> String {
    let when = format!("checked after {sync} completed syncs");
    let list = ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if against_majority {
        format!(
            "replicas diverged ({when}): rank(s) {list} hold different parameters from the \
             majority ({} of {world} ranks differ)",
            ranks.len()
        )
    } else {
        format!(
            "replicas diverged ({when}): rank(s) {list} hold different parameters from rank 0, \
             and no majority of the {world} ranks agrees, so which replica is wrong cannot be \
             told"
        )
    }
}
