//! Checkpoint and resume for a DDP run, with a user's own model and optimizer: the collective
//! side of [`crate::checkpoint`]'s file.
//!
//! Replicas are identical after every step, so one rank's state is the job's state:
//!
//! - [`save_checkpoint`]: every rank calls it at the same point (it is a collective when the
//!   checkpoint is taken mid-epoch: each rank's loss sum so far is gathered); rank 0 alone
//!   writes the file, atomically, and returns its path.
//! - [`resume`]: every rank calls it; rank 0 alone reads the file and broadcasts it, so nodes
//!   need no shared file system. A file of another model is refused, and so is one written by a
//!   run with another world size or seed (another data order and other dropout masks: the
//!   resumed run would not continue that run) unless the caller allows it. Every rank decides
//!   the same. Then the model and optimizer records are loaded. Resume *before* wrapping the
//!   model in [`crate::DistributedDataParallel`]: loading a record gives the parameters new ids.
//! - A communication hook's state (PowerSGD's error feedback and Q) is each rank's own, not the
//!   job's: [`save_ddp_checkpoint`] gathers every rank's into the file, and [`resume`] hands
//!   each rank its own back ([`Resumed::comm_hook_state`]).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use ddp_comm::ProcessGroup;

use crate::checkpoint::{self, Checkpoint, CheckpointMeta};
use crate::ddp::DistributedDataParallel;
use crate::zero::ShardedDataParallel;
use crate::DdpError;

/// A [`DdpError::Checkpoint`] with this text.
fn fail(text: impl Into<String>) -> DdpError {
    DdpError::Checkpoint(text.into())
}

/// Where a run stands when it saves a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Position {
    /// Epochs completed.
    pub epoch: usize,
    /// Batches of the epoch in progress already trained (0 at an epoch's end).
    pub batch_in_epoch: usize,
    /// Optimizer steps completed.
    pub step: u64,
    /// This rank's sum of the training losses of those `batch_in_epoch` batches (for the
    /// epoch's mean loss after a resume; ignored at an epoch's end).
    pub loss_sum: f64,
}

/// What identifies a run, checked by [`resume`] against the checkpoint's.
#[derive(Debug, Clone, PartialEq)]
pub struct RunId {
    /// The model's name (any text the program chooses).
    pub model: String,
    /// The run's seed.
    pub seed: u64,
    /// Resume from a checkpoint of another world size or seed anyway (with a warning).
    pub allow_mismatch: bool,
}

/// Saves the run's state after `position` into `dir/checkpoint.ddpck`. Every rank calls it;
/// rank 0 writes the file (atomically: a crash leaves the old checkpoint or the new one) and
/// returns `Some(path)`, the other ranks `None`.
pub fn save_checkpoint<M: Module>(
    pg: &ProcessGroup,
    dir: &Path,
    run: &RunId,
    position: &Position,
    model: &M,
    optim: &ModuleOptimizer,
) -> Result<Option<PathBuf>, DdpError> {
    save_with(pg, dir, run, position, model, Vec::new(), || {
        optim
            .into_bytes()
            .map(|b| b.to_vec())
            .map_err(|e| fail(format!("encoding the optimizer record: {e:?}")))
    })
}

/// [`save_checkpoint`] for a run wrapped in `ddp`, with every rank's communication hook state
/// ([`DistributedDataParallel::comm_hook_state`], gathered to rank 0), so that a run resumed
/// from it at the same world size continues bit for bit ([`Resumed::comm_hook_state`]).
/// Without a hook with state it writes what [`save_checkpoint`] writes. Every rank calls it;
/// rank 0 writes.
pub fn save_ddp_checkpoint<M: Module>(
    pg: &ProcessGroup,
    dir: &Path,
    run: &RunId,
    position: &Position,
    model: &M,
    optim: &ModuleOptimizer,
    ddp: &DistributedDataParallel,
) -> Result<Option<PathBuf>, DdpError> {
    let hooks = gather_states(pg, ddp.comm_hook_state())?;
    save_with(pg, dir, run, position, model, hooks, || {
        optim
            .into_bytes()
            .map(|b| b.to_vec())
            .map_err(|e| fail(format!("encoding the optimizer record: {e:?}")))
    })
}

/// Every rank's `state` in rank order (empty when no rank has one): the lengths are
/// all-gathered, then the states, each padded to the longest.
fn gather_states(pg: &ProcessGroup, state: Option<Vec<u8>>) -> Result<Vec<Vec<u8>>, DdpError> {
    let mut mine = state.unwrap_or_default();
    let lens = pg.all_gather(vec![mine.len() as i64])?;
    let longest = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    if longest == 0 {
        return Ok(Vec::new());
    }
    mine.resize(longest, 0);
    let all = pg.all_gather(mine)?;
    Ok(all
        .chunks(longest)
        .zip(&lens)
        .map(|(chunk, &len)| chunk[..(len.max(0) as usize).min(longest)].to_vec())
        .collect())
}

