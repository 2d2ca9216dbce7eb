//! NVRTC for CUDA 13 only (`nvidia/cu13/lib/libnvrtc.so.13`, as PyTorch's CUDA 13 wheels install
//! it) is found, but cudarc, built with this crate's CUDA 12.8 bindings, opens NVRTC only as
//! `libnvrtc.so` or `libnvrtc.so.12`: the loader says so and what to install, instead of
//! cudarc's panic. With a fake `libnvrtc.so.13` built here by `cc`; in a test binary of its own,
//! since NVRTC is loaded once per process.
#![cfg(feature = "nccl")]

use std::process::Command;

use ddp_comm::nccl::{load_library_in, CudaLibrary, SearchEnv, SharedLib};

#[test]
fn nvrtc_13_alone_is_refused_with_what_to_install() {
    let root = tempfile::tempdir().unwrap();
    let lib = root
        .path()
        .join("venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13");
    std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
    let c = root.path().join("libnvrtc.c");
    std::fs::write(&c, include_str!("fixtures/fake_cuda/libnvrtc.c")).unwrap();
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnvrtc.so.13", "-o"])
        .arg(&lib)
        .arg(&c)
        .output()
        .expect("this test builds a fake library with `cc`; install a C compiler");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = SearchEnv {
        virtual_env: Some(root.path().join("venv")),
        ..SearchEnv::default()
    };
    // A machine whose loader finds a real `libnvrtc.so` (cudarc's first name) uses that one.
    let system_nvrtc = SharedLib::open_by_name("libnvrtc.so").is_ok();
    let result = load_library_in(CudaLibrary::Nvrtc, &env);
    if system_nvrtc {
        let loaded = result.unwrap();
        assert_ne!(loaded.path, lib);
        assert!(loaded.note.is_some(), "{loaded:?}");
        return;
    }
    let e = result.unwrap_err().to_string();
    for part in [
        "NVRTC (libnvrtc) could not be loaded",
        &format!("{} was found but cudarc", lib.display()),
        "takes it only as libnvrtc.so or libnvrtc.so.12",
        "pip install nvidia-cuda-nvrtc-cu12",
        "as libnvrtc.so in a folder of your own and put that folder first in LD_LIBRARY_PATH",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    assert!(!e.contains("panicked"), "{e}");
}
