//! PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank
//! Gradient Compression for Distributed Optimization", NeurIPS 2019), run the way PyTorch's
//! `powerSGD_hook` runs it (`torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`),
//! one bucket at a time.
//!
//! Each gradient of a bucket is viewed as a matrix `M` of `shape[0]` rows (a Linear weight, a
//! convolution's weight with its kernel folded into the columns). Instead of all-reducing `M`
//! (`n·m` numbers) the ranks all-reduce `P = M Q` (`n·r`) and `Q = Mᵀ P` (`m·r`), one step
//! of power iteration towards `M`'s `r` leading singular directions, and every rank rebuilds
//! the average as `P Qᵀ`. What compression loses on a rank is kept (error feedback) and added
//! to its next gradient, so nothing is lost for good, only delayed; Q is kept from one step to
//! the next (warm start), so the power iteration continues across steps. See
//! [`PowerSgd::submit`] and [`PowerSgd::wait`] for the two halves of a bucket's exchange.
//!
//! PyTorch's choices, kept here: the rank `r`; plain all-reduce for the first
//! `start_powersgd_iter` steps; a gradient is compressed only when `(n + m)·r·min_compression_rate
//! < n·m`, so vectors (biases) and small matrices are all-reduced plain, batched in one buffer
//! per bucket; error feedback and warm start on by default; Q drawn from normal numbers seeded
//! from the hook's own generator, alike on every rank; P and Q of a bucket each travel as one
//! all-reduce. Where this differs: orthogonalisation is always Gram-Schmidt in a fixed order
//! (PyTorch uses LAPACK's QR above rank 2; the two differ only in column signs, which cancel in
//! `P Qᵀ`), the normal numbers come from SplitMix64 and Box-Muller instead of PyTorch's
//! generator (`powersgd_math.rs`), and `start_powersgd_iter` may be 0 or 1 (PyTorch refuses
//! those because its buckets are rebuilt after the first step; ours are fixed).
//!
//! The hook's state (the step count, the generator, each bucket's error feedback and Q) is
//! this rank's own: the errors differ between ranks. It is saved and restored as bytes
//! ([`PowerSgd::state_bytes`], `powersgd_state.rs`), so a resumed run is bit-identical to an
//! uninterrupted one.

use ddp_comm::{ProcessGroup, ReduceOp, Work};

use crate::hooks::comm_hook::{BucketDesc, CommHook, GradBuffer};
use crate::hooks::powersgd_config::PowerSgdConfig;
use crate::hooks::powersgd_math::{
    back_project, expand, fill_normal, orthogonalize, project, splitmix64,
};
use crate::hooks::powersgd_state::{decode, encode, Saved, State};
use crate::DdpError;

/// A gradient PowerSGD compresses: a `rows × cols` matrix and the rank it gets.
#[derive(Debug, Clone)]
struct Matrix {
    part: usize,
    offset: usize,
    rows: usize,
    cols: usize,
    rank: usize,
    /// Offsets of its P (`rows × rank`) and Q (`cols × rank`) in the bucket's P and Q buffers.
    p_off: usize,
    q_off: usize,
}

/// How a bucket is exchanged once compression runs (PyTorch's step I, decided by shape only).
#[derive(Debug, Clone)]
struct Plan {
    part_lens: Vec<usize>,
    /// Offset of each part in the bucket's flat error buffer (the parts one after another).
    part_starts: Vec<usize>,
    len: usize,
    /// Gradients all-reduced plain, `(part, offset, numel)`, in packing order, packed one
    /// after another into one buffer of `plain_len`.
    plain: Vec<(usize, usize, usize)>,
    plain_len: usize,
    /// Compressed gradients, grouped by matrix shape (in order of first appearance, then
    /// packing order), which is the order of their P and Q in the buffers (PyTorch's).
    matrices: Vec<Matrix>,
    p_len: usize,
    q_len: usize,
}

