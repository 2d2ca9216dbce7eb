//! Where a [`GroupConfig`]'s values come from: explicit values (the builder's), torchrun's
//! variables, Slurm's, the `DDP_*` variables, the defaults.
//!
//! Precedence, per value: an explicit value, then the variables of the one launcher detected,
//! then the defaults of a single process (rank 0 of 1). Launchers, in the order they are
//! detected (the first whose variables are present wins, and only its variables are read, so
//! only those are validated):
//!
//! | launcher | detected by | rank, world, local rank, local world |
//! | --- | --- | --- |
//! | torchrun (ddprun, `ddp_launch::spawn`, Kubeflow PyTorchJob; named by `DDP_LAUNCHER` when set) | `RANK` or `WORLD_SIZE` | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` and `_SIZE` | `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE` |
//! | MPICH, Intel MPI (Hydra `mpiexec`), `srun --mpi=pmi2` | `PMI_RANK` and `PMI_SIZE` | `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`; else Slurm's `SLURM_LOCALID`, `SLURM_TASKS_PER_NODE`/`SLURM_NODEID` when `SLURM_PROCID` and `SLURM_NTASKS` match (srun's pmi2 sets no local variables); else an error when the world is over 1 |
//! | Slurm (`srun`) | `SLURM_PROCID` and `SLURM_NTASKS` | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_TASKS_PER_NODE`/`SLURM_NODEID` |
//!
//! MPI comes before Slurm because an `mpirun` inside a Slurm batch script inherits the batch
//! step's `SLURM_PROCID` (0 in every rank). Kubeflow's PyTorchJob sets torchrun's variables
//! (`RANK`: the pod's index) and torchrun's options as `PET_*` variables, which torchrun and
//! ddprun read as their options' defaults: a program its pods start directly is the pod's only
//! rank (local world 1) when `PET_NPROC_PER_NODE` is 1 (or `auto`), and an error naming
//! `PET_NPROC_PER_NODE` when it is more (`WORLD_SIZE` counts processes nobody starts); with no
//! launcher's rank variables, `PET_NNODES` or `PET_NPROC_PER_NODE` above 1 is an error naming it
//! rather than a rank 0 of 1 (see `kubeflow.rs`).
//!
//! Rank 0's address: `MASTER_ADDR`; else under Slurm the first host of `SLURM_JOB_NODELIST`;
//! else under MPI the first host of `PBS_NODEFILE` (a PBS job), else of `SLURM_JOB_NODELIST`
//! (an `mpirun` inside a Slurm job), else this host when every rank is local, else an error
//! that asks for `MASTER_ADDR` (`mpirun -x MASTER_ADDR=host`). The port: `MASTER_PORT`; else
//! under Slurm and MPI one derived from the job id (`PBS_JOBID`, `SLURM_JOB_ID`, Open MPI's or
//! PMIx's job name), so that jobs sharing a node differ; else torchrun's default, 29500. The variables `DDP_TIMEOUT`, `DDP_CONNECT_TIMEOUT`, `DDP_PEER_TIMEOUT` (seconds),
//! `DDP_TRACE_DIR`, `DDP_TOKEN`, `DDP_JOB_ID`, `DDP_SEGMENT_BYTES`, `DDP_SMALL_ALLREDUCE_BYTES`,
//! `DDP_TRANSPORT` and `DDP_HOST_ID` apply in every case.
//!
//! torchrun's elastic agent (and ddprun) hosts a PyTorch `TCPStore` on `MASTER_ADDR:MASTER_PORT`
//! itself and says so with `TORCHELASTIC_USE_AGENT_STORE=True`: then no rank hosts a store, every rank
//! connects to the agent's (see [`GroupConfig::torch_agent_store`]), and the keys go under
//! torch's worker prefix for `TORCHELASTIC_RESTART_COUNT`.
//!
//! [`resolve`] reads the values in named steps (who the ranks are, where rank 0 is, the
//! deadlines, the tuning, the rest); every invalid value is a [`CommError::Config`] naming the
//! variable, or the builder setting, it came from.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{
    default_small_allreduce_bytes, GroupConfig, Transport, DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MASTER_PORT, DEFAULT_PEER_TIMEOUT, DEFAULT_SEGMENT_BYTES, DEFAULT_TIMEOUT,
    MAX_SEGMENT_BYTES,
};
use crate::error::CommError;
use crate::launcher::slurm::{first_host, parse_tasks_per_node};

