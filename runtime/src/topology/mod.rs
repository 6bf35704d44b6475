//! The topology file: which processes run which roles on which hosts, the models, the sync
//! policy, the stop rule and the transport of each link — parsed from TOML and validated
//! whole before anything starts.
//!
//! Plain code: text in, values out (no I/O: the caller reads the file, no async).
//!
//! ```
//! use refit_runtime::topology::{Reach, Role, Topology, TransportKind};
//!
//! let topo = Topology::parse(r#"
//!     [run]
//!     command = ["my-program"]
//!     [[model]]
//!     id = "policy"
//!     [[process]]
//!     name = "learner"
//!     roles = ["trainer", "controller"]
//!     [[process]]
//!     name = "actor"
//!     replicas = 2
//!     roles = ["engine", "rollout"]
//! "#)?;
//! assert_eq!(topo.world_size(), 3);
//! assert_eq!(topo.rank(2)?.process, "actor");
//! assert!(topo.rank(1)?.has(Role::Engine));
//! assert_eq!(topo.engine_ranks(), vec![1, 2]);
//! // `auto` (the default): the nearest transport that reaches one host
//! let policy = topo.model_ids()[0].clone();
//! assert_eq!(topo.trainer_ranks(&policy), vec![0]);
//! assert_eq!(topo.weights_transport(&policy, 0, 1), TransportKind::Nearest(Reach::Host));
//! # Ok::<(), refit_runtime::Error>(())
//! ```

mod convert;
mod locate;
mod overrides;
mod placement;
mod schema;
#[cfg(test)]
mod tests;
mod validate;

use std::path::Path;
use std::time::Duration;

pub use convert::{CastRuleSection, ConvertSection, LayoutRuleSection};
pub use overrides::Override;
pub use placement::RankPlan;
pub use schema::{
    Apply, CheckpointSection, Commit, DEFAULT_MAX_RESTARTS, Deltas, HostSection, LinkTransport,
    LinksSection, ModelSection, OnFailure, ProcessSection, RESERVED_ENV, Reach, Restart, Role,
    RunSection, Sharded, StopSection, TransportKind, Verify,
};

use crate::error::{Error, Result};
use crate::ids::ModelId;
use crate::sync_policy::SyncConfig;

/// The most ranks one topology may expand to.
pub const MAX_WORLD_SIZE: u32 = 65_536;

/// A validated topology file.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    /// `[run]`.
    pub run: RunSection,
    /// `[sync]`, with `models` filled from the `[[model]]` sections.
    pub sync: SyncConfig,
    /// `[stop]`.
    pub stop: StopSection,
    /// `[[model]]`, in file order.
    pub models: Vec<ModelSection>,
    /// `[[host]]`, in file order (one `local` host at `127.0.0.1` when none is declared).
    pub hosts: Vec<HostSection>,
    /// `[[process]]`, in file order, each with its host filled in.
    pub processes: Vec<ProcessSection>,
    /// `[links]`.
    pub links: LinksSection,
    /// `[checkpoint]`, when the run saves its trainers' state.
    pub checkpoint: Option<CheckpointSection>,
    ranks: Vec<RankPlan>,
}

impl Topology {
    /// Parses and validates a topology file's text.
    ///
    /// # Errors
    /// [`Error::Topology`] naming the key (with its table and, for `[[process]]` entries, the
    /// process): malformed TOML, an unknown key, a value of the wrong type, an unknown role
    /// or transport, or a placement that cannot work (see the module docs and the book).
    pub fn parse(text: &str) -> Result<Self> {
        Self::from_text(text, true)
    }

    /// Parses a topology file's text with `overrides` applied to it first (in order, each
    /// one replacing what the file or an earlier override set), then validates the result:
    /// what `refit launch --set key=value` and every rank it starts do.
    ///
    /// # Errors
    /// As [`Topology::parse`]; an override that cannot be applied is named by its key
    /// ([`Override::apply`]), and an error on a key an override set says so. Errors past
    /// the overrides name no line: the lines of the file no longer hold the values.
    pub fn parse_with(text: &str, overrides: &[Override]) -> Result<Self> {
        if overrides.is_empty() {
            return Self::parse(text);
        }
        let mut doc: toml::Table =
            toml::from_str(text).map_err(|e| locate::parse_error(text, &e, true))?;
        let applied = overrides::apply_all(&mut doc, overrides)?;
        let merged = toml::to_string(&doc).map_err(|e| Error::Topology {
            key: "<file>".into(),
            reason: format!("cannot write the document back after the overrides: {e}"),
        })?;
        Self::from_text(&merged, false).map_err(|e| overrides::blame(e, &applied))
    }

