//! Finding and opening the CUDA libraries (`ddp_comm::nccl`'s loader), without a GPU:
//!
//! - with fake libraries built here by the C compiler (`cc`) in a temporary folder: a NCCL
//!   (`libnccl.so.2`, as NCCL's packages and pip wheels name it) found in a venv, in
//!   `LD_LIBRARY_PATH` and in the system folders, in that order of preference; a broken file or
//!   an old NCCL skipped for the next one; and a fake NVIDIA driver (`libcuda.so.1`) that cudarc
//!   itself then opens, so that what the search finds is what runs;
//! - with NVIDIA's real pip wheels (`nvidia-nccl-cu12`, `nvidia-cuda-nvrtc-cu12`), installed
//!   in a venv named by `DDP_CUDA_WHEELS` (CI installs them): the loader finds them there,
//!   `ncclGetVersion` answers the wheel's version, and NVRTC compiles a kernel. Those tests are
//!   ignored by default and fail, never skip, when run without the venv.
#![cfg(feature = "nccl")]

use std::path::{Path, PathBuf};
use std::process::Command;

use ddp_comm::nccl::{load_library_in, CudaLibrary, NcclLibrary, SearchEnv};

/// The fake NCCL: every function the loader resolves; `ncclGetVersion` answers `FAKE_VERSION`.
/// With `NO_INIT_CONFIG`, `ncclCommInitRankConfig` is missing (as in NCCL before 2.14).
const FAKE_NCCL: &str = include_str!("fixtures/fake_cuda/libnccl.c");

/// The fake driver: what cudarc calls to count the GPUs, and the version.
const FAKE_DRIVER: &str = include_str!("fixtures/fake_cuda/libcuda.c");

/// Compiles `source` into the shared library `path` with soname `soname` (`defines`: `-D`
/// flags). Fails the test when there is no C compiler: these tests need one.
fn build_library(path: &Path, soname: &str, source: &str, defines: &[&str]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let c = path.with_extension("c");
    std::fs::write(&c, source).unwrap();
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(path)
        .arg(format!("-Wl,-soname,{soname}"))
        .args(defines)
        .arg(&c)
        .output()
        .expect("these tests build fake libraries with `cc`; install a C compiler");
    assert!(
        out.status.success(),
        "cc failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A fake NCCL of version `code` (`major * 10000 + minor * 100 + patch`) at `path`.
fn fake_nccl(path: &Path, code: u32) {
    build_library(
        path,
        "libnccl.so.2",
        FAKE_NCCL,
        &[&format!("-DFAKE_VERSION={code}")],
    );
}

/// A search that sees only `root`'s folders: `root/sys` as the system folder.
fn env_in(root: &Path) -> SearchEnv {
    SearchEnv {
        system_dirs: vec![root.join("sys")],
        ..SearchEnv::default()
    }
}

fn wheel_dir(venv: &Path, wheel: &str) -> PathBuf {
    venv.join("lib/python3.11/site-packages/nvidia")
        .join(wheel)
        .join("lib")
}

#[test]
fn nccl_from_a_venv_is_found_by_its_real_name_and_answers_its_version() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let lib = wheel_dir(&r.join("venv"), "nccl").join("libnccl.so.2");
    fake_nccl(&lib, 22105);
    let env = SearchEnv {
        virtual_env: Some(r.join("venv")),
        ..env_in(r)
    };
    let nccl = NcclLibrary::find(&env).unwrap();
    assert_eq!(nccl.path(), lib);
    assert_eq!(nccl.file(), lib, "dladdr finds ncclGetVersion in that file");
    assert_eq!(nccl.version(), (2, 21, 5));
    assert!(
        nccl.origin().starts_with("VIRTUAL_ENV="),
        "{}",
        nccl.origin()
    );
}

#[test]
fn ld_library_path_comes_first_then_the_venv_then_the_system() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    fake_nccl(&r.join("ld/libnccl.so.2"), 21903);
    fake_nccl(
        &wheel_dir(&r.join("venv"), "nccl").join("libnccl.so.2"),
        22105,
    );
    fake_nccl(&r.join("sys/libnccl.so.2"), 21800);
    let mut env = SearchEnv {
        ld_library_path: Some(r.join("ld").into_os_string()),
        virtual_env: Some(r.join("venv")),
        ..env_in(r)
    };
    assert_eq!(NcclLibrary::find(&env).unwrap().version(), (2, 19, 3));
    env.ld_library_path = None;
    assert_eq!(NcclLibrary::find(&env).unwrap().version(), (2, 21, 5));
    env.virtual_env = None;
    let nccl = NcclLibrary::find(&env).unwrap();
    assert_eq!(nccl.version(), (2, 18, 0));
    assert_eq!(nccl.origin(), "system");
}

#[test]
fn a_broken_file_an_old_nccl_and_one_without_a_function_are_skipped() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    std::fs::create_dir_all(r.join("a")).unwrap();
    std::fs::write(r.join("a/libnccl.so.2"), b"not a library").unwrap();
    fake_nccl(&r.join("b/libnccl.so.2"), 21205);
    build_library(
        &r.join("c/libnccl.so.2"),
        "libnccl.so.2",
        FAKE_NCCL,
        &["-DFAKE_VERSION=21500", "-DNO_INIT_CONFIG"],
    );
    let path = std::env::join_paths([r.join("a"), r.join("b"), r.join("c")]).unwrap();
    let mut env = SearchEnv {
        ld_library_path: Some(path),
        ..env_in(r)
    };
    let e = NcclLibrary::find(&env).unwrap_err().to_string();
    for part in [
        format!("{} was found but", r.join("a/libnccl.so.2").display()),
        format!(
            "{} was found but it is NCCL 2.12.5, older than 2.14",
            r.join("b/libnccl.so.2").display()
        ),
        "has no function ncclCommInitRankConfig".to_string(),
        "tried the names libnccl.so.2, libnccl.so".to_string(),
    ] {
        assert!(e.contains(&part), "{part:?} not in {e}");
    }
    fake_nccl(&r.join("sys/libnccl.so.2"), 22304);
    env.system_dirs = vec![r.join("sys")];
    let nccl = NcclLibrary::find(&env).unwrap();
    assert_eq!(nccl.path(), r.join("sys/libnccl.so.2"));
    assert_eq!(nccl.version(), (2, 23, 4));
}

