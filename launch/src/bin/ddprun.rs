//! `ddprun`: start the local ranks of a distributed job, like `torchrun`.
//!
//! ```text
//! ddprun --nproc-per-node 4 -- target/release/train-mnist --epochs 1
//! ddprun --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -- CMD...
//! ddprun --nnodes 2:3 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 --max-restarts 3 -- CMD...
//! ddprun --nnodes 2:3 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job --max-restarts 3 -- CMD...
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` (and `DDP_JOB_ID`); its output lines come out prefixed with `[rank R]`. When a
//! rank fails, the others are stopped and ddprun exits non-zero, naming the root cause last (the
//! rank the first failure's error blames, else the first rank to fail), with its error message
//! and where every rank was (flight records). `kill -USR1` of ddprun
//! prints where every rank is without stopping the job. With `--max-restarts N`, a failure
//! restarts all local ranks (up to N times) instead of ending the job; trainers given a
//! `--checkpoint-dir` then resume from their last checkpoint.
//! Like torchrun, ddprun takes `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,
//! `PET_MASTER_ADDR`, `PET_MASTER_PORT` and `PET_MAX_RESTARTS` (what Kubeflow's PyTorchJob sets)
//! as the defaults of the flags not given (a given flag's variable is not read), and
//! `--nproc-per-node auto`, `cpu` or `gpu` as torchrun does. `--nnodes MIN:MAX` (or
//! `PET_NNODES=MIN:MAX`) runs an elastic job: a failed rank is restarted alone and rejoins,
//! the survivors go on without it (see the `ddp_launch` crate documentation). Like torchrun's agent, it hosts the
//! rendezvous store on `MASTER_PORT` itself (`TORCHELASTIC_USE_AGENT_STORE=True`), so that a
//! PyTorch program starts under it as under torchrun.
//! All the work is in the `ddp_launch` library; this binary only parses arguments.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use ddp_launch::{self as launch, GivenFlags, LaunchConfig, LaunchError, PetDefaults};