/// [`save_checkpoint`] for a sharded run: the optimizer state is consolidated from every
/// rank's shard ([`ShardedDataParallel::consolidated_state`]), so the file is the same
/// whatever the world size, and a run at another world size can resume from it
/// ([`resume_sharded`]). Every rank calls it; rank 0 writes.
pub fn save_sharded_checkpoint<M: Module>(
    pg: &ProcessGroup,
    dir: &Path,
    run: &RunId,
    position: &Position,
    model: &M,
    zero: &ShardedDataParallel,
) -> Result<Option<PathBuf>, DdpError> {
    let state = zero.consolidated_state()?;
    save_with(pg, dir, run, position, model, Vec::new(), || {
        state.ok_or_else(|| fail("rank 0 holds no consolidated optimizer state"))
    })
}

/// Rank 0 writes the checkpoint with the optimizer bytes `optim` gives (called on rank 0
/// only) and the ranks' hook states `hooks`; a mid-epoch position first gathers every rank's
/// loss sum.
fn save_with<M: Module>(
    pg: &ProcessGroup,
    dir: &Path,
    run: &RunId,
    position: &Position,
    model: &M,
    hooks: Vec<Vec<u8>>,
    optim: impl FnOnce() -> Result<Vec<u8>, DdpError>,
) -> Result<Option<PathBuf>, DdpError> {
    let epoch_loss_sums = if position.batch_in_epoch > 0 {
        pg.all_gather(vec![position.loss_sum])?
    } else {
        Vec::new()
    };
    if pg.rank() != 0 {
        return Ok(None);
    }
    let meta = CheckpointMeta {
        epoch: position.epoch,
        batch_in_epoch: position.batch_in_epoch as u64,
        epoch_loss_sums,
        step: position.step,
        seed: run.seed,
        world_size: pg.world_size(),
        model: run.model.clone(),
        model_len: 0,
        optim_len: 0,
        sha256: String::new(),
        hook_lens: Vec::new(),
    };
    let model_bytes = (model.clone().into_record().into_bytes())
        .map_err(|e| fail(format!("encoding the model record: {e:?}")))?;
    let optim_bytes = optim()?;
    checkpoint::save_with_hooks(dir, meta, &model_bytes, &optim_bytes, &hooks).map(Some)
}

/// What [`resume`] returns: the model and optimizer, restored when there was a checkpoint.
pub struct Resumed<M> {
    /// The model: with the checkpoint's parameters, or as it was given when there was none.
    pub model: M,
    /// The optimizer: with the checkpoint's state, or as it was given.
    pub optim: ModuleOptimizer,
    /// Where the checkpointed run stood (epochs, batches of the next epoch, steps, each rank's
    /// loss sums); `None` when there was no checkpoint: start fresh.
    pub meta: Option<CheckpointMeta>,
    /// Set when the checkpoint's world size or seed differ from this run's and
    /// [`RunId::allow_mismatch`] let it through: what differs.
    pub mismatch: Option<String>,
    /// This rank's communication hook state from the checkpoint, for
    /// [`DistributedDataParallel::load_comm_hook_state`] after wrapping (`None`: none saved,
    /// or the checkpoint was written at another world size, whose states do not map onto
    /// these ranks).
    pub comm_hook_state: Option<Vec<u8>>,
}

/// Restores `model` and `optim` from the checkpoint at `path`, or hands them back unchanged
/// when there is no file there (`meta: None`: start fresh). Every rank calls it; rank 0 reads
/// the file and broadcasts it.
/// Errors name the file: unreadable, corrupted, another model, or another world size or seed
/// (unless `run.allow_mismatch`).
pub fn resume<M: Module>(
    pg: &ProcessGroup,
    path: &Path,
    run: &RunId,
    model: M,
    optim: ModuleOptimizer,
) -> Result<Resumed<M>, DdpError> {
    let resumed = resume_sharded(pg, path, run, model)?;
    let optim = match resumed.optim_state {
        None => optim,
        Some(bytes) if bytes.starts_with(b"DDPZERO1") => {
            return Err(fail(format!(
                "{}: the optimizer state was written by a sharded run (ZeRO stage 1 or 2, \
                 ShardedDataParallel): resume it with resume_sharded and a sharded run",
                path.display()
            )))
        }
        Some(bytes) => optim
            .from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| fail(format!("{}: optimizer record: {e:?}", path.display())))?,
    };
    Ok(Resumed {
        model: resumed.model,
        optim,
        meta: resumed.meta,
        mismatch: resumed.mismatch,
        comm_hook_state: resumed.comm_hook_state,
    })
}

