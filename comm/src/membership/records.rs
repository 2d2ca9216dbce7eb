//! The records of an elastic job's membership and the decisions made from them: who is in
//! each generation of the job, which step it continues from, who left and who joined
//! ([`decide_founding`], [`decide_next`], [`decide_new_round`]). Pure functions over the
//! records; the store calls around them are `membership/group.rs`'s.
//!
//! # Generations
//!
//! An elastic job runs as a sequence of generations, each a process group of its own. Every
//! process has a *slot* (its launch `RANK`, stable across restarts) and an *incarnation* (a
//! random number per process, so that a restarted slot is a new process). Generation 1 is
//! founded from the first processes to register; each later one is decided when the current
//! generation cannot go on (a rank died or froze: the survivors report) or should grow (a
//! process asked to join: every member stops at the same step boundary). A generation decided
//! after a failure admits no joiner unless the job needs one to stay at its minimum: joiners
//! wait for the survivors' next step boundary, so the survivors' first step after a death
//! carries no heal.
//!
//! When no member of the latest generation is left to decide the next one (every one was
//! killed at once: an OOM, a node-wide fault, a bad batch that ends every rank), the processes
//! waiting to join decide it among themselves as at founding ([`decide_new_round`]): a *new
//! round* of the job, which starts from its last checkpoint rather than from a live peer.
//!
//! # Which step a generation continues from
//!
//! Every step ends with a vote, a tiny all-reduce submitted only by a rank whose step's
//! collectives all succeeded (torchft's `should_commit`). A rank applies a step only once its
//! vote completed. An all-reduce completes on one rank only when every rank submitted it, so:
//! if any survivor *committed* step `s` (its vote completed), every rank *finished* step `s`
//! (holds its averaged gradients, or its updated shard); a survivor whose own vote failed has
//! finished but not committed it. [`decide_next`] takes the highest committed step `A` of the
//! survivors: a survivor at `A - 1` that finished `A` applies it now; a survivor at `A` that
//! finished `A + 1` (its collectives completed, but nobody's vote did) drops it. The step in
//! flight is committed on every survivor or dropped on every survivor, never half; the
//! replicas stay identical without a checkpoint, and the samples of a dropped step are
//! trained again by the new world.
//!
//! # Ranks
//!
//! The survivors keep their order (old rank order), the joiners follow in slot order: the new
//! numbering depends only on the membership schedule, so the same schedule gives the same
//! reduction order and the same bits, and rank 0, which heals the joiners, is always a
//! survivor.

use serde::{Deserialize, Serialize};

/// One process of an elastic job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Its slot: the launch `RANK` (node rank × processes per node + local rank), kept when
    /// the launcher restarts it.
    pub slot: usize,
    /// Random per process: tells a restarted process from the one it replaces.
    pub incarnation: u64,
    /// Its host name, for messages.
    pub host: String,
}

/// Why a member is not in the next generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Left {
    /// Its slot.
    pub slot: usize,
    /// Its rank in the generation it left.
    pub rank: usize,
    /// Why, in words (a survivor's error that blamed it, or its silence).
    pub why: String,
}

/// A generation of the job, as its decider wrote it into the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generation {
    /// 1 for the founding generation, then counting up.
    pub number: u64,
    /// The members in rank order: survivors in their old order, then joiners by slot.
    pub members: Vec<Member>,
    /// The last step committed before this generation: where it continues (after it). 0 for
    /// the founding generation and for a new round ([`Generation::new_round`]), which start
    /// from the job's checkpoint when the program has one, else from the start.
    pub step: u64,
    /// Slots that joined with this generation (to be healed from rank 0).
    pub joined: Vec<usize>,
    /// Members of the previous generation that are not in this one.
    pub left: Vec<Left>,
    /// Join requests up to this number have been answered.
    pub joins_seen: u64,
    /// Join requests refused, and why.
    pub refused: Vec<(u64, String)>,
    /// Set when the job cannot go on (fewer than its minimum of ranks): why, naming the ranks
    /// lost. The generation has no group then.
    pub failed: Option<String>,
    /// Why this generation was decided (founding, a failure, a join).
    pub reason: String,
    /// Set when this generation starts a new round of the running job: no member of the
    /// previous generation was left alive to decide it (every one was killed at once), so
    /// the processes waiting to join decided it among themselves ([`decide_new_round`]), as
    /// at founding. Its members are not healed from a peer (nobody holds the job's state):
    /// they resume from the job's last checkpoint, as a job restarted below its minimum does.
    #[serde(default)]
    pub new_round: bool,
}

