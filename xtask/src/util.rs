//! What the tasks share: finding the workspace, building its binaries, running commands.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The workspace root (the folder above `xtask/`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lies in the workspace")
        .to_path_buf()
}

/// The cargo that runs this task (`$CARGO`), or `cargo` from the path.
fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The workspace's target directory, as cargo reports it (so `CARGO_TARGET_DIR` is honoured).
pub fn target_dir() -> Result<PathBuf> {
    let mut command = cargo();
    command.args(["metadata", "--format-version", "1", "--no-deps"]);
    command.current_dir(workspace_root());
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!("cargo metadata failed ({})", output.status);
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("parsing cargo metadata")?;
    let dir = metadata["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    Ok(PathBuf::from(dir))
}

/// Environment variable with extra cargo features for the binaries the tasks build (for
/// example `ddp-apps/cuda`), so that CI's end-to-end run reuses the build of its tests.
pub const FEATURES_VAR: &str = "DDP_CARGO_FEATURES";

/// Builds the binaries `bins` in release and returns the folder that holds them
/// (`target/release`). The build covers the whole workspace's feature set (`--workspace`), so
/// that it shares every compiled dependency with `cargo build/test --release --workspace`
/// instead of recompiling burn under a different feature set; `features` and
/// `$DDP_CARGO_FEATURES` add cargo features.
pub fn build_release_bins(bins: &[&str], features: &[&str]) -> Result<PathBuf> {
    let mut command = cargo();
    command.args(["build", "--release", "--workspace"]);
    let mut all: Vec<String> = features.iter().map(|f| f.to_string()).collect();
    if let Ok(extra) = std::env::var(FEATURES_VAR) {
        all.extend(
            extra
                .split([',', ' '])
                .filter(|f| !f.is_empty())
                .map(str::to_string),
        );
    }
    if !all.is_empty() {
        command.args(["--features", &all.join(",")]);
    }
    for bin in bins {
        command.args(["--bin", bin]);
    }
    run(command.current_dir(workspace_root()))?;
    Ok(target_dir()?.join("release"))
}

/// Runs `command` with its output streaming to ours; fails unless it exits 0.
pub fn run(command: &mut Command) -> Result<()> {
    let line = command_line(command);
    eprintln!("$ {line}");
    let status = command
        .status()
        .with_context(|| format!("starting `{line}`"))?;
    if !status.success() {
        bail!("`{line}` failed ({status})");
    }
    Ok(())
}

/// `command` as a shell-like line, for messages.
pub fn command_line(command: &Command) -> String {
    let mut words = vec![command.get_program().to_string_lossy().into_owned()];
    words.extend(
        command
            .get_args()
            .map(|arg| arg.to_string_lossy().into_owned()),
    );
    words.join(" ")
}
