//! The user's program (`user-train`) as a user runs it: standalone with batch 2b, and under the
//! real `ddprun` on 2 ranks with batch b each, over shared memory and over TCP
//! (`DDP_TRANSPORT`). The 2-rank runs must end where the 1-rank run ends, to float tolerance
//! (the same samples per step: the sampler's shards of a step are the 1-rank batch), and
//! every rank's replica must be bit-identical. Every process runs under a deadline.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

#[path = "../../apps/tests/common/mod.rs"]
mod common;

const DEADLINE: Duration = Duration::from_secs(180);
const STEPS: &str = "30";

/// The parameters rank `rank` wrote into `dir`.
fn params(dir: &Path, rank: usize) -> Vec<f32> {
    let path = dir.join(format!("params-rank{rank}.f32"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Runs `command` to completion under the deadline; panics with its output unless it succeeds.
fn run(command: &mut Command) -> String {
    let out = common::output_with_deadline(command, DEADLINE);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\n{text}",
        out.status
    );
    text
}

/// ||a - b|| / ||a||.
fn norm_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let n: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (d / n).sqrt()
}

#[test]
fn two_ranks_with_batch_b_match_one_rank_with_batch_2b_on_every_transport() {
    let tmp = tempfile::tempdir().unwrap();
    let user_train = env!("CARGO_BIN_EXE_user-train");

    let single = tmp.path().join("single");
    let mut command = Command::new(user_train);
    common::clear_launcher_env(&mut command);
    command
        .args(["--batch", "16", "--steps", STEPS, "--out"])
        .arg(&single);
    let text = run(&mut command);
    assert!(text.contains("30 steps on 1 rank(s)"), "{text}");
    let reference = params(&single, 0);

    // Training moved the parameters: an untrained run (0 steps) ends elsewhere.
    let untrained = tmp.path().join("untrained");
    let mut command = Command::new(user_train);
    common::clear_launcher_env(&mut command);
    command
        .args(["--batch", "16", "--steps", "0", "--out"])
        .arg(&untrained);
    run(&mut command);
    let moved = norm_rel_diff(&params(&untrained, 0), &reference);
    assert!(
        moved > 1e-3,
        "training did not move the parameters ({moved})"
    );

    for transport in ["shm", "tcp"] {
        let dir = tmp.path().join(transport);
        let mut command = Command::new(common::workspace_bin("ddprun"));
        common::clear_launcher_env(&mut command);
        command
            .env("DDP_TRANSPORT", transport)
            .args(["--nproc-per-node", "2", "--"])
            .arg(user_train)
            .args(["--batch", "8", "--steps", STEPS, "--out"])
            .arg(&dir);
        let text = run(&mut command);
        assert!(
            text.contains("30 steps on 2 rank(s)"),
            "{transport}: {text}"
        );
        let (r0, r1) = (params(&dir, 0), params(&dir, 1));
        assert!(r0 == r1, "{transport}: the replicas differ");
        let d = norm_rel_diff(&reference, &r0);
        eprintln!("{transport}: 2 x 8 against 1 x 16, relative difference {d:e}");
        assert!(
            d < 1e-5,
            "{transport}: 2 ranks x 8 differ from 1 rank x 16 by {d}"
        );
    }
}
