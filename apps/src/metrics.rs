//! Training metrics: a CSV file and TensorBoard event files side by side in one directory.
//!
//! The event file gets the training curves every `--log-interval` steps ([`MetricsWriter::
//! write_scalars`]: `train/loss`, `train/learning_rate`, `train/samples_per_sec`,
//! `train/comm_seconds`, `train/comm_fraction`) and the test metrics once per epoch
//! ([`MetricsWriter::write`]: `test/accuracy`, `test/loss`, `train/epoch_loss`), flushed after
//! every write so that a live `tensorboard --logdir DIR` shows the run as it goes. The CSV has
//! one row per epoch.
//!
//! TensorBoard reads `events.out.tfevents.*` files: TFRecord framing (length, masked CRC-32C of
//! the length, payload, masked CRC-32C of the payload) around protobuf `Event` messages. We write
//! only what scalars need, encoding the three messages by hand:
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; float simple_value = 2; }
//! ```

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// The CSV columns, in order.
pub const CSV_COLUMNS: [&str; 8] = [
    "epoch",
    "step",
    "train_loss",
    "test_accuracy",
    "test_loss",
    "samples_per_sec",
    "learning_rate",
    "comm_seconds",
];

/// One row of metrics, written at the end of an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpochMetrics {
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Global optimizer steps so far.
    pub step: u64,
    /// Mean training loss of the epoch on this rank.
    pub train_loss: f64,
    /// Test accuracy over the whole test set (every sample counted once).
    pub test_accuracy: f64,
    /// Mean test loss over the whole test set.
    pub test_loss: f64,
    /// Training samples per second, all ranks together.
    pub samples_per_sec: f64,
    /// Learning rate in force.
    pub learning_rate: f64,
    /// Seconds the epoch spent in gradient synchronisation on this rank.
    pub comm_seconds: f64,
}

/// Writes metrics rows to `metrics.csv` and a TensorBoard event file in one directory.
pub struct MetricsWriter {
    csv: BufWriter<File>,
    events: BufWriter<File>,
    events_path: PathBuf,
}

impl MetricsWriter {
    /// Creates `dir` if needed and opens `metrics.csv` (appending when it exists, so a resumed
    /// run continues it) and a new event file.
    pub fn create(dir: &Path) -> Result<MetricsWriter> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating metrics directory {}", dir.display()))?;
        let csv_path = dir.join("metrics.csv");
        let fresh = !csv_path.exists();
        let mut csv = BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&csv_path)
                .with_context(|| format!("opening {}", csv_path.display()))?,
        );
        if fresh {
            writeln!(csv, "{}", CSV_COLUMNS.join(","))?;
        }
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let events_path = dir.join(format!(
            "events.out.tfevents.{}.{}.{}",
            now.as_secs(),
            host,
            std::process::id()
        ));
        let mut events = BufWriter::new(
            File::create(&events_path)
                .with_context(|| format!("creating {}", events_path.display()))?,
        );
        let mut first = Vec::new();
        put_double(&mut first, 1, now.as_secs_f64());
        put_bytes(&mut first, 3, b"brain.Event:2");
        write_record(&mut events, &first)?;
        events.flush()?;
        Ok(MetricsWriter {
            csv,
            events,
            events_path,
        })
    }

    /// The TensorBoard event file being written.
    pub fn events_path(&self) -> &Path {
        &self.events_path
    }

    /// Appends one row to the CSV and the matching scalars to the event file, and flushes both.
    pub fn write(&mut self, m: &EpochMetrics) -> Result<()> {
        writeln!(
            self.csv,
            "{},{},{:.6},{:.6},{:.6},{:.3},{:.8},{:.6}",
            m.epoch,
            m.step,
            m.train_loss,
            m.test_accuracy,
            m.test_loss,
            m.samples_per_sec,
            m.learning_rate,
            m.comm_seconds
        )?;
        self.csv.flush()?;
        self.write_scalars(
            m.step,
            &[
                ("test/accuracy", m.test_accuracy),
                ("test/loss", m.test_loss),
                ("train/epoch_loss", m.train_loss),
            ],
        )
    }

    /// Appends scalars `(tag, value)` at global step `step` to the event file and flushes it,
    /// so that a running TensorBoard sees them at once.
    pub fn write_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64();
        for &(tag, value) in scalars {
            self.scalar(tag, value as f32, step as i64, wall)?;
        }
        self.events.flush()?;
        Ok(())
    }

    /// Writes one scalar event.
    fn scalar(&mut self, tag: &str, value: f32, step: i64, wall_time: f64) -> Result<()> {
        let mut v = Vec::new();
        put_bytes(&mut v, 1, tag.as_bytes());
        put_key(&mut v, 2, 5);
        v.extend_from_slice(&value.to_le_bytes());
        let mut summary = Vec::new();
        put_bytes(&mut summary, 1, &v);
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time);
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step as u64);
        put_bytes(&mut event, 5, &summary);
        write_record(&mut self.events, &event)
    }
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn write_record(out: &mut impl Write, payload: &[u8]) -> Result<()> {
    let len = (payload.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(payload)?;
    out.write_all(&masked_crc(payload).to_le_bytes())?;
    Ok(())
}

/// Reads back the scalars of an event file as `(tag, step, value)`, checking every CRC: what
/// TensorBoard itself would do with the file, for tests and tools.
pub fn read_scalars(path: &Path) -> Result<Vec<(String, i64, f32)>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .with_context(|| format!("{}: truncated record at byte {at}", path.display()))?;
        let len = u64::from_le_bytes(header[..8].try_into()?) as usize;
        anyhow::ensure!(
            masked_crc(&header[..8]).to_le_bytes() == header[8..12],
            "{}: bad length CRC at byte {at}",
            path.display()
        );
        let payload = bytes
            .get(at + 12..at + 12 + len)
            .with_context(|| format!("{}: truncated payload at byte {at}", path.display()))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .with_context(|| format!("{}: truncated CRC at byte {at}", path.display()))?;
        anyhow::ensure!(
            masked_crc(payload).to_le_bytes() == crc,
            "{}: bad payload CRC at byte {at}",
            path.display()
        );
        parse_event(payload, &mut out);
        at += 16 + len;
    }
    Ok(out)
}

