//! End-to-end: the trainers as real processes under `ddprun`, on the real MNIST files in
//! `../shared/data/mnist`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod common;

/// The longest one trainer run in these tests may take on a loaded 2-core machine (a deadline
/// against hangs, not a speed check: speed is measured by the benches).
const DEADLINE: Duration = Duration::from_secs(900);

/// Runs `command` under guard (killed past [`DEADLINE`] or if the test panics).
fn run(command: &mut Command) -> Output {
    common::output_with_deadline(command, DEADLINE)
}

use serde_json::Value;

fn mnist_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist")
}

/// Runs `train-mnist ARGS` on `nproc` ranks through ddprun.
fn ddprun_mnist(nproc: usize, args: &[&str]) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_ddprun"))
        .args(["--nproc-per-node", &nproc.to_string(), "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(args))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The JSON summary rank 0 prints at the end.
fn summary(out: &Output) -> Value {
    let all = text(out);
    assert!(out.status.success(), "run failed:\n{all}");
    let line = all
        .lines()
        .find_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no summary in:\n{all}"));
    serde_json::from_str(&line).unwrap()
}

#[test]
fn two_ranks_learn_mnist() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics");
    let weights = dir.path().join("model.safetensors");
    let out = ddprun_mnist(
        2,
        &[
            "--max-steps",
            "60",
            "--test-samples",
            "1000",
            "--metrics-dir",
            metrics.to_str().unwrap(),
            "--export",
            weights.to_str().unwrap(),
        ],
    );
    let s = summary(&out);
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
    assert!(std::fs::metadata(&weights).unwrap().len() > 4 * 1_199_882);
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
        "train-images-idx3-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ] {
        std::fs::copy(mnist_dir().join(name), dir.path().join(name)).unwrap();
    }
    // A labels file cut short, as an interrupted copy would leave it.
    let labels = std::fs::read(mnist_dir().join("train-labels-idx1-ubyte.gz")).unwrap();
    std::fs::write(
        dir.path().join("train-labels-idx1-ubyte.gz"),
        &labels[..labels.len() / 2],
    )
    .unwrap();
    let out = run(Command::new(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(dir.path()));
    assert!(!out.status.success());
    let all = text(&out);
    assert!(all.contains("train-labels-idx1-ubyte.gz"), "{all}");
}
