//! `ddp_launch::spawn` (PyTorch's `mp.spawn`) with real processes: this test binary spawns
//! itself as the ranks. Its `main` (no libtest harness) tells the two apart by the first
//! argument: `--spawn-test-rank DIR FAIL` makes it a rank, which writes the variables it got to
//! `DIR/rank<R>.txt` and then exits 3 when it is rank FAIL, sleeps 30 s when another rank is to
//! fail (so that only being stopped ends it early), or exits 0.
//!
//! A watchdog ends the whole test (and with it the ranks: `PR_SET_PDEATHSIG`) past `DEADLINE`,
//! so a hang fails instead of stalling the suite.

use std::path::Path;
use std::time::{Duration, Instant};

use ddp_launch::{spawn, LaunchError, SpawnOptions};

/// The longest the whole test may take.
const DEADLINE: Duration = Duration::from_secs(120);

/// A run that ends well before this stopped its ranks rather than letting them sleep 30 s.
const STOPPED_EARLY: Duration = Duration::from_secs(20);

const RANK_FLAG: &str = "--spawn-test-rank";

/// Variables a rank records.
const VARS: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(RANK_FLAG) {
        rank(Path::new(&args[2]), &args[3]);
        return;
    }
    if args.iter().any(|a| a == "--list") {
        return; // libtest's listing: nothing to list without libtest
    }
    // Launcher variables this test may have inherited would make it a rank already.
    for var in [
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
        "SLURM_STEPID",
    ] {
        std::env::remove_var(var);
    }
    std::thread::spawn(|| {
        std::thread::sleep(DEADLINE);
        eprintln!("spawn test: past its {DEADLINE:?} deadline");
        std::process::exit(1);
    });
    two_ranks_get_torchrun_s_variables();
    a_failing_rank_is_named_and_the_other_stopped();
    a_rank_cannot_spawn();
    a_slurm_batch_script_can_spawn_a_task_of_a_step_cannot();
    println!("spawn test: 4 passed");
}

/// A rank: records its variables, then ends as asked.
fn rank(dir: &Path, fail: &str) {
    let rank = std::env::var("RANK").expect("RANK");
    let text: Vec<String> = VARS
        .iter()
        .map(|v| format!("{v}={}", std::env::var(v).unwrap_or_default()))
        .collect();
    std::fs::write(dir.join(format!("rank{rank}.txt")), text.join("\n")).unwrap();
    if fail == rank {
        eprintln!("rank {rank}: failing on purpose");
        std::process::exit(3);
    }
    if fail != "none" {
        std::thread::sleep(Duration::from_secs(30));
    }
}

fn options(dir: &Path, fail: &str) -> SpawnOptions {
    let mut options = SpawnOptions::with_args(vec![
        RANK_FLAG.into(),
        dir.as_os_str().to_owned(),
        fail.into(),
    ]);
    options.grace_period = Duration::from_millis(500);
    options
}

fn recorded(dir: &Path, rank: usize) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(dir.join(format!("rank{rank}.txt")))
        .unwrap_or_else(|e| panic!("rank {rank} left no record: {e}"));
    text.lines()
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn two_ranks_get_torchrun_s_variables() {
    let dir = tempfile::tempdir().unwrap();
    let report = spawn(2, &options(dir.path(), "none")).expect("both ranks succeed");
    assert_eq!(report.exits.len(), 2);
    assert!(report.exits.iter().all(|e| e.success()), "{report:?}");
    let port = recorded(dir.path(), 0)[5].1.clone();
    assert!(
        port.parse::<u16>().is_ok_and(|p| p > 0),
        "MASTER_PORT={port}"
    );
    for rank in 0..2 {
        let want = [
            rank.to_string(),
            "2".into(),
            rank.to_string(),
            "2".into(),
            "127.0.0.1".into(),
            port.clone(),
        ];
        let got = recorded(dir.path(), rank);
        for ((var, value), want) in got.iter().zip(want) {
            assert_eq!(value, &want, "rank {rank}: {var}");
        }
    }
    println!("spawn test: two ranks got their variables (MASTER_PORT={port})");
}

