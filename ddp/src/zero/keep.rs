//! What ZeRO keeps of a step until it is committed (elastic runs: a step that fails after its
//! update must be dropped): the step's starting point, and the update that writes the step
//! from it into a second set of buffers (`ShardedDataParallel::keep_starting_points`).

use crate::gradients::host_buf::HostBuf;
use crate::optim::shard_optim::ShardOptimizer;

/// Where a step started (elastic runs keep it, to drop a step that failed after the update):
/// the trainable parameters' memory and the optimizer state as they were, the step counts.
/// The step itself writes into a second set of buffers, reused from step to step, reading the
/// kept ones ([`step_from`]): keeping them costs no copy, and no allocation after the first
/// step.
pub(crate) struct StartingPoint {
    /// The trainable parameters' memory (`None` for the others), by visiting index.
    pub(crate) values: Vec<Option<HostBuf>>,
    /// The optimizer's state vectors over this rank's shard.
    pub(crate) state: Vec<Vec<f32>>,
    /// Step count of every trainable parameter.
    pub(crate) times: Vec<u64>,
    /// Steps taken.
    pub(crate) steps: u64,
}

/// Elements a block of [`step_from`].
const STEP_BLOCK: usize = 4096;

/// Writes one piece's step into the step's own buffers `to` (parameter, optimizer state) from
/// its kept starting point `from`, with `optimizer` when `step` gives the averaged gradient and
/// step count, else as it was. It goes a block at a time, the block copied and then updated
/// while it is in the cache, so that keeping the starting point moves the same bytes through
/// memory as an update in place (read the old values once, write the new ones once) instead
/// of a copy of the shard before the update. The optimizers are element-wise, so a block's
/// update is the piece's, bit for bit.
pub(crate) fn step_from(
    optimizer: &ShardOptimizer,
    lr: f64,
    step: Option<(&[f32], u64)>,
    from: (&[f32], &[&[f32]]),
    to: (&mut [f32], &mut [&mut [f32]]),
) {
    let ((from_param, from_state), (param, state)) = (from, to);
    for start in (0..param.len()).step_by(STEP_BLOCK) {
        let block = start..(start + STEP_BLOCK).min(param.len());
        param[block.clone()].copy_from_slice(&from_param[block.clone()]);
        for (to, from) in state.iter_mut().zip(from_state) {
            to[block.clone()].copy_from_slice(&from[block.clone()]);
        }
        if let Some((grad, time)) = step {
            let mut block_state: Vec<&mut [f32]> =
                state.iter_mut().map(|v| &mut v[block.clone()]).collect();
            optimizer.update(
                lr,
                time,
                &mut param[block.clone()],
                &grad[block],
                &mut block_state,
            );
        }
    }
}