/// Start N local ranks of a distributed job with the torchrun environment variables set.
#[derive(Debug, Parser)]
#[command(
    name = "ddprun",
    version,
    override_usage = "ddprun [OPTIONS] -- <CMD>..."
)]
struct Args {
    /// Ranks to start on this node: a number, or torchrun's `auto` (one per GPU, else one per
    /// CPU), `cpu` (one per CPU this process may use) or `gpu` (one per GPU; an error without
    /// any) [default: PET_NPROC_PER_NODE, else 1].
    #[arg(long, alias = "nproc_per_node", value_name = "N", value_parser = launch::nproc_per_node)]
    nproc_per_node: Option<usize>,
    /// Nodes in the job; more than 1 needs --master-addr and --master-port. `MIN:MAX` makes an
    /// elastic job: it runs while at least MIN nodes' ranks are up; a rank that fails is
    /// restarted alone (within --max-restarts) and rejoins the running job, the others go on
    /// (the ranks get DDP_ELASTIC=MIN:MAX in ranks; the trainers follow it) [default:
    /// PET_NNODES, else 1].
    #[arg(long, value_name = "M|MIN:MAX", value_parser = node_count)]
    nnodes: Option<(usize, usize)>,
    /// This node's index, 0 to nnodes-1; RANK = node_rank * nproc_per_node + LOCAL_RANK
    /// [default: PET_NODE_RANK, else 0].
    #[arg(long, alias = "node_rank", value_name = "K")]
    node_rank: Option<usize>,
    /// Address of the node with node rank 0 [default: PET_MASTER_ADDR, else on a single node
    /// 127.0.0.1].
    #[arg(long, alias = "master_addr", value_name = "ADDR")]
    master_addr: Option<String>,
    /// Port of the rendezvous store [default: PET_MASTER_PORT, else on a single node a free
    /// port].
    #[arg(long, alias = "master_port", value_name = "PORT")]
    master_port: Option<u16>,
    /// One node, a free port: what ddprun does without --nnodes anyway; accepted so that a
    /// torchrun command line works as it is (torchrun's underscore spellings, such as
    /// --nproc_per_node, are accepted too).
    #[arg(long, conflicts_with_all = ["nnodes", "node_rank", "master_addr", "master_port"])]
    standalone: bool,
    /// torchrun's rendezvous backend: `c10d` (with --nnodes MIN:MAX and no --node-rank, every
    /// agent runs the same command line and takes its node rank at the rendezvous: the one on
    /// the endpoint's host that can bind its port hosts the store and is node 0, the others
    /// count themselves in that store) or `static` (the node rank is --node-rank's)
    /// [default: PET_RDZV_BACKEND, else static].
    #[arg(long, alias = "rdzv_backend", value_name = "c10d|static", value_parser = launch::rdzv_backend)]
    rdzv_backend: Option<String>,
    /// torchrun's rendezvous endpoint, HOST:PORT or HOST (port 29400): the
    /// rendezvous store's address, as --master-addr and --master-port [default:
    /// PET_RDZV_ENDPOINT].
    #[arg(long, alias = "rdzv_endpoint", value_name = "HOST:PORT", value_parser = launch::parse_endpoint,
          conflicts_with_all = ["master_addr", "master_port", "standalone"])]
    rdzv_endpoint: Option<(String, u16)>,
    /// torchrun's rendezvous id: the job's id, as --job-id [default: PET_RDZV_ID].
    #[arg(long, alias = "rdzv_id", value_name = "ID")]
    rdzv_id: Option<String>,
    /// The address the other nodes reach this node at (torchrun's flag): an elastic job on
    /// several nodes publishes this node's standby store there, where the job's store moves if
    /// node 0 is lost [default: the address this node reaches the rendezvous store from].
    #[arg(long, alias = "local_addr", value_name = "ADDR")]
    local_addr: Option<String>,
    /// torchrun's rendezvous settings, KEY=VALUE[,KEY=VALUE...]: `last_call_timeout=S` (how
    /// long the founding of an elastic job waits for more processes once MIN joined; the ranks
    /// get DDP_ELASTIC_LAST_CALL) and `join_timeout=S` (how long a rank tries to join; the ranks
    /// get DDP_CONNECT_TIMEOUT); torchrun's other c10d keys are accepted and have no effect
    /// [default: PET_RDZV_CONF].
    #[arg(long, alias = "rdzv_conf", value_name = "KEY=VALUE,...", value_parser = launch::parse_rdzv_conf)]
    rdzv_conf: Option<launch::RdzvConf>,
    /// Job id exported as DDP_JOB_ID [default on a single node: generated].
    #[arg(long, value_name = "ID")]
    job_id: Option<String>,
    /// Seconds between SIGTERM and SIGKILL when stopping the ranks.
    #[arg(long, value_name = "SECS", default_value_t = 5.0)]
    grace_period: f64,
    /// Restart all local ranks up to N times when one fails (0: stop the job at the first
    /// failure). Each restart is a new rendezvous round (new MASTER_PORT on a single node unless
    /// --master-port is given, new DDP_JOB_ID) with TORCHELASTIC_RESTART_COUNT set to the number
    /// of restarts so far; the trainers then resume from their --checkpoint-dir on their own.
    /// With --nnodes MIN:MAX a failed rank is restarted alone, from the same budget, and sees
    /// TORCHELASTIC_RESTART_COUNT count it.
    /// SIGINT/SIGTERM to ddprun never restarts. On several nodes the ddpruns restart together:
    /// node 0's hosts a store on --master-port + 1 through which the first node to see a
    /// failure moves every node to the next round.
    /// [default: PET_MAX_RESTARTS, else 0]
    #[arg(long, alias = "max_restarts", value_name = "N")]
    max_restarts: Option<usize>,
    /// The command each rank runs, and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// `--nnodes`: a count, or an elastic range `MIN:MAX`.
