//! Groups that rendezvous through a PyTorch `TCPStore`, as under torchrun
//! (`TORCHELASTIC_USE_AGENT_STORE=True`): a minimal torch-protocol server written here (checked
//! against the bytes real torch 2.15 exchanged, `fixtures/torch_store/transcript.txt`) stands in
//! for torchrun's agent, and real ranks form a group through it over real sockets.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ddp_comm::{CommError, GroupConfig, ProcessGroup, ReduceOp};

const TRANSCRIPT: &str = include_str!("fixtures/torch_store/transcript.txt");
const MAGIC: u32 = 0x3C85_F7CE;
const MAX_LEN: u64 = 16 << 20;

/// The keys and values of the test server, and a condition variable for WAIT.
#[derive(Default)]
struct State {
    map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
    changed: Condvar,
}

/// A minimal PyTorch `TCPStore` server (the queries of torch's `QueryType` that ddp-comm
/// sends), one thread per connection. Like torch's, it closes a connection whose first query is
/// not VALIDATE with the magic, that GETs a missing key, or that sends anything it does not know.
struct TorchServer {
    port: u16,
    state: Arc<State>,
}

impl TorchServer {
    fn start() -> TorchServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State::default());
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(stream) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = serve(&stream, &st);
                    let _ = stream.shutdown(Shutdown::Both);
                });
            }
        });
        TorchServer { port, state }
    }

    fn keys(&self) -> Vec<String> {
        let map = self.state.map.lock().unwrap();
        let mut keys: Vec<String> = map
            .keys()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        keys.sort();
        keys
    }
}