/// The variable with which a launcher that sets torchrun's variables names itself, for
/// [`GroupConfig::launcher`]: ddprun sets `ddprun`, and
/// `ddp_launch::spawn` (PyTorch's `mp.spawn` for a Rust program) `spawn`; torchrun sets none, so
/// its ranks say `torchrun`. A short name of ASCII letters, digits, `-`, `_` or `.`.
pub const LAUNCHER_ENV: &str = "DDP_LAUNCHER";

/// How variables are read: the process environment ([`process_env`]) or a caller's map.
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Values given explicitly (through `GroupBuilder`); each one wins over every variable, and the
/// variable it overrides is not even read.
#[derive(Debug, Default)]
pub(crate) struct Explicit {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_rank: Option<usize>,
    pub local_world_size: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub timeout: Option<Duration>,
    pub connect_timeout: Option<Duration>,
    pub peer_timeout: Option<Duration>,
    pub trace_dir: Option<PathBuf>,
    pub token: Option<String>,
    pub job_id: Option<String>,
    pub segment_bytes: Option<usize>,
    pub small_allreduce_bytes: Option<usize>,
    pub torch_agent_store: Option<u32>,
    pub store_scope: Option<String>,
    pub transport: Option<Transport>,
    pub host_id: Option<String>,
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
        resolve(&Explicit::default(), &lookup)
    }
}

/// A variable of the process environment (lossily decoded).
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// The launcher whose variables say who the ranks are.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// `RANK` or `WORLD_SIZE` is set (torchrun, ddprun, anything that mimics them).
    Torchrun,
    /// `OMPI_COMM_WORLD_RANK` and `OMPI_COMM_WORLD_SIZE` (Open MPI's `mpirun`).
    OpenMpi,
    /// `PMI_RANK` and `PMI_SIZE` (MPICH's and Intel MPI's Hydra `mpiexec`).
    Mpich,
    /// `SLURM_PROCID` and `SLURM_NTASKS` (`srun`).
    Slurm,
    /// Neither: a single process, unless explicit values say otherwise.
    None,
}

impl Launcher {
    fn detect(env: Lookup) -> Launcher {
        if env("RANK").is_some() || env("WORLD_SIZE").is_some() {
            Launcher::Torchrun
        } else if env("OMPI_COMM_WORLD_RANK").is_some() && env("OMPI_COMM_WORLD_SIZE").is_some() {
            Launcher::OpenMpi
        } else if env("PMI_RANK").is_some() && env("PMI_SIZE").is_some() {
            Launcher::Mpich
        } else if env("SLURM_PROCID").is_some() && env("SLURM_NTASKS").is_some() {
            Launcher::Slurm
        } else {
            Launcher::None
        }
    }

    /// The name [`GroupConfig::launcher`] reports.
    fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "open-mpi",
            Launcher::Mpich => "mpich",
            Launcher::Slurm => "slurm",
            Launcher::None => "none",
        }
    }

    /// Whether an MPI launcher started the ranks.
    fn is_mpi(self) -> bool {
        matches!(self, Launcher::OpenMpi | Launcher::Mpich)
    }
}

/// The store's port for a numeric job id: 20000 + the id's last four digits.
fn job_port(id: u64) -> u16 {
    20000 + (id % 10000) as u16
}

/// The store's port under an MPI launcher without `MASTER_PORT`: from the PBS job id
/// (`1234.server`: its number), else the Slurm job id, else Open MPI's or PMIx's job name
/// (hashed), the same in every rank of the job; else torchrun's default.
fn mpi_job_port(env: Lookup) -> Result<u16, CommError> {
    if let Some(id) = env("PBS_JOBID") {
        let digits: String = id.chars().take_while(char::is_ascii_digit).collect();
        return match digits.parse::<u64>() {
            Ok(n) => Ok(job_port(n)),
            Err(_) => Ok(job_port(crate::hash::fnv1a(id.as_bytes()))),
        };
    }
    if let Some(id) = parse_var::<u64>(env, "SLURM_JOB_ID", "a job number")? {
        return Ok(job_port(id));
    }
    for var in ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"] {
        if let Some(name) = env(var).filter(|n| !n.is_empty()) {
            return Ok(job_port(crate::hash::fnv1a(name.as_bytes())));
        }
    }
    Ok(DEFAULT_MASTER_PORT)
}