impl Generation {
    /// The rank of `slot` with `incarnation` in this generation, if it is a member.
    pub fn rank_of(&self, slot: usize, incarnation: u64) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.slot == slot && m.incarnation == incarnation)
    }

    /// The members' slots in rank order, for messages (`[0, 2, 1]`).
    pub fn slots(&self) -> Vec<usize> {
        self.members.iter().map(|m| m.slot).collect()
    }
}

/// A process's request to join, as it registered it (request numbers count from 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinRequest {
    /// Who asks.
    pub member: Member,
}

/// What a survivor of a generation reports when that generation cannot go on or must grow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Which process reports (a report of another incarnation of the slot is ignored).
    pub incarnation: u64,
    /// The last step it applied for good.
    pub committed: u64,
    /// `Some(committed + 1)` when it finished that step's collectives (it holds the step's
    /// result) but its vote did not complete.
    pub finished: Option<u64>,
    /// The slot its error blamed, if any.
    pub blamed: Option<usize>,
    /// Its error, or why it stopped (a planned growth).
    pub why: String,
}

/// What the job's processes must agree on: checked by every process against the first one's
/// before it may register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobTerms {
    /// The launcher's job id (`DDP_JOB_ID`), if any.
    pub job_id: Option<String>,
    /// The least number of ranks the job runs with.
    pub min: usize,
    /// The most.
    pub max: usize,
    /// What the program says its ranks must share (the model's parameter list, ...).
    pub compat: String,
}

impl JobTerms {
    /// The first field in which `ours` differs from the job's `self`, as a sentence naming
    /// both values; `None` when they agree.
    pub fn refuse(&self, ours: &JobTerms) -> Option<String> {
        if self.job_id != ours.job_id {
            return Some(format!(
                "it belongs to job {} but the store serves job {}",
                ours.job_id.as_deref().unwrap_or("(none)"),
                self.job_id.as_deref().unwrap_or("(none)")
            ));
        }
        if (self.min, self.max) != (ours.min, ours.max) {
            return Some(format!(
                "an incompatible world: it was started for {}:{} ranks, the job runs with {}:{}",
                ours.min, ours.max, self.min, self.max
            ));
        }
        if self.compat != ours.compat {
            return Some(
                setting_difference(&self.compat, &ours.compat).unwrap_or_else(|| {
                    format!(
                        "another model: it trains {:?}, the job trains {:?}",
                        ours.compat, self.compat
                    )
                }),
            );
        }
        None
    }
}

/// Where two `compat` texts written as settings differ (one `name = value` per line, see
/// [`ElasticConfig::compat`](crate::ElasticConfig::compat)): the first of the job's settings
/// whose value differs in `ours` or that `ours` lacks, then any that only `ours` has, as a
/// sentence naming the setting and both values. `None` when either text is not such a list
/// (a line without ` = `), or when they agree.
fn setting_difference(job: &str, ours: &str) -> Option<String> {
    let parse = |text: &str| -> Option<Vec<(String, String)>> {
        text.lines()
            .map(|l| {
                l.split_once(" = ")
                    .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            })
            .collect()
    };
    let (job, ours) = (parse(job)?, parse(ours)?);
    let find = |list: &[(String, String)], name: &str| {
        list.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    };
    for (name, value) in &job {
        match find(&ours, name) {
            Some(v) if v == *value => {}
            Some(v) => {
                return Some(format!(
                    "another setting: {name} is {v} in this process, the job runs with {value}"
                ))
            }
            None => {
                return Some(format!(
                    "another setting: this process does not set {name}, the job runs with \
                     {value}"
                ))
            }
        }
    }
    ours.iter()
        .find(|(k, _)| find(&job, k).is_none())
        .map(|(k, v)| format!("another setting: this process sets {k} = {v}, the job has no {k}"))
}

