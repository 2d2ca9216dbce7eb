//! Nothing silent: what used to make ranks train differently without an error, each with a
//! test that fails on the wrapper before the fix.
//!
//! - a `sync` that fails on one rank only (a gradient that cannot be packed, a gradient of an
//!   unknown parameter) fails on every rank, the others naming the failing rank, and the group
//!   goes on to the next step;
//! - parameters keep their element type end to end (f16 and bf16 on every rank, gradients
//!   returned in that type); f64, which f32 would round, is refused at construction naming the
//!   parameter;
//! - only burn's `RunningState`s are buffers broadcast at every sync; frozen parameters are
//!   left alone; `broadcast_buffers = false` keeps each rank's own running statistics;
//! - f16 compression divides before the all-reduce, so that sums above f16's range (65504)
//!   stay finite.

use burn::module::{Module, Param, ParamId};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorCreationOptions, TensorData};
use ddp::{
    flatten_params, load_flat_params, param_infos, Compression, DdpConfig, DdpError,
    DistributedDataParallel, ParamKind,
};

use crate::common;
use common::{device, run_ranks};

/// Two linear layers, 4 → 3 → 2, with a BatchNorm between them.
#[derive(Module, Debug)]
struct Net {
    backbone: Linear,
    bn: BatchNorm,
    head: Linear,
}

impl Net {
    fn new() -> Net {
        let device = device();
        Net {
            backbone: LinearConfig::new(4, 3).init(&device),
            bn: BatchNormConfig::new(3).init(&device),
            head: LinearConfig::new(3, 2).init(&device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.head.forward(self.bn.forward(self.backbone.forward(x)))
    }
}

/// Rank `rank`'s input: 5 rows of 4 features, different on every rank.
fn input(rank: usize) -> Tensor<2> {
    let values: Vec<f32> = (0..20)
        .map(|i| ((i * 7 + rank * 13) % 11) as f32 / 5.0 - 1.0 + rank as f32)
        .collect();
    Tensor::from_data(TensorData::new(values, [5, 4]), &device())
}

/// The net's gradients for rank `rank`'s input.
fn grads(net: &Net, rank: usize) -> GradientsParams {
    let loss = net.forward(input(rank)).powi_scalar(2).mean();
    GradientsParams::from_grads(loss.backward(), net)
}

/// Rank 1's module starts from other values than rank 0's (the broadcast must fix that).
fn net_for(rank: usize) -> Net {
    let net = Net::new();
    let n = flatten_params(&net).unwrap().len();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 5 + 1) % 9) as f32 / 10.0 + rank as f32)
        .collect();
    load_flat_params(net, &values).unwrap()
}

#[test]
fn a_local_failure_fails_the_sync_on_every_rank_naming_the_rank() {
    for (world, bad) in [(2, 1), (3, 0), (3, 2)] {
        let results = run_ranks(world, |pg| {
            let rank = pg.rank();
            let (net, mut ddp) =
                DistributedDataParallel::new(net_for(rank), pg, DdpConfig::default()).unwrap();
            // Step 1: rank `bad` hands over a gradient of the wrong size.
            let mut g = grads(&net, rank);
            if rank == bad {
                let bias = param_infos(&net)
                    .into_iter()
                    .find(|p| p.name == "head.bias")
                    .unwrap();
                g.register::<1>(bias.id, Tensor::zeros([7], &device()));
            }
            let first = ddp.sync(&net, g).map(|_| ());
            // Step 2: rank `bad` hands over a gradient of a parameter the module does not have.
            let mut g = grads(&net, rank);
            if rank == bad {
                g.register::<1>(ParamId::new(), Tensor::zeros([3], &device()));
            }
            let second = ddp.sync(&net, g).map(|_| ());
            // Step 3: all is well again, and every rank gets the same averaged gradients.
            let g = ddp.sync(&net, grads(&net, rank)).unwrap();
            let head = param_infos(&net)
                .into_iter()
                .find(|p| p.name == "head.weight")
                .unwrap();
            let third = g.get::<2>(head.id).unwrap().into_data().try_to_vec::<f32>();
            (first, second, third.unwrap())
        });
        for (rank, (first, second, _)) in results.iter().enumerate() {
            for (step, result) in [(1, first), (2, second)] {
                let e = match result {
                    Err(e) => e,
                    Ok(()) => panic!("world {world}, rank {rank}: sync {step} returned Ok"),
                };
                if rank == bad {
                    let text = e.to_string();
                    let what = if step == 1 { "head.bias" } else { "1 gradient" };
                    assert!(text.contains(what), "rank {rank}, sync {step}: {text}");
                } else {
                    match e {
                        DdpError::PeerFailed { sync, count, rank } => {
                            assert_eq!((*sync, *count, *rank), (step, 1, Some(bad)));
                            assert!(e.to_string().contains(&format!("rank {bad} failed")));
                        }
                        other => panic!("rank {rank}, sync {step}: {other}"),
                    }
                }
            }
        }
        for (rank, (_, _, third)) in results.iter().enumerate() {
            assert_eq!(third, &results[0].2, "world {world}: rank {rank} differs");
        }
    }
}

