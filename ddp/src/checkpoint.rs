//! Checkpoints: model, optimizer state, epoch, step and seed in one file, written atomically.
//! Written at an epoch's end, or in the middle of one (`--checkpoint-every STEPS`): then
//! `batch_in_epoch` says how many batches of the epoch in progress are done, and a resumed run
//! continues with the next one.
//!
//! Layout of `checkpoint.ddpck`:
//!
//! ```text
//! "DDPCKPT1" | u32 LE meta length | meta (JSON) | model record bytes | optimizer record bytes
//!            | each rank's communication hook state (rank order; absent without one)
//! ```
//!
//! The JSON meta holds the epoch, step, seed, world size, the two payload lengths and the
//! SHA-256 of the payload, so a truncated or corrupted file is an error that names it, never a
//! half-loaded model. Writing goes to a temporary file in the same directory, which is fsynced
//! and then renamed over the old checkpoint (and the directory fsynced): a crash at any point
//! leaves either the old checkpoint or the new one, and a stray temporary file is ignored
//! (`ddp_fsio::atomic_write`).
//!
//! Every error is [`DdpError::Checkpoint`], naming the file (and the header field at fault).
//! The collective side (rank 0 writes, rank 0 reads and broadcasts, the resume check) is in
//! `resume.rs`.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::DdpError;

type Result<T> = std::result::Result<T, DdpError>;

/// A [`DdpError::Checkpoint`] with this text.
fn fail(text: impl Into<String>) -> DdpError {
    DdpError::Checkpoint(text.into())
}

const MAGIC: &[u8; 8] = b"DDPCKPT1";
/// Numbers that may be `null`: serde_json writes a non-finite `f64` as `null`, which it cannot
/// read back as an `f64`; read as NaN, so that a checkpoint of a run whose loss diverged can
/// still be resumed (the weights are what they are; the loss only feeds the epoch's mean).
fn nan_for_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<f64>, D::Error> {
    let values: Vec<Option<f64>> = Vec::deserialize(d)?;
    Ok(values.into_iter().map(|v| v.unwrap_or(f64::NAN)).collect())
}

/// File name of the latest checkpoint inside the checkpoint directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.ddpck";

/// What a checkpoint says besides the weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Epochs completed.
    pub epoch: usize,
    /// Batches of the epoch after those (the one in progress, index `epoch` from 0) already
    /// trained: 0 at an epoch's end, the sampler position in a mid-epoch checkpoint. Absent
    /// (0) in checkpoints of older versions, which were all written at epoch ends.
    #[serde(default)]
    pub batch_in_epoch: u64,
    /// Each rank's sum of the training losses of those `batch_in_epoch` batches, in rank order
    /// (for the epoch's mean loss after a resume); empty at an epoch's end. A sum that is not
    /// finite (a diverged run's NaN) is written as JSON's `null` and read back as NaN.
    #[serde(default, deserialize_with = "nan_for_null")]
    pub epoch_loss_sums: Vec<f64>,
    /// Optimizer steps completed (the global step).
    pub step: u64,
    /// The run's seed.
    pub seed: u64,
    /// World size of the run that wrote it.
    pub world_size: usize,
    /// Which model (a name the program chooses; for a clear error when resuming another one).
    pub model: String,
    /// Length of the model record.
    pub model_len: u64,
    /// Length of the optimizer record.
    pub optim_len: u64,
    /// Hex SHA-256 of the payload: model record, optimizer record, hook states.
    pub sha256: String,
    /// Length of each rank's communication hook state (PowerSGD's error feedback and Q:
    /// `DistributedDataParallel::comm_hook_state`), in rank order after the optimizer record;
    /// empty when the run had none (and in checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hook_lens: Vec<u64>,
}

/// A loaded checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// Its metadata.
    pub meta: CheckpointMeta,
    /// The model record, as `Module::into_record().into_bytes()` wrote it.
    pub model: Vec<u8>,
    /// The optimizer record, as `ModuleOptimizer::into_bytes()` wrote it.
    pub optim: Vec<u8>,
    /// Each rank's communication hook state, in rank order (empty: none).
    pub hooks: Vec<Vec<u8>>,
}

