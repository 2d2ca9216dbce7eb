//! PowerSGD against PyTorch's own `powerSGD_hook` (fixtures written by
//! `tests/fixtures/powersgd/generate.py`, which runs the hook on 2 gloo ranks), and the
//! properties a training run relies on: every rank gets the same bits, a resumed hook
//! continues bit for bit, a saved state loads only where it fits. Ranks are threads, each with
//! its own process group over loopback sockets.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;

use ddp::{BucketDesc, GradSlot, PowerSgd, PowerSgdConfig, ProcessGroup};
use ddp_comm::Transport;
use serde_json::Value;

/// Runs `f` on `n` ranks, one thread each, each with its own process group over TCP.
fn run_ranks<T: Send>(n: usize, f: impl Fn(Arc<ProcessGroup>) -> T + Sync) -> Vec<T> {
    common::run_ranks_over(n, Transport::Tcp, f)
}

/// SplitMix64's output for state `key` (the generator's definition, as the fixture's).
fn mix(key: u64) -> u64 {
    let mut z = key.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The fixture's gradients: element i of bucket b on rank r at step s.
fn gradient(rank: u64, step: u64, bucket: u64, n: usize) -> Vec<f32> {
    let key = ((rank * 1000 + step) * 100 + bucket) << 32;
    (0..n as u64)
        .map(|i| (mix(key + i) >> 40) as f32 / (1u32 << 23) as f32 - 1.0)
        .collect()
}

/// A bucket of parts, each a list of shapes packed one after another.
fn bucket(parts: &[Vec<Vec<usize>>]) -> BucketDesc {
    let mut grads = Vec::new();
    let mut part_lens = Vec::new();
    for (p, shapes) in parts.iter().enumerate() {
        let mut at = 0;
        for s in shapes {
            grads.push(GradSlot {
                part: p,
                offset: at,
                shape: s.clone(),
            });
            at += s.iter().product::<usize>();
        }
        part_lens.push(at);
    }
    BucketDesc { part_lens, grads }
}

/// `flat` cut into the bucket's parts.
fn split(desc: &BucketDesc, flat: &[f32]) -> Vec<Vec<f32>> {
    let mut at = 0;
    desc.part_lens
        .iter()
        .map(|&l| {
            at += l;
            flat[at - l..at].to_vec()
        })
        .collect()
}

/// PowerSGD with `config`, bound to buckets `descs`.
fn bound(config: PowerSgdConfig, descs: &[BucketDesc]) -> PowerSgd {
    let mut hook = PowerSgd::new(config).unwrap();
    hook.bind(descs).unwrap();
    hook
}

/// What a rank's run gives: every step's averaged buckets (flat), and the saved state.
struct RankRun {
    outputs: Vec<Vec<f32>>,
    bytes: Vec<u64>,
    state: Vec<u8>,
}

/// Runs `hook` on this rank for `steps` steps from `first`, every bucket submitted before any
/// is waited for (as the pipeline does), on the fixture's gradients.
fn train(
    pg: &ProcessGroup,
    hook: &mut PowerSgd,
    descs: &[BucketDesc],
    first: u64,
    steps: u64,
) -> RankRun {
    let rank = pg.rank() as u64;
    let (mut outputs, mut bytes) = (Vec::new(), Vec::new());
    for step in first..first + steps {
        let flights: Vec<_> = descs
            .iter()
            .enumerate()
            .map(|(b, d)| {
                let n = d.part_lens.iter().sum();
                let parts = split(d, &gradient(rank, step, b as u64, n));
                hook.submit(pg, b, parts).unwrap()
            })
            .collect();
        for f in flights {
            bytes.push(f.bytes());
            outputs.push(hook.wait(pg, f).unwrap().concat());
        }
        hook.end_step();
    }
    RankRun {
        outputs,
        bytes,
        state: hook.state_bytes(),
    }
}

/// A bucket's saved error feedback and Q.
type SavedBucket = (Option<Vec<f32>>, Option<Vec<f32>>);

/// The state's header and, per bucket, its error feedback and Q (the documented format:
/// `DDPPSGD1`, u32 header length, JSON header, f32 payload).
fn read_state(bytes: &[u8]) -> (Value, Vec<SavedBucket>) {
    assert_eq!(&bytes[..8], b"DDPPSGD1");
    let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[12..12 + len]).unwrap();
    let mut floats = bytes[12 + len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
    let mut take = |v: &Value| {
        v.as_u64()
            .map(|n| (&mut floats).take(n as usize).collect::<Vec<f32>>())
    };
    let buckets = header["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (take(&b["error"]), take(&b["q"])))
        .collect();
    (header, buckets)
}

fn fixture(name: &str) -> (Value, Vec<f32>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/powersgd");
    let meta = std::fs::read(dir.join(format!("{name}.json"))).unwrap();
    let bin = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
    let floats = bin
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (serde_json::from_slice(&meta).unwrap(), floats)
}

/// Asserts `got` is within `tol` of `want`, relative to `want`'s largest magnitude.
fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    let (i, worst) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / scale)
        .enumerate()
        .fold((0, 0.0f32), |a, b| if b.1 > a.1 { b } else { a });
    assert!(
        worst <= tol,
        "{what}: element {i} is {} where PyTorch has {} (relative difference {worst})",
        got[i],
        want[i]
    );
}