/// The founding generation from the join requests registered so far (`requests`, numbered
/// from 1): the latest request of each slot, in slot order, at most `max` of them (the rest
/// refused). The caller decides when enough have registered.
pub fn decide_founding(requests: &[(u64, JoinRequest)], max: usize) -> Generation {
    let latest = latest_per_slot(requests);
    let mut members = Vec::new();
    let mut refused = Vec::new();
    for (n, request) in latest {
        if members.len() < max {
            members.push(request.member.clone());
        } else {
            refused.push((n, full(max)));
        }
    }
    Generation {
        number: 1,
        joined: members.iter().map(|m| m.slot).collect(),
        members,
        step: 0,
        left: Vec::new(),
        joins_seen: requests.iter().map(|(n, _)| *n).max().unwrap_or(0),
        refused,
        failed: None,
        reason: "founded".into(),
        new_round: false,
    }
}

/// The generation after `prev` when no member of `prev` is alive to decide it (see
/// [`Generation::new_round`]): founded from the join requests registered since `prev`
/// (`requests`, numbered), as [`decide_founding`] does (the latest of each slot, in slot
/// order, at most `max`), every member of `prev` named as left. The caller decides when
/// enough have registered (the founding's last call) and leaves out the requests of
/// processes that are not alive.
pub fn decide_new_round(
    prev: &Generation,
    requests: &[(u64, JoinRequest)],
    max: usize,
) -> Generation {
    let mut next = decide_founding(requests, max);
    next.number = prev.number + 1;
    next.joins_seen = next.joins_seen.max(prev.joins_seen);
    next.left = prev
        .members
        .iter()
        .enumerate()
        .map(|(rank, m)| Left {
            slot: m.slot,
            rank,
            why: format!(
                "lost with every other member of generation {} (dead or silent)",
                prev.number
            ),
        })
        .collect();
    next.reason = format!(
        "a new round: every member of generation {} was lost",
        prev.number
    );
    next.new_round = true;
    next
}

