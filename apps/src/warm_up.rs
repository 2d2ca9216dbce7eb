//! Warming burn up on a GPU before an elastic process asks to join.
//!
//! burn's CUDA backend compiles (NVRTC) and tunes each kernel the first time it runs: on a cold
//! kernel cache the first training step and the first evaluation take minutes, every later
//! step milliseconds (docs/gpu.md has the figures). A process that joins a running elastic
//! job and paid this inside its first step would hold every member of the job in that step's
//! all-reduce for minutes. So a process on a GPU runs the kernels of one training step
//! (forward, backward, burn's optimizer) and of one evaluation batch first, with batches of the
//! run's shapes, on a copy of its model, and throws the results away; then it joins, and its
//! first real step runs at full speed. The trainers call it before `ElasticGroup::join` on
//! every process of a `--backend cuda` run (for a founding rank it only moves the same work
//! before the group forms); on the CPU backend nothing is compiled at run time and it is not
//! called.

use std::time::{Duration, Instant};

use anyhow::Result;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use ddp_data::{BatchSource, CpuBatch};
use ddp_models::Classifier;

/// Runs one training step (forward, backward, and a step of `optim`, a fresh optimizer of the
/// run's kind, with its learning rate, when given) on a copy of `model` with the first `batch`
/// samples of `train`, and one evaluation batch of `test` without autodiff, on `device` (an
/// autodiff device); returns the time it took. `model` is left as it was: the step's result
/// and the optimizer are dropped.
pub(crate) fn warm_up<M, S, const D: usize>(
    model: &M,
    train: &S,
    test: &S,
    batch: usize,
    optim: Option<(ModuleOptimizer, f64)>,
    device: &Device,
) -> Result<Duration>
where
    M: Module + Classifier<D>,
    S: BatchSource<D> + ?Sized,
{
    let started = Instant::now();
    let first = |set: &S| (0..batch.min(set.len())).collect::<Vec<usize>>();
    let b = CpuBatch::build(train, &first(train)).into_tensors(device);
    let (loss, _) = model.loss(b.inputs, b.targets);
    let grads = GradientsParams::from_grads(loss.backward(), model);
    if let Some((mut optim, lr)) = optim {
        let stepped = optim.step(lr, model.clone(), grads);
        // Reading one value waits for the step's kernels.
        if let Some(t) = first_float(&stepped) {
            t.into_scalar::<f32>();
        }
    }
    let eval = model.valid();
    let b = CpuBatch::build(test, &first(test)).into_tensors(&device.clone().inner());
    let (loss, output) = eval.loss(b.inputs, b.targets.clone());
    eval.correct(&output, &b.targets);
    loss.into_scalar::<f32>();
    Ok(started.elapsed())
}

/// The first element of `model`'s first float tensor, as a one-element tensor.
fn first_float<M: Module>(model: &M) -> Option<Tensor<1>> {
    struct First(Option<Tensor<1>>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() {
                self.0 = Some(param.val().flatten::<1>(0, D - 1).slice(0..1));
            }
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddp_data::PimaTable;
    use ddp_models::PimaMlpConfig;

    /// A table of `rows` rows whose label is whether the first feature is above 50.
    fn table(rows: usize) -> PimaTable {
        let text: String = (0..rows)
            .map(|i| {
                let x = (i * 37 % 100) as f32;
                format!(
                    "{x},{},{},1,2,3,0.5,30,{}\n",
                    i % 7,
                    60 + i % 11,
                    u8::from(x > 50.0)
                )
            })
            .collect();
        PimaTable::parse(&text, "warm_up test").unwrap()
    }

    #[test]
    fn warming_up_leaves_the_model_as_it_was() {
        let device = Device::flex().autodiff();
        let split = table(40).split(0.25, 7).unwrap();
        let model = PimaMlpConfig::new().init(&device);
        let before = ddp::flatten_params(&model).unwrap();
        let optim = burn::optim::AdamConfig::new().init();
        let took = warm_up(
            &model,
            &split.train,
            &split.test,
            8,
            Some((optim, 0.5)),
            &device,
        )
        .unwrap();
        assert!(took > Duration::ZERO);
        // A step with lr 0.5 moves every weight of the copy: none of the model moved.
        assert_eq!(ddp::flatten_params(&model).unwrap(), before);
    }
}