/// What [`resume_sharded`] returns: the model, restored when there was a checkpoint, and the
/// optimizer state's bytes for [`ShardedDataParallel::load_consolidated`].
pub struct ResumedSharded<M> {
    /// The model: with the checkpoint's parameters, or as it was given when there was none.
    pub model: M,
    /// The checkpoint's optimizer state (`None` without a checkpoint): for a sharded run, the
    /// consolidated state to load after wrapping the model.
    pub optim_state: Option<Vec<u8>>,
    /// Where the checkpointed run stood; `None` when there was no checkpoint.
    pub meta: Option<CheckpointMeta>,
    /// What differs from the checkpointed run when [`RunId::allow_mismatch`] let it through.
    pub mismatch: Option<String>,
    /// This rank's communication hook state, as in [`Resumed::comm_hook_state`].
    pub comm_hook_state: Option<Vec<u8>>,
}

/// [`resume`] for a sharded run: restores the model (before wrapping it) and returns the
/// optimizer state's bytes, which [`ShardedDataParallel::load_consolidated`] loads after
/// wrapping at any world size (a different world size than the checkpoint's is still a
/// mismatch that `run.allow_mismatch` must allow: the data order changes). Every rank calls it.
pub fn resume_sharded<M: Module>(
    pg: &ProcessGroup,
    path: &Path,
    run: &RunId,
    model: M,
) -> Result<ResumedSharded<M>, DdpError> {
    let Some(mut ck) = fetch(pg, path)? else {
        return Ok(ResumedSharded {
            model,
            optim_state: None,
            meta: None,
            mismatch: None,
            comm_hook_state: None,
        });
    };
    let mismatch = check_resumable(&ck.meta, path, run, pg.world_size())?;
    let name = path.display();
    let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(ck.model))
        .map_err(|e| fail(format!("{name}: model record: {e:?}")))?;
    let model = model
        .try_load_record(record)
        .map_err(|e| fail(format!("{name}: model record: {e:?}")))?;
    let world = pg.world_size();
    let same_ranks = ck.meta.world_size == world && ck.hooks.len() == world;
    let comm_hook_state = same_ranks.then(|| ck.hooks.swap_remove(pg.rank()));
    Ok(ResumedSharded {
        model,
        optim_state: Some(ck.optim),
        meta: Some(ck.meta),
        mismatch,
        comm_hook_state,
    })
}

/// Reads the checkpoint at `path` on rank 0 and broadcasts it, so that every rank returns the
/// same checkpoint (or `None`: no file). Rank 0 first broadcasts `[state, length]`: 1 when the
/// checkpoint follows (then its bytes), 0 when there is none, -1 when rank 0 could not read it
/// (it returns its own error naming the file; the others say rank 0 failed), so that no rank
/// waits for bytes that never come.
pub fn fetch(pg: &ProcessGroup, path: &Path) -> Result<Option<Checkpoint>, DdpError> {
    let name = path.display().to_string();
    if pg.rank() == 0 {
        let read = if path.exists() {
            checkpoint::read(path)
                .and_then(|bytes| Ok((checkpoint::parse(&bytes, &name)?, bytes)))
                .map(Some)
        } else {
            Ok(None)
        };
        let header = match &read {
            Ok(Some((_, bytes))) => vec![1i64, bytes.len() as i64],
            Ok(None) => vec![0, 0],
            Err(_) => vec![-1, 0],
        };
        pg.broadcast(header, 0)?;
        let Some((ck, bytes)) = read? else {
            return Ok(None);
        };
        pg.broadcast(bytes, 0)?;
        Ok(Some(ck))
    } else {
        let header = pg.broadcast(vec![0i64; 2], 0)?;
        match header[..] {
            [1, len] => {
                let len = usize::try_from(len)
                    .map_err(|_| fail(format!("rank 0 announced a checkpoint of {len} bytes")))?;
                let bytes = pg.broadcast(vec![0u8; len], 0)?;
                Ok(Some(checkpoint::parse(&bytes, &name)?))
            }
            [0, _] => Ok(None),
            _ => Err(fail(format!(
                "rank 0 could not read the checkpoint {name} (rank 0's error says why)"
            ))),
        }
    }
}

/// Whether this run may resume from the checkpoint at `path` described by `meta`: the same
/// model always; the same world size and seed unless `run.allow_mismatch` (then `Ok(Some(what
/// differs))`). Every rank decides the same, from the same broadcast header.
fn check_resumable(
    meta: &CheckpointMeta,
    path: &Path,
    run: &RunId,
    world: usize,
) -> Result<Option<String>, DdpError> {
    if meta.model != run.model {
        return Err(fail(format!(
            "{} holds a `{}` model, this run trains `{}`",
            path.display(),
            meta.model,
            run.model
        )));
    }
    let mut differences = Vec::new();
    if meta.world_size != world {
        differences.push(format!(
            "world size {} (this run: {world})",
            meta.world_size
        ));
    }
    if meta.seed != run.seed {
        differences.push(format!("seed {} (this run: {})", meta.seed, run.seed));
    }
    if differences.is_empty() {
        return Ok(None);
    }
    let what = differences.join(" and ");
    if !run.allow_mismatch {
        return Err(DdpError::CheckpointMismatch {
            path: path.display().to_string(),
            what,
        });
    }
    Ok(Some(what))
}
