//! `train-mnist`: the MNIST CNN (or MLP) of PyTorch's examples, data-parallel over every rank
//! the environment describes (world size 1 when it describes none).

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;

use anyhow::Result;
use burn::tensor::Device;
use clap::{Parser, ValueEnum};
use ddp_apps::options::{DataFormat, TrainArgs, TrainConfig};
use ddp_apps::spawn::SpawnArgs;
use ddp_apps::train::{self, Data, Task};
use ddp_comm::ProcessGroup;
use ddp_data::{ensure_mnist, Mnist, MnistSplit, ShardSet};
use ddp_models::{MnistCnnConfig, MnistMlpConfig};

/// Which network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ModelKind {
    /// conv 32, conv 64, max-pool, dropout, fc 128, dropout, fc 10 (PyTorch's example).
    Cnn,
    /// 784-256-10 with ReLU.
    Mlp,
}

/// Train a classifier on MNIST with data parallelism across ranks.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Cli {
    /// The network.
    #[arg(long, value_enum, default_value = "cnn")]
    model: ModelKind,
    /// Hidden units of `--model mlp` (784 → hidden → 10; 64000 makes the 50.9 M-parameter MLP
    /// of the ZeRO and elastic benchmarks).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Only obtain MNIST (download it into --data-dir or the default cache folder, checked
    /// against its SHA-256 sums, unless it is already there), print its folder and exit; for
    /// job scripts that fetch once before starting the ranks.
    #[arg(long)]
    fetch_data: bool,
    #[command(flatten)]
    args: TrainArgs,
    #[command(flatten)]
    spawn: SpawnArgs,
}

/// Defaults that reach 98 % test accuracy in two epochs on two ranks.
fn defaults() -> TrainArgs {
    TrainArgs {
        epochs: Some(2),
        batch_size: Some(64),
        lr: Some(1e-3),
        ..TrainArgs::default()
    }
}

fn main() -> std::process::ExitCode {
    ddp_comm::elastic::finish(try_main())
}

fn try_main() -> Result<()> {
    let cli = Cli::parse();
    if cli.fetch_data {
        println!("{}", ensure_mnist(cli.args.data_dir.as_deref())?.display());
        return Ok(());
    }
    if let Some(ranks) = cli.spawn.run_ranks() {
        return ranks;
    }
    let train::Started { cfg, pg, device } = train::start(&cli.args, &defaults())?;

    let (train_set, test_set) = match (cfg.data_format, &cfg.data_dir) {
        // Streamed: each rank opens the indexes now (errors surface before training) and
        // later reads only its own shards.
        (DataFormat::Shards, Some(dir)) => (
            Data::Shards(ShardSet::open(&dir.join("train"))?),
            Data::Shards(ShardSet::open(&dir.join("test"))?),
        ),
        _ => {
            // One download per host: local rank 0 fetches, the others wait and then find the
            // files.
            if pg.local_rank() == 0 {
                ensure_mnist(cfg.data_dir.as_deref())?;
            }
            pg.barrier()?;
            let dir = ensure_mnist(cfg.data_dir.as_deref())?;
            (
                Arc::new(Mnist::load(&dir, MnistSplit::Train)?).into(),
                Arc::new(Mnist::load(&dir, MnistSplit::Test)?).into(),
            )
        }
    };

    run(
        (cli.model, cli.hidden),
        &cfg,
        pg,
        device,
        train_set,
        test_set,
    )
}

/// Trains the chosen network on `device` (the same loop on the CPU and on GPUs).
fn run(
    (model, hidden): (ModelKind, usize),
    cfg: &TrainConfig,
    pg: Arc<ProcessGroup>,
    device: Device,
    train_set: Data<Mnist>,
    test_set: Data<Mnist>,
) -> Result<()> {
    device.seed(cfg.seed);
    match model {
        ModelKind::Cnn => {
            let task = Task {
                name: "cnn".into(),
                model: MnistCnnConfig::new().init(&device),
                train: train_set,
                test: test_set,
            };
            ddp_apps::fit::train::<_, _, 4>(cfg, pg, device, task)?;
        }
        ModelKind::Mlp => {
            let task = Task {
                name: "mlp".into(),
                model: MnistMlpConfig::new().with_hidden(hidden).init(&device),
                train: train_set,
                test: test_set,
            };
            ddp_apps::fit::train::<_, _, 4>(cfg, pg, device, task)?;
        }
    }
    Ok(())
}
