//! The trainers' entry: the plain loop (`train.rs`) or, with an elastic range, the elastic one
//! (`elastic.rs`), chosen here so that neither loop's file needs the other.

use std::sync::Arc;

use anyhow::Result;
use burn::module::Module;
use burn::tensor::Device;
use ddp_comm::ProcessGroup;
use ddp_data::BatchSource;
use ddp_models::Classifier;

use crate::options::TrainConfig;
use crate::train::{RunSummary, Task};

/// Trains `task` with the settings in `cfg` on every rank of `pg` (with `--elastic` or
/// `DDP_ELASTIC`, in an elastic group formed by the loop itself).
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
    if cfg.elastic_range().is_some() {
        return crate::elastic::run(cfg, device, task);
    }
    crate::train::run(cfg, pg, device, task)
}