/// Decides, by shape alone, which gradients of `bucket` are compressed and where their P and Q
/// go: PyTorch's `_should_compress`. A gradient of shape `[n, ...]` is the matrix `n × m`, `m`
/// the product of the other dimensions (a vector is `n × 1`), with rank `r' = min(n, m, r)`; it
/// is compressed when `(n + m)·r'·min_compression_rate < n·m`, that is when its two factors
/// are smaller than it by the required rate. A vector never is (`(n + 1)·1·2 > n`), nor are
/// small matrices, whose saving would not pay for the extra collectives. Compressed ones are
/// grouped by shape as PyTorch orders them, so that P and Q are laid out as in PyTorch.
fn plan(bucket: &BucketDesc, config: &PowerSgdConfig) -> Plan {
    let mut part_starts = Vec::with_capacity(bucket.part_lens.len());
    let mut len = 0;
    for &l in &bucket.part_lens {
        part_starts.push(len);
        len += l;
    }
    let mut plain = Vec::new();
    let mut plain_len = 0;
    let mut shapes: Vec<(usize, usize)> = Vec::new();
    let mut groups: Vec<Vec<Matrix>> = Vec::new();
    for g in &bucket.grads {
        let numel: usize = g.shape.iter().product();
        let rows = g.shape.first().copied().unwrap_or(1);
        let cols = numel.checked_div(rows).unwrap_or(0);
        let rank = rows.min(cols).min(config.matrix_approximation_rank);
        let compressed = ((rows + cols) * rank) as f64 * config.min_compression_rate;
        if numel > 0 && compressed < numel as f64 {
            let m = Matrix {
                part: g.part,
                offset: g.offset,
                rows,
                cols,
                rank,
                p_off: 0,
                q_off: 0,
            };
            match shapes.iter().position(|&s| s == (rows, cols)) {
                Some(i) => groups[i].push(m),
                None => {
                    shapes.push((rows, cols));
                    groups.push(vec![m]);
                }
            }
        } else {
            plain.push((g.part, g.offset, numel));
            plain_len += numel;
        }
    }
    let (mut p_len, mut q_len) = (0, 0);
    let mut matrices: Vec<Matrix> = groups.into_iter().flatten().collect();
    for m in &mut matrices {
        m.p_off = p_len;
        m.q_off = q_len;
        p_len += m.rows * m.rank;
        q_len += m.cols * m.rank;
    }
    Plan {
        part_lens: bucket.part_lens.clone(),
        part_starts,
        len,
        plain,
        plain_len,
        matrices,
        p_len,
        q_len,
    }
}

/// The PowerSGD communication hook of one rank: its settings, the plan of each bucket, and its
/// state across steps (see the module documentation).
#[derive(Debug)]
pub struct PowerSgd {
    config: PowerSgdConfig,
    plans: Vec<Plan>,
    state: State,
    /// The state from before the step in progress (taken at its first `submit`, its buffers
    /// reused from step to step), for [`discard_step`](Self::discard_step); `None` between
    /// steps.
    before_step: Option<State>,
    /// The last step's copy, kept for its allocations.
    spare: Option<State>,
}

/// One bucket's exchange in flight, from [`PowerSgd::submit`] to [`PowerSgd::wait`].
#[derive(Debug)]
pub struct PowerSgdFlight<B> {
    bucket: usize,
    stage: Stage<B>,
    bytes: u64,
}

#[derive(Debug)]
enum Stage<B> {
    /// Before compression starts: each part all-reduced in place.
    Plain(Vec<Work<B>>),
    /// Compressing: the parts (holding this rank's gradients plus its error), the plain
    /// gradients' all-reduce and P's.
    Compressed {
        parts: Vec<B>,
        plain: Option<Work<Vec<f32>>>,
        p: Option<Work<Vec<f32>>>,
    },
}

impl<B> PowerSgdFlight<B> {
    /// The bucket.
    pub fn bucket(&self) -> usize {
        self.bucket
    }

