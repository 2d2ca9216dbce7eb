//! The store of [`super::TorchStoreHost`] and what each request does to it ([`execute`]): its
//! keys, values and queues ([`Data`]), with the one byte budget that bounds the server's memory
//! (the data, and every connection's buffers, which the server thread counts in
//! [`Data::buffers`]), and the answers, as torch's libuv server gives them.
//!
//! # The budget
//!
//! Everything the server holds on behalf of its clients is counted against one budget, in
//! bytes: each key and value with [`ENTRY_OVERHEAD`] (the hash map's entry, the two
//! allocations), each queued value with [`QUEUE_ENTRY_OVERHEAD`], and, through
//! [`Data::buffers`], each connection's input and output buffers (their capacity, not their
//! length: what is allocated), the keys a WAIT waits for and a fixed [`CONNECTION_OVERHEAD`].
//! A quarter of the budget ([`Data::reserve`]) is kept for answers and small requests: data and
//! large requests in progress may use the other three quarters only, so that a store filled by
//! one client, or clients sending huge requests slowly, still leave room for everyone's PINGs,
//! GETs and WAITs. Who would pass the budget is refused (the server closes that connection, or
//! holds an answer back until the others drain theirs), never the server's memory grown.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::rendezvous::torch_store::{
    CHECK_NOT_READY, CHECK_READY, STOP_WAITING, VALIDATION_MAGIC, WAIT_CANCELED,
};
use crate::rendezvous::torch_store_request::Request;

/// Bytes counted for each key of the map besides its key and value: the entry (two `Vec`s,
/// the hash table's control byte and slack) and the two allocations' headers.
pub(crate) const ENTRY_OVERHEAD: usize = 96;
/// Bytes counted for each value in a queue besides the value (its `Vec`, the deque's slot).
pub(crate) const QUEUE_ENTRY_OVERHEAD: usize = 48;
/// Bytes counted for each connection besides its buffers (its state, its peer's name).
pub(crate) const CONNECTION_OVERHEAD: usize = 1024;
/// Bytes counted for each key a WAIT waits for besides the key (the set's entry).
pub(crate) const WAIT_KEY_OVERHEAD: usize = 48;
/// The longest answer to one request.
pub(crate) const MAX_ANSWER_BYTES: usize = 64 << 20;

/// The keys, values and queues of the store, and the byte budget (see the module
/// documentation).
pub(crate) struct Data {
    pub map: HashMap<Vec<u8>, Vec<u8>>,
    /// Non-empty queues only: a queue emptied by its last pop is removed (its key counted no
    /// more), which torch's answers cannot tell from an empty one.
    pub queues: HashMap<Vec<u8>, VecDeque<Vec<u8>>>,
    /// Bytes of the map and the queues, overheads included.
    pub bytes: usize,
    /// Bytes of the connections (their buffers and waits), kept by the server thread.
    pub buffers: usize,
    /// The most bytes of `bytes` and `buffers` together.
    pub budget: usize,
}

impl Data {
    /// An empty store with this budget.
    pub fn new(budget: usize) -> Data {
        Data {
            map: HashMap::new(),
            queues: HashMap::new(),
            bytes: 0,
            buffers: 0,
            budget,
        }
    }

    /// Bytes counted now against the budget.
    pub fn used(&self) -> usize {
        self.bytes.saturating_add(self.buffers)
    }

    /// The part of the budget kept for answers and small requests.
    pub fn reserve(&self) -> usize {
        self.budget / 4
    }

    /// Bytes that data and large requests may hold together.
    pub fn bulk_limit(&self) -> usize {
        self.budget - self.reserve()
    }

    /// Empties the map and the queues.
    pub fn clear(&mut self) {
        self.map.clear();
        self.queues.clear();
        self.bytes = 0;
    }

    /// Whether `key` is set, or has a non-empty queue (what CHECK and WAIT look for).
    fn present(&self, key: &[u8]) -> bool {
        self.map.contains_key(key) || self.queues.contains_key(key)
    }

    /// Makes room for `add` more bytes of data after `remove` are freed, or says why not.
    fn account(&mut self, remove: usize, add: usize) -> Result<(), String> {
        let bytes = self.bytes.saturating_sub(remove).saturating_add(add);
        let used = bytes.saturating_add(self.buffers);
        if add > remove && used > self.bulk_limit() {
            return Err(format!(
                "the store's budget is spent: {bytes} bytes of keys and values and {} of \
                 connections would pass the {} of its {}-byte budget that data may use",
                self.buffers,
                self.bulk_limit(),
                self.budget
            ));
        }
        self.bytes = bytes;
        Ok(())
    }

