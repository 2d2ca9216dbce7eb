//! What a launched rank shares with its launcher (ddprun, in the `ddp-launch` crate, or
//! torchrun): the variables the launcher sets, and the error file through which a rank that
//! fails tells the launcher why ([`record_error`], [`finish`]). Kept here, not in the launcher's
//! crate, because every rank needs it and no rank needs the launcher.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable torchrun sets to the file where a rank records its fatal error (torchelastic's
/// `@record`); ddprun sets it too, and [`record_error`] writes it.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// The variable that tells a rank how many times the launcher has restarted the job before
/// starting it (0 on the first attempt), as torchrun names it.
pub const RESTART_COUNT_ENV: &str = "TORCHELASTIC_RESTART_COUNT";

/// The variable that tells a rank how many restarts the launcher allows (`--max-restarts`), as
/// torchrun names it.
pub const MAX_RESTARTS_ENV: &str = "TORCHELASTIC_MAX_RESTARTS";

/// Records a fatal error of this process where the launcher looks for it: the file named by
/// `TORCHELASTIC_ERROR_FILE` (set by ddprun and by torchrun), in torchelastic's format
/// (`{"message": {"message": ..., "extraInfo": {"timestamp": ...}}}`), so that both launchers
/// quote it in their failure summary. Does nothing without the variable, and never fails: the
/// error being reported matters more. Call it just before exiting on a fatal error.
pub fn record_error(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV).filter(|p| !p.is_empty()) else {
        return;
    };
    let path = PathBuf::from(path);
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": { "py_callstack": "", "timestamp": secs.to_string() },
        }
    });
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, body.to_string()).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

/// Ends a program's `main` the way a launched rank should: on an error, prints it with its
/// causes (`Error: {error:?}`, as Rust does for a `main` that returns `Err`), records it with
/// [`record_error`] (its `{error:#}` form: one line with the causes, as `anyhow` writes it) and
/// exits with code 1.
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
            std::process::ExitCode::FAILURE
        }
    }
}
