//! Gradient all-reduces started during backward (`DdpConfig::overlap`, `prepare` and
//! `backward`), against the same runs without overlap, the reference: one thread per rank,
//! each with its own process group.
//!
//! - results are bit-identical with overlap on and off, at world sizes 1 to 4, over shared
//!   memory and TCP, with a layer used only in some steps (its bucket waits for the sync) and
//!   a layer used twice in one forward pass (its hook fires once both uses are in);
//! - overlap happens: after the first step (which measures the graph's depth), buckets are
//!   submitted before backward returns;
//! - accumulation (`no_sync` micro-steps on a prepared model) is unchanged.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use ddp::{flatten_params, load_flat_params, DdpConfig, DistributedDataParallel, SyncPhase};
use ddp_comm::Transport;

mod common;
use common::{device, run_ranks_over};

const IN: usize = 13;
const HIDDEN: usize = 9;
const OUT: usize = 5;
const PARAMS: usize = 13 * 9 + 9 + 9 * 9 + 9 + 9 * 5 + 5 + 9 * 5 + 5;

/// `a`, then `mid` applied twice (the same parameters used twice), then `b`; `extra` only in
/// some steps (declared before `b`, so that its bucket is not the first: a bucket whose
/// gradient is missing holds back every later one).
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    mid: Linear,
    extra: Linear,
    b: Linear,
}

impl Net {
    fn new(rank_offset: f32) -> Net {
        let device = device();
        let net = Net {
            a: LinearConfig::new(IN, HIDDEN).init(&device),
            mid: LinearConfig::new(HIDDEN, HIDDEN).init(&device),
            extra: LinearConfig::new(HIDDEN, OUT).init(&device),
            b: LinearConfig::new(HIDDEN, OUT).init(&device),
        };
        let values: Vec<f32> = (0..PARAMS)
            .map(|i| ((i * 37 + 11) % 101) as f32 / 101.0 - 0.5 + rank_offset)
            .collect();
        load_flat_params(net, &values).unwrap()
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>, use_extra: bool) -> Tensor<1> {
        let h = relu(self.a.forward(x));
        let h = relu(self.mid.forward(relu(self.mid.forward(h))));
        let mut out = self.b.forward(h.clone());
        if use_extra {
            out = out + self.extra.forward(h);
        }
        (out - y).powi_scalar(2).mean()
    }
}

fn data(step: usize, micro: usize, rank: usize) -> (Tensor<2>, Tensor<2>) {
    let seed = step * 1000 + micro * 100 + rank * 10;
    let x: Vec<f32> = (0..4 * IN)
        .map(|i| (((seed + i) * 7919) % 97) as f32 / 48.0 - 1.0)
        .collect();
    let y: Vec<f32> = (0..4 * OUT)
        .map(|i| (((seed + i) * 104_729) % 89) as f32 / 44.0 - 1.0)
        .collect();
    let device = device();
    (
        Tensor::from_data(TensorData::new(x, [4, IN]), &device),
        Tensor::from_data(TensorData::new(y, [4, OUT]), &device),
    )
}

/// Buckets of 40 elements: several per step, so that some can go out early.
const SMALL_BUCKETS_MB: f64 = 40.0 * 4.0 / (1024.0 * 1024.0);

/// Per rank: the final parameters, and for each step after the first whether some bucket was
/// submitted before backward returned.
type Outcome = (Vec<f32>, Vec<bool>);

/// `steps` steps of Adam on `world` ranks, `micro` micro-steps each; `extra` unused in steps
/// 1 and 4.
fn train(world: usize, overlap: bool, micro: usize, steps: usize, t: Transport) -> Vec<Outcome> {
    run_ranks_over(world, t, |pg| {
        let rank = pg.rank();
        let config = DdpConfig::new()
            .with_bucket_cap_mb(SMALL_BUCKETS_MB)
            .with_first_bucket_mb(SMALL_BUCKETS_MB)
            .with_overlap(overlap);
        let (mut model, mut ddp) =
            DistributedDataParallel::new(Net::new(rank as f32), pg, config).unwrap();
        ddp.record_spans(true);
        let mut optim = AdamConfig::new().init();
        let mut early = Vec::new();
        for step in 0..steps {
            let use_extra = step % 3 != 1;
            for m in 0..micro - 1 {
                // A prepared model through `accumulate` trains as an unprepared one.
                let hooked = ddp.prepare(&model);
                let (x, y) = data(step, m, rank);
                let loss = hooked.loss(x, y, use_extra).div_scalar(micro as f32);
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                ddp.accumulate(grads).unwrap();
            }
            let hooked = ddp.prepare(&model);
            let (x, y) = data(step, micro - 1, rank);
            let loss = hooked.loss(x, y, use_extra).div_scalar(micro as f32);
            let grads = ddp.backward(&model, loss).unwrap();
            let spans = ddp.take_spans();
            if let (Some((_, backward_end)), true) = (ddp.last_backward(), step > 0) {
                early.push(
                    spans
                        .iter()
                        .any(|s| s.phase == SyncPhase::Pack && s.end < backward_end),
                );
            }
            model = optim.step(1e-2, model, grads);
        }
        (flatten_params(&model).unwrap(), early)
    })
}

fn assert_bit_identical(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    if let Some(i) = a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

#[test]
fn overlap_gives_the_same_bits_at_world_sizes_1_to_4() {
    for world in 1..=4 {
        let off = train(world, false, 1, 6, Transport::Auto);
        let on = train(world, true, 1, 6, Transport::Auto);
        let start = flatten_params(&Net::new(0.0)).unwrap();
        assert!(
            off[0].0.iter().zip(&start).any(|(a, b)| a != b),
            "the runs move"
        );
        for r in 0..world {
            let what = format!("world {world}, rank {r}");
            assert_bit_identical(&on[r].0, &off[0].0, &what);
            if world > 1 {
                // Steps 1 to 5: the depth is known, and some bucket goes out during backward.
                assert_eq!(on[r].1.len(), 5, "{what}");
                assert!(on[r].1.iter().all(|&e| e), "{what}: {:?}", on[r].1);
                assert!(
                    off[r].1.iter().all(|&e| !e),
                    "{what}: no overlap without the setting: {:?}",
                    off[r].1
                );
            }
        }
    }
}

#[test]
fn overlap_over_tcp_gives_the_same_bits() {
    for world in [2, 3] {
        let off = train(world, false, 1, 4, Transport::Tcp);
        let on = train(world, true, 1, 4, Transport::Tcp);
        for (r, (params, early)) in on.iter().enumerate() {
            assert_bit_identical(params, &off[0].0, &format!("tcp, world {world}, rank {r}"));
            assert!(early.iter().all(|&e| e));
        }
    }
}

#[test]
fn accumulation_with_overlap_gives_the_same_bits() {
    let off = train(2, false, 3, 4, Transport::Auto);
    let on = train(2, true, 3, 4, Transport::Auto);
    assert_bit_identical(&on[0].0, &off[0].0, "3 micro-steps");
    assert_bit_identical(&on[1].0, &off[0].0, "3 micro-steps, rank 1");
}
