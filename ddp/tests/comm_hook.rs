//! Communication hooks in the DDP pipeline (`DdpConfig::comm_hook`,
//! `DistributedDataParallel::register_comm_hook`), two ranks as threads, each with its own
//! process group over loopback sockets, training a small MLP:
//!
//! - PowerSGD keeps the replicas bit-identical, compresses for real (other parameters than
//!   plain DDP's, fewer bytes per step), and before its start step is plain all-reduce bit for
//!   bit;
//! - a user's hook is called per bucket in order (submits, then waits, then the end of the
//!   step), during backward with overlap, and a hook that all-reduces and divides gives plain
//!   DDP's bits (the wrapper does not divide a hook's average again);
//! - a run resumed from the parameters and the hook's saved state continues bit for bit;
//! - what cannot run is refused by name (a second hook, PowerSGD with bf16 compression, a hook
//!   whose result has the wrong length).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Tensor, TensorData};
use ddp::{
    flatten_params, load_flat_params, BucketDesc, CommHook, CommHookKind, Compression, DdpConfig,
    DdpError, DistributedDataParallel, GradBuffer, PowerSgdConfig, ProcessGroup, ReduceOp,
};
use ddp_comm::{Transport, Work as CommWork};

use crate::common;
use common::{device, run_ranks_over};

const IN: usize = 13;
const HIDDEN: usize = 9;
const OUT: usize = 5;
const PARAMS: usize = IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;

#[derive(Module, Debug)]
struct Net {
    a: Linear,
    mid: Linear,
    b: Linear,
}

impl Net {
    /// The net with fixed values (different per rank; the wrapper broadcasts rank 0's).
    fn new(rank: usize) -> Net {
        let device = device();
        let net = Net {
            a: LinearConfig::new(IN, HIDDEN).init(&device),
            mid: LinearConfig::new(HIDDEN, HIDDEN).init(&device),
            b: LinearConfig::new(HIDDEN, OUT).init(&device),
        };
        let values: Vec<f32> = (0..PARAMS)
            .map(|i| ((i * 37 + 11 + rank) % 101) as f32 / 101.0 - 0.5)
            .collect();
        load_flat_params(net, &values).unwrap()
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        let h = relu(self.a.forward(x));
        let h = relu(self.mid.forward(h));
        (self.b.forward(h) - y).powi_scalar(2).mean()
    }
}

/// Rank `rank`'s batch of step `step`.
fn data(step: usize, rank: usize) -> (Tensor<2>, Tensor<2>) {
    let seed = step * 1000 + rank * 10;
    let x: Vec<f32> = (0..4 * IN)
        .map(|i| (((seed + i) * 7919) % 97) as f32 / 48.0 - 1.0)
        .collect();
    let y: Vec<f32> = (0..4 * OUT)
        .map(|i| (((seed + i) * 104_729) % 89) as f32 / 44.0 - 1.0)
        .collect();
    let device = device();
    (
        Tensor::from_data(TensorData::new(x, [4, IN]), &device),
        Tensor::from_data(TensorData::new(y, [4, OUT]), &device),
    )
}

/// Buckets of about 40 elements: every weight a bucket of its own, several buckets a step.
const SMALL_BUCKETS_MB: f64 = 40.0 * 4.0 / (1024.0 * 1024.0);

fn config(overlap: bool) -> DdpConfig {
    DdpConfig::new()
        .with_bucket_cap_mb(SMALL_BUCKETS_MB)
        .with_first_bucket_mb(SMALL_BUCKETS_MB)
        .with_overlap(overlap)
}

fn powersgd(start: u64) -> CommHookKind {
    CommHookKind::PowerSgd(
        PowerSgdConfig::new()
            .with_matrix_approximation_rank(1)
            .with_start_powersgd_iter(start),
    )
}

/// What one rank's run ends with: its parameters, the bytes each step handed to collectives,
/// and the hook's state.
struct Run {
    params: Vec<f32>,
    bytes: Vec<u64>,
    state: Option<Vec<u8>>,
}

