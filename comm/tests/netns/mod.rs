//! Two "hosts" on one machine for the tests that need them: network namespaces joined by a
//! veth pair (root, iproute2). Included by comm's process tests and, through `#[path]`, by the
//! example crate's hierarchical DDP test.

#![allow(dead_code)] // each test binary uses a subset

use std::process::Command;

/// Two network namespaces joined by a veth pair: two "hosts". Deleted (with the pair) on drop.
/// Creating them needs root (as the tests and CI run); a failure to create them fails the test.
pub struct TwoHosts {
    /// The namespaces' names, host 0's first.
    pub names: [String; 2],
}

impl TwoHosts {
    /// The hosts' addresses on the link, host 0's first.
    pub const ADDRS: [&'static str; 2] = ["10.233.0.1", "10.233.0.2"];

    /// Creates the two namespaces (named after this process and `tag`) and the link.
    pub fn new(tag: &str) -> TwoHosts {
        let id = std::process::id();
        let hosts = TwoHosts {
            names: [format!("ddpt-{id}-{tag}-a"), format!("ddpt-{id}-{tag}-b")],
        };
        let veth = [
            format!("dv{}a", id % 1_000_000),
            format!("dv{}b", id % 1_000_000),
        ];
        let [a, b] = &hosts.names;
        ip(&["netns", "add", a]);
        ip(&["netns", "add", b]);
        ip(&[
            "link", "add", &veth[0], "netns", a, "type", "veth", "peer", "name", &veth[1], "netns",
            b,
        ]);
        for (i, ns) in hosts.names.iter().enumerate() {
            ip(&["-n", ns, "link", "set", "lo", "up"]);
            let addr = format!("{}/24", TwoHosts::ADDRS[i]);
            ip(&["-n", ns, "addr", "add", &addr, "dev", &veth[i]]);
            ip(&["-n", ns, "link", "set", &veth[i], "up"]);
        }
        hosts
    }

    /// Cuts the link: both ends of the pair go down. Nothing is sent either way any more, and
    /// no reset or FIN reaches either side: a partition, as a pulled cable or a dead switch.
    pub fn cut(&self) {
        let id = std::process::id();
        ip(&[
            "-n",
            &self.names[0],
            "link",
            "set",
            &format!("dv{}a", id % 1_000_000),
            "down",
        ]);
        ip(&[
            "-n",
            &self.names[1],
            "link",
            "set",
            &format!("dv{}b", id % 1_000_000),
            "down",
        ]);
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// Runs `ip args...`; panics with its error output when it fails.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip` (iproute2; the test needs it, as root): {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed (network namespaces need root): {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}
