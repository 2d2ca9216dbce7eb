//! Timelines of training steps as Chrome trace event files (`--trace-dir DIR`), which Perfetto
//! (<https://ui.perfetto.dev>) and `chrome://tracing` open.
//!
//! Each rank writes `DIR/trace-rank<R>.json` for a bounded window of steps (`--trace-steps
//! A..B`): one process per rank (`pid` = rank) with two tracks, the training thread (`step`
//! enclosing `data`, `forward`, `backward`, `sync` with its `pack`/`wait`/`unpack` per bucket,
//! and `optimizer`) and the communication thread (one `all_reduce` per bucket), so that the
//! all-reduces show against the packing and unpacking they overlap.
//!
//! Clock: timestamps are microseconds since the UNIX epoch (the wall clock, read once per rank
//! and advanced by the monotonic clock from there), so the ranks' tracks line up when loaded
//! together (ranks on one host share the clock; across hosts, as far as NTP keeps them).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use ddp::{SyncPhase, SyncSpan};
use ddp_comm::CollectiveRecord;
use serde::Serialize;
use serde_json::{json, Value};

/// The track (Chrome trace "thread") a span goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Track {
    /// The training loop's thread: data, forward, backward, packing, unpacking, optimizer.
    Training,
    /// The process group's communication thread: the collectives themselves.
    Communication,
}

impl Track {
    fn tid(self) -> u32 {
        match self {
            Track::Training => 1,
            Track::Communication => 2,
        }
    }
}

/// One Chrome trace event (complete events `X` and metadata `M`).
#[derive(Debug, Serialize)]
struct Event {
    name: String,
    ph: &'static str,
    pid: usize,
    tid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    args: Value,
}

/// One rank's trace of a window of steps, written as a Chrome trace event file.
pub struct Tracer {
    rank: usize,
    steps: Range<u64>,
    path: PathBuf,
    origin: Instant,
    origin_us: f64,
    events: Vec<Event>,
    written: bool,
}

impl Tracer {
    /// A tracer of steps `steps` (global step numbers, from 1; half-open) for `rank`, writing
    /// `dir/trace-rank<rank>.json` (the folder is created now).
    pub fn new(dir: &Path, rank: usize, steps: Range<u64>) -> Result<Tracer> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating trace directory {}", dir.display()))?;
        let origin = Instant::now();
        let origin_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .context("the clock is before 1970")?
            .as_secs_f64()
            * 1e6;
        let mut events = vec![Event {
            name: "process_name".into(),
            ph: "M",
            pid: rank,
            tid: 0,
            cat: None,
            ts: None,
            dur: None,
            args: json!({ "name": format!("rank {rank}") }),
        }];
        for (track, name) in [
            (Track::Training, "training"),
            (Track::Communication, "communication"),
        ] {
            events.push(Event {
                name: "thread_name".into(),
                ph: "M",
                pid: rank,
                tid: track.tid(),
                cat: None,
                ts: None,
                dur: None,
                args: json!({ "name": name }),
            });
        }
        Ok(Tracer {
            rank,
            steps,
            path: dir.join(format!("trace-rank{rank}.json")),
            origin,
            origin_us,
            events,
            written: false,
        })
    }

    /// Whether step `step` (from 1) is in the traced window.
    pub fn covers(&self, step: u64) -> bool {
        self.steps.contains(&step)
    }

    /// Whether the window is over after step `step`: the last traced step is done.
    pub fn done_after(&self, step: u64) -> bool {
        step + 1 >= self.steps.end
    }

    /// The file this tracer writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Microseconds since the UNIX epoch at `t`.
    fn us(&self, t: Instant) -> f64 {
        match t.checked_duration_since(self.origin) {
            Some(d) => self.origin_us + d.as_secs_f64() * 1e6,
            None => self.origin_us - (self.origin - t).as_secs_f64() * 1e6,
        }
    }

    /// Records a span from `start` to `end` on `track`, with `args` (e.g. the step, the
    /// bucket) shown when it is selected.
    pub fn span(&mut self, track: Track, name: &str, start: Instant, end: Instant, args: Value) {
        let (ts, end) = (self.us(start), self.us(end));
        self.push(track, name, ts, end, args);
    }

    /// Records a span given in microseconds since the UNIX epoch (as the process group's
    /// flight recorder reports its collectives).
    pub fn span_us(&mut self, track: Track, name: &str, start_us: u64, end_us: u64, args: Value) {
        self.push(track, name, start_us as f64, end_us as f64, args);
    }

    fn push(&mut self, track: Track, name: &str, ts: f64, end: f64, args: Value) {
        self.events.push(Event {
            name: name.into(),
            ph: "X",
            pid: self.rank,
            tid: track.tid(),
            cat: Some(match track {
                Track::Training => "compute",
                Track::Communication => "communication",
            }),
            ts: Some(ts),
            dur: Some((end - ts).max(0.0)),
            args,
        });
    }

    /// Writes the file (once; later calls do nothing) and returns its path when written now.
    pub fn write(&mut self) -> Result<Option<PathBuf>> {
        if self.written {
            return Ok(None);
        }
        self.written = true;
        let file = json!({
            "traceEvents": self.events,
            "displayTimeUnit": "ms",
            "otherData": {
                "rank": self.rank,
                "steps": format!("{}..{}", self.steps.start, self.steps.end),
                "clock": "microseconds since the UNIX epoch",
            },
        });
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&file)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path)
            .with_context(|| format!("renaming {} into place", tmp.display()))?;
        Ok(Some(self.path.clone()))
    }
}

