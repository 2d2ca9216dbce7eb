//! `cargo xtask bench-gpt`: `train-gpt` under `ddprun` against PyTorch DDP (gloo, `torchrun`)
//! training the same GPT from the same initial weights on the same windows of the same text,
//! with AdamW, global-norm clipping and the cosine schedule: tokens/s of both, their ratio,
//! and the two loss curves side by side.
//!
//! Same start: ours is run once on one rank for zero steps with `--export`, which writes the
//! initial weights as safetensors with PyTorch's names; the PyTorch script loads them
//! (`load_state_dict(strict=True)`). Same data: the script derives the windows exactly as
//! `ddp_data::DistributedSampler` does (the splitmix64 Fisher-Yates permutation of the window
//! starts for seed 0, epoch 0, padded to a multiple of the world, rank `r` taking every
//! `world`-th from `r`, batches in that order), re-implemented in a few lines of Python; the
//! first step's loss agreeing to float noise checks that the two agree.
//!
//! Tolerances: step 1 computes the same function of the same numbers, differing only in the
//! order of f32 sums (matmul blocking, softmax, LayerNorm): a relative difference of 1e-5 or
//! less, so |Δ| ≤ 1e-4 on a loss near ln(vocab) ≈ 4.4 is required. Later steps drift apart:
//! Adam divides each gradient by its own running size, so a rounding-level difference in a
//! gradient element near zero becomes a difference of order `lr` in its weight; the curves
//! stay together statistically, so the end is compared as the mean loss of the last 10
//! steps, required within 2 % (several times the step-to-step noise of the mean at these
//! sizes).
//!
//! Not part of CI: it needs torch and takes minutes.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::util;

/// Options of `cargo xtask bench-gpt`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The text (any UTF-8 file; GPL-3 from Debian's base-files by default).
    #[arg(long, default_value = "/usr/share/common-licenses/GPL-3")]
    text: String,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: usize,
    /// Ranks of each side.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Compute threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    n_layer: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    n_head: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    n_embd: usize,
    /// Context (window) length.
    #[arg(long, default_value_t = 64)]
    block_size: usize,
    /// Windows per rank per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Peak learning rate (AdamW).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// Warm-up steps of the cosine schedule (which decays to lr/10 at the last step).
    #[arg(long, default_value_t = 10)]
    warmup_steps: usize,
    /// Global-norm clip.
    #[arg(long, default_value_t = 1.0)]
    max_grad_norm: f64,
    /// Runs of each side, alternating; the median tokens/s is reported (the losses are the
    /// first run's).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
}

/// PyTorch DDP's side: the GPT of ddp-models' gpt.rs in PyTorch (the same parameter names),
/// the initial weights from our export, the windows as our sampler orders them, AdamW (weight
/// decay 0.01 on every parameter, as ours), `clip_grad_norm_`, nanoGPT's `get_lr`. Rank 0
/// prints every step's loss (`LOSS step value`) and the tokens/s of all ranks from a barrier
/// to the last step (`TOKENS_PER_SEC value`).
const TORCH_GPT: &str = r#"
import json, math, struct, sys, time, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
(text_path, init_path, steps, batch, block, n_layer, n_head, n_embd, lr, warmup, clip,
 threads) = sys.argv[1:13]
steps, batch, block, n_layer, n_head, n_embd, warmup, threads = map(int, (steps, batch, block, n_layer, n_head, n_embd, warmup, threads))
lr, clip = float(lr), float(clip)
torch.set_num_threads(threads)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
text = open(text_path, encoding="utf-8").read()
vocab = sorted(set(text))
index = {c: i for i, c in enumerate(vocab)}
tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
cut = int(len(tokens) * 0.9)
windows = cut - block  # window starts 0..cut-block-1 (each needs block+1 tokens)
M = (1 << 64) - 1
def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
class SplitMix:
    def __init__(self, seed, stream):
        self.s = seed
        self.s = self.next() ^ ((stream * 0xD1B54A32D192ED03) & M)
    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M
        return mix(self.s)
    def below(self, n):
        m = self.next() * n
        if (m & M) < n:
            t = ((1 << 64) - n) % n
            while (m & M) < t:
                m = self.next() * n
        return m >> 64
rng, order = SplitMix(0, 0), list(range(windows))
for i in range(windows - 1, 0, -1):
    j = rng.below(i + 1); order[i], order[j] = order[j], order[i]
per_rank = -(-windows // world)
order = (order + order * world)[:per_rank * world][rank::world]
class Attn(nn.Module):
    def __init__(self):
        super().__init__(); self.c_attn = nn.Linear(n_embd, 3 * n_embd); self.c_proj = nn.Linear(n_embd, n_embd)
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // n_head))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))
class Mlp(nn.Module):
    def __init__(self):
        super().__init__(); self.c_fc = nn.Linear(n_embd, 4 * n_embd); self.c_proj = nn.Linear(4 * n_embd, n_embd)
    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd); self.attn = Attn(); self.ln_2 = nn.LayerNorm(n_embd); self.mlp = Mlp()
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))
class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(len(vocab), n_embd); self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([Block() for _ in range(n_layer)]); self.ln_f = nn.LayerNorm(n_embd)
    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        return F.linear(self.ln_f(x), self.wte.weight)
