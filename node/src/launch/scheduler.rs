//! Host addresses from the scheduler. A topology's `[[host]]` without `addr` takes the
//! address of the scheduler's host at the same position in the file's host list:
//!
//! - under **Slurm**, the step's node list (`SLURM_STEP_NODELIST`, else the job's,
//!   `SLURM_JOB_NODELIST`), expanded as `scontrol show hostnames` does: with
//!   `node[01-03]`, the file's first host is `node01`, its second `node02`;
//! - under **Kubernetes**, the pods of a StatefulSet behind a headless Service (named by
//!   `REFIT_K8S_SERVICE`): the file's host *i* is pod *i*, reached at its DNS name
//!   `SET-i.SERVICE` (`SET-i.SERVICE.NAMESPACE.svc` with `REFIT_K8S_NAMESPACE`). Each pod
//!   runs one rank: the one the file places on its host.
//!
//! The launcher turns the addresses into overrides (`host[a].addr="node01"`), which every
//! rank applies with the launch's other overrides (`REFIT_SET`), so every rank reads the
//! same addresses. A host that writes its `addr` keeps it.

use refit_runtime::topology::{Override, Topology};

use crate::error::{Error, Result};
use crate::slurm;

/// The headless Service of a Kubernetes StatefulSet whose pods run the ranks (its name);
/// set, it makes the launch take host addresses and ranks from the pods.
pub const K8S_SERVICE_ENV: &str = "REFIT_K8S_SERVICE";
/// This pod's name, `SET-ORDINAL` (the downward API's `metadata.name`); `HOSTNAME` when
/// unset, which a StatefulSet's pod gets as its own name.
pub const K8S_POD_ENV: &str = "REFIT_K8S_POD";
/// The pods' namespace (the downward API's `metadata.namespace`), when their DNS names
/// should name it: `SET-i.SERVICE.NAMESPACE.svc`.
pub const K8S_NAMESPACE_ENV: &str = "REFIT_K8S_NAMESPACE";

/// The scheduler a launch runs under, as far as hosts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduler {
    /// Slurm: the expanded node list and the node this task runs on.
    Slurm {
        /// The variable the list came from (`SLURM_STEP_NODELIST` or `SLURM_JOB_NODELIST`).
        var: &'static str,
        /// The list as Slurm wrote it.
        list: String,
        /// Its hosts, in order.
        nodes: Vec<String>,
        /// The node this task runs on (`SLURMD_NODENAME`), when known.
        this_node: Option<String>,
    },
    /// Kubernetes: pod `SET-ORDINAL` of a StatefulSet behind a headless Service.
    Kubernetes {
        /// The variable the pod's name came from (`REFIT_K8S_POD` or `HOSTNAME`).
        var: &'static str,
        /// The StatefulSet's name (the pods' names without their ordinal).
        set: String,
        /// This pod's ordinal.
        ordinal: usize,
        /// The headless Service's name.
        service: String,
        /// The namespace, when the DNS names should carry it.
        namespace: Option<String>,
    },
}

impl Scheduler {
    /// The scheduler whose variables are set: Kubernetes with `REFIT_K8S_SERVICE`, else
    /// Slurm with `SLURM_STEP_NODELIST` or `SLURM_JOB_NODELIST`, else `None`. `lookup`
    /// reads a variable (empty ones count as unset).
    ///
    /// # Errors
    /// [`Error::Launch`] naming the variable: a bad Slurm node list, a pod name that is not
    /// `SET-ORDINAL`, or no pod name at all.
    pub fn detect(lookup: &impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if let Some(service) = get(K8S_SERVICE_ENV) {
            let (var, pod) = match (get(K8S_POD_ENV), get("HOSTNAME")) {
                (Some(p), _) => (K8S_POD_ENV, p),
                (None, Some(p)) => ("HOSTNAME", p),
                (None, None) => {
                    return Err(Error::Launch {
                        var: K8S_POD_ENV,
                        reason: format!(
                            "not set (nor HOSTNAME), while {K8S_SERVICE_ENV} is: this pod's \
                             name gives its ordinal"
                        ),
                    });
                }
            };
            let (set, ordinal) = pod_ordinal(&pod).ok_or_else(|| Error::Launch {
                var,
                reason: format!(
                    "{pod:?} is not the name of a StatefulSet's pod (NAME-ORDINAL, as `refit-0`)"
                ),
            })?;
            return Ok(Some(Self::Kubernetes {
                var,
                set: set.to_string(),
                ordinal,
                service,
                namespace: get(K8S_NAMESPACE_ENV),
            }));
        }
        for var in ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"] {
            if let Some(list) = get(var) {
                return Ok(Some(Self::Slurm {
                    var,
                    nodes: slurm::expand_nodelist(var, &list)?,
                    list,
                    this_node: get("SLURMD_NODENAME"),
                }));
            }
        }
        Ok(None)
    }

    /// The address of its host number `i` (0-based, the file's host order); `None` past the
    /// end of a Slurm node list.
    pub fn host(&self, i: usize) -> Option<String> {
        match self {
            Self::Slurm { nodes, .. } => nodes.get(i).cloned(),
            Self::Kubernetes {
                set,
                service,
                namespace,
                ..
            } => Some(match namespace {
                Some(ns) => format!("{set}-{i}.{service}.{ns}.svc"),
                None => format!("{set}-{i}.{service}"),
            }),
        }
    }

    /// Where the addresses come from, for messages.
    pub fn describe(&self) -> String {
        match self {
            Self::Slurm { var, list, .. } => format!("{var} `{list}`"),
            Self::Kubernetes { set, service, .. } => {
                format!("the pods of StatefulSet `{set}` behind Service `{service}`")
            }
        }
    }
}

