#!/usr/bin/env bash
# cargo semver-checks on every library crate against the last release.
#
# No version is on crates.io yet, so the baseline is the release's commit, recorded in
# ci/semver-baseline; once one is published, the registry's copy becomes the baseline. The
# version in Cargo.toml decides what may change: the same version allows additions but no
# breaking change; 0.1 -> 0.2 allows them (CHANGELOG.md lists them).
#
# How: rustdoc's JSON of every library crate, for this tree and for the baseline (its sources
# from `git archive`), each made by one `cargo doc --workspace` so that the dependencies are
# checked once for both (same Cargo.lock, features and target folder), then cargo semver-checks
# on each pair of JSON files. (`cargo semver-checks --workspace` builds every crate twice in a
# fresh target folder of its own, the dependencies included: about an hour on two cores.)
# rustdoc's JSON output is unstable: RUSTC_BOOTSTRAP=1, as cargo semver-checks itself sets.
# The feature set is CI's (the `cuda` features would need cubecl-llvm's LLVM download).
#
# Usage: ci/semver.sh FEATURES. Writes under target/semver only.
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES=${1:?usage: ci/semver.sh FEATURES}
ROOT=$PWD
OUT=$ROOT/target/semver

baseline=$(grep -v '^#' ci/semver-baseline | head -1)
if ! git cat-file -e "$baseline^{commit}" 2>/dev/null; then
  echo "ci/semver.sh: the baseline commit $baseline (ci/semver-baseline) is not in this clone" \
    "(a shallow clone?): fetch the history (git fetch --unshallow) and run again" >&2
  exit 1
fi

rm -rf "$OUT/src" "$OUT/json"
mkdir -p "$OUT/src/baseline" "$OUT/json/current" "$OUT/json/baseline"
git archive "$baseline" | tar -x -C "$OUT/src/baseline"

# rustdoc JSON of every library crate of the workspace at $1, into $2.
rustdoc_json() {
  rm -f "$OUT"/target/doc/*.json
  (cd "$1" && RUSTC_BOOTSTRAP=1 RUSTDOCFLAGS="-Z unstable-options --output-format json" \
    CARGO_TARGET_DIR="$OUT/target" cargo doc --quiet --workspace --no-deps --lib --locked \
    --features "$FEATURES")
  cp "$OUT"/target/doc/*.json "$2"/
}
# The baseline gets the features of $FEATURES that it has (a feature added since, such as
# ddp-apps/wgpu, cannot be asked of it; what it enables is new API, compared as additions).
baseline_features=()
for f in ${FEATURES//,/ }; do
  pkg=${f%%/*} feat=${f#*/}
  manifest=$(grep -l "^name = \"$pkg\"" "$OUT"/src/baseline/*/Cargo.toml | head -1)
  if [ -n "$manifest" ] && grep -q "^$feat = " "$manifest"; then
    baseline_features+=("$f")
  else
    echo "semver: the baseline has no feature $f; comparing without it"
  fi
done
rustdoc_json "$ROOT" "$OUT/json/current"
FEATURES=$(IFS=,; echo "${baseline_features[*]}") rustdoc_json "$OUT/src/baseline" "$OUT/json/baseline"

# Every publishable library crate must be checked: a crate with no baseline is new (its first
# release), which is fine; a crate of the baseline that is gone is a breaking change.
status=0
for current in "$OUT"/json/current/*.json; do
  name=$(basename "$current")
  if [ ! -e "$OUT/json/baseline/$name" ]; then
    echo "semver: ${name%.json} is new since the baseline (nothing to compare)"
    continue
  fi
  echo "semver: ${name%.json}"
  cargo semver-checks --baseline-rustdoc "$OUT/json/baseline/$name" --current-rustdoc "$current" \
    || status=1
done
for old in "$OUT"/json/baseline/*.json; do
  if [ ! -e "$OUT/json/current/$(basename "$old")" ]; then
    echo "semver: the library $(basename "$old" .json) of the baseline is gone" >&2
    status=1
  fi
done
exit $status
