//! End-to-end: the trainers as real processes under `ddprun`, on the real MNIST files (see
//! `mnist::real_mnist`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod common;
mod mnist;
mod trainer;

use common::text;
use trainer::summary;

/// The longest one trainer run in these tests may take on a loaded 2-core machine (a deadline
/// against hangs, not a speed check: speed is measured by the benches).
const DEADLINE: Duration = Duration::from_secs(900);

/// Runs `command` under guard (killed past [`DEADLINE`] or if the test panics).
fn run(command: &mut Command) -> Output {
    common::output_with_deadline(command, DEADLINE)
}

use serde_json::Value;

fn mnist_dir() -> PathBuf {
    mnist::real_mnist()
}

/// Runs `train-mnist ARGS` on `nproc` ranks through ddprun.
fn ddprun_mnist(nproc: usize, args: &[&str]) -> Output {
    run(Command::new(common::workspace_bin("ddprun"))
        .args(["--nproc-per-node", &nproc.to_string(), "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(args))
}

/// The run of [`two_ranks_learn_mnist`] also checks observability (issue 14): TensorBoard
/// curves every `--log-interval` steps, Chrome traces of `--trace-steps` on every rank, and log
/// lines (`RUST_LOG=info`) without ANSI escapes, stdout and stderr being pipes.
#[test]
fn two_ranks_learn_mnist() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics");
    let weights = dir.path().join("model.safetensors");
    let traces = dir.path().join("traces");
    let out = run(Command::new(common::workspace_bin("ddprun"))
        .args(["--nproc-per-node", "2", "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(["--max-steps", "60", "--test-samples", "1000"])
        .args(["--log-interval", "10", "--trace-steps", "3..6"])
        .arg("--metrics-dir")
        .arg(&metrics)
        .arg("--export")
        .arg(&weights)
        .arg("--trace-dir")
        .arg(&traces)
        .env("RUST_LOG", "info"));
    let s = summary(&out);
    // Log lines came through the pipes, without colour escapes.
    let all = text(&out);
    assert!(
        all.contains("training cnn: world 2 (launcher: ddprun;"),
        "ddprun's ranks name it:\n{all}"
    );
    assert!(
        all.contains("joined the process group"),
        "no log line in:\n{all}"
    );
    for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        if let Some(at) = bytes.iter().position(|&b| b == 0x1b) {
            let context =
                String::from_utf8_lossy(&bytes[at.saturating_sub(80)..(at + 20).min(bytes.len())]);
            panic!("an escape byte in piped {name}: {context:?}");
        }
    }
    check_traces(&traces, 2, 3..6);
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["steps"], 60);
    // Every test sample counted once across the two ranks.
    assert_eq!(s["test_total"], 1000);
    let accuracy = s["test_accuracy"].as_f64().unwrap();
    assert!(
        accuracy > 0.80,
        "accuracy {accuracy} after 60 steps:\n{}",
        text(&out)
    );
    // Rank 0 wrote the metrics and the weights; the event file holds the accuracy.
    let csv = std::fs::read_to_string(metrics.join("metrics.csv")).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    let events = std::fs::read_dir(&metrics)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .expect("event file");
    let scalars = ddp_apps::metrics::read_scalars(&events).unwrap();
    assert!(scalars.iter().any(|(tag, step, v)| tag == "test/accuracy"
        && *step == 60
        && (*v as f64 - accuracy).abs() < 1e-6));
    // Training curves every 10 steps: 60 / 10 points of each, at steps 10, 20, ..., 60.
    for tag in [
        "train/loss",
        "train/learning_rate",
        "train/samples_per_sec",
        "train/comm_seconds",
        "train/comm_fraction",
    ] {
        let steps: Vec<i64> = scalars
            .iter()
            .filter(|(t, _, v)| t == tag && v.is_finite())
            .map(|(_, step, _)| *step)
            .collect();
        assert_eq!(steps, [10, 20, 30, 40, 50, 60], "{tag}");
    }
    let losses: Vec<f32> = scalars
        .iter()
        .filter(|(t, _, _)| t == "train/loss")
        .map(|(_, _, v)| *v)
        .collect();
    assert!(
        losses[5] < losses[0],
        "the loss curve does not fall: {losses:?}"
    );
    assert!(std::fs::metadata(&weights).unwrap().len() > 4 * 1_199_882);
}

/// Checks the Chrome traces of `world` ranks in `dir` for the steps `steps`: valid JSON, every
/// kind of span on every rank and step, all-reduces on the communication track within the step
/// that issued them, and the ranks' clocks lined up (each all-reduce overlaps the other ranks').
fn check_traces(dir: &Path, world: usize, steps: std::ops::Range<u64>) {
    // Spans from the process group's flight recorder carry whole wall-clock microseconds, the
    // loop's come from the monotonic clock anchored to the wall clock once: allow a little.
    const SLACK_US: f64 = 500.0;
    let mut reduces: Vec<Vec<(u64, u64, f64, f64)>> = Vec::new(); // (step, bucket, start, end)
    for rank in 0..world {
        let path = dir.join(format!("trace-rank{rank}.json"));
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let trace: Value = serde_json::from_slice(&bytes).expect("a trace is JSON");
        let spans: Vec<&Value> = trace["traceEvents"]
            .as_array()
            .expect("traceEvents")
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert!(spans.iter().all(|e| e["pid"] == rank as u64), "rank {rank}");
        let span = |e: &Value| {
            let ts = e["ts"].as_f64().unwrap();
            (ts, ts + e["dur"].as_f64().unwrap())
        };
        let step_of = |e: &Value| e["args"]["step"].as_u64().expect("a step argument");
        for step in steps.clone() {
            let of_step: Vec<&&Value> = spans.iter().filter(|e| step_of(e) == step).collect();
            for kind in [
                "step",
                "data",
                "forward",
                "backward",
                "pack",
                "all_reduce",
                "unpack",
                "optimizer",
            ] {
                assert!(
                    of_step.iter().any(|e| e["name"] == kind),
                    "rank {rank} step {step}: no `{kind}` span"
                );
            }
            let (start, end) = span(of_step.iter().find(|e| e["name"] == "step").unwrap());
            for e in &of_step {
                let on_comm = e["name"] == "all_reduce";
                assert_eq!(e["tid"], if on_comm { 2 } else { 1 }, "{e}");
                let (s, t) = span(e);
                assert!(
                    s >= start - SLACK_US && t <= end + SLACK_US,
                    "rank {rank}: {e} lies outside its step ({start}..{end})"
                );
            }
        }
        let traced: std::collections::BTreeSet<u64> = spans.iter().map(|e| step_of(e)).collect();
        assert_eq!(traced, steps.clone().collect(), "rank {rank}: traced steps");
        reduces.push(
            spans
                .iter()
                .filter(|e| e["name"] == "all_reduce")
                .map(|e| {
                    let (s, t) = span(e);
                    (step_of(e), e["args"]["bucket"].as_u64().unwrap(), s, t)
                })
                .collect(),
        );
    }
    // A collective needs every rank: on one clock, rank r's all-reduce overlaps rank 0's.
    for (rank, theirs) in reduces.iter().enumerate().skip(1) {
        assert_eq!(theirs.len(), reduces[0].len(), "rank {rank}: all-reduces");
        for (a, b) in reduces[0].iter().zip(theirs) {
            assert_eq!((a.0, a.1), (b.0, b.1));
            assert!(
                a.2 <= b.3 + SLACK_US && b.2 <= a.3 + SLACK_US,
                "step {} bucket {}: rank 0's all-reduce {:?} and rank {rank}'s {:?} do not \
                 overlap: the ranks' clocks disagree",
                a.0,
                a.1,
                (a.2, a.3),
                (b.2, b.3)
            );
        }
    }
}

#[test]
fn resume_ends_where_an_uninterrupted_run_ends() {
    let common = [
        "--model",
        "mlp",
        "--train-samples",
        "3000",
        "--test-samples",
        "500",
        "--batch-size",
        "50",
    ];
    let whole = summary(&ddprun_mnist(
        2,
        &[&common[..], &["--epochs", "2"]].concat(),
    ));

    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().to_str().unwrap();
    let first = summary(&ddprun_mnist(
        2,
        &[&common[..], &["--epochs", "1", "--checkpoint-dir", ck]].concat(),
    ));
    assert_eq!(first["epochs"], 1);
    // A crash while writing the next checkpoint leaves a partial temporary file behind.
    std::fs::write(
        dir.path().join("checkpoint.ddpck.4242.tmp"),
        b"DDPCKPT1\x10\x00\x00\x00{\"epoch\": 2",
    )
    .unwrap();
    let resumed = summary(&ddprun_mnist(
        2,
        &[
            &common[..],
            &["--epochs", "2", "--checkpoint-dir", ck, "--resume"],
        ]
        .concat(),
    ));
    assert_eq!(resumed["epochs"], 2);
    assert_eq!(resumed["steps"], whole["steps"]);
    assert_eq!(
        resumed["params_hash"], whole["params_hash"],
        "resumed run ended with different weights"
    );
    assert_ne!(first["params_hash"], whole["params_hash"]);
}

/// Issue 40: a `--comm-hook powersgd` run resumed from its epoch checkpoint ends bit-identical
/// to an uninterrupted one (every rank's PowerSGD state, error feedback and Q, is in the
/// checkpoint), and PowerSGD is really on (plain DDP ends elsewhere).
#[test]
fn a_resumed_powersgd_run_ends_bit_identical() {
    let common = [
        "--model",
        "mlp",
        "--train-samples",
        "2000",
        "--test-samples",
        "200",
        "--batch-size",
        "50",
    ];
    let hook = [
        "--comm-hook",
        "powersgd",
        "--powersgd-rank",
        "2",
        "--powersgd-start",
        "5",
    ];
    let flags = [&common[..], &hook[..]].concat();
    let whole = summary(&ddprun_mnist(2, &[&flags[..], &["--epochs", "2"]].concat()));
    let plain = summary(&ddprun_mnist(
        2,
        &[&common[..], &["--epochs", "2"]].concat(),
    ));
    assert_ne!(whole["params_hash"], plain["params_hash"]);

    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().to_str().unwrap();
    let first = summary(&ddprun_mnist(
        2,
        &[&flags[..], &["--epochs", "1", "--checkpoint-dir", ck]].concat(),
    ));
    assert_eq!(first["epochs"], 1);
    let resumed = summary(&ddprun_mnist(
        2,
        &[
            &flags[..],
            &["--epochs", "2", "--checkpoint-dir", ck, "--resume"],
        ]
        .concat(),
    ));
    assert_eq!(resumed["steps"], whole["steps"]);
    assert_eq!(
        resumed["params_hash"], whole["params_hash"],
        "the resumed PowerSGD run ended with different weights"
    );
}

#[test]
fn a_corrupt_checkpoint_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("checkpoint.ddpck");
    std::fs::write(&ck, b"DDPCKPT1\x02\x00\x00\x00{}garbage").unwrap();
    let out = ddprun_mnist(
        2,
        &[
            "--model",
            "mlp",
            "--train-samples",
            "200",
            "--checkpoint-dir",
            dir.path().to_str().unwrap(),
            "--resume",
        ],
    );
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains("checkpoint.ddpck"), "{all}");
}

