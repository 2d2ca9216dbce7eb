//! Time, in the two forms the crate needs: deadlines on the monotonic clock (every wait of the
//! crate has one, and asks [`remaining`] how long it may still block), and wall-clock stamps in
//! microseconds since the UNIX epoch ([`now_us`]) for records that other processes read.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Time left until `deadline`: zero once it has passed, so it can be handed to any blocking
/// call as its timeout.
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// Microseconds since the UNIX epoch, now (0 if the clock is before the epoch).
pub fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