/// Resolves every value of a [`GroupConfig`] (see the module documentation for the order).
pub(crate) fn resolve(given: &Explicit, env: Lookup) -> Result<GroupConfig, CommError> {
    let launcher = Launcher::detect(env);
    if launcher == Launcher::None && given.rank.is_none() && given.world_size.is_none() {
        crate::launcher::kubeflow::check_single_process(env)?;
    }
    let ranks = ranks(given, env, launcher)?;
    let master_addr = master_addr(given, env, launcher, &ranks)?;
    let master_port = master_port(given, env, launcher)?;
    let (timeout, connect_timeout, peer_timeout) = deadlines(given, env)?;
    let trace_dir = match &given.trace_dir {
        Some(d) => Some(d.clone()),
        None => env(crate::flight::TRACE_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from),
    };
    let (token, job_id) = identity(given, env)?;
    let (segment_bytes, small_allreduce_bytes) = tuning(given, env, ranks.world)?;
    let torch_agent_store = match given.torch_agent_store {
        Some(n) => Some(n),
        None => agent_store_from_env(env)?,
    };
    let transport = match given.transport {
        Some(t) => t,
        None => Transport::parse(env("DDP_TRANSPORT").as_deref())?,
    };
    let host_id = given
        .host_id
        .clone()
        .or_else(|| env("DDP_HOST_ID"))
        .filter(|h| !h.trim().is_empty());
    Ok(GroupConfig {
        rank: ranks.rank,
        world_size: ranks.world,
        local_rank: ranks.local_rank,
        local_world_size: ranks.local_world,
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
        store_scope: given.store_scope.clone(),
        transport,
        host_id,
        launcher: if given.rank.is_some() && given.world_size.is_some() {
            "explicit".to_string()
        } else {
            launcher_name(env, launcher)?
        },
    })
}

/// The launcher's name for [`GroupConfig::launcher`]: under torchrun's variables the name a
/// launcher gives itself in `DDP_LAUNCHER` (ddprun, spawn), else the detected launcher's.
fn launcher_name(env: Lookup, launcher: Launcher) -> Result<String, CommError> {
    let var = LAUNCHER_ENV;
    match env(var).filter(|n| !n.is_empty()) {
        Some(name) if launcher == Launcher::Torchrun => {
            let fine = name.len() <= 32
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
            match fine {
                true => Ok(name),
                false => Err(CommError::config(
                    var,
                    format!(
                        "{name:?}: a launcher's name is at most 32 ASCII letters, digits, '-', \
                         '_' or '.'"
                    ),
                )),
            }
        }
        _ => Ok(launcher.name().to_string()),
    }
}

/// A value and the variable (or builder setting) it came from, for error messages.
struct FromVar<T> {
    value: T,
    var: String,
}

impl<T> FromVar<T> {
    fn new(value: T, var: &str) -> FromVar<T> {
        FromVar {
            value,
            var: var.to_string(),
        }
    }
}

/// The explicit value (named `setting`), else the first candidate that has one.
fn first_given<T>(
    explicit: Option<T>,
    setting: &str,
    candidates: Vec<(Option<T>, &str)>,
) -> Option<FromVar<T>> {
    if let Some(value) = explicit {
        return Some(FromVar::new(value, setting));
    }
    candidates
        .into_iter()
        .find_map(|(value, var)| value.map(|v| FromVar::new(v, var)))
}

/// Who this rank is among whom.
struct Ranks {
    rank: usize,
    world: usize,
    local_rank: usize,
    local_world: usize,
}

