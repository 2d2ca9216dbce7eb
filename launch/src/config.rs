//! [`LaunchConfig`]: what to launch and how (the equivalent of `ddprun`'s command line), and what
//! follows from it for each rank and attempt: its environment ([`rank_env`]) and the job id.

use std::ffi::OsString;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ddp_comm::elastic::{MAX_RESTARTS_ENV, RESTART_COUNT_ENV, USE_AGENT_STORE_ENV};
use ddp_comm::{ELASTIC_ENV, ELASTIC_ROUND_ENV, LAUNCHER_ENV};

/// The grace period between `SIGTERM` and `SIGKILL` when no other is configured.
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(5);

/// The rendezvous address used on a single node when none is given.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// What to launch and how: the equivalent of `ddprun`'s command line.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Ranks to start on this node (`--nproc-per-node`), at least 1.
    pub nproc_per_node: usize,
    /// Nodes in the job (`--nnodes`), at least 1; with [`min_nnodes`](Self::min_nnodes), the
    /// most nodes of an elastic job.
    pub nnodes: usize,
    /// `Some(MIN)` for an elastic job (`--nnodes MIN:MAX` with MIN < MAX): it runs while at
    /// least `MIN × nproc_per_node` ranks are up. A rank that fails is restarted alone (within
    /// `max_restarts`) and rejoins the running job, the others go on; the ranks get
    /// `DDP_ELASTIC=MIN:MAX` in ranks (see [`crate::launch`]).
    pub min_nnodes: Option<usize>,
    /// This node's index in `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// The node rank comes from the rendezvous, as torchrun's c10d rendezvous gives it
    /// (`--rdzv-backend c10d` without `--node-rank`): every agent of an elastic job runs the
    /// same command line, the one that can host the store on `master_addr:master_port` is
    /// node 0, and the others take the next node rank from a counter in that store;
    /// `node_rank` is then ignored. Needs an elastic job ([`min_nnodes`](Self::min_nnodes))
    /// with `master_addr` and `master_port`.
    pub node_rank_at_rendezvous: bool,
    /// Address of the node that runs rank 0, where the rendezvous store listens. Required when
    /// `nnodes > 1`; on a single node it defaults to [`DEFAULT_MASTER_ADDR`].
    pub master_addr: Option<String>,
    /// Port of the rendezvous store, which node 0's launcher hosts (a PyTorch `TCPStore`,
    /// [`ddp_comm::TorchStoreHost`]) and keeps for the whole job. Required when `nnodes > 1`; on
    /// a single node, when it is `None`, the launcher binds a free port for each attempt and
    /// hosts that attempt's store on it. Either way the launcher holds the port from the moment
    /// it chose it, so no other process can take it.
    pub master_port: Option<u16>,
    /// The address the other nodes reach this node at (`--local-addr`, torchrun's flag): where
    /// an elastic job's standby store on this node is published (see [`crate::launch`]). When
    /// `None`, the address this node's launcher reaches the rendezvous store from, which is
    /// right unless the other nodes reach this one through another interface.
    pub local_addr: Option<String>,
    /// How long an elastic job's founding waits for more processes once MIN joined, given to
    /// the ranks as `DDP_ELASTIC_LAST_CALL` (torchrun's `--rdzv-conf last_call_timeout`);
    /// `None`: the ranks' own (the variable if set, else 2 s).
    pub last_call: Option<Duration>,
    /// How long a rank tries to join (and to re-form), given to the ranks as
    /// `DDP_CONNECT_TIMEOUT` (torchrun's `--rdzv-conf join_timeout`); `None`: the ranks' own.
    pub join_timeout: Option<Duration>,
    /// An identifier shared by all ranks of the job, exported as `DDP_JOB_ID`. When `None`, a
    /// single-node launch generates one and a multi-node launch exports none (every node would
    /// generate a different one); an inherited `DDP_JOB_ID` is then passed through unchanged.
    pub job_id: Option<String>,
    /// The program and its arguments, run once per local rank. Must not be empty.
    pub command: Vec<OsString>,
    /// Time between `SIGTERM` and `SIGKILL` when stopping ranks.
    pub grace_period: Duration,
    /// Whether to forward `SIGINT` and `SIGTERM` received by this process to the ranks. The
    /// handlers are installed for the duration of [`crate::launch`] and the previous ones restored.
    pub forward_signals: bool,
    /// How many times to restart all local ranks after one failed (`--max-restarts`); 0, the
    /// default, stops the job at the first failure. A `SIGINT`/`SIGTERM` to the launcher never
    /// leads to a restart. See [`crate::launch`] for what a restart does.
    pub max_restarts: usize,
    /// The launcher's name, given to every rank as `DDP_LAUNCHER`
    /// ([`ddp_comm::LAUNCHER_ENV`]), which a rank's `GroupConfig::launcher` reports:
    /// `ddprun` ([`LaunchConfig::new`]'s), `spawn` for [`crate::spawn`].
    pub launcher: String,
}