    fn set(&mut self, key: &[u8], value: Vec<u8>) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| entry_bytes(key, v));
        self.account(old, entry_bytes(key, &value))?;
        self.map.insert(key.to_vec(), value);
        Ok(())
    }

    /// The value of `key` as a signed decimal number (0 when missing), for ADD and BARRIER.
    fn number(&self, key: &[u8], what: &str) -> Result<i64, String> {
        match self.map.get(key) {
            None => Ok(0),
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .ok_or_else(|| {
                    format!(
                        "{what} on key {:?}, whose value is not a number",
                        String::from_utf8_lossy(key)
                    )
                }),
        }
    }
}

/// The bytes a key and its value count.
fn entry_bytes(key: &[u8], value: &[u8]) -> usize {
    ENTRY_OVERHEAD + key.len() + value.len()
}

/// The bytes a queued value counts.
fn queued_bytes(value: &[u8]) -> usize {
    QUEUE_ENTRY_OVERHEAD + value.len()
}

/// The bytes a queue's key counts while the queue is not empty.
fn queue_key_bytes(key: &[u8]) -> usize {
    ENTRY_OVERHEAD + key.len()
}

/// A change of the store that may end other connections' waits.
pub(crate) enum Wake {
    /// These keys were set.
    Set(Vec<Vec<u8>>),
    /// A value was pushed to this key's queue: one waiter of it wakes.
    Pushed(Vec<u8>),
    None,
}