/// The variable each launcher sets for the world size, the rank, the local world size and the
/// local rank (in that order); Slurm's local world size comes from its task counts instead.
fn launcher_vars(launcher: Launcher) -> [Option<&'static str>; 4] {
    match launcher {
        Launcher::Torchrun => [
            Some("WORLD_SIZE"),
            Some("RANK"),
            Some("LOCAL_WORLD_SIZE"),
            Some("LOCAL_RANK"),
        ],
        Launcher::OpenMpi => [
            Some("OMPI_COMM_WORLD_SIZE"),
            Some("OMPI_COMM_WORLD_RANK"),
            Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
            Some("OMPI_COMM_WORLD_LOCAL_RANK"),
        ],
        Launcher::Mpich => [
            Some("PMI_SIZE"),
            Some("PMI_RANK"),
            Some("MPI_LOCALNRANKS"),
            Some("MPI_LOCALRANKID"),
        ],
        Launcher::Slurm => [
            Some("SLURM_NTASKS"),
            Some("SLURM_PROCID"),
            None,
            Some("SLURM_LOCALID"),
        ],
        Launcher::None => [None; 4],
    }
}

/// Quantity `which` ([`launcher_vars`]'s order) as the launcher in use sets it: `None` when it
/// was given explicitly (`explicit`), or the launcher sets no variable for it, or the variable is
/// unset; an error naming the variable when it is not a non-negative integer.
fn launcher_value(
    env: Lookup,
    launcher: Launcher,
    which: usize,
    explicit: bool,
) -> Result<(Option<usize>, &'static str), CommError> {
    let torch_name = launcher_vars(Launcher::Torchrun)[which].expect("torchrun sets all four");
    match launcher_vars(launcher)[which] {
        Some(var) if !explicit => {
            Ok((parse_var::<usize>(env, var, "a non-negative integer")?, var))
        }
        Some(var) => Ok((None, var)),
        None => Ok((None, torch_name)),
    }
}

/// The rank, world size, local rank and local world size, from the launcher in use, checked
/// against each other. In steps: the world size, the rank within it, the ranks on this host,
/// this rank among them; each from an explicit value, else the launcher's variable, else a
/// source of that launcher's own (Slurm's task counts, a Kubeflow pod), else the single-process
/// default.
fn ranks(given: &Explicit, env: Lookup, launcher: Launcher) -> Result<Ranks, CommError> {
    let world = world_size(given, env, launcher)?;
    let rank = rank_in_world(given, env, launcher, &world)?;
    // `srun --mpi=pmi2` (or `MpiDefault=pmi2`): PMI_RANK and PMI_SIZE without MPICH's local
    // variables, beside the Slurm step's own, which then describe the same tasks.
    let pmi_under_srun = launcher == Launcher::Mpich && slurm_step_is(env, rank.value, world.value);
    let local_world = local_world_size(given, env, launcher, pmi_under_srun, (&rank, &world))?;
    let local_rank = local_rank(given, env, launcher, pmi_under_srun, &rank, &local_world)?;
    Ok(Ranks {
        rank: rank.value,
        world: world.value,
        local_rank: local_rank.value,
        local_world: local_world.value,
    })
}

/// The world size: explicit, else the launcher's variable, else 1; at least 1.
fn world_size(
    given: &Explicit,
    env: Lookup,
    launcher: Launcher,
) -> Result<FromVar<usize>, CommError> {
    let from_launcher = launcher_value(env, launcher, 0, given.world_size.is_some())?;
    let world = first_given(given.world_size, "world_size", vec![from_launcher])
        .unwrap_or(FromVar::new(1, "WORLD_SIZE"));
    if world.value == 0 {
        return Err(CommError::config(
            &world.var,
            format!("{}=0: the world size must be at least 1", world.var),
        ));
    }
    Ok(world)
}

/// The rank: explicit, else the launcher's variable, else 0 in a world of one; below the world
/// size.
fn rank_in_world(
    given: &Explicit,
    env: Lookup,
    launcher: Launcher,
    world: &FromVar<usize>,
) -> Result<FromVar<usize>, CommError> {
    let from_launcher = launcher_value(env, launcher, 1, given.rank.is_some())?;
    let rank = match first_given(given.rank, "rank", vec![from_launcher]) {
        Some(r) => r,
        None if world.value == 1 => FromVar::new(0, "RANK"),
        None => {
            return Err(CommError::config(
                "RANK",
                format!(
                    "RANK is not set (and no rank was given), but the world size is {} (from {})",
                    world.value, world.var
                ),
            ))
        }
    };
    if rank.value >= world.value {
        return Err(CommError::config(
            &rank.var,
            format!(
                "{}={} must be less than the world size {}={}",
                rank.var, rank.value, world.var, world.value
            ),
        ));
    }
    Ok(rank)
}

