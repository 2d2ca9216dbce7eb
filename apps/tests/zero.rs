//! `--zero-stage` and `--overlap` end to end: the trainer as real processes under `ddprun`, on
//! the real MNIST.
//!
//! - overlap (all-reduces during backward, the default) ends with the very weights of
//!   `--overlap false` (after backward), for the MLP and the CNN, over shared memory and TCP,
//!   and its all-reduces did start during backward (the JSON summary counts them; none
//!   without it);
//! - stages 1 and 2 end with the very weights of plain DDP (stage 0): the same parameter hash
//!   and byte-identical exported safetensors; so does stage 2 with `--overlap`, whose
//!   reduce-scatters did start during backward;
//! - `--optimizer adamw --max-grad-norm` (global-norm clipping) ends with the same weights at
//!   stages 0, 1 and 2;
//! - a sharded checkpoint written by 2 ranks resumes on 1 rank (another world size, allowed
//!   with `--allow-mismatched-checkpoint`), and a plain DDP run refuses it with an error that
//!   names the file and says why;
//! - a rank killed during sharded training is named as the root cause, as under DDP.
//!   (Whether the survivor prints its own error first depends on timing: ddprun stops it.)

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

mod common;
mod mnist;
mod trainer;

use common::text;
use trainer::summary;

/// A deadline against hangs, not a speed check.
const DEADLINE: Duration = Duration::from_secs(900);

/// A small MLP run: 2000 training samples, batch 50 per rank.
const SMALL: [&str; 10] = [
    "--model",
    "mlp",
    "--train-samples",
    "2000",
    "--test-samples",
    "500",
    "--batch-size",
    "50",
    "--epochs",
    "1",
];

fn mnist_dir() -> PathBuf {
    mnist::real_mnist()
}

/// `train-mnist ARGS` on `nproc` ranks through ddprun (`nproc` 1: one process, no launcher).
fn train(nproc: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = if nproc == 1 {
        let mut c = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
        common::clear_launcher_env(&mut c);
        c
    } else {
        let mut c = Command::new(common::workspace_bin("ddprun"));
        c.args(["--nproc-per-node", &nproc.to_string(), "--"])
            .arg(env!("CARGO_BIN_EXE_train-mnist"));
        c
    };
    command
        .arg("--data-dir")
        .arg(mnist_dir())
        .args(["--threads", "1", "--json"])
        .args(args)
        .env_remove("DDP_TEST_KILL_AT_STEP")
        .env_remove("TORCHELASTIC_RESTART_COUNT");
    for (k, v) in env {
        command.env(k, v);
    }
    common::output_with_deadline(&mut command, DEADLINE)
}

#[test]
fn zero_stages_end_with_the_weights_of_plain_ddp() {
    let dir = tempfile::tempdir().unwrap();
    let mut hashes = Vec::new();
    let mut weights = Vec::new();
    for (stage, overlap) in [
        ("0", "false"),
        ("1", "false"),
        ("2", "false"),
        ("2", "true"),
    ] {
        let export = dir
            .path()
            .join(format!("stage{stage}-{overlap}.safetensors"));
        let out = train(
            2,
            &[
                &SMALL[..],
                &["--zero-stage", stage, "--export", export.to_str().unwrap()],
                &["--overlap", overlap],
            ]
            .concat(),
            &[],
        );
        let s = summary(&out);
        if stage != "0" {
            assert!(
                text(&out).contains(&format!("ZeRO stage {stage} (this rank steps")),
                "{}",
                text(&out)
            );
        }
        let early = s["buckets_during_backward"].as_u64().unwrap();
        if overlap == "true" {
            assert!(
                text(&out).contains("(reduce-scatters during backward)"),
                "{}",
                text(&out)
            );
            // Every step but the first, which holds its buckets until backward ends (it
            // learns which parameters the loss reaches outside the hooked copy).
            assert!(early + 1 >= s["steps"].as_u64().unwrap(), "{s}");
        } else {
            assert_eq!(early, 0, "{s}");
        }
        assert_eq!(s["world_size"], 2);
        assert!(
            s["test_accuracy"].as_f64().unwrap() > 0.8,
            "stage {stage}: {s}"
        );
        hashes.push(s["params_hash"].as_str().unwrap().to_string());
        weights.push(std::fs::read(&export).unwrap());
    }
    assert_eq!(hashes[1], hashes[0], "stage 1 against DDP");
    assert_eq!(hashes[2], hashes[0], "stage 2 against DDP");
    assert_eq!(hashes[3], hashes[0], "stage 2 with overlap against DDP");
    assert!(weights[1..].iter().all(|w| *w == weights[0]));
}