fn a_failing_rank_is_named_and_the_other_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let error = spawn(2, &options(dir.path(), "1")).expect_err("rank 1 fails");
    let elapsed = started.elapsed();
    let LaunchError::RankFailed(failure) = &error else {
        panic!("expected RankFailed, got {error}");
    };
    assert_eq!((failure.rank, failure.culprit()), (1, 1), "{error}");
    assert_eq!(failure.exit.shell_code(), 3, "{error}");
    assert!(error.to_string().contains("rank 1"), "{error}");
    assert!(
        elapsed < STOPPED_EARLY,
        "rank 0 was not stopped: the spawn took {elapsed:?}"
    );
    let the_box = ddp_launch::root_cause_box(&error).expect("a root-cause box");
    assert!(the_box.contains("rank 1"), "{the_box}");
    println!("spawn test: rank 1's failure named ({error}), rank 0 stopped after {elapsed:?}");
}

fn a_rank_cannot_spawn() {
    let dir = tempfile::tempdir().unwrap();
    std::env::set_var("RANK", "1");
    std::env::set_var("WORLD_SIZE", "2");
    let result = spawn(2, &options(dir.path(), "none"));
    std::env::remove_var("RANK");
    std::env::remove_var("WORLD_SIZE");
    match result {
        Err(error @ LaunchError::AlreadyARank { .. }) => {
            assert!(error.to_string().contains("rank 1 of 2"), "{error}");
            assert_eq!(error.exit_code(), 2);
        }
        other => panic!("expected AlreadyARank, got {other:?}"),
    }
    assert!(
        !dir.path().join("rank0.txt").exists(),
        "no rank was started"
    );
    println!("spawn test: a rank is refused");
}

/// Runs `f` with `vars` set in this process's environment, then removes them.
fn with_env<T>(vars: &[(&str, &str)], f: impl FnOnce() -> T) -> T {
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let result = f();
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    result
}

/// Inside an sbatch script the batch step's SLURM_PROCID and SLURM_NTASKS are set although no
/// rank exists yet (as PyTorch's mp.spawn allows): the batch step of a job of several tasks (no
/// step number: Slurm 22.05 sets none there; or one named `batch`), or a step of one task, may
/// spawn; a task of a step of several (srun -n 2, which sets the step's number) may not.
fn a_slurm_batch_script_can_spawn_a_task_of_a_step_cannot() {
    let job = [
        ("SLURM_JOB_ID", "77"),
        ("SLURM_JOB_NODELIST", "localhost"),
        ("SLURM_NODEID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_PROCID", "0"),
    ];
    for (step, ntasks) in [(None, "4"), (Some("batch"), "4"), (Some("0"), "1")] {
        let dir = tempfile::tempdir().unwrap();
        let mut vars = job.to_vec();
        vars.extend([("SLURM_NTASKS", ntasks), ("SLURM_TASKS_PER_NODE", ntasks)]);
        if let Some(step) = step {
            vars.push(("SLURM_STEP_ID", step));
        }
        let report = with_env(&vars, || spawn(2, &options(dir.path(), "none")))
            .unwrap_or_else(|e| panic!("step {step:?} of {ntasks} tasks: {e}"));
        assert_eq!(report.exits.len(), 2);
        for rank in 0..2 {
            let got = recorded(dir.path(), rank);
            assert_eq!(got[0].1, rank.to_string(), "step {step:?}: RANK");
            assert_eq!(got[1].1, "2", "step {step:?}: WORLD_SIZE");
        }
    }
    // A task of `srun -n 2`: a rank already.
    let dir = tempfile::tempdir().unwrap();
    let mut vars = job.to_vec();
    vars.extend([
        ("SLURM_STEP_ID", "0"),
        ("SLURM_STEPID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_TASKS_PER_NODE", "2"),
    ]);
    vars.retain(|(k, _)| *k != "SLURM_PROCID" && *k != "SLURM_LOCALID");
    vars.extend([("SLURM_PROCID", "1"), ("SLURM_LOCALID", "1")]);
    match with_env(&vars, || spawn(2, &options(dir.path(), "none"))) {
        Err(error @ LaunchError::AlreadyARank { .. }) => {
            let msg = error.to_string();
            assert!(
                msg.contains("rank 1 of 2") && msg.contains("slurm"),
                "{msg}"
            );
        }
        other => panic!("expected AlreadyARank, got {other:?}"),
    }
    assert!(
        !dir.path().join("rank0.txt").exists(),
        "no rank was started"
    );
    println!("spawn test: a Slurm batch script spawns, a task of a step does not");
}