    /// Parses and validates `text`; `lines`: errors name the line.
    fn from_text(text: &str, lines: bool) -> Result<Self> {
        let mut raw: schema::RawTopology =
            toml::from_str(text).map_err(|e| locate::parse_error(text, &e, lines))?;
        validate::validate(&mut raw)?;
        let ranks = placement::expand(&raw.run, &raw.processes, &raw.hosts, &raw.models);
        Ok(Self {
            run: raw.run,
            sync: raw.sync,
            stop: raw.stop,
            models: raw.models,
            hosts: raw.hosts,
            processes: raw.processes,
            links: raw.links,
            checkpoint: raw.checkpoint,
            ranks,
        })
    }

    /// Parses and validates the text of the topology file at `path` (which the caller read:
    /// this crate reads no configuration files).
    ///
    /// # Errors
    /// As [`Topology::parse`], with the path at the end of the reason.
    pub fn parse_file(text: &str, path: &Path) -> Result<Self> {
        Self::parse_file_with(text, path, &[])
    }

    /// As [`Topology::parse_with`], for the text of the file at `path` (named at the end of
    /// the reason of an error).
    ///
    /// # Errors
    /// As [`Topology::parse_with`], with the path at the end of the reason.
    pub fn parse_file_with(text: &str, path: &Path, overrides: &[Override]) -> Result<Self> {
        Self::parse_with(text, overrides).map_err(|e| match e {
            Error::Topology { key, reason } => Error::Topology {
                key,
                reason: format!("{reason}, in `{}`", path.display()),
            },
            other => other,
        })
    }

    /// Number of ranks: every process times its replicas.
    pub fn world_size(&self) -> u32 {
        u32::try_from(self.ranks.len()).unwrap_or(u32::MAX)
    }

    /// What rank `r` runs.
    ///
    /// # Errors
    /// [`Error::Topology`] (key `RANK`) when `r` is not below [`Topology::world_size`].
    pub fn rank(&self, r: u32) -> Result<RankPlan> {
        self.ranks
            .get(r as usize)
            .cloned()
            .ok_or_else(|| Error::Topology {
                key: "RANK".into(),
                reason: format!(
                    "{r} is not below the topology's world size {}",
                    self.world_size()
                ),
            })
    }

    /// Every rank, in order.
    pub fn ranks(&self) -> &[RankPlan] {
        &self.ranks
    }

    /// The ranks that hold the `engine` role (for any model), in order.
    pub fn engine_ranks(&self) -> Vec<u32> {
        self.ranks_with(Role::Engine)
    }

    /// The ranks that hold `role`, in order.
    pub fn ranks_with(&self, role: Role) -> Vec<u32> {
        self.ranks
            .iter()
            .filter(|p| p.has(role))
            .map(|p| p.rank)
            .collect()
    }

    /// The ranks that hold `role` for `model`, in order (see [`RankPlan::serves`]).
    pub fn ranks_serving(&self, role: Role, model: &ModelId) -> Vec<u32> {
        self.ranks
            .iter()
            .filter(|p| p.serves(role, model))
            .map(|p| p.rank)
            .collect()
    }

    /// The ranks of `model`'s trainer, in order: one rank, or the shards of a trainer
    /// process with replicas (the first one publishes).
    pub fn trainer_ranks(&self, model: &ModelId) -> Vec<u32> {
        self.ranks_serving(Role::Trainer, model)
    }

    /// True when `model`'s trainer is sharded (several ranks) and its shards publish their
    /// own parts to the engines (`links.sharded = "mesh"`) instead of gathering at shard 0.
    pub fn publishes_over_mesh(&self, model: &ModelId) -> bool {
        self.links.sharded == Sharded::Mesh && self.trainer_ranks(model).len() > 1
    }

    /// The rank whose engine serves `model`, in order.
    pub fn engine_ranks_of(&self, model: &ModelId) -> Vec<u32> {
        self.ranks_serving(Role::Engine, model)
    }

    /// The rank that holds the evaluator, if one does.
    pub fn evaluator_rank(&self) -> Option<u32> {
        self.ranks_with(Role::Evaluator).first().copied()
    }

