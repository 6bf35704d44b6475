//! `refit launch <topology.toml>`: start every rank of a topology on this machine and
//! supervise them, or (with `RANK`/`WORLD_SIZE`, Slurm's variables or `--rank`) start just
//! this machine's rank of a multi-host run.
//!
//! A thin shell over `refit::node::launch`: the file is read and checked here (with the
//! `--set` overrides and the link factory), [`resolve_rank`] finds which ranks start,
//! [`LaunchSpec`] gives each its program and environment, and [`Supervisor`] runs them. With
//! `--metrics-addr HOST:PORT` each rank also gets `REFIT_METRICS_ADDR=HOST:PORT+RANK`, where
//! it serves its metrics (each rank its own page, labelled `rank`: the engines' phases are
//! recorded where they run, and no process relays another's). With `--status-addr` the
//! launcher serves the launch's status (see `status.rs`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use refit::node::launch::{
    LaunchSpec, RankSpawn, SchedulerHosts, Supervisor, Verdict, check_rank, free_port,
    resolve_rank, scheduler_hosts, scheduler_incarnation,
};
use refit::node::{ClusterToken, LaunchEnv, TOKEN_ENV, TOKEN_FILE_ENV};
use refit::runtime::topology::{DEFAULT_MAX_RESTARTS, OnFailure, Override, Restart, Topology};
use refit::runtime::{Error, Result};

