//! End-to-end: `train-mnist --data-format shards` as real processes, under `ddprun` and
//! standalone, on shards that `ddp-shards from-mnist` writes from the real MNIST (see
//! `mnist::real_mnist`). Every process runs under a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
mod mnist;

fn mnist_dir() -> PathBuf {
    mnist::real_mnist()
}

/// Runs `command` with its output in files under `dir`, killing it after `secs`; returns
/// whether it succeeded and its stdout and stderr together.
fn run(mut command: Command, dir: &Path, secs: u64) -> (bool, String) {
    let (out, err) = (dir.join("stdout.txt"), dir.join("stderr.txt"));
    command
        .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
        .stderr(Stdio::from(std::fs::File::create(&err).unwrap()));
    let mut child = command.spawn().expect("starting the command");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no exit within {secs} s:\n{}{}",
                std::fs::read_to_string(&out).unwrap_or_default(),
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!(
        "{}{}",
        std::fs::read_to_string(&out).unwrap(),
        std::fs::read_to_string(&err).unwrap()
    );
    (status.success(), text)
}

/// Shards of the real MNIST (train and test) in a temporary folder.
fn make_shards() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddp-shards"));
    command
        .arg("from-mnist")
        .arg("--mnist-dir")
        .arg(mnist_dir())
        .arg("--out")
        .arg(dir.path().join("shards"));
    let (ok, text) = run(command, dir.path(), 120);
    assert!(ok, "ddp-shards from-mnist failed:\n{text}");
    dir
}

fn summary(text: &str) -> Value {
    let line = text
        .lines()
        .find_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no summary in:\n{text}"));
    serde_json::from_str(&line).unwrap()
}

fn trainer(shards: &Path, args: &[&str]) -> Vec<String> {
    let mut all: Vec<String> = vec![
        "--data-format".into(),
        "shards".into(),
        "--data-dir".into(),
        shards.display().to_string(),
        "--threads".into(),
        "1".into(),
        "--json".into(),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    all
}

#[test]
fn two_ranks_learn_mnist_from_shards() {
    let dir = make_shards();
    let shards = dir.path().join("shards");
    let mut command = Command::new(common::workspace_bin("ddprun"));
    command
        .args(["--nproc-per-node", "2", "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .args(trainer(
            &shards,
            &["--max-steps", "60", "--test-samples", "1000"],
        ));
    let (ok, text) = run(command, dir.path(), 600);
    assert!(ok, "run failed:\n{text}");
    let s = summary(&text);
    assert_eq!(s["world_size"], 2);
    assert_eq!(s["steps"], 60);
    // Every one of the first 1000 test samples evaluated once across the two ranks.
    assert_eq!(s["test_total"], 1000);
    let accuracy = s["test_accuracy"].as_f64().unwrap();
    assert!(
        accuracy > 0.80,
        "accuracy {accuracy} after 60 steps:\n{text}"
    );
    // Per rank: 30 of the 60 training shards (1000 samples each), batches of 64.
    assert!(
        text.contains("60000 training samples (30000 per rank, 469 steps per epoch)"),
        "{text}"
    );
}

#[test]
fn standalone_from_shards_and_a_corrupt_shard_names_its_file() {
    let dir = make_shards();
    let shards = dir.path().join("shards");
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command.args(trainer(
        &shards,
        &[
            "--max-steps",
            "20",
            "--test-samples",
            "500",
            "--model",
            "mlp",
        ],
    ));
    let (ok, text) = run(command, dir.path(), 300);
    assert!(ok, "run failed:\n{text}");
    let s = summary(&text);
    assert_eq!(s["world_size"], 1);
    assert_eq!(s["steps"], 20);
    assert_eq!(s["test_total"], 500);

    // Flip one pixel of a test shard: the checksum in the index catches it when evaluating.
    let victim = shards.join("test/shard-00000.safetensors");
    let mut bytes = std::fs::read(&victim).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0xff;
    std::fs::write(&victim, &bytes).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command.args(trainer(
        &shards,
        &[
            "--max-steps",
            "5",
            "--test-samples",
            "500",
            "--model",
            "mlp",
        ],
    ));
    let (ok, text) = run(command, dir.path(), 300);
    assert!(!ok, "a corrupt shard went unnoticed:\n{text}");
    assert!(
        text.contains("shard-00000.safetensors") && text.contains("CRC-32"),
        "{text}"
    );

    // A missing training shard: an error naming it before any training.
    std::fs::remove_file(shards.join("train/shard-00007.safetensors")).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    command.args(trainer(&shards, &["--max-steps", "5"]));
    let (ok, text) = run(command, dir.path(), 300);
    assert!(!ok, "a missing shard went unnoticed:\n{text}");
    assert!(text.contains("train/shard-00007.safetensors"), "{text}");
}
