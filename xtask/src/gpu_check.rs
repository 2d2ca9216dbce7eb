//! `cargo xtask gpu-check`: what only a machine with an NVIDIA GPU shows, in one command, every
//! row under its own time limit (a row that fails or runs out of time is reported and the next
//! one runs; the task fails at the end if any row failed).
//!
//! 1. **probe**: `nvidia-smi -L` must list GPUs (else it stops at once with "no NVIDIA driver
//!    found", before building anything); `ddp-nccl-bench --probe` names the driver, NVRTC and
//!    NCCL files it loaded, the GPU count and the NCCL version.
//! 2. **nccl-N**: `ddprun --nproc-per-node N -- ddp-nccl-bench` at every world size the GPUs
//!    allow (every collective's result checked exactly; all-reduce timed per size), and two
//!    ranks on GPU 0 when the NCCL is 2.30 or newer (`NCCL_MULTI_RANK_GPU_ENABLE=1`, older ones
//!    refuse two ranks on one GPU).
//! 3. **cold**: `train-mnist --backend cuda`, one epoch, in a process whose kernel cache is empty
//!    (burn compiles every kernel through NVRTC and autotunes): the time to its first step (the
//!    row passes once the first step is done, even where the limit stops the epoch).
//! 4. **warm**: a second process with the cache the first one filled, two epochs: the time to its
//!    first step, and samples/s of the second epoch (from `metrics.csv`).
//! 5. **torch**: PyTorch's epoch on the same GPU and batch (`xtask/scripts/torch_mnist_epoch.py`,
//!    one untimed epoch first) when a python with torch and CUDA is at hand (`$DDP_PYTHON`, else
//!    `~/.cache/torchenv/bin/python`, else `python3`), and the ratio of the warm epoch to it.
//! 6. **two-ranks** / **one-rank**: two ranks sharing GPU 0 (their gradients through NCCL on the
//!    GPU where NCCL allows two ranks per GPU, else through the host), against one rank, the
//!    same steps: the time DDP adds per step. Where NCCL ran, the same two ranks through the
//!    host path must end with bit-identical parameters (the reduced gradients of every step
//!    agree, and so did the first broadcast).
//! 7. **kill**: the same two ranks, rank 1 killed after step 40: ddprun must fail, naming rank 1
//!    as the first rank to fail, and rank 0 must name its peer.
//! 8. **device-f32** / **device-bf16**: the device gradient path (resolve, one sync, NCCL, back
//!    into burn's fusion) at one rank (`DDP_NCCL=1`), f32 and bf16 buckets; f32 is compared bit
//!    for bit with the host path's one-rank run (reported, not required: GPU kernels may reduce
//!    in another order from run to run).
//! 9. **mnist-N**: with several GPUs, one rank per GPU, gradients through NCCL.
//! 10. From NCCL 2.30, on one GPU: **ddp-nccl**, two ranks through NCCL for two epochs (samples/s
//!     of the second, synchronisation per step beside the host path's); **torch-2**, PyTorch
//!     DDP at two ranks on the same GPU and batch (torchrun, NCCL: the carried one preloaded);
//!     **elastic-nccl**, a `1:2` elastic job on GPU 0 through NCCL whose rank 1 is killed after
//!     step 40 and healed back (a communicator made at each new world). The **kill** row also
//!     times the kill to ddprun's exit.
//!
//! `--nccl-dir DIR` uses the `libnccl.so.2` in DIR (NCCL 2.32.3 carried to a lent machine whose
//! own is older, `xtask/py/nccl_for_one_arch.py`): first on `LD_LIBRARY_PATH` of every process,
//! preloaded into PyTorch's; the probe row checks that the loader took it.
//!
//! With `$DDP_BIN_DIR` set, nothing is built: the binaries are taken from there. This is how a
//! lent GPU machine without cargo or network runs it, from the repository's root, with `xtask`
//! copied beside the GPU build's binaries:
//!
//! ```text
//! DDP_BIN_DIR=BINS BINS/xtask gpu-check --out OUT --data-dir MNIST
//! ```
//!
//! A machine whose only NVRTC is CUDA 13's
//! (`libnvrtc.so.13`) gets it offered as `libnvrtc.so`, the name the CUDA 12 bindings open
//! (docs/gpu.md, first contact). Results go to `target/gpu-check/` (or `--out`): every row's
//! log, `gpu-check.md` (printed at the end) and `gpu-check.json`.

use std::fmt::Write as _;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::size::human_size;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::util;

/// Arguments of `cargo xtask gpu-check`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// All-reduce sizes, comma separated; K, M, G suffixes are powers of 1024.
    #[arg(long, default_value = "4K,64K,1M,16M,64M,256M")]
    sizes: String,
    /// Timed iterations per all-reduce size.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Use at most this many GPUs.
    #[arg(long)]
    max_gpus: Option<usize>,
    /// MNIST folder [default: $DDP_DATA_DIR/mnist, else ~/.cache/ddp-rs/mnist]; train-mnist
    /// fetches the files when they are missing.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Batch size per rank (ours and PyTorch's).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Steps of the two-rank, one-rank and device-path runs.
    #[arg(long, default_value_t = 300)]
    steps: u64,
    /// Seconds the cold process may take (it compiles every kernel).
    #[arg(long, default_value_t = 330)]
    cold_limit: u64,
    /// Kernel cache of the run, emptied first [default: ddp-gpu-check-cache in the temporary
    /// folder].
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Do not run the PyTorch comparison even if torch is available.
    #[arg(long)]
    no_torch: bool,
    /// Folder for the results [default: target/gpu-check].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Folder of the `libnccl.so.2` to use instead of the machine's (NCCL 2.32.3 carried to a
    /// lent machine: `xtask/py/nccl_for_one_arch.py --join`): first on `LD_LIBRARY_PATH` for
    /// every process, and preloaded into PyTorch's; the probe row fails unless the loader took
    /// it.
    #[arg(long)]
    nccl_dir: Option<PathBuf>,
}

/// One size of `ddp-nccl-bench`'s JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SizeResult {
    bytes: usize,
    iters: usize,
    median_s: f64,
    min_s: f64,
    algbw_gbs: f64,
    busbw_gbs: f64,
}

/// `ddp-nccl-bench`'s JSON for one world size.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct BenchReport {
    world_size: usize,
    nccl_version: String,
    results: Vec<SizeResult>,
}

/// One row of the report: a check, whether it passed, how long it took, what it measured.
#[derive(Debug, Serialize)]
struct Row {
    name: String,
    ok: bool,
    seconds: f64,
    figures: String,
}

