//! torchrun's c10d rendezvous: the agents of an elastic job all start with the same command
//! line (`--rdzv-backend c10d --rdzv-endpoint HOST:PORT --nnodes MIN:MAX`, no `--node-rank`;
//! Kubeflow's elastic policy starts its pods so, through `PET_RDZV_*`), and each learns its
//! node rank at the rendezvous.
//!
//! How, as torchrun decides who hosts the store: an agent whose own address is the endpoint's
//! host ([`is_local`]) tries to bind the endpoint's port and host the store there
//! (`rendezvous.rs`); the one that binds it is node 0. An agent that finds the port taken
//! (`EADDRINUSE`: another agent on this host was first), or whose address is not the
//! endpoint's, is a client: it connects to the store (retrying until [`CONNECT_BY`], the host
//! may start later) and takes the next number of a counter there
//! ([`ddp_comm::next_node_rank`]): 1, 2, ... in the order the agents ask, so no two agents get
//! the same node rank, and node ranks (the ranks' slots, `RANK = node rank × nproc +
//! local rank`) stay below MAX. An agent that would get MAX or more is refused: the job already
//! had its most nodes. A node rank is the agent's for the whole job, across its rounds.
//!
//! The hosting agent's death does not end an elastic job: the store moves to another agent's
//! standby (`ddp_comm`'s `failover.rs`), and an agent started later on the endpoint's host
//! hosts a fresh store there, where the moved store's agent writes where the job went
//! (`ddp_comm::Redirect`): the next agents take their node ranks from the moved store.

use std::net::{IpAddr, TcpListener, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::config::LaunchConfig;
use crate::error::LaunchError;

/// How long an agent that does not host the store tries to reach it for its node rank.
const CONNECT_BY: Duration = Duration::from_secs(300);

/// torchrun's default port of a c10d rendezvous endpoint given without one.
pub const DEFAULT_RDZV_PORT: u16 = 29400;

/// `config` with its node rank, when it was to come from the rendezvous
/// ([`LaunchConfig::node_rank_at_rendezvous`]): 0 for the agent that hosts the store at
/// `addr:port` (`hosts`), else the store's next node number (see the module documentation).
/// Any other `config` is returned as it is.
pub(crate) fn assign(
    config: &LaunchConfig,
    addr: &str,
    port: u16,
    hosts: bool,
) -> Result<LaunchConfig, LaunchError> {
    let mut config = config.clone();
    if !config.node_rank_at_rendezvous {
        return Ok(config);
    }
    let failed = |message: String| LaunchError::Agents { message };
    config.node_rank = match hosts {
        true => 0,
        false => ddp_comm::next_node_rank(addr, port, Instant::now() + CONNECT_BY)
            .map_err(|e| failed(format!("taking a node rank at the rendezvous: {e}")))?,
    };
    if config.node_rank >= config.nnodes {
        return Err(failed(format!(
            "the rendezvous at {addr}:{} gave this agent node rank {}: the elastic job already \
             had its most nodes ({}); an agent started again after one died is not taken back",
            port, config.node_rank, config.nnodes
        )));
    }
    crate::output::notice(&format!(
        "node rank {} of at most {} (from the rendezvous at {addr}:{}{})",
        config.node_rank,
        config.nnodes,
        port,
        if hosts {
            ", whose store this agent hosts"
        } else {
            ""
        }
    ));
    Ok(config)
}

/// Whether `host` names this machine, as torchrun's `is_host` decides it: `localhost`, this
/// machine's host name, or an address that is a loopback address or one of this machine's (it
/// can be bound).
pub(crate) fn is_local(host: &str) -> bool {
    if host.eq_ignore_ascii_case("localhost") || host_name().is_some_and(|h| matches(&h, host)) {
        return true;
    }
    let Ok(addrs) = (host, 0).to_socket_addrs() else {
        return false;
    };
    addrs
        .map(|a| a.ip())
        .any(|ip: IpAddr| ip.is_loopback() || TcpListener::bind((ip, 0)).is_ok())
}

/// Whether `name` is this machine's host name `own`, or its first label.
fn matches(own: &str, name: &str) -> bool {
    own.eq_ignore_ascii_case(name) || own.split('.').next() == Some(name)
}

/// This machine's host name.
fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that much.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    std::str::from_utf8(&buf[..end]).ok().map(str::to_string)
}

/// torchrun's `--rdzv-endpoint`: `HOST`, `HOST:PORT`, or `[IPv6]:PORT`; the port defaults to
/// [`DEFAULT_RDZV_PORT`].
pub fn parse_endpoint(text: &str) -> Result<(String, u16), String> {
    let text = text.trim();
    let bad = |why: &str| format!("{text:?}: {why} (expected HOST or HOST:PORT)");
    let (host, port) = if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| bad("no closing ']'"))?;
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(bad("text after ']'")),
        }
    } else {
        match text.rsplit_once(':') {
            Some((host, _)) if host.contains(':') => (text, None), // a bare IPv6 address
            Some((host, port)) => (host, Some(port)),
            None => (text, None),
        }
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    let port = match port {
        None => DEFAULT_RDZV_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(bad("not a port number (1-65535)")),
        },
    };
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_as_torchrun_s() {
        let ok = |t: &str| parse_endpoint(t).unwrap();
        assert_eq!(ok("node0:1234"), ("node0".into(), 1234));
        assert_eq!(ok("node0"), ("node0".into(), DEFAULT_RDZV_PORT));
        assert_eq!(ok("[::1]:29500"), ("::1".into(), 29500));
        assert_eq!(ok("::1"), ("::1".into(), DEFAULT_RDZV_PORT));
        for bad in [
            "",
            ":80",
            "node0:0",
            "node0:x",
            "node0:70000",
            "[::1",
            "[::1]x",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn this_machine_is_local_and_others_are_not() {
        assert!(is_local("localhost"));
        assert!(is_local("127.0.0.1"));
        assert!(host_name().is_some_and(|h| is_local(&h)));
        assert!(!is_local("192.0.2.1"), "TEST-NET-1 is nobody's");
    }
}
