//! The operations the models spend their time in, as a backend extension: [`FastOps`].
//!
//! The models call [`conv2d`], [`max_pool2d`] and [`dropout`] instead of `Conv2d::forward`,
//! `MaxPool2d::forward` and `Dropout::forward`. They take burn's own layers (so the models keep
//! their fields, their record layout and their PyTorch names). On burn's CPU backend (a
//! `Device::flex()` device, with or without autodiff) they end in a method of [`FastOps`], a
//! burn 0.22 backend extension (`#[backend_extension]`) implemented for two backends:
//!
//! - `Flex` runs the kernels of `cpu_ops.rs`: im2col + gemm straight on NCHW data, parallel
//!   over the images of the batch;
//! - `Autodiff<B>` records its own backward steps, which call `B`'s gradient methods of this
//!   trait: on an autodiff flex device the backward pass runs the fast kernels too.
//!
//! On every other device (CUDA, ...) they are the layer's own `forward`: burn's kernels. The
//! trait's default methods are burn's own ops, so a backend added to the extension without
//! kernels of its own computes exactly what the layer would.
//!
//! A layer configuration the fast path does not cover (groups, asymmetric or `Same`
//! padding, `ceil_mode`) falls back to the layer's own `forward` too, so every configuration
//! gives burn's result.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::ops::ConvOptions;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    backend_extension, Autodiff, AutodiffBackend, Backend, Dispatch, DispatchDevice, TensorMetadata,
};
use burn::nn::conv::Conv2d;
use burn::nn::pool::MaxPool2d;
use burn::nn::{Dropout, PaddingConfig2d};
use burn::tensor::{Device, Distribution, IntDType, Scalar, Tensor};

/// Backend extension for the models' hot operations. Every method has a default that is
/// burn's own op; a backend overrides the ones it has faster kernels for.
///
/// Shapes and semantics are those of burn's `ModuleOps` methods of the same name without the
/// `fast_` prefix.
#[backend_extension(Flex, Autodiff)]
pub trait FastOps: Backend {
    /// 2-D convolution without bias, NCHW.
    fn fast_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, weight, None, options)
    }

    /// 2-D convolution with a bias, NCHW. (Two methods rather than one with an optional bias:
    /// burn 0.22's extension macro does not route `Option` tensor arguments.)
    fn fast_conv2d_with_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d(x, weight, Some(bias), options)
    }

    /// Gradient of [`FastOps::fast_conv2d`] with respect to its input.
    fn fast_conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_x_backward(x, weight, output_grad, options)
    }

    /// Gradient of [`FastOps::fast_conv2d`] with respect to its weight.
    fn fast_conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        Self::conv2d_weight_backward(x, weight, output_grad, options)
    }

    /// Gradient of [`FastOps::fast_conv2d`] with respect to its bias.
    fn fast_conv2d_bias_backward(
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::conv2d_bias_backward(x, bias, output_grad)
    }

    /// 2-D max-pool, NCHW: the output and the flat index (`y * width + x`) of each maximum in
    /// its input plane.
    fn fast_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        let out = Self::max_pool2d_with_indices(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            false,
            IntDType::I64,
        );
        (out.output, out.indices)
    }

    /// Gradient of [`FastOps::fast_max_pool2d_with_indices`] with respect to its input.
    fn fast_max_pool2d_backward(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        output_grad: FloatTensor<Self>,
        indices: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::max_pool2d_with_indices_backward(
            x,
            kernel_size,
            stride,
            padding,
            dilation,
            false,
            output_grad,
            indices,
        )
        .x_grad
    }

    /// A dropout mask of `like`'s shape, device and dtype: every element independently
    /// `1 / (1 - prob)` with probability `1 - prob`, else `0`, drawn from the device's seeded
    /// generator (so `Device::seed` makes it reproducible). `prob` must lie in `[0, 1)`. The
    /// default is burn's own sampling (a Bernoulli tensor, then scaled).
    fn fast_dropout_mask(like: FloatTensor<Self>, prob: f64) -> FloatTensor<Self> {
        let keep = 1.0 - prob;
        let device = like.device();
        let mask = Self::float_random(
            like.shape(),
            Distribution::Bernoulli(keep),
            &device,
            like.dtype().into(),
        );
        Self::float_mul_scalar(mask, Scalar::from(1.0 / keep))
    }
}

/// Whether `device` is burn's CPU backend (flex), with or without autodiff: where [`FastOps`]
/// has its kernels. Everywhere else the layers' own `forward` runs.
fn on_flex(device: &Device) -> bool {
    matches!(
        device.clone().inner().as_dispatch(),
        DispatchDevice::Flex(_)
    )
}

