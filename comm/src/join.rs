//! Joining a group: the steps every rank takes, in order, before its first collective
//! ([`join`]). The last step, a barrier over the new mesh, is the group's own (`group.rs`).
//!
//! 1. Rank 0 hosts the rendezvous store; every rank (rank 0 too) connects to it. With a
//!    launcher's job name, the store handshake carries its hash, so processes of other jobs are
//!    refused. Under torchrun's agent store nobody hosts one: every rank connects to the agent's
//!    PyTorch TCPStore, which has no handshake of ours, so the job id is agreed through the store
//!    alone (step 2) and first checked by the peers' handshakes (step 3).
//! 2. Rank 0 publishes the job id and its tuning; the others adopt them, so every rank runs the
//!    same algorithms. Each rank then claims its rank in the store: a second process with the
//!    same rank is refused.
//! 3. The full mesh of peer connections (`connect.rs`), then its threads (`transport/mesh.rs`).
//! 4. Shared memory between the ranks that share a host (`shm.rs`): all of them (it carries
//!    every collective), some (hierarchical, with TCP between hosts) or none (TCP alone). Every
//!    rank reaches the same verdict through the store.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use crate::clock::remaining;
use crate::config::{GroupConfig, MAX_SEGMENT_BYTES};
use crate::error::CommError;
use crate::flight::FlightRecorder;
use crate::rendezvous::connect::connect_mesh;
use crate::rendezvous::handshake::Identity;
use crate::rendezvous::store::Store;
use crate::rendezvous::store_server::StoreServer;
use crate::rendezvous::torch_store::agent_key_prefix;
use crate::transport::liveness::{Silence, StartupWatch};
use crate::transport::mesh::Mesh;
use crate::transport::shm::{ShmGroup, ShmSetup};
use crate::wire;

const JOB_ID_KEY: &str = "ddp/job_id";
const TUNING_KEY: &str = "ddp/tuning";

/// What a rank has once it joined: everything the group runs on.
pub(crate) struct Joined {
    pub store: Store,
    /// Rank 0's store server (kept alive with the group).
    pub server: Option<StoreServer>,
    pub mesh: Mesh,
    pub shm: Option<ShmGroup>,
    pub flight: Arc<FlightRecorder>,
    /// Rank 0's segment size and small-buffer threshold.
    pub segment_bytes: usize,
    pub small_bytes: usize,
}

/// Steps 1 to 4 of the module documentation for a group of several ranks; rank 0 hosts the
/// store on `listener` when given. Every step has the connect deadline. `startup`: what
/// vouches for a peer silent on its link until the start-up barrier passed (`liveness.rs`).
pub(crate) fn join(
    config: &GroupConfig,
    listener: Option<TcpListener>,
    loss_grace: std::time::Duration,
    startup: Option<Arc<StartupWatch>>,
) -> Result<Joined, CommError> {
    let rank = config.rank;
    let deadline = Instant::now() + config.connect_timeout;

    if config.store_scope.is_some() && config.torch_agent_store.is_none() {
        return Err(CommError::config(
            "store_scope",
            "a store scope needs an agent store (TORCHELASTIC_USE_AGENT_STORE=True, or the \
             builder's torch_agent_store)",
        ));
    }

    // 1.
    let named_job = config.job_id.as_deref().map(wire::job_id_from_name);
    let server = if rank == 0 && config.torch_agent_store.is_none() {
        Some(StoreServer::start(
            listener,
            &config.master_addr,
            config.master_port,
            config.world_size,
            config.token.clone(),
            named_job.unwrap_or([0; 16]),
        )?)
    } else {
        None
    };
    let mut me = Identity {
        rank,
        world: config.world_size,
        job_id: named_job.unwrap_or([0; 16]),
        token: config.token.clone(),
    };
    let store = match config.torch_agent_store {
        None => Store::connect(
            &me,
            &config.master_addr,
            config.master_port,
            deadline,
            config.timeout,
        )?,
        Some(restart) => Store::connect_torch(
            rank,
            &config.master_addr,
            config.master_port,
            format!(
                "{}{}",
                agent_key_prefix(restart),
                config.store_scope.as_deref().unwrap_or("")
            ),
            deadline,
            config.timeout,
        )?,
    };

    // 2.
    let (segment_bytes, small_bytes) = if rank == 0 {
        me.job_id = named_job.unwrap_or_else(new_job_id);
        publish_job_and_tuning(&store, config, &me.job_id)?
    } else {
        let (job_id, tuning) = adopt_job_and_tuning(&store, config, deadline)?;
        me.job_id = job_id;
        tuning
    };
    claim_rank(&store, rank)?;

    // 3.
    let local_ip = store.local_addr().ip();
    let streams = connect_mesh(&me, &store, local_ip, &config.master_addr, deadline)?;
    let flight = FlightRecorder::new(rank, config.world_size, config.trace_dir.clone());
    // Test hook: a process that starts slowly, its links made and not yet run.
    if let Some(hold) = startup.as_ref().and_then(|s| s.hold) {
        std::thread::sleep(hold);
    }
    let silence = Silence {
        peer_timeout: config.peer_timeout,
        startup,
    };
    let mesh = Mesh::start(
        rank,
        streams,
        config.timeout,
        silence,
        loss_grace,
        segment_bytes.max(8),
        flight.clone(),
    )?;
    tracing::debug!(
        "rank {rank}: joined a group of {} (job {})",
        config.world_size,
        wire::job_id_hex(&me.job_id)
    );

    // 4.
    let setup = ShmSetup {
        rank,
        world: config.world_size,
        job_id: &me.job_id,
        transport: config.transport,
        host_id: config.host_id.as_deref(),
        timeout: config.timeout,
        deadline,
    };
    let shm = ShmGroup::setup(&store, &setup)?;
    Ok(Joined {
        store,
        server,
        mesh,
        shm,
        flight,
        segment_bytes,
        small_bytes,
    })
}

