//! The sections of a topology file, as they are written.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::ModelId;
use crate::sync_policy::SyncConfig;

/// What a rank does when another rank's process dies with a failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFailure {
    /// A dead process ends the whole run (the others are stopped).
    #[default]
    Abort,
    /// A dead engine/rollout process is reported and the others go on; rank 0 dying still
    /// ends the run.
    Continue,
}

impl OnFailure {
    /// The name used in topology files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Abort => "abort",
            Self::Continue => "continue",
        }
    }
}

/// Whether the launcher starts a process's rank again when it dies with a failure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Restart {
    /// A dead rank stays dead; `[run] on_failure` decides what the run does.
    #[default]
    Never,
    /// A rank that exits with a failure or is killed is started again (same rank, same
    /// environment, `REFIT_INCARNATION` one higher), up to `max_restarts` times.
    OnFailure,
}

impl Restart {
    /// The name used in topology files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Never => "never",
            Self::OnFailure => "on-failure",
        }
    }
}

/// The environment variables `refit launch` sets for every rank itself, which a process's
/// `env` may not set (the rank would lose its place in the run).
pub const RESERVED_ENV: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "REFIT_TOPOLOGY",
    "REFIT_SET",
    "REFIT_INCARNATION",
    "REFIT_TOKEN",
    "REFIT_TOKEN_FILE",
    "REFIT_METRICS_ADDR",
];

/// How many restarts `restart = "on-failure"` allows when `max_restarts` is not written.
pub const DEFAULT_MAX_RESTARTS: u32 = 3;

/// `[run]`: what every rank runs and how the run behaves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSection {
    /// The program and its arguments, started once per rank (`["prog", "arg", ...]`);
    /// may be left out (empty) when every `[[process]]` has a `command` of its own.
    #[serde(default)]
    pub command: Vec<String>,
    /// What happens when a process other than rank 0 dies with a failure.
    #[serde(default)]
    pub on_failure: OnFailure,
    /// Seed of the run (each rank derives its own from it).
    #[serde(default)]
    pub seed: u64,
    /// Deadline, in seconds, of each blocked step (a positive number).
    #[serde(default = "default_wait_s")]
    pub wait_s: f64,
    /// Every rank pings the ranks it depends on this often, in seconds (default 1).
    #[serde(default = "default_keepalive_s")]
    pub keepalive_s: f64,
    /// A rank that answered no ping for this long (or whose connection closed) is dead:
    /// rank 0 drops or replaces it, the others stop when rank 0 is (default 5; more than
    /// `keepalive_s`).
    #[serde(default = "default_dead_after_s")]
    pub dead_after_s: f64,
    /// Before any rank starts, `refit launch` runs each rank program once as a check
    /// (`REFIT_CHECK=1`): a program built on Refit checks its roles' params and exits
    /// (default true). `false` for programs that cannot check quickly or must not run
    /// twice.
    #[serde(default = "default_check")]
    pub check: bool,
}

fn default_check() -> bool {
    true
}

fn default_wait_s() -> f64 {
    60.0
}

fn default_keepalive_s() -> f64 {
    1.0
}

fn default_dead_after_s() -> f64 {
    5.0
}

/// `[stop]`: when training ends (whichever comes first; all optional).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopSection {
    /// Stop once every model's mean return reaches this (its last 20 episodes, or its
    /// last batch of generated completions).
    pub target_return: Option<f64>,
    /// Stop once every model's latest validation (mean return or reward on held-out
    /// episodes or prompts) reaches this.
    pub target_eval: Option<f64>,
    /// Stop after this many weight updates.
    pub max_updates: Option<u64>,
    /// Stop after this many seconds of wall time.
    pub max_time_s: Option<f64>,
}

/// `[checkpoint]`: the trainers' state saved every `every` versions, to resume a run from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// Where checkpoints go: `DIR/MODEL/vVERSION.safetensors` (relative paths from each
    /// rank's working directory; a folder every trainer rank and rank 0 reach).
    pub dir: std::path::PathBuf,
    /// Save every this many versions (>= 1): at each version divisible by it.
    pub every: u64,
    /// How many checkpoints of each model are kept (>= 1; older ones are removed).
    #[serde(default = "default_keep")]
    pub keep: u32,
    /// Start from the newest checkpoint every model has (`refit launch --resume` sets it).
    /// A run told to resume that finds no usable checkpoint fails, naming why: it never
    /// starts from zero silently.
    #[serde(default)]
    pub resume: bool,
}

