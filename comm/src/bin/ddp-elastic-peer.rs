//! Test helper: an elastic rank ([`ddp_comm::ElasticGroup`], from `DDP_ELASTIC` and the
//! launcher's variables) that runs steps of one all-reduce and the commit vote, going on
//! through the failures and joins of its job, printing one line per event:
//!
//! - `elastic slot S gen G rank R world W step N at T`: step N committed;
//! - `elastic slot S reformed gen G rank R world W from N action A healed H grace_ms M at T`: a
//!   new generation (M: its group's `ProcessGroup::loss_grace`);
//! - `elastic slot S new round gen G rank R world W at T`: it founded a new round with the
//!   other processes waiting, every member of the job's last generation lost (it starts from
//!   step 0: it has no checkpoint);
//! - `elastic slot S done at T` (every step done), `elastic slot S error: <message>`;
//! - `elastic slot S starts: restart count C, round R` (first: `TORCHELASTIC_RESTART_COUNT`
//!   and `DDP_ELASTIC_ROUND` as the launcher gave them, `-` where unset);
//! - `elastic slot S arrived after the end at T`: it joined a job that had already finished
//!   ([`ElasticGroup::join`] gave `Ok(None)`), and exits 0.
//!
//! T is the wall clock in milliseconds since the Unix epoch. Each step all-reduces
//! `PEER_ELEMS` (default 1000) ones and checks that every element is the world size. Variables
//! of its own: `PEER_STEPS` (steps to commit, default 50), `PEER_SLEEP_MS` (pause per step,
//! default 20), `PEER_COMPAT` (the terms' `compat`, default `peer`). Exits 0 when done, 1 on
//! an error, [`ddp_comm::elastic::ELASTIC_STOP_EXIT`] when the job fell below its minimum.
//!
//! Test hook: with `PEER_DIE_AFTER_LAST=S`, slot S kills itself (`SIGKILL`) once it has
//! committed the last step, before it says the job finished, `PEER_DIE_DELAY_MS` (default 0)
//! later; only when it founded the job (not restarted: `TORCHELASTIC_RESTART_COUNT` unset or
//! 0, and not healed into a running job).
//!
//! Test hook: with `PEER_LOSE_LAST_VOTE=S`, slot S (when it founded the job, as above) takes
//! part in the last step's commit vote and then takes it for failed, as a rank does whose
//! peer was killed right after the vote, its connection reset before its last bytes arrived:
//! it re-forms with the step finished while the others commit it and finish.
//!
//! Test hook: with `PEER_BUSY_SLOT=S`, slot S, at its first failed step, stays busy
//! `PEER_BUSY_MS` (default 5000) before it re-forms (a long backward, a checkpoint write), its
//! links alive. The membership's own hooks (`DDP_TEST_ELASTIC_DIE`) kill a process inside a
//! re-form or a join.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ddp_comm::{Continue, ElasticConfig, ElasticGroup, ReduceOp, StepStatus, Vote};

