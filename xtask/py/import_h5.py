#!/usr/bin/env python3
"""Converts an HDF5 file in the workshop's MNIST layout into ddp-shards (format version 1).

The workshop's layout (written by h5py):
    train/images  float32 (G, 100, 1, 28, 28), values in [0, 1]   (groups of 100 images)
    train/labels  int64   (G, 100)
    test/images   float32 (T, 100, 1, 28, 28)
    test/labels   int64   (T, 100)
any compression and chunking. The output is OUT/train and OUT/test, each an index.json plus
safetensors shards of --shard-size samples: images u8 [n, 28, 28] (round(x * 255)), labels
u8 [n]. Reads one row of HDF5 chunks at a time (at most about
64 MiB), so memory stays bounded whatever the file's size.

Needs h5py, numpy and safetensors (pip install h5py numpy safetensors; no torch).
Run by `cargo xtask import-h5 FILE OUT`, which then verifies the result with ddp-shards.
"""
import argparse
import json
import os
import sys
import zlib

import h5py
import numpy as np
from safetensors.numpy import save_file

FORMAT = "ddp-shards"
VERSION = 1


def fail(message):
    sys.exit(f"import-h5: {message}")


def write_shard(out_dir, number, images, labels):
    name = f"shard-{number:05d}.safetensors"
    path = os.path.join(out_dir, name)
    tmp = path + ".tmp"
    save_file({"images": np.ascontiguousarray(images), "labels": np.ascontiguousarray(labels)}, tmp)
    with open(tmp, "rb") as f:
        data = f.read()
    os.replace(tmp, path)
    return {"file": name, "samples": int(len(labels)), "bytes": len(data), "crc32": zlib.crc32(data)}


def convert_split(h5, path, split, out_dir, shard_size):
    if split not in h5:
        fail(f"{path}: no group `{split}`")
    group = h5[split]
    for name in ("images", "labels"):
        if name not in group:
            fail(f"{path}: no dataset `{split}/{name}`")
    images, labels = group["images"], group["labels"]
    where = f"{path}: {split}/images"
    if images.dtype != np.float32:
        fail(f"{where} has dtype {images.dtype}, expected float32")
    if images.ndim != 5 or images.shape[2] != 1:
        fail(f"{where} has shape {images.shape}, expected (groups, per_group, 1, height, width)")
    if not np.issubdtype(labels.dtype, np.integer):
        fail(f"{path}: {split}/labels has dtype {labels.dtype}, expected an integer type")
    if labels.shape != images.shape[:2]:
        fail(f"{path}: {split}/labels has shape {labels.shape}, expected {images.shape[:2]}")
    groups, per_group, _, height, width = images.shape
    os.makedirs(out_dir, exist_ok=True)
    shards = []
    buf_x, buf_y, buffered = [], [], 0
    worst = 0.0
    # Read whole rows of chunks at a time (a chunk spans several groups with h5py's default
    # chunking; reading group by group would decompress each chunk many times), capped at about
    # 64 MiB of float32 so that memory stays bounded.
    group_bytes = per_group * height * width * 4
    step = max(1, min(images.chunks[0] if images.chunks else 1, (64 << 20) // max(1, group_bytes)))
    slab_x = slab_y = None
    for g in range(groups):
        if g % step == 0:
            slab_x = images[g:g + step]
            slab_y = labels[g:g + step]
        x = slab_x[g % step].reshape(per_group, height, width)
        y = slab_y[g % step]
        if not np.all(np.isfinite(x)) or x.min() < 0.0 or x.max() > 1.0:
            fail(f"{where}[{g}]: values outside [0, 1] (min {x.min()}, max {x.max()})")
        if y.min() < 0 or y.max() > 9:
            fail(f"{path}: {split}/labels[{g}]: labels outside 0..=9 (min {y.min()}, max {y.max()})")
        scaled = x.astype(np.float64) * 255.0
        q = np.rint(scaled)
        worst = max(worst, float(np.abs(scaled - q).max()))
        buf_x.append(q.astype(np.uint8))
        buf_y.append(y.astype(np.uint8))
        buffered += per_group
        while buffered >= shard_size or (g == groups - 1 and buffered > 0):
            xs, ys = np.concatenate(buf_x), np.concatenate(buf_y)
            n = min(shard_size, buffered)
            shards.append(write_shard(out_dir, len(shards), xs[:n], ys[:n]))
            buf_x, buf_y, buffered = [xs[n:]], [ys[n:]], buffered - n
    index = {
        "format": FORMAT,
        "version": VERSION,
        "sample_shape": [int(height), int(width)],
        "num_classes": 10,
        "num_samples": int(groups * per_group),
        "shards": shards,
    }
    tmp = os.path.join(out_dir, "index.json.tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    os.replace(tmp, os.path.join(out_dir, "index.json"))
    note = "" if worst < 0.01 else f" (values were not multiples of 1/255: up to {worst:.3f}/255 lost)"
    print(f"{split}: {groups * per_group} samples in {len(shards)} shards -> {out_dir}{note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("h5", help="the workshop's HDF5 file")
    parser.add_argument("out", help="output folder (train/ and test/ are written in it)")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    args = parser.parse_args()
    if args.shard_size < 1:
        fail("--shard-size must be at least 1")
    try:
        h5 = h5py.File(args.h5, "r")
    except OSError as e:
        fail(f"{args.h5}: cannot open as HDF5: {e}")
    with h5:
        for split in ("train", "test"):
            convert_split(h5, args.h5, split, os.path.join(args.out, split), args.shard_size)


if __name__ == "__main__":
    main()
