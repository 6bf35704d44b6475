//! Which ranks a launch starts: all of them (no launch variables), or one, named by
//! `--rank`, `RANK`/`WORLD_SIZE` (torchrun), `SLURM_PROCID`/`SLURM_NTASKS` (Slurm) or the
//! pod's ordinal (a Kubernetes StatefulSet, `REFIT_K8S_SERVICE`).

use refit_runtime::topology::Topology;

use super::scheduler::{K8S_SERVICE_ENV, Scheduler};
use super::{LaunchEnv, number};
use crate::error::{Error, Result};
use crate::slurm;

/// The port of the rendezvous store when nothing names one in a per-rank launch (and rank
/// 0's process has no `port`).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Where a launch stands: `None` to start every rank here, or the one rank to start.
///
/// `flag_rank` (`--rank`) wins over `RANK`, which wins over `SLURM_PROCID`, which wins over
/// a Kubernetes pod's ordinal (with `REFIT_K8S_SERVICE` set, pod *i* runs the one rank the
/// file places on its host *i*); the world size comes from `WORLD_SIZE`, else
/// `SLURM_NTASKS`, else the topology, and must equal the topology's. `MASTER_ADDR` comes
/// from the variable, else (under Slurm) the first host of `SLURM_STEP_NODELIST` (or
/// `SLURM_JOB_NODELIST`), else rank 0's host in the file;
/// `MASTER_PORT` from `flag_port` (`--master-port`), else the variable, else rank 0's
/// `port` in the file, else [`DEFAULT_MASTER_PORT`]. `lookup` reads a variable (empty ones
/// count as unset).
///
/// # Errors
/// [`Error::Launch`] naming the variable that is bad, disagrees with the topology, or is
/// missing (`WORLD_SIZE` without `RANK` and the reverse).
pub fn resolve_rank(
    flag_rank: Option<u32>,
    flag_port: Option<u16>,
    topo: &Topology,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<LaunchEnv>> {
    let get = |k: &str| lookup(k).filter(|v| !v.trim().is_empty());
    let torch = get("RANK").is_some() || get("WORLD_SIZE").is_some();
    let slurm = !torch && get("SLURM_PROCID").is_some();
    let kube = get(K8S_SERVICE_ENV).is_some();
    if flag_rank.is_none() && !torch && !slurm && !kube {
        return Ok(None);
    }
    let (rank_var, world_var) = if slurm {
        ("SLURM_PROCID", "SLURM_NTASKS")
    } else {
        ("RANK", "WORLD_SIZE")
    };
    let pod_rank = match (flag_rank, get(rank_var)) {
        (None, None) if kube => Some(pod_rank(topo, lookup)?),
        _ => None,
    };
    let rank = match (flag_rank.or(pod_rank), get(rank_var)) {
        (Some(r), _) => r,
        (None, Some(raw)) => number(rank_var, &raw)?,
        (None, None) => {
            return Err(Error::Launch {
                var: rank_var,
                reason: format!("not set, while {world_var} is"),
            });
        }
    };
    let world_size = match get(world_var) {
        Some(raw) => number(world_var, &raw)?,
        None if flag_rank.is_some() || kube => topo.world_size(),
        None => {
            return Err(Error::Launch {
                var: world_var,
                reason: format!("not set, while {rank_var} is"),
            });
        }
    };
    if world_size != topo.world_size() {
        return Err(Error::Launch {
            var: world_var,
            reason: format!(
                "{world_size} does not match the topology's world size {} (its processes times their replicas)",
                topo.world_size()
            ),
        });
    }
    if rank >= world_size {
        return Err(Error::Launch {
            var: if flag_rank.is_some() {
                "--rank"
            } else {
                rank_var
            },
            reason: format!("{rank} is not below the world size {world_size}"),
        });
    }
    let master_addr = match get("MASTER_ADDR") {
        Some(a) => a.trim().to_string(),
        None if slurm => match (get("SLURM_STEP_NODELIST"), get("SLURM_JOB_NODELIST")) {
            (Some(list), _) => slurm::first_host("SLURM_STEP_NODELIST", &list)?,
            (None, Some(list)) => slurm::first_host("SLURM_JOB_NODELIST", &list)?,
            (None, None) => {
                return Err(Error::Launch {
                    var: "SLURM_STEP_NODELIST",
                    reason: "not set (nor MASTER_ADDR), so rank 0's host is unknown".into(),
                });
            }
        },
        None => topo.master_host()?.to_string(),
    };
    let master_port = match (flag_port, get("MASTER_PORT")) {
        (Some(p), _) => p,
        (None, Some(raw)) => number("MASTER_PORT", &raw)?,
        (None, None) => topo.ranks()[0].port.unwrap_or(DEFAULT_MASTER_PORT),
    };
    if master_port == 0 {
        return Err(Error::Launch {
            var: "MASTER_PORT",
            reason: "port 0 cannot be reached".into(),
        });
    }
    Ok(Some(LaunchEnv {
        rank,
        world_size,
        master_addr,
        master_port,
    }))
}

/// The rank of this Kubernetes pod: pod *i* runs the one rank the file places on its host
/// *i* (file order).
fn pod_rank(topo: &Topology, lookup: &impl Fn(&str) -> Option<String>) -> Result<u32> {
    let Some(Scheduler::Kubernetes {
        var, set, ordinal, ..
    }) = Scheduler::detect(lookup)?
    else {
        return Err(Error::Launch {
            var: K8S_SERVICE_ENV,
            reason: "set, but this is no Kubernetes pod".into(),
        });
    };
    let pod = format!("{set}-{ordinal}");
    let Some(host) = topo.hosts.get(ordinal) else {
        return Err(Error::Launch {
            var,
            reason: format!(
                "pod `{pod}` has no host in the file, which declares {} (give the StatefulSet \
                 as many replicas as the file has hosts)",
                topo.hosts.len()
            ),
        });
    };
    let ranks: Vec<u32> = topo
        .ranks()
        .iter()
        .filter(|r| r.host.name == host.name)
        .map(|r| r.rank)
        .collect();
    match ranks[..] {
        [rank] => Ok(rank),
        _ => Err(Error::Launch {
            var,
            reason: format!(
                "pod `{pod}` is host `{}`, where the file places {} ranks ({ranks:?}); in a \
                 StatefulSet each pod runs one rank: give each rank a host of its own",
                host.name,
                ranks.len()
            ),
        }),
    }
}

/// The incarnation of a per-rank launch's first start: `REFIT_INCARNATION`,
/// `SLURM_RESTART_COUNT` (a requeued Slurm job) or `TORCHELASTIC_RESTART_COUNT`, the first
/// set, else 0 (a scheduler that restarts the task says so through one of them).
///
/// # Errors
/// [`Error::Launch`] naming a variable that is not a number.
pub fn scheduler_incarnation(lookup: &impl Fn(&str) -> Option<String>) -> Result<u32> {
    for var in [
        super::INCARNATION_ENV,
        "SLURM_RESTART_COUNT",
        "TORCHELASTIC_RESTART_COUNT",
    ] {
        if let Some(raw) = lookup(var).filter(|v| !v.trim().is_empty()) {
            return number(var, &raw);
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::test_env as env;

    fn topo() -> Topology {
        Topology::parse(
            r#"
            [run]
            command = ["p"]
            [[model]]
            id = "m"
            [[host]]
            name = "a"
            addr = "10.1.0.1"
            [[process]]
            name = "learner"
            roles = ["trainer", "controller"]
            [[process]]
            name = "actor"
            replicas = 2
            roles = ["engine"]
            "#,
        )
        .unwrap()
    }

    fn err(r: Result<Option<LaunchEnv>>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn no_variables_start_every_rank() {
        assert_eq!(resolve_rank(None, None, &topo(), &env(&[])).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_pick_one_rank() {
        let e = resolve_rank(
            None,
            None,
            &topo(),
            &env(&[
                ("RANK", "2"),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "h0"),
                ("MASTER_PORT", "1234"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 2,
                world_size: 3,
                master_addr: "h0".into(),
                master_port: 1234
            }
        );
        // defaults: the file's master host, port 29500; the flag wins over the variable
        let e = resolve_rank(
            None,
            None,
            &topo(),
            &env(&[("RANK", "1"), ("WORLD_SIZE", "3")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.1.0.1", 29500));
        // --rank wins over RANK; the world size then defaults to the topology's
        let e = resolve_rank(
            Some(0),
            Some(7),
            &topo(),
            &env(&[("RANK", "1"), ("MASTER_PORT", "9")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size, e.master_port), (0, 3, 7));
        let e = resolve_rank(Some(2), Some(7), &topo(), &env(&[]))
            .unwrap()
            .unwrap();
        assert_eq!((e.rank, e.world_size, e.master_port), (2, 3, 7));
    }

    #[test]
    fn slurm_variables_pick_one_rank_and_the_first_host() {
        let e = resolve_rank(
            None,
            None,
            &topo(),
            &env(&[
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "3"),
                ("SLURM_STEP_NODELIST", "gpu[07-09],cpu1"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.world_size), (1, 3));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("gpu07", 29500));
        let e = resolve_rank(
            None,
            Some(4000),
            &topo(),
            &env(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "3"),
                ("SLURM_JOB_NODELIST", "n1"),
                ("MASTER_PORT", "5"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("n1", 4000));
    }

    #[test]
    fn bad_variables_are_named() {
        let t = topo();
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("RANK", "0"), ("WORLD_SIZE", "4")]),
        ));
        assert!(
            e.contains("WORLD_SIZE") && e.contains("world size 3"),
            "{e}"
        );
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("RANK", "x"), ("WORLD_SIZE", "3")]),
        ));
        assert!(e.contains("`RANK`") && e.contains("\"x\""), "{e}");
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("RANK", "3"), ("WORLD_SIZE", "3")]),
        ));
        assert!(e.contains("`RANK`") && e.contains("not below"), "{e}");
        let e = err(resolve_rank(None, None, &t, &env(&[("WORLD_SIZE", "3")])));
        assert!(e.contains("`RANK`: not set"), "{e}");
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_PORT", "http")]),
        ));
        assert!(e.contains("`MASTER_PORT`"), "{e}");
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]),
        ));
        assert!(
            e.contains("`SLURM_NTASKS`") && e.contains("world size 3"),
            "{e}"
        );
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "3")]),
        ));
        assert!(e.contains("SLURM_STEP_NODELIST"), "{e}");
        let e = err(resolve_rank(
            None,
            None,
            &t,
            &env(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "3"),
                ("SLURM_STEP_NODELIST", "n[2-1]"),
            ]),
        ));
        assert!(
            e.contains("SLURM_STEP_NODELIST") && e.contains("backwards"),
            "{e}"
        );
        let e = err(resolve_rank(Some(5), None, &t, &env(&[])));
        assert!(e.contains("`--rank`"), "{e}");
    }

    #[test]
    fn a_kubernetes_pod_runs_the_rank_on_its_host() {
        let text = r#"
            [run]
            command = ["p"]
            [[model]]
            id = "m"
            [[host]]
            name = "a"
            [[host]]
            name = "b"
            [[host]]
            name = "c"
            [[process]]
            name = "learner"
            host = "a"
            roles = ["trainer", "controller"]
            port = 29400
            [[process]]
            name = "actor-c"
            host = "c"
            roles = ["engine"]
            [[process]]
            name = "actor-b"
            host = "b"
            roles = ["engine"]
            "#;
        let pod = |name: &str| {
            let vars = [(K8S_SERVICE_ENV, "refit"), ("HOSTNAME", name)];
            let raw = Topology::parse(text).unwrap();
            let hosts = super::super::scheduler_hosts(&raw, &env(&vars))
                .unwrap()
                .unwrap();
            let t = Topology::parse_with(text, &hosts.overrides().unwrap()).unwrap();
            resolve_rank(None, None, &t, &env(&vars))
        };
        // pod 2 is host `c`, where actor-c (rank 1) runs; rank 0's pod is the master
        assert_eq!(
            pod("refit-2").unwrap().unwrap(),
            LaunchEnv {
                rank: 1,
                world_size: 3,
                master_addr: "refit-0.refit".into(),
                master_port: 29400
            }
        );
        assert_eq!(pod("refit-1").unwrap().unwrap().rank, 2);
        assert_eq!(pod("refit-0").unwrap().unwrap().rank, 0);
        let e = err(pod("refit-3"));
        assert!(
            e.contains("`HOSTNAME`") && e.contains("`refit-3` has no host") && e.contains("3"),
            "{e}"
        );
        // two ranks on one host cannot share a pod
        let two = text.replace(
            "name = \"actor-b\"\n            host = \"b\"",
            "name = \"actor-b\"\n            host = \"c\"",
        );
        assert_ne!(two, text);
        let vars = [(K8S_SERVICE_ENV, "refit"), ("HOSTNAME", "refit-2")];
        let raw = Topology::parse(&two).unwrap();
        let hosts = super::super::scheduler_hosts(&raw, &env(&vars))
            .unwrap()
            .unwrap();
        let t = Topology::parse_with(&two, &hosts.overrides().unwrap()).unwrap();
        let e = err(resolve_rank(None, None, &t, &env(&vars)));
        assert!(
            e.contains("host `c`") && e.contains("2 ranks ([1, 2])") && e.contains("one rank"),
            "{e}"
        );
    }

    #[test]
    fn rank_0s_fixed_port_is_the_default_master_port() {
        let t = Topology::parse(
            r#"
            [run]
            command = ["p"]
            [[model]]
            id = "m"
            [[process]]
            name = "learner"
            roles = ["trainer", "controller"]
            port = 41234
            [[process]]
            name = "actor"
            roles = ["engine"]
            "#,
        )
        .unwrap();
        let e = resolve_rank(None, None, &t, &env(&[("RANK", "1"), ("WORLD_SIZE", "2")]))
            .unwrap()
            .unwrap();
        assert_eq!(e.master_port, 41234);
        let e = resolve_rank(
            None,
            None,
            &t,
            &env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "7")]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(e.master_port, 7);
    }
}
