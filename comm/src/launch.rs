//! The ddprun launcher library (placeholder).
