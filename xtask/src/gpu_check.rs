//! `cargo xtask gpu-check`: what can only be checked on a machine with NVIDIA GPUs.
//!
//! 1. The driver: `nvidia-smi -L` must list GPUs; otherwise it stops at once with
//!    "no NVIDIA driver found" (before building anything).
//! 2. Builds `ddprun`, `ddp-nccl-bench` and `train-mnist` with the `cuda` feature of `ddp-apps`
//!    and asks `ddp-nccl-bench --probe` for the GPU count and the NCCL version. When NCCL is only
//!    present as `libnccl.so.2` (pip's nvidia-nccl-cu12, which PyTorch uses), it links it as
//!    `libnccl.so` under the output folder and puts that on `LD_LIBRARY_PATH`.
//! 3. NCCL at every world size the GPUs allow (1 to the GPU count, or `--max-gpus`):
//!    `ddprun --nproc-per-node N -- ddp-nccl-bench`, which checks every collective's result
//!    exactly and times all-reduce per size (algbw, busbw as nccl-tests defines them).
//! 4. `train-mnist --backend cuda` for one epoch on one GPU (and on all of them when there are
//!    several: gradients then go through NCCL on the GPU): test accuracy and samples/s.
//! 5. The same epoch in PyTorch on the same GPU (`xtask/scripts/torch_mnist_epoch.py`) when a
//!    python with torch and CUDA is at hand (`$DDP_PYTHON`, else `~/.cache/torchenv/bin/python`, else `python3`), and the
//!    ratio of our samples/s to PyTorch's.
//!
//! Results go to `target/gpu-check/` (or `--out`): `gpu-check.md` (printed at the end) and
//! `gpu-check.json`. Any failed check fails the task.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use ddp_comm::bytes::human_size;
use serde::{Deserialize, Serialize};

use crate::{train, util};

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
    /// Batch size per GPU for the MNIST epoch (ours and PyTorch's).
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Do not run the PyTorch comparison even if torch is available.
    #[arg(long)]
    no_torch: bool,
    /// Folder for the results [default: target/gpu-check].
    #[arg(long)]
    out: Option<PathBuf>,
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

/// One MNIST epoch, ours or PyTorch's.
#[derive(Debug, Clone, Serialize)]
struct Epoch {
    implementation: String,
    gpus: usize,
    test_accuracy: f64,
    samples_per_sec: f64,
}

/// What `gpu-check.json` holds.
#[derive(Debug, Serialize)]
struct Report {
    gpus: Vec<String>,
    nccl_version: String,
    allreduce: Vec<BenchReport>,
    mnist: Vec<Epoch>,
    torch_skipped: Option<String>,
    /// Our samples/s on one GPU divided by PyTorch's.
    ratio_to_torch: Option<f64>,
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

    let (gpus, nccl_version) = probe(&bin_dir, &out)?;
    let max = args.max_gpus.unwrap_or(gpus).min(gpus).max(1);
    eprintln!("{gpus} GPU(s) visible, NCCL {nccl_version}; using up to {max}");

    let mut allreduce = Vec::new();
    for world in 1..=max {
        let json = out.join(format!("nccl-{world}.json"));
        let mut command = Command::new(bin_dir.join("ddprun"));
        command
            .args(["--nproc-per-node", &world.to_string(), "--"])
            .arg(bin_dir.join("ddp-nccl-bench"))
            .args(["--sizes", &args.sizes, "--iters", &args.iters.to_string()])
            .arg("--json")
            .arg(&json);
        util::run(&mut command).with_context(|| format!("NCCL check at world size {world}"))?;
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("reading {}", json.display()))?;
        allreduce.push(serde_json::from_str::<BenchReport>(&text)?);
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
    let mut mnist = Vec::new();
    let mut worlds = vec![1];
    if max > 1 {
        worlds.push(max);
    }
    for &world in &worlds {
        let trainer_args: Vec<String> = vec![
            "--backend".into(),
            "cuda".into(),
            "--epochs".into(),
            "1".into(),
            "--batch-size".into(),
            args.batch_size.to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
        ];
        let s = train::launch(&bin_dir, "train-mnist", world, &trainer_args)
            .with_context(|| format!("train-mnist --backend cuda on {world} GPU(s)"))?;
        mnist.push(Epoch {
            implementation: "ddp-rs (burn-cuda)".into(),
            gpus: world,
            test_accuracy: s.test_accuracy,
            samples_per_sec: s.samples_per_sec,
        });
    }

    let (torch, torch_skipped) = if args.no_torch {
        (None, Some("--no-torch".to_string()))
    } else {
        match torch_epoch(&data_dir, args.batch_size)? {
            Ok(epoch) => (Some(epoch), None),
            Err(reason) => (None, Some(reason)),
        }
    };
    let ratio_to_torch = torch
        .as_ref()
        .map(|t| mnist[0].samples_per_sec / t.samples_per_sec);
    mnist.extend(torch);

