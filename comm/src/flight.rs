//! The flight recorder: every group keeps its last [`FLIGHT_RECORDS`] collectives (sequence
//! number, op, dtype, count, state, times) so that a failure or a hang can be explained after the
//! fact ("rank 1 last completed broadcast #57 and never entered #58"), the way PyTorch's NCCL
//! flight recorder does.
//!
//! The records are written as JSON (`flight-rank<R>.json`, see [`FlightDump`]) into the
//! directory named by `DDP_TRACE_DIR`:
//! - when a collective fails (the group's first error, whatever caused it),
//! - when a [`crate::Work::wait`] gives up ([`crate::CommError::WaitTimeout`]),
//! - when the process receives `SIGUSR1` (checked by the group's liveness thread, at most a
//!   second later; the handler itself only sets a flag). The handler is installed only while
//!   `DDP_TRACE_DIR` is set, so a process that does not ask for records keeps `SIGUSR1`'s
//!   default action.
//!
//! `ddprun` sets `DDP_TRACE_DIR` for its ranks, forwards its own `SIGUSR1` to them, and merges
//! the files into one hang report with [`hang_report`]. Files are written whole (a temporary
//! file synced and renamed into place, `ddp_fsio::atomic_write`), so a reader never sees half a
//! record.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};

/// Prefix of the marker file (`.sigusr1-rank<R>`) a group with a trace directory leaves there
/// once its SIGUSR1 handler is installed, so that a launcher signals only ranks that handle it.
pub const HANDLER_MARKER: &str = ".sigusr1-rank";

/// The marker file name of `rank` (see [`HANDLER_MARKER`]).
pub fn handler_marker(rank: usize) -> String {
    format!("{HANDLER_MARKER}{rank}")
}

/// How many collectives a group remembers.
pub const FLIGHT_RECORDS: usize = 256;

/// The environment variable naming the directory for flight records.
pub const TRACE_DIR_ENV: &str = "DDP_TRACE_DIR";

/// Where a recorded collective stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    /// Submitted, waiting behind earlier collectives on the communication thread.
    Queued,
    /// Being run by the communication thread.
    Running,
    /// Finished successfully.
    Completed,
    /// Finished with an error.
    Failed,
}

/// One collective in a group's flight recorder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CollectiveRecord {
    /// The collective's sequence number in the group (as in `all_reduce #58`); `None` while it
    /// is queued (numbers are given when the communication thread starts it).
    pub seq: Option<u64>,
    /// The collective: `all_reduce`, `broadcast`, `all_gather`, `reduce_scatter`, `barrier`.
    pub op: String,
    /// Element type (`f32`, `bf16`, ...).
    pub dtype: String,
    /// Elements in the caller's buffer.
    pub count: u64,
    /// Where it stands.
    pub state: RecordState,
    /// When it was submitted (microseconds since the UNIX epoch).
    pub queued_us: u64,
    /// When the communication thread started it.
    pub started_us: Option<u64>,
    /// When it finished (completed or failed).
    pub finished_us: Option<u64>,
    /// The error, for a failed collective.
    pub error: Option<String>,
}

impl CollectiveRecord {
    /// `all_reduce #58` (or `all_reduce (queued)`).
    pub fn name(&self) -> String {
        match self.seq {
            Some(s) => format!("{} #{s}", self.op),
            None => format!("{} (queued)", self.op),
        }
    }
}

/// What `flight-rank<R>.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlightDump {
    /// The rank that wrote it.
    pub rank: usize,
    /// The group's size.
    pub world_size: usize,
    /// Why it was written: `failure`, `timeout` or `SIGUSR1`.
    pub reason: String,
    /// When it was written (microseconds since the UNIX epoch).
    pub written_us: u64,
    /// The last collectives, oldest first.
    pub records: Vec<CollectiveRecord>,
}

/// Microseconds since the UNIX epoch, now (the stamps of the records).
pub use crate::clock::now_us;

