//! `cargo xtask bench-step`: the time of one training step (forward, backward, Adam) of the
//! MNIST CNN and MLP at batch 64, on 1 thread and on every core, ours (the `step_time`
//! example of ddp-models, on burn's CPU backend with the fast ops) and PyTorch's in the same
//! run when a python with torch is at hand ($DDP_PYTHON or ~/.cache/torchenv/bin/python),
//! with the ratio PyTorch / ours (above 1: we are faster).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

/// Options of `cargo xtask bench-step`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Timed steps per measurement (after 2 warm-up steps); the median is reported.
    #[arg(long, default_value_t = 20)]
    steps: usize,
}

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

/// A python with torch: `$DDP_PYTHON`, else `~/.cache/torchenv/bin/python` if torch imports.
fn torch_python() -> Option<PathBuf> {
    let candidate = std::env::var_os("DDP_PYTHON")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/torchenv/bin/python"))
        })?;
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

/// Builds the example, times both sides at 1 thread and at every core, prints the table.
pub fn run(args: Args) -> Result<()> {
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build.args([
        "build",
        "--release",
        "--workspace",
        "--features",
        util::DEFAULT_FEATURES,
        "--example",
        "step_time",
    ]);
    util::run(build.current_dir(util::workspace_root()))?;
    let example = util::target_dir()?.join("release/examples/step_time");
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
    Ok(())
}
