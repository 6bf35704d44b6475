//! Checks a parsed file whole, before anything runs: every refusal names the key, the value
//! and the process (or host, or model) to blame.

use std::collections::BTreeSet;

use super::schema::{
    Commit, HostSection, ModelSection, ProcessSection, RESERVED_ENV, RawTopology, Restart, Role,
    RunSection, StopSection,
};
use crate::error::{Error, Result};

fn bad(key: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Topology {
        key: key.into(),
        reason: reason.into(),
    }
}

fn seconds(key: &str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 && v < 1e9 {
        Ok(())
    } else {
        Err(bad(
            key,
            format!("must be a positive number of seconds, not {v}"),
        ))
    }
}

fn name_ok(key: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(
            key,
            format!("{name:?} is not a name (empty, or holds spaces or control characters)"),
        ));
    }
    Ok(())
}

/// A command as written: a program (first element, not empty) and its arguments.
fn check_command(key: &str, command: &[String]) -> Result<()> {
    match command.first() {
        None => Err(bad(key, "is empty; give the program and its arguments")),
        Some(p) if p.trim().is_empty() => Err(bad(key, "the program (first element) is empty")),
        Some(_) => Ok(()),
    }
}

fn check_run(run: &RunSection, processes: &[ProcessSection]) -> Result<()> {
    // `[run] command` may be left out when every process brings its own
    match processes.iter().find(|p| p.command.is_none()) {
        Some(p) if run.command.is_empty() => {
            return Err(bad(
                "run.command",
                format!(
                    "is empty; give the program and its arguments (process `{}` has no `command` of its own)",
                    p.name
                ),
            ));
        }
        _ if !run.command.is_empty() => check_command("run.command", &run.command)?,
        _ => {}
    }
    seconds("run.wait_s", run.wait_s)?;
    seconds("run.keepalive_s", run.keepalive_s)?;
    seconds("run.dead_after_s", run.dead_after_s)?;
    if run.dead_after_s <= run.keepalive_s {
        return Err(bad(
            "run.dead_after_s",
            format!(
                "{} s must be more than run.keepalive_s ({} s): a rank needs a ping to answer",
                run.dead_after_s, run.keepalive_s
            ),
        ));
    }
    Ok(())
}

fn check_stop(stop: &StopSection) -> Result<()> {
    if let Some(t) = stop.target_return
        && !t.is_finite()
    {
        return Err(bad(
            "stop.target_return",
            format!("must be a finite number, not {t}"),
        ));
    }
    if let Some(t) = stop.target_eval
        && !t.is_finite()
    {
        return Err(bad(
            "stop.target_eval",
            format!("must be a finite number, not {t}"),
        ));
    }
    if stop.max_updates == Some(0) {
        return Err(bad("stop.max_updates", "must be at least 1"));
    }
    if let Some(t) = stop.max_time_s {
        seconds("stop.max_time_s", t)?;
    }
    Ok(())
}

fn check_hosts(hosts: &[HostSection]) -> Result<()> {
    let mut seen = BTreeSet::new();
    for h in hosts {
        name_ok("host.name", &h.name)?;
        let key = format!("host[{}].addr", h.name);
        if let Some(addr) = &h.addr
            && (addr.trim().is_empty() || addr.chars().any(char::is_whitespace))
        {
            return Err(bad(key, format!("{addr:?} is not an address")));
        }
        if !seen.insert(h.name.as_str()) {
            return Err(bad(
                "host.name",
                format!("host `{}` is declared twice", h.name),
            ));
        }
    }
    Ok(())
}