    /// The rollout workers `model` gets on `rank`: the process's `rollout_workers`, else
    /// the model's `params.workers`, else 1 (0 where the rank holds no rollout role for it).
    pub fn rollout_workers(&self, rank: u32, model: &ModelId) -> u32 {
        let Some(plan) = self.ranks.get(rank as usize) else {
            return 0;
        };
        if !plan.serves(Role::Rollout, model) {
            return 0;
        }
        if plan.rollout_workers > 0 {
            return plan.rollout_workers;
        }
        self.model(model)
            .and_then(|m| m.params.get("workers"))
            .and_then(toml::Value::as_integer)
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n > 0)
            .unwrap_or(1)
    }

    /// How `model`'s weights are linked: its `link`, else `[links] weights`.
    pub fn link_of(&self, model: &ModelId) -> &LinkTransport {
        self.model(model)
            .and_then(|m| m.link.as_ref())
            .unwrap_or(&self.links.weights)
    }

    /// The transport `model`'s weights take from `from_rank` to `to_rank`: the one its
    /// link names, or for `auto` the reach the link needs (same rank: one process; same
    /// host: one host; else the network). A rank outside the topology needs the network.
    pub fn weights_transport(
        &self,
        model: &ModelId,
        from_rank: u32,
        to_rank: u32,
    ) -> TransportKind {
        match (
            self.ranks.get(from_rank as usize),
            self.ranks.get(to_rank as usize),
        ) {
            (Some(from), Some(to)) => placement::resolve(self.link_of(model), from, to),
            _ => TransportKind::Nearest(Reach::Network),
        }
    }

    /// Checks every model's link against what the caller knows of transports (`reach_of`
    /// gives a name's reach: the link factory's `find(name)?.reach()`): it must exist and
    /// carry weights from the model's trainer to every engine that serves it.
    ///
    /// # Errors
    /// [`Error::Topology`] on `model[ID].link` (or `links.weights` when the model names
    /// none): a name `reach_of` refuses (with its reason, e.g. the known transports), or one
    /// that cannot reach an engine, naming its process and host.
    pub fn check_links(&self, reach_of: impl Fn(&str) -> Result<Reach>) -> Result<()> {
        for m in &self.models {
            let (key, link) = match &m.link {
                Some(l) => (format!("model[{}].link", m.id), l),
                None => ("links.weights".to_string(), &self.links.weights),
            };
            let LinkTransport::Named(name) = link else {
                continue;
            };
            let blame = |reason: String| Error::Topology {
                key: key.clone(),
                reason,
            };
            let reach = reach_of(name).map_err(|e| blame(e.to_string()))?;
            let Some(trainer) = self
                .trainer_ranks(&m.id)
                .first()
                .and_then(|r| self.ranks.get(*r as usize))
            else {
                continue;
            };
            for p in self.ranks.iter().filter(|p| p.serves(Role::Engine, &m.id)) {
                let refused = match reach {
                    Reach::Process if p.rank != trainer.rank => Some("in another process"),
                    Reach::Host if p.host.name != trainer.host.name => Some("on another host"),
                    _ => None,
                };
                if let Some(why) = refused {
                    return Err(blame(format!(
                        "`{name}` cannot carry model `{}`'s weights from its trainer (process `{}`, \
                         host `{}`) to the engine in process `{}` (host `{}`), {why}",
                        m.id, trainer.process, trainer.host.name, p.process, p.host.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The model ids, in file order.
    pub fn model_ids(&self) -> Vec<ModelId> {
        self.models.iter().map(|m| m.id.clone()).collect()
    }

    /// The `[[model]]` section of `id`.
    pub fn model(&self, id: &ModelId) -> Option<&ModelSection> {
        self.models.iter().find(|m| &m.id == id)
    }

    /// The deadline of each blocked step (`run.wait_s`).
    pub fn wait(&self) -> Duration {
        Duration::from_secs_f64(self.run.wait_s)
    }

    /// The stop rule.
    pub fn stop(&self) -> &StopSection {
        &self.stop
    }

    /// The position of `model` in the file's `[[model]]` list.
    pub fn model_index(&self, model: &ModelId) -> Option<usize> {
        self.models.iter().position(|m| &m.id == model)
    }

    /// How often ranks ping each other (`run.keepalive_s`).
    pub fn keepalive(&self) -> Duration {
        Duration::from_secs_f64(self.run.keepalive_s)
    }

    /// How long a silent rank lives on (`run.dead_after_s`).
    pub fn dead_after(&self) -> Duration {
        Duration::from_secs_f64(self.run.dead_after_s)
    }

    /// The host of rank 0 (the controller, and the rendezvous store).
    pub fn master(&self) -> &HostSection {
        &self.ranks[0].host
    }

    /// The address of rank 0's host: `MASTER_ADDR` for every rank.
    ///
    /// # Errors
    /// [`Error::Topology`] naming `host[NAME].addr` when the file leaves it to a scheduler
    /// and nothing filled it in ([`HostSection::address`]).
    pub fn master_host(&self) -> Result<&str> {
        self.master().address()
    }
}
