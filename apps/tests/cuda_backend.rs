//! `--backend cuda`, checked where this suite runs. Which checks apply depends on the machine,
//! which `build.rs` asks the dynamic loader independently of the code under test
//! (`cfg(ddp_cuda_driver)`: `libcuda.so.1` loads):
//!
//! - no NVIDIA driver (here and in CI): the trainers and `ddp-nccl-bench --probe` fail fast
//!   with exit status 1 and an error naming the missing library (`libcuda.so`), never a panic
//!   (101) and never a hang; the GPU tests are reported as ignored, with the reason;
//! - a driver (a GPU machine): a few steps of `train-mnist --backend cuda` must succeed and
//!   `ddp-nccl-bench --probe` must find the GPUs; the no-driver tests are reported as ignored.
//!   The fuller GPU checks (NCCL at every world size, an epoch against PyTorch) live in
//!   `cargo xtask gpu-check`.
//!
//! Without the `cuda` feature the trainers cannot use a GPU at all, whatever the machine, and
//! the error says how to build them.

use std::process::{Command, Output};
use std::time::Duration;

mod common;

use common::text;
mod mnist;

/// A generous bound against hangs (the commands fail within a second when they work).
const DEADLINE: Duration = Duration::from_secs(120);

/// Runs `bin ARGS` as a standalone rank (none of the launcher's variables), under a deadline.
fn standalone(bin: &str, args: &[&str]) -> Output {
    let mut command = Command::new(bin);
    common::clear_launcher_env(&mut command);
    command.args(args);
    common::output_with_deadline(&mut command, DEADLINE)
}

/// The error `--backend cuda` must end with on this machine.
fn expected_error() -> &'static str {
    if cfg!(feature = "cuda") {
        "no NVIDIA driver found: libcuda.so could not be loaded"
    } else {
        "--backend cuda: this build has no CUDA support (build with --features cuda)"
    }
}

/// Exit status 1, the expected message, no panic.
fn assert_clear_failure(out: &Output, expected: &str) {
    let all = text(out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains(expected), "expected {expected:?} in:\n{all}");
    assert!(!all.contains("panicked"), "{all}");
}

#[test]
#[cfg_attr(
    all(feature = "cuda", ddp_cuda_driver),
    ignore = "this machine has an NVIDIA driver (libcuda.so.1 loads): the GPU tests run instead"
)]
fn train_mnist_backend_cuda_without_a_driver_names_the_missing_library() {
    let data = mnist::real_mnist();
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
    assert_clear_failure(&out, expected_error());
}

#[test]
#[cfg_attr(
    all(feature = "cuda", ddp_cuda_driver),
    ignore = "this machine has an NVIDIA driver (libcuda.so.1 loads): the GPU tests run instead"
)]
fn train_pima_backend_cuda_without_a_driver_names_the_missing_library() {
    let out = standalone(
        env!("CARGO_BIN_EXE_train-pima"),
        &["--backend", "cuda", "--epochs", "1"],
    );
    assert_clear_failure(&out, expected_error());
}

#[cfg(feature = "nccl")]
#[test]
#[cfg_attr(
    ddp_cuda_driver,
    ignore = "this machine has an NVIDIA driver (libcuda.so.1 loads): the GPU tests run instead"
)]
fn nccl_bench_probe_without_a_driver_names_the_missing_library() {
    let out = standalone(env!("CARGO_BIN_EXE_ddp-nccl-bench"), &["--probe"]);
    assert_clear_failure(
        &out,
        "no NVIDIA driver found: libcuda.so could not be loaded",
    );
}

#[cfg(feature = "cuda")]
#[test]
#[cfg_attr(
    not(ddp_cuda_driver),
    ignore = "needs an NVIDIA GPU and driver (libcuda.so.1 did not load when this test was built)"
)]
fn train_mnist_backend_cuda_trains_on_the_gpu() {
    let data = mnist::real_mnist();
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
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("\"steps\":5"), "{}", text(&out));
}

#[cfg(feature = "nccl")]
#[test]
#[cfg_attr(
    not(ddp_nccl_library),
    ignore = "needs an NVIDIA GPU, its driver and NCCL (libcuda.so.1 and libnccl.so.2 did not both load when this test was built)"
)]
fn nccl_bench_probe_finds_the_gpus() {
    let out = standalone(env!("CARGO_BIN_EXE_ddp-nccl-bench"), &["--probe"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}
