//! `--backend wgpu` (feature `wgpu`): burn's cubecl kernels, fusion, autotune and the kernel
//! cache, with device tensors flowing through DDP, on a machine without a GPU. Mesa's lavapipe
//! (Debian's `mesa-vulkan-drivers`) gives wgpu a Vulkan device on the CPU; without a Vulkan
//! device these tests are reported as ignored with the reason, and CI (`.ci/run`), which
//! installs lavapipe, runs them.
//!
//! - The kernel cache: a first process fills `DDP_CACHE_DIR` (the database file is there, not
//!   empty); a second process with the same folder finds it (its first step is printed beside
//!   the first process's; the time is a figure for the note, not an assertion). Then, with that
//!   cache, two ranks train a few dozen steps on wgpu: their final parameters are bit-identical
//!   (the host gradient path all-reduces device tensors), and the loss is close to the CPU
//!   backend's run of the same steps (other kernels, other rounding: close, not equal). One
//!   test, so that lavapipe compiles the CNN's kernels once.
//! - The device-tensor paths on `--backend vulkan` (wgpu pinned to the Vulkan API), in phases
//!   of one test that share a kernel cache under the target folder (only the first phase
//!   compiles): ZeRO stage 2 at 2 ranks ends bit-identical across ranks and with plain DDP's
//!   weights; a sharded run resumed from its epoch checkpoint ends where the uninterrupted one
//!   ends; each epoch's last partial batch is dropped (`--drop-last`, on by default on GPUs);
//!   an elastic job of two agents (`--nnodes 1:2`) whose node-1 rank kills itself after step
//!   4 goes on at world 1 from device tensors, and the rank its agent restarts is healed from
//!   rank 0 (weights, optimizer state, ZeRO's shards resharded) and ends with rank 0's bits,
//!   under DDP and under ZeRO stage 2; the elastic epoch drops its last partial step too.
//!   Evaluation pads its last partial batch to the training batch's rows (one shape) and
//!   counts every test sample once.
//! - `--backend metal` off Apple's systems is an error naming the backend (not ignored: it
//!   needs no device).

#![cfg(feature = "wgpu")]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod common;
mod mnist;

use common::text;
use serde_json::Value;

/// A bound against hangs: lavapipe compiles every kernel on the CPU (minutes the first time).
const DEADLINE: Duration = Duration::from_secs(1200);

/// The training samples of the elastic heal phase (no multiple of 32: see [`vulkan_heal`]).
const HEAL_SAMPLES: u64 = 15_400;

/// One Vulkan test at a time: each keeps both cores busy (lavapipe compiles and runs kernels on
/// the CPU), and the heal phase's restarted rank must start before the job ends.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds [`ONE_AT_A_TIME`] (a test that panicked while holding it poisons it; the next goes on).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// `train-mnist ARGS` on `nproc` ranks through ddprun, the kernel cache in `cache`.
fn ddprun_mnist(nproc: usize, cache: &Path, args: &[&str]) -> Output {
    let defaults = ["--test-samples", "256", "--batch-size", "32"];
    ddprun(nproc, cache, &[&defaults[..], args].concat())
}

/// `train-mnist ARGS` on `nproc` ranks through ddprun (`--json --verbose --threads 1`, the real
/// MNIST), the kernel cache in `cache`.
fn ddprun(nproc: usize, cache: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(common::workspace_bin("ddprun"));
    common::clear_launcher_env(&mut command);
    command.args(["--nproc-per-node", &nproc.to_string(), "--"]);
    train_mnist(&mut command, cache).args(args);
    common::output_with_deadline(&mut command, DEADLINE)
}

/// Adds `train-mnist --json --verbose --threads 1` on the real MNIST to a ddprun `command`, the
/// kernel cache in `cache`.
fn train_mnist<'a>(command: &'a mut Command, cache: &Path) -> &'a mut Command {
    command
        .arg(env!("CARGO_BIN_EXE_train-mnist"))
        .arg("--data-dir")
        .arg(mnist::real_mnist())
        .args([
            "--json",
            "--verbose",
            "--threads",
            "1",
            "--log-interval",
            "10",
        ])
        .env("DDP_CACHE_DIR", cache)
}