/// `dropout.forward(x)`: the identity unless the layer is in training mode and the device
/// records gradients (burn's own rule) and the probability is positive, else `x` times a
/// [`FastOps::fast_dropout_mask`], one multiplication forward and one backward (burn's
/// `Dropout` multiplies twice: by the Bernoulli tensor, then by `1 / (1 - prob)`). A
/// probability of 1 or more zeroes `x`. Off the CPU backend: `dropout.forward(x)`.
pub fn dropout<const D: usize>(x: Tensor<D>, dropout: &Dropout) -> Tensor<D> {
    let device = x.device();
    if !on_flex(&device) {
        return dropout.forward(x);
    }
    if !dropout.training.is_enabled() || !device.is_autodiff() || dropout.prob <= 0.0 {
        return x;
    }
    if dropout.prob >= 1.0 {
        return x.zeros_like();
    }
    let mask = Dispatch::fast_dropout_mask(x.clone().into_dispatch(), dropout.prob);
    x * Tensor::from_dispatch(mask)
}

/// The symmetric padding `[height, width]` of a padding configuration, `None` when it is not
/// symmetric (or `Same`, whose amount depends on the input).
fn symmetric(padding: &PaddingConfig2d) -> Option<[usize; 2]> {
    match *padding {
        PaddingConfig2d::Valid => Some([0, 0]),
        PaddingConfig2d::Explicit(top, left, bottom, right) if top == bottom && left == right => {
            Some([top, left])
        }
        _ => None,
    }
}

/// `conv.forward(x)`, through [`FastOps::fast_conv2d`] on the CPU backend where the layer's
/// configuration allows (one group, symmetric padding), else through the layer itself.
pub fn conv2d(x: Tensor<4>, conv: &Conv2d) -> Tensor<4> {
    let padding = symmetric(&conv.padding).filter(|_| conv.groups == 1);
    let Some(padding) = padding.filter(|_| on_flex(&x.device())) else {
        return conv.forward(x);
    };
    let options = ConvOptions::new(conv.stride, padding, conv.dilation, 1);
    let (x, weight) = (x.into_dispatch(), conv.weight.val().into_dispatch());
    Tensor::from_dispatch(match &conv.bias {
        None => Dispatch::fast_conv2d(x, weight, options),
        Some(bias) => {
            Dispatch::fast_conv2d_with_bias(x, weight, bias.val().into_dispatch(), options)
        }
    })
}

/// `pool.forward(x)`, through [`FastOps::fast_max_pool2d_with_indices`] on the CPU backend
/// where the layer's configuration allows (symmetric padding, no `ceil_mode`), else through
/// the layer itself.
pub fn max_pool2d(x: Tensor<4>, pool: &MaxPool2d) -> Tensor<4> {
    let padding = symmetric(&pool.padding).filter(|_| !pool.ceil_mode);
    let Some(padding) = padding.filter(|_| on_flex(&x.device())) else {
        return pool.forward(x);
    };
    let (out, _indices) = Dispatch::fast_max_pool2d_with_indices(
        x.into_dispatch(),
        pool.kernel_size,
        pool.stride,
        padding,
        pool.dilation,
    );
    Tensor::from_dispatch(out)
}

/// Backward step of [`FastOps::fast_conv2d`] with a bias on `Autodiff`: parents input, weight
/// and bias; state: their checkpointed values and the options.
#[derive(Debug)]
struct FastConv2dBackward;

/// Backward step of [`FastOps::fast_conv2d`] without a bias: parents input and weight.
#[derive(Debug)]
struct FastConv2dNoBiasBackward;

/// Registers the input's and the weight's gradients of a convolution (those whose nodes
/// require one).
fn conv2d_x_weight_grads<B: FastOps>(
    [node_x, node_weight]: [Option<NodeId>; 2],
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    options: ConvOptions<2>,
    grads: &mut Gradients,
) {
    if let Some(node) = node_weight {
        let g = B::fast_conv2d_weight_backward(
            x.clone(),
            weight.clone(),
            grad.clone(),
            options.clone(),
        );
        grads.register::<B>(node, g);
    }
    if let Some(node) = node_x {
        let g = B::fast_conv2d_x_backward(x, weight, grad, options);
        grads.register::<B>(node, g);
    }
}

