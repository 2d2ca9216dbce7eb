//! [`GroupBuilder`]: a process group from explicit values, anything not given coming from the
//! environment (`env.rs`), and [`ProcessGroup::builder`], where one starts.

use std::net::TcpListener;
use std::time::Duration;

use crate::config::{GroupConfig, Transport};
use crate::error::CommError;
use crate::group::ProcessGroup;
use crate::launcher::contract::inherited_store_listener;
use crate::launcher::env::{process_env, resolve, Explicit};

/// Builds a [`ProcessGroup`] from explicit values; anything not given comes from the environment
/// (see [`GroupConfig::from_env`]).
///
/// ```no_run
/// # use std::time::Duration;
/// let pg = ddp_comm::ProcessGroup::builder()
///     .rank(1)
///     .world_size(2)
///     .master_addr("127.0.0.1")
///     .master_port(29500)
///     .timeout(Duration::from_secs(60))
///     .build()?;
/// # Ok::<(), ddp_comm::CommError>(())
/// ```
#[derive(Debug, Default)]
pub struct GroupBuilder {
    given: Explicit,
    master_listener: Option<TcpListener>,
    no_env: bool,
}

impl GroupBuilder {
    /// This process's rank.
    pub fn rank(mut self, rank: usize) -> Self {
        self.given.rank = Some(rank);
        self
    }
    /// Number of processes in the group.
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.given.world_size = Some(world_size);
        self
    }
    /// Rank among the processes on this node.
    pub fn local_rank(mut self, local_rank: usize) -> Self {
        self.given.local_rank = Some(local_rank);
        self
    }
    /// Number of processes on this node.
    pub fn local_world_size(mut self, local_world_size: usize) -> Self {
        self.given.local_world_size = Some(local_world_size);
        self
    }
    /// Host of rank 0's rendezvous store.
    pub fn master_addr(mut self, addr: impl Into<String>) -> Self {
        self.given.master_addr = Some(addr.into());
        self
    }
    /// Port of rank 0's rendezvous store.
    pub fn master_port(mut self, port: u16) -> Self {
        self.given.master_port = Some(port);
        self
    }
    /// Deadline of every wait on a peer during a collective (default 300 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.given.timeout = Some(timeout);
        self
    }
    /// Deadline for reaching the store and the peers while the group forms (default 300 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.given.connect_timeout = Some(timeout);
        self
    }
    /// Liveness deadline: a peer silent this long, heartbeats included, is declared dead
    /// (overrides `DDP_PEER_TIMEOUT`; default 7 s).
    pub fn peer_timeout(mut self, timeout: Duration) -> Self {
        self.given.peer_timeout = Some(timeout);
        self
    }
    /// What carries the collectives (overrides `DDP_TRANSPORT`; default [`Transport::Auto`]).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.given.transport = Some(transport);
        self
    }
    /// This rank's host identity (overrides `DDP_HOST_ID`; see [`GroupConfig::host_id`]).
    pub fn host_id(mut self, host_id: impl Into<String>) -> Self {
        self.given.host_id = Some(host_id.into());
        self
    }
    /// Directory for the flight recorder's dumps (overrides `DDP_TRACE_DIR`).
    pub fn trace_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.given.trace_dir = Some(dir.into());
        self
    }
    /// Shared secret that every connection must present (overrides `DDP_TOKEN`).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.given.token = Some(token.into());
        self
    }
    /// The job's name (overrides `DDP_JOB_ID`); every rank must give the same.
    pub fn job_id(mut self, job_id: impl Into<String>) -> Self {
        self.given.job_id = Some(job_id.into());
        self
    }
    /// Segment size of the pipelined algorithms in bytes (default 1 MiB).
    pub fn segment_bytes(mut self, bytes: usize) -> Self {
        self.given.segment_bytes = Some(bytes);
        self
    }
    /// Size up to which buffers use the latency-optimal algorithms (default 256 KiB).
    pub fn small_allreduce_bytes(mut self, bytes: usize) -> Self {
        self.given.small_allreduce_bytes = Some(bytes);
        self
    }
    /// Rendezvous through a PyTorch `TCPStore` that something else (torchrun's agent) hosts at
    /// the master address, with torch's worker key prefix for `restart_count` (overrides
    /// `TORCHELASTIC_USE_AGENT_STORE`; see [`GroupConfig::torch_agent_store`]).
    pub fn torch_agent_store(mut self, restart_count: u32) -> Self {
        self.given.torch_agent_store = Some(restart_count);
        self
    }
    /// Puts this group's keys under `scope` in the agent store (see
    /// [`GroupConfig::store_scope`]); needs [`torch_agent_store`](Self::torch_agent_store) (or
    /// `TORCHELASTIC_USE_AGENT_STORE`).
    pub fn store_scope(mut self, scope: impl Into<String>) -> Self {
        self.given.store_scope = Some(scope.into());
        self
    }
    /// Rank 0 only: host the rendezvous store on this already bound listener instead of binding
    /// `MASTER_PORT` (its port becomes the master port). Lets tests and launchers pick a free
    /// port with no race.
    pub fn master_listener(mut self, listener: TcpListener) -> Self {
        self.master_listener = Some(listener);
        self
    }
    /// Ignore the process environment: only explicit values and defaults are used.
    pub fn no_env(mut self) -> Self {
        self.no_env = true;
        self
    }

    /// Resolves the configuration (explicit values, then the environment, then defaults)
    /// without joining a group.
    pub fn config(&self) -> Result<GroupConfig, CommError> {
        if self.no_env {
            resolve(&self.given, &|_: &str| None)
        } else {
            resolve(&self.given, &process_env)
        }
    }

    /// Resolves the configuration and joins the group (blocks until every rank has connected,
    /// or the connect deadline passes). Rank 0 hosts the store on the listener given with
    /// [`GroupBuilder::master_listener`], else on the one its launcher handed it
    /// ([`crate::launcher::contract::STORE_FD_ENV`], unless [`GroupBuilder::no_env`]), else on a socket
    /// it binds to `MASTER_PORT`.
    pub fn build(mut self) -> Result<ProcessGroup, CommError> {
        let mut config = self.config()?;
        let listener = match self.master_listener.take() {
            Some(l) => {
                if let Ok(addr) = l.local_addr() {
                    config.master_port = addr.port();
                }
                Some(l)
            }
            None if self.no_env => None,
            None => inherited_store_listener(&config, &process_env)?,
        };
        ProcessGroup::init(config, listener, crate::config::DEFAULT_LOSS_GRACE, None)
    }
}

impl ProcessGroup {
    /// A builder for explicit values; anything not given comes from the environment.
    pub fn builder() -> GroupBuilder {
        GroupBuilder::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn builder_overrides_and_skips_environment() {
        let b = ProcessGroup::builder()
            .rank(1)
            .world_size(2)
            .master_port(7)
            .no_env();
        let c = b.config().unwrap();
        assert_eq!((c.rank, c.world_size, c.master_port), (1, 2, 7));
        // An explicit value means the (invalid) variable is not even read.
        let b = ProcessGroup::builder().rank(0).world_size(2).master_port(9);
        let c = resolve(
            &b.given,
            &vars(&[("RANK", "x"), ("WORLD_SIZE", "y"), ("MASTER_PORT", "z")]),
        )
        .unwrap();
        assert_eq!((c.rank, c.world_size, c.master_port), (0, 2, 9));
    }

    #[test]
    fn an_explicit_value_out_of_range_names_the_setting() {
        let err = ProcessGroup::builder()
            .rank(2)
            .world_size(2)
            .no_env()
            .config()
            .unwrap_err();
        assert!(
            matches!(&err, CommError::Config { var, .. } if var == "rank"),
            "{err}"
        );
    }
}
