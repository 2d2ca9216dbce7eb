//! What every process-spawning test of ddp-apps shares: a child process that is killed when its
//! guard is dropped (a failed assertion unwinds through it) and by a watchdog past its
//! deadline, so that no test can hang or leave processes behind.
//!
//! Killing `ddprun` is enough to stop its ranks: it starts them with `PR_SET_PDEATHSIG =
//! SIGKILL` (launch/src/lib.rs), so they die with it.
//!
//! The launcher's tests (launch/tests) include this file too (`#[path]`).

#![allow(dead_code)] // each test binary uses a subset

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// A binary of another package of the workspace (`ddprun` of ddp-launch, `ddp-comm-peer` of
/// ddp-comm, ...), where the workspace build puts it: in the folder of the final binaries
/// (`target/<profile>/`). Cargo gives a test the path of its own package's binaries only; the
/// folder is theirs (their `CARGO_BIN_EXE_*` paths), or, for a package without binaries, the
/// one above this test's executable (`target/<profile>/deps/`), which is the same folder unless
/// cargo's build directory (`build.build-dir`, CI's dependency cache) is set apart.
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // One binary of each package that includes this file and has any.
    let own_bins = [
        option_env!("CARGO_BIN_EXE_train-mnist"),
        option_env!("CARGO_BIN_EXE_ddprun"),
        option_env!("CARGO_BIN_EXE_user-train"),
        option_env!("CARGO_BIN_EXE_ddp-allreduce-bench"),
        option_env!("CARGO_BIN_EXE_ddp-comm-peer"),
    ];
    let folders = own_bins
        .into_iter()
        .flatten()
        .filter_map(|bin| std::path::Path::new(bin).parent().map(|d| d.to_path_buf()))
        .chain(
            exe.parent()
                .and_then(|deps| deps.parent())
                .map(|d| d.to_path_buf()),
        );
    for folder in folders {
        let path = folder.join(name);
        if path.exists() {
            return path;
        }
    }
    panic!(
        "{name} is not built next to this package's binaries nor next to {}: build the whole \
         workspace first (cargo build --release --workspace, or cargo test --release --workspace)",
        exe.display()
    )
}

/// A child process under guard: killed (and reaped) on drop if still running, and killed by a
/// watchdog thread once `deadline` has passed since it started.
pub struct Guarded {
    child: Arc<Mutex<Child>>,
    started: Instant,
    deadline: Duration,
    /// The child's stdout, when it was piped and not yet taken.
    pub stdout: Option<ChildStdout>,
    /// The child's stderr, when it was piped and not yet taken.
    pub stderr: Option<ChildStderr>,
}

impl Guarded {
    /// Spawns `command` under guard; panics if it cannot start.
    pub fn spawn(command: &mut Command, deadline: Duration) -> Guarded {
        let mut child = command.spawn().expect("starting the child process");
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let child = Arc::new(Mutex::new(child));
        let started = Instant::now();
        let watched = Arc::downgrade(&child);
        thread::spawn(move || loop {
            thread::sleep(Duration::from_millis(50));
            let Some(child) = watched.upgrade() else {
                return; // the guard was dropped (and killed the child if needed)
            };
            let mut child = child.lock().unwrap_or_else(|e| e.into_inner());
            match child.try_wait() {
                Ok(None) if started.elapsed() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
                Ok(None) => {}
                _ => return,
            }
        });
        Guarded {
            child,
            started,
            deadline,
            stdout,
            stderr,
        }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.lock().id()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its exit status if it has exited.
    pub fn try_wait(&self) -> Option<ExitStatus> {
        self.lock().try_wait().expect("waiting for the child")
    }

    /// Waits for the child to exit; kills it and panics once the deadline has passed.
    pub fn wait(&self) -> ExitStatus {
        loop {
            if let Some(status) = self.try_wait() {
                if self.started.elapsed() > self.deadline {
                    panic!("the child did not finish within {:?}", self.deadline);
                }
                return status;
            }
            if self.started.elapsed() > self.deadline {
                let mut child = self.lock();
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child did not finish within {:?}", self.deadline);
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Time since the child started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let mut child = self.lock();
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Reads all of `source` on a thread.
pub fn collect(mut source: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = source.read_to_end(&mut bytes);
        bytes
    })
}

/// Like `Command::output`, but under guard: the child is killed and the test fails past
/// `deadline` (and the child is killed if the test panics meanwhile).
pub fn output_with_deadline(command: &mut Command, deadline: Duration) -> Output {
    let mut guarded = Guarded::spawn(
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
        deadline,
    );
    let stdout = collect(guarded.stdout.take().expect("piped stdout"));
    let stderr = collect(guarded.stderr.take().expect("piped stderr"));
    let status = guarded.wait();
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

/// The variables of launchers (torchrun, ddprun, Kubeflow's PET_*, MPI, Slurm) and the trainers' test hooks, which a
/// child started on its own must not inherit from a test run under one.
const LAUNCHER_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DDP_JOB_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "PET_MAX_RESTARTS",
    "PET_RDZV_BACKEND",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_ID",
    "PET_RDZV_CONF",
    "DDP_LAUNCHER",
    "DDP_TEST_KILL_AT_STEP",
    "DDP_TEST_KILL_RANK",
];

/// Removes [`LAUNCHER_VARS`] from `command`'s environment.
pub fn clear_launcher_env(command: &mut Command) -> &mut Command {
    for var in LAUNCHER_VARS {
        command.env_remove(var);
    }
    command
}

/// A command that runs the trainer `bin` as `nproc` ranks: through `ddprun` for 2 or more, as
/// one process with the launcher variables cleared for 1; the caller adds the trainer's flags.
pub fn ranks_command(bin: &str, nproc: usize) -> Command {
    if nproc == 1 {
        let mut c = Command::new(bin);
        clear_launcher_env(&mut c);
        return c;
    }
    let mut c = Command::new(workspace_bin("ddprun"));
    c.args(["--nproc-per-node", &nproc.to_string(), "--"])
        .arg(bin);
    c
}

/// A finished process's stdout and stderr, in that order, as text.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The lines `child` writes to its stdout and stderr (both piped; taken here), as they come:
/// each stream read by a thread of its own, the lines of both in one channel.
pub fn output_lines(child: &mut Guarded) -> mpsc::Receiver<String> {
    let (tx, lines) = mpsc::channel();
    let streams = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ];
    for stream in streams.into_iter().flatten() {
        let tx = tx.clone();
        thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
    }
    lines
}
