//! [`spawn`]: PyTorch's `torch.multiprocessing.spawn(fn, nprocs=N)` for a Rust program: the
//! program starts N copies of itself as the local ranks of a one-node job and waits for them,
//! with everything [`crate::launch`] does (torchrun's variables, a free port on which the
//! launching process hosts the rendezvous store, output prefixed with `[rank R]`, the others
//! stopped when one fails and the first failure named as the root cause, restarts).
//!
//! A process that a launcher started as a rank of a larger job refuses: the launcher decides how
//! many ranks there are. One exception, as for PyTorch's `mp.spawn`: the batch step of a Slurm
//! job (the script `sbatch` runs) carries the job's `SLURM_PROCID` (0) and `SLURM_NTASKS`
//! although it is no rank of anything, so it may start its ranks; so may a step of one task.
//! Only `srun` starts steps, and it sets the step's number (`SLURM_STEP_ID`, older Slurm
//! `SLURM_STEPID`), which the batch step lacks (Slurm 22.05 sets neither there; a Slurm that
//! names the batch step sets `batch`). So a task of a real step of several tasks (`srun -n 2`)
//! is refused, and the batch step is not.

use std::ffi::OsString;
use std::time::Duration;

use crate::config::{LaunchConfig, DEFAULT_GRACE_PERIOD};
use crate::error::{LaunchError, LaunchReport};

/// How [`spawn`] starts the ranks.
#[derive(Debug, Clone)]
pub struct SpawnOptions {
    /// The arguments every rank gets (the program is always this one,
    /// [`std::env::current_exe`]); [`SpawnOptions::new`] takes this process's own, and a
    /// program removes from them the flag that asked for the ranks, so that they do not spawn
    /// again.
    pub args: Vec<OsString>,
    /// Restarts of all ranks after a failure, as [`LaunchConfig::max_restarts`] (default 0).
    pub max_restarts: usize,
    /// Time between `SIGTERM` and `SIGKILL` when stopping the ranks (default
    /// [`DEFAULT_GRACE_PERIOD`]).
    pub grace_period: Duration,
}

impl SpawnOptions {
    /// This process's own arguments (without the program), no restarts, the default grace
    /// period.
    pub fn new() -> SpawnOptions {
        SpawnOptions::with_args(std::env::args_os().skip(1).collect())
    }

    /// `args` for every rank, no restarts, the default grace period.
    pub fn with_args(args: Vec<OsString>) -> SpawnOptions {
        SpawnOptions {
            args,
            max_restarts: 0,
            grace_period: DEFAULT_GRACE_PERIOD,
        }
    }
}

impl Default for SpawnOptions {
    fn default() -> SpawnOptions {
        SpawnOptions::new()
    }
}

/// Runs this program (`std::env::current_exe()` with `options.args`) as `nprocs` local ranks
/// of a one-node job and waits for them: ddprun's `--nproc-per-node nprocs` without ddprun.
/// Each rank gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, a free `MASTER_PORT`, ...; see
/// [`crate::rank_env`]) and `DDP_LAUNCHER=spawn`, so `ProcessGroup::from_env()` in it forms the group.
///
/// Returns the ranks' report when all exited 0, else [`crate::launch`]'s error: for a failed
/// rank [`LaunchError::RankFailed`], naming the root cause (print it with
/// [`crate::root_cause_box`]) after the other ranks were stopped. A process that already is a
/// rank (a launcher's variables say so: torchrun's, MPI's, a Slurm step's of several tasks) gets
/// [`LaunchError::AlreadyARank`] and starts nothing; a Slurm batch script or single-task step may
/// spawn (see the module documentation); `nprocs` 0 is [`LaunchError::Zero`].
pub fn spawn(nprocs: usize, options: &SpawnOptions) -> Result<LaunchReport, LaunchError> {
    let group = ddp_comm::GroupConfig::from_env()
        .map_err(|e| LaunchError::Environment(format!("cannot start ranks: {e}")))?;
    let step_id = ddp_comm::elastic::slurm_step_id();
    if group.launcher != "none" && !single_task_slurm_step(&group, step_id.as_deref()) {
        return Err(LaunchError::AlreadyARank {
            rank: group.rank,
            world_size: group.world_size,
            launcher: group.launcher,
            hint: "start it without a launcher to have it start its ranks, or leave the number \
                   of processes to the launcher"
                .to_string(),
        });
    }
    let program = std::env::current_exe().map_err(|source| LaunchError::Spawn {
        rank: 0,
        program: "this program (std::env::current_exe)".to_string(),
        source,
    })?;
    let mut command = vec![program.into_os_string()];
    command.extend(options.args.iter().cloned());
    let mut config = LaunchConfig::new(nprocs, command);
    config.max_restarts = options.max_restarts;
    config.grace_period = options.grace_period;
    config.launcher = "spawn".to_string();
    crate::launch(&config)
}

/// Whether `group` was read from a Slurm step that runs a single task: one task in all, or the
/// batch step (no step number, `step_id` unset or `batch`: the script sbatch runs, whose
/// `SLURM_NTASKS` is the job's).
fn single_task_slurm_step(group: &ddp_comm::GroupConfig, step_id: Option<&str>) -> bool {
    let batch_step = match step_id.map(str::trim) {
        None | Some("batch") => true,
        Some(_) => false,
    };
    group.launcher == "slurm" && (group.world_size == 1 || batch_step)
}