/// Steps `steps` (data of steps `first..`) of SGD on this rank with `config`; `start`: the
/// parameters to start from and the hook state to load, when resuming.
fn train_on(
    pg: Arc<ProcessGroup>,
    config: DdpConfig,
    start: Option<(&[f32], Option<&[u8]>)>,
    first: usize,
    steps: usize,
) -> Run {
    let rank = pg.rank();
    let mut net = Net::new(rank);
    if let Some((params, _)) = start {
        net = load_flat_params(net, params).unwrap();
    }
    let (mut model, mut ddp) = DistributedDataParallel::new(net, pg, config).unwrap();
    if let Some((_, Some(state))) = start {
        ddp.load_comm_hook_state(state, "saved state").unwrap();
    }
    let mut optim = SgdConfig::new().init();
    let mut bytes = Vec::new();
    for step in first..first + steps {
        let hooked = ddp.prepare(&model);
        let (x, y) = data(step, rank);
        let grads = ddp.backward(&model, hooked.loss(x, y)).unwrap();
        bytes.push(ddp.take_stats().bytes);
        model = optim.step(0.05, model, grads);
    }
    Run {
        params: flatten_params(&model).unwrap(),
        bytes,
        state: ddp.comm_hook_state(),
    }
}

/// [`train_on`] on two ranks over TCP, 5 steps from the start.
fn train(config: DdpConfig) -> Vec<Run> {
    run_ranks_over(2, Transport::Tcp, |pg| {
        train_on(pg, config.clone(), None, 0, 5)
    })
}

