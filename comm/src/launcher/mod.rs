//! The launcher's side of a rank: the variables of torchrun, ddprun, Slurm, Open MPI, MPICH
//! and Kubeflow, in order of precedence (`env.rs`, with Slurm's node lists and task counts in
//! `slurm.rs` and Kubeflow's in `kubeflow.rs`), and what a rank shares with its launcher
//! (`contract.rs`, public as [`crate::elastic`]: the error file, the restart variables, the
//! agent-store variable, the store socket a launcher may hand rank 0).

pub mod contract;
pub(crate) mod env;
pub(crate) mod kubeflow;
pub(crate) mod slurm;
pub(crate) mod vars;
