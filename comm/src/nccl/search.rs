//! Where the CUDA libraries are: the NVIDIA driver (`libcuda.so.1`), NVRTC (`libnvrtc.so.12`)
//! and NCCL (`libnccl.so.2`), found as files under the names that distributions and NVIDIA's pip
//! wheels give them, in the places those put them. Nothing is opened here (`library.rs` and
//! `api.rs` open what this finds); the search only reads folders, so the tests run it on fake
//! files in a temporary folder.
//!
//! How: the places form groups, searched in this order, and inside a group a better name wins
//! over a later folder (so that a venv holding both `nvidia/cu13/lib/libnvrtc.so.13` and
//! `nvidia/cuda_nvrtc/lib/libnvrtc.so.12` gives the one this build's CUDA 12 bindings open):
//!
//! 1. `LD_LIBRARY_PATH`, folder by folder: what the user named explicitly comes first;
//! 2. Python environments (NVRTC and NCCL only; no wheel ships the driver):
//!    `site-packages/nvidia/*/lib` (and `dist-packages`) of the active venv (`VIRTUAL_ENV`), of
//!    the active conda environment (`CONDA_PREFIX`), of the python that `PATH` runs (its
//!    prefix: a venv's `bin/python3` without resolving the link), and of the user's own
//!    packages (`~/.local`). This is where `pip install torch` puts NCCL
//!    (`nvidia-nccl-cu12`, `nvidia/nccl/lib/libnccl.so.2`) and NVRTC
//!    (`nvidia/cuda_nvrtc/lib`, or `nvidia/cu13/lib` for CUDA 13 wheels);
//! 3. the system folders: the CUDA toolkit's (`/usr/local/cuda/lib64`, ...), the
//!    distribution's (`/usr/lib/x86_64-linux-gnu`, `/usr/lib64`, ...), WSL's
//!    (`/usr/lib/wsl/lib`) and the one container runtimes mount the driver into
//!    (`/usr/local/nvidia/lib64`).
//!
//! After these, `library.rs` still asks the dynamic loader itself (which also knows the folders
//! of `/etc/ld.so.conf`), and says which file it gave.
//!
//! The same file reached twice (a symlink, a folder listed twice) is a candidate once.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// A library of the GPU path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The NVIDIA driver's user-space library (`libcuda.so.1`): every CUDA call.
    Driver,
    /// NVIDIA's run-time compiler: burn's CUDA backend compiles its kernels with it.
    Nvrtc,
    /// NVIDIA's collective communication library: gradients across GPUs.
    Nccl,
}

impl CudaLibrary {
    /// How errors and the summary line name it.
    pub fn label(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "the NVIDIA driver (libcuda)",
            CudaLibrary::Nvrtc => "NVRTC (libnvrtc)",
            CudaLibrary::Nccl => "NCCL (libnccl)",
        }
    }

    /// The file names it is looked for under, best first: the versioned names that
    /// distributions and pip wheels install (no `-dev` symlink needed), then the unversioned
    /// one. NVRTC 13 comes last: this build's CUDA 12.8 bindings (cudarc) open NVRTC only as
    /// `libnvrtc.so` or `libnvrtc.so.12` (see `library.rs`).
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            CudaLibrary::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLibrary::Nvrtc => &["libnvrtc.so.12", "libnvrtc.so", "libnvrtc.so.13"],
            CudaLibrary::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// Whether pip wheels ship it (the driver comes with the kernel module, never from pip).
    fn shipped_in_wheels(self) -> bool {
        !matches!(self, CudaLibrary::Driver)
    }
}

impl fmt::Display for CudaLibrary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// What the search reads from the environment, and the system folders it looks in.
/// [`SearchEnv::from_process`] takes them from this process; tests build their own.
#[derive(Debug, Clone, Default)]
pub struct SearchEnv {
    /// `LD_LIBRARY_PATH`.
    pub ld_library_path: Option<OsString>,
    /// `VIRTUAL_ENV`: the active venv.
    pub virtual_env: Option<PathBuf>,
    /// `CONDA_PREFIX`: the active conda environment.
    pub conda_prefix: Option<PathBuf>,
    /// `PATH`, for the prefix of the python it runs.
    pub path: Option<OsString>,
    /// `HOME`, for the user's own packages (`~/.local`).
    pub home: Option<PathBuf>,
    /// The system library folders, in order.
    pub system_dirs: Vec<PathBuf>,
}

/// The system folders searched by default (the toolkit's first, then the distribution's).
pub const SYSTEM_DIRS: &[&str] = &[
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/local/nvidia/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/lib64",
    "/usr/local/lib",
    "/usr/lib",
    "/usr/lib/wsl/lib",
];

