//! The trainers' elastic loop (`--elastic MIN:MAX`, or `DDP_ELASTIC`, which `ddprun --nnodes
//! MIN:MAX` sets): ranks leave and join while the job runs, the survivors go on from memory,
//! a joiner is healed from rank 0 ([`ddp::ElasticDdp`], `ddp_comm::ElasticGroup`), and the
//! epoch's samples are handed out by [`ElasticSampler`] from one position counting the
//! committed steps' samples, so that each is trained once whatever the membership does.
//!
//! The per-rank batch stays `--batch-size` (torchrun's behaviour): the global batch is
//! `world × batch`, and the learning rate follows the world as `--lr-scaling` says (fixed by
//! default). Dropout masks depend on (seed, epoch, step, rank): the same membership schedule
//! gives the same bits. Every membership change is a line (`elastic: generation G ...`), and
//! so is the first step after it (`elastic: step N at world W at T`, T in ms since the epoch
//! when the step was committed);
//! with `--json` every rank prints `DDP_ELASTIC_SUMMARY {...}` at the end: its generations,
//! steps committed, repeated and dropped, and for each epoch how often each sample was trained
//! by the committed steps this rank saw (from the sampler's plan of every rank of each step).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use burn::module::Module;
use burn::tensor::Device;
use ddp::{DdpError, ElasticDdp, ElasticOptimizer, Outcome, Position, Progress, RunId};
use ddp_comm::{ElasticConfig, ElasticGroup, ELASTIC_ENV};
use ddp_data::{
    Batch, BatchSource, CpuBatch, DataLoader, DistributedSampler, ElasticSampler, LoaderConfig,
};
use ddp_models::Classifier;
use serde_json::json;

use crate::frame::{
    checkpoint_to_resume, eval_pad, local_eval, step_seed, sum_eval, Data, Ending, RunSummary, Task,
};
use crate::options::{BackendKind, HookKind, LrScaling, OptimizerKind, TrainConfig};

/// Milliseconds since the Unix epoch.
fn now_ms() -> u128 {
    ms_since_epoch(SystemTime::now())
}

