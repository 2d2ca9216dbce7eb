//! Verified answers to "how does burn 0.22 do X" for the DDP wrapper (docs/burn-notes.md quotes
//! these tests). They exercise burn, not this crate's logic; the models only serve as modules.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp_models::{param_specs, MnistCnnConfig, MnistMlp, MnistMlpConfig};

/// The device of these tests: burn's CPU backend, recording gradients.
fn device() -> Device {
    Device::flex().autodiff()
}

/// burn's Flex RNG is one process-wide stream (`Device::seed` replaces it, every random op draws
/// from it), and the test harness runs tests on parallel threads: tests that seed or draw
/// random numbers (every model init does) hold this lock so they do not interleave.
fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn batch(n: usize) -> (Tensor<4>, Tensor<1, Int>) {
    let device = device();
    let pixels: Vec<f32> = (0..n * 784)
        .map(|i| ((i * 31 % 97) as f32 / 97.0) - 0.5)
        .collect();
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 10).collect();
    (
        Tensor::from_data(TensorData::new(pixels, [n, 1, 28, 28]), &device),
        Tensor::from_data(TensorData::new(labels, [n]), &device),
    )
}

/// Every float parameter as flat f32, in visiting order (for comparisons and hashing).
fn read_flat<M: Module>(module: &M) -> Vec<Vec<f32>> {
    struct Reader(Vec<Vec<f32>>);
    impl ModuleVisitor for Reader {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.push(data.try_into_vec::<f32>().unwrap());
        }
    }
    let mut reader = Reader(Vec::new());
    module.visit(&mut reader);
    reader.0
}

/// Takes every gradient out of `grads` as flat f32 in visiting order (`None` where a
/// parameter got no gradient). Inside `visit_float` the rank `D` is a const generic, so no
/// runtime-rank dispatch is needed.
fn take_grads<M: Module>(model: &M, grads: &mut GradientsParams) -> Vec<Option<Vec<f32>>> {
    struct Taker<'a> {
        grads: &'a mut GradientsParams,
        out: Vec<Option<Vec<f32>>>,
    }
    impl ModuleVisitor for Taker<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let grad: Option<Tensor<D>> = self.grads.remove::<D>(param.id);
            self.out.push(grad.map(|g| {
                g.into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .unwrap()
            }));
        }
    }
    let mut taker = Taker {
        grads,
        out: Vec::new(),
    };
    model.visit(&mut taker);
    taker.out
}

/// Puts flat f32 gradients back, in visiting order, on the inner backend.
fn put_grads<M: Module>(model: &M, flat: Vec<Vec<f32>>) -> GradientsParams {
    struct Putter {
        grads: GradientsParams,
        flat: std::vec::IntoIter<Vec<f32>>,
    }
    impl ModuleVisitor for Putter {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let values = self.flat.next().unwrap();
            let shape = param.val().dims();
            // Gradients live on the device without autodiff (`Device::inner`).
            let device = param.val().device().inner();
            let tensor = Tensor::<D>::from_data(TensorData::new(values, shape), &device);
            self.grads.register::<D>(param.id, tensor);
        }
    }
    let mut putter = Putter {
        grads: GradientsParams::new(),
        flat: flat.into_iter(),
    };
    model.visit(&mut putter);
    putter.grads
}

#[test]
fn gradients_out_as_flat_f32_and_back() {
    let _rng = rng_lock();
    let device = device();
    device.seed(11);
    let model = MnistMlpConfig::new().init(&device);
    let (x, y) = batch(8);

    let (loss, _) = model.loss(x.clone(), y.clone());
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    assert_eq!(grads.len(), 4); // one per parameter that took part in the loss
    let flat = take_grads(&model, &mut grads);
    assert!(grads.is_empty());
    let specs = param_specs(&model);
    for (spec, g) in specs.iter().zip(&flat) {
        assert_eq!(g.as_ref().unwrap().len(), spec.numel(), "{}", spec.name);
    }

    // Reference: step with burn's own gradients.
    let (loss, _) = model.loss(x.clone(), y.clone());
    let reference_grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut sgd = SgdConfig::new().init();
    let reference = sgd.step(0.1, model.clone(), reference_grads);

    // Round trip through Vec<f32> (what an all-reduce over one rank does) gives the same step,
    // bit for bit.
    let back = put_grads(&model, flat.into_iter().map(Option::unwrap).collect());
    let mut sgd = SgdConfig::new().init();
    let stepped = sgd.step(0.1, model.clone(), back);
    assert!(
        read_flat(&stepped) == read_flat(&reference),
        "parameter values not as expected"
    );

    // Ids survive the optimizer step.
    let ids = |m: &MnistMlp| param_specs(m).into_iter().map(|s| s.id).collect::<Vec<_>>();
    assert_eq!(ids(&stepped), ids(&model));
}