/// Resolves every process's host (filling `host` in) and checks each process on its own.
fn check_processes(processes: &mut [ProcessSection], hosts: &[HostSection]) -> Result<()> {
    if processes.is_empty() {
        return Err(bad("process", "no [[process]] is declared"));
    }
    let mut seen = BTreeSet::new();
    for p in processes.iter_mut() {
        name_ok("process.name", &p.name)?;
        if !seen.insert(p.name.clone()) {
            return Err(bad(
                "process.name",
                format!("process `{}` is declared twice", p.name),
            ));
        }
        if !p.hosts.is_empty() {
            check_copy_hosts(p, hosts)?;
        }
        let at = |k: &str| format!("process[{}].{k}", p.name);
        if p.host.is_empty() {
            match hosts {
                [only] => p.host = only.name.clone(),
                _ => {
                    return Err(bad(
                        at("host"),
                        format!(
                            "process `{}` names no host and the file declares {} hosts",
                            p.name,
                            hosts.len()
                        ),
                    ));
                }
            }
        } else if !hosts.iter().any(|h| h.name == p.host) {
            let declared: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
            return Err(bad(
                at("host"),
                format!(
                    "process `{}` runs on host `{}`, which is not declared (hosts: {})",
                    p.name,
                    p.host,
                    declared.join(", ")
                ),
            ));
        }
        if p.replicas == 0 {
            return Err(bad(
                at("replicas"),
                format!(
                    "process `{}` has replicas = 0; it must run at least once",
                    p.name
                ),
            ));
        }
        if p.replicas > super::MAX_WORLD_SIZE {
            return Err(bad(
                at("replicas"),
                format!(
                    "process `{}` has replicas = {}; a run holds at most {} ranks",
                    p.name,
                    p.replicas,
                    super::MAX_WORLD_SIZE
                ),
            ));
        }
        if p.roles.is_empty() {
            return Err(bad(
                at("roles"),
                format!("process `{}` has no roles", p.name),
            ));
        }
        let mut roles = BTreeSet::new();
        for r in &p.roles {
            if !roles.insert(*r) {
                return Err(bad(
                    at("roles"),
                    format!("process `{}` lists role `{r}` twice", p.name),
                ));
            }
        }
        if p.has(Role::Rollout) && !p.has(Role::Engine) {
            return Err(bad(
                at("roles"),
                format!(
                    "process `{}` has `rollout` without an `engine` in the same process",
                    p.name
                ),
            ));
        }
        match p.rollout_workers {
            Some(0) => {
                return Err(bad(
                    at("rollout_workers"),
                    format!("process `{}` has rollout_workers = 0; at least 1", p.name),
                ));
            }
            Some(_) if !p.has(Role::Rollout) => {
                return Err(bad(
                    at("rollout_workers"),
                    format!(
                        "process `{}` sets rollout_workers without the `rollout` role",
                        p.name
                    ),
                ));
            }
            _ => {}
        }
        check_launch_keys(p)?;
    }
    let world: u64 = processes.iter().map(|p| u64::from(p.replicas)).sum();
    if world > u64::from(super::MAX_WORLD_SIZE) {
        return Err(bad(
            "process.replicas",
            format!(
                "the processes add up to {world} ranks; a run holds at most {}",
                super::MAX_WORLD_SIZE
            ),
        ));
    }
    Ok(())
}

/// Checks what the launcher does with one process: its command, environment, restarts,
/// bind address and port.
fn check_launch_keys(p: &ProcessSection) -> Result<()> {
    let at = |k: &str| format!("process[{}].{k}", p.name);
    if let Some(command) = &p.command {
        check_command(&at("command"), command)?;
    }
    for (k, v) in &p.env {
        if k.is_empty() || k.contains(['=', '\0']) || k.chars().any(char::is_whitespace) {
            return Err(bad(
                at("env"),
                format!(
                    "process `{}`: {k:?} is not an environment variable name (empty, or holds `=`, a space or NUL)",
                    p.name
                ),
            ));
        }
        if v.contains('\0') {
            return Err(bad(
                format!("{}.{k}", at("env")),
                format!("process `{}`: the value holds a NUL byte", p.name),
            ));
        }
        if RESERVED_ENV.contains(&k.as_str()) {
            return Err(bad(
                format!("{}.{k}", at("env")),
                format!(
                    "process `{}` sets `{k}`, which `refit launch` sets for every rank itself",
                    p.name
                ),
            ));
        }
    }
    match (p.restart, p.max_restarts) {
        (Restart::Never, Some(_)) => {
            return Err(bad(
                at("max_restarts"),
                format!(
                    "process `{}` sets max_restarts without restart = \"on-failure\"",
                    p.name
                ),
            ));
        }
        (Restart::OnFailure, Some(0)) => {
            return Err(bad(
                at("max_restarts"),
                format!(
                    "process `{}` has max_restarts = 0; at least 1 (or restart = \"never\")",
                    p.name
                ),
            ));
        }
        _ => {}
    }
    if let Some(b) = &p.bind
        && b.trim().parse::<std::net::IpAddr>().is_err()
    {
        return Err(bad(
            at("bind"),
            format!(
                "process `{}`: {b:?} is not an IP address (`0.0.0.0` listens on every interface)",
                p.name
            ),
        ));
    }
    match p.port {
        Some(0) => Err(bad(
            at("port"),
            format!(
                "process `{}` has port = 0; leave `port` out for a free port",
                p.name
            ),
        )),
        Some(port) if u32::from(port) + p.replicas - 1 > u32::from(u16::MAX) => Err(bad(
            at("port"),
            format!(
                "process `{}`: port {port} + {} replicas goes past 65535",
                p.name, p.replicas
            ),
        )),
        _ => Ok(()),
    }
}

