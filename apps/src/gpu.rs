//! `--backend cuda` (feature `cuda`): burn's CUDA backend on the GPU of `LOCAL_RANK` (gradients
//! of more than one rank are all-reduced on the GPU through NCCL by the `ddp` crate).

use anyhow::{anyhow, Context, Result};
use burn::tensor::Device;
use ddp_comm::ProcessGroup;

/// burn's CUDA device for this rank: GPU `LOCAL_RANK` (or the one GPU `CUDA_VISIBLE_DEVICES`
/// leaves visible). The driver and the number of GPUs are checked first, so that a machine
/// without an NVIDIA driver, or with fewer GPUs than local ranks, gets a clear error here
/// instead of a panic inside burn.
pub fn cuda_device(pg: &ProcessGroup) -> Result<Device> {
    let count = ddp_comm::nccl::device_count().context("--backend cuda")?;
    let mask = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = ddp_comm::nccl::pick_device(
        pg.local_rank(),
        pg.local_world_size(),
        count,
        mask.as_deref(),
    )
    .map_err(|m| anyhow!("--backend cuda: rank {}: {m}", pg.rank()))?;
    Ok(Device::cuda(ordinal))
}