/// `(n, m, r')` when PyTorch compresses a gradient of `shape`: viewed as `n × m` (`n` its
/// first dimension), at rank `r' = min(n, m, r)`, when `(n + m)·r'·rate < n·m` (PyTorch's
/// `_should_compress`, written here again from its source).
fn compressed(shape: &[usize], config: &PowerSgdConfig) -> Option<(usize, usize, usize)> {
    let n = shape[0];
    let m = shape.iter().product::<usize>() / n;
    let r = n.min(m).min(config.matrix_approximation_rank);
    ((((n + m) * r) as f64) * config.min_compression_rate < (n * m) as f64).then_some((n, m, r))
}

/// The compressed matrices of a bucket as PyTorch lays out their P and Q: `(n, m, r')` grouped
/// by shape in order of first appearance.
fn q_layout(parts: &[Vec<Vec<usize>>], config: &PowerSgdConfig) -> Vec<(usize, usize, usize)> {
    let mut groups: Vec<Vec<(usize, usize, usize)>> = Vec::new();
    for c in parts.iter().flatten().filter_map(|s| compressed(s, config)) {
        match groups.iter_mut().find(|g| (g[0].0, g[0].1) == (c.0, c.1)) {
            Some(g) => g.push(c),
            None => groups.push(vec![c]),
        }
    }
    groups.into_iter().flatten().collect()
}

/// Asserts that Q matches PyTorch's up to the sign of each column (PyTorch's QR and our
/// Gram-Schmidt may choose opposite signs, which cancel in `P Qᵀ`).
fn assert_q_close(got: &[f32], want: &[f32], layout: &[(usize, usize, usize)], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut at = 0;
    let mut flipped = got.to_vec();
    for &(_, cols, r) in layout {
        for k in 0..r {
            let idx = |j: usize| at + j * r + k;
            let dot: f64 = (0..cols)
                .map(|j| f64::from(got[idx(j)]) * f64::from(want[idx(j)]))
                .sum();
            if dot < 0.0 {
                (0..cols).for_each(|j| flipped[idx(j)] = -got[idx(j)]);
            }
        }
        at += cols * r;
    }
    assert_eq!(at, got.len(), "{what}: the layout covers Q");
    assert_close(&flipped, want, 1e-5, what);
}

