//! Unit tests' ranks: threads of this process, with process groups over loopback sockets.

use std::sync::Arc;
use std::time::Duration;

use ddp_comm::ProcessGroup;

/// Runs `f` on two ranks, one thread each, with process groups over loopback sockets.
pub(crate) fn two_ranks<T: Send>(f: impl Fn(Arc<ProcessGroup>) -> T + Sync) -> Vec<T> {
    ranks(2, f)
}

/// Runs `f` on `n` ranks, one thread each, with process groups over loopback sockets.
pub(crate) fn ranks<T: Send>(n: usize, f: impl Fn(Arc<ProcessGroup>) -> T + Sync) -> Vec<T> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let own = if rank == 0 { listener.take() } else { None };
                let f = &f;
                s.spawn(move || {
                    let mut builder = ProcessGroup::builder()
                        .no_env()
                        .rank(rank)
                        .world_size(n)
                        .master_addr("127.0.0.1")
                        .master_port(port)
                        .timeout(Duration::from_secs(30))
                        .connect_timeout(Duration::from_secs(30));
                    if let Some(l) = own {
                        builder = builder.master_listener(l);
                    }
                    f(Arc::new(builder.build().expect("process group")))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