/// Minimal protobuf walk of an `Event`, collecting its scalar values.
fn parse_event(event: &[u8], out: &mut Vec<(String, i64, f32)>) {
    let mut step = 0;
    let mut values = Vec::new();
    for (field, value) in fields(event) {
        match (field, value) {
            (2, Field::Varint(s)) => step = s as i64,
            (5, Field::Bytes(summary)) => {
                for (f, v) in fields(summary) {
                    if let (1, Field::Bytes(value)) = (f, v) {
                        let mut tag = String::new();
                        let mut x = f32::NAN;
                        for (f, v) in fields(value) {
                            match (f, v) {
                                (1, Field::Bytes(t)) => tag = String::from_utf8_lossy(t).into(),
                                (2, Field::Fixed32(b)) => x = f32::from_le_bytes(b),
                                _ => {}
                            }
                        }
                        values.push((tag, x));
                    }
                }
            }
            _ => {}
        }
    }
    out.extend(values.into_iter().map(|(t, x)| (t, step, x)));
}

enum Field<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

/// Iterates over the fields of a protobuf message; stops at the first malformed byte.
fn fields(mut msg: &[u8]) -> impl Iterator<Item = (u64, Field<'_>)> {
    std::iter::from_fn(move || {
        let key = varint(&mut msg)?;
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut msg)?),
            1 => {
                msg = msg.get(8..)?;
                Field::Fixed64
            }
            2 => {
                let n = varint(&mut msg)? as usize;
                let (b, rest) = (msg.get(..n)?, msg.get(n..)?);
                msg = rest;
                Field::Bytes(b)
            }
            5 => {
                let b: [u8; 4] = msg.get(..4)?.try_into().ok()?;
                msg = &msg[4..];
                Field::Fixed32(b)
            }
            _ => return None,
        };
        Some((key >> 3, field))
    })
}

fn varint(msg: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = msg.split_first()?;
        *msg = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_known_vector() {
        // CRC-32C of "123456789" is 0xE3069283 (RFC 3720).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn scalars_round_trip_through_the_event_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = MetricsWriter::create(dir.path()).unwrap();
        let m = EpochMetrics {
            epoch: 1,
            step: 42,
            train_loss: 0.5,
            test_accuracy: 0.97,
            ..Default::default()
        };
        w.write(&m).unwrap();
        // Flushed: readable while the writer is still open.
        let scalars = read_scalars(w.events_path()).unwrap();
        assert!(scalars.contains(&("test/accuracy".into(), 42, 0.97)));
        assert!(scalars.contains(&("train/epoch_loss".into(), 42, 0.5)));
        assert_eq!(scalars.len(), 3);
        for step in [10, 20, 30] {
            w.write_scalars(
                step,
                &[("train/loss", step as f64), ("train/learning_rate", 1e-3)],
            )
            .unwrap();
        }
        let scalars = read_scalars(w.events_path()).unwrap();
        let loss: Vec<(i64, f32)> = scalars
            .iter()
            .filter(|(tag, _, _)| tag == "train/loss")
            .map(|(_, step, v)| (*step, *v))
            .collect();
        assert_eq!(loss, [(10, 10.0), (20, 20.0), (30, 30.0)]);
        let csv = std::fs::read_to_string(dir.path().join("metrics.csv")).unwrap();
        assert!(csv.starts_with("epoch,step,train_loss"));
        assert!(csv
            .lines()
            .nth(1)
            .unwrap()
            .starts_with("1,42,0.500000,0.970000"));
    }
}