raw = open(init_path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
state = {k: torch.frombuffer(bytearray(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]), dtype=torch.float32).view(v["shape"])
         for k, v in header.items() if k != "__metadata__"}
model = Gpt()
model.load_state_dict(state, strict=True)
model = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
min_lr = lr / 10
def get_lr(it):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > steps:
        return min_lr
    ratio = (it - warmup) / (steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
dist.barrier()
t0 = time.perf_counter()
for step in range(steps):
    starts = order[(step * batch) % len(order):][:batch]
    x = torch.stack([tokens[s:s + block] for s in starts])
    y = torch.stack([tokens[s + 1:s + block + 1] for s in starts])
    for g in opt.param_groups:
        g["lr"] = get_lr(step)
    opt.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    value = loss.item()
    if rank == 0:
        print(f"LOSS {step + 1} {value:.6f}", flush=True)
elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"TOKENS_PER_SEC {steps * batch * block * world / elapsed.item():.3f}", flush=True)
dist.barrier()
dist.destroy_process_group()
"#;

/// The model and optimizer flags of `train-gpt` for `args`.
fn trainer_flags(args: &Args) -> Vec<String> {
    let mut flags: Vec<String> = vec!["--text".into(), args.text.clone()];
    for (flag, value) in [
        ("--n-layer", args.n_layer.to_string()),
        ("--n-head", args.n_head.to_string()),
        ("--n-embd", args.n_embd.to_string()),
        ("--block-size", args.block_size.to_string()),
        ("--batch-size", args.batch_size.to_string()),
        ("--threads", args.threads.to_string()),
        ("--lr", args.lr.to_string()),
        ("--optimizer", "adamw".into()),
        ("--max-grad-norm", args.max_grad_norm.to_string()),
        ("--lr-schedule", "cosine".into()),
        ("--warmup-steps", args.warmup_steps.to_string()),
        ("--decay-steps", args.steps.to_string()),
        ("--min-lr", (args.lr / 10.0).to_string()),
        ("--seed", "0".into()),
        ("--log-interval", "1".into()),
        ("--test-samples", "1".into()),
    ] {
        flags.extend([flag.to_string(), value]);
    }
    flags
}

/// Rank 0's loss at every step from the trainer's lines `... step N (..) lr X loss Y`.
fn our_losses(lines: &[String]) -> Vec<f64> {
    lines
        .iter()
        .filter(|l| l.contains(" step ") && l.contains(" lr "))
        .filter_map(|l| l.rsplit_once(" loss ")?.1.trim().parse().ok())
        .collect()
}

/// `cargo xtask bench-gpt`.
pub fn run(args: Args) -> Result<()> {
    if args.warmup_steps >= args.steps {
        bail!("--warmup-steps must be below --steps");
    }
    let python = util::torch_python();
    let bin_dir = util::build_release_bins(&["ddprun", "train-gpt"], &[])?;
    let out = util::target_dir()?.join("bench/gpt");
    std::fs::create_dir_all(&out)?;
    let init = out.join("init.safetensors");
    // The initial weights: one rank, no step, exported.
    let mut export = Command::new(bin_dir.join("train-gpt"));
    export
        .args(trainer_flags(&args))
        .args(["--max-steps", "0", "--export"])
        .arg(&init);
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
    ] {
        export.env_remove(var);
    }
    util::run_stdout(&mut export)?;

    let mut ours_args = trainer_flags(&args);
    ours_args.extend(["--max-steps".into(), args.steps.to_string()]);
    let (mut ours_tps, mut theirs_tps) = (Vec::new(), Vec::new());
    let (mut ours_loss, mut theirs_loss) = (Vec::new(), Vec::new());
    for _ in 0..args.repeats.max(1) {
        let ours = crate::train::launch(&bin_dir, "train-gpt", args.nproc, &ours_args)?;
        ours_tps.push(ours.samples_per_sec);
        let (tps, loss) = theirs(&python, &args, &out, &init)?;
        theirs_tps.push(tps);
        if ours_loss.is_empty() {
            (ours_loss, theirs_loss) = (our_losses(&ours.output), loss);
        }
    }
    report(&args, (&ours_tps, &ours_loss), (&theirs_tps, &theirs_loss))
}

