//! Where the ranks of each attempt meet: `MASTER_ADDR` and `MASTER_PORT`.
//!
//! On several nodes both are given, and rank 0 (on node 0) binds the port itself. On a single
//! node without a port, the launcher binds a free one for each attempt ([`bind_free_port`]) and
//! hands the listening socket to local rank 0, which hosts the store on it
//! ([`ddp_comm::elastic::STORE_FD_ENV`]): the port is held from the moment it is chosen, so no
//! other process can take it before the store listens (as it could if the launcher only asked
//! for a free port, closed it, and left rank 0 to bind it again).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener};

use crate::config::{LaunchConfig, DEFAULT_MASTER_ADDR};
use crate::error::LaunchError;

/// The rendezvous address of a launch, and its port when given.
pub(crate) struct Rendezvous {
    pub addr: String,
    fixed_port: Option<u16>,
}

impl Rendezvous {
    /// The address and port of `config`: both given on several nodes (an error otherwise), on a
    /// single node [`DEFAULT_MASTER_ADDR`] and a port bound per attempt when not given.
    pub fn settle(config: &LaunchConfig) -> Result<Rendezvous, LaunchError> {
        match (&config.master_addr, config.master_port) {
            (Some(addr), Some(port)) => Ok(Rendezvous {
                addr: addr.clone(),
                fixed_port: Some(port),
            }),
            _ if config.nnodes > 1 => Err(LaunchError::MultiNodeNeedsMaster {
                nnodes: config.nnodes,
            }),
            (addr, port) => Ok(Rendezvous {
                addr: addr
                    .clone()
                    .unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string()),
                fixed_port: port,
            }),
        }
    }

    /// The port of the next attempt: the given one (and no socket: rank 0 binds it), or a free
    /// one bound now on every interface of the address's family, with its listening socket for
    /// local rank 0 (the store may listen on any interface; a port free on all is free on each).
    pub fn next_port(&self) -> Result<(u16, Option<TcpListener>), LaunchError> {
        if let Some(port) = self.fixed_port {
            return Ok((port, None));
        }
        let v6 = self.addr.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6());
        let any: IpAddr = if v6 {
            Ipv6Addr::UNSPECIFIED.into()
        } else {
            Ipv4Addr::UNSPECIFIED.into()
        };
        let listener = bind_free_port(any)?;
        let port = listener
            .local_addr()
            .map_err(|source| LaunchError::FreePort {
                addr: any.to_string(),
                source,
            })?
            .port();
        Ok((port, Some(listener)))
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
