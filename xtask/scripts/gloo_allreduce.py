"""torch.distributed gloo all_reduce timed the way ddp-allreduce-bench times ours.

Run one process per rank with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set (ddprun sets
them), e.g.

    ddprun --nproc-per-node 2 -- python3 xtask/scripts/gloo_allreduce.py --sizes 4096,1048576

Per size: each rank fills a float32 tensor with small integers depending on its rank and the
index, runs warm-up and timed all_reduce(SUM) calls, each after a barrier, and checks every
result against the exact expected sum. An iteration's time is the slowest rank's. Rank 0 prints
a table and writes JSON in the format of ddp-allreduce-bench's --json. The fill pattern and the
iteration-count rule are the same as in apps/src/bin/ddp-allreduce-bench.rs.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

FULL_COUNT_BYTES = 16 << 20


def pattern(rank, n):
    """Rank `rank`'s buffer: ((i * 7 + rank * 13) % 97) as float32."""
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 97).to(torch.float32)


def scaled(count, nbytes, floor):
    if nbytes <= FULL_COUNT_BYTES:
        return count
    return max(count * FULL_COUNT_BYTES // nbytes, min(floor, count))


def bench_size(rank, world, nbytes, iters, warmup):
    n = nbytes // 4
    source = pattern(rank, n)
    expected = sum(pattern(r, n) for r in range(world))
    warmup, iters = scaled(warmup, nbytes, 1), scaled(iters, nbytes, 3)
    buf = source.clone()
    times = []
    for iteration in range(warmup + iters):
        buf.copy_(source)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        elapsed = time.perf_counter() - start
        if not torch.equal(buf, expected):
            bad = int((buf != expected).nonzero()[0])
            raise SystemExit(
                f"rank {rank}: gloo all_reduce of {nbytes} bytes (iteration {iteration}) is wrong "
                f"at index {bad}: got {buf[bad].item()}, expected {expected[bad].item()}"
            )
        if iteration >= warmup:
            times.append(elapsed)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = sorted(slowest.tolist())
    mid = iters // 2
    median = slowest[mid] if iters % 2 else (slowest[mid - 1] + slowest[mid]) / 2
    algbw = nbytes / median / 1e9
    return {
        "bytes": nbytes,
        "iters": iters,
        "median_s": median,
        "min_s": slowest[0],
        "algbw_gbs": algbw,
        "busbw_gbs": algbw * 2 * (world - 1) / world,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="where rank 0 writes the results")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    dist.init_process_group("gloo")  # env:// rendezvous: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"gloo all_reduce(float32, sum) over {world} ranks, torch {torch.__version__}")
        print(f"{'bytes':>10} {'iters':>6} {'median(us)':>12} {'busbw(GB/s)':>12}", flush=True)
    results = []
    for nbytes in sizes:
        result = bench_size(rank, world, nbytes, args.iters, args.warmup)
        results.append(result)
        if rank == 0:
            print(
                f"{nbytes:>10} {result['iters']:>6} {result['median_s'] * 1e6:>12.1f} "
                f"{result['busbw_gbs']:>12.3f}",
                flush=True,
            )
    if rank == 0 and args.json:
        report = {
            "implementation": "gloo",
            "label": f"torch {torch.__version__}",
            "world_size": world,
            "small_allreduce_bytes": None,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
