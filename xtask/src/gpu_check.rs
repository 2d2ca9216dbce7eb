//! `cargo xtask gpu-check`: what can only be checked on a machine with NVIDIA GPUs.
//!
//! 1. The driver: `nvidia-smi -L` must list GPUs; otherwise it stops at once with
//!    "no NVIDIA driver found" (before building anything).
//! 2. Builds `ddprun`, `ddp-nccl-bench` and `train-mnist` with the `cuda` feature of `ddp-apps`
//!    and asks `ddp-nccl-bench --probe` which driver and NCCL files it loaded (found under their
//!    real names, `libnccl.so.2` from pip's nvidia-nccl-cu12 included, with no symlink), the GPU
//!    count and the NCCL version.
//! 3. NCCL at every world size the GPUs allow (1 to the GPU count, or `--max-gpus`):
//!    `ddprun --nproc-per-node N -- ddp-nccl-bench`, which checks every collective's result
//!    exactly and times all-reduce per size (algbw, busbw as nccl-tests defines them).
//! 4. `train-mnist --backend cuda` on one GPU (and on all of them when there are several:
//!    gradients then go through NCCL on the GPU): a warm-up epoch, in which burn's autotune
//!    benchmarks its kernels and NVRTC compiles them, then the timed epoch; samples/s is the
//!    timed epoch's (from the trainer's `metrics.csv`), the test accuracy the one after both.
//! 5. The same in PyTorch on the same GPU (`xtask/scripts/torch_mnist_epoch.py --warmup-epochs
//!    1`: its own warm-up epoch, untimed, then the timed one) when a python with torch and CUDA is
//!    at hand (`$DDP_PYTHON`, else `~/.cache/torchenv/bin/python`, else `python3`), and the ratio
//!    of our samples/s to PyTorch's.
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

/// Untimed epochs before the timed one, ours and PyTorch's (burn's autotune and NVRTC's
/// compilation happen in the first; cuDNN's and the caching allocator's warm-up in PyTorch's).
const WARMUP_EPOCHS: usize = 1;

/// What `gpu-check.json` holds.
#[derive(Debug, Serialize)]
struct Report {
    gpus: Vec<String>,
    /// The probe's line naming the driver and NCCL files loaded.
    libraries: String,
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

    let (gpus, nccl_version, libraries) = probe(&bin_dir)?;
    eprintln!("{libraries}");
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
        let metrics = out.join(format!("mnist-metrics-{world}"));
        let _ = std::fs::remove_dir_all(&metrics);
        let trainer_args: Vec<String> = vec![
            "--backend".into(),
            "cuda".into(),
            "--epochs".into(),
            (WARMUP_EPOCHS + 1).to_string(),
            "--batch-size".into(),
            args.batch_size.to_string(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--metrics-dir".into(),
            metrics.display().to_string(),
        ];
        let s = train::launch(&bin_dir, "train-mnist", world, &trainer_args)
            .with_context(|| format!("train-mnist --backend cuda on {world} GPU(s)"))?;
        let csv = metrics.join("metrics.csv");
        let csv =
            std::fs::read_to_string(&csv).with_context(|| format!("reading {}", csv.display()))?;
        mnist.push(Epoch {
            implementation: "ddp-rs (burn-cuda)".into(),
            gpus: world,
            test_accuracy: s.test_accuracy,
            samples_per_sec: epoch_rate(&csv, WARMUP_EPOCHS + 1)?,
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
        libraries,
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
        .args(["--warmup-epochs", &WARMUP_EPOCHS.to_string()])
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
    let _ = writeln!(md, "- {}", report.libraries);
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
    let _ = writeln!(
        md,
        "\n## MNIST CNN, one epoch timed after {WARMUP_EPOCHS} warm-up epoch(s)\n"
    );
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
}
