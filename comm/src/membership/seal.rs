//! The elastic job's records, sealed with the job's secret: anyone who reaches the store
//! (`MASTER_PORT`, a PyTorch `TCPStore` with no authentication of its own) could otherwise say
//! the job is done, write garbage where the next generation's record goes, send join requests
//! that re-form the job again and again, or join and be healed with rank 0's weights.
//!
//! How: with a secret (`DDP_TOKEN`, which ddprun makes for a one-node job and hands to its
//! ranks), every record an elastic rank writes (`terms`, `join/<n>`, `gen/<g>`, the reports of a
//! re-form, `done`) ends with `\n#hmac-sha256:<64 hex digits>`, the HMAC-SHA256 of the key and
//! the record under the secret. A reader that finds a record failing the check logs it (once
//! per key) and takes it for absent: it waits for the real one (which overwrites it) where it
//! waits for a record, and skips it where it counts records (a join request). Without a secret
//! the records are written and read as they are (ranks of one job all have the secret or
//! none). The counters (`joins`, `gen/latest`) cannot be sealed: a stranger can still make a
//! joiner wait in vain, but no longer make the job do anything.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::error::CommError;
use crate::rendezvous::store::Store;

/// What follows a sealed record.
const TAG: &[u8] = b"\n#hmac-sha256:";

/// HMAC-SHA256 (RFC 2104) of `message` under `key`.
fn hmac_sha256(key: &[u8], message: &[&[u8]]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(block.map(|b| b ^ 0x36));
    for part in message {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(block.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The MAC of the record `body` at `key`.
fn mac(secret: &str, key: &str, body: &[u8]) -> String {
    hex(&hmac_sha256(
        secret.as_bytes(),
        &[key.as_bytes(), &[0], body],
    ))
}

/// `body` sealed for `key` with `secret` (as it is without one).
pub(crate) fn seal(secret: Option<&str>, key: &str, body: &[u8]) -> Vec<u8> {
    let Some(secret) = secret else {
        return body.to_vec();
    };
    let mut out = body.to_vec();
    out.extend_from_slice(TAG);
    out.extend_from_slice(mac(secret, key, body).as_bytes());
    out
}

/// The record of a sealed `value` at `key` (JSON).
pub(crate) fn seal_json<T: serde::Serialize>(
    secret: Option<&str>,
    key: &str,
    value: &T,
) -> Vec<u8> {
    seal(secret, key, &serde_json::to_vec(value).unwrap_or_default())
}

/// The body of the record `bytes` at `key`, or why it fails the check.
pub(crate) fn open<'a>(
    secret: Option<&str>,
    key: &str,
    bytes: &'a [u8],
) -> Result<&'a [u8], String> {
    let Some(secret) = secret else {
        return Ok(bytes);
    };
    let at = bytes
        .windows(TAG.len())
        .rposition(|w| w == TAG)
        .ok_or("it carries no seal of the job's secret")?;
    let (body, tail) = (&bytes[..at], &bytes[at + TAG.len()..]);
    let want = mac(secret, key, body);
    // Every byte compared, whatever differs first.
    let same = tail.len() == want.len()
        && tail
            .iter()
            .zip(want.as_bytes())
            .fold(0u8, |d, (a, b)| d | (a ^ b))
            == 0;
    match same {
        true => Ok(body),
        false => Err("its seal does not match the job's secret".into()),
    }
}

/// Logs, once per key, a record that fails the check.
fn ignore(key: &str, why: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen
        .get_or_insert_with(HashSet::new)
        .insert(key.to_string())
    {
        tracing::warn!(
            "elastic: ignored the record at {key:?}: {why} (written by a process outside the \
             job?)"
        );
    }
}

/// Whether the record at `key` is there and passes the check (a failing one is logged).
pub(crate) fn present(store: &Store, secret: Option<&str>, key: &str) -> Result<bool, CommError> {
    if !store.check(&[key])? {
        return Ok(false);
    }
    let bytes = store.get_timeout(key, Duration::from_secs(5))?;
    Ok(match open(secret, key, &bytes) {
        Ok(_) => true,
        Err(why) => {
            ignore(key, &why);
            false
        }
    })
}

/// The record at `key` (JSON), waiting up to `timeout` for one that passes the check: one that
/// fails it is logged and waited past (the real one overwrites it). `None` for a record that
/// is there but fails the check, when `skip` (a count of records: skip it).
pub(crate) fn read<T: serde::de::DeserializeOwned>(
    store: &Store,
    secret: Option<&str>,
    key: &str,
    timeout: Duration,
    skip: bool,
) -> Result<Option<T>, CommError> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let bytes = store.get_timeout(key, left.max(Duration::from_millis(1)))?;
        let why = match open(secret, key, &bytes) {
            Ok(body) => match serde_json::from_slice(body) {
                Ok(value) => return Ok(Some(value)),
                Err(e) => format!("it is unreadable: {e}"),
            },
            Err(why) => why,
        };
        ignore(key, &why);
        if skip {
            return Ok(None);
        }
        if Instant::now() >= deadline {
            return Err(CommError::StoreTimeout {
                rank: 0,
                addr: store.address().to_string(),
                keys: format!("{key} (a record that passes the job's secret check; {why})"),
                timeout,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The record at `key` (JSON), as [`read`] waits for it.
pub(crate) fn read_record<T: serde::de::DeserializeOwned>(
    store: &Store,
    secret: Option<&str>,
    key: &str,
    timeout: Duration,
) -> Result<T, CommError> {
    read(store, secret, key, timeout, false)?.ok_or_else(|| CommError::StoreTimeout {
        rank: 0,
        addr: store.address().to_string(),
        keys: key.to_string(),
        timeout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231's test cases 1 and 6 (a key longer than a block).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let one = hmac_sha256(&[0x0b; 20], &[b"Hi There"]);
        assert_eq!(
            hex(&one),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        let six = hmac_sha256(
            &[0xaa; 131],
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        assert_eq!(
            hex(&six),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    /// A sealed record opens with the secret and its key only; a forged, altered or unsealed
    /// one does not; without a secret records pass as they are.
    #[test]
    fn a_record_opens_only_with_its_secret_and_key() {
        let sealed = seal(Some("s3cret"), "gen/2", b"{\"x\":1}");
        assert_eq!(
            open(Some("s3cret"), "gen/2", &sealed),
            Ok(&b"{\"x\":1}"[..])
        );
        assert!(open(Some("other"), "gen/2", &sealed).is_err());
        assert!(
            open(Some("s3cret"), "gen/3", &sealed).is_err(),
            "moved to another key"
        );
        let mut altered = sealed.clone();
        altered[5] ^= 1;
        assert!(open(Some("s3cret"), "gen/2", &altered).is_err());
        assert!(open(Some("s3cret"), "done", b"1").is_err(), "unsealed");
        assert_eq!(open(None, "done", b"1"), Ok(&b"1"[..]));
        assert_eq!(seal(None, "done", b"1"), b"1");
    }
}