/// Runs fixture `name` on 2 ranks and compares everything with PyTorch's.
fn check_fixture(name: &str) {
    let (meta, reference) = fixture(name);
    let config: PowerSgdConfig = serde_json::from_value(meta["config"].clone()).unwrap();
    let parts: Vec<Vec<Vec<Vec<usize>>>> = serde_json::from_value(meta["buckets"].clone()).unwrap();
    let descs: Vec<BucketDesc> = parts.iter().map(|p| bucket(p)).collect();
    let steps = meta["steps"].as_u64().unwrap();
    let runs = run_ranks(2, |pg| {
        let mut hook = bound(config.clone(), &descs);
        train(&pg, &mut hook, &descs, 0, steps)
    });
    let mut at = 0;
    let mut next = |n: usize| {
        at += n;
        &reference[at - n..at]
    };
    for step in 0..steps as usize {
        for (b, d) in descs.iter().enumerate() {
            let i = step * descs.len() + b;
            let ours = &runs[0].outputs[i];
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(ours),
                bits(&runs[1].outputs[i]),
                "{name}: ranks differ at step {step}, bucket {b}"
            );
            let want = next(d.part_lens.iter().sum());
            let what = format!("{name}: step {step}, bucket {b}");
            if (step as u64) < config.start_powersgd_iter {
                // Plain: x/2 + y/2 (PyTorch) and (x + y)/2 (ours) are the same bits.
                assert_eq!(bits(ours), bits(want), "{what}: plain all-reduce");
            } else {
                assert_close(ours, want, 1e-5, &what);
            }
        }
    }
    let states: Vec<_> = runs.iter().map(|r| read_state(&r.state)).collect();
    for (rank, present) in meta["errors"].as_array().unwrap().iter().enumerate() {
        for (b, present) in present.as_array().unwrap().iter().enumerate() {
            let ours = &states[rank].1[b].0;
            assert_eq!(
                ours.is_some(),
                present.as_bool().unwrap(),
                "{name}: rank {rank}, bucket {b}: error feedback kept"
            );
            if let Some(e) = ours {
                let what = format!("{name}: rank {rank}, bucket {b}: error feedback");
                assert_close(e, next(e.len()), 1e-5, &what);
            }
        }
    }
    for (b, len) in meta["q_lens"].as_array().unwrap().iter().enumerate() {
        let ours = &states[0].1[b].1;
        assert_eq!(
            ours.as_ref().map(|q| q.len() as u64),
            len.as_u64(),
            "{name}: bucket {b}: Q kept"
        );
        if let Some(q) = ours {
            assert_eq!(
                states[1].1[b].1.as_ref(),
                Some(q),
                "{name}: bucket {b}: Q differs between ranks"
            );
            let layout = q_layout(&parts[b], &config);
            assert_q_close(q, next(q.len()), &layout, &format!("{name}: bucket {b}: Q"));
        }
    }
    assert_eq!(
        at,
        reference.len(),
        "{name}: the whole fixture was compared"
    );
    // What went on the wire: the whole bucket before compression, then the plain gradients,
    // P and Q.
    for (i, &bytes) in runs[0].bytes.iter().enumerate() {
        let (step, b) = (i / descs.len(), i % descs.len());
        let total: usize = descs[b].part_lens.iter().sum();
        if (step as u64) < config.start_powersgd_iter {
            assert_eq!(bytes, 4 * total as u64);
        } else {
            let layout = q_layout(&parts[b], &config);
            let q: usize = layout.iter().map(|(_, m, r)| m * r).sum();
            let p: usize = layout.iter().map(|(n, _, r)| n * r).sum();
            let compressed: usize = layout.iter().map(|(n, m, _)| n * m).sum();
            assert_eq!(
                bytes,
                4 * (total - compressed + p + q) as u64,
                "{name}: bytes of bucket {b}"
            );
        }
    }
}

#[test]
fn matches_pytorchs_hook_at_rank_4_with_error_feedback_and_warm_start() {
    check_fixture("r4");
}

#[test]
fn matches_pytorchs_hook_at_rank_2_with_q_drawn_every_step() {
    check_fixture("r2_cold");
}

#[test]
fn matches_pytorchs_hook_at_rank_1_without_error_feedback() {
    check_fixture("r1_noef");
}