#[test]
fn config_file_values_apply_and_flags_override_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(&config, "model-is-not-a-key = 1\n").unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_train-mnist"))
        .args(["--config", config.to_str().unwrap()]));
    assert!(!out.status.success());
    assert!(text(&out).contains("run.toml"), "{}", text(&out));

    std::fs::write(
        &config,
        "epochs = 1\nbatch-size = 100\ntrain-samples = 400\ntest-samples = 100\nmax-steps = 3\n",
    )
    .unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_train-mnist"))
        .args(["--model", "mlp", "--config", config.to_str().unwrap()])
        .args(["--max-steps", "2", "--json", "--data-dir"])
        .arg(mnist_dir()));
    let s = summary(&out);
    assert_eq!(s["steps"], 2, "the flag overrides the file's max-steps");
    assert_eq!(s["test_total"], 100, "the file's test-samples applies");
    assert_eq!(s["world_size"], 1);
}

#[test]
fn a_corrupt_data_file_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "train-images-idx3-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ] {
        let from = mnist::file(&mnist_dir(), name);
        std::fs::copy(&from, dir.path().join(from.file_name().unwrap())).unwrap();
    }
    // A labels file cut short, as an interrupted copy would leave it (raw or .gz, as found).
    let labels = mnist::file(&mnist_dir(), "train-labels-idx1-ubyte");
    let bytes = std::fs::read(&labels).unwrap();
    std::fs::write(
        dir.path().join(labels.file_name().unwrap()),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(dir.path()));
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains("train-labels-idx1-ubyte"), "{all}");
}

