//! Collectives on real sockets (127.0.0.1), one thread per rank: every op and dtype against a
//! sequential reference that follows the documented reduction order, so results must match bit
//! for bit (which also proves they are identical on all ranks and from run to run).

mod common;

use std::fmt::Debug;
use std::time::{Duration, Instant};

use common::{run_group, Rng};
use ddp_comm::{chunk_range, CommError, Element, ProcessGroup, ReduceOp, Transport};
use half::{bf16, f16};

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max];

/// A test element type with a reference reduction written here, element by element,
/// independently of the crate's (blocked, slice-converting) kernels: `combine(op, a, b)` is the
/// documented result of reducing two values, `div(a, n)` the last step of `Avg`.
trait TestElem: Element + Debug + PartialEq {
    fn random(rng: &mut Rng) -> Self;
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    fn div(a: Self, n: usize) -> Self;
}

/// Floats: IEEE arithmetic in the type itself; min and max keep the first operand on ties.
macro_rules! float_ref {
    ($t:ty, $scale:expr) => {
        impl TestElem for $t {
            fn random(rng: &mut Rng) -> Self {
                (rng.unit() * $scale) as $t
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + b,
                    ReduceOp::Min => {
                        if b < a {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Max => {
                        if b > a {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
            fn div(a: Self, n: usize) -> Self {
                a / n as $t
            }
        }
    };
}
float_ref!(f32, 100.0);
float_ref!(f64, 100.0);

/// 16-bit floats: each value widened to f32, combined in f32, rounded back to nearest (the
/// documented semantics), one scalar conversion at a time.
macro_rules! half_ref {
    ($t:ty) => {
        impl TestElem for $t {
            fn random(rng: &mut Rng) -> Self {
                <$t>::from_f64(rng.unit() * 10.0)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                <$t>::from_f32(f32::combine(op, a.to_f32(), b.to_f32()))
            }
            fn div(a: Self, n: usize) -> Self {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
        }
    };
}
half_ref!(bf16);
half_ref!(f16);

/// Integers: wrapping sums, truncating division.
macro_rules! int_ref {
    ($t:ty, $random:expr) => {
        impl TestElem for $t {
            fn random(rng: &mut Rng) -> Self {
                let f: fn(&mut Rng) -> $t = $random;
                f(rng)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Min => std::cmp::min(a, b),
                    ReduceOp::Max => std::cmp::max(a, b),
                }
            }
            fn div(a: Self, n: usize) -> Self {
                (a as i128 / n as i128) as $t
            }
        }
    };
}
int_ref!(i32, |rng| (rng.next_u64() % 2_000_001) as i32 - 1_000_000);
int_ref!(i64, |rng| rng.next_u64() as i64); // sums wrap
int_ref!(u8, |rng| rng.next_u64() as u8);

fn inputs<T: TestElem>(world: usize, len: usize, seed: u64) -> Vec<Vec<T>> {
    (0..world)
        .map(|r| {
            let mut rng = Rng::new(seed * 1000 + r as u64 + 1);
            (0..len).map(|_| T::random(&mut rng)).collect()
        })
        .collect()
}

/// Reduces `xs[order[0]][range], xs[order[1]][range], ...` left to right.
fn fold<T: TestElem>(
    xs: &[Vec<T>],
    order: impl Iterator<Item = usize>,
    range: std::ops::Range<usize>,
    op: ReduceOp,
) -> Vec<T> {
    let mut order = order;
    let mut acc = xs[order.next().unwrap()][range.clone()].to_vec();
    for r in order {
        for (a, &b) in acc.iter_mut().zip(&xs[r][range.clone()]) {
            *a = T::combine(op, *a, b);
        }
    }
    if op == ReduceOp::Avg {
        for a in acc.iter_mut() {
            *a = T::div(*a, xs.len());
        }
    }
    acc
}

/// The documented result of all_reduce: rank order 0..N for the direct path; for the ring,
/// chunk c summed from rank c around the ring.
fn reference_all_reduce<T: TestElem>(xs: &[Vec<T>], op: ReduceOp, direct: bool) -> Vec<T> {
    let n = xs.len();
    let len = xs[0].len();
    if direct || n == 1 {
        return fold(xs, 0..n, 0..len, op);
    }
    let mut out = Vec::with_capacity(len);
    for c in 0..n {
        out.extend(fold(
            xs,
            (0..n).map(|k| (c + k) % n),
            chunk_range(len, n, c),
            op,
        ));
    }
    out
}

/// The documented result of reduce_scatter at `rank`: rank order for the direct path; for the
/// ring, chunk c summed from rank c+1 around the ring, ending with rank c.
fn reference_reduce_scatter<T: TestElem>(
    xs: &[Vec<T>],
    op: ReduceOp,
    direct: bool,
    rank: usize,
) -> Vec<T> {
    let n = xs.len();
    let range = chunk_range(xs[0].len(), n, rank);
    if direct || n == 1 {
        fold(xs, 0..n, range, op)
    } else {
        fold(xs, (1..=n).map(|k| (rank + k) % n), range, op)
    }
}

/// The documented result of a hierarchical all-reduce (ranks on several hosts; `hosts[r]` is
/// rank r's host, hosts numbered in the order of their lowest rank): each host's ranks summed in
/// rank order, then the hosts' sums combined as the TCP algorithm over the leaders does (`direct`:
/// host order; ring: chunk c from host c), and `Avg` divided by the world size once.
fn reference_hierarchical<T: TestElem>(
    xs: &[Vec<T>],
    op: ReduceOp,
    hosts: &[usize],
    direct: bool,
) -> Vec<T> {
    let (n, len) = (xs.len(), xs[0].len());
    let acc_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let n_hosts = hosts.iter().max().unwrap() + 1;
    let sums: Vec<Vec<T>> = (0..n_hosts)
        .map(|h| fold(xs, (0..n).filter(|&r| hosts[r] == h), 0..len, acc_op))
        .collect();
    let mut out = reference_all_reduce(&sums, acc_op, direct);
    if op == ReduceOp::Avg {
        for a in out.iter_mut() {
            *a = T::div(*a, n);
        }
    }
    out
}

fn assert_bits<T: TestElem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let g: &[u8] = bytemuck::cast_slice(got);
    let w: &[u8] = bytemuck::cast_slice(want);
    if g != w {
        let i = got
            .iter()
            .zip(want)
            .position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b))
            .unwrap();
        panic!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        );
    }
}

/// Runs every collective over `T` for several lengths on this rank and checks it.
/// Over shared memory on one host every reduction is in rank order (the "direct" reference),
/// whatever the size; over several hosts (`hosts`: each rank's host, when some share one) the
/// all-reduce is hierarchical and the other collectives go over TCP.
fn check_dtype<T: TestElem>(
    pg: &ProcessGroup,
    small: usize,
    lens: &[usize],
    seed: u64,
    shm: bool,
    hosts: Option<&[usize]>,
) {
    let (rank, n) = (pg.rank(), pg.world_size());
    let name = T::DTYPE.name();
    for (li, &len) in lens.iter().enumerate() {
        let xs = inputs::<T>(n, len, seed + li as u64);
        let small_enough = len * std::mem::size_of::<T>() <= small;
        let direct = (shm && hosts.is_none()) || small_enough;
        for op in OPS {
            let what = format!("world {n} rank {rank}: all_reduce {len} {name} {op:?}");
            let out = pg
                .all_reduce(xs[rank].clone(), op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = match hosts {
                Some(h) => reference_hierarchical(&xs, op, h, small_enough),
                None => reference_all_reduce(&xs, op, direct),
            };
            assert_bits(&out, &want, &what);
            // In place, in a buffer of another type than `Vec`.
            let what = format!("{what} in place");
            let out = pg
                .submit_all_reduce_in_place::<T, _>(xs[rank].clone().into_boxed_slice(), op)
                .wait()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_bits(&out, &want, &what);

            let what = format!("world {n} rank {rank}: reduce_scatter {len} {name} {op:?}");
            let out = pg
                .reduce_scatter(xs[rank].clone(), op)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_bits(
                &out,
                &reference_reduce_scatter(&xs, op, direct, rank),
                &what,
            );

            // In place: the same chunk, where it lies in the buffer that comes back.
            let what = format!("{what} in place");
            let out = pg
                .submit_reduce_scatter_in_place::<T, _>(xs[rank].clone(), op)
                .wait()
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(out.len(), len, "{what}: the whole buffer comes back");
            assert_bits(
                &out[chunk_range(len, n, rank)],
                &reference_reduce_scatter(&xs, op, direct, rank),
                &what,
            );
        }
        let what = format!("world {n} rank {rank}: all_gather {len} {name}");
        let out = pg
            .all_gather(xs[rank].clone())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_bits(&out, &xs.concat(), &what);
        // In place, of the reduce-scatter's chunks: rank r contributes chunk r of its own
        // input (the rest of its buffer is garbage), everyone ends with every rank's chunk.
        let what = format!("world {n} rank {rank}: all_gather in place {len} {name}");
        let mut mine = inputs::<T>(1, len, seed + 1000 + rank as u64).remove(0);
        let own = chunk_range(len, n, rank);
        mine[own.clone()].copy_from_slice(&xs[rank][own]);
        let out = pg
            .submit_all_gather_in_place::<T, _>(mine)
            .wait()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let want: Vec<T> = (0..n)
            .flat_map(|r| xs[r][chunk_range(len, n, r)].to_vec())
            .collect();
        assert_bits(&out, &want, &what);
        for root in 0..n {
            let what = format!("world {n} rank {rank}: broadcast {len} {name} from {root}");
            let out = pg
                .broadcast(xs[rank].clone(), root)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_bits(&out, &xs[root], &what);
            let out = pg
                .submit_broadcast_in_place::<T, _>(xs[rank].clone().into_boxed_slice(), root)
                .wait()
                .unwrap_or_else(|e| panic!("{what} in place: {e}"));
            assert_bits(&out, &xs[root], &format!("{what} in place"));
        }
    }
    pg.barrier().unwrap();
}

fn check_everything(world: usize, small: usize, segment: usize, transport: Transport) {
    check_topology(world, small, segment, transport, None);
}

/// [`check_everything`] with rank r on simulated host `hosts[r]` (`GroupBuilder::host_id`).
fn check_topology(
    world: usize,
    small: usize,
    segment: usize,
    transport: Transport,
    hosts: Option<&[usize]>,
) {
    // 0 elements, 1 and 2 (fewer than the ranks), lengths not divisible by the world size, and
    // enough for several segments of `segment` bytes.
    let lens = [0usize, 1, 2, 7, 64, 301];
    let shm = transport == Transport::Shm && world > 1;
    // Hierarchical only when some host has two ranks; one rank per host is plain TCP.
    let shared = |h: &[usize]| (0..world).any(|r| h.iter().filter(|&&x| x == h[r]).count() > 1);
    let hier = hosts.filter(|h| shm && shared(h));
    let flat_shm = shm && hosts.is_none();
    run_group(
        world,
        |rank, b| {
            let b = b
                .small_allreduce_bytes(small)
                .segment_bytes(segment)
                .transport(transport);
            match hosts {
                Some(h) => b.host_id(format!("host-{}", h[rank])),
                None => b,
            }
        },
        |_, pg| {
            check_dtype::<f32>(&pg, small, &lens, 1, flat_shm, hier);
            check_dtype::<f64>(&pg, small, &lens, 2, flat_shm, hier);
            check_dtype::<bf16>(&pg, small, &lens, 3, flat_shm, hier);
            check_dtype::<f16>(&pg, small, &lens, 4, flat_shm, hier);
            check_dtype::<i32>(&pg, small, &lens, 5, flat_shm, hier);
            check_dtype::<i64>(&pg, small, &lens, 6, flat_shm, hier);
            check_dtype::<u8>(&pg, small, &lens, 7, flat_shm, hier);
        },
    );
}

#[test]
fn every_op_and_dtype_across_simulated_hosts() {
    // Two hosts of two; hosts interleaved (Slurm's cyclic placement); a host of one beside a
    // host of two; one rank per host (plain TCP). Leaders direct (small) and ring (0).
    let topologies: [&[usize]; 4] = [&[0, 0, 1, 1], &[0, 1, 0, 1, 0], &[0, 1, 1], &[0, 1, 2]];
    for hosts in topologies {
        for small in [usize::MAX, 0] {
            check_topology(hosts.len(), small, 64, Transport::Shm, Some(hosts));
        }
    }
}

#[test]
fn every_op_and_dtype_world_1() {
    check_everything(1, 1 << 20, 64, Transport::Auto);
}

#[test]
fn every_op_and_dtype_over_shared_memory_worlds_2_to_5() {
    // Explicitly shm: a fallback to TCP would be an error, not a silent pass.
    for world in 2..=5 {
        check_everything(world, 0, 64, Transport::Shm);
    }
}

#[test]
fn every_op_and_dtype_world_2_direct_and_ring() {
    check_everything(2, usize::MAX, 64, Transport::Tcp);
    check_everything(2, 0, 64, Transport::Tcp);
}

#[test]
fn every_op_and_dtype_world_3_direct_and_ring() {
    check_everything(3, usize::MAX, 64, Transport::Tcp);
    check_everything(3, 0, 64, Transport::Tcp);
}

#[test]
fn every_op_and_dtype_world_4_direct_and_ring() {
    check_everything(4, usize::MAX, 48, Transport::Tcp);
    check_everything(4, 0, 48, Transport::Tcp);
}

#[test]
fn every_op_and_dtype_world_5_direct_and_ring() {
    check_everything(5, usize::MAX, 40, Transport::Tcp);
    check_everything(5, 0, 40, Transport::Tcp);
}

#[test]
fn integer_results_are_exact() {
    // An independent check of the arithmetic (not of the order): small integers, plain math.
    let out = run_group(
        3,
        |_, b| b.small_allreduce_bytes(0).segment_bytes(16),
        |rank, pg| {
            let buf: Vec<f32> = (0..50).map(|i| (i * (rank + 1)) as f32).collect();
            let sum = pg.all_reduce(buf.clone(), ReduceOp::Sum).unwrap();
            let avg = pg.all_reduce(buf.clone(), ReduceOp::Avg).unwrap();
            let max = pg.all_reduce(buf.clone(), ReduceOp::Max).unwrap();
            let min = pg.all_reduce(buf, ReduceOp::Min).unwrap();
            let ints = pg
                .all_reduce(vec![rank as i32 * 7 + 1; 5], ReduceOp::Avg)
                .unwrap();
            (sum, avg, max, min, ints)
        },
    );
    for (sum, avg, max, min, ints) in out {
        for i in 0..50 {
            assert_eq!(sum[i], (6 * i) as f32);
            assert_eq!(avg[i], (2 * i) as f32);
            assert_eq!(max[i], (3 * i) as f32);
            assert_eq!(min[i], i as f32);
        }
        assert_eq!(ints, vec![(1 + 8 + 15) / 3; 5]);
    }
}

#[test]
fn large_buffers_use_the_pipelined_ring_and_are_bit_identical() {
    // Default tuning: 1 MiB segments, so an 8 MiB buffer in 2 chunks has 4 segments per chunk.
    let len = 2 * (1 << 20) + 3;
    let xs = inputs::<f32>(2, len, 42);
    let want = reference_all_reduce(&xs, ReduceOp::Sum, false);
    let outs = run_group(
        2,
        |_, b| b.transport(Transport::Tcp),
        |rank, pg| pg.all_reduce(xs[rank].clone(), ReduceOp::Sum).unwrap(),
    );
    for out in &outs {
        assert_bits(out, &want, "8 MiB all_reduce, world 2");
    }

    // World 4 with 64 KiB segments: many segments in flight per chunk; twice in one group and
    // once more in a new group, every time the same bits.
    let len = 3 * (1 << 18) + 5;
    let xs = inputs::<f32>(4, len, 43);
    let hs = inputs::<bf16>(4, len, 44);
    let want = reference_all_reduce(&xs, ReduceOp::Avg, false);
    let want_h = reference_all_reduce(&hs, ReduceOp::Sum, false);
    let want_rs = reference_reduce_scatter(&xs, ReduceOp::Sum, false, 0);
    for _ in 0..2 {
        let outs = run_group(
            4,
            |_, b| b.segment_bytes(64 << 10).transport(Transport::Tcp),
            |rank, pg| {
                let a = pg.all_reduce(xs[rank].clone(), ReduceOp::Avg).unwrap();
                let b = pg.all_reduce(xs[rank].clone(), ReduceOp::Avg).unwrap();
                let h = pg.all_reduce(hs[rank].clone(), ReduceOp::Sum).unwrap();
                let rs = pg.reduce_scatter(xs[rank].clone(), ReduceOp::Sum).unwrap();
                let g = pg.all_gather(xs[rank][..100_000].to_vec()).unwrap();
                let bc = pg.broadcast(xs[rank].clone(), 3).unwrap();
                // In place, through the ring: every chunk as the reduce-scatter sums it.
                let buf = pg
                    .submit_reduce_scatter_in_place::<f32, _>(xs[rank].clone(), ReduceOp::Sum)
                    .wait()
                    .unwrap();
                let buf = pg.submit_all_gather_in_place::<f32, _>(buf).wait().unwrap();
                let want: Vec<f32> = (0..4)
                    .flat_map(|c| reference_reduce_scatter(&xs, ReduceOp::Sum, false, c))
                    .collect();
                assert_bits(&buf, &want, "reduce_scatter + all_gather in place, ring");
                (a, b, h, rs, g, bc)
            },
        );
        for (rank, (a, b, h, rs, g, bc)) in outs.iter().enumerate() {
            assert_bits(a, &want, "avg, first run");
            assert_bits(b, &want, "avg, second run");
            assert_bits(h, &want_h, "bf16 sum");
            if rank == 0 {
                assert_bits(rs, &want_rs, "reduce_scatter");
            }
            let gathered: Vec<f32> = xs
                .iter()
                .flat_map(|x| x[..100_000].iter().copied())
                .collect();
            assert_bits(g, &gathered, "all_gather");
            assert_bits(bc, &xs[3], "broadcast");
        }
    }
}

#[test]
fn large_buffers_over_shared_memory_are_bit_identical() {
    // Several 4 MiB pieces (the slots alternate), a last piece of odd length, two-phase and
    // one-shot pieces; every element summed in rank order, the same bits on every rank, twice
    // in one group and again in a new one.
    let len = 2_500_001;
    let xs = inputs::<f32>(3, len, 45);
    let hs = inputs::<bf16>(3, 3 * (1 << 18) + 5, 46);
    let want = reference_all_reduce(&xs, ReduceOp::Avg, true);
    let want_h = reference_all_reduce(&hs, ReduceOp::Sum, true);
    let want_max = reference_all_reduce(&xs, ReduceOp::Max, true);
    for _ in 0..2 {
        let outs = run_group(
            3,
            |_, b| b.transport(Transport::Shm),
            |rank, pg| {
                let a = pg.all_reduce(xs[rank].clone(), ReduceOp::Avg).unwrap();
                let b = pg.all_reduce(xs[rank].clone(), ReduceOp::Avg).unwrap();
                let h = pg.all_reduce(hs[rank].clone(), ReduceOp::Sum).unwrap();
                let m = pg.all_reduce(xs[rank].clone(), ReduceOp::Max).unwrap();
                let rs = pg.reduce_scatter(xs[rank].clone(), ReduceOp::Sum).unwrap();
                let g = pg.all_gather(xs[rank][..1_200_000].to_vec()).unwrap();
                let bc = pg.broadcast(xs[rank].clone(), 2).unwrap();
                // In place: the reduced chunk where it lies, then every chunk gathered back.
                let mut buf = pg
                    .submit_reduce_scatter_in_place::<f32, _>(xs[rank].clone(), ReduceOp::Sum)
                    .wait()
                    .unwrap();
                assert_bits(
                    &buf[chunk_range(len, 3, rank)],
                    &rs,
                    "reduce_scatter in place",
                );
                buf = pg.submit_all_gather_in_place::<f32, _>(buf).wait().unwrap();
                let whole = pg.all_reduce(xs[rank].clone(), ReduceOp::Sum).unwrap();
                assert_bits(&buf, &whole, "reduce_scatter + all_gather in place");
                (a, b, h, m, rs, g, bc)
            },
        );
        let gathered: Vec<f32> = xs
            .iter()
            .flat_map(|x| x[..1_200_000].iter().copied())
            .collect();
        for (rank, (a, b, h, m, rs, g, bc)) in outs.iter().enumerate() {
            assert_bits(a, &want, "avg, first run");
            assert_bits(b, &want, "avg, second run");
            assert_bits(h, &want_h, "bf16 sum");
            assert_bits(m, &want_max, "max");
            let want_rs = reference_reduce_scatter(&xs, ReduceOp::Sum, true, rank);
            assert_bits(rs, &want_rs, "reduce_scatter");
            assert_bits(g, &gathered, "all_gather");
            assert_bits(bc, &xs[2], "broadcast");
        }
    }
}

#[test]
fn large_buffers_across_simulated_hosts_are_bit_identical() {
    // Two hosts of two ranks (hosts interleaved): many shared-memory pieces inside each host,
    // the TCP ring between the leaders; the documented order, the same bits on every rank.
    let hosts = [0usize, 1, 0, 1];
    let len = 2_500_001;
    let xs = inputs::<f32>(4, len, 47);
    let hs = inputs::<bf16>(4, 3 * (1 << 18) + 5, 48);
    let want = reference_hierarchical(&xs, ReduceOp::Avg, &hosts, false);
    let want_h = reference_hierarchical(&hs, ReduceOp::Sum, &hosts, false);
    let outs = run_group(
        4,
        |rank, b| {
            b.transport(Transport::Shm)
                .host_id(format!("host-{}", hosts[rank]))
        },
        |rank, pg| {
            let a = pg.all_reduce(xs[rank].clone(), ReduceOp::Avg).unwrap();
            let h = pg.all_reduce(hs[rank].clone(), ReduceOp::Sum).unwrap();
            let bc = pg.broadcast(xs[rank].clone(), 3).unwrap();
            pg.barrier().unwrap();
            (a, h, bc)
        },
    );
    for (a, h, bc) in &outs {
        assert_bits(a, &want, "avg");
        assert_bits(h, &want_h, "bf16 sum");
        assert_bits(bc, &xs[3], "broadcast");
    }
}

/// Flow control never silences a rank: rank 0 sends 100 segments (beyond its 16 credits) to
/// rank 1, which sits in a step three times the peer timeout before it consumes any. Rank 0's
/// writer waits for credit meanwhile, and must keep sending heartbeats, or rank 1 would declare
/// it dead.
#[test]
fn a_sender_waiting_for_credit_still_sends_heartbeats() {
    let xs: Vec<f32> = (0..25_600).map(|i| i as f32).collect();
    let outs = run_group(
        2,
        |_, b| {
            b.transport(Transport::Tcp)
                .segment_bytes(1024)
                .peer_timeout(Duration::from_secs(1))
        },
        |rank, pg| {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(3));
            }
            pg.broadcast(xs.clone(), 0)
        },
    );
    for (rank, out) in outs.into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_bits(&out, &xs, "broadcast");
    }
}

