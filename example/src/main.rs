//! `user-train`: a user's own burn program on N ranks (see the crate README). Everything a
//! user writes is here: the model, the data, the loop; ddp-rs adds the process group, the
//! wrapper with its one line per step, and the sampler.
//!
//! Usage: `user-train [--batch B] [--steps S] [--seed N] [--out DIR]`, standalone or under
//! `ddprun`, `torchrun` or `srun`.

use std::error::Error;
use std::path::PathBuf;
use std::sync::Arc;

use burn::config::Config;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Gelu, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp::{flatten_params, DdpConfig, DistributedDataParallel, ProcessGroup, ReduceOp};
use ddp_data::DistributedSampler;

/// One residual block: `x + fc2(gelu(fc1(norm(x))))`.
#[derive(Module, Debug)]
struct Block {
    norm: LayerNorm,
    fc1: Linear,
    act: Gelu,
    fc2: Linear,
}

impl Block {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self.fc2.forward(
            self.act
                .forward(self.fc1.forward(self.norm.forward(x.clone()))),
        );
        x + h
    }
}

/// The model: an input projection, residual blocks, a final LayerNorm and a classifier head.
#[derive(Module, Debug)]
struct ResMlp {
    input: Linear,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

/// The model's settings.
#[derive(Config, Debug)]
struct ResMlpConfig {
    #[config(default = 16)]
    features: usize,
    #[config(default = 32)]
    width: usize,
    #[config(default = 2)]
    depth: usize,
    #[config(default = 4)]
    classes: usize,
}

impl ResMlpConfig {
    fn init(&self, device: &Device) -> ResMlp {
        let block = || Block {
            norm: LayerNormConfig::new(self.width).init(device),
            fc1: LinearConfig::new(self.width, 2 * self.width).init(device),
            act: Gelu::new(),
            fc2: LinearConfig::new(2 * self.width, self.width).init(device),
        };
        ResMlp {
            input: LinearConfig::new(self.features, self.width).init(device),
            blocks: (0..self.depth).map(|_| block()).collect(),
            norm: LayerNormConfig::new(self.width).init(device),
            head: LinearConfig::new(self.width, self.classes).init(device),
        }
    }
}

impl ResMlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let mut h = self.input.forward(x);
        for block in &self.blocks {
            h = block.forward(h);
        }
        self.head.forward(self.norm.forward(h))
    }
}

/// The user's data: `len` samples of `features` values from a fixed hash, each labelled with
/// the class whose fixed direction it is closest to.
struct Blobs {
    x: Vec<f32>,
    y: Vec<i64>,
    features: usize,
}

impl Blobs {
    fn new(len: usize, features: usize, classes: usize, salt: u64) -> Blobs {
        let value = |i: u64, salt: u64| {
            let mut z = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        // The class directions are the same for every data set (salt 0).
        let centre = |c: usize, f: usize| value((c * features + f) as u64, 0);
        let x: Vec<f32> = (0..len * features).map(|i| value(i as u64, salt)).collect();
        let y = (0..len)
            .map(|s| {
                let row = &x[s * features..(s + 1) * features];
                let score =
                    |c: usize| -> f32 { (0..features).map(|f| row[f] * centre(c, f)).sum() };
                (0..classes)
                    .max_by(|&a, &b| score(a).total_cmp(&score(b)))
                    .unwrap() as i64
            })
            .collect();
        Blobs { x, y, features }
    }

    fn len(&self) -> usize {
        self.y.len()
    }

    /// The samples `indices` as a batch on `device`.
    fn batch(&self, indices: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let f = self.features;
        let x: Vec<f32> = indices
            .iter()
            .flat_map(|&i| self.x[i * f..(i + 1) * f].to_vec())
            .collect();
        let y: Vec<i64> = indices.iter().map(|&i| self.y[i]).collect();
        (
            Tensor::from_data(TensorData::new(x, [indices.len(), f]), device),
            Tensor::from_data(TensorData::new(y, [indices.len()]), device),
        )
    }
}

/// The command line: `--batch B --steps S --seed N --out DIR`.
struct Args {
    batch: usize,
    steps: usize,
    seed: u64,
    out: Option<PathBuf>,
}

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut args = Args {
        batch: 16,
        steps: 20,
        seed: 7,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--batch" => args.batch = value()?.parse()?,
            "--steps" => args.steps = value()?.parse()?,
            "--seed" => args.seed = value()?.parse()?,
            "--out" => args.out = Some(value()?.into()),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    Ok(args)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    let pg = Arc::new(ProcessGroup::from_env()?);
    let (rank, world) = (pg.rank(), pg.world_size());

    let config = ResMlpConfig::new();
    let model = config.init(&device);
    let ddp_config = DdpConfig::new().with_check_replicas_every(Some(5));
    let (mut model, mut ddp) = DistributedDataParallel::new(model, pg.clone(), ddp_config)?;
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);

    let train = Blobs::new(1024, config.features, config.classes, 1);
    let mut sampler = DistributedSampler::new(train.len(), world, rank)?.with_seed(args.seed);
    let mut step = 0;
    'epochs: for epoch in 0.. {
        sampler.set_epoch(epoch);
        for chunk in sampler.indices().chunks_exact(args.batch) {
            if step == args.steps {
                break 'epochs;
            }
            let (x, y) = train.batch(chunk, &device);
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let grads = ddp.sync(&model, grads)?;
            model = optim.step(1e-3, model, grads);
            step += 1;
        }
    }

    // Exact evaluation: every test sample on exactly one rank, the counts summed once.
    let test = Blobs::new(300, config.features, config.classes, 2);
    let eval = DistributedSampler::exact(test.len(), world, rank)?;
    let valid = model.valid();
    let eval_device = device.clone().inner();
    let mut correct = 0i64;
    for chunk in eval.indices().chunks(64) {
        let (x, y) = test.batch(chunk, &eval_device);
        let predicted = valid.forward(x).argmax(1).squeeze_dim::<1>(1);
        correct += predicted.equal(y).int().sum().into_scalar::<i64>();
    }
    let totals = pg.all_reduce(vec![correct, eval.num_samples() as i64], ReduceOp::Sum)?;
    if rank == 0 {
        println!(
            "{step} steps on {world} rank(s): test accuracy {:.2}% ({}/{})",
            100.0 * totals[0] as f64 / totals[1] as f64,
            totals[0],
            totals[1]
        );
    }

    if let Some(out) = args.out {
        std::fs::create_dir_all(&out)?;
        let params = flatten_params(&model)?;
        let bytes: Vec<u8> = params.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(out.join(format!("params-rank{rank}.f32")), bytes)?;
    }
    Ok(())
}
