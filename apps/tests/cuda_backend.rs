//! `--backend cuda` where it cannot run is a clear error (exit status 1), never a panic (101):
//! without the `cuda` feature it says how to build, with it on a machine without an NVIDIA
//! driver it says so. On a machine with a GPU (and the feature) the MNIST case trains a few
//! steps instead.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `bin ARGS` as a standalone rank (none of the launcher's variables).
fn standalone(bin: &str, args: &[&str]) -> Output {
    let mut command = Command::new(bin);
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
    ] {
        command.env_remove(var);
    }
    command.args(args).output().expect("starting the trainer")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether this build can reach a GPU (feature `cuda` and an NVIDIA driver).
fn gpu_usable() -> bool {
    #[cfg(feature = "cuda")]
    {
        ddp_comm::nccl::device_count().is_ok_and(|n| n > 0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The error `--backend cuda` must end with where it cannot run.
fn expected_error() -> &'static str {
    if cfg!(feature = "cuda") {
        "no NVIDIA driver found"
    } else {
        "--backend cuda: this build has no CUDA support (build with --features cuda)"
    }
}

#[test]
fn train_mnist_backend_cuda() {
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
    let out = standalone(
        env!("CARGO_BIN_EXE_train-mnist"),
        &[
            "--backend",
            "cuda",
            "--data-dir",
            data.to_str().unwrap(),
            "--max-steps",
            "5",
            "--test-samples",
            "500",
        ],
    );
    if gpu_usable() {
        assert!(out.status.success(), "{}", text(&out));
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(expected_error()), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}

#[test]
fn train_pima_backend_cuda() {
    if gpu_usable() {
        return; // the MNIST case covers a GPU
    }
    let out = standalone(
        env!("CARGO_BIN_EXE_train-pima"),
        &["--backend", "cuda", "--epochs", "1"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(expected_error()), "{}", text(&out));
    assert!(!text(&out).contains("panicked"), "{}", text(&out));
}

#[cfg(feature = "cuda")]
#[test]
fn nccl_bench_probe_says_what_is_missing() {
    let out = standalone(env!("CARGO_BIN_EXE_ddp-nccl-bench"), &["--probe"]);
    if gpu_usable() {
        // A GPU machine: the probe succeeds unless NCCL is missing, which it must say.
        assert!(
            out.status.success() || text(&out).contains("NCCL library could not be loaded"),
            "{}",
            text(&out)
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("no NVIDIA driver found"),
        "{}",
        text(&out)
    );
}
