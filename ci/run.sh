#!/usr/bin/env bash
# CI: the README's two commands' builds, each once: the test command's release build of the whole
# workspace (`ddp-apps/nccl`: the NCCL layer of ddp-comm, loaded at run time, so no CUDA toolkit
# is needed; `ddp-apps/wgpu`: burn's wgpu backend with fusion and the kernel cache, run on Mesa's
# lavapipe), shared by the tests, the root tests and the packs' build; and the main job's CPU
# build (`cargo xtask ...`, feature `ddp-apps/nccl`, into target/features-nccl/release), shared
# by the end-to-end tasks. The GPU training code (`ddp-apps/cuda`: burn 0.22's CUDA backend)
# cannot be built here: its cubecl-llvm build script downloads an LLVM bundle. CI type-checks and
# lints it offline instead (`DOCS_RS=1` makes that build script skip the download, as on
# docs.rs), with the tests' feature set, in one lint of a target folder of its own, which the
# docs and the packs' check reuse. Compiled dependencies are kept between runs on one machine
# (ci/cache.sh: outside the clone, checked, pruned, and never trusted over a cold build). The
# whole run must stay under CI's 90 minutes on two cores, cold: each step's seconds are printed at
# the end.
#
# Everything runs in a fresh clone of this repository (under target/ci-fresh), with no `../shared`
# beside it and an empty HOME (cargo's and rustup's own caches kept), as a user's first clone on a
# fresh machine: the README's test command runs first, before any system package is installed
# (no nftables, no Slurm), and must pass there; the tests obtain MNIST on their own. The later
# steps install what they need (a fresh machine has the Rust toolchain, gcc, python3, node/npm).
set -euo pipefail
cd "$(dirname "$0")/.."

# The README's test command's feature set (keep in sync with README.md): the tests, the root
# tests, the packs' build. The tasks (`cargo xtask ...`) build the README's main job's CPU set
# (`ddp-apps/nccl`, into target/features-nccl/release), as a user's first command does.
FEATURES=ddp-apps/nccl,ddp-apps/wgpu

# Each step prints its start time and records its duration; a table of seconds per step is
# printed at the end, and on a failure (the EXIT trap), so that a run tells where its time goes.
STEP_NAMES=()
STEP_STARTS=()
step() {
  STEP_NAMES+=("$1")
  STEP_STARTS+=("$(date +%s)")
  printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"
}
step_times() {
  local rc=$? now i n end total
  now=$(date +%s)
  n=${#STEP_NAMES[@]}
  [ "$n" -gt 0 ] || return "$rc"
  printf '\n== seconds per step%s\n' "$([ "$rc" -eq 0 ] || echo " (failed in the last one, exit $rc)")"
  for ((i = 0; i < n; i++)); do
    if [ $((i + 1)) -lt "$n" ]; then end=${STEP_STARTS[$((i + 1))]}; else end=$now; fi
    printf '%6d  %s\n' $((end - STEP_STARTS[i])) "${STEP_NAMES[$i]:0:90}"
  done
  total=$((now - STEP_STARTS[0]))
  printf '%6d  total\n' "$total"
  return "$rc"
}
# The dependency cache (ci/cache.sh) is stamped on any exit but a kill, then the table printed.
on_exit() {
  local rc=$?
  cache_close
  (exit "$rc")
  step_times
}
# shellcheck source=ci/cache.sh
source ci/cache.sh
trap on_exit EXIT

step "toolchain"
cargo --version
rustc --version
if ! cargo clippy --version >/dev/null 2>&1; then rustup component add clippy; fi
if ! cargo fmt --version >/dev/null 2>&1; then rustup component add rustfmt; fi

step "a fresh clone: no ../shared beside it, an empty HOME; the dependency cache"
export CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}
export RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup}
# The machine's dependency cache (ci/cache.sh), outside the clone and the empty HOME.
export DDP_CI_CACHE=${DDP_CI_CACHE:-$HOME/.cache/ddp-rs-ci}
# Inside this checkout's target folder (ignored by git, on the same disk as the build), where
# nothing named shared sits beside the clone.
work=$PWD/target/ci-fresh
rm -rf "$work"
mkdir -p "$work"
git clone --quiet --no-hardlinks "$PWD" "$work/ddp-rs"
export HOME=$work/home
mkdir -p "$HOME"
cd "$work/ddp-rs"
git log -1 --oneline
test ! -e ../shared
echo "clone: $PWD; HOME: $HOME (empty); CARGO_HOME: $CARGO_HOME"
bash ci/cache_test.sh
cache_open

step "fmt"
cargo fmt --all -- --check

