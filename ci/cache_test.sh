#!/usr/bin/env bash
# Tests of ci/cache.sh (CI's dependency cache), run by ci/run.sh before the cache is opened: each
# case builds a cache folder by hand (no cargo build), calls the functions, and checks what they
# did to the folder, the variables and the log. Runs in a few seconds; exits non-zero at the
# first case that fails, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ddp-cache-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail() { echo "ci/cache_test.sh: $1" >&2; exit 1; }

# A cache with one dependency (serde) and one artifact of each kind of this workspace's (the
# ddp-comm library, a test binary named after a test target, the lib of burn-ddp named `ddp`).
fill() {
  local dir=$1
  mkdir -p "$dir/target/release/deps" "$dir/target/release/.fingerprint/serde-1" \
    "$dir/target/release/.fingerprint/ddp-comm-2" "$dir/target/release/build/ddp-apps-3"
  touch "$dir/target/release/deps/libserde-1.rlib" "$dir/target/release/deps/libddp_comm-2.rlib" \
    "$dir/target/release/deps/processes-4" "$dir/target/release/deps/libddp-5.rlib"
}

# Runs `$@` in a subshell that has sourced ci/cache.sh with DDP_CI_CACHE=$dir, from the root;
# the log goes to $tmp/log, and the subshell prints `state=<CACHE_STATE> build=<dir>` last.
opened() {
  local dir=$1
  shift
  (
    source "$ROOT/ci/cache.sh"
    export DDP_CI_CACHE=$dir
    unset CARGO_BUILD_BUILD_DIR
    "$@"
    echo "state=$CACHE_STATE build=${CARGO_BUILD_BUILD_DIR:-}"
  ) >"$tmp/log" 2>&1
}

stamp() { (source "$ROOT/ci/cache.sh" && cache_stamp); }

# 1. No cache yet: cold, the build folder is the cache's, and closing stamps it.
opened "$tmp/c1" eval 'cache_open; cache_close'
grep -q "state=cold build=$tmp/c1/target" "$tmp/log" || fail "a new cache is not cold: $(cat "$tmp/log")"
[ "$(cat "$tmp/c1/stamp")" = "$(stamp)" ] || fail "closing did not stamp the cache"

# 2. A stamped cache of this toolchain: warm; the workspace's artifacts pruned, the dependency kept;
#    the stamp removed while the run uses it.
fill "$tmp/c2" && stamp >"$tmp/c2/stamp"
opened "$tmp/c2" cache_open
grep -q "state=warm build=$tmp/c2/target" "$tmp/log" || fail "a stamped cache is not warm: $(cat "$tmp/log")"
[ -e "$tmp/c2/target/release/deps/libserde-1.rlib" ] || fail "pruning removed a dependency"
[ -d "$tmp/c2/target/release/.fingerprint/serde-1" ] || fail "pruning removed a dependency's fingerprint"
for gone in deps/libddp_comm-2.rlib deps/processes-4 deps/libddp-5.rlib .fingerprint/ddp-comm-2 \
  build/ddp-apps-3; do
  [ ! -e "$tmp/c2/target/release/$gone" ] || fail "pruning left the workspace's $gone"
done
[ ! -e "$tmp/c2/stamp" ] || fail "an open cache still has its stamp"

# 3. No stamp (a run stopped in the middle): wiped, cold, and the log says why.
fill "$tmp/c3"
opened "$tmp/c3" cache_open
grep -q "state=cold" "$tmp/log" || fail "an unstamped cache was used: $(cat "$tmp/log")"
grep -q "it has no stamp" "$tmp/log" || fail "the log does not say why the cache was wiped"
[ ! -e "$tmp/c3/target/release/deps/libserde-1.rlib" ] || fail "an unstamped cache was not wiped"

# 4. Another toolchain's stamp: wiped.
fill "$tmp/c4" && printf 'layout 1\nrelease: 1.0.0\n' >"$tmp/c4/stamp"
opened "$tmp/c4" cache_open
grep -q "written by another toolchain (1.0.0)" "$tmp/log" || fail "another toolchain's cache: $(cat "$tmp/log")"
[ ! -e "$tmp/c4/target/release/deps/libserde-1.rlib" ] || fail "another toolchain's cache was kept"

# 5. Over the size limit: wiped.
fill "$tmp/c5" && stamp >"$tmp/c5/stamp"
DDP_CI_CACHE_MAX_GB=0 opened "$tmp/c5" cache_open
grep -q "over DDP_CI_CACHE_MAX_GB=0" "$tmp/log" || fail "an oversized cache: $(cat "$tmp/log")"

# 6. A build that fails on the warm cache (its artifacts damaged) is run again cold, after the
#    cache is wiped; it passes then, and the log says so.
fill "$tmp/c6" && stamp >"$tmp/c6/stamp" && touch "$tmp/c6/target/release/deps/libdamaged-6.rlib"
build_needs_no_damage() { [ ! -e "$DDP_CI_CACHE/target/release/deps/libdamaged-6.rlib" ]; }
opened "$tmp/c6" eval 'cache_open; cache_build build_needs_no_damage && echo "build passed"'
grep -q "the build failed on the warm cache" "$tmp/log" || fail "no cold retry: $(cat "$tmp/log")"
grep -q "build passed" "$tmp/log" || fail "the cold retry did not pass: $(cat "$tmp/log")"

# 7. A build that fails cold fails, once.
opened "$tmp/c7" eval 'cache_open; n=0; failing() { n=$((n + 1)); false; }; cache_build failing || echo "failed after $n run(s)"'
grep -q "failed after 1 run(s)" "$tmp/log" || fail "a cold failure: $(cat "$tmp/log")"

# 8. A cache another run holds is not shared: this run builds in its clone, no build folder set.
mkdir -p "$tmp/c8" && exec 8>"$tmp/c8/lock" && flock -n 8
opened "$tmp/c8" cache_open
exec 8>&-
grep -q "held by another run" "$tmp/log" || fail "a held cache: $(cat "$tmp/log")"
grep -q "state=off build=$" "$tmp/log" || fail "a held cache was used: $(cat "$tmp/log")"

# 9. DDP_CI_CACHE=off: no cache.
opened off cache_open
grep -q "state=off build=$" "$tmp/log" || fail "DDP_CI_CACHE=off: $(cat "$tmp/log")"

echo "ci/cache_test.sh: 9 cases passed"
