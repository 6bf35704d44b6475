//! What to start for each rank: the program (its process's `command`, else `[run] command`),
//! its arguments and its environment (the launch variables, the topology file and its
//! overrides, the token, the process's `env`).

use std::fmt;
use std::path::{Path, PathBuf};

use refit_runtime::topology::{Override, RankPlan, Topology};

use super::{
    INCARNATION_ENV, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV, LaunchEnv, SET_ENV, TOPOLOGY_ENV,
};
use crate::error::{Error, Result};
use crate::{ClusterToken, TOKEN_ENV};

/// What to start for one rank.
#[derive(Clone, PartialEq, Eq)]
pub struct RankSpawn {
    /// The rank.
    pub rank: u32,
    /// Its process's name (in reports and output prefixes).
    pub name: String,
    /// The program: a relative path with a `/` is already resolved against the launch's
    /// directory; a bare name is looked up in `PATH` when started.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The environment it gets on top of the launcher's (`REFIT_INCARNATION` is added at
    /// each start; `REFIT_TOKEN_FILE` is removed).
    pub env: Vec<(String, String)>,
    /// How many times it may be restarted after a failure (0: never; rank 0 never is).
    pub max_restarts: u32,
    /// The `REFIT_INCARNATION` of its first start (each restart adds one).
    pub incarnation: u32,
}

impl fmt::Debug for RankSpawn {
    /// Everything but the token's value.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| {
                let v = if k == TOKEN_ENV { "<redacted>" } else { v };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("RankSpawn")
            .field("rank", &self.rank)
            .field("name", &self.name)
            .field("program", &self.program)
            .field("args", &self.args)
            .field("env", &env)
            .field("max_restarts", &self.max_restarts)
            .field("incarnation", &self.incarnation)
            .finish()
    }
}

/// What every rank of one launch shares: the topology (parsed with the overrides), its file,
/// the overrides, the cluster token and the directory relative programs resolve against.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// The topology, overrides applied.
    pub topology: Topology,
    /// The absolute path of its file (`REFIT_TOPOLOGY`).
    pub path: PathBuf,
    /// The overrides of its keys (`REFIT_SET`).
    pub overrides: Vec<Override>,
    /// The cluster token (`REFIT_TOKEN`).
    pub token: ClusterToken,
    /// The directory relative program paths are resolved against.
    pub cwd: PathBuf,
}

/// The variable naming the interpreter of Python ranks: a command whose program is
/// `python3` or `python` runs it instead (a virtual environment's, say), so a topology file
/// need not name one machine's path.
pub const PYTHON_ENV: &str = "REFIT_PYTHON";

/// The program a rank runs for the command's `program`: `python` (the value of
/// [`PYTHON_ENV`], when set and not empty) for `python3` and `python`, else `program`.
pub fn interpreter<'a>(program: &'a str, python: Option<&'a str>) -> &'a str {
    match python.map(str::trim).filter(|p| !p.is_empty()) {
        Some(p) if program == "python3" || program == "python" => p,
        _ => program,
    }
}

/// A relative program path with a `/` is resolved against `cwd`; a bare name is looked up
/// in `PATH` when started.
fn resolve_program(cwd: &Path, program: &str) -> PathBuf {
    let p = Path::new(program);
    if p.is_relative() && program.contains('/') {
        cwd.join(p)
    } else {
        p.to_path_buf()
    }
}

