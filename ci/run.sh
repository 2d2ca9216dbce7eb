#!/usr/bin/env bash
# CI: one release build of the whole workspace with the GPU feature compiled in (no CUDA toolkit
# needed: cudarc and burn-cuda load CUDA at run time), shared by the tests, the end-to-end run and
# clippy's view of the same feature set. A fresh machine has the Rust toolchain, gcc, python3 and
# node/npm; nothing else is needed (the tests read MNIST from ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."

# The one feature set of every step below (keep in sync with README.md).
FEATURES=ddp-apps/cuda
export DDP_CARGO_FEATURES=$FEATURES

step() { printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "toolchain"
cargo --version
rustc --version
if ! cargo clippy --version >/dev/null 2>&1; then rustup component add clippy; fi
if ! cargo fmt --version >/dev/null 2>&1; then rustup component add rustfmt; fi

step "fmt"
cargo fmt --all -- --check

step "build (release, whole workspace, GPU feature compiled in)"
cargo build --release --workspace --all-targets --features "$FEATURES"

step "tests: the README's test command"
# Keep in sync with README.md ("Set-up").
cargo test --release --workspace --features ddp-apps/cuda

step "end to end: 2 ranks of train-mnist, 200 steps on the real MNIST"
cargo xtask train-mnist --nproc 2 --epochs 1 --out target/ci-run --min-accuracy 0.95 \
  --data-dir ../shared/data/mnist --max-steps 200 --log-interval 50

step "clippy"
cargo clippy --release --workspace --all-targets --features "$FEATURES" -- -D warnings

step "done"