    let report = Report {
        gpus: listed,
        nccl_version,
        allreduce,
        mnist,
        torch_skipped,
        ratio_to_torch,
    };
    let markdown = markdown(&report);
    std::fs::write(out.join("gpu-check.md"), &markdown)?;
    std::fs::write(
        out.join("gpu-check.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    println!("{markdown}");
    println!("results in {}", out.display());
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

/// GPU count and NCCL version from `ddp-nccl-bench --probe`; links pip's `libnccl.so.2` as
/// `libnccl.so` (and puts it on `LD_LIBRARY_PATH` for everything after) when that is what it
/// takes.
fn probe(bin_dir: &Path, out: &Path) -> Result<(usize, String)> {
    let attempt = || -> Result<std::result::Result<(usize, String), String>> {
        let output = Command::new(bin_dir.join("ddp-nccl-bench"))
            .arg("--probe")
            .output()
            .context("running ddp-nccl-bench --probe")?;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if !output.status.success() {
            return Ok(Err(format!(
                "{}{}",
                stdout,
                String::from_utf8_lossy(&output.stderr)
            )));
        }
        let words: Vec<&str> = stdout.split_whitespace().collect();
        match words.as_slice() {
            ["gpus", n, "nccl", version] => Ok(Ok((n.parse()?, version.to_string()))),
            _ => bail!("unexpected probe output {stdout:?}"),
        }
    };
    let message = match attempt()? {
        Ok(found) => return Ok(found),
        Err(message) => message,
    };
    if !message.contains("NCCL library could not be loaded") {
        bail!("{}", message.trim());
    }
    let Some(lib) = find_libnccl2() else {
        bail!("{}", message.trim());
    };
    let link_dir = out.join("nccl-lib");
    std::fs::create_dir_all(&link_dir)?;
    let link = link_dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link)
        .with_context(|| format!("linking {} to {}", link.display(), lib.display()))?;
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", link_dir.display()),
        _ => link_dir.display().to_string(),
    };
    eprintln!(
        "NCCL is only there as {}: linked it as {} and put {} on LD_LIBRARY_PATH",
        lib.display(),
        link.display(),
        link_dir.display()
    );
    // Single-threaded at this point; every command from here on inherits it.
    std::env::set_var("LD_LIBRARY_PATH", path);
    match attempt()? {
        Ok(found) => Ok(found),
        Err(message) => bail!("{}", message.trim()),
    }
}

/// A `libnccl.so.2` from pip's nvidia-nccl package or the usual library folders.
fn find_libnccl2() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let python = util::torch_python().display().to_string();
    if let Ok(output) = Command::new(&python)
        .args([
            "-c",
            "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))",
        ])
        .output()
    {
        if output.status.success() {
            dirs.push(String::from_utf8_lossy(&output.stdout).trim().into());
        }
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/nccl/lib",
        ]
        .map(PathBuf::from),
    );
    dirs.into_iter()
        .map(|d| d.join("libnccl.so.2"))
        .find(|p| p.exists())
}

/// PyTorch's epoch on GPU 0, or why it was skipped.
fn torch_epoch(data_dir: &Path, batch_size: usize) -> Result<std::result::Result<Epoch, String>> {
    let python = util::torch_python().display().to_string();
    let probe = Command::new(&python)
        .args([
            "-c",
            "import torch; print(torch.__version__, torch.cuda.is_available())",
        ])
        .output();
    match probe {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("True") => {}
        Ok(o) if o.status.success() => {
            return Ok(Err(format!("{python}: torch sees no CUDA GPU")));
        }
        _ => return Ok(Err(format!("{python} cannot import torch"))),
    }
    let script = util::workspace_root().join("xtask/scripts/torch_mnist_epoch.py");
    let mut command = Command::new(&python);
    command
        .arg(&script)
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--device", "cuda:0", "--epochs", "1"])
        .args(["--batch-size", &batch_size.to_string()]);
    eprintln!("$ {}", util::command_line(&command));
    let output = command.output().context("running the PyTorch epoch")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the PyTorch epoch failed ({}): {}{}",
            output.status,
            stdout,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let json = stdout
        .lines()
        .find_map(|l| l.strip_prefix("TORCH_SUMMARY "))
        .context("the PyTorch script printed no TORCH_SUMMARY line")?;
    let value: serde_json::Value = serde_json::from_str(json)?;
    let number = |key: &str| {
        value[key]
            .as_f64()
            .with_context(|| format!("{key} in the PyTorch summary"))
    };
    Ok(Ok(Epoch {
        implementation: format!(
            "PyTorch {}",
            value["torch"].as_str().unwrap_or("(unknown version)")
        ),
        gpus: 1,
        test_accuracy: number("test_accuracy")?,
        samples_per_sec: number("samples_per_sec")?,
    }))
}

/// The report as Markdown.
fn markdown(report: &Report) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# gpu-check\n");
    for gpu in &report.gpus {
        let _ = writeln!(md, "- {gpu}");
    }
    let _ = writeln!(md, "- NCCL {}\n", report.nccl_version);
    let _ = writeln!(md, "## NCCL all-reduce (f32, sum; every result checked)\n");
    let _ = writeln!(
        md,
        "| GPUs | size | median (us) | algbw (GB/s) | busbw (GB/s) |\n| ---: | ---: | ---: | ---: | ---: |"
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
    let _ = writeln!(md, "\n## MNIST CNN, one epoch\n");
    let _ = writeln!(
        md,
        "| implementation | GPUs | test accuracy | samples/s |\n| --- | ---: | ---: | ---: |"
    );
    for e in &report.mnist {
        let _ = writeln!(
            md,
            "| {} | {} | {:.2}% | {:.0} |",
            e.implementation,
            e.gpus,
            100.0 * e.test_accuracy,
            e.samples_per_sec
        );
    }
    match (report.ratio_to_torch, &report.torch_skipped) {
        (Some(ratio), _) => {
            let _ = writeln!(
                md,
                "\nours / PyTorch on one GPU: {ratio:.2}x the samples per second"
            );
        }
        (None, Some(why)) => {
            let _ = writeln!(md, "\nPyTorch comparison skipped: {why}");
        }
        (None, None) => {}
    }
    md
}