fn differs(a: &[f32], b: &[f32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

fn assert_bit_identical(a: &[f32], b: &[f32], what: &str) {
    if let Some(i) = differs(a, b) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

#[test]
fn powersgd_keeps_replicas_identical_and_compresses() {
    for overlap in [false, true] {
        let plain = train(config(overlap));
        let ours = train(config(overlap).with_comm_hook(powersgd(1)));
        let what = format!("overlap {overlap}");
        assert_bit_identical(&ours[0].params, &ours[1].params, &what);
        assert_bit_identical(&plain[0].params, &plain[1].params, &what);
        assert!(
            differs(&ours[0].params, &plain[0].params).is_some(),
            "{what}: PowerSGD gave plain DDP's parameters"
        );
        // Step 0 is plain (the start step is 1); the later ones send less.
        assert_eq!(ours[0].bytes[0], plain[0].bytes[0], "{what}");
        for s in 1..5 {
            assert!(
                ours[0].bytes[s] < plain[0].bytes[s],
                "{what}: step {s} sent {} bytes, plain DDP {}",
                ours[0].bytes[s],
                plain[0].bytes[s]
            );
        }
        // The state is each rank's own: the error feedback differs between ranks.
        let (s0, s1) = (ours[0].state.as_ref(), ours[1].state.as_ref());
        assert!(s0.is_some() && s0 != s1, "{what}");
    }
}

#[test]
fn powersgd_before_its_start_step_is_plain_all_reduce() {
    let plain = train(config(false));
    let ours = train(config(false).with_comm_hook(powersgd(1000)));
    for r in 0..2 {
        assert_bit_identical(&ours[r].params, &plain[r].params, &format!("rank {r}"));
        assert_eq!(ours[r].bytes, plain[r].bytes);
    }
}

#[test]
fn a_resumed_powersgd_run_continues_bit_for_bit() {
    let setup = config(false).with_comm_hook(powersgd(1));
    let whole = run_ranks_over(2, Transport::Tcp, |pg| {
        train_on(pg, setup.clone(), None, 0, 6)
    });
    let first = run_ranks_over(2, Transport::Tcp, |pg| {
        train_on(pg, setup.clone(), None, 0, 3)
    });
    let resumed = run_ranks_over(2, Transport::Tcp, |pg| {
        let mine = &first[pg.rank()];
        let state = mine.state.as_deref();
        train_on(pg, setup.clone(), Some((&mine.params, state)), 3, 3)
    });
    for r in 0..2 {
        assert_bit_identical(&resumed[r].params, &whole[r].params, &format!("rank {r}"));
    }
    // Without the hook's state the run does not continue (the state matters).
    let fresh = run_ranks_over(2, Transport::Tcp, |pg| {
        let mine = &first[pg.rank()];
        train_on(pg, setup.clone(), Some((&mine.params, None)), 3, 3)
    });
    assert!(differs(&fresh[0].params, &whole[0].params).is_some());
}

/// What a recording hook saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Bind(usize),
    Submit(usize),
    Wait(usize),
    EndStep,
}

/// A recording hook's calls and their times.
type Log = Arc<Mutex<Vec<(Event, Instant)>>>;

/// A user's hook: all-reduces every part in `f32` and divides by the world size (PyTorch's
/// `allreduce_hook`), recording its calls and when each bucket was submitted.
struct Recording {
    log: Log,
    /// Truncate the first part of the result (a broken hook).
    broken: bool,
}

impl CommHook for Recording {
    type Work = (usize, Vec<CommWork<GradBuffer>>);

    fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError> {
        let now = Instant::now();
        self.log
            .lock()
            .unwrap()
            .push((Event::Bind(buckets.len()), now));
        Ok(())
    }

    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<GradBuffer>,
    ) -> Result<Self::Work, DdpError> {
        let now = Instant::now();
        self.log.lock().unwrap().push((Event::Submit(bucket), now));
        let works = parts
            .into_iter()
            .map(|p| pg.submit_all_reduce_in_place(p, ReduceOp::Sum))
            .collect();
        Ok((bucket, works))
    }

    fn wait(&mut self, pg: &ProcessGroup, work: Self::Work) -> Result<Vec<GradBuffer>, DdpError> {
        let (bucket, works) = work;
        let now = Instant::now();
        self.log.lock().unwrap().push((Event::Wait(bucket), now));
        let world = pg.world_size() as f32;
        let mut parts = Vec::new();
        for w in works {
            let mut part = w.wait()?;
            part.as_mut().iter_mut().for_each(|x| *x /= world);
            parts.push(part);
        }
        if self.broken {
            let short = parts[0].as_ref()[1..].to_vec();
            parts[0] = GradBuffer::from(short);
        }
        Ok(parts)
    }

    fn end_step(&mut self) {
        self.log
            .lock()
            .unwrap()
            .push((Event::EndStep, Instant::now()));
    }
}

#[test]
fn a_registered_hook_gets_every_bucket_in_order_and_its_average_is_used() {
    for overlap in [false, true] {
        let plain = train(config(overlap));
        let logs: Vec<Log> = (0..2).map(|_| Arc::default()).collect();
        let buckets = Mutex::new(0);
        let backward_ends = Mutex::new(Vec::new());
        let ours = run_ranks_over(2, Transport::Tcp, |pg| {
            let log = Arc::clone(&logs[pg.rank()]);
            let rank = pg.rank();
            let (mut model, mut ddp) =
                DistributedDataParallel::new(Net::new(rank), pg, config(overlap)).unwrap();
            *buckets.lock().unwrap() = ddp.bucket_layout().len();
            ddp.register_comm_hook(Recording { log, broken: false })
                .unwrap();
            let mut optim = SgdConfig::new().init();
            for step in 0..5 {
                let hooked = ddp.prepare(&model);
                let (x, y) = data(step, rank);
                let grads = ddp.backward(&model, hooked.loss(x, y)).unwrap();
                if rank == 0 {
                    backward_ends.lock().unwrap().push(ddp.last_backward());
                }
                model = optim.step(0.05, model, grads);
            }
            flatten_params(&model).unwrap()
        });
        let what = format!("overlap {overlap}");
        // The average is the hook's: not divided by the world size again.
        for r in 0..2 {
            assert_bit_identical(&ours[r], &plain[r].params, &what);
        }
        let n = *buckets.lock().unwrap();
        assert!(n >= 3, "{what}: {n} buckets");
        let mut expected = vec![Event::Bind(n)];
        for _ in 0..5 {
            expected.extend((0..n).map(Event::Submit));
            expected.extend((0..n).map(Event::Wait));
            expected.push(Event::EndStep);
        }
        for (r, log) in logs.iter().enumerate() {
            let log = log.lock().unwrap();
            let events: Vec<Event> = log.iter().map(|e| e.0).collect();
            assert_eq!(events, expected, "{what}, rank {r}");
        }
        // With overlap, after the first step (which measures the graph), bucket 0 goes to the
        // hook before backward returns.
        let log = logs[0].lock().unwrap();
        let ends = backward_ends.lock().unwrap();
        let submits: Vec<Instant> = log
            .iter()
            .filter(|e| e.0 == Event::Submit(0))
            .map(|e| e.1)
            .collect();
        for step in 1..5 {
            let (_, end) = ends[step].expect("backward was timed");
            assert_eq!(
                submits[step] < end,
                overlap,
                "{what}: step {step}'s bucket 0 went to the hook during backward"
            );
        }
    }
}

#[test]
fn hooks_that_cannot_run_are_refused_by_name() {
    let results = run_ranks_over(2, Transport::Tcp, |pg| {
        let rank = pg.rank();
        let log = Arc::default();
        // PowerSGD over bf16 compression.
        let both = config(false)
            .with_compression(Compression::Bf16)
            .with_comm_hook(powersgd(1));
        let err = DistributedDataParallel::new(Net::new(rank), Arc::clone(&pg), both)
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("compression Bf16"), "{err}");
        // A second hook.
        let with_powersgd = config(false).with_comm_hook(powersgd(1));
        let (_, mut ddp) =
            DistributedDataParallel::new(Net::new(rank), Arc::clone(&pg), with_powersgd).unwrap();
        let err = ddp
            .register_comm_hook(Recording {
                log: Arc::clone(&log),
                broken: false,
            })
            .unwrap_err()
            .to_string();
        assert!(err.contains("installed already"), "{err}");
        // A hook state where there is no hook.
        let (_, mut ddp) =
            DistributedDataParallel::new(Net::new(rank), Arc::clone(&pg), config(false)).unwrap();
        let err = ddp.load_comm_hook_state(b"x", "ck.bin").unwrap_err();
        assert!(err.to_string().contains("ck.bin"), "{err}");
        // A hook that returns a part of the wrong length: an error naming the bucket, on
        // every rank, no panic.
        let (model, mut ddp) =
            DistributedDataParallel::new(Net::new(rank), Arc::clone(&pg), config(false)).unwrap();
        ddp.register_comm_hook(Recording { log, broken: true })
            .unwrap();
        let (x, y) = data(0, rank);
        let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
        ddp.sync(&model, grads).unwrap_err().to_string()
    });
    for err in results {
        assert!(err.contains("part 0 of bucket 0 came back with"), "{err}");
    }
}

