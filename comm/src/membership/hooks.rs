//! Test hooks of the membership: a process that kills itself at a named point of a re-form or a
//! join, so that the tests can put a second failure exactly where a membership change is
//! weakest (`comm/tests/elastic.rs`), and one that starts its group slowly. Inert unless
//! [`DIE_ENV`] or [`HOLD_ENV`] is set.

/// `<slot>:<stage>` (or `any:<stage>`): the process in that slot (any) kills itself with
/// `SIGKILL` at `stage`: `reported` (its report of the first re-form written, before anything
/// else), `deciding` (it won the decision of generation 2 and has not published it),
/// `admitted` (a joiner read the generation that admits it into a running job, before forming
/// its group), `founding` (it won the founding decision and has not published generation 1),
/// `refounding` (it won the decision of a new round, `founding.rs`, and has not published it).
pub(crate) const DIE_ENV: &str = "DDP_TEST_ELASTIC_DIE";

/// Kills this process when [`DIE_ENV`] names `slot` (or `any`) and `stage`, saying so on stderr
/// first.
pub(crate) fn die_at(slot: usize, stage: &str) {
    let Ok(value) = std::env::var(DIE_ENV) else {
        return;
    };
    let Some((who, at)) = value.split_once(':') else {
        return;
    };
    if at.trim() != stage || !(who.trim() == "any" || who.trim().parse::<usize>() == Ok(slot)) {
        return;
    }
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    eprintln!("elastic slot {slot}: test hook {DIE_ENV} kills it ({stage}) at {ms}");
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGKILL) };
}

/// `<slot>:<ms>`: the process in that slot, when it forms the group of its first generation,
/// waits `ms` milliseconds once its connections to every peer are made and before it runs
/// them (`join.rs`): its peers hear nothing from it meanwhile, as from a process that starts
/// slowly (many ranks on few cores), while its beat in the store goes on.
pub(crate) const HOLD_ENV: &str = "DDP_TEST_ELASTIC_HOLD";

/// How long [`HOLD_ENV`] holds the process in `slot`, if it names it; says so on stderr.
pub(crate) fn hold_for(slot: usize) -> Option<std::time::Duration> {
    let value = std::env::var(HOLD_ENV).ok()?;
    let (who, ms) = value.split_once(':')?;
    if who.trim().parse::<usize>() != Ok(slot) {
        return None;
    }
    let ms: u64 = ms.trim().parse().ok()?;
    eprintln!("elastic slot {slot}: test hook {HOLD_ENV} holds its group's start for {ms} ms");
    Some(std::time::Duration::from_millis(ms))
}
