"""PyTorch's side of `cargo xtask bench-zero`, one process per rank under torchrun (gloo, CPU).

The same model as ddp-zero-bench (784 -> hidden -> 10, ReLU, cross-entropy), Adam (eps 1e-8,
lr 1e-4), a fixed synthetic batch per rank, 1 compute thread per rank. Stage 0: DDP and
torch.optim.Adam; stage 1: DDP and ZeroRedundancyOptimizer(Adam) (PyTorch's ZeRO stage 1:
DDP's all-reduce, then each rank steps its parameters and broadcasts them). A step's time is the
slowest rank's, from a barrier to the end of the optimizer step; the median is reported.
Rank 0 prints `TORCH_ZERO {json}`: the largest rank's optimizer state bytes (and every rank's:
ZeroRedundancyOptimizer partitions whole parameters, so the shares differ), every rank's peak RSS
(getrusage, MiB) and the median step time.

    python -m torch.distributed.run --nproc-per-node 2 zero_bench.py STAGE HIDDEN BATCH WARMUP STEPS
"""
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

stage, hidden, batch, warmup, steps = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, 10)))
if stage == 0:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8)
    local = opt
else:
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4, eps=1e-8)
    local = opt.optim
g = torch.Generator().manual_seed(rank)
x = torch.rand(batch, 784, generator=g)
y = torch.arange(batch) % 10
times = []
for step in range(warmup + steps):
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if step >= warmup:
        times.append(time.perf_counter() - t0)
slowest = torch.tensor(times, dtype=torch.float64)
dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
state_bytes = sum(
    t.numel() * t.element_size()
    for s in local.state.values()
    for t in s.values()
    if torch.is_tensor(t)
)
# ZeroRedundancyOptimizer assigns whole parameters to ranks, so the ranks' shares differ:
# every rank's is gathered, and the largest reported.
all_state = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
dist.all_gather(all_state, torch.tensor([float(state_bytes)], dtype=torch.float64))
rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
all_rss = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
dist.all_gather(all_rss, rss)
if rank == 0:
    med = sorted(slowest.tolist())[len(times) // 2]
    print("TORCH_ZERO " + json.dumps({
        "stage": stage, "world": world,
        "optimizer_bytes": int(max(t.item() for t in all_state)),
        "optimizer_bytes_per_rank": [int(t.item()) for t in all_state],
        "peak_rss_mib": [r.item() for r in all_rss], "step_s": med,
    }), flush=True)
dist.barrier()
sys.stdout.flush()
# With ZeroRedundancyOptimizer, torch 2.x's teardown of the gloo group aborts one rank
# ("terminate called without an active exception") after everything above has completed; the
# figures are in, so leave without it.
os._exit(0)
