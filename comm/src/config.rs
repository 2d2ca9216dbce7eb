//! Configuration of a process group: [`GroupConfig`] from torchrun's or Slurm's environment
//! variables, and [`GroupBuilder`] for explicit values.
//!
//! Precedence, per value: an explicit builder value, then torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), then Slurm's
//! (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_TASKS_PER_NODE`/`SLURM_NODEID`, the
//! first host of `SLURM_JOB_NODELIST`, a port derived from `SLURM_JOB_ID`), then the defaults of
//! a single process (rank 0 of 1). Slurm's variables are used only when neither `RANK` nor
//! `WORLD_SIZE` is set. The variables `DDP_TIMEOUT`, `DDP_CONNECT_TIMEOUT`, `DDP_PEER_TIMEOUT`
//! (seconds),
//! `DDP_TOKEN`, `DDP_JOB_ID`, `DDP_SEGMENT_BYTES` and `DDP_SMALL_ALLREDUCE_BYTES` apply in every
//! case.
//!
//! torchrun's elastic agent hosts a PyTorch `TCPStore` on `MASTER_ADDR:MASTER_PORT` itself and
//! says so with `TORCHELASTIC_USE_AGENT_STORE=True`: then no rank hosts a store, every rank
//! connects to the agent's (see [`GroupConfig::torch_agent_store`]), and the keys go under
//! torch's worker prefix for `TORCHELASTIC_RESTART_COUNT`.

use std::net::TcpListener;
use std::time::Duration;

use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::shm::Transport;

/// Default deadline of every wait on a peer (a peer silent this long fails the group): 300 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default liveness deadline: a peer from which nothing (not even a heartbeat) arrives for this
/// long is declared dead, whatever the collective deadline: 10 s.
pub const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(10);
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
/// Build one with [`GroupConfig::from_env`], [`GroupBuilder::config`] or
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
    /// What carries the collectives (`DDP_TRANSPORT`: `auto`, the default, uses shared memory
    /// between the ranks that share a host, confirmed by mapping each other's segments, and TCP
    /// between hosts; `tcp`; `shm`, an error when shared memory cannot be set up).
    pub transport: Transport,
    /// This rank's host identity for the transport's choice (`DDP_HOST_ID`): ranks with equal
    /// identities try shared memory with each other. `None`: the host name plus the kernel's
    /// boot id. Set it where those do not tell hosts apart, or to simulate several hosts.
    pub host_id: Option<String>,
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
            host_id: None,
        }
    }
}

impl GroupConfig {
    /// Reads the configuration from the process environment: torchrun's variables, then Slurm's,
    /// then a single process (world size 1) when neither is present.
    ///
    /// Invalid values (a rank not below the world size, a port that is not a number, ...) are
    /// [`CommError::Config`] errors naming the variable.
    pub fn from_env() -> Result<GroupConfig, CommError> {
        GroupConfig::from_vars(process_env)
    }

    /// Like [`GroupConfig::from_env`], but reads variables through `lookup` (for tests and
    /// launchers that compute an environment without setting it).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<GroupConfig, CommError> {
        resolve(&GroupBuilder::default(), &lookup)
    }
}

fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// Builds a [`ProcessGroup`] from explicit values; anything not given comes from the environment
/// (see [`GroupConfig::from_env`]).
///
/// ```no_run
/// # use std::time::Duration;
/// let pg = ddp_comm::ProcessGroup::builder()
///     .rank(1)
///     .world_size(2)
///     .master_addr("127.0.0.1")
///     .master_port(29500)
///     .timeout(Duration::from_secs(60))
///     .build()?;
/// # Ok::<(), ddp_comm::CommError>(())
/// ```
#[derive(Debug, Default)]
pub struct GroupBuilder {
    rank: Option<usize>,
    world_size: Option<usize>,
    local_rank: Option<usize>,
    local_world_size: Option<usize>,
    master_addr: Option<String>,
    master_port: Option<u16>,
    timeout: Option<Duration>,
    connect_timeout: Option<Duration>,
    peer_timeout: Option<Duration>,
    trace_dir: Option<std::path::PathBuf>,
    token: Option<String>,
    job_id: Option<String>,
    segment_bytes: Option<usize>,
    small_allreduce_bytes: Option<usize>,
    torch_agent_store: Option<u32>,
    transport: Option<Transport>,
    host_id: Option<String>,
    master_listener: Option<TcpListener>,
    no_env: bool,
}