    /// Bytes this exchange hands to collectives, the all-reduce of Q that [`PowerSgd::wait`]
    /// submits included.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl PowerSgd {
    /// The hook with `config` (refused when invalid); it learns its buckets from
    /// [`bind`](Self::bind), which the wrapper calls when it installs it.
    pub fn new(config: PowerSgdConfig) -> Result<PowerSgd, DdpError> {
        config.validate()?;
        let state = State {
            iter: 0,
            rng: config.random_seed,
            errors: Vec::new(),
            qs: Vec::new(),
        };
        Ok(PowerSgd {
            config,
            plans: Vec::new(),
            state,
            before_step: None,
            spare: None,
        })
    }

    /// Plans buckets `buckets` (in communication order) and starts afresh; refuses gradients
    /// that do not lie inside their part.
    pub fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError> {
        for (b, bucket) in buckets.iter().enumerate() {
            for (i, g) in bucket.grads.iter().enumerate() {
                let numel: usize = g.shape.iter().product();
                let fits = bucket
                    .part_lens
                    .get(g.part)
                    .is_some_and(|&len| g.offset.checked_add(numel).is_some_and(|end| end <= len));
                if !fits {
                    return Err(DdpError::Config(format!(
                        "PowerSGD: gradient {i} of bucket {b} (part {}, offset {}, shape {:?}) \
                         does not lie inside the bucket's parts of lengths {:?}",
                        g.part, g.offset, g.shape, bucket.part_lens
                    )));
                }
            }
        }
        self.plans = buckets.iter().map(|b| plan(b, &self.config)).collect();
        let n = buckets.len();
        self.state = State {
            iter: 0,
            rng: self.config.random_seed,
            errors: vec![None; n],
            qs: vec![None; n],
        };
        self.before_step = None;
        Ok(())
    }

    /// Its settings.
    pub fn config(&self) -> &PowerSgdConfig {
        &self.config
    }

    /// Steps completed ([`end_step`](Self::end_step) calls).
    pub fn iter(&self) -> u64 {
        self.state.iter
    }

    /// Whether this step's buckets are compressed (the step count has reached
    /// `start_powersgd_iter`).
    pub fn compressing(&self) -> bool {
        self.state.iter >= self.config.start_powersgd_iter
    }

    /// Elements a step hands to collectives once compression runs, and the gradient elements
    /// it carries: PyTorch's compression statistics, over every bucket.
    pub fn compression_stats(&self) -> (usize, usize) {
        let sent = self
            .plans
            .iter()
            .map(|p| p.plain_len + p.p_len + p.q_len)
            .sum();
        (sent, self.plans.iter().map(|p| p.len).sum())
    }

    /// Marks the end of a step, after every bucket's exchange: PyTorch's `maybe_increase_iter`
    /// on the last bucket. Every bucket of a step sees the same step count.
    pub fn end_step(&mut self) {
        self.state.iter += 1;
        self.spare = self.before_step.take().or(self.spare.take());
    }

    /// Drops the step in progress (it failed on some rank, and no rank applies it): the
    /// state (error feedback, Q, generator, step count) goes back to what it was before the
    /// step's first [`submit`](Self::submit), so that running the step again gives the bits of
    /// a run where it never failed.
    pub fn discard_step(&mut self) {
        if let Some(before) = self.before_step.take() {
            self.spare = Some(std::mem::replace(&mut self.state, before));
        }
    }

    /// Remembers the state before the step's first submit (see
    /// [`discard_step`](Self::discard_step)): a copy into the last step's buffers.
    fn keep_state_before_step(&mut self) {
        if self.before_step.is_none() {
            let mut copy = self.spare.take().unwrap_or_else(|| self.state.clone());
            copy.clone_from(&self.state);
            self.before_step = Some(copy);
        }
    }

