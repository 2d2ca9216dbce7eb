//! `--backend cuda`, checked where this suite runs. Which checks apply depends on the machine,
//! which `build.rs` asks the dynamic loader independently of the code under test
//! (`cfg(ddp_cuda_driver)`: `libcuda.so.1` loads):
//!
//! - no NVIDIA driver (here and in CI): the trainers and `ddp-nccl-bench --probe` fail fast
//!   with exit status 1 and an error naming the missing library, the names tried
//!   (`libcuda.so.1, libcuda.so`) and the folders searched, never a panic (101) and never a
//!   hang; with a fake driver and a fake NCCL (built here with `cc`), `ddp-nccl-bench --probe`
//!   names the files it loaded in its first line; the GPU tests are reported as ignored, with
//!   the reason;
//! - a driver (a GPU machine): a few steps of `train-mnist --backend cuda` must succeed and
//!   `ddp-nccl-bench --probe` must find the GPUs; the no-driver tests are reported as ignored.
//!   The fuller GPU checks (NCCL at every world size, an epoch against PyTorch) live in
//!   `cargo xtask gpu-check`.
//!
//! Without the `cuda` feature the trainers cannot use a GPU at all, whatever the machine, and
//! the error says how to build them.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

mod common;

use common::text;
mod mnist;

/// A generous bound against hangs (the commands fail within a second when they work).
const DEADLINE: Duration = Duration::from_secs(120);

/// Runs `bin ARGS` as a standalone rank (none of the launcher's variables), under a deadline.
fn standalone(bin: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> Output {
    let mut command = Command::new(bin);
    common::clear_launcher_env(&mut command);
    command.args(args);
    common::output_with_deadline(&mut command, DEADLINE)
}

/// `ddp-nccl-bench` of the unpublished ddp-bench crate, built by the workspace's test build.
fn nccl_bench() -> std::path::PathBuf {
    common::workspace_bin("ddp-nccl-bench")
}

/// The error of a machine without a driver: the library, the names tried.
const NO_DRIVER: &str = "no NVIDIA driver found: the NVIDIA driver (libcuda) could not be loaded: \
                         tried the names libcuda.so.1, libcuda.so";

/// The error `--backend cuda` of the trainer `program` must end with on this machine.
fn expected_error(program: &str) -> String {
    if cfg!(feature = "cuda") {
        NO_DRIVER.to_string()
    } else {
        format!(
            "--backend cuda: this {program} was built without the cargo feature \
             `ddp-apps/cuda`; build it with `cargo build --release --features ddp-apps/cuda \
             --bin {program}`"
        )
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
    assert_clear_failure(&out, &expected_error("train-mnist"));
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
    assert_clear_failure(&out, &expected_error("train-pima"));
}

#[cfg(feature = "nccl")]
#[test]
#[cfg_attr(
    ddp_cuda_driver,
    ignore = "this machine has an NVIDIA driver (libcuda.so.1 loads): the GPU tests run instead"
)]
fn nccl_bench_probe_without_a_driver_names_the_missing_library() {
    let out = standalone(nccl_bench(), &["--probe"]);
    assert_clear_failure(&out, NO_DRIVER);
}

