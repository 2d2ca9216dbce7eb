//! `cargo xtask bench-step`: the time of one training step (forward, backward, Adam) of the
//! MNIST CNN and MLP at batch 64, on 1 thread and on every core, ours (the `step_time`
//! example of ddp-models, on burn's CPU backend with the fast ops) and PyTorch's in the same
//! run when a python with torch is at hand ($DDP_PYTHON or ~/.cache/torchenv/bin/python),
//! with the ratio PyTorch / ours (above 1: we are faster).
//!
//! Then the end-to-end figure: `train-mnist` on 2 ranks x 1 thread through `ddprun`, 200 steps
//! of batch 64 per rank, against PyTorch DDP (gloo, `torchrun`) training the same CNN on the same
//! MNIST files with Adam, alternating ours and theirs `--repeats` times; samples/s of all ranks
//! (training loop only, evaluation excluded), medians and the ratio.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

/// Options of `cargo xtask bench-step`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed steps per measurement (after 2 warm-up steps); the median is reported.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Steps per rank of the end-to-end run (0: skip it).
    #[arg(long, default_value_t = 200)]
    e2e_steps: usize,
    /// Ranks of the end-to-end run.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Compute threads per rank in the end-to-end run.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// End-to-end runs of each side; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// MNIST folder for the end-to-end run (default `../shared/data/mnist` beside the
    /// repository when it exists, else the trainer's own default, where it downloads MNIST).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// PyTorch DDP's end-to-end run, one process per rank under `torchrun`: the same CNN, Adam at
/// 1e-3, batch 64 per rank from MNIST held in memory (normalised like ours, a seeded
/// permutation split over ranks), `steps` steps timed from a barrier to the last step on every
/// rank; rank 0 prints the samples/s of all ranks over the slowest rank's time.
const TORCH_DDP: &str = r#"
import gzip, os, sys, time, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
data_dir, steps, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
def idx(name, offset):
    path = os.path.join(data_dir, name)
    raw = gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
    return torch.frombuffer(bytearray(raw[offset:]), dtype=torch.uint8)
images = ((idx("train-images-idx3-ubyte", 16).view(-1, 1, 28, 28).float() / 255) - 0.1307) / 0.3081
labels = idx("train-labels-idx1-ubyte", 8).long()
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1); self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25); self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128); self.fc2 = nn.Linear(128, 10)
    def forward(self, x):
        x = F.relu(self.conv1(x)); x = F.relu(self.conv2(x)); x = F.max_pool2d(x, 2)
        x = self.dropout1(x); x = torch.flatten(x, 1); x = F.relu(self.fc1(x))
        x = self.dropout2(x); return F.log_softmax(self.fc2(x), dim=1)
torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))[rank::world]
dist.barrier()
t0 = time.perf_counter()
for step in range(steps):
    i = order[(step * batch) % (len(order) - batch):][:batch]
    opt.zero_grad(); loss = F.nll_loss(model(images[i]), labels[i]); loss.backward(); opt.step()
    loss.item()
elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"TORCH_DDP {steps * batch * world / elapsed.item():.3f}")
dist.destroy_process_group()
"#;

/// PyTorch's step timer: the same models (PyTorch's `examples/mnist` `Net` and a 784-256-10
/// MLP), batch 64, Adam, median of `steps` steps after 2 warm-up steps, in ms.
const TORCH_STEP: &str = r#"
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
threads, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1); self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25); self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128); self.fc2 = nn.Linear(128, 10)
    def forward(self, x):
        x = F.relu(self.conv1(x)); x = F.relu(self.conv2(x)); x = F.max_pool2d(x, 2)
        x = self.dropout1(x); x = torch.flatten(x, 1); x = F.relu(self.fc1(x))
        x = self.dropout2(x); return F.log_softmax(self.fc2(x), dim=1)
