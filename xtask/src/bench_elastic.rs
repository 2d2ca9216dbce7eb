//! `cargo xtask bench-elastic`: what a rank's death costs an elastic job against ddprun's
//! restart from a checkpoint, and what the elastic setting costs a job where nothing fails.
//!
//! Failure: three ranks train MNIST with `train-mnist` (the CNN, and the 50.9 M-parameter MLP
//! 784 → 64000 → 10 with Adam, 600 MB of state; `mlp-zero1`, not run by default: the MLP
//! under ZeRO stage 1), and rank 1 kills itself (SIGKILL) right after
//! step 30 (the trainers' `DDP_TEST_KILL_AT_STEP` hook):
//!
//! - elastic: three `ddprun --nnodes 2:3` agents, one rank each, `--max-restarts 1`: the
//!   survivors go on at world 2, rank 1's agent restarts it, it is healed from rank 0 and the
//!   world grows back to 3;
//! - restart: one `ddprun --nproc-per-node 3 --max-restarts 1` with `--checkpoint-every 20`:
//!   every rank restarts and resumes from step 20's checkpoint.
//!
//! Every line of every agent is stamped as it arrives; the elastic trainers also stamp their
//! lines with the wall clock. Reported, from the kill (the hook's line): the time until the
//! survivors train again (re-formed at world 2 and wrapped: rank 0's generation-2 line), the
//! next step (the survivors' first committed step, stamped when committed; the restarted
//! job's first step), the heal (from the commit of the step after which the rank joins, as
//! rank 0's generation line says it, until the group of 3 trains: re-formed, the state sent,
//! wrapped), the time until the world is back at 3 (the healed rank's first committed step;
//! the restarted job's first step), the time until the job is past the step it was killed
//! in, the steps lost (computed and thrown away: the dropped step in flight; the steps after
//! the checkpoint and the one in flight) and the steps computed twice. `--no-restart` measures the elastic run alone.
//!
//! Steady state: `bench-scaling`'s run (CNN, batch 64 per rank, one thread per rank, 60
//! steps) at 2 and 3 ranks, plain and with `--elastic N:N` (the commit vote after every step),
//! alternating, `--repeats` times each; the medians of samples/s and their ratio, and the
//! commit vote's own time (`ElasticDdp::vote_time`, from every rank's summary).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::util;

/// Options of `bench-elastic`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Models: `cnn`, `mlp` (the 50.9 M-parameter MLP) and `mlp-zero1` (the same under ZeRO
    /// stage 1: the optimizer state resharded over the survivors, not sent from rank 0).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["cnn".to_string(), "mlp".to_string()])]
    models: Vec<String>,
    /// Runs of each steady-state configuration (medians are reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Skip the steady-state comparison.
    #[arg(long)]
    no_steady: bool,
    /// Skip the restart from a checkpoint (measure the elastic recovery only).
    #[arg(long)]
    no_restart: bool,
    /// MNIST folder (the trainer's default cache when absent).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Output folder (default `target/bench`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The step after which rank 1 kills itself.
const KILL_AT: u64 = 30;

/// One agent (a ddprun), its lines stamped as they arrive.
struct Agent {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    seen: Vec<(Instant, String)>,
}