/// A process naming the host of each copy (`hosts`): as many as its copies, each
/// declared, and no `host` or `bind` beside them (`host` is set to the first copy's).
fn check_copy_hosts(p: &mut ProcessSection, hosts: &[HostSection]) -> Result<()> {
    let at = |k: &str| format!("process[{}].{k}", p.name);
    if !p.host.is_empty() {
        return Err(bad(
            at("hosts"),
            format!(
                "process `{}` names both `host` and `hosts`: `hosts` places each copy, \
                 leave `host` out",
                p.name
            ),
        ));
    }
    if p.hosts.len() != p.replicas as usize {
        return Err(bad(
            at("hosts"),
            format!(
                "process `{}` names {} hosts for {} copies (replicas): one host per copy",
                p.name,
                p.hosts.len(),
                p.replicas
            ),
        ));
    }
    if let Some(h) = p
        .hosts
        .iter()
        .find(|h| !hosts.iter().any(|d| d.name == **h))
    {
        let declared: Vec<&str> = hosts.iter().map(|h| h.name.as_str()).collect();
        return Err(bad(
            at("hosts"),
            format!(
                "process `{}` runs a copy on host `{h}`, which is not declared (hosts: {})",
                p.name,
                declared.join(", ")
            ),
        ));
    }
    if p.bind.is_some() && p.hosts.iter().any(|h| *h != p.hosts[0]) {
        return Err(bad(
            at("bind"),
            format!(
                "process `{}` runs on several hosts: one `bind` address cannot serve them all",
                p.name
            ),
        ));
    }
    p.host = p.hosts[0].clone();
    Ok(())
}

