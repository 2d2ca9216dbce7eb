//! Every call of PyTorch's own `TCPStore` client, as torch's own server answered it
//! (`fixtures/torch_store/every_call.txt`, recorded from torch 2.15 by `record_every_call.py`
//! beside it), replayed against ddp-comm's server ([`TorchStoreHost`], what ddprun hosts): the
//! bytes each client connection sent are sent again, in the recorded order across connections,
//! and every answer must be the one torch's server gave (byte for byte; a `LIST_KEYS` answer
//! as a set of keys, since torch's order is its hash map's). No torch is needed here.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use ddp_comm::TorchStoreHost;

const EVERY_CALL: &str = include_str!("fixtures/torch_store/every_call.txt");

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex {s:?}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The keys of a `LIST_KEYS` answer read from `next` (a count, then strings), sorted.
fn keys_of(mut next: impl FnMut(usize) -> Vec<u8>) -> Vec<Vec<u8>> {
    let count = i64::from_le_bytes(next(8).try_into().unwrap());
    assert!((0..100_000).contains(&count), "a count of {count} keys");
    let mut keys: Vec<Vec<u8>> = (0..count)
        .map(|_| {
            let n = u64::from_le_bytes(next(8).try_into().unwrap()) as usize;
            assert!(n <= 8192, "a key of {n} bytes");
            next(n)
        })
        .collect();
    keys.sort();
    keys
}

#[test]
fn every_call_of_torch_s_client_is_answered_as_torch_s_server_answered_it() {
    let server = TorchStoreHost::start(TcpListener::bind("127.0.0.1:0").unwrap()).unwrap();
    let mut conns: HashMap<usize, TcpStream> = HashMap::new();
    let mut step = "";
    let mut steps = Vec::new();
    let mut answers = 0;
    for line in EVERY_CALL.lines().filter(|l| !l.starts_with('#')) {
        if let Some(name) = line.strip_prefix("step ") {
            step = name;
            steps.push(name);
            continue;
        }
        let (tag, h) = line.split_once(' ').unwrap_or((line, ""));
        let digits = tag.find(|ch: char| !ch.is_ascii_digit()).expect(line);
        let (id, kind) = (tag[..digits].parse::<usize>().expect(line), &tag[digits..]);
        let c = conns.entry(id).or_insert_with(|| {
            let s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s
        });
        let mut next = |n: usize| {
            let mut b = vec![0u8; n];
            c.read_exact(&mut b)
                .unwrap_or_else(|e| panic!("step {step:?}, connection {id}: no answer: {e}"));
            b
        };
        match kind {
            ">" => c.write_all(&unhex(h)).unwrap(),
            "<" => {
                let want = unhex(h);
                let got = next(want.len());
                assert_eq!(hex(&got), h, "step {step:?}, connection {id}");
                answers += 1;
            }
            "<keys" => {
                let want = unhex(h);
                let mut at = 0;
                let expected = keys_of(|n| {
                    at += n;
                    want[at - n..at].to_vec()
                });
                assert_eq!(at, want.len(), "the fixture's own LIST_KEYS answer");
                let got = keys_of(&mut next);
                let show = |k: &[Vec<u8>]| -> Vec<String> {
                    k.iter()
                        .map(|k| String::from_utf8_lossy(k).into_owned())
                        .collect()
                };
                assert_eq!(
                    show(&got),
                    show(&expected),
                    "step {step:?}, connection {id}"
                );
                answers += 1;
            }
            "<eof" => {
                let mut b = [0u8; 1];
                let r = c.read(&mut b);
                assert!(
                    matches!(r, Ok(0))
                        || matches!(&r, Err(e) if e.kind() == ErrorKind::ConnectionReset),
                    "step {step:?}, connection {id}: torch's server closed it, ours answered {r:?}"
                );
            }
            _ => panic!("bad fixture line {line:?}"),
        }
    }
    for wanted in [
        "list_keys",
        "barrier of two, second",
        "queue_pop blocking times out",
    ] {
        assert!(steps.contains(&wanted), "no step {wanted:?} in the fixture");
    }
    assert!(answers >= 60, "only {answers} answers in the fixture");
    // And nothing more than torch answered, on any connection.
    for (id, c) in &mut conns {
        c.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut extra = [0u8; 16];
        assert!(
            !matches!(c.read(&mut extra), Ok(n) if n > 0),
            "connection {id}: answer bytes torch's server did not send"
        );
    }
}