/// The generation after `prev`, from the reports of its survivors (`reports`: slot and report;
/// a report of another incarnation than the member's is ignored) and the join requests
/// registered since `prev` (`requests`, with their numbers). See the module documentation for
/// the step and the order of ranks. Members without a report have left (`blame`: the slots
/// the survivors' errors named, for the message). With fewer than `min` ranks the generation
/// is `failed`, naming the ranks lost.
pub fn decide_next(
    prev: &Generation,
    reports: &[(usize, Report)],
    requests: &[(u64, JoinRequest)],
    (min, max): (usize, usize),
    reason: &str,
) -> Generation {
    let report_of = |m: &Member| {
        reports
            .iter()
            .find(|(slot, r)| *slot == m.slot && r.incarnation == m.incarnation)
            .map(|(_, r)| r)
    };
    let mut survivors = Vec::new();
    let mut left = Vec::new();
    for (rank, m) in prev.members.iter().enumerate() {
        match report_of(m) {
            Some(r) => survivors.push((m.clone(), r.clone())),
            None => {
                let blamers: Vec<String> = reports
                    .iter()
                    .filter(|(_, r)| r.blamed == Some(m.slot))
                    .map(|(_, r)| r.why.clone())
                    .collect();
                let why = match blamers.first() {
                    Some(error) => format!("named by a survivor: {error}"),
                    None => "it did not report (dead, frozen or cut off)".to_string(),
                };
                left.push(Left {
                    slot: m.slot,
                    rank,
                    why,
                });
            }
        }
    }
    let committed = survivors
        .iter()
        .map(|(_, r)| r.committed)
        .max()
        .unwrap_or(prev.step);
    let mut next = Generation {
        number: prev.number + 1,
        members: survivors.iter().map(|(m, _)| m.clone()).collect(),
        step: committed,
        joined: Vec::new(),
        left,
        joins_seen: requests
            .iter()
            .map(|(n, _)| *n)
            .max()
            .unwrap_or(0)
            .max(prev.joins_seen),
        refused: Vec::new(),
        failed: None,
        reason: reason.to_string(),
        new_round: false,
    };
    // Every survivor is at the committed step, or one short of it and holding it (see the
    // module documentation); anything else is a broken promise of the vote.
    if let Some((m, r)) = survivors.iter().find(|(_, r)| {
        !(r.committed == committed
            || (r.committed + 1 == committed && r.finished == Some(committed)))
    }) {
        next.failed = Some(format!(
            "the survivors disagree on the last step: slot {} committed step {} (finished {:?}) \
             while another committed step {committed}",
            m.slot, r.committed, r.finished
        ));
        return next;
    }
    // A re-form after a failure admits nobody while the survivors alone keep the job at its
    // minimum: the join requests stay in the store (`joins_seen` does not pass them), the new
    // generation's look-out sees them at once, and they are admitted at the survivors' next
    // step boundary. So the survivors' first step after a death is never delayed by a heal
    // (ddprun restarts a killed rank in well under a second, often before the re-form is
    // decided), and a joiner is still admitted one step later.
    if !next.left.is_empty() && next.members.len() >= min {
        next.joins_seen = prev.joins_seen;
        return next;
    }
    for (n, request) in latest_per_slot(requests) {
        let slot = request.member.slot;
        if next.members.iter().any(|m| m.slot == slot) {
            next.refused.push((
                n,
                format!("slot {slot} is held by a live member of the job"),
            ));
        } else if next.members.len() >= max {
            next.refused.push((n, full(max)));
        } else {
            next.members.push(request.member.clone());
            next.joined.push(slot);
        }
    }
    if next.members.len() < min {
        let lost: Vec<String> = next
            .left
            .iter()
            .map(|l| format!("rank {} (slot {}: {})", l.rank, l.slot, l.why))
            .collect();
        next.failed = Some(format!(
            "{} rank(s) left, fewer than the job's minimum of {min}; ranks lost: {}",
            next.members.len(),
            if lost.is_empty() {
                "none".to_string()
            } else {
                lost.join("; ")
            }
        ));
    }
    next
}

/// Why a join request is refused when the job is at its maximum.
fn full(max: usize) -> String {
    format!("the job already runs with its maximum of {max} ranks")
}

