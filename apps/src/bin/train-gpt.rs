//! `train-gpt`: a small GPT (ddp-models' [`ddp_models::Gpt`]) on the characters of any UTF-8
//! text file, data-parallel over every rank the environment describes (world size 1 when it
//! describes none), with everything `train-mnist` has: checkpoints and resume, TensorBoard
//! metrics, ZeRO, overlap, AdamW, clipping and the learning-rate schedule.
//!
//! The vocabulary is the text's sorted distinct characters; the first `--train-fraction` of
//! the text trains (every window of `--block-size` characters, in the sampler's seeded order,
//! each rank its share), the rest validates (disjoint windows). A "sample" of the trainer's
//! counts is one predicted character: samples/s are tokens/s, the test accuracy is the share of
//! validation characters predicted exactly.

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Parser;
use ddp_apps::options::{DataFormat, OptimizerKind, TrainArgs};
use ddp_apps::spawn::SpawnArgs;
use ddp_apps::train::{self, Task};
use ddp_data::CharText;
use ddp_models::GptConfig;

/// Train a character-level GPT on a text file with data parallelism across ranks.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Cli {
    /// The text to learn: any UTF-8 file.
    #[arg(long)]
    text: PathBuf,
    /// Characters of context (and of every training window).
    #[arg(long, default_value_t = 256)]
    block_size: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 6)]
    n_layer: usize,
    /// Attention heads (must divide --n-embd).
    #[arg(long, default_value_t = 6)]
    n_head: usize,
    /// Width of the model.
    #[arg(long, default_value_t = 384)]
    n_embd: usize,
    /// Dropout probability (0: none, as the default).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Fraction of the text (from its start) that trains; the rest validates.
    #[arg(long, default_value_t = 0.9)]
    train_fraction: f64,
    #[command(flatten)]
    args: TrainArgs,
    #[command(flatten)]
    spawn: SpawnArgs,
}

/// nanoGPT's character-level settings, scaled to a CPU: AdamW at 1e-3, clipped at norm 1,
/// 12 windows per rank, one epoch (cut it with `--max-steps`).
fn defaults() -> TrainArgs {
    TrainArgs {
        epochs: Some(1),
        batch_size: Some(12),
        lr: Some(1e-3),
        optimizer: Some(OptimizerKind::Adamw),
        max_grad_norm: Some(1.0),
        log_interval: Some(10),
        ..TrainArgs::default()
    }
}

fn main() -> std::process::ExitCode {
    ddp_comm::elastic::finish(try_main())
}

fn try_main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(ranks) = cli.spawn.run_ranks() {
        return ranks;
    }
    if cli.n_head == 0 || cli.n_embd == 0 || !cli.n_embd.is_multiple_of(cli.n_head) {
        bail!(
            "--n-head ({}) must divide --n-embd ({}), both at least 1",
            cli.n_head,
            cli.n_embd
        );
    }
    if cli.n_layer == 0 || cli.block_size == 0 {
        bail!("--n-layer and --block-size must be at least 1");
    }
    if !(0.0..1.0).contains(&cli.dropout) {
        bail!("--dropout must be in [0, 1) (got {})", cli.dropout);
    }
    let train::Started { cfg, pg, device } = train::start(&cli.args, &defaults())?;
    if cfg.data_format != DataFormat::Memory {
        bail!("train-gpt reads its text into memory: --data-format shards is for MNIST");
    }
    let text = CharText::load(&cli.text)?;
    let (train_set, test_set) = text.split(cli.train_fraction, cli.block_size)?;
    let config = GptConfig::new(text.vocab_size())
        .with_block_size(cli.block_size)
        .with_n_layer(cli.n_layer)
        .with_n_head(cli.n_head)
        .with_n_embd(cli.n_embd)
        .with_dropout(cli.dropout);
    if pg.rank() == 0 {
        println!(
            "{}: {} characters, vocabulary {}; GPT of {} parameters ({} layers, {} heads, {} \
             wide, block {})",
            cli.text.display(),
            text.len(),
            text.vocab_size(),
            config.num_params(),
            cli.n_layer,
            cli.n_head,
            cli.n_embd,
            cli.block_size
        );
    }
    device.seed(cfg.seed);
    let task = Task {
        name: "gpt".into(),
        model: config.init(&device),
        train: Arc::new(train_set).into(),
        test: Arc::new(test_set).into(),
    };
    ddp_apps::fit::train::<_, _, 2>(&cfg, pg, device, task)?;
    Ok(())
}