impl SearchEnv {
    /// This process's variables and the default system folders.
    pub fn from_process() -> SearchEnv {
        let path_var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        SearchEnv {
            ld_library_path: path_var("LD_LIBRARY_PATH"),
            virtual_env: path_var("VIRTUAL_ENV").map(PathBuf::from),
            conda_prefix: path_var("CONDA_PREFIX").map(PathBuf::from),
            path: path_var("PATH"),
            home: path_var("HOME").map(PathBuf::from),
            system_dirs: SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
        }
    }
}

/// A folder the search looks in, and which place of the search order it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchDir {
    /// The folder.
    pub dir: PathBuf,
    /// Why it is searched: `LD_LIBRARY_PATH`, `VIRTUAL_ENV=/x`, `system`, ...
    pub origin: String,
    /// Its group in the search order (0: `LD_LIBRARY_PATH`, then the Python environments, then
    /// the system folders).
    group: usize,
}

/// A file found under one of a library's names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The file (as found: a symlink is not resolved, so that the message shows what the
    /// user installed).
    pub path: PathBuf,
    /// Where the search found it (see [`SearchDir::origin`]).
    pub origin: String,
}

/// The folders searched for `lib`, in order (see the module documentation), existing or not.
pub fn search_dirs(lib: CudaLibrary, env: &SearchEnv) -> Vec<SearchDir> {
    let mut dirs = Vec::new();
    let mut push = |dir: PathBuf, origin: String, group: usize| {
        if !dirs.iter().any(|d: &SearchDir| d.dir == dir) {
            dirs.push(SearchDir { dir, origin, group });
        }
    };
    if let Some(list) = &env.ld_library_path {
        for dir in std::env::split_paths(list).filter(|d| !d.as_os_str().is_empty()) {
            push(dir, "LD_LIBRARY_PATH".into(), 0);
        }
    }
    if lib.shipped_in_wheels() {
        let mut prefixes: Vec<(PathBuf, String)> = Vec::new();
        if let Some(venv) = &env.virtual_env {
            prefixes.push((venv.clone(), format!("VIRTUAL_ENV={}", venv.display())));
        }
        if let Some(conda) = &env.conda_prefix {
            prefixes.push((conda.clone(), format!("CONDA_PREFIX={}", conda.display())));
        }
        if let Some(prefix) = env.path.as_ref().and_then(python_prefix) {
            prefixes.push((
                prefix.clone(),
                format!("python on PATH ({})", prefix.display()),
            ));
            if prefix == Path::new("/usr") {
                // Debian's pip, run as root, installs into /usr/local.
                prefixes.push(("/usr/local".into(), "python on PATH (/usr/local)".into()));
            }
        }
        if let Some(home) = &env.home {
            let local = home.join(".local");
            prefixes.push((
                local.clone(),
                format!("user packages ({})", local.display()),
            ));
        }
        for (prefix, origin) in prefixes {
            for dir in wheel_lib_dirs(&prefix) {
                push(dir, origin.clone(), 1);
            }
        }
    }
    for dir in &env.system_dirs {
        push(dir.clone(), "system".into(), 2);
    }
    dirs
}

/// The prefix of the first `python3` (or `python`) on `path`: the folder above its `bin`,
/// without resolving links (a venv's `bin/python3` links to the system's python, but its
/// packages are the venv's).
fn python_prefix(path: &OsString) -> Option<PathBuf> {
    std::env::split_paths(path)
        .filter(|d| !d.as_os_str().is_empty())
        .find(|d| d.join("python3").is_file() || d.join("python").is_file())
        .and_then(|bin| bin.parent().map(Path::to_path_buf))
}

/// `prefix/lib*/python3*/{site,dist}-packages/nvidia/*/lib`, sorted, existing ones only.
fn wheel_lib_dirs(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in ["lib", "lib64"] {
        for python in sorted_children(&prefix.join(lib)) {
            let name = python.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !name.starts_with("python3") {
                continue;
            }
            for packages in ["site-packages", "dist-packages"] {
                for wheel in sorted_children(&python.join(packages).join("nvidia")) {
                    let dir = wheel.join("lib");
                    if dir.is_dir() {
                        out.push(dir);
                    }
                }
            }
        }
    }
    out
}

/// The entries of `dir`, sorted by name (none when it cannot be read).
fn sorted_children(dir: &Path) -> Vec<PathBuf> {
    let mut children: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    children.sort();
    children
}