/// Checks that no two processes on one host ask for the same fixed port.
fn check_ports(processes: &[ProcessSection]) -> Result<()> {
    for (i, p) in processes.iter().enumerate() {
        let Some(port) = p.port else { continue };
        let mine = u32::from(port)..u32::from(port) + p.replicas;
        for q in &processes[..i] {
            let Some(other) = q.port else { continue };
            let theirs = u32::from(other)..u32::from(other) + q.replicas;
            let shared =
                (0..p.replicas).any(|i| (0..q.replicas).any(|j| p.host_of(i) == q.host_of(j)));
            if shared && mine.start < theirs.end && theirs.start < mine.end {
                return Err(bad(
                    format!("process[{}].port", p.name),
                    format!(
                        "process `{}` (ports {}..={}) and process `{}` (ports {}..={}) share host `{}` and a port",
                        p.name,
                        mine.start,
                        mine.end - 1,
                        q.name,
                        theirs.start,
                        theirs.end - 1,
                        p.host
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Rank 0's process may say `restart = "on-failure"` only in a run with `[checkpoint]`: its
/// failure then restarts every rank, resumed from the last checkpoint (rank 0 alone cannot
/// come back: the store and the controller's state go with it). Another trainer process
/// may not say it: a trainer rank's failure ends the run, which rank 0's restart covers.
fn check_lead_restart(raw: &RawTopology) -> Result<()> {
    let Some(first) = raw.processes.first() else {
        return Ok(());
    };
    if first.restart != Restart::Never && raw.checkpoint.is_none() {
        return Err(bad(
            format!("process[{}].restart", first.name),
            format!(
                "process `{}` runs rank 0, whose end ends the run: it is restarted only with \
                 a [checkpoint] section (every rank then starts again from the last \
                 checkpoint)",
                first.name
            ),
        ));
    }
    // a trainer rank cannot come back alone either: the run restarts whole, by rank 0's
    if let Some(p) = raw
        .processes
        .iter()
        .skip(1)
        .find(|p| p.has(Role::Trainer) && p.restart != Restart::Never)
    {
        return Err(bad(
            format!("process[{}].restart", p.name),
            format!(
                "process `{}` holds a trainer, which cannot rejoin a running run alone: its \
                 failure ends the run. To go on from the last checkpoint, say restart = \
                 \"on-failure\" on rank 0's process (`{}`) with a [checkpoint] section: \
                 every rank then starts again",
                p.name, first.name
            ),
        ));
    }
    Ok(())
}

/// How many engine ranks serve `model` (every replica of a process that holds the role).
fn engine_count(processes: &[ProcessSection], model: &crate::ids::ModelId) -> u32 {
    processes
        .iter()
        .filter(|p| p.has(Role::Engine) && p.models.as_ref().is_none_or(|l| l.contains(model)))
        .map(|p| p.replicas.max(1))
        .sum()
}

/// Checks that `m` has an engine, and that its commit quorum is one its `engines` can meet.
fn check_commit(m: &ModelSection, engines: u32) -> Result<()> {
    if engines == 0 {
        return Err(bad(
            "process.roles",
            format!("no process holds the `engine` role for model `{}`", m.id),
        ));
    }
    if let Commit::Quorum(n) = m.commit
        && (n == 0 || n > engines)
    {
        return Err(bad(
            format!("model[{}].commit", m.id),
            format!("a quorum of {n} engines, but the model has {engines} (from 1 to {engines})"),
        ));
    }
    Ok(())
}

/// Checks `[checkpoint]`: its numbers and its folder.
fn check_checkpoint(raw: &RawTopology) -> Result<()> {
    let Some(c) = &raw.checkpoint else {
        return Ok(());
    };
    if c.every == 0 {
        return Err(bad(
            "checkpoint.every",
            "must be at least 1 (versions between checkpoints)",
        ));
    }
    if c.keep == 0 {
        return Err(bad(
            "checkpoint.keep",
            "must be at least 1 (checkpoints kept per model)",
        ));
    }
    if c.dir.as_os_str().is_empty() {
        return Err(bad(
            "checkpoint.dir",
            "is empty: name the folder checkpoints go to",
        ));
    }
    Ok(())
}

/// Checks each model's settings: its `link` name and its `[model.convert]` rules.
fn check_models(models: &[ModelSection]) -> Result<()> {
    for m in models {
        if let Some(c) = &m.convert {
            c.want(&format!("model[{}].convert", m.id))?;
        }
    }
    Ok(())
}

/// Checks where the roles sit: the controller on rank 0 alone; per model exactly one trainer
/// process (a process with replicas is a sharded trainer) and at least one engine; at most
/// one evaluator; every `models` entry declared (whether the weights transport reaches every
/// engine is [`Topology::check_links`](super::Topology::check_links)'s, with the link
/// factory's knowledge).
fn check_placement(processes: &[ProcessSection], models: &[ModelSection]) -> Result<()> {
    let first = &processes[0];
    if !first.has(Role::Controller) {
        return Err(bad(
            format!("process[{}].roles", first.name),
            format!(
                "process `{}` runs rank 0 and must hold `controller` (rank 0 leads the run and \
                 serves the rendezvous store)",
                first.name
            ),
        ));
    }
    if first.replicas != 1 {
        return Err(bad(
            format!("process[{}].replicas", first.name),
            format!(
                "process `{}` holds the controller and must run once, not {} times",
                first.name, first.replicas
            ),
        ));
    }
    for p in &processes[1..] {
        if p.has(Role::Controller) {
            return Err(bad(
                format!("process[{}].roles", p.name),
                format!(
                    "process `{}` holds `controller`, but the controller runs once, in the first \
                     process (`{}`, rank 0)",
                    p.name, first.name
                ),
            ));
        }
    }
    let evaluators: Vec<&ProcessSection> = processes
        .iter()
        .filter(|p| p.has(Role::Evaluator))
        .collect();
    if let Some(p) = evaluators.get(1) {
        return Err(bad(
            format!("process[{}].roles", p.name),
            format!(
                "process `{}` holds `evaluator`, and so does `{}`: a run has one evaluator",
                p.name, evaluators[0].name
            ),
        ));
    }
    if let Some(p) = evaluators.first()
        && p.name != first.name
    {
        return Err(bad(
            format!("process[{}].roles", p.name),
            format!(
                "process `{}` holds `evaluator`, which runs beside the controller in the first \
                 process (`{}`, rank 0): the controller's leader calls it on eval steps",
                p.name, first.name
            ),
        ));
    }
    for p in processes {
        let Some(list) = &p.models else { continue };
        let key = format!("process[{}].models", p.name);
        if list.is_empty() {
            return Err(bad(key, format!("process `{}` serves no model", p.name)));
        }
        if ![Role::Trainer, Role::Engine, Role::Rollout]
            .iter()
            .any(|r| p.has(*r))
        {
            return Err(bad(
                key,
                format!(
                    "process `{}` lists models without a trainer, engine or rollout role to serve them",
                    p.name
                ),
            ));
        }
        let mut seen = BTreeSet::new();
        for m in list {
            if !models.iter().any(|d| &d.id == m) {
                let declared: Vec<String> = models.iter().map(|d| d.id.to_string()).collect();
                return Err(bad(
                    key,
                    format!(
                        "process `{}` serves model `{m}`, which is not declared (models: {})",
                        p.name,
                        declared.join(", ")
                    ),
                ));
            }
            if !seen.insert(m) {
                return Err(bad(
                    key,
                    format!("process `{}` lists model `{m}` twice", p.name),
                ));
            }
        }
    }
    let serves = |p: &ProcessSection, role: Role, m: &crate::ids::ModelId| {
        p.has(role) && p.models.as_ref().is_none_or(|l| l.contains(m))
    };
    for m in models {
        let trainers: Vec<&ProcessSection> = processes
            .iter()
            .filter(|p| serves(p, Role::Trainer, &m.id))
            .collect();
        match trainers.as_slice() {
            [] => {
                return Err(bad(
                    "process.roles",
                    format!("no process holds the `trainer` role for model `{}`", m.id),
                ));
            }
            [_] => {}
            [a, b, ..] => {
                return Err(bad(
                    format!("process[{}].roles", b.name),
                    format!(
                        "model `{}` is trained by processes `{}` and `{}`: one process trains a \
                         model (give it replicas to shard it; `models = [...]` splits models \
                         between trainers)",
                        m.id, a.name, b.name
                    ),
                ));
            }
        }
        check_commit(m, engine_count(processes, &m.id))?;
    }
    Ok(())
}

/// Checks `raw` whole; fills in defaults that depend on other sections (the default host,
/// each process's host, the sync models).
pub(crate) fn validate(raw: &mut RawTopology) -> Result<()> {
    check_run(&raw.run, &raw.processes)?;
    if !raw.sync.models.is_empty() {
        return Err(bad(
            "sync.models",
            "is filled from the [[model]] sections; declare the models there",
        ));
    }
    if raw.models.is_empty() {
        return Err(bad("model", "no [[model]] is declared"));
    }
    let mut ids = BTreeSet::new();
    for m in &raw.models {
        if !ids.insert(m.id.clone()) {
            return Err(bad(
                "model.id",
                format!("model `{}` is declared twice", m.id),
            ));
        }
    }
    raw.sync.models = raw.models.iter().map(|m| m.id.clone()).collect();
    raw.sync.check().map_err(|e| match e {
        Error::Config(reason) => bad("sync", reason),
        other => other,
    })?;
    check_stop(&raw.stop)?;
    if raw.hosts.is_empty() {
        raw.hosts.push(HostSection::local());
    }
    check_hosts(&raw.hosts)?;
    check_models(&raw.models)?;
    check_checkpoint(raw)?;
    check_lead_restart(raw)?;
    check_processes(&mut raw.processes, &raw.hosts)?;
    check_ports(&raw.processes)?;
    check_placement(&raw.processes, &raw.models)
}
