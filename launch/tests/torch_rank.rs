//! ddprun starts a program that is not ddp-rs: a stand-in for a PyTorch script's
//! `init_process_group("gloo")` (env://), run under ddprun as real processes, without torch.
//!
//! This test binary is that program too (its `main`, no libtest harness, tells the two apart:
//! `--torch-rank` makes it a rank). The rank speaks PyTorch's `TCPStore` protocol with a client
//! of its own (not ddp-comm's) and does what torch 2.x's env:// rendezvous does, under each
//! value of `TORCHELASTIC_USE_AGENT_STORE`:
//!
//! - `True` (torchrun, and ddprun): every rank, rank 0 too, connects to the launcher's store on
//!   `MASTER_ADDR:MASTER_PORT` as a client (`torch.distributed.rendezvous._create_c10d_store`).
//! - unset: rank 0 binds `MASTER_PORT` and hosts the store itself (torch's `TCPStore(...,
//!   is_master=True)`; here ddp-comm's server of the same protocol), failing with EADDRINUSE
//!   when something holds the port; the other ranks connect to it.
//!
//! Then, as `TCPStore`'s constructor and gloo's rendezvous do: `ADD /init/ 1`, `SET` of its own
//! address key, `WAIT` and `GET` of every rank's, and a store-based barrier (`ADD` a counter;
//! the last rank `SET`s a key the others `WAIT` for). Each value names the attempt
//! (`TORCHELASTIC_RESTART_COUNT`), so that a rank that reads a key of an earlier attempt (a store
//! not renewed between attempts) fails, naming it.
//!
//! A watchdog ends the whole test past `DEADLINE`, and every child runs under a deadline, so a
//! hang fails instead of stalling the suite.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

#[path = "../../apps/tests/common/mod.rs"]
mod common;

/// The longest the whole test may take.
const DEADLINE: Duration = Duration::from_secs(240);
/// The longest one launch may take.
const RUN: Duration = Duration::from_secs(60);
/// How long a rank waits for the others, or for the store.
const RANK_TIMEOUT: Duration = Duration::from_secs(30);

const RANK_FLAG: &str = "--torch-rank";

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(RANK_FLAG) {
        std::process::exit(match rank() {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e}");
                1
            }
        });
    }
    // libtest's listing, and the run of ignored tests: this binary has no ignored test.
    if args.iter().any(|a| a == "--list" || a == "--ignored") {
        return;
    }
    std::thread::spawn(|| {
        std::thread::sleep(DEADLINE);
        eprintln!("torch_rank test: past its {DEADLINE:?} deadline");
        std::process::exit(1);
    });
    let tests: [(&str, fn()); 4] = [
        (
            "torch's ranks rendezvous through ddprun's store",
            ranks_rendezvous_through_ddprun_s_store,
        ),
        (
            "a rank 0 that binds MASTER_PORT fails with EADDRINUSE under ddprun only",
            a_rank_0_that_binds_the_port_fails_under_ddprun_only,
        ),
        (
            "each attempt meets in a store of its own (a free port)",
            || each_attempt_meets_in_a_store_of_its_own(&[]),
        ),
        (
            "each attempt meets in a store of its own (--master-port)",
            each_attempt_meets_in_a_cleared_store_on_a_given_port,
        ),
    ];
    for (name, test) in tests {
        test();
        println!("torch_rank test: {name}: ok");
    }
    println!("torch_rank test: {} passed", tests.len());
}

// ---------------------------------------------------------------------------------------------
// The rank: PyTorch's env:// rendezvous, by hand.

/// A variable that must be set.
fn var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("{name} is not set"))
}

fn number(name: &str) -> Result<u64, String> {
    var(name)?
        .trim()
        .parse()
        .map_err(|_| format!("{name} is not a number"))
}