/// A group's recorder (shared by the submitting threads and the communication thread).
pub(crate) struct FlightRecorder {
    rank: usize,
    world: usize,
    dir: Option<PathBuf>,
    inner: Mutex<Ring>,
    /// The SIGUSR1 count this recorder has answered.
    signals_seen: AtomicU64,
}

struct Ring {
    /// Submission index of `records[0]`.
    first: u64,
    records: VecDeque<CollectiveRecord>,
}

/// Counts SIGUSR1 deliveries (the handler only increments it).
static SIGUSR1_COUNT: AtomicU64 = AtomicU64::new(0);
/// Live recorders, for the SIGUSR1 dump.
static RECORDERS: Mutex<Vec<Weak<FlightRecorder>>> = Mutex::new(Vec::new());

extern "C" fn on_sigusr1(_: libc::c_int) {
    SIGUSR1_COUNT.fetch_add(1, Ordering::Relaxed);
}

impl FlightRecorder {
    /// A recorder for `rank` of `world`, dumping into `dir` when given (then SIGUSR1 dumps
    /// too).
    pub fn new(rank: usize, world: usize, dir: Option<PathBuf>) -> Arc<FlightRecorder> {
        let recorder = Arc::new(FlightRecorder {
            rank,
            world,
            dir,
            inner: Mutex::new(Ring {
                first: 0,
                records: VecDeque::with_capacity(FLIGHT_RECORDS),
            }),
            signals_seen: AtomicU64::new(SIGUSR1_COUNT.load(Ordering::Relaxed)),
        });
        if recorder.dir.is_some() {
            let mut all = RECORDERS.lock().unwrap_or_else(|p| p.into_inner());
            all.retain(|r| r.strong_count() > 0);
            if all.is_empty() {
                // SAFETY: the handler only increments an atomic, which is async-signal-safe.
                unsafe {
                    libc::signal(
                        libc::SIGUSR1,
                        on_sigusr1 as extern "C" fn(libc::c_int) as libc::sighandler_t,
                    );
                }
            }
            all.push(Arc::downgrade(&recorder));
            if let Some(dir) = &recorder.dir {
                let _ = std::fs::create_dir_all(dir);
                let _ = std::fs::write(dir.join(handler_marker(rank)), b"");
            }
        }
        recorder
    }

    /// Records a submission; returns its index for [`FlightRecorder::start`] and
    /// [`FlightRecorder::finish`].
    pub fn queue(&self, op: &str, dtype: &str, count: usize) -> u64 {
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if ring.records.len() == FLIGHT_RECORDS {
            ring.records.pop_front();
            ring.first += 1;
        }
        ring.records.push_back(CollectiveRecord {
            seq: None,
            op: op.to_string(),
            dtype: dtype.to_string(),
            count: count as u64,
            state: RecordState::Queued,
            queued_us: now_us(),
            started_us: None,
            finished_us: None,
            error: None,
        });
        ring.first + ring.records.len() as u64 - 1
    }

    fn update(&self, index: u64, f: impl FnOnce(&mut CollectiveRecord)) {
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = index.checked_sub(ring.first) {
            if let Some(r) = ring.records.get_mut(i as usize) {
                f(r);
            }
        }
    }

    /// The communication thread starts collective `index` as number `seq`.
    pub fn start(&self, index: u64, seq: u64) {
        self.update(index, |r| {
            r.seq = Some(seq);
            r.state = RecordState::Running;
            r.started_us = Some(now_us());
        });
    }

    /// Collective `index` finished, with `error` if it failed.
    pub fn finish(&self, index: u64, error: Option<String>) {
        self.update(index, |r| {
            r.state = if error.is_some() {
                RecordState::Failed
            } else {
                RecordState::Completed
            };
            r.finished_us = Some(now_us());
            r.error = error;
        });
    }

    /// The records, oldest first.
    pub fn records(&self) -> Vec<CollectiveRecord> {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        ring.records.iter().cloned().collect()
    }

