//! burn-ddp's integration tests, one binary: each file below was a test binary of its own, and
//! each linked burn's training stack again (about 5 minutes of CI's two cores for the eight);
//! as modules of one binary they share it. Run one file's tests with its module's name as the
//! filter: `cargo test --release -p burn-ddp --test integration overlap::`.

mod common;

mod checkpoint;
mod comm_hook;
// Not `mod ddp`: the library is `ddp` too.
#[path = "ddp.rs"]
mod equivalence;
mod failures;
mod guide;
mod overlap;
mod powersgd;
mod zero;