    /// Starts the exchange of bucket `bucket`, whose buffers `parts` hold this rank's summed
    /// gradients, on `pg`. Before `start_powersgd_iter` steps, each part is all-reduced as it
    /// is. After, PyTorch's steps I to III.2:
    ///
    /// 1. Error feedback: the error this rank kept from the bucket's last exchange is added to
    ///    the gradients (on the first compressed step it is zero), and the sum is remembered
    ///    (in the error buffer itself), to compute the new error once the result is in.
    /// 2. The plain gradients are packed into one buffer, whose all-reduce is submitted.
    /// 3. Q: on the bucket's first compressed step (and every step without warm start) it is
    ///    drawn from normal numbers, seeded by the hook's generator, one draw per bucket and
    ///    step, alike on every rank; otherwise last step's Q is reused. Either way each
    ///    matrix's Q is orthogonalised (an orthonormal basis of the directions to project on).
    /// 4. `P = M Q` for each compressed gradient, all into one buffer, whose all-reduce (a sum:
    ///    P is orthogonalised next, so its scale does not matter) is submitted.
    ///
    /// The collectives of a bucket go out in this order on every rank; [`wait`](Self::wait)
    /// submits the last one (Q's), so a caller submits every bucket before waiting for any,
    /// or submits and waits bucket by bucket, the same way on every rank.
    pub fn submit<B>(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        mut parts: Vec<B>,
    ) -> Result<PowerSgdFlight<B>, DdpError>
    where
        B: AsRef<[f32]> + AsMut<[f32]> + Send + 'static,
    {
        let plan = self.plans.get(bucket).ok_or_else(|| {
            DdpError::Config(format!(
                "PowerSGD: bucket {bucket} of {} submitted",
                self.plans.len()
            ))
        })?;
        let lens: Vec<usize> = parts.iter().map(|p| p.as_ref().len()).collect();
        if lens != plan.part_lens {
            return Err(DdpError::Config(format!(
                "PowerSGD: bucket {bucket}'s buffers have lengths {lens:?}, its layout {:?}",
                plan.part_lens
            )));
        }
        self.keep_state_before_step();
        let plan = &self.plans[bucket];
        if !self.compressing() {
            let bytes = 4 * plan.len as u64;
            let works = parts
                .into_iter()
                .map(|p| pg.submit_all_reduce_in_place(p, ReduceOp::Sum))
                .collect();
            return Ok(PowerSgdFlight {
                bucket,
                stage: Stage::Plain(works),
                bytes,
            });
        }
        let config = &self.config;
        // 1. Error feedback.
        if config.use_error_feedback {
            let error = self.state.errors[bucket].get_or_insert_with(|| vec![0.0; plan.len]);
            for (part, &start) in parts.iter_mut().zip(&plan.part_starts) {
                let part = part.as_mut();
                let memo = &mut error[start..start + part.len()];
                for (x, e) in part.iter_mut().zip(memo.iter_mut()) {
                    *x += *e;
                    *e = *x;
                }
            }
        }
        // 2. The plain gradients, packed.
        let plain = (plan.plain_len > 0).then(|| {
            let mut buf = Vec::with_capacity(plan.plain_len);
            for &(part, offset, numel) in &plan.plain {
                buf.extend_from_slice(&parts[part].as_ref()[offset..offset + numel]);
            }
            pg.submit_all_reduce(buf, ReduceOp::Sum)
        });
        // 3. Q, drawn or reused, orthogonalised.
        let q = &mut self.state.qs[bucket];
        if !config.warm_start || q.is_none() {
            let mut fresh = vec![0.0; plan.q_len];
            fill_normal(splitmix64(&mut self.state.rng), &mut fresh);
            *q = Some(fresh);
        }
        let q = q.as_mut().expect("Q was just drawn");
        for m in &plan.matrices {
            let qm = &mut q[m.q_off..m.q_off + m.cols * m.rank];
            orthogonalize(qm, m.cols, m.rank, config.orthogonalization_epsilon);
        }
        // 4. P = M Q.
        let p = (plan.p_len > 0).then(|| {
            let mut p = vec![0.0; plan.p_len];
            for m in &plan.matrices {
                let mat = &parts[m.part].as_ref()[m.offset..m.offset + m.rows * m.cols];
                let qm = &q[m.q_off..m.q_off + m.cols * m.rank];
                let pm = &mut p[m.p_off..m.p_off + m.rows * m.rank];
                project(mat, m.rows, m.cols, qm, m.rank, pm);
            }
            pg.submit_all_reduce(p, ReduceOp::Sum)
        });
        Ok(PowerSgdFlight {
            bucket,
            stage: Stage::Compressed { parts, plain, p },
            bytes: 4 * (plan.plain_len + plan.p_len + plan.q_len) as u64,
        })
    }

