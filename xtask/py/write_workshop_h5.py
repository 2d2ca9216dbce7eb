#!/usr/bin/env python3
"""Writes MNIST (the IDX files, raw or .gz) as an HDF5 file in the workshop's layout, as its
conversion script does with h5py: train/images float32 (G, 100, 1, 28, 28) in [0, 1],
train/labels int64 (G, 100), test/images (T, 100, 1, 28, 28), test/labels (T, 100), gzip level
4, chunk shapes left to h5py. G <= 600 and T <= 100 take the first groups (for short CI runs).

Used by CI to exercise `cargo xtask import-h5` on a file made the workshop's way.
"""
import argparse
import gzip
import os

import h5py
import numpy as np


def read_idx(directory, name):
    for candidate in (name, name + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.exists(path):
            opener = gzip.open if candidate.endswith(".gz") else open
            with opener(path, "rb") as f:
                data = f.read()
            dims = data[3]
            shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
            return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)
    raise SystemExit(f"{directory}: no {name} or {name}.gz")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mnist-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-groups", type=int, default=600)
    parser.add_argument("--test-groups", type=int, default=100)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with h5py.File(args.out, "w") as f:
        for split, prefix, groups in (("train", "train", args.train_groups), ("test", "t10k", args.test_groups)):
            images = read_idx(args.mnist_dir, f"{prefix}-images-idx3-ubyte")
            labels = read_idx(args.mnist_dir, f"{prefix}-labels-idx1-ubyte")
            n = groups * 100
            if n > len(labels):
                raise SystemExit(f"{split}: {groups} groups of 100 need {n} samples, MNIST has {len(labels)}")
            x = (images[:n].astype(np.float32) / 255.0).reshape(groups, 100, 1, 28, 28)
            y = labels[:n].astype(np.int64).reshape(groups, 100)
            f.create_dataset(f"{split}/images", data=x, compression="gzip", compression_opts=4)
            f.create_dataset(f"{split}/labels", data=y, compression="gzip", compression_opts=4)
            print(f"{args.out}: {split}/images {x.shape} float32, {split}/labels {y.shape} int64, "
                  f"chunks {f[split + '/images'].chunks}")


if __name__ == "__main__":
    main()
