//! What the data tests share: the real MNIST, found or fetched the product's way.

#![allow(dead_code)] // each test binary uses a subset

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A folder holding the real MNIST: the product's cache when a run filled it, else the
/// developers' `../shared/data/mnist`, else a download by the product's own fetcher into the
/// build's target folder (`CARGO_TARGET_TMPDIR`). Never written outside the target folder.
pub fn real_mnist() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist");
        ddp_data::fetch::mnist_for_tests(Path::new(env!("CARGO_TARGET_TMPDIR")), Some(&local))
            .unwrap_or_else(|e| panic!("the tests need the real MNIST: {e}"))
    })
    .clone()
}

/// The bytes of MNIST file `name` in `dir`, decompressed (the folder may hold it raw or `.gz`).
pub fn read_decompressed(dir: &Path, name: &str) -> Vec<u8> {
    let raw = dir.join(name);
    let mut bytes = Vec::new();
    if raw.is_file() {
        return std::fs::read(&raw).unwrap();
    }
    let gz = std::fs::File::open(dir.join(format!("{name}.gz"))).unwrap();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut bytes)
        .unwrap();
    bytes
}