/// What `refit launch --help` says after the flags.
const ENVIRONMENT: &str = "\
Environment it reads:
  RANK, WORLD_SIZE          start only this rank (torchrun's names); MASTER_ADDR, MASTER_PORT
                            say where rank 0's rendezvous store is
  SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)
                            the same under Slurm (MASTER_ADDR: the list's first host); hosts
                            without `addr` take the list's nodes in file order
  REFIT_K8S_SERVICE, REFIT_K8S_POD (or HOSTNAME), REFIT_K8S_NAMESPACE
                            a Kubernetes StatefulSet behind that headless Service: pod i is
                            the file's host i (address POD.SERVICE), and runs its one rank
  REFIT_TOKEN, REFIT_TOKEN_FILE
                            the cluster token (required in a per-rank launch; else random)
  REFIT_INCARNATION, SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT
                            a per-rank launch restarted by its scheduler: the first start's
                            incarnation

Environment every rank gets (on top of the launcher's own):
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  REFIT_TOPOLOGY (the file's absolute path), REFIT_SET (the --set overrides, one per line),
  REFIT_TOKEN, REFIT_INCARNATION (0, then n after the nth restart), the process's `env`,
  and with --metrics-addr or --status-addr REFIT_METRICS_ADDR. RUST_LOG and
  REFIT_LOG_FORMAT (text or json) pass on from the launcher's environment.
A rank loads the same topology with refit::node::launch::load_topology().";

/// Arguments of `refit launch`.
#[derive(Debug, clap::Args)]
#[command(after_help = ENVIRONMENT)]
pub(crate) struct LaunchArgs {
    /// The topology file (TOML): processes, roles, hosts, models, sync policy, stop rule.
    topology: PathBuf,
    /// Override a key of the topology file, before it is checked (repeatable; later ones
    /// win): `--set sync.sync_mode=fully-async`, `--set process.actor.replicas=3`, `--set
    /// model.policy.params.lr=0.001`. The value is TOML (`3`, `true`, `["a", "b"]`); a bare
    /// word is a string. Every rank loads the file with the same overrides.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Port of the rendezvous store on rank 0's host. Default: in a per-rank launch
    /// `MASTER_PORT`, else rank 0's `port`, else 29500; when every rank starts here, rank 0's
    /// `port`, else a free port.
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,
    /// Start only this rank (a per-rank launch), as if `RANK` were set.
    #[arg(long, value_name = "N")]
    rank: Option<u32>,
    /// Seconds the other ranks get to exit on their own once rank 0 is done, and to exit
    /// after SIGTERM before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    grace_s: f64,
    /// Each rank serves its metrics (Prometheus text, every sample labelled `rank`) at
    /// `http://HOST:PORT+RANK/metrics`: rank 0 on PORT, rank 1 on PORT+1, and so on (port 0:
    /// a free port each, chosen here; every rank logs `metrics: http://ADDR/metrics`).
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = refit::metrics_page::METRICS_ADDR_ENV,
        hide_env_values = true
    )]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Serve this launch's status at `http://HOST:PORT/status` (JSON: every rank's process,
    /// state, restarts, health, versions); `refit status HOST:PORT` prints it. Without
    /// --metrics-addr, each rank then serves its metrics on a free port of HOST.
    #[arg(long, value_name = "HOST:PORT")]
    status_addr: Option<std::net::SocketAddr>,
    /// Resume from the newest checkpoint every model has (the file's `[checkpoint]`: its
    /// `dir`, or DIR when given): every trainer restores its learner and the run goes on
    /// from the version after it. A run told to resume that finds no usable checkpoint
    /// fails, naming why; it never starts from zero silently.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    #[allow(clippy::option_option)]
    resume: Option<Option<PathBuf>>,
    /// Check the file, print the ranks it expands to (program, roles, host, links) and
    /// start nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also write each rank's output, as the rank printed it, to `DIR/rank-N-NAME.log`
    /// (created if needed; a restarted rank's lines are appended). The output still goes to
    /// the terminal, prefixed `[rank N NAME]`.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<PathBuf>,
}

/// The address rank `rank` serves its metrics on: `base`'s port plus the rank (port 0: a
/// port free now on `base`'s address, so that the status page knows where to look).
fn rank_metrics_addr(base: std::net::SocketAddr, rank: u32) -> Result<std::net::SocketAddr> {
    if base.port() == 0 {
        let port = free_port(&base.ip().to_string())?;
        return Ok(std::net::SocketAddr::new(base.ip(), port));
    }
    let port = u16::try_from(u32::from(base.port()) + rank).map_err(|_| {
        Error::Config(format!(
            "--metrics-addr {base}: rank {rank}'s port is past 65535"
        ))
    })?;
    Ok(std::net::SocketAddr::new(base.ip(), port))
}

/// The overrides `--resume [DIR]` stands for: `checkpoint.resume = true`, and the folder
/// when given.
fn resume_overrides(dir: Option<&Path>) -> Result<Vec<Override>> {
    let mut out = vec![Override::parse("checkpoint.resume=true")?];
    if let Some(dir) = dir {
        let dir = std::path::absolute(dir).map_err(|source| Error::Path {
            context: "resolving the --resume folder",
            path: dir.to_path_buf(),
            source,
        })?;
        out.push(Override::new("checkpoint.dir", &dir.display().to_string())?);
    }
    Ok(out)
}

/// Runs `refit launch`.
pub(crate) fn run(args: &LaunchArgs) -> ExitCode {
    match launch(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("refit launch: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The file at `path` with `overrides`, checked whole (links included, with the link
/// factory's knowledge).
fn topology(path: &Path, overrides: &[Override]) -> Result<Topology> {
    let topo = Topology::parse_file_with(&refit::read_config(path)?, path, overrides)?;
    topo.check_links(refit::transports::link::reach_of)
        .map_err(|e| match e {
            Error::Topology { key, reason } => Error::Topology {
                key,
                reason: format!("{reason}, in `{}`", path.display()),
            },
            other => other,
        })?;
    // the framework's keys of each model's params (`workers`, `batch_frames`, ...)
    #[cfg(feature = "actors")]
    refit::actors::run::model_specs(&topo).map_err(|e| {
        refused(format!(
            "{}, in `{}`",
            plain(&e.to_string()),
            path.display()
        ))
    })?;
    Ok(topo)
}

/// A refusal of the file, said as it is (no category before it).
fn refused(what: String) -> Error {
    Error::from(refit::node::Error::Start(what))
}

/// `model ...: ...` out of `invalid configuration: model ...: ...` (what a rank's roles
/// say): the file's key is the news, not the category.
fn plain(cause: &str) -> &str {
    let mut c = cause.trim();
    while let Some(rest) = c.strip_prefix("invalid configuration: ") {
        c = rest;
    }
    c
}

/// Runs each distinct rank program of `ranks` once as a check (`REFIT_CHECK=1`), before
/// any rank starts: the first refusal is the launch's error.
fn check_programs(ranks: &[RankSpawn], wait: Duration, cwd: &Path) -> Result<()> {
    let mut checked: Vec<(&Path, &[String])> = Vec::new();
    for r in ranks {
        let key = (r.program.as_path(), r.args.as_slice());
        if checked.contains(&key) {
            continue;
        }
        checked.push(key);
        match check_rank(r, wait).map_err(Error::from)? {
            Verdict::Passed => {
                tracing::debug!("rank {} ({}): its program checked the file", r.rank, r.name);
            }
            Verdict::NotSpoken => tracing::debug!(
                "rank {} ({}): `{}` does not check the file before the launch",
                r.rank,
                r.name,
                r.program.display()
            ),
            Verdict::Refused(cause) => {
                let program = r.program.strip_prefix(cwd).unwrap_or(&r.program);
                return Err(refused(format!(
                    "{} (found by `{}`, the program of rank {} ({}), before any rank started)",
                    plain(&cause),
                    program.display(),
                    r.rank,
                    r.name,
                )));
            }
        }
    }
    Ok(())
}

/// `--dry-run`: what each rank would run, one block per rank.
fn print_ranks(topo: &Topology, ranks: &[RankSpawn], cwd: &Path) -> Result<()> {
    for r in ranks {
        let plan = topo.rank(r.rank)?;
        let roles: Vec<String> = plan.roles.iter().map(ToString::to_string).collect();
        let program = r.program.strip_prefix(cwd).unwrap_or(&r.program);
        let mut command = vec![program.display().to_string()];
        command.extend(r.args.iter().cloned());
        println!(
            "rank {} ({}, replica {}): host {} ({})",
            r.rank,
            r.name,
            plan.replica,
            plan.host.name,
            plan.host.address().unwrap_or("address from the scheduler")
        );
        println!("  command: {}", command.join(" "));
        println!("  roles: {}", roles.join(", "));
        if r.max_restarts > 0 {
            println!("  restarts: up to {}", r.max_restarts);
        }
    }
    for model in topo.model_ids() {
        let shards = topo.trainer_ranks(&model);
        if let [lead, rest @ ..] = shards.as_slice()
            && !rest.is_empty()
        {
            let ranks = |rs: &[u32]| rs.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
            if topo.publishes_over_mesh(&model) {
                for to in topo.engine_ranks_of(&model) {
                    println!(
                        "model {model}: weights from ranks {} (each its part) to rank {to} over \
                         the mesh (tcp)",
                        ranks(&shards)
                    );
                }
                continue;
            }
            let (who, send) = match rest {
                [one] => (format!("the shard on rank {one}"), "sends its part"),
                _ => (
                    format!("the shards on ranks {}", ranks(rest)),
                    "send their parts",
                ),
            };
            println!("model {model}: {who} {send} to rank {lead}, which publishes");
        }
        for from in shards.iter().take(1) {
            for to in topo.engine_ranks_of(&model) {
                let kind = topo.weights_transport(&model, *from, to);
                let link = refit::transports::link::for_kind(&kind)
                    .map_or_else(|e| format!("{kind} ({e})"), |l| l.name().to_string());
                println!("model {model}: weights from rank {from} to rank {to} over {link}");
            }
        }
    }
    println!("dry run: nothing started");
    Ok(())
}

fn launch(args: &LaunchArgs) -> Result<u8> {
    if !(args.grace_s.is_finite() && args.grace_s >= 0.0 && args.grace_s < 1e6) {
        return Err(Error::Config(format!(
            "--grace-s must be a non-negative number of seconds, not {}",
            args.grace_s
        )));
    }
    let grace = Duration::from_secs_f64(args.grace_s);
    let mut overrides = args
        .set
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<Vec<_>>>()?;

    let path = std::path::absolute(&args.topology).map_err(|source| Error::Path {
        context: "resolving the topology file",
        path: args.topology.clone(),
        source,
    })?;
    let lookup = |k: &str| std::env::var(k).ok();
    let mut topo = topology(&path, &overrides)?;
    if let Some(dir) = &args.resume {
        if topo.checkpoint.is_none() {
            return Err(Error::Config(format!(
                "--resume: {} has no [checkpoint] section (dir, every): there is nothing to \
                 resume from",
                path.display()
            )));
        }
        overrides.extend(resume_overrides(dir.as_deref())?);
        topo = topology(&path, &overrides)?;
    }
    // hosts without `addr`: the scheduler's, as overrides every rank applies too
    let scheduled = scheduler_hosts(&topo, &lookup).map_err(Error::from)?;
    if let Some(hosts) = &scheduled {
        overrides.extend(hosts.overrides().map_err(Error::from)?);
        topo = topology(&path, &overrides)?;
        eprintln!(
            "refit launch: host addresses from {}: {}",
            hosts.scheduler.describe(),
            hosts.summary()
        );
    }
    let given = ClusterToken::from_env()?;
    let spec = LaunchSpec {
        token: given.clone().unwrap_or_else(ClusterToken::random),
        cwd: std::env::current_dir().map_err(|e| Error::io("reading the current directory", e))?,
        topology: topo,
        path,
        overrides,
    };
    let topo = &spec.topology;
    let mut ranks = match resolve_rank(args.rank, args.master_port, topo, &lookup)? {
        Some(place) => {
            let unshared = given.is_none();
            vec![one_rank(
                &spec,
                &place,
                scheduled.as_ref(),
                unshared,
                &lookup,
            )?]
        }
        None => every_rank(&spec, args.master_port)?,
    };
    let listed = give_metrics_addrs(args, &mut ranks)?;
    if args.dry_run {
        print_ranks(topo, &ranks, &spec.cwd)?;
        return Ok(0);
    }
    if topo.run.check {
        check_programs(&ranks, topo.wait(), &spec.cwd)?;
    }
    let on_failure = if ranks.len() == 1 {
        OnFailure::Abort
    } else {
        topo.run.on_failure
    };
    let supervisor = Supervisor::with_log_dir(grace, on_failure, args.log_dir.clone());
    if let Some(dir) = &args.log_dir {
        eprintln!(
            "refit launch: each rank's output also goes to {}/rank-N-NAME.log",
            dir.display()
        );
    }
    if let Some(addr) = args.status_addr {
        let info = super::status::LaunchInfo {
            topology: spec.path.clone(),
            world_size: topo.world_size(),
            ranks: listed,
        };
        let bound = super::status::serve(addr, std::sync::Arc::clone(&supervisor), info)?;
        eprintln!("refit launch: status: http://{bound}/status (`refit status {bound}`)");
    }
    let mut code = supervisor.run(&ranks);
    let most = run_restarts(&spec, ranks.len());
    let mut restarts = 0;
    while code != 0 && !supervisor.interrupted() && restarts < most {
        restarts += 1;
        if let Some(failure) = supervisor.failure() {
            eprintln!("refit launch: error: {failure}");
        }
        let (again, from) = restarted(&spec)?;
        eprintln!(
            "refit launch: starting every rank again {from} (run restart {restarts} of {most})"
        );
        supervisor.clear();
        let mut ranks = every_rank(&again, None)?;
        give_metrics_addrs(args, &mut ranks)?;
        code = supervisor.run(&ranks);
    }
    if code != 0
        && let Some(failure) = supervisor.failure()
    {
        eprintln!("refit launch: error: {failure}");
    }
    Ok(code)
}

/// How many times a failed run starts again whole: rank 0's `max_restarts` when its process
/// says `restart = "on-failure"` in a run with `[checkpoint]` launched whole here (a
/// per-rank launch is its scheduler's to requeue, with `--resume`); else 0.
fn run_restarts(spec: &LaunchSpec, ranks_here: usize) -> u32 {
    let topo = &spec.topology;
    let first = &topo.processes[0];
    let whole = ranks_here == topo.world_size() as usize;
    if whole && topo.checkpoint.is_some() && first.restart == Restart::OnFailure {
        first.max_restarts.unwrap_or(DEFAULT_MAX_RESTARTS)
    } else {
        0
    }
}

/// The launch again after a failed run: resumed from the newest checkpoint every model has
/// (`checkpoint.resume`), or from zero when none was written yet; answers it and which.
fn restarted(spec: &LaunchSpec) -> Result<(LaunchSpec, String)> {
    let topo = &spec.topology;
    let Some(cfg) = &topo.checkpoint else {
        return Err(Error::Config("a run restart needs [checkpoint]".into()));
    };
    let mut overrides = spec.overrides.clone();
    let from = match refit::actors::run::resume_version(cfg, &topo.model_ids()) {
        Ok(v) => {
            overrides.extend(resume_overrides(None)?);
            format!("from the checkpoint of version {v}")
        }
        Err(e) => format!("from zero ({e})"),
    };
    let topology = topology(&spec.path, &overrides)?;
    let again = LaunchSpec {
        token: spec.token.clone(),
        cwd: spec.cwd.clone(),
        topology,
        path: spec.path.clone(),
        overrides,
    };
    Ok((again, from))
}

/// The one rank of a per-rank launch (a scheduler's task, or `--rank`): checked against the
/// scheduler's hosts, with the shared token a per-rank launch needs (`unshared`: none was
/// given) and its incarnation.
fn one_rank(
    spec: &LaunchSpec,
    place: &LaunchEnv,
    scheduled: Option<&SchedulerHosts>,
    unshared: bool,
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<RankSpawn> {
    let topo = &spec.topology;
    if let Some(hosts) = scheduled {
        hosts.check_rank(topo, place.rank).map_err(Error::from)?;
    }
    if unshared && place.world_size > 1 {
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
    let incarnation = scheduler_incarnation(lookup)?;
    eprintln!(
        "refit launch: rank {} of {} ({}) from {}; rendezvous at {}:{}{}",
        place.rank,
        place.world_size,
        topo.rank(place.rank)?.process,
        spec.path.display(),
        place.master_addr,
        place.master_port,
        if incarnation > 0 {
            format!("; incarnation {incarnation}")
        } else {
            String::new()
        }
    );
    spec.rank(place, incarnation).map_err(Error::from)
}

/// Every rank of the file, on this machine.
fn every_rank(spec: &LaunchSpec, master_port: Option<u16>) -> Result<Vec<RankSpawn>> {
    let topo = &spec.topology;
    let master_port = match master_port.or(topo.ranks()[0].port) {
        Some(p) => p,
        None => free_port(topo.master_host()?)?,
    };
    eprintln!(
        "refit launch: {} ranks from {}; rendezvous at {}:{master_port}",
        topo.world_size(),
        spec.path.display(),
        topo.master_host()?
    );
    if topo.hosts.len() > 1 {
        eprintln!(
            "refit launch: the file declares {} hosts, and every rank starts on this machine; \
             to start one rank per host, run `refit launch` on each with RANK/WORLD_SIZE, \
             Slurm's variables or --rank",
            topo.hosts.len()
        );
    }
    spec.every_rank(master_port).map_err(Error::from)
}

/// Gives each rank its metrics address (or none) and answers the list the status page shows.
fn give_metrics_addrs(
    args: &LaunchArgs,
    ranks: &mut [RankSpawn],
) -> Result<Vec<(u32, String, Option<std::net::SocketAddr>)>> {
    // a status page reads the ranks' metrics: they get an address of its host if not told
    let metrics_base = args.metrics_addr.or(args
        .status_addr
        .map(|a| std::net::SocketAddr::new(a.ip(), 0)));
    let mut listed = Vec::new();
    for r in ranks.iter_mut() {
        // the ranks get a metrics address only from these flags (or the launcher's
        // REFIT_METRICS_ADDR, the default of --metrics-addr), each its own: inherited as
        // it is, they would all ask for the same one
        let metrics = match metrics_base {
            Some(base) => Some(rank_metrics_addr(base, r.rank)?),
            None => None,
        };
        r.env.push((
            refit::metrics_page::METRICS_ADDR_ENV.into(),
            metrics.map(|a| a.to_string()).unwrap_or_default(),
        ));
        listed.push((r.rank, r.name.clone(), metrics));
    }
    Ok(listed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_serves_metrics_on_its_own_port() {
        let base: std::net::SocketAddr = "127.0.0.1:9100".parse().unwrap();
        assert_eq!(rank_metrics_addr(base, 0).unwrap(), base);
        assert_eq!(
            rank_metrics_addr(base, 3).unwrap(),
            "127.0.0.1:9103".parse().unwrap()
        );
        // port 0: a free port, chosen here (the status page must know it)
        let any: std::net::SocketAddr = "127.0.0.1:0".parse().unwrap();
        let picked = rank_metrics_addr(any, 5).unwrap();
        assert_eq!(picked.ip(), any.ip());
        assert_ne!(picked.port(), 0);
        let top: std::net::SocketAddr = "127.0.0.1:65535".parse().unwrap();
        assert!(rank_metrics_addr(top, 1).is_err());
    }
}
