//! What a launcher hands a rank beyond the process group's own variables, read in one place:
//! the restart count, the elastic range and round, the job's secret and id, the visible GPUs,
//! the Slurm step. The group's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, Slurm's, MPI's,
//! `PET_*`) are read by `GroupConfig::from_env` (`env.rs`); no other file of any crate of the
//! workspace reads a launcher's variable itself. Imports nothing of the crate, so that any
//! layer may read here. Public through [`crate::elastic`].

/// The variable that tells a rank how many times the launcher has restarted the job before
/// starting it (0 on the first attempt), as torchrun names it.
pub const RESTART_COUNT_ENV: &str = "TORCHELASTIC_RESTART_COUNT";

/// The variable that makes a rank elastic: `MIN:MAX`, the least and the most ranks the job
/// runs with (ddprun sets it from `--nnodes MIN:MAX`, in ranks).
pub const ELASTIC_ENV: &str = "DDP_ELASTIC";

/// The variable with which ddprun tells an elastic rank its job's round (0, then 1, 2, ... after
/// each restart of the whole job below its minimum): the round's keys in the store are its
/// own. Without it, the round is `TORCHELASTIC_RESTART_COUNT` (torchrun's count), which under
/// ddprun also counts the ranks restarted alone, and so differs from rank to rank.
pub const ELASTIC_ROUND_ENV: &str = "DDP_ELASTIC_ROUND";

/// The variable that sets an elastic job's "last call" (seconds; torchrun's c10d rendezvous
/// calls it `last_call_timeout`): once MIN processes have asked to found the job, the founding
/// waits this long for more before generation 1 starts without them (unless MAX have asked).
/// [`DEFAULT_LAST_CALL`](crate::DEFAULT_LAST_CALL) without it. A job whose processes start
/// unevenly (a GPU process compiles its kernels before it asks: seconds to minutes on a cold
/// cache) founds at MAX with a longer last call, rather than at MIN and healing the latecomers.
pub const LAST_CALL_ENV: &str = "DDP_ELASTIC_LAST_CALL";

/// The variable holding the job's secret (`DDP_TOKEN`): the same on every node, it
/// authenticates ranks to ddp-comm's store and mesh, and seals an elastic job's membership
/// records.
pub const TOKEN_ENV: &str = "DDP_TOKEN";

/// The variable by which a launcher or a user restricts the NVIDIA GPUs a process sees (a list
/// of ordinals or UUIDs), as CUDA reads it.
pub const VISIBLE_DEVICES_ENV: &str = "CUDA_VISIBLE_DEVICES";

/// The variable that carries a multi-node job's id to every node's launcher (ddprun's
/// `--job-id` when not given).
pub const JOB_ID_ENV: &str = "DDP_JOB_ID";

/// A variable of the process environment, `None` when unset or empty (lossily decoded).
fn set_var(name: &str) -> Option<String> {
    std::env::var_os(name)
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|v| !v.trim().is_empty())
}

/// How many times the launcher restarted the job before starting this process
/// ([`RESTART_COUNT_ENV`], set by ddprun and torchrun); 0 when unset or unreadable.
pub fn restart_count() -> usize {
    set_var(RESTART_COUNT_ENV)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The round of an elastic job this process belongs to: ddprun's
/// [`ELASTIC_ROUND_ENV`], the same for every rank of the round (a rank
/// restarted alone into a running job has a restart count of its own), else
/// [`restart_count`].
pub fn elastic_round() -> usize {
    set_var(ELASTIC_ROUND_ENV)
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or_else(restart_count)
}

/// The elastic range `MIN:MAX` the launcher gave ([`ELASTIC_ENV`], which
/// `ddprun --nnodes MIN:MAX` sets); `None`: not an elastic job.
pub fn elastic_range() -> Option<String> {
    set_var(ELASTIC_ENV)
}

/// The job's secret ([`TOKEN_ENV`]), `None` when unset or empty.
pub fn job_token() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// The GPUs this process may see ([`VISIBLE_DEVICES_ENV`]), as set (`None`: every GPU).
pub fn visible_devices() -> Option<String> {
    std::env::var(VISIBLE_DEVICES_ENV).ok()
}

/// The job id every node's launcher shares ([`JOB_ID_ENV`]), `None` when unset or empty.
pub fn job_id() -> Option<String> {
    std::env::var(JOB_ID_ENV).ok().filter(|id| !id.is_empty())
}

/// The Slurm job step this process runs in (`SLURM_STEP_ID`, or the older `SLURM_STEPID`),
/// `None` outside a step (a batch script).
pub fn slurm_step_id() -> Option<String> {
    std::env::var("SLURM_STEP_ID")
        .or_else(|_| std::env::var("SLURM_STEPID"))
        .ok()
}
