//! docs/guide.md tells a user which burn features to depend on, and that `ddp` adds only
//! `extension` to them and `ddp-data` none: checked here against the burn features
//! ddp/Cargo.toml and data/Cargo.toml really turn on (through the workspace's set where one
//! says `burn.workspace = true`).

use std::path::Path;

/// The quoted words of the `features = [...]` list on `line`.
fn features_of(line: &str) -> Vec<String> {
    let Some(start) = line.find("features") else {
        return Vec::new();
    };
    let rest = &line[start..];
    let (Some(open), Some(close)) = (rest.find('['), rest.find(']')) else {
        return Vec::new();
    };
    rest[open + 1..close]
        .split(',')
        .map(|f| f.trim().trim_matches('"').to_string())
        .filter(|f| !f.is_empty())
        .collect()
}

/// The first line of `text` that declares the `burn` dependency.
fn burn_line(text: &str) -> Option<&str> {
    text.lines()
        .find(|l| l.trim_start().starts_with("burn ") || l.trim_start().starts_with("burn."))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The burn features the crate in `dir` (under the workspace `root`) turns on.
fn burn_features_of(root: &Path, dir: &str) -> Vec<String> {
    let manifest = read(&root.join(dir).join("Cargo.toml"));
    let line = burn_line(&manifest).unwrap_or_else(|| panic!("{dir}/Cargo.toml declares burn"));
    if line.contains("workspace = true") || line.contains(".workspace") {
        let workspace = read(&root.join("Cargo.toml"));
        let deps = workspace
            .split("[workspace.dependencies]")
            .nth(1)
            .expect("the workspace has dependencies");
        features_of(burn_line(deps).expect("the workspace declares burn"))
    } else {
        features_of(line)
    }
}

/// ddp-data, in the guide's dependency list too, turns on no burn feature beyond the guide's
/// (the workspace's set would force burn-flex's `simd` on every user).
#[test]
fn ddp_data_turns_on_no_burn_feature_beyond_the_guides() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = burn_features_of(&root, "data");
    let guide = read(&root.join("docs/guide.md"));
    let user = features_of(burn_line(&guide).expect("the guide shows a burn dependency"));
    assert!(guide.contains("ddp-data = "), "the guide lists ddp-data");
    let added: Vec<&String> = data.iter().filter(|f| !user.contains(f)).collect();
    assert!(
        added.is_empty(),
        "ddp-data turns on burn's {added:?} beyond the guide's {user:?}"
    );
}

#[test]
fn ddp_turns_on_only_the_burn_features_the_guide_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let ddp_features = burn_features_of(&root, "ddp");
    assert!(
        ddp_features.iter().any(|f| f == "extension"),
        "the overlap hooks need burn's `extension`: {ddp_features:?}"
    );

    let guide = read(&root.join("docs/guide.md"));
    let user = features_of(burn_line(&guide).expect("the guide shows a burn dependency"));
    assert!(!user.is_empty(), "the guide's burn line names its features");
    let added: Vec<&String> = ddp_features.iter().filter(|f| !user.contains(f)).collect();
    assert_eq!(
        added,
        vec!["extension"],
        "ddp turns on {ddp_features:?}; the guide's burn line has {user:?} and says that ddp \
         adds only `extension`"
    );
    assert!(
        guide.contains("`extension`"),
        "the guide says that ddp turns on `extension`"
    );
}
