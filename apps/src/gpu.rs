//! `--backend cuda` (feature `cuda`): burn's CUDA backend on the GPU of `LOCAL_RANK` (gradients
//! of more than one rank are all-reduced on the GPU through NCCL by the `ddp` crate).

use anyhow::{anyhow, Result};
use burn::tensor::Device;
use ddp_comm::ProcessGroup;

/// burn's CUDA device for this rank: GPU `LOCAL_RANK` (or the one GPU `CUDA_VISIBLE_DEVICES`
/// leaves visible).
///
/// First, before burn touches CUDA, the libraries are loaded: the NVIDIA driver, NVRTC (burn
/// compiles its kernels with it) and, for more than one rank, NCCL (unless `DDP_NCCL=0`; at one
/// rank with `DDP_NCCL=1`), found under their real names in `LD_LIBRARY_PATH`, the active venv's
/// NVIDIA wheels and the system folders (`ddp_comm::nccl::load_cuda_libraries`). The first rank
/// of each host prints which files were loaded, as the run's first line. A missing library, a
/// machine without a driver, or fewer GPUs than local ranks is a clear error here (naming the
/// library, the names tried and the folders searched) instead of a panic inside burn.
pub fn cuda_device(pg: &ProcessGroup) -> Result<Device> {
    let nccl = ddp_comm::nccl::gradients_through_nccl(pg.world_size());
    let libraries = ddp_comm::nccl::load_cuda_libraries(true, nccl)
        .map_err(|e| anyhow!("--backend cuda: rank {}: {e}", pg.rank()))?;
    if pg.local_rank() == 0 {
        eprintln!("rank {}: {libraries}", pg.rank());
    }
    let count = ddp_comm::nccl::device_count()
        .map_err(|e| anyhow!("--backend cuda: rank {}: {e}", pg.rank()))?;
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