fn default_keep() -> u32 {
    2
}

/// One `[[model]]`: a synchronised model, with free-form parameters for the user's roles.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The model's id (what weight sets and the controller name it by).
    pub id: ModelId,
    /// Free-form table handed to the user's role factory.
    #[serde(default)]
    pub params: toml::Table,
    /// The transport of this model's weights (default: `[links] weights`).
    pub link: Option<LinkTransport>,
    /// The engine's layout and dtypes of this model (default: the roles' own, or none).
    pub convert: Option<super::convert::ConvertSection>,
    /// What engines verify of the weights they serve (default `off`).
    #[serde(default)]
    pub verify: Verify,
    /// How a version is committed across the model's engines (default `all`).
    #[serde(default)]
    pub commit: Commit,
    /// How the model's engines take a version in (default `staged`).
    #[serde(default)]
    pub apply: Apply,
}

/// How an engine takes a version of a model in: beside generation into a second copy, or
/// tensor by tensor into the served model while generation of it is paused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Apply {
    /// `apply = "staged"`: the version is pulled and checked whole, and staged beside
    /// generation; the pause holds only the load. The engine holds the model twice (and
    /// the receiver's copy) during an update.
    #[default]
    Staged,
    /// `apply = "streaming"`: at the commit, generation of the model stops, and the
    /// version is pulled and loaded tensor by tensor as its bytes are verified; the pause
    /// holds the transfer. The receiver holds a few buckets, not the model. A version
    /// that fails part-way leaves the engine's model mixed: the engine is fenced from
    /// rollouts until a version streams in whole. Offered by backend engines (the Python
    /// engine, vLLM's); Refit's own engines stage.
    Streaming,
}

impl Apply {
    /// The name used in topology files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Staged => "staged",
            Self::Streaming => "streaming",
        }
    }
}

/// How the controller commits a model's version across its engines: every engine stages
/// the version first (fetched and validated, nothing served yet), then the controller
/// commits it (each engine serves it) or aborts it everywhere.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Commit {
    /// `commit = "all"`: committed only when every engine staged it; otherwise aborted
    /// everywhere and the fleet keeps serving the previous version, whole.
    #[default]
    All,
    /// `commit = { quorum = N }`: committed when at least N engines staged it; the others
    /// are fenced (no rollouts are admitted from them) until they serve the fleet's version
    /// again, which the controller reloads on them.
    Quorum(u32),
}

impl std::fmt::Display for Commit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Quorum(n) => write!(f, "quorum {n}"),
        }
    }
}

/// What an engine verifies of the weights it serves, per model. The values form a ladder:
/// each does what the ones before it do.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Nothing past the transport's own checks of the bytes in flight.
    #[default]
    Off,
    /// Every tensor sent was applied. Refit's own engines do this always (a version whose
    /// tensors are not the policy's is refused before anything is applied); the vLLM backend
    /// checks the names `load_weights` reports loaded.
    Names,
    /// A corrupt-then-restore self-test at the engine's first update: a copy of the version
    /// with every element changed is loaded and read back, then the version itself. A tensor
    /// the update path does not carry fails that first load, naming it (however equal the
    /// engine's initial weights and the version were).
    Startup,
    /// The self-test, and after each apply the engine hashes what it serves, tensor by
    /// tensor, against the version applied (an apply that did not land whole fails), and
    /// again at the next update: weights changed while served are reported by that update,
    /// naming the engine, the model and the tensor.
    Hashes,
}

impl Verify {
    /// The name used in topology files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Names => "names",
            Self::Startup => "startup",
            Self::Hashes => "hashes",
        }
    }
}

/// One `[[host]]`: a machine the run spans.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSection {
    /// The name processes refer to it by.
    pub name: String,
    /// Its address (IP or resolvable host name) as the other hosts reach it. Left out, the
    /// scheduler gives it: `refit launch` fills it from Slurm's node list or a Kubernetes
    /// StatefulSet's pods (`refit_node::launch::scheduler_hosts`), as an override every
    /// rank applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
}