#[test]
fn async_work_runs_in_submission_order() {
    let outs = run_group(
        3,
        |_, b| b.segment_bytes(4096),
        |rank, pg| {
            let big: Vec<f32> = vec![rank as f32 + 1.0; 300_000];
            let a = pg.submit_all_reduce(big, ReduceOp::Sum);
            let b = pg.submit_broadcast(vec![rank as u8; 10], 2);
            let c = pg.submit_all_gather(vec![rank as i64; 2]);
            let d = pg.submit_barrier();
            let e = pg.submit_reduce_scatter(vec![1.0f64; 7], ReduceOp::Sum);
            let f = pg.submit_all_reduce(vec![rank as i32], ReduceOp::Max);
            // Wait for the last first: everything before it must be complete by then.
            let f = f.wait().unwrap();
            assert!(a.is_completed() && b.is_completed() && c.is_completed());
            assert!(d.is_completed() && e.is_completed());
            let e = e.wait().unwrap();
            d.wait().unwrap();
            let c = c.wait().unwrap();
            let b = b.wait().unwrap();
            let a = a.wait().unwrap();
            (a, b, c, e, f)
        },
    );
    for (rank, (a, b, c, e, f)) in outs.into_iter().enumerate() {
        assert!(a.iter().all(|&x| x == 6.0));
        assert_eq!(b, vec![2u8; 10]);
        assert_eq!(c, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(e, vec![3.0; chunk_range(7, 3, rank).len()]);
        assert_eq!(f, vec![2]);
    }
}

#[test]
fn world_size_one_needs_nothing() {
    let pg = ProcessGroup::builder().no_env().build().unwrap();
    assert_eq!(
        (
            pg.rank(),
            pg.world_size(),
            pg.local_rank(),
            pg.local_world_size()
        ),
        (0, 1, 0, 1)
    );
    assert!(pg.store().is_none());
    assert_eq!(
        pg.all_reduce(vec![3.0f32, 4.0], ReduceOp::Avg).unwrap(),
        [3.0, 4.0]
    );
    assert_eq!(
        pg.reduce_scatter(vec![1u8, 2, 3], ReduceOp::Sum).unwrap(),
        [1, 2, 3]
    );
    assert_eq!(pg.all_gather(vec![5i64]).unwrap(), [5]);
    assert_eq!(pg.broadcast(vec![bf16::ONE], 0).unwrap(), [bf16::ONE]);
    pg.barrier().unwrap();
    let err = pg.broadcast(vec![1.0f32], 1).unwrap_err();
    assert!(err.to_string().contains("root 1"), "{err}");
    let w = pg.submit_all_reduce(vec![1.0f64], ReduceOp::Sum);
    assert!(w.is_completed());
    assert_eq!(w.wait().unwrap(), [1.0]);
}

#[test]
fn store_is_usable_and_matching_tokens_work() {
    let outs = run_group(
        3,
        |_, b| b.token("s3cret"),
        |rank, pg| {
            let store = pg.store().unwrap();
            store.set(&format!("test/{rank}"), &[rank as u8]).unwrap();
            let n = store.add("test/count", 1).unwrap();
            store.wait(&["test/0", "test/1", "test/2"]).unwrap();
            let v = store.get("test/2").unwrap();
            pg.barrier().unwrap();
            let total = store.add("test/count", 0).unwrap();
            (
                n,
                v,
                total,
                pg.all_reduce(vec![1u8], ReduceOp::Sum).unwrap(),
            )
        },
    );
    let mut ns: Vec<i64> = outs.iter().map(|o| o.0).collect();
    ns.sort();
    assert_eq!(ns, [1, 2, 3]);
    for (_, v, total, sum) in outs {
        assert_eq!((v, total, sum), (vec![2], 3, vec![3]));
    }
}

// ------------------------------------------------------------------------------------------
// Errors

fn message(r: &Result<impl Debug, CommError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mismatched_collectives_fail_on_both_ranks_naming_both() {
    check_mismatch(Transport::Tcp);
}

#[test]
fn mismatched_collectives_over_shared_memory_fail_on_both_ranks_naming_both() {
    check_mismatch(Transport::Shm);
}

fn check_mismatch(transport: Transport) {
    let outs = run_group(
        2,
        |_, b| b.transport(transport),
        |rank, pg| {
            let t = Instant::now();
            let first = if rank == 0 {
                pg.all_reduce(vec![0f32; 4096], ReduceOp::Sum).map(|_| ())
            } else {
                pg.broadcast(vec![0f32; 10], 0).map(|_| ())
            };
            let later = pg.barrier();
            (first, later, t.elapsed())
        },
    );
    for (rank, (first, later, took)) in outs.iter().enumerate() {
        let msg = message(first);
        assert!(
            msg.contains("all_reduce #0 (4096 f32, sum)"),
            "rank {rank}: {msg}"
        );
        assert!(
            msg.contains("broadcast #0 (10 f32, root 0)"),
            "rank {rank}: {msg}"
        );
        // Over TCP rank 1 sees rank 0's frame first and its ABORT reaches rank 0; over shared
        // memory both see the other's fingerprint at once, and each names both sides.
        let names_both = (msg.contains("rank 1 is in broadcast")
            && msg.contains("rank 0 sent all_reduce"))
            || (transport == Transport::Shm
                && msg.contains("rank 0 is in all_reduce")
                && msg.contains("rank 1 sent broadcast"));
        assert!(names_both, "rank {rank}: {msg}");
        // Long before the 10 s deadline: a mismatch fails at once.
        assert!(*took < Duration::from_secs(8), "rank {rank} took {took:?}");
        // Every later operation fails too, with the same root cause.
        let later = message(later);
        assert!(
            later.contains("barrier #1") && later.contains("failed earlier"),
            "{later}"
        );
    }

    // A rank that skips a collective: the sequence numbers differ.
    let outs = run_group(
        2,
        |_, b| b,
        |rank, pg| {
            if rank == 0 {
                pg.barrier().unwrap_err();
            }
            pg.all_reduce(vec![1i64; 3], ReduceOp::Max).map(|_| ())
        },
    );
    let msg = message(&outs[1]);
    assert!(
        msg.contains("all_reduce #0") && msg.contains("barrier #0"),
        "{msg}"
    );
    // Same op and sequence, different length or type.
    let outs = run_group(
        2,
        |_, b| b,
        |rank, pg| {
            if rank == 0 {
                pg.all_reduce(vec![1i64; 3], ReduceOp::Sum).map(|_| ())
            } else {
                pg.all_reduce(vec![1f64; 4], ReduceOp::Sum).map(|_| ())
            }
        },
    );
    for out in &outs {
        let msg = message(out);
        assert!(
            msg.contains("(3 i64, sum)") && msg.contains("(4 f64, sum)"),
            "{msg}"
        );
    }
}

#[test]
fn a_silent_rank_is_named_after_the_deadline() {
    let outs = run_group(
        3,
        |_, b| b.timeout(Duration::from_millis(1500)),
        |rank, pg| {
            let t = Instant::now();
            if rank == 2 {
                // Silent for 4x the deadline: the others must give up on it (had they waited
                // for it, the all-reduce would have succeeded).
                std::thread::sleep(Duration::from_millis(6000));
            }
            (pg.all_reduce(vec![1f32; 100], ReduceOp::Sum), t.elapsed())
        },
    );
    for (rank, (r, took)) in outs.iter().enumerate().take(2) {
        let msg = message(r);
        assert!(
            msg.contains("rank 2") && msg.contains("all_reduce #0"),
            "rank {rank}: {msg}"
        );
        // Not before the deadline.
        assert!(
            *took >= Duration::from_millis(1400),
            "rank {rank}: {took:?}"
        );
    }
    // The silent rank learns of the failure too (the others aborted).
    assert!(outs[2].0.is_err());
}

#[test]
fn a_rank_that_leaves_early_is_named() {
    // Rank 1 leaves as soon as its build() returns. A slower rank may still be in its own
    // start-up barrier then (rank 1 had all the frames it needed; the slower rank has them
    // queued behind the ABORT that rank 2 sends when it meets rank 1's goodbye): its build()
    // fails instead of its all_reduce. Either way the error must name rank 1, quickly.
    let outs = common::try_group(
        3,
        |_, b| b,
        |rank, built| {
            let t = Instant::now();
            let pg = match built {
                Ok(pg) => pg,
                Err(e) if rank != 1 => return Some((Err(e), "start-up", t.elapsed())),
                Err(e) => panic!("rank 1 could not join: {e}"),
            };
            if rank == 1 {
                // Leaving does not wait for the others' deadline (10 s): they are alive and
                // answer the goodbye.
                drop(pg);
                assert!(
                    t.elapsed() < Duration::from_secs(8),
                    "drop took {:?}",
                    t.elapsed()
                );
                return None;
            }
            let r = pg.all_reduce(vec![1f32; 10], ReduceOp::Sum);
            Some((r.map(|_| ()), "all_reduce #0", t.elapsed()))
        },
    );
    for (r, op, took) in outs.into_iter().flatten() {
        let msg = message(&r);
        assert!(msg.contains("rank 1") && msg.contains(op), "{msg}");
        assert!(took < Duration::from_secs(8), "{took:?}");
        assert_eq!(r.unwrap_err().peer(), Some(1));
    }
}

#[test]
fn rank_0_may_leave_right_after_start_up() {
    // build() returns only when every rank is connected, so rank 0 dropping its group (and the
    // store) at once never strands a rank that is still starting up.
    for _ in 0..5 {
        let all_built = std::sync::Barrier::new(4);
        let outs = common::try_group(
            4,
            |_, b| b,
            |rank, r| {
                let r = r.map(|pg| if rank == 0 { None } else { Some(pg) });
                all_built.wait();
                if let Some(pg) = r? {
                    // Rank 0 has left: the next collective names it.
                    let err = pg.barrier().unwrap_err();
                    assert_eq!(err.peer(), Some(0), "{err}");
                }
                Ok::<(), CommError>(())
            },
        );
        for (rank, r) in outs.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        }
    }
}

#[test]
fn a_wrong_token_is_refused() {
    let outs = common::try_group(
        2,
        |rank, b| {
            b.token(if rank == 0 { "right" } else { "wrong" })
                .connect_timeout(Duration::from_secs(2))
        },
        |_, r| r.map(|pg| pg.rank()),
    );
    let msg = message(&outs[1]);
    assert!(
        msg.contains("token mismatch") && msg.contains("127.0.0.1:"),
        "{msg}"
    );
    let msg = message(&outs[0]);
    assert!(msg.contains("rank 0"), "{msg}");
}

#[test]
fn another_jobs_process_is_refused() {
    let outs = common::try_group(
        2,
        |rank, b| {
            b.job_id(if rank == 0 { "job-a" } else { "job-b" })
                .connect_timeout(Duration::from_secs(2))
        },
        |_, r| r.map(|pg| pg.rank()),
    );
    let msg = message(&outs[1]);
    assert!(
        msg.contains("job id mismatch") && msg.contains("rendezvous store"),
        "{msg}"
    );
    assert!(outs[0].is_err());
    // The same job name on every rank works.
    let outs = run_group(
        2,
        |_, b| b.job_id("job-c"),
        |_, pg| pg.all_reduce(vec![1u8], ReduceOp::Sum).unwrap(),
    );
    assert_eq!(outs, [vec![2], vec![2]]);
}

#[test]
fn process_group_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<ProcessGroup>();
    check::<ddp_comm::Store>();
    check::<ddp_comm::Work<Vec<f32>>>();
    check::<CommError>();
}

