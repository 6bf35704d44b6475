//! Launch conventions shared with torchrun and friends: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` in the environment; rank 0 serves the rendezvous store at the master
//! address. `refit launch` also gives every rank `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, the
//! topology file (`REFIT_TOPOLOGY`), the overrides of its keys (`REFIT_SET`), the cluster
//! token (`REFIT_TOKEN`) and its incarnation (`REFIT_INCARNATION`).
//!
//! A rank reads its place with [`LaunchEnv::from_env`] and its topology with
//! [`load_topology`] (the file with the launch's overrides applied: every rank parses the
//! same topology the launcher checked).
//!
//! The launcher itself is library code too: [`scheduler_hosts`] gives the hosts a file
//! leaves without `addr` the addresses of Slurm's nodes or a Kubernetes StatefulSet's pods,
//! [`resolve_rank`] reads torchrun's, Slurm's or the pod's variables, [`LaunchSpec`] turns a
//! topology into what to start for each rank ([`RankSpawn`]), and [`Supervisor`] starts and
//! watches them (restarts, `on_failure`, signals passed on).

mod check;
mod child;
mod plan;
mod resolve;
mod scheduler;
mod supervise;

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use refit_runtime::topology::{Override, Topology};

use crate::error::{Error, Result};

pub use check::{
    ANSWER_WITHIN, CHECK_ENV, CHECK_PASSED, CHECK_STARTED, Verdict, announce_check,
    announce_passed, build_hint, cannot_start, check_rank, checking, error_cause,
};
pub use plan::{LaunchSpec, PYTHON_ENV, RankSpawn, free_port, interpreter};
pub use resolve::{DEFAULT_MASTER_PORT, resolve_rank, scheduler_incarnation};
pub use scheduler::{
    K8S_NAMESPACE_ENV, K8S_POD_ENV, K8S_SERVICE_ENV, Scheduler, SchedulerHosts, scheduler_hosts,
};
pub use supervise::{RankState, Supervisor};

/// The absolute path of the topology file, set by `refit launch` for every rank.
pub const TOPOLOGY_ENV: &str = "REFIT_TOPOLOGY";
/// The overrides of topology keys (`refit launch --set`), one `key=value` per line
/// ([`Override::join_lines`]); empty when there are none.
pub const SET_ENV: &str = "REFIT_SET";
/// How many times this rank was started before (0 for the first start, n after the nth
/// restart): a rank above 0 rejoins a running job.
pub const INCARNATION_ENV: &str = "REFIT_INCARNATION";
/// The rank's index among the ranks on its host (torchrun's name).
pub const LOCAL_RANK_ENV: &str = "LOCAL_RANK";
/// How many ranks run on the rank's host (torchrun's name).
pub const LOCAL_WORLD_SIZE_ENV: &str = "LOCAL_WORLD_SIZE";

/// The topology of this launch: the file `REFIT_TOPOLOGY` names, with the overrides of
/// `REFIT_SET` applied, validated (what every rank calls first; the launcher parsed the
/// same text with the same overrides).
///
/// # Errors
/// [`Error::Launch`] when `REFIT_TOPOLOGY` is not set or `REFIT_SET` holds a bad line; the
/// core's [`Path`](refit_runtime::Error::Path) error when the file cannot be read and its
/// [`Topology`](refit_runtime::Error::Topology) error naming the key when it is refused.
pub fn load_topology() -> Result<Topology> {
    load_topology_from(|k| std::env::var(k).ok())
}

/// As [`load_topology`], reading the variables through `lookup`.
///
/// # Errors
/// As [`load_topology`].
pub fn load_topology_from(lookup: impl Fn(&str) -> Option<String>) -> Result<Topology> {
    if lookup(CHECK_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        announce_check();
    }
    let path: PathBuf = lookup(TOPOLOGY_ENV)
        .filter(|p| !p.trim().is_empty())
        .ok_or_else(|| Error::Launch {
            var: TOPOLOGY_ENV,
            reason: "not set (start this program with `refit launch FILE.toml`)".into(),
        })?
        .into();
    let overrides =
        Override::parse_lines(&lookup(SET_ENV).unwrap_or_default()).map_err(|e| Error::Launch {
            var: SET_ENV,
            reason: e.to_string(),
        })?;
    let text = std::fs::read_to_string(&path).map_err(|source| {
        Error::Core(refit_runtime::Error::Path {
            context: "reading the topology file (REFIT_TOPOLOGY)",
            path: path.clone(),
            source,
        })
    })?;
    Ok(Topology::parse_file_with(&text, &path, &overrides)?)
}