    /// Completes a bucket's exchange and returns its buffers holding the average over ranks.
    /// Before compression starts: each part's sum divided by the world size. After, PyTorch's
    /// steps II.2 and III.3 to III.7:
    ///
    /// 1. The plain gradients' sum, divided by the world size, goes back to their places.
    /// 2. P's sum is orthogonalised per matrix: the same bits on every rank, an orthonormal
    ///    basis of the ranks' combined leading directions.
    /// 3. `Q = Mᵀ P` per matrix (this rank's gradient seen through the shared basis), all
    ///    into one buffer; its all-reduce is submitted and waited for, and the sum divided by
    ///    the world size is the average gradient's `Q`, kept for the next step (warm start).
    /// 4. Each compressed gradient is overwritten by `P Qᵀ`, the rank-`r` approximation of the
    ///    average, identical on every rank.
    /// 5. Error feedback: the new error is what this rank put in (step 1 of `submit`) minus
    ///    what came out, for every element of the bucket (the plain gradients too, as in
    ///    PyTorch: there it is this rank's deviation from the average, which sums to zero over
    ///    the ranks and so leaves the next average unchanged).
    pub fn wait<B>(
        &mut self,
        pg: &ProcessGroup,
        flight: PowerSgdFlight<B>,
    ) -> Result<Vec<B>, DdpError>
    where
        B: AsRef<[f32]> + AsMut<[f32]> + Send + 'static,
    {
        let world = pg.world_size() as f32;
        let bucket = flight.bucket;
        let (mut parts, plain, p) = match flight.stage {
            Stage::Plain(works) => {
                let mut parts = Vec::with_capacity(works.len());
                for w in works {
                    let mut part = w.wait()?;
                    part.as_mut().iter_mut().for_each(|x| *x /= world);
                    parts.push(part);
                }
                return Ok(parts);
            }
            Stage::Compressed { parts, plain, p } => (parts, plain, p),
        };
        let plan = &self.plans[bucket];
        let config = &self.config;
        // 1. The plain gradients.
        if let Some(w) = plain {
            let sum = w.wait()?;
            let mut at = 0;
            for &(part, offset, numel) in &plan.plain {
                let dst = &mut parts[part].as_mut()[offset..offset + numel];
                for (d, s) in dst.iter_mut().zip(&sum[at..at + numel]) {
                    *d = s / world;
                }
                at += numel;
            }
        }
        // 2. to 4. P orthogonalised, Q = Mᵀ P all-reduced, M = P Qᵀ.
        if let Some(w) = p {
            let mut p = w.wait()?;
            let Some(mut q) = self.state.qs[bucket].take() else {
                return Err(DdpError::Config(format!(
                    "PowerSGD: bucket {bucket} was submitted twice before its wait"
                )));
            };
            for m in &plan.matrices {
                let pm = &mut p[m.p_off..m.p_off + m.rows * m.rank];
                orthogonalize(pm, m.rows, m.rank, config.orthogonalization_epsilon);
                let mat = &parts[m.part].as_ref()[m.offset..m.offset + m.rows * m.cols];
                let qm = &mut q[m.q_off..m.q_off + m.cols * m.rank];
                back_project(mat, m.rows, m.cols, pm, m.rank, qm);
            }
            let mut q = pg.submit_all_reduce(q, ReduceOp::Sum).wait()?;
            q.iter_mut().for_each(|x| *x /= world);
            for m in &plan.matrices {
                let pm = &p[m.p_off..m.p_off + m.rows * m.rank];
                let qm = &q[m.q_off..m.q_off + m.cols * m.rank];
                let mat = &mut parts[m.part].as_mut()[m.offset..m.offset + m.rows * m.cols];
                expand(pm, m.rows, qm, m.cols, m.rank, mat);
            }
            if config.warm_start {
                self.state.qs[bucket] = Some(q);
            }
        } else if !config.warm_start {
            self.state.qs[bucket] = None;
        }
        // 5. The new error.
        if let Some(error) = self.state.errors[bucket].as_mut() {
            for (part, &start) in parts.iter().zip(&plan.part_starts) {
                let part = part.as_ref();
                for (e, x) in error[start..start + part.len()].iter_mut().zip(part) {
                    *e -= *x;
                }
            }
        }
        Ok(parts)
    }

