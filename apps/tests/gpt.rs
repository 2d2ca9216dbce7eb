//! `train-gpt` end to end: real processes under `ddprun`, a tiny GPT on the characters of this
//! crate's README (written into the test's temp dir), AdamW, global-norm clipping and the
//! cosine schedule on.
//!
//! - plain DDP, overlap and ZeRO stage 2 end with bit-identical weights on both ranks and
//!   across the three modes, the loss goes down, and the clip and the schedule act (without
//!   them the run ends elsewhere);
//! - a run interrupted by its checkpoint and resumed ends bit-identical to an uninterrupted
//!   one (the schedule is a function of the restored step);
//! - bad input (a block longer than the text, a file that is not UTF-8) is an error naming the
//!   file.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

mod common;
mod trainer;

use common::text;
use trainer::summary;

/// A deadline against hangs, not a speed check.
const DEADLINE: Duration = Duration::from_secs(300);

/// The tiny model and the optimizer settings of every run: 2 layers, 2 heads, 32 wide, 32
/// characters of context, batch 4 per rank, AdamW at 3e-3 clipped at 0.5 (the first steps'
/// norms are above it), warm-up 2 then cosine to step 12.
const TINY: [&str; 24] = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--lr",
    "3e-3",
    "--max-grad-norm",
    "0.5",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "2",
    "--decay-steps",
    "12",
    "--log-interval",
    "1",
    "--threads",
    "1",
];

/// The corpus: this crate's README, as a file in `dir`.
fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, include_str!("../README.md")).unwrap();
    path
}

/// `train-gpt --text TEXT ARGS --json --verbose` on `nproc` ranks through ddprun (`nproc` 1:
/// one process, no launcher).
fn train(nproc: usize, text: &Path, args: &[&str]) -> Output {
    let mut command = common::ranks_command(env!("CARGO_BIN_EXE_train-gpt"), nproc);
    command
        .arg("--text")
        .arg(text)
        .args(["--json", "--verbose"])
        .args(args)
        .env_remove("DDP_TEST_KILL_AT_STEP")
        .env_remove("TORCHELASTIC_RESTART_COUNT");
    common::output_with_deadline(&mut command, DEADLINE)
}

/// Every rank's parameter hash (each prints its summary with `--verbose`), after checking
/// that the run succeeded.
fn rank_hashes(out: &Output) -> Vec<String> {
    summary(out);
    text(out)
        .lines()
        .filter_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .map(|j| {
            let v: serde_json::Value = serde_json::from_str(&j).unwrap();
            v["params_hash"].as_str().unwrap().to_string()
        })
        .collect()
}

/// Rank 0's loss at every step, from its log lines (`... step N (..) loss X`).
fn losses(out: &Output) -> Vec<f64> {
    text(out)
        .lines()
        .filter(|l| !l.contains("[rank 1]") && l.contains(" step ") && l.contains(" loss "))
        .filter_map(|l| l.rsplit_once(" loss ")?.1.trim().parse().ok())
        .collect()
}

#[test]
fn ddp_overlap_and_zero2_end_bit_identical_and_the_loss_goes_down() {
    let dir = tempfile::tempdir().unwrap();
    let text_file = corpus(dir.path());
    let steps = ["--max-steps", "12"];
    let mut hashes = Vec::new();
    for (stage, overlap) in [("0", "false"), ("0", "true"), ("2", "true")] {
        let mode = ["--zero-stage", stage, "--overlap", overlap];
        let out = train(2, &text_file, &[&TINY[..], &steps, &mode].concat());
        let ranks = rank_hashes(&out);
        assert_eq!(ranks.len(), 2, "{}", text(&out));
        assert_eq!(
            ranks[0], ranks[1],
            "stage {stage} overlap {overlap}: ranks differ"
        );
        assert!(
            text(&out).contains("schedule cosine (warm-up 2 steps, to "),
            "{}",
            text(&out)
        );
        let loss = losses(&out);
        assert_eq!(loss.len(), 12, "{}", text(&out));
        let last: f64 = loss[9..].iter().sum::<f64>() / 3.0;
        assert!(last < loss[0] - 0.3, "the loss did not go down: {loss:?}");
        hashes.push(ranks[0].clone());
    }
    assert_eq!(hashes[1], hashes[0], "overlap against DDP");
    assert_eq!(hashes[2], hashes[0], "ZeRO 2 against DDP");
    // The clip and the schedule changed the run: without either it ends elsewhere.
    let unclipped = [&TINY[..], &steps, &["--max-grad-norm", "1e9"]].concat();
    let constant = [&TINY[..14], &TINY[20..], &steps[..]].concat();
    for (what, args) in [("clip", unclipped), ("schedule", constant)] {
        let other = &rank_hashes(&train(2, &text_file, &args))[0];
        assert_ne!(*other, hashes[0], "the {what} did not act");
    }
}

#[test]
fn a_resumed_run_with_the_schedule_ends_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let text_file = corpus(dir.path());
    let ck = dir.path().join("ck");
    let ck = ck.to_str().unwrap();
    let whole = summary(&train(
        2,
        &text_file,
        &[&TINY[..], &["--max-steps", "12"]].concat(),
    ));
    let first = summary(&train(
        2,
        &text_file,
        &[&TINY[..], &["--max-steps", "5", "--checkpoint-dir", ck]].concat(),
    ));
    assert_eq!(first["steps"], 5);
    let resumed = summary(&train(
        2,
        &text_file,
        &[
            &TINY[..],
            &["--max-steps", "12", "--checkpoint-dir", ck, "--resume"],
        ]
        .concat(),
    ));
    assert_eq!(resumed["steps"], 12);
    assert_eq!(
        resumed["params_hash"], whole["params_hash"],
        "the resumed run ended with different weights"
    );
    assert_ne!(first["params_hash"], whole["params_hash"]);
}

#[test]
fn bad_text_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let text_file = corpus(dir.path());
    let out = train(
        1,
        &text_file,
        &[&TINY[..], &["--block-size", "5000"]].concat(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("corpus.txt") && text(&out).contains("block of 5000"),
        "{}",
        text(&out)
    );
    let binary = dir.path().join("binary.txt");
    std::fs::write(&binary, [b'a', 0xc3, 0x28, b'b']).unwrap();
    let out = train(1, &binary, &TINY);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("binary.txt") && text(&out).contains("not UTF-8"),
        "{}",
        text(&out)
    );
}
