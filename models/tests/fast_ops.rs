//! The fast CPU ops of `ddp_models::ops` against burn's own layers on `Autodiff<Flex>`: forward
//! values and every gradient, on random inputs of odd sizes, batch 1, strides, padding and
//! dilation, at 1 and 3 threads; bit-identical reruns; and the whole CNN against the same
//! network built from burn's layer `forward`s.

use burn::module::Param;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::PaddingConfig2d;
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp_models::{nll_loss, ops, MnistCnn, MnistCnnConfig};

/// The device of these tests: burn's CPU backend, recording gradients.
fn device() -> Device {
    Device::flex().autodiff()
}

/// Deterministic values in `[-1, 1)` from a 64-bit LCG, so tests do not touch burn's global
/// RNG (which parallel tests would interleave).
fn lcg(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<D> {
    let n = shape.iter().product();
    Tensor::from_data(TensorData::new(lcg(n, seed), shape), &device())
}

fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

fn inner_values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// `‖a − b‖ / ‖b‖ ≤ 1e-5` (and equal lengths): the float sums of the two implementations run
/// in different orders, so they agree to rounding, not bit for bit.
fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum::<f64>().sqrt();
    assert!(norm > 0.0, "{what}: the reference is all zeros");
    assert!(
        diff <= 1e-5 * norm,
        "{what}: relative difference {:e} (‖ref‖ {norm:e})",
        diff / norm
    );
}

/// One convolution case.
struct ConvCase {
    batch: usize,
    channels: [usize; 2],
    size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    bias: bool,
}

const CONV_CASES: &[ConvCase] = &[
    // The CNN's two layers, at batch 1 and an odd batch.
    ConvCase {
        batch: 1,
        channels: [1, 32],
        size: [28, 28],
        kernel: [3, 3],
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        bias: true,
    },
    ConvCase {
        batch: 3,
        channels: [32, 64],
        size: [26, 26],
        kernel: [3, 3],
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        bias: true,
    },
    // Odd sizes, a rectangular kernel, strides, padding, dilation.
    ConvCase {
        batch: 5,
        channels: [3, 7],
        size: [11, 9],
        kernel: [3, 2],
        stride: [2, 1],
        padding: [1, 2],
        dilation: [1, 2],
        bias: true,
    },
    ConvCase {
        batch: 2,
        channels: [4, 5],
        size: [13, 10],
        kernel: [5, 3],
        stride: [3, 2],
        padding: [2, 1],
        dilation: [1, 1],
        bias: false,
    },
    // 1x1 kernel, stride 1, no padding: the column matrix is the image itself.
    ConvCase {
        batch: 3,
        channels: [6, 4],
        size: [5, 7],
        kernel: [1, 1],
        stride: [1, 1],
        padding: [0, 0],
        dilation: [1, 1],
        bias: true,
    },
    // Padding wider than the kernel's reach on one side (whole padded rows and columns).
    ConvCase {
        batch: 1,
        channels: [2, 3],
        size: [4, 3],
        kernel: [2, 2],
        stride: [1, 3],
        padding: [3, 2],
        dilation: [2, 1],
        bias: true,
    },
];

fn conv_layer(case: &ConvCase, seed: u64) -> Conv2d {
    let conv: Conv2d = Conv2dConfig::new(case.channels, case.kernel)
        .with_stride(case.stride)
        .with_padding(PaddingConfig2d::Explicit(
            case.padding[0],
            case.padding[1],
            case.padding[0],
            case.padding[1],
        ))
        .with_dilation(case.dilation)
        .with_bias(case.bias)
        .init(&device());
    let [ci, co] = case.channels;
    let fan_in = (ci * case.kernel[0] * case.kernel[1]) as f32;
    let scale = 1.0 / fan_in.sqrt();
    let weight = tensor([co, ci, case.kernel[0], case.kernel[1]], seed).mul_scalar(scale);
    Conv2d {
        weight: Param::from_tensor(weight),
        bias: case
            .bias
            .then(|| Param::from_tensor(tensor([co], seed + 1).mul_scalar(scale))),
        ..conv
    }
}

/// Output, input gradient, weight gradient and bias gradient of `forward` under the loss
/// `Σ y ⊙ r` for a fixed random `r`.
fn conv_results(
    case: &ConvCase,
    conv: &Conv2d,
    forward: impl Fn(Tensor<4>, &Conv2d) -> Tensor<4>,
) -> Vec<Vec<f32>> {
    let x = tensor(
        [case.batch, case.channels[0], case.size[0], case.size[1]],
        11,
    )
    .require_grad();
    let y = forward(x.clone(), conv);
    let r = tensor(y.dims(), 12);
    let grads = (y.clone() * r).sum().backward();
    let mut out = vec![
        values(y),
        inner_values(x.grad(&grads).unwrap()),
        inner_values(conv.weight.grad(&grads).unwrap()),
    ];
    if let Some(bias) = &conv.bias {
        out.push(inner_values(bias.grad(&grads).unwrap()));
    }
    out
}

fn in_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

#[test]
fn conv2d_matches_burn_forward_and_gradients() {
    for (i, case) in CONV_CASES.iter().enumerate() {
        let conv = conv_layer(case, 100 + i as u64);
        let reference = conv_results(case, &conv, |x, c| c.forward(x));
        for threads in [1, 3] {
            let fast = in_pool(threads, || conv_results(case, &conv, ops::conv2d));
            assert_eq!(fast.len(), reference.len());
            for (what, (f, r)) in ["output", "x grad", "weight grad", "bias grad"]
                .iter()
                .zip(fast.iter().zip(&reference))
            {
                assert_close(&format!("case {i}, {threads} threads, {what}"), f, r);
            }
        }
    }
}