/// Two layers, of which `forward` uses only the first.
#[derive(Module, Debug)]
struct HalfUsed {
    used: Linear,
    unused: Linear,
}

#[test]
fn params_without_gradient_are_absent_and_left_alone() {
    let _rng = rng_lock();
    let device = device();
    let model = ddp_models::materialize(HalfUsed {
        used: LinearConfig::new(4, 3).init(&device),
        unused: LinearConfig::new(4, 3).init(&device),
    });
    let x = Tensor::<2>::ones([2, 4], &device);
    let loss = model.used.forward(x).sum();
    let mut grads = GradientsParams::from_grads(loss.backward(), &model);
    assert_eq!(grads.len(), 2);
    let taken = take_grads(&model, &mut grads);
    assert!(taken[0].is_some() && taken[1].is_some());
    assert!(taken[2].is_none() && taken[3].is_none());

    // Adam with gradients only for `used`: `unused` keeps its values (and gets no state).
    let before = read_flat(&model);
    let loss = model.used.forward(Tensor::<2>::ones([2, 4], &device)).sum();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let mut adam = AdamConfig::new().init();
    let after = read_flat(&adam.step(0.1, model.clone(), grads));
    assert!(after[0] != before[0], "parameter values not as expected");
    assert!(
        after[2..] == before[2..],
        "parameter values not as expected"
    );

    // Zero is not the same as absent once the optimizer has state: after one real step,
    // Adam's momentum moves `used` on a zero gradient, while an absent gradient leaves it.
    let second_step = |zero_grads: bool| {
        let mut adam = AdamConfig::new().init();
        let loss = model.used.forward(Tensor::<2>::ones([2, 4], &device)).sum();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let stepped = adam.step(0.1, model.clone(), grads);
        let before = read_flat(&stepped);
        let grads = if zero_grads {
            put_grads(
                &stepped,
                before.iter().map(|v| vec![0.0; v.len()]).collect(),
            )
        } else {
            GradientsParams::new()
        };
        let after = read_flat(&adam.step(0.1, stepped, grads));
        (before, after)
    };
    let (before, after) = second_step(false);
    assert!(after == before, "parameter values not as expected");
    let (before, after) = second_step(true);
    assert!(after[0] != before[0], "parameter values not as expected");
    assert!(
        after[2..] == before[2..],
        "parameter values not as expected"
    ); // no state for `unused`: zero grad, zero update
}

#[test]
fn module_mapper_overwrites_values_keeping_ids() {
    let _rng = rng_lock();
    /// Replaces every float parameter's values by the next entry of `values`.
    struct Overwrite(std::vec::IntoIter<Vec<f32>>);
    impl ModuleMapper for Overwrite {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            let values = self.0.next().unwrap();
            let new = Tensor::<D>::from_data(TensorData::new(values, old.dims()), &old.device())
                .set_require_grad(old.is_require_grad());
            Param::from_mapped_value(id, new, mapper)
        }
    }

    let device = device();
    device.seed(1);
    let rank0 = MnistCnnConfig::new().init(&device);
    device.seed(2);
    let rank1 = MnistCnnConfig::new().init(&device);
    let ids_before: Vec<ParamId> = param_specs(&rank1).iter().map(|s| s.id).collect();
    assert!(
        read_flat(&rank0) != read_flat(&rank1),
        "parameter values not as expected"
    );

    let rank1 = rank1.map(&mut Overwrite(read_flat(&rank0).into_iter()));
    assert!(
        read_flat(&rank0) == read_flat(&rank1),
        "parameter values not as expected"
    );
    let ids_after: Vec<ParamId> = param_specs(&rank1).iter().map(|s| s.id).collect();
    assert!(ids_before == ids_after, "parameter values not as expected");
    assert!(rank1.fc1.weight.val().is_require_grad());

    // The overwritten model still trains: its gradients come back under the kept ids.
    let (x, y) = batch(2);
    let (loss, _) = rank1.loss(x, y);
    let mut grads = GradientsParams::from_grads(loss.backward(), &rank1);
    assert_eq!(grads.len(), 8);
    assert!(take_grads(&rank1, &mut grads).iter().all(Option::is_some));

    // Pitfall: a tensor made with `from_data` on an autodiff backend does not require a
    // gradient. A mapper that forgets `set_require_grad` silently freezes the parameter.
    struct Forgetful;
    impl ModuleMapper for Forgetful {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, old, mapper) = param.consume();
            let new = Tensor::<D>::from_data(old.to_data(), &old.device());
            Param::from_mapped_value(id, new, mapper)
        }
    }
    let frozen = rank1.map(&mut Forgetful);
    let (x, y) = batch(2);
    let (loss, _) = frozen.loss(x, y);
    // burn 0.22: nothing in the graph is tracked any more, and `backward` on such a loss
    // panics ("Tensor::backward requires a tracked autodiff tensor") instead of returning no
    // gradients as 0.21 did.
    assert!(!frozen.fc1.weight.val().is_require_grad());
    assert!(!loss.is_tracked());
}

