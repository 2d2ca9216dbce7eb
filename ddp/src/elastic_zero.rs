//! ZeRO's optimizer state across a change of membership: the survivors' shards, cut for the
//! old world, become the new world's shards ([`reshard`]).
//!
//! How: every member of the new group says how many bytes of old shard it holds (a joiner
//! none), then each holder broadcasts its shard (`ShardedDataParallel::shard_state`: the state
//! of its ranges of the flat trainable vector, with the ranges in its header) and every rank
//! writes it into a consolidated state of the whole flat vector, which it loads
//! ([`ShardedDataParallel::load_consolidated`]: each rank keeps its new shard). The ranges of
//! the ranks that left are lost with them: their optimizer state (Adam's moments of 1/N of the
//! parameters) starts again from zero, the step counts are kept. Every rank briefly holds the
//! whole state, as rank 0 does when a checkpoint is consolidated.

use ddp_comm::ProcessGroup;

use crate::zero::ShardedDataParallel;
use crate::zero_state::{decode, encode, StateHeader};
use crate::DdpError;

/// Reads the header of an encoded (shard) state, without checking it against anything.
fn header_of(bytes: &[u8], name: &str) -> Result<StateHeader, DdpError> {
    let bad = |what: String| DdpError::Checkpoint(format!("{name}: {what}"));
    let len = bytes
        .get(8..12)
        .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
        .ok_or_else(|| bad("shorter than a state's header".into()))?;
    let json = bytes
        .get(12..12 + len)
        .ok_or_else(|| bad(format!("header of {len} bytes runs past the end")))?;
    serde_json::from_slice(json).map_err(|e| bad(format!("header: {e}")))
}

/// Makes `zero` (just built over the new group) hold the optimizer state of the old
/// generation: `old` is this rank's shard of it (`shard_state` of the old wrapper, at the step
/// the new generation continues from), `None` for a joiner. A collective of the new group.
/// Returns the elements of the flat vector whose state was lost with the ranks that left.
pub(crate) fn reshard(
    zero: &mut ShardedDataParallel,
    old: Option<&[u8]>,
) -> Result<usize, DdpError> {
    let pg: &ProcessGroup = zero.process_group();
    let (rank, world) = (pg.rank(), pg.world_size());
    let lens = pg.all_gather(vec![old.map_or(0, |b| b.len() as i64)])?;
    let mut full: Option<(StateHeader, Vec<Vec<f32>>)> = None;
    let mut covered = 0usize;
    for (r, &len) in lens.iter().enumerate().take(world) {
        if len <= 0 {
            continue;
        }
        let name = format!("the old shard of rank {r} of the new group");
        let bytes = if r == rank {
            old.map(<[u8]>::to_vec).unwrap_or_default()
        } else {
            vec![0u8; len as usize]
        };
        let bytes = pg.broadcast(bytes, r)?;
        let header = header_of(&bytes, &name)?;
        let (header, vectors) = decode(&bytes, &header, &name)?;
        let Some(shard) = header.shard.clone() else {
            return Err(DdpError::Checkpoint(format!(
                "{name}: a consolidated state, not a shard"
            )));
        };
        let (_, all) = full.get_or_insert_with(|| {
            let total = header.params.iter().map(|(_, n)| n).sum();
            let mut consolidated = header.clone();
            consolidated.shard = None;
            (consolidated, vec![vec![0.0; total]; header.vectors])
        });
        for (v, dst) in vectors.iter().zip(all.iter_mut()) {
            let mut at = 0;
            for &(start, end) in &shard.ranges {
                let n = end.saturating_sub(start);
                let (Some(d), Some(s)) = (dst.get_mut(start..end), v.get(at..at + n)) else {
                    return Err(DdpError::Checkpoint(format!(
                        "{name}: range {start}..{end} is beyond the state"
                    )));
                };
                d.copy_from_slice(s);
                at += n;
            }
        }
        covered += shard.ranges.iter().map(|(a, b)| b - a).sum::<usize>();
    }
    let Some((header, vectors)) = full else {
        return Err(DdpError::Checkpoint(
            "no member of the new group holds any of the old optimizer state".into(),
        ));
    };
    let total: usize = header.params.iter().map(|(_, n)| n).sum();
    let bytes = encode(&header, &vectors)?;
    drop(vectors);
    zero.load_consolidated(&bytes, "the survivors' optimizer state")?;
    Ok(total.saturating_sub(covered))
}
