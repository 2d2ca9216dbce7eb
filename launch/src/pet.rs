//! [`PetDefaults`]: the defaults of ddprun's options from torchrun's `PET_*` variables, which is
//! how Kubeflow's PyTorchJob passes torchrun its options (torchrun reads `PET_<OPTION>` as the
//! default of every `--<option>`). A flag on the command line wins, and its variable is then not
//! read at all ([`GivenFlags`]), as in torchrun: the training operator sets
//! `PET_NPROC_PER_NODE=auto` in every pod by default, and `--nproc-per-node 2` beside it must
//! simply mean 2.

use crate::devices::nproc_per_node;
use crate::error::LaunchError;

/// ddprun's options as `PET_*` variables give them: `PET_NNODES`, `PET_NPROC_PER_NODE`,
/// `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT` (and `PET_MAX_RESTARTS`), each `None`
/// when unset or empty, or when its flag was given ([`GivenFlags`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PetDefaults {
    /// `PET_NNODES`: a count, or the most of torchrun's elastic `MIN:MAX`.
    pub nnodes: Option<usize>,
    /// The least of `PET_NNODES=MIN:MAX` when `MIN < MAX` (an elastic job).
    pub min_nnodes: Option<usize>,
    /// `PET_NPROC_PER_NODE`: a count, or torchrun's `auto`, `cpu` or `gpu` (see
    /// [`crate::nproc_per_node`]).
    pub nproc_per_node: Option<usize>,
    /// `PET_NODE_RANK`.
    pub node_rank: Option<usize>,
    /// `PET_MASTER_ADDR`.
    pub master_addr: Option<String>,
    /// `PET_MASTER_PORT`.
    pub master_port: Option<u16>,
    /// `PET_MAX_RESTARTS`.
    pub max_restarts: Option<usize>,
    /// `PET_RDZV_BACKEND`: `c10d` or `static` (torchrun's; others are refused).
    pub rdzv_backend: Option<String>,
    /// `PET_RDZV_ENDPOINT`: the rendezvous store's `HOST[:PORT]`
    /// ([`crate::parse_endpoint`]).
    pub rdzv_endpoint: Option<(String, u16)>,
    /// `PET_RDZV_ID`: the job's id.
    pub rdzv_id: Option<String>,
    /// `PET_RDZV_CONF`: torchrun's rendezvous settings ([`crate::parse_rdzv_conf`]).
    pub rdzv_conf: Option<crate::RdzvConf>,
}

/// Which of ddprun's options were given on its command line: their `PET_*` variables are not
/// read (neither used nor checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GivenFlags {
    /// `--nnodes` (`PET_NNODES`).
    pub nnodes: bool,
    /// `--nproc-per-node` (`PET_NPROC_PER_NODE`).
    pub nproc_per_node: bool,
    /// `--node-rank` (`PET_NODE_RANK`).
    pub node_rank: bool,
    /// `--master-addr` (`PET_MASTER_ADDR`).
    pub master_addr: bool,
    /// `--master-port` (`PET_MASTER_PORT`).
    pub master_port: bool,
    /// `--max-restarts` (`PET_MAX_RESTARTS`).
    pub max_restarts: bool,
    /// `--rdzv-backend` (`PET_RDZV_BACKEND`).
    pub rdzv_backend: bool,
    /// `--rdzv-endpoint` (`PET_RDZV_ENDPOINT`).
    pub rdzv_endpoint: bool,
    /// `--rdzv-id` (`PET_RDZV_ID`).
    pub rdzv_id: bool,
    /// `--rdzv-conf` (`PET_RDZV_CONF`).
    pub rdzv_conf: bool,
}

impl PetDefaults {
    /// Reads the variables of the options not `given` from the process environment.
    pub fn from_env(given: &GivenFlags) -> Result<PetDefaults, LaunchError> {
        PetDefaults::from_vars(given, |var| {
            std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
        })
    }