impl LaunchSpec {
    /// What to start for the rank `place` names, first started as `incarnation`.
    ///
    /// # Errors
    /// [`Error::Core`] (a topology error on `RANK`) when the rank is not in the topology;
    /// [`Error::Launch`] when its command is empty.
    pub fn rank(&self, place: &LaunchEnv, incarnation: u32) -> Result<RankSpawn> {
        let plan: RankPlan = self.topology.rank(place.rank)?;
        let Some((program, args)) = plan.command.split_first() else {
            return Err(Error::Launch {
                var: TOPOLOGY_ENV,
                reason: format!(
                    "rank {} (process `{}`) has no command",
                    place.rank, plan.process
                ),
            });
        };
        let mut env: Vec<(String, String)> = place
            .vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        env.extend([
            (LOCAL_RANK_ENV.to_string(), plan.local_rank.to_string()),
            (
                LOCAL_WORLD_SIZE_ENV.to_string(),
                plan.local_world_size.to_string(),
            ),
            (
                TOPOLOGY_ENV.to_string(),
                self.path.to_string_lossy().into_owned(),
            ),
            (SET_ENV.to_string(), Override::join_lines(&self.overrides)),
            (TOKEN_ENV.to_string(), self.token.expose().to_string()),
        ]);
        env.extend(plan.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        debug_assert!(env.iter().all(|(k, _)| k != INCARNATION_ENV));
        Ok(RankSpawn {
            rank: place.rank,
            name: plan.process.clone(),
            program: resolve_program(
                &self.cwd,
                interpreter(program, std::env::var(PYTHON_ENV).ok().as_deref()),
            ),
            args: args.to_vec(),
            env,
            max_restarts: if place.rank == 0 {
                0
            } else {
                plan.max_restarts
            },
            incarnation,
        })
    }

    /// What to start for every rank on this machine, meeting at rank 0's host address and
    /// `master_port`.
    ///
    /// # Errors
    /// As [`LaunchSpec::rank`]; the core's topology error when rank 0's host has no
    /// address.
    pub fn every_rank(&self, master_port: u16) -> Result<Vec<RankSpawn>> {
        let world_size = self.topology.world_size();
        let master_addr = self.topology.master_host()?.to_string();
        (0..world_size)
            .map(|rank| {
                let place = LaunchEnv {
                    rank,
                    world_size,
                    master_addr: master_addr.clone(),
                    master_port,
                };
                self.rank(&place, 0)
            })
            .collect()
    }
}

/// A port free right now on `addr` (or on every interface when `addr` is not local).
///
/// # Errors
/// [`Error::Core`] (I/O) when no port can be bound.
pub fn free_port(addr: &str) -> Result<u16> {
    let listener = std::net::TcpListener::bind((addr, 0))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", 0)))
        .map_err(|e| Error::io("finding a free port for MASTER_PORT", e))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| Error::io("finding a free port for MASTER_PORT", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_ranks_run_the_interpreter_refit_python_names() {
        let venv = Some("/venv/bin/python");
        assert_eq!(interpreter("python3", venv), "/venv/bin/python");
        assert_eq!(interpreter("python", venv), "/venv/bin/python");
        assert_eq!(interpreter("python3", None), "python3");
        assert_eq!(interpreter("python3", Some(" ")), "python3");
        assert_eq!(
            interpreter("python", Some(" /venv/bin/python ")),
            "/venv/bin/python"
        );
        // only the bare names: a path or another program is the file's own choice
        assert_eq!(interpreter("/usr/bin/python3", venv), "/usr/bin/python3");
        assert_eq!(
            interpreter("target/release/examples/grpo", venv),
            "target/release/examples/grpo"
        );
    }

    const FILE: &str = r#"
[run]
command = ["target/release/prog", "topology"]
[[model]]
id = "policy"
[[host]]
name = "a"
addr = "127.0.0.1"
[[host]]
name = "b"
addr = "127.0.0.2"
[[process]]
name = "learner"
host = "a"
roles = ["trainer", "controller"]
[[process]]
name = "actor"
host = "b"
replicas = 2
roles = ["engine", "rollout"]
command = ["sh", "-c", "echo $RANK"]
env = { MODE = "fast" }
restart = "on-failure"
max_restarts = 2
"#;

    fn spec(overrides: &[&str]) -> LaunchSpec {
        let overrides: Vec<Override> = overrides
            .iter()
            .map(|s| Override::parse(s).unwrap())
            .collect();
        LaunchSpec {
            topology: Topology::parse_with(FILE, &overrides).unwrap(),
            path: "/runs/topo.toml".into(),
            overrides,
            token: ClusterToken::new("plan-test-token-0123456789").unwrap(),
            cwd: "/work".into(),
        }
    }

    fn var<'a>(s: &'a RankSpawn, k: &str) -> &'a str {
        s.env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{k} not set"))
    }