/// `--fetch-data` (used by job scripts before `srun`) resolves the same folder the trainer
/// reads, `$DDP_DATA_DIR/mnist` here, prints it and exits without forming a group.
#[test]
fn fetch_data_prints_the_folder_the_trainer_reads() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("mnist");
    std::fs::create_dir(&dir).unwrap();
    for name in [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ] {
        let from = mnist::file(&mnist_dir(), name);
        std::fs::copy(&from, dir.join(from.file_name().unwrap())).unwrap();
    }
    let out = run(Command::new(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--fetch-data")
        .env("DDP_DATA_DIR", root.path())
        .env_remove("WORLD_SIZE")
        .env_remove("RANK"));
    assert!(out.status.success(), "{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert_eq!(Path::new(printed.trim()), dir, "{}", text(&out));
}

/// The CNN (it has dropout, so the masks of the replayed steps matter) on a small subset: 20
/// steps per epoch on 2 ranks, 40 on one.
const SMALL_CNN: [&str; 8] = [
    "--train-samples",
    "640",
    "--test-samples",
    "200",
    "--batch-size",
    "16",
    "--epochs",
    "1",
];

/// `train-mnist ARGS` as one process (world size 1), without any launcher variables.
fn mnist_alone(args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(args);
    common::clear_launcher_env(&mut command);
    command
}

/// Issue 13 item 3: rank 1 kills itself (SIGKILL, the test hook) after step 7 under
/// `ddprun --max-restarts 1`; ddprun restarts both ranks once, they resume from the mid-epoch
/// checkpoint of step 5 on their own, and the job ends with exit 0 and the very weights of an
/// uninterrupted run.
#[test]
fn a_killed_rank_is_restarted_and_resumes_from_the_mid_epoch_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let whole_weights = dir.path().join("whole.safetensors");
    let whole = summary(&ddprun_mnist(
        2,
        &[
            &SMALL_CNN[..],
            &["--export", whole_weights.to_str().unwrap()],
        ]
        .concat(),
    ));

    let ck = dir.path().join("ck");
    let weights = dir.path().join("restarted.safetensors");
    let out = run(Command::new(common::workspace_bin("ddprun"))
        .args(["--nproc-per-node", "2", "--max-restarts", "1", "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(SMALL_CNN)
        .args(["--checkpoint-every", "5", "--checkpoint-dir"])
        .arg(&ck)
        .arg("--export")
        .arg(&weights)
        .env("DDP_TEST_KILL_AT_STEP", "7")
        .env_remove("DDP_TEST_KILL_RANK")
        .env_remove("TORCHELASTIC_RESTART_COUNT"));
    let all = text(&out);
    let restarted = summary(&out);
    assert!(
        all.contains("rank 1 kills itself after step 7"),
        "the hook did not fire:\n{all}"
    );
    assert_eq!(
        all.matches("restarting all 2 ranks").count(),
        1,
        "exactly one restart:\n{all}"
    );
    assert!(all.contains("(restart 1 of 1)"), "{all}");
    assert!(all.contains("1 of 1 restarts used"), "{all}");
    assert!(
        all.contains("(mid-epoch: step 5, epoch 1 continues after its batch 5)"),
        "no resume from the step-5 checkpoint:\n{all}"
    );
    assert_eq!(restarted["steps"], whole["steps"]);
    assert_eq!(
        restarted["params_hash"], whole["params_hash"],
        "the restarted run ended with other weights:\n{all}"
    );
    assert_eq!(restarted["train_loss"], whole["train_loss"]);
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        std::fs::read(&whole_weights).unwrap(),
        "exported weights differ"
    );
}

/// A mid-epoch `--resume` in one process, no launcher: the run killed after step 7 resumes
/// from its checkpoint of step 5 and ends bit-identical to an uninterrupted run.
#[test]
fn a_mid_epoch_resume_in_one_process_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let whole_weights = dir.path().join("whole.safetensors");
    let whole = summary(&run(mnist_alone(&SMALL_CNN)
        .arg("--export")
        .arg(&whole_weights)));
    assert_eq!(whole["steps"], 40);

    let ck = dir.path().join("ck");
    let killed = run(mnist_alone(&SMALL_CNN)
        .args(["--checkpoint-every", "5", "--checkpoint-dir"])
        .arg(&ck)
        .env("DDP_TEST_KILL_AT_STEP", "7"));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        killed.status.signal(),
        Some(9),
        "the hook did not kill the run:\n{}",
        text(&killed)
    );

    let weights = dir.path().join("resumed.safetensors");
    let out = run(mnist_alone(&SMALL_CNN)
        .args(["--resume", "--checkpoint-every", "5", "--checkpoint-dir"])
        .arg(&ck)
        .arg("--export")
        .arg(&weights));
    let resumed = summary(&out);
    assert!(
        text(&out).contains("(mid-epoch: step 5, epoch 1 continues after its batch 5)"),
        "{}",
        text(&out)
    );
    assert_eq!(resumed["steps"], 40);
    assert_eq!(resumed["params_hash"], whole["params_hash"]);
    assert_eq!(resumed["train_loss"], whole["train_loss"]);
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        std::fs::read(&whole_weights).unwrap()
    );
}

