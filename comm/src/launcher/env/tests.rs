//! Unit tests of `env.rs`: each launcher's variables, the rank 0 address and port, invalid values.

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

/// Under torchrun's variables the launcher is `torchrun` unless it names itself in
/// `DDP_LAUNCHER` (ddprun, spawn); a name that is no short word is an error naming the variable;
/// the variable means nothing under another launcher.
#[test]
fn a_launcher_names_itself_in_ddp_launcher() {
    let torch = [("RANK", "0"), ("WORLD_SIZE", "2")];
    let with = |base: &[(&str, &str)], name: Option<&str>| {
        let mut all = base.to_vec();
        all.extend(name.map(|n| ("DDP_LAUNCHER", n)));
        GroupConfig::from_vars(vars(&all))
    };
    assert_eq!(with(&torch, None).unwrap().launcher, "torchrun");
    assert_eq!(with(&torch, Some("")).unwrap().launcher, "torchrun");
    assert_eq!(with(&torch, Some("ddprun")).unwrap().launcher, "ddprun");
    assert_eq!(with(&torch, Some("spawn")).unwrap().launcher, "spawn");
    for bad in ["two words", "x\n", &"y".repeat(33)] {
        let e = with(&torch, Some(bad)).unwrap_err();
        assert_eq!(err_var(e), "DDP_LAUNCHER", "{bad:?}");
    }
    let slurm = [
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("MASTER_ADDR", "a"),
    ];
    assert_eq!(with(&slurm, Some("ddprun")).unwrap().launcher, "slurm");
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
    // An explicit value overrides the environment.
    let given = Explicit {
        torch_agent_store: Some(5),
        ..Explicit::default()
    };
    let c = resolve(&given, &vars(&[("TORCHELASTIC_USE_AGENT_STORE", "x")])).unwrap();
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
fn open_mpi_variables() {
    let c = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("PMIX_NAMESPACE", "prterun-host-1234@1"),
    ]))
    .unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (3, 4, 1, 2)
    );
    assert_eq!(
        (c.master_addr.as_str(), c.launcher.as_str()),
        ("node0", "open-mpi")
    );
    // The port: from the job's name, the same for every rank, in the jobs' range.
    let again = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("PMIX_NAMESPACE", "prterun-host-1234@1"),
    ]))
    .unwrap();
    assert_eq!(c.master_port, again.master_port);
    assert!((20000..30000).contains(&c.master_port), "{}", c.master_port);
    // One host, no MASTER_ADDR: this host.
    let local = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!(
        (local.master_addr.as_str(), local.master_port),
        ("127.0.0.1", 29500)
    );
    // Several hosts and nothing that says where rank 0 is: an error asking for MASTER_ADDR.
    let e = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("mpirun -x MASTER_ADDR"), "{e}");
    assert_eq!(err_var(e), "MASTER_ADDR");
}

#[test]
fn mpich_variables_and_mpi_inside_slurm() {
    let c = GroupConfig::from_vars(vars(&[
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "3"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "1"),
        // An mpiexec inside a Slurm batch script: the batch step's variables are there too
        // (SLURM_PROCID 0 in every rank) and must not win.
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_JOB_NODELIST", "n[3-5]"),
        ("SLURM_JOB_ID", "77"),
    ]))
    .unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (2, 3, 0, 1)
    );
    assert_eq!(c.launcher, "mpich");
    assert_eq!((c.master_addr.as_str(), c.master_port), ("n3", 20077));
    let e = GroupConfig::from_vars(vars(&[("PMI_RANK", "3"), ("PMI_SIZE", "3")])).unwrap_err();
    assert_eq!(err_var(e), "PMI_RANK");
}

