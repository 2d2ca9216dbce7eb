//! What the tasks share: finding the workspace, building its binaries, running commands.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The workspace root (the folder above `xtask/`): where this xtask was built, or, for a copy of
/// the binary run from another machine's checkout (a lent GPU machine without cargo), the
/// current folder when the build's folder is not there.
pub fn workspace_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lies in the workspace")
        .to_path_buf();
    match std::env::current_dir() {
        Ok(here) if !built.join("xtask").is_dir() && here.join("xtask").is_dir() => here,
        _ => built,
    }
}

/// The cargo that runs this task (`$CARGO`), or `cargo` from the path, without the variables
/// that `cargo run` set for this task's own package (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...).
/// Left in, they reach the build scripts' fingerprints (ring's tracks `CARGO_MANIFEST_DIR`), so
/// an xtask's build and a plain `cargo build`/`cargo test` would each rebuild ring, rustls,
/// ureq, ddp-data and ddp-apps (about 2 minutes) after the other.
fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_by_cargo_run = name.starts_with("CARGO_PKG_")
            || matches!(
                name.as_ref(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if set_by_cargo_run {
            command.env_remove(name.as_ref());
        }
    }
    // `cargo run` also put its own folders first on LD_LIBRARY_PATH; ddp-apps' build script
    // tracks that variable (it probes for libcuda), so the xtask's build recompiled ddp-apps and
    // every binary after a plain `cargo test` (and the next `cargo test` did it again).
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    if let (Some(value), Some(exe_dir)) = (std::env::var_os("LD_LIBRARY_PATH"), exe_dir) {
        match library_path_without_cargo_run(&value, &exe_dir) {
            Some(path) => command.env("LD_LIBRARY_PATH", path),
            None => command.env_remove("LD_LIBRARY_PATH"),
        };
    }
    command
}

/// `LD_LIBRARY_PATH`'s `value` without the folders `cargo run` put first on it for a binary in
/// `exe_dir` (`target/release`, the folders under it, and the toolchain's
/// `lib/rustlib/<target>/lib`): the value cargo had, `None` when nothing of it is left. What
/// rustup's proxy had set for that cargo (the toolchain's own `lib`) stays, as a plain `cargo
/// build` through the proxy sees it.
fn library_path_without_cargo_run(
    value: &std::ffi::OsStr,
    exe_dir: &Path,
) -> Option<std::ffi::OsString> {
    let kept: Vec<PathBuf> = std::env::split_paths(value)
        .filter(|e| !(e.starts_with(exe_dir) || e.to_string_lossy().contains("/lib/rustlib/")))
        .collect();
    if kept.is_empty() {
        return None;
    }
    std::env::join_paths(kept).ok()
}

/// The workspace's target directory, as cargo reports it (so `CARGO_TARGET_DIR` is honoured).
pub fn target_dir() -> Result<PathBuf> {
    Ok(cargo_dirs()?.0)
}

/// The target directory and the build directory (where cargo keeps its intermediate artifacts:
/// `build.build-dir`, the target directory unless configured), as `cargo metadata` reports them.
fn cargo_dirs() -> Result<(PathBuf, PathBuf)> {
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
    let target = metadata["target_directory"]
        .as_str()
        .context("cargo metadata has no target_directory")?;
    let build = metadata["build_directory"].as_str().unwrap_or(target);
    Ok((PathBuf::from(target), PathBuf::from(build)))
}

/// Environment variable that replaces [`DEFAULT_FEATURES`] (comma or space separated; empty
/// for none).
pub const FEATURES_VAR: &str = "DDP_CARGO_FEATURES";

/// The cargo features the tasks build with unless `$DDP_CARGO_FEATURES` says otherwise: the
/// CPU build (`ddp-apps/nccl`: ddp-comm's NCCL layer, loaded at run time, which the workspace's
/// ddp-bench turns on anyway), without burn's GPU stack (cubecl, wgpu, fusion, the kernel
/// cache) that the README's test command adds (`--features ddp-apps/nccl,ddp-apps/wgpu`): a
/// user's first `cargo xtask train-mnist` compiles in about 6 minutes on two cores instead of
/// about 20. A task that needs a GPU backend adds its feature (`train-mnist --backend wgpu`).
pub const DEFAULT_FEATURES: &str = "ddp-apps/nccl";