fn read_n<const N: usize>(s: &mut &TcpStream) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn read_vec(s: &mut &TcpStream) -> std::io::Result<Vec<u8>> {
    let len = u64::from_le_bytes(read_n::<8>(s)?);
    if len > MAX_LEN {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn read_keys(s: &mut &TcpStream) -> std::io::Result<Vec<Vec<u8>>> {
    let n = u64::from_le_bytes(read_n::<8>(s)?);
    if n > 4096 {
        return Err(std::io::ErrorKind::InvalidData.into());
    }
    (0..n).map(|_| read_vec(s)).collect()
}

fn vec_bytes(v: &[u8]) -> Vec<u8> {
    let mut out = (v.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(v);
    out
}

fn bad() -> std::io::Error {
    std::io::ErrorKind::InvalidData.into()
}

/// Serves one connection until it closes or misbehaves (an `Err` closes it).
fn serve(stream: &TcpStream, st: &State) -> std::io::Result<()> {
    let mut s = stream;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let [q] = read_n::<1>(&mut s)?;
    if q != 0 || u32::from_le_bytes(read_n::<4>(&mut s)?) != MAGIC {
        return Err(bad());
    }
    loop {
        let [q] = read_n::<1>(&mut s)?;
        match q {
            // PING: echo the nonce.
            13 => {
                let nonce = read_n::<4>(&mut s)?;
                s.write_all(&nonce)?;
            }
            // SET
            1 => {
                let (k, v) = (read_vec(&mut s)?, read_vec(&mut s)?);
                st.map.lock().unwrap().insert(k, v);
                st.changed.notify_all();
            }
            // COMPARE_SET: an empty expected value matches a missing key; answers the value
            // after the operation (the expected one for a missing key that did not match).
            2 => {
                let (k, exp, want) = (read_vec(&mut s)?, read_vec(&mut s)?, read_vec(&mut s)?);
                let mut map = st.map.lock().unwrap();
                let answer = match map.get(&k) {
                    None if exp.is_empty() => {
                        map.insert(k, want.clone());
                        want
                    }
                    None => exp,
                    Some(cur) if *cur == exp => {
                        map.insert(k, want.clone());
                        want
                    }
                    Some(cur) => cur.clone(),
                };
                st.changed.notify_all();
                s.write_all(&vec_bytes(&answer))?;
            }
            // GET: the key must exist (clients WAIT first).
            3 => {
                let k = read_vec(&mut s)?;
                let v = st.map.lock().unwrap().get(&k).cloned().ok_or_else(bad)?;
                s.write_all(&vec_bytes(&v))?;
            }
            // ADD: the value is kept as decimal text.
            4 => {
                let k = read_vec(&mut s)?;
                let delta = i64::from_le_bytes(read_n::<8>(&mut s)?);
                let mut map = st.map.lock().unwrap();
                let cur = match map.get(&k) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|t| t.parse::<i64>().ok())
                        .ok_or_else(bad)?,
                };
                let new = cur.wrapping_add(delta);
                map.insert(k, new.to_string().into_bytes());
                st.changed.notify_all();
                drop(map);
                s.write_all(&new.to_le_bytes())?;
            }
            // CHECK: 0 ready, 1 not ready.
            5 => {
                let keys = read_keys(&mut s)?;
                let map = st.map.lock().unwrap();
                let ready = keys.iter().all(|k| map.contains_key(k));
                drop(map);
                s.write_all(&[if ready { 0 } else { 1 }])?;
            }
            // WAIT: STOP_WAITING (0) once every key is set, or WAIT_CANCELED (1) on CANCEL_WAIT.
            6 => {
                let keys = read_keys(&mut s)?;
                wait(&mut s, st, &keys)?;
            }
            // MULTI_GET: one vector per key, no count.
            10 => {
                let keys = read_keys(&mut s)?;
                let map = st.map.lock().unwrap();
                let mut out = Vec::new();
                for k in &keys {
                    out.extend(vec_bytes(map.get(k).ok_or_else(bad)?));
                }
                drop(map);
                s.write_all(&out)?;
            }
            // MULTI_SET: count, then key value pairs.
            11 => {
                let n = u64::from_le_bytes(read_n::<8>(&mut s)?);
                if n > 4096 {
                    return Err(bad());
                }
                let mut pairs = Vec::new();
                for _ in 0..n {
                    pairs.push((read_vec(&mut s)?, read_vec(&mut s)?));
                }
                st.map.lock().unwrap().extend(pairs);
                st.changed.notify_all();
            }
            // CANCEL_WAIT with no wait in progress (the wait ended just before): WAIT_CANCELED.
            12 => s.write_all(&[1])?,
            _ => return Err(bad()),
        }
    }
}

/// A WAIT: polls the map (woken by the condition variable) and the socket (for CANCEL_WAIT).
fn wait(s: &mut &TcpStream, st: &State, keys: &[Vec<u8>]) -> std::io::Result<()> {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        {
            let map = st.map.lock().unwrap();
            if keys.iter().all(|k| map.contains_key(k)) {
                drop(map);
                return s.write_all(&[0]);
            }
            let _ = st
                .changed
                .wait_timeout(map, Duration::from_millis(20))
                .unwrap();
        }
        s.set_read_timeout(Some(Duration::from_millis(1)))?;
        let mut b = [0u8; 1];
        let got = s.read(&mut b);
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        match got {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) if b[0] == 12 => return s.write_all(&[1]),
            Ok(_) => return Err(bad()),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) => return Err(e),
        }
        if Instant::now() > give_up {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
    }
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

/// The test server must answer real torch's client bytes exactly as real torch's server did:
/// replays the transcript's client side and compares every answer.
#[test]
fn test_server_answers_like_torch() {
    let server = TorchServer::start();
    let mut c = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
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
    let server = TorchServer::start();
    let world = 3;
    let results: Vec<Result<Vec<f32>, CommError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let config = torchrun_env(rank, world, server.port, 2);
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
    let server = TorchServer::start();
    let mut config = torchrun_env(1, 2, server.port, 0);
    config.connect_timeout = Duration::from_millis(800);
    let t = Instant::now();
    let err = ProcessGroup::with_config(config).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let msg = err.to_string();
    assert!(
        msg.contains("ddp/job_id") && msg.contains(&format!("127.0.0.1:{}", server.port)),
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
