//! A client of PyTorch's `TCPStore` wire protocol (c10d, torch 2.x), so that the ranks can
//! rendezvous through the store that torchrun's elastic agent already hosts.
//!
//! # The protocol
//!
//! Followed from `torch/csrc/distributed/c10d/TCPStore.cpp` (the client),
//! `TCPStoreBackend.hpp` (the query codes), `TCPStoreLibUvBackend.cpp` (the default server since
//! torch 2.4) and `Utils.hpp` (`sendString`/`sendVector`/`sendValue`), and checked byte for byte
//! against torch 2.15: `tests/fixtures/torch_store/transcript.txt` is what a real torch client
//! sent to a real torch server (through a recording proxy, `capture.py` next to it) for a
//! scripted sequence of calls, and the tests of this module replay it against this client.
//! `tests/fixtures/torch_store/every_call.txt` (by `record_every_call.py`) holds every call of
//! torch 2.15's client, `LIST_KEYS` and `BARRIER` included, over several connections; the
//! server's tests replay it (`tests/torch_store_calls.rs`).
//!
//! Every integer is little-endian (torch sends its in-memory values on x86 and ARM). A request is
//! one byte of query type followed by its arguments; a string or byte vector is a `u64` length
//! then the bytes; a list of keys is a `u64` count then the strings. The query types are
//! `VALIDATE 0, SET 1, COMPARE_SET 2, GET 3, ADD 4, CHECK 5, WAIT 6, GETNUMKEYS 7, DELETE_KEY 8,
//! APPEND 9, MULTI_GET 10, MULTI_SET 11, CANCEL_WAIT 12, PING 13, QUEUE_PUSH 14, QUEUE_POP 15,
//! QUEUE_LEN 16, LIST_KEYS 17, BARRIER 18`. The server side is `torch_store_server.rs` (ddprun hosts it).
//!
//! - On connect the client sends `VALIDATE` with the `u32` magic `0x3C85F7CE` (no answer; a
//!   server closes a connection whose first query is anything else), then `PING` with a `u32`
//!   nonce (torch uses its process id); the server echoes the nonce.
//! - `SET key value`: no answer. `ADD key i64`: answers the new value as an `i64` (the value is
//!   stored as its decimal text, so `GET` of a counter gives e.g. `b"5"`).
//! - `CHECK keys`: answers one byte, `0` ready (every key set) or `1` not ready.
//! - `WAIT keys`: answers one byte `0` (STOP_WAITING) once every key is set, which may be never.
//!   The client waits for it up to its timeout; then it sends `CANCEL_WAIT` and the server answers
//!   `1` (WAIT_CANCELED), possibly after a STOP_WAITING that crossed the cancel on the wire.
//! - `GET key`: answers the value as a vector. A server does not wait: a GET of a missing key
//!   closes the connection, so the client always sends `WAIT [key]` first (as torch's does);
//!   `MULTI_GET keys` likewise after a `WAIT keys`, answering one vector per key (no count).
//! - `COMPARE_SET key expected desired`: answers the value after the operation (the desired one
//!   when it applied; an empty `expected` matches a missing key).
//! - `MULTI_SET count key value key value ...`: no answer.
//! - `LIST_KEYS`: answers an `i64` count, then every key of the store as a string (the client's
//!   prefix included, in no fixed order: torch iterates a hash map).
//! - `BARRIER key world_size(i64)`: adds one to the counter `key` (decimal text, as `ADD`) and
//!   answers `0` (STOP_WAITING) once it reaches `world_size`, waking every earlier caller; a
//!   client that gives up sends `CANCEL_WAIT`, as after a `WAIT`.
//!
//! Keys: torch's `TCPStore` puts `/` in front of every key (its `keyPrefix_`), and torch's own
//! workers under torchrun wrap the agent's store in `PrefixStore("/worker/attempt_{restart}")`
//! (`torch.distributed.rendezvous._create_c10d_store`), which joins with another `/`: a worker's
//! key `k` travels as `//worker/attempt_0/k`. [`agent_key_prefix`] makes the same prefix, so our
//! keys sit where a torch worker of the same attempt would put them.
//!
//! Unlike ddp-comm's own store there is no handshake carrying a job id or a token, and no error
//! answer: a server that dislikes a request closes the connection. Every read here has a
//! deadline, every length prefix is checked against [`MAX_STORE_VALUE_BYTES`] before anything is
//! allocated, and any failure leaves the connection out of step, so the caller drops it.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::clock::remaining;
use crate::error::StoreCallError;
use crate::wire::MAX_STORE_VALUE_BYTES;

