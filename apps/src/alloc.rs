//! The binaries' allocator setting for sharded (ZeRO) runs: large blocks straight from and back
//! to the operating system.
//!
//! The binaries use mimalloc (apps/Cargo.toml says why). mimalloc 3 serves every block up to
//! 2 GiB from arenas it reserves 1 GiB at a time, and a freed block's pages stay in the arena
//! until they are purged, in slices that a later, larger block may not fit. ZeRO frees and
//! allocates blocks of a parameter's size (200 MB for the 50.9 M MLP's first layer) at
//! different points of every step, so the arena grows past what the step holds at once: with
//! 2 ranks at stage 2, 846 MiB peak RSS measured from outside against 625 MiB with glibc's
//! malloc (which maps every block above its threshold on its own and unmaps it when freed) and
//! a limit of 731 MiB. [`large_blocks_from_the_os`] sets mimalloc's `arena_max_object_size`
//! to [`ARENA_MAX_OBJECT_MIB`]: larger blocks are mapped on their own, as glibc does, and
//! smaller ones (the CNN's im2col buffers, 42 MB at batch 64) keep the arena's reuse. Plain
//! DDP keeps mimalloc's default: its large blocks live through the step, and mapping them
//! afresh costs the 50.9 M MLP's step 8-13 % here for 160 MiB less peak RSS.
//!
//! An elastic heal allocates the state it moves all at once (rank 0 encodes burn's optimizer
//! record, a joiner receives and decodes it). [`heal_hooks`] sets the limit on every rank of
//! the heal for its length only (`ddp::set_heal_hooks`), so that the elastic run's steps keep
//! the arena. With the 50.9 M MLP (611 MB of state, 3 ranks on 2 cores) the heal took
//! 0.70-1.43 s (6 runs) against 1.08-1.95 s (4 runs) without it; the joiner decoded its 407 MB
//! record in 0.07-0.09 s against 0.53-0.57 s, while rank 0's encoding took longer (0.36-0.98 s
//! against 0.24-0.48 s). The limit on the joiner alone (4 runs), or everywhere but rank 0's
//! encoding (3 runs), left the decoding at 0.53-0.63 s: it is fast only when rank 0 also
//! encodes with the limit. Not established why; a guess: rank 0 then unmaps its 814 MB of
//! encoding buffers at once, whole huge pages that the joiner's faults find free, where the
//! arena would purge them later, while the joiner's madvised memory waits on compaction.

use std::ffi::{c_int, c_long};
use std::sync::atomic::{AtomicI64, Ordering};

// The options below are mimalloc's own; this links it into every binary and test that calls
// them (the binaries also make it their global allocator).
extern crate mimalloc as _;

/// Largest block, in MiB, that [`large_blocks_from_the_os`] leaves to mimalloc's arenas.
pub const ARENA_MAX_OBJECT_MIB: c_long = 64;

/// `mi_option_arena_max_object_size` in mimalloc 3's `mi_option_t` (its header's enum; the
/// Rust bindings do not name it). [`large_blocks_from_the_os`] checks the index against the
/// option's documented default before it sets anything.
const MI_OPTION_ARENA_MAX_OBJECT_SIZE: c_int = 45;

/// mimalloc 3's default for that option, in KiB (2 GiB on 64-bit).
const MI_ARENA_MAX_OBJECT_SIZE_DEFAULT_KIB: c_long = 2 * 1024 * 1024;

unsafe extern "C" {
    /// mimalloc's option getter (`mimalloc.h`).
    fn mi_option_get(option: c_int) -> c_long;
    /// mimalloc's option setter (`mimalloc.h`).
    fn mi_option_set(option: c_int, value: c_long);
}

/// What [`large_blocks_from_the_os`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaLimit {
    /// Blocks above [`ARENA_MAX_OBJECT_MIB`] now come from the operating system.
    Set,
    /// `MIMALLOC_ARENA_MAX_OBJECT_SIZE` is set: the user's value stands.
    UserSetting,
    /// The option did not hold mimalloc 3's default (another mimalloc): nothing was changed.
    UnknownMimalloc,
}

/// Makes mimalloc map blocks above [`ARENA_MAX_OBJECT_MIB`] from the operating system and
/// unmap them when freed (the module documentation says why sharded runs want it). Leaves a
/// `MIMALLOC_ARENA_MAX_OBJECT_SIZE` of the environment alone. Call it before the model is
/// built; it may be called again (it then sees its own value and changes nothing).
pub fn large_blocks_from_the_os() -> ArenaLimit {
    if std::env::var_os("MIMALLOC_ARENA_MAX_OBJECT_SIZE").is_some() {
        return ArenaLimit::UserSetting;
    }
    let limit_kib = ARENA_MAX_OBJECT_MIB * 1024;
    // SAFETY: mimalloc's option calls take any option index and value; reading and setting an
    // option is thread-safe in mimalloc.
    let current = unsafe { mi_option_get(MI_OPTION_ARENA_MAX_OBJECT_SIZE) };
    if current == limit_kib {
        return ArenaLimit::Set;
    }
    if current != MI_ARENA_MAX_OBJECT_SIZE_DEFAULT_KIB {
        tracing::debug!(
            "mimalloc option {MI_OPTION_ARENA_MAX_OBJECT_SIZE} holds {current}, not \
             arena_max_object_size's default: left as it is"
        );
        return ArenaLimit::UnknownMimalloc;
    }
    // SAFETY: as above; the index was checked against the option's default value.
    unsafe { mi_option_set(MI_OPTION_ARENA_MAX_OBJECT_SIZE, limit_kib) };
    ArenaLimit::Set
}