/// The ranks on this host: explicit, else the launcher's variable, else Slurm's task counts
/// (under srun, also beneath PMI), else a Kubeflow pod's `PET_NPROC_PER_NODE`, else the whole
/// world (one host); MPICH without any of them is an error (each rank would take the host for
/// its own). At least 1.
fn local_world_size(
    given: &Explicit,
    env: Lookup,
    launcher: Launcher,
    pmi_under_srun: bool,
    (rank, world): (&FromVar<usize>, &FromVar<usize>),
) -> Result<FromVar<usize>, CommError> {
    let explicit = given.local_world_size.is_some();
    let slurm_tasks = if (launcher == Launcher::Slurm || pmi_under_srun) && !explicit {
        slurm_tasks_on_this_node(env)?
    } else {
        None
    };
    // Started directly in a Kubeflow pod: RANK and WORLD_SIZE without LOCAL_WORLD_SIZE.
    let pod_local_world =
        if launcher == Launcher::Torchrun && !explicit && env("LOCAL_WORLD_SIZE").is_none() {
            crate::launcher::kubeflow::direct_local_world(env, world.value)?
        } else {
            None
        };
    let candidates = vec![
        launcher_value(env, launcher, 2, explicit)?,
        (slurm_tasks, "SLURM_TASKS_PER_NODE"),
        (pod_local_world, "PET_NPROC_PER_NODE"),
    ];
    let local_world = match first_given(given.local_world_size, "local_world_size", candidates) {
        Some(l) => l,
        None if launcher == Launcher::Mpich && world.value > 1 => {
            return Err(CommError::config(
                "MPI_LOCALNRANKS",
                format!(
                    "PMI_RANK={} and PMI_SIZE={} say who this rank is, but nothing says how many \
                     ranks run on this host: neither MPI_LOCALNRANKS and MPI_LOCALRANKID (set by \
                     MPICH's and Intel MPI's mpiexec) nor, under srun --mpi=pmi2, Slurm's \
                     SLURM_TASKS_PER_NODE and SLURM_LOCALID beside a matching SLURM_PROCID and \
                     SLURM_NTASKS are set; without them each rank would take the whole host for \
                     its own (all its cores, and GPU {} as if it were alone)",
                    rank.value, world.value, rank.value
                ),
            ))
        }
        None => FromVar::new(world.value, "LOCAL_WORLD_SIZE"),
    };
    if local_world.value == 0 {
        return Err(CommError::config(
            &local_world.var,
            format!("{}=0: must be at least 1", local_world.var),
        ));
    }
    Ok(local_world)
}

/// This rank among the ranks of its host: explicit, else the launcher's variable (under srun
/// beneath PMI, `SLURM_LOCALID`), else the rank modulo the local world size; below the local
/// world size.
fn local_rank(
    given: &Explicit,
    env: Lookup,
    launcher: Launcher,
    pmi_under_srun: bool,
    rank: &FromVar<usize>,
    local_world: &FromVar<usize>,
) -> Result<FromVar<usize>, CommError> {
    let explicit = given.local_rank.is_some();
    let pmi_local_rank = if pmi_under_srun && !explicit {
        parse_var::<usize>(env, "SLURM_LOCALID", "a non-negative integer")?
    } else {
        None
    };
    let candidates = vec![
        launcher_value(env, launcher, 3, explicit)?,
        (pmi_local_rank, "SLURM_LOCALID"),
    ];
    let local_rank = first_given(given.local_rank, "local_rank", candidates).unwrap_or(
        FromVar::new(rank.value % local_world.value.max(1), "LOCAL_RANK"),
    );
    if local_rank.value >= local_world.value {
        return Err(CommError::config(
            &local_rank.var,
            format!(
                "{}={} must be less than the local world size {}={}",
                local_rank.var, local_rank.value, local_world.var, local_world.value
            ),
        ));
    }
    Ok(local_rank)
}