/// Rank 0: publishes the job id and its tuning; returns the tuning.
fn publish_job_and_tuning(
    store: &Store,
    config: &GroupConfig,
    job_id: &[u8; 16],
) -> Result<(usize, usize), CommError> {
    let tuning = format!("{} {}", config.segment_bytes, config.small_allreduce_bytes);
    store.set(TUNING_KEY, tuning.as_bytes())?;
    store.set(JOB_ID_KEY, wire::job_id_hex(job_id).as_bytes())?;
    Ok((config.segment_bytes, config.small_allreduce_bytes))
}

/// The other ranks: wait for rank 0's job id and tuning, and check them.
fn adopt_job_and_tuning(
    store: &Store,
    config: &GroupConfig,
    deadline: Instant,
) -> Result<([u8; 16], (usize, usize)), CommError> {
    let rank = config.rank;
    let invalid = |message: String| CommError::Store {
        rank,
        addr: store.address().to_string(),
        message,
    };
    let raw = store.get_timeout(JOB_ID_KEY, remaining(deadline))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let job_id = wire::parse_job_id(&text)
        .ok_or_else(|| invalid(format!("invalid job id {text:?} in the store")))?;
    let raw = store.get_timeout(TUNING_KEY, remaining(deadline))?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let mut parts = text.split_whitespace().map(|p| p.parse::<usize>());
    match (parts.next(), parts.next()) {
        (Some(Ok(seg)), Some(Ok(small))) if seg > 0 && seg <= MAX_SEGMENT_BYTES => {
            if (seg, small) != (config.segment_bytes, config.small_allreduce_bytes) {
                tracing::debug!(
                    "rank {rank}: using rank 0's segment size {seg} and small-buffer threshold {small}"
                );
            }
            Ok((job_id, (seg, small)))
        }
        _ => Err(invalid(format!("invalid tuning {text:?} in the store"))),
    }
}

/// Claims `rank` in the store: a second process with the same rank is refused.
fn claim_rank(store: &Store, rank: usize) -> Result<(), CommError> {
    let joined = store.add(&format!("ddp/joined/{rank}"), 1)?;
    if joined != 1 {
        return Err(CommError::config(
            "RANK",
            format!(
                "two processes claim rank {rank} in the job at {}",
                store.address()
            ),
        ));
    }
    Ok(())
}

/// A fresh random job id (rank 0's, when the launcher names no job).
fn new_job_id() -> [u8; 16] {
    // RandomState is seeded from the operating system's randomness; mix in time and pid so that
    // two ids never collide even if that seeding were weak.
    let mut id = [0u8; 16];
    for (i, half) in id.chunks_mut(8).enumerate() {
        let mut h = RandomState::new().build_hasher();
        h.write_usize(i);
        h.write_u32(std::process::id());
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        half.copy_from_slice(&h.finish().to_le_bytes());
    }
    id
}
