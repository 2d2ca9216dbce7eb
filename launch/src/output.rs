//! The ranks' output and the launcher's own: every line a rank writes to stdout or stderr goes to
//! the launcher's stdout or stderr prefixed with `[rank R] ` ([`forward_lines`], one thread per
//! stream, whole lines at a time), and the last lines of each rank are kept ([`Tail`]) to quote
//! its error when it wrote no error file ([`error_lines`]). The launcher's own messages go to
//! stderr prefixed with `[ddprun] ` ([`notice`]).

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;

/// Lines of each rank's output kept for the root-cause report.
pub(crate) const TAIL_LINES: usize = 40;

/// A rank's last [`TAIL_LINES`] lines of output (both streams), shared with its forwarders.
pub(crate) type Tail = Arc<Mutex<VecDeque<String>>>;

/// Which of the launcher's own streams a rank's stream is forwarded to.
#[derive(Clone, Copy)]
pub(crate) enum Stream {
    Stdout,
    Stderr,
}

/// Starts a thread that copies `source` line by line to the launcher's `stream`, each line
/// prefixed with `prefix` and written in one piece, keeps the last lines in `tail`, then sends on
/// `done` when `source` closes.
/// A last line without a newline gets one. Write errors (a closed stdout) are ignored and the
/// source is still drained, so that a rank never blocks on a full pipe.
pub(crate) fn forward_lines(
    source: impl Read + Send + 'static,
    prefix: String,
    (stream, tail): (Stream, Tail),
    done: mpsc::Sender<()>,
) {
    thread::spawn(move || {
        let mut reader = BufReader::new(source);
        let mut line = Vec::with_capacity(256);
        let mut out = Vec::with_capacity(256);
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) => break,
                Ok(_) => {}
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
            {
                let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                if tail.len() == TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(String::from_utf8_lossy(&line).into_owned());
            }
            out.clear();
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            if !line.ends_with(b"\n") {
                out.push(b'\n');
            }
            let _ = match stream {
                Stream::Stdout => io::stdout().lock().write_all(&out),
                Stream::Stderr => io::stderr().lock().write_all(&out),
            };
        }
        let _ = done.send(());
    });
}

/// Prints one of the launcher's own messages to stderr.
pub(crate) fn notice(message: &str) {
    let _ = writeln!(io::stderr().lock(), "[ddprun] {message}");
}

/// The lines of a rank's output tail that look like its error (`error`, `panicked`, `Error`
/// and what follows the first of them), else its last three lines.
pub(crate) fn error_lines(tail: &Tail) -> Option<String> {
    let tail = tail.lock().unwrap_or_else(|p| p.into_inner());
    let lines: Vec<&String> = tail.iter().collect();
    let first = lines.iter().position(|l| {
        let l = l.to_ascii_lowercase();
        l.contains("error") || l.contains("panicked")
    });
    let chosen = match first {
        Some(i) => &lines[i..],
        None => &lines[lines.len().saturating_sub(3)..],
    };
    let text = chosen
        .iter()
        .map(|l| l.trim_end())
        .collect::<Vec<_>>()
        .join("\n");
    Some(text).filter(|t| !t.trim().is_empty())
}