/// `--optimizer adamw --max-grad-norm` (the clip active: the MLP's early gradients have norms
/// above 0.5) ends with the very weights at stages 0, 1 and 2, with and without overlap; and
/// clipping changed the run.
#[test]
fn adamw_with_clipping_ends_with_the_same_weights_at_every_stage() {
    let mut hashes = Vec::new();
    for (stage, overlap, clip) in [
        ("0", "true", "0.5"),
        ("1", "false", "0.5"),
        ("2", "true", "0.5"),
        ("0", "true", "1e9"),
    ] {
        let args = [
            &SMALL[..],
            &["--zero-stage", stage, "--overlap", overlap],
            &["--optimizer", "adamw", "--max-grad-norm", clip],
        ]
        .concat();
        let out = train(2, &args, &[]);
        let s = summary(&out);
        assert!(
            text(&out).contains("adamw (weight decay 0.01)"),
            "{}",
            text(&out)
        );
        assert!(s["test_accuracy"].as_f64().unwrap() > 0.8, "{s}");
        hashes.push(s["params_hash"].as_str().unwrap().to_string());
    }
    assert_eq!(hashes[1], hashes[0], "stage 1 against DDP, clipped");
    assert_eq!(
        hashes[2], hashes[0],
        "stage 2 with overlap against DDP, clipped"
    );
    assert_ne!(
        hashes[3], hashes[0],
        "a clip that never acts changes nothing: 0.5 did act"
    );
}

#[test]
fn a_sharded_checkpoint_resumes_on_another_world_size_and_ddp_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().to_str().unwrap();
    let first = summary(&train(
        2,
        &[
            &SMALL[..],
            &[
                "--zero-stage",
                "2",
                "--max-steps",
                "10",
                "--checkpoint-dir",
                ck,
            ],
        ]
        .concat(),
        &[],
    ));
    assert_eq!(first["steps"], 10);

    // One process, stage 1, from the 2-rank stage-2 checkpoint.
    let resume = [
        &SMALL[..],
        &[
            "--checkpoint-dir",
            ck,
            "--resume",
            "--allow-mismatched-checkpoint",
        ],
    ]
    .concat();
    let out = train(1, &[&resume[..], &["--zero-stage", "1"]].concat(), &[]);
    let s = summary(&out);
    assert!(
        text(&out).contains("resuming from") && text(&out).contains("world size 2"),
        "{}",
        text(&out)
    );
    assert!(s["steps"].as_u64().unwrap() > 10, "{s}");

    // Plain DDP cannot use a sharded optimizer state: an error naming the file.
    let out = train(1, &[&resume[..], &["--zero-stage", "0"]].concat(), &[]);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("checkpoint.ddpck") && all.contains("written by a sharded run"),
        "{all}"
    );
}

#[test]
fn a_rank_killed_during_sharded_training_is_named() {
    let out = train(
        2,
        &[&SMALL[..], &["--zero-stage", "2"]].concat(),
        &[("DDP_TEST_KILL_AT_STEP", "5")],
    );
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("rank 1 kills itself after step 5"),
        "the hook did not fire:\n{all}"
    );
    // ddprun's root cause names rank 1 and its signal, not the survivor.
    let root = all
        .rsplit_once("Root cause:")
        .map(|(_, r)| r)
        .unwrap_or_else(|| panic!("no root cause in:\n{all}"));
    assert!(
        root.contains("rank 1 (local rank 1) killed by SIGKILL"),
        "root cause:\n{root}"
    );
    // The survivor's own error, when it got to print one before ddprun stopped it, names
    // the dead peer.
    if let Some(line) = all.lines().find(|l| l.starts_with("[rank 0] Error:")) {
        assert!(line.contains("rank 1"), "{line}");
    }
}

#[test]
fn overlap_ends_with_the_weights_of_the_all_reduce_after_backward() {
    for (model, transport) in [("mlp", "shm"), ("cnn", "tcp")] {
        let args = [
            "--model",
            model,
            "--train-samples",
            "1200",
            "--test-samples",
            "200",
            "--batch-size",
            "50",
            "--epochs",
            "1",
            "--bucket-cap-mb",
            "1",
        ];
        let env = [("DDP_TRANSPORT", transport)];
        let plain = summary(&train(
            2,
            &[&args[..], &["--overlap", "false"]].concat(),
            &env,
        ));
        // Overlap is the default: no flag.
        let out = train(2, &args, &env);
        assert!(
            text(&out).contains("DDP (all-reduces during backward)"),
            "{}",
            text(&out)
        );
        let overlapped = summary(&out);
        assert_eq!(plain["steps"], overlapped["steps"]);
        // The all-reduces started during backward: bucket 0 at least, at every step but the
        // first (which holds its buckets until backward ends, to learn the loss's paths).
        let steps = overlapped["steps"].as_u64().unwrap();
        let early = overlapped["buckets_during_backward"].as_u64().unwrap();
        assert!(
            steps > 1 && early + 1 >= steps && early <= overlapped["buckets"].as_u64().unwrap(),
            "{model} over {transport}: {overlapped}"
        );
        assert_eq!(plain["buckets_during_backward"], 0, "{plain}");
        assert_eq!(plain["buckets"], overlapped["buckets"]);
        assert_eq!(
            plain["params_hash"], overlapped["params_hash"],
            "{model} over {transport}"
        );
    }
}