fn node_count(text: &str) -> Result<(usize, usize), String> {
    ddp_comm::parse_range(text).ok_or_else(|| {
        format!("{text:?}: expected a count of at least 1, or MIN:MAX with 1 <= MIN <= MAX")
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    let grace_period = match Duration::try_from_secs_f64(args.grace_period) {
        Ok(grace) => grace,
        Err(_) => {
            eprintln!("ddprun: error: --grace-period must be a non-negative number of seconds");
            return ExitCode::from(2);
        }
    };
    // torchrun's options as PET_* variables (Kubeflow's PyTorchJob sets them): the defaults of
    // the flags not given, as torchrun takes them; a given flag's variable is not read at all.
    // --standalone stands for one node with a free port, so it counts as giving those flags.
    let given = GivenFlags {
        nnodes: args.nnodes.is_some() || args.standalone,
        nproc_per_node: args.nproc_per_node.is_some(),
        node_rank: args.node_rank.is_some() || args.standalone,
        master_addr: args.master_addr.is_some() || args.standalone,
        master_port: args.master_port.is_some() || args.standalone,
        max_restarts: args.max_restarts.is_some(),
        rdzv_backend: args.rdzv_backend.is_some(),
        rdzv_endpoint: args.rdzv_endpoint.is_some() || args.standalone,
        rdzv_id: args.rdzv_id.is_some(),
        rdzv_conf: args.rdzv_conf.is_some(),
    };
    let pet = match PetDefaults::from_env(&given) {
        Ok(pet) => pet,
        Err(error) => {
            report(&error);
            return ExitCode::from(2);
        }
    };
    // torchrun's rendezvous options: the endpoint is the store's address (a flag wins over
    // every variable), and c10d without a node rank takes it at the rendezvous.
    let endpoint = args.rdzv_endpoint.or(pet.rdzv_endpoint);
    let (endpoint_addr, endpoint_port) = endpoint.map_or((None, None), |(a, p)| (Some(a), Some(p)));
    let node_rank = args.node_rank.or(pet.node_rank);
    let c10d = args.rdzv_backend.or(pet.rdzv_backend).as_deref() == Some("c10d");
    let rdzv_conf = args.rdzv_conf.or(pet.rdzv_conf).unwrap_or_default();
    if !rdzv_conf.ignored.is_empty() {
        eprintln!(
            "[ddprun] --rdzv-conf: {} have no effect here (ddprun's elastic membership has its \
             own: DDP_PEER_TIMEOUT, beats in the store)",
            rdzv_conf.ignored.join(", ")
        );
    }
    let config = LaunchConfig {
        nproc_per_node: args.nproc_per_node.or(pet.nproc_per_node).unwrap_or(1),
        nnodes: args.nnodes.map(|(_, max)| max).or(pet.nnodes).unwrap_or(1),
        min_nnodes: match args.nnodes {
            Some((min, max)) => (min < max).then_some(min),
            None => pet.min_nnodes,
        },
        node_rank: node_rank.unwrap_or(0),
        node_rank_at_rendezvous: c10d && node_rank.is_none(),
        master_addr: args.master_addr.or(endpoint_addr).or(pet.master_addr),
        master_port: args.master_port.or(endpoint_port).or(pet.master_port),
        local_addr: args.local_addr,
        last_call: rdzv_conf.last_call,
        join_timeout: rdzv_conf.join_timeout,
        job_id: args.job_id.or(args.rdzv_id).or(pet.rdzv_id),
        command: args.command,
        grace_period,
        forward_signals: true,
        max_restarts: args.max_restarts.or(pet.max_restarts).unwrap_or(0),
        launcher: "ddprun".to_string(),
    };
    match launch::launch(&config) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            report(&error);
            ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(1))
        }
    }
}

/// Prints the error as the last thing on stderr: for a failed rank, the root-cause box
/// ([`launch::root_cause_box`]: the rank at fault, the first rank to fail when that is another,
/// its error in its own words, where every local rank was), framed so that it stands out after
/// the ranks' output.
fn report(error: &LaunchError) {
    match launch::root_cause_box(error) {
        Some(the_box) => eprintln!("{the_box}"),
        None => eprintln!("ddprun: error: {error}"),
    }
}
