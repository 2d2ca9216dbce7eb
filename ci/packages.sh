#!/usr/bin/env bash
# The library crates as crates.io would receive them, and the example built against them.
#
# 1. `cargo package --workspace` packs every crate. Those that can be published have
#    the metadata crates.io requires (description, licence, readme, documentation, keywords,
#    categories, rust-version), the licence files inside each crate, a version on every path
#    dependency, and only the files the crate owns. The example, ddp-bench and xtask
#    (`publish = false`) are packed too: the example to be built from its pack, xtask so that
#    the packs' build unifies features as the workspace's does (xtask's plotters turns on num-traits' `default`;
#    without it every burn crate would compile again).
# 2. The packs are unpacked side by side into one workspace whose dependencies between them go
#    through crates.io's names with `[patch.crates-io]` pointing at the unpacked packs (the
#    crates are not on crates.io yet), so that every crate compiles from its own pack alone:
#    every pack's libraries and binaries are type-checked with every feature, the GPU ones
#    included (`DOCS_RS=1`, as CI's lint), in the lint's target folder, whose dependencies are
#    already checked (the same versions from the copied Cargo.lock, the same features and
#    profile), so only the packs are checked. Then the example (`ddp-user-example`, packed too)
#    is built, linked, against the packed `burn-ddp` and `ddp-data` as a user's program is
#    against the registry, not against the workspace, in the release build of the tests' feature
#    set, whose compiled burn it shares. This replaces `cargo package`'s own verification, which
#    builds every pack in turn in the dev profile and compiles burn once more for it (about 25
#    minutes on CI's two cores); building every pack in release took 6 minutes.
#
# Run from the repository root with the tests' feature set as the first argument and the lint's
# (every feature) as the second. It writes under target/ only: target/package (cargo's packs),
# target/package-build, the packs' check in target/gpu-check, and the example's binaries in
# target/release (then the packs' builds of the same sources; the workspace's next cargo build
# links its own again).
set -euo pipefail
cd "$(dirname "$0")/.."
FEATURES=${1:?usage: ci/packages.sh FEATURES CHECK_FEATURES}
CHECK_FEATURES=${2:?usage: ci/packages.sh FEATURES CHECK_FEATURES}
ROOT=$PWD

rm -rf target/package target/package-build
cargo package --workspace --no-verify --locked

build=target/package-build
mkdir -p "$build"
crates=()
for pack in target/package/*.crate; do
  tar -xzf "$pack" -C "$build"
  crates+=("$(basename "$pack" .crate)")
done
# cargo stamps every file of a pack with one fixed time (2006): without a fresh stamp, a pack
# built before in target/release (an older revision's) would count as up to date and be linked.
find "$build" -type f -exec touch {} +
echo "packed: ${crates[*]}"

python3 - "$build" "${crates[@]}" <<'PY'
import json, pathlib, re, sys, tomllib

build = pathlib.Path(sys.argv[1])
crates = sys.argv[2:]
names = {}
unpublished = set()
for folder in crates:
    manifest = tomllib.loads((build / folder / "Cargo.toml").read_text())
    names[manifest["package"]["name"]] = folder
    # A pack must stand alone: no dependency of any kind may point at a path.
    for table in ("dependencies", "dev-dependencies", "build-dependencies"):
        for dep, spec in manifest.get(table, {}).items():
            if isinstance(spec, dict) and "path" in spec:
                sys.exit(f"{folder}/Cargo.toml: [{table}] {dep} still has a path: {spec}")
    if manifest["package"].get("publish") is False:
        unpublished.add(manifest["package"]["name"])
        continue  # the example, the benchmarks and xtask: never published
    for key in ("description", "license", "readme", "documentation", "keywords", "categories",
                "rust-version"):
        if not manifest["package"].get(key):
            sys.exit(f"{folder}/Cargo.toml: package.{key} is missing")
    for licence in ("LICENSE-MIT", "LICENSE-APACHE", manifest["package"]["readme"]):
        if not (build / folder / licence).is_file():
            sys.exit(f"{folder}: {licence} is not in the pack")

example = tomllib.loads((build / names["ddp-user-example"] / "Cargo.toml").read_text())
for dep in ("burn-ddp", "ddp-data"):
    spec = example["dependencies"][dep]
    if not (isinstance(spec, dict) and spec.get("version")):
        sys.exit(f"the packed example's {dep} is not a registry dependency: {spec}")

root = tomllib.loads(pathlib.Path("Cargo.toml").read_text())
release = root["profile"]["release"]
lines = ["[workspace]", 'resolver = "2"',
         "members = [" + ", ".join(f'"{f}"' for f in crates) + "]", "",
         "# The workspace's release profile, so that its compiled dependencies are reused.",
         "[profile.release]"]
def toml_value(v):
    return str(v).lower() if isinstance(v, bool) else json.dumps(v)
lines += [f"{k} = {toml_value(v)}" for k, v in release.items() if not isinstance(v, dict)]
# Per-package settings ([profile.release.package.NAME]), as the workspace has them.
for name, settings in release.get("package", {}).items():
    lines += ["", f'[profile.release.package."{name}"]']
    lines += [f"{k} = {toml_value(v)}" for k, v in settings.items()]
lines += ["", "# Not on crates.io yet: the registry's names resolve to the unpacked packs.",
          "[patch.crates-io]"]
lines += [f'{name} = {{ path = "{folder}" }}' for name, folder in sorted(names.items())
          if name not in unpublished]
(build / "Cargo.toml").write_text("\n".join(lines) + "\n")
print((build / "Cargo.toml").read_text())
PY

cp Cargo.lock "$build/Cargo.lock"
cd "$build"
# Every pack's libraries and binaries, type-checked with every feature.
# (The lint's build folder: CI's dependency cache keeps it apart from the release build's, see
# ci/cache.sh; by default the target folder itself.)
DOCS_RS=1 CARGO_TARGET_DIR=$ROOT/target/gpu-check \
  CARGO_BUILD_BUILD_DIR=${DDP_CHECK_BUILD_DIR:-$ROOT/target/gpu-check} cargo check --release \
  --workspace --features "$CHECK_FEATURES"
# The example's binaries, built from the packs (the workspace's features: `--workspace` unifies
# them as the workspace does, so that burn is the tests' build).
CARGO_TARGET_DIR=$ROOT/target cargo build --release --workspace --features "$FEATURES" \
  --bin user-train --bin user-elastic
# The example's binary was built from the packs: its dependencies' sources are the unpacked
# folders, which cargo's lock file records.
python3 - <<'PY'
import sys, tomllib
lock = tomllib.loads(open("Cargo.lock").read())
sources = {p["name"]: p.get("source") for p in lock["package"]}
for name in ("burn-ddp", "ddp-data", "ddp-comm", "ddp-fsio"):
    if name not in sources:
        sys.exit(f"{name} is not in the packs' lock file")
    if sources[name] is not None:
        sys.exit(f"{name} came from {sources[name]}, not from its unpacked pack")
print("the example built against the packs of burn-ddp, ddp-data, ddp-comm and ddp-fsio")
PY
