//! The GPU backends: `--backend cuda` (feature `cuda`), burn's CUDA backend on the GPU of
//! `LOCAL_RANK` (gradients of more than one rank are all-reduced on the GPU through NCCL by the
//! `ddp` crate), and `--backend wgpu` (feature `wgpu`), burn's wgpu backend on wgpu's default
//! adapter (gradients through the host), or pinned to one graphics API (`--backend vulkan`,
//! `--backend metal`). All use burn's kernel cache in one folder per user.

#[cfg(feature = "cuda")]
use anyhow::anyhow;
use anyhow::Result;
use burn::tensor::Device;
use ddp_comm::ProcessGroup;

/// burn's CUDA device for this rank: GPU `LOCAL_RANK` (or the one GPU `CUDA_VISIBLE_DEVICES`
/// leaves visible).
///
/// First, before burn touches CUDA, burn's kernel caches are pointed at one folder per user
/// (`ddp::kernel_cache::configure_kernel_cache`), and the libraries are loaded: the NVIDIA driver, NVRTC (burn
/// compiles its kernels with it) and, for more than one rank, NCCL (unless `DDP_NCCL=0`; at one
/// rank with `DDP_NCCL=1`), found under their real names in `LD_LIBRARY_PATH`, the active venv's
/// NVIDIA wheels and the system folders (`ddp_comm::nccl::load_cuda_libraries`). The first rank
/// of each host prints which files were loaded, as the run's first line. A missing library, a
/// machine without a driver, or fewer GPUs than local ranks is a clear error here (naming the
/// library, the names tried and the folders searched) instead of a panic inside burn.
#[cfg(feature = "cuda")]
pub fn cuda_device(pg: &ProcessGroup) -> Result<Device> {
    // Before the first device: burn's compiled kernels and autotune results in one folder per
    // user, shared by every rank of the host, so only the first process compiles and tunes.
    let cache = ddp::kernel_cache::configure_kernel_cache(None);
    let nccl = ddp_comm::nccl::gradients_through_nccl(pg.world_size());
    let libraries = ddp_comm::nccl::load_cuda_libraries(true, nccl)
        .map_err(|e| anyhow!("--backend cuda: rank {}: {e}", pg.rank()))?;
    if pg.local_rank() == 0 {
        eprintln!("rank {}: {libraries}; {cache}", pg.rank());
    }
    let count = ddp_comm::nccl::device_count()
        .map_err(|e| anyhow!("--backend cuda: rank {}: {e}", pg.rank()))?;
    let mask = ddp_comm::elastic::visible_devices();
    let ordinal = ddp_comm::nccl::pick_device(
        pg.local_rank(),
        pg.local_world_size(),
        count,
        mask.as_deref(),
    )
    .map_err(|m| anyhow!("--backend cuda: rank {}: {m}", pg.rank()))?;
    Ok(Device::cuda(ordinal))
}

/// burn's wgpu device for this rank, shared by the ranks of a host. burn's kernel caches are
/// pointed at one folder per user first (`ddp::kernel_cache::configure_kernel_cache`), and the
/// first rank of each host says where.
///
/// - `--backend wgpu`: wgpu's default adapter on whichever graphics API wgpu settles on (a
///   discrete GPU first; on a machine without one, Mesa's lavapipe, a Vulkan device on the CPU;
///   `CUBECL_WGPU_DEFAULT_DEVICE` chooses another), brought up lazily by burn.
/// - `--backend vulkan` / `metal`: the same adapter pinned to that API (burn's WGSL compiler:
///   burn's `vulkan` feature, SPIR-V, is not built). The device is brought up here, so that a
///   machine without it is an error naming the backend, not a panic inside burn; `metal` is
///   an error at once on a system other than Apple's.
#[cfg(feature = "wgpu")]
pub fn wgpu_device(pg: &ProcessGroup, backend: crate::options::BackendKind) -> Result<Device> {
    use crate::options::BackendKind;
    use burn::backend::wgpu::{WgpuBackend, WgpuDevice};
    let name = backend.name();
    let pinned = match backend {
        BackendKind::Vulkan => Some(WgpuBackend::Vulkan),
        BackendKind::Metal => Some(WgpuBackend::Metal),
        _ => None,
    };
    if backend == BackendKind::Metal && !cfg!(target_vendor = "apple") {
        anyhow::bail!(
            "--backend metal: Metal is Apple's graphics API (macOS, iOS), and this is {}: use \
             --backend wgpu (wgpu's default adapter) or --backend vulkan",
            std::env::consts::OS
        );
    }
    let cache = ddp::kernel_cache::configure_kernel_cache(None);
    let Some(api) = pinned else {
        if pg.local_rank() == 0 {
            eprintln!("rank {}: wgpu's default adapter; {cache}", pg.rank());
        }
        return Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
    };
    let device = WgpuDevice::default().on(api);
    bring_up(&device, backend).map_err(|e| {
        anyhow::anyhow!(
            "--backend {name}: rank {}: no {api:?} device: {e}",
            pg.rank()
        )
    })?;
    if pg.local_rank() == 0 {
        eprintln!(
            "rank {}: wgpu's default adapter on {api:?}; {cache}",
            pg.rank()
        );
    }
    Ok(Device::new(device))
}

/// Brings `device` up on its pinned graphics API, registering its client with cubecl (burn then
/// finds it under the device's id).
#[cfg(feature = "wgpu")]
fn bring_up(
    device: &burn::backend::wgpu::WgpuDevice,
    backend: crate::options::BackendKind,
) -> std::result::Result<(), String> {
    use burn::backend::wgpu::{graphics, try_init_setup, RuntimeOptions};
    let options = RuntimeOptions::try_default().map_err(|e| e.to_string())?;
    let setup = match backend {
        crate::options::BackendKind::Metal => try_init_setup::<graphics::Metal>(device, options),
        _ => try_init_setup::<graphics::Vulkan>(device, options),
    };
    setup.map(|_| ()).map_err(|e| e.to_string())
}
