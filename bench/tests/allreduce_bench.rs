//! `ddp-allreduce-bench` under `ddprun`, end to end: two real ranks, small sizes, checked
//! results and the JSON that `cargo xtask bench-allreduce` reads.

use std::process::Command;
use std::time::Duration;

#[path = "../../apps/tests/common/mod.rs"]
mod common;
use common::output_with_deadline;

/// Runs the bench over `nproc` ranks with the extra `env`, failing the test past 120 s.
fn bench(nproc: usize, env: &[(&str, &str)], json: &std::path::Path) -> (bool, String) {
    let mut command = Command::new(common::workspace_bin("ddprun"));
    command.args([
        "--grace-period",
        "1",
        "--nproc-per-node",
        &nproc.to_string(),
        "--",
    ]);
    command.arg(env!("CARGO_BIN_EXE_ddp-allreduce-bench"));
    command.args([
        "--sizes",
        "4,4K,100K,1M",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
    ]);
    command.arg(json).envs(env.iter().copied());
    let output = output_with_deadline(&mut command, Duration::from_secs(120));
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

fn results(json: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[test]
fn bench_runs_checks_and_writes_json_for_each_algorithm() {
    let dir = tempfile::tempdir().unwrap();
    for (algo, threshold) in [
        ("auto", None),
        ("ring", Some("0")),
        ("small", Some("1099511627776")),
    ] {
        let json = dir.path().join(format!("{algo}.json"));
        let env: Vec<(&str, &str)> = threshold
            .map(|t| ("DDP_SMALL_ALLREDUCE_BYTES", t))
            .into_iter()
            .collect();
        let (ok, text) = bench(2, &env, &json);
        assert!(ok, "{algo}: {text}");
        assert!(
            text.contains("[rank 0]"),
            "{algo}: rank 0 prints the table: {text}"
        );
        let report = results(&json);
        assert_eq!(report["implementation"], "ddp-rs");
        assert_eq!(report["world_size"], 2);
        let sizes: Vec<u64> = report["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(sizes, [4, 4096, 102_400, 1 << 20], "{algo}");
        for result in report["results"].as_array().unwrap() {
            let median = result["median_s"].as_f64().unwrap();
            let (algbw, busbw) = (
                result["algbw_gbs"].as_f64().unwrap(),
                result["busbw_gbs"].as_f64().unwrap(),
            );
            assert!(median > 0.0 && median < 10.0, "{algo}: {result}");
            let bytes = result["bytes"].as_f64().unwrap();
            assert!(
                (algbw - bytes / median / 1e9).abs() <= 1e-9 * algbw.max(1.0),
                "{result}"
            );
            // busbw = algbw * 2(N-1)/N, which is algbw itself for N = 2.
            assert!((busbw - algbw).abs() <= 1e-12 * algbw.max(1.0), "{result}");
            assert_eq!(result["iters"], 3);
        }
    }
}

#[test]
fn bench_over_three_ranks_reports_bus_bandwidth() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("three.json");
    let (ok, text) = bench(3, &[], &json);
    assert!(ok, "{text}");
    for result in results(&json)["results"].as_array().unwrap() {
        let (algbw, busbw) = (
            result["algbw_gbs"].as_f64().unwrap(),
            result["busbw_gbs"].as_f64().unwrap(),
        );
        assert!(
            (busbw - algbw * 4.0 / 3.0).abs() <= 1e-9 * busbw.max(1.0),
            "{result}"
        );
    }
}

#[test]
fn bench_refuses_a_size_that_is_not_whole_floats() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(common::workspace_bin("ddprun"));
    command.args(["--grace-period", "1", "--nproc-per-node", "2", "--"]);
    command
        .arg(env!("CARGO_BIN_EXE_ddp-allreduce-bench"))
        .args(["--sizes", "6"]);
    let output = output_with_deadline(command.current_dir(dir.path()), Duration::from_secs(120));
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("size 6 is not a positive multiple of 4 bytes"),
        "{stderr}"
    );
    assert!(stderr.contains("Root cause"), "{stderr}");
}