/// Where [`Picky`] fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailIn {
    /// Never (the reference run).
    Nowhere,
    /// In `submit`, after submitting its all-reduces (as the trait asks: the same collectives
    /// on every rank).
    Submit,
    /// In `wait`, after its all-reduces completed (a check of the result).
    Wait,
}

/// A user's hook that all-reduces and averages, and fails once, on rank 1 only, in step 2's
/// bucket 0 (`fail_in` says where), as a hook that rejects a value would.
struct Picky {
    rank: usize,
    fail_in: FailIn,
    /// Steps ended (`end_step`).
    steps: u64,
    /// Whether it has failed already (the step run again succeeds).
    failed: bool,
}

impl Picky {
    /// Whether this call fails.
    fn fails(&mut self, here: FailIn, bucket: usize) -> bool {
        let fail = self.fail_in == here
            && self.rank == 1
            && self.steps == 2
            && bucket == 0
            && !self.failed;
        self.failed |= fail;
        fail
    }
}

impl CommHook for Picky {
    type Work = (usize, Vec<CommWork<GradBuffer>>);

    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<GradBuffer>,
    ) -> Result<Self::Work, DdpError> {
        let works = parts
            .into_iter()
            .map(|p| pg.submit_all_reduce_in_place(p, ReduceOp::Sum))
            .collect::<Vec<_>>();
        if self.fails(FailIn::Submit, bucket) {
            // Its collectives are out, as on the other rank; their results are not wanted.
            for w in works {
                let _ = w.wait();
            }
            return Err(DdpError::Config(
                "picky hook: submit refused bucket 0".into(),
            ));
        }
        Ok((bucket, works))
    }

    fn wait(&mut self, pg: &ProcessGroup, work: Self::Work) -> Result<Vec<GradBuffer>, DdpError> {
        let (bucket, works) = work;
        let world = pg.world_size() as f32;
        let mut parts = Vec::new();
        for w in works {
            let mut part = w.wait()?;
            part.as_mut().iter_mut().for_each(|x| *x /= world);
            parts.push(part);
        }
        if self.fails(FailIn::Wait, bucket) {
            return Err(DdpError::Config(
                "picky hook: wait rejected bucket 0".into(),
            ));
        }
        Ok(parts)
    }

    fn end_step(&mut self) {
        self.steps += 1;
    }
}

/// Per rank: the final parameters and every attempt's outcome (`Ok`, or the error's text).
type Attempts = (Vec<f32>, Vec<Result<(), String>>);

/// 5 steps of SGD on two ranks over TCP with [`Picky`] failing in `fail_in`; a step that
/// fails is run again (once).
fn train_picky(fail_in: FailIn, overlap: bool) -> Vec<Attempts> {
    run_ranks_over(2, Transport::Tcp, |pg| {
        let rank = pg.rank();
        let (mut model, mut ddp) =
            DistributedDataParallel::new(Net::new(rank), pg, config(overlap)).unwrap();
        let hook = Picky {
            rank,
            fail_in,
            steps: 0,
            failed: false,
        };
        ddp.register_comm_hook(hook).unwrap();
        let mut optim = SgdConfig::new().init();
        let mut attempts = Vec::new();
        for step in 0..5 {
            for _attempt in 0..2 {
                let hooked = ddp.prepare(&model);
                let (x, y) = data(step, rank);
                match ddp.backward(&model, hooked.loss(x, y)) {
                    Ok(grads) => {
                        model = optim.step(0.05, model, grads);
                        attempts.push(Ok(()));
                        break;
                    }
                    Err(e) => attempts.push(Err(e.to_string())),
                }
            }
        }
        (flatten_params(&model).unwrap(), attempts)
    })
}