impl HostSection {
    /// The host assumed when the file declares none: `local` at `127.0.0.1`.
    pub fn local() -> Self {
        Self {
            name: "local".into(),
            addr: Some("127.0.0.1".into()),
        }
    }

    /// Its address.
    ///
    /// # Errors
    /// [`Error::Topology`] naming `host[NAME].addr` when the file leaves it to a scheduler
    /// and nothing filled it in.
    pub fn address(&self) -> Result<&str> {
        self.addr.as_deref().ok_or_else(|| Error::Topology {
            key: format!("host[{}].addr", self.name),
            reason: format!(
                "host `{}` has no address: the file leaves it to the scheduler, and none gave \
                 it (`refit launch` under Slurm takes it from SLURM_STEP_NODELIST or \
                 SLURM_JOB_NODELIST, under Kubernetes from the StatefulSet's pods named by \
                 REFIT_K8S_SERVICE); elsewhere write it, or set it for one run with \
                 `--set host.{}.addr=ADDRESS`",
                self.name, self.name
            ),
        })
    }
}

/// What an actor does; a process holds one or more roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Turns batches into new weight versions and publishes them.
    Trainer,
    /// The weight-sync controller (sync modes, staleness, eval steps).
    Controller,
    /// Runs validation on eval steps.
    Evaluator,
    /// An inference engine: loads weights, answers act/generate requests.
    Engine,
    /// Rollout/collector workers feeding the trainer through an engine.
    Rollout,
}

impl Role {
    /// The name used in topology files.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Trainer => "trainer",
            Self::Controller => "controller",
            Self::Evaluator => "evaluator",
            Self::Engine => "engine",
            Self::Rollout => "rollout",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn one() -> u32 {
    1
}

/// One `[[process]]`: a program instance (times `replicas`) holding some roles.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessSection {
    /// Unique name (shown in the launcher's reports).
    pub name: String,
    /// The host it runs on; optional in the file when there is one host, always filled in
    /// once parsed.
    #[serde(default)]
    pub host: String,
    /// The host of each copy, in order (copy `i` on `hosts[i]`), instead of `host`: a
    /// process whose copies span machines (a trainer sharded across hosts). As many as
    /// `replicas`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// How many copies of this process run (consecutive ranks), at least 1.
    #[serde(default = "one")]
    pub replicas: u32,
    /// What it does.
    pub roles: Vec<Role>,
    /// Rollout worker actors per model in each copy (default: the model's
    /// `params.workers`, else 1; only with `rollout`).
    pub rollout_workers: Option<u32>,
    /// The models its trainer, engine and rollout roles serve (default: every model).
    pub models: Option<Vec<ModelId>>,
    /// The program and its arguments for this process's ranks, instead of `[run] command`.
    pub command: Option<Vec<String>>,
    /// More environment variables for this process's ranks (not the launcher's own:
    /// [`RESERVED_ENV`]).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Whether a rank that dies with a failure is started again (never for rank 0).
    #[serde(default)]
    pub restart: Restart,
    /// How many times each rank may be restarted (only with `restart = "on-failure"`;
    /// default [`DEFAULT_MAX_RESTARTS`]).
    pub max_restarts: Option<u32>,
    /// The address this process's nodes listen on (`0.0.0.0`: every interface), apart from
    /// the host's `addr`, which the other ranks reach them at. Default: the host's `addr`.
    pub bind: Option<String>,
    /// A fixed port for this process's nodes instead of a free one: copy `i` listens on
    /// `port + i`. For rank 0 it is the rendezvous port (`MASTER_PORT`'s default).
    pub port: Option<u16>,
}

impl ProcessSection {
    /// True when the process holds `role`.
    pub fn has(&self, role: Role) -> bool {
        self.roles.contains(&role)
    }

    /// The host copy `replica` runs on: `hosts[replica]` when the file names the host of
    /// each copy, else `host`.
    pub fn host_of(&self, replica: u32) -> &str {
        usize::try_from(replica)
            .ok()
            .and_then(|r| self.hosts.get(r))
            .unwrap_or(&self.host)
    }
}