/// The path of the latest checkpoint in `dir`.
pub fn checkpoint_path(dir: &Path) -> PathBuf {
    dir.join(CHECKPOINT_FILE)
}

/// Lower-case hexadecimal of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The payload's SHA-256, as the header stores it: of `model` followed by `rest` (the
/// optimizer record and the hook states).
fn digest(model: &[u8], rest: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(model);
    h.update(rest);
    hex(&h.finalize())
}

/// Writes a checkpoint atomically to `dir/checkpoint.ddpck`, returning its path. `meta`'s
/// lengths and digest are filled in here.
pub fn save(dir: &Path, meta: CheckpointMeta, model: &[u8], optim: &[u8]) -> Result<PathBuf> {
    save_with_hooks(dir, meta, model, optim, &[])
}

/// [`save`], with each rank's communication hook state (`hooks`, in rank order) after the
/// optimizer record.
pub fn save_with_hooks(
    dir: &Path,
    mut meta: CheckpointMeta,
    model: &[u8],
    optim: &[u8],
    hooks: &[Vec<u8>],
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| {
        fail(format!(
            "creating checkpoint directory {}: {e}",
            dir.display()
        ))
    })?;
    meta.model_len = model.len() as u64;
    meta.optim_len = optim.len() as u64;
    meta.hook_lens = hooks.iter().map(|h| h.len() as u64).collect();
    let mut rest = optim.to_vec();
    hooks.iter().for_each(|h| rest.extend_from_slice(h));
    meta.sha256 = digest(model, &rest);
    let json = serde_json::to_vec(&meta)
        .map_err(|e| fail(format!("encoding the checkpoint header: {e}")))?;
    let path = checkpoint_path(dir);
    ddp_fsio::atomic_write(&path, |f| {
        f.write_all(MAGIC)?;
        f.write_all(&(json.len() as u32).to_le_bytes())?;
        f.write_all(&json)?;
        f.write_all(model)?;
        f.write_all(&rest)
    })
    .map_err(|e| fail(format!("writing checkpoint {}: {e}", path.display())))?;
    Ok(path)
}

/// Reads and verifies the checkpoint at `path`. Every problem is an error naming the file (and
/// the header field at fault), never a panic: lengths in the header are checked against the
/// file's actual size before anything is sliced or allocated.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let bytes = read(path)?;
    parse(&bytes, &path.display().to_string())
}

/// The bytes of the checkpoint file at `path`, for [`parse`] (here or on another rank, after a
/// broadcast). Checks the magic and the header length against the file's size before reading
/// the file, so a bad file is an error naming it, not a large allocation.
pub fn read(path: &Path) -> Result<Vec<u8>> {
    let name = path.display();
    let io = |e: std::io::Error| fail(format!("reading checkpoint {name}: {e}"));
    let size = std::fs::metadata(path).map_err(io)?.len();
    let mut file = File::open(path).map_err(io)?;
    let mut head = [0u8; 12];
    if size < 12 || file.read_exact(&mut head).is_err() || &head[..8] != MAGIC {
        return Err(fail(format!(
            "{name} is not a ddp-rs checkpoint (bad magic bytes)"
        )));
    }
    let meta_len = u64::from(u32::from_le_bytes([head[8], head[9], head[10], head[11]]));
    if meta_len > size - 12 {
        return Err(fail(format!(
            "{name} is truncated inside its header: the header length field says {meta_len} \
             bytes, the file holds {} after it",
            size - 12
        )));
    }
    // Reading the file now allocates only as much as it holds.
    let mut bytes = Vec::with_capacity(size as usize);
    bytes.extend_from_slice(&head);
    file.read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}