/// Every file found under one of `lib`'s names in the folders of [`search_dirs`], best first:
/// by group, then by name, then by folder (see the module documentation). The same file
/// reached twice is listed once.
pub fn find_candidates(lib: CudaLibrary, env: &SearchEnv) -> Vec<Candidate> {
    let dirs = search_dirs(lib, env);
    let mut found: Vec<(usize, usize, usize, Candidate)> = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    for (folder, dir) in dirs.iter().enumerate() {
        for (name_rank, name) in lib.file_names().iter().enumerate() {
            let path = dir.dir.join(name);
            if !path.is_file() {
                continue;
            }
            let real = std::fs::canonicalize(&path).unwrap_or_else(|_| path.clone());
            if seen.contains(&real) {
                continue;
            }
            seen.push(real);
            found.push((
                dir.group,
                name_rank,
                folder,
                Candidate {
                    path,
                    origin: dir.origin.clone(),
                },
            ));
        }
    }
    found.sort_by_key(|(group, name, folder, _)| (*group, *name, *folder));
    found.into_iter().map(|(.., c)| c).collect()
}

/// Why a library could not be loaded: the names tried, the folders searched and what went
/// wrong with each file that was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound {
    /// The library.
    pub library: CudaLibrary,
    /// The folders searched, in order.
    pub searched: Vec<SearchDir>,
    /// Files found that could not be used, each with the reason.
    pub rejected: Vec<(PathBuf, String)>,
    /// What else was tried (the dynamic loader's own search, cudarc's names), if anything.
    pub also: Vec<String>,
}

impl NotFound {
    /// No file found yet for `lib` after searching `env`'s folders.
    pub fn new(lib: CudaLibrary, env: &SearchEnv) -> NotFound {
        NotFound {
            library: lib,
            searched: search_dirs(lib, env),
            rejected: Vec::new(),
            also: Vec::new(),
        }
    }
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} could not be loaded: tried the names {} ",
            self.library,
            self.library.file_names().join(", ")
        )?;
        let existing: Vec<String> = self
            .searched
            .iter()
            .filter(|d| d.dir.is_dir())
            .map(|d| format!("{} [{}]", d.dir.display(), d.origin))
            .collect();
        if existing.is_empty() {
            write!(f, "in no existing folder (LD_LIBRARY_PATH, VIRTUAL_ENV, CONDA_PREFIX and the system folders hold none)")?;
        } else {
            write!(f, "in {}", existing.join(", "))?;
        }
        for (path, why) in &self.rejected {
            write!(f, "; {} was found but {why}", path.display())?;
        }
        for also in &self.also {
            write!(f, "; {also}")?;
        }
        write!(f, ". {}", install_hint(self.library))
    }
}

