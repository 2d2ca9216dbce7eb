//! Groups that rendezvous through a PyTorch `TCPStore`, as under torchrun or ddprun
//! (`TORCHELASTIC_USE_AGENT_STORE=True`): ddp-comm's own server of torch's protocol
//! ([`TorchStoreHost`], what ddprun hosts), checked against the bytes real torch 2.15 exchanged
//! (`fixtures/torch_store/transcript.txt`), stands in for torchrun's agent, and real ranks form
//! a group through it over real sockets.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use ddp_comm::{CommError, GroupConfig, ProcessGroup, ReduceOp, TorchStoreHost};

const TRANSCRIPT: &str = include_str!("fixtures/torch_store/transcript.txt");

/// A server of torch's protocol on a free port of 127.0.0.1.
fn torch_server() -> TorchStoreHost {
    TorchStoreHost::start(TcpListener::bind("127.0.0.1:0").unwrap()).unwrap()
}
fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The server must answer real torch's client bytes exactly as real torch's server did:
/// replays the transcript's client side and compares every answer.
#[test]
fn the_server_answers_like_torch() {
    let server = torch_server();
    let mut c = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut step = "";
    let mut answers = 0;
    for line in TRANSCRIPT.lines().filter(|l| !l.starts_with('#')) {
        match line.split_once(' ') {
            Some(("step", name)) => step = name,
            Some((">", h)) => c.write_all(&unhex(h)).unwrap(),
            Some(("<", h)) => {
                let want = unhex(h);
                let mut got = vec![0u8; want.len()];
                c.read_exact(&mut got)
                    .unwrap_or_else(|e| panic!("step {step:?}: no answer {h}: {e}"));
                assert_eq!(hex(&got), h, "step {step:?}");
                answers += 1;
            }
            _ => panic!("bad transcript line {line:?}"),
        }
    }
    assert!(answers >= 15, "only {answers} answers in the transcript");
    // And nothing more than torch answered.
    c.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut extra = [0u8; 16];
    assert!(
        !matches!(c.read(&mut extra), Ok(n) if n > 0),
        "extra answer bytes"
    );
}

/// torchrun's environment for `rank` of `world`, with the agent store at `port`.
fn torchrun_env(rank: usize, world: usize, port: u16, restart: u32) -> GroupConfig {
    let vars: HashMap<&str, String> = [
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
        ("DDP_TIMEOUT", "10".to_string()),
        ("DDP_CONNECT_TIMEOUT", "10".to_string()),
    ]
    .into_iter()
    .collect();
    GroupConfig::from_vars(|k| vars.get(k).cloned()).unwrap()
}

/// Three ranks form a group through a torch-protocol store (nobody binds MASTER_PORT: the test
/// server holds it, so a rank 0 trying to host its own store would fail), run an all-reduce, and
/// every key they wrote lies under torch's worker prefix for the restart count.
#[test]
fn three_ranks_form_a_group_over_a_torch_store() {
    let server = torch_server();
    let world = 3;
    let results: Vec<Result<Vec<f32>, CommError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let config = torchrun_env(rank, world, server.port(), 2);
                s.spawn(move || {
                    let pg = ProcessGroup::with_config(config)?;
                    let store = pg.store().expect("a store at world size 3");
                    assert_eq!(store.key_prefix(), "//worker/attempt_2/");
                    store.set(&format!("user/{rank}"), b"hi")?;
                    let sum = pg.all_reduce(vec![rank as f32 + 1.0; 1000], ReduceOp::Sum)?;
                    store.wait(&["user/0", "user/1", "user/2"])?;
                    assert_eq!(store.get("user/2")?, b"hi");
                    pg.barrier()?;
                    Ok(sum)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        let sum = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            sum.iter().all(|&x| x == 6.0),
            "rank {rank}: {:?}",
            &sum[..3]
        );
    }
    let keys = server.keys();
    for k in &keys {
        assert!(
            k.starts_with("//worker/attempt_2/"),
            "key {k:?} outside the prefix"
        );
    }
    for k in [
        "ddp/job_id",
        "ddp/addr/0",
        "ddp/addr/2",
        "ddp/joined/1",
        "user/1",
    ] {
        let full = format!("//worker/attempt_2/{k}");
        assert!(keys.contains(&full), "{full:?} missing from {keys:?}");
    }
}

/// A rank whose peers never come: the wait on the torch store ends at the connect deadline
/// with an error naming the key and the store's address (WAIT, then CANCEL_WAIT), no hang.
#[test]
fn a_missing_rank_0_is_a_timeout_naming_the_key() {
    let server = torch_server();
    let mut config = torchrun_env(1, 2, server.port(), 0);
    config.connect_timeout = Duration::from_millis(800);
    let t = Instant::now();
    let err = ProcessGroup::with_config(config).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let msg = err.to_string();
    assert!(
        msg.contains("ddp/job_id") && msg.contains(&format!("127.0.0.1:{}", server.port())),
        "{msg}"
    );
}

/// Something on MASTER_PORT that is not a torch store (it closes at once, as ddp-comm's own
/// store does on torch's bytes): a clear error naming the address and the handshake.
#[test]
fn a_server_that_is_not_a_torch_store_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in listener.incoming().flatten() {
            let _ = c.shutdown(Shutdown::Both);
        }
    });
    let mut config = torchrun_env(0, 2, port, 0);
    config.connect_timeout = Duration::from_secs(2);
    let err = ProcessGroup::with_config(config).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("VALIDATE") && msg.contains(&format!("127.0.0.1:{port}")),
        "{msg}"
    );
}
