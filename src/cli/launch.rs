//! `refit launch <topology.toml>`: start every rank of a topology on this machine and
//! supervise them, or (with `RANK`/`WORLD_SIZE`, Slurm's variables or `--rank`) start just
//! this machine's rank of a multi-host run.
//!
//! Every rank gets `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `REFIT_TOPOLOGY`
//! (absolute path of the file) and `REFIT_TOKEN` (the cluster token) in its environment; with
//! `--metrics-addr HOST:PORT` also `REFIT_METRICS_ADDR=HOST:PORT+RANK`, where the rank serves
//! its update phase timings (each rank its own page: the engines' phases are recorded where
//! they run, and no process relays another's).

mod child;
mod mode;
mod supervise;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use refit::node::{ClusterToken, TOKEN_ENV, TOKEN_FILE_ENV};
use refit::runtime::topology::{OnFailure, Topology};
use refit::runtime::{Error, Result};

use child::RankSpawn;
pub(crate) use mode::RankEnv;

/// Arguments of `refit launch`.
#[derive(Debug, clap::Args)]
pub(crate) struct LaunchArgs {
    /// The topology file (TOML): processes, roles, hosts, models, sync policy, stop rule.
    topology: PathBuf,
    /// Port of the rendezvous store on rank 0's host. Default: a free port when every rank
    /// starts here; in a per-rank launch `MASTER_PORT`, else 29500.
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// Start only this rank (a per-rank launch), as if `RANK` were set.
    #[arg(long, value_name = "N")]
    rank: Option<u32>,
    /// Seconds the other ranks get to exit on their own once rank 0 is done, and to exit
    /// after SIGTERM before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    grace_s: f64,
    /// Each rank serves its update phase timings (Prometheus text) at
    /// `http://HOST:PORT+RANK/metrics`: rank 0 on PORT, rank 1 on PORT+1, and so on (port 0:
    /// a free port each, printed by every rank as `metrics: http://ADDR/metrics`).
    #[arg(long, value_name = "HOST:PORT")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// The address rank `rank` serves its metrics on: `base`'s port plus the rank (port 0 stays
/// 0: any free port).
fn rank_metrics_addr(base: std::net::SocketAddr, rank: u32) -> Result<std::net::SocketAddr> {
    if base.port() == 0 {
        return Ok(base);
    }
    let port = u16::try_from(u32::from(base.port()) + rank).map_err(|_| {
        Error::Config(format!(
            "--metrics-addr {base}: rank {rank}'s port is past 65535"
        ))
    })?;
    Ok(std::net::SocketAddr::new(base.ip(), port))
}

/// Runs `refit launch`.
pub(crate) fn run(args: &LaunchArgs) -> ExitCode {
    match launch(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("refit launch: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn launch(args: &LaunchArgs) -> Result<ExitCode> {
    if !(args.grace_s.is_finite() && args.grace_s >= 0.0 && args.grace_s < 1e6) {
        return Err(Error::Config(format!(
            "--grace-s must be a non-negative number of seconds, not {}",
            args.grace_s
        )));
    }
    let grace = Duration::from_secs_f64(args.grace_s);
    let path = absolute(&args.topology)?;
    let topo = Topology::parse_file(&refit::read_config(&path)?, &path)?;
    // the `[links]` transports are the link factory's: known, and reaching every engine
    topo.check_links(refit::transports::link::reach_of)
        .map_err(|e| match e {
            Error::Topology { key, reason } => Error::Topology {
                key,
                reason: format!("{reason}, in `{}`", path.display()),
            },
            other => other,
        })?;
    let given = ClusterToken::from_env()?;
    let token = given.clone().unwrap_or_else(ClusterToken::random);
    let cwd = std::env::current_dir().map_err(|e| Error::io("reading the current directory", e))?;
    let program = resolve_program(&cwd, &topo.run.command[0]);
    let spawn = |rank: u32, env: &RankEnv| -> Result<RankSpawn> {
        let plan = topo.rank(rank)?;
        let mut vars = env.vars(&path, &token);
        // the ranks get a metrics address only from this flag, never from the launcher's
        // own environment (they would all ask for the same one)
        let metrics = match args.metrics_addr {
            Some(base) => rank_metrics_addr(base, rank)?.to_string(),
            None => String::new(),
        };
        vars.push((refit::metrics_page::METRICS_ADDR_ENV.into(), metrics));
        Ok(RankSpawn {
            rank,
            name: plan.process,
            program: program.clone(),
            args: topo.run.command[1..].to_vec(),
            env: vars,
        })
    };
    let lookup = |k: &str| std::env::var(k).ok();
    let ranks = match mode::rank_env(args.rank, args.master_port, &topo, &lookup)? {
        Some(env) => {
            if given.is_none() && env.world_size > 1 {
                // each host's launcher would make its own token and the ranks would refuse
                // each other
                return Err(Error::from(refit::node::Error::Launch {
                    var: TOKEN_ENV,
                    reason: format!(
                        "not set (nor {TOKEN_FILE_ENV}): the ranks of a per-rank launch must share one cluster token; \
                         make one with `refit token FILE` and give it to every rank with {TOKEN_FILE_ENV}"
                    ),
                }));
            }
            eprintln!(
                "refit launch: rank {} of {} ({}) from {}; rendezvous at {}:{}",
                env.rank,
                env.world_size,
                topo.rank(env.rank)?.process,
                path.display(),
                env.master_addr,
                env.master_port
            );
            vec![spawn(env.rank, &env)?]
        }
        None => {
            let master_addr = topo.master_host().to_string();
            let master_port = match args.master_port {
                Some(p) => p,
                None => free_port(&master_addr)?,
            };
            eprintln!(
                "refit launch: {} ranks from {}; rendezvous at {master_addr}:{master_port}",
                topo.world_size(),
                path.display()
            );
            if topo.hosts.len() > 1 {
                eprintln!(
                    "refit launch: the file declares {} hosts, and every rank starts on this machine; \
                     to start one rank per host, run `refit launch` on each with RANK/WORLD_SIZE, \
                     Slurm's variables or --rank",
                    topo.hosts.len()
                );
            }
            (0..topo.world_size())
                .map(|rank| {
                    let env = RankEnv {
                        rank,
                        world_size: topo.world_size(),
                        master_addr: master_addr.clone(),
                        master_port,
                    };
                    spawn(rank, &env)
                })
                .collect::<Result<Vec<_>>>()?
        }
    };
    let on_failure = if ranks.len() == 1 {
        OnFailure::Abort
    } else {
        topo.run.on_failure
    };
    let sup = Arc::new(supervise::Supervisor::new(grace, on_failure));
    Ok(sup.run(&ranks))
}

/// `path` made absolute against the current directory (the file need not exist yet; reading
/// it reports a missing one).
fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).map_err(|source| Error::Path {
        context: "resolving the topology file",
        path: path.to_path_buf(),
        source,
    })
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

/// A port free right now on `addr` (or on every interface when `addr` is not local).
fn free_port(addr: &str) -> Result<u16> {
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
    fn programs_resolve_against_the_current_directory() {
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
    fn each_rank_serves_metrics_on_its_own_port() {
        let base: std::net::SocketAddr = "127.0.0.1:9100".parse().unwrap();
        assert_eq!(rank_metrics_addr(base, 0).unwrap(), base);
        assert_eq!(
            rank_metrics_addr(base, 3).unwrap(),
            "127.0.0.1:9103".parse().unwrap()
        );
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        assert_eq!(rank_metrics_addr(any, 5).unwrap(), any);
        let top: std::net::SocketAddr = "127.0.0.1:65535".parse().unwrap();
        assert!(rank_metrics_addr(top, 1).is_err());
    }

    #[test]
    fn a_free_port_is_found() {
        assert_ne!(free_port("127.0.0.1").unwrap(), 0);
        // an address not on this machine falls back to every interface
        assert_ne!(free_port("192.0.2.1").unwrap(), 0);
    }
}