/// `srun --mpi=pmi2` (or Slurm's `MpiDefault=pmi2`) sets PMI_RANK and PMI_SIZE but not MPICH's
/// local variables: the local rank and size come from the step's Slurm variables, and without
/// any the ranks are refused rather than each taking the host for its own.
#[test]
fn srun_pmi2_takes_the_local_ranks_from_slurm() {
    // srun --mpi=pmi2 -N 2 -n 4: rank 3 is the second task on the second node.
    let step = [
        ("PMI_RANK", "3"),
        ("PMI_SIZE", "4"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ("SLURM_JOB_NODELIST", "gpu[1-2]"),
        ("SLURM_JOB_ID", "5"),
    ];
    let c = GroupConfig::from_vars(vars(&step)).unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.local_rank, c.local_world_size),
        (3, 4, 1, 2)
    );
    assert_eq!(c.launcher, "mpich");
    assert_eq!((c.master_addr.as_str(), c.master_port), ("gpu1", 20005));
    // MPICH's own local variables win where they are set.
    let mut with_mpich = step.to_vec();
    with_mpich.extend([("MPI_LOCALRANKID", "0"), ("MPI_LOCALNRANKS", "1")]);
    let c = GroupConfig::from_vars(vars(&with_mpich)).unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (0, 1));
    // Nothing says how many ranks share the host: refused, naming the variables.
    let refused = |pairs: &[(&str, &str)]| {
        let e = GroupConfig::from_vars(vars(pairs)).unwrap_err();
        let msg = e.to_string();
        for var in ["MPI_LOCALNRANKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"] {
            assert!(msg.contains(var), "{var} not named: {msg}");
        }
        assert_eq!(err_var(e), "MPI_LOCALNRANKS");
    };
    refused(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]);
    // A Slurm step's variables that describe other tasks (an mpiexec inside a batch script of
    // one task) are not taken for this rank's.
    refused(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "1"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_TASKS_PER_NODE", "1"),
    ]);
    // One rank needs no local variables.
    let c = GroupConfig::from_vars(vars(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")])).unwrap();
    assert_eq!((c.local_rank, c.local_world_size), (0, 1));
}

#[test]
fn a_pbs_job_gives_rank_0_s_host_and_the_port() {
    let file = std::env::temp_dir().join(format!("ddp-nodefile-{}", std::process::id()));
    std::fs::write(&file, "\ncn07\ncn07\ncn08\n").unwrap();
    let path = file.to_string_lossy().into_owned();
    let c = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "3"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
        ("PBS_NODEFILE", &path),
        ("PBS_JOBID", "4321.pbs-server"),
    ]));
    std::fs::remove_file(&file).unwrap();
    let c = c.unwrap();
    assert_eq!((c.master_addr.as_str(), c.master_port), ("cn07", 24321));
    let e = GroupConfig::from_vars(vars(&[
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "1"),
        ("PBS_NODEFILE", "/nonexistent/ddp-nodefile"),
    ]))
    .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/ddp-nodefile"), "{e}");
    assert_eq!(err_var(e), "PBS_NODEFILE");
}

/// A PBS job without a node file (`PBS_JOBID` alone), and Slurm's `qsub` wrapper (a PBS script
/// run as a Slurm batch job: no `PBS_*` at all, as `ci/slurm.sh` found, only the batch step's
/// Slurm variables around the `mpirun`).
#[test]
fn a_pbs_job_needs_no_node_file() {
    let c = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PBS_JOBID", "88.headnode"),
    ]))
    .unwrap();
    assert_eq!(
        (c.master_addr.as_str(), c.master_port),
        ("127.0.0.1", 20088)
    );
    // A job id with no leading number (some servers): hashed, still in the jobs' range.
    let c = GroupConfig::from_vars(vars(&[
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "2"),
        ("MPI_LOCALRANKID", "0"),
        ("MPI_LOCALNRANKS", "2"),
        ("PBS_JOBID", "job-x"),
    ]))
    .unwrap();
    assert!((20000..30000).contains(&c.master_port), "{}", c.master_port);
    let c = GroupConfig::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMIX_NAMESPACE", "1003880449"),
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "vm"),
        ("SLURM_JOB_ID", "3"),
    ]))
    .unwrap();
    assert_eq!(
        (c.rank, c.world_size, c.launcher.as_str()),
        (1, 2, "open-mpi")
    );
    assert_eq!((c.master_addr.as_str(), c.master_port), ("vm", 20003));
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
    let given = Explicit {
        rank: Some(2),
        world_size: Some(2),
        ..Explicit::default()
    };
    let err = resolve(&given, &vars(&[])).unwrap_err();
    assert_eq!(err_var(err), "rank");
}
