#!/usr/bin/env bash
# CI: one release build of the whole workspace (tests, benches and the end-to-end run share it),
# the README's test command, clippy and fmt. A fresh machine has the Rust toolchain, gcc,
# python3 and node/npm; nothing else is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "toolchain"
cargo --version
rustc --version
if ! cargo clippy --version >/dev/null 2>&1; then rustup component add clippy; fi
if ! cargo fmt --version >/dev/null 2>&1; then rustup component add rustfmt; fi

step "fmt"
cargo fmt --all -- --check

step "build (release, whole workspace)"
cargo build --release --workspace --all-targets

step "tests: the README's test command"
# Keep in sync with README.md ("Run the tests").
cargo test --release --workspace

step "end to end: 2 ranks of train-mnist, 200 steps on the real MNIST"
cargo xtask train-mnist --nproc 2 --epochs 1 --out target/ci-run --min-accuracy 0.95 \
  --data-dir ../shared/data/mnist --max-steps 200 --log-interval 50

step "clippy"
cargo clippy --release --workspace --all-targets -- -D warnings

step "done"
