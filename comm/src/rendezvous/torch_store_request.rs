//! The requests of PyTorch's `TCPStore` protocol as its server reads them ([`parse`]): one query
//! byte and its arguments, taken from the front of a connection's input buffer, for the server
//! of `torch_store_server.rs`. The wire format is described in `torch_store.rs`.
//!
//! Bytes arrive in pieces, so a request may be incomplete: [`parse`] then says how many bytes
//! it needs at least ([`Parsed::Need`]), and the server does not try again before it has them
//! (a request is never copied before it is whole). Every length and count is checked before
//! anything is read or allocated: a key of at most [`MAX_KEY_BYTES`] (torch's
//! `MAX_STRING_LEN`), a value of at most [`MAX_STORE_VALUE_BYTES`], at most [`MAX_KEYS`] keys
//! in one request (torch's `MAX_KEY_COUNT`), and [`MAX_REQUEST_BYTES`] in all. A request out of
//! these bounds, or an unknown query byte, is [`Parsed::Bad`] with the reason; the server then
//! closes the connection, as torch's does.

use crate::rendezvous::torch_store::Query;
use crate::wire::MAX_STORE_VALUE_BYTES;

/// The longest key (torch's `MAX_STRING_LEN`).
pub(crate) const MAX_KEY_BYTES: usize = 8 * 1024;
/// The most keys in one request (torch's `MAX_KEY_COUNT`).
pub(crate) const MAX_KEYS: usize = 128 * 1024;
/// The longest request, keys and values together.
pub(crate) const MAX_REQUEST_BYTES: usize = 64 << 20;

