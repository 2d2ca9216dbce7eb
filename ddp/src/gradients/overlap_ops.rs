//! The two autodiff operations behind gradient overlap (`overlap.rs`), as a burn backend
//! extension: [`OverlapOps`].
//!
//! - `ddp_grad_hook(param, carrier, hook)` is the identity on `param` (a hooked copy of the
//!   model uses its result in place of the parameter). Its backward step consumes the gradient
//!   of its output, which by then is complete (see below), and hands it to `hook` when the
//!   hook is armed (taken, not copied: the parameter then gets no gradient from this use);
//!   disarmed, it reads nothing and passes it on to the parameter, as any identity would. The
//!   second parent, `carrier`, only sets the step's place in backward.
//! - `ddp_depth_probe(loss, probe)` is the identity on the loss; its backward step, the first
//!   of the pass, records the depth of the graph.
//!
//! Why a carrier: burn's autodiff runs backward steps by graph depth, deepest first (a node's
//! depth is one more than its deepest parent's; `runtime/server.rs`, `execute_steps`). Every
//! consumer of the hooked value is deeper than the hook, so when the hook's step runs, every
//! contribution to the gradient is in: it is complete, however often the model used the
//! parameter. A hook on a bare parameter has depth 1 and would run last; with a carrier of depth
//! k (a chain of k operations on a one-element tensor) it has depth k + 1 and runs as soon as
//! the pass reaches that depth. A hook deeper than its consumer's other input pushes the
//! consumer (and what follows it) deeper: the order of the pass changes, never its results.
//!
//! The extension is routed on burn's CPU backend (`Flex`) and `Autodiff`; elsewhere the caller
//! does not hook (calling an extension on an unlisted backend panics).

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::flex::Flex;
use burn::backend::tensor::FloatTensor;
use burn::backend::{backend_extension, Autodiff, Backend, TensorMetadata};
use burn::tensor::{Shape, TensorData};

/// What a hook's backward step calls with its parameter's complete gradient (`None` when the
/// gradient could not be read), while `armed`.
#[derive(Clone)]
pub struct GradHook {
    /// The parameter's index in the wrapper's parameter list.
    pub index: usize,
    /// Whether the gradient is wanted: when not, the step reads nothing and calls nobody
    /// (accumulation micro-steps, a prepared model through plain `backward` and `sync`).
    pub armed: Arc<AtomicBool>,
    /// The receiver.
    pub sink: Arc<dyn Fn(usize, Option<TensorData>) + Send + Sync>,
}

impl fmt::Debug for GradHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GradHook({})", self.index)
    }
}

/// What the depth probe's backward step calls with the loss's depth.
#[derive(Clone)]
pub struct DepthProbe {
    /// The receiver.
    pub sink: Arc<dyn Fn(usize) + Send + Sync>,
}

impl fmt::Debug for DepthProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DepthProbe")
    }
}

/// The overlap operations; the defaults (any backend without autodiff) are the identity.
#[backend_extension(Flex, Autodiff)]
pub trait OverlapOps: Backend {
    /// The identity on `param`; on `Autodiff`, a backward step at the carrier's depth + 1 that
    /// hands the complete gradient to `hook` (armed) or to the parameter (disarmed).
    fn ddp_grad_hook(
        param: FloatTensor<Self>,
        carrier: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self> {
        let _ = (carrier, hook);
        param
    }

    /// The identity on `loss`; on `Autodiff`, the first backward step, which reports the
    /// loss's depth to `probe`.
    fn ddp_depth_probe(loss: FloatTensor<Self>, probe: DepthProbe) -> FloatTensor<Self> {
        let _ = probe;
        loss
    }
}

impl OverlapOps for Flex {}

/// Backward step of [`OverlapOps::ddp_grad_hook`].
#[derive(Debug)]
struct HookBackward;

impl<B: Backend> Backward<B, 2> for HookBackward {
    type State = GradHook;

