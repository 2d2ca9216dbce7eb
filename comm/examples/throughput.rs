//! Rough all-reduce timing with every rank as a thread of this process (real sockets on
//! 127.0.0.1). For real measurements use `ddp-allreduce-bench` under `ddprun`.
//!
//! `cargo run --release -p ddp-comm --example throughput -- [WORLD] [SIZES_KIB,..] [SEGMENT_BYTES] [SMALL_BYTES]`

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ddp_comm::{ProcessGroup, ReduceOp, DEFAULT_SEGMENT_BYTES, DEFAULT_SMALL_ALLREDUCE_BYTES};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let world: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let sizes: Vec<usize> = args
        .get(2)
        .map(|s| {
            s.split(',')
                .map(|k| k.parse::<usize>().unwrap() * 1024)
                .collect()
        })
        .unwrap_or_else(|| vec![4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20]);
    let segment: usize = args
        .get(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEGMENT_BYTES);
    let small: usize = args
        .get(4)
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SMALL_ALLREDUCE_BYTES);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    let results: Vec<Vec<Duration>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let mut b = ProcessGroup::builder()
                    .no_env()
                    .rank(rank)
                    .world_size(world)
                    .master_addr("127.0.0.1")
                    .master_port(port)
                    .segment_bytes(segment)
                    .small_allreduce_bytes(small);
                if rank == 0 {
                    b = b.master_listener(listener.take().unwrap());
                }
                let sizes = sizes.clone();
                s.spawn(move || {
                    let pg = b.build().unwrap();
                    sizes
                        .iter()
                        .map(|&bytes| {
                            let n = bytes / 4;
                            let iters = (256 << 20) / bytes.max(1 << 16) + 5;
                            let mut buf = vec![1.0f32; n];
                            buf = pg.all_reduce(buf, ReduceOp::Sum).unwrap(); // warm-up
                            let mut times = Vec::new();
                            for _ in 0..iters.min(200) {
                                pg.barrier().unwrap();
                                let t = Instant::now();
                                buf = pg.all_reduce(buf, ReduceOp::Avg).unwrap();
                                times.push(t.elapsed());
                            }
                            times.sort();
                            times[times.len() / 2]
                        })
                        .collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    println!("world {world}, segment {segment} B, small threshold {small} B");
    println!(
        "{:>12} {:>12} {:>10} {:>10}",
        "bytes", "median", "algbw GB/s", "busbw GB/s"
    );
    for (i, &bytes) in sizes.iter().enumerate() {
        let t = results.iter().map(|r| r[i]).max().unwrap();
        let algbw = bytes as f64 / t.as_secs_f64() / 1e9;
        let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
        println!("{bytes:>12} {:>12?} {algbw:>10.3} {busbw:>10.3}", t);
    }
}
