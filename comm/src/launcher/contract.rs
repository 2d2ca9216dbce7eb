//! What a launched rank shares with its launcher (ddprun, in the `ddp-launch` crate, or
//! torchrun): the variables the launcher sets (among them [`USE_AGENT_STORE_ENV`]: the launcher
//! hosts the rendezvous store), the listening socket a launcher may hand rank 0 for the store
//! instead ([`STORE_FD_ENV`]), and the error file through which a rank that fails tells the
//! launcher why and whom it blames ([`record_error`], [`finish`], [`read_error_file`]).
//! Kept here, not in the launcher's crate, because every rank needs it and no rank needs the
//! launcher.

use std::io::Write as _;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::config::GroupConfig;
use crate::error::CommError;
use crate::launcher::env::Lookup;
pub use crate::launcher::vars::*;

/// The variable torchrun sets to the file where a rank records its fatal error (torchelastic's
/// `@record`); ddprun sets it too, and [`record_error`] writes it.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// The variable that tells a rank how many restarts the launcher allows (`--max-restarts`), as
/// torchrun names it.
pub const MAX_RESTARTS_ENV: &str = "TORCHELASTIC_MAX_RESTARTS";

/// The variable with which torchrun (and ddprun) tells every rank that the launcher hosts a
/// PyTorch `TCPStore` on `MASTER_ADDR:MASTER_PORT` (value `True`): no rank binds the port, every
/// rank (rank 0 too) connects to the launcher's store as a client, PyTorch's
/// `init_process_group` as well as ddp-comm's ranks (see `GroupConfig::torch_agent_store`).
pub const USE_AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// The variable with which a launcher hands rank 0 an inherited descriptor: a TCP socket already
/// bound to `MASTER_PORT` and listening, on which rank 0 hosts the rendezvous store instead of
/// binding the port itself. The launcher chose the port by binding it and never let go of it, so
/// no other process can take it in between. ddprun does not use it (it hosts the store itself,
/// [`USE_AGENT_STORE_ENV`]); a launcher of ddp-comm ranks only, or a test, may.
pub const STORE_FD_ENV: &str = "DDP_STORE_FD";

/// The exit code of a rank whose elastic job stopped below its minimum of ranks
/// ([`CommError::ElasticStopped`]), as [`finish`] gives it: a launcher in elastic mode restarts
/// the whole job (from its last checkpoint) on it, where it would only restart the rank on
/// another failure. 75 is `EX_TEMPFAIL`.
pub const ELASTIC_STOP_EXIT: u8 = 75;

/// The key of [`read_error_file`]'s blamed rank in an error file's `extraInfo`.
const BLAMED_RANK_KEY: &str = "blamed_rank";

/// Records a fatal error of this process where the launcher looks for it: the file named by
/// `TORCHELASTIC_ERROR_FILE` (set by ddprun and by torchrun), in torchelastic's format
/// (`{"message": {"message": ..., "extraInfo": {"timestamp": ...}}}`), so that both launchers
/// quote it in their failure summary. When a process group of this process has failed, the
/// rank its root cause blames ([`CommError::peer`]) goes into `extraInfo` too
/// (`"blamed_rank"`), so that the launcher can headline the rank the failure is about rather
/// than the first rank to exit (see [`read_error_file`]).
///
/// Does nothing without the variable, and never fails: the error being reported matters more.
/// Call it just before exiting on a fatal error. The file is written atomically
/// (`ddp_fsio::atomic_write`): a launcher never reads half of it.
pub fn record_error(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV).filter(|p| !p.is_empty()) else {
        return;
    };
    let path = PathBuf::from(path);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut extra = serde_json::json!({ "py_callstack": "", "timestamp": secs.to_string() });
    if let Some(Some(blamed)) = group_failure() {
        extra[BLAMED_RANK_KEY] = serde_json::Value::String(blamed.to_string());
    }
    let body = serde_json::json!({
        "message": { "message": message, "extraInfo": extra }
    });
    let _ = ddp_fsio::atomic_write(&path, |file| file.write_all(body.to_string().as_bytes()));
}