#[test]
fn connect_deadline_names_the_address() {
    let (_refusing, port) = common::refusing_port();
    let t = Instant::now();
    let r = ProcessGroup::builder()
        .no_env()
        .rank(1)
        .world_size(2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .connect_timeout(Duration::from_millis(500))
        .build();
    let msg = message(&r);
    assert!(
        msg.contains(&format!("127.0.0.1:{port}")) && msg.contains("rendezvous store"),
        "{msg}"
    );
    // The deadline is honoured (0.5 s asked; a generous bound for a loaded machine).
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
}

#[test]
fn master_port_in_use_is_reported() {
    let holder = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let r = ProcessGroup::builder()
        .no_env()
        .rank(0)
        .world_size(2)
        .master_addr("127.0.0.1")
        .master_port(port)
        .connect_timeout(Duration::from_secs(2))
        .build();
    let msg = message(&r);
    assert!(
        msg.contains("already in use") && msg.contains(&port.to_string()),
        "{msg}"
    );
    assert!(matches!(r.unwrap_err(), CommError::AddrInUse { .. }));
}

#[test]
fn invalid_environment_values_name_the_variable() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let err =
        ddp_comm::GroupConfig::from_vars(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
    assert!(err.to_string().contains("RANK=2"), "{err}");
    let err = ddp_comm::GroupConfig::from_vars(env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "abc"),
    ]))
    .unwrap_err();
    assert!(err.to_string().contains("MASTER_PORT"), "{err}");
    let c = ddp_comm::GroupConfig::from_vars(env(&[])).unwrap();
    assert_eq!((c.rank, c.world_size), (0, 1));
}

