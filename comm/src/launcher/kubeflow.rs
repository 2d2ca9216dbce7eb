//! Kubeflow's PyTorchJob, for a program its pods start directly (not through torchrun or
//! ddprun).
//!
//! The training operator gives every pod torchrun's options as `PET_*` variables
//! (`PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`:
//! torchrun reads `PET_<OPTION>` as the default of its `--<option>`, and so does ddprun), and,
//! with a Master replica, `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE` (pods × processes per pod)
//! and `RANK` (the pod's index). A program started directly is one process per pod, so:
//!
//! - with `RANK` and `WORLD_SIZE` but no `LOCAL_WORLD_SIZE` (which torchrun and ddprun always
//!   set), `PET_NPROC_PER_NODE` says how many processes the job counts per pod: 1 (or torchrun's
//!   words `auto`, `cpu`, `gpu`, which Kubeflow counts as 1) makes this process the pod's only
//!   rank (local world 1); more is an error, since `WORLD_SIZE` then counts processes nobody
//!   starts ([`direct_local_world`]);
//! - with no launcher's rank variables at all, `PET_*` describing more than one process is an
//!   error instead of a silent rank 0 of 1 ([`check_single_process`]).

use crate::error::CommError;

/// How variables are read (the process environment or a test's map).
type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// A variable, trimmed, when set and not empty.
fn get(env: Vars, var: &str) -> Option<String> {
    env(var)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Whether `PET_NNODES` (`N` or torchrun's elastic `MIN:MAX`) means exactly one node.
fn one_node(raw: &str) -> bool {
    match raw.split_once(':') {
        Some((min, max)) => min.trim() == "1" && max.trim() == "1",
        None => raw.parse::<usize>() == Ok(1),
    }
}

/// No launcher's rank variables are set, so this process would be rank 0 of 1: an error naming
/// the variable when Kubeflow's `PET_NNODES` or `PET_NPROC_PER_NODE` describe a job of several
/// processes (the program should have been started through ddprun or torchrun, which read
/// them).
pub(crate) fn check_single_process(env: Vars) -> Result<(), CommError> {
    let many = |var: &str| -> Option<String> {
        let raw = get(env, var)?;
        let several = match var {
            "PET_NNODES" => !one_node(&raw),
            _ => matches!(raw.parse::<usize>(), Ok(n) if n > 1),
        };
        several.then_some(raw)
    };
    for var in ["PET_NNODES", "PET_NPROC_PER_NODE"] {
        if let Some(raw) = many(var) {
            return Err(CommError::config(
                var,
                format!(
                    "{var}={raw:?} (a Kubeflow PyTorchJob's option for torchrun) describes a job \
                     of several processes, but no launcher started this one (none of RANK, \
                     WORLD_SIZE, MPI's or Slurm's variables is set), so it would train alone as \
                     rank 0 of 1: start it through ddprun, which takes PET_NNODES, \
                     PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT as \
                     the defaults of its options as torchrun does (`ddprun -- my-trainer`), or \
                     through torchrun"
                ),
            ));
        }
    }
    Ok(())
}

/// The local world size of a process that has torchrun's `RANK` and `WORLD_SIZE` but no
/// `LOCAL_WORLD_SIZE` (so no torchrun or ddprun started it), from Kubeflow's
/// `PET_NPROC_PER_NODE`: `None` when that is unset, 1 when it counts one process per pod, and an
/// error naming it when it counts several (`world` is `WORLD_SIZE`, for the message).
pub(crate) fn direct_local_world(env: Vars, world: usize) -> Result<Option<usize>, CommError> {
    let Some(raw) = get(env, "PET_NPROC_PER_NODE") else {
        return Ok(None);
    };
    match raw.parse::<usize>() {
        Ok(n) if n > 1 => Err(CommError::config(
            "PET_NPROC_PER_NODE",
            format!(
                "PET_NPROC_PER_NODE={n}: the Kubeflow PyTorchJob counts {n} processes per pod in \
                 WORLD_SIZE={world}, but this process was started directly (RANK and WORLD_SIZE \
                 are set, LOCAL_WORLD_SIZE is not, so neither torchrun nor ddprun started it) and \
                 is its pod's only one: start the pods' command through ddprun (`ddprun -- \
                 my-trainer`, which reads PET_NPROC_PER_NODE and the other PET_* variables as \
                 torchrun does), or set the job's nprocPerNode to 1"
            ),
        )),
        // 1, or torchrun's words (auto, cpu, gpu), which Kubeflow counts as one process.
        _ => Ok(Some(1)),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use crate::config::GroupConfig;
    use crate::error::CommError;

    fn from(pairs: &[(&str, &str)]) -> Result<GroupConfig, CommError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        GroupConfig::from_vars(move |k: &str| map.get(k).cloned())
    }

    fn err_var(e: CommError) -> String {
        match e {
            CommError::Config { var, .. } => var,
            other => panic!("expected a config error, got {other}"),
        }
    }

    /// The pod of a PyTorchJob with a Master replica and nprocPerNode 1, started directly:
    /// torchrun's variables (RANK is the pod's index), and the pod is its own local world.
    #[test]
    fn a_direct_start_with_one_process_per_pod_is_the_pod_s_rank() {
        let c = from(&[
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
            ("WORLD_SIZE", "3"),
            ("RANK", "2"),
            ("PET_NNODES", "3"),
            ("PET_NPROC_PER_NODE", "1"),
            ("PET_NODE_RANK", "2"),
            ("PET_MASTER_ADDR", "job-master-0"),
            ("PET_MASTER_PORT", "23456"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (2, 3, 0, 1)
        );
        assert_eq!(
            (c.master_addr.as_str(), c.master_port, c.launcher.as_str()),
            ("job-master-0", 23456, "torchrun")
        );
        // nprocPerNode "auto" (Kubeflow's default) counts as one process per pod too.
        let c = from(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("PET_NPROC_PER_NODE", "auto"),
        ])
        .unwrap();
        assert_eq!((c.local_rank, c.local_world_size), (0, 1));
    }

    /// nprocPerNode 2, started directly: WORLD_SIZE counts processes nobody starts.
    #[test]
    fn a_direct_start_in_a_pod_meant_for_several_processes_is_refused() {
        let e = from(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "1"),
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "1"),
        ])
        .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ddprun") && msg.contains("WORLD_SIZE=4"),
            "{msg}"
        );
        assert_eq!(err_var(e), "PET_NPROC_PER_NODE");
    }

    /// Under torchrun or ddprun (LOCAL_WORLD_SIZE set) the PET_* variables the ranks inherit
    /// change nothing.
    #[test]
    fn the_ranks_of_a_launcher_in_the_pod_ignore_pet_variables() {
        let c = from(&[
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "2"),
        ])
        .unwrap();
        assert_eq!(
            (c.rank, c.world_size, c.local_rank, c.local_world_size),
            (3, 4, 1, 2)
        );
    }

    /// Only PET_* (torchrun's options, an elastic job's pods): not a silent rank 0 of 1.
    #[test]
    fn pet_variables_alone_are_not_a_single_process() {
        for (pairs, var) in [
            (
                vec![("PET_NNODES", "2"), ("PET_NPROC_PER_NODE", "1")],
                "PET_NNODES",
            ),
            (vec![("PET_NNODES", "1:4")], "PET_NNODES"),
            (vec![("PET_NPROC_PER_NODE", "2")], "PET_NPROC_PER_NODE"),
            (
                vec![("PET_NNODES", "1"), ("PET_NPROC_PER_NODE", "4")],
                "PET_NPROC_PER_NODE",
            ),
        ] {
            let e = from(&pairs).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("ddprun") && msg.contains("rank 0 of 1"),
                "{msg}"
            );
            assert_eq!(err_var(e), var, "{pairs:?}");
        }
        // A job of one process is exactly what a plain start is.
        for pairs in [
            vec![("PET_NNODES", "1"), ("PET_NPROC_PER_NODE", "1")],
            vec![("PET_NNODES", "1:1"), ("PET_NPROC_PER_NODE", "auto")],
            vec![("PET_MASTER_ADDR", "x"), ("PET_NODE_RANK", "0")],
        ] {
            let c = from(&pairs).unwrap();
            assert_eq!((c.rank, c.world_size, c.launcher.as_str()), (0, 1, "none"));
        }
    }
}