fn rank() -> Result<(), String> {
    let rank = number("RANK")?;
    let world = number("WORLD_SIZE")?;
    let attempt = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|_| "0".into());
    let addr = var("MASTER_ADDR")?;
    let port = number("MASTER_PORT")? as u16;
    let agent_store = std::env::var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Ok("True");
    // torch 2.x: rank 0 hosts the store unless the agent does (`_create_c10d_store`).
    let _own_store = if rank == 0 && !agent_store {
        let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).map_err(|e| {
            let errno = if e.kind() == io::ErrorKind::AddrInUse {
                "EADDRINUSE"
            } else {
                "error"
            };
            format!("rank 0 cannot listen on MASTER_PORT {port}: {errno}: {e}")
        })?;
        println!("rank 0 hosts the store on port {port}");
        Some(ddp_comm::TorchStoreHost::start(listener).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let mut store = Client::connect(&addr, port)?;
    // TCPStore's constructor: every client counts itself in.
    store.add("/init/", 1)?;
    let me = format!("rank{rank}-attempt{attempt}");
    if let Some(ms) = std::env::var("TORCH_RANK_SET_DELAY_MS")
        .ok()
        .filter(|_| rank == 0)
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    store.set(&format!("/rdzv/addr/{rank}"), me.as_bytes())?;
    let mut seen = Vec::new();
    for r in 0..world {
        let key = format!("/rdzv/addr/{r}");
        store.wait(&[&key])?;
        let value = String::from_utf8_lossy(&store.get(&key)?).into_owned();
        if value != format!("rank{r}-attempt{attempt}") {
            return Err(format!(
                "rank {rank} of attempt {attempt} read {key} = {value:?}: a key of another \
                 attempt"
            ));
        }
        seen.push(value);
    }
    // torch's store-based barrier.
    let count = store.add("/rdzv/barrier", 1)?;
    if count > world as i64 {
        return Err(format!(
            "rank {rank}: the barrier counter is {count} with {world} ranks: an earlier \
             attempt's count"
        ));
    }
    if count == world as i64 {
        store.set("/rdzv/barrier/last", b"1")?;
    }
    store.wait(&["/rdzv/barrier/last"])?;
    println!(
        "rank {rank} of {world} (attempt {attempt}) saw {}",
        seen.join(" ")
    );
    if std::env::var("TORCH_RANK_FAIL").ok() == Some(format!("{rank}-{attempt}")) {
        return Err(format!(
            "rank {rank} fails in attempt {attempt} (TORCH_RANK_FAIL)"
        ));
    }
    // The host of the store waits for everyone to be done with it (torch's rank 0 keeps its
    // store up until the other ranks' destructors; here, their `done` keys).
    store.add("/rdzv/done", 1)?;
    if _own_store.is_some() {
        let t = Instant::now();
        while store.add("/rdzv/done", 0)? < world as i64 {
            if t.elapsed() > RANK_TIMEOUT {
                return Err("the other ranks never finished".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// A client of PyTorch's `TCPStore` protocol, written from torch's `TCPStore.cpp` apart from
/// ddp-comm's (the rank must not need ddp-comm to reach the launcher's store).
struct Client(TcpStream);

impl Client {
    /// Connects (retrying until [`RANK_TIMEOUT`]: the store may not listen yet), then
    /// `VALIDATE` and `PING`, as torch's client does.
    fn connect(addr: &str, port: u16) -> Result<Client, String> {
        let t = Instant::now();
        let stream = loop {
            match TcpStream::connect((addr, port)) {
                Ok(s) => break s,
                Err(e) if t.elapsed() > RANK_TIMEOUT => {
                    return Err(format!("cannot reach the store at {addr}:{port}: {e}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        stream
            .set_read_timeout(Some(RANK_TIMEOUT))
            .map_err(|e| e.to_string())?;
        let mut c = Client(stream);
        let nonce = std::process::id();
        let mut hello = vec![0u8];
        hello.extend(0x3C85_F7CEu32.to_le_bytes());
        hello.push(13);
        hello.extend(nonce.to_le_bytes());
        c.send(&hello)?;
        if c.read::<4>()? != nonce.to_le_bytes() {
            return Err("the store did not echo PING".into());
        }
        Ok(c)
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.0.write_all(bytes).map_err(|e| format!("store: {e}"))
    }

    fn read<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut b = [0u8; N];
        self.0
            .read_exact(&mut b)
            .map_err(|e| format!("store: no answer: {e}"))?;
        Ok(b)
    }

    fn request(query: u8, keys: &[&str]) -> Vec<u8> {
        let mut r = vec![query];
        for k in keys {
            r.extend((k.len() as u64).to_le_bytes());
            r.extend_from_slice(k.as_bytes());
        }
        r
    }

    fn set(&mut self, key: &str, value: &[u8]) -> Result<(), String> {
        let mut r = Client::request(1, &[key]);
        r.extend((value.len() as u64).to_le_bytes());
        r.extend_from_slice(value);
        self.send(&r)
    }

    fn add(&mut self, key: &str, n: i64) -> Result<i64, String> {
        let mut r = Client::request(4, &[key]);
        r.extend(n.to_le_bytes());
        self.send(&r)?;
        Ok(i64::from_le_bytes(self.read::<8>()?))
    }

    /// WAIT: the answer comes once every key is set (within the read timeout).
    fn wait(&mut self, keys: &[&str]) -> Result<(), String> {
        let mut r = vec![6];
        r.extend((keys.len() as u64).to_le_bytes());
        r.extend(Client::request(0, keys).split_off(1));
        self.send(&r)?;
        match self.read::<1>()? {
            [0] => Ok(()),
            [b] => Err(format!("WAIT {keys:?} answered {b}")),
        }
    }

    fn get(&mut self, key: &str) -> Result<Vec<u8>, String> {
        self.send(&Client::request(3, &[key]))?;
        let n = u64::from_le_bytes(self.read::<8>()?);
        if n > 1 << 20 {
            return Err(format!("GET {key}: a value of {n} bytes"));
        }
        let mut v = vec![0u8; n as usize];
        self.0.read_exact(&mut v).map_err(|e| e.to_string())?;
        Ok(v)
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// `ddprun` of `nproc` of these ranks, with ddprun's `options` and a short grace period; each
/// rank started through `wrapper` (a command that runs the rank), when not empty.
fn ddprun(nproc: usize, options: &[&str], wrapper: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ddprun"));
    command.args([
        "--grace-period",
        "1",
        "--nproc-per-node",
        &nproc.to_string(),
    ]);
    command.args(options);
    command.arg("--").args(wrapper);
    command.arg(std::env::current_exe().unwrap()).arg(RANK_FLAG);
    common::clear_launcher_env(&mut command);
    command
}

/// Runs `command` to its end (within [`RUN`]): exit code, stdout and stderr.
fn run(command: &mut Command) -> (Option<i32>, String, String) {
    let out = common::output_with_deadline(command, RUN);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ranks_rendezvous_through_ddprun_s_store() {
    let (code, out, err) = run(&mut ddprun(3, &[], &[]));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    for r in 0..3 {
        assert!(
            out.contains(&format!(
                "[rank {r}] rank {r} of 3 (attempt 0) saw rank0-attempt0 rank1-attempt0 \
                 rank2-attempt0"
            )),
            "rank {r}:\n{out}\n{err}"
        );
    }
    assert!(
        !out.contains("hosts the store"),
        "a rank hosted the store:\n{out}"
    );
}

fn a_rank_0_that_binds_the_port_fails_under_ddprun_only() {
    // Under ddprun, without the variable (a program that ignores it): rank 0 binds MASTER_PORT
    // as torch's would, and cannot, since ddprun holds it.
    let mut command = ddprun(2, &[], &["env", "-u", "TORCHELASTIC_USE_AGENT_STORE"]);
    let (code, out, err) = run(&mut command);
    assert_eq!(code, Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("rank 0 cannot listen on MASTER_PORT") && err.contains("EADDRINUSE"),
        "{err}"
    );
    // The same ranks started by hand, on a port nothing holds: rank 0 binds it and hosts the
    // store, rank 1 joins (so the EADDRINUSE above was ddprun's holding the port). The port is
    // a free one found just before; another process may take it meanwhile, so a few tries.
    let mut last = String::new();
    for _ in 0..3 {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let children: Vec<_> = (0..2)
            .map(|r| {
                let mut c = Command::new(std::env::current_exe().unwrap());
                c.arg(RANK_FLAG);
                common::clear_launcher_env(&mut c);
                c.env_remove("TORCHELASTIC_USE_AGENT_STORE");
                c.envs([
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", "2".to_string()),
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.clone()),
                ]);
                std::thread::spawn(move || run(&mut c))
            })
            .collect();
        let results: Vec<_> = children.into_iter().map(|h| h.join().unwrap()).collect();
        if results.iter().all(|(code, _, _)| *code == Some(0)) {
            assert!(
                results[0].1.contains("rank 0 hosts the store"),
                "{results:?}"
            );
            assert!(
                results[1]
                    .1
                    .contains("rank 1 of 2 (attempt 0) saw rank0-attempt0 rank1-attempt0"),
                "{results:?}"
            );
            return;
        }
        last = format!("{results:?}");
    }
    panic!("the ranks never met on a free port without ddprun: {last}");
}

/// Rank 1 fails after the rendezvous of attempt 0; in attempt 1 rank 0 sets its key late, so
/// that a store still holding attempt 0's keys would hand rank 1 the old one at once.
fn each_attempt_meets_in_a_store_of_its_own(options: &[&str]) {
    let mut all = vec!["--max-restarts", "1"];
    all.extend_from_slice(options);
    let mut command = ddprun(2, &all, &[]);
    command.envs([
        ("TORCH_RANK_FAIL", "1-0"),
        ("TORCH_RANK_SET_DELAY_MS", "500"),
    ]);
    let (code, out, err) = run(&mut command);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("restarting all 2 ranks (restart 1 of 1)"),
        "{err}"
    );
    for r in 0..2 {
        assert!(
            out.contains(&format!(
                "[rank {r}] rank {r} of 2 (attempt 1) saw rank0-attempt1 rank1-attempt1"
            )),
            "rank {r}:\n{out}\n{err}"
        );
    }
}

fn each_attempt_meets_in_a_cleared_store_on_a_given_port() {
    // A port nothing holds just now (ddprun then holds it for the whole job).
    let port = TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    each_attempt_meets_in_a_store_of_its_own(&["--master-port", &port]);
}