/// `refit-12` → (`refit`, 12).
fn pod_ordinal(pod: &str) -> Option<(&str, usize)> {
    let (set, ordinal) = pod.rsplit_once('-')?;
    if set.is_empty() || ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((set, ordinal.parse().ok()?))
}

/// The hosts a scheduler gave addresses to, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerHosts {
    /// The scheduler.
    pub scheduler: Scheduler,
    /// Each host of the file that had no `addr` (its index in the file and its name), and
    /// the address it takes.
    pub filled: Vec<(usize, String, String)>,
}

impl SchedulerHosts {
    /// The overrides that give each host its address (`host[NAME].addr="ADDRESS"`), to
    /// apply with the launch's own (every rank gets them in `REFIT_SET`).
    ///
    /// # Errors
    /// The core's topology error for a host name no override key can hold.
    pub fn overrides(&self) -> Result<Vec<Override>> {
        self.filled
            .iter()
            .map(|(_, name, addr)| {
                // a quoted TOML string: a node named `1000` stays a string
                let quoted = format!("\"{}\"", addr.replace('\\', "\\\\").replace('"', "\\\""));
                Ok(Override::new(&format!("host[{name}].addr"), &quoted)?)
            })
            .collect()
    }

    /// `a = node01, b = node02`, for the launcher's report.
    pub fn summary(&self) -> String {
        self.filled
            .iter()
            .map(|(_, name, addr)| format!("{name} = {addr}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Checks that the scheduler runs `rank` where the file places it, when its host's
    /// address came from the scheduler: under Slurm on the node of its host's position in
    /// the node list (`SLURMD_NODENAME`); under Kubernetes in the pod of its host's
    /// position.
    ///
    /// # Errors
    /// [`Error::Launch`] naming the variable that shows the task elsewhere, and how to place
    /// it.
    pub fn check_rank(&self, topo: &Topology, rank: u32) -> Result<()> {
        let plan = topo.rank(rank)?;
        let Some((index, host, addr)) = self.filled.iter().find(|(_, h, _)| *h == plan.host.name)
        else {
            return Ok(());
        };
        match &self.scheduler {
            Scheduler::Slurm {
                var,
                this_node: Some(node),
                ..
            } if node != addr => Err(Error::Launch {
                var: "SLURMD_NODENAME",
                reason: format!(
                    "Slurm started rank {rank} (process `{}`) on node `{node}`, but the file \
                     places it on host `{host}`, node {} of {var} (`{addr}`): ask Slurm for \
                     one task per rank in the file's order (`srun --ntasks-per-node=N` with \
                     the file's N ranks per host, the default block distribution)",
                    plan.process,
                    index + 1
                ),
            }),
            Scheduler::Kubernetes { set, ordinal, .. } if ordinal != index => Err(Error::Launch {
                var: "RANK",
                reason: format!(
                    "rank {rank} (process `{}`) runs in pod `{set}-{ordinal}`, but the file \
                         places it on host `{host}`, pod `{set}-{index}`",
                    plan.process
                ),
            }),
            _ => Ok(()),
        }
    }
}

/// The addresses a scheduler gives to the hosts of `topo` that have no `addr`: `None` when
/// every host has one (nothing to fill), else the scheduler and each such host's address.
///
/// # Errors
/// [`Error::Launch`]: a host without `addr` and no scheduler's variables (naming the host
/// and what to set), a Slurm node list with fewer nodes than the file has hosts (naming the
/// first host without a node), or the errors of [`Scheduler::detect`].
pub fn scheduler_hosts(
    topo: &Topology,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<SchedulerHosts>> {
    let Some(first) = topo.hosts.iter().find(|h| h.addr.is_none()) else {
        return Ok(None);
    };
    let Some(scheduler) = Scheduler::detect(lookup)? else {
        return Err(Error::Launch {
            var: "SLURM_JOB_NODELIST",
            reason: format!(
                "not set (nor {K8S_SERVICE_ENV}), and host `{}` has no `addr`: the file leaves \
                 its hosts' addresses to a scheduler; start it under Slurm (srun) or in a \
                 Kubernetes StatefulSet, or write the addresses (`--set host.{}.addr=ADDRESS`)",
                first.name, first.name
            ),
        });
    };
    let mut filled = Vec::new();
    for (i, h) in topo.hosts.iter().enumerate() {
        if h.addr.is_some() {
            continue;
        }
        let Some(addr) = scheduler.host(i) else {
            // only a node list ends
            let (var, nodes) = match &scheduler {
                Scheduler::Slurm { var, nodes, .. } => (*var, nodes.len()),
                Scheduler::Kubernetes { .. } => (K8S_SERVICE_ENV, i),
            };
            return Err(Error::Launch {
                var,
                reason: format!(
                    "{} names {nodes} host{}, and the file's host `{}` is its host number {}: \
                     ask for as many nodes as the file has hosts ({}), in its order",
                    scheduler.describe(),
                    if nodes == 1 { "" } else { "s" },
                    h.name,
                    i + 1,
                    topo.hosts.len()
                ),
            });
        };
        filled.push((i, h.name.clone(), addr));
    }
    Ok(Some(SchedulerHosts { scheduler, filled }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::test_env as env;

    /// Three hosts, the middle one with its address written; one rank on each.
    const TOPO: &str = r#"
            [run]
            command = ["p"]
            [[model]]
            id = "m"
            [[host]]
            name = "a"
            [[host]]
            name = "b"
            addr = "10.9.0.2"
            [[host]]
            name = "c"
            [[process]]
            name = "learner"
            host = "a"
            roles = ["trainer", "controller"]
            [[process]]
            name = "actor-c"
            host = "c"
            roles = ["engine"]
            [[process]]
            name = "actor-b"
            host = "b"
            roles = ["engine"]
            "#;

    fn topo() -> Topology {
        Topology::parse(TOPO).unwrap()
    }

    fn filled(h: &SchedulerHosts) -> Vec<(&str, &str)> {
        h.filled
            .iter()
            .map(|(_, n, a)| (n.as_str(), a.as_str()))
            .collect()
    }

    #[test]
    fn slurm_hosts_take_the_node_list_in_file_order() {
        let t = topo();
        let h = scheduler_hosts(
            &t,
            &env(&[
                ("SLURM_JOB_NODELIST", "gpu[1-9]"),
                ("SLURM_STEP_NODELIST", "node[07-08],login1"),
            ]),
        )
        .unwrap()
        .unwrap();
        // the step's list wins over the job's; `b` keeps its own address
        assert_eq!(filled(&h), [("a", "node07"), ("c", "login1")]);
        assert_eq!(h.summary(), "a = node07, c = login1");
        let over = h.overrides().unwrap();
        assert_eq!(over[0].to_string(), "host[a].addr=\"node07\"");
        // applied, every host has its address
        let t2 = Topology::parse_with(TOPO, &over).unwrap();
        let addrs: Vec<&str> = t2.hosts.iter().map(|h| h.address().unwrap()).collect();
        assert_eq!(addrs, ["node07", "10.9.0.2", "login1"]);
        assert_eq!(t2.master_host().unwrap(), "node07");
        // a numeric node name stays a string
        let h = scheduler_hosts(&t, &env(&[("SLURM_JOB_NODELIST", "[1000-1002]")]))
            .unwrap()
            .unwrap();
        let t3 = Topology::parse_with(TOPO, &h.overrides().unwrap()).unwrap();
        assert_eq!(t3.master_host().unwrap(), "1000");
    }

    #[test]
    fn a_file_with_every_address_needs_no_scheduler() {
        let t = Topology::parse(
            "[run]\ncommand = [\"p\"]\n[[model]]\nid = \"m\"\n[[process]]\nname = \"l\"\n\
             roles = [\"trainer\", \"controller\", \"engine\"]\n",
        )
        .unwrap();
        assert_eq!(
            scheduler_hosts(&t, &env(&[("SLURM_JOB_NODELIST", "n1")])).unwrap(),
            None
        );
    }

    #[test]
    fn missing_schedulers_and_short_lists_are_named() {
        let e = scheduler_hosts(&topo(), &env(&[])).unwrap_err().to_string();
        assert!(
            e.contains("SLURM_JOB_NODELIST")
                && e.contains(K8S_SERVICE_ENV)
                && e.contains("host `a` has no `addr`"),
            "{e}"
        );
        let e = scheduler_hosts(&topo(), &env(&[("SLURM_STEP_NODELIST", "n1")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`SLURM_STEP_NODELIST`")
                && e.contains("names 1 host,")
                && e.contains("host `c`")
                && e.contains("(3)"),
            "{e}"
        );
        let e = scheduler_hosts(&topo(), &env(&[("SLURM_JOB_NODELIST", "n[3-1]")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("SLURM_JOB_NODELIST") && e.contains("backwards"),
            "{e}"
        );
    }

    #[test]
    fn kubernetes_hosts_are_the_statefulsets_pods() {
        let t = topo();
        let vars = [(K8S_SERVICE_ENV, "refit"), ("HOSTNAME", "trainer-run-2")];
        let h = scheduler_hosts(&t, &env(&vars)).unwrap().unwrap();
        assert_eq!(
            h.scheduler,
            Scheduler::Kubernetes {
                var: "HOSTNAME",
                set: "trainer-run".into(),
                ordinal: 2,
                service: "refit".into(),
                namespace: None
            }
        );
        assert_eq!(
            filled(&h),
            [("a", "trainer-run-0.refit"), ("c", "trainer-run-2.refit")]
        );
        // the downward API's pod name and namespace win over HOSTNAME
        let h = scheduler_hosts(
            &t,
            &env(&[
                (K8S_SERVICE_ENV, "svc"),
                (K8S_POD_ENV, "refit-1"),
                ("HOSTNAME", "other-7"),
                (K8S_NAMESPACE_ENV, "rl"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(filled(&h)[0], ("a", "refit-0.svc.rl.svc"));
        for bad in ["refit", "refit-", "-3", "refit-x1"] {
            let e = scheduler_hosts(&t, &env(&[(K8S_SERVICE_ENV, "s"), (K8S_POD_ENV, bad)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(K8S_POD_ENV) && e.contains("NAME-ORDINAL"), "{e}");
        }
        let e = scheduler_hosts(&t, &env(&[(K8S_SERVICE_ENV, "s")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(K8S_POD_ENV) && e.contains("HOSTNAME"), "{e}");
    }

    #[test]
    fn a_rank_the_scheduler_runs_elsewhere_is_refused() {
        let t = topo();
        // ranks: 0 learner on a (node 1), 1 actor-c on c (node 3), 2 actor-b on b (written)
        let slurm = |node: &str| {
            scheduler_hosts(
                &t,
                &env(&[("SLURM_STEP_NODELIST", "h[1-3]"), ("SLURMD_NODENAME", node)]),
            )
            .unwrap()
            .unwrap()
        };
        slurm("h1").check_rank(&t, 0).unwrap();
        slurm("h3").check_rank(&t, 1).unwrap();
        // rank 2's host has its own address: nothing to check
        slurm("h1").check_rank(&t, 2).unwrap();
        let e = slurm("h2").check_rank(&t, 1).unwrap_err().to_string();
        assert!(
            e.contains("SLURMD_NODENAME")
                && e.contains("rank 1 (process `actor-c`) on node `h2`")
                && e.contains("host `c`, node 3 of SLURM_STEP_NODELIST (`h3`)"),
            "{e}"
        );
        let k8s = |pod: &str| {
            scheduler_hosts(&t, &env(&[(K8S_SERVICE_ENV, "s"), (K8S_POD_ENV, pod)]))
                .unwrap()
                .unwrap()
        };
        k8s("r-2").check_rank(&t, 1).unwrap();
        let e = k8s("r-1").check_rank(&t, 1).unwrap_err().to_string();
        assert!(e.contains("pod `r-1`") && e.contains("pod `r-2`"), "{e}");
    }
}
