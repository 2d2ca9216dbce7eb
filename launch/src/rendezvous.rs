//! Where the ranks of each attempt meet: `MASTER_ADDR` and `MASTER_PORT`, and the rendezvous
//! store the launcher hosts there.
//!
//! As torchrun does, the launcher hosts the store, a PyTorch `TCPStore`
//! ([`ddp_comm::TorchStoreHost`]), and tells every rank so (`TORCHELASTIC_USE_AGENT_STORE=True`,
//! [`ddp_comm::elastic::USE_AGENT_STORE_ENV`]): every rank connects to it as a client, rank 0
//! too, whether it is a PyTorch program (`init_process_group`, env://) or a ddp-comm rank. No
//! rank binds `MASTER_PORT`, and the port is held by the launcher from the moment it is chosen,
//! so no other process can take it before the ranks meet (as it could if the launcher only asked
//! for a free port, closed it, and left rank 0 to bind it again).
//!
//! - One node, no port given: each attempt gets a store of its own on a free port (bound on
//!   every interface of the address's family: a port free on all is free on each), as torchrun's
//!   `--standalone` rendezvous gives each round a new store; the old one, and any connection a
//!   straggler of the old attempt kept, goes with it.
//! - A port given (one node or several): node 0's launcher binds it once and keeps it for the
//!   whole job, as torchrun's static rendezvous does, but clears the store between attempts,
//!   once every rank of the old one has ended on every node (`agents.rs` says when on several
//!   nodes): under torchrun 2.15 the workers of a restart read the old attempt's keys (gloo's
//!   peer addresses) and fail, which this avoids. (ddp-comm's ranks also put their keys under
//!   the attempt's prefix, `/worker/attempt_{TORCHELASTIC_RESTART_COUNT}/`.) The other nodes'
//!   launchers host nothing: their ranks connect to node 0's.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener};

use ddp_comm::TorchStoreHost;

use crate::config::{LaunchConfig, DEFAULT_MASTER_ADDR};
use crate::error::LaunchError;

/// The rendezvous address of a launch, its port when given, and whether this node's launcher
/// hosts the store.
pub(crate) struct Rendezvous {
    pub addr: String,
    fixed_port: Option<u16>,
    hosts_store: bool,
    /// torchrun's c10d rendezvous without node ranks (`node_rank.rs`): an agent that finds the
    /// port taken is a client.
    client_if_taken: bool,
}

/// An attempt's port, and the store this launcher hosts on it (`None` on a node other than 0),
/// held for as long as the attempt's ranks may use it (dropping it stops the store).
pub(crate) struct AttemptStore {
    pub port: u16,
    pub _host: Option<TorchStoreHost>,
}

impl Rendezvous {
    /// The address and port of `config`: both given on several nodes (an error otherwise), on a
    /// single node [`DEFAULT_MASTER_ADDR`] and a port bound per attempt when not given.
    /// Without a node rank (torchrun's c10d rendezvous), an agent on the address's host tries
    /// to host the store, and is a client when the port is taken (see `node_rank.rs`).
    pub fn settle(config: &LaunchConfig) -> Result<Rendezvous, LaunchError> {
        let client_if_taken = config.node_rank_at_rendezvous;
        let hosts_store = match (client_if_taken, &config.master_addr) {
            (true, Some(addr)) => crate::node_rank::is_local(addr),
            _ => config.node_rank == 0,
        };
        match (&config.master_addr, config.master_port) {
            (Some(addr), Some(port)) => Ok(Rendezvous {
                addr: addr.clone(),
                fixed_port: Some(port),
                hosts_store,
                client_if_taken,
            }),
            _ if config.nnodes > 1 => Err(LaunchError::MultiNodeNeedsMaster {
                nnodes: config.nnodes,
            }),
            (addr, port) => Ok(Rendezvous {
                addr: addr
                    .clone()
                    .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()),
                fixed_port: port,
                hosts_store,
                client_if_taken,
            }),
        }
    }

    /// The store of the first attempt (see the module documentation).
    pub fn first_store(&self) -> Result<AttemptStore, LaunchError> {
        match (self.fixed_port, self.hosts_store) {
            (Some(port), false) => Ok(AttemptStore { port, _host: None }),
            (Some(port), true) if self.client_if_taken => match self.host(port) {
                Err(LaunchError::StorePort { source, .. })
                    if source.kind() == io::ErrorKind::AddrInUse =>
                {
                    Ok(AttemptStore { port, _host: None })
                }
                other => other,
            },
            (port, _) => self.host(port.unwrap_or(0)),
        }
    }

    /// Makes `store` the next attempt's, once every rank of the last one has ended: on a given
    /// port the same store, cleared (its keys gone, its old connections closed) unless `keep`,
    /// else a new one on a new free port (bound before the old one is dropped, so the port
    /// differs).
    pub fn renew(&self, store: &mut AttemptStore, keep: bool) -> Result<(), LaunchError> {
        match (self.fixed_port, &store._host) {
            (None, _) => *store = self.host(0)?,
            (Some(_), Some(_)) if keep => {}
            (Some(port), Some(host)) => host.clear().map_err(|source| LaunchError::StorePort {
                addr: self.addr.clone(),
                port,
                source,
            })?,
            (Some(_), None) => {}
        }
        Ok(())
    }

    /// A standby store for an elastic job on several nodes (on a node other than 0): empty, on
    /// a free port of every interface of the address's family, with the same protections as
    /// node 0's; the job's store moves there if node 0 is lost (`ddp_comm`'s `standby.rs`).
    pub fn standby(&self) -> Result<TorchStoreHost, LaunchError> {
        let AttemptStore { _host, .. } = self.host(0)?;
        _host.ok_or_else(|| LaunchError::Environment("no standby store was started".into()))
    }

    /// Binds `port` (0: a free one) on every interface of the address's family and hosts a
    /// store on it.
    fn host(&self, port: u16) -> Result<AttemptStore, LaunchError> {
        let v6 = self.addr.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6());
        let any: IpAddr = if v6 {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        let failed = |source: io::Error| match port {
            0 => LaunchError::FreePort {
                addr: any.to_string(),
                source,
            },
            _ => LaunchError::StorePort {
                addr: any.to_string(),
                port,
                source,
            },
        };
        let listener = TcpListener::bind((any, port)).map_err(failed)?;
        let host = TorchStoreHost::start(listener).map_err(failed)?;
        Ok(AttemptStore {
            port: host.port(),
            _host: Some(host),
        })
    }
}

/// Binds a free TCP port on `addr` and returns the listening socket: the port is the
/// socket's (`local_addr`), and it stays taken until the socket is closed.
pub fn bind_free_port(addr: IpAddr) -> Result<TcpListener, LaunchError> {
    TcpListener::bind((addr, 0)).map_err(|source| LaunchError::FreePort {
        addr: addr.to_string(),
        source,
    })
}
