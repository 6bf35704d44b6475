//! `run::join` refuses launch variables that do not fit the topology, naming them, before
//! anything starts.
#![allow(clippy::unwrap_used, missing_docs)]

fn two_rank_topology(rank0_roles: &str) -> refit_runtime::topology::Topology {
    refit_runtime::topology::Topology::parse(&format!(
        r#"
        [run]
        command = ["x", "topology"]
        [[model]]
        id = "policy"
        [[process]]
        name = "learner"
        roles = [{rank0_roles}]
        [[process]]
        name = "actor"
        roles = ["engine", "rollout"]
        "#
    ))
    .unwrap()
}

fn launch(rank: u32, world_size: u32) -> refit_node::LaunchEnv {
    refit_node::LaunchEnv {
        rank,
        world_size,
        master_addr: "127.0.0.1".into(),
        master_port: 29_999,
    }
}

#[test]
fn join_refuses_launch_variables_and_placements_that_do_not_fit_naming_them() {
    use refit_actors::CartPolePpo;
    use refit_actors::run as cluster;
    let topo = two_rank_topology(r#""trainer", "controller""#);
    let e = cluster::join(&topo, &launch(0, 3), CartPolePpo::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("WORLD_SIZE is 3") && e.contains("2 ranks"),
        "{e}"
    );
    let e = cluster::join(&topo, &launch(2, 2), CartPolePpo::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("RANK"), "{e}");
}