/// A module of one parameter in element type `dtype`, filled with `value`.
#[derive(Module, Debug)]
struct Typed {
    w: Param<Tensor<2>>,
}

fn typed(dtype: DType, value: f32) -> Typed {
    let options = TensorCreationOptions::new(device()).with_dtype(dtype);
    let data = TensorData::new(vec![value; 6], [2, 3]);
    Typed {
        w: Param::from_tensor(Tensor::from_data(data, options).require_grad()),
    }
}

#[test]
fn half_precision_parameters_keep_their_type_on_every_rank() {
    for dtype in [DType::F16, DType::BF16] {
        let results = run_ranks(2, |pg| {
            let rank = pg.rank();
            // 0.5 and 1.5 are exact in both types.
            let model = typed(dtype, 0.5 + rank as f32);
            let (model, mut ddp) =
                DistributedDataParallel::new(model, pg, DdpConfig::default()).unwrap();
            let w = model.w.val();
            let after_broadcast = (
                w.dtype(),
                w.into_data().convert::<f32>().try_to_vec::<f32>(),
            );
            // A gradient in the parameter's type, 1 on rank 0 and 2 on rank 1: mean 1.5.
            let options = TensorCreationOptions::new(device().inner()).with_dtype(dtype);
            let grad = Tensor::<2>::from_data(
                TensorData::new(vec![1.0 + rank as f32; 6], [2, 3]),
                options,
            );
            let mut grads = GradientsParams::new();
            grads.register::<2>(model.w.id, grad);
            let mut grads = ddp.sync(&model, grads).unwrap();
            let g = grads.remove::<2>(model.w.id).unwrap();
            let averaged = (
                g.dtype(),
                g.into_data().convert::<f32>().try_to_vec::<f32>(),
            );
            (after_broadcast, averaged)
        });
        for (rank, ((wt, w), (gt, g))) in results.into_iter().enumerate() {
            assert_eq!(wt, dtype, "rank {rank}: parameter type");
            assert_eq!(w.unwrap(), vec![0.5; 6], "rank {rank}: rank 0's values");
            assert_eq!(gt, dtype, "rank {rank}: gradient type");
            assert_eq!(g.unwrap(), vec![1.5; 6], "rank {rank}: averaged gradient");
        }
    }
}

#[test]
fn f64_parameters_are_refused_at_construction_naming_the_parameter() {
    let errors = run_ranks(2, |pg| {
        DistributedDataParallel::new(typed(DType::F64, 1.0), pg, DdpConfig::default())
            .err()
            .map(|e| e.to_string())
    });
    for e in errors {
        let e = e.expect("an f64 model was accepted");
        assert!(e.contains("`w`") && e.contains("F64"), "{e}");
    }
}

