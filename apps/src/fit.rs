//! The trainers' entry, the frame of every run (`frame.rs`): it decides once whether the
//! membership is fixed or elastic, runs that step loop (`train.rs` or `elastic.rs`, neither
//! of which needs the other) and ends the run the same way for both (`frame::finish`).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use burn::module::Module;
use burn::tensor::Device;
use ddp_comm::ProcessGroup;
use ddp_data::BatchSource;
use ddp_models::Classifier;

use crate::frame::{finish, RunSummary, Task};
use crate::options::TrainConfig;

/// Trains `task` with the settings in `cfg` on every rank of `pg` or, with `--elastic` or
/// `DDP_ELASTIC` (asked here, once), in an elastic group formed by the elastic loop itself.
pub fn train<M, S, const D: usize>(
    cfg: &TrainConfig,
    pg: Arc<ProcessGroup>,
    device: Device,
    task: Task<M, S>,
) -> Result<RunSummary>
where
    M: Module + Classifier<D>,
    S: BatchSource<D> + 'static,
{
    let started = Instant::now();
    let ending = match cfg.elastic_range() {
        None => crate::train::run(cfg, pg, device, task, started)?,
        Some(range) => {
            let name = task.name.clone();
            match crate::elastic::run(cfg, device, task, range)? {
                Some(ending) => ending,
                None => return Ok(RunSummary::new(&name, 0, None)),
            }
        }
    };
    finish(cfg, started, ending)
}