/// The features of every build the tasks run: `$DDP_CARGO_FEATURES` if set, else
/// [`DEFAULT_FEATURES`].
fn default_features() -> Vec<String> {
    let text = std::env::var(FEATURES_VAR).unwrap_or_else(|_| DEFAULT_FEATURES.to_string());
    text.split([',', ' '])
        .filter(|f| !f.is_empty())
        .map(str::to_string)
        .collect()
}

/// The folder, under the target directory, that holds the final binaries of a build with
/// `features`: `features-<names>` (each feature without its `package/`, sorted, joined by `-`;
/// `features-none` for none), e.g. `features-nccl` for the tasks' default build and
/// `features-nccl-wgpu` for the README's test command's feature set.
pub fn features_folder(features: &[String]) -> String {
    let mut names: Vec<&str> = features
        .iter()
        .map(|f| f.rsplit('/').next().unwrap_or(f))
        .collect();
    names.sort_unstable();
    names.dedup();
    match names.is_empty() {
        true => "features-none".to_string(),
        false => format!("features-{}", names.join("-")),
    }
}

/// Builds the binaries `bins` in release and returns the folder that holds them
/// (`target/features-<names>/release`, see [`build_release`]).
pub fn build_release_bins(bins: &[&str], features: &[&str]) -> Result<PathBuf> {
    build_release("--bin", bins, features)
}

/// Builds the examples `examples` in release, like [`build_release_bins`] (the same features,
/// the same environment, so nothing is compiled twice), and returns the `examples` folder of
/// that build.
pub fn build_release_examples(examples: &[&str]) -> Result<PathBuf> {
    Ok(build_release("--example", examples, &[])?.join("examples"))
}

/// `cargo build --release --workspace` of the targets `names` of kind `flag` (`--bin`,
/// `--example`) with the default features ([`DEFAULT_FEATURES`], or `$DDP_CARGO_FEATURES`) plus
/// `features`; returns the folder of its final binaries.
///
/// Every feature set shares one build directory (the workspace's target directory, or cargo's
/// `build.build-dir`): what two feature sets compile alike (every dependency whose features do
/// not change) is compiled once, and a build after another of a different set recompiles
/// nothing the first had already compiled for it. The final binaries of each set go to a folder
/// of its own, [`features_folder`] (cargo's `--target-dir` with the build directory kept), so
/// that the tasks' CPU binaries and the test command's (in `target/release`) never overwrite
/// each other.
///
/// With `$DDP_BIN_DIR` set, nothing is built: the binaries are taken from that folder (a copy
/// kept aside, so that a benchmark measures what was built while the tree changes).
fn build_release(flag: &str, names: &[&str], features: &[&str]) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("DDP_BIN_DIR").filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        for name in names {
            let at = if flag == "--example" {
                dir.join("examples").join(name)
            } else {
                dir.join(name)
            };
            anyhow::ensure!(at.is_file(), "DDP_BIN_DIR: {} is missing", at.display());
        }
        return Ok(dir);
    }
    let mut all = default_features();
    for feature in features {
        if !all.iter().any(|f| f == feature) {
            all.push(feature.to_string());
        }
    }
    let (target, build) = cargo_dirs()?;
    let out = target.join(features_folder(&all));
    let mut command = cargo();
    command.args(["build", "--release", "--workspace"]);
    if !all.is_empty() {
        command.args(["--features", &all.join(",")]);
    }
    for name in names {
        command.args([flag, name]);
    }
    command
        .arg("--target-dir")
        .arg(&out)
        .env("CARGO_BUILD_BUILD_DIR", &build);
    run(command.current_dir(workspace_root()))?;
    Ok(out.join("release"))
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

/// The output folder of a run: `out` if given, else `runs/<name>-<unix seconds>` in the
/// workspace; created either way.
pub fn run_dir(name: &str, out: Option<PathBuf>) -> Result<PathBuf> {
    let out = match out {
        Some(out) => out,
        None => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs();
            workspace_root().join("runs").join(format!("{name}-{now}"))
        }
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    Ok(out)
}

