//! The launcher's own signals: `SIGINT` and `SIGTERM` (forwarded to the ranks, a second one kills
//! at once; never followed by a restart) and `SIGUSR1` (prints where every rank is, the job goes
//! on). The handler only counts signals in atomics; the watch loop reads them through a
//! [`SignalForwarding`] guard.

use std::io;
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::LaunchError;

/// The last signal received by the handler.
static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);
/// How many signals the handler has received; each [`SignalForwarding`] remembers how many it
/// has seen, so that every launch running in this process sees every signal.
static SIGNAL_COUNT: AtomicUsize = AtomicUsize::new(0);
/// How many [`SignalForwarding`] guards are alive, and the handlers that were installed before
/// the first of them (restored when the last one drops).
static INSTALLED: Mutex<(usize, Vec<(i32, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

/// How many SIGUSR1 the handler has received (a request for the hang report, not a stop).
static USR1_COUNT: AtomicUsize = AtomicUsize::new(0);

extern "C" fn record_signal(signal: libc::c_int) {
    if signal == libc::SIGUSR1 {
        USR1_COUNT.fetch_add(1, Ordering::SeqCst);
        return;
    }
    LAST_SIGNAL.store(signal, Ordering::SeqCst);
    SIGNAL_COUNT.fetch_add(1, Ordering::SeqCst);
}

/// `SIGINT`, `SIGTERM` and `SIGUSR1` handlers that record the signal for the watch loop,
/// installed while any such guard lives; dropping the last one restores the previous handlers.
pub(crate) struct SignalForwarding {
    seen: usize,
    usr1_seen: usize,
}

impl SignalForwarding {
    const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1];

    /// Installs the handlers (unless another guard already did).
    pub fn install() -> Result<SignalForwarding, LaunchError> {
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if installed.0 == 0 {
            for signal in Self::SIGNALS {
                // SAFETY: a zeroed sigaction is valid; the handler only touches atomics, which is
                // async-signal-safe.
                let previous = unsafe {
                    let mut action: libc::sigaction = std::mem::zeroed();
                    action.sa_sigaction = record_signal as extern "C" fn(libc::c_int) as usize;
                    action.sa_flags = libc::SA_RESTART;
                    libc::sigemptyset(&mut action.sa_mask);
                    let mut previous: libc::sigaction = std::mem::zeroed();
                    if libc::sigaction(signal, &action, &mut previous) != 0 {
                        let source = io::Error::last_os_error();
                        restore_handlers(&mut installed.1);
                        return Err(LaunchError::SignalHandler { signal, source });
                    }
                    previous
                };
                installed.1.push((signal, previous));
            }
        }
        installed.0 += 1;
        Ok(SignalForwarding {
            seen: SIGNAL_COUNT.load(Ordering::SeqCst),
            usr1_seen: USR1_COUNT.load(Ordering::SeqCst),
        })
    }

    /// Whether a SIGUSR1 arrived since the last call.
    pub fn take_usr1(&mut self) -> bool {
        let count = USR1_COUNT.load(Ordering::SeqCst);
        std::mem::replace(&mut self.usr1_seen, count) != count
    }

    /// The signal received since the last call, if any.
    pub fn take(&mut self) -> Option<i32> {
        let count = SIGNAL_COUNT.load(Ordering::SeqCst);
        if count == self.seen {
            return None;
        }
        self.seen = count;
        Some(LAST_SIGNAL.load(Ordering::SeqCst))
    }
}

impl Drop for SignalForwarding {
    fn drop(&mut self) {
        let mut installed = INSTALLED
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        installed.0 -= 1;
        if installed.0 == 0 {
            restore_handlers(&mut installed.1);
        }
    }
}

/// Puts back the signal handlers saved in `saved`, emptying it.
fn restore_handlers(saved: &mut Vec<(i32, libc::sigaction)>) {
    for (signal, previous) in saved.drain(..).rev() {
        // SAFETY: restores a sigaction obtained from the kernel.
        unsafe { libc::sigaction(signal, &previous, std::ptr::null_mut()) };
    }
}
