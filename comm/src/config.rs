//! [`GroupConfig`]: everything a rank needs to join a process group, its defaults, and the
//! choice of [`Transport`]. Where the values come from (builder, torchrun's or Slurm's
//! variables, defaults) is `env.rs`; the builder is `builder.rs`.

use std::time::Duration;

use crate::error::CommError;

/// Default deadline of every wait on a peer (a peer silent this long fails the group): 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default liveness deadline: a peer from which nothing (not even a heartbeat) arrives for this
/// long is declared dead, whatever the collective deadline: 7 s, so that a frozen rank or a cut
/// link is named on every survivor within 10 s (see `liveness.rs` for why not shorter).
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(7);

/// How long a lost connection of a group waits for an ABORT frame that explains it before it
/// is itself taken as the group's root cause (`health.rs`); an elastic job's groups wait none
/// (`membership/group.rs`).
pub(crate) const DEFAULT_LOSS_GRACE: Duration = Duration::from_millis(400);
/// Default deadline for reaching the rendezvous store and the peers at start-up: 300 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default master port when neither `MASTER_PORT` nor Slurm gives one (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Default size of one message segment of the ring algorithms: 1 MiB.
pub const DEFAULT_SEGMENT_BYTES: usize = 1 << 20;
/// Largest allowed segment size (and so the largest data frame a peer may send): 64 MiB.
pub const MAX_SEGMENT_BYTES: usize = 64 << 20;
/// Size (in bytes) up to which all-reduce, reduce-scatter, all-gather and broadcast use the
/// latency-optimal direct algorithms over the full mesh instead of the ring, at 2 ranks: 256 KiB.
/// At N ranks the default is this divided by N - 1, see [`default_small_allreduce_bytes`].
pub const DEFAULT_SMALL_ALLREDUCE_BYTES: usize = 256 << 10;

/// The default small-buffer threshold for `world_size` ranks: 256 KiB / (N - 1). The direct
/// exchange sends (N - 1) times the bytes of the ring, so its advantage (one message latency
/// instead of 2(N - 1)) pays for less data as N grows; `cargo xtask bench-allreduce --crossover`
/// measured the crossover at 256-512 KiB for 2 ranks and 64 KiB for 4 on the 2-core dev box.
pub fn default_small_allreduce_bytes(world_size: usize) -> usize {
    DEFAULT_SMALL_ALLREDUCE_BYTES / world_size.saturating_sub(1).max(1)
}

