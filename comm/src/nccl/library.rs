//! Loading the libraries of the GPU path and saying which files were loaded
//! ([`load_cuda_libraries`], [`CudaLibraries`]): the NVIDIA driver and NVRTC, which cudarc and
//! burn's CUDA backend open, and NCCL, which this crate opens itself (`api.rs`).
//!
//! cudarc opens a library by trying a fixed list of file names with `dlopen` (its
//! `get_lib_name_candidates`: `libcuda.so`, ..., `libcuda.so.12`, ..., `libcuda.so.1`; for NVRTC
//! `libnvrtc.so`, ..., `libnvrtc.so.12`), takes no path and reads no variable of its own, and
//! panics when none loads. It cannot be handed a file, but the dynamic loader can be made to
//! give it one: a library already loaded answers a later `dlopen` of its soname. So each
//! library is found by file (`search.rs`) and opened by path, globally and for good, before
//! cudarc first asks for it; cudarc's `dlopen("libcuda.so.1")` or `("libnvrtc.so.12")` then
//! gets that copy. Then cudarc is asked to open it (inside `catch_unwind`, and only when
//! something can be loaded at all, so that a missing library is an error rather than a panic
//! message), and `dladdr` on one of its functions says which file cudarc really uses: that is
//! the file reported. When it differs from the one found (an unversioned `libnvrtc.so` of
//! another toolkit on the loader's own path wins over the soname), the summary says so.
//!
//! NVRTC compiles with its builtins library (`libnvrtc-builtins.so.12.x`), which it opens by
//! name at run time; the builtins next to the NVRTC found are loaded with it, so that a copy
//! in a venv works without `LD_LIBRARY_PATH`.
//!
//! Everything is loaded once per process; the first call decides (later calls get the same
//! answer).

use std::ffi::{c_int, c_void};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;
use cudarc::driver::CudaContext;

use super::api::{nccl_in, NcclLibrary};
use super::dl::{file_of, same_file, SharedLib};
use super::search::{find_candidates, CudaLibrary, NotFound, SearchEnv};
use crate::error::CommError;

/// The variable named in setup errors about the GPU or the driver.
pub(super) const CUDA_VAR: &str = "CUDA";
/// The variable named in setup and run-time errors about NCCL.
pub(super) const NCCL_VAR: &str = "NCCL";
/// The variable named in setup errors about NVRTC.
const NVRTC_VAR: &str = "NVRTC";

/// One library as loaded: which file, found where, which version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedLibrary {
    /// Which library.
    pub library: CudaLibrary,
    /// The file in use.
    pub path: PathBuf,
    /// Where the search found it (`LD_LIBRARY_PATH`, `VIRTUAL_ENV=...`, `system`, `the dynamic
    /// loader's search`).
    pub origin: String,
    /// Its version (`12.4`, `2.21.5`).
    pub version: String,
    /// Anything the user should know (cudarc opened another file than the one found first).
    pub note: Option<String>,
}

impl fmt::Display for LoadedLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.library {
            CudaLibrary::Driver => "driver (CUDA ",
            CudaLibrary::Nvrtc => "NVRTC (",
            CudaLibrary::Nccl => "NCCL (",
        };
        write!(
            f,
            "{name}{}) {} [{}]",
            self.version,
            self.path.display(),
            self.origin
        )?;
        if let Some(note) = &self.note {
            write!(f, " ({note})")?;
        }
        Ok(())
    }
}

/// The libraries of the GPU path as loaded, for the first line of a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaLibraries {
    /// The NVIDIA driver.
    pub driver: LoadedLibrary,
    /// NVRTC, when asked for.
    pub nvrtc: Option<LoadedLibrary>,
    /// NCCL, when asked for.
    pub nccl: Option<LoadedLibrary>,
}

impl fmt::Display for CudaLibraries {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CUDA libraries: {}", self.driver)?;
        for lib in [&self.nvrtc, &self.nccl].into_iter().flatten() {
            write!(f, "; {lib}")?;
        }
        Ok(())
    }
}

/// Loads the NVIDIA driver, and NVRTC and NCCL when asked, from this process's environment
/// (see the module documentation), before anything else touches CUDA; the error names the
/// library, the names tried and the folders searched. Never panics.
pub fn load_cuda_libraries(nvrtc: bool, nccl: bool) -> Result<CudaLibraries, CommError> {
    load_cuda_libraries_in(&SearchEnv::from_process(), nvrtc, nccl)
}

