//! The launchers ("agents", as torchrun calls them) of an elastic job on several nodes, as the
//! ranks' rendezvous store sees them, so that the job ends at a point every agent agrees on.
//!
//! The store of an elastic job lives in node 0's launcher (ddprun hosts a PyTorch `TCPStore`).
//! A rank that another node's launcher restarts after the job's last step (it was killed
//! after it committed that step, before it said so) must still find that store: there it
//! reads that the job is over ([`crate::ElasticGroup::join`] returns `Ok(None)`) and exits 0.
//! So node 0's launcher keeps the store until every other launcher has seen the end: each
//! other launcher registers in the store when it starts, beats while it runs
//! ([`AgentPresence`]) and says when it leaves (its ranks are gone for good, so none of them
//! will use the store again); node 0's launcher reads that from its own store
//! ([`AgentWatch`]), and takes a launcher whose beat stopped for [`AGENT_SILENCE`] for gone
//! (its node died hard), so that it never waits forever.
//!
//! Every other launcher also hosts a standby store and publishes it here (`standby.rs`); when
//! node 0 is lost, the ranks move to the lowest live standby, each other launcher's presence
//! follows them there, and the launcher whose standby it is keeps it as node 0's did.
//!
//! Keys, under [`AGENTS_PREFIX`] (the job's, across its rounds): `node/<n>` (node n's launcher
//! registered), `beat/<n>` (a counter it adds 1 to every [`AGENT_BEAT`]), `left/<n>` (it
//! left), `next_node` (the node ranks handed out to launchers started without one,
//! [`next_node_rank`]), the standby stores' `standby/...` (`standby.rs`) and, at the job's
//! first address once its store moved, `moved` (`redirect.rs`).

use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::CommError;
use crate::membership::standby::{
    connect_first, publish, raise_to, reachable, read_moved, MovedStore, Standby, StandbyReader,
};
use crate::rendezvous::store::Store;
use crate::rendezvous::torch_store_server::TorchStoreHost;

/// The key prefix of the launchers' keys in the ranks' store (as the keys travel).
pub const AGENTS_PREFIX: &str = "/ddprun/agents/";

/// How often a launcher beats.
pub const AGENT_BEAT: Duration = Duration::from_millis(500);

/// A launcher whose beat has not moved for this long is gone (its node died hard).
pub const AGENT_SILENCE: Duration = Duration::from_secs(10);

/// Deadline of one store call of a launcher's beat thread.
const CALL: Duration = Duration::from_secs(10);

/// How long [`AgentPresence`]'s drop waits for its thread to say in the store that it left.
const LEAVE: Duration = Duration::from_secs(5);

/// Where the job's store moved, once it did: `(host, port)`.
type Moved = Arc<Mutex<Option<(String, u16)>>>;

/// A launcher that does not host the store, in the store of its elastic job: registered, and
/// beating from a thread of its own, until it is dropped, which says that it left (see the
/// module documentation).
pub struct AgentPresence {
    /// Closing it (drop) tells the thread to say that this launcher left.
    stop: Option<mpsc::Sender<()>>,
    /// The thread says through this that it wrote `left/<n>` (or gave up).
    left: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
    /// Where the thread followed the job's store, once it moved.
    moved: Moved,
}

impl std::fmt::Debug for AgentPresence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentPresence").finish_non_exhaustive()
    }
}

impl AgentPresence {
    /// Registers node `node`'s launcher in the store at `addr:port` and beats every `beat`,
    /// from a thread of its own: the thread connects (retrying until `connect_by`: node 0's
    /// launcher may start later) and registers. Never blocks; an unreachable store only means
    /// that node 0's launcher will not wait for this one. With `standby` (the address the
    /// other nodes reach this one at, `None` for the one this launcher reaches the store from,
    /// and the port of this launcher's standby store, `standby.rs`), the thread first publishes
    /// it, sealed with `secret`; and when the store is
    /// lost it follows the job's ranks to the standby they move to (the lowest node's that
    /// accepts a connection) and registers and beats there.
    pub fn start(
        node: usize,
        (addr, port): (&str, u16),
        beat: Duration,
        connect_by: Instant,
        standby: Option<(Option<String>, u16)>,
        secret: Option<String>,
    ) -> Result<AgentPresence, CommError> {
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let (left_tx, left) = mpsc::channel::<()>();
        let addr = addr.to_string();
        let moved = Arc::new(Mutex::new(None));
        let moved_here = moved.clone();
        let thread = std::thread::Builder::new()
            .name("ddprun-elastic-presence".into())
            .spawn(move || {
                let store = Store::connect_torch(
                    node,
                    &addr,
                    port,
                    AGENTS_PREFIX.to_string(),
                    connect_by,
                    CALL,
                );
                if let Ok(store) = store {
                    let mine = standby.map(|(host, port)| Standby {
                        node,
                        host: host.unwrap_or_else(|| store.local_addr().ip().to_string()),
                        port,
                    });
                    let to = (mine, secret, moved_here);
                    follow(store, (node, &addr, port), beat, &stop_rx, to);
                }
                let _ = left_tx.send(());
            })
            .map_err(|e| CommError::Internal {
                rank: node,
                message: format!("cannot start the launcher's presence thread: {e}"),
            })?;
        Ok(AgentPresence {
            stop: Some(stop_tx),
            left,
            thread: Some(thread),
            moved,
        })
    }

