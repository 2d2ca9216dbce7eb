//! `--backend cuda` on a machine without an NVIDIA driver, which is what this suite can check
//! here and in CI (no GPU, no driver): the trainers and `ddp-nccl-bench --probe` fail fast with
//! exit status 1 and an error naming the missing library (`libcuda.so`), never a panic (101)
//! and never a hang.
//!
//! Each test first establishes **independently** of the code under test that no driver is
//! present: it asks the dynamic loader itself (`dlopen`) for the library names the CUDA driver
//! is installed under. If a driver is found, the test FAILS instead of passing or skipping: on
//! a GPU machine these checks do not apply, and the GPU checks (training on the GPU, NCCL
//! all-reduce) live in `cargo xtask gpu-check`.
//!
//! Without the `cuda` feature the trainers cannot use a GPU at all, and the error says how to
//! build them.

use std::ffi::CString;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

mod common;

/// A generous bound against hangs (the commands fail within a second when they work).
const DEADLINE: Duration = Duration::from_secs(120);

/// The names under which an NVIDIA driver installs its library (the driver package ships
/// `libcuda.so.1`; the development symlink is `libcuda.so`).
const DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Fails the test unless the dynamic loader finds none of [`DRIVER_LIBRARIES`].
fn assert_no_cuda_driver() {
    for name in DRIVER_LIBRARIES {
        let c_name = CString::new(name).unwrap();
        // SAFETY: dlopen with a valid C string; a handle, if any, is closed at once.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            // SAFETY: a handle dlopen just returned.
            unsafe { libc::dlclose(handle) };
            panic!(
                "{name} can be loaded: this machine has a CUDA driver, and this test checks the \
                 error of --backend cuda on a machine without one. Run the GPU checks with \
                 `cargo xtask gpu-check` instead."
            );
        }
    }
}

/// Runs `bin ARGS` as a standalone rank (none of the launcher's variables), under a deadline.
fn standalone(bin: &str, args: &[&str]) -> Output {
    let mut command = Command::new(bin);
    common::clear_launcher_env(&mut command);
    command.args(args);
    common::output_with_deadline(&mut command, DEADLINE)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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
fn train_mnist_backend_cuda_without_a_driver_names_the_missing_library() {
    assert_no_cuda_driver();
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
    assert_clear_failure(&out, expected_error());
}

#[test]
fn train_pima_backend_cuda_without_a_driver_names_the_missing_library() {
    assert_no_cuda_driver();
    let out = standalone(
        env!("CARGO_BIN_EXE_train-pima"),
        &["--backend", "cuda", "--epochs", "1"],
    );
    assert_clear_failure(&out, expected_error());
}

#[cfg(feature = "cuda")]
#[test]
fn nccl_bench_probe_without_a_driver_names_the_missing_library() {
    assert_no_cuda_driver();
    let out = standalone(env!("CARGO_BIN_EXE_ddp-nccl-bench"), &["--probe"]);
    assert_clear_failure(
        &out,
        "no NVIDIA driver found: libcuda.so could not be loaded",
    );
}