impl Agent {
    fn start(mut command: Command) -> Result<Agent> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().context("starting ddprun")?;
        let (tx, lines) = mpsc::channel();
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().context("stdout")?);
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().context("stderr")?);
        for stream in [out, err] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((Instant::now(), line));
                }
            });
        }
        Ok(Agent {
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// Waits (at most `limit`) for the agent to exit and keeps its stamped lines.
    fn finish(&mut self, limit: Duration) -> Result<bool> {
        let deadline = Instant::now() + limit;
        loop {
            while let Ok(line) = self.lines.try_recv() {
                self.seen.push(line);
            }
            if let Some(status) = self.child.try_wait()? {
                while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
                    self.seen.push(line);
                }
                return Ok(status.success());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!("an agent did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// When the first line containing `what` arrived after `after`.
    fn first(&self, what: &str, after: Instant) -> Option<(Instant, &str)> {
        self.seen
            .iter()
            .find(|(t, l)| *t >= after && l.contains(what))
            .map(|(t, l)| (*t, l.as_str()))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a kill cost one way of running.
#[derive(Debug, Clone, Serialize)]
struct Recovery {
    model: String,
    mode: String,
    /// From the kill until the survivors train again (re-formed and wrapped; elastic), or the
    /// restarted job's first step (restart).
    training_again_s: f64,
    /// From the kill until the survivors' next step is committed (elastic), or the restarted
    /// job's first step.
    next_step_s: f64,
    /// The heal: from the survivors' step after which the rank joined until the group of 3
    /// trains (re-formed, state sent, wrapped); NaN (shown as "–") for a restart, and when the
    /// generation that grew back does not continue after the survivors' first step.
    heal_s: f64,
    /// From the kill until the world is back at 3.
    rejoin_s: f64,
    /// From the kill until the job is past the step it was killed in.
    past_kill_s: f64,
    steps_lost: u64,
    steps_repeated: u64,
    /// State that travelled to the healed rank (elastic), or was read from the checkpoint.
    state_mb: f64,
}

/// `cargo xtask bench-elastic`.
pub fn run(args: Args) -> Result<()> {
    let bin_dir = util::build_release_bins(&["ddprun", "train-mnist"], &[])?;
    let out = match &args.out {
        Some(out) => out.clone(),
        None => util::target_dir()?.join("bench"),
    };
    std::fs::create_dir_all(&out)?;
    let mut rows = Vec::new();
    for model in &args.models {
        let (model_args, state_mb) = match model.as_str() {
            "cnn" => (vec!["--model", "cnn", "--batch-size", "64"], 4.8 * 3.0),
            "mlp" => (
                vec!["--model", "mlp", "--hidden", "64000", "--batch-size", "16"],
                203.6 * 3.0,
            ),
            // ZeRO stage 1: the joiner receives the weights and its third of Adam's moments.
            "mlp-zero1" => (
                vec![
                    "--model",
                    "mlp",
                    "--hidden",
                    "64000",
                    "--batch-size",
                    "16",
                    "--zero-stage",
                    "1",
                ],
                203.6 * (1.0 + 2.0 / 3.0),
            ),
            other => bail!("--models: unknown model {other} (cnn, mlp, mlp-zero1)"),
        };
        let mut trainer: Vec<String> = model_args.iter().map(|s| s.to_string()).collect();
        trainer.extend(
            [
                "--epochs",
                "1",
                "--threads",
                "1",
                "--max-steps",
                "60",
                "--log-interval",
                "1",
                "--test-samples",
                "500",
                "--json",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        if let Some(dir) = &args.data_dir {
            trainer.extend(["--data-dir".into(), dir.display().to_string()]);
        }
        rows.push(elastic_recovery(&bin_dir, &out, model, &trainer, state_mb)?);
        if !args.no_restart {
            rows.push(checkpoint_recovery(&bin_dir, model, &trainer, state_mb)?);
        }
    }
    let mut md = String::from(
        "A kill -9 of rank 1 of 3 right after step 30 (train-mnist, one thread per rank, \
         one host): elastic (`ddprun --nnodes 2:3`, three agents) against ddprun's restart \
         from a checkpoint written every 20 steps.\n\n| model | mode | next step (s) | world \
         back at 3 (s) | past step 31 (s) | steps lost | steps computed twice | state \
         moved (MB) | training again (s) | heal (s) |\n| --- | --- | --- | --- | --- | --- | --- \
         | --- | --- | --- |\n",
    );
    for r in &rows {
        md += &format!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {:.0} | {:.2} | {} |\n",
            r.model,
            r.mode,
            r.next_step_s,
            r.rejoin_s,
            r.past_kill_s,
            r.steps_lost,
            r.steps_repeated,
            r.state_mb,
            r.training_again_s,
            seconds_or_dash(r.heal_s)
        );
    }
    if rows
        .iter()
        .any(|r| r.mode == "elastic" && r.heal_s.is_nan())
    {
        md += "\nheal –: not measured: rank 0's line of the generation that grew back to 3 \
               names no commit time (a trainer from before it did) and that generation does \
               not continue after the survivors' first step.\n";
    }
    let steady = if args.no_steady {
        Vec::new()
    } else {
        steady_state(&bin_dir, &args)?
    };
    if !steady.is_empty() {
        md += "\nSteady state (`bench-scaling`'s run: CNN, batch 64 per rank, 60 steps), \
               medians of samples/s; the commit vote (what `--elastic` adds to a step): the \
               rank longest in it, per step and as a share of its training time, medians:\n\n\
               | ranks | plain | --elastic N:N | elastic / plain | vote per step (ms) | \
               vote / step |\n| --- | --- | --- | --- | --- | --- |\n";
        for s in &steady {
            md += &format!(
                "| {} | {:.0} | {:.0} | {:.3} | {:.2} | {:.2} % |\n",
                s.world,
                s.plain,
                s.elastic,
                s.elastic / s.plain,
                s.vote_ms,
                100.0 * s.vote_share
            );
        }
    }
    println!("\n{md}");
    std::fs::write(out.join("elastic.md"), &md)?;
    std::fs::write(
        out.join("elastic.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "recovery": rows,
            "steady": steady,
        }))?,
    )?;
    println!(
        "wrote {} and elastic.json",
        out.join("elastic.md").display()
    );
    Ok(())
}

/// A free TCP port (bound and released).
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The wall-clock stamp ending a trainer's line (`... at T`, ms since the Unix epoch).
fn stamp(line: &str) -> Option<u128> {
    line.rsplit_once(" at ")?.1.trim().parse().ok()
}

/// The step number in a trainer's progress line (`epoch 1 step 31 (...`).
fn step_of(line: &str) -> Option<u64> {
    let (_, rest) = line.split_once(" step ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// The first progress line (`epoch E step N (`) after `after` with a step above `above`.
fn first_step_after(agent: &Agent, after: Instant, above: u64) -> Option<(Instant, u64)> {
    agent
        .seen
        .iter()
        .filter(|(t, l)| {
            *t >= after && l.contains("epoch ") && l.contains(" step ") && l.contains(" (")
        })
        .find_map(|(t, l)| step_of(l).filter(|s| *s > above).map(|s| (*t, s)))
}

/// Three elastic agents; rank 1 dies after step 30. Each agent's output (its trainers' lines,
/// with `RUST_LOG=ddp=debug` the heal's phases) goes to `out/elastic-MODEL-agentN.log`.
fn elastic_recovery(
    bin: &Path,
    out: &Path,
    model: &str,
    trainer: &[String],
    state_mb: f64,
) -> Result<Recovery> {
    let port = free_port()?;
    let mut agents = Vec::new();
    for node in 0..3 {
        let mut command = Command::new(bin.join("ddprun"));
        command
            .args(["--nnodes", "2:3", "--node-rank", &node.to_string()])
            .args([
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                &port.to_string(),
            ])
            .args(["--max-restarts", "1", "--"])
            .arg(bin.join("train-mnist"))
            .args(trainer)
            .env("DDP_TEST_KILL_AT_STEP", KILL_AT.to_string())
            .env("DDP_TEST_KILL_RANK", "1");
        agents.push(Agent::start(command)?);
    }
    for (node, a) in agents.iter_mut().enumerate() {
        let finished = a.finish(Duration::from_secs(1800))?;
        let log: String = a.seen.iter().map(|(_, l)| format!("{l}\n")).collect();
        std::fs::write(out.join(format!("elastic-{model}-agent{node}.log")), log)?;
        if !finished {
            bail!(
                "an elastic agent failed:\n{}",
                a.seen
                    .iter()
                    .map(|(_, l)| l.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    // The trainers stamp the kill and the first step after each membership change with the
    // wall clock (ms since the epoch, one host): those stamps, not the time a line came through
    // the agents' pipes, measure the recovery.
    let start = agents[0].seen.first().map_or(Instant::now(), |(t, _)| *t);
    let (killed, kill_line) = agents[1]
        .first("kills itself after step", start)
        .context("rank 1's kill line")?;
    let killed_ms = stamp(kill_line).context("the kill line's time")?;
    let (_, next_line) = agents[0]
        .first("elastic: step ", killed)
        .context("the survivors' first step after the kill")?;
    let next_ms = stamp(next_line).context("the survivors' step time")?;
    let (_, shrunk_line) = agents[0]
        .first("elastic: generation 2: rank", killed)
        .context("the survivors' generation 2")?;
    let shrunk_ms = stamp(shrunk_line).context("generation 2's time")?;
    // The generation that grows back: rank 0's line, printed once the joiner is healed and
    // the model wrapped; the heal is timed from the commit of the step it continues after.
    let (_, grown_line) = agents[0]
        .first(" of 3 (joined slots [1]", killed)
        .context("the generation that grows back to 3")?;
    let grown_ms = stamp(grown_line).context("the grown generation's time")?;
    let after = |line: &str, key: &str| -> Option<u64> {
        line.split_once(key)?
            .1
            .split_whitespace()
            .next()?
            .trim_end_matches(',')
            .parse()
            .ok()
    };
    // The step's commit time as rank 0 printed it; before the trainers printed it, the
    // survivors' first step's (when the rank joined after that one).
    let heal_from = after(grown_line, ", committed at ")
        .map(u128::from)
        .or_else(|| {
            (after(grown_line, "continuing after step ") == step_of(next_line)).then_some(next_ms)
        });
    let (_, back_line) = agents[1]
        .first("elastic: step ", killed)
        .context("the healed rank's first step")?;
    let back_ms = stamp(back_line).context("the healed rank's step time")?;
    let (past, _) = first_step_after(&agents[0], killed, KILL_AT + 1).context("step 32")?;
    let summary = |a: &Agent| -> Option<serde_json::Value> {
        a.seen.iter().rev().find_map(|(_, l)| {
            l.split_once("DDP_ELASTIC_SUMMARY ")
                .and_then(|(_, j)| serde_json::from_str(j).ok())
        })
    };
    let s0 = summary(&agents[0]).context("rank 0's elastic summary")?;
    let secs = |t: Instant| t.duration_since(killed).as_secs_f64();
    let after_kill = |ms: u128| ms.saturating_sub(killed_ms) as f64 / 1000.0;
    let heal_s = heal_from.map_or(f64::NAN, |from| {
        grown_ms.saturating_sub(from) as f64 / 1000.0
    });
    eprintln!(
        "elastic {model}: training again {:.2} s, next step {:.2} s, heal {} s, back at 3 \
         {:.2} s",
        after_kill(shrunk_ms),
        after_kill(next_ms),
        seconds_or_dash(heal_s),
        after_kill(back_ms)
    );
    Ok(Recovery {
        model: model.into(),
        mode: "elastic".into(),
        training_again_s: after_kill(shrunk_ms),
        next_step_s: after_kill(next_ms),
        heal_s,
        rejoin_s: after_kill(back_ms),
        past_kill_s: secs(past),
        steps_lost: s0["steps_dropped"].as_u64().unwrap_or(0),
        steps_repeated: s0["steps_repeated"].as_u64().unwrap_or(0),
        state_mb,
    })
}

/// One ddprun of three ranks with checkpoints every 20 steps; rank 1 dies after step 30.
fn checkpoint_recovery(
    bin: &Path,
    model: &str,
    trainer: &[String],
    state_mb: f64,
) -> Result<Recovery> {
    let dir =
        std::env::temp_dir().join(format!("ddp-bench-elastic-{}-{model}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut command = Command::new(bin.join("ddprun"));
    command
        .args(["--nproc-per-node", "3", "--max-restarts", "1", "--"])
        .arg(bin.join("train-mnist"))
        .args(trainer)
        .args(["--checkpoint-every", "20", "--checkpoint-dir"])
        .arg(&dir)
        .env("DDP_TEST_KILL_AT_STEP", KILL_AT.to_string())
        .env("DDP_TEST_KILL_RANK", "1");
    let mut agent = Agent::start(command)?;
    let ok = agent.finish(Duration::from_secs(1800))?;
    let _ = std::fs::remove_dir_all(&dir);
    if !ok {
        bail!(
            "the restarted job failed:\n{}",
            agent
                .seen
                .iter()
                .map(|(_, l)| l.as_str())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let start = agent.seen.first().map_or(Instant::now(), |(t, _)| *t);
    let (killed, _) = agent
        .first("kills itself after step", start)
        .context("rank 1's kill line")?;
    let (restarted, _) = agent
        .first("restarting all", killed)
        .context("the restart")?;
    let (next, first) =
        first_step_after(&agent, restarted, 0).context("a step after the restart")?;
    let (past, _) = first_step_after(&agent, restarted, KILL_AT + 1).context("step 32")?;
    let secs = |t: Instant| t.duration_since(killed).as_secs_f64();
    eprintln!("restart {model}: first step {first} at {:.2} s", secs(next));
    Ok(Recovery {
        model: model.into(),
        mode: "restart from checkpoint".into(),
        training_again_s: secs(next),
        next_step_s: secs(next),
        heal_s: f64::NAN,
        rejoin_s: secs(next),
        past_kill_s: secs(past),
        // The steps after the checkpoint, and the one in flight.
        steps_lost: KILL_AT + 1 - (first - 1),
        steps_repeated: KILL_AT + 1 - first,
        state_mb,
    })
}

/// One world size's steady state: medians over the runs.
#[derive(Debug, serde::Serialize)]
struct Steady {
    world: usize,
    /// Samples/s without the elastic setting.
    plain: f64,
    /// Samples/s with `--elastic N:N`.
    elastic: f64,
    /// The commit vote's time per step, the rank longest in it, ms.
    vote_ms: f64,
    /// The commit vote's time over the training time, the rank longest in it.
    vote_share: f64,
}

/// `bench-scaling`'s run at 2 and 3 ranks, plain and `--elastic N:N`, alternating, with the
/// commit vote's time from the elastic runs' summaries.
fn steady_state(bin: &Path, args: &Args) -> Result<Vec<Steady>> {
    let mut rows = Vec::new();
    for world in [2usize, 3] {
        let (mut plain, mut elastic) = (Vec::new(), Vec::new());
        let (mut vote_ms, mut vote_share) = (Vec::new(), Vec::new());
        for _ in 0..args.repeats {
            for on in [false, true] {
                let mut a: Vec<String> = [
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
                    "--max-steps",
                    "60",
                    "--batch-size",
                    "64",
                    "--log-interval",
                    "30",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                if let Some(dir) = &args.data_dir {
                    a.extend(["--data-dir".into(), dir.display().to_string()]);
                }
                if on {
                    a.extend(["--elastic".into(), format!("{world}:{world}")]);
                }
                let s = crate::train::launch(bin, "train-mnist", world, &a)?;
                match on {
                    false => plain.push(s.samples_per_sec),
                    true => {
                        elastic.push(s.samples_per_sec);
                        let (ms, share) = vote_time(&s.output, world)?;
                        vote_ms.push(ms);
                        vote_share.push(share);
                    }
                }
            }
        }
        rows.push(Steady {
            world,
            plain: median(&mut plain),
            elastic: median(&mut elastic),
            vote_ms: median(&mut vote_ms),
            vote_share: median(&mut vote_share),
        });
    }
    Ok(rows)
}

/// The commit vote of the rank longest in it, from every rank's `DDP_ELASTIC_SUMMARY` line in
/// `output`: (ms per committed step, share of its training time).
fn vote_time(output: &[String], world: usize) -> Result<(f64, f64)> {
    let mut worst: Option<(f64, f64)> = None;
    let mut ranks = 0;
    for line in output {
        let Some((_, json)) = line.split_once("DDP_ELASTIC_SUMMARY ") else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(json).context("an elastic summary")?;
        let field = |name: &str| {
            v[name]
                .as_f64()
                .with_context(|| format!("{name} in the elastic summary {json}"))
        };
        let (vote, steps, train) = (
            field("vote_seconds")?,
            field("steps_committed")?,
            field("train_seconds")?,
        );
        ranks += 1;
        if worst.is_none_or(|(_, s)| vote / train > s) {
            worst = Some((1e3 * vote / steps.max(1.0), vote / train.max(1e-9)));
        }
    }
    if ranks != world {
        bail!("{ranks} elastic summaries for {world} ranks");
    }
    worst.context("no elastic summary")
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Seconds with two decimals, or "–" for a figure that was not measured (NaN).
fn seconds_or_dash(s: f64) -> String {
    if s.is_nan() {
        "–".to_string()
    } else {
        format!("{s:.2}")
    }
}