/// A checkpoint written by one process (world size 1) is refused by a 2-rank run, with an
/// error naming the file and both world sizes, and by a run with another seed; with
/// `--allow-mismatched-checkpoint` the 2-rank run resumes from it with a warning.
#[test]
fn a_checkpoint_of_another_world_size_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().to_str().unwrap();
    let small = [
        "--model",
        "mlp",
        "--train-samples",
        "400",
        "--batch-size",
        "50",
    ];
    let args = [
        &small[..],
        &["--test-samples", "100", "--checkpoint-dir", ck],
    ]
    .concat();
    let first = summary(&run(&mut mnist_alone(
        &[&args[..], &["--max-steps", "4", "--checkpoint-every", "2"]].concat(),
    )));
    assert_eq!(first["steps"], 4);

    let resume = [&args[..], &["--resume", "--epochs", "1"]].concat();
    let out = ddprun_mnist(2, &resume);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("checkpoint.ddpck") && all.contains("world size 1 (this run: 2)"),
        "{all}"
    );
    assert!(all.contains("--allow-mismatched-checkpoint"), "{all}");

    let out = run(&mut mnist_alone(&[&resume[..], &["--seed", "5"]].concat()));
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("checkpoint.ddpck") && all.contains("seed 0 (this run: 5)"),
        "{all}"
    );

    let out = ddprun_mnist(
        2,
        &[&resume[..], &["--allow-mismatched-checkpoint"]].concat(),
    );
    let s = summary(&out);
    assert!(text(&out).contains("warning:"), "{}", text(&out));
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["epochs"], 1);
}