/// How far apart the two ends of a link may be: what a transport reaches, and what `auto`
/// asks of one (the link factory, `refit_transports::link`, knows which transport reaches
/// how far).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reach {
    /// Both ends in one process (threads, actors).
    Process,
    /// Processes of one host.
    Host,
    /// Processes of any hosts that reach each other over the network.
    Network,
}

impl std::fmt::Display for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Process => "one process",
            Self::Host => "one host",
            Self::Network => "the network",
        })
    }
}

/// A transport as written in `[links]`: `auto` or a transport's name. Names are the link
/// factory's; whoever opens links checks them ([`Topology::check_links`](super::Topology::check_links)).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum LinkTransport {
    /// In-process when both ends share a process, else the nearest transport that reaches
    /// one host, else one that reaches the network.
    #[default]
    Auto,
    /// The transport of this name (lowercase).
    Named(String),
}

impl From<String> for LinkTransport {
    fn from(s: String) -> Self {
        let s = s.trim().to_ascii_lowercase();
        if s == "auto" {
            Self::Auto
        } else {
            Self::Named(s)
        }
    }
}

impl From<LinkTransport> for String {
    fn from(l: LinkTransport) -> Self {
        l.as_str().to_owned()
    }
}

impl LinkTransport {
    /// The name used in topology files.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Auto => "auto",
            Self::Named(n) => n,
        }
    }
}

impl std::fmt::Display for LinkTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The transport of one link once placement is known: a name, or for `auto` the reach the
/// link needs (the link factory picks the nearest transport of that reach).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// The transport `[links]` names.
    Named(String),
    /// `auto`: the nearest transport that reaches this far.
    Nearest(Reach),
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Named(n) => f.write_str(n),
            Self::Nearest(r) => write!(f, "auto (within {r})"),
        }
    }
}

/// `[links]`: the transport of each kind of link.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinksSection {
    /// Trainer -> engine weights.
    #[serde(default)]
    pub weights: LinkTransport,
    /// A checksum per version of every weight link, verified by each receiver before it
    /// admits the version (shared memory, where it is off by default; TCP, file and
    /// broadcast check theirs whatever this says).
    #[serde(default)]
    pub checksum: bool,
    /// What a version after the first carries over links that pull from a version the
    /// receiver holds (TCP): every byte, the buckets holding a changed tensor, or those
    /// buckets as element-level deltas.
    #[serde(default)]
    pub delta: Deltas,
    /// How the versions of a sharded trainer (a trainer process with `replicas > 1`) reach
    /// its engines.
    #[serde(default)]
    pub sharded: Sharded,
}

/// `links.sharded`: how a sharded trainer's versions reach its engines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sharded {
    /// Every shard sends its part to shard 0, which assembles each version and publishes
    /// it through the weight links (any transport, conversions to the engines' layout).
    #[default]
    Gather,
    /// Every shard publishes its own part (a flat run of the model's elements) over TCP
    /// and every engine pulls each version from all shards at once: no gather at shard
    /// 0, each shard's uplink carries its part only. The engines serve the trainer's
    /// layout (no conversion).
    Mesh,
}

/// `links.delta`: what a version after the first carries to a receiver that holds an
/// earlier one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Deltas {
    /// Every byte of every version.
    Off,
    /// The buckets holding a tensor that changed, whole (unchanged tensors stay behind).
    #[default]
    Buckets,
    /// Those buckets as their element-level difference against the version the receiver
    /// holds (the changed bytes, compressed): bytes on the wire follow what changed, at
    /// the cost of encoding on the sender and copying the held version on the receiver.
    /// For links where bytes are dear (across hosts, across regions).
    Elements,
}

/// The whole file as written, before validation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTopology {
    pub(crate) run: RunSection,
    #[serde(default)]
    pub(crate) sync: SyncConfig,
    #[serde(default)]
    pub(crate) stop: StopSection,
    #[serde(default, rename = "model")]
    pub(crate) models: Vec<ModelSection>,
    #[serde(default, rename = "host")]
    pub(crate) hosts: Vec<HostSection>,
    #[serde(default, rename = "process")]
    pub(crate) processes: Vec<ProcessSection>,
    #[serde(default)]
    pub(crate) links: LinksSection,
    #[serde(default)]
    pub(crate) checkpoint: Option<CheckpointSection>,
}
