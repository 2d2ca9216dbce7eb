//! PowerSGD's state across steps (`powersgd.rs` runs the algorithm on it) and its bytes, for
//! checkpoints.
//!
//! ```text
//! "DDPPSGD1" | u32 LE header length | header (JSON) | payload (f32 LE)
//! ```
//!
//! The header holds the settings, the step count, the generator's state and, per bucket, the
//! lengths of its error feedback and Q (`null` where the bucket has none yet); the payload is
//! each bucket's error then Q, in bucket order. Reading checks every length against the bytes
//! actually there before allocating anything, and names what does not fit. The checkpoint file
//! that carries these bytes has its own digest.

use serde::{Deserialize, Serialize};

use crate::hooks::powersgd_config::PowerSgdConfig;
use crate::DdpError;

const MAGIC: &[u8; 8] = b"DDPPSGD1";

/// What PowerSGD keeps between steps: the step count, the generator that seeds Q, and per
/// bucket the error feedback (the bucket's length) and Q (`None` until the bucket is first
/// compressed, and again after each step without warm start).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct State {
    pub(crate) iter: u64,
    pub(crate) rng: u64,
    pub(crate) errors: Vec<Option<Vec<f32>>>,
    pub(crate) qs: Vec<Option<Vec<f32>>>,
}

/// The header.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    config: PowerSgdConfig,
    iter: u64,
    rng: u64,
    buckets: Vec<BucketLens>,
}

/// Lengths of one bucket's saved arrays.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BucketLens {
    error: Option<usize>,
    q: Option<usize>,
}

/// A decoded state and the settings it was written with.
#[derive(Debug)]
pub(crate) struct Saved {
    pub(crate) config: PowerSgdConfig,
    pub(crate) state: State,
}

/// The bytes of `state` under `config` (the format above).
pub(crate) fn encode(config: &PowerSgdConfig, state: &State) -> Vec<u8> {
    let buckets = state
        .errors
        .iter()
        .zip(&state.qs)
        .map(|(e, q)| BucketLens {
            error: e.as_ref().map(Vec::len),
            q: q.as_ref().map(Vec::len),
        })
        .collect();
    let header = Header {
        config: config.clone(),
        iter: state.iter,
        rng: state.rng,
        buckets,
    };
    let json = serde_json::to_vec(&header).expect("the header serialises");
    let mut out = Vec::with_capacity(12 + json.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    for (e, q) in state.errors.iter().zip(&state.qs) {
        for v in [e, q].into_iter().flatten() {
            out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
    }
    out
}

/// The state in `bytes` (`name` says where they came from, for the errors).
pub(crate) fn decode(bytes: &[u8], name: &str) -> Result<Saved, DdpError> {
    let fail = |what: String| DdpError::Checkpoint(format!("{name}: {what}"));
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(fail("not a PowerSGD state (no DDPPSGD1 header)".into()));
    }
    let header_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize;
    let rest = &bytes[12..];
    if header_len > rest.len() {
        return Err(fail(format!(
            "the PowerSGD state's header says {header_len} bytes, {} follow",
            rest.len()
        )));
    }
    let header: Header = serde_json::from_slice(&rest[..header_len])
        .map_err(|e| fail(format!("the PowerSGD state's header: {e}")))?;
    let payload = &rest[header_len..];
    let elements = header
        .buckets
        .iter()
        .flat_map(|b| [b.error, b.q])
        .try_fold(0usize, |sum, len| sum.checked_add(len.unwrap_or(0)));
    if elements.and_then(|n| n.checked_mul(4)) != Some(payload.len()) {
        return Err(fail(format!(
            "the PowerSGD state's header lists {} f32 elements, the payload holds {} bytes",
            elements.map_or("too many".to_string(), |n| n.to_string()),
            payload.len()
        )));
    }
    let mut at = 0;
    let mut take = |len: Option<usize>| {
        len.map(|len| {
            let v: Vec<f32> = payload[at..at + 4 * len]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            at += 4 * len;
            v
        })
    };
    let (mut errors, mut qs) = (Vec::new(), Vec::new());
    for b in &header.buckets {
        errors.push(take(b.error));
        qs.push(take(b.q));
    }
    Ok(Saved {
        config: header.config,
        state: State {
            iter: header.iter,
            rng: header.rng,
            errors,
            qs,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (PowerSgdConfig, State) {
        let config = PowerSgdConfig::new().with_matrix_approximation_rank(4);
        let state = State {
            iter: 7,
            rng: u64::MAX - 3,
            errors: vec![Some(vec![1.5, -0.0, f32::MIN_POSITIVE]), None],
            qs: vec![Some(vec![0.25; 4]), Some(vec![])],
        };
        (config, state)
    }

    #[test]
    fn a_state_comes_back_bit_for_bit() {
        let (config, state) = sample();
        let bytes = encode(&config, &state);
        let saved = decode(&bytes, "s.bin").unwrap();
        assert_eq!(saved.config, config);
        assert_eq!(saved.state, state);
        let bits = |s: &State| -> Vec<u32> {
            s.errors
                .iter()
                .flatten()
                .flatten()
                .map(|x| x.to_bits())
                .collect()
        };
        assert_eq!(bits(&saved.state), bits(&state), "-0.0 keeps its sign");
    }

    #[test]
    fn damaged_bytes_are_refused_naming_the_file() {
        let (config, state) = sample();
        let bytes = encode(&config, &state);
        let err = |b: &[u8]| decode(b, "s.bin").unwrap_err().to_string();
        assert!(err(b"DDPCKPT1\0\0\0\0").contains("s.bin: not a PowerSGD state"));
        assert!(err(&bytes[..5]).contains("not a PowerSGD state"));
        assert!(err(&bytes[..bytes.len() - 1]).contains("payload holds"));
        let mut long = bytes.clone();
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&long).contains("header says"));
        // A header that claims more elements than there are bytes: refused before allocating.
        let json =
            br#"{"config":{},"iter":0,"rng":0,"buckets":[{"error":18446744073709551615,"q":2}]}"#;
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&(json.len() as u32).to_le_bytes());
        huge.extend_from_slice(json);
        assert!(err(&huge).contains("too many"), "{}", err(&huge));
        let mut garbled = bytes;
        garbled[12] = b'[';
        assert!(err(&garbled).contains("header"));
    }
}
