#!/usr/bin/env bash
# Makes a lent GPU machine's run ready, on a machine without a GPU (issue 71): everything the
# run needs, in folders that the device tool carries, and the fixed sequence of calls to make.
#
#   bash xtask/scripts/gpu-prepare.sh [--full-nccl]
#
# 1. The binaries, built offline (docs/gpu.md, "Building without network": DOCS_RS=1, NVRTC for
#    burn's kernels, LLVM's symbols stubbed by xtask/scripts/offline-cuda-linker): ddprun,
#    ddp-nccl-bench and train-mnist with `ddp-apps/cuda,burn-ddp/cuda-nvrtc`, and xtask from
#    the CPU build (it runs gpu-check there without cargo), stripped, as one xz archive,
#    .gpu/bin/bins.tar.xz (train-mnist alone is 120 MB stripped).
# 2. NCCL 2.32.3 from the registry's wheel (`nvidia-nccl-cu13`), cut to the H200's sm_90 by
#    xtask/py/nccl_for_one_arch.py (34 MB under xz), or whole with --full-nccl (268 MB: five
#    pieces, five calls), into .gpu/nccl/piece*/, with its manifest.
# 3. MNIST (the four IDX files, gzip), into .gpu/mnist: the lent machine has no network.
# 4. A rehearsal of every step that needs no GPU: the pieces are joined and checked as on the
#    device; `ddp-nccl-bench --probe` of .gpu/bin, with a fake driver (comm's test fixture) and a
#    venv holding an older fake NCCL, must take the carried library and print its version.
# 5. .gpu/PLAN.md: each device call's `carry` and command, sized under the tool's 64 MiB.
#
# Everything it writes is ignored by git (.gpu/, target/). The build takes about 25 minutes on two
# cores from nothing (its own target folder, target/gpu-build).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
ARCH=90
[ "${1:-}" = "--full-nccl" ] && ARCH=all
GPU=.gpu
WORK=target/gpu-prepare
mkdir -p "$GPU" "$WORK"
rm -rf "$GPU/bin" "$GPU/nccl" "$GPU/mnist" "$WORK/bin"
mkdir -p "$GPU/bin" "$GPU/mnist" "$WORK/bin"

echo "== 1. binaries (offline CUDA build, target/gpu-build)"
DOCS_RS=1 CARGO_TARGET_DIR=target/gpu-build \
  CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER="$ROOT/xtask/scripts/offline-cuda-linker" \
  cargo build --release --workspace --features ddp-apps/cuda,burn-ddp/cuda-nvrtc \
  --bin ddprun --bin ddp-nccl-bench --bin train-mnist
cargo build --release -p xtask
for bin in ddprun ddp-nccl-bench train-mnist; do
  strip -o "$WORK/bin/$bin" "target/gpu-build/release/$bin"
done
strip -o "$WORK/bin/xtask" target/release/xtask
ls -la "$WORK/bin"
tar -cf - -C "$WORK/bin" ddprun ddp-nccl-bench train-mnist xtask | xz -6 -T0 >"$GPU/bin/bins.tar.xz"
ls -la "$GPU/bin"

echo "== 2. NCCL 2.32.3 from the registry's wheel (sm_$ARCH)"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$WORK/wheel" nvidia-nccl-cu13==2.32.3
wheel=$(ls "$WORK"/wheel/nvidia_nccl_cu13-2.32.3-*.whl)
python3 xtask/py/nccl_for_one_arch.py "$wheel" --arch "$ARCH" --out "$GPU/nccl"

echo "== 3. MNIST"
mnist=$(target/gpu-build/release/train-mnist --fetch-data)
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte \
  t10k-labels-idx1-ubyte; do
  if [ -f "$mnist/$f" ]; then gzip -9c "$mnist/$f" >"$GPU/mnist/$f.gz"; else cp "$mnist/$f.gz" "$GPU/mnist/"; fi
done
ls -la "$GPU/mnist"

echo "== 4. rehearsal: join, check, and the loader takes the carried NCCL"
rm -rf "$WORK/rehearsal" && mkdir -p "$WORK/rehearsal/driver" \
  "$WORK/rehearsal/venv/lib/python3.12/site-packages/nvidia/nccl/lib"
python3 xtask/py/nccl_for_one_arch.py --join "$GPU/nccl" --to "$WORK/rehearsal/nccl"
cc -shared -fPIC -o "$WORK/rehearsal/driver/libcuda.so.1" -Wl,-soname,libcuda.so.1 \
  comm/tests/fixtures/fake_cuda/libcuda.c