#[test]
fn only_running_states_are_buffers_and_frozen_parameters_are_left_alone() {
    let frozen = |rank: usize| {
        let mut net = net_for(rank);
        net.backbone = net.backbone.no_grad();
        net
    };
    let kinds: Vec<(String, ParamKind)> = param_infos(&frozen(0))
        .into_iter()
        .map(|p| (p.name, p.kind))
        .collect();
    let names_of = |kind: ParamKind| -> Vec<&str> {
        kinds
            .iter()
            .filter(|(_, k)| *k == kind)
            .map(|(n, _)| n.as_str())
            .collect()
    };
    assert_eq!(
        names_of(ParamKind::Frozen),
        ["backbone.weight", "backbone.bias"]
    );
    assert_eq!(
        names_of(ParamKind::Buffer),
        ["bn.running_mean", "bn.running_var"]
    );

    let results = run_ranks(2, |pg| {
        let rank = pg.rank();
        let (net, mut ddp) =
            DistributedDataParallel::new(frozen(rank), pg, DdpConfig::default()).unwrap();
        let backbone = |net: &Net| {
            let mut v = net
                .backbone
                .weight
                .val()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            v.extend(
                net.backbone
                    .bias
                    .as_ref()
                    .unwrap()
                    .val()
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
            v
        };
        let at_start = backbone(&net);
        // Rank 1 changes its frozen backbone after wrapping (as a user's own code might): the
        // sync must not overwrite it with rank 0's, as it did when frozen parameters counted
        // as buffers.
        let net = if rank == 1 {
            let n = backbone(&net).len();
            let mut all = flatten_params(&net).unwrap();
            all[..n].iter_mut().for_each(|v| *v += 1.0);
            load_flat_params(net, &all).unwrap()
        } else {
            net
        };
        let mine = backbone(&net);
        let g = ddp.sync(&net, grads(&net, rank)).unwrap();
        let frozen_grad = g.get::<2>(net.backbone.weight.id).is_some();
        (at_start, mine, backbone(&net), frozen_grad)
    });
    assert_eq!(
        results[0].0, results[1].0,
        "construction broadcasts every parameter"
    );
    for (rank, (_, mine, after_sync, frozen_grad)) in results.iter().enumerate() {
        assert_eq!(
            mine, after_sync,
            "rank {rank}: the sync changed a frozen parameter"
        );
        assert!(
            !frozen_grad,
            "rank {rank}: a frozen parameter got a gradient"
        );
    }
    assert_ne!(results[0].2, results[1].2);
}

#[test]
fn broadcast_buffers_off_keeps_each_ranks_running_statistics() {
    for broadcast in [true, false] {
        let stats = run_ranks(2, |pg| {
            let rank = pg.rank();
            let config = DdpConfig::new().with_broadcast_buffers(broadcast);
            let (net, mut ddp) = DistributedDataParallel::new(net_for(rank), pg, config).unwrap();
            for _ in 0..2 {
                let g = grads(&net, rank);
                ddp.sync(&net, g).unwrap();
            }
            common::running_stats(&net.bn)
        });
        // The ranks' inputs differ, so their own statistics differ.
        assert_eq!(
            stats[0] == stats[1],
            broadcast,
            "broadcast_buffers = {broadcast}"
        );
    }
}

#[test]
fn f16_compression_divides_first_so_large_sums_stay_finite() {
    // 4 ranks with gradient 30000 each: the sum, 120000, is past f16's largest value (65504);
    // the mean, 30000, is not.
    let results = run_ranks(4, |pg| {
        let config = DdpConfig::new().with_compression(Compression::F16);
        let model = typed(DType::F32, 1.0);
        let (model, mut ddp) = DistributedDataParallel::new(model, pg, config).unwrap();
        let grad = Tensor::<2>::from_data(TensorData::new(vec![30000.0f32; 6], [2, 3]), &device());
        let mut grads = GradientsParams::new();
        grads.register::<2>(model.w.id, grad);
        let mut grads = ddp.sync(&model, grads).unwrap();
        let g = grads.remove::<2>(model.w.id).unwrap();
        g.into_data().try_to_vec::<f32>().unwrap()
    });
    for (rank, g) in results.into_iter().enumerate() {
        assert_eq!(g, vec![30000.0; 6], "rank {rank}");
    }
}
