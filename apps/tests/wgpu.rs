//! `--backend wgpu` (feature `wgpu`): burn's cubecl kernels, fusion, autotune and the kernel
//! cache, with device tensors flowing through DDP, on a machine without a GPU. Mesa's lavapipe
//! (Debian's `mesa-vulkan-drivers`) gives wgpu a Vulkan device on the CPU; without a Vulkan
//! device these tests are reported as ignored with the reason, and CI (`.ci/run`), which
//! installs lavapipe, runs them.
//!
//! - Two ranks train a few dozen steps on wgpu: their final parameters are bit-identical (the
//!   host gradient path all-reduces device tensors), and the loss is close to the CPU
//!   backend's run of the same steps (other kernels, other rounding: close, not equal).
//! - The kernel cache: a first process fills `DDP_CACHE_DIR` (the database file is there, not
//!   empty); a second process with the same folder finds it (its first step is printed beside
//!   the first process's; the time is a figure for the note, not an assertion).

#![cfg(feature = "wgpu")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod common;
mod mnist;

use common::text;
use serde_json::Value;

/// A bound against hangs: lavapipe compiles every kernel on the CPU (minutes the first time).
const DEADLINE: Duration = Duration::from_secs(1200);

/// `train-mnist ARGS` on `nproc` ranks through ddprun, the kernel cache in `cache`.
fn ddprun_mnist(nproc: usize, cache: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(common::workspace_bin("ddprun"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--nproc-per-node", &nproc.to_string(), "--"])
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist::real_mnist())
        .args([
            "--json",
            "--verbose",
            "--threads",
            "1",
            "--test-samples",
            "256",
        ])
        .args(["--batch-size", "32", "--log-interval", "10"])
        .args(args)
        .env("DDP_CACHE_DIR", cache);
    common::output_with_deadline(&mut command, DEADLINE)
}

/// Every rank's summary (`--verbose`: each rank prints its own).
fn summaries(out: &Output) -> Vec<Value> {
    let all = text(out);
    assert!(out.status.success(), "run failed:\n{all}");
    let found: Vec<Value> = all
        .lines()
        .filter_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .map(|j| serde_json::from_str(&j).unwrap_or_else(|e| panic!("{e}: {j}")))
        .collect();
    assert!(!found.is_empty(), "no summary in:\n{all}");
    found
}

/// The trainer's "first step done T s" figure.
fn first_step(out: &Output) -> f64 {
    let all = text(out);
    all.lines()
        .find_map(|l| {
            let rest = l.split_once("first step done ")?.1;
            rest.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no first-step line in:\n{all}"))
}

/// The files under `dir`, with their sizes.
fn files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(files(&path));
        } else if let Ok(m) = e.metadata() {
            out.push((path, m.len()));
        }
    }
    out
}

#[test]
#[ignore = "needs a Vulkan device (Mesa's lavapipe: apt-get install mesa-vulkan-drivers; CI installs it and runs this)"]
fn two_ranks_on_vulkan_are_bit_identical_and_train_like_the_cpu() {
    let cache = tempfile::tempdir().unwrap();
    let steps = ["--max-steps", "30"];
    let wgpu = ddprun_mnist(
        2,
        cache.path(),
        &[&["--backend", "wgpu"][..], &steps].concat(),
    );
    let cpu = ddprun_mnist(
        2,
        cache.path(),
        &[&["--backend", "cpu"][..], &steps].concat(),
    );
    let (w, c) = (summaries(&wgpu), summaries(&cpu));
    assert_eq!(w.len(), 2, "{}", text(&wgpu));
    assert_eq!(w[0]["steps"], 30);
    // The host path gave both ranks the same averaged gradients: the same bits.
    assert_eq!(w[0]["params_hash"], w[1]["params_hash"], "{}", text(&wgpu));
    // The gradients went through DDP (buckets all-reduced), not around it.
    assert!(w[0]["buckets"].as_u64().unwrap() > 0, "{}", text(&wgpu));
    // The same training, not the same bits: other kernels and rounding, and dropout masks drawn
    // by each backend's own generator from the same seed. Within 10 % of the mean loss (seen:
    // 1.087 on wgpu, 1.040 on the CPU; an untrained CNN is at 2.30).
    let (lw, lc) = (
        w[0]["train_loss"].as_f64().unwrap(),
        c[0]["train_loss"].as_f64().unwrap(),
    );
    eprintln!("mean training loss over 30 steps: wgpu {lw:.5}, cpu {lc:.5}");
    assert!(
        (lw - lc).abs() <= 0.10 * lc.abs().max(1e-3),
        "wgpu's loss {lw} is not close to the CPU's {lc}:\n{}",
        text(&wgpu)
    );
    assert!(lw.is_finite() && lw < 1.8, "wgpu did not train: {lw}");
}

#[test]
#[ignore = "needs a Vulkan device (Mesa's lavapipe: apt-get install mesa-vulkan-drivers; CI installs it and runs this)"]
fn a_second_process_finds_the_kernel_cache_of_the_first() {
    let cache = tempfile::tempdir().unwrap();
    let args = ["--backend", "wgpu", "--max-steps", "3"];
    let first = ddprun_mnist(1, cache.path(), &args);
    summaries(&first);
    let written = files(cache.path());
    let bytes: u64 = written.iter().map(|(_, n)| n).sum();
    // cubecl's database (compiled kernels and autotune results) under DDP_CACHE_DIR/cubecl.
    assert!(
        written
            .iter()
            .any(|(p, n)| p.starts_with(cache.path().join("cubecl")) && *n > 0),
        "nothing in the kernel cache {}: {written:?}\n{}",
        cache.path().display(),
        text(&first)
    );
    assert!(
        text(&first).contains(&format!(
            "kernel cache {}",
            cache.path().join("cubecl").display()
        )),
        "{}",
        text(&first)
    );
    let second = ddprun_mnist(1, cache.path(), &args);
    summaries(&second);
    let (cold, warm) = (first_step(&first), first_step(&second));
    eprintln!(
        "kernel cache: {} files, {bytes} bytes after the first process; first step {cold:.1} s \
         cold, {warm:.1} s with the cache",
        written.len()
    );
}