/// Where rank 0 is: `MASTER_ADDR`, else what the launcher in use says (see the module
/// documentation), else this host.
fn master_addr(
    given: &Explicit,
    env: Lookup,
    launcher: Launcher,
    ranks: &Ranks,
) -> Result<String, CommError> {
    let addr = match &given.master_addr {
        Some(a) => a.clone(),
        None => match env("MASTER_ADDR").filter(|s| !s.trim().is_empty()) {
            Some(a) => a.trim().to_string(),
            None if launcher == Launcher::Slurm => slurm_first_host(env)?,
            None if launcher.is_mpi() => mpi_master_addr(env, ranks)?,
            None => "127.0.0.1".to_string(),
        },
    };
    if addr.is_empty() {
        return Err(CommError::config(
            "master_addr",
            "the master address is empty",
        ));
    }
    Ok(addr)
}

/// The first host of the Slurm job's node list.
fn slurm_first_host(env: Lookup) -> Result<String, CommError> {
    let (var, list) = match env("SLURM_JOB_NODELIST") {
        Some(l) => ("SLURM_JOB_NODELIST", l),
        None => ("SLURM_NODELIST", env("SLURM_NODELIST").unwrap_or_default()),
    };
    first_host(&list).ok_or_else(|| {
        CommError::config(
            var,
            format!("{var}={list:?}: cannot find a first host name (and MASTER_ADDR is not set)"),
        )
    })
}

/// Rank 0's host under an MPI launcher without `MASTER_ADDR`: the first line of the PBS job's
/// node file, else the first host of the Slurm job around the `mpirun`, else this host when
/// every rank runs here; several hosts and nothing to go by is an error asking for
/// `MASTER_ADDR`. (mpirun starts rank 0 on the first host of its allocation.)
fn mpi_master_addr(env: Lookup, ranks: &Ranks) -> Result<String, CommError> {
    if let Some(path) = env("PBS_NODEFILE").filter(|p| !p.trim().is_empty()) {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| CommError::config("PBS_NODEFILE", format!("PBS_NODEFILE={path}: {e}")))?;
        return text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(str::to_string)
            .ok_or_else(|| {
                CommError::config("PBS_NODEFILE", format!("PBS_NODEFILE={path} names no host"))
            });
    }
    if env("SLURM_JOB_NODELIST").is_some() || env("SLURM_NODELIST").is_some() {
        return slurm_first_host(env);
    }
    if ranks.local_world == ranks.world {
        return Ok("127.0.0.1".to_string());
    }
    Err(CommError::config(
        "MASTER_ADDR",
        format!(
            "MASTER_ADDR is not set: {} of the {} ranks run on other hosts, and the MPI \
             launcher does not say where rank 0 is (pass it on: mpirun -x MASTER_ADDR=<rank 0's \
             host>)",
            ranks.world - ranks.local_world,
            ranks.world
        ),
    ))
}

/// The store's port: `MASTER_PORT`, else under Slurm one derived from the job id (so that jobs
/// sharing a node differ), else torchrun's default.
fn master_port(given: &Explicit, env: Lookup, launcher: Launcher) -> Result<u16, CommError> {
    if let Some(p) = given.master_port {
        return Ok(p);
    }
    Ok(
        match parse_var::<u16>(env, "MASTER_PORT", "a port number (1-65535)")? {
            Some(0) => {
                return Err(CommError::config(
                    "MASTER_PORT",
                    "MASTER_PORT=\"0\" is not a usable port (1-65535)",
                ))
            }
            Some(p) => p,
            None if launcher == Launcher::Slurm => {
                match parse_var::<u64>(env, "SLURM_JOB_ID", "a job number")? {
                    Some(id) => job_port(id),
                    None => DEFAULT_MASTER_PORT,
                }
            }
            None if launcher.is_mpi() => mpi_job_port(env)?,
            None => DEFAULT_MASTER_PORT,
        },
    )
}