/// A hook's error on rank 1 only (in `wait`, after its collectives; in `submit`, after
/// submitting them) fails the step on both ranks: rank 1 with its hook's error, rank 0 naming
/// rank 1; no replica applies it, the collectives stay in step (the step run again and the
/// later ones succeed), and the run ends with the bits of a run whose hook never failed.
#[test]
fn a_hook_error_on_one_rank_fails_the_step_on_every_rank() {
    // Every case is checked, and every failure listed (not only the first).
    let mut failures = Vec::new();
    for overlap in [false, true] {
        let reference = train_picky(FailIn::Nowhere, overlap);
        for fail_in in [FailIn::Wait, FailIn::Submit] {
            let what = format!("overlap {overlap}, failing in {fail_in:?}");
            let runs = train_picky(fail_in, overlap);
            for (r, (params, attempts)) in runs.iter().enumerate() {
                assert!(reference[r].1.iter().all(Result::is_ok), "{what}");
                let failed: Vec<usize> = (0..attempts.len())
                    .filter(|&i| attempts[i].is_err())
                    .collect();
                if failed != [2] || attempts.len() != 6 {
                    failures.push(format!(
                        "{what}, rank {r}: attempts {attempts:?} (want step 2 failed once)"
                    ));
                }
                if let Some(i) = differs(params, &reference[r].0) {
                    failures.push(format!(
                        "{what}, rank {r}: element {i} differs from the run that never failed"
                    ));
                }
            }
            match runs[1].1.get(2) {
                Some(Err(own)) if own.contains("picky hook") => {}
                other => failures.push(format!("{what}: rank 1's step 2: {other:?}")),
            }
            match runs[0].1.get(2) {
                Some(Err(peer)) if peer.contains("rank 1 failed") => {}
                other => failures.push(format!("{what}: rank 0's step 2: {other:?}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A PowerSGD run (compressing from step 1, error feedback and warm start on) whose step 2
/// fails on every rank (rank 1 syncs a model the wrapper does not know: a local failure) and
/// is run again ends with the parameters and the hook state, bit for bit, of a run where it
/// never failed: the failed step left the hook's state (error feedback, Q, step count) as it
/// was.
#[test]
fn a_failed_step_leaves_the_powersgd_state_as_it_was() {
    let run = |fail: bool| {
        run_ranks_over(2, Transport::Tcp, |pg| {
            let rank = pg.rank();
            let setup = config(false).with_comm_hook(powersgd(1));
            let (mut model, mut ddp) =
                DistributedDataParallel::new(Net::new(rank), pg, setup).unwrap();
            let mut optim = SgdConfig::new().init();
            let mut errors = Vec::new();
            for step in 0..5 {
                if fail && step == 2 {
                    let (x, y) = data(step, rank);
                    let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                    // Rank 1 hands over a model with other parameter ids.
                    let stranger = Net::new(rank);
                    let shown = if rank == 1 { &stranger } else { &model };
                    errors.push(ddp.sync(shown, grads).unwrap_err().to_string());
                }
                let (x, y) = data(step, rank);
                let grads = GradientsParams::from_grads(model.loss(x, y).backward(), &model);
                let grads = ddp.sync(&model, grads).unwrap();
                model = optim.step(0.05, model, grads);
            }
            (
                flatten_params(&model).unwrap(),
                ddp.comm_hook_state().expect("PowerSGD keeps state"),
                errors,
            )
        })
    };
    let reference = run(false);
    let failed = run(true);
    for r in 0..2 {
        assert_eq!(failed[r].2.len(), 1, "rank {r}: the step failed");
        assert_bit_identical(&failed[r].0, &reference[r].0, &format!("rank {r}"));
        assert!(
            failed[r].1 == reference[r].1,
            "rank {r}: the hook's state differs from the run without the failure"
        );
    }
    assert!(
        failed[0].2[0].contains("rank 1 failed"),
        "{}",
        failed[0].2[0]
    );
    assert!(failed[1].2[0].contains("ParamId"), "{}", failed[1].2[0]);
}
