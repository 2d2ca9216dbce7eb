//! The error type of the `ddp` crate.

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
    /// The replicas no longer hold identical parameters.
    #[error(
        "replicas diverged (checked before sync #{sync}): rank {rank} holds different parameters \
         from the majority ({differing} of {world} ranks differ)"
    )]
    ReplicaDiverged {
        /// The first (lowest) rank whose parameters differ from the majority.
        rank: usize,
        /// The number of the sync call at which the check ran.
        sync: u64,
        /// How many ranks differ from the majority.
        differing: usize,
        /// The world size.
        world: usize,
    },
    /// A parameter the wrapper cannot handle.
    #[error("parameter `{name}` is not supported: {reason}")]
    UnsupportedParam {
        /// The parameter's name.
        name: String,
        /// Why.
        reason: String,
    },
    /// An invalid setting.
    #[error("invalid DDP configuration: {0}")]
    Config(String),
}
