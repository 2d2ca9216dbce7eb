//! Tells the tests whether this machine has an NVIDIA driver: `cfg(ddp_cuda_driver)` when the
//! dynamic loader finds `libcuda.so.1` (the driver's library) at build time. The tests of
//! `--backend cuda` use it to run the checks that apply here (success on a GPU, a clear error
//! without a driver) and to report the others as ignored, with the reason.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(ddp_cuda_driver)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=LD_LIBRARY_PATH");
    if driver_present() {
        println!("cargo::rustc-cfg=ddp_cuda_driver");
    }
}

/// Whether `dlopen` finds the CUDA driver library under one of its installed names.
fn driver_present() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
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