/// [`load_cuda_libraries`] with the search reading `env` instead of the process's variables
/// (for tests; the first call of the process decides).
pub fn load_cuda_libraries_in(
    env: &SearchEnv,
    nvrtc: bool,
    nccl: bool,
) -> Result<CudaLibraries, CommError> {
    let driver = driver_in(env).map_err(|m| CommError::config(CUDA_VAR, m))?;
    let nvrtc = nvrtc
        .then(|| nvrtc_in(env).map_err(|m| CommError::config(NVRTC_VAR, m)))
        .transpose()?;
    let nccl = nccl
        .then(|| {
            nccl_in(env)
                .map(nccl_loaded)
                .map_err(|m| CommError::config(NCCL_VAR, m))
        })
        .transpose()?;
    Ok(CudaLibraries {
        driver: driver.clone(),
        nvrtc: nvrtc.cloned(),
        nccl,
    })
}

/// Loads one library, searching `env` (the first call of the process for each library decides;
/// see the module documentation). For tests and tools; [`load_cuda_libraries`] loads what a run
/// needs.
pub fn load_library_in(lib: CudaLibrary, env: &SearchEnv) -> Result<LoadedLibrary, CommError> {
    match lib {
        CudaLibrary::Driver => driver_in(env)
            .cloned()
            .map_err(|m| CommError::config(CUDA_VAR, m)),
        CudaLibrary::Nvrtc => nvrtc_in(env)
            .cloned()
            .map_err(|m| CommError::config(NVRTC_VAR, m)),
        CudaLibrary::Nccl => nccl_in(env)
            .map(nccl_loaded)
            .map_err(|m| CommError::config(NCCL_VAR, m)),
    }
}

/// The loaded NCCL, described.
fn nccl_loaded(nccl: &NcclLibrary) -> LoadedLibrary {
    let (major, minor, patch) = nccl.version();
    LoadedLibrary {
        library: CudaLibrary::Nccl,
        path: nccl.file(),
        origin: nccl.origin().to_string(),
        version: format!("{major}.{minor}.{patch}"),
        note: None,
    }
}