/// This rank's incarnation: `REFIT_INCARNATION`, 0 when unset (the first start).
///
/// # Errors
/// [`Error::Launch`] when the variable is not a number.
pub fn incarnation() -> Result<u32> {
    incarnation_from(|k| std::env::var(k).ok())
}

/// As [`incarnation`], reading the variable through `lookup`.
///
/// # Errors
/// As [`incarnation`].
pub fn incarnation_from(lookup: impl Fn(&str) -> Option<String>) -> Result<u32> {
    lookup(INCARNATION_ENV)
        .filter(|v| !v.trim().is_empty())
        .map_or(Ok(0), |raw| number(INCARNATION_ENV, &raw))
}

/// Where this process stands in a launched job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: u32,
    /// Number of processes in the job.
    pub world_size: u32,
    /// Host of the rank-0 process (name or address).
    pub master_addr: String,
    /// Port of the rendezvous store on the master.
    pub master_port: u16,
}

fn parse<T: std::str::FromStr>(
    var: &'static str,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<T> {
    let raw = lookup(var).ok_or_else(|| Error::Launch {
        var,
        reason: "not set".into(),
    })?;
    number(var, &raw)
}

/// `raw` (trimmed) as a number, or an error naming `var`.
pub(crate) fn number<T: std::str::FromStr>(var: &'static str, raw: &str) -> Result<T> {
    raw.trim().parse().map_err(|_| Error::Launch {
        var,
        reason: format!("{raw:?} is not a valid number"),
    })
}

