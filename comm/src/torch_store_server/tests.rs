//! Unit tests of `torch_store_server.rs` over real sockets: the queries torch's server answers,
//! waits across connections, and bad clients (garbage, oversized requests, silence, a full
//! store), which must be closed without a panic while the others are served. The transcript of
//! a real torch client and server is replayed against this server in `tests/torch_store.rs`.

use super::*;
use crate::torch_store::{Query, CHECK_NOT_READY, CHECK_READY, VALIDATION_MAGIC, WAIT_CANCELED};
use std::net::Shutdown;
use std::os::fd::AsRawFd;

/// A connection speaking the protocol by hand, every read with a deadline.
struct Client(TcpStream);

impl Client {
    fn connect(port: u16) -> Client {
        let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Client(s)
    }

    /// Connects and validates.
    fn valid(port: u16) -> Client {
        let mut c = Client::connect(port);
        c.send(&req(Query::Validate).u32(VALIDATION_MAGIC).0);
        c
    }

    fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).unwrap();
    }

    fn read(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }

    fn i64(&mut self) -> i64 {
        i64::from_le_bytes(self.read(8).try_into().unwrap())
    }

    fn vec(&mut self) -> Vec<u8> {
        let n = self.i64() as usize;
        self.read(n)
    }

    /// Whether the server closed the connection (end of stream within 5 s).
    fn closed(&mut self) -> bool {
        self.0
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 1];
        match self.0.read(&mut b) {
            Ok(0) => true,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    }

    /// Whether nothing arrives within `d`.
    fn silent_for(&mut self, d: Duration) -> bool {
        self.0.set_read_timeout(Some(d)).unwrap();
        let mut b = [0u8; 1];
        let r = self.0.read(&mut b);
        self.0
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        matches!(r, Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut)
    }
}

/// A request under construction.
struct Req(Vec<u8>);

fn req(q: Query) -> Req {
    Req(vec![q as u8])
}

