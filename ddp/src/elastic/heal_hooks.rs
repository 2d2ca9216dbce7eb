//! Functions a program runs around an elastic heal ([`set_heal_hooks`]): the heal allocates
//! the state it moves all at once (rank 0 encodes burn's optimizer record; a joiner receives
//! and decodes it), hundreds of megabytes for a large model, and how fast fresh memory comes
//! depends on the program's allocator, which this library does not know. The trainers use the
//! hooks to have mimalloc map those blocks on their own for the heal's length
//! (`ddp_apps::alloc`): with the 50.9 M-parameter MLP (611 MB of state) the whole heal took
//! 0.70-1.43 s that way (6 runs) against 1.08-1.95 s (4 runs) from mimalloc's arenas.

use std::sync::OnceLock;

/// What [`set_heal_hooks`] installs.
#[derive(Debug, Clone, Copy)]
pub struct HealHooks {
    /// Runs when a heal that moves state starts on this rank (rank 0, every survivor and
    /// every joiner of a generation that admits joiners), before anything is allocated.
    pub begin: fn(),
    /// Runs when that heal ends on this rank (the weights are in), whether it succeeded or
    /// failed.
    pub end: fn(),
}

/// The process's hooks, set at most once.
static HOOKS: OnceLock<HealHooks> = OnceLock::new();

/// Installs `hooks` for every later heal of this process. Once per process: a second call
/// leaves the first hooks in place and returns the ones it was given.
pub fn set_heal_hooks(hooks: HealHooks) -> Result<(), HealHooks> {
    HOOKS.set(hooks)
}

/// A heal in progress on this rank: [`HealHooks::begin`] ran when it was made,
/// [`HealHooks::end`] runs when it is dropped.
pub(crate) struct HealScope {
    hooks: Option<HealHooks>,
}

impl HealScope {
    /// Runs the begin hook, if any.
    pub(crate) fn enter() -> HealScope {
        let hooks = HOOKS.get().copied();
        if let Some(h) = hooks {
            (h.begin)();
        }
        HealScope { hooks }
    }
}

impl Drop for HealScope {
    fn drop(&mut self) {
        if let Some(h) = self.hooks {
            (h.end)();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static BEGUN: AtomicUsize = AtomicUsize::new(0);
    static ENDED: AtomicUsize = AtomicUsize::new(0);

    fn begin() {
        BEGUN.fetch_add(1, Ordering::SeqCst);
    }

    fn end() {
        ENDED.fetch_add(1, Ordering::SeqCst);
    }

    /// The hooks run once around a scope, also when it is left early with an error;
    /// a second installation is refused.
    #[test]
    fn hooks_run_around_a_heal_and_install_once() {
        set_heal_hooks(HealHooks { begin, end }).expect("first installation");
        assert!(set_heal_hooks(HealHooks {
            begin: end,
            end: begin
        })
        .is_err());
        {
            let _scope = HealScope::enter();
            assert_eq!(BEGUN.load(Ordering::SeqCst), 1);
            assert_eq!(
                ENDED.load(Ordering::SeqCst),
                0,
                "end ran before the heal ended"
            );
        }
        assert_eq!(ENDED.load(Ordering::SeqCst), 1);
        fn failing_heal() -> Result<(), ()> {
            let _scope = HealScope::enter();
            Err(())
        }
        assert!(failing_heal().is_err());
        assert_eq!(
            (BEGUN.load(Ordering::SeqCst), ENDED.load(Ordering::SeqCst)),
            (2, 2)
        );
    }
}
