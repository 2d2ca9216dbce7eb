//! burn's GPU kernel caches in one place per user (features `cuda` and `wgpu`).
//!
//! burn's cubecl backends compile every kernel at run time (NVRTC on CUDA) and autotune the ones
//! with several candidates (matmul, convolution, reductions) the first time each shape is seen.
//! Without a cache on disk every process pays that again: the MNIST CNN's first step took 151-188 s
//! on an H100 and an H200, in every rank, every restart and every elastic joiner (docs/gpu.md).
//! cubecl keeps autotune results and compiled kernels in one database (its "environment", shared
//! safely by the processes of a host through a write-ahead log) only with its `persistence` feature
//! (on with `burn-ddp/cuda` and `burn-ddp/wgpu`) and, for compiled kernels, with the compilation
//! cache switched on in its configuration; and by default it puts that database under the outermost
//! `target/` of the working directory, so an installed binary, or the same job started from another
//! folder, starts cold.
//!
//! `configure_kernel_cache` (features `cuda`, `wgpu`) sets cubecl's configuration the way cubecl
//! asks a library to (`CubeClRuntimeConfig::try_set`, before the first device is created), unless
//! the user has their own: a `cubecl.toml` (or a `[cubecl]` section of `burn.toml`) in the working
//! directory or above it wins, as do cubecl's `CUBECL_*` environment variables, which are applied
//! on top of ours. Every rank of a job on one host then reads and writes the same database, so only
//! the first process of a machine compiles and tunes.

// Without a GPU backend only the choice of folder and the search for a user's file are compiled
// (and unit-tested); `configure_kernel_cache` needs cubecl.
#![cfg_attr(not(any(feature = "cuda", feature = "wgpu")), allow(dead_code))]

use std::path::{Path, PathBuf};

#[cfg(any(feature = "cuda", feature = "wgpu"))]
use cubecl_runtime::config::{cache::CacheConfig, CubeClRuntimeConfig, RuntimeConfig};

/// The environment variable that names the folder of ddp-rs's caches (the kernel cache goes in
/// its `cubecl` subfolder).
pub const CACHE_DIR_ENV: &str = "DDP_CACHE_DIR";

/// What `configure_kernel_cache` (features `cuda`, `wgpu`) did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelCache {
    /// Compiled kernels and autotune results are kept in this folder.
    Folder(PathBuf),
    /// The user's own cubecl configuration file was found and left in charge.
    UserFile(PathBuf),
    /// cubecl's configuration had already been set or read in this process (a device was
    /// created first, or the program set its own): left as it was.
    AlreadySet,
}

impl std::fmt::Display for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelCache::Folder(dir) => write!(f, "kernel cache {}", dir.display()),
            KernelCache::UserFile(file) => write!(f, "kernel cache as {} says", file.display()),
            KernelCache::AlreadySet => f.write_str("kernel cache as cubecl was configured before"),
        }
    }
}

/// Points burn's kernel caches (compiled kernels and autotune results) at one folder per user,
/// `dir` when given, else `$DDP_CACHE_DIR/cubecl`, else `$XDG_CACHE_HOME/ddp-rs/cubecl`, else
/// `~/.cache/ddp-rs/cubecl`, and switches the compilation cache on (see the module
/// documentation). Call it before the first GPU device is created; the trainers' `--backend
/// cuda` does. A user's `cubecl.toml` (or `burn.toml` with a `[cubecl]` section) in the working
/// directory or above it is left in charge, and cubecl's `CUBECL_*` variables still apply.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub fn configure_kernel_cache(dir: Option<&Path>) -> KernelCache {
    if let Some(file) = user_config_file(&std::env::current_dir().unwrap_or_default()) {
        return KernelCache::UserFile(file);
    }
    let dir = match dir {
        Some(dir) => dir.to_path_buf(),
        None => default_dir(|name| std::env::var_os(name).filter(|v| !v.is_empty())),
    };
    // cubecl creates the database inside; a folder it cannot create costs a recompute (cubecl
    // then runs without the cache), never the run.
    let _ = std::fs::create_dir_all(&dir);
    let mut config = CubeClRuntimeConfig::default();
    config.environment.path = CacheConfig::Directory(dir.clone());
    config.compilation.cache = true;
    let config = config.override_from_env();
    if CubeClRuntimeConfig::try_set(config) {
        KernelCache::Folder(dir)
    } else {
        KernelCache::AlreadySet
    }
}

/// The folder of the kernel cache from the environment (`var` reads a variable).
fn default_dir(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> PathBuf {
    if let Some(dir) = var(CACHE_DIR_ENV) {
        return PathBuf::from(dir).join("cubecl");
    }
    let base = match (var("XDG_CACHE_HOME"), var("HOME")) {
        (Some(xdg), _) => PathBuf::from(xdg),
        (None, Some(home)) => PathBuf::from(home).join(".cache"),
        (None, None) => std::env::temp_dir(),
    };
    base.join("ddp-rs").join("cubecl")
}

/// The cubecl configuration file that cubecl itself would read from `start` (the working
/// directory): `cubecl.toml` or `CubeCL.toml`, or `burn.toml`/`Burn.toml` with a `[cubecl]`
/// section, in `start` or a folder above it.
fn user_config_file(start: &Path) -> Option<PathBuf> {
    start.ancestors().find_map(|dir| {
        let own = ["cubecl.toml", "CubeCL.toml"]
            .iter()
            .map(|name| dir.join(name))
            .find(|p| p.is_file());
        own.or_else(|| {
            ["burn.toml", "Burn.toml"]
                .iter()
                .map(|name| dir.join(name))
                .find(|p| {
                    std::fs::read_to_string(p).is_ok_and(|text| {
                        text.lines().any(|l| l.trim_start().starts_with("[cubecl"))
                    })
                })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_folder_comes_from_ddp_cache_dir_then_xdg_then_home() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        let all = env(&[
            ("DDP_CACHE_DIR", "/c"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(default_dir(all), PathBuf::from("/c/cubecl"));
        let xdg = env(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
        assert_eq!(default_dir(xdg), PathBuf::from("/x/ddp-rs/cubecl"));
        let home = env(&[("HOME", "/h")]);
        assert_eq!(default_dir(home), PathBuf::from("/h/.cache/ddp-rs/cubecl"));
    }

    #[test]
    fn a_users_cubecl_file_above_the_working_directory_is_found() {
        let root = tempfile::tempdir().unwrap();
        let deep = root.path().join("a").join("b");
        std::fs::create_dir_all(&deep).unwrap();
        assert_eq!(user_config_file(&deep), None);
        // burn.toml without a [cubecl] section is not cubecl's configuration.
        std::fs::write(root.path().join("a/burn.toml"), "[other]\nx = 1\n").unwrap();
        assert_eq!(user_config_file(&deep), None);
        std::fs::write(
            root.path().join("a/burn.toml"),
            "[cubecl.autotune]\nlevel = 1\n",
        )
        .unwrap();
        assert_eq!(
            user_config_file(&deep),
            Some(root.path().join("a/burn.toml"))
        );
        std::fs::write(deep.join("cubecl.toml"), "").unwrap();
        assert_eq!(user_config_file(&deep), Some(deep.join("cubecl.toml")));
    }
}