/// The latest request of each slot (a restarted process registers again), in slot order.
fn latest_per_slot(requests: &[(u64, JoinRequest)]) -> Vec<(u64, &JoinRequest)> {
    let mut latest: Vec<(u64, &JoinRequest)> = Vec::new();
    for (n, request) in requests {
        match latest
            .iter_mut()
            .find(|(_, r)| r.member.slot == request.member.slot)
        {
            Some(entry) if entry.0 < *n => *entry = (*n, request),
            Some(_) => {}
            None => latest.push((*n, request)),
        }
    }
    latest.sort_by_key(|(_, r)| r.member.slot);
    latest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(slot: usize, incarnation: u64) -> Member {
        Member {
            slot,
            incarnation,
            host: "h".into(),
        }
    }

    fn request(slot: usize, incarnation: u64) -> JoinRequest {
        JoinRequest {
            member: member(slot, incarnation),
        }
    }

    fn report(incarnation: u64, committed: u64, finished: Option<u64>) -> Report {
        Report {
            incarnation,
            committed,
            finished,
            blamed: Some(1),
            why: "rank 1 closed".into(),
        }
    }

    fn three() -> Generation {
        decide_founding(
            &[
                (1, request(2, 12)),
                (2, request(0, 10)),
                (3, request(1, 11)),
            ],
            3,
        )
    }

    #[test]
    fn the_founders_are_ranked_by_slot_and_extra_ones_refused() {
        let g = three();
        assert_eq!(g.slots(), [0, 1, 2]);
        assert_eq!((g.number, g.step, g.joins_seen), (1, 0, 3));
        // A slot that registered twice counts once, with its latest process.
        let g = decide_founding(
            &[
                (1, request(0, 1)),
                (2, request(1, 2)),
                (3, request(0, 3)),
                (4, request(5, 4)),
            ],
            2,
        );
        assert_eq!(g.members, [member(0, 3), member(1, 2)]);
        assert_eq!(g.refused.len(), 1);
        assert_eq!(g.refused[0].0, 4);
        assert!(g.refused[0].1.contains("maximum of 2"), "{:?}", g.refused);
    }

    /// A survivor that finished the step whose vote completed elsewhere applies it; the
    /// generation continues from the highest committed step; the dead rank is named.
    #[test]
    fn the_survivors_continue_from_the_highest_committed_step() {
        let g = three();
        let reports = [(0, report(10, 7, None)), (2, report(12, 6, Some(7)))];
        let next = decide_next(&g, &reports, &[], (2, 3), "failure");
        assert_eq!(next.failed, None);
        assert_eq!((next.number, next.step), (2, 7));
        assert_eq!(next.slots(), [0, 2]);
        assert_eq!(next.left.len(), 1);
        assert_eq!((next.left[0].slot, next.left[0].rank), (1, 1));
        assert!(
            next.left[0].why.contains("rank 1 closed"),
            "{:?}",
            next.left
        );
        // Nobody's vote completed: the step in flight is dropped by whoever finished it.
        let reports = [(0, report(10, 6, Some(7))), (2, report(12, 6, None))];
        assert_eq!(decide_next(&g, &reports, &[], (2, 3), "f").step, 6);
    }

    #[test]
    fn a_vote_broken_promise_fails_the_generation() {
        let g = three();
        // Slot 2 is two steps behind: impossible if the vote works; refuse to go on.
        let reports = [(0, report(10, 7, None)), (2, report(12, 5, None))];
        let next = decide_next(&g, &reports, &[], (1, 3), "f");
        assert!(next.failed.unwrap().contains("disagree"));
    }

    #[test]
    fn joiners_follow_the_survivors_and_stay_within_max() {
        let g = three();
        // Slot 1 died and came back (a new incarnation); slot 0's report is of an old process.
        let reports = [
            (0, report(10, 4, None)),
            (2, report(12, 4, None)),
            (1, report(99, 4, None)),
        ];
        let requests = [
            (4, request(1, 21)),
            (5, request(3, 23)),
            (6, request(0, 24)),
        ];
        // After a failure (slot 1's old incarnation did not report) the joiners wait for the
        // next step boundary: the survivors alone are above the minimum.
        let next = decide_next(&g, &reports, &requests, (2, 3), "failure");
        assert_eq!(next.slots(), [0, 2]);
        assert!(next.joined.is_empty() && next.refused.is_empty());
        assert_eq!(next.joins_seen, g.joins_seen, "the requests stay pending");
        // At that boundary (nobody left) they are decided.
        let reports = [(0, report(10, 5, None)), (2, report(12, 5, None))];
        let next = decide_next(&next, &reports, &requests, (2, 3), "join");
        assert_eq!(next.slots(), [0, 2, 1]);
        assert_eq!(next.joined, [1]);
        assert_eq!(next.members[2].incarnation, 21);
        assert_eq!(next.joins_seen, 6);
        let refused: Vec<u64> = next.refused.iter().map(|(n, _)| *n).collect();
        assert_eq!(refused, [6, 5], "{:?}", next.refused);
        assert!(next.refused[0].1.contains("held by a live member"));
        assert!(next.refused[1].1.contains("maximum of 3"));
        assert_eq!(next.rank_of(1, 21), Some(2));
        assert_eq!(next.rank_of(1, 11), None);
    }

    #[test]
    fn below_the_minimum_the_job_stops_naming_the_ranks_lost() {
        let g = three();
        let reports = [(2, report(12, 4, None))];
        let next = decide_next(&g, &reports, &[], (2, 3), "failure");
        let failed = next.failed.expect("below MIN");
        assert!(failed.contains("minimum of 2"), "{failed}");
        assert!(
            failed.contains("rank 0 (slot 0") && failed.contains("rank 1 (slot 1"),
            "{failed}"
        );
        // A joiner that arrives in time keeps the job above its minimum.
        let next = decide_next(&g, &reports, &[(4, request(0, 30))], (2, 3), "failure");
        assert_eq!(next.failed, None);
        assert_eq!(next.slots(), [2, 0]);
    }

    /// A new round after every member of generation 2 was lost: founded from the requests
    /// since (the latest of each slot, by slot, at most MAX), numbered 3, from step 0, every
    /// old member named as left.
    #[test]
    fn a_new_round_is_founded_from_the_requests_since_the_lost_generation() {
        let g = three();
        let reports = [(0, report(10, 4, None)), (2, report(12, 4, None))];
        let lost = decide_next(&g, &reports, &[], (2, 3), "failure");
        assert_eq!((lost.number, lost.slots()), (2, vec![0, 2]));
        let requests = [
            (4, request(2, 32)),
            (5, request(1, 31)),
            (6, request(2, 42)),
            (7, request(0, 30)),
            (8, request(5, 35)),
        ];
        let next = decide_new_round(&lost, &requests, 3);
        assert!(next.new_round && next.failed.is_none());
        assert_eq!((next.number, next.step, next.joins_seen), (3, 0, 8));
        assert_eq!(next.slots(), [0, 1, 2]);
        assert_eq!(next.members[2].incarnation, 42, "the slot's latest process");
        assert_eq!(next.joined, [0, 1, 2]);
        let left: Vec<usize> = next.left.iter().map(|l| l.slot).collect();
        assert_eq!(left, [0, 2]);
        assert!(next.left[0].why.contains("generation 2"), "{:?}", next.left);
        assert_eq!(next.refused.len(), 1);
        assert_eq!(next.refused[0].0, 8);
        assert!(!decide_next(&lost, &reports, &[], (2, 3), "f").new_round);
    }

    #[test]
    fn terms_name_the_field_that_differs() {
        let job = JobTerms {
            job_id: Some("a".into()),
            min: 2,
            max: 3,
            compat: "cnn".into(),
        };
        assert_eq!(job.refuse(&job.clone()), None);
        let other = |f: &dyn Fn(&mut JobTerms)| {
            let mut t = job.clone();
            f(&mut t);
            job.refuse(&t).unwrap()
        };
        assert!(other(&|t| t.job_id = Some("b".into())).contains("job b"));
        assert!(other(&|t| t.max = 4).contains("incompatible world"));
        assert!(other(&|t| t.compat = "mlp".into()).contains("another model"));
    }

    /// Terms whose `compat` is a list of settings name the first setting that differs, with
    /// both values; a setting only one side has is named too.
    #[test]
    fn terms_of_settings_name_the_setting_and_both_values() {
        let job = JobTerms {
            job_id: None,
            min: 2,
            max: 3,
            compat: "model = mlp (4 tensors)\nlr = 0.001 (linear scaling)\nbatch size = 32".into(),
        };
        assert_eq!(job.refuse(&job.clone()), None);
        let with = |compat: &str| {
            let mut t = job.clone();
            t.compat = compat.into();
            job.refuse(&t).unwrap()
        };
        let why = with("model = mlp (4 tensors)\nlr = 0.002 (linear scaling)\nbatch size = 16");
        assert_eq!(
            why,
            "another setting: lr is 0.002 (linear scaling) in this process, the job runs with \
             0.001 (linear scaling)"
        );
        let why = with("model = mlp (4 tensors)\nlr = 0.001 (linear scaling)");
        assert!(
            why.contains("does not set batch size") && why.contains("32"),
            "{why}"
        );
        let why =
            with("model = mlp (4 tensors)\nlr = 0.001 (linear scaling)\nbatch size = 32\nseed = 7");
        assert!(why.contains("seed = 7"), "{why}");
        // A compat that is no list of settings is compared whole, as a model.
        assert!(with("cnn").contains("another model"));
    }
}
