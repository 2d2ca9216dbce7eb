//! The trainers' JSON summary, as the tests that run them read it (`--json`: rank 0 prints
//! `DDP_SUMMARY {...}` at the end).

use std::process::Output;

use serde_json::Value;

use crate::common::text;

/// The JSON summary rank 0 printed; panics, showing the output, when the run failed or printed
/// none.
pub fn summary(out: &Output) -> Value {
    let all = text(out);
    assert!(out.status.success(), "run failed:\n{all}");
    let line = all
        .lines()
        .find_map(|l| l.split_once("DDP_SUMMARY ").map(|(_, j)| j.to_string()))
        .unwrap_or_else(|| panic!("no summary in:\n{all}"));
    serde_json::from_str(&line).unwrap()
}