impl LaunchEnv {
    /// Reads the four variables from the environment.
    ///
    /// # Errors
    /// [`Error::Launch`] naming the variable that is missing or bad, or a rank out of range.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the four variables through `lookup` (for tests and custom launchers).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let rank: u32 = parse("RANK", &lookup)?;
        let world_size: u32 = parse("WORLD_SIZE", &lookup)?;
        if world_size == 0 {
            return Err(Error::Launch {
                var: "WORLD_SIZE",
                reason: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(Error::Launch {
                var: "RANK",
                reason: format!("{rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let master_addr = lookup("MASTER_ADDR")
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| Error::Launch {
                var: "MASTER_ADDR",
                reason: "not set".into(),
            })?;
        let master_port: u16 = parse("MASTER_PORT", &lookup)?;
        if master_port == 0 {
            return Err(Error::Launch {
                var: "MASTER_PORT",
                reason: "port 0 cannot be reached".into(),
            });
        }
        Ok(Self {
            rank,
            world_size,
            master_addr,
            master_port,
        })
    }

    /// True for rank 0, which serves the store.
    pub fn is_master(&self) -> bool {
        self.rank == 0
    }

    /// The master's socket address (resolving a host name).
    ///
    /// # Errors
    /// [`Error::Launch`] when `MASTER_ADDR` does not resolve.
    pub fn master(&self) -> Result<SocketAddr> {
        (self.master_addr.as_str(), self.master_port)
            .to_socket_addrs()
            .map_err(|e| Error::Launch {
                var: "MASTER_ADDR",
                reason: format!("{:?} does not resolve: {e}", self.master_addr),
            })?
            .next()
            .ok_or_else(|| Error::Launch {
                var: "MASTER_ADDR",
                reason: format!("{:?} resolves to nothing", self.master_addr),
            })
    }

    /// The variables as `(name, value)` pairs, to hand to a child process.
    pub fn vars(&self) -> [(&'static str, String); 4] {
        [
            ("RANK", self.rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

/// An environment of the given variables alone, as the launch code reads one (the unit
/// tests of this module and its files).
#[cfg(test)]
pub(crate) fn test_env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let vars: std::collections::HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |k| vars.get(k).cloned()
}

#[cfg(test)]
mod tests {
    use super::test_env as env;
    use super::*;

    #[test]
    fn launch_variables_are_typed_and_named_when_bad() {
        let ok = [
            ("RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let l = LaunchEnv::from_lookup(env(&ok)).unwrap();
        assert_eq!((l.rank, l.world_size, l.master_port), (1, 3, 29500));
        assert!(!l.is_master());
        assert_eq!(l.master().unwrap().port(), 29500);
        let again = LaunchEnv::from_lookup(env(&l
            .vars()
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .collect::<Vec<_>>()))
        .unwrap();
        assert_eq!(again, l);
        let cases: [(&[(&str, &str)], &str); 5] = [
            (&ok[1..], "launch variable `RANK`: not set"),
            (
                &[("RANK", "x"), ok[1], ok[2], ok[3]],
                "launch variable `RANK`: \"x\" is not a valid number",
            ),
            (
                &[("RANK", "3"), ok[1], ok[2], ok[3]],
                "not below WORLD_SIZE 3",
            ),
            (&[ok[0], ok[1], ok[3]], "`MASTER_ADDR`: not set"),
            (
                &[ok[0], ok[1], ok[2], ("MASTER_PORT", "70000")],
                "`MASTER_PORT`",
            ),
        ];
        for (vars, want) in cases {
            let e = LaunchEnv::from_lookup(env(vars)).unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }

    #[test]
    fn ranks_load_the_topology_with_the_launch_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("topo.toml");
        std::fs::write(
            &path,
            "[run]\ncommand = [\"p\"]\n[[model]]\nid = \"m\"\n[[process]]\nname = \"learner\"\n\
             roles = [\"trainer\", \"controller\"]\n[[process]]\nname = \"actor\"\nroles = [\"engine\"]\n",
        )
        .unwrap();
        let p = path.to_string_lossy().into_owned();
        let t = load_topology_from(env(&[(TOPOLOGY_ENV, &p)])).unwrap();
        assert_eq!(t.world_size(), 2);
        let set = "process.actor.replicas=3\nsync.sync_mode=fully-async\n";
        let t = load_topology_from(env(&[(TOPOLOGY_ENV, &p), (SET_ENV, set)])).unwrap();
        assert_eq!(t.world_size(), 4);
        assert_eq!(t.sync.sync_mode.to_string(), "fully-async");
        // each fault is named: the variable, the file, the key
        let e = load_topology_from(env(&[])).unwrap_err().to_string();
        assert!(e.contains("`REFIT_TOPOLOGY`: not set"), "{e}");
        let e = load_topology_from(env(&[(TOPOLOGY_ENV, &p), (SET_ENV, "replicas")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("`REFIT_SET`") && e.contains("replicas"), "{e}");
        let e = load_topology_from(env(&[
            (TOPOLOGY_ENV, &p),
            (SET_ENV, "process.actor.replicas=0"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("process[actor].replicas") && e.contains("topo.toml"),
            "{e}"
        );
        let missing = dir
            .path()
            .join("missing.toml")
            .to_string_lossy()
            .into_owned();
        let e = load_topology_from(env(&[(TOPOLOGY_ENV, &missing)]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.toml"), "{e}");
    }

    #[test]
    fn the_incarnation_is_read_and_named_when_bad() {
        assert_eq!(incarnation_from(env(&[])).unwrap(), 0);
        assert_eq!(incarnation_from(env(&[(INCARNATION_ENV, "2")])).unwrap(), 2);
        let e = incarnation_from(env(&[(INCARNATION_ENV, "x")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`REFIT_INCARNATION`") && e.contains("\"x\""),
            "{e}"
        );
        // a per-rank launch under a scheduler that restarted the task
        assert_eq!(scheduler_incarnation(&env(&[])).unwrap(), 0);
        assert_eq!(
            scheduler_incarnation(&env(&[("SLURM_RESTART_COUNT", "3")])).unwrap(),
            3
        );
        assert_eq!(
            scheduler_incarnation(&env(&[
                ("TORCHELASTIC_RESTART_COUNT", "1"),
                (INCARNATION_ENV, "5")
            ]))
            .unwrap(),
            5
        );
        let e = scheduler_incarnation(&env(&[("SLURM_RESTART_COUNT", "-1")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("SLURM_RESTART_COUNT"), "{e}");
    }
}