    /// This rank's state (step count, generator, error feedback and Q of every bucket) with
    /// the settings, as bytes for a checkpoint (`powersgd_state.rs` has the format).
    pub fn state_bytes(&self) -> Vec<u8> {
        encode(&self.config, &self.state)
    }

    /// Restores a state [`state_bytes`](Self::state_bytes) wrote (`name` says where the bytes
    /// came from, for the error). Refused, naming the field or bucket, when the bytes are not
    /// such a state, were written with other settings, or do not fit this hook's buckets.
    pub fn load_state_bytes(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        let Saved { config, state } = decode(bytes, name)?;
        if config != self.config {
            let ours = serde_json::to_value(&self.config).expect("settings serialise");
            let theirs = serde_json::to_value(&config).expect("settings serialise");
            let field = ours
                .as_object()
                .and_then(|o| o.iter().find(|(k, v)| theirs.get(k.as_str()) != Some(v)))
                .map_or("?".to_string(), |(k, v)| {
                    format!("{k} = {} (this run: {v})", theirs[k.as_str()])
                });
            return Err(DdpError::Checkpoint(format!(
                "{name}: the PowerSGD state was written with other settings: {field}"
            )));
        }
        if state.errors.len() != self.plans.len() {
            return Err(DdpError::Checkpoint(format!(
                "{name}: the PowerSGD state has {} buckets, this model {}",
                state.errors.len(),
                self.plans.len()
            )));
        }
        for (b, plan) in self.plans.iter().enumerate() {
            let check = |what: &str, got: &Option<Vec<f32>>, want: usize| match got {
                Some(v) if v.len() != want => Err(DdpError::Checkpoint(format!(
                    "{name}: bucket {b}'s PowerSGD {what} has {} elements, this model's {want}",
                    v.len()
                ))),
                _ => Ok(()),
            };
            check("error feedback", &state.errors[b], plan.len)?;
            check("Q", &state.qs[b], plan.q_len)?;
        }
        self.state = state;
        self.before_step = None;
        Ok(())
    }
}

/// PowerSGD as the wrapper's communication hook (`DdpConfig::comm_hook`).
impl CommHook for PowerSgd {
    type Work = PowerSgdFlight<GradBuffer>;

    fn bind(&mut self, buckets: &[BucketDesc]) -> Result<(), DdpError> {
        PowerSgd::bind(self, buckets)
    }

    fn submit(
        &mut self,
        pg: &ProcessGroup,
        bucket: usize,
        parts: Vec<GradBuffer>,
    ) -> Result<Self::Work, DdpError> {
        PowerSgd::submit(self, pg, bucket, parts)
    }

    fn wait(&mut self, pg: &ProcessGroup, work: Self::Work) -> Result<Vec<GradBuffer>, DdpError> {
        PowerSgd::wait(self, pg, work)
    }