    #[test]
    fn every_rank_gets_its_program_and_environment() {
        let spec = spec(&["sync.sync_mode=fully-async", "run.seed=3"]);
        let ranks = spec.every_rank(4242).unwrap();
        assert_eq!(ranks.len(), 3);
        let r0 = &ranks[0];
        assert_eq!(r0.program, Path::new("/work/target/release/prog"));
        assert_eq!(r0.args, ["topology"]);
        assert_eq!(r0.max_restarts, 0);
        for (r, s) in ranks.iter().enumerate() {
            assert_eq!(var(s, "RANK"), r.to_string());
            assert_eq!(var(s, "WORLD_SIZE"), "3");
            assert_eq!(var(s, "MASTER_ADDR"), "127.0.0.1");
            assert_eq!(var(s, "MASTER_PORT"), "4242");
            assert_eq!(var(s, TOPOLOGY_ENV), "/runs/topo.toml");
            assert_eq!(var(s, TOKEN_ENV), "plan-test-token-0123456789");
            assert_eq!(
                Override::parse_lines(var(s, SET_ENV)).unwrap(),
                spec.overrides
            );
            assert_eq!(s.incarnation, 0);
        }
        // LOCAL_RANK counts within each host: the learner alone on `a`, two actors on `b`
        let local: Vec<(&str, &str)> = ranks
            .iter()
            .map(|s| (var(s, LOCAL_RANK_ENV), var(s, LOCAL_WORLD_SIZE_ENV)))
            .collect();
        assert_eq!(local, [("0", "1"), ("0", "2"), ("1", "2")]);
        let r2 = &ranks[2];
        assert_eq!(r2.program, Path::new("sh"));
        assert_eq!(r2.args, ["-c", "echo $RANK"]);
        assert_eq!(var(r2, "MODE"), "fast");
        assert_eq!(r2.max_restarts, 2);
        // the token never shows in Debug
        let shown = format!("{r2:?}");
        assert!(
            !shown.contains("plan-test-token") && shown.contains("<redacted>"),
            "{shown}"
        );
    }

    #[test]
    fn one_rank_is_planned_with_its_incarnation() {
        let spec = spec(&[]);
        let place = LaunchEnv {
            rank: 1,
            world_size: 3,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
        };
        let s = spec.rank(&place, 4).unwrap();
        assert_eq!((s.rank, s.name.as_str(), s.incarnation), (1, "actor", 4));
        assert_eq!(var(&s, SET_ENV), "");
        assert_eq!(var(&s, "MASTER_ADDR"), "10.0.0.1");
        let e = spec
            .rank(&LaunchEnv { rank: 9, ..place }, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK") && e.contains('9'), "{e}");
    }

    #[test]
    fn every_variable_the_launcher_sets_is_reserved_from_a_process_env() {
        let spec = spec(&[]);
        let place = LaunchEnv {
            rank: 1,
            world_size: 3,
            master_addr: "10.0.0.1".into(),
            master_port: 29500,
        };
        let s = spec.rank(&place, 0).unwrap();
        let own = &spec.topology.rank(1).unwrap().env;
        let set: Vec<&str> = s
            .env
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| !own.contains_key(*k))
            .chain([INCARNATION_ENV, crate::TOKEN_FILE_ENV])
            .collect();
        assert!(set.len() > 4, "{set:?}");
        for k in set {
            assert!(
                refit_runtime::topology::RESERVED_ENV.contains(&k),
                "the launcher sets {k}, which a process env could override"
            );
        }
    }

    #[test]
    fn programs_resolve_against_the_launch_directory() {
        let cwd = Path::new("/work/run");
        assert_eq!(
            resolve_program(cwd, "target/release/x"),
            Path::new("/work/run/target/release/x")
        );
        assert_eq!(resolve_program(cwd, "./x"), Path::new("/work/run/./x"));
        assert_eq!(resolve_program(cwd, "sh"), Path::new("sh"));
        assert_eq!(resolve_program(cwd, "/bin/sh"), Path::new("/bin/sh"));
    }

    #[test]
    fn a_free_port_is_found() {
        assert_ne!(free_port("127.0.0.1").unwrap(), 0);
        // an address not on this machine falls back to every interface
        assert_ne!(free_port("192.0.2.1").unwrap(), 0);
    }
}