/// Parses and verifies checkpoint bytes (as [`read`] returns them) that came from the file
/// `name`, which every error names. Never panics on bad bytes: lengths are checked before
/// anything is sliced, and the payload's SHA-256 against the header's.
pub fn parse(bytes: &[u8], name: &str) -> Result<Checkpoint> {
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        return Err(fail(format!(
            "{name} is not a ddp-rs checkpoint (bad magic bytes)"
        )));
    }
    let meta_len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if meta_len > bytes.len() - 12 {
        return Err(fail(format!(
            "{name} is truncated inside its header: the header length field says {meta_len} \
             bytes, the file holds {} after it",
            bytes.len() - 12
        )));
    }
    let meta_end = 12 + meta_len;
    let meta: CheckpointMeta = serde_json::from_slice(&bytes[12..meta_end])
        .map_err(|e| fail(format!("{name}: unreadable checkpoint header: {e}")))?;
    let body = &bytes[meta_end..];
    let payload = body.len() as u64;
    if meta.model_len > payload {
        return Err(fail(format!(
            "{name} is truncated or its header is wrong: header field `model_len` says {} \
             bytes, the file holds {payload} payload bytes",
            meta.model_len
        )));
    }
    if meta.optim_len > payload - meta.model_len {
        return Err(fail(format!(
            "{name} is truncated or its header is wrong: header field `optim_len` says {} \
             bytes, {} payload bytes remain after the model's {}",
            meta.optim_len,
            payload - meta.model_len,
            meta.model_len
        )));
    }
    let hooks_len = meta
        .hook_lens
        .iter()
        .try_fold(0u64, |a, &l| a.checked_add(l));
    let expected = hooks_len.and_then(|h| (meta.model_len + meta.optim_len).checked_add(h));
    if expected != Some(payload) {
        let announced = expected.map_or("more than 2^64".to_string(), |e| e.to_string());
        return Err(fail(format!(
            "{name} is truncated or padded: the header announces {announced} payload bytes \
             (`model_len` + `optim_len` + `hook_lens`), the file holds {payload}"
        )));
    }
    let (model, rest) = body.split_at(meta.model_len as usize);
    let actual = digest(model, rest);
    if actual != meta.sha256 {
        return Err(fail(format!(
            "{name} is corrupted: SHA-256 of the payload is {actual}, the header says {}",
            meta.sha256
        )));
    }
    let (optim, mut hooks_bytes) = rest.split_at(meta.optim_len as usize);
    let hooks = meta
        .hook_lens
        .iter()
        .map(|&l| {
            let (hook, after) = hooks_bytes.split_at(l as usize);
            hooks_bytes = after;
            hook.to_vec()
        })
        .collect();
    Ok(Checkpoint {
        model: model.to_vec(),
        optim: optim.to_vec(),
        hooks,
        meta,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> CheckpointMeta {
        CheckpointMeta {
            epoch: 2,
            batch_in_epoch: 0,
            epoch_loss_sums: Vec::new(),
            step: 100,
            seed: 7,
            world_size: 2,
            model: "cnn".into(),
            model_len: 0,
            optim_len: 0,
            sha256: String::new(),
            hook_lens: Vec::new(),
        }
    }

    #[test]
    fn round_trip_and_corruption_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = save(dir.path(), meta(), b"model-bytes", b"optim").unwrap();
        let ck = load(&path).unwrap();
        assert_eq!(ck.meta.epoch, 2);
        assert_eq!(ck.model, b"model-bytes");
        assert_eq!(ck.optim, b"optim");

        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 2] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(
            err.contains("corrupted") && err.contains("checkpoint.ddpck"),
            "{err}"
        );

        std::fs::write(&path, &bytes[..n - 3]).unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");

        std::fs::write(&path, b"garbage").unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains("not a ddp-rs checkpoint"), "{err}");
    }

    /// A run whose loss became NaN writes `null` into the header; reading it back gives NaN
    /// (it failed with "unreadable checkpoint header" before) and the finite sums as written.
    #[test]
    fn a_nan_loss_sum_is_written_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = meta();
        m.batch_in_epoch = 3;
        m.epoch_loss_sums = vec![1.5, f64::NAN];
        let path = save(dir.path(), m, b"model", b"").unwrap();
        let ck = load(&path).unwrap();
        assert_eq!(ck.meta.epoch_loss_sums[0], 1.5);
        assert!(ck.meta.epoch_loss_sums[1].is_nan());
    }

    #[test]
    fn hook_states_come_back_in_rank_order() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = vec![b"rank0".to_vec(), Vec::new(), b"rank-2".to_vec()];
        let path = save_with_hooks(dir.path(), meta(), b"model", b"optim", &hooks).unwrap();
        let ck = load(&path).unwrap();
        assert_eq!(
            (ck.model, ck.optim, ck.hooks),
            (b"model".to_vec(), b"optim".to_vec(), hooks)
        );
        // Without hooks the header has no `hook_lens`, as older versions wrote it.
        let path = save(dir.path(), meta(), b"model", b"optim").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(!String::from_utf8_lossy(&bytes).contains("hook_lens"));
        assert!(load(&path).unwrap().hooks.is_empty());
    }

    /// A checkpoint file whose header is `meta` (as JSON, lengths and digest as given) followed
    /// by `payload`.
    fn forged(dir: &Path, meta: &CheckpointMeta, meta_len: Option<u32>, payload: &[u8]) -> PathBuf {
        let json = serde_json::to_vec(meta).unwrap();
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&meta_len.unwrap_or(json.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&json);
        bytes.extend_from_slice(payload);
        let path = dir.join("forged.ddpck");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn a_header_that_lies_about_lengths_is_an_error_naming_file_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let payload = b"model-bytesoptim";
        let honest = CheckpointMeta {
            model_len: 11,
            optim_len: 5,
            sha256: digest(b"model-bytes", b"optim"),
            ..meta()
        };
        let path = forged(dir.path(), &honest, None, payload);
        assert_eq!(load(&path).unwrap().optim, b"optim");

        // Lengths whose sum wraps around to the payload's size (u64::MAX + 17 = 16).
        let wrapping = CheckpointMeta {
            model_len: u64::MAX,
            optim_len: 17,
            ..honest.clone()
        };
        let err = load(&forged(dir.path(), &wrapping, None, payload))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("forged.ddpck") && err.contains("`model_len`"),
            "{err}"
        );

        // A model length that fits, an optimizer length that does not.
        let too_long = CheckpointMeta {
            optim_len: u64::MAX - 3,
            ..honest.clone()
        };
        let err = load(&forged(dir.path(), &too_long, None, payload))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("forged.ddpck") && err.contains("`optim_len`"),
            "{err}"
        );

        // Lengths that fit but do not add up to the payload.
        let short = CheckpointMeta {
            optim_len: 2,
            ..honest.clone()
        };
        let err = load(&forged(dir.path(), &short, None, payload))
            .unwrap_err()
            .to_string();
        assert!(err.contains("truncated or padded"), "{err}");

        // Hook state lengths whose sum wraps around: an error naming the field, not a panic.
        let wrapping_hooks = CheckpointMeta {
            hook_lens: vec![u64::MAX, 2],
            ..honest.clone()
        };
        let err = load(&forged(dir.path(), &wrapping_hooks, None, payload))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("truncated or padded") && err.contains("`hook_lens`"),
            "{err}"
        );

        // A header length field far beyond the file (4 GiB - 1): an error, not an allocation.
        let err = load(&forged(dir.path(), &honest, Some(u32::MAX), payload))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("forged.ddpck") && err.contains("header length field"),
            "{err}"
        );
    }

    #[test]
    fn a_stray_temporary_file_does_not_replace_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        save(dir.path(), meta(), b"good", b"").unwrap();
        // A crash mid-write leaves only a temporary file behind.
        std::fs::write(dir.path().join("checkpoint.ddpck.999.tmp"), b"DDPCKPT1\x05").unwrap();
        let ck = load(&checkpoint_path(dir.path())).unwrap();
        assert_eq!(ck.model, b"good");
    }
}