#[test]
fn conv2d_fast_path_is_bit_reproducible() {
    let case = &CONV_CASES[1];
    let conv = conv_layer(case, 7);
    for threads in [1, 2] {
        let a = in_pool(threads, || conv_results(case, &conv, ops::conv2d));
        let b = in_pool(threads, || conv_results(case, &conv, ops::conv2d));
        for (x, y) in a.iter().zip(&b) {
            let (x, y): (Vec<u32>, Vec<u32>) = (
                x.iter().map(|v| v.to_bits()).collect(),
                y.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(x, y, "{threads} threads: two runs differ");
        }
    }
}

/// Max-pool cases: input size, kernel, stride, padding, dilation.
type PoolCase = ([usize; 4], [usize; 2], [usize; 2], [usize; 2], [usize; 2]);

const POOL_CASES: &[PoolCase] = &[
    ([3, 64, 24, 24], [2, 2], [2, 2], [0, 0], [1, 1]),
    ([1, 3, 7, 9], [2, 2], [2, 2], [0, 0], [1, 1]),
    ([2, 5, 11, 8], [3, 3], [2, 2], [1, 1], [1, 1]),
    ([2, 3, 10, 9], [3, 2], [1, 2], [1, 0], [2, 1]),
];

fn pool_results(
    case: &PoolCase,
    relu_first: bool,
    forward: impl Fn(Tensor<4>, &MaxPool2d) -> Tensor<4>,
) -> Vec<Vec<f32>> {
    let (shape, kernel, stride, padding, dilation) = *case;
    let pool = MaxPool2dConfig::new(kernel)
        .with_strides(stride)
        .with_padding(PaddingConfig2d::Explicit(
            padding[0], padding[1], padding[0], padding[1],
        ))
        .with_dilation(dilation)
        .init();
    let x = tensor(shape, 21).require_grad();
    // After a ReLU most windows hold ties at zero: the gradient must go to the same one of
    // them as burn's (the first).
    let input = if relu_first {
        relu(x.clone())
    } else {
        x.clone()
    };
    let y = forward(input, &pool);
    let r = tensor(y.dims(), 22);
    let grads = (y.clone() * r).sum().backward();
    vec![values(y), inner_values(x.grad(&grads).unwrap())]
}

#[test]
fn max_pool2d_matches_burn_forward_and_gradient() {
    for (i, case) in POOL_CASES.iter().enumerate() {
        for relu_first in [false, true] {
            let reference = pool_results(case, relu_first, |x, p| p.forward(x));
            for threads in [1, 3] {
                let fast = in_pool(threads, || pool_results(case, relu_first, ops::max_pool2d));
                for (what, (f, r)) in ["output", "x grad"].iter().zip(fast.iter().zip(&reference)) {
                    let what = format!("case {i}, relu {relu_first}, {threads} threads, {what}");
                    // Max-pool moves values without arithmetic: exactly equal.
                    assert_eq!(f, r, "{what}");
                }
            }
        }
    }
}

/// The CNN's forward with burn's layers only (what `MnistCnn::forward` was before the fast
/// path), dropout off.
fn reference_cnn(model: &MnistCnn, images: Tensor<4>) -> Tensor<2> {
    let x = relu(model.conv1.forward(images));
    let x = relu(model.conv2.forward(x));
    let x = model.pool.forward(x);
    let x = x.flatten::<2>(1, 3);
    let x = relu(model.fc1.forward(x));
    log_softmax(model.fc2.forward(x), 1)
}

#[test]
fn cnn_matches_burn_layers_in_loss_and_every_gradient() {
    let device = device();
    let model = MnistCnnConfig::new()
        .with_dropout1(0.0)
        .with_dropout2(0.0)
        .init(&device);
    let images = tensor([5, 1, 28, 28], 31);
    let targets = Tensor::<1, Int>::from_ints([3, 1, 4, 1, 5], &device);
    let fast = model.forward(images.clone());
    let reference = reference_cnn(&model, images);
    assert_close(
        "log-probs",
        &values(fast.clone()),
        &values(reference.clone()),
    );
    let g_fast = nll_loss(fast, targets.clone()).backward();
    let g_ref = nll_loss(reference, targets).backward();
    let params: Vec<(&str, Tensor<4>)> = vec![
        ("conv1.weight", model.conv1.weight.val()),
        ("conv2.weight", model.conv2.weight.val()),
    ];
    for (name, p) in params {
        assert_close(
            name,
            &inner_values(p.grad(&g_fast).unwrap()),
            &inner_values(p.grad(&g_ref).unwrap()),
        );
    }
    for (name, p) in [
        ("conv1.bias", model.conv1.bias.as_ref().unwrap().val()),
        ("conv2.bias", model.conv2.bias.as_ref().unwrap().val()),
        ("fc1.bias", model.fc1.bias.as_ref().unwrap().val()),
    ] {
        assert_close(
            name,
            &inner_values(p.grad(&g_fast).unwrap()),
            &inner_values(p.grad(&g_ref).unwrap()),
        );
    }
    assert_close(
        "fc1.weight",
        &inner_values(model.fc1.weight.val().grad(&g_fast).unwrap()),
        &inner_values(model.fc1.weight.val().grad(&g_ref).unwrap()),
    );
}