/// Compiles the fake library `source` (comm's test fixtures) into `path` with `soname`.
#[cfg(feature = "nccl")]
fn build_fake(path: &Path, soname: &str, source: &str, defines: &[&str]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let c = path.with_extension("c");
    std::fs::write(&c, source).unwrap();
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(path)
        .arg(format!("-Wl,-soname,{soname}"))
        .args(defines)
        .arg(&c)
        .output()
        .expect("this test builds fake libraries with `cc`; install a C compiler");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ddp-nccl-bench --probe` with a fake driver in `LD_LIBRARY_PATH` and the NCCL of the venv
/// `venv`, in a clean environment; returns its output.
#[cfg(feature = "nccl")]
fn probe_with(driver_dir: &Path, venv: &Path, home: &Path) -> Output {
    let mut command = Command::new(nccl_bench());
    common::clear_launcher_env(&mut command);
    command
        .arg("--probe")
        .env("LD_LIBRARY_PATH", driver_dir)
        .env("VIRTUAL_ENV", venv)
        .env("HOME", home)
        .env_remove("CONDA_PREFIX");
    common::output_with_deadline(&mut command, DEADLINE)
}

/// The first line of the run names the files loaded: the fake driver from `LD_LIBRARY_PATH`
/// and NCCL from the venv, under its real name `libnccl.so.2`; cudarc's calls reach the fake
/// driver (three GPUs).
#[cfg(feature = "nccl")]
#[test]
#[cfg_attr(
    ddp_cuda_driver,
    ignore = "this machine has an NVIDIA driver (libcuda.so.1 loads): cudarc would open it, not the fake"
)]
fn nccl_bench_probe_names_the_files_it_loaded_in_its_first_line() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let driver = r.join("driver/libcuda.so.1");
    build_fake(
        &driver,
        "libcuda.so.1",
        include_str!("../../comm/tests/fixtures/fake_cuda/libcuda.c"),
        &[],
    );
    let nccl = r.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
    build_fake(
        &nccl,
        "libnccl.so.2",
        include_str!("../../comm/tests/fixtures/fake_cuda/libnccl.c"),
        &["-DFAKE_VERSION=22105"],
    );
    let out = probe_with(&r.join("driver"), &r.join("venv"), r);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.lines().next().unwrap_or(""),
        format!(
            "CUDA libraries: driver (CUDA 12.4) {} [LD_LIBRARY_PATH]; NCCL (2.21.5) {} \
             [VIRTUAL_ENV={}]",
            driver.display(),
            nccl.display(),
            r.join("venv").display()
        ),
        "{}",
        text(&out)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "gpus 3 nccl 2.21.5"
    );
}

/// The same with NVIDIA's real NCCL wheel, in the venv `DDP_CUDA_WHEELS` names (CI installs
/// `nvidia-nccl-cu12` there): the probe's first line names the wheel's `libnccl.so.2`, and its
/// `ncclGetVersion` answers the wheel's version.
#[cfg(feature = "nccl")]
#[test]
#[ignore = "needs the nvidia-nccl wheel; CI installs it"]
fn nccl_wheel_is_named_in_the_probes_first_line() {
    let venv = std::path::PathBuf::from(std::env::var_os("DDP_CUDA_WHEELS").expect(
        "set DDP_CUDA_WHEELS to a venv with `pip install nvidia-nccl-cu12` (CI does) to run \
         this test",
    ));
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    build_fake(
        &r.join("driver/libcuda.so.1"),
        "libcuda.so.1",
        include_str!("../../comm/tests/fixtures/fake_cuda/libcuda.c"),
        &[],
    );
    let out = probe_with(&r.join("driver"), &venv, r);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let first = String::from_utf8_lossy(&out.stderr)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();
    let site = std::fs::read_dir(venv.join("lib"))
        .unwrap()
        .flatten()
        .map(|p| p.path().join("site-packages"))
        .find(|p| p.is_dir())
        .expect("a site-packages folder in the venv");
    let wheel = std::fs::read_dir(&site)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("nvidia_nccl_cu") && n.ends_with(".dist-info"))
        .expect("the nvidia-nccl wheel's metadata");
    let version = wheel
        .trim_end_matches(".dist-info")
        .rsplit_once('-')
        .unwrap()
        .1
        .to_string();
    let lib = site.join("nvidia/nccl/lib/libnccl.so.2");
    assert!(
        first.contains(&format!("NCCL ({version}) {} [VIRTUAL_ENV=", lib.display())),
        "{first}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.trim(), format!("gpus 3 nccl {version}"));
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
    let out = standalone(nccl_bench(), &["--probe"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}