class Mlp(nn.Module):
    def __init__(self):
        super().__init__(); self.fc1 = nn.Linear(784, 256); self.fc2 = nn.Linear(256, 10)
    def forward(self, x):
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))
x = torch.rand(64, 1, 28, 28) - 0.5
y = torch.arange(64) % 10
for name, model, loss_fn in [("cnn", Net(), F.nll_loss), ("mlp", Mlp(), F.cross_entropy)]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); opt.step()
        if step >= 2: times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{name} {times[len(times) // 2] * 1e3:.3f}")
"#;

/// A python with torch ([`util::torch_python`]) if torch imports.
fn torch_python() -> Option<PathBuf> {
    let candidate = util::torch_python();
    let ok = Command::new(&candidate)
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then_some(candidate)
}

/// Our median step time (ms) of the CNN and the MLP at batch 64 on `threads` threads, from
/// the `step_time` example's output lines `cnn b=64     step  <ms> ...`.
fn ours(example: &PathBuf, threads: usize, steps: usize) -> Result<(f64, f64)> {
    let output = Command::new(example)
        .arg(steps.to_string())
        .env("RAYON_NUM_THREADS", threads.to_string())
        .output()
        .context("running the step_time example")?;
    if !output.status.success() {
        bail!("step_time failed ({})", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let find = |model: &str| -> Result<f64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{model} b=64")))
            .with_context(|| format!("no `{model} b=64` line in step_time's output"))?;
        let mut words = line.split_whitespace();
        words.find(|w| *w == "step");
        words
            .next()
            .context("no time after `step`")?
            .parse()
            .context("parsing step_time's step time")
    };
    Ok((find("cnn")?, find("mlp")?))
}

/// PyTorch's median step times (ms) of the CNN and the MLP on `threads` threads.
fn theirs(python: &PathBuf, threads: usize, steps: usize) -> Result<(f64, f64)> {
    let output = Command::new(python)
        .args(["-c", TORCH_STEP, &threads.to_string(), &steps.to_string()])
        .output()
        .context("running PyTorch's step timer")?;
    if !output.status.success() {
        bail!(
            "PyTorch's step timer failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let find = |model: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{model} ")))
            .with_context(|| format!("no `{model}` line from PyTorch"))?
            .trim()
            .parse()
            .context("parsing PyTorch's step time")
    };
    Ok((find("cnn")?, find("mlp")?))
}

/// The MNIST folder of the end-to-end run: `--data-dir`, else `../shared/data/mnist` beside
/// the repository when it exists, else `None` (the trainer's default).
fn mnist_dir(args: &Args) -> Option<PathBuf> {
    args.data_dir.clone().or_else(|| {
        let shared = util::workspace_root().join("../shared/data/mnist");
        shared.is_dir().then_some(shared)
    })
}

/// The folder the trainer reads MNIST from when given `dir` (its own default otherwise:
/// `$DDP_DATA_DIR/mnist`, else `~/.cache/ddp-rs/mnist`).
fn trainer_mnist_dir(dir: Option<&Path>) -> Option<PathBuf> {
    dir.map(Path::to_path_buf).or_else(|| {
        std::env::var_os("DDP_DATA_DIR")
            .map(|d| PathBuf::from(d).join("mnist"))
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/ddp-rs/mnist"))
            })
    })
}