#[test]
fn a_bad_root_is_a_local_error_and_the_group_goes_on() {
    let outs = run_group(
        2,
        |_, b| b,
        |_, pg| {
            let bad = pg.broadcast(vec![1f32; 4], 2);
            // The group is not failed: the next collectives run normally, with the same
            // sequence numbers on both ranks (the refused call was never numbered).
            let sum = pg.all_reduce(vec![1f32; 4], ReduceOp::Sum);
            let b = pg.broadcast(vec![pg.rank() as f32; 2], 1);
            (bad, sum, b)
        },
    );
    for (rank, (bad, sum, b)) in outs.into_iter().enumerate() {
        let err = bad.unwrap_err();
        assert!(
            matches!(err, CommError::InvalidArgument { .. })
                && err
                    .to_string()
                    .contains("root 2 is not below the world size 2"),
            "rank {rank}: {err}"
        );
        assert_eq!(sum.unwrap(), [2.0; 4], "rank {rank}");
        assert_eq!(b.unwrap(), [1.0; 2], "rank {rank}");
    }
}

#[test]
fn wait_timeout_returns_and_names_the_collective() {
    let outs = run_group(
        2,
        |_, b| b,
        |rank, pg| {
            if rank == 1 {
                // Rank 1 joins the all-reduce late.
                std::thread::sleep(Duration::from_millis(1500));
            }
            let t = Instant::now();
            let early = pg
                .submit_all_reduce(vec![1f32; 8], ReduceOp::Sum)
                .wait_timeout(Duration::from_millis(if rank == 0 { 200 } else { 8000 }));
            let took = t.elapsed();
            // The collective itself still completes on both ranks; the group is usable.
            let after = pg.all_reduce(vec![2f32; 3], ReduceOp::Sum);
            (early, took, after)
        },
    );
    let (early, took, after) = &outs[0];
    let err = early.as_ref().unwrap_err();
    assert!(
        matches!(err, CommError::WaitTimeout { .. })
            && err.to_string().contains("all_reduce of 8 f32"),
        "{err}"
    );
    assert!(*took >= Duration::from_millis(200), "{took:?}");
    assert_eq!(after.as_ref().unwrap(), &[4.0; 3]);
    let (late, _, after) = &outs[1];
    assert_eq!(late.as_ref().unwrap(), &[2.0; 8]);
    assert_eq!(after.as_ref().unwrap(), &[4.0; 3]);
}