impl GroupBuilder {
    /// This process's rank.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }
    /// Number of processes in the group.
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }
    /// Rank among the processes on this node.
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.local_rank = Some(local_rank);
        self
    }
    /// Number of processes on this node.
    pub fn local_world_size(mut self, local_world_size: usize) -> Self {
        self.local_world_size = Some(local_world_size);
        self
    }
    /// Host of rank 0's rendezvous store.
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.master_addr = Some(addr.into());
        self
    }
    /// Port of rank 0's rendezvous store.
    pub fn master_port(mut self, port: u16) -> Self {
        self.master_port = Some(port);
        self
    }
    /// Deadline of every wait on a peer during a collective (default 300 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// Deadline for reaching the store and the peers while the group forms (default 300 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = Some(timeout);
        self
    }
    /// Liveness deadline: a peer silent this long, heartbeats included, is declared dead
    /// (overrides `DDP_PEER_TIMEOUT`; default 10 s).
    pub fn peer_timeout(mut self, timeout: Duration) -> Self {
        self.peer_timeout = Some(timeout);
        self
    }
    /// What carries the collectives (overrides `DDP_TRANSPORT`; default [`Transport::Auto`]).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = Some(transport);
        self
    }
    /// This rank's host identity (overrides `DDP_HOST_ID`; see [`GroupConfig::host_id`]).
    pub fn host_id(mut self, host_id: impl Into<String>) -> Self {
        self.host_id = Some(host_id.into());
        self
    }
    /// Directory for the flight recorder's dumps (overrides `DDP_TRACE_DIR`).
    pub fn trace_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.trace_dir = Some(dir.into());
        self
    }
    /// Shared secret that every connection must present (overrides `DDP_TOKEN`).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }
    /// The job's name (overrides `DDP_JOB_ID`); every rank must give the same.
    pub fn job_id(mut self, job_id: impl Into<String>) -> Self {
        self.job_id = Some(job_id.into());
        self
    }
    /// Segment size of the pipelined algorithms in bytes (default 1 MiB).
    pub fn segment_bytes(mut self, bytes: usize) -> Self {
        self.segment_bytes = Some(bytes);
        self
    }
    /// Size up to which buffers use the latency-optimal algorithms (default 256 KiB).
    pub fn small_allreduce_bytes(mut self, bytes: usize) -> Self {
        self.small_allreduce_bytes = Some(bytes);
        self
    }
    /// Rendezvous through a PyTorch `TCPStore` that something else (torchrun's agent) hosts at
    /// the master address, with torch's worker key prefix for `restart_count` (overrides
    /// `TORCHELASTIC_USE_AGENT_STORE`; see [`GroupConfig::torch_agent_store`]).
    pub fn torch_agent_store(mut self, restart_count: u32) -> Self {
        self.torch_agent_store = Some(restart_count);
        self
    }
    /// Rank 0 only: host the rendezvous store on this already bound listener instead of binding
    /// `MASTER_PORT` (its port becomes the master port). Lets tests and launchers pick a free
    /// port with no race.
    pub fn master_listener(mut self, listener: TcpListener) -> Self {
        self.master_listener = Some(listener);
        self
    }
    /// Ignore the process environment: only explicit values and defaults are used.
    pub fn no_env(mut self) -> Self {
        self.no_env = true;
        self
    }

    /// Resolves the configuration (explicit values, then the environment, then defaults)
    /// without joining a group.
    pub fn config(&self) -> Result<GroupConfig, CommError> {
        if self.no_env {
            resolve(self, &|_: &str| None)
        } else {
            resolve(self, &process_env)
        }
    }

    /// Resolves the configuration and joins the group (blocks until every rank has connected,
    /// or the connect deadline passes).
    pub fn build(mut self) -> Result<ProcessGroup, CommError> {
        let mut config = self.config()?;
        let listener = self.master_listener.take();
        if let Some(l) = &listener {
            if let Ok(addr) = l.local_addr() {
                config.master_port = addr.port();
            }
        }
        ProcessGroup::init(config, listener)
    }
}