/// `train-pima ARGS` as one process (world size 1, the bundled CSV), without launcher variables.
fn pima_alone(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-pima"));
    command.args(["--threads", "1", "--json"]).args(args);
    common::clear_launcher_env(&mut command);
    run(&mut command)
}

/// Issue 36 item 8: `--help` opens with the trainer's own description (not the apps crate's),
/// and the first line names the learning rate, the optimizer and the overlap in words (no
/// Debug values), saying that `--overlap` is off, and why, where it cannot work.
#[test]
fn help_and_first_line_speak_for_the_trainer() {
    for (bin, first) in [
        (
            env!("CARGO_BIN_EXE_train-mnist"),
            "Train a classifier on MNIST with data parallelism across ranks",
        ),
        (
            env!("CARGO_BIN_EXE_train-pima"),
            "Train the Pima diabetes classifier with data parallelism across ranks",
        ),
    ] {
        let mut command = Command::new(bin);
        common::clear_launcher_env(command.arg("--help"));
        let out = run(&mut command);
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", text(&out));
        assert!(
            help.lines().next().is_some_and(|l| l.starts_with(first)),
            "{bin} --help:\n{help}"
        );
    }

    let out = pima_alone(&["--epochs", "1", "--max-steps", "2", "--overlap"]);
    let s = summary(&out);
    let all = text(&out);
    let line = all
        .lines()
        .find(|l| l.contains("training pima-mlp"))
        .unwrap_or_else(|| panic!("no first line in:\n{all}"));
    assert!(
        line.contains("(not scaled), adam, DDP (no overlap: "),
        "{line}"
    );
    assert!(line.contains("one rank"), "{line}");
    assert!(
        !line.contains("scaling)") && !line.contains("Adam"),
        "{line}"
    );
    assert_eq!(s["buckets_during_backward"], 0, "{s}");

    let out = pima_alone(&[
        "--epochs",
        "1",
        "--max-steps",
        "1",
        "--lr-scaling",
        "linear",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.5",
    ]);
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    assert!(
        all.contains(
            "× 1 ranks, linear scaling), sgd (momentum 0.5), DDP (no overlap: one rank, \
             nothing to all-reduce), "
        ),
        "{all}"
    );
}

/// `--drop-last` (PyTorch's `drop_last=True`): 100 samples in batches of 32 are 3 steps an
/// epoch, not 4, and the line at the start says what was dropped; off by default on the CPU
/// backend (the last batch of 4 samples is a step), so CPU runs keep their weights.
#[test]
fn drop_last_drops_the_partial_batch_and_is_off_on_the_cpu() {
    let small = [
        "--model",
        "mlp",
        "--train-samples",
        "100",
        "--test-samples",
        "100",
        "--batch-size",
        "32",
        "--epochs",
        "2",
    ];
    let kept = ddprun_mnist(1, &small);
    assert_eq!(summary(&kept)["steps"], 8, "{}", text(&kept));
    assert!(text(&kept).contains("(100 per rank, 4 steps per epoch)"));
    let dropped = ddprun_mnist(1, &[&small[..], &["--drop-last"]].concat());
    assert_eq!(summary(&dropped)["steps"], 6, "{}", text(&dropped));
    assert!(
        text(&dropped).contains("3 steps per epoch; the last partial batch of 4 dropped"),
        "{}",
        text(&dropped)
    );
    assert_ne!(
        summary(&dropped)["params_hash"],
        summary(&kept)["params_hash"]
    );
}