/// The figures the issue's goals are about.
#[derive(Debug, Default, Serialize)]
struct Goals {
    /// Seconds to the first step of a process with an empty kernel cache (`None`: it did not
    /// get there within its limit).
    cold_first_step_s: Option<f64>,
    /// The same for a second process with the cache the first one filled.
    warm_first_step_s: Option<f64>,
    /// Our samples/s on one GPU divided by PyTorch's (timed epochs after warm-up).
    ratio_to_torch: Option<f64>,
    /// How the two ranks on one GPU reduced their gradients: "nccl" or "host".
    two_rank_path: Option<String>,
    /// Milliseconds of gradient synchronisation per step at two ranks (rank 0).
    ddp_ms_per_step: Option<f64>,
    /// The same through the host path, where the two ranks also ran through NCCL.
    host_ms_per_step: Option<f64>,
    /// Samples/s of our two ranks on one GPU through NCCL (both ranks, the timed epoch).
    two_rank_samples_per_sec: Option<f64>,
    /// The same for PyTorch DDP (torchrun, NCCL) on the same GPU and batch.
    torch_two_rank_samples_per_sec: Option<f64>,
    /// Seconds from a rank's SIGKILL to ddprun's exit naming it.
    kill_named_s: Option<f64>,
}

/// What `gpu-check.json` holds.
#[derive(Debug, Serialize)]
struct Report {
    gpus: Vec<String>,
    /// The probe's line naming the driver and NCCL files loaded.
    libraries: String,
    nccl_version: String,
    rows: Vec<Row>,
    allreduce: Vec<BenchReport>,
    goals: Goals,
}

/// A process run under a time limit: its exit status (`None`: killed at the limit), its wall
/// time and its output (stdout and stderr together, also kept in a log file).
struct Limited {
    status: Option<ExitStatus>,
    seconds: f64,
    output: String,
    /// Seconds after the start at which the log first held the watched text (see
    /// [`run_watched`]), to 0.1 s.
    marker_s: Option<f64>,
}

impl Limited {
    /// Exited 0 within the limit.
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    /// How it ended, for a row.
    fn ending(&self, limit: u64) -> String {
        match self.status {
            None => format!("killed at its {limit} s limit"),
            Some(s) if s.success() => "exit 0".into(),
            Some(s) => format!("failed ({s})"),
        }
    }
}

/// Runs `command` in its own process group with its output in `log`; kills the whole group
/// when `limit` seconds have passed.
fn run_limited(command: &mut Command, limit: u64, log: &Path) -> Result<Limited> {
    run_watched(command, limit, log, None)
}

/// [`run_limited`], also noting when the log first holds `marker` (read every 100 ms).
fn run_watched(
    command: &mut Command,
    limit: u64,
    log: &Path,
    marker: Option<&str>,
) -> Result<Limited> {
    use std::os::unix::process::CommandExt as _;
    let file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    command
        .stdin(Stdio::null())
        .stdout(file.try_clone()?)
        .stderr(file)
        .process_group(0);
    eprintln!(
        "$ {}  (limit {limit} s, log {})",
        util::command_line(command),
        log.display()
    );
    let started = Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("starting `{}`", util::command_line(command)))?;
    let deadline = started + Duration::from_secs(limit);
    let mut marker_s = None;
    let status = loop {
        if let (Some(text), None) = (marker, marker_s) {
            if std::fs::read(log).is_ok_and(|b| String::from_utf8_lossy(&b).contains(text)) {
                marker_s = Some(started.elapsed().as_secs_f64());
            }
        }
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            // The whole group: ddprun and the ranks it started.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let seconds = started.elapsed().as_secs_f64();
    let output = String::from_utf8_lossy(&std::fs::read(log)?).into_owned();
    Ok(Limited {
        status,
        seconds,
        output,
        marker_s,
    })
}

/// A train-mnist run's result: how the process ended, and what it printed.
struct TrainerRun {
    run: Limited,
    /// "first step done T s after the trainer started" (rank 0).
    first_step_s: Option<f64>,
    /// The closing `DDP_SUMMARY` of rank 0.
    summary: Option<serde_json::Value>,
}

impl TrainerRun {
    /// A number of the summary.
    fn number(&self, key: &str) -> Option<f64> {
        self.summary.as_ref()?.get(key)?.as_f64()
    }

    /// Milliseconds of gradient synchronisation per step (rank 0's summary).
    fn sync_ms_per_step(&self) -> Option<f64> {
        self.number("comm_seconds")
            .zip(self.number("steps"))
            .map(|(s, n)| 1000.0 * s / n.max(1.0))
    }

    /// The final parameters' hash.
    fn params_hash(&self) -> Option<&str> {
        self.summary.as_ref()?.get("params_hash")?.as_str()
    }

    /// The usual figures of a row: steps, samples/s, loss, accuracy, synchronisation time.
    fn figures(&self) -> String {
        let mut text = String::new();
        if let Some(first) = self.first_step_s {
            let _ = write!(text, "first step {first:.1} s; ");
        }
        if let (Some(steps), Some(sps)) = (self.number("steps"), self.number("samples_per_sec")) {
            let _ = write!(
                text,
                "{steps} steps, {sps:.0} samples/s, train loss {:.4}, test accuracy {:.2}%, \
                 gradient sync {:.2} s",
                self.number("train_loss").unwrap_or(f64::NAN),
                100.0 * self.number("test_accuracy").unwrap_or(f64::NAN),
                self.number("comm_seconds").unwrap_or(f64::NAN)
            );
        } else {
            text.push_str("no summary");
        }
        text
    }
}

/// What the trainer runs share.
struct Trainer<'a> {
    bin_dir: &'a Path,
    out: &'a Path,
    data_dir: &'a Path,
    batch_size: usize,
    cache: &'a Path,
}

impl Trainer<'_> {
    /// `ddprun --nproc-per-node nproc -- train-mnist --backend cuda ...` with `env` and `args`,
    /// under `limit` seconds; its log is `<out>/<name>.log`.
    fn run(
        &self,
        name: &str,
        nproc: usize,
        env: &[(&str, &str)],
        args: &[String],
        limit: u64,
    ) -> Result<TrainerRun> {
        self.run_watched(name, nproc, env, args, limit, None)
    }

    /// [`Trainer::run`], noting when the output first holds `marker`.
    fn run_watched(
        &self,
        name: &str,
        nproc: usize,
        env: &[(&str, &str)],
        args: &[String],
        limit: u64,
        marker: Option<&str>,
    ) -> Result<TrainerRun> {
        let mut command = Command::new(self.bin_dir.join("ddprun"));
        command
            .args(["--nproc-per-node", &nproc.to_string(), "--"])
            .arg(self.bin_dir.join("train-mnist"))
            .args(["--backend", "cuda", "--json", "--log-interval", "100"])
            .args(["--batch-size", &self.batch_size.to_string()])
            .arg("--data-dir")
            .arg(self.data_dir)
            .args(args)
            .env("DDP_CACHE_DIR", self.cache);
        for (key, value) in env {
            command.env(key, value);
        }
        let log = self.out.join(format!("{name}.log"));
        let run = run_watched(&mut command, limit, &log, marker)?;
        let first_step_s = run.output.lines().find_map(first_step);
        let summary = run
            .output
            .lines()
            .filter_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, json)| json))
            .filter_map(|json| serde_json::from_str(json).ok())
            .next_back();
        Ok(TrainerRun {
            run,
            first_step_s,
            summary,
        })
    }
}

