//! Communication hooks (PyTorch's `register_comm_hook`): the [`CommHook`](comm_hook::CommHook)
//! trait a user implements (`comm_hook.rs`) and the built-in PowerSGD (`powersgd.rs`, its
//! settings, math and saved state in the other `powersgd_*` files).

pub(crate) mod comm_hook;
pub(crate) mod powersgd;
pub(crate) mod powersgd_config;
pub(crate) mod powersgd_math;
pub(crate) mod powersgd_state;
