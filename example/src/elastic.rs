//! `user-elastic`: a user's own burn program as an elastic job (docs/guide.md, section 9):
//! ranks may die and be restarted, or join, while it runs; the survivors go on at the smaller
//! world and the newcomers are healed from a live rank. Its own model, data and loop, written
//! only against the public API of `ddp` and `ddp-data`.
//!
//! Usage, under `ddprun --nnodes MIN:MAX` (one launcher per node, or several on one host):
//! `user-elastic [--samples N] [--batch B] [--epochs E] [--seed S]`. Each rank ends with one
//! line: `rank R (slot S) done: STEPS steps, world W, parameters fnv HASH`.

use std::error::Error;
use std::process::ExitCode;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Tensor, TensorData};
use ddp::{
    flatten_params, CommError, DdpConfig, DdpError, ElasticConfig, ElasticDdp, ElasticGroup,
    ElasticOptimizer, Outcome, Progress,
};
use ddp_data::ElasticSampler;

/// The model: two layers.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    relu: Relu,
    out: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Mlp {
        Mlp {
            hidden: LinearConfig::new(4, 16).init(device),
            relu: Relu::new(),
            out: LinearConfig::new(16, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(self.relu.forward(self.hidden.forward(x)))
    }
}

/// The user's data: sample i is 4 values from a fixed hash, labelled with their sum.
fn batch(indices: &[usize], device: &Device) -> (Tensor<2>, Tensor<2>) {
    let value = |i: usize| ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as f32;
    let x: Vec<f32> = indices
        .iter()
        .flat_map(|&i| (0..4).map(move |f| value(4 * i + f) / (1 << 23) as f32 - 1.0))
        .collect();
    let y: Vec<f32> = x.chunks(4).map(|row| row.iter().sum()).collect();
    let n = indices.len();
    (
        Tensor::from_data(TensorData::new(x, [n, 4]), device),
        Tensor::from_data(TensorData::new(y, [n, 1]), device),
    )
}

/// The command line.
struct Args {
    samples: usize,
    batch: usize,
    epochs: u64,
    seed: u64,
}

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut args = Args {
        samples: 4096,
        batch: 8,
        epochs: 2,
        seed: 7,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--samples" => args.samples = value.parse()?,
            "--batch" => args.batch = value.parse()?,
            "--epochs" => args.epochs = value.parse()?,
            "--seed" => args.seed = value.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("Error: {error}");
            // Below its minimum of ranks the job stops; exit code 75 tells ddprun to restart
            // the whole job (from your checkpoint, if you keep one).
            let below_min = |e: &CommError| matches!(e, CommError::ElasticStopped { .. });
            let stopped = error.downcast_ref::<CommError>().is_some_and(below_min)
                || matches!(error.downcast_ref::<DdpError>(), Some(DdpError::Comm(e)) if below_min(e));
            ExitCode::from(if stopped { 75 } else { 1 })
        }
    }
}

// guide: begin
fn run() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    let lr = 1e-2;
    // What every rank must share, one `name = value` per line: a process started with another
    // value is refused at join (naming the setting and both values) and the job goes on.
    let compat = format!(
        "model = mlp 4-16-1\nlr = {lr}\nbatch size = {}\nsamples = {}\nepochs = {}\nseed = {}",
        args.batch, args.samples, args.epochs, args.seed
    );
    let config = ElasticConfig::from_env(&compat)?
        .ok_or("run me under ddprun --nnodes MIN:MAX (DDP_ELASTIC is not set)")?;
    // `None`: the job finished before this process could join (a rank restarted after the
    // last step): nothing left to do.
    let Some(group) = ElasticGroup::join(config)? else {
        println!("the job has already finished");
        return Ok(());
    };
    let slot = group.slot();
    let optimizer = ElasticOptimizer::Ddp {
        config: DdpConfig::new(),
        optim: AdamConfig::new().init(),
    };
    // A founding rank starts from rank 0's weights; a joiner is healed from rank 0 (weights,
    // optimizer state, progress) before `start` returns.
    let mut run = ElasticDdp::start(group, Mlp::new(&device), optimizer, Progress::default())?;
    let mut sampler = ElasticSampler::new(args.samples, args.batch)?.with_seed(args.seed);
    let mut order = (u64::MAX, Vec::new());
    loop {
        // Plan every step from the committed progress, the rank and the world size: they are
        // the same on every rank, and a change of membership may change all three.
        let p = run.progress().clone();
        if order.0 != p.epoch {
            sampler.set_epoch(p.epoch);
            order = (p.epoch, sampler.order());
        }
        let (rank, world) = (run.rank(), run.world_size());
        let Some(share) = sampler.step(&order.1, p.position as usize, world, rank) else {
            // The epoch is over, on every rank at the same step: stop after the last one, or
            // roll over to the next (every rank alike, outside a step).
            if p.epoch + 1 == args.epochs {
                break;
            }
            run.set_progress(Progress {
                epoch: p.epoch + 1,
                position: 0,
                ..p
            });
            continue;
        };
        let (x, y) = batch(&share.indices, &device);
        let prediction = run.prepare().forward(x);
        // The step's mean over its samples: 1 but where the epoch's last step leaves some
        // rank fewer samples (or none).
        let loss = (prediction - y)
            .powi_scalar(2)
            .mean()
            .mul_scalar(share.loss_scale);
        // Where the run stands once this step is committed.
        let after = Progress {
            step: p.step + 1,
            position: share.next as u64,
            ..p
        };
        match run.step(lr, loss, after)? {
            Outcome::Committed if (p.step + 1) % 500 == 0 => {
                println!("slot {slot}: step {} at world {world}", p.step + 1)
            }
            Outcome::Committed => {}
            // The membership changed: the step was committed unless `dropped` (or `healed`:
            // this rank took rank 0's state); the loop plans the next one from `progress()`
            // either way.
            Outcome::Changed(m) => println!(
                "slot {slot}: generation {}, rank {} of {}, step {} dropped: {}",
                m.generation,
                m.rank,
                m.world_size,
                p.step + 1,
                m.dropped
            ),
            // Other ranks ended the job while this one was re-forming.
            Outcome::Finished => break,
        }
    }
    let (rank, world, steps) = (run.rank(), run.world_size(), run.progress().step);
    // Says the job is over: a rank restarted from now on finds it so and exits.
    let model = run.finish()?;
    let hash = flatten_params(&model)?
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x100_0000_01b3)
        });
    println!(
        "rank {rank} (slot {slot}) done: {steps} steps, world {world}, parameters fnv {hash:016x}"
    );
    Ok(())
}
// guide: end