#[test]
fn burn_params_are_lazy_and_clones_share_their_first_draw() {
    let _rng = rng_lock();
    let device = device();
    device.seed(5);
    let layer: Linear = LinearConfig::new(3, 2).init(&device);
    assert!(!layer.weight.is_initialized());
    let copy = layer.clone();
    let a = layer.weight.val().into_data().try_to_vec::<f32>().unwrap();
    let b = copy.weight.val().into_data().try_to_vec::<f32>().unwrap();
    assert_eq!(layer.weight.id, copy.weight.id);
    // burn 0.22 shares the lazy cell between clones (0.21 drew again per clone): the clone
    // sees the same values. Still lazy: the values are drawn at the first use, so which
    // parameter draws first decides who gets which random numbers.
    assert!(a == b, "a clone taken before first use drew other values");

    // ddp_models::materialize (called by every model's init) prevents that.
    let layer = ddp_models::materialize(LinearConfig::new(3, 2).init(&device));
    assert!(layer.weight.is_initialized());
    let copy = layer.clone();
    assert!(
        read_flat(&layer) == read_flat(&copy),
        "parameter values not as expected"
    );
}

#[test]
fn param_ids_differ_between_identical_inits() {
    let _rng = rng_lock();
    let device = device();
    device.seed(3);
    let a = MnistMlpConfig::new().init(&device);
    device.seed(3);
    let b = MnistMlpConfig::new().init(&device);
    assert!(
        read_flat(&a) == read_flat(&b),
        "parameter values not as expected"
    );
    let ids = |m: &MnistMlp| param_specs(m).into_iter().map(|s| s.id).collect::<Vec<_>>();
    assert!(ids(&a).iter().zip(ids(&b)).all(|(x, y)| *x != y));
}