/// Reads a variable and parses it; a parse failure names the variable and the value.
fn parse_var<T: std::str::FromStr>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    what: &str,
) -> Result<Option<T>, CommError> {
    match env(var) {
        None => Ok(None),
        Some(raw) => raw
            .trim()
            .parse::<T>()
            .map(Some)
            .map_err(|_| CommError::config(var, format!("{var}={raw:?} is not {what}"))),
    }
}

fn parse_seconds(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
) -> Result<Option<Duration>, CommError> {
    match parse_var::<f64>(env, var, "a number of seconds")? {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Some(Duration::from_secs_f64(s))),
        Some(_) => Err(CommError::config(
            var,
            format!(
                "{var}={:?} must be a positive number of seconds",
                env(var).unwrap_or_default()
            ),
        )),
    }
}

/// A resolved value and the name of where it came from (for error messages).
struct Sourced<T> {
    value: T,
    from: String,
}

fn pick<T>(
    explicit: Option<T>,
    builder_name: &str,
    candidates: Vec<(Option<T>, &str)>,
) -> Option<Sourced<T>> {
    if let Some(value) = explicit {
        return Some(Sourced {
            value,
            from: builder_name.to_string(),
        });
    }
    for (value, var) in candidates {
        if let Some(value) = value {
            return Some(Sourced {
                value,
                from: var.to_string(),
            });
        }
    }
    None
}