step "tests: the README's test command, on the fresh clone, before any system package"
# Keep in sync with README.md ("Set-up"). Tests that need root, network namespaces or a GPU are
# reported as ignored here, with their reason; the root ones run in the next steps.
command -v nft >/dev/null 2>&1 && echo "(nft is installed on this machine)" || echo "(no nft here)"
# The build first, through the cache's fallback (a failure on a warm cache builds again cold),
# then the README's command itself, which finds everything built.
cache_build cargo test --release --workspace --features "$FEATURES" --no-run
cargo test --release --workspace --features ddp-apps/nccl,ddp-apps/wgpu

step "system packages"
# The network-namespace tests (comm/tests/processes.rs: a cut link between two "hosts", a lossy
# link and a one-way partition made with nftables rules) need iproute2's `ip` and nftables' `nft`;
# the Slurm step needs slurm-wlm and munge, and slurm-wlm-torque (Slurm's qsub, for the PBS
# script); the mpirun step Open MPI's openmpi-bin; the Python
# steps need venv (Debian ships it apart from python3); the wgpu tests Mesa's lavapipe (a Vulkan
# device on the CPU). Installed only when missing.
missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
command -v slurmctld >/dev/null 2>&1 || missing+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || missing+=(munge)
command -v qsub >/dev/null 2>&1 || missing+=(slurm-wlm-torque)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
# --backend wgpu's tests (apps/tests/wgpu.rs) need a Vulkan device: Mesa's lavapipe, on the CPU.
ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || missing+=(mesa-vulkan-drivers libvulkan1)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
ip -V

step "NVIDIA's NCCL and NVRTC pip wheels (no GPU needed): the loader's real-library tests"
# The root step below runs the ignored tests that open these wheels' real libnccl.so.2 and
# libnvrtc.so.12 (found in the venv, ncclGetVersion answered, a kernel compiled by NVRTC); they
# fail, not skip, when DDP_CUDA_WHEELS is set and nothing is found there.
python3 -m venv target/cuda-wheels
target/cuda-wheels/bin/pip install --quiet --disable-pip-version-check nvidia-nccl-cu12 \
  nvidia-cuda-nvrtc-cu12
export DDP_CUDA_WHEELS="$PWD/target/cuda-wheels"

step "tests that need root: network namespaces and nftables (ignored in a plain cargo test)"
# Every ignored test but the GPU ones (ignored here: CI has no GPU).
cargo test --release --workspace --features "$FEATURES" -- --ignored --skip gpu

step "end to end: the README's main job's CPU build; 2 ranks of train-mnist, 200 steps on the real MNIST"
# The main job's build (the CPU feature set, no GPU stack: the README's first command) and run.
# No --data-dir: the trainer fetches MNIST into the product's cache (~/.cache/ddp-rs/mnist, in
# the empty HOME), as the README's main job does on a fresh machine; later steps read it there.
cargo xtask train-mnist --nproc 2 --epochs 1 --out target/ci-run --min-accuracy 0.95 \
  --max-steps 200 --log-interval 50
MNIST=$HOME/.cache/ddp-rs/mnist
ls "$MNIST"
# That build has no GPU backend: --backend wgpu must fail at once, naming the feature and the
# command that builds it.
if wgpu_out=$(target/features-nccl/release/train-mnist --backend wgpu --data-dir "$MNIST" 2>&1); then
  echo "the CPU build accepted --backend wgpu: $wgpu_out"
  exit 1
fi
echo "$wgpu_out" | head -1
grep -q 'cargo build --release --features ddp-apps/wgpu --bin train-mnist' <<<"$wgpu_out"

step "a user's own program: example/ (user-train) under ddprun, 2 ranks, shared memory and TCP"
# Its test (example/tests/equivalence.rs, in the README's test command above) checks 2 x b
# against 1 x 2b and identical replicas on both transports; here it trains to an accuracy.
for transport in shm tcp; do
  DDP_TRANSPORT=$transport target/release/ddprun --nproc-per-node 2 -- \
    target/release/user-train --batch 8 --steps 300 | tee target/user-train-$transport.txt
  python3 - "target/user-train-$transport.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"300 steps on 2 rank\(s\): test accuracy ([0-9.]+)%", text)
assert m and float(m.group(1)) >= 80.0, f"user-train: {text!r}"
PY
done

step "shards: the workshop's HDF5 layout (h5py) imported; 2 ranks of train-mnist from shards"
# A Python venv under target/ with h5py, numpy and safetensors from PyPI (no torch). h5py writes
# MNIST in the workshop's layout (float32 (600, 100, 1, 28, 28), int64 labels, gzip 4, h5py's
# chunks); the importer converts it; the result must hold exactly the samples make-shards writes
# from the IDX files; then the same 200 steps as the in-memory run above, from the shards, must
# reach its accuracy (within 1.5 points: only the sample order differs).
python3 -m venv target/pyenv
target/pyenv/bin/pip install --quiet --disable-pip-version-check h5py numpy safetensors
rm -rf target/ci-shards && mkdir -p target/ci-shards
target/pyenv/bin/python xtask/py/write_workshop_h5.py --mnist-dir "$MNIST" \
  --out target/ci-shards/workshop.h5
