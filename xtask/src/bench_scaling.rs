//! `cargo xtask bench-scaling`: trains the MNIST CNN for a fixed number of steps at world sizes
//! 1, 2 and 4 (fixed per-rank batch, one compute thread per rank) and reports samples/s,
//! scaling efficiency (samples/s at N over N × samples/s at 1), gradient-communication time per
//! step and peak RSS per rank. Writes `scaling.md`, `scaling.json` and `scaling.png`.
//!
//! On a machine with fewer cores than ranks the ranks share cores, and the table says so: the
//! efficiency there measures oversubscription as much as DDP.

use std::path::PathBuf;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::train::{launch, Summary};
use crate::util;

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
    let png = out.join("scaling.png");
    plot(&rows, cores).save(&png)?;
    println!(
        "wrote {}, {} and {}",
        out.join("scaling.md").display(),
        out.join("scaling.json").display(),
        png.display()
    );
    Ok(())
}

/// samples/s against ranks, measured and ideal (linear from world 1).
fn plot(rows: &[Row], cores: usize) -> Canvas {
    let mut c = Canvas::new(640, 420);
    let (x0, y0, x1, y1) = (100, 360, 610, 50); // plot area: left, bottom, right, top
    let max_world = rows.iter().map(|r| r.world).max().unwrap_or(1).max(2) as f64;
    let base = rows
        .first()
        .map_or(1.0, |r| r.samples_per_sec / r.world as f64);
    let max_y = rows
        .iter()
        .map(|r| r.samples_per_sec.max(base * r.world as f64))
        .fold(1.0, f64::max)
        * 1.1;
    let px = |w: f64| x0 as f64 + (w - 1.0) / (max_world - 1.0) * (x1 - x0) as f64;
    let py = |v: f64| y0 as f64 - v / max_y * (y0 - y1) as f64;
    let black = [0, 0, 0];
    c.line(x0 as f64, y0 as f64, x1 as f64, y0 as f64, black);
    c.line(x0 as f64, y0 as f64, x0 as f64, y1 as f64, black);
    for i in 0..=4 {
        let v = max_y * i as f64 / 4.0;
        let y = py(v);
        c.line(x0 as f64 - 5.0, y, x0 as f64, y, black);
        c.text(4, y as i64 - 7, &format!("{v:>5.0}"), black);
    }
    for r in rows {
        let x = px(r.world as f64);
        c.line(x, y0 as f64, x, y0 as f64 + 5.0, black);
        c.text(x as i64 - 6, y0 + 12, &r.world.to_string(), black);
    }
    c.text(250, y0 + 36, "ranks (processes)", black);
    c.text(
        x0,
        12,
        &format!("MNIST CNN samples/s ({cores} cores)"),
        black,
    );
    let (blue, grey) = ([30, 90, 200], [150, 150, 150]);
    c.line(px(1.0), py(base), px(max_world), py(base * max_world), grey);
    for pair in rows.windows(2) {
        c.line(
            px(pair[0].world as f64),
            py(pair[0].samples_per_sec),
            px(pair[1].world as f64),
            py(pair[1].samples_per_sec),
            blue,
        );
    }
    for r in rows {
        c.dot(px(r.world as f64), py(r.samples_per_sec), blue);
    }
    c.text(x0 + 20, y1 + 10, "measured", blue);
    c.text(x0 + 20, y1 + 30, "ideal (linear)", grey);
    c
}

/// A minimal RGB raster with lines, dots and 8x8-font text, saved as PNG.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Canvas {
        Canvas {
            w,
            h,
            px: vec![255; w * h * 3],
        }
    }

    fn set(&mut self, x: i64, y: i64, rgb: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&rgb);
        }
    }

    /// A 2-pixel-wide line.
    fn line(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, rgb: [u8; 3]) {
        let n = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as usize;
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = (x0 + t * (x1 - x0), y0 + t * (y1 - y0));
            for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                self.set(x as i64 + dx, y as i64 + dy, rgb);
            }
        }
    }

    fn dot(&mut self, x: f64, y: f64, rgb: [u8; 3]) {
        for dy in -4..=4i64 {
            for dx in -4..=4i64 {
                if dx * dx + dy * dy <= 16 {
                    self.set(x as i64 + dx, y as i64 + dy, rgb);
                }
            }
        }
    }

    /// Text in the 8x8 font, scaled 2x.
    fn text(&mut self, x: i64, y: i64, s: &str, rgb: [u8; 3]) {
        for (k, ch) in s.chars().enumerate() {
            let glyph = font8x8::legacy::BASIC_LEGACY
                .get(ch as usize)
                .copied()
                .unwrap_or([0; 8]);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                            self.set(
                                x + k as i64 * 16 + col * 2 + dx,
                                y + row as i64 * 2 + dy,
                                rgb,
                            );
                        }
                    }
                }
            }
        }
    }

    fn save(&self, path: &std::path::Path) -> Result<()> {
        let file =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut encoder =
            png::Encoder::new(std::io::BufWriter::new(file), self.w as u32, self.h as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        encoder.write_header()?.write_image_data(&self.px)?;
        Ok(())
    }
}