/// The option's value before the heal in progress, [`NO_HEAL`] when none is.
static BEFORE_HEAL: AtomicI64 = AtomicI64::new(NO_HEAL);

/// [`BEFORE_HEAL`] when no heal is in progress (or the setting was left alone).
const NO_HEAL: i64 = i64::MIN;

/// The hooks of an elastic run ([`ddp::set_heal_hooks`]): the limit of
/// [`large_blocks_from_the_os`] while a heal runs, the previous setting after it (a sharded
/// run keeps its limit).
pub fn heal_hooks() -> ddp::HealHooks {
    ddp::HealHooks {
        begin: heal_begins,
        end: heal_ends,
    }
}

/// Sets the limit and keeps the setting it replaces (see [`heal_hooks`]).
fn heal_begins() {
    // SAFETY: as in large_blocks_from_the_os.
    let before = unsafe { mi_option_get(MI_OPTION_ARENA_MAX_OBJECT_SIZE) };
    let limit = large_blocks_from_the_os();
    if limit == ArenaLimit::Set {
        BEFORE_HEAL.store(before, Ordering::SeqCst);
    }
    tracing::debug!("heal begins: mimalloc's large blocks {limit:?} (option was {before} KiB)");
}

/// Puts back the setting [`heal_begins`] replaced.
fn heal_ends() {
    let before = BEFORE_HEAL.swap(NO_HEAL, Ordering::SeqCst);
    if before != NO_HEAL {
        // SAFETY: as in large_blocks_from_the_os; `before` is what the option held.
        unsafe { mi_option_set(MI_OPTION_ARENA_MAX_OBJECT_SIZE, before) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::alloc::{GlobalAlloc, Layout};

    /// The index is mimalloc 3's `arena_max_object_size`: its default is the documented 2 GiB,
    /// and after the call a block above the limit is mapped on its own (its pages leave the
    /// process's resident set when it is freed, which an arena's purge delay would not do).
    #[test]
    fn large_blocks_are_returned_to_the_os_when_freed() {
        if std::env::var_os("MIMALLOC_ARENA_MAX_OBJECT_SIZE").is_some() {
            panic!("unset MIMALLOC_ARENA_MAX_OBJECT_SIZE to run this test");
        }
        // SAFETY: as in large_blocks_from_the_os.
        let get = || unsafe { mi_option_get(MI_OPTION_ARENA_MAX_OBJECT_SIZE) };
        assert_eq!(
            get(),
            MI_ARENA_MAX_OBJECT_SIZE_DEFAULT_KIB,
            "not mimalloc 3's option"
        );
        // A heal sets the limit for its length only.
        let hooks = heal_hooks();
        (hooks.begin)();
        assert_eq!(get(), ARENA_MAX_OBJECT_MIB * 1024, "during a heal");
        (hooks.end)();
        assert_eq!(get(), MI_ARENA_MAX_OBJECT_SIZE_DEFAULT_KIB, "after a heal");
        assert_eq!(large_blocks_from_the_os(), ArenaLimit::Set);
        // A sharded run's limit stays after a heal.
        (hooks.begin)();
        (hooks.end)();
        assert_eq!(
            get(),
            ARENA_MAX_OBJECT_MIB * 1024,
            "a sharded run after a heal"
        );
        assert_eq!(get(), ARENA_MAX_OBJECT_MIB * 1024);
        assert_eq!(large_blocks_from_the_os(), ArenaLimit::Set, "a second call");

        // A 256 MiB block through mimalloc (not the test harness's allocator): touched, it is
        // resident; freed, its pages go back at once.
        let layout = Layout::from_size_align(256 << 20, 64).unwrap();
        let rss = || resident_kib().expect("/proc/self/status has VmRSS");
        let start = rss();
        // SAFETY: a non-zero layout, freed below with the same allocator and layout.
        let p = unsafe { GlobalAlloc::alloc(&mimalloc::MiMalloc, layout) };
        assert!(!p.is_null());
        // SAFETY: p points at `layout.size()` writable bytes.
        unsafe { std::ptr::write_bytes(p, 1, layout.size()) };
        let touched = rss();
        // SAFETY: p came from MiMalloc with this layout.
        unsafe { GlobalAlloc::dealloc(&mimalloc::MiMalloc, p, layout) };
        let freed = rss();
        assert!(
            touched >= start + 200 * 1024,
            "touching 256 MiB raised RSS from {start} to {touched} KiB only"
        );
        assert!(
            freed + 200 * 1024 <= touched,
            "freeing 256 MiB left RSS at {freed} KiB (was {touched} KiB touched)"
        );
    }

    /// This process's resident set in KiB.
    fn resident_kib() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }
}
