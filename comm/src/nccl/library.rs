//! The CUDA driver and NCCL libraries, loaded at run time: whether they are present, what to
//! tell a user when they are not, and the translation of our types (element types, reductions)
//! and of NCCL's results. cudarc panics when a library or symbol is missing; [`guard`] turns
//! that into an error.

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};

use cudarc::driver::sys as cu;
use cudarc::driver::CudaContext;
use cudarc::nccl::sys as nc;

use crate::element::{DType, ReduceOp};
use crate::error::CommError;

/// The variable named in setup errors about the GPU or the driver.
pub(super) const CUDA_VAR: &str = "CUDA";
/// The variable named in setup and run-time errors about NCCL.
pub(super) const NCCL_VAR: &str = "NCCL";

/// Whether the NVIDIA driver library (`libcuda.so`) can be loaded. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library and closes it again.
    catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false)
}

/// Whether the NCCL library can be loaded under a name cudarc looks for (`libnccl.so`, ...).
/// Never panics.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library and closes it again.
    catch_unwind(|| unsafe { nc::is_culib_present() }).unwrap_or(false)
}

/// The number of GPUs the NVIDIA driver makes visible to this process (after
/// `CUDA_VISIBLE_DEVICES`); a clear error when there is no driver. Never panics.
pub fn device_count() -> Result<usize, CommError> {
    check_driver().map_err(|m| CommError::config(CUDA_VAR, m))
}

/// The NCCL library's version as `(major, minor, patch)`; an error when it cannot be loaded.
pub fn nccl_version() -> Result<(u32, u32, u32), CommError> {
    if !nccl_present() {
        return Err(CommError::config(NCCL_VAR, nccl_missing_message()));
    }
    let mut code: std::ffi::c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    let r = guard(|| unsafe { nc::ncclGetVersion(&mut code) })
        .map_err(|m| CommError::config(NCCL_VAR, m))?;
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(CommError::config(
            NCCL_VAR,
            format!("ncclGetVersion failed: {}", nccl_error_text(r, None)),
        ));
    }
    let code = code.max(0) as u32;
    // NCCL >= 2.9 encodes the version as major * 10000 + minor * 100 + patch.
    Ok((code / 10000, (code / 100) % 100, code % 100))
}

/// Loads the driver, initialises it and counts the devices, as text errors for the caller to
/// wrap.
pub(super) fn check_driver() -> Result<usize, String> {
    if !driver_present() {
        return Err(
            "no NVIDIA driver found: libcuda.so could not be loaded (is this a machine with an \
             NVIDIA GPU and its driver installed? is the driver's library folder on the loader \
             path?)"
                .into(),
        );
    }
    let count = guard(CudaContext::device_count)?
        .map_err(|e| format!("the NVIDIA driver is installed but cuInit failed: {e}"))?;
    Ok(count.max(0) as usize)
}

/// What to tell a user whose NCCL cannot be loaded.
pub(super) fn nccl_missing_message() -> String {
    let mut message = String::from(
        "the NCCL library could not be loaded: cudarc looks for libnccl.so (and a few versioned \
         names) on the loader path; install NCCL (for example the libnccl2 and libnccl-dev \
         packages) or add its lib folder to LD_LIBRARY_PATH",
    );
    if dlopen_works("libnccl.so.2") {
        message.push_str(
            "; libnccl.so.2 is loadable, but not under the name libnccl.so: make a symlink named \
             libnccl.so to it in a folder on LD_LIBRARY_PATH (pip's nvidia-nccl-cu12 package \
             ships only libnccl.so.2)",
        );
    }
    message
}

/// Whether `name` can be opened by the dynamic loader.
fn dlopen_works(name: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: dlopen with a valid C string; the handle is closed at once.
    unsafe {
        let handle = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            false
        } else {
            libc::dlclose(handle);
            true
        }
    }
}

/// Runs `f`, turning a panic (cudarc panics on a missing library or symbol) into an error.
pub(super) fn guard<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        format!("the CUDA/NCCL bindings panicked: {what}")
    })
}

/// NCCL's data type for ours.
pub(super) fn nccl_dtype(dtype: DType) -> nc::ncclDataType_t {
    match dtype {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::F64 => nc::ncclDataType_t::ncclFloat64,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        DType::F16 => nc::ncclDataType_t::ncclFloat16,
        DType::I32 => nc::ncclDataType_t::ncclInt32,
        DType::I64 => nc::ncclDataType_t::ncclInt64,
        DType::U8 => nc::ncclDataType_t::ncclUint8,
    }
}

/// NCCL's reduction for ours (`Avg` is NCCL's `ncclAvg`).
pub(super) fn nccl_op(op: ReduceOp) -> nc::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nc::ncclRedOp_t::ncclAvg,
        ReduceOp::Min => nc::ncclRedOp_t::ncclMin,
        ReduceOp::Max => nc::ncclRedOp_t::ncclMax,
    }
}

/// NCCL's description of `result`, plus the communicator's last error message when there is one.
pub(super) fn nccl_error_text(result: nc::ncclResult_t, comm: Option<nc::ncclComm_t>) -> String {
    // SAFETY: both return static (or communicator-owned) NUL-terminated strings or null.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let mut message = format!(
        "{result:?} ({})",
        guard(|| text(unsafe { nc::ncclGetErrorString(result) })).unwrap_or_default()
    );
    if let Some(comm) = comm.filter(|c| !c.is_null()) {
        let last = guard(|| text(unsafe { nc::ncclGetLastError(comm) })).unwrap_or_default();
        if !last.is_empty() {
            message.push_str(": ");
            message.push_str(&last);
        }
    }
    message
}

/// Ok for `ncclSuccess` (and `ncclInProgress`, which blocking communicators do not return).
pub(super) fn check(result: nc::ncclResult_t) -> Result<(), nc::ncclResult_t> {
    match result {
        nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => Ok(()),
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_absence_is_reported_without_panicking() {
        if !nccl_present() {
            let e = nccl_version().unwrap_err().to_string();
            assert!(e.contains("NCCL library could not be loaded"), "{e}");
        }
    }
}
