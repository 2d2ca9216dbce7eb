//! `ElasticDdp`'s unit tests (real ranks over loopback TCP).

use super::*;
use crate::optim::shard_optim::ShardedAdamConfig;
use crate::params::flatten_params;
use crate::test_ranks::two_ranks;
use crate::zero::ZeroStage;
use burn::module::Param;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, TensorData};
use ddp_comm::ReduceOp;

/// A large weight (a part of its own, stepped in its own memory) and small ones (sharing
/// a part).
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
}

/// A linear layer with fixed weights (the same in every run).
fn linear(inputs: usize, outputs: usize, device: &Device) -> Linear {
    let mut layer = LinearConfig::new(inputs, outputs).init(device);
    let values = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 11 % 23) as f32 - 11.0) / (23.0 * inputs as f32).sqrt())
            .collect()
    };
    let w = TensorData::new(values(inputs * outputs), [inputs, outputs]);
    layer.weight = Param::from_tensor(Tensor::from_data(w, device));
    let b = TensorData::new(values(outputs), [outputs]);
    layer.bias = Some(Param::from_tensor(Tensor::from_data(b, device)));
    layer
}

fn loss(net: &Net, rank: usize, step: usize) -> Tensor<1> {
    let device = Device::flex().autodiff();
    let x: Vec<f32> = (0..8 * 600)
        .map(|i| ((i * 7 + rank * 13 + step * 31) % 17) as f32 / 17.0 - 0.5)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(x, [8, 600]), &device);
    net.b
        .forward(net.a.forward(x).tanh())
        .powf_scalar(2.0)
        .mean()
}

/// ZeRO stage 2 with Adam, each rank its own data; with `keep` (what an elastic run
/// does), step 2 is first taken and rolled back (checked against step 1's parameters and
/// state), then taken again. Returns the parameters after step 4 (which depend on the
/// optimizer state and step counts that steps 2 to 4 started from).
fn train(pg: Arc<ProcessGroup>, keep: bool) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let net = Net {
        a: linear(600, 512, &device),
        b: linear(512, 4, &device),
    };
    let adam = ShardOptimizer::Adam(ShardedAdamConfig::new());
    let config = ZeroConfig::new(ZeroStage::Two).with_bucket_cap_mb(1.0);
    let pg_rank = pg.rank();
    let (mut net, mut zero) = ShardedDataParallel::new(net, pg, config, adam).unwrap();
    if keep {
        zero.keep_starting_points();
    }
    let rank = pg_rank;
    for step in 1..=4 {
        if keep && step == 2 {
            let (params, state) = (flatten_params(&net).unwrap(), zero.shard_state().unwrap());
            let l = loss(&net, rank, step);
            let stepped = zero.try_backward_step(1e-2, net, l).ok().unwrap();
            assert_ne!(
                flatten_params(&stepped).unwrap(),
                params,
                "the step moved nothing"
            );
            net = zero.roll_back(stepped).unwrap();
            assert_eq!(
                flatten_params(&net).unwrap(),
                params,
                "parameters not restored"
            );
            assert_eq!(
                zero.shard_state().unwrap(),
                state,
                "optimizer state not restored"
            );
        }
        let l = loss(&net, rank, step);
        net = zero.try_backward_step(1e-2, net, l).ok().unwrap();
        if keep {
            zero.commit_step();
        }
    }
    flatten_params(&net).unwrap()
}

#[test]
fn a_kept_step_rolls_back_exactly_and_keeping_changes_no_bit() {
    let plain = two_ranks(|pg| train(pg, false));
    let kept = two_ranks(|pg| train(pg, true));
    assert_eq!(plain[0], plain[1], "replicas differ");
    for (rank, (p, k)) in plain.iter().zip(&kept).enumerate() {
        assert_eq!(p, k, "rank {rank}: parameters differ when steps are kept");
    }
}