    /// Reads the variables of the options not `given` through `lookup`. A value ddprun cannot
    /// use is [`LaunchError::Variable`] naming the variable: a count that is not a number (or is
    /// 0), a range that is not `MIN:MAX` with `1 <= MIN <= MAX`, `PET_NPROC_PER_NODE=gpu` on a
    /// host without GPUs.
    pub fn from_vars(
        given: &GivenFlags,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<PetDefaults, LaunchError> {
        let get = |var: &str, flag_given: bool| {
            if flag_given {
                return None;
            }
            lookup(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let bad = |var: &'static str, value: &str, why: &str| LaunchError::Variable {
            var,
            value: value.to_string(),
            why: why.to_string(),
        };
        let count = |var: &'static str,
                     flag_given: bool,
                     min: usize|
         -> Result<Option<usize>, LaunchError> {
            match get(var, flag_given) {
                None => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= min => Ok(Some(n)),
                    _ if min == 1 => Err(bad(var, &v, "not a whole number of at least 1")),
                    _ => Err(bad(var, &v, "not a whole number")),
                },
            }
        };
        let (nnodes, min_nnodes) = match get("PET_NNODES", given.nnodes) {
            Some(v) if v.contains(':') => match ddp_comm::parse_range(&v) {
                Some((min, max)) => (Some(max), (min < max).then_some(min)),
                None => {
                    return Err(bad(
                        "PET_NNODES",
                        &v,
                        "not an elastic range MIN:MAX with 1 <= MIN <= MAX",
                    ))
                }
            },
            _ => (count("PET_NNODES", given.nnodes, 1)?, None),
        };
        let nproc_per_node = match get("PET_NPROC_PER_NODE", given.nproc_per_node) {
            None => None,
            Some(v) => Some(nproc_per_node(&v).map_err(|why| {
                bad(
                    "PET_NPROC_PER_NODE",
                    &v,
                    &format!("{why} (or give --nproc-per-node N)"),
                )
            })?),
        };
        let master_port = match get("PET_MASTER_PORT", given.master_port) {
            None => None,
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => Some(p),
                _ => return Err(bad("PET_MASTER_PORT", &v, "not a port number (1-65535)")),
            },
        };
        let rdzv_backend = match get("PET_RDZV_BACKEND", given.rdzv_backend) {
            None => None,
            Some(v) => Some(rdzv_backend(&v).map_err(|why| bad("PET_RDZV_BACKEND", &v, &why))?),
        };
        let rdzv_endpoint = match get("PET_RDZV_ENDPOINT", given.rdzv_endpoint) {
            None => None,
            Some(v) => Some(
                crate::node_rank::parse_endpoint(&v)
                    .map_err(|why| bad("PET_RDZV_ENDPOINT", &v, &why))?,
            ),
        };
        let rdzv_conf = match get("PET_RDZV_CONF", given.rdzv_conf) {
            None => None,
            Some(v) => {
                Some(crate::parse_rdzv_conf(&v).map_err(|why| bad("PET_RDZV_CONF", &v, &why))?)
            }
        };
        Ok(PetDefaults {
            rdzv_conf,
            rdzv_backend,
            rdzv_endpoint,
            rdzv_id: get("PET_RDZV_ID", given.rdzv_id),
            nnodes,
            min_nnodes,
            nproc_per_node,
            node_rank: count("PET_NODE_RANK", given.node_rank, 0)?,
            master_addr: get("PET_MASTER_ADDR", given.master_addr),
            master_port,
            max_restarts: count("PET_MAX_RESTARTS", given.max_restarts, 0)?,
        })
    }
}

