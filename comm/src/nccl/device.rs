//! Which GPU a rank uses ([`pick_device`]) and opening it ([`open_device`]): rank `LOCAL_RANK`
//! uses GPU `LOCAL_RANK` (its primary context, the one burn's CUDA backend also uses, so device
//! pointers are shared); a process that sees exactly one GPU through `CUDA_VISIBLE_DEVICES`
//! uses it. [`check_same_gpu`] refuses a model on another GPU than NCCL's.
//! [`gradients_through_nccl`] says whether a job's gradients go through NCCL at all.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};

use super::api::{nccl, NcclLibrary};
use super::library::{check_driver, guard};

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

/// How a device ordinal reads for a user: `GPU 1`, and with `CUDA_VISIBLE_DEVICES` set, the
/// device it names (`GPU 1 (CUDA_VISIBLE_DEVICES entry "3")`).
pub fn describe_gpu(ordinal: usize, cuda_visible_devices: Option<&str>) -> String {
    let entry = cuda_visible_devices.and_then(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .nth(ordinal)
            .map(str::to_string)
    });
    match entry {
        Some(entry) => format!("GPU {ordinal} (CUDA_VISIBLE_DEVICES entry {entry:?})"),
        None => format!("GPU {ordinal}"),
    }
}

/// Refuses a model on another GPU than the one NCCL uses: the gradients NCCL reduces must live
/// on its own device. Both ordinals count the GPUs this process sees (after
/// `CUDA_VISIBLE_DEVICES`); the error names both, and the devices they stand for.
pub fn check_same_gpu(
    model: usize,
    nccl: usize,
    local_rank: usize,
    cuda_visible_devices: Option<&str>,
) -> Result<(), String> {
    if model == nccl {
        return Ok(());
    }
    Err(format!(
        "the model is on {} but NCCL uses {} (LOCAL_RANK {local_rank}'s GPU): put the model on \
         Device::cuda({nccl}) (ddp_comm::nccl::pick_device gives each local rank its GPU), or \
         give each rank one GPU through CUDA_VISIBLE_DEVICES",
        describe_gpu(model, cuda_visible_devices),
        describe_gpu(nccl, cuda_visible_devices),
    ))
}

/// This rank's GPU, opened: its context and a stream for NCCL, its ordinal, and NCCL.
pub(super) struct OpenedDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub nccl: &'static NcclLibrary,
}

/// Opens this rank's GPU: driver, NCCL library, device choice, context and stream.
pub(super) fn open_device(
    local_rank: usize,
    local_world_size: usize,
) -> Result<OpenedDevice, String> {
    let visible = check_driver()?;
    let nccl = nccl()?;
    let mask = crate::launcher::vars::visible_devices();
    let ordinal = pick_device(local_rank, local_world_size, visible, mask.as_deref())?;
    let ctx = guard(|| CudaContext::new(ordinal))?
        .map_err(|e| format!("cannot open GPU {ordinal}: {e:?}"))?;
    let stream = guard(|| ctx.new_stream())?
        .map_err(|e| format!("cannot create a CUDA stream on GPU {ordinal}: {e:?}"))?;
    Ok(OpenedDevice {
        ctx,
        stream,
        ordinal,
        nccl,
    })
}

/// Whether the gradients of a job of `world_size` ranks on CUDA devices go through NCCL on the
/// GPU, from `DDP_NCCL` (the same on every rank): with more than one rank unless it is `0` (the
/// host and the process group then carry them); with one rank only when it is `1`, where NCCL's
/// all-reduce changes nothing but the whole device path runs (packing, one synchronisation, the
/// in-place collective, the slots read back, unpacking): a check of that path on one GPU.
pub fn gradients_through_nccl(world_size: usize) -> bool {
    through_nccl(std::env::var("DDP_NCCL").ok().as_deref(), world_size)
}

/// [`gradients_through_nccl`] for the value `setting` of `DDP_NCCL`.
fn through_nccl(setting: Option<&str>, world_size: usize) -> bool {
    match setting.map(str::trim) {
        Some("0") => false,
        Some("1") => true,
        _ => world_size > 1,
    }
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

    #[test]
    fn a_model_on_another_gpu_than_nccls_is_refused_naming_both() {
        assert_eq!(check_same_gpu(1, 1, 1, None), Ok(()));
        let e = check_same_gpu(0, 2, 2, None).unwrap_err();
        assert!(
            e.contains("the model is on GPU 0 but NCCL uses GPU 2"),
            "{e}"
        );
        assert!(e.contains("LOCAL_RANK 2"), "{e}");
        let e = check_same_gpu(1, 0, 0, Some("4, 6")).unwrap_err();
        assert!(
            e.contains(
                "the model is on GPU 1 (CUDA_VISIBLE_DEVICES entry \"6\") but NCCL uses GPU 0 \
                 (CUDA_VISIBLE_DEVICES entry \"4\")"
            ),
            "{e}"
        );
    }

    #[test]
    fn ddp_nccl_chooses_the_gradient_path() {
        // Unset (or anything else): NCCL from two ranks on.
        assert!(!through_nccl(None, 1));
        assert!(through_nccl(None, 2));
        assert!(through_nccl(Some("yes"), 3));
        // 0: the host path at every size; 1: the device path at one rank too.
        assert!(!through_nccl(Some(" 0 "), 4));
        assert!(through_nccl(Some("1"), 1));
        assert!(through_nccl(Some("1\n"), 8));
    }
}
