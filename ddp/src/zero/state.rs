//! The consolidated optimizer state of a sharded run (PyTorch's `consolidate_state_dict`): the
//! whole optimizer state in the flat layout of the trainable parameters, independent of the
//! world size that wrote it, so that a run can resume at another world size.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! "DDPZERO1" | u32 header length | header (JSON) | vectors x total f32
//! ```
//!
//! The JSON header names the optimizer, the number of state vectors, every trainable parameter
//! (name and element count, in visiting order), every parameter's step count, the wrapper's
//! step count and its run. Decoding checks the first four against what the loading run
//! expects and names the first field that differs. A per-rank shard also names its place; the
//! ranks' shards load only together, when every rank's file is of the same run and step
//! ([`check_shards_agree`]).

use serde::{Deserialize, Serialize};

use crate::gradients::agree::diverged_ranks;
use crate::DdpError;

const MAGIC: &[u8; 8] = b"DDPZERO1";

/// The shard layout of the per-rank files this version writes (`ShardHeader::layout`): 2 for
/// shards of DDP's buckets (issue 38), where the files of earlier versions (which record no
/// layout, read as 1) cut the flat vector into buckets of its own.
pub(crate) const SHARD_LAYOUT: u32 = 2;

/// The layout a per-rank file that records none was written with.
fn first_layout() -> u32 {
    1
}

/// The header of a consolidated state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct StateHeader {
    /// `adam` or `sgd`.
    pub optimizer: String,
    /// State vectors (Adam: 2, SGD with momentum: 1, plain SGD: 0).
    pub vectors: usize,
    /// Name and element count of every trainable parameter, in visiting order.
    pub params: Vec<(String, usize)>,
    /// Step count of every trainable parameter.
    pub times: Vec<u64>,
    /// Steps the writing wrapper had taken, the ones it loaded included (0 in files of older
    /// versions).
    #[serde(default)]
    pub step: u64,
    /// The writing run's id, the same on all of its ranks (0 in files of older versions).
    #[serde(default)]
    pub run: u64,
    /// Set when the vectors hold one rank's shard only (what that rank saves on its own);
    /// absent in a consolidated state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardHeader>,
}

/// Which shard a per-rank state holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ShardHeader {
    /// The world size of the run that wrote it.
    pub world: usize,
    /// The rank that wrote it.
    pub rank: usize,
    /// The shard's ranges of the flat trainable vector, in shard order.
    pub ranges: Vec<(usize, usize)>,
    /// The shard layout that cut them ([`SHARD_LAYOUT`]; 1 in files of earlier versions).
    #[serde(default = "first_layout")]
    pub layout: u32,
}

impl StateHeader {
    /// Elements of one state vector: the flat trainable vector's length, or the shard's.
    pub fn total(&self) -> usize {
        if let Some(shard) = &self.shard {
            return shard.ranges.iter().map(|(a, b)| b.saturating_sub(*a)).sum();
        }
        self.params.iter().map(|(_, n)| n).sum()
    }
}

/// A [`DdpError::Checkpoint`] about the state named `what`.
fn fail(what: &str, text: impl std::fmt::Display) -> DdpError {
    DdpError::Checkpoint(format!("sharded optimizer state ({what}): {text}"))
}

/// What every rank reports of the shard file it read, for [`check_shards_agree`]: whether it
/// could read it, then its step and run (as `i64`, the process group's integer element).
pub(crate) fn shard_report(read: Option<&StateHeader>) -> Vec<i64> {
    match read {
        Some(h) => vec![1, h.step as i64, h.run as i64],
        None => vec![0, 0, 0],
    }
}