/// torchrun's `--rdzv-backend`: `c10d` (the node rank may come from the rendezvous) or
/// `static` (it must be given), in any case; torchrun's `etcd` backends are refused.
pub fn rdzv_backend(text: &str) -> Result<String, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        b @ ("c10d" | "static") => Ok(b.to_string()),
        _ => Err(format!(
            "{text:?}: ddprun's rendezvous backends are c10d and static (its store is a \
             PyTorch TCPStore on the endpoint)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<PetDefaults, LaunchError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        PetDefaults::from_vars(&GivenFlags::default(), move |k: &str| map.get(k).cloned())
    }

    /// Kubeflow's elastic policy: torchrun's rendezvous options as `PET_RDZV_*`, no node rank.
    #[test]
    fn an_elastic_pod_s_rendezvous_variables_are_read() {
        let d = from(&[
            ("PET_NNODES", "2:3"),
            ("PET_RDZV_BACKEND", "C10D"),
            ("PET_RDZV_ENDPOINT", "job-worker-0:29400"),
            ("PET_RDZV_ID", "job"),
        ])
        .unwrap();
        assert_eq!(d.rdzv_backend.as_deref(), Some("c10d"));
        assert_eq!(d.rdzv_endpoint, Some(("job-worker-0".into(), 29400)));
        assert_eq!(d.rdzv_id.as_deref(), Some("job"));
        assert_eq!(
            (d.nnodes, d.min_nnodes, d.node_rank),
            (Some(3), Some(2), None)
        );
        for (var, value) in [
            ("PET_RDZV_BACKEND", "etcd-v2"),
            ("PET_RDZV_ENDPOINT", "job-worker-0:x"),
            ("PET_RDZV_CONF", "join_timeout=never"),
        ] {
            match from(&[(var, value)]) {
                Err(LaunchError::Variable { var: v, .. }) => assert_eq!(v, var),
                other => panic!("{var}={value}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_kubeflow_pod_s_variables_are_the_defaults() {
        let d = from(&[
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "4"),
            ("PET_NODE_RANK", "1"),
            ("PET_MASTER_ADDR", "job-master-0"),
            ("PET_MASTER_PORT", "23456"),
            ("PET_MAX_RESTARTS", "3"),
            ("RANK", "1"),
        ])
        .unwrap();
        assert_eq!(
            d,
            PetDefaults {
                nnodes: Some(2),
                min_nnodes: None,
                nproc_per_node: Some(4),
                node_rank: Some(1),
                master_addr: Some("job-master-0".into()),
                master_port: Some(23456),
                max_restarts: Some(3),
                ..PetDefaults::default()
            }
        );
        assert_eq!(from(&[]).unwrap(), PetDefaults::default());
        let conf = from(&[("PET_RDZV_CONF", "last_call_timeout=5")]).unwrap();
        let last_call = conf.rdzv_conf.and_then(|c| c.last_call);
        assert_eq!(last_call, Some(std::time::Duration::from_secs(5)));
        assert_eq!(from(&[("PET_NNODES", "3:3")]).unwrap().nnodes, Some(3));
        // An elastic range: its most nodes, and its least.
        let elastic = from(&[("PET_NNODES", "2:4")]).unwrap();
        assert_eq!((elastic.nnodes, elastic.min_nnodes), (Some(4), Some(2)));
        assert!(
            from(&[("PET_NPROC_PER_NODE", "cpu")])
                .unwrap()
                .nproc_per_node
                >= Some(1)
        );
    }

    #[test]
    fn unusable_values_name_the_variable() {
        for (var, value) in [
            ("PET_NNODES", "4:1"),
            ("PET_NNODES", "0:2"),
            ("PET_NNODES", "0"),
            ("PET_NNODES", "two"),
            ("PET_NPROC_PER_NODE", "xpu"),
            ("PET_NPROC_PER_NODE", "0"),
            ("PET_NODE_RANK", "-1"),
            ("PET_MASTER_PORT", "70000"),
            ("PET_MASTER_PORT", "0"),
            ("PET_MAX_RESTARTS", "x"),
        ] {
            let e = from(&[(var, value)]).unwrap_err();
            let msg = e.to_string();
            assert!(msg.starts_with(&format!("{var}=")), "{var}={value}: {msg}");
            assert_eq!(e.exit_code(), 2, "{msg}");
        }
    }

    /// A flag wins over its variable: the variable is not even read, so a value ddprun could
    /// not use is no error beside its flag.
    #[test]
    fn a_given_flag_leaves_its_variable_unread() {
        let pod = [
            ("PET_NNODES", "4:1"),
            ("PET_NPROC_PER_NODE", "xpu"),
            ("PET_NODE_RANK", "-1"),
            ("PET_MASTER_ADDR", "job-master-0"),
            ("PET_MASTER_PORT", "0"),
            ("PET_MAX_RESTARTS", "x"),
        ];
        let lookup = |k: &str| {
            pod.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let all = GivenFlags {
            nnodes: true,
            nproc_per_node: true,
            node_rank: true,
            master_addr: true,
            master_port: true,
            max_restarts: true,
            rdzv_backend: true,
            rdzv_endpoint: true,
            rdzv_id: true,
            rdzv_conf: true,
        };
        assert_eq!(
            PetDefaults::from_vars(&all, lookup).unwrap(),
            PetDefaults::default()
        );
        // Only the variables of the flags not given are read: each one still counts.
        let some = PetDefaults::from_vars(
            &GivenFlags {
                nproc_per_node: false,
                ..all
            },
            |k: &str| (k == "PET_NPROC_PER_NODE").then(|| "3".to_string()),
        )
        .unwrap();
        assert_eq!(some.nproc_per_node, Some(3));
        let e = PetDefaults::from_vars(
            &GivenFlags {
                nnodes: false,
                ..all
            },
            lookup,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("PET_NNODES="), "{e}");
    }

    #[test]
    fn auto_and_cpu_count_this_host() {
        let cpus = std::thread::available_parallelism().unwrap().get();
        let n = |v: &str| from(&[("PET_NPROC_PER_NODE", v)]).unwrap().nproc_per_node;
        assert_eq!(n("cpu"), Some(cpus));
        let gpus = crate::devices::gpu_count();
        assert_eq!(n("auto"), Some(if gpus > 0 { gpus } else { cpus }));
    }
}