/// One end-to-end run of ours: `train-mnist` on `args.nproc` ranks through ddprun; samples/s.
fn ours_e2e(bin_dir: &Path, args: &Args, data_dir: Option<&Path>) -> Result<f64> {
    let mut trainer_args: Vec<String> = [
        "--model",
        "cnn",
        "--epochs",
        "1",
        "--workers",
        "1",
        "--test-samples",
        "500",
        "--batch-size",
        "64",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    trainer_args.extend([
        "--threads".into(),
        args.threads.to_string(),
        "--max-steps".into(),
        args.e2e_steps.to_string(),
        "--log-interval".into(),
        args.e2e_steps.max(1).to_string(),
    ]);
    if let Some(dir) = data_dir {
        trainer_args.extend(["--data-dir".into(), dir.display().to_string()]);
    }
    let summary = crate::train::launch(bin_dir, "train-mnist", args.nproc, &trainer_args)?;
    Ok(summary.samples_per_sec)
}

/// One end-to-end run of PyTorch DDP under torchrun; samples/s of all ranks.
fn theirs_e2e(python: &Path, args: &Args, data_dir: &Path) -> Result<f64> {
    let script = util::target_dir()?.join("bench/torch_ddp_mnist.py");
    let mut command = util::torchrun(python, args.nproc, args.threads, (&script, TORCH_DDP))?;
    command.arg(data_dir).args([
        args.e2e_steps.to_string(),
        "64".into(),
        args.threads.to_string(),
    ]);
    eprintln!("$ {}", util::command_line(&command));
    let output = command.output().context("running torchrun")?;
    if !output.status.success() {
        bail!(
            "PyTorch DDP failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("TORCH_DDP "))
        .context("no TORCH_DDP line from PyTorch DDP")?
        .trim()
        .parse()
        .context("parsing PyTorch DDP's samples/s")
}

/// The median of `v` (which must not be empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The end-to-end comparison: ours and PyTorch DDP alternately, `args.repeats` times each.
fn end_to_end(args: &Args, python: Option<&Path>) -> Result<()> {
    let bin_dir = util::build_release_bins(&["ddprun", "train-mnist"], &[])?;
    let data_dir = mnist_dir(args);
    let (mut mine, mut other) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats.max(1) {
        mine.push(ours_e2e(&bin_dir, args, data_dir.as_deref())?);
        if let (Some(python), Some(dir)) = (python, trainer_mnist_dir(data_dir.as_deref())) {
            other.push(theirs_e2e(python, args, &dir)?);
        }
    }
    println!();
    println!(
        "end to end, MNIST CNN, {} ranks x {} thread(s), {} steps of batch 64 per rank, {} run(s) each:",
        args.nproc,
        args.threads,
        args.e2e_steps,
        mine.len()
    );
    println!("| | samples/s (median) | runs |");
    println!("|---|---|---|");
    let show = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let ours = median(mine.clone());
    println!(
        "| ours (ddprun, train-mnist) | {ours:.0} | {} |",
        show(&mine)
    );
    if !other.is_empty() {
        let theirs = median(other.clone());
        println!(
            "| PyTorch DDP (torchrun, gloo) | {theirs:.0} | {} |",
            show(&other)
        );
        println!("ours / PyTorch: {:.2}x", ours / theirs);
    }
    Ok(())
}

/// Builds the example, times both sides at 1 thread and at every core, prints the table; then
/// the end-to-end comparison unless `--e2e-steps 0`.
pub fn run(args: Args) -> Result<()> {
    let example = util::build_release_examples(&["step_time"])?.join("step_time");
    let python = torch_python();
    if python.is_none() {
        eprintln!("no python with torch ($DDP_PYTHON or ~/.cache/torchenv/bin/python): ours only");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts = vec![1];
    if cores > 1 {
        thread_counts.push(cores);
    }
    println!("| model | threads | ours (ms/step) | PyTorch (ms/step) | PyTorch / ours |");
    println!("|---|---|---|---|---|");
    for threads in thread_counts {
        let (cnn, mlp) = ours(&example, threads, args.steps)?;
        let torch = python
            .as_ref()
            .map(|p| theirs(p, threads, args.steps))
            .transpose()?;
        for (name, mine, other) in [
            ("CNN", cnn, torch.map(|t| t.0)),
            ("MLP", mlp, torch.map(|t| t.1)),
        ] {
            match other {
                Some(t) => println!(
                    "| {name} b=64 | {threads} | {mine:.2} | {t:.2} | {:.2}x |",
                    t / mine
                ),
                None => println!("| {name} b=64 | {threads} | {mine:.2} | - | - |"),
            }
        }
    }
    if args.e2e_steps > 0 {
        end_to_end(&args, python.as_deref())?;
    }
    Ok(())
}