cargo xtask make-shards --mnist-dir "$MNIST" --out target/ci-shards/from-idx
cargo xtask import-h5 --python target/pyenv/bin/python --same-as target/ci-shards/from-idx \
  target/ci-shards/workshop.h5 target/ci-shards/from-h5
MEMORY_ACCURACY=$(python3 -c 'import csv; print(list(csv.DictReader(open("target/ci-run/metrics/metrics.csv")))[-1]["test_accuracy"])')
MIN_ACCURACY=$(python3 -c "print(max(0.95, $MEMORY_ACCURACY - 0.015))")
echo "in-memory run: test accuracy $MEMORY_ACCURACY; the shard run needs $MIN_ACCURACY"
cargo xtask train-mnist --nproc 2 --epochs 1 --out target/ci-run-shards \
  --min-accuracy "$MIN_ACCURACY" --data-format shards --data-dir target/ci-shards/from-h5 \
  --max-steps 200 --log-interval 50

step "observability: TensorBoard's own reader on the end-to-end run's curves; a 2-rank trace"
# TensorBoard (pip, no TensorFlow or torch) reads the event files of the first end-to-end run
# above (200 steps, --log-interval 50): at least 4 points of train/loss and the other curves.
# The Rust tests check the same files with our reader (ddp_apps::metrics::read_scalars), so that
# `cargo test` needs no Python. Then `cargo xtask trace-mnist` traces a few steps on 2 ranks and
# merges the Chrome trace files (the tests check their contents).
python3 -m venv target/pyenv
target/pyenv/bin/pip install --quiet --disable-pip-version-check tensorboard
target/pyenv/bin/python xtask/py/check_tensorboard.py target/ci-run/metrics --min-points 4
cargo xtask trace-mnist --out target/ci-trace --data-dir "$MNIST"

step "ZeRO stage 2 and overlap: 2 ranks of train-mnist, 200 steps each"
# Sharded optimizer state and gradients must train the CNN as DDP does (apps/tests/zero.rs checks
# bit-identical weights on the MLP); then a trace of the all-reduces during backward over TCP,
# whose share inside backward is printed (a figure, not a check: it depends on the machine).
cargo xtask train-mnist --nproc 2 --epochs 1 --out target/ci-run-zero --min-accuracy 0.95 \
  --max-steps 200 --log-interval 100 --zero-stage 2
DDP_TRANSPORT=tcp cargo xtask trace-mnist --out target/ci-trace-overlap --data-dir "$MNIST" \
  --overlap --bucket-cap-mb 1

step "slurm: the example job scripts on a real one-node Slurm cluster: sbatch (srun), qsub (mpirun)"
bash ci/slurm.sh target/ci-slurm

step "mpirun: Open MPI starts 2 ranks of train-mnist, found through OMPI_COMM_WORLD_* alone"
# No torchrun or Slurm variables: the ranks must recognise Open MPI's, and find rank 0 on this
# host (every rank is local) at the default port.
mpirun --allow-run-as-root --oversubscribe -np 2 target/release/train-mnist --epochs 1 \
  --max-steps 100 --log-interval 50 --threads 1 --data-dir "$MNIST" | tee target/ci-mpirun.txt
grep -q "world 2 (launcher: open-mpi; 1 compute threads per rank)" target/ci-mpirun.txt
python3 - target/ci-mpirun.txt <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"done: 1 epochs, 100 steps, test accuracy ([0-9.]+)%", text)
assert m and float(m.group(1)) >= 90.0, f"mpirun: {text!r}"
PY

step "spawn: train-mnist --nproc-per-node 2 starts its own 2 ranks (no launcher, PyTorch's mp.spawn)"
target/release/train-mnist --nproc-per-node 2 --epochs 1 --max-steps 100 --log-interval 50 \
  --threads 1 --data-dir "$MNIST" | tee target/ci-spawn.txt
grep -q "\\[rank 0\\] training cnn: world 2 (launcher: spawn; 1 compute threads per rank)" \
  target/ci-spawn.txt
python3 - target/ci-spawn.txt <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"done: 1 epochs, 100 steps, test accuracy ([0-9.]+)%", text)
assert m and float(m.group(1)) >= 90.0, f"spawn: {text!r}"
PY