impl LaunchConfig {
    /// A single-node configuration running `command` as `nproc_per_node` ranks, with the
    /// defaults: free port, default grace period, signals forwarded.
    pub fn new(nproc_per_node: usize, command: Vec<OsString>) -> LaunchConfig {
        LaunchConfig {
            nproc_per_node,
            nnodes: 1,
            min_nnodes: None,
            node_rank: 0,
            node_rank_at_rendezvous: false,
            master_addr: None,
            master_port: None,
            local_addr: None,
            last_call: None,
            join_timeout: None,
            job_id: None,
            command,
            grace_period: DEFAULT_GRACE_PERIOD,
            forward_signals: true,
            max_restarts: 0,
            launcher: "ddprun".to_string(),
        }
    }

    /// Total number of ranks in the job: `nnodes * nproc_per_node`.
    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The elastic range in ranks, `(MIN × nproc_per_node, MAX × nproc_per_node)`, when the
    /// job is elastic.
    pub fn elastic_ranks(&self) -> Option<(usize, usize)> {
        self.min_nnodes
            .map(|min| (min * self.nproc_per_node, self.world_size()))
    }

    /// Global rank of this node's local rank `local_rank`: `node_rank * nproc_per_node +
    /// local_rank`.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc_per_node + local_rank
    }
}

/// The environment variables that local rank `local_rank` is started with on attempt `restart`
/// (0 for the first start): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
/// `GROUP_RANK` (the node rank, as torchrun names it), `MASTER_ADDR`, `MASTER_PORT`,
/// [`RESTART_COUNT_ENV`], [`MAX_RESTARTS_ENV`] and [`USE_AGENT_STORE_ENV`]` = True` (node 0's
/// launcher hosts the store on `MASTER_PORT`: no rank binds it), [`LAUNCHER_ENV`] (the
/// launcher's name, [`LaunchConfig::launcher`]), `DDP_JOB_ID` when `job_id`
/// is given, and [`ELASTIC_ENV`]` = MIN:MAX` (in ranks) and [`ELASTIC_ROUND_ENV`]` = restart`
/// for an elastic job (`WORLD_SIZE` is then the most ranks, and `RANK` the rank's slot among
/// them). [`RESTART_COUNT_ENV`] is `restart` too; ddprun raises it for a rank of an elastic
/// job restarted alone, and for the ranks of a later round, to the restarts of its budget used
/// (torchrun's count), while the round stays the store keys' (see [`crate::launch`]).
pub fn rank_env(
    config: &LaunchConfig,
    local_rank: usize,
    master_addr: &str,
    master_port: u16,
    job_id: Option<&str>,
    restart: usize,
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("RANK", config.global_rank(local_rank).to_string()),
        ("WORLD_SIZE", config.world_size().to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string()),
        ("GROUP_RANK", config.node_rank.to_string()),
        ("MASTER_ADDR", master_addr.to_string()),
        ("MASTER_PORT", master_port.to_string()),
        (RESTART_COUNT_ENV, restart.to_string()),
        (MAX_RESTARTS_ENV, config.max_restarts.to_string()),
        (USE_AGENT_STORE_ENV, "True".to_string()),
        (LAUNCHER_ENV, config.launcher.clone()),
    ];
    if let Some(id) = job_id {
        env.push((ddp_comm::elastic::JOB_ID_ENV, id.to_string()));
    }
    if let Some((min, max)) = config.elastic_ranks() {
        env.push((ELASTIC_ENV, format!("{min}:{max}")));
        env.push((ELASTIC_ROUND_ENV, restart.to_string()));
    }
    if let Some(last_call) = config.last_call {
        let var = ddp_comm::elastic::LAST_CALL_ENV;
        env.push((var, last_call.as_secs_f64().to_string()));
    }
    if let Some(join) = config.join_timeout {
        env.push(("DDP_CONNECT_TIMEOUT", join.as_secs_f64().to_string()));
    }
    env
}

/// The job id of attempt `restart`: the configured id (an inherited `DDP_JOB_ID` on several
/// nodes) on the first attempt and that id with `-restart<k>` appended on restart `k`, so that
/// every node that restarts as often derives the same one; on a single node without a
/// configured id, a freshly generated one per attempt. `None` on several nodes without any id.
pub(crate) fn attempt_job_id(config: &LaunchConfig, restart: usize, port: u16) -> Option<String> {
    let base = match &config.job_id {
        Some(id) => Some(id.clone()),
        None if config.nnodes == 1 => return Some(generate_job_id(port)),
        None => ddp_comm::elastic::job_id(),
    };
    match (base, restart) {
        (Some(id), 0) => Some(id),
        (Some(id), k) => Some(format!("{id}-restart{k}")),
        // Nothing to pass; the ranks inherit nothing either (restart 0 keeps today's behaviour).
        (None, _) => None,
    }
}

/// A job id unique enough on one host: time, launcher pid and port.
fn generate_job_id(port: u16) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "ddprun-{:x}-{}-{port}",
        nanos & 0xffff_ffff_ffff,
        std::process::id()
    )
}