/// Ends a program's `main` the way a launched rank should: on an error, prints it with its
/// causes (`Error: {error:?}`, as Rust does for a `main` that returns `Err`), records it with
/// [`record_error`] (its `{error:#}` form: one line with the causes, as `anyhow` writes it) and
/// exits with code 1, or [`ELASTIC_STOP_EXIT`] when this process's elastic job stopped below
/// its minimum of ranks.
///
/// ```no_run
/// fn main() -> std::process::ExitCode {
///     ddp_comm::elastic::finish(run())
/// }
/// fn run() -> Result<(), std::io::Error> {
///     std::fs::read("missing.bin").map(drop)
/// }
/// ```
pub fn finish<E: std::fmt::Debug + std::fmt::Display>(
    result: Result<(), E>,
) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error:?}");
            record_error(&format!("{error:#}"));
            if ELASTIC_STOPPED.load(Ordering::Acquire) {
                return std::process::ExitCode::from(ELASTIC_STOP_EXIT);
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// What a failed rank left in its error file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorRecord {
    /// Its error in its own words.
    pub message: String,
    /// The rank its error blames, when a process group of it failed blaming one (may be the
    /// writer itself).
    pub blamed_rank: Option<usize>,
}

/// Reads an error file written by [`record_error`], or by torchelastic's `@record` (the same
/// shape; the message may also be a plain string). `None` when there is no such file, it is
/// not of that shape, or its message is empty.
pub fn read_error_file(path: &Path) -> Option<ErrorRecord> {
    let text = std::fs::read(path).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&text).ok()?;
    let message = &value["message"];
    let text = match message {
        serde_json::Value::String(s) => s.clone(),
        _ => message["message"].as_str()?.to_string(),
    };
    let blamed_rank = match &message["extraInfo"][BLAMED_RANK_KEY] {
        serde_json::Value::String(s) => s.trim().parse().ok(),
        serde_json::Value::Number(n) => n.as_u64().map(|n| n as usize),
        _ => None,
    };
    let message = text.trim().to_string();
    (!message.is_empty()).then_some(ErrorRecord {
        message,
        blamed_rank,
    })
}

/// This process's first group failure: 0 none yet, 1 a failure that blames nobody, 2 + r a
/// failure that blames rank r.
static GROUP_FAILURE: AtomicU64 = AtomicU64::new(0);

/// Notes the first failure of any process group of this process and the rank it blames, for
/// [`record_error`]; later failures do not change it.
pub(crate) fn note_group_failure(blamed: Option<usize>) {
    let code = blamed.map_or(1, |r| r as u64 + 2);
    let _ = GROUP_FAILURE.compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
}

/// Whether this process's elastic job stopped below its minimum (see [`finish`]).
static ELASTIC_STOPPED: AtomicBool = AtomicBool::new(false);

/// Notes that this process's elastic job stopped below its minimum of ranks, for [`finish`]'s
/// exit code.
pub(crate) fn note_elastic_stop() {
    ELASTIC_STOPPED.store(true, Ordering::Release);
}

/// `Some(blamed)` once a group of this process has failed.
fn group_failure() -> Option<Option<usize>> {
    match GROUP_FAILURE.load(Ordering::Acquire) {
        0 => None,
        1 => Some(None),
        code => Some(Some((code - 2) as usize)),
    }
}

/// Whether this process has adopted its [`STORE_FD_ENV`] descriptor already (it may only once).
static STORE_FD_TAKEN: AtomicBool = AtomicBool::new(false);

