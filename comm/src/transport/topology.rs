//! Which ranks share a host: [`Topology`], made from every rank's host identity
//! ([`host_identity`], or `DDP_HOST_ID`). The ranks with the same identity form a *host*; hosts
//! are ordered by their lowest rank, which is the host's *leader*. The shared-memory transport
//! (`shm.rs`) maps the segments of the ranks of its host, and the hierarchical collectives
//! (`collectives/dispatch.rs`) run TCP among the leaders only.

/// This host's identity: its name and the kernel's boot id (two containers may share a name).
pub(crate) fn host_identity() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut name = [0u8; 256];
    // SAFETY: gethostname writes at most name.len() bytes.
    let ok = unsafe { libc::gethostname(name.as_mut_ptr().cast(), name.len()) } == 0;
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    let host = if ok {
        String::from_utf8_lossy(&name[..end]).into_owned()
    } else {
        String::new()
    };
    format!("{host}/{}", boot.trim())
}

/// The hosts of a group: which ranks share one, and each host's leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Topology {
    /// The leader (lowest global rank) of every host, hosts in the order of their leaders.
    leaders: Vec<usize>,
    /// For every global rank, the index of its host in `leaders`.
    host_of: Vec<usize>,
}

impl Topology {
    /// The topology of ranks `0..hosts.len()`, where rank r runs on host `hosts[r]`.
    pub fn from_hosts(hosts: &[String]) -> Topology {
        let mut leaders: Vec<usize> = Vec::new();
        let mut host_of = vec![0usize; hosts.len()];
        for (r, name) in hosts.iter().enumerate() {
            match leaders.iter().position(|&l| hosts[l] == *name) {
                Some(h) => host_of[r] = h,
                None => {
                    host_of[r] = leaders.len();
                    leaders.push(r);
                }
            }
        }
        Topology { leaders, host_of }
    }

    /// Whether every rank shares one host.
    pub fn is_flat(&self) -> bool {
        self.leaders.len() == 1
    }

    /// Whether every rank has a host of its own.
    pub fn one_rank_per_host(&self) -> bool {
        self.leaders.len() == self.host_of.len()
    }

    /// The hosts' leaders (lowest global rank of each host), in host order.
    pub fn leaders(&self) -> &[usize] {
        &self.leaders
    }

    /// The index of `rank`'s host in [`Topology::leaders`].
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// The global ranks on `rank`'s host, ascending (its leader first).
    pub fn host_ranks(&self, rank: usize) -> Vec<usize> {
        let host = self.host_of[rank];
        (0..self.host_of.len())
            .filter(|&r| self.host_of[r] == host)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_ordered_by_their_lowest_rank() {
        let names: Vec<String> = ["b", "a", "b", "c", "a"].map(String::from).to_vec();
        let t = Topology::from_hosts(&names);
        assert_eq!(t.leaders(), [0, 1, 3]);
        assert_eq!(
            (0..5).map(|r| t.host_of(r)).collect::<Vec<_>>(),
            [0, 1, 0, 2, 1]
        );
        assert_eq!(t.host_ranks(4), [1, 4]);
        assert!(!t.is_flat() && !t.one_rank_per_host());
        let flat = Topology::from_hosts(&["h".to_string(), "h".to_string()]);
        assert!(flat.is_flat() && !flat.one_rank_per_host());
        let apart = Topology::from_hosts(&["x".to_string(), "y".to_string()]);
        assert!(apart.one_rank_per_host());
    }
}
