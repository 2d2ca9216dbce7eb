//! The user's program (`user-train`) as a user runs it: standalone with batch 2b, and under the
//! real `ddprun` on 2 ranks with batch b each, over shared memory and over TCP
//! (`DDP_TRANSPORT`). The 2-rank runs must end where the 1-rank run ends, to float tolerance
//! (the same samples per step: the sampler's shards of a step are the 1-rank batch), and
//! every rank's replica must be bit-identical. The same on two "hosts" (network namespaces,
//! root only) of two ranks each: the hierarchical path, shared memory inside a host and TCP
//! between hosts. Every process runs under a deadline.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

#[path = "../../apps/tests/common/mod.rs"]
mod common;
#[path = "../../comm/tests/netns/mod.rs"]
mod netns;

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

/// The parameters of the standalone run with batch `batch` and `steps` steps (one rank),
/// written under `dir`.
fn single_rank(dir: &Path, batch: usize, steps: &str) -> Vec<f32> {
    let out = dir.join(format!("single-{batch}-{steps}"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_user-train"));
    common::clear_launcher_env(&mut command);
    command
        .args(["--batch", &batch.to_string(), "--steps", steps, "--out"])
        .arg(&out);
    let text = run(&mut command);
    assert!(
        text.contains(&format!("{steps} steps on 1 rank(s)")),
        "{text}"
    );
    params(&out, 0)
}

/// Checks that the `world` replicas in `dir` are bit-identical and match `reference`.
fn check_ranks(what: &str, dir: &Path, world: usize, reference: &[f32]) {
    let r0 = params(dir, 0);
    for rank in 1..world {
        assert!(
            params(dir, rank) == r0,
            "{what}: rank {rank}'s replica differs from rank 0's"
        );
    }
    let d = norm_rel_diff(reference, &r0);
    eprintln!("{what}: against 1 rank, relative difference {d:e}");
    assert!(d < 1e-5, "{what}: differs from 1 rank by {d}");
}

#[test]
fn two_ranks_with_batch_b_match_one_rank_with_batch_2b_on_every_transport() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = single_rank(tmp.path(), 16, STEPS);
    // Training moved the parameters: an untrained run (0 steps) ends elsewhere.
    let moved = norm_rel_diff(&single_rank(tmp.path(), 16, "0"), &reference);
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
            .arg(env!("CARGO_BIN_EXE_user-train"))
            .args(["--batch", "8", "--steps", STEPS, "--out"])
            .arg(&dir);
        let text = run(&mut command);
        assert!(
            text.contains("30 steps on 2 rank(s)"),
            "{transport}: {text}"
        );
        check_ranks(&format!("2 x 8 over {transport}"), &dir, 2, &reference);
    }
}

#[test]
#[ignore = "needs root and iproute2 (`ip netns`): two network namespaces; CI runs it with --ignored"]
fn two_hosts_of_two_ranks_match_one_rank_over_the_hierarchical_path() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = single_rank(tmp.path(), 16, STEPS);
    let hosts = netns::TwoHosts::new("user");
    let dir = tmp.path().join("hosts");
    // One ddprun per host, as on two machines: shared memory inside each host (DDP_HOST_ID
    // tells the hosts apart: the namespaces share /dev/shm), TCP between them.
    let node = |n: usize| {
        let mut command = Command::new("ip");
        common::clear_launcher_env(&mut command);
        command
            .args(["netns", "exec", &hosts.names[n]])
            .arg(common::workspace_bin("ddprun"))
            .args(["--nnodes", "2", "--node-rank", &n.to_string()])
            .args(["--nproc-per-node", "2", "--master-port", "29500"])
            .args(["--master-addr", netns::TwoHosts::ADDRS[0], "--"])
            .arg(env!("CARGO_BIN_EXE_user-train"))
            .args(["--batch", "4", "--steps", STEPS, "--out"])
            .arg(&dir)
            .env("DDP_HOST_ID", format!("host-{n}"))
            .env("DDP_TRANSPORT", "shm");
        run(&mut command)
    };
    let texts = std::thread::scope(|s| {
        let second = s.spawn(|| node(1));
        let first = node(0);
        [first, second.join().unwrap()]
    });
    assert!(texts[0].contains("30 steps on 4 rank(s)"), "{}", texts[0]);
    check_ranks("2 hosts x 2 ranks x 4", &dir, 4, &reference);
}