    /// Where the job's store is now when it moved off the address this launcher was given
    /// (the store's node was lost, and this launcher followed the ranks to a standby), as
    /// `(host, port)`: a rank restarted from now on is given it.
    pub fn moved_to(&self) -> Option<(String, u16)> {
        self.moved.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Publishes `mine` (this launcher's standby, if any) and registers and beats in `store` (node
/// `node`'s launcher; the store at `addr:port`) until `stop` closes; when the store is lost (a
/// beat fails and nothing accepts a connection at its address any more), moves to the standby
/// the ranks move to, says so in `moved`, and does the same there; when the store says that the
/// job's store moved elsewhere (a `moved` record, `redirect.rs`: this launcher started after
/// the move, at the job's first address), leaves it and does the same there.
fn follow(
    mut store: Store,
    (node, addr, port): (usize, &str, u16),
    beat: Duration,
    stop: &mpsc::Receiver<()>,
    (mine, secret, moved): (Option<Standby>, Option<String>, Moved),
) {
    let mut reader = StandbyReader::new("", secret.clone());
    let standbys = Mutex::new(Vec::new());
    let mut lost: Vec<String> = Vec::new();
    let (mut host, mut port) = (addr.to_string(), port);
    let say_moved = |host: &str, port: u16| {
        *moved.lock().unwrap_or_else(|p| p.into_inner()) = Some((host.to_string(), port));
    };
    loop {
        if let Some(mine) = &mine {
            if let Err(e) = publish(&store, "", mine, secret.as_deref()) {
                tracing::warn!("ddprun: cannot publish node {node}'s standby store: {e}");
            }
        }
        let ended = match store.add(&format!("node/{node}"), 1) {
            Ok(_) => present(
                &store,
                node,
                beat,
                stop,
                (&mut reader, secret.as_deref()),
                &standbys,
            ),
            Err(_) => Presence::Failed,
        };
        match ended {
            Presence::Left => return,
            Presence::Redirected(to) => {
                // Left here (an add: answered), so that this store's host does not wait for it.
                let _ = store.add(&format!("left/{node}"), 1);
                let by = Instant::now() + CALL;
                let prefix = AGENTS_PREFIX.to_string();
                match Store::connect_torch(node, &to.host, to.port, prefix, by, CALL) {
                    Ok(next) => {
                        tracing::warn!(
                            "ddprun: node {node}'s launcher found the elastic job's store moved \
                             from {} to {}:{}; following it there",
                            store.address(),
                            to.host,
                            to.port
                        );
                        say_moved(&to.host, to.port);
                        (store, host, port) = (next, to.host, to.port);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(
                            "ddprun: node {node}'s launcher cannot reach the job's moved store: \
                             {e}"
                        );
                        return;
                    }
                }
            }
            Presence::Failed => {}
        }
        if reachable(&host, port) {
            return;
        }
        lost.push(store.address().to_string());
        let list = standbys.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some((standby, next)) = connect_first(&list, &mut lost, node, AGENTS_PREFIX, CALL)
        else {
            return;
        };
        tracing::warn!(
            "ddprun: node {node}'s launcher lost the store at {}; following the job to node \
             {}'s standby at {}",
            store.address(),
            standby.node,
            standby.address()
        );
        // An agent that takes its node rank in the moved store (`next_node_rank`, through a
        // `moved` record) gets none of the survivors'.
        let _ = raise_to(&next, "next_node", node as i64);
        say_moved(&standby.host, standby.port);
        (store, host, port) = (next, standby.host, standby.port);
    }
}

/// The node rank of a launcher of an elastic job started without one (torchrun's c10d
/// rendezvous: every agent runs the same command line), from the store at `addr:port` that
/// the agent which could host it holds as node 0: the count of launchers that asked so far,
/// `next_node` under [`AGENTS_PREFIX`] (1 for the first, 2 for the next, ...), so that no two
/// agents of the job get the same node rank, whatever order they start in. Retries connecting
/// until `connect_by` (the hosting agent may start later). When the store there says that the
/// job's store moved (a `moved` record sealed with `DDP_TOKEN`, `redirect.rs`), the counter is
/// the moved store's, which the agents that followed the move raised to their node ranks.
pub fn next_node_rank(addr: &str, port: u16, connect_by: Instant) -> Result<usize, CommError> {
    let prefix = AGENTS_PREFIX.to_string();
    let mut store = Store::connect_torch(0, addr, port, prefix.clone(), connect_by, CALL)?;
    let secret = crate::launcher::vars::job_token();
    if let Some(to) = read_moved(&store, secret.as_deref())? {
        store = Store::connect_torch(0, &to.host, to.port, prefix, connect_by, CALL)?;
    }
    let n = store.add("next_node", 1)?;
    usize::try_from(n)
        .ok()
        .filter(|&n| n >= 1)
        .ok_or_else(|| CommError::Store {
            rank: 0,
            addr: format!("{addr}:{port}"),
            message: format!("the launchers' node counter ({AGENTS_PREFIX}next_node) gave {n}"),
        })
}

/// How a launcher's presence in a store ended.
enum Presence {
    /// `stop` closed: it said that it left.
    Left,
    /// A beat failed.
    Failed,
    /// The store holds a `moved` record: the job is elsewhere.
    Redirected(MovedStore),
}

/// Beats until `stop` closes, then says that this launcher left; or until a beat fails, or the
/// store says that the job's store moved (a `moved` record sealed with `secret`); keeps
/// `standbys` up to date meanwhile.
fn present(
    store: &Store,
    node: usize,
    beat: Duration,
    stop: &mpsc::Receiver<()>,
    (reader, secret): (&mut StandbyReader, Option<&str>),
    standbys: &Mutex<Vec<Standby>>,
) -> Presence {
    let key = format!("beat/{node}");
    let mut beats = 0u32;
    loop {
        if store.add(&key, 1).is_err() {
            return Presence::Failed;
        }
        if let Ok(Some(to)) = read_moved(store, secret) {
            return Presence::Redirected(to);
        }
        let _ = reader.refresh(store, standbys);
        // Ten beats a second for the first 50 (the other agents publish their standbys as the
        // job starts: a store lost in its first seconds is followed where the ranks go, not to
        // a standby this launcher alone knows), then every `beat`.
        beats += 1;
        let every = match beats < 50 {
            true => beat.min(Duration::from_millis(100)),
            false => beat,
        };
        match stop.recv_timeout(every) {
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            _ => break,
        }
    }
    // An add, not a set: its answer says the store holds it (a set is not answered).
    let _ = store.add(&format!("left/{node}"), 1);
    Presence::Left
}

impl Drop for AgentPresence {
    /// Says that this launcher left: waits (at most 5 s) for the thread to write it, so that
    /// node 0's launcher need not wait for this one's silence.
    fn drop(&mut self) {
        drop(self.stop.take());
        if self.left.recv_timeout(LEAVE).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// What node 0's launcher sees of the other launchers in the store it hosts.
#[derive(Debug)]
pub struct AgentWatch {
    /// Per node: the last beat count seen and when it last moved.
    beats: Vec<Option<(i64, Instant)>>,
    silence: Duration,
    /// The nodes whose launchers were silent for the silence at the last look, without having
    /// left: they died hard.
    lost: Vec<usize>,
    /// When a launcher's beat last moved between two looks (not counting the first look).
    moved: Option<Instant>,
}

impl AgentWatch {
    /// A watch over the launchers of nodes `1..nnodes`; one silent for `silence` is gone.
    pub fn new(nnodes: usize, silence: Duration) -> AgentWatch {
        AgentWatch {
            beats: vec![None; nnodes],
            silence,
            lost: Vec::new(),
            moved: None,
        }
    }

    /// The nodes whose launchers had gone silent for the silence at the last
    /// [`present`](Self::present), registered and never having left: killed, or their hosts
    /// down or cut off.
    pub fn lost(&self) -> &[usize] {
        &self.lost
    }

    /// When another launcher's beat was last seen to move (between two looks), if ever: a
    /// launcher alive now has moved within its beat interval.
    pub fn last_moved(&self) -> Option<Instant> {
        self.moved
    }

    /// The silence after which a launcher is gone.
    pub fn silence(&self) -> Duration {
        self.silence
    }

    /// The nodes whose launchers node 0's launcher must still keep the store for: registered
    /// in `host`, not left, and beating within the silence (counted from this watch's first
    /// look at them). Call it repeatedly: silence is measured between calls.
    pub fn present(&mut self, host: &TorchStoreHost) -> Vec<usize> {
        let value = |key: String| host.value(&format!("{AGENTS_PREFIX}{key}"));
        let now = Instant::now();
        let mut present = Vec::new();
        self.lost.clear();
        for (node, seen) in self.beats.iter_mut().enumerate().skip(1) {
            if value(format!("node/{node}")).is_none() || value(format!("left/{node}")).is_some() {
                continue;
            }
            let count = value(format!("beat/{node}"))
                .and_then(|v| String::from_utf8(v).ok())
                .and_then(|v| v.trim().parse::<i64>().ok())
                .unwrap_or(0);
            match seen {
                Some((last, since)) if *last == count => {
                    if now.duration_since(*since) >= self.silence {
                        self.lost.push(node);
                        continue;
                    }
                }
                Some(_) => {
                    self.moved = Some(now);
                    *seen = Some((count, now));
                }
                None => *seen = Some((count, now)),
            }
            present.push(node);
        }
        present
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn host() -> TorchStoreHost {
        TorchStoreHost::start(TcpListener::bind("127.0.0.1:0").unwrap()).unwrap()
    }

    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "{what}: not within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A launcher is present from its registration until it leaves (its drop says so).
    #[test]
    fn a_launcher_is_present_until_it_leaves() {
        let host = host();
        let mut watch = AgentWatch::new(3, Duration::from_secs(10));
        assert!(watch.present(&host).is_empty());
        let by = Instant::now() + Duration::from_secs(10);
        let two = AgentPresence::start(2, ("127.0.0.1", host.port()), AGENT_BEAT, by, None, None)
            .unwrap();
        until("node 2 registered", || watch.present(&host) == vec![2]);
        let one = AgentPresence::start(1, ("127.0.0.1", host.port()), AGENT_BEAT, by, None, None)
            .unwrap();
        until("node 1 registered", || watch.present(&host) == vec![1, 2]);
        drop(two);
        assert_eq!(watch.present(&host), vec![1], "left at once on drop");
        drop(one);
        assert!(watch.present(&host).is_empty());
    }

    /// A launcher that beats is present past the silence; one that stops beating without
    /// leaving (its node died hard) is gone after the silence, counted from the watch's first
    /// look.
    #[test]
    fn a_silent_launcher_is_gone_after_the_silence() {
        let host = host();
        let by = Instant::now() + Duration::from_secs(10);
        let silence = Duration::from_millis(300);
        let mut watch = AgentWatch::new(3, silence);
        let beating = AgentPresence::start(
            1,
            ("127.0.0.1", host.port()),
            Duration::from_millis(50),
            by,
            None,
            None,
        )
        .unwrap();
        until("node 1 registered", || watch.present(&host) == vec![1]);
        // What a launcher killed by SIGKILL leaves: a registration and a beat, then nothing.
        let store =
            Store::connect_torch(2, "127.0.0.1", host.port(), AGENTS_PREFIX.into(), by, CALL)
                .unwrap();
        store.add("node/2", 1).unwrap();
        store.add("beat/2", 1).unwrap();
        let started = Instant::now();
        assert_eq!(watch.present(&host), vec![1, 2]);
        until("node 2 gone", || watch.present(&host) == vec![1]);
        assert!(started.elapsed() >= silence, "{:?}", started.elapsed());
        assert_eq!(watch.lost(), [2], "node 2 died hard");
        std::thread::sleep(silence * 2);
        assert_eq!(watch.present(&host), vec![1], "node 1 still beats");
        assert!(watch.last_moved().is_some_and(|t| t.elapsed() < silence));
        drop(beating);
        assert_eq!(
            watch.present(&host),
            Vec::<usize>::new(),
            "{:?}",
            host.keys()
        );
        assert_eq!(watch.lost(), [2], "node 1 left, node 2 is still lost");
    }
}