    fn bytes(&self, work: &Self::Work) -> u64 {
        work.bytes()
    }

    fn end_step(&mut self) {
        PowerSgd::end_step(self)
    }

    fn discard_step(&mut self) {
        PowerSgd::discard_step(self)
    }

    fn state(&self) -> Option<Vec<u8>> {
        Some(self.state_bytes())
    }

    fn load_state(&mut self, bytes: &[u8], name: &str) -> Result<(), DdpError> {
        self.load_state_bytes(bytes, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hooks::comm_hook::GradSlot;

    fn bucket(shapes: &[&[usize]]) -> BucketDesc {
        let mut grads = Vec::new();
        let mut at = 0;
        for s in shapes {
            grads.push(GradSlot {
                part: 0,
                offset: at,
                shape: s.to_vec(),
            });
            at += s.iter().product::<usize>();
        }
        BucketDesc {
            part_lens: vec![at],
            grads,
        }
    }

    #[test]
    fn plan_compresses_what_pytorch_compresses_grouped_by_shape() {
        // Rank 4, rate 2: [24, 20] compresses ((24 + 20)·4·2 = 352 < 480); a bias, a [5, 6]
        // matrix (88 ≥ 30) and a [8, 4, 3, 3] convolution (8 × 36: 352 ≥ 288) do not; a
        // [16, 4, 3, 3] one (16 × 36: 416 < 576) does.
        let b = bucket(&[
            &[24, 20],
            &[24],
            &[16, 4, 3, 3],
            &[5, 6],
            &[8, 4, 3, 3],
            &[24, 20],
        ]);
        let config = PowerSgdConfig::new().with_matrix_approximation_rank(4);
        let p = plan(&b, &config);
        let shapes: Vec<_> = p
            .matrices
            .iter()
            .map(|m| (m.rows, m.cols, m.offset))
            .collect();
        // Grouped by shape: both [24, 20] first (first appearance), then the convolution.
        assert_eq!(shapes, [(24, 20, 0), (24, 20, 1398), (16, 36, 504)]);
        assert_eq!(p.plain, [(0, 480, 24), (0, 1080, 30), (0, 1110, 288)]);
        assert_eq!((p.p_len, p.q_len), (4 * (24 + 24 + 16), 4 * (20 + 20 + 36)));
        assert_eq!(p.matrices[1].p_off, 96);
        assert_eq!(p.matrices[2].q_off, 160);
        // Rank above min(n, m) is cut to it: [3, 400] at rank 4 is rank 3 (and compressed
        // only at a rate below 1: its factors are larger than it).
        assert!(plan(&bucket(&[&[3, 400]]), &config).matrices.is_empty());
        let p = plan(
            &bucket(&[&[3, 400]]),
            &config.clone().with_min_compression_rate(0.5),
        );
        assert_eq!(p.matrices[0].rank, 3);
        // Rate 0 compresses every matrix, never an empty tensor.
        let p = plan(
            &bucket(&[&[2, 2], &[0, 3]]),
            &config.with_min_compression_rate(0.0),
        );
        assert_eq!((p.matrices.len(), p.plain.len()), (1, 1));
    }

    #[test]
    fn settings_and_layouts_that_cannot_run_are_refused() {
        let err = PowerSgd::new(PowerSgdConfig::new().with_matrix_approximation_rank(0));
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("matrix_approximation_rank"));
        let err = PowerSgd::new(PowerSgdConfig::new().with_orthogonalization_epsilon(f32::NAN));
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("orthogonalization_epsilon"));
        let mut outside = bucket(&[&[4, 4]]);
        outside.grads[0].offset = 1;
        let mut hook = PowerSgd::new(PowerSgdConfig::new()).unwrap();
        let err = hook.bind(&[outside]).unwrap_err();
        assert!(err.to_string().contains("gradient 0 of bucket 0"), "{err}");
    }
}
