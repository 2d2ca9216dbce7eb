//! Peak memory of a `ShardLoader` over a data set much larger than its prefetch: measured from
//! this process's resident set (`VmRSS`, `VmHWM` in /proc/self/status). The only test of its
//! binary, so that no other test's allocations share the process.

use std::sync::mpsc;
use std::time::Duration;

use ddp_data::{ShardLoader, ShardLoaderConfig, ShardSet, ShardWriter};

/// `(VmRSS, VmHWM)` in MiB.
fn rss_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /proc/self/status"))
            / 1024.0
    };
    (field("VmRSS:"), field("VmHWM:"))
}

const SHARDS: usize = 300;
const SHARD_SAMPLES: usize = 1000;
const SAMPLE: usize = 28 * 28;
/// The bound on the loader's peak memory above the resident set before it starts.
const BOUND_MIB: f64 = 32.0;

#[test]
fn peak_memory_stays_bounded_over_a_large_set() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(measure());
    });
    let (data_mib, grown_mib, samples) = rx
        .recv_timeout(Duration::from_secs(240))
        .expect("the measurement did not finish within 240 s");
    println!(
        "{SHARDS} shards, {data_mib:.0} MiB on disk: peak resident memory {grown_mib:.1} MiB \
         above the baseline over one epoch of {samples} samples"
    );
    assert_eq!(samples, SHARDS * SHARD_SAMPLES);
    // The data set is far larger than the bound, so loading it would break it.
    assert!(data_mib > 4.0 * BOUND_MIB, "{data_mib} MiB");
    assert!(
        grown_mib < BOUND_MIB,
        "the loader's peak grew {grown_mib:.1} MiB over a {data_mib:.0} MiB data set"
    );
}

/// Writes the set shard by shard, then streams one epoch with K = 2 prefetched shards and a
/// shuffle buffer of 2 shards; returns (data set MiB, peak growth MiB, samples seen).
fn measure() -> (f64, f64, usize) {
    let dir = tempfile::tempdir().unwrap();
    let mut writer = ShardWriter::create(dir.path(), &[28, 28], 10).unwrap();
    let labels: Vec<u8> = (0..SHARD_SAMPLES).map(|i| (i % 10) as u8).collect();
    let mut state = 0x9e37_79b9u32;
    let mut pixels = vec![0u8; SHARD_SAMPLES * SAMPLE];
    for _ in 0..SHARDS {
        for p in pixels.iter_mut() {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *p = state as u8;
        }
        writer.write_shard(&pixels, &labels).unwrap();
    }
    let index = writer.finish().unwrap();
    drop(pixels);
    let data_bytes: u64 = index.shards.iter().map(|s| s.bytes.unwrap()).sum();
    // Reset the peak to the current resident set where the kernel allows it (Linux >= 4.0);
    // otherwise the peak so far (the writer's, one shard at a time) stays in the measurement,
    // which only makes the check stricter.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let (baseline, _) = rss_mib();

    let set = ShardSet::open(dir.path()).unwrap();
    let config = ShardLoaderConfig {
        batch_size: 64,
        prefetch_shards: 2,
        shuffle_shards: 2,
        ..ShardLoaderConfig::default()
    };
    let mut loader = ShardLoader::<4>::new(set, 1, 0, config).unwrap();
    loader.set_epoch(1);
    let mut samples = 0;
    let mut checksum = 0f64;
    for batch in loader.iter().unwrap() {
        let batch = batch.unwrap();
        samples += batch.targets.len();
        checksum += f64::from(batch.inputs[0]);
    }
    assert!(checksum.is_finite());
    let (_, peak) = rss_mib();
    (
        data_bytes as f64 / (1024.0 * 1024.0),
        peak - baseline,
        samples,
    )
}