/// Whether every rank's shard file (`all`: each rank's [`shard_report`], in rank order) is of
/// one run and one step, so that together they are one checkpoint; else an error for this
/// rank (which read `name`), naming the ranks out of line and their steps. Shard files of two
/// checkpoints happen when a save stopped part-way (a crash): one rank's file is still the
/// older one, and loading it would step that rank's slice with old moments and an old step
/// count, silently, since the replicas stay identical.
pub(crate) fn check_shards_agree(all: &[i64], name: &str) -> Result<(), DdpError> {
    let world = all.len() / 3;
    let (read, step, run) = (
        |r: usize| all[3 * r] == 1,
        |r: usize| all[3 * r + 1] as u64,
        |r: usize| all[3 * r + 2],
    );
    let list = |ranks: &[usize]| match ranks {
        [one] => format!("rank {one}"),
        [init @ .., last] => format!(
            "ranks {} and {last}",
            init.iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        [] => "no rank".into(),
    };
    let unread: Vec<usize> = (0..world).filter(|&r| !read(r)).collect();
    if !unread.is_empty() {
        return Err(fail(
            name,
            format!(
                "{} could not load its shard file (its own error says why): nothing was loaded",
                list(&unread)
            ),
        ));
    }
    let runs: Vec<i64> = (0..world).map(run).collect();
    if let Some((odd, against_majority)) = diverged_ranks(&runs) {
        let reference = if against_majority {
            (0..world).find(|r| !odd.contains(r)).unwrap_or(0)
        } else {
            0
        };
        let theirs: Vec<String> = odd
            .iter()
            .map(|&r| {
                format!(
                    "rank {r}'s is of another run ({:016x}, step {})",
                    runs[r],
                    step(r)
                )
            })
            .collect();
        return Err(fail(
            name,
            format!(
                "the shard files are not of one run: {}, rank {reference}'s of run {:016x}                  (step {}); nothing was loaded",
                theirs.join(", "),
                runs[reference],
                step(reference)
            ),
        ));
    }
    let mut steps: Vec<u64> = (0..world).map(step).collect();
    steps.sort_unstable();
    steps.dedup();
    if steps.len() > 1 {
        let groups: Vec<String> = steps
            .iter()
            .rev()
            .map(|&s| {
                let ranks: Vec<usize> = (0..world).filter(|&r| step(r) == s).collect();
                format!("{} at step {s}", list(&ranks))
            })
            .collect();
        return Err(fail(
            name,
            format!(
                "the shard files are of different checkpoints: {} (a save that did not finish                  on every rank leaves a file older than the others); nothing was loaded",
                groups.join(", ")
            ),
        ));
    }
    Ok(())
}

/// Encodes a consolidated state: `vectors[k]` is state vector k over the whole flat vector.
pub(crate) fn encode(header: &StateHeader, vectors: &[Vec<f32>]) -> Result<Vec<u8>, DdpError> {
    let json = serde_json::to_vec(header).map_err(|e| fail("header", e))?;
    let mut out = Vec::with_capacity(12 + json.len() + vectors.len() * header.total() * 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    for v in vectors {
        out.extend_from_slice(bytemuck::cast_slice(v));
    }
    Ok(out)
}

/// Decodes a consolidated state, checking it against `expected` (the loading run's optimizer
/// and parameter list; its `times` are ignored): returns the file's header and its vectors.
/// `name` names the source in errors (the checkpoint file).
pub(crate) fn decode(
    bytes: &[u8],
    expected: &StateHeader,
    name: &str,
) -> Result<(StateHeader, Vec<Vec<f32>>), DdpError> {
    let (header, data) = check(bytes, expected, name)?;
    let total = header.total();
    if total == 0 {
        let vectors = vec![Vec::new(); header.vectors];
        return Ok((header, vectors));
    }
    let vectors = data
        .chunks_exact(4 * total)
        .take(header.vectors)
        .map(|c| {
            c.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect()
        })
        .collect();
    Ok((header, vectors))
}

/// [`decode`]'s checks without the copy: the header and the state's bytes (`vectors` runs of
/// `total()` little-endian `f32`s), once they match `expected` as `decode` requires.
pub(crate) fn check<'a>(
    bytes: &'a [u8],
    expected: &StateHeader,
    name: &str,
) -> Result<(StateHeader, &'a [u8]), DdpError> {
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(fail(
            name,
            "not a sharded optimizer state (no DDPZERO1 magic): a checkpoint of a run without \
             sharding holds burn's optimizer record; resume it without sharding",
        ));
    }
    let len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) as usize;
    let json = bytes
        .get(12..12 + len)
        .ok_or_else(|| fail(name, format!("header of {len} bytes runs past the end")))?;
    let header: StateHeader =
        serde_json::from_slice(json).map_err(|e| fail(name, format!("header: {e}")))?;
    if header.optimizer != expected.optimizer {
        return Err(fail(
            name,
            format!(
                "field `optimizer` is `{}`, this run steps with `{}`",
                header.optimizer, expected.optimizer
            ),
        ));
    }
    if header.vectors != expected.vectors {
        return Err(fail(
            name,
            format!(
                "field `vectors` is {}, this run's optimizer keeps {}",
                header.vectors, expected.vectors
            ),
        ));
    }
    if let (Some(file), Some(run)) = (&header.shard, &expected.shard) {
        if file.layout != run.layout {
            return Err(fail(
                name,
                format!(
                    "field `shard.layout`: rank {}'s shard file was cut by shard layout {} (an \
                     earlier version's, which cut the flat parameter vector into buckets of its \
                     own), this version cuts DDP's buckets (layout {}); per-rank shard files do \
                     not carry over: resume from the checkpoint's consolidated state (the \
                     checkpoint file, `resume_sharded`), which does not depend on the layout",
                    file.rank, file.layout, run.layout
                ),
            ));
        }
    }
    if header.shard != expected.shard {
        let what = |s: &Option<ShardHeader>| match s {
            None => "the consolidated state".to_string(),
            Some(s) => format!(
                "rank {}'s shard of a {}-rank run ({} ranges)",
                s.rank,
                s.world,
                s.ranges.len()
            ),
        };
        return Err(fail(
            name,
            format!(
                "field `shard`: it holds {}, this rank needs {} (a per-rank shard loads only \
                 into the same rank of the same layout; consolidate to change the world size)",
                what(&header.shard),
                what(&expected.shard)
            ),
        ));
    }
    if header.params != expected.params {
        let at = (0..header.params.len().max(expected.params.len()))
            .find(|&i| header.params.get(i) != expected.params.get(i))
            .unwrap_or(0);
        return Err(fail(
            name,
            format!(
                "field `params` differs at #{at}: the state has {:?}, this model {:?}",
                header.params.get(at),
                expected.params.get(at)
            ),
        ));
    }
    if header.times.len() != header.params.len() {
        return Err(fail(
            name,
            format!(
                "field `times` has {} entries for {} parameters",
                header.times.len(),
                header.params.len()
            ),
        ));
    }
    let data = &bytes[12 + len..];
    let total = header.total();
    let want = header
        .vectors
        .checked_mul(total)
        .and_then(|n| n.checked_mul(4))
        .ok_or_else(|| fail(name, "field `params` describes an impossible size"))?;
    if data.len() != want {
        return Err(fail(
            name,
            format!(
                "{} bytes of state, expected {want} ({} vectors of {total} f32)",
                data.len(),
                header.vectors
            ),
        ));
    }
    Ok((header, data))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> StateHeader {
        StateHeader {
            optimizer: "adam".into(),
            vectors: 2,
            params: vec![("w".into(), 3), ("b".into(), 1)],
            times: vec![4, 3],
            step: 4,
            run: 0x5eed,
            shard: None,
        }
    }

    #[test]
    fn a_state_round_trips_and_every_field_is_checked() {
        let h = header();
        let vectors = vec![vec![1.0, 2.0, 3.0, 4.0], vec![5.0, 6.0, 7.0, 8.0]];
        let bytes = encode(&h, &vectors).unwrap();
        let (back, v) = decode(&bytes, &h, "f").unwrap();
        assert_eq!((back, v), (h.clone(), vectors.clone()));

        let mut other = h.clone();
        other.optimizer = "sgd".into();
        let e = decode(&bytes, &other, "f").unwrap_err().to_string();
        assert!(e.contains("`optimizer`"), "{e}");
        let mut other = h.clone();
        other.params[1] = ("bias".into(), 1);
        let e = decode(&bytes, &other, "f").unwrap_err().to_string();
        assert!(e.contains("`params` differs at #1"), "{e}");
        let e = decode(&bytes[..bytes.len() - 4], &h, "ck.ddpck")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ck.ddpck") && e.contains("expected 32"), "{e}");
        let e = decode(b"burn record", &h, "f").unwrap_err().to_string();
        assert!(e.contains("DDPZERO1"), "{e}");

        // A shard loads only where the same shard is expected.
        let mut shard = h.clone();
        shard.shard = Some(ShardHeader {
            world: 2,
            rank: 1,
            ranges: vec![(2, 4)],
            layout: SHARD_LAYOUT,
        });
        let bytes = encode(&shard, &[vec![3.0, 4.0], vec![7.0, 8.0]]).unwrap();
        assert_eq!(decode(&bytes, &shard, "s").unwrap().1[1], vec![7.0, 8.0]);
        let e = decode(&bytes, &h, "s").unwrap_err().to_string();
        assert!(
            e.contains("rank 1's shard of a 2-rank run") && e.contains("the consolidated state"),
            "{e}"
        );
    }

    #[test]
    fn shards_load_only_as_one_checkpoint_of_one_run() {
        let report = |step: u64, run: u64| {
            let mut h = header();
            (h.step, h.run) = (step, run);
            shard_report(Some(&h))
        };
        let all = |reports: &[Vec<i64>]| reports.concat();
        assert!(check_shards_agree(&all(&[report(3, 9), report(3, 9)]), "f").is_ok());
        // Rank 1's file is a checkpoint older.
        let e = check_shards_agree(&all(&[report(3, 9), report(2, 9), report(3, 9)]), "s1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ranks 0 and 2 at step 3, rank 1 at step 2") && e.contains("(s1)"),
            "{e}"
        );
        // Rank 2's file is another run's (the majority tells), at two ranks rank 0's is the
        // reference.
        let e = check_shards_agree(&all(&[report(3, 9), report(3, 9), report(3, 8)]), "f")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 2's is of another run (0000000000000008, step 3)"),
            "{e}"
        );
        let e = check_shards_agree(&all(&[report(3, 9), report(3, 8)]), "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1's is of another run"), "{e}");
        // A rank that could not read its file: the others name it.
        let e = check_shards_agree(&all(&[report(3, 9), shard_report(None)]), "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 could not load"), "{e}");
    }
}