/// The median of `v` (not empty).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// PyTorch DDP under torchrun: tokens/s of all ranks and rank 0's loss at every step.
fn theirs(python: &Path, args: &Args, out: &Path, init: &Path) -> Result<(f64, Vec<f64>)> {
    let script = out.join("torch_ddp_gpt.py");
    let mut command = util::torchrun(python, args.nproc, args.threads, (&script, TORCH_GPT))?;
    command
        .arg(&args.text)
        .arg(init)
        .args(
            [
                args.steps,
                args.batch_size,
                args.block_size,
                args.n_layer,
                args.n_head,
                args.n_embd,
            ]
            .map(|v| v.to_string()),
        )
        .args([
            args.lr.to_string(),
            args.warmup_steps.to_string(),
            args.max_grad_norm.to_string(),
            args.threads.to_string(),
        ]);
    // torch 2.15's gloo now and then aborts a rank ("terminate called without an active
    // exception"); such a run is started again, and said so.
    let mut tries = 0;
    let text = loop {
        tries += 1;
        match util::run_stdout(&mut command) {
            Ok(text) => break text,
            Err(e) if tries < 3 => eprintln!("PyTorch DDP failed ({e:#}); starting it again"),
            Err(e) => return Err(e.context("PyTorch DDP (is torch installed?)")),
        }
    };
    let loss = text
        .lines()
        .filter_map(|l| l.strip_prefix("LOSS "))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    let tps = text
        .lines()
        .find_map(|l| l.strip_prefix("TOKENS_PER_SEC "))
        .context("no TOKENS_PER_SEC line from PyTorch")?
        .trim()
        .parse()
        .context("parsing PyTorch's tokens/s")?;
    Ok((tps, loss))
}

/// Prints the table, the curves side by side and the checks against the tolerances of the
/// module documentation; an error when a check fails.
fn report(args: &Args, ours: (&[f64], &[f64]), theirs: (&[f64], &[f64])) -> Result<()> {
    let (ours_runs, ours_loss) = ours;
    let (theirs_runs, theirs_loss) = theirs;
    let (ours_tps, theirs_tps) = (median(ours_runs), median(theirs_runs));
    if ours_loss.len() != args.steps || theirs_loss.len() != args.steps {
        bail!(
            "expected {} losses from each side, got {} (ours) and {} (PyTorch)",
            args.steps,
            ours_loss.len(),
            theirs_loss.len()
        );
    }
    let tail = |v: &[f64]| {
        let k = v.len().min(10);
        v[v.len() - k..].iter().sum::<f64>() / k as f64
    };
    println!();
    println!(
        "GPT {} layers, {} heads, {} wide, block {}, batch {} per rank, {} ranks x {} thread(s), \
         {} steps, AdamW lr {:e} (cosine, warm-up {}), clip {}:",
        args.n_layer,
        args.n_head,
        args.n_embd,
        args.block_size,
        args.batch_size,
        args.nproc,
        args.threads,
        args.steps,
        args.lr,
        args.warmup_steps,
        args.max_grad_norm
    );
    println!(
        "{}",
        util::md_header(
            &[
                "",
                "tokens/s (median)",
                "runs",
                "loss step 1",
                "loss step 2"
            ],
            [
                "loss step 3".to_string(),
                "mean loss, last 10 steps".to_string()
            ]
        )
        .trim_end()
    );
    for (name, tps, runs, loss) in [
        ("ours (ddprun, train-gpt)", ours_tps, ours_runs, ours_loss),
        (
            "PyTorch DDP (torchrun, gloo)",
            theirs_tps,
            theirs_runs,
            theirs_loss,
        ),
    ] {
        let runs: Vec<String> = runs.iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "| {name} | {tps:.0} | {} | {:.6} | {:.6} | {:.6} | {:.4} |",
            runs.join(", "),
            loss[0],
            loss[1],
            loss[2],
            tail(loss)
        );
    }
    println!(
        "ratio ours / PyTorch: {:.2}x (above 1: we are faster)",
        ours_tps / theirs_tps
    );
    println!();
    println!("| step | ours | PyTorch |");
    println!("| --- | --- | --- |");
    let every = (args.steps / 20).max(1);
    for (i, (a, b)) in ours_loss.iter().zip(theirs_loss).enumerate() {
        if i < 3 || (i + 1) % every == 0 {
            println!("| {} | {a:.4} | {b:.4} |", i + 1);
        }
    }
    let first = (ours_loss[0] - theirs_loss[0]).abs();
    let end = (tail(ours_loss) - tail(theirs_loss)).abs() / tail(theirs_loss);
    println!();
    let widest = ours_loss
        .iter()
        .zip(theirs_loss)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("step 1: |ours - PyTorch| = {first:.2e} (tolerance 1e-4)");
    println!(
        "largest |ours - PyTorch| over all {} steps: {widest:.2e}",
        args.steps
    );
    println!(
        "last 10 steps: relative difference {:.2} % (tolerance 2 %)",
        100.0 * end
    );
    if first > 1e-4 {
        bail!("the first step's losses differ by {first:.2e}: not the same weights or data");
    }
    if end > 0.02 {
        bail!("the end losses differ by {:.2} %", 100.0 * end);
    }
    Ok(())
}