/// Joins an elastic job of `max` slots (minimum 1) as slot `slot`, over TCP with its store at
/// `port`, and returns the founding group; collectives time out after `timeout`.
fn join_founder(slot: usize, max: usize, port: u16, timeout: Duration, name: &str) -> ElasticGroup {
    let base = ddp_comm::GroupConfig {
        rank: slot,
        world_size: max,
        master_port: port,
        torch_agent_store: Some(0),
        job_id: Some(format!("{name}-{port}")),
        transport: ddp_comm::Transport::Tcp,
        timeout,
        connect_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let config = ddp_comm::ElasticConfig {
        min: 1,
        max,
        slot,
        compat: name.into(),
        last_call: Duration::from_secs(30),
        poll: ddp_comm::DEFAULT_POLL,
        base,
    };
    ElasticGroup::join(config).unwrap().expect("a founder")
}

/// One slot of a two-slot elastic run of `Net` (DDP, SGD) in this process, its store at
/// `port`; collectives time out after `timeout`.
fn elastic_run(slot: usize, port: u16, timeout: Duration) -> ElasticDdp<Net> {
    // Founded at once when both slots are in (MAX), never alone.
    let group = join_founder(slot, 2, port, timeout, "skip-test");
    let device = Device::flex().autodiff();
    let net = Net {
        a: linear(600, 16, &device),
        b: linear(16, 4, &device),
    };
    let optimizer = ElasticOptimizer::Ddp {
        config: DdpConfig::new(),
        optim: burn::optim::SgdConfig::new().init(),
    };
    ElasticDdp::start(group, net, optimizer, Progress::default()).unwrap()
}

/// PowerSGD under `ElasticDdp` is refused with the reason, before any collective (a
/// one-slot job, so that nobody waits).
#[test]
fn powersgd_is_refused_with_the_reason() {
    let store =
        ddp_comm::TorchStoreHost::start(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .unwrap();
    let group = join_founder(0, 1, store.port(), Duration::from_secs(30), "powersgd-test");
    let device = Device::flex().autodiff();
    let net = Net {
        a: linear(6, 4, &device),
        b: linear(4, 2, &device),
    };
    let optimizer = ElasticOptimizer::Ddp {
        config: DdpConfig::new()
            .with_comm_hook(CommHookKind::PowerSgd(crate::PowerSgdConfig::new())),
        optim: burn::optim::SgdConfig::new().init(),
    };
    let Err(e) = ElasticDdp::start(group, net, optimizer, Progress::default()) else {
        panic!("PowerSGD under ElasticDdp was accepted");
    };
    let text = e.to_string();
    assert!(
        text.contains("PowerSGD") && text.contains("error feedback") && text.contains("joiner"),
        "{text}"
    );
}

fn after(step: u64) -> Progress {
    Progress {
        step,
        ..Progress::default()
    }
}

/// The group fails while rank 0 runs a step's forward pass (rank 1's collective times out
/// and its ABORT arrives): rank 0 does not run that step's backward, drops the step and
/// re-forms with rank 1; both then go on. Rank 1 reports only after rank 0 has (its
/// timeout names rank 0, and a named rank that has not reported may be left out).
#[test]
fn a_step_begun_after_the_group_failed_skips_its_backward() {
    let store = Arc::new(
        ddp_comm::TorchStoreHost::start(std::net::TcpListener::bind("127.0.0.1:0").unwrap())
            .unwrap(),
    );
    let port = store.port();
    let (failed_tx, failed_rx) = std::sync::mpsc::channel::<()>();
    let host = store.clone();
    let other = std::thread::spawn(move || {
        let mut run = elastic_run(1, port, Duration::from_secs(1));
        let l = loss(run.model(), 1, 1);
        assert!(matches!(
            run.step(0.1, l, after(1)).unwrap(),
            Outcome::Committed
        ));
        // A collective rank 0 never enters: it times out, and the group fails.
        let e = run
            .process_group()
            .all_reduce(vec![1.0f32], ReduceOp::Sum)
            .unwrap_err();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !host
            .keys()
            .iter()
            .any(|k| k.ends_with("elastic/g1/report/0"))
        {
            assert!(Instant::now() < deadline, "rank 0 never reported");
            std::thread::sleep(Duration::from_millis(5));
        }
        let changed = run.collective(|_| Err::<(), _>(DdpError::Comm(e))).unwrap();
        let _ = failed_tx.send(());
        assert!(changed.is_err(), "the group re-formed");
        let l = loss(run.model(), 1, 2);
        assert!(matches!(
            run.step(0.1, l, after(2)).unwrap(),
            Outcome::Committed
        ));
        run.finish().unwrap();
    });
    let mut run = elastic_run(0, port, Duration::from_secs(1));
    let l = loss(run.model(), 0, 1);
    assert!(matches!(
        run.step(0.1, l, after(1)).unwrap(),
        Outcome::Committed
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while run.process_group().failure().is_none() {
        assert!(Instant::now() < deadline, "rank 0 never saw the group fail");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The forward pass of step 2, then the step: nothing of it may run on the failed group.
    let l = loss(run.model(), 0, 2);
    match run.step(0.1, l, after(2)).unwrap() {
        Outcome::Changed(m) => {
            assert!(m.dropped, "{m:?}");
            assert_eq!(m.world_size, 2, "{m:?}");
        }
        o => panic!("step 2 on a failed group: {o:?}"),
    }
    assert_eq!(run.backwards_skipped(), 1);
    assert_eq!(run.progress().step, 1);
    failed_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("rank 1 re-formed");
    let l = loss(run.model(), 0, 2);
    assert!(matches!(
        run.step(0.1, l, after(2)).unwrap(),
        Outcome::Committed
    ));
    run.finish().unwrap();
    other.join().unwrap();
}