/// Buckets of a small model: a convolution, a linear layer, biases.
fn model_buckets() -> Vec<BucketDesc> {
    vec![
        bucket(&[vec![vec![64, 40], vec![64]], vec![vec![10, 64], vec![10]]]),
        bucket(&[vec![vec![16, 3, 5, 5], vec![16]]]),
    ]
}

#[test]
fn three_ranks_get_the_same_bits() {
    let descs = model_buckets();
    let config = PowerSgdConfig::new()
        .with_matrix_approximation_rank(2)
        .with_start_powersgd_iter(1);
    let runs = run_ranks(3, |pg| {
        let mut hook = bound(config.clone(), &descs);
        train(&pg, &mut hook, &descs, 0, 4)
    });
    for r in &runs[1..] {
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&r.outputs), bits(&runs[0].outputs));
    }
    // Each rank keeps its own error: they differ.
    assert_ne!(read_state(&runs[0].state).1, read_state(&runs[1].state).1);
}

#[test]
fn a_resumed_hook_continues_bit_for_bit() {
    let descs = model_buckets();
    let config = PowerSgdConfig::new()
        .with_matrix_approximation_rank(2)
        .with_start_powersgd_iter(1)
        .with_random_seed(3);
    let runs = run_ranks(2, |pg| {
        let mut straight = bound(config.clone(), &descs);
        let whole = train(&pg, &mut straight, &descs, 0, 5);
        let mut first = bound(config.clone(), &descs);
        let head = train(&pg, &mut first, &descs, 0, 2);
        let mut resumed = bound(config.clone(), &descs);
        resumed.load_state_bytes(&head.state, "state").unwrap();
        assert_eq!(resumed.iter(), 2);
        let tail = train(&pg, &mut resumed, &descs, 2, 3);
        (whole, head, tail)
    });
    for (whole, head, tail) in runs {
        let bits = |v: &[Vec<f32>]| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
        let joined: Vec<Vec<f32>> = head.outputs.into_iter().chain(tail.outputs).collect();
        assert_eq!(bits(&joined), bits(&whole.outputs));
        assert_eq!(tail.state, whole.state);
    }
}

#[test]
fn a_saved_state_loads_only_where_it_fits() {
    let descs = model_buckets();
    let config = PowerSgdConfig::new().with_start_powersgd_iter(0);
    let runs = run_ranks(2, |pg| {
        let mut hook = bound(config.clone(), &descs);
        train(&pg, &mut hook, &descs, 0, 1).state
    });
    let state = &runs[0];
    let err = bound(config.clone().with_matrix_approximation_rank(2), &descs)
        .load_state_bytes(state, "ck.bin")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ck.bin") && err.contains("matrix_approximation_rank = 1 (this run: 2)"),
        "{err}"
    );
    let mut smaller = model_buckets();
    smaller[1] = bucket(&[vec![vec![16, 3, 5, 5]]]);
    let err = bound(config.clone(), &smaller)
        .load_state_bytes(state, "ck.bin")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bucket 1's PowerSGD error feedback has 1216 elements, this model's 1200"),
        "{err}"
    );
    let err = bound(config, &descs[..1])
        .load_state_bytes(state, "ck.bin")
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 buckets, this model 1"), "{err}");
}

#[test]
fn a_large_layer_sends_a_fraction_of_its_bytes() {
    // The deep MLP's hidden layer: 2048 × 2048 at rank 4 sends (2048 + 2048)·4 numbers, plus
    // its bias plain: 1/250 of the bytes.
    let descs = vec![bucket(&[vec![vec![2048, 2048], vec![2048]]])];
    let config = PowerSgdConfig::new()
        .with_matrix_approximation_rank(4)
        .with_start_powersgd_iter(0);
    let hook = bound(config, &descs);
    let (sent, total) = hook.compression_stats();
    assert_eq!((sent, total), (2048 * 8 + 2048, 2048 * 2049));
    assert!(total / sent >= 10);
}
