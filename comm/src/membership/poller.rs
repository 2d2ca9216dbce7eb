//! Rank 0's look-out for joiners: a thread with a store connection of its own that looks at
//! the join requests every poll interval and says whether one newer than the generation is
//! waiting, so that the next commit vote grows the job.
//!
//! A request counts only when its record passes the check of the job's secret
//! (`elastic_seal.rs`): a stranger who bumps the `joins` counter and writes a request every
//! 100 ms does not make the job re-form each time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::GroupConfig;
use crate::error::CommError;
use crate::membership::seal::open;
use crate::rendezvous::store::Store;

/// Deadline of one store call of the look-out.
const CALL: Duration = Duration::from_secs(30);

/// Rank 0's look-out (see the module documentation).
pub(crate) struct Poller {
    waiting: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Starts the look-out of the process in `slot` (with `base`'s store and secret, looking
    /// every `poll`) for requests past the first `seen`, on a connection of its own to the
    /// store of `store`.
    pub fn start(
        (slot, base, poll): (usize, &GroupConfig, Duration),
        store: &Store,
        seen: u64,
    ) -> Result<Poller, CommError> {
        let own =
            store.torch_connection_of_its_own(slot, &base.master_addr, base.master_port, CALL)?;
        let secret = base.token.clone();
        let waiting = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (w, s) = (waiting.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("ddp-elastic-poll".into())
            .spawn(move || {
                let mut warned = false;
                // Requests up to this one were looked at (and were strangers').
                let mut checked = seen;
                while !s.load(Ordering::Acquire) {
                    match look(&own, secret.as_deref(), &mut checked) {
                        Ok(true) => w.store(true, Ordering::Release),
                        Ok(false) => {}
                        Err(e) if !warned => {
                            warned = true;
                            tracing::warn!("elastic: cannot look for joiners: {e}");
                        }
                        Err(_) => {}
                    }
                    std::thread::sleep(poll);
                }
            })
            .map_err(|e| CommError::Internal {
                rank: slot,
                message: format!("cannot start the elastic look-out thread: {e}"),
            })?;
        Ok(Poller {
            waiting,
            stop,
            thread: Some(thread),
        })
    }

    /// Whether a joiner is waiting.
    pub fn waiting(&self) -> bool {
        self.waiting.load(Ordering::Acquire)
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether a request past `checked` passes the check; requests that fail it are passed over
/// (`checked` moves past them). A request counted but not yet written is looked at again.
fn look(store: &Store, secret: Option<&str>, checked: &mut u64) -> Result<bool, CommError> {
    let count = store.add("joins", 0)?.max(0) as u64;
    while *checked < count {
        let key = format!("join/{}", *checked + 1);
        if !store.check(&[&key])? {
            return Ok(false);
        }
        let bytes = store.get_timeout(&key, CALL)?;
        if open(secret, &key, &bytes).is_ok() {
            return Ok(true);
        }
        tracing::warn!(
            "elastic: ignored the join request at {key:?}: it fails the job's secret check"
        );
        *checked += 1;
    }
    Ok(false)
}