fn var(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

fn main() -> std::process::ExitCode {
    let result = run();
    if let Err(e) = &result {
        println!("elastic error: {e}");
    }
    ddp_comm::elastic::finish(result)
}

fn run() -> Result<(), ddp_comm::CommError> {
    let steps = var("PEER_STEPS", 50);
    let elems = var("PEER_ELEMS", 1000) as usize;
    let sleep = Duration::from_millis(var("PEER_SLEEP_MS", 20));
    let compat = std::env::var("PEER_COMPAT").unwrap_or_else(|_| "peer".into());
    let config = ElasticConfig::from_env(&compat)?.ok_or_else(|| ddp_comm::CommError::Config {
        var: ddp_comm::ELASTIC_ENV.into(),
        message: "ddp-elastic-peer needs DDP_ELASTIC".into(),
    })?;
    let slot = config.slot;
    let given = |name: &str| std::env::var(name).unwrap_or_else(|_| "-".into());
    println!(
        "elastic slot {slot} starts: restart count {}, round {}",
        given(ddp_comm::elastic::RESTART_COUNT_ENV),
        given(ddp_comm::ELASTIC_ROUND_ENV)
    );
    let Some(mut group) = ElasticGroup::join(config)? else {
        println!("elastic slot {slot} arrived after the end at {}", now_ms());
        return Ok(());
    };
    let first_start = var(ddp_comm::elastic::RESTART_COUNT_ENV, 0) == 0 && !group.joined_running();
    let hooked = |name: &str| {
        std::env::var(name).ok().and_then(|v| v.parse().ok()) == Some(slot) && first_start
    };
    let die_after_last = hooked("PEER_DIE_AFTER_LAST");
    let lose_last_vote = hooked("PEER_LOSE_LAST_VOTE");
    let mut busy = std::env::var("PEER_BUSY_SLOT")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        == Some(slot);
    let mut committed = group.generation().step;
    if group.generation().new_round {
        println!(
            "elastic slot {slot} new round gen {} rank {} world {} at {}",
            group.generation().number,
            group.rank(),
            group.world_size(),
            now_ms()
        );
    }
    if group.joined_running() {
        println!(
            "elastic slot {slot} reformed gen {} rank {} world {} from {committed} action Keep \
             healed true at {}",
            group.generation().number,
            group.rank(),
            group.world_size(),
            now_ms()
        );
    }
    while committed < steps {
        std::thread::sleep(sleep);
        let world = group.world_size();
        let reduced = group
            .group()
            .all_reduce(vec![1.0f32; elems], ReduceOp::Sum)
            .and_then(|sum| match sum.iter().find(|&&x| x != world as f32) {
                Some(x) => Err(ddp_comm::CommError::Internal {
                    rank: group.rank(),
                    message: format!("all-reduce of ones gave {x} at world {world}"),
                }),
                None => Ok(()),
            });
        let vote = reduced
            .clone()
            .and_then(|()| group.should_commit())
            .and_then(|vote| match lose_last_vote && committed + 1 == steps {
                true => Err(ddp_comm::CommError::Internal {
                    rank: group.rank(),
                    message: "the last step's vote taken for lost (PEER_LOSE_LAST_VOTE)".into(),
                }),
                false => Ok(vote),
            });
        let (finished, cause) = match vote {
            Ok(vote) => {
                committed += 1;
                println!(
                    "elastic slot {slot} gen {} rank {} world {world} step {committed} at {}",
                    group.generation().number,
                    group.rank(),
                    now_ms()
                );
                if vote == Vote::Commit {
                    continue;
                }
                (false, None)
            }
            Err(e) => (reduced.is_ok(), Some(e)),
        };
        if busy && cause.is_some() {
            busy = false;
            let ms = var("PEER_BUSY_MS", 5000);
            println!("elastic slot {slot} busy for {ms} ms at {}", now_ms());
            std::thread::sleep(Duration::from_millis(ms));
        }
        let status = StepStatus {
            committed,
            finished,
        };
        let Some(change) = group.reform(status, cause.as_ref())? else {
            break;
        };
        match change.action {
            Continue::ApplyFinished => committed += 1,
            Continue::DropFinished | Continue::Keep => {}
        }
        if change.healed {
            committed = change.generation.step;
        }
        println!(
            "elastic slot {slot} reformed gen {} rank {} world {} from {} action {:?} healed {} \
             grace_ms {} at {}",
            change.generation.number,
            change.rank,
            change.generation.members.len(),
            change.generation.step,
            change.action,
            change.healed,
            group.group().loss_grace().as_millis(),
            now_ms()
        );
        assert_eq!(committed, change.generation.step, "slot {slot}");
    }
    if die_after_last {
        std::thread::sleep(Duration::from_millis(var("PEER_DIE_DELAY_MS", 0)));
        println!(
            "elastic slot {slot} kills itself after the last step at {}",
            now_ms()
        );
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(std::process::id() as libc::pid_t, libc::SIGKILL) };
    }
    group.finish()?;
    println!("elastic slot {slot} done at {}", now_ms());
    Ok(())
}