/// One request, borrowing its keys and values from the input buffer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Request<'a> {
    Validate(u32),
    Ping(u32),
    Set(&'a [u8], &'a [u8]),
    CompareSet(&'a [u8], &'a [u8], &'a [u8]),
    Get(&'a [u8]),
    Add(&'a [u8], i64),
    Check(Vec<&'a [u8]>),
    Wait(Vec<&'a [u8]>),
    GetNumKeys,
    DeleteKey(&'a [u8]),
    Append(&'a [u8], &'a [u8]),
    MultiGet(Vec<&'a [u8]>),
    MultiSet(Vec<(&'a [u8], &'a [u8])>),
    CancelWait,
    QueuePush(&'a [u8], &'a [u8]),
    QueuePop(&'a [u8]),
    QueueLen(&'a [u8]),
    ListKeys,
    Barrier(&'a [u8], i64),
}

/// What the front of an input buffer holds.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Parsed<'a> {
    /// A whole request, and its length in bytes.
    Done(Request<'a>, usize),
    /// The start of one: it needs at least this many bytes in all.
    Need(usize),
    /// Not a request of the protocol, or out of bounds.
    Bad(String),
}

/// Why a request could not be read yet, or at all.
enum Short {
    Need(usize),
    Bad(String),
}

/// A reading position in the input buffer.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// The next `n` bytes.
    fn take(&mut self, n: usize) -> Result<&'a [u8], Short> {
        let end = self.pos.saturating_add(n);
        if end > MAX_REQUEST_BYTES {
            return Err(Short::Bad(format!(
                "a request of more than {MAX_REQUEST_BYTES} bytes"
            )));
        }
        if end > self.buf.len() {
            return Err(Short::Need(end));
        }
        let b = &self.buf[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, Short> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, Short> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A `u64` length, at most `max`, then that many bytes.
    fn bytes(&mut self, max: usize, what: &str) -> Result<&'a [u8], Short> {
        let n = self.u64()?;
        if n > max as u64 {
            return Err(Short::Bad(format!("a {what} of {n} bytes (at most {max})")));
        }
        self.take(n as usize)
    }

    fn key(&mut self) -> Result<&'a [u8], Short> {
        self.bytes(MAX_KEY_BYTES, "key")
    }

    fn value(&mut self) -> Result<&'a [u8], Short> {
        self.bytes(MAX_STORE_VALUE_BYTES, "value")
    }

    /// A `u64` count of at most [`MAX_KEYS`].
    fn count(&mut self) -> Result<usize, Short> {
        let n = self.u64()?;
        if n > MAX_KEYS as u64 {
            return Err(Short::Bad(format!(
                "{n} keys in one request (at most {MAX_KEYS})"
            )));
        }
        Ok(n as usize)
    }

    /// A count, then that many keys.
    fn keys(&mut self) -> Result<Vec<&'a [u8]>, Short> {
        let n = self.count()?;
        // Grown as keys arrive, not reserved from the count: a count alone allocates nothing.
        let mut keys = Vec::new();
        for _ in 0..n {
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

/// The request at the front of `buf` (see the module documentation).
pub(crate) fn parse(buf: &[u8]) -> Parsed<'_> {
    let mut c = Cursor { buf, pos: 0 };
    match request(&mut c) {
        Ok(r) => Parsed::Done(r, c.pos),
        Err(Short::Need(n)) => Parsed::Need(n),
        Err(Short::Bad(why)) => Parsed::Bad(why),
    }
}

fn request<'a>(c: &mut Cursor<'a>) -> Result<Request<'a>, Short> {
    let [code] = c.array::<1>()?;
    let query = Query::from_code(code)
        .ok_or_else(|| Short::Bad(format!("an unknown query type {code}")))?;
    Ok(match query {
        Query::Validate => Request::Validate(c.u32()?),
        Query::Ping => Request::Ping(c.u32()?),
        Query::Set => Request::Set(c.key()?, c.value()?),
        Query::CompareSet => Request::CompareSet(c.key()?, c.value()?, c.value()?),
        Query::Get => Request::Get(c.key()?),
        Query::Add => Request::Add(c.key()?, c.u64()? as i64),
        Query::Check => Request::Check(c.keys()?),
        Query::Wait => Request::Wait(c.keys()?),
        Query::GetNumKeys => Request::GetNumKeys,
        Query::DeleteKey => Request::DeleteKey(c.key()?),
        Query::Append => Request::Append(c.key()?, c.value()?),
        Query::MultiGet => Request::MultiGet(c.keys()?),
        Query::MultiSet => {
            let n = c.count()?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((c.key()?, c.value()?));
            }
            Request::MultiSet(pairs)
        }
        Query::CancelWait => Request::CancelWait,
        Query::QueuePush => Request::QueuePush(c.key()?, c.value()?),
        Query::QueuePop => Request::QueuePop(c.key()?),
        Query::QueueLen => Request::QueueLen(c.key()?),
        Query::ListKeys => Request::ListKeys,
        Query::Barrier => Request::Barrier(c.key()?, c.u64()? as i64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vec_of(b: &[u8]) -> Vec<u8> {
        let mut v = (b.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(b);
        v
    }

    #[test]
    fn a_request_is_read_whole_or_says_what_it_needs() {
        let mut set = vec![Query::Set as u8];
        set.extend(vec_of(b"/k"));
        set.extend(vec_of(b"value"));
        set.push(Query::GetNumKeys as u8);
        assert_eq!(
            parse(&set),
            Parsed::Done(Request::Set(b"/k", b"value"), set.len() - 1)
        );
        // Every prefix is incomplete, and says a length it does not yet have.
        let whole = set.len() - 1;
        for cut in 0..whole {
            match parse(&set[..cut]) {
                Parsed::Need(n) => assert!(n > cut && n <= whole, "{cut}: {n}"),
                other => panic!("{cut}: {other:?}"),
            }
        }
    }

    #[test]
    fn bounds_and_unknown_queries_are_refused_before_allocating() {
        let bad = |buf: &[u8], what: &str| match parse(buf) {
            Parsed::Bad(why) => assert!(why.contains(what), "{why}"),
            other => panic!("{other:?}"),
        };
        bad(&[99], "unknown query type 99");
        let mut huge_key = vec![Query::Get as u8];
        huge_key.extend((1u64 << 62).to_le_bytes());
        bad(&huge_key, "key of 4611686018427387904 bytes");
        let mut huge_value = vec![Query::Set as u8];
        huge_value.extend(vec_of(b"k"));
        huge_value.extend(u64::MAX.to_le_bytes());
        bad(&huge_value, "value of");
        let mut many = vec![Query::Wait as u8];
        many.extend((MAX_KEYS as u64 + 1).to_le_bytes());
        bad(&many, "keys in one request");
        // Many keys that fit one by one but not together.
        let mut wide = vec![Query::Check as u8];
        wide.extend((MAX_KEYS as u64).to_le_bytes());
        let key = vec_of(&[b'k'; MAX_KEY_BYTES]);
        let mut cut = None;
        for _ in 0..MAX_KEYS {
            wide.extend_from_slice(&key);
            if wide.len() > MAX_REQUEST_BYTES {
                cut = Some(wide.len());
                break;
            }
        }
        assert!(cut.is_some());
        bad(&wide, "more than");
    }
}