/// The seconds of a "first step done T s after the trainer started" line.
fn first_step(line: &str) -> Option<f64> {
    let (_, rest) = line.split_once("first step done ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// Whether NCCL `version` ("2.30.1") lets two ranks share one GPU
/// (`NCCL_MULTI_RANK_GPU_ENABLE`, new in 2.30).
fn allows_two_ranks_per_gpu(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (2, 30)
}

/// `cargo xtask gpu-check`.
pub fn run(args: Args) -> Result<()> {
    let listed = nvidia_gpus()?;
    eprintln!("nvidia-smi lists {} GPU(s)", listed.len());
    let out = match &args.out {
        Some(out) => out.clone(),
        None => util::target_dir()?.join("gpu-check"),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let bin_dir = util::build_release_bins(
        &["ddprun", "ddp-nccl-bench", "train-mnist"],
        &["ddp-apps/cuda"],
    )?;
    offer_nvrtc13()?;
    if let Some(dir) = &args.nccl_dir {
        anyhow::ensure!(
            dir.join("libnccl.so.2").is_file(),
            "--nccl-dir {}: no libnccl.so.2 there",
            dir.display()
        );
        let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        std::env::set_var("LD_LIBRARY_PATH", format!("{}:{old}", dir.display()));
    }
    if std::env::var_os("VIRTUAL_ENV").is_none() {
        // The loader looks for NCCL in the active venv's NVIDIA wheels: the torch python's.
        if let Ok(prefix) = util::run_stdout(
            Command::new(util::torch_python()).args(["-c", "import sys; print(sys.prefix)"]),
        ) {
            std::env::set_var("VIRTUAL_ENV", prefix.trim());
        }
    }

    let started = Instant::now();
    let mut rows = Vec::new();
    let mut goals = Goals::default();
    let (gpus, nccl_version, libraries) = probe(&bin_dir)?;
    eprintln!("{libraries}");
    let max = args.max_gpus.unwrap_or(gpus).min(gpus).max(1);
    let shared_nccl = allows_two_ranks_per_gpu(&nccl_version);
    // The carried NCCL must be the one the loader took.
    let carried = args.nccl_dir.as_ref().map(|dir| {
        let file = dir.join("libnccl.so.2");
        let taken = libraries.contains(&file.display().to_string());
        (file, taken)
    });
    push(
        &mut rows,
        Row {
            name: "probe".into(),
            ok: carried.as_ref().is_none_or(|(_, taken)| *taken),
            seconds: started.elapsed().as_secs_f64(),
            figures: format!(
                "{gpus} GPU(s), NCCL {nccl_version} ({}two ranks per GPU){}",
                if shared_nccl { "" } else { "before 2.30: no " },
                match &carried {
                    Some((file, true)) => format!("; the carried {} was taken", file.display()),
                    Some((file, false)) => format!(
                        "; the carried {} was NOT taken: {libraries}",
                        file.display()
                    ),
                    None => String::new(),
                }
            ),
        },
    );

    // NCCL's collectives, checked and timed, at every world size the GPUs allow, and two ranks
    // on GPU 0 where NCCL allows it.
    let mut allreduce = Vec::new();
    let mut worlds: Vec<(usize, bool)> = (1..=max).map(|w| (w, false)).collect();
    if max == 1 && shared_nccl {
        worlds.push((2, true));
    }
    for (world, shared) in worlds {
        let name = format!("nccl-{world}{}", if shared { "-on-gpu0" } else { "" });
        let json = out.join(format!("{name}.json"));
        let _ = std::fs::remove_file(&json);
        let mut command = Command::new(bin_dir.join("ddprun"));
        command
            .args(["--nproc-per-node", &world.to_string(), "--"])
            .arg(bin_dir.join("ddp-nccl-bench"))
            .args(["--sizes", &args.sizes, "--iters", &args.iters.to_string()])
            .arg("--json")
            .arg(&json);
        if shared {
            shared_gpu_env(&mut command);
        }
        let run = run_limited(&mut command, 120, &out.join(format!("{name}.log")))?;
        let report = std::fs::read_to_string(&json)
            .ok()
            .and_then(|text| serde_json::from_str::<BenchReport>(&text).ok());
        let figures = match (&report, report.as_ref().and_then(|r| r.results.last())) {
            (Some(_), Some(r)) => format!(
                "collectives exact; all-reduce {}: {:.1} us, busbw {:.2} GB/s",
                human_size(r.bytes),
                r.median_s * 1e6,
                r.busbw_gbs
            ),
            _ => format!("{}: {}", run.ending(120), tail(&run.output)),
        };
        push(
            &mut rows,
            Row {
                name,
                ok: run.ok() && report.is_some(),
                seconds: run.seconds,
                figures,
            },
        );
        allreduce.extend(report);
    }

    let data_dir = match &args.data_dir {
        Some(dir) => dir.clone(),
        // Where train-mnist keeps MNIST by default (it downloads it there if needed).
        None => {
            let out =
                util::run_stdout(Command::new(bin_dir.join("train-mnist")).arg("--fetch-data"))
                    .context("obtaining MNIST with train-mnist --fetch-data")?;
            PathBuf::from(out.trim())
        }
    };
    let cache = args
        .cache_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("ddp-gpu-check-cache"));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let trainer = Trainer {
        bin_dir: &bin_dir,
        out: &out,
        data_dir: &data_dir,
        batch_size: args.batch_size,
        cache: &cache,
    };
    let strings = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();

    // Start: a cold process (empty cache), then a warm one (the same cache), whose second epoch
    // is the speed figure.
    let cold = trainer.run(
        "cold",
        1,
        &[],
        &strings(&["--epochs", "1"]),
        args.cold_limit,
    )?;
    goals.cold_first_step_s = cold.first_step_s;
    let (files, bytes) = folder_size(&cache);
    push(
        &mut rows,
        Row {
            name: "cold".into(),
            // The row is about the first step: a cold process still compiling the epoch's
            // other shapes at its limit has done what the row measures.
            ok: cold.first_step_s.is_some() && cold.run.status.is_none_or(|s| s.success()),
            seconds: cold.run.seconds,
            figures: format!(
                "{}; {}; kernel cache {files} files, {}",
                cold.run.ending(args.cold_limit),
                cold.figures(),
                human_size(bytes as usize)
            ),
        },
    );
    let metrics = out.join("warm-metrics");
    let _ = std::fs::remove_dir_all(&metrics);
    let mut warm_args = strings(&["--epochs", "2", "--metrics-dir"]);
    warm_args.push(metrics.display().to_string());
    let warm = trainer.run("warm", 1, &[], &warm_args, 150)?;
    goals.warm_first_step_s = warm.first_step_s;
    let (epoch2, epoch2_text) = second_epoch(&metrics);
    push(
        &mut rows,
        Row {
            name: "warm".into(),
            ok: warm.run.ok() && epoch2.is_ok(),
            seconds: warm.run.seconds,
            figures: format!(
                "{}; {}; epoch 2: {epoch2_text}",
                warm.run.ending(150),
                warm.figures(),
            ),
        },
    );

    if args.no_torch {
        push(
            &mut rows,
            Row {
                name: "torch".into(),
                ok: true,
                seconds: 0.0,
                figures: "skipped: --no-torch".into(),
            },
        );
    } else {
        let row = torch_row(&out, &data_dir, args.batch_size, 1, &None)?;
        if let (Some(theirs), Ok(ours)) = (row.1, &epoch2) {
            goals.ratio_to_torch = Some(ours / theirs);
        }
        push(&mut rows, row.0);
    }

    // Two ranks on GPU 0 against one rank: NCCL on the GPU where it allows two ranks per GPU,
    // else the host path.
    let steps = args.steps.to_string();
    let short = strings(&["--max-steps", &steps, "--test-samples", "2000"]);
    let path = if shared_nccl { "nccl" } else { "host" };
    goals.two_rank_path = Some(path.into());
    let two_env: Vec<(&str, &str)> = if shared_nccl {
        vec![
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("DDP_NCCL", "1"),
            ("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
            ("NCCL_MAX_CTAS", "4"),
        ]
    } else {
        vec![("CUDA_VISIBLE_DEVICES", "0"), ("DDP_NCCL", "0")]
    };
    let two = trainer.run("two-ranks", 2, &two_env, &short, 150)?;
    let one = trainer.run("one-rank", 1, &[("DDP_NCCL", "0")], &short, 120)?;
    let per_step = |run: &TrainerRun, world: f64| {
        run.number("samples_per_sec")
            .map(|sps| 1000.0 * world * args.batch_size as f64 / sps)
    };
    let sync_ms = two.sync_ms_per_step();
    goals.ddp_ms_per_step = sync_ms;
    push(
        &mut rows,
        Row {
            name: format!("two-ranks ({path})"),
            ok: two.run.ok() && two.summary.is_some(),
            seconds: two.run.seconds,
            figures: format!(
                "{}; {}; step {} ms; gradient sync {} ms/step",
                two.run.ending(150),
                two.figures(),
                per_step(&two, 2.0).map_or("?".into(), |ms| format!("{ms:.2}")),
                sync_ms.map_or("?".into(), |ms| format!("{ms:.2}"))
            ),
        },
    );
    push(
        &mut rows,
        Row {
            name: "one-rank".into(),
            ok: one.run.ok() && one.summary.is_some(),
            seconds: one.run.seconds,
            figures: format!(
                "{}; {}; step {} ms",
                one.run.ending(120),
                one.figures(),
                per_step(&one, 1.0).map_or("?".into(), |ms| format!("{ms:.2}"))
            ),
        },
    );
    if shared_nccl {
        // The same job through the host: the same bits at the end.
        let host = trainer.run(
            "two-ranks-host",
            2,
            &[("CUDA_VISIBLE_DEVICES", "0"), ("DDP_NCCL", "0")],
            &short,
            150,
        )?;
        let same = host.params_hash().is_some() && host.params_hash() == two.params_hash();
        goals.host_ms_per_step = host.sync_ms_per_step();
        push(
            &mut rows,
            Row {
                name: "nccl-equals-host".into(),
                ok: host.run.ok() && same,
                seconds: host.run.seconds,
                figures: format!(
                    "final parameters: NCCL {} / host {} ({})",
                    two.params_hash().unwrap_or("?"),
                    host.params_hash().unwrap_or("?"),
                    if same { "bit-identical" } else { "DIFFERENT" }
                ),
            },
        );
        // Speed at two ranks through NCCL (a timed epoch), PyTorch DDP beside it, and an
        // elastic job whose communicator is made again at every new world.
        let (row, rate) = ddp_nccl_row(&trainer, &two_env)?;
        goals.two_rank_samples_per_sec = rate;
        push(&mut rows, row);
        if !args.no_torch {
            let (row, rate) = torch_row(&out, &data_dir, args.batch_size, 2, &args.nccl_dir)?;
            goals.torch_two_rank_samples_per_sec = rate;
            push(&mut rows, row);
        }
        push(&mut rows, elastic_nccl_row(&trainer)?);
    }

    // A rank killed mid-step: ddprun fails and names it; the survivor names its peer.
    let mut kill_env = two_env.clone();
    kill_env.extend([("DDP_TEST_KILL_AT_STEP", "40"), ("DDP_TEST_KILL_RANK", "1")]);
    let kill = trainer.run_watched(
        "kill",
        2,
        &kill_env,
        &short,
        120,
        Some("test hook DDP_TEST_KILL_AT_STEP"),
    )?;
    // From the kill (the hook's line) to ddprun's exit, which comes after its box names rank 1.
    let named_s = kill.run.marker_s.map(|at| kill.run.seconds - at);
    goals.kill_named_s = named_s;
    let blamed = kill
        .run
        .output
        .lines()
        .find(|l| l.contains("rank 1") && l.contains("first rank to fail"));
    let survivor = kill
        .run
        .output
        .lines()
        .find(|l| l.contains("rank 0") && l.contains("rank 1") && !l.contains("test hook"));
    push(
        &mut rows,
        Row {
            name: "kill".into(),
            ok: kill.run.status.is_some_and(|s| !s.success())
                && blamed.is_some()
                && survivor.is_some(),
            seconds: kill.run.seconds,
            figures: format!(
                "{}; {}; ddprun: {}; rank 0: {}",
                kill.run.ending(120),
                named_s.map_or("(the hook's line was not seen)".into(), |s| format!(
                    "ddprun exited {s:.1} s after the kill"
                )),
                blamed.map_or("(rank 1 not named)".into(), clip),
                survivor.map_or("(no error naming rank 1)".into(), clip)
            ),
        },
    );

    // The device gradient path at one rank, f32 and bf16 buckets.
    for (name, hook) in [("device-f32", None), ("device-bf16", Some("bf16"))] {
        let mut device_args = short.clone();
        if let Some(hook) = hook {
            device_args.extend(["--comm-hook".to_string(), hook.to_string()]);
        }
        let device = trainer.run(name, 1, &[("DDP_NCCL", "1")], &device_args, 120)?;
        let loss_ok = device.number("train_loss").is_some_and(f64::is_finite);
        let same = device.params_hash().is_some() && device.params_hash() == one.params_hash();
        push(
            &mut rows,
            Row {
                name: name.into(),
                ok: device.run.ok() && loss_ok,
                seconds: device.run.seconds,
                figures: format!(
                    "{}; {}{}",
                    device.run.ending(120),
                    device.figures(),
                    if hook.is_none() {
                        format!(
                            "; parameters {} the host path's",
                            if same {
                                "bit-identical to"
                            } else {
                                "differ from"
                            }
                        )
                    } else {
                        String::new()
                    }
                ),
            },
        );
    }

    // Several GPUs: one rank each, gradients through NCCL.
    if max > 1 {
        let name = format!("mnist-{max}");
        let run = trainer.run(&name, max, &[], &strings(&["--epochs", "1"]), 300)?;
        push(
            &mut rows,
            Row {
                name,
                ok: run.run.ok() && run.summary.is_some(),
                seconds: run.run.seconds,
                figures: format!("{}; {}", run.run.ending(300), run.figures()),
            },
        );
    }

    let report = Report {
        gpus: listed,
        libraries,
        nccl_version,
        rows,
        allreduce,
        goals,
    };
    let markdown = markdown(&report);
    std::fs::write(out.join("gpu-check.md"), &markdown)?;
    std::fs::write(
        out.join("gpu-check.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    println!("{markdown}");
    println!(
        "results and logs in {} ({:.0} s in all)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    let failed: Vec<&str> = report
        .rows
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.name.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("gpu-check: failed rows: {}", failed.join(", "));
    }
    Ok(())
}

/// **ddp-nccl**: two ranks on GPU 0 through NCCL for two epochs; samples/s of the second (both
/// ranks' samples, from rank 0's `metrics.csv`) and the synchronisation per step.
fn ddp_nccl_row(trainer: &Trainer, env: &[(&str, &str)]) -> Result<(Row, Option<f64>)> {
    let metrics = trainer.out.join("ddp-nccl-metrics");
    let _ = std::fs::remove_dir_all(&metrics);
    let args = vec![
        "--epochs".to_string(),
        "2".to_string(),
        "--metrics-dir".to_string(),
        metrics.display().to_string(),
    ];
    let run = trainer.run("ddp-nccl", 2, env, &args, 180)?;
    let (rate, rate_text) = second_epoch(&metrics);
    let row = Row {
        name: "ddp-nccl".into(),
        ok: run.run.ok() && rate.is_ok(),
        seconds: run.run.seconds,
        figures: format!(
            "{}; {}; epoch 2: {rate_text}; gradient sync {} ms/step",
            run.run.ending(180),
            run.figures(),
            run.sync_ms_per_step()
                .map_or("?".into(), |ms| format!("{ms:.2}"))
        ),
    };
    Ok((row, rate.ok()))
}

/// **elastic-nccl**: two ddprun agents of a `1:2` elastic job, one rank each, both on GPU 0 with
/// their gradients through NCCL; rank 1 kills itself after step 40, rank 0 goes on alone (a new
/// generation, a new communicator of one rank), rank 1's agent restarts it, and it is healed back
/// (a third generation, a communicator of two again). Both agents must exit 0 with the same
/// final parameters and two membership changes; the figure is the time from the kill to rank 0's
/// next step.
fn elastic_nccl_row(trainer: &Trainer) -> Result<Row> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let started = Instant::now();
    let agents: Vec<_> = (0..2)
        .map(|node: usize| {
            let mut command = Command::new(trainer.bin_dir.join("ddprun"));
            command
                .args(["--grace-period", "1", "--nnodes", "1:2", "--node-rank"])
                .arg(node.to_string())
                .args([
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    &port.to_string(),
                ])
                .args(["--max-restarts", &node.to_string(), "--"])
                .arg(trainer.bin_dir.join("train-mnist"))
                .args(["--backend", "cuda", "--json", "--log-interval", "100"])
                .args(["--batch-size", &trainer.batch_size.to_string()])
                .arg("--data-dir")
                .arg(trainer.data_dir)
                .args([
                    "--epochs",
                    "1",
                    "--train-samples",
                    "40000",
                    "--test-samples",
                    "2000",
                ])
                .env("DDP_CACHE_DIR", trainer.cache)
                .env("DDP_NCCL", "1")
                .env("DDP_TEST_KILL_AT_STEP", "40")
                .env("DDP_TEST_KILL_RANK", "1")
                // Founded by both ranks, however unevenly they start.
                .env("DDP_ELASTIC_LAST_CALL", "120");
            shared_gpu_env(&mut command);
            let log = trainer.out.join(format!("elastic-nccl-{node}.log"));
            std::thread::spawn(move || run_limited(&mut command, 240, &log))
        })
        .collect();
    let mut runs = Vec::new();
    for agent in agents {
        runs.push(
            agent
                .join()
                .map_err(|_| anyhow::anyhow!("an agent's thread panicked"))??,
        );
    }
    let summary = |run: &Limited| {
        run.output
            .lines()
            .filter_map(|l| l.split_once("DDP_ELASTIC_SUMMARY ").map(|(_, json)| json))
            .filter_map(|json| serde_json::from_str::<serde_json::Value>(json).ok())
            .next_back()
    };
    let (s0, s1) = (summary(&runs[0]), summary(&runs[1]));
    let changes = s0
        .as_ref()
        .and_then(|s| s["changes"].as_array().cloned())
        .unwrap_or_default();
    let hash = |s: &Option<serde_json::Value>| {
        s.as_ref()
            .and_then(|s| s["summary"]["params_hash"].as_str().map(str::to_string))
    };
    let same = hash(&s0).is_some() && hash(&s0) == hash(&s1);
    let healed = runs[1].output.contains("joined (healed from rank 0)");
    let on_gpu = runs[0]
        .output
        .contains("gradients all-reduced on the GPU through NCCL");
    // The hook's line ends with the kill's time (ms since the epoch), the change record holds
    // when the survivor's new generation formed.
    let killed_ms = runs[1]
        .output
        .lines()
        .find(|l| l.contains("test hook DDP_TEST_KILL_AT_STEP"))
        .and_then(|l| l.rsplit(" at ").next())
        .and_then(|ms| ms.trim().parse::<f64>().ok());
    let recovery = changes
        .first()
        .and_then(|c| c["at_ms"].as_f64())
        .zip(killed_ms)
        .map(|(formed, killed)| (formed - killed) / 1000.0);
    Ok(Row {
        name: "elastic-nccl".into(),
        ok: runs.iter().all(Limited::ok) && changes.len() == 2 && same && healed && on_gpu,
        seconds: started.elapsed().as_secs_f64(),
        figures: format!(
            "agents: {} / {}; {} membership change(s) ({}); rank 1 {}healed back; gradients {}\
             through NCCL; final parameters {}{}",
            runs[0].ending(240),
            runs[1].ending(240),
            changes.len(),
            changes
                .iter()
                .map(|c| format!("after step {} to world {}", c["after_step"], c["world"]))
                .collect::<Vec<_>>()
                .join(", "),
            if healed { "" } else { "NOT " },
            if on_gpu { "" } else { "NOT " },
            if same {
                "identical"
            } else {
                "DIFFERENT or missing"
            },
            recovery.map_or(String::new(), |s| format!(
                "; kill to the survivor's new generation {s:.2} s"
            ))
        ),
    })
}

/// Adds `row` to `rows` and prints it at once (a run cut short still shows its rows).
fn push(rows: &mut Vec<Row>, row: Row) {
    eprintln!(
        "ROW {} {} {:.1} s: {}",
        row.name,
        if row.ok { "ok" } else { "FAILED" },
        row.seconds,
        row.figures
    );
    rows.push(row);
}

/// NCCL's settings for two ranks on one GPU: both on GPU 0, NCCL told to allow it, and its
/// blocks per collective limited (NCCL's note: two ranks with unlimited CTAs can deadlock).
fn shared_gpu_env(command: &mut Command) {
    command
        .env("CUDA_VISIBLE_DEVICES", "0")
        .env("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        .env("NCCL_MAX_CTAS", "4");
}

/// The last lines of a log, for a row that failed.
fn tail(output: &str) -> String {
    let lines: Vec<&str> = output.lines().rev().take(3).collect();
    lines
        .into_iter()
        .rev()
        .map(clip)
        .collect::<Vec<_>>()
        .join(" / ")
}

/// `line` cut to 240 characters.
fn clip(line: &str) -> String {
    let line = line.trim();
    match line.char_indices().nth(240) {
        Some((at, _)) => format!("{}...", &line[..at]),
        None => line.to_string(),
    }
}

/// Files and bytes under `dir`.
fn folder_size(dir: &Path) -> (u64, u64) {
    let mut total = (0, 0);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return total;
    };
    for entry in entries.flatten() {
        match entry.file_type() {
            Ok(t) if t.is_dir() => {
                let (files, bytes) = folder_size(&entry.path());
                total = (total.0 + files, total.1 + bytes);
            }
            Ok(_) => {
                total.0 += 1;
                total.1 += entry.metadata().map_or(0, |m| m.len());
            }
            Err(_) => {}
        }
    }
    total
}

/// When the only NVRTC on the machine is CUDA 13's (`libnvrtc.so.13`: PyTorch's cu13 wheels, a
/// CUDA 13 toolkit), offers it to this build's CUDA 12 bindings under the name they open
/// (`libnvrtc.so`, in a folder put first on `LD_LIBRARY_PATH` for the processes started
/// here). NVRTC 13 compiled and ran every kernel of the CNN that way (docs/gpu.md).
fn offer_nvrtc13() -> Result<()> {
    let known = Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("libnvrtc.so.12"))
        .unwrap_or(false);
    let on_path = std::env::var("LD_LIBRARY_PATH").is_ok_and(|p| {
        p.split(':')
            .any(|d| !d.is_empty() && Path::new(d).join("libnvrtc.so.12").exists())
    });
    if known || on_path {
        return Ok(());
    }
    let script = "import glob, os, sys\n\
                  roots = [p for p in sys.path if p.endswith('site-packages')]\n\
                  roots += ['/usr/local/cuda/lib64', '/usr/lib/x86_64-linux-gnu']\n\
                  found = [f for r in roots for f in glob.glob(os.path.join(r, '**', \
                  'libnvrtc.so.1[23]*'), recursive=True) if 'builtins' not in f]\n\
                  print(sorted(found)[0] if found else '')";
    let found = util::run_stdout(Command::new(util::torch_python()).args(["-c", script]))
        .unwrap_or_default();
    let found = PathBuf::from(found.trim());
    if !found.is_file() {
        eprintln!("no libnvrtc.so.12 or .13 found; the trainer will say what to install");
        return Ok(());
    }
    let dir = std::env::temp_dir().join("ddp-gpu-check-nvrtc");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    std::os::unix::fs::symlink(&found, dir.join("libnvrtc.so"))?;
    let lib = found.parent().context("NVRTC's folder")?;
    for entry in std::fs::read_dir(lib)?.flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("libnvrtc-builtins.so") {
            std::os::unix::fs::symlink(entry.path(), dir.join(&name))?;
        }
    }
    let old = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    std::env::set_var("LD_LIBRARY_PATH", format!("{}:{old}", dir.display()));
    eprintln!("NVRTC offered as libnvrtc.so: {}", found.display());
    Ok(())
}

/// The GPUs `nvidia-smi -L` lists; the "no NVIDIA driver found" error when there is none.
fn nvidia_gpus() -> Result<Vec<String>> {
    let driver_dir = Path::new("/proc/driver/nvidia").exists();
    let output = match Command::new("nvidia-smi").arg("-L").output() {
        Ok(output) => output,
        Err(e) if !driver_dir => bail!(
            "no NVIDIA driver found: nvidia-smi cannot be run ({e}) and /proc/driver/nvidia does \
             not exist; gpu-check needs a machine with NVIDIA GPUs and their driver"
        ),
        Err(e) => bail!(
            "/proc/driver/nvidia exists but nvidia-smi cannot be run ({e}); put the driver's \
             tools on PATH"
        ),
    };
    if !output.status.success() {
        bail!(
            "no usable NVIDIA driver: `nvidia-smi -L` failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let gpus: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.starts_with("GPU "))
        .map(str::to_string)
        .collect();
    if gpus.is_empty() {
        bail!("the NVIDIA driver is loaded but nvidia-smi lists no GPU");
    }
    Ok(gpus)
}

/// GPU count, NCCL version and the libraries line from `ddp-nccl-bench --probe` (which finds
/// `libnccl.so.2` in the active venv's NVIDIA wheels or the system folders by itself).
fn probe(bin_dir: &Path) -> Result<(usize, String, String)> {
    let output = Command::new(bin_dir.join("ddp-nccl-bench"))
        .arg("--probe")
        .output()
        .context("running ddp-nccl-bench --probe")?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        bail!("ddp-nccl-bench --probe failed: {}{}", stdout, stderr.trim());
    }
    parse_probe(&stdout, &stderr)
}

/// The probe's answer: `gpus N nccl X.Y.Z` on stdout, the libraries line on stderr.
fn parse_probe(stdout: &str, stderr: &str) -> Result<(usize, String, String)> {
    let libraries = stderr
        .lines()
        .find(|l| l.starts_with("CUDA libraries: "))
        .with_context(|| format!("the probe named no libraries: {stderr:?}"))?
        .to_string();
    let line = stdout
        .lines()
        .find(|l| l.starts_with("gpus "))
        .with_context(|| format!("unexpected probe output {stdout:?}"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["gpus", n, "nccl", version] => Ok((n.parse()?, version.to_string(), libraries)),
        _ => bail!("unexpected probe output {line:?}"),
    }
}

/// The samples/s of the second epoch (the timed one, after burn's warm-up) in the
/// `metrics.csv` of `metrics`, and how a row shows it.
fn second_epoch(metrics: &Path) -> (Result<f64>, String) {
    let rate = std::fs::read_to_string(metrics.join("metrics.csv"))
        .context("no metrics.csv")
        .and_then(|csv| epoch_rate(&csv, 2));
    let text = match &rate {
        Ok(rate) => format!("{rate:.0} samples/s"),
        Err(e) => format!("{e:#}"),
    };
    (rate, text)
}

/// The samples/s of epoch `epoch` in a trainer's `metrics.csv` (columns as
/// `ddp_apps::metrics::CSV_COLUMNS`: `epoch` first, `samples_per_sec` by name).
fn epoch_rate(csv: &str, epoch: usize) -> Result<f64> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines
        .next()
        .context("metrics.csv is empty")?
        .split(',')
        .collect();
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h.trim() == name)
            .with_context(|| format!("metrics.csv has no {name} column: {header:?}"))
    };
    let (epoch_col, rate_col) = (column("epoch")?, column("samples_per_sec")?);
    for line in lines {
        let fields: Vec<&str> = line.split(',').collect();
        if fields
            .get(epoch_col)
            .and_then(|e| e.trim().parse::<usize>().ok())
            == Some(epoch)
        {
            let rate = fields
                .get(rate_col)
                .context("a short metrics.csv row")?
                .trim();
            return rate
                .parse::<f64>()
                .with_context(|| format!("samples_per_sec {rate:?} of epoch {epoch}"));
        }
    }
    bail!("metrics.csv has no row for epoch {epoch} (the timed epoch after the warm-up)")
}

/// PyTorch's epoch on GPU 0 as a row (`torch`), or at `ranks` ranks sharing GPU 0 through NCCL
/// under torchrun (`torch-N`, PyTorch DDP: the carried NCCL of `nccl_dir` preloaded), and its
/// samples/s; a skipped row (passing, saying why) where no python with torch and CUDA is at hand.
fn torch_row(
    out: &Path,
    data_dir: &Path,
    batch_size: usize,
    ranks: usize,
    nccl_dir: &Option<PathBuf>,
) -> Result<(Row, Option<f64>)> {
    let name = if ranks == 1 {
        "torch".to_string()
    } else {
        format!("torch-{ranks}")
    };
    let python = util::torch_python();
    let skipped = |why: String| Row {
        name: name.clone(),
        ok: true,
        seconds: 0.0,
        figures: format!("skipped: {why}"),
    };
    let probe = Command::new(&python)
        .args([
            "-c",
            "import torch; print(torch.__version__, torch.cuda.is_available())",
        ])
        .output();
    match probe {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("True") => {}
        Ok(o) if o.status.success() => {
            let why = format!("{}: torch sees no CUDA GPU", python.display());
            return Ok((skipped(why), None));
        }
        _ => {
            let why = format!("{} cannot import torch", python.display());
            return Ok((skipped(why), None));
        }
    }
    let script = util::workspace_root().join("xtask/scripts/torch_mnist_epoch.py");
    let mut command = Command::new(&python);
    if ranks > 1 {
        // PyTorch DDP under torchrun, every rank on GPU 0 as ours, with the carried NCCL
        // preloaded when there is one (torch's wheel links its own by name, and an older one
        // refuses two ranks per GPU).
        command
            .args([
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
            ])
            .arg(ranks.to_string());
        shared_gpu_env(&mut command);
        if let Some(dir) = nccl_dir {
            command.env("LD_PRELOAD", dir.join("libnccl.so.2"));
        }
    }
    command
        .arg(&script)
        .arg("--data-dir")
        .arg(data_dir)
        .args([
            "--device",
            "cuda:0",
            "--epochs",
            "1",
            "--warmup-epochs",
            "1",
        ])
        .args(["--batch-size", &batch_size.to_string()])
        .env("PYTHONUNBUFFERED", "1");
    let limit = 150 + 30 * ranks as u64;
    let run = run_limited(&mut command, limit, &out.join(format!("{name}.log")))?;
    let summary = run
        .output
        .lines()
        .find_map(|l| l.strip_prefix("TORCH_SUMMARY "))
        .and_then(|json| serde_json::from_str::<serde_json::Value>(json).ok());
    let rate = summary.as_ref().and_then(|s| s["samples_per_sec"].as_f64());
    let figures = match (&summary, rate) {
        (Some(s), Some(rate)) => format!(
            "PyTorch {}{}: epoch 2: {rate:.0} samples/s, test accuracy {:.2}%",
            s["torch"].as_str().unwrap_or("?"),
            match ranks {
                1 => String::new(),
                n => format!(
                    " DDP, {n} ranks on GPU 0, NCCL {}",
                    s["nccl"].as_str().unwrap_or("?")
                ),
            },
            100.0 * s["test_accuracy"].as_f64().unwrap_or(f64::NAN)
        ),
        _ => format!("{}: {}", run.ending(limit), tail(&run.output)),
    };
    let row = Row {
        name,
        ok: run.ok() && rate.is_some(),
        seconds: run.seconds,
        figures,
    };
    Ok((row, rate))
}

/// The report as Markdown.
fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# gpu-check\n");
    for gpu in &report.gpus {
        let _ = writeln!(md, "- {gpu}");
    }
    let _ = writeln!(md, "- {}", report.libraries);
    let _ = writeln!(md, "- NCCL {}\n", report.nccl_version);
    let _ = writeln!(md, "| row | ok | s | figures |\n| --- | --- | ---: | --- |");
    for row in &report.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {} |",
            row.name,
            if row.ok { "yes" } else { "**NO**" },
            row.seconds,
            row.figures.replace('|', "/")
        );
    }
    let g = &report.goals;
    let seconds = |s: Option<f64>| s.map_or("not reached".to_string(), |s| format!("{s:.1} s"));
    let met = |ok: bool| if ok { "met" } else { "not met" };
    let _ = writeln!(md, "\n## Goals\n");
    let _ = writeln!(
        md,
        "- first step, cold process (empty kernel cache): {} (goal <= 60 s: {})",
        seconds(g.cold_first_step_s),
        met(g.cold_first_step_s.is_some_and(|s| s <= 60.0))
    );
    let _ = writeln!(
        md,
        "- first step, warm process (the same cache): {} (goal <= 10 s: {})",
        seconds(g.warm_first_step_s),
        met(g.warm_first_step_s.is_some_and(|s| s <= 10.0))
    );
    match g.ratio_to_torch {
        Some(r) => {
            let _ = writeln!(
                md,
                "- ours / PyTorch on one GPU: {r:.2}x the samples per second (goal >= 1.0x: {})",
                met(r >= 1.0)
            );
        }
        None => {
            let _ = writeln!(md, "- ours / PyTorch: not measured");
        }
    }
    if let (Some(path), Some(ms)) = (&g.two_rank_path, g.ddp_ms_per_step) {
        let _ = writeln!(
            md,
            "- two ranks on one GPU through the {path} path: gradient sync {ms:.2} ms per step{}",
            match (path.as_str(), g.host_ms_per_step) {
                ("nccl", Some(host)) => format!(
                    " (host path: {host:.2} ms; goal <= 0.5 ms: {})",
                    met(ms <= 0.5)
                ),
                _ => String::new(),
            }
        );
    }
    if let (Some(ours), Some(theirs)) =
        (g.two_rank_samples_per_sec, g.torch_two_rank_samples_per_sec)
    {
        let _ = writeln!(
            md,
            "- two ranks on one GPU, ours / PyTorch DDP: {ours:.0} / {theirs:.0} samples/s, {:.2}x \
             (goal >= 1.0x: {})",
            ours / theirs,
            met(ours >= theirs)
        );
    }
    if let Some(s) = g.kill_named_s {
        let _ = writeln!(
            md,
            "- a killed rank named {s:.1} s after the kill (goal <= 10 s: {})",
            met(s <= 10.0)
        );
    }
    if !report.allreduce.is_empty() {
        let _ = writeln!(
            md,
            "\n## NCCL all-reduce (f32, sum; every result checked)\n"
        );
        let _ = writeln!(
            md,
            "| ranks | size | median (us) | algbw (GB/s) | busbw (GB/s) |\n| ---: | ---: | ---: | ---: | ---: |"
        );
        for bench in &report.allreduce {
            for r in &bench.results {
                let _ = writeln!(
                    md,
                    "| {} | {} | {:.1} | {:.2} | {:.2} |",
                    bench.world_size,
                    human_size(r.bytes),
                    r.median_s * 1e6,
                    r.algbw_gbs,
                    r.busbw_gbs
                );
            }
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timed_epoch_is_the_one_after_the_warm_up() {
        let csv = "epoch,step,train_loss,test_accuracy,test_loss,samples_per_sec,learning_rate,\
                   comm_seconds\n1,938,0.2,0.97,0.1,4100.5,0.001,0\n2,1876,0.1,0.98,0.05,9800.25,\
                   0.001,0\n";
        assert_eq!(epoch_rate(csv, 2).unwrap(), 9800.25);
        assert_eq!(epoch_rate(csv, 1).unwrap(), 4100.5);
        let e = epoch_rate(csv, 3).unwrap_err().to_string();
        assert!(e.contains("no row for epoch 3"), "{e}");
        assert!(epoch_rate("epoch,step\n2,5\n", 2).is_err());
    }

    #[test]
    fn the_probe_gives_the_gpus_the_version_and_the_libraries_line() {
        let stderr = "CUDA libraries: driver (CUDA 12.4) /usr/lib/libcuda.so.1 [system]; NCCL \
                      (2.21.5) /v/libnccl.so.2 [VIRTUAL_ENV=/v]\n";
        let (gpus, version, libraries) = parse_probe("gpus 4 nccl 2.21.5\n", stderr).unwrap();
        assert_eq!((gpus, version.as_str()), (4, "2.21.5"));
        assert!(libraries.ends_with("[VIRTUAL_ENV=/v]"), "{libraries}");
        assert!(parse_probe("gpus 4 nccl 2.21.5\n", "").is_err());
        assert!(parse_probe("gpus four\n", stderr).is_err());
    }

    #[test]
    fn two_ranks_share_a_gpu_from_nccl_2_30() {
        assert!(!allows_two_ranks_per_gpu("2.28.9"));
        assert!(!allows_two_ranks_per_gpu("2.3.0"));
        assert!(allows_two_ranks_per_gpu("2.30.0"));
        assert!(allows_two_ranks_per_gpu("2.31.2"));
        assert!(allows_two_ranks_per_gpu("3.0.0"));
        assert!(!allows_two_ranks_per_gpu("garbage"));
    }

    #[test]
    fn the_first_step_line_gives_its_seconds() {
        let line = "rank 0: first step done 243.7 s after the trainer started";
        assert_eq!(first_step(line), Some(243.7));
        assert_eq!(first_step("epoch 1 step 100 loss 0.2"), None);
    }

    #[test]
    fn a_process_past_its_limit_is_killed_with_its_children() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sleep.log");
        // The child's child would keep the log open if only the shell were killed.
        let mut command = Command::new("sh");
        command.args(["-c", "echo started; sleep 30 & wait"]);
        let run = run_limited(&mut command, 1, &log).unwrap();
        assert!(run.status.is_none(), "it was not killed");
        assert!(run.seconds < 10.0, "took {} s", run.seconds);
        assert!(run.output.contains("started"), "{}", run.output);
        let mut command = Command::new("sh");
        command.args(["-c", "echo done; exit 3"]);
        let run = run_limited(&mut command, 10, &log).unwrap();
        assert_eq!(run.status.and_then(|s| s.code()), Some(3));
        assert!(!run.ok());
    }
}