/// The `u32` that `VALIDATE` carries (`validationMagicNumber` in torch).
pub(crate) const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// How long the client waits for the answer to a `CANCEL_WAIT`.
const CANCEL_MARGIN: Duration = Duration::from_secs(10);

/// The query types of torch's `QueryType` enum (one byte on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Query {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    GetNumKeys = 7,
    DeleteKey = 8,
    Append = 9,
    MultiGet = 10,
    MultiSet = 11,
    CancelWait = 12,
    Ping = 13,
    QueuePush = 14,
    QueuePop = 15,
    QueueLen = 16,
    ListKeys = 17,
    Barrier = 18,
}

impl Query {
    /// The query of a code, `None` for a code torch does not know.
    pub(crate) fn from_code(code: u8) -> Option<Query> {
        const ALL: [Query; 19] = [
            Query::Validate,
            Query::Set,
            Query::CompareSet,
            Query::Get,
            Query::Add,
            Query::Check,
            Query::Wait,
            Query::GetNumKeys,
            Query::DeleteKey,
            Query::Append,
            Query::MultiGet,
            Query::MultiSet,
            Query::CancelWait,
            Query::Ping,
            Query::QueuePush,
            Query::QueuePop,
            Query::QueueLen,
            Query::ListKeys,
            Query::Barrier,
        ];
        ALL.get(code as usize).copied()
    }
}

/// CHECK's answer when every key is set.
pub(crate) const CHECK_READY: u8 = 0;
/// CHECK's answer when some key is missing.
pub(crate) const CHECK_NOT_READY: u8 = 1;
/// WAIT's answer once every key is set.
pub(crate) const STOP_WAITING: u8 = 0;
/// The answer to CANCEL_WAIT.
pub(crate) const WAIT_CANCELED: u8 = 1;

/// The key prefix of torch's workers under torchrun's agent store for restart `restart_count`
/// (`TORCHELASTIC_RESTART_COUNT`): TCPStore's `/`, then `PrefixStore`'s
/// `/worker/attempt_{n}` and its joining `/`.
pub(crate) fn agent_key_prefix(restart_count: u32) -> String {
    format!("//worker/attempt_{restart_count}/")
}

/// The key prefix of a bare torch `TCPStore` client (its `keyPrefix_`).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const TCPSTORE_KEY_PREFIX: &str = "/";

/// One request, built in memory and sent with one write.
struct Request(Vec<u8>);

impl Request {
    fn new(query: Query) -> Request {
        Request(vec![query as u8])
    }

    /// A string or byte vector: `u64` length, then the bytes.
    fn bytes(mut self, b: &[u8]) -> Request {
        self.0.extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }

