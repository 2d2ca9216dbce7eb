//! What the ddp test files share: the device and ranks as threads, each with its own process
//! group over loopback sockets.

#![allow(dead_code)] // each test binary uses a subset

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use burn::nn::BatchNorm;
use burn::tensor::Device;
use ddp_comm::{ProcessGroup, Transport};

/// The device of these tests: burn's CPU backend, recording gradients.
pub fn device() -> Device {
    Device::flex().autodiff()
}

/// Runs `f` on `n` ranks, one thread each, every thread with its own process group over the
/// default transport (shared memory: the ranks share a host).
pub fn run_ranks<T: Send>(n: usize, f: impl Fn(Arc<ProcessGroup>) -> T + Sync) -> Vec<T> {
    run_ranks_over(n, Transport::Auto, f)
}

/// Runs `f` on `n` ranks, one thread each, every thread with its own process group over
/// `transport`.
pub fn run_ranks_over<T: Send>(
    n: usize,
    transport: Transport,
    f: impl Fn(Arc<ProcessGroup>) -> T + Sync,
) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let own = if rank == 0 { listener.take() } else { None };
                let f = &f;
                s.spawn(move || {
                    let mut builder = ProcessGroup::builder()
                        .no_env()
                        .rank(rank)
                        .world_size(n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .transport(transport)
                        .timeout(Duration::from_secs(60))
                        .connect_timeout(Duration::from_secs(30));
                    if let Some(l) = own {
                        builder = builder.master_listener(l);
                    }
                    f(Arc::new(builder.build().expect("process group")))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The running mean and variance of `bn`, concatenated.
pub fn running_stats(bn: &BatchNorm) -> Vec<f32> {
    let read = |t: burn::tensor::Tensor<1>| t.into_data().try_to_vec::<f32>().unwrap();
    let mut v = read(bn.running_mean.value());
    v.extend(read(bn.running_var.value()));
    v
}
