//! Two simulated hosts for the benchmarks: network namespaces joined by a veth pair (needs
//! root and iproute2), optionally limited to a data-centre link rate with `tc`.

use std::process::Command;

use anyhow::{Context, Result};

use crate::util;

/// Two network namespaces joined by a veth pair, deleted (with the pair) on drop.
pub struct TwoHosts {
    /// The namespaces' names (`ip netns exec NAME ...`).
    pub names: [String; 2],
}

impl TwoHosts {
    /// The two hosts' addresses on the link.
    pub const ADDRS: [&'static str; 2] = ["10.233.9.1", "10.233.9.2"];

    /// Creates the namespaces and the link; with `rate` (`tc`'s syntax, e.g. `10gbit`), each
    /// end's egress is limited to it by a token bucket.
    pub fn new(rate: Option<&str>) -> Result<TwoHosts> {
        let id = std::process::id();
        let hosts = TwoHosts {
            names: [format!("ddpb-{id}-a"), format!("ddpb-{id}-b")],
        };
        let veth = [
            format!("dvb{}a", id % 100_000),
            format!("dvb{}b", id % 100_000),
        ];
        let [a, b] = &hosts.names;
        let ip = |args: &[&str]| -> Result<()> {
            util::run(Command::new("ip").args(args))
                .context("--two-hosts needs root and iproute2's `ip` (network namespaces)")
        };
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&[
            "link", "add", &veth[0], "netns", a, "type", "veth", "peer", "name", &veth[1], "netns",
            b,
        ])?;
        for (i, ns) in hosts.names.iter().enumerate() {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", Self::ADDRS[i]),
                "dev",
                &veth[i],
            ])?;
            ip(&["-n", ns, "link", "set", &veth[i], "up"])?;
            if let Some(rate) = rate {
                // A token bucket at `rate`: bursts of 1 MB, at most 10 ms of queue.
                util::run(Command::new("ip").args(["netns", "exec", ns]).args([
                    "tc", "qdisc", "add", "dev", &veth[i], "root", "tbf", "rate", rate, "burst",
                    "1mb", "latency", "10ms",
                ]))
                .context("limiting the link's rate needs iproute2's `tc`")?;
            }
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}
