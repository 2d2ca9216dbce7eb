"""One epoch of PyTorch's MNIST example CNN on one GPU, timed the way train-mnist times ours.

    python3 xtask/scripts/torch_mnist_epoch.py --data-dir ~/.cache/ddp-rs/mnist --device cuda:0

`cargo xtask gpu-check` runs it next to `train-mnist --backend cuda` and reports the ratio.

The same model as ddp-models' MnistCnn (pytorch/examples mnist/main.py: conv 32, conv 64,
max-pool, dropout 0.25, fc 128, dropout 0.5, fc 10, log-softmax + NLL loss), the same
normalisation (0.1307, 0.3081), Adam (lr 1e-3, eps 1e-8) and batch size 64 by default, the
training set in a new random order every epoch and the last partial batch kept. Batches are
cut from the normalised training set in host memory and copied to the GPU one by one, as our
loader does. `--warmup-epochs N` trains N epochs first, untimed (CUDA's context, cuDNN's
algorithm choice and the caching allocator settle there), as gpu-check gives train-mnist a
warm-up epoch for burn's autotune. samples/s counts the timed epochs' training loops only (the
GPU synchronised at their start and end); the test set is evaluated afterwards. Reads the IDX files that train-mnist fetches (raw, or .gz).
Prints one line `TORCH_SUMMARY {json}`.

Under torchrun (`WORLD_SIZE` > 1) it is PyTorch DDP: `init_process_group("nccl")`, the model in
`DistributedDataParallel`, each rank a `DistributedSampler`-style shard of every epoch's order
(the same permutation on every rank, rank r taking every world-th index from r), batch
`--batch-size` per rank, as `train-mnist` at N ranks. Every rank uses `--device` (so two ranks can
share GPU 0, which NCCL allows from 2.30 with `NCCL_MULTI_RANK_GPU_ENABLE=1`); rank 0 prints the
summary, whose samples/s counts every rank's samples and which names the NCCL that torch loaded.
"""

import argparse
import gzip
import json
import os
import struct
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def read_idx(folder, name):
    """The IDX file `name` (or `name.gz`) in `folder` as a uint8 tensor of its shape."""
    path = os.path.join(folder, name)
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
    elif os.path.exists(path + ".gz"):
        with gzip.open(path + ".gz", "rb") as f:
            data = f.read()
    else:
        raise SystemExit(f"{path} (or .gz) not found: run train-mnist once to fetch MNIST")
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).reshape(dims)


def load(folder, split):
    images = read_idx(folder, f"{split}-images-idx3-ubyte").float().div_(255.0)
    images = images.sub_(0.1307).div_(0.3081).unsqueeze(1)
    labels = read_idx(folder, f"{split}-labels-idx1-ubyte").long()
    return images, labels


class Net(nn.Module):
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
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--epochs", type=int, default=1, help="timed epochs")
    parser.add_argument("--warmup-epochs", type=int, default=0, help="untimed epochs first")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    train_x, train_y = load(args.data_dir, "train")
    test_x, test_y = load(args.data_dir, "t10k")
    model = Net().to(device)
    net = model
    if world > 1:
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    optim = torch.optim.Adam(net.parameters(), lr=args.lr, eps=1e-8)

    train_time, samples = 0.0, 0
    for epoch in range(args.warmup_epochs + args.epochs):
        timed = epoch >= args.warmup_epochs
        net.train()
        # The same permutation on every rank (one seed), rank r taking every world-th index.
        order = torch.randperm(len(train_x))[rank::world]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss_sum, batches = torch.zeros((), device=device), 0
        for first in range(0, len(order), args.batch_size):
            idx = order[first : first + args.batch_size]
            x = train_x[idx].to(device, non_blocking=True)
            y = train_y[idx].to(device, non_blocking=True)
            optim.zero_grad(set_to_none=True)
            loss = F.nll_loss(net(x), y)
            loss.backward()
            optim.step()
            loss_sum += loss.detach()
            batches += 1
            if timed:
                samples += len(idx)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if timed:
            train_time += time.perf_counter() - start
        train_loss = loss_sum.item() / max(batches, 1)

    if world > 1:
        # Every rank's samples count: the timed epochs end together (DDP's last all-reduce).
        total = torch.tensor([samples], device=device)
        dist.all_reduce(total)
        samples = int(total.item())
    model.eval()
    correct = 0
    with torch.no_grad():
        for first in range(0, len(test_x), 1000):
            x = test_x[first : first + 1000].to(device)
            y = test_y[first : first + 1000].to(device)
            correct += (model(x).argmax(dim=1) == y).sum().item()
    summary = {
        "implementation": "pytorch",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "epochs": args.epochs,
        "warmup_epochs": args.warmup_epochs,
        "train_loss": train_loss,
        "test_accuracy": correct / len(test_x),
        "test_correct": correct,
        "test_total": len(test_x),
        "samples_per_sec": samples / train_time,
        "train_seconds": train_time,
        "world_size": world,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
    }
    if rank == 0:
        print("TORCH_SUMMARY " + json.dumps(summary), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