fn resolve(
    b: &GroupBuilder,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<GroupConfig, CommError> {
    let torch = env("RANK").is_some() || env("WORLD_SIZE").is_some();
    let slurm = !torch && env("SLURM_PROCID").is_some() && env("SLURM_NTASKS").is_some();
    let num = "a non-negative integer";
    // Only read (and so only validate) the variables of the source in use, and only those the
    // builder does not override.
    let read = |explicit: bool, var: &str, active: bool| -> Result<Option<usize>, CommError> {
        if explicit || !active {
            Ok(None)
        } else {
            parse_var::<usize>(env, var, num)
        }
    };

    let world = pick(
        b.world_size,
        "world_size",
        vec![
            (
                read(b.world_size.is_some(), "WORLD_SIZE", torch)?,
                "WORLD_SIZE",
            ),
            (
                read(b.world_size.is_some(), "SLURM_NTASKS", slurm)?,
                "SLURM_NTASKS",
            ),
        ],
    )
    .unwrap_or(Sourced {
        value: 1,
        from: "WORLD_SIZE".to_string(),
    });
    if world.value == 0 {
        return Err(CommError::config(
            &world.from,
            format!("{}=0: the world size must be at least 1", world.from),
        ));
    }
    let rank = pick(
        b.rank,
        "rank",
        vec![
            (read(b.rank.is_some(), "RANK", torch)?, "RANK"),
            (
                read(b.rank.is_some(), "SLURM_PROCID", slurm)?,
                "SLURM_PROCID",
            ),
        ],
    );
    let rank = match rank {
        Some(r) => r,
        None if world.value == 1 => Sourced {
            value: 0,
            from: "RANK".to_string(),
        },
        None => {
            return Err(CommError::config(
                "RANK",
                format!(
                    "RANK is not set (and no rank was given), but the world size is {} (from {})",
                    world.value, world.from
                ),
            ))
        }
    };
    if rank.value >= world.value {
        return Err(CommError::config(
            &rank.from,
            format!(
                "{}={} must be less than the world size {}={}",
                rank.from, rank.value, world.from, world.value
            ),
        ));
    }

    let slurm_local_world = if slurm && b.local_world_size.is_none() {
        slurm_tasks_on_this_node(env)?
    } else {
        None
    };
    let local_world = pick(
        b.local_world_size,
        "local_world_size",
        vec![
            (
                read(b.local_world_size.is_some(), "LOCAL_WORLD_SIZE", torch)?,
                "LOCAL_WORLD_SIZE",
            ),
            (slurm_local_world, "SLURM_TASKS_PER_NODE"),
        ],
    )
    .unwrap_or(Sourced {
        value: world.value,
        from: "LOCAL_WORLD_SIZE".to_string(),
    });
    let local_rank = pick(
        b.local_rank,
        "local_rank",
        vec![
            (
                read(b.local_rank.is_some(), "LOCAL_RANK", torch)?,
                "LOCAL_RANK",
            ),
            (
                read(b.local_rank.is_some(), "SLURM_LOCALID", slurm)?,
                "SLURM_LOCALID",
            ),
        ],
    )
    .unwrap_or(Sourced {
        value: rank.value % local_world.value.max(1),
        from: "LOCAL_RANK".to_string(),
    });
    if local_world.value == 0 {
        return Err(CommError::config(
            &local_world.from,
            format!("{}=0: must be at least 1", local_world.from),
        ));
    }
    if local_rank.value >= local_world.value {
        return Err(CommError::config(
            &local_rank.from,
            format!(
                "{}={} must be less than the local world size {}={}",
                local_rank.from, local_rank.value, local_world.from, local_world.value
            ),
        ));
    }

    let master_addr = match &b.master_addr {
        Some(a) => a.clone(),
        None => match env("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
            Some(a) => a.trim().to_string(),
            None if slurm => {
                let (var, list) = match env("SLURM_JOB_NODELIST") {
                    Some(l) => ("SLURM_JOB_NODELIST", l),
                    None => ("SLURM_NODELIST", env("SLURM_NODELIST").unwrap_or_default()),
                };
                first_host(&list).ok_or_else(|| {
                    CommError::config(
                        var,
                        format!("{var}={list:?}: cannot find a first host name (and MASTER_ADDR is not set)"),
                    )
                })?
            }
            None => "127.0.0.1".to_string(),
        },
    };
    if master_addr.is_empty() {
        return Err(CommError::config(
            "master_addr",
            "the master address is empty",
        ));
    }

    let master_port = match b.master_port {
        Some(p) => p,
        None => match parse_var::<u16>(env, "MASTER_PORT", "a port number (1-65535)")? {
            Some(0) => {
                return Err(CommError::config(
                    "MASTER_PORT",
                    "MASTER_PORT=\"0\" is not a usable port (1-65535)",
                ))
            }
            Some(p) => p,
            None if slurm => match parse_var::<u64>(env, "SLURM_JOB_ID", "a job number")? {
                // Different jobs sharing a node get different ports.
                Some(id) => 20000 + (id % 10000) as u16,
                None => DEFAULT_MASTER_PORT,
            },
            None => DEFAULT_MASTER_PORT,
        },
    };

    let timeout = match b.timeout {
        Some(t) => t,
        None => parse_seconds(env, "DDP_TIMEOUT")?.unwrap_or(DEFAULT_TIMEOUT),
    };
    let connect_timeout = match b.connect_timeout {
        Some(t) => t,
        None => parse_seconds(env, "DDP_CONNECT_TIMEOUT")?.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
    };
    let peer_timeout = match b.peer_timeout {
        Some(t) => t,
        None => parse_seconds(env, "DDP_PEER_TIMEOUT")?.unwrap_or(DEFAULT_PEER_TIMEOUT),
    };
    if timeout.is_zero() {
        return Err(CommError::config("timeout", "the timeout must be positive"));
    }
    if peer_timeout < Duration::from_millis(100) {
        return Err(CommError::config(
            "DDP_PEER_TIMEOUT",
            format!("{peer_timeout:?} is too short: at least 0.1 s (heartbeats are sent every 1/5 of it)"),
        ));
    }
    if connect_timeout.is_zero() {
        return Err(CommError::config(
            "connect_timeout",
            "the connect timeout must be positive",
        ));
    }
    let trace_dir = match &b.trace_dir {
        Some(d) => Some(d.clone()),
        None => env(crate::flight::TRACE_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(std::path::PathBuf::from),
    };
    let token = match &b.token {
        Some(t) => Some(t.clone()),
        None => env("DDP_TOKEN").filter(|t| !t.is_empty()),
    };
    if let Some(t) = &token {
        if t.len() > crate::wire::MAX_TOKEN_BYTES {
            return Err(CommError::config(
                "DDP_TOKEN",
                format!(
                    "the token is {} bytes long; at most {} are allowed",
                    t.len(),
                    crate::wire::MAX_TOKEN_BYTES
                ),
            ));
        }
    }
    let job_id = match &b.job_id {
        Some(j) => Some(j.clone()),
        None => env("DDP_JOB_ID").filter(|j| !j.trim().is_empty()),
    };
    let segment_bytes = match b.segment_bytes {
        Some(s) => s,
        None => parse_var::<usize>(env, "DDP_SEGMENT_BYTES", "a number of bytes")?
            .unwrap_or(DEFAULT_SEGMENT_BYTES),
    };
    if segment_bytes == 0 || segment_bytes > MAX_SEGMENT_BYTES {
        let var = if b.segment_bytes.is_some() {
            "segment_bytes"
        } else {
            "DDP_SEGMENT_BYTES"
        };
        return Err(CommError::config(
            var,
            format!("{var}={segment_bytes} must be between 1 and {MAX_SEGMENT_BYTES}"),
        ));
    }
    let small_allreduce_bytes = match b.small_allreduce_bytes {
        Some(s) => s,
        None => parse_var::<usize>(env, "DDP_SMALL_ALLREDUCE_BYTES", "a number of bytes")?
            .unwrap_or_else(|| default_small_allreduce_bytes(world.value)),
    };

    let torch_agent_store = match b.torch_agent_store {
        Some(n) => Some(n),
        None => agent_store_from_env(env)?,
    };
    let transport = match b.transport {
        Some(t) => t,
        None => Transport::parse(env("DDP_TRANSPORT").as_deref())?,
    };
    let host_id = b
        .host_id
        .clone()
        .or_else(|| env("DDP_HOST_ID"))
        .filter(|h| !h.trim().is_empty());

    Ok(GroupConfig {
        rank: rank.value,
        world_size: world.value,
        local_rank: local_rank.value,
        local_world_size: local_world.value,
        master_addr,
        master_port,
        timeout,
        connect_timeout,
        peer_timeout,
        trace_dir,
        token,
        job_id,
        segment_bytes,
        small_allreduce_bytes,
        torch_agent_store,
        transport,
        host_id,
    })
}

/// torchrun's agent-store variables: `TORCHELASTIC_USE_AGENT_STORE` (torchrun sets exactly
/// `True`; `true` and `1` in any case are accepted too, `False`, `0` or empty mean no) and then
/// `TORCHELASTIC_RESTART_COUNT` (0 if unset). Any other value is an error naming the variable.
fn agent_store_from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<u32>, CommError> {
    const USE: &str = "TORCHELASTIC_USE_AGENT_STORE";
    let Some(raw) = env(USE) else {
        return Ok(None);
    };
    match raw.trim().to_ascii_lowercase().as_str() {
        "true" | "1" => {}
        "false" | "0" | "" => return Ok(None),
        _ => {
            return Err(CommError::config(
                USE,
                format!("{USE}={raw:?} is neither True nor False"),
            ))
        }
    }
    let restart = parse_var::<u32>(env, "TORCHELASTIC_RESTART_COUNT", "a restart count")?;
    Ok(Some(restart.unwrap_or(0)))
}

/// Number of tasks on this node under Slurm, from `SLURM_TASKS_PER_NODE` (e.g. `2(x3),1`) and
/// `SLURM_NODEID`, or `SLURM_NTASKS_PER_NODE`.
fn slurm_tasks_on_this_node(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<usize>, CommError> {
    if let Some(list) = env("SLURM_TASKS_PER_NODE") {
        let node = parse_var::<usize>(env, "SLURM_NODEID", "a node index")?.unwrap_or(0);
        let counts = parse_tasks_per_node(&list).ok_or_else(|| {
            CommError::config(
                "SLURM_TASKS_PER_NODE",
                format!("SLURM_TASKS_PER_NODE={list:?} is not of the form 2(x3),1"),
            )
        })?;
        return Ok(counts.get(node).copied().or(counts.first().copied()));
    }
    parse_var::<usize>(env, "SLURM_NTASKS_PER_NODE", "a number of tasks")
}

/// Expands Slurm's compressed task counts: `2(x3),1` is `[2, 2, 2, 1]`.
pub(crate) fn parse_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for item in list.trim().split(',') {
        let item = item.trim();
        if let Some((count, rest)) = item.split_once("(x") {
            let reps: usize = rest.strip_suffix(')')?.parse().ok()?;
            let count: usize = count.parse().ok()?;
            if reps > 100_000 {
                return None;
            }
            out.extend(std::iter::repeat_n(count, reps));
        } else {
            out.push(item.parse().ok()?);
        }
    }
    if out.is_empty() {
        None
    } else {
        Some(out)
    }
}

/// The first host of a Slurm node list: `node[01-04,07]` gives `node01`, `a,b` gives `a`,
/// `rack[1-2]-gpu[3,5]` gives `rack1-gpu3`, `host` gives `host`.
pub fn first_host(nodelist: &str) -> Option<String> {
    let list = nodelist.trim();
    // The first item at bracket depth 0.
    let mut depth = 0i32;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let item = &list[..end];
    // Replace every bracket group by the start of its first range.
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        let inner = &rest[open + 1..close];
        let first = inner.split(',').next()?.split('-').next()?.trim();
        if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    let host = host.trim().to_string();
    if host.is_empty() {
        None
    } else {
        Some(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    fn err_var(e: CommError) -> String {
        match e {
            CommError::Config { var, .. } => var,
            other => panic!("expected a config error, got {other}"),
        }
    }

    #[test]
    fn no_variables_is_a_single_process() {
        let c = GroupConfig::from_vars(vars(&[])).unwrap();
        assert_eq!(c, GroupConfig::default());
    }

    #[test]
    fn torchrun_agent_store_variables() {
        let base = [("RANK", "1"), ("WORLD_SIZE", "2")];
        let with = |extra: &[(&str, &str)]| {
            let mut all = base.to_vec();
            all.extend_from_slice(extra);
            GroupConfig::from_vars(vars(&all))
        };
        assert_eq!(with(&[]).unwrap().torch_agent_store, None);
        for off in ["False", "0", ""] {
            let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", off)]).unwrap();
            assert_eq!(c.torch_agent_store, None, "{off:?}");
        }
        for on in ["True", "true", "TRUE", "1"] {
            let c = with(&[("TORCHELASTIC_USE_AGENT_STORE", on)]).unwrap();
            assert_eq!(c.torch_agent_store, Some(0), "{on:?}");
        }
        let c = with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "3"),
        ])
        .unwrap();
        assert_eq!(c.torch_agent_store, Some(3));
        let e = with(&[("TORCHELASTIC_USE_AGENT_STORE", "yes")]).unwrap_err();
        assert_eq!(err_var(e), "TORCHELASTIC_USE_AGENT_STORE");
        let e = with(&[
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "-1"),
        ])
        .unwrap_err();
        assert_eq!(err_var(e), "TORCHELASTIC_RESTART_COUNT");
        // The builder overrides the environment.
        let c = GroupBuilder::default()
            .torch_agent_store(5)
            .no_env()
            .config()
            .unwrap();
        assert_eq!(c.torch_agent_store, Some(5));
    }

    #[test]
    fn torchrun_variables() {
        let c = GroupConfig::from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "1234"),
            ("DDP_TIMEOUT", "2.5"),
            ("DDP_TOKEN", "s3cret"),
            ("DDP_JOB_ID", "job-7"),
            ("DDP_SEGMENT_BYTES", "4096"),
            ("DDP_SMALL_ALLREDUCE_BYTES", "0"),
            // Ignored: torchrun's variables win.
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 8, 1, 2)
        );
        assert_eq!((c.master_addr.as_str(), c.master_port), ("node7", 1234));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.connect_timeout, DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(c.token.as_deref(), Some("s3cret"));
        assert_eq!(c.job_id.as_deref(), Some("job-7"));
        assert_eq!((c.segment_bytes, c.small_allreduce_bytes), (4096, 0));
    }

    #[test]
    fn slurm_variables() {
        let c = GroupConfig::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_JOB_NODELIST", "gpu[07-09,12],cpu1"),
            ("SLURM_JOB_ID", "123456"),
        ]))
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (5, 7, 1, 2)
        );
        assert_eq!(c.master_addr, "gpu07");
        assert_eq!(c.master_port, 20000 + 3456);
        // MASTER_ADDR / MASTER_PORT override Slurm's guesses.
        let c = GroupConfig::from_vars(vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "a,b"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "4000"),
        ]))
        .unwrap();
        assert_eq!((c.master_addr.as_str(), c.master_port), ("head", 4000));
        assert_eq!((c.local_rank, c.local_world_size), (0, 2));
    }

    #[test]
    fn builder_overrides_and_skips_environment() {
        let b = ProcessGroup::builder()
            .rank(1)
            .world_size(2)
            .master_port(7)
            .no_env();
        let c = b.config().unwrap();
        assert_eq!((c.rank, c.world_size, c.master_port), (1, 2, 7));
        // An explicit value means the (invalid) variable is not even read.
        let b = ProcessGroup::builder().rank(0).world_size(2).master_port(9);
        let c = resolve(
            &b,
            &vars(&[("RANK", "x"), ("WORLD_SIZE", "y"), ("MASTER_PORT", "z")]),
        )
        .unwrap();
        assert_eq!((c.rank, c.world_size, c.master_port), (0, 2, 9));
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![("RANK", "4"), ("WORLD_SIZE", "4")], "RANK"),
            (vec![("RANK", "x"), ("WORLD_SIZE", "4")], "RANK"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "-1")], "WORLD_SIZE"),
            (vec![("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (vec![("WORLD_SIZE", "2")], "RANK"),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "http")],
                "MASTER_PORT",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")],
                "MASTER_PORT",
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "LOCAL_RANK",
            ),
            (
                vec![("SLURM_PROCID", "3"), ("SLURM_NTASKS", "3")],
                "SLURM_PROCID",
            ),
            (
                vec![
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_JOB_NODELIST", "["),
                ],
                "SLURM_JOB_NODELIST",
            ),
            (vec![("DDP_TIMEOUT", "soon")], "DDP_TIMEOUT"),
            (vec![("DDP_CONNECT_TIMEOUT", "-3")], "DDP_CONNECT_TIMEOUT"),
            (vec![("DDP_SEGMENT_BYTES", "0")], "DDP_SEGMENT_BYTES"),
            (
                vec![("DDP_SMALL_ALLREDUCE_BYTES", "1MB")],
                "DDP_SMALL_ALLREDUCE_BYTES",
            ),
        ];
        for (pairs, var) in cases {
            let err = GroupConfig::from_vars(vars(&pairs)).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(var), "{pairs:?}: {msg}");
            assert_eq!(err_var(err), var, "{pairs:?}");
        }
        let err = ProcessGroup::builder()
            .rank(2)
            .world_size(2)
            .no_env()
            .config()
            .unwrap_err();
        assert_eq!(err_var(err), "rank");
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07]").as_deref(), Some("node01"));
        assert_eq!(first_host("node[07,01-04]").as_deref(), Some("node07"));
        assert_eq!(first_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_host("host").as_deref(), Some("host"));
        assert_eq!(first_host(" host1 ").as_deref(), Some("host1"));
        assert_eq!(
            first_host("rack[1-2]-gpu[3,5],x").as_deref(),
            Some("rack1-gpu3")
        );
        assert_eq!(first_host("gpu[1-2],cpu[3-4]").as_deref(), Some("gpu1"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("node[01-04"), None);
        assert_eq!(first_host("node[]"), None);
        assert_eq!(first_host("node]"), None);
    }

    #[test]
    fn slurm_tasks_per_node() {
        assert_eq!(parse_tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(parse_tasks_per_node("4"), Some(vec![4]));
        assert_eq!(parse_tasks_per_node("x"), None);
        assert_eq!(parse_tasks_per_node("2(x3"), None);
    }
}
