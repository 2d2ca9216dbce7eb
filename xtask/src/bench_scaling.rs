//! `cargo xtask bench-scaling`: trains the MNIST CNN for a fixed number of steps at world sizes
//! 1, 2 and 4 (fixed per-rank batch, one compute thread per rank) and reports samples/s,
//! scaling efficiency (samples/s at N over N × samples/s at 1), gradient-communication time per
//! step and peak RSS per rank. Writes `scaling.md`, `scaling.json` and `scaling.svg` (samples/s and efficiency).
//!
//! On a machine with fewer cores than ranks the ranks share cores, and the table says so: the
//! efficiency there measures oversubscription as much as DDP.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::train::{launch, Summary};
use crate::{plot, util};

/// Options of `bench-scaling`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// World sizes to run, comma separated.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 2, 4])]
    pub worlds: Vec<usize>,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 60)]
    pub steps: u64,
    /// Batch size per rank.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// MNIST folder (the trainer's default cache when absent).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Output folder (default `target/bench`).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One world size's figures.
#[derive(Debug, Clone, Serialize)]
struct Row {
    world: usize,
    steps: u64,
    samples_per_sec: f64,
    efficiency: f64,
    step_ms: f64,
    comm_ms_per_step: f64,
    pack_ms_per_step: f64,
    wait_ms_per_step: f64,
    unpack_ms_per_step: f64,
    peak_rss_mib: Vec<f64>,
    oversubscribed: bool,
}

/// `cargo xtask bench-scaling`.
pub fn run(args: Args) -> Result<()> {
    let bin_dir = util::build_release_bins(&["ddprun", "train-mnist"], &[])?;
    let out = match args.out {
        Some(out) => out,
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows: Vec<Row> = Vec::new();
    for &world in &args.worlds {
        let mut trainer_args: Vec<String> = [
            "--model",
            "cnn",
            "--epochs",
            "1",
            "--threads",
            "1",
            "--workers",
            "1",
            "--test-samples",
            "500",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        trainer_args.extend([
            "--max-steps".into(),
            args.steps.to_string(),
            "--batch-size".into(),
            args.batch_size.to_string(),
            "--log-interval".into(),
            (args.steps / 2).max(1).to_string(),
        ]);
        if let Some(dir) = &args.data_dir {
            trainer_args.extend(["--data-dir".into(), dir.display().to_string()]);
        }
        let s: Summary = launch(&bin_dir, "train-mnist", world, &trainer_args)
            .with_context(|| format!("world size {world}"))?;
        let base = rows.first().map_or(s.samples_per_sec / world as f64, |r| {
            r.samples_per_sec / r.world as f64
        });
        let step_s = (args.batch_size * world) as f64 / s.samples_per_sec;
        rows.push(Row {
            world,
            steps: s.steps,
            samples_per_sec: s.samples_per_sec,
            efficiency: s.samples_per_sec / (world as f64 * base),
            step_ms: 1e3 * step_s,
            comm_ms_per_step: 1e3 * s.comm_seconds / s.steps.max(1) as f64,
            pack_ms_per_step: 1e3 * s.pack_seconds / s.steps.max(1) as f64,
            wait_ms_per_step: 1e3 * s.wait_seconds / s.steps.max(1) as f64,
            unpack_ms_per_step: 1e3 * s.unpack_seconds / s.steps.max(1) as f64,
            peak_rss_mib: s.peak_rss_mib,
            oversubscribed: world > cores,
        });
    }

    let mut md = format!(
        "MNIST CNN, {} steps per run, batch {} per rank, 1 compute thread per rank, on {} \
         core(s).\n\n| ranks | samples/s | efficiency | step (ms) | comm per step (ms): pack + wait + \
         unpack | peak RSS per rank (MiB) | note |\n| --- | --- | --- | --- | --- | --- | --- |\n",
        args.steps, args.batch_size, cores
    );
    for r in &rows {
        let rss: Vec<String> = r.peak_rss_mib.iter().map(|m| format!("{m:.0}")).collect();
        md += &format!(
            "| {} | {:.0} | {:.2} | {:.0} | {:.1}: {:.1} + {:.1} + {:.1} | {} | {} |\n",
            r.world,
            r.samples_per_sec,
            r.efficiency,
            r.step_ms,
            r.comm_ms_per_step,
            r.pack_ms_per_step,
            r.wait_ms_per_step,
            r.unpack_ms_per_step,
            rss.join(", "),
            if r.oversubscribed {
                format!("{} ranks share {} cores", r.world, cores)
            } else {
                String::new()
            }
        );
    }
    md += "\nefficiency = samples/s at N / (N × samples/s at 1); comm per step = time the step \
           spends packing, waiting for and unpacking gradient all-reduces (rank 0).\n";
    println!("\n{md}");
    std::fs::write(out.join("scaling.md"), &md)?;
    std::fs::write(
        out.join("scaling.json"),
        serde_json::to_string_pretty(&serde_json::json!({ "cores": cores, "rows": rows }))?,
    )?;
    let svg = out.join("scaling.svg");
    plot::svg(&svg, &plot(&rows, cores))?;
    println!(
        "wrote {}, {} and {}",
        out.join("scaling.md").display(),
        out.join("scaling.json").display(),
        svg.display()
    );
    Ok(())
}

/// Two panels: samples/s against ranks (measured and ideal, linear from the first world size),
/// and the scaling efficiency.
fn plot(rows: &[Row], cores: usize) -> Vec<plot::Chart> {
    let base = rows
        .first()
        .map_or(1.0, |r| r.samples_per_sec / r.world as f64);
    let worlds = |f: &dyn Fn(&Row) -> f64| -> Vec<(f64, f64)> {
        rows.iter().map(|r| (r.world as f64, f(r))).collect()
    };
    let ticks = rows.iter().map(|r| r.world).max().unwrap_or(1);
    vec![
        plot::Chart {
            title: format!("MNIST CNN training throughput ({cores} cores)"),
            x_desc: "ranks (processes)".into(),
            y_desc: "samples/s (all ranks)".into(),
            series: vec![
                plot::Series {
                    label: "measured".into(),
                    points: worlds(&|r| r.samples_per_sec),
                    reference: false,
                },
                plot::Series {
                    label: "ideal (linear)".into(),
                    points: worlds(&|r| base * r.world as f64),
                    reference: true,
                },
            ],
            x_label: |x| format!("{x:.0}"),
            x_ticks: ticks,
        },
        plot::Chart {
            title: "scaling efficiency: samples/s at N / (N x samples/s at 1)".into(),
            x_desc: "ranks (processes)".into(),
            y_desc: "efficiency".into(),
            series: vec![
                plot::Series {
                    label: "measured".into(),
                    points: worlds(&|r| r.efficiency),
                    reference: false,
                },
                plot::Series {
                    label: "ideal".into(),
                    points: worlds(&|_| 1.0),
                    reference: true,
                },
            ],
            x_label: |x| format!("{x:.0}"),
            x_ticks: ticks,
        },
    ]
}