/// Everything a rank needs to join a process group.
///
/// Build one with [`GroupConfig::from_env`], [`crate::GroupBuilder::config`] or
/// [`GroupConfig::default`] (a single process) and field updates.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the group.
    pub world_size: usize,
    /// Rank among the processes on this node (for picking a device).
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
    /// Deadline of every wait on a peer during a collective.
    pub timeout: Duration,
    /// Deadline for reaching the store and the peers while the group forms.
    pub connect_timeout: Duration,
    /// Liveness deadline (`DDP_PEER_TIMEOUT`): every connection carries heartbeats from a thread
    /// of its own, independent of the training loop, and a peer silent this long (frozen,
    /// stopped, cut off by the network) is declared dead and named. A peer that is alive but
    /// busy outside collectives keeps sending heartbeats and never trips it; a peer alive but not
    /// entering a collective (a desync) is caught by `timeout` instead.
    pub peer_timeout: Duration,
    /// Where the flight recorder writes `flight-rank<R>.json` on a failure, a timeout or
    /// SIGUSR1 (`DDP_TRACE_DIR`; `None`: nowhere, and SIGUSR1 keeps its default action).
    pub trace_dir: Option<std::path::PathBuf>,
    /// Shared secret every connection must present (`DDP_TOKEN`), if any.
    pub token: Option<String>,
    /// The launcher's name for this job (`DDP_JOB_ID`, set by ddprun), if any. When set, a
    /// process with a different (or no) job name is refused by the store, so two jobs that
    /// share a master port by mistake never mix; otherwise rank 0 makes a random job id.
    pub job_id: Option<String>,
    /// Size of one message segment of the pipelined algorithms, in bytes. Rank 0's value is
    /// used by every rank.
    pub segment_bytes: usize,
    /// Buffers up to this many bytes use the latency-optimal algorithms (direct exchange over
    /// the full mesh) instead of the ring. Rank 0's value is used by every rank.
    pub small_allreduce_bytes: usize,
    /// `Some(restart count)` when torchrun's elastic agent hosts the rendezvous store, a PyTorch
    /// `TCPStore` at `MASTER_ADDR:MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`, with
    /// `TORCHELASTIC_RESTART_COUNT`, 0 if unset): no rank hosts a store, every rank (rank 0 too)
    /// speaks torch's store protocol to it, and every key goes under
    /// `/worker/attempt_{restart count}/` as torch's own workers' keys do. `None`: rank 0 hosts
    /// ddp-comm's own store.
    pub torch_agent_store: Option<u32>,
    /// A scope for this group's keys in an agent store ([`GroupConfig::torch_agent_store`]):
    /// every key goes under `/worker/attempt_{N}/{scope}` instead of `/worker/attempt_{N}/`, so
    /// that several groups can form one after another in one store without reading each
    /// other's keys (the generations of an elastic job, `membership/group.rs`). `None`: no scope.
    pub store_scope: Option<String>,
    /// What carries the collectives (`DDP_TRANSPORT`: `auto`, the default, uses shared memory
    /// between the ranks that share a host, confirmed by mapping each other's segments, and TCP
    /// between hosts; `tcp`; `shm`, an error when shared memory cannot be set up).
    pub transport: Transport,
    /// This rank's host identity for the transport's choice (`DDP_HOST_ID`): ranks with equal
    /// identities try shared memory with each other. `None`: the host name plus the kernel's
    /// boot id. Set it where those do not tell hosts apart, or to simulate several hosts.
    pub host_id: Option<String>,
    /// Whose variables said who the ranks are: `torchrun` (also Kubeflow's PyTorchJob and
    /// anything else that sets torchrun's variables), or the name a launcher that sets them
    /// gives in `DDP_LAUNCHER` ([`crate::LAUNCHER_ENV`]: `ddprun`, `spawn`),
    /// `open-mpi`, `mpich` (MPICH, Intel MPI and other Hydra/PMI launchers), `slurm`,
    /// `explicit` (a builder's values), or `none` (a single process). For the first log line of
    /// a run.
    pub launcher: String,
}

impl Default for GroupConfig {
    /// A single process: rank 0 of 1, default timeouts and tuning.
    fn default() -> Self {
        GroupConfig {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: DEFAULT_MASTER_PORT,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            peer_timeout: DEFAULT_PEER_TIMEOUT,
            trace_dir: None,
            token: None,
            job_id: None,
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            small_allreduce_bytes: DEFAULT_SMALL_ALLREDUCE_BYTES,
            transport: Transport::Auto,
            torch_agent_store: None,
            store_scope: None,
            host_id: None,
            launcher: "none".to_string(),
        }
    }
}

/// Which transport carries a group's collectives (`DDP_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory between the ranks of each host (confirmed by mapping), TCP between hosts
    /// (hierarchical when there are several), TCP alone when no two ranks share a host.
    Auto,
    /// Always TCP.
    Tcp,
    /// As `Auto`, but a failure to set up shared memory is an error instead of a fall-back.
    Shm,
}

impl Transport {
    /// Parses a value of `DDP_TRANSPORT` (`auto` when unset or empty).
    pub(crate) fn parse(value: Option<&str>) -> Result<Transport, CommError> {
        match value {
            None => Ok(Transport::Auto),
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(Transport::Auto),
                "tcp" => Ok(Transport::Tcp),
                "shm" => Ok(Transport::Shm),
                _ => Err(CommError::config(
                    "DDP_TRANSPORT",
                    format!("DDP_TRANSPORT={v:?}: expected auto, tcp or shm"),
                )),
            },
        }
    }
}
