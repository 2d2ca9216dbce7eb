//! The README's example: join the group described by the environment and run a few
//! collectives. `cargo run --release -p ddp-comm --example quickstart` (one process) or
//! `ddprun --nproc-per-node 4 -- target/release/examples/quickstart`.

use ddp_comm::{ProcessGroup, ReduceOp};

fn main() -> Result<(), ddp_comm::CommError> {
    // Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ... (or Slurm's variables); with none
    // set, this is a group of one process that needs no sockets.
    let pg = ProcessGroup::from_env()?;
    println!("rank {} of {}", pg.rank(), pg.world_size());

    // Blocking: every rank gets the average of every rank's buffer.
    let grads = pg.all_reduce(vec![0.5f32; 1000], ReduceOp::Avg)?;
    assert_eq!(grads.len(), 1000);

    // Asynchronous: queued to the group's communication thread, run in submission order.
    let a = pg.submit_all_reduce(vec![1.0f32; 1 << 20], ReduceOp::Sum);
    let b = pg.submit_broadcast(vec![pg.rank() as u8; 16], 0);
    let (a, b) = (a.wait()?, b.wait()?);
    assert_eq!(b, vec![0u8; 16]);
    assert_eq!(a[0], pg.world_size() as f32);

    let everyone = pg.all_gather(vec![pg.rank() as i64])?; // [0, 1, ..., N-1]
    assert_eq!(everyone.len(), pg.world_size());
    pg.barrier()
}
