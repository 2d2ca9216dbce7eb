//! The test hook of a heal: a joiner that kills itself in the middle of its heal, after its
//! group formed and rank 0 sent it the progress, the parameter ids and the optimizer record,
//! before the weights' broadcast, so that the tests can put a second failure where the
//! survivors are inside the heal's collectives (`apps/tests/elastic.rs`). Inert unless
//! [`DIE_ENV`] is set.

/// `weights`: a rank being healed (a joiner) kills itself with `SIGKILL` right before the
/// weights' broadcast of its heal.
pub(crate) const DIE_ENV: &str = "DDP_TEST_HEAL_DIE";

/// Kills this process when it is being healed and [`DIE_ENV`] names `stage`, saying so on
/// stderr first (with the wall clock in milliseconds, for the tests' timings).
pub(crate) fn die_at(healed: bool, stage: &str) {
    if !healed || std::env::var(DIE_ENV).ok().as_deref().map(str::trim) != Some(stage) {
        return;
    }
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    eprintln!("elastic heal: test hook {DIE_ENV} kills this joiner ({stage}) at {ms}");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGKILL) };
}