    fn backward(self, ops: Ops<GradHook, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [param, carrier] = ops.parents;
        if let Some(carrier) = carrier {
            // A tracked carrier (the wrapper's are not) expects a gradient.
            let zeros = B::float_zeros(Shape::new([1]), &grad.device(), grad.dtype().into());
            grads.register::<B>(carrier.id, zeros);
        }
        if ops.state.armed.load(Ordering::Acquire) {
            // Taken, not copied: the tensor is this step's alone, so its memory becomes the
            // data handed over (burn's CPU backend reads a unique, contiguous tensor without
            // a copy), and the parameter gets no gradient of its own.
            let data = burn::tensor::try_read_sync(B::float_into_data(grad)).and_then(Result::ok);
            (ops.state.sink)(ops.state.index, data);
            return;
        }
        // On to the parameter (a leaf), as any identity: `GradientsParams::from_grads` on the
        // unhooked model finds it there.
        if let Some(param) = param {
            grads.register::<B>(param.id, grad);
        }
    }
}

/// Backward step of [`OverlapOps::ddp_depth_probe`].
#[derive(Debug)]
struct ProbeBackward;

impl<B: Backend> Backward<B, 1> for ProbeBackward {
    type State = DepthProbe;

    fn backward(self, ops: Ops<DepthProbe, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        (ops.state.sink)(ops.node.order.saturating_sub(1));
        let grad = grads.consume::<B>(&ops.node);
        let [loss] = ops.parents;
        if let Some(loss) = loss {
            grads.register::<B>(loss.id, grad);
        }
    }
}

impl<B: OverlapOps, C: CheckpointStrategy> OverlapOps for Autodiff<B, C> {
    fn ddp_grad_hook(
        param: FloatTensor<Self>,
        carrier: FloatTensor<Self>,
        hook: GradHook,
    ) -> FloatTensor<Self> {
        match HookBackward
            .prepare::<C>([param.node(), carrier.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(hook, param.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(param.into_primitive()),
        }
    }

    fn ddp_depth_probe(loss: FloatTensor<Self>, probe: DepthProbe) -> FloatTensor<Self> {
        match ProbeBackward
            .prepare::<C>([loss.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(probe, loss.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(loss.into_primitive()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    use burn::backend::Dispatch;
    use burn::tensor::{Device, Tensor};

    use super::*;

    #[test]
    fn a_disarmed_hook_reads_no_gradient_and_an_armed_one_takes_it_from_the_parameter() {
        let device = Device::flex().autodiff();
        let calls = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let armed = Arc::new(AtomicBool::new(false));
        let (c, v) = (Arc::clone(&calls), Arc::clone(&seen));
        let hook = GradHook {
            index: 7,
            armed: Arc::clone(&armed),
            sink: Arc::new(move |index, data| {
                c.fetch_add(1, Ordering::SeqCst);
                let values = data.map(|d| d.try_to_vec::<f32>().unwrap());
                v.lock().unwrap().push((index, values));
            }),
        };
        let param =
            Tensor::<1>::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &device).require_grad();
        let pass = |param: &Tensor<1>| {
            let carrier = Tensor::<1>::zeros([1], &device);
            let hooked = Tensor::<1>::from_dispatch(Dispatch::ddp_grad_hook(
                param.clone().into_dispatch(),
                carrier.into_dispatch(),
                hook.clone(),
            ));
            let grads = hooked.mul_scalar(3.0).sum().backward();
            param
                .grad(&grads)
                .map(|grad| grad.into_data().try_to_vec::<f32>().unwrap())
        };
        assert_eq!(pass(&param), Some(vec![3.0, 3.0]));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "a disarmed hook was called"
        );
        armed.store(true, Ordering::Release);
        assert_eq!(pass(&param), None, "the armed hook took the gradient");
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(7, Some(vec![3.0, 3.0]))],
            "an armed hook gets the gradient"
        );
    }
}
