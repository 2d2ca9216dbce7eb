# CI's persistent dependency cache, sourced by ci/run.sh (as rust-cache keeps `target/` between
# runs on hosted CI).
#
# How it works: cargo's build directory (`build.build-dir`: the compiled dependencies, the
# fingerprints, the build scripts' output; not the final binaries) lives outside the clone, in
# `$DDP_CI_CACHE` (default `~/.cache/ddp-rs-ci`, the machine's, not the run's empty HOME), so a
# later run on the same machine finds every dependency compiled and rebuilds only the workspace's
# own crates, whose artifacts cargo keys by the clone's path. The final binaries stay in the
# clone's `target/`, where every step and test looks for them. Two build folders, as before the
# cache: `target` (the tests, the tasks, the packs' build) and `gpu-check` (the lint, the docs,
# the packs' check, which run with `DOCS_RS=1`; sharing one folder would rerun the build scripts
# that watch that variable at every switch).
#
# A cache must never make a run fail or pass wrongly:
# - cargo itself rebuilds what changed (a new Cargo.lock, other features, another profile);
# - a cache written by another toolchain, or by a run that stopped before its end (its stamp
#   is removed at the start and written back on exit), or larger than `$DDP_CI_CACHE_MAX_GB`
#   (default 40), is wiped, and the log says why;
# - the workspace's artifacts of earlier runs (other clones' paths: never used again) are pruned
#   at the start, so the cache holds dependencies only and does not grow run after run;
# - `cache_build` runs the first build of a folder; if it fails on a warm cache, the cache is
#   wiped and the build runs again cold (the log says so): a build that fails cold fails CI;
# - a cache that another run holds (flock) is not shared: this run builds cold in its clone.
# `DDP_CI_CACHE=off` turns the cache off (a cold build in the clone's target folder).

CACHE_DIR=
CACHE_STATE=off

# The stamp of a cache this toolchain may use: the compiler's full version and this file's
# layout version.
cache_stamp() {
  printf 'layout 1\n%s\n' "$(rustc -vV)"
}

# Opens the cache (call from the clone's root, before any build): checks, prunes and exports
# CARGO_BUILD_BUILD_DIR; sets CACHE_STATE to cold, warm or off.
cache_open() {
  local dir=${DDP_CI_CACHE:-$HOME/.cache/ddp-rs-ci} max_gb=${DDP_CI_CACHE_MAX_GB:-40} size_gb
  if [ "$dir" = off ]; then
    echo "dependency cache: off (DDP_CI_CACHE=off): a cold build in the clone"
    return 0
  fi
  if ! mkdir -p "$dir" 2>/dev/null || ! exec 9>"$dir/lock"; then
    echo "dependency cache: $dir cannot be written: a cold build in the clone"
    return 0
  fi
  if ! flock -n 9; then
    echo "dependency cache: $dir is held by another run: a cold build in the clone"
    exec 9>&-
    return 0
  fi
  CACHE_DIR=$dir
  if [ -d "$dir/target" ] || [ -d "$dir/gpu-check" ]; then
    size_gb=$(du -s --block-size=1G "$dir" 2>/dev/null | cut -f1)
    if [ ! -f "$dir/stamp" ]; then
      cache_wipe "it has no stamp: the run that wrote it stopped before its end"
    elif [ "$(cat "$dir/stamp")" != "$(cache_stamp)" ]; then
      cache_wipe "it was written by another toolchain ($(sed -n 's/^release: //p' "$dir/stamp"))"
    elif [ "${size_gb:-0}" -gt "$max_gb" ]; then
      cache_wipe "it holds ${size_gb} GB, over DDP_CI_CACHE_MAX_GB=$max_gb"
    else
      cache_prune
      CACHE_STATE=warm
      echo "dependency cache: warm, $dir ($(du -sh "$dir" | cut -f1) after pruning)"
    fi
  fi
  if [ "$CACHE_STATE" != warm ]; then
    CACHE_STATE=cold
    echo "dependency cache: cold, $dir (filled by this run)"
  fi
  rm -f "$dir/stamp"
  export CARGO_BUILD_BUILD_DIR=$dir/target
}

# The build folder for the lint's steps (`DOCS_RS=1`): the cache's, or the clone's own.
cache_check_dir() {
  if [ -n "$CACHE_DIR" ]; then echo "$CACHE_DIR/gpu-check"; else echo "$PWD/target/gpu-check"; fi
}

# Removes the cache's folders, saying why.
cache_wipe() {
  echo "dependency cache: $CACHE_DIR is not used: $1; wiped, a cold build follows"
  rm -rf "$CACHE_DIR/target" "$CACHE_DIR/gpu-check"
  CACHE_STATE=cold
}

# Deletes what earlier runs compiled of this workspace's own packages (any clone's path):
# their fingerprints, build script folders and outputs, by package and target name. A name that
# a registry package also has is left alone.
cache_prune() {
  local metadata=$CACHE_DIR/metadata.json
  cargo metadata --format-version 1 --no-deps --offline >"$metadata" 2>/dev/null &&
    python3 - "$CACHE_DIR" Cargo.lock "$metadata" <<'PY' || echo "dependency cache: pruning failed (ignored)"
import json, pathlib, shutil, sys, tomllib
cache, lock = pathlib.Path(sys.argv[1]), tomllib.loads(pathlib.Path(sys.argv[2]).read_text())
meta = json.loads(pathlib.Path(sys.argv[3]).read_text())
ours = {p["name"] for p in meta["packages"]}
theirs = {p["name"].replace("-", "_") for p in lock["package"] if p.get("source")}
packages = {n for n in ours if n.replace("-", "_") not in theirs}
crates = {t["name"].replace("-", "_") for p in meta["packages"] for t in p["targets"]}
crates -= theirs
removed = 0
for profile in cache.glob("*/*"):
    for folder, names, sep in ((".fingerprint", packages, "-"), ("build", packages, "-"),
                               ("deps", crates, "-"), ("examples", crates, "-")):
        for entry in (profile / folder).glob("*"):
            stem = entry.name[3:] if folder == "deps" and entry.name.startswith("lib") else entry.name
            if any(stem.startswith(n + sep) for n in names):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                removed += 1
print(f"dependency cache: pruned {removed} artifacts of the workspace's own crates")
PY
}

# Runs the first build of a folder, `$@`; on a failure with a warm cache, wipes the cache and
# runs it again cold.
cache_build() {
  if "$@"; then return 0; fi
  if [ "$CACHE_STATE" != warm ]; then return 1; fi
  cache_wipe "the build failed on the warm cache (above)"
  "$@"
}

# Stamps the cache as whole (from the EXIT trap): a later run may use it.
cache_close() {
  if [ -n "$CACHE_DIR" ] && [ -d "$CACHE_DIR" ]; then
    cache_stamp >"$CACHE_DIR/stamp"
  fi
}