#[test]
fn the_flight_recorder_says_who_waits_where_on_sigusr1() {
    // Ranks 0 and 2 enter all_reduce #2; rank 1 does not (yet). SIGUSR1 makes every rank write
    // its records into the trace directory; the merged report names where each rank stands.
    let dir = std::env::temp_dir().join(format!("ddp-flight-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let submitted = std::sync::Barrier::new(3);
    let reported = std::sync::Barrier::new(3);
    let dir_ref = &dir;
    let report = std::sync::Mutex::new(String::new());
    run_group(
        3,
        |_, b| b.trace_dir(dir_ref),
        |rank, pg| {
            pg.all_reduce(vec![1f32; 10], ReduceOp::Sum).unwrap();
            pg.broadcast(vec![2u8; 3], 0).unwrap();
            let records = pg.flight_records();
            assert_eq!(records.len(), 2, "{records:?}");
            for (i, r) in records.iter().enumerate() {
                assert_eq!(r.seq, Some(i as u64));
                assert_eq!(r.state, ddp_comm::RecordState::Completed);
                let (s, f) = (r.started_us.unwrap(), r.finished_us.unwrap());
                assert!(r.queued_us <= s && s <= f, "{r:?}");
            }
            assert_eq!(
                (records[0].op.as_str(), records[0].count),
                ("all_reduce", 10)
            );
            assert_eq!(
                (records[1].op.as_str(), records[1].dtype.as_str()),
                ("broadcast", "u8")
            );
            let work = (rank != 1).then(|| pg.submit_all_reduce(vec![1f32; 10], ReduceOp::Sum));
            submitted.wait();
            if rank == 1 {
                // SAFETY: kill(2) on our own pid; the recorder has installed its handler.
                assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGUSR1) }, 0);
                let t = Instant::now();
                let (dumps, _) = loop {
                    let (dumps, bad) = ddp_comm::flight::read_dumps(dir_ref);
                    let stamped = dumps.len() == 3 && dumps.iter().all(|d| d.reason == "SIGUSR1");
                    if stamped || t.elapsed() > Duration::from_secs(8) {
                        break (dumps, bad);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                };
                *report.lock().unwrap() = ddp_comm::flight::hang_report(&dumps, 3);
            }
            reported.wait();
            if rank == 1 {
                pg.all_reduce(vec![1f32; 10], ReduceOp::Sum).unwrap();
            } else {
                work.unwrap().wait().unwrap();
            }
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    let report = report.into_inner().unwrap();
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(lines.len(), 2, "{report}");
    assert!(
        lines[0].starts_with("ranks 0, 2 wait in all_reduce #2 (10 f32) since "),
        "{report}"
    );
    assert_eq!(
        lines[1], "rank 1 last completed broadcast #1 and never entered #2",
        "{report}"
    );
}

#[test]
fn a_failed_collective_leaves_a_flight_record() {
    let dir = std::env::temp_dir().join(format!("ddp-flight-fail-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_ref = &dir;
    run_group(
        2,
        |_, b| b.trace_dir(dir_ref),
        |rank, pg| {
            // A mismatch: rank 0 all-reduces f32, rank 1 i32.
            let r = if rank == 0 {
                pg.all_reduce(vec![1f32; 10], ReduceOp::Sum).map(|_| ())
            } else {
                pg.all_reduce(vec![1i32; 10], ReduceOp::Sum).map(|_| ())
            };
            assert!(r.is_err());
        },
    );
    let (dumps, bad) = ddp_comm::flight::read_dumps(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(dumps.len(), 2, "{dumps:?}");
    for d in &dumps {
        assert_eq!(d.reason, "failure");
        let last = d.records.last().unwrap();
        assert_eq!(last.state, ddp_comm::RecordState::Failed, "{d:?}");
        assert!(
            last.error.as_deref().unwrap().contains("all_reduce #0"),
            "{d:?}"
        );
    }
}