/// What to install, or where to point, for `lib`.
fn install_hint(lib: CudaLibrary) -> &'static str {
    match lib {
        CudaLibrary::Driver => {
            "Is this a machine with an NVIDIA GPU and its driver installed? If the driver's \
             library folder is elsewhere, add it to LD_LIBRARY_PATH"
        }
        CudaLibrary::Nvrtc => {
            "Install it with `pip install nvidia-cuda-nvrtc-cu12` in the active venv, or the \
             CUDA toolkit (/usr/local/cuda/lib64), or add its folder to LD_LIBRARY_PATH"
        }
        CudaLibrary::Nccl => {
            "Install it with `pip install nvidia-nccl-cu12` in the active venv (PyTorch's CUDA \
             wheels bring it), or the distribution's libnccl2 package, or add its folder to \
             LD_LIBRARY_PATH"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake library file (the search only looks at names).
    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"not really ELF").unwrap();
    }

    fn env_in(root: &Path) -> SearchEnv {
        SearchEnv {
            system_dirs: vec![root.join("sys")],
            ..SearchEnv::default()
        }
    }

    #[test]
    fn the_wheel_name_is_found_without_an_unversioned_link() {
        let root = tempfile::tempdir().unwrap();
        let lib = root
            .path()
            .join("venv/lib/python3.11/site-packages/nvidia/nccl/lib");
        touch(&lib.join("libnccl.so.2"));
        let env = SearchEnv {
            virtual_env: Some(root.path().join("venv")),
            ..env_in(root.path())
        };
        let found = find_candidates(CudaLibrary::Nccl, &env);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, lib.join("libnccl.so.2"));
        assert!(found[0].origin.starts_with("VIRTUAL_ENV="), "{found:?}");
    }

    #[test]
    fn ld_library_path_comes_before_the_venv_and_the_venv_before_the_system() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let wheel = r.join("venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        touch(&r.join("sys/libnccl.so.2"));
        touch(&wheel);
        touch(&r.join("ld/libnccl.so"));
        let mut env = SearchEnv {
            virtual_env: Some(r.join("venv")),
            ld_library_path: Some(r.join("ld").into_os_string()),
            ..env_in(r)
        };
        let order: Vec<PathBuf> = find_candidates(CudaLibrary::Nccl, &env)
            .into_iter()
            .map(|c| c.path)
            .collect();
        assert_eq!(
            order,
            [
                r.join("ld/libnccl.so"),
                wheel.clone(),
                r.join("sys/libnccl.so.2")
            ]
        );
        env.ld_library_path = None;
        assert_eq!(find_candidates(CudaLibrary::Nccl, &env)[0].path, wheel);
        env.virtual_env = None;
        assert_eq!(
            find_candidates(CudaLibrary::Nccl, &env)[0].path,
            r.join("sys/libnccl.so.2")
        );
    }

    #[test]
    fn ld_library_path_folders_keep_their_order_and_names_rank_inside_a_place() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        touch(&r.join("a/libnvrtc.so.13"));
        touch(&r.join("b/libnvrtc.so.12"));
        let joined = std::env::join_paths([r.join("a"), r.join("b")]).unwrap();
        let env = SearchEnv {
            ld_library_path: Some(joined),
            ..env_in(r)
        };
        let order: Vec<PathBuf> = find_candidates(CudaLibrary::Nvrtc, &env)
            .into_iter()
            .map(|c| c.path)
            .collect();
        // libnvrtc.so.12 is the better name (the one cudarc's CUDA 12 bindings open).
        assert_eq!(
            order,
            [r.join("b/libnvrtc.so.12"), r.join("a/libnvrtc.so.13")]
        );
    }

    #[test]
    fn the_cuda_13_and_cuda_12_wheel_folders_of_one_venv() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let site = r.join("venv/lib/python3.10/site-packages/nvidia");
        touch(&site.join("cu13/lib/libnvrtc.so.13"));
        touch(&site.join("cuda_nvrtc/lib/libnvrtc.so.12"));
        let env = SearchEnv {
            virtual_env: Some(r.join("venv")),
            ..env_in(r)
        };
        let order: Vec<PathBuf> = find_candidates(CudaLibrary::Nvrtc, &env)
            .into_iter()
            .map(|c| c.path)
            .collect();
        assert_eq!(
            order,
            [
                site.join("cuda_nvrtc/lib/libnvrtc.so.12"),
                site.join("cu13/lib/libnvrtc.so.13")
            ]
        );
    }

    #[test]
    fn the_python_on_path_and_the_users_packages_are_searched() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        touch(&r.join("env/bin/python3"));
        let wheel = r.join("env/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        touch(&wheel);
        let user = r.join("home/.local/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
        touch(&user);
        let path = std::env::join_paths([r.join("nothing/bin"), r.join("env/bin")]).unwrap();
        let env = SearchEnv {
            path: Some(path),
            home: Some(r.join("home")),
            ..env_in(r)
        };
        let found = find_candidates(CudaLibrary::Nccl, &env);
        let order: Vec<&Path> = found.iter().map(|c| c.path.as_path()).collect();
        assert_eq!(order, [wheel.as_path(), user.as_path()]);
        assert!(found[0].origin.starts_with("python on PATH"), "{found:?}");
    }

    #[test]
    fn the_driver_is_never_taken_from_a_wheel() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        touch(&r.join("venv/lib/python3.11/site-packages/nvidia/cuda/lib/libcuda.so.1"));
        touch(&r.join("sys/libcuda.so.1"));
        let env = SearchEnv {
            virtual_env: Some(r.join("venv")),
            ..env_in(r)
        };
        let found = find_candidates(CudaLibrary::Driver, &env);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, r.join("sys/libcuda.so.1"));
    }

    #[test]
    fn one_file_reached_twice_is_one_candidate() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        touch(&r.join("sys/libnccl.so.2"));
        std::os::unix::fs::symlink(r.join("sys/libnccl.so.2"), r.join("sys/libnccl.so")).unwrap();
        let found = find_candidates(CudaLibrary::Nccl, &env_in(r));
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].path, r.join("sys/libnccl.so.2"));
    }

    #[test]
    fn not_found_names_the_library_the_names_and_the_folders() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("ld")).unwrap();
        std::fs::create_dir_all(r.join("sys")).unwrap();
        let env = SearchEnv {
            ld_library_path: Some(r.join("ld").into_os_string()),
            ..env_in(r)
        };
        assert!(find_candidates(CudaLibrary::Nccl, &env).is_empty());
        let mut e = NotFound::new(CudaLibrary::Nccl, &env);
        e.rejected
            .push((r.join("x/libnccl.so.2"), "dlopen failed: bad ELF".into()));
        let text = e.to_string();
        for part in [
            "NCCL (libnccl) could not be loaded",
            "libnccl.so.2, libnccl.so",
            &format!("{} [LD_LIBRARY_PATH]", r.join("ld").display()),
            &format!("{} [system]", r.join("sys").display()),
            "was found but dlopen failed: bad ELF",
            "pip install nvidia-nccl-cu12",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
    }
}
