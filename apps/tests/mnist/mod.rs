//! The real MNIST for the trainers' tests, found or fetched the product's way (kept apart from
//! `common`, which the launcher's tests include and which must not need ddp-data).

#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A folder holding the real MNIST: the product's cache when a run filled it, else the
/// developers' `../shared/data/mnist`, else a download by the product's own fetcher into the
/// build's target folder (`CARGO_TARGET_TMPDIR`). Nothing outside the target folder is written.
pub fn real_mnist() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
        ddp_data::fetch::mnist_for_tests(Path::new(env!("CARGO_TARGET_TMPDIR")), Some(&local))
            .unwrap_or_else(|e| panic!("the tests need the real MNIST: {e}"))
    })
    .clone()
}

/// The MNIST file `name` (its standard name without `.gz`) in `dir`, raw or `.gz`, whichever
/// is there.
pub fn file(dir: &Path, name: &str) -> PathBuf {
    [name.to_string(), format!("{name}.gz")]
        .into_iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{} holds no {name}", dir.display()))
}