    /// Writes the records to `DDP_TRACE_DIR/flight-rank<R>.json` (nothing without the
    /// variable). Errors are logged, not returned: the recorder must never turn a failure into
    /// a different one.
    pub fn dump(&self, reason: &str) {
        let Some(dir) = &self.dir else { return };
        let dump = FlightDump {
            rank: self.rank,
            world_size: self.world,
            reason: reason.to_string(),
            written_us: now_us(),
            records: self.records(),
        };
        if let Err(e) = write_dump(dir, &dump) {
            tracing::warn!(
                "rank {}: cannot write the flight record into {}: {e}",
                self.rank,
                dir.display()
            );
        }
    }

    /// Dumps if a SIGUSR1 arrived since the last look (called by the liveness thread).
    pub fn poll_signal(&self) {
        let count = SIGUSR1_COUNT.load(Ordering::Relaxed);
        if self.dir.is_some() && self.signals_seen.swap(count, Ordering::Relaxed) != count {
            self.dump("SIGUSR1");
        }
    }
}

fn write_dump(dir: &Path, dump: &FlightDump) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!("flight-rank{}.json", dump.rank));
    let text = serde_json::to_vec_pretty(dump).map_err(std::io::Error::other)?;
    ddp_fsio::atomic_write(&path, |file| file.write_all(&text))
}

/// Reads every `flight-rank<R>.json` in `dir`. A file that cannot be read or parsed is reported
/// in the second list (path and reason), not fatal.
pub fn read_dumps(dir: &Path) -> (Vec<FlightDump>, Vec<String>) {
    let mut dumps = Vec::new();
    let mut bad = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (dumps, bad);
    };
    let mut paths: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("flight-rank") && n.ends_with(".json"))
        })
        .collect();
    paths.sort();
    for path in paths {
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<FlightDump>(&b).map_err(|e| e.to_string()))
        {
            Ok(d) => dumps.push(d),
            Err(e) => bad.push(format!("{}: {e}", path.display())),
        }
    }
    dumps.sort_by_key(|d| d.rank);
    (dumps, bad)
}

/// `HH:MM:SS.mmm` (UTC) of a time in microseconds since the UNIX epoch.
pub fn clock(us: u64) -> String {
    let ms = us / 1000;
    let s = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03} UTC",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        ms % 1000
    )
}