impl<B: FastOps> Backward<B, 3> for FastConv2dBackward {
    type State = (NodeId, NodeId, NodeId, ConvOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x, node_weight, node_bias] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state, bias_state, options) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
        let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight_state);
        let bias = checkpointer.retrieve_node_output::<FloatTensor<B>>(bias_state);
        if let Some(node) = node_bias {
            let g = B::fast_conv2d_bias_backward(x.clone(), bias, grad.clone());
            grads.register::<B>(node.id, g);
        }
        conv2d_x_weight_grads::<B>(
            [node_x.map(|n| n.id), node_weight.map(|n| n.id)],
            x,
            weight,
            grad,
            options,
            grads,
        );
    }
}

impl<B: FastOps> Backward<B, 2> for FastConv2dNoBiasBackward {
    type State = (NodeId, NodeId, ConvOptions<2>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, weight_state, options) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
        let weight = checkpointer.retrieve_node_output::<FloatTensor<B>>(weight_state);
        let [node_x, node_weight] = ops.parents;
        conv2d_x_weight_grads::<B>(
            [node_x.map(|n| n.id), node_weight.map(|n| n.id)],
            x,
            weight,
            grad,
            options,
            grads,
        );
    }
}

/// Backward step of [`FastOps::fast_max_pool2d_with_indices`] on `Autodiff`: one parent, the
/// input; state: its checkpoint, the indices of the maxima and the pool's geometry.
#[derive(Debug)]
struct FastMaxPool2dBackward;

/// State of [`FastMaxPool2dBackward`]: input, indices, kernel, stride, padding, dilation.
type PoolState<B> = (
    NodeId,
    IntTensor<B>,
    [usize; 2],
    [usize; 2],
    [usize; 2],
    [usize; 2],
);

impl<B: FastOps> Backward<B, 1> for FastMaxPool2dBackward {
    type State = PoolState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x_state, indices, kernel, stride, padding, dilation) = ops.state;
        let x = checkpointer.retrieve_node_output::<FloatTensor<B>>(x_state);
        if let Some(node) = node_x {
            let g =
                B::fast_max_pool2d_backward(x, kernel, stride, padding, dilation, grad, indices);
            grads.register::<B>(node.id, g);
        }
    }
}

/// The autodiff decorator: forward through the inner backend's fast ops, backward through its
/// fast gradient methods. The gradient methods themselves are never called on `Autodiff` by
/// these steps; their defaults (burn's ops on `Autodiff`) stay.
impl<B: FastOps, C: CheckpointStrategy> FastOps for Autodiff<B, C> {
    fn fast_conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        match FastConv2dNoBiasBackward
            .prepare::<C>([x.node(), weight.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let weight_state = prep.checkpoint(&weight);
                let out =
                    B::fast_conv2d(x.into_primitive(), weight.into_primitive(), options.clone());
                prep.finish((x_state, weight_state, options), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fast_conv2d(
                x.into_primitive(),
                weight.into_primitive(),
                options,
            )),
        }
    }

    fn fast_conv2d_with_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        match FastConv2dBackward
            .prepare::<C>([x.node(), weight.node(), bias.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let weight_state = prep.checkpoint(&weight);
                let bias_state = prep.checkpoint(&bias);
                let out = B::fast_conv2d_with_bias(
                    x.into_primitive(),
                    weight.into_primitive(),
                    bias.into_primitive(),
                    options.clone(),
                );
                prep.finish((x_state, weight_state, bias_state, options), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fast_conv2d_with_bias(
                x.into_primitive(),
                weight.into_primitive(),
                bias.into_primitive(),
                options,
            )),
        }
    }

    fn fast_max_pool2d_with_indices(
        x: FloatTensor<Self>,
        kernel_size: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> (FloatTensor<Self>, IntTensor<Self>) {
        match FastMaxPool2dBackward
            .prepare::<C>([x.node()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let (output, indices) = B::fast_max_pool2d_with_indices(
                    x.into_primitive(),
                    kernel_size,
                    stride,
                    padding,
                    dilation,
                );
                let state = (
                    x_state,
                    indices.clone(),
                    kernel_size,
                    stride,
                    padding,
                    dilation,
                );
                (prep.finish(state, output), indices)
            }
            OpsKind::UnTracked(prep) => {
                let (output, indices) = B::fast_max_pool2d_with_indices(
                    x.into_primitive(),
                    kernel_size,
                    stride,
                    padding,
                    dilation,
                );
                (prep.finish(output), indices)
            }
        }
    }

    /// The inner backend's mask, as a constant (no gradient flows into a mask).
    fn fast_dropout_mask(like: FloatTensor<Self>, prob: f64) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::fast_dropout_mask(like.into_primitive(), prob))
    }
}