/// The kernel cache the device-tensor test's phases share, under the build's target folder:
/// filled by the first phase (or an earlier run of the test), found by the later ones.
fn shared_cache() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wgpu-kernel-cache");
    std::fs::create_dir_all(&dir).unwrap();
    dir
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
fn the_kernel_cache_is_found_by_a_second_process_and_two_ranks_are_bit_identical() {
    let _alone = one_at_a_time();
    // One cold compile of the CNN's kernels (minutes on lavapipe), shared by both halves: a first
    // process fills the empty cache, a second finds it, and the two ranks then read the settled
    // cache (a process tuning a kernel itself may pick another variant than its peer's).
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

    // Two ranks train a few dozen steps on wgpu, then on the CPU backend.
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

/// The phases of [`device_tensors_on_vulkan_shard_checkpoint_and_resume`]: one MLP run of
/// `epochs` epochs at 2 ranks on Vulkan, each rank's summary checked against the other's.
fn vulkan_run(cache: &Path, epochs: &str, args: &[&str]) -> Value {
    let small = [
        "--backend",
        "vulkan",
        "--model",
        "mlp",
        "--train-samples",
        "520",
        // 68 test samples a rank: two batches of 32 and a last one of 4, which evaluation
        // pads to 32 rows on a GPU backend (no kernel tuned for a second shape).
        "--test-samples",
        "136",
        "--batch-size",
        "32",
        "--epochs",
        epochs,
    ];
    let start = std::time::Instant::now();
    let out = ddprun(2, cache, &[&small[..], args].concat());
    let s = summaries(&out);
    let all = text(&out);
    eprintln!(
        "vulkan, {epochs} epoch(s) {args:?}: {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert!(all.contains("wgpu's default adapter on Vulkan"), "{all}");
    assert!(
        all.contains("8 steps per epoch; the last partial batch of 4 dropped"),
        "{all}"
    );
    assert_eq!(s.len(), 2, "{all}");
    // The padded rows are not counted: every test sample once.
    assert_eq!(s[0]["test_total"], 136, "{all}");
    // The ranks stepped the same replica (for ZeRO: each its shard, then the all-gather).
    assert_eq!(s[0]["params_hash"], s[1]["params_hash"], "{all}");
    s[0].clone()
}

/// The heal phase of [`device_tensors_on_vulkan_shard_checkpoint_resume_and_heal`]: two
/// ddprun agents of a `1:2` elastic job (one rank each) train the MLP on Vulkan; node 1's
/// rank kills itself after step 4 (`DDP_TEST_KILL_AT_STEP`), rank 0 goes on alone, node 1's
/// agent restarts its rank, which joins at a step boundary and is healed from rank 0's device
/// tensors. Returns both agents' output, node 0's first.
fn vulkan_heal(cache: &Path, args: &[&str]) -> [String; 2] {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let agent = |node: usize| {
        let mut command = Command::new(common::workspace_bin("ddprun"));
        common::clear_launcher_env(&mut command);
        command
            .args(["--grace-period", "1", "--nnodes", "1:2", "--node-rank"])
            .arg(node.to_string())
            .args(["--master-addr", "127.0.0.1", "--master-port"])
            .arg(port.to_string())
            .args(["--max-restarts", &node.to_string(), "--"]);
        train_mnist(&mut command, cache)
            .args([
                "--backend",
                "vulkan",
                "--model",
                "mlp",
                "--batch-size",
                "32",
            ])
            // ~240 steps at world 2, or ~480 at world 1 (~35 ms each here, ~17 s): the
            // restarted rank finds the job running (its kernels are in the cache, but lavapipe
            // compiles their pipelines again in every process: 21 s seen under another
            // test's load, with 7720 samples then, and the job had finished). HEAL_SAMPLES is
            // no multiple of 32: the epoch's last step would be partial, and is dropped.
            .args([
                "--train-samples",
                HEAL_SAMPLES.to_string().as_str(),
                "--test-samples",
                "128",
                "--epochs",
                "1",
            ])
            .args(args)
            .env("DDP_TEST_KILL_AT_STEP", "4")
            .env("DDP_TEST_KILL_RANK", "1")
            // Founded by both ranks, however unevenly they start (each compiles its kernels
            // first): not by rank 0 alone, with rank 1 healed in at once and never killed.
            .env("DDP_ELASTIC_LAST_CALL", "120")
            .env("RUST_LOG", "warn");
        std::thread::spawn(move || common::output_with_deadline(&mut command, DEADLINE))
    };
    let start = std::time::Instant::now();
    let runs = [agent(0), agent(1)].map(|t| t.join().unwrap());
    eprintln!(
        "vulkan, elastic kill and heal {args:?}: {:.1} s",
        start.elapsed().as_secs_f64()
    );
    runs.map(|out| {
        let all = text(&out);
        assert!(out.status.success(), "an agent failed:\n{all}");
        all
    })
}

/// The last `DDP_ELASTIC_SUMMARY` in `all`.
fn elastic_summary(all: &str) -> Value {
    let json = all
        .lines()
        .rev()
        .find_map(|l| l.split_once("DDP_ELASTIC_SUMMARY ").map(|(_, j)| j))
        .unwrap_or_else(|| panic!("no elastic summary in:\n{all}"));
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{e}: {json}"))
}

#[test]
#[ignore = "needs a Vulkan device (Mesa's lavapipe: apt-get install mesa-vulkan-drivers; CI installs it and runs this)"]
fn device_tensors_on_vulkan_shard_checkpoint_resume_and_heal() {
    let _alone = one_at_a_time();
    let cache = shared_cache();
    // A cold cache is filled first, by a short run of every kernel shape the phases use: a
    // process that tunes a kernel itself may pick another variant (another rounding) than the
    // one the cache then holds (seen: ZeRO 2 off DDP's bits by a cold DDP run). The phases
    // compared below all read the settled cache.
    vulkan_run(&cache, "1", &["--zero-stage", "2", "--max-steps", "3"]);
    // 520 samples on 2 ranks in batches of 32: 8 steps an epoch, the last partial batch (4
    // samples) dropped by default on a GPU backend (no kernel tuned for a second shape).
    let ddp = vulkan_run(&cache, "2", &[]);
    assert_eq!(ddp["steps"], 16);
    // The gradients went through DDP's buckets (the host path), not around them.
    assert!(ddp["buckets"].as_u64().unwrap() > 0, "{ddp}");
    let zero = vulkan_run(&cache, "2", &["--zero-stage", "2"]);
    assert_eq!(
        zero["params_hash"], ddp["params_hash"],
        "ZeRO stage 2 on Vulkan did not end with DDP's weights"
    );
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().to_str().unwrap();
    let sharded = ["--zero-stage", "2", "--checkpoint-dir", ck];
    let first = vulkan_run(&cache, "1", &sharded);
    assert_eq!(first["epochs"], 1);
    assert_ne!(first["params_hash"], zero["params_hash"]);
    let resumed = vulkan_run(&cache, "2", &[&sharded[..], &["--resume"]].concat());
    assert_eq!(resumed["steps"], zero["steps"]);
    assert_eq!(
        resumed["params_hash"], zero["params_hash"],
        "the run resumed on Vulkan from its checkpoint ended with other weights"
    );
    // Elastic: a rank lost and healed back from device tensors, under DDP and ZeRO stage 2.
    for args in [&[][..], &["--zero-stage", "2"][..]] {
        let [node0, node1] = vulkan_heal(&cache, args);
        assert!(
            node1.contains("restarting it alone to rejoin the elastic job"),
            "{node1}"
        );
        assert!(node1.contains("joined (healed from rank 0)"), "{node1}");
        let (s0, s1) = (elastic_summary(&node0), elastic_summary(&node1));
        // Rank 0 went on alone after the loss and grew back to 2: two membership changes, no
        // sample trained twice, no step repeated; every step full (--drop-last, the default
        // on a GPU backend: one batch shape), the tail of less than a step of 2 x 32 left.
        let changes = s0["changes"].as_array().unwrap();
        assert_eq!(changes.len(), 2, "{s0}");
        assert_eq!(
            (&changes[0]["after_step"], &changes[0]["world"]),
            (&4.into(), &1.into())
        );
        assert_eq!(changes[1]["world"], 2, "{s0}");
        assert_eq!(s0["steps_repeated"], 0, "{s0}");
        assert_eq!(s0["epochs"][0]["max_count"], 1, "{s0}");
        let trained = s0["epochs"][0]["trained"].as_u64().unwrap();
        assert!(
            trained % 32 == 0 && trained < HEAL_SAMPLES && HEAL_SAMPLES - trained < 64,
            "{trained} samples trained of {HEAL_SAMPLES}: {s0}"
        );
        assert_eq!(s1["healed_at_start"], true, "{s1}");
        // The healed rank ends with rank 0's weights, bit for bit.
        assert_eq!(
            s0["summary"]["params_hash"], s1["summary"]["params_hash"],
            "the rank healed on Vulkan {args:?} ended with other weights:\n{node0}\n{node1}"
        );
    }
}

#[test]
#[cfg(not(target_vendor = "apple"))]
fn backend_metal_off_apple_systems_is_an_error_naming_it() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_train-mnist"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--backend", "metal", "--max-steps", "1", "--threads", "1"])
        .arg("--data-dir")
        .arg(mnist::real_mnist());
    let out = common::output_with_deadline(&mut command, DEADLINE);
    let all = text(&out);
    assert!(!out.status.success(), "{all}");
    assert!(
        all.contains("--backend metal: Metal is Apple's graphics API"),
        "{all}"
    );
}