/// Merges the ranks' flight records into a hang report, one line per group of ranks in the
/// same place, e.g.
///
/// ```text
/// ranks 0, 2 wait in all_reduce #58 (4096 f32) since 12:01:07.250 UTC
/// rank 1 last completed broadcast #57 and never entered #58
/// ```
///
/// How: each rank's newest started collective tells where it is (running or failed: it waits
/// or failed there; completed: it is between collectives). The furthest collective any rank
/// started is the one the group is stuck in; a rank whose last completed collective is before
/// it "never entered" it. Ranks of `world_size` with no file are listed as such.
pub fn hang_report(dumps: &[FlightDump], world_size: usize) -> String {
    use std::collections::BTreeMap;
    let furthest = dumps
        .iter()
        .flat_map(|d| d.records.iter().filter_map(|r| r.seq))
        .max();
    // (where, description) -> (ranks, earliest time of the event): ranks in the same place
    // share a line, which gives the earliest of their times.
    let mut lines: BTreeMap<(u64, String), (Vec<usize>, Option<u64>)> = BTreeMap::new();
    for d in dumps {
        let started: Vec<&CollectiveRecord> =
            d.records.iter().filter(|r| r.seq.is_some()).collect();
        // A rank that failed is reported at its first failed collective (later ones only say
        // "the group failed earlier"); else where it is now.
        let last = started
            .iter()
            .find(|r| r.state == RecordState::Failed)
            .or(started.last());
        let last_done = started
            .iter()
            .rev()
            .find(|r| r.state == RecordState::Completed);
        let (order, text, at) = match last {
            Some(r) if r.state == RecordState::Running => (
                r.seq.unwrap_or(0),
                format!("wait in {} ({} {}) since", r.name(), r.count, r.dtype),
                Some(r.started_us.unwrap_or(r.queued_us)),
            ),
            Some(r) if r.state == RecordState::Failed => (
                r.seq.unwrap_or(0),
                format!(
                    "failed in {}: {}; first at",
                    r.name(),
                    r.error.as_deref().unwrap_or("?")
                ),
                Some(r.finished_us.unwrap_or(r.queued_us)),
            ),
            _ => {
                let mut t = match last_done {
                    Some(r) => format!("last completed {}", r.name()),
                    None => "completed no collective".to_string(),
                };
                if let Some(f) = furthest {
                    if last_done.and_then(|r| r.seq).is_none_or(|s| s < f) {
                        let _ = write!(t, " and never entered #{f}");
                    }
                }
                (last_done.and_then(|r| r.seq).unwrap_or(0), t, None)
            }
        };
        let entry = lines.entry((order, text)).or_default();
        entry.0.push(d.rank);
        entry.1 = match (entry.1, at) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
    let mut out = String::new();
    for ((_, text), (ranks, at)) in lines.iter().rev() {
        let _ = match at {
            Some(at) => writeln!(out, "{} {text} {}", ranks_phrase(ranks), clock(*at)),
            None => writeln!(out, "{} {text}", ranks_phrase(ranks)),
        };
    }
    let missing: Vec<usize> = (0..world_size)
        .filter(|r| !dumps.iter().any(|d| d.rank == *r))
        .collect();
    if !missing.is_empty() {
        let _ = writeln!(
            out,
            "{} left no flight record (killed before it could write one, or not started)",
            ranks_phrase(&missing)
        );
    }
    out
}

/// "rank 1" or "ranks 0, 2".
fn ranks_phrase(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    if ranks.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, op: &str, state: RecordState) -> CollectiveRecord {
        CollectiveRecord {
            seq: Some(seq),
            op: op.into(),
            dtype: "f32".into(),
            count: 4096,
            state,
            queued_us: 1_000_000,
            started_us: Some(43_267_250_000),
            finished_us: None,
            error: None,
        }
    }

    fn dump(rank: usize, records: Vec<CollectiveRecord>) -> FlightDump {
        FlightDump {
            rank,
            world_size: 4,
            reason: "timeout".into(),
            written_us: 0,
            records,
        }
    }

    #[test]
    fn the_report_says_who_waits_where_and_who_never_came() {
        use RecordState::*;
        let waiting = vec![
            rec(57, "broadcast", Completed),
            rec(58, "all_reduce", Running),
        ];
        let dumps = vec![
            dump(0, waiting.clone()),
            dump(
                1,
                vec![
                    rec(56, "all_reduce", Completed),
                    rec(57, "broadcast", Completed),
                ],
            ),
            dump(2, waiting),
        ];
        let report = hang_report(&dumps, 4);
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(
            lines,
            [
                "ranks 0, 2 wait in all_reduce #58 (4096 f32) since 12:01:07.250 UTC",
                "rank 1 last completed broadcast #57 and never entered #58",
                "rank 3 left no flight record (killed before it could write one, or not started)",
            ],
            "{report}"
        );
    }

    #[test]
    fn the_recorder_keeps_the_last_records_in_order() {
        let r = FlightRecorder::new(0, 2, None);
        for i in 0..(FLIGHT_RECORDS as u64 + 10) {
            let idx = r.queue("all_reduce", "f32", 3);
            assert_eq!(idx, i);
            r.start(idx, i);
            r.finish(idx, (i % 2 == 1).then(|| "boom".to_string()));
        }
        let recs = r.records();
        assert_eq!(recs.len(), FLIGHT_RECORDS);
        assert_eq!(recs[0].seq, Some(10));
        assert_eq!(recs.last().unwrap().seq, Some(FLIGHT_RECORDS as u64 + 9));
        assert_eq!(recs.last().unwrap().state, RecordState::Failed);
        assert_eq!(recs[0].state, RecordState::Completed);
        // An index that has left the ring is ignored, not a panic.
        r.finish(0, None);
    }
}