/// Parses a step window `A..B` (global steps from 1, B excluded; `A..=B` includes B).
pub fn parse_steps(text: &str) -> Result<Range<u64>> {
    let bad = || format!("`{text}` is not a step range like 10..15 (or 10..=14)");
    let (a, b) = text.split_once("..").with_context(bad)?;
    let a: u64 = a.trim().parse().with_context(bad)?;
    let b: u64 = match b.strip_prefix('=') {
        Some(b) => b.trim().parse::<u64>().with_context(bad)? + 1,
        None => b.trim().parse().with_context(bad)?,
    };
    anyhow::ensure!(a >= 1 && a < b, "{}: steps count from 1 and A < B", bad());
    Ok(a..b)
}

/// Records one step's spans: the loop's phases from `marks` (data, forward, backward, sync,
/// optimizer, end) and DDP's per-bucket spans, the all-reduces on the communication track. The
/// all-reduces' times are the communication thread's own (start and end of the collective)
/// from the process group's flight recorder `flight`; when it does not hold this sync's
/// buckets, DDP's view (submission or previous end, to the wait's return) stands in.
pub(crate) fn trace_step(
    tracer: &mut Tracer,
    step: u64,
    marks: [Instant; 6],
    spans: Vec<SyncSpan>,
    flight: &[CollectiveRecord],
) {
    let [data, forward, backward, sync, optimizer, end] = marks;
    let args = json!({ "step": step });
    tracer.span(Track::Training, "step", data, end, args.clone());
    for (name, start, stop) in [
        ("data", data, forward),
        ("forward", forward, backward),
        ("backward", backward, sync),
        ("sync", sync, optimizer),
        ("optimizer", optimizer, end),
    ] {
        tracer.span(Track::Training, name, start, stop, args.clone());
    }
    // The sync's bucket all-reduces are among the last the group ran: the last ones, or, with
    // overlap, the ones before the small all-reduce of its failure slots.
    let reduces: Vec<&SyncSpan> = spans
        .iter()
        .filter(|s| s.phase == SyncPhase::AllReduce)
        .collect();
    let all: Vec<&CollectiveRecord> = flight.iter().filter(|r| r.op == "all_reduce").collect();
    let matches = |window: &[&CollectiveRecord]| {
        window.len() == reduces.len()
            && window.iter().zip(&reduces).all(|(r, s)| {
                r.count == s.elements as u64 && r.started_us.is_some() && r.finished_us.is_some()
            })
    };
    let n = reduces.len();
    let recorded: &[&CollectiveRecord] = (0..2)
        .filter_map(|skip| {
            let end = all.len().checked_sub(skip)?;
            all.get(end.checked_sub(n)?..end)
        })
        .find(|w| matches(w))
        .unwrap_or(&[]);
    let from_flight = n > 0 && recorded.len() == n;
    for s in &spans {
        let (track, name) = match s.phase {
            SyncPhase::Pack => (Track::Training, "pack"),
            SyncPhase::Wait => (Track::Training, "wait"),
            SyncPhase::Unpack => (Track::Training, "unpack"),
            SyncPhase::AllReduce if from_flight => continue,
            SyncPhase::AllReduce => (Track::Communication, "all_reduce"),
        };
        let args = json!({ "step": step, "bucket": s.bucket, "elements": s.elements });
        tracer.span(track, name, s.start, s.end, args);
    }
    if from_flight {
        for (bucket, r) in recorded.iter().enumerate() {
            let args = json!({
                "step": step,
                "bucket": bucket,
                "elements": r.count,
                "dtype": r.dtype,
                "seq": r.seq,
                "queued_us": r.queued_us,
            });
            let (start, end) = (r.started_us.unwrap_or(0), r.finished_us.unwrap_or(0));
            tracer.span_us(Track::Communication, "all_reduce", start, end, args);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn step_ranges_parse() {
        assert_eq!(parse_steps("10..15").unwrap(), 10..15);
        assert_eq!(parse_steps("3..=5").unwrap(), 3..6);
        assert!(parse_steps("5..5").is_err());
        assert!(parse_steps("0..3").is_err());
        assert!(parse_steps("5").is_err());
        assert!(parse_steps("a..b").is_err());
    }

    #[test]
    fn the_file_is_chrome_trace_json_on_the_wall_clock() {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Tracer::new(dir.path(), 3, 2..4).unwrap();
        assert!(!t.covers(1) && t.covers(2) && t.covers(3) && !t.covers(4));
        assert!(!t.done_after(2) && t.done_after(3));
        let start = Instant::now();
        let end = start + Duration::from_millis(2);
        t.span(Track::Training, "forward", start, end, json!({ "step": 2 }));
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let wall = wall.as_micros() as u64;
        t.span_us(
            Track::Communication,
            "all_reduce",
            wall,
            wall + 1000,
            json!({ "bucket": 0 }),
        );
        let path = t.write().unwrap().unwrap();
        assert!(t.write().unwrap().is_none(), "written once");
        let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let events = v["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = events.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "process_name",
                "thread_name",
                "thread_name",
                "forward",
                "all_reduce"
            ]
        );
        let fwd = &events[3];
        assert_eq!(
            (fwd["pid"].as_u64(), fwd["tid"].as_u64()),
            (Some(3), Some(1))
        );
        assert!((fwd["dur"].as_f64().unwrap() - 2000.0).abs() < 1.0);
        let now_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            * 1e6;
        for e in &events[3..] {
            let ts = e["ts"].as_f64().unwrap();
            assert!(
                (now_us - ts).abs() < 60e6,
                "{ts} is not near now ({now_us})"
            );
        }
        assert_eq!(events[4]["tid"], 2);
    }
}
