//! [`PetDefaults`]: the defaults of ddprun's options from torchrun's `PET_*` variables, which is
//! how Kubeflow's PyTorchJob passes torchrun its options (torchrun reads `PET_<OPTION>` as the
//! default of every `--<option>`; a flag on the command line wins).

use crate::error::LaunchError;

/// ddprun's options as `PET_*` variables give them: `PET_NNODES`, `PET_NPROC_PER_NODE`,
/// `PET_NODE_RANK`, `PET_MASTER_ADDR`, `PET_MASTER_PORT` (and `PET_MAX_RESTARTS`), each `None`
/// when unset or empty. A flag given on ddprun's command line wins over its variable.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PetDefaults {
    /// `PET_NNODES`: a count, or torchrun's elastic `MIN:MAX` with `MIN = MAX`.
    pub nnodes: Option<usize>,
    /// `PET_NPROC_PER_NODE`: a count, or torchrun's `cpu` (this host's cores).
    pub nproc_per_node: Option<usize>,
    /// `PET_NODE_RANK`.
    pub node_rank: Option<usize>,
    /// `PET_MASTER_ADDR`.
    pub master_addr: Option<String>,
    /// `PET_MASTER_PORT`.
    pub master_port: Option<u16>,
    /// `PET_MAX_RESTARTS`.
    pub max_restarts: Option<usize>,
}

impl PetDefaults {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<PetDefaults, LaunchError> {
        PetDefaults::from_vars(|var| {
            std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
        })
    }

    /// Reads the variables through `lookup`. A value ddprun cannot use is
    /// [`LaunchError::Variable`] naming the variable: a count that is not a number (or is 0), an
    /// elastic range (`PET_NNODES=1:4`: ddprun has no elastic membership), `PET_NPROC_PER_NODE`
    /// of `auto` or `gpu` (give `--nproc-per-node`: ddprun does not count GPUs).
    pub fn from_vars(lookup: impl Fn(&str) -> Option<String>) -> Result<PetDefaults, LaunchError> {
        let get = |var: &str| {
            lookup(var)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let bad = |var: &'static str, value: &str, why: &str| LaunchError::Variable {
            var,
            value: value.to_string(),
            why: why.to_string(),
        };
        let count = |var: &'static str, min: usize| -> Result<Option<usize>, LaunchError> {
            match get(var) {
                None => Ok(None),
                Some(v) => match v.parse::<usize>() {
                    Ok(n) if n >= min => Ok(Some(n)),
                    _ if min == 1 => Err(bad(var, &v, "not a whole number of at least 1")),
                    _ => Err(bad(var, &v, "not a whole number")),
                },
            }
        };
        let nnodes = match get("PET_NNODES") {
            Some(v) if v.contains(':') => {
                let (min, max) = v.split_once(':').unwrap_or_default();
                match (min.trim().parse::<usize>(), max.trim().parse::<usize>()) {
                    (Ok(a), Ok(b)) if a == b && a >= 1 => Some(a),
                    _ => {
                        return Err(bad(
                            "PET_NNODES",
                            &v,
                            "an elastic range of nodes, which ddprun does not support: give a \
                             fixed count (MIN = MAX, or --nnodes)",
                        ))
                    }
                }
            }
            _ => count("PET_NNODES", 1)?,
        };
        let nproc_per_node = match get("PET_NPROC_PER_NODE").as_deref() {
            Some("cpu") => Some(std::thread::available_parallelism().map_or(1, |n| n.get())),
            Some(word @ ("auto" | "gpu")) => {
                return Err(bad(
                    "PET_NPROC_PER_NODE",
                    word,
                    "ddprun does not count GPUs: give --nproc-per-node N (one rank per GPU)",
                ))
            }
            _ => count("PET_NPROC_PER_NODE", 1)?,
        };
        let master_port = match get("PET_MASTER_PORT") {
            None => None,
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => Some(p),
                _ => return Err(bad("PET_MASTER_PORT", &v, "not a port number (1-65535)")),
            },
        };
        Ok(PetDefaults {
            nnodes,
            nproc_per_node,
            node_rank: count("PET_NODE_RANK", 0)?,
            master_addr: get("PET_MASTER_ADDR"),
            master_port,
            max_restarts: count("PET_MAX_RESTARTS", 0)?,
        })
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
        PetDefaults::from_vars(move |k: &str| map.get(k).cloned())
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
                nproc_per_node: Some(4),
                node_rank: Some(1),
                master_addr: Some("job-master-0".into()),
                master_port: Some(23456),
                max_restarts: Some(3),
            }
        );
        assert_eq!(from(&[]).unwrap(), PetDefaults::default());
        assert_eq!(from(&[("PET_NNODES", "3:3")]).unwrap().nnodes, Some(3));
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
            ("PET_NNODES", "1:4"),
            ("PET_NNODES", "0"),
            ("PET_NNODES", "two"),
            ("PET_NPROC_PER_NODE", "auto"),
            ("PET_NPROC_PER_NODE", "gpu"),
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
}