/// Seed, init, and run `steps` Adam steps of the CNN with dropout on; returns the parameters.
fn seeded_cnn_run(seed: u64, steps: usize) -> Vec<Vec<f32>> {
    let device = device();
    device.seed(seed);
    let mut model = MnistCnnConfig::new().init(&device);
    let mut adam = AdamConfig::new().init();
    for _ in 0..steps {
        let (x, y) = batch(4);
        let (loss, _) = model.loss(x, y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = adam.step(1e-3, model, grads);
    }
    read_flat(&model)
}

#[test]
fn same_seed_same_training_bit_for_bit_dropout_included() {
    let _rng = rng_lock();
    let a = seeded_cnn_run(9, 2);
    let b = seeded_cnn_run(9, 2);
    assert!(a == b, "parameter values not as expected");
    assert!(
        a != seeded_cnn_run(10, 2),
        "parameter values not as expected"
    );
}

#[test]
fn dropout_draws_from_the_global_seeded_rng_and_is_off_in_valid() {
    let _rng = rng_lock();
    let device = device();
    device.seed(4);
    let model = MnistCnnConfig::new()
        .with_dropout1(0.5)
        .with_dropout2(0.5)
        .init(&device);
    let (x, _) = batch(2);
    let out = |m: &ddp_models::MnistCnn| {
        m.forward(x.clone())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    };

    device.seed(100);
    let first = out(&model);
    let second = out(&model);
    assert!(first != second, "each forward draws new masks");
    device.seed(100);
    assert!(out(&model) == first, "re-seeding replays the masks");

    let eval = model.valid();
    let x_inner = x.clone().inner();
    let e1 = eval
        .forward(x_inner.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let e2 = eval
        .forward(x_inner)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    assert!(e1 == e2, "no dropout on the inner backend");
}

/// An identity op whose backward step records its label: the only kind of "gradient hook"
/// out-of-tree code can add to burn 0.22's autodiff (custom ops are public API: the
/// `extension` feature's `Tensor::try_into_primitive` gives the `Autodiff<Flex>` primitive).
mod hook {
    use super::*;
    use burn::backend::autodiff::checkpoint::{base::Checkpointer, strategy::NoCheckpointing};
    use burn::backend::autodiff::grads::Gradients;
    use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
    use burn::backend::{Autodiff, Backend, Flex};
    use std::sync::Mutex;

    pub static EVENTS: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

    #[derive(Debug)]
    struct Hook;

    impl<Bk: Backend> Backward<Bk, 1> for Hook {
        type State = &'static str;
        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            EVENTS.lock().unwrap().push(ops.state);
            unary::<Bk, _>(ops.parents, ops.node, grads, |grad| grad);
        }
    }

    /// `x`, with a backward step that logs `label` when it runs.
    pub fn hooked<const D: usize>(x: Tensor<D>, label: &'static str) -> Tensor<D> {
        let x = x
            .try_into_primitive::<Autodiff<Flex>>()
            .expect("an autodiff flex tensor");
        let out = match Hook
            .prepare::<NoCheckpointing>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(label, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        };
        Tensor::from_primitive::<Autodiff<Flex>>(out)
    }

    /// Wraps every parameter in a hook named by the next label, keeping ids.
    pub struct HookParams(pub std::array::IntoIter<&'static str, 4>);
    impl ModuleMapper for HookParams {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, value, mapper) = param.consume();
            Param::from_mapped_value(id, hooked(value, self.0.next().unwrap()), mapper)
        }
    }
}

#[derive(Module, Debug)]
struct TwoLayer {
    fc1: Linear,
    fc2: Linear,
}

#[test]
fn custom_backward_ops_run_in_depth_order_so_param_hooks_fire_last() {
    let _rng = rng_lock();
    let device = device();
    let model = ddp_models::materialize(TwoLayer {
        fc1: LinearConfig::new(4, 4).init(&device),
        fc2: LinearConfig::new(4, 2).init(&device),
    });
    let names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];
    let model = model.map(&mut hook::HookParams(names.into_iter()));
    hook::EVENTS.lock().unwrap().clear();

    // fc2(relu(fc1(x))), with a marker on fc1's output.
    let x = Tensor::<2>::ones([3, 4], &device);
    let h = hook::hooked(model.fc1.forward(x), "fc1 output");
    let y = model.fc2.forward(burn::tensor::activation::relu(h));
    let mut grads = y.sum().backward();
    let events = hook::EVENTS.lock().unwrap().clone();

    // PyTorch would release fc2's gradients before reaching fc1; burn runs steps by graph
    // depth, and a parameter's hook sits at depth 1, so all of them run at the very end.
    assert_eq!(events[0], "fc1 output", "{events:?}");
    let mut params: Vec<_> = events[1..].to_vec();
    params.sort();
    assert_eq!(params, ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]);

    // And the hooked (non-leaf) parameter values have no gradient left for from_grads:
    // burn frees an intermediate node's gradient once its step has consumed it.
    assert!(model.fc2.weight.val().grad_remove(&mut grads).is_none());
}

#[test]
fn load_record_adopts_the_saved_param_ids() {
    let _rng = rng_lock();
    let device = device();
    let saved = MnistMlpConfig::new().init(&device);
    let fresh = MnistMlpConfig::new().init(&device);
    let ids = |m: &MnistMlp| param_specs(m).into_iter().map(|s| s.id).collect::<Vec<_>>();
    assert!(ids(&saved) != ids(&fresh));
    let loaded = fresh.load_record(saved.clone().into_record());
    // Ids cached before a checkpoint load (by a DDP wrapper, an optimizer) no longer match.
    assert!(ids(&loaded) == ids(&saved));
    assert!(read_flat(&loaded) == read_flat(&saved));
}