/// The fake driver, found in the search's `LD_LIBRARY_PATH` (a folder the dynamic loader itself
/// does not know), is the one cudarc opens under its soname, and cudarc's calls reach it. On a machine with a real driver that the loader finds as
/// `libcuda.so` (cudarc's first name), cudarc opens that instead, and the loader must say so.
#[test]
fn the_driver_found_is_the_one_cudarc_opens() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let lib = r.join("driver/libcuda.so.1");
    build_library(&lib, "libcuda.so.1", FAKE_DRIVER, &[]);
    let env = SearchEnv {
        ld_library_path: Some(r.join("driver").into_os_string()),
        ..env_in(r)
    };
    let real_unversioned = ddp_comm::nccl::SharedLib::open_by_name("libcuda.so").is_ok();
    let loaded = load_library_in(CudaLibrary::Driver, &env).unwrap();
    if real_unversioned {
        assert_ne!(loaded.path, lib);
        assert!(
            loaded.note.as_deref().unwrap_or("").contains("not"),
            "{loaded:?}"
        );
        return;
    }
    assert_eq!(loaded.path, lib, "{loaded:?}");
    assert_eq!(loaded.origin, "LD_LIBRARY_PATH");
    assert_eq!(loaded.version, "12.4");
    assert_eq!(loaded.note, None);
    // cudarc's own calls go to the fake: three GPUs.
    assert_eq!(ddp_comm::nccl::device_count().unwrap(), 3);
}

/// The venv with NVIDIA's wheels that CI installs (`DDP_CUDA_WHEELS`); a clear failure when
/// the variable is missing or names no venv.
fn wheels_venv() -> PathBuf {
    let venv = std::env::var_os("DDP_CUDA_WHEELS")
        .map(PathBuf::from)
        .expect(
            "set DDP_CUDA_WHEELS to a venv with `pip install nvidia-nccl-cu12 \
         nvidia-cuda-nvrtc-cu12` (CI does) to run this test",
        );
    assert!(
        venv.join("bin/python").exists() || venv.join("bin/python3").exists(),
        "DDP_CUDA_WHEELS={} is not a venv",
        venv.display()
    );
    venv
}

/// The version in the name of the installed wheel's `<dist>-<version>.dist-info` folder (an
/// independent account of the version: pip's metadata, not the library).
fn wheel_version(venv: &Path, dist_prefix: &str) -> String {
    let lib = venv.join("lib");
    for python in std::fs::read_dir(&lib).unwrap().flatten() {
        let site = python.path().join("site-packages");
        let Ok(entries) = std::fs::read_dir(&site) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // `<name>-<version>.dist-info`; the name has no `-` (pip writes `_`).
            if let Some(stem) = name
                .strip_suffix(".dist-info")
                .filter(|_| name.starts_with(dist_prefix))
            {
                if let Some((_, version)) = stem.rsplit_once('-') {
                    return version.to_string();
                }
            }
        }
    }
    panic!("no {dist_prefix}*.dist-info in {}", lib.display());
}

#[test]
#[ignore = "needs the nvidia-nccl wheel; CI installs it"]
fn nccl_wheel_is_found_in_the_venv_and_answers_ncclgetversion() {
    let venv = wheels_venv();
    let env = SearchEnv {
        virtual_env: Some(venv.clone()),
        ..SearchEnv::default()
    };
    let nccl = NcclLibrary::find(&env).unwrap_or_else(|e| panic!("{e}"));
    assert!(nccl.path().starts_with(&venv), "{:?}", nccl.path());
    assert!(
        nccl.path().ends_with("nvidia/nccl/lib/libnccl.so.2"),
        "{:?}",
        nccl.path()
    );
    let (major, minor, patch) = nccl.version();
    let wheel = wheel_version(&venv, "nvidia_nccl_cu1");
    assert_eq!(
        format!("{major}.{minor}.{patch}"),
        wheel.split('+').next().unwrap(),
        "ncclGetVersion against the wheel's metadata"
    );
}

#[test]
#[ignore = "needs the nvidia-cuda-nvrtc wheel; CI installs it"]
fn nvrtc_wheel_is_what_cudarc_opens_and_it_compiles_a_kernel() {
    let venv = wheels_venv();
    let env = SearchEnv {
        virtual_env: Some(venv.clone()),
        ..SearchEnv::default()
    };
    let loaded = load_library_in(CudaLibrary::Nvrtc, &env).unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded.path.starts_with(&venv), "{loaded:?}");
    assert_eq!(loaded.note, None, "cudarc opened another file: {loaded:?}");
    let wheel = wheel_version(&venv, "nvidia_cuda_nvrtc_cu1");
    assert!(
        wheel.starts_with(&format!("{}.", loaded.version)),
        "nvrtcVersion {} against the wheel's {wheel}",
        loaded.version
    );
    // NVRTC compiles through cudarc (with its builtins library, loaded from the venv too).
    let ptx = cudarc::nvrtc::compile_ptx(
        "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }",
    )
    .unwrap_or_else(|e| panic!("NVRTC from {}: {e:?}", loaded.path.display()));
    assert!(ptx.to_src().contains("twice"), "{}", ptx.to_src());
}
