//! `ddp-zero-bench`: one rank of one ZeRO benchmark configuration (see
//! `ddp_bench::zero`); `cargo xtask bench-zero` runs it under `ddprun` for world sizes
//! 1, 2 and 4 at stages 0, 1 and 2.
//!
//! ```text
//! ddprun --nproc-per-node 2 -- target/release/ddp-zero-bench --stage 2
//! ```
//!
//! The allocator is chosen per run by `DDP_ALLOCATOR` (read once, before the first
//! allocation): `mimalloc` (default, as the trainers: freed pages stay mapped, so a step
//! allocates without page faults; at stages 1 and 2 blocks above 64 MiB are mapped on their
//! own and unmapped when freed, as the trainers' sharded runs do: `ddp_apps::alloc`) or
//! `system` (glibc's malloc: large blocks mapped fresh and unmapped on free). Peak memory
//! differs: burn's CPU backend asks for a zeroed buffer for every matmul output and copies it
//! into an aligned one at once (`docs/burn-notes.md`, section f); mimalloc writes those zeros
//! into reused memory and keeps freed pages, while glibc's fresh pages are never written.
//! `cargo xtask bench-zero` measures time with mimalloc and memory with both.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU8, Ordering};

use anyhow::Result;
use clap::Parser;
use ddp_bench::zero::{self as zero_bench, ZeroBenchArgs};

#[global_allocator]
static GLOBAL: BenchAlloc = BenchAlloc;

/// The allocator `DDP_ALLOCATOR` names (see the module documentation).
struct BenchAlloc;

/// 0: not decided yet; 1: mimalloc; 2: glibc.
static MODE: AtomicU8 = AtomicU8::new(0);

/// Whether glibc's malloc serves this process, decided by the first call (before any
/// allocation exists, so that every block is freed by the allocator that made it; `getenv`
/// allocates nothing).
fn system() -> bool {
    let mut m = MODE.load(Ordering::Relaxed);
    if m == 0 {
        // SAFETY: a NUL-terminated name; the result is read at once, before other threads run.
        let value = unsafe { libc::getenv(c"DDP_ALLOCATOR".as_ptr()) };
        // SAFETY: getenv returns a NUL-terminated string or null.
        let system = !value.is_null() && unsafe { std::ffi::CStr::from_ptr(value) } == c"system";
        m = if system { 2 } else { 1 };
        MODE.store(m, Ordering::Relaxed);
    }
    m == 2
}

// SAFETY: one allocator per process (see `system`), every call forwarded to it.
unsafe impl GlobalAlloc for BenchAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        unsafe {
            if system() {
                System.alloc(layout)
            } else {
                mimalloc::MiMalloc.alloc(layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded.
        unsafe {
            if system() {
                System.alloc_zeroed(layout)
            } else {
                mimalloc::MiMalloc.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded to the allocator that made the block.
        unsafe {
            if system() {
                System.dealloc(ptr, layout)
            } else {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded to the allocator that made the block.
        unsafe {
            if system() {
                System.realloc(ptr, layout, new_size)
            } else {
                mimalloc::MiMalloc.realloc(ptr, layout, new_size)
            }
        }
    }
}

/// What ZeRO sharding saves per rank, and what a step costs.
#[derive(Parser)]
#[command(version)]
struct Cli {
    #[command(flatten)]
    args: ZeroBenchArgs,
    /// Compute threads of this rank (default 1).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Stage 0 only: time the steps with and without `--overlap` in the same run, alternating
    /// (`ddp_bench::zero::overlap_pairs`), and print `OVERLAP_PAIRS {json}`.
    #[arg(long)]
    overlap_pairs: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    ddp_apps::train::set_compute_threads(cli.threads)?;
    if cli.args.stage > 0 {
        // As the trainers do for a sharded run (ddp_apps::alloc; no effect under glibc).
        ddp_apps::alloc::large_blocks_from_the_os();
    }
    if cli.overlap_pairs {
        if let Some(pairs) = zero_bench::overlap_pairs(&cli.args)? {
            println!("OVERLAP_PAIRS {}", serde_json::to_string(&pairs)?);
        }
    } else if let Some(result) = zero_bench::report(&cli.args)? {
        println!("ZERO_BENCH {}", serde_json::to_string(&result)?);
    }
    Ok(())
}
