//! Tells the tests what this machine has, as the dynamic loader sees it at build time:
//! `cfg(ddp_cuda_driver)` when it finds `libcuda.so.1` (the NVIDIA driver's library), and
//! `cfg(ddp_nccl_library)` when it also finds NCCL (`libnccl.so.2`). The tests of
//! `--backend cuda` and of the NCCL bench use them to run the checks that apply here (success
//! on a GPU, a clear error without a driver) and to report the others as ignored, with the
//! reason.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ddp_cuda_driver)");
    println!("cargo::rustc-check-cfg=cfg(ddp_nccl_library)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    if loads(&["libcuda.so.1", "libcuda.so"]) {
        println!("cargo::rustc-cfg=ddp_cuda_driver");
        if loads(&["libnccl.so.2", "libnccl.so"]) {
            println!("cargo::rustc-cfg=ddp_nccl_library");
        }
    }
}

/// Whether `dlopen` finds a library under one of `names`.
fn loads(names: &[&str]) -> bool {
    names.iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL in the name");
        // SAFETY: dlopen with a valid C string; a handle, if any, is closed at once.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return false;
        }
        // SAFETY: a handle dlopen just returned.
        unsafe { libc::dlclose(handle) };
        true
    })
}
