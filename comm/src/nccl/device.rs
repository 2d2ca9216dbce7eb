//! Which GPU a rank uses ([`pick_device`]) and opening it ([`open_device`]): rank `LOCAL_RANK`
//! uses GPU `LOCAL_RANK` (its primary context, the one burn's CUDA backend also uses, so device
//! pointers are shared); a process that sees exactly one GPU through `CUDA_VISIBLE_DEVICES`
//! uses it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::library::{check_driver, guard, nccl_missing_message, nccl_present};

/// The GPU ordinal for a rank: `local_rank` when every local rank has a GPU of its own; 0 when
/// the process sees exactly one GPU because `CUDA_VISIBLE_DEVICES` names one (a launcher gave
/// each rank its own); otherwise an error that says how many GPUs and ranks there are.
pub fn pick_device(
    local_rank: usize,
    local_world_size: usize,
    visible: usize,
    cuda_visible_devices: Option<&str>,
) -> Result<usize, String> {
    let mask = cuda_visible_devices
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
        .unwrap_or_default();
    if visible == 0 {
        return Err(format!(
            "the NVIDIA driver is loaded but reports no GPU{mask}"
        ));
    }
    if local_rank < visible && local_world_size <= visible {
        return Ok(local_rank);
    }
    let one_named = cuda_visible_devices
        .is_some_and(|v| v.split(',').filter(|d| !d.trim().is_empty()).count() == 1);
    if visible == 1 && one_named {
        return Ok(0);
    }
    Err(format!(
        "{local_world_size} local rank(s) on this host but only {visible} GPU(s) visible{mask}: \
         LOCAL_RANK {local_rank} has no GPU of its own (start at most {visible} rank(s) per host, \
         or give each rank one GPU through CUDA_VISIBLE_DEVICES)"
    ))
}

/// Opens this rank's GPU: driver, NCCL library, device choice, context and stream.
pub(super) fn open_device(
    local_rank: usize,
    local_world_size: usize,
) -> Result<(Arc<CudaContext>, Arc<CudaStream>, usize), String> {
    let visible = check_driver()?;
    if !nccl_present() {
        return Err(nccl_missing_message());
    }
    let mask = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let ordinal = pick_device(local_rank, local_world_size, visible, mask.as_deref())?;
    let ctx = guard(|| CudaContext::new(ordinal))?
        .map_err(|e| format!("cannot open GPU {ordinal}: {e:?}"))?;
    let stream = guard(|| ctx.new_stream())?
        .map_err(|e| format!("cannot create a CUDA stream on GPU {ordinal}: {e:?}"))?;
    Ok((ctx, stream, ordinal))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_local_rank_gets_its_own_gpu() {
        assert_eq!(pick_device(0, 2, 2, None), Ok(0));
        assert_eq!(pick_device(1, 2, 4, None), Ok(1));
        assert_eq!(pick_device(3, 4, 4, Some("0,1,2,3")), Ok(3));
    }

    #[test]
    fn one_visible_gpu_per_process_is_used() {
        assert_eq!(pick_device(3, 4, 1, Some("3")), Ok(0));
    }

    #[test]
    fn fewer_gpus_than_local_ranks_is_a_clear_error() {
        let e = pick_device(2, 4, 2, None).unwrap_err();
        assert!(
            e.contains("4 local rank(s)") && e.contains("only 2 GPU(s)"),
            "{e}"
        );
        assert!(e.contains("LOCAL_RANK 2"), "{e}");
        // Even the ranks that would find a GPU refuse: the group could not form anyway.
        assert!(pick_device(0, 4, 2, None).is_err());
        let e = pick_device(0, 1, 0, Some("")).unwrap_err();
        assert!(e.contains("reports no GPU"), "{e}");
    }
}