/// The driver, loaded once per process.
fn driver_in(env: &SearchEnv) -> Result<&'static LoadedLibrary, String> {
    static DRIVER: OnceLock<Result<LoadedLibrary, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            load_through_cudarc(
                CudaLibrary::Driver,
                env,
                &CudarcSide {
                    // SAFETY: only tries to dlopen the library and closes it again.
                    present: || catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false),
                    // SAFETY: cudarc's loader; a panic (no library) is caught by `guard`.
                    file: || guard(|| unsafe { cudarc_file(cu::culib(), b"cuInit\0") })?,
                    version: driver_version,
                },
            )
            .map_err(|m| format!("no NVIDIA driver found: {m}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// NVRTC, loaded once per process.
fn nvrtc_in(env: &SearchEnv) -> Result<&'static LoadedLibrary, String> {
    use cudarc::nvrtc::sys as rtc;
    static NVRTC: OnceLock<Result<LoadedLibrary, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            load_through_cudarc(
                CudaLibrary::Nvrtc,
                env,
                &CudarcSide {
                    // SAFETY: only tries to dlopen the library and closes it again.
                    present: || {
                        catch_unwind(|| unsafe { rtc::is_culib_present() }).unwrap_or(false)
                    },
                    // SAFETY: cudarc's loader; a panic (no library) is caught by `guard`.
                    file: || guard(|| unsafe { cudarc_file(rtc::culib(), b"nvrtcVersion\0") })?,
                    version: || {
                        let (mut major, mut minor): (c_int, c_int) = (0, 0);
                        // SAFETY: writes two ints.
                        let r = guard(|| unsafe { rtc::nvrtcVersion(&mut major, &mut minor) })?;
                        if r != rtc::nvrtcResult::NVRTC_SUCCESS {
                            return Err(format!("nvrtcVersion failed: {r:?}"));
                        }
                        Ok(format!("{major}.{minor}"))
                    },
                },
            )
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// How cudarc opens one library: whether it can (without panicking), which file it opened,
/// and the version the library reports.
struct CudarcSide {
    present: fn() -> bool,
    file: fn() -> Result<PathBuf, String>,
    version: fn() -> Result<String, String>,
}

/// The file of cudarc's copy of a library, through one of its functions (`symbol`, with its
/// NUL).
///
/// # Safety
///
/// `lib` is a loaded library and `symbol` one of its functions.
unsafe fn cudarc_file(lib: &libloading::Library, symbol: &[u8]) -> Result<PathBuf, String> {
    // SAFETY: the address is only given to dladdr.
    let address: *mut c_void = *unsafe { lib.get::<*mut c_void>(symbol) }.map_err(|e| {
        format!(
            "cudarc's copy has no {}: {e}",
            String::from_utf8_lossy(symbol)
        )
    })?;
    file_of(address).ok_or_else(|| "dladdr cannot say which file cudarc opened".into())
}

/// Finds `lib` by file and opens the first that loads, then lets cudarc open it and reports the
/// file cudarc uses (see the module documentation).
fn load_through_cudarc(
    lib: CudaLibrary,
    env: &SearchEnv,
    cudarc: &CudarcSide,
) -> Result<LoadedLibrary, String> {
    let mut not_found = NotFound::new(lib, env);
    let mut ours = None;
    for candidate in find_candidates(lib, env) {
        match SharedLib::open(&candidate.path) {
            Ok(_kept_open) => {
                ours = Some(candidate);
                break;
            }
            Err(why) => not_found
                .rejected
                .push((candidate.path, format!("cannot be loaded: {why}"))),
        }
    }
    if let (CudaLibrary::Nvrtc, Some(found)) = (lib, &ours) {
        load_nvrtc_builtins(&found.path);
    }
    // Asked without panicking first: whether cudarc can open the library under one of its names
    // (the file found, by its soname, or another on the loader's own path).
    if !(cudarc.present)() {
        match ours {
            Some(found) => not_found.rejected.push((found.path, cudarc_name_hint(lib))),
            None => not_found
                .also
                .push("the dynamic loader's own search (ld.so.cache) has none either".into()),
        }
        return Err(not_found.to_string());
    }
    let actual = match (cudarc.file)() {
        Ok(actual) => actual,
        Err(why) => {
            not_found.also.push(why);
            return Err(not_found.to_string());
        }
    };
    let loader = "the dynamic loader's search".to_string();
    let (path, origin, note) = match ours {
        Some(found) if same_file(&found.path, &actual) => (found.path, found.origin, None),
        Some(found) => (
            actual,
            loader,
            Some(format!(
                "cudarc opened this file, not {} [{}] found first",
                found.path.display(),
                found.origin
            )),
        ),
        None => (actual, loader, None),
    };
    let version = (cudarc.version)().map_err(|why| format!("{}: {why}", path.display()))?;
    Ok(LoadedLibrary {
        library: lib,
        path,
        origin,
        version,
        note,
    })
}

/// Why cudarc did not take a file the search found: its name is not one cudarc opens.
fn cudarc_name_hint(lib: CudaLibrary) -> String {
    let (names, fix) = match lib {
        CudaLibrary::Nvrtc => (
            "libnvrtc.so or libnvrtc.so.12",
            "install NVRTC for CUDA 12 next to it (`pip install nvidia-cuda-nvrtc-cu12`, which \
             adds nvidia/cuda_nvrtc/lib/libnvrtc.so.12; a CUDA 13 driver runs it), or link this \
             file as libnvrtc.so in a folder of your own and put that folder first in \
             LD_LIBRARY_PATH (NVRTC 13.0 ran burn's kernels so on an H100)",
        ),
        _ => (
            "libcuda.so or libcuda.so.1",
            "add the folder of the driver's libcuda.so.1 to LD_LIBRARY_PATH",
        ),
    };
    format!(
        "cudarc, which opens it for this build (CUDA 12.8 bindings), takes it only as {names}: \
         {fix}"
    )
}

/// Loads the `libnvrtc-builtins.so.*` next to the NVRTC at `nvrtc` (NVRTC opens it by name at
/// compile time; loaded first, the name finds this copy). Those that do not load are left to
/// NVRTC's own search.
fn load_nvrtc_builtins(nvrtc: &Path) {
    let Some(dir) = nvrtc.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut builtins: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so."))
        })
        .collect();
    builtins.sort();
    for path in builtins {
        if let Err(why) = SharedLib::open(&path) {
            tracing::debug!("NVRTC builtins {}: {why}", path.display());
        }
    }
}

