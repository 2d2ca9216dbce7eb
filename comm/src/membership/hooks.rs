//! Test hooks of the membership: a process that kills itself at a named point of a re-form or a
//! join, so that the tests can put a second failure exactly where a membership change is
//! weakest (`comm/tests/elastic.rs`). Inert unless [`DIE_ENV`] is set.

/// `<slot>:<stage>` (or `any:<stage>`): the process in that slot (any) kills itself with
/// `SIGKILL` at `stage`: `reported` (its report of the first re-form written, before anything
/// else), `deciding` (it won the decision of generation 2 and has not published it),
/// `admitted` (a joiner read the generation that admits it into a running job, before forming
/// its group), `founding` (it won the founding decision and has not published generation 1).
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