step "train-gpt: 2 ranks, ZeRO 2, AdamW, clipping, cosine schedule, on GPL-3 (base-files)"
# /usr/share/common-licenses/GPL-3 ships with Debian's and Ubuntu's base-files (essential: on every
# such system). A small GPT, 150 steps: the validation loss must fall well below ln(vocabulary).
target/release/ddprun --nproc-per-node 2 -- target/release/train-gpt \
  --text /usr/share/common-licenses/GPL-3 --n-layer 2 --n-head 4 --n-embd 64 --block-size 64 \
  --batch-size 8 --max-steps 150 --lr 3e-3 --lr-schedule cosine --warmup-steps 15 \
  --zero-stage 2 --log-interval 50 --threads 1 | tee target/ci-gpt.txt
python3 - target/ci-gpt.txt <<'PY'
import math, re, sys
text = open(sys.argv[1]).read()
vocab = int(re.search(r"vocabulary (\d+);", text).group(1))
loss = float(re.search(r"test loss ([0-9.]+)", text).group(1))
assert loss < math.log(vocab) - 1.0, f"train-gpt: validation loss {loss} (ln {vocab} = {math.log(vocab):.2f}): {text!r}"
PY

step "layout: no two files of a library crate import each other, no source file over 1000 lines"
for crate in fsio comm launch data models ddp apps; do
  printf '%s: ' "$crate"
  python3 ci/layout.py "$crate/src"
done

step "clippy: every feature, the GPU code included (type-checked offline: burn 0.22 CUDA backend, NCCL device path)"
# One lint of the whole workspace with the GPU features on top of the tests' ones, in a target
# folder of its own: `ddp-apps/cuda` cannot be built here (cubecl-llvm's build script downloads an
# LLVM bundle); `DOCS_RS=1` makes that build script skip the download, as on docs.rs, so the CUDA
# code is type-checked and linted, never linked. (Two lints, the tests' feature set and the CUDA
# one apart, checked every dependency twice: about 5 minutes more on two cores; the code that only
# the feature set without `cuda` compiles is four `cfg(not(feature = "cuda"))` lines.) The steps
# below (docs, packages, semver) reuse this folder's checked dependencies.
export DDP_CHECK_FEATURES=$FEATURES,ddp-apps/cuda
export DDP_CHECK_BUILD_DIR
DDP_CHECK_BUILD_DIR=$(cache_check_dir)
check() {
  DOCS_RS=1 CARGO_TARGET_DIR="$PWD/target/gpu-check" CARGO_BUILD_BUILD_DIR="$DDP_CHECK_BUILD_DIR" \
    "$@"
}
cache_build check cargo clippy --release --workspace --all-targets \
  --features "$DDP_CHECK_FEATURES" -- -D warnings

step "docs: every crate's documentation renders without warnings (broken or private links)"
# --release and the lint's folder and features: the dependencies' metadata is the lint's, just
# built (anything else would check every dependency again: minutes on two cores).
RUSTDOCFLAGS="-D warnings" check cargo doc --release --workspace --no-deps \
  --features "$DDP_CHECK_FEATURES"

step "packages: every crate packed as crates.io takes it; the packs and the example built from them"
# Last but one: the example's binaries in target/release are then the packs' builds (same sources).
bash ci/packages.sh "$FEATURES" "$DDP_CHECK_FEATURES"

step "semver: the public API against the last release (cargo semver-checks from crates.io)"
# The baseline is the commit of the last release (ci/semver-baseline) until a version is on
# crates.io; ci/semver.sh says how. Only when this version may not break the baseline's API: from
# a breaking release (0.1.x -> 0.2.0, 1.x -> 2.0.0) cargo semver-checks allows every change (the
# CHANGELOG lists them) and cannot fail, so it is not run then; building it from crates.io takes
# over 8 minutes on two cores and its rustdoc JSON 5 more.
semver_key() { local v=$1; if [ "${v%%.*}" = 0 ]; then echo "${v%.*}"; else echo "${v%%.*}"; fi; }
version_of() { sed -n 's/^version = "\(.*\)"$/\1/p' | head -1; }
baseline_version=$(git show "$(grep -v '^#' ci/semver-baseline | head -1):Cargo.toml" | version_of)
current_version=$(version_of <Cargo.toml)
if [ "$(semver_key "$baseline_version")" = "$(semver_key "$current_version")" ]; then
  if ! command -v cargo-semver-checks >/dev/null 2>&1; then
    cargo install --locked --quiet cargo-semver-checks
  fi
  cargo semver-checks --version
  bash ci/semver.sh "$FEATURES"
else
  echo "semver: $baseline_version -> $current_version is a breaking release: every change is" \
    "allowed (CHANGELOG.md lists them); nothing to check until a $current_version baseline"
fi

step "done"