/// Appends a `u64` length and `bytes`.
fn put_vec(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// The most bytes that executing `request` adds to its connection: its answer, and the keys
/// a WAIT may keep. The server checks them against the budget before executing it; an answer
/// beyond [`MAX_ANSWER_BYTES`] is an error (the connection is closed).
pub(crate) fn answer_bytes(data: &Data, request: &Request<'_>) -> Result<usize, String> {
    let value = |k: &[u8]| 8 + data.map.get(k).map_or(0, Vec::len);
    let n = match request {
        Request::Get(k) => value(k),
        Request::CompareSet(k, expected, desired) => {
            8 + value(k).max(expected.len()).max(desired.len())
        }
        Request::MultiGet(keys) => keys.iter().map(|k| value(k)).sum(),
        Request::QueuePop(k) => {
            16 + data
                .queues
                .get(*k)
                .and_then(|q| q.front())
                .map_or(0, Vec::len)
        }
        Request::ListKeys => 8 + data.map.keys().map(|k| 8 + k.len()).sum::<usize>(),
        Request::Wait(keys) => {
            1 + keys
                .iter()
                .map(|k| WAIT_KEY_OVERHEAD + k.len())
                .sum::<usize>()
        }
        Request::Barrier(k, _) => 1 + WAIT_KEY_OVERHEAD + k.len(),
        _ => 8,
    };
    if n > MAX_ANSWER_BYTES {
        return Err(format!(
            "{} would answer {n} bytes (at most {MAX_ANSWER_BYTES})",
            name(request)
        ));
    }
    Ok(n)
}

/// The query's name, for messages.
fn name(request: &Request<'_>) -> &'static str {
    match request {
        Request::MultiGet(_) => "MULTI_GET",
        Request::ListKeys => "LIST_KEYS",
        Request::Wait(_) => "WAIT",
        _ => "a request",
    }
}

/// Executes one request against the store, appending its answer to `out`; an `Err` closes the
/// connection (the module documentation of `torch_store_server.rs` says what each query does).
pub(crate) fn execute(
    data: &mut Data,
    request: &Request<'_>,
    validated: &mut bool,
    waiting: &mut Option<HashSet<Vec<u8>>>,
    out: &mut Vec<u8>,
) -> Result<Wake, String> {
    if !*validated {
        return match request {
            Request::Validate(VALIDATION_MAGIC) => {
                *validated = true;
                Ok(Wake::None)
            }
            Request::Validate(magic) => Err(format!(
                "VALIDATE with {magic:#x}, not PyTorch's {VALIDATION_MAGIC:#x}"
            )),
            other => Err(format!(
                "{other:?} before VALIDATE (not a PyTorch TCPStore client?)"
            )),
        };
    }
    Ok(match request {
        Request::Validate(_) => return Err("a second VALIDATE".into()),
        Request::Ping(nonce) => {
            out.extend_from_slice(&nonce.to_le_bytes());
            Wake::None
        }
        Request::Set(k, v) => {
            data.set(k, v.to_vec())?;
            Wake::Set(vec![k.to_vec()])
        }
        Request::MultiSet(pairs) => {
            for (k, v) in pairs {
                data.set(k, v.to_vec())?;
            }
            Wake::Set(pairs.iter().map(|(k, _)| k.to_vec()).collect())
        }
        Request::Append(k, v) => {
            let mut value = data.map.get(*k).cloned().unwrap_or_default();
            if value.len() + v.len() > crate::wire::MAX_STORE_VALUE_BYTES {
                return Err(format!(
                    "APPEND would make a value of {} bytes (at most {})",
                    value.len() + v.len(),
                    crate::wire::MAX_STORE_VALUE_BYTES
                ));
            }
            value.extend_from_slice(v);
            data.set(k, value)?;
            Wake::Set(vec![k.to_vec()])
        }
        Request::Add(k, delta) => {
            let new = data.number(k, "ADD")?.wrapping_add(*delta);
            data.set(k, new.to_string().into_bytes())?;
            out.extend_from_slice(&new.to_le_bytes());
            Wake::Set(vec![k.to_vec()])
        }
        Request::CompareSet(k, expected, desired) => {
            let (answer, changed) = match data.map.get(*k) {
                None if expected.is_empty() => (desired.to_vec(), true),
                None => (expected.to_vec(), false),
                Some(current) if current.as_slice() == *expected => (desired.to_vec(), true),
                Some(current) => (current.clone(), false),
            };
            put_vec(out, &answer);
            if changed {
                data.set(k, answer)?;
                Wake::Set(vec![k.to_vec()])
            } else {
                Wake::None
            }
        }
        Request::Get(k) => {
            put_vec(out, data.map.get(*k).map_or(&[][..], Vec::as_slice));
            Wake::None
        }
        Request::MultiGet(keys) => {
            for k in keys {
                put_vec(out, data.map.get(*k).map_or(&[][..], Vec::as_slice));
            }
            Wake::None
        }
        Request::Check(keys) => {
            let ready = keys.iter().all(|k| data.present(k));
            out.push(if ready { CHECK_READY } else { CHECK_NOT_READY });
            Wake::None
        }
        Request::Wait(keys) => {
            let missing: HashSet<Vec<u8>> = keys
                .iter()
                .filter(|k| !data.present(k))
                .map(|k| k.to_vec())
                .collect();
            if missing.is_empty() {
                *waiting = None;
                out.push(STOP_WAITING);
            } else {
                *waiting = Some(missing);
            }
            Wake::None
        }
        Request::CancelWait => {
            *waiting = None;
            out.push(WAIT_CANCELED);
            Wake::None
        }
        Request::GetNumKeys => {
            out.extend_from_slice(&(data.map.len() as i64).to_le_bytes());
            Wake::None
        }
        Request::DeleteKey(k) => {
            let deleted = match data.map.remove(*k) {
                Some(v) => {
                    data.bytes = data.bytes.saturating_sub(entry_bytes(k, &v));
                    1i64
                }
                None => 0,
            };
            out.extend_from_slice(&deleted.to_le_bytes());
            Wake::None
        }
        Request::QueuePush(k, v) => {
            let key = if data.queues.contains_key(*k) {
                0
            } else {
                queue_key_bytes(k)
            };
            data.account(0, key + queued_bytes(v))?;
            data.queues
                .entry(k.to_vec())
                .or_default()
                .push_back(v.to_vec());
            Wake::Pushed(k.to_vec())
        }
        Request::QueuePop(k) => {
            let queue = data.queues.get_mut(*k);
            let len = queue.as_ref().map_or(0, |q| q.len());
            out.extend_from_slice(&(len as i64).to_le_bytes());
            if let Some(v) = queue.and_then(VecDeque::pop_front) {
                data.bytes = data.bytes.saturating_sub(queued_bytes(&v));
                put_vec(out, &v);
                if len == 1 {
                    data.queues.remove(*k);
                    data.bytes = data.bytes.saturating_sub(queue_key_bytes(k));
                }
            }
            Wake::None
        }
        Request::QueueLen(k) => {
            let len = data.queues.get(*k).map_or(0, VecDeque::len);
            out.extend_from_slice(&(len as i64).to_le_bytes());
            Wake::None
        }
        Request::ListKeys => {
            out.extend_from_slice(&(data.map.len() as i64).to_le_bytes());
            for k in data.map.keys() {
                put_vec(out, k);
            }
            Wake::None
        }
        Request::Barrier(k, world) => {
            // As torch's server: the counter is set without waking anyone until it reaches
            // the world size; then every earlier caller (waiting on the key) wakes, and this
            // one is answered at once.
            let count = data.number(k, "BARRIER")?.wrapping_add(1);
            data.set(k, count.to_string().into_bytes())?;
            if count >= *world {
                out.push(STOP_WAITING);
                Wake::Set(vec![k.to_vec()])
            } else {
                *waiting = Some(HashSet::from([k.to_vec()]));
                Wake::None
            }
        }
    })
}