impl Req {
    fn u32(mut self, v: u32) -> Req {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(mut self, v: u64) -> Req {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn b(mut self, b: &[u8]) -> Req {
        self.0.extend((b.len() as u64).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn keys(mut self, keys: &[&[u8]]) -> Req {
        self.0.extend((keys.len() as u64).to_le_bytes());
        for k in keys {
            self = self.b(k);
        }
        self
    }
}

fn host(limits: Limits) -> TorchStoreHost {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    TorchStoreHost::start_with(l, limits).unwrap()
}

#[test]
fn every_query_is_answered_as_torch_answers_it() {
    let h = host(Limits::default());
    let mut c = Client::valid(h.port());
    c.send(&req(Query::Ping).u32(77).0);
    assert_eq!(c.read(4), 77u32.to_le_bytes());
    c.send(&req(Query::Set).b(b"a").b(b"1").0);
    c.send(&req(Query::Append).b(b"a").b(b"23").0);
    c.send(&req(Query::Append).b(b"new").b(b"x").0);
    c.send(&req(Query::Get).b(b"a").0);
    assert_eq!(c.vec(), b"123");
    c.send(&req(Query::Get).b(b"missing").0);
    assert_eq!(
        c.vec(),
        b"",
        "a missing key is an empty value, as in torch's libuv server"
    );
    c.send(&req(Query::Add).b(b"a").u64(-124i64 as u64).0);
    assert_eq!(c.i64(), -1);
    c.send(&req(Query::GetNumKeys).0);
    assert_eq!(c.i64(), 2);
    c.send(&req(Query::DeleteKey).b(b"new").0);
    assert_eq!(c.i64(), 1);
    c.send(&req(Query::DeleteKey).b(b"new").0);
    assert_eq!(c.i64(), 0);
    c.send(
        &req(Query::MultiSet)
            .u64(2)
            .b(b"m1")
            .b(b"x")
            .b(b"m2")
            .b(b"")
            .0,
    );
    c.send(&req(Query::MultiGet).keys(&[b"m2", b"m1", b"a"]).0);
    assert_eq!(
        (c.vec(), c.vec(), c.vec()),
        (vec![], b"x".to_vec(), b"-1".to_vec())
    );
    c.send(&req(Query::Check).keys(&[b"m1", b"a"]).0);
    assert_eq!(c.read(1), [CHECK_READY]);
    c.send(&req(Query::Check).keys(&[b"m1", b"q"]).0);
    assert_eq!(c.read(1), [CHECK_NOT_READY]);
    // Queues: a non-empty queue counts for CHECK; POP answers the length, then the value.
    c.send(&req(Query::QueuePush).b(b"q").b(b"v1").0);
    c.send(&req(Query::QueuePush).b(b"q").b(b"v2").0);
    c.send(&req(Query::Check).keys(&[b"q"]).0);
    assert_eq!(c.read(1), [CHECK_READY]);
    c.send(&req(Query::QueueLen).b(b"q").0);
    assert_eq!(c.i64(), 2);
    c.send(&req(Query::QueuePop).b(b"q").0);
    assert_eq!((c.i64(), c.vec()), (2, b"v1".to_vec()));
    c.send(&req(Query::QueuePop).b(b"q").0);
    assert_eq!((c.i64(), c.vec()), (1, b"v2".to_vec()));
    c.send(&req(Query::QueuePop).b(b"q").0);
    assert_eq!(c.i64(), 0, "an empty queue answers its length only");
    // COMPARE_SET, as torch's server does it.
    c.send(&req(Query::CompareSet).b(b"cas").b(b"").b(b"one").0);
    assert_eq!(c.vec(), b"one");
    c.send(&req(Query::CompareSet).b(b"cas").b(b"nope").b(b"two").0);
    assert_eq!(c.vec(), b"one");
    c.send(&req(Query::CompareSet).b(b"absent").b(b"exp").b(b"two").0);
    assert_eq!(c.vec(), b"exp");
    c.send(&req(Query::Check).keys(&[b"absent"]).0);
    assert_eq!(c.read(1), [CHECK_NOT_READY]);
    // CANCEL_WAIT while not waiting: WAIT_CANCELED all the same.
    c.send(&req(Query::CancelWait).0);
    assert_eq!(c.read(1), [WAIT_CANCELED]);
    assert!(
        c.silent_for(Duration::from_millis(100)),
        "one answer per query"
    );
    assert_eq!(h.keys(), ["a", "cas", "m1", "m2"]);
}

#[test]
fn a_wait_ends_when_another_connection_sets_the_last_key() {
    let h = host(Limits::default());
    let mut waiter = Client::valid(h.port());
    let mut setter = Client::valid(h.port());
    waiter.send(&req(Query::Wait).keys(&[b"x", b"y"]).0);
    setter.send(&req(Query::Set).b(b"x").b(b"1").0);
    assert!(
        waiter.silent_for(Duration::from_millis(200)),
        "y is missing"
    );
    setter.send(&req(Query::Add).b(b"y").u64(1).0);
    assert_eq!(setter.i64(), 1);
    assert_eq!(waiter.read(1), [STOP_WAITING]);
    // A wait for keys already there ends at once; a cancelled one answers WAIT_CANCELED once.
    waiter.send(&req(Query::Wait).keys(&[b"x"]).0);
    assert_eq!(waiter.read(1), [STOP_WAITING]);
    waiter.send(&req(Query::Wait).keys(&[b"never"]).0);
    assert!(waiter.silent_for(Duration::from_millis(200)));
    waiter.send(&req(Query::CancelWait).0);
    assert_eq!(waiter.read(1), [WAIT_CANCELED]);
    setter.send(&req(Query::Set).b(b"never").b(b"").0);
    assert!(
        waiter.silent_for(Duration::from_millis(200)),
        "a cancelled wait is not woken"
    );
    // A queue push wakes one waiter of its key, not both. (A PING on each waiting connection
    // is answered once its WAIT is registered: a connection's requests run in order.)
    let mut other = Client::valid(h.port());
    for c in [&mut waiter, &mut other] {
        c.send(&req(Query::Wait).keys(&[b"jobs"]).0);
        c.send(&req(Query::Ping).u32(2).0);
        assert_eq!(c.read(4), 2u32.to_le_bytes(), "the wait is registered");
    }
    setter.send(&req(Query::QueuePush).b(b"jobs").b(b"j").0);
    let first = !waiter.silent_for(Duration::from_millis(300));
    let second = !other.silent_for(Duration::from_millis(300));
    assert!(first ^ second, "one waiter woke: {first} {second}");
}

#[test]
fn bad_clients_are_closed_and_the_others_served() {
    let h = host(Limits::default());
    let port = h.port();
    let mut good = Client::valid(port);
    // Anything but VALIDATE first; a wrong magic; an unknown query; a huge length; a second
    // VALIDATE; ADD to text: each closes its own connection only.
    let cases: Vec<Vec<u8>> = vec![
        req(Query::Ping).u32(1).0,
        req(Query::Validate).u32(1234).0,
        [req(Query::Validate).u32(VALIDATION_MAGIC).0, vec![200]].concat(),
        [
            req(Query::Validate).u32(VALIDATION_MAGIC).0,
            req(Query::Set).u64(u64::MAX).0,
        ]
        .concat(),
        [
            req(Query::Validate).u32(VALIDATION_MAGIC).0,
            req(Query::Validate).u32(VALIDATION_MAGIC).0,
        ]
        .concat(),
        [
            req(Query::Validate).u32(VALIDATION_MAGIC).0,
            req(Query::Set).b(b"t").b(b"text").0,
            req(Query::Add).b(b"t").u64(1).0,
        ]
        .concat(),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
    ];
    for (i, bytes) in cases.iter().enumerate() {
        let mut bad = Client::connect(port);
        bad.send(bytes);
        assert!(bad.closed(), "case {i} was not closed");
        good.send(&req(Query::Ping).u32(i as u32).0);
        assert_eq!(good.read(4), (i as u32).to_le_bytes(), "case {i}");
    }
    // Half a request, then the client leaves: nothing left behind.
    let mut half = Client::valid(port);
    half.send(&req(Query::Set).b(b"k").0);
    half.0.shutdown(Shutdown::Both).unwrap();
    good.send(&req(Query::GetNumKeys).0);
    assert_eq!(good.i64(), 1, "only case 5's text key: {:?}", h.keys());
}

#[test]
fn deadlines_and_the_store_s_size_close_connections() {
    let limits = Limits {
        budget: 1 << 20,
        first_query: Duration::from_millis(300),
        request: Duration::from_millis(300),
        write: Duration::from_millis(300),
        idle: Duration::from_secs(60),
    };
    let h = host(limits);
    let port = h.port();
    // Silence after connecting.
    let t = Instant::now();
    let mut silent = Client::connect(port);
    assert!(silent.closed());
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t.elapsed()
    );
    // A request begun and never finished.
    let mut slow = Client::valid(port);
    slow.send(&req(Query::Set).b(b"k").u64(10).0);
    assert!(slow.closed());
    // Values beyond the part of the budget data may use (3/4 of 1 MiB): the connection that
    // sends them is closed, nothing kept.
    let mut big = Client::valid(port);
    big.send(&req(Query::Set).b(b"k").b(&[7u8; 300 << 10]).0);
    big.send(&req(Query::Ping).u32(1).0);
    assert_eq!(big.read(4), 1u32.to_le_bytes());
    big.send(&req(Query::Set).b(b"j").b(&[7u8; 300 << 10]).0);
    assert!(big.closed());
    assert_eq!(h.keys(), ["k"]);
    let mut small = Client::valid(port);
    small.send(&req(Query::Set).b(b"s").b(&[1u8; 1000]).0);
    drop(small);
    // A client that asks and never reads: its answers pile up, it is closed, no more memory.
    let mut greedy = Client::valid(port);
    let mut burst = Vec::new();
    for _ in 0..2000 {
        burst.extend(req(Query::MultiGet).keys(&[b"s", b"s", b"s", b"s"]).0);
    }
    // Each burst asks for 50 times its size in answers; a server that read on would write
    // on until the client's buffers are full, then wait: it must instead close the client.
    let writer = std::thread::spawn(move || {
        let _ = greedy.0.set_write_timeout(Some(Duration::from_secs(10)));
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(20) {
            if let Err(e) = greedy.0.write_all(&burst) {
                return Some(e.kind());
            }
        }
        None
    });
    // Closed by the server (its write deadline), not ended by the client's own write timeout.
    let ended = writer.join().unwrap();
    assert!(
        matches!(
            ended,
            Some(io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset)
        ),
        "the server did not close a client that reads nothing: {ended:?}"
    );
    let mut after = Client::valid(port);
    after.send(&req(Query::Ping).u32(5).0);
    assert_eq!(after.read(4), 5u32.to_le_bytes());
}

/// Sets small socket buffers on `fd`, so that what the kernel holds in flight is small.
fn small_buffers(fd: i32) {
    let size: libc::c_int = 64 << 10;
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: setsockopt reads `size` (a c_int, of the length given) on a socket we own.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
    }
}

/// A client that sends requests and reads no answers: once its unread answers pass the high
/// water mark the server reads no more from it (so they cannot grow without bound), and reads
/// again once the client takes them.
#[test]
fn unread_answers_stop_the_reading_until_they_are_taken() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    small_buffers(listener.as_raw_fd());
    let h = TorchStoreHost::start_with(listener, Limits::default()).unwrap();
    let mut c = Client::valid(h.port());
    small_buffers(c.0.as_raw_fd());
    c.send(&req(Query::Set).b(b"k").b(b"v").0);
    // GET k: 18 bytes asked, 9 answered.
    let burst: Vec<u8> = (0..10_000)
        .flat_map(|_| req(Query::Get).b(b"k").0)
        .collect();
    c.0.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
    let mut written = 0usize;
    // Where the next write starts in the burst: a write cut short (the timeout after part of
    // it went out) goes on from there, so that the server never sees half a request followed
    // by a whole one (which it would rightly refuse, closing the connection).
    let mut at = 0usize;
    let limit = 32 << 20;
    while written < limit {
        match c.0.write(&burst[at..]) {
            Ok(n) => {
                written += n;
                at = (at + n) % burst.len();
            }
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut =>
            {
                break
            }
            Err(e) => panic!("the server closed the connection: {e}"),
        }
    }
    assert!(
        written < limit,
        "the server read {written} bytes of requests whose answers nobody reads"
    );
    // Taking the answers lets the server read on.
    let mut answers = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    while answers < 4 << 20 {
        let n = c.0.read(&mut buf).unwrap();
        assert!(n > 0);
        answers += n;
    }
    c.0.write_all(&burst[at..]).unwrap();
    c.0.write_all(&burst).unwrap();
}

#[test]
fn dropping_the_host_closes_its_connections_and_port() {
    let h = host(Limits::default());
    let port = h.port();
    let mut c = Client::valid(port);
    c.send(&req(Query::Wait).keys(&[b"never"]).0);
    let t = Instant::now();
    drop(h);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert!(c.closed());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn a_clear_empties_the_store_and_closes_the_old_connections() {
    let h = host(Limits::default());
    let mut old = Client::valid(h.port());
    old.send(&req(Query::Set).b(b"addr/0").b(b"old").0);
    old.send(&req(Query::QueuePush).b(b"q").b(b"x").0);
    old.send(&req(Query::Ping).u32(1).0);
    assert_eq!(old.read(4), 1u32.to_le_bytes());
    h.clear().unwrap();
    assert!(old.closed(), "a connection of before the clear is closed");
    assert!(h.keys().is_empty(), "{:?}", h.keys());
    let mut new = Client::valid(h.port());
    new.send(&req(Query::Check).keys(&[b"addr/0"]).0);
    assert_eq!(new.read(1), [CHECK_NOT_READY]);
    new.send(&req(Query::QueueLen).b(b"q").0);
    assert_eq!(new.i64(), 0);
    new.send(&req(Query::Set).b(b"addr/0").b(b"new").0);
    new.send(&req(Query::Get).b(b"addr/0").0);
    assert_eq!(new.vec(), b"new");
}
