//! What one rank of a topology does first, under `refit launch`: read its place from the
//! launch variables and its plan from the topology file, then meet the other ranks at the
//! rendezvous store that rank 0 serves.
//!
//! ```text
//! cargo build --example topology_rank
//! cargo run --bin refit -- launch examples/topologies/ranks.toml
//! ```
//!
//! Each rank prints its process, host, roles and the transport weights take from the
//! trainer (rank 0) to it; rank 0 then prints the roll call of every rank.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use refit::node::{ClusterToken, Error, LaunchEnv, Node, NodeConfig, Result, Store, StoreClient};
use refit::runtime::Error as CoreError;
use refit::runtime::topology::Role;

fn main() -> ExitCode {
    if let Err(e) = refit::init() {
        eprintln!("topology_rank: error: {e}");
        return ExitCode::FAILURE;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("topology_rank: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    // ANCHOR: plan
    // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's names)
    let launch = LaunchEnv::from_env()?;
    // the file REFIT_TOPOLOGY names, with the launch's `--set` overrides (REFIT_SET)
    // applied: the topology the launcher checked
    let topo = refit::node::launch::load_topology()?;
    topo.check_links(refit::transports::link::reach_of)?;
    let plan = topo.rank(launch.rank)?;
    let roles: Vec<&str> = plan.roles.iter().map(|r| r.as_str()).collect();
    // the link factory turns the file's choice (`auto`: the reach the link needs) into a
    // transport
    let model = topo.model_ids()[0].clone();
    let trainer = topo.trainer_ranks(&model)[0];
    let link =
        refit::transports::link::for_kind(&topo.weights_transport(&model, trainer, launch.rank))?;
    println!(
        "process `{}` copy {} on host `{}` ({}), roles {}; weights from rank {trainer} over {}",
        plan.process,
        plan.replica,
        plan.host.name,
        plan.host.address()?,
        roles.join("+"),
        link.name(),
    );
    // ANCHOR_END: plan

    // ANCHOR: check
    // `refit launch` runs each rank program once with REFIT_CHECK=1 before any rank starts
    // (`load_topology` said `refit-check: started`): a program that does not go on to
    // `run::join` says the file passed once it checked what it needs, and starts nothing
    if refit::node::launch::checking() {
        refit::node::launch::announce_passed();
        return Ok(());
    }
    // ANCHOR_END: check

    // ANCHOR: rendezvous
    // REFIT_TOKEN: the cluster token every node presents
    let token = ClusterToken::from_env()?.ok_or(Error::Launch {
        var: "REFIT_TOKEN",
        reason: "not set".into(),
    })?;
    let master = launch.master()?;
    // rank 0 serves the store at MASTER_ADDR:MASTER_PORT; the others listen on their host
    let bind = if launch.is_master() {
        master
    } else {
        SocketAddr::new(master.ip(), 0)
    };
    let node = Node::start(NodeConfig::loopback(token).with_bind(bind))?;
    if launch.is_master() {
        Store::serve(&node);
    }
    let store = connect(&node, master, topo.wait())?;
    store.set(&format!("rank/{}", launch.rank), plan.process.as_bytes())?;
    if plan.has(Role::Controller) {
        // the controller waits for every rank to check in, then lets them go
        let keys: Vec<String> = (0..launch.world_size)
            .map(|r| format!("rank/{r}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        store.wait(&keys, topo.wait())?;
        for r in 0..launch.world_size {
            let name = store.get(&format!("rank/{r}"))?.unwrap_or_default();
            println!("rank {r}: {} checked in", String::from_utf8_lossy(&name));
        }
        store.set("go", b"1")?;
        // and serves the store until every other rank has seen it
        let others = i64::from(launch.world_size) - 1;
        let deadline = Instant::now() + topo.wait();
        while store.add("seen", 0)? < others {
            if Instant::now() >= deadline {
                return Err(CoreError::Timeout {
                    what: "every rank to see the go".into(),
                    after: topo.wait(),
                }
                .into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    } else {
        store.wait_get("go", topo.wait())?;
        store.add("seen", 1)?;
    }
    // ANCHOR_END: rendezvous
    Ok(())
}

/// Connects to the store, retrying while rank 0 is still starting (until `wait`).
fn connect(node: &Node, master: SocketAddr, wait: Duration) -> Result<StoreClient> {
    let deadline = Instant::now() + wait;
    loop {
        match StoreClient::connect(node, master, wait) {
            Ok(store) => return Ok(store.with_timeout(wait)),
            Err(Error::Core(CoreError::Io { .. })) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}