/// The python the torch comparisons use (gloo, PyTorch's step, torchrun, PyTorch on GPU):
/// `$DDP_PYTHON`, else `~/.cache/torchenv/bin/python` when it exists (the venv docs/running.md sets up), else
/// `python3`. Each task checks what it needs of it (torch, gloo, CUDA) and says so.
pub fn torch_python() -> PathBuf {
    if let Some(p) = std::env::var_os("DDP_PYTHON").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/torchenv/bin/python"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// PyTorch's launcher on this host: `python -m torch.distributed.run --standalone
/// --nproc-per-node nproc SCRIPT` (torchrun) with `OMP_NUM_THREADS=threads`, after writing the
/// Python `source` to `script`; the caller adds the script's arguments.
pub fn torchrun(
    python: &Path,
    nproc: usize,
    threads: usize,
    (script, source): (&Path, &str),
) -> Result<Command> {
    if let Some(dir) = script.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(script, source).with_context(|| format!("writing {}", script.display()))?;
    let mut command = Command::new(python);
    command
        .args([
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
        ])
        .arg(nproc.to_string())
        .arg(script)
        .env("OMP_NUM_THREADS", threads.to_string());
    Ok(command)
}

/// A Markdown table's first two lines: `first_columns` then `columns`.
pub fn md_header(first_columns: &[&str], columns: impl IntoIterator<Item = String>) -> String {
    let names: Vec<String> = first_columns
        .iter()
        .map(|c| c.to_string())
        .chain(columns)
        .collect();
    format!(
        "| {} |\n|{}\n",
        names.join(" | "),
        " --- |".repeat(names.len())
    )
}

/// Runs `command` with its stderr passed through and returns its stdout; an error if it cannot
/// start or exits non-zero.
pub fn run_stdout(command: &mut Command) -> Result<String> {
    let line = command_line(command);
    eprintln!("$ {line}");
    let output = command
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("starting `{line}`"))?;
    if !output.status.success() {
        bail!("`{line}` failed ({})", output.status);
    }
    String::from_utf8(output.stdout).with_context(|| format!("`{line}` printed non-UTF-8"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_feature_set_has_a_folder_of_its_own() {
        let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(features_folder(&set(&["ddp-apps/nccl"])), "features-nccl");
        // The order and repeats do not matter; the package does not name the folder.
        assert_eq!(
            features_folder(&set(&["ddp-apps/wgpu", "ddp-apps/nccl", "nccl"])),
            "features-nccl-wgpu"
        );
        assert_eq!(features_folder(&[]), "features-none");
        assert_ne!(
            features_folder(&set(&["ddp-apps/nccl"])),
            features_folder(&set(&["ddp-apps/nccl", "ddp-apps/cuda"]))
        );
    }

    #[test]
    fn cargo_runs_folders_are_taken_off_the_library_path_and_the_users_kept() {
        let toolchain = "/root/.rustup/toolchains/stable-x86_64-unknown-linux-gnu";
        let added = format!(
            "/w/target/release:/w/target/release/deps:{toolchain}/lib/rustlib/\
             x86_64-unknown-linux-gnu/lib:{toolchain}/lib"
        );
        let exe_dir = Path::new("/w/target/release");
        // Only what rustup's proxy had set is left.
        assert_eq!(
            library_path_without_cargo_run(added.as_ref(), exe_dir),
            Some(format!("{toolchain}/lib").into())
        );
        // The user's own folders stay, in their order.
        let with_users = format!("{added}:/opt/cuda/lib64:/usr/local/lib");
        assert_eq!(
            library_path_without_cargo_run(with_users.as_ref(), exe_dir),
            Some(format!("{toolchain}/lib:/opt/cuda/lib64:/usr/local/lib").into())
        );
        // Nothing but cargo run's: nothing.
        let only_cargo_run = "/w/target/release:/w/target/release/deps";
        assert_eq!(
            library_path_without_cargo_run(only_cargo_run.as_ref(), exe_dir),
            None
        );
        // A path that only shares a prefix with the target folder is the user's.
        assert_eq!(
            library_path_without_cargo_run("/w/target/release-libs".as_ref(), exe_dir),
            Some("/w/target/release-libs".into())
        );
    }
}