/// The driver's CUDA version (`cuDriverGetVersion`), as `12.4`.
fn driver_version() -> Result<String, String> {
    let mut code: c_int = 0;
    // SAFETY: writes one int.
    let r = guard(|| unsafe { cu::cuDriverGetVersion(&mut code) })?;
    if r != cu::cudaError_enum::CUDA_SUCCESS {
        return Err(format!("cuDriverGetVersion failed: {r:?}"));
    }
    Ok(format!("{}.{}", code / 1000, (code % 1000) / 10))
}

/// Whether the NVIDIA driver library can be loaded (see [`load_cuda_libraries`]). Never panics.
pub fn driver_present() -> bool {
    driver_in(&SearchEnv::from_process()).is_ok()
}

/// Whether a NCCL library (2.14 or newer) can be loaded (see [`load_cuda_libraries`]). Never
/// panics.
pub fn nccl_present() -> bool {
    super::api::nccl().is_ok()
}

/// The number of GPUs the NVIDIA driver makes visible to this process (after
/// `CUDA_VISIBLE_DEVICES`); a clear error when there is no driver. Never panics.
pub fn device_count() -> Result<usize, CommError> {
    check_driver().map_err(|m| CommError::config(CUDA_VAR, m))
}

/// The NCCL library's version as `(major, minor, patch)`; an error naming the names tried and
/// the folders searched when it cannot be loaded.
pub fn nccl_version() -> Result<(u32, u32, u32), CommError> {
    super::api::nccl()
        .map(NcclLibrary::version)
        .map_err(|m| CommError::config(NCCL_VAR, m))
}

/// Loads the driver, initialises it and counts the devices, as text errors for the caller to
/// wrap.
pub(super) fn check_driver() -> Result<usize, String> {
    let driver = driver_in(&SearchEnv::from_process())?;
    let count = guard(CudaContext::device_count)?.map_err(|e| {
        format!(
            "the NVIDIA driver {} is loaded but cuInit failed: {e}",
            driver.path.display()
        )
    })?;
    Ok(count.max(0) as usize)
}

/// Runs `f`, turning a panic (cudarc panics on a missing library or symbol) into an error.
pub(super) fn guard<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        format!("the CUDA bindings panicked: {what}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_line_names_every_file() {
        let lib = |library, path: &str, version: &str| LoadedLibrary {
            library,
            path: path.into(),
            origin: "system".into(),
            version: version.into(),
            note: None,
        };
        let all = CudaLibraries {
            driver: lib(CudaLibrary::Driver, "/usr/lib/libcuda.so.1", "12.4"),
            nvrtc: Some(lib(CudaLibrary::Nvrtc, "/v/libnvrtc.so.12", "12.9")),
            nccl: Some(LoadedLibrary {
                origin: "VIRTUAL_ENV=/v".into(),
                ..lib(CudaLibrary::Nccl, "/v/libnccl.so.2", "2.21.5")
            }),
        };
        assert_eq!(
            all.to_string(),
            "CUDA libraries: driver (CUDA 12.4) /usr/lib/libcuda.so.1 [system]; NVRTC (12.9) \
             /v/libnvrtc.so.12 [system]; NCCL (2.21.5) /v/libnccl.so.2 [VIRTUAL_ENV=/v]"
        );
    }

    #[test]
    fn a_missing_library_is_reported_without_panicking() {
        // No driver on this machine (or one): either way, no panic, and an error says what.
        if let Err(e) = catch_unwind(device_count).expect("device_count must not panic") {
            let e = e.to_string();
            assert!(e.contains("no NVIDIA driver found"), "{e}");
            assert!(e.contains("libcuda.so.1, libcuda.so"), "{e}");
        }
        if let Err(e) = catch_unwind(nccl_version).expect("nccl_version must not panic") {
            let e = e.to_string();
            assert!(e.contains("NCCL (libnccl) could not be loaded"), "{e}");
        }
    }
}
