//! torchrun's `--rdzv-conf KEY=VALUE,...` (Kubeflow's `PET_RDZV_CONF`): the c10d rendezvous's
//! settings, as ddprun's elastic membership takes them.
//!
//! - `last_call_timeout` (seconds): how long the founding waits for more processes once MIN
//!   joined; the ranks get it as `DDP_ELASTIC_LAST_CALL`
//!   ([`ddp_comm::elastic::LAST_CALL_ENV`]).
//! - `join_timeout` (seconds): how long a process tries to join; the ranks get it as
//!   `DDP_CONNECT_TIMEOUT`, the deadline of their join and of every re-form.
//! - Every other key torchrun's c10d backend knows (`close_timeout`, `timeout`,
//!   `read_timeout`, `keep_alive_interval`, `keep_alive_max_attempt`, `is_host`,
//!   `use_agent_store`) is accepted and has no effect here: ddprun's membership has its own
//!   (beats in the store, `DDP_PEER_TIMEOUT`); [`RdzvConf::ignored`] names them, so ddprun
//!   says so. A key torchrun does not know, or a value that is not a number of seconds, is an
//!   error naming it, as a typo must not pass silently.

use std::time::Duration;

/// The keys of torchrun's c10d rendezvous configuration that ddprun accepts and ignores.
const IGNORED: [&str; 7] = [
    "close_timeout",
    "timeout",
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "is_host",
    "use_agent_store",
];

/// What `--rdzv-conf` sets (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RdzvConf {
    /// `last_call_timeout`.
    pub last_call: Option<Duration>,
    /// `join_timeout`.
    pub join_timeout: Option<Duration>,
    /// The keys given that have no effect here, in the order given.
    pub ignored: Vec<String>,
}

/// Parses `KEY=VALUE[,KEY=VALUE...]` (an empty text is no setting); an error says which key or
/// value is wrong and why.
pub fn parse_rdzv_conf(text: &str) -> Result<RdzvConf, String> {
    let mut conf = RdzvConf::default();
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim()))
            .ok_or_else(|| format!("{item:?}: expected KEY=VALUE"))?;
        let seconds = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|s| *s < 1e9)
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| format!("{key}={value:?}: expected seconds (30, 0.5, ...)"))
        };
        match key {
            "last_call_timeout" => conf.last_call = Some(seconds()?),
            "join_timeout" => match seconds()? {
                Duration::ZERO => return Err(format!("{key}={value:?}: must be more than 0")),
                d => conf.join_timeout = Some(d),
            },
            k if IGNORED.contains(&k) => conf.ignored.push(k.to_string()),
            k => {
                return Err(format!(
                    "{k:?}: not a key of torchrun's c10d rendezvous (last_call_timeout, \
                     join_timeout, {})",
                    IGNORED.join(", ")
                ))
            }
        }
    }
    Ok(conf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchrun_keys_parse_and_a_typo_is_refused() {
        let conf =
            parse_rdzv_conf("last_call_timeout=7, join_timeout=0.5,read_timeout=60").unwrap();
        assert_eq!(conf.last_call, Some(Duration::from_secs(7)));
        assert_eq!(conf.join_timeout, Some(Duration::from_millis(500)));
        assert_eq!(conf.ignored, ["read_timeout"]);
        assert_eq!(parse_rdzv_conf("").unwrap(), RdzvConf::default());
        let typo = parse_rdzv_conf("last_cal_timeout=7").unwrap_err();
        assert!(typo.contains("\"last_cal_timeout\""), "{typo}");
        let bad = parse_rdzv_conf("join_timeout=soon").unwrap_err();
        assert!(bad.contains("join_timeout=\"soon\""), "{bad}");
        assert!(parse_rdzv_conf("join_timeout=-1").is_err());
        assert!(parse_rdzv_conf("join_timeout=0").is_err());
        assert!(parse_rdzv_conf("join_timeout").is_err());
    }
}