    /// A list of keys: `u64` count, then each key.
    fn keys(mut self, keys: &[&str]) -> Request {
        self.0.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            self = self.bytes(k.as_bytes());
        }
        self
    }

    fn u32(mut self, v: u32) -> Request {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn i64(mut self, v: i64) -> Request {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
}

/// An open connection to a torch `TCPStore` server, validated and pinged. Keys are given as they
/// travel (the caller adds the prefix).
pub(crate) struct TorchConn {
    stream: TcpStream,
    /// Deadline of an answer that needs no waiting on the server (a dead server is noticed
    /// after this long).
    io_timeout: Duration,
}

impl TorchConn {
    /// Starts the protocol on a connected `stream`: VALIDATE, then PING with `nonce`, whose echo
    /// must come back before `deadline`.
    pub fn start(
        stream: TcpStream,
        nonce: u32,
        io_timeout: Duration,
        deadline: Instant,
    ) -> Result<TorchConn, StoreCallError> {
        let _ = stream.set_nodelay(true);
        let mut conn = TorchConn { stream, io_timeout };
        let mut hello = Request::new(Query::Validate).u32(VALIDATION_MAGIC).0;
        hello.extend(Request::new(Query::Ping).u32(nonce).0);
        conn.send(&hello, deadline)?;
        let mut echo = [0u8; 4];
        conn.read_full(&mut echo, deadline)?;
        let echo = u32::from_le_bytes(echo);
        if echo != nonce {
            return Err(StoreCallError::Protocol(format!(
                "PING {nonce} was answered with {echo}: not a PyTorch TCPStore?"
            )));
        }
        Ok(conn)
    }

    fn io_deadline(&self) -> Instant {
        Instant::now() + self.io_timeout
    }

    /// Writes all of `bytes` before `deadline`.
    fn send(&mut self, bytes: &[u8], deadline: Instant) -> Result<(), StoreCallError> {
        self.stream
            .set_write_timeout(Some(remaining(deadline).max(Duration::from_millis(1))))?;
        self.stream.write_all(bytes)?;
        Ok(())
    }

    /// Fills `buf` before `deadline` (re-arming the socket's timeout before every read, so a
    /// trickle of bytes cannot stretch the deadline).
    fn read_full(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), StoreCallError> {
        let mut got = 0;
        while got < buf.len() {
            let left = remaining(deadline);
            if left.is_zero() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time").into());
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// One byte, or `None` if none came before `deadline` (the connection stays in step).
    fn read_byte_until(&mut self, deadline: Instant) -> Result<Option<u8>, StoreCallError> {
        let mut b = [0u8; 1];
        loop {
            let left = remaining(deadline);
            if left.is_zero() {
                return Ok(None);
            }
            self.stream.set_read_timeout(Some(left))?;
            match self.stream.read(&mut b) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
                Ok(_) => return Ok(Some(b[0])),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::TimedOut => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn read_u64(&mut self, deadline: Instant) -> Result<u64, StoreCallError> {
        let mut b = [0u8; 8];
        self.read_full(&mut b, deadline)?;
        Ok(u64::from_le_bytes(b))
    }

    /// A `u64`-length-prefixed vector, refusing a length above [`MAX_STORE_VALUE_BYTES`] before
    /// allocating.
    fn read_vec(&mut self, deadline: Instant) -> Result<Vec<u8>, StoreCallError> {
        let len = self.read_u64(deadline)?;
        if len > MAX_STORE_VALUE_BYTES as u64 {
            return Err(StoreCallError::Protocol(format!(
                "the server announced a value of {len} bytes (at most {MAX_STORE_VALUE_BYTES})"
            )));
        }
        let mut v = vec![0u8; len as usize];
        self.read_full(&mut v, deadline)?;
        Ok(v)
    }

    /// SET: no answer.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreCallError> {
        let req = Request::new(Query::Set).bytes(key.as_bytes()).bytes(value);
        self.send(&req.0, self.io_deadline())
    }

    /// ADD: the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64, StoreCallError> {
        let deadline = self.io_deadline();
        let req = Request::new(Query::Add).bytes(key.as_bytes()).i64(delta);
        self.send(&req.0, deadline)?;
        Ok(self.read_u64(deadline)? as i64)
    }

    /// CHECK: whether every key is set.
    pub fn check(&mut self, keys: &[&str]) -> Result<bool, StoreCallError> {
        let deadline = self.io_deadline();
        self.send(&Request::new(Query::Check).keys(keys).0, deadline)?;
        let mut b = [0u8; 1];
        self.read_full(&mut b, deadline)?;
        match b[0] {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            other => Err(StoreCallError::Protocol(format!(
                "CHECK was answered with {other} (expected 0 or 1)"
            ))),
        }
    }

    /// WAIT for every key, up to `timeout`.
    ///
    /// The server answers STOP_WAITING once every key is set. If that does not come in time,
    /// the wait is cancelled (CANCEL_WAIT) so that the connection stays in step: the server
    /// answers WAIT_CANCELED, or STOP_WAITING then WAIT_CANCELED if the keys arrived while the
    /// cancel was on its way (then the wait succeeded after all). Only a clean cancel is a
    /// [`StoreCallError::Timeout`]; anything else leaves the connection unusable.
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<(), StoreCallError> {
        let deadline = Instant::now() + timeout;
        self.send(&Request::new(Query::Wait).keys(keys).0, self.io_deadline())?;
        let unexpected = |what: &str, b: u8| {
            StoreCallError::Protocol(format!("{what} was answered with {b} (expected 0 or 1)"))
        };
        match self.read_byte_until(deadline)? {
            Some(STOP_WAITING) => return Ok(()),
            Some(b) => return Err(unexpected("WAIT", b)),
            None => {}
        }
        let cancel_deadline = Instant::now() + CANCEL_MARGIN;
        self.send(&Request::new(Query::CancelWait).0, cancel_deadline)?;
        let mut b = [0u8; 1];
        self.read_full(&mut b, cancel_deadline)?;
        match b[0] {
            WAIT_CANCELED => Err(StoreCallError::Timeout(String::new())),
            STOP_WAITING => {
                self.read_full(&mut b, cancel_deadline)?;
                if b[0] == WAIT_CANCELED {
                    Ok(())
                } else {
                    Err(unexpected("CANCEL_WAIT", b[0]))
                }
            }
            other => Err(unexpected("CANCEL_WAIT", other)),
        }
    }

    /// GET, after waiting up to `timeout` for the key (a torch server does not wait itself).
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreCallError> {
        self.wait(&[key], timeout)?;
        let deadline = self.io_deadline();
        self.send(&Request::new(Query::Get).bytes(key.as_bytes()).0, deadline)?;
        self.read_vec(deadline)
    }

    /// COMPARE_SET: sets `key` to `desired` if its value is `expected` (an empty `expected`
    /// matches a missing key); answers the value after the operation.
    pub fn compare_set(
        &mut self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreCallError> {
        let deadline = self.io_deadline();
        let req = Request::new(Query::CompareSet)
            .bytes(key.as_bytes())
            .bytes(expected)
            .bytes(desired);
        self.send(&req.0, deadline)?;
        self.read_vec(deadline)
    }

    /// MULTI_SET: no answer.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn multi_set(&mut self, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreCallError> {
        if keys.len() != values.len() {
            return Err(StoreCallError::Refused(format!(
                "MULTI_SET of {} keys with {} values",
                keys.len(),
                values.len()
            )));
        }
        let mut req = Request::new(Query::MultiSet);
        req.0.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for (k, v) in keys.iter().zip(values) {
            req = req.bytes(k.as_bytes()).bytes(v);
        }
        self.send(&req.0, self.io_deadline())
    }

    /// MULTI_GET, after waiting up to `timeout` for every key: one value per key.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn multi_get(
        &mut self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, StoreCallError> {
        self.wait(keys, timeout)?;
        let deadline = self.io_deadline();
        self.send(&Request::new(Query::MultiGet).keys(keys).0, deadline)?;
        keys.iter().map(|_| self.read_vec(deadline)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const TRANSCRIPT: &str = include_str!("../../tests/fixtures/torch_store/transcript.txt");

    /// One event of the transcript: bytes the client sent (`>`) or the server answered (`<`).
    #[derive(Debug, Clone)]
    enum Event {
        Step(String),
        ToServer(Vec<u8>),
        ToClient(Vec<u8>),
    }

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

    fn transcript() -> Vec<Event> {
        TRANSCRIPT
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| match l.split_once(' ') {
                Some(("step", name)) => Event::Step(name.to_string()),
                Some((">", h)) => Event::ToServer(unhex(h)),
                Some(("<", h)) => Event::ToClient(unhex(h)),
                _ => panic!("bad transcript line {l:?}"),
            })
            .collect()
    }

    /// A fake torch server that replays `events`: it reads exactly the recorded client bytes and
    /// compares them, then writes the recorded answer. Returns the first mismatch, if any.
    fn replay_server(events: Vec<Event>) -> (u16, std::thread::JoinHandle<Result<(), String>>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let h = std::thread::spawn(move || {
            let (mut s, _) = l.accept().map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut step = String::new();
            for e in events {
                match e {
                    Event::Step(name) => step = name,
                    Event::ToServer(want) => {
                        let mut got = vec![0u8; want.len()];
                        s.read_exact(&mut got).map_err(|e| {
                            format!(
                                "step {step:?}: expected {} from the client: {e}",
                                hex(&want)
                            )
                        })?;
                        if got != want {
                            return Err(format!(
                                "step {step:?}: client sent {}, torch sends {}",
                                hex(&got),
                                hex(&want)
                            ));
                        }
                    }
                    Event::ToClient(b) => s.write_all(&b).map_err(|e| e.to_string())?,
                }
            }
            // Nothing more may come: the client sent exactly what torch sent.
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let mut extra = [0u8; 64];
            match s.read(&mut extra) {
                Ok(n) if n > 0 => Err(format!("extra bytes {}", hex(&extra[..n]))),
                _ => Ok(()),
            }
        });
        (port, h)
    }

    fn nonce_of(events: &[Event]) -> u32 {
        // The connect step's first client bytes: VALIDATE, magic, PING, nonce.
        let first = events
            .iter()
            .find_map(|e| match e {
                Event::ToServer(b) => Some(b.clone()),
                _ => None,
            })
            .unwrap();
        assert_eq!(first.len(), 10, "{}", hex(&first));
        u32::from_le_bytes(first[6..10].try_into().unwrap())
    }

    /// Our client, call for call, against the bytes real torch 2.15 exchanged: a wrong byte
    /// (or a missing or extra one) fails.
    #[test]
    fn client_matches_the_torch_transcript() {
        let events = transcript();
        let nonce = nonce_of(&events);
        let steps: Vec<String> = events
            .iter()
            .filter_map(|e| match e {
                Event::Step(n) => Some(n.clone()),
                _ => None,
            })
            .collect();
        let (port, server) = replay_server(events);
        let k = |key: &str| format!("{TCPSTORE_KEY_PREFIX}{key}");
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let io = Duration::from_secs(10);
        let mut c = None;
        let short = Duration::from_millis(300);
        for step in &steps {
            if step == "connect" {
                c = Some(
                    TorchConn::start(stream.try_clone().unwrap(), nonce, io, deadline).unwrap(),
                );
                continue;
            }
            let c = c.as_mut().expect("connect comes first");
            let r: Result<(), StoreCallError> = (|| {
                match step.as_str() {
                    "set key0 value0" => c.set(&k("key0"), b"value0")?,
                    "get key0" => assert_eq!(c.get(&k("key0"), io)?, b"value0"),
                    "add counter 5" => assert_eq!(c.add(&k("counter"), 5)?, 5),
                    "add counter -7" => assert_eq!(c.add(&k("counter"), -7)?, -2),
                    "check key0" => assert!(c.check(&[&k("key0")])?),
                    "check key0 missing" => assert!(!c.check(&[&k("key0"), &k("missing")])?),
                    "wait key0 counter" => c.wait(&[&k("key0"), &k("counter")], io)?,
                    "compare_set cas '' first" => {
                        assert_eq!(c.compare_set(&k("cas"), b"", b"first")?, b"first")
                    }
                    "compare_set cas first second" => {
                        assert_eq!(c.compare_set(&k("cas"), b"first", b"second")?, b"second")
                    }
                    "compare_set cas wrong third" => {
                        assert_eq!(c.compare_set(&k("cas"), b"wrong", b"third")?, b"second")
                    }
                    "multi_set m1 m2" => c.multi_set(&[&k("m1"), &k("m2")], &[b"a", b"bc"])?,
                    "multi_get m1 m2" => assert_eq!(
                        c.multi_get(&[&k("m1"), &k("m2")], io)?,
                        vec![b"a".to_vec(), b"bc".to_vec()]
                    ),
                    "wait never 300ms timeout" => {
                        let t = Instant::now();
                        let e = c.wait(&[&k("never")], short);
                        assert!(matches!(e, Err(StoreCallError::Timeout(_))), "{e:?}");
                        assert!(t.elapsed() >= short);
                    }
                    "get never 300ms timeout" => {
                        let e = c.get(&k("never"), short);
                        assert!(matches!(e, Err(StoreCallError::Timeout(_))), "{e:?}");
                    }
                    "set after 01ff" => c.set(&k("after"), &[0, 1, 255])?,
                    "get after" => assert_eq!(c.get(&k("after"), io)?, [0, 1, 255]),
                    "prefix set ddp/job_id" => {
                        c.set(&format!("{}ddp/job_id", agent_key_prefix(0)), b"0123")?
                    }
                    "prefix get ddp/job_id" => assert_eq!(
                        c.get(&format!("{}ddp/job_id", agent_key_prefix(0)), io)?,
                        b"0123"
                    ),
                    "end" => {}
                    other => panic!("the transcript has a step this test does not know: {other}"),
                }
                Ok(())
            })();
            if let Err(e) = r {
                // The server's verdict explains a client error better (it saw the bytes).
                drop(stream);
                let verdict = server.join().unwrap();
                panic!("step {step:?}: {e} (server: {verdict:?})");
            }
        }
        drop(c);
        stream.shutdown(std::net::Shutdown::Both).unwrap();
        server.join().unwrap().unwrap();
    }

    /// A one-shot server that answers the handshake correctly, then `reply` to whatever comes.
    fn scripted(reply: Vec<u8>, echo_ping: bool) -> u16 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut hello = [0u8; 10];
            if s.read_exact(&mut hello).is_err() {
                return;
            }
            if echo_ping {
                let _ = s.write_all(&hello[6..10]);
            } else {
                let _ = s.write_all(&[9, 9, 9, 9]);
            }
            let _ = s.write_all(&reply);
            let mut sink = [0u8; 256];
            while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
        });
        port
    }

    fn conn(port: u16) -> Result<TorchConn, StoreCallError> {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let d = Instant::now() + Duration::from_secs(5);
        TorchConn::start(s, 42, Duration::from_millis(500), d)
    }

    #[test]
    fn bad_server_bytes_are_errors_not_panics_or_huge_allocations() {
        // A value length of 2^63: refused before allocating.
        let mut huge = vec![STOP_WAITING];
        huge.extend_from_slice(&(1u64 << 63).to_le_bytes());
        let mut c = conn(scripted(huge, true)).unwrap();
        let e = c.get("/k", Duration::from_secs(1)).unwrap_err();
        assert!(
            matches!(&e, StoreCallError::Protocol(m) if m.contains("bytes")),
            "{e:?}"
        );

        // CHECK answered with neither 0 nor 1.
        let mut c = conn(scripted(vec![7], true)).unwrap();
        let e = c.check(&["/k"]).unwrap_err();
        assert!(
            matches!(&e, StoreCallError::Protocol(m) if m.contains("CHECK")),
            "{e:?}"
        );

        // A wrong PING echo: not a torch store.
        let e = conn(scripted(vec![], false)).err().unwrap();
        assert!(
            matches!(&e, StoreCallError::Protocol(m) if m.contains("PING")),
            "{e:?}"
        );

        // A server that never answers: the io deadline, not a hang.
        let mut c = conn(scripted(vec![], true)).unwrap();
        let t = Instant::now();
        let e = c.add("/n", 1).unwrap_err();
        assert!(matches!(&e, StoreCallError::Io(_)), "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn agent_prefix_matches_torch_workers() {
        assert_eq!(agent_key_prefix(3), "//worker/attempt_3/");
    }
}
