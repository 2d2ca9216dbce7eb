"""PyTorch's side of `cargo xtask bench-powersgd`: one rank of DDP with a communication hook.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... \
        python powersgd_bench.py MODEL HOOK RANK_R START BATCH WARMUP STEPS

MODEL: `cnn` (PyTorch's MNIST example CNN, ddp-models' MnistCnn) or `deep` (784 -> 4 x 2048 ->
10 with ReLU, ddp-models' DeepMlp). HOOK: `none` (DDP's own all-reduce), `bf16`
(default_hooks.bf16_compress_hook) or `powersgd` (powerSGD_hook with
PowerSGDState(matrix_approximation_rank=RANK_R, start_powerSGD_iter=START), PyTorch's other
defaults), waited for inside the hook, bucket by bucket (see `serial_powersgd`). gloo on the CPU, 1 compute thread, Adam (lr 1e-4, eps 1e-8), a fixed synthetic batch
per rank, DDP's default buckets (25 MiB). A step's time is the slowest rank's, from a barrier to
the end of the optimizer step; the median is reported. Bytes on the wire: what the host's
network interfaces other than `lo` sent during the timed steps (/proc/net/dev), per step; in a
network namespace joined to the other rank's by a veth pair, that is the traffic between the
ranks. Rank 0 prints `TORCH_POWERSGD {json}`.
"""
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP


class Cnn(nn.Module):
    """pytorch/examples mnist/main.py's Net (ddp-models' MnistCnn)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def deep_mlp():
    layers, width = [], 784
    for _ in range(4):
        layers += [nn.Linear(width, 2048), nn.ReLU()]
        width = 2048
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(nn.Flatten(), *layers)


def tx_bytes():
    """Bytes sent by every interface but `lo` (/proc/net/dev's 9th field)."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


def serial_powersgd(state, bucket):
    """powerSGD_hook, its future waited for before returning.

    PyTorch's hook submits the all-reduce of P (and then Q) from the completion callback of the
    bucket's first all-reduce. On gloo that callback runs on gloo's thread while the main thread
    goes on with backward and submits the next bucket's all-reduce, so the ranks can submit the
    two in different orders, and gloo fails ("Received data size doesn't match expected size.
    Is there a distributed collective mismatch", seen on this benchmark's models, which have two
    or more buckets). Waiting here fixes the order at the cost of overlapping a bucket's
    exchange with the rest of backward, which the 1-thread CPU runs barely have anyway.
    """
    fut = psgd.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def main():
    model_name, hook = sys.argv[1], sys.argv[2]
    rank_r, start, batch, warmup, steps = (int(a) for a in sys.argv[3:8])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Cnn() if model_name == "cnn" else deep_mlp()
    model = DDP(net)
    if hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                   start_powerSGD_iter=start)
        model.register_comm_hook(state, serial_powersgd)
    elif hook != "none":
        sys.exit(f"unknown hook {hook}")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8)
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(batch, 1, 28, 28, generator=g)
    y = torch.arange(batch) % 10
    times = []
    sent = 0
    for step in range(warmup + steps):
        dist.barrier()
        if step == warmup:
            sent = tx_bytes()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = F.nll_loss(out, y) if model_name == "cnn" else F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    sent = tx_bytes() - sent
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        med = sorted(slowest.tolist())[len(times) // 2]
        print("TORCH_POWERSGD " + json.dumps({
            "model": model_name, "hook": hook, "step_s": med,
            "wire_bytes_per_step": sent / steps,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