/// The listening socket a launcher handed this process for the rendezvous store
/// ([`STORE_FD_ENV`] in `env`), when `config` says this process hosts the store (rank 0 of a
/// group of several, not under torchrun's agent store) and has not taken it before; set
/// close-on-exec, so that what the rank starts does not hold the port. `None` without the
/// variable. An invalid value (not a number, not a listening TCP socket, another port than
/// `MASTER_PORT`) is an error naming the variable.
pub(crate) fn inherited_store_listener(
    config: &GroupConfig,
    env: Lookup,
) -> Result<Option<TcpListener>, CommError> {
    let Some(raw) = env(STORE_FD_ENV).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    let hosts_store =
        config.rank == 0 && config.world_size > 1 && config.torch_agent_store.is_none();
    if !hosts_store {
        return Ok(None);
    }
    let bad = |why: String| CommError::config(STORE_FD_ENV, format!("{STORE_FD_ENV}={raw}: {why}"));
    let fd: i32 = raw
        .trim()
        .parse()
        .ok()
        .filter(|fd| *fd >= 0)
        .ok_or_else(|| bad("not a file descriptor number".into()))?;
    if STORE_FD_TAKEN.swap(true, Ordering::AcqRel) {
        return Ok(None);
    }
    if !is_listening_socket(fd) {
        return Err(bad(format!(
            "descriptor {fd} is not a listening socket (was it inherited? is it closed?)"
        )));
    }
    // SAFETY: the launcher handed this descriptor to this process for this purpose, it is a
    // listening socket (checked above), and it is taken only once (`STORE_FD_TAKEN`).
    let listener = unsafe { <TcpListener as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let port = listener
        .local_addr()
        .map_err(|e| bad(format!("descriptor {fd} is not a TCP socket: {e}")))?
        .port();
    if port != config.master_port {
        return Err(bad(format!(
            "the socket listens on port {port}, but MASTER_PORT is {}",
            config.master_port
        )));
    }
    // SAFETY: fcntl on a descriptor this process now owns.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(Some(listener))
}

/// Whether `fd` is an open socket in the listening state.
fn is_listening_socket(fd: i32) -> bool {
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `listening`; a descriptor that is not
    // a socket (or not open) makes it fail, which is the answer.
    let ok = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut listening as *mut libc::c_int).cast(),
            &mut len,
        )
    } == 0;
    ok && listening != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn error_files_round_trip_with_and_without_a_blamed_rank() {
        let dir = std::env::temp_dir().join(format!("ddp-elastic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("error.json");
        let ours = r#"{"message": {"message": "rank 0: all_reduce #3 failed", "extraInfo": {"py_callstack": "", "timestamp": "1", "blamed_rank": "2"}}}"#;
        std::fs::write(&path, ours).unwrap();
        let got = read_error_file(&path).unwrap();
        assert_eq!(got.message, "rank 0: all_reduce #3 failed");
        assert_eq!(got.blamed_rank, Some(2));
        // torchelastic's own, and a bare message: no blame.
        let torch = r#"{"message": {"message": "ValueError: x", "extraInfo": {"py_callstack": "tb", "timestamp": "1"}}}"#;
        std::fs::write(&path, torch).unwrap();
        assert_eq!(read_error_file(&path).unwrap().blamed_rank, None);
        std::fs::write(&path, r#"{"message": "plain"}"#).unwrap();
        assert_eq!(read_error_file(&path).unwrap().message, "plain");
        std::fs::write(&path, r#"{"message": {"message": "  "}}"#).unwrap();
        assert_eq!(read_error_file(&path), None);
        std::fs::write(&path, "not json").unwrap();
        assert_eq!(read_error_file(&path), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_inherited_store_socket_is_checked_before_it_is_adopted() {
        let config = GroupConfig {
            world_size: 2,
            master_port: 1,
            ..GroupConfig::default()
        };
        let vars = |value: &'static str| move |k: &str| (k == STORE_FD_ENV).then(|| value.into());
        // Not a number; not rank 0 (left alone, even when invalid).
        let err = inherited_store_listener(&config, &vars("x")).unwrap_err();
        assert!(err.to_string().contains("DDP_STORE_FD=x"), "{err}");
        let rank_1 = GroupConfig {
            rank: 1,
            ..config.clone()
        };
        assert!(inherited_store_listener(&rank_1, &vars("x"))
            .unwrap()
            .is_none());
        // A descriptor that is a file, not a socket: refused, and not closed.
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        let fd = file.as_raw_fd();
        assert!(!is_listening_socket(fd));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(is_listening_socket(listener.as_raw_fd()));
        let connected = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!is_listening_socket(connected.as_raw_fd()));
    }
}