/// `t` in milliseconds since the Unix epoch.
fn ms_since_epoch(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// The optimizer step `cfg` asks for, for every generation (the plain loop's settings).
fn elastic_optimizer(cfg: &TrainConfig) -> ElasticOptimizer {
    match crate::stepper::zero_config(cfg) {
        None => ElasticOptimizer::Ddp {
            config: crate::stepper::ddp_config(cfg),
            optim: crate::stepper::burn_optimizer(cfg),
        },
        Some(config) => ElasticOptimizer::Zero {
            config,
            optimizer: crate::stepper::shard_optimizer(cfg),
        },
    }
}

/// What every process of the job must share, as settings (one `name = value` per line, so
/// that a process with another value is refused naming the setting and both values, and the
/// job goes on without it): the model (its name and a hash of its parameter list: names and
/// shapes), the optimizer and its settings, the learning rate, its scaling and its schedule,
/// the batch size (the elastic sampler cuts the epoch by it), the buckets, the communication
/// hook and wire type, the ZeRO stage and the seed. A joiner with another of these would step
/// differently from the others forever, skip or repeat samples, or (buckets, hook) make the
/// job re-form again and again. Overlap, threads and loader workers change no result and may
/// differ.
fn compat<M: Module>(name: &str, model: &M, cfg: &TrainConfig) -> String {
    let params = ddp::param_infos(model);
    let text: String = params
        .iter()
        .map(|p| format!("{}{:?};", p.name, p.shape))
        .collect();
    let optimizer = match cfg.optimizer {
        OptimizerKind::Adam => "adam".to_string(),
        OptimizerKind::Adamw => "adamw (weight decay 0.01)".to_string(),
        OptimizerKind::Sgd => format!("sgd (momentum {})", cfg.momentum),
    };
    let optimizer = match cfg.max_grad_norm {
        Some(max) => format!("{optimizer}, gradients clipped at norm {max}"),
        None => optimizer,
    };
    let hook = match cfg.comm_hook {
        HookKind::Powersgd => format!(
            "powersgd (rank {}, start {})",
            cfg.powersgd_rank, cfg.powersgd_start
        ),
        other => format!("{other:?} ({:?} on the wire)", cfg.compression).to_lowercase(),
    };
    let scaling = match cfg.lr_scaling {
        LrScaling::None => "not scaled",
        LrScaling::Linear => "times the world size",
        LrScaling::Sqrt => "times the square root of the world size",
    };
    [
        format!(
            "model = {name} ({} tensors, parameter list {:016x})",
            params.len(),
            ddp_comm::hash::fnv1a(text.as_bytes())
        ),
        format!("optimizer = {optimizer}"),
        format!("lr = {} ({scaling})", cfg.lr),
        format!("lr schedule = {}", cfg.schedule.describe()),
        format!("batch size = {} per rank", cfg.batch_size),
        format!("buckets = {} MiB", cfg.bucket_cap_mb),
        format!("comm hook = {hook}"),
        format!("zero stage = {}", cfg.zero_stage),
        format!("seed = {}", cfg.seed),
    ]
    .join("\n")
}

/// One membership change, for the summary.
#[derive(serde::Serialize)]
struct ChangeRecord {
    generation: u64,
    world: usize,
    rank: usize,
    after_step: u64,
    joined: Vec<usize>,
    left: Vec<usize>,
    dropped: bool,
    healed: bool,
    at_ms: u128,
}

/// Trains `task` elastically in `range` (`MIN:MAX`; see the module documentation); `None`:
/// the job had finished before this process could join it.
pub(crate) fn run<M, S, const D: usize>(
    cfg: &TrainConfig,
    device: Device,
    task: Task<M, S>,
    range: String,
) -> Result<Option<Ending<M>>>
where
    M: Module + Classifier<D>,
    S: BatchSource<D> + 'static,
{
    let Task {
        name,
        model,
        train,
        test,
    } = task;
    let (Data::Memory(train), Data::Memory(test)) = (train, test) else {
        bail!("--elastic trains from memory only (not --data-format shards)");
    };
    if cfg.comm_hook == HookKind::Powersgd {
        bail!(
            "--comm-hook powersgd cannot be combined with elastic training ({ELASTIC_ENV} or \
             --elastic): its state is each rank's own and does not survive a change of members"
        );
    }
    let lookup = |k: &str| {
        if k == ELASTIC_ENV {
            Some(range.clone())
        } else {
            std::env::var(k).ok()
        }
    };
    let config = ElasticConfig::from_vars(&compat(&name, &model, cfg), &lookup)?
        .context("not an elastic run")?;
    let (min, max, slot) = (config.min, config.max, config.slot);
    if cfg.backend != BackendKind::Cpu {
        // burn compiles its GPU kernels on first use: before joining, not in a step that the
        // whole job would wait for (warm_up.rs).
        let optim = (cfg.zero_stage == 0).then(|| (crate::stepper::burn_optimizer(cfg), cfg.lr));
        let took =
            crate::warm_up::warm_up(&model, &*train, &*test, cfg.batch_size, optim, &device)?;
        println!(
            "elastic: slot {slot}: burn's GPU kernels compiled and tuned in {:.1} s, before \
             joining",
            took.as_secs_f64()
        );
    }
    let Some(group) = ElasticGroup::join(config)? else {
        println!("elastic: slot {slot}: the job has already finished");
        return Ok(None);
    };
    let healed = group.joined_running();
    // A new round of the running job (every member of its last generation was lost, and the
    // processes waiting founded the next one, `Generation::new_round`): no peer holds the
    // job's state, so it resumes from the checkpoint, as a job restarted below MIN does.
    let new_round = group.generation().new_round;
    let train_len = cfg
        .train_samples
        .map_or(train.len(), |n| n.min(train.len()));
    let test_len = cfg.test_samples.map_or(test.len(), |n| n.min(test.len()));
    let sampler = ElasticSampler::new(train_len, cfg.batch_size)?
        .with_seed(cfg.seed)
        .with_drop_last(cfg.drop_last);

    // A founder of a restarted job resumes from the last checkpoint; a joiner is healed.
    let run_id = RunId {
        model: format!("{name}-elastic"),
        seed: cfg.seed,
        allow_mismatch: true,
    };
    let restart = ddp_comm::elastic::restart_count();
    // Whether the job (not only this process) was restarted: ddprun's round, the same for
    // every rank of the round (a rank restarted alone into a running job has a restart count
    // of its own, and is healed rather than resumed).
    let round = ddp_comm::elastic::elastic_round();
    let mut model = model;
    let mut optimizer = elastic_optimizer(cfg);
    let mut progress = Progress::default();
    let mut zero_state = None;
    // A joiner is healed from the job, never resumed.
    let resume = match healed {
        true => None,
        false => checkpoint_to_resume(cfg, round > 0 || new_round)?,
    };
    let mut resumed_from = None;
    if let Some(path) = resume {
        let pg = group.group();
        let meta = match &mut optimizer {
            ElasticOptimizer::Ddp { optim, .. } => {
                let fresh = std::mem::replace(optim, crate::stepper::burn_optimizer(cfg));
                let r = ddp::resume(pg, &path, &run_id, model, fresh)?;
                (model, *optim) = (r.model, r.optim);
                r.meta
            }
            ElasticOptimizer::Zero { .. } => {
                let r = ddp::resume_sharded(pg, &path, &run_id, model)?;
                model = r.model;
                zero_state = r.optim_state;
                r.meta
            }
        };
        if let Some(meta) = meta {
            progress = Progress {
                step: meta.step,
                epoch: meta.epoch as u64,
                position: meta.batch_in_epoch,
                extra: Vec::new(),
            };
            resumed_from = Some(path.clone());
            if group.rank() == 0 {
                println!(
                    "elastic: resuming from {} (step {}, epoch {}, {} samples of it trained)",
                    path.display(),
                    meta.step,
                    meta.epoch + 1,
                    meta.batch_in_epoch
                );
            }
        }
    }
    if new_round && group.rank() == 0 {
        let g = group.generation().number;
        let from = match &resumed_from {
            Some(path) => format!(
                "resumes from the job's last checkpoint, {} (step {})",
                path.display(),
                progress.step
            ),
            None if cfg.checkpoint_dir.is_none() => {
                "has no checkpoint to resume from (no --checkpoint-dir): trains from the start"
                    .to_string()
            }
            None => "finds no checkpoint yet: trains from the start".to_string(),
        };
        println!(
            "elastic: generation {g} is a new round (every member of generation {} was lost); \
             it {from}",
            g - 1
        );
    }
    // The heal's large allocations mapped on their own (alloc.rs); set once per process.
    let _ = ddp::set_heal_hooks(crate::alloc::heal_hooks());
    let mut run = ElasticDdp::start(group, model, optimizer, progress)?;
    // Test hooks: replay a membership schedule (this slot kills itself after a step; joiners
    // are admitted at a given step).
    let kill_at = test_var("DDP_TEST_KILL_AT_STEP")
        .filter(|_| !healed && restart == 0 && test_var("DDP_TEST_KILL_RANK") == Some(slot as u64));
    if let Some(step) = test_var("DDP_TEST_GROW_AT_STEP") {
        run.admit_joins_from(step);
    }
    if let (Some(bytes), Some(zero)) = (zero_state, run.zero_mut()) {
        zero.load_consolidated(&bytes, "the checkpoint's optimizer state")?;
    }
    let say = |run: &ElasticDdp<M>, text: String| {
        if run.rank() == 0 || cfg.verbose {
            println!("{text}");
        }
    };
    let generation = run.elastic_group().generation().number;
    let line = format!(
        "elastic: slot {slot} {} generation {generation}: rank {} of {} ({min}:{max} ranks), \
         from step {}; {train_len} training samples, batch {} per rank, {}",
        if healed {
            "joined (healed from rank 0)"
        } else {
            "founded"
        },
        run.rank(),
        run.world_size(),
        run.progress().step,
        cfg.batch_size,
        cfg.describe_optimizer()
    );
    if healed {
        println!("{line}");
    } else {
        say(&run, line);
    }

    let mut changes: Vec<ChangeRecord> = Vec::new();
    let mut committed: Vec<u64> = Vec::new();
    let mut dropped = 0u64;
    let mut mark_next_step = healed || new_round;
    // Per epoch: how often each sample was trained by the committed steps seen here.
    let mut counts: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut order: (u64, Vec<usize>) = (u64::MAX, Vec::new());
    let (mut loss_sum, mut loss_steps) = (0.0f64, 0u64);
    let mut summary = RunSummary::new(&name, 0, None);
    let loader_cfg = LoaderConfig {
        batch_size: cfg.batch_size,
        num_workers: 0,
        ..LoaderConfig::default()
    };
    let test_loader = DataLoader::<S, D>::new(test.clone(), loader_cfg, device.clone().inner())?;
    let at_limit = |step: u64| cfg.max_steps.is_some_and(|m| step >= m);
    let mut samples_done = 0u64;
    let train_started = Instant::now();
    let mut aside = std::time::Duration::ZERO;
    loop {
        let p = run.progress().clone();
        // Nothing left, or (--drop-last) less than a full step at this world.
        let epoch_over = sampler.step_len(p.position as usize, run.world_size()) == 0;
        if epoch_over || at_limit(p.step) {
            // The epoch's end (or the step limit): evaluate and save, on every rank (not
            // counted as training time).
            let aside_from = Instant::now();
            let local = local_eval(
                run.model(),
                test_batches(&test_loader, test_len, &run),
                eval_pad(cfg),
            )?;
            let evaluated =
                run.collective(|r| sum_eval(r.process_group(), local).map_err(DdpError::Comm))?;
            let (correct, total, test_loss) = match evaluated {
                Ok(v) => v,
                Err(outcome) => {
                    note_change(
                        &run,
                        outcome,
                        &mut changes,
                        &mut mark_next_step,
                        &mut dropped,
                    );
                    aside += aside_from.elapsed();
                    continue;
                }
            };
            summary.test_accuracy = correct as f64 / total.max(1) as f64;
            summary.test_correct = correct;
            summary.test_total = total;
            summary.epochs = p.epoch as usize + usize::from(epoch_over);
            summary.train_loss = loss_sum / loss_steps.max(1) as f64;
            say(
                &run,
                format!(
                    "epoch {}: train loss {:.4}, test accuracy {:.2}% ({correct}/{total}), test \
                     loss {test_loss:.4}, world {}",
                    p.epoch + 1,
                    summary.train_loss,
                    100.0 * summary.test_accuracy,
                    run.world_size()
                ),
            );
            let position = if epoch_over {
                (p.epoch + 1, 0)
            } else {
                (p.epoch, p.position)
            };
            match save(cfg, &mut run, &run_id, position, p.step)? {
                Ok(path) => summary.checkpoint = path.or(summary.checkpoint),
                Err(outcome) => {
                    note_change(
                        &run,
                        outcome,
                        &mut changes,
                        &mut mark_next_step,
                        &mut dropped,
                    );
                    aside += aside_from.elapsed();
                    continue;
                }
            }
            aside += aside_from.elapsed();
            if !epoch_over || p.epoch + 1 >= cfg.epochs as u64 {
                break;
            }
            run.set_progress(Progress {
                epoch: p.epoch + 1,
                position: 0,
                ..p
            });
            (loss_sum, loss_steps) = (0.0, 0);
            continue;
        }
        if order.0 != p.epoch {
            let mut s = sampler.clone();
            s.set_epoch(p.epoch);
            order = (p.epoch, s.order());
        }
        let (world, rank) = (run.world_size(), run.rank());
        let share = sampler
            .step(&order.1, p.position as usize, world, rank)
            .context("a step inside the epoch")?;
        let batch = CpuBatch::build(&*train, &share.indices).into_tensors(&device);
        device.seed(step_seed(cfg.seed, p.epoch, rank as u64, p.step));
        let hooked = run.prepare();
        let (loss, _) = hooked.loss(batch.inputs, batch.targets);
        drop(hooked);
        let loss_value = f64::from(loss.clone().into_scalar::<f32>());
        let loss = if share.loss_scale == 1.0 {
            loss
        } else {
            loss.mul_scalar(share.loss_scale)
        };
        let after = Progress {
            step: p.step + 1,
            epoch: p.epoch,
            position: share.next as u64,
            extra: Vec::new(),
        };
        let lr = cfg.lr_at(world, p.step);
        let outcome = run.step(lr, loss, after)?;
        let step_committed = match &outcome {
            Outcome::Committed => true,
            Outcome::Changed(m) => !m.dropped && !m.healed,
            Outcome::Finished => false,
        };
        if step_committed {
            committed.push(p.step + 1);
            samples_done += share.step_samples as u64;
            loss_sum += loss_value;
            loss_steps += 1;
            let epoch_counts = match counts.iter_mut().find(|(e, _)| *e == p.epoch) {
                Some((_, c)) => c,
                None => {
                    counts.push((p.epoch, vec![0; train_len]));
                    &mut counts.last_mut().expect("just pushed").1
                }
            };
            for r in 0..world {
                if let Some(s) = sampler.step(&order.1, p.position as usize, world, r) {
                    for &i in &s.indices[..s.real] {
                        epoch_counts[i] += 1;
                    }
                }
            }
            if mark_next_step {
                mark_next_step = false;
                // The time the step was committed: a step after which ranks joined returns
                // only once they are healed.
                let at = run.committed_at().map_or_else(now_ms, ms_since_epoch);
                println!("elastic: step {} at world {world} at {at}", p.step + 1);
            }
            let step = p.step + 1;
            if kill_at == Some(step) {
                eprintln!(
                    "test hook DDP_TEST_KILL_AT_STEP: slot {slot} kills itself after step {step} at {}", now_ms()
                );
                // SAFETY: raise has no memory-safety preconditions.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            if step.is_multiple_of(cfg.log_interval as u64) {
                say(
                    &run,
                    format!(
                        "epoch {} step {step} ({}/{train_len} samples) loss {loss_value:.4} \
                         world {world}",
                        p.epoch + 1,
                        share.next
                    ),
                );
            }
            if cfg.checkpoint_every.is_some_and(|k| step.is_multiple_of(k))
                && sampler.step_len(share.next, world) > 0
                && !at_limit(step)
            {
                let position = (p.epoch, share.next as u64);
                let aside_from = Instant::now();
                let saved = save(cfg, &mut run, &run_id, position, step)?;
                aside += aside_from.elapsed();
                if let Err(o) = saved {
                    note_change(&run, o, &mut changes, &mut mark_next_step, &mut dropped);
                }
            }
        }
        match outcome {
            Outcome::Committed => {}
            Outcome::Finished => break,
            changed => note_change(
                &run,
                changed,
                &mut changes,
                &mut mark_next_step,
                &mut dropped,
            ),
        }
    }
    let train_time = train_started.elapsed().saturating_sub(aside);
    summary.world_size = run.world_size();
    summary.steps = run.progress().step;
    summary.samples_per_sec = samples_done as f64 / train_time.as_secs_f64().max(1e-9);
    let (rank, generation) = (run.rank(), run.elastic_group().generation().number);
    let vote_seconds = run.vote_time().as_secs_f64();
    let backwards_skipped = run.backwards_skipped();
    summary.add_comm(&run.take_stats());
    let model = run.finish()?;
    let mut sorted = committed.clone();
    sorted.sort_unstable();
    let repeated = sorted.windows(2).filter(|w| w[0] == w[1]).count();
    let epochs: Vec<serde_json::Value> = counts
        .iter()
        .map(|(e, c)| {
            json!({
                "epoch": e,
                "min_count": c.iter().min(),
                "max_count": c.iter().max(),
                "trained": c.iter().filter(|&&n| n > 0).count(),
            })
        })
        .collect();
    let elastic = json!({
        "slot": slot,
        "rank": rank,
        "generation": generation,
        "healed_at_start": healed,
        "new_round": new_round,
        "changes": changes,
        "steps_committed": committed.len(),
        "first_step": committed.first(),
        "last_step": committed.last(),
        "steps_in_order": committed.windows(2).all(|w| w[1] == w[0] + 1),
        "steps_repeated": repeated,
        "steps_dropped": dropped,
        "backwards_skipped": backwards_skipped,
        "vote_seconds": vote_seconds,
        "train_seconds": train_time.as_secs_f64(),
        "epochs": epochs,
    });
    let serde_json::Value::Object(elastic_json) = elastic else {
        unreachable!("json! of an object literal is an object")
    };
    Ok(Some(Ending {
        model,
        rank,
        summary,
        detail: format!("{} membership changes", changes.len()),
        group: None,
        elastic_json: Some(elastic_json),
    }))
}

/// A whole number from the test hook variable `name`.
fn test_var(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Records a membership change and says it (every rank: the test reads the survivors').
fn note_change<M: Module>(
    run: &ElasticDdp<M>,
    outcome: Outcome,
    changes: &mut Vec<ChangeRecord>,
    mark_next_step: &mut bool,
    dropped: &mut u64,
) {
    let Outcome::Changed(m) = outcome else {
        return;
    };
    let left: Vec<String> = m
        .left
        .iter()
        .map(|l| format!("rank {} (slot {}): {}", l.rank, l.slot, l.why))
        .collect();
    let at = now_ms();
    // When ranks joined after a committed step, when that step was committed: the heal took
    // from then until `at`.
    let committed = match run.committed_at() {
        Some(t) if !m.dropped && !m.joined.is_empty() => {
            format!(", committed at {}", ms_since_epoch(t))
        }
        _ => String::new(),
    };
    println!(
        "elastic: generation {}: rank {} of {} (joined slots {:?}; left: {}), continuing after \
         step {}{committed}{}{} at {at}",
        m.generation,
        m.rank,
        m.world_size,
        m.joined,
        if left.is_empty() {
            "none".to_string()
        } else {
            left.join("; ")
        },
        run.progress().step,
        if m.dropped {
            ", the step in flight dropped"
        } else {
            ""
        },
        if m.lost_state > 0 {
            format!(
                ", {} optimizer-state elements lost with the ranks that left (they start \
                 again from zero)",
                m.lost_state
            )
        } else {
            String::new()
        }
    );
    *dropped += u64::from(m.dropped);
    *mark_next_step = true;
    changes.push(ChangeRecord {
        generation: m.generation,
        world: m.world_size,
        rank: m.rank,
        after_step: run.progress().step,
        joined: m.joined,
        left: m.left.iter().map(|l| l.slot).collect(),
        dropped: m.dropped,
        healed: m.healed,
        at_ms: at,
    });
}

/// Writes a checkpoint (position: epoch and samples of it trained) when the run has a
/// checkpoint directory; a collective, re-formed on a failure (`Ok(Err)`: run it again later).
fn save<M: Module>(
    cfg: &TrainConfig,
    run: &mut ElasticDdp<M>,
    run_id: &RunId,
    (epoch, position): (u64, u64),
    step: u64,
) -> Result<Result<Option<std::path::PathBuf>, Outcome>> {
    let Some(dir) = &cfg.checkpoint_dir else {
        return Ok(Ok(None));
    };
    let position = Position {
        epoch: epoch as usize,
        batch_in_epoch: position as usize,
        step,
        loss_sum: 0.0,
    };
    Ok(run.collective(|r| match (r.ddp(), r.zero(), r.optim()) {
        (_, Some(zero), _) => {
            ddp::save_sharded_checkpoint(r.process_group(), dir, run_id, &position, r.model(), zero)
        }
        (_, _, Some(optim)) => {
            ddp::save_checkpoint(r.process_group(), dir, run_id, &position, r.model(), optim)
        }
        _ => Ok(None),
    })?)
}

/// This rank's exact share of the first `test_len` test samples, in the current world.
fn test_batches<'a, M: Module, S, const D: usize>(
    loader: &'a DataLoader<S, D>,
    test_len: usize,
    run: &ElasticDdp<M>,
) -> impl Iterator<Item = Result<Batch<D>>> + 'a
where
    S: BatchSource<D> + 'static,
{
    let sampler = DistributedSampler::exact(test_len, run.world_size(), run.rank())
        .expect("a rank of its world");
    loader
        .iter(sampler.indices())
        .expect("the exact sampler's indices are in the test set")
        .map(Ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::TrainArgs;
    use burn::nn::LinearConfig;
    use clap::Parser;
    use ddp_comm::membership::JobTerms;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: TrainArgs,
    }

    /// The job terms of a trainer started with `flags` (a small model, the terms a process
    /// registers with).
    fn terms(flags: &[&str]) -> JobTerms {
        let argv = std::iter::once("train-mnist").chain(flags.iter().copied());
        let defaults = TrainArgs {
            epochs: Some(1),
            batch_size: Some(32),
            lr: Some(1e-3),
            ..Default::default()
        };
        let cfg = Cli::parse_from(argv).args.resolve(&defaults).unwrap();
        let model = LinearConfig::new(3, 2).init(&Device::flex().autodiff());
        JobTerms {
            job_id: None,
            min: 2,
            max: 3,
            compat: compat("mlp", &model, &cfg),
        }
    }

    /// A joiner started with another `--lr` or another `--bucket-cap-mb` than the job is
    /// refused, naming the setting and both values; one that differs only in settings that
    /// change no result (overlap, threads) is admitted.
    #[test]
    fn a_joiner_with_another_lr_or_bucket_size_is_refused_naming_both_values() {
        let job = terms(&["--lr", "0.001", "--bucket-cap-mb", "25"]);
        let why = job
            .refuse(&terms(&["--lr", "0.002", "--bucket-cap-mb", "25"]))
            .expect("another --lr is refused");
        assert_eq!(
            why,
            "another setting: lr is 0.002 (not scaled) in this process, the job runs with 0.001 \
             (not scaled)"
        );
        let why = job
            .refuse(&terms(&["--lr", "0.001", "--bucket-cap-mb", "4"]))
            .expect("another bucket size is refused");
        assert_eq!(
            why,
            "another setting: buckets is 4 MiB in this process, the job runs with 25 MiB"
        );
        for (flags, setting) in [
            (&["--batch-size", "64"][..], "batch size"),
            (&["--seed", "7"], "seed"),
            (&["--optimizer", "sgd"], "optimizer"),
            (&["--lr-scaling", "linear"], "lr"),
            (
                &["--lr-schedule", "cosine", "--decay-steps", "9"],
                "lr schedule",
            ),
            (&["--comm-hook", "bf16"], "comm hook"),
            (&["--zero-stage", "1"], "zero stage"),
        ] {
            let flags = [&["--lr", "0.001", "--bucket-cap-mb", "25"][..], flags].concat();
            let why = job.refuse(&terms(&flags)).expect("refused");
            assert!(
                why.starts_with(&format!("another setting: {setting} is ")),
                "{flags:?}: {why}"
            );
        }
        let same = terms(&[
            "--lr",
            "0.001",
            "--bucket-cap-mb",
            "25",
            "--overlap",
            "false",
            "--threads",
            "2",
        ]);
        assert_eq!(job.refuse(&same), None);
    }
}
