//! Checkpoint and resume with a user's own model and optimizer (`ddp::save_checkpoint`,
//! `ddp::resume`): rank 0 writes, every rank resumes from rank 0's broadcast to the same
//! parameters and optimizer state, and a checkpoint of another world size or seed is refused
//! on every rank unless allowed.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Tensor, TensorData};
use ddp::{
    flatten_params, load_flat_params, resume, save_checkpoint, DdpConfig, DdpError,
    DistributedDataParallel, Position, RunId,
};

use crate::common;
use common::{device, run_ranks};

#[derive(Module, Debug)]
struct Net {
    fc: Linear,
}

fn net(rank: usize) -> Net {
    let net = Net {
        fc: LinearConfig::new(3, 2).init(&device()),
    };
    let values: Vec<f32> = (0..8).map(|i| i as f32 / 10.0 + rank as f32).collect();
    load_flat_params(net, &values).unwrap()
}

/// `steps` Adam steps on rank-dependent data.
fn train(
    net: Net,
    ddp: &mut DistributedDataParallel,
    optim: &mut ModuleOptimizer,
    rank: usize,
    steps: usize,
) -> Net {
    let mut net = net;
    for step in 0..steps {
        let x: Vec<f32> = (0..6).map(|i| (i + step + rank) as f32 / 7.0).collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [2, 3]), &device());
        let loss = net.fc.forward(x).powi_scalar(2).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        let grads = ddp.sync(&net, grads).unwrap();
        net = optim.step(1e-2, net, grads);
    }
    net
}

fn run_id(seed: u64, allow_mismatch: bool) -> RunId {
    RunId {
        model: "net".into(),
        seed,
        allow_mismatch,
    }
}

#[test]
fn a_resumed_run_continues_bit_identical_to_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = ddp::checkpoint::checkpoint_path(dir.path());
    let results = run_ranks(2, |pg| {
        let rank = pg.rank();
        // Uninterrupted: 6 steps.
        let (model, mut ddp) =
            DistributedDataParallel::new(net(rank), pg.clone(), DdpConfig::new()).unwrap();
        let mut optim = AdamConfig::new().init();
        let model = train(model, &mut ddp, &mut optim, rank, 3);
        let position = Position {
            epoch: 0,
            batch_in_epoch: 3,
            step: 3,
            loss_sum: rank as f64,
        };
        let saved = save_checkpoint(
            &pg,
            dir.path(),
            &run_id(1, false),
            &position,
            &model,
            &optim,
        )
        .unwrap();
        assert_eq!(
            saved.is_some(),
            rank == 0,
            "rank {rank}: only rank 0 writes"
        );
        let uninterrupted = train(model, &mut ddp, &mut optim, rank, 3);

        // Resumed: a fresh model and optimizer (other values), then the last 3 steps.
        let resumed = resume(
            &pg,
            &path,
            &run_id(1, false),
            net(rank + 5),
            AdamConfig::new().init(),
        )
        .unwrap();
        let meta = resumed.meta.expect("a checkpoint was found");
        assert_eq!((meta.step, meta.batch_in_epoch, meta.world_size), (3, 3, 2));
        assert_eq!(
            meta.epoch_loss_sums,
            vec![0.0, 1.0],
            "every rank's loss sum, in rank order"
        );
        let (model, mut optim) = (resumed.model, resumed.optim);
        let (model, mut ddp) =
            DistributedDataParallel::new(model, pg.clone(), DdpConfig::new()).unwrap();
        let continued = train(model, &mut ddp, &mut optim, rank, 3);
        (
            flatten_params(&uninterrupted).unwrap(),
            flatten_params(&continued).unwrap(),
        )
    });
    for (rank, (uninterrupted, continued)) in results.iter().enumerate() {
        assert!(
            uninterrupted == continued,
            "rank {rank}: the resumed run differs"
        );
        assert!(
            uninterrupted == &results[0].0,
            "rank {rank}: replicas differ"
        );
    }
}

#[test]
fn a_checkpoint_of_another_seed_is_refused_on_every_rank_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let path = ddp::checkpoint::checkpoint_path(dir.path());
    let outcomes = run_ranks(2, |pg| {
        let model = net(0);
        let optim = AdamConfig::new().init();
        let position = Position {
            epoch: 1,
            batch_in_epoch: 0,
            step: 4,
            loss_sum: 0.0,
        };
        save_checkpoint(
            &pg,
            dir.path(),
            &run_id(1, false),
            &position,
            &model,
            &optim,
        )
        .unwrap();
        let refused = match resume(
            &pg,
            &path,
            &run_id(2, false),
            net(1),
            AdamConfig::new().init(),
        ) {
            Err(DdpError::CheckpointMismatch { what, .. }) => what,
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("a checkpoint of seed 1 was accepted by a run of seed 2"),
        };
        let allowed = resume(
            &pg,
            &path,
            &run_id(2, true),
            net(1),
            AdamConfig::new().init(),
        )
        .unwrap();
        (
            refused,
            allowed.mismatch,
            flatten_params(&allowed.model).unwrap(),
        )
    });
    for (refused, mismatch, params) in outcomes {
        assert_eq!(refused, "seed 1 (this run: 2)");
        assert_eq!(mismatch.as_deref(), Some("seed 1 (this run: 2)"));
        assert_eq!(
            params,
            flatten_params(&net(0)).unwrap(),
            "the checkpoint's parameters"
        );
    }
}