cc -shared -fPIC -o "$WORK/rehearsal/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2" \
  -Wl,-soname,libnccl.so.2 -DFAKE_VERSION=22105 comm/tests/fixtures/fake_cuda/libnccl.c
carried=$ROOT/$WORK/rehearsal/nccl
# The binaries as the device unpacks them.
mkdir -p "$WORK/rehearsal/bin"
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
  "$GPU/bin/bins.tar.xz" "$WORK/rehearsal/bin"
probe=$(env -u CONDA_PREFIX LD_LIBRARY_PATH="$ROOT/$WORK/rehearsal/driver:$carried" \
  VIRTUAL_ENV="$ROOT/$WORK/rehearsal/venv" "$WORK/rehearsal/bin/ddp-nccl-bench" --probe 2>&1)
echo "$probe"
grep -q "NCCL (2.32.3) $carried/libnccl.so.2 \[LD_LIBRARY_PATH\]" <<<"$probe"
grep -q "^gpus 3 nccl 2.32.3$" <<<"$probe"
echo "rehearsal passed: the carried NCCL 2.32.3 was taken over the venv's 2.21.5"

echo "== 5. the plan"
python3 - "$GPU" <<'PY'
import json, os, pathlib, subprocess, sys
gpu = pathlib.Path(sys.argv[1])
limit = 64 << 20
tree = sum(os.path.getsize(f) for f in subprocess.run(
    ["git", "ls-files", "-z"], capture_output=True, check=True, text=True).stdout.split("\0") if f)
def size(path):
    p = pathlib.Path(path)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
manifest = json.loads((gpu / "nccl/manifest.json").read_text())
items = [(f"{gpu}/nccl/{p['folder']}", p["bytes"]) for p in manifest["pieces"]]
items += [(f"{gpu}/mnist", size(gpu / "mnist")), (f"{gpu}/bin", size(gpu / "bin"))]
# Calls: fill each with what fits beside the working tree (and the manifest, which travels with
# the tree as an ignored file named in carry).
calls, current, used = [], [], tree + size(gpu / "nccl/manifest.json")
for path, n in items:
    if n + used > limit and current:
        calls.append(current); current, used = [], tree + size(gpu / "nccl/manifest.json")
    if n + used > limit:
        sys.exit(f"{path} ({n / 2**20:.1f} MiB) does not fit one call beside the tree")
    current.append(path); used += n
calls.append(current)
join = (f"python3 xtask/py/nccl_for_one_arch.py --join {gpu}/nccl --to /tmp/ddp-nccl && "
        f"python3 -c \"import tarfile; tarfile.open('{gpu}/bin/bins.tar.xz').extractall("
        f"'/tmp/ddp-bin')\"")
# Every row's log stays in /tmp/gc (the tool returns at most 8 files): the report, its JSON,
# the whole output and the logs as one archive come back.
check = (f"DDP_BIN_DIR=/tmp/ddp-bin /tmp/ddp-bin/xtask gpu-check --out /tmp/gc --data-dir {gpu}/mnist "
         f"--nccl-dir /tmp/ddp-nccl >$OUT/gpu-check.log 2>&1; rc=$?; "
         f"cp /tmp/gc/gpu-check.md /tmp/gc/gpu-check.json $OUT/; tar czf $OUT/logs.tgz -C /tmp gc; "
         f"tail -60 $OUT/gpu-check.log; exit $rc")
lines = ["# The device run (made by xtask/scripts/gpu-prepare.sh)", "",
         f"Working tree {tree / 2**20:.1f} MiB; NCCL {manifest['arch']} "
         f"({manifest['xz_bytes'] / 1e6:.1f} MB under xz, copy SHA-256 {manifest['copy_sha256']}).",
         "Make the calls one right after the other (a machine stays warm 30 s and keeps the",
         "ignored paths of earlier calls that a later call's carry does not name):", ""]
for i, carry in enumerate(calls):
    last = i == len(calls) - 1
    command = f"{join} && {check}" if last else "ls -la .gpu"
    carry_all = carry + [f"{gpu}/nccl/manifest.json"] if last else carry
    lines += [f"{i + 1}. carry `{json.dumps(carry_all)}`, timeout_s {540 if last else 60}:",
              "", f"       {command}", ""]
lines += ["If the probe row says the carried NCCL was not taken, or NCCL fails to load its",
          "kernels from the sm_90 copy, prepare again with --full-nccl (the library as the wheel",
          "has it, in five pieces) and make those calls instead."]
(gpu / "PLAN.md").write_text("\n".join(lines) + "\n")
print((gpu / "PLAN.md").read_text())
PY