/// The collective deadline, the connect deadline and the liveness deadline.
fn deadlines(given: &Explicit, env: Lookup) -> Result<(Duration, Duration, Duration), CommError> {
    let timeout = match given.timeout {
        Some(t) => t,
        None => parse_seconds(env, "DDP_TIMEOUT")?.unwrap_or(DEFAULT_TIMEOUT),
    };
    let connect_timeout = match given.connect_timeout {
        Some(t) => t,
        None => parse_seconds(env, "DDP_CONNECT_TIMEOUT")?.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
    };
    let peer_timeout = match given.peer_timeout {
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
    Ok((timeout, connect_timeout, peer_timeout))
}

/// The shared secret (`DDP_TOKEN`, checked against the handshake's limit) and the launcher's
/// job name (`DDP_JOB_ID`).
fn identity(given: &Explicit, env: Lookup) -> Result<(Option<String>, Option<String>), CommError> {
    let token = match &given.token {
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
    let job_id = match &given.job_id {
        Some(j) => Some(j.clone()),
        None => env("DDP_JOB_ID").filter(|j| !j.trim().is_empty()),
    };
    Ok((token, job_id))
}

/// The segment size and the small-buffer threshold (its default depends on the world size).
fn tuning(given: &Explicit, env: Lookup, world: usize) -> Result<(usize, usize), CommError> {
    let segment_bytes = match given.segment_bytes {
        Some(s) => s,
        None => parse_var::<usize>(env, "DDP_SEGMENT_BYTES", "a number of bytes")?
            .unwrap_or(DEFAULT_SEGMENT_BYTES),
    };
    if segment_bytes == 0 || segment_bytes > MAX_SEGMENT_BYTES {
        let var = if given.segment_bytes.is_some() {
            "segment_bytes"
        } else {
            "DDP_SEGMENT_BYTES"
        };
        return Err(CommError::config(
            var,
            format!("{var}={segment_bytes} must be between 1 and {MAX_SEGMENT_BYTES}"),
        ));
    }
    let small_allreduce_bytes = match given.small_allreduce_bytes {
        Some(s) => s,
        None => parse_var::<usize>(env, "DDP_SMALL_ALLREDUCE_BYTES", "a number of bytes")?
            .unwrap_or_else(|| default_small_allreduce_bytes(world)),
    };
    Ok((segment_bytes, small_allreduce_bytes))
}

/// Reads a variable and parses it; a parse failure names the variable and the value.
fn parse_var<T: std::str::FromStr>(
    env: Lookup,
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

/// Reads a positive number of seconds.
fn parse_seconds(env: Lookup, var: &str) -> Result<Option<Duration>, CommError> {
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

/// torchrun's agent-store variables: `TORCHELASTIC_USE_AGENT_STORE` (torchrun sets exactly
/// `True`; `true` and `1` in any case are accepted too, `False`, `0` or empty mean no) and then
/// `TORCHELASTIC_RESTART_COUNT` (0 if unset). Any other value is an error naming the variable.
fn agent_store_from_env(env: Lookup) -> Result<Option<u32>, CommError> {
    // `crate::launcher::contract::USE_AGENT_STORE_ENV` (spelled out: elastic.rs reads variables through
    // this file).
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

/// Whether a Slurm step's variables describe the ranks `rank` of `world` too: `SLURM_PROCID` and
/// `SLURM_NTASKS` are set and equal them (so that its local variables are this rank's; an
/// `mpiexec` inside a batch script inherits the batch step's, which describe something else).
fn slurm_step_is(env: Lookup, rank: usize, world: usize) -> bool {
    let number = |var: &str| env(var).and_then(|v| v.trim().parse::<usize>().ok());
    number("SLURM_PROCID") == Some(rank) && number("SLURM_NTASKS") == Some(world)
}

/// Number of tasks on this node under Slurm, from `SLURM_TASKS_PER_NODE` (e.g. `2(x3),1`) and
/// `SLURM_NODEID`, or `SLURM_NTASKS_PER_NODE`.
fn slurm_tasks_on_this_node(env: Lookup) -> Result<Option<usize>, CommError> {
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

#[cfg(test)]
mod tests;
