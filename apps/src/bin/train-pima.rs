//! `train-pima`: the Pima Indians diabetes MLP, data-parallel over every rank the environment
//! describes (world size 1 when it describes none).

/// mimalloc, for the reasons given at its dependency in apps/Cargo.toml.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use burn::tensor::Device;
use clap::Parser;
use ddp_apps::options::{TrainArgs, TrainConfig};
use ddp_apps::spawn::SpawnArgs;
use ddp_apps::train::{self, Task};
use ddp_comm::ProcessGroup;
use ddp_data::{PimaSplit, PimaTable};
use ddp_models::PimaMlpConfig;

/// Train the Pima diabetes classifier with data parallelism across ranks.
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Cli {
    /// CSV file (8 features and the label, no header); the bundled copy when absent.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Fraction of rows held out for testing (stratified by label).
    #[arg(long, default_value_t = 0.2)]
    test_fraction: f64,
    #[command(flatten)]
    args: TrainArgs,
    #[command(flatten)]
    spawn: SpawnArgs,
}

fn defaults() -> TrainArgs {
    TrainArgs {
        epochs: Some(60),
        batch_size: Some(16),
        lr: Some(1e-3),
        log_interval: Some(1000),
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
    let train::Started { cfg, pg, device } = train::start(&cli.args, &defaults())?;

    if cfg.data_format != ddp_apps::options::DataFormat::Memory {
        anyhow::bail!("train-pima reads its CSV into memory: --data-format shards is for MNIST");
    }
    let table = PimaTable::load(cli.csv.as_deref())?;
    let split = table.split(cli.test_fraction, cfg.seed)?;

    run(&cfg, pg, device, split)
}

/// Trains the MLP on `device` (the same loop on the CPU and on GPUs).
fn run(cfg: &TrainConfig, pg: Arc<ProcessGroup>, device: Device, split: PimaSplit) -> Result<()> {
    device.seed(cfg.seed);
    let task = Task {
        name: "pima-mlp".into(),
        model: PimaMlpConfig::new().init(&device),
        train: Arc::new(split.train).into(),
        test: Arc::new(split.test).into(),
    };
    ddp_apps::fit::train::<_, _, 2>(cfg, pg, device, task)?;
    Ok(())
}
