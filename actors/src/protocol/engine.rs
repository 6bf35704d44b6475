//! The engine's protocol: what a controller, a rollout worker and an evaluator ask of an
//! inference engine, the wire names these messages cross processes under, and
//! [`EngineRef`], one typed reference to an engine whether it runs in this process or in
//! another.
//!
//! Two kinds of engine answer it: an acting engine (`ActBatch`: observations in, actions
//! out) and a generating engine (`Generate`: prompt tokens in, a completion with per-token
//! versions out). Each refuses the other kind's request with an error naming it, so one
//! reference type serves both.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::dev::ToEnvelope;
use actix::prelude::*;
use refit_runtime::{ModelId, Version, WeightSet};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::generation::{Completion, SamplingParams, Token};
use crate::policy::ActionOut;
use crate::remote::RemoteAddr;

/// Asks the engine's default model for an action.
#[derive(Debug, Message)]
#[rtype(result = "Result<Acted>")]
pub struct Act {
    /// The observation.
    pub obs: Vec<f32>,
}

/// An action and the weights version that chose it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Acted {
    /// The action and its log-probability.
    pub out: ActionOut,
    /// The version of the weights that acted.
    pub version: Version,
}

/// Asks one model for actions on several observations at once (one rollout step of a
/// vector of environments).
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<ActedBatch>")]
pub struct ActBatch {
    /// The model.
    pub model: ModelId,
    /// Observations, one after the other (`n * obs_dim` values).
    pub obs: Vec<f32>,
    /// The cancellation epoch the episode started in (`None`: not cancellable). A
    /// request from an older epoch is refused with [`Error::Cancelled`].
    pub epoch: Option<u64>,
    /// Greedy actions (evaluation) instead of samples.
    pub greedy: bool,
}

/// The answer to [`ActBatch`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActedBatch {
    /// One action per observation.
    pub actions: Vec<ActionOut>,
    /// The version of the weights that acted (one version for the whole request).
    pub version: Version,
    /// The engine's cancellation epoch.
    pub epoch: u64,
}

/// Pauses generation of every model: requests queue until [`Continue`].
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Pause;

/// Resumes generation and answers the queued requests.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Continue;

/// Loads weights pushed by the caller (validated whole first; a refused version leaves the
/// served one). The model is the one the weight set names; its requests queue during the
/// apply, other models keep being served.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<Version>")]
pub struct LoadWeights {
    /// The weights.
    pub weights: Arc<WeightSet>,
}

/// Brings one model to at least `version`: fetch through the model's inlet and validate
/// (staging, generation goes on), then pause that model, apply, continue, and acknowledge
/// the version to its sender (an ack means served). Loads of one model are serialised by a
/// per-model lock; loads of different models overlap.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<LoadReport>")]
pub struct UpdateModel {
    /// The model.
    pub model: ModelId,
    /// The least version to serve afterwards.
    pub version: Version,
    /// Deadline for the whole load: the wait for the model's load lock, the fetch, and the
    /// wait for a running batch or a step boundary at the commit.
    pub timeout: Duration,
}

/// Stages a version of one model without serving it (the first half of [`UpdateModel`]):
/// fetch through the model's inlet and validate, beside generation. The staged version is
/// held, with the model's load lock, until [`CommitModel`] serves it, [`AbortStage`] drops
/// it, or `hold` passes (then it is dropped: a controller that went away holds nothing for
/// good). A second stage of the same model replaces what is held. This is how a controller
/// commits a version across a fleet: stage everywhere, then commit everywhere, or nowhere.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<StageReport>")]
pub struct StageModel {
    /// The model.
    pub model: ModelId,
    /// The least version to stage (the inlet may bring a newer one).
    pub version: Version,
    /// Deadline for the fetch.
    pub timeout: Duration,
    /// How long the staged version is held before it is dropped uncommitted.
    pub hold: Duration,
}

/// What a [`StageModel`] holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReport {
    /// The model.
    pub model: ModelId,
    /// The version staged, or (`fresh` false) the version already served, when the inlet
    /// had nothing newer.
    pub version: Version,
    /// Whether a new version is held for a commit.
    pub fresh: bool,
    /// Lock wait, fetch and validation.
    pub staged: Duration,
}

/// Serves the version a [`StageModel`] staged: pause the model, apply, continue, and
/// acknowledge to its sender (the second half of [`UpdateModel`]). A version already served
/// answers at once; one neither staged nor served is refused.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "Result<LoadReport>")]
pub struct CommitModel {
    /// The model.
    pub model: ModelId,
    /// The version staged.
    pub version: Version,
    /// Deadline for the swap (a generating engine in `wait` mode drains first).
    pub timeout: Duration,
}

/// Drops what a [`StageModel`] holds of a model, serving nothing new (the fleet did not
/// commit); nothing held is not an error.
#[derive(Debug, Clone, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
pub struct AbortStage {
    /// The model.
    pub model: ModelId,
}

/// What one load did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The model.
    pub model: ModelId,
    /// The version served afterwards.
    pub version: Version,
    /// Waiting for the per-model lock plus fetching and validating the bytes.
    pub staged: Duration,
    /// How long the model's generation was paused (the apply only).
    pub paused: Duration,
    /// With `verify = "hashes"`: how the weights this engine served before this version
    /// differed from the version it had applied (changed while served), naming the tensor.
    /// This version replaced them whole.
    pub damaged: Option<String>,
}

impl LoadReport {
    /// A load that found `version` served already (an earlier load brought it): nothing
    /// applied, no pause.
    pub fn already_served(model: ModelId, version: Version, staged: Duration) -> Self {
        Self {
            model,
            version,
            staged,
            paused: Duration::ZERO,
            damaged: None,
        }
    }
}

/// Cancels in-flight episodes: requests of older cancellation epochs are refused from now on, and
/// queued ones are answered with [`Error::Cancelled`]. Answers the new epoch.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "u64")]
pub struct CancelInFlight;

/// Asks which version the default model serves.
#[derive(Debug, Message)]
#[rtype(result = "Version")]
pub struct ServedVersion;

/// Asks which version every model serves.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "BTreeMap<ModelId, Version>")]
pub struct ServedVersions;

/// Asks for the engine's load statistics.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "EngineStats")]
pub struct GetEngineStats;

/// Load statistics of an engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Loads applied.
    pub loads: u64,
    /// Total time models were paused for applies.
    pub paused_total: Duration,
    /// Longest single pause.
    pub paused_max: Duration,
    /// Total staging time (lock wait + fetch + validation), outside any pause.
    pub staged_total: Duration,
    /// Requests refused because their episode was cancelled (a generating engine also
    /// counts the in-flight requests it ended with `Finish::Cancelled`).
    pub cancelled: u64,
    /// Tokens generated (a generating engine; zero for an acting engine).
    pub tokens: u64,
    /// Total time generation went on under the old version while a new one waited for its
    /// boundary (a generating engine's drains in `wait` mode, a backend's wait for the
    /// running batch or, committed in flight, for its step boundary; not a pause).
    pub drained_total: Duration,
    /// Sequences ended by an update in `abort` mode (a generating engine, or a backend
    /// engine whose backend ends them when interrupted).
    pub aborted: u64,
}

/// Asks a generating engine for one completion of `prompt` with `model`.
///
/// The request joins the model's running batch at the next step boundary (a model with no
/// weights yet queues it until its first version is swapped in); a bad request (empty
/// prompt, a token outside the vocabulary, past the context, bad sampling parameters) is
/// answered at once with [`Error::BadRequest`] naming the field.
/// The caller's deadline bounds the wait.
#[derive(Debug, Clone, PartialEq, Message, Serialize, Deserialize)]
#[rtype(result = "Result<Completion>")]
pub struct Generate {
    /// The model.
    pub model: ModelId,
    /// The prompt tokens.
    pub prompt: Vec<Token>,
    /// How to sample.
    pub params: SamplingParams,
    /// The cancellation epoch the request's episode started in (`None`: not
    /// cancellable). A request of an older epoch is refused with
    /// [`Error::Cancelled`].
    pub epoch: Option<u64>,
}

/// Asks a generating engine for the log-probability of each of `tokens` after `prompt`
/// under `model` (teacher forcing: the tokens are fed, not sampled), at `temperature`
/// (`0`: the model's own distribution). The request is decoded beside the generation
/// requests, takes the same swaps and cancellations, and is answered as a [`Completion`]
/// whose `tokens` are the given ones, `logprobs` their scores and `versions` the versions
/// that scored them. A bad request is refused with
/// [`Error::BadRequest`] naming the field (`prompt`, `tokens`,
/// `temperature`).
#[derive(Debug, Clone, PartialEq, Message, Serialize, Deserialize)]
#[rtype(result = "Result<Completion>")]
pub struct Score {
    /// The model that scores.
    pub model: ModelId,
    /// The prompt tokens.
    pub prompt: Vec<Token>,
    /// The tokens to score, in order after the prompt.
    pub tokens: Vec<Token>,
    /// Softmax temperature of the scores.
    pub temperature: f32,
    /// The cancellation epoch, as [`Generate::epoch`].
    pub epoch: Option<u64>,
}

crate::remote_reply!(EngineStats);

// ANCHOR: wire_names
crate::remote::wire_names! {
    // `UpdateModel` is the call that tells a receiver to pull fresh weights
    UpdateModel => "_receive_weights_scheme",
    StageModel => "engine.stage",
    CommitModel => "engine.commit",
    AbortStage => "engine.abort_stage",
    CancelInFlight => "engine.cancel_in_flight",
    ServedVersions => "engine.served_versions",
    GetEngineStats => "engine.stats",
    ActBatch => "engine.act_batch",
    Generate => "engine.generate",
    Score => "engine.score",
}
// ANCHOR_END: wire_names

/// An actor that answers the engine's weight plane (an acting or a generating engine): the
/// calls the controller makes. What it serves beside is [`Requests`].
pub trait EngineActor:
    Actor
    + Handler<UpdateModel>
    + Handler<StageModel>
    + Handler<CommitModel>
    + Handler<AbortStage>
    + Handler<CancelInFlight>
    + Handler<ServedVersions>
    + Handler<GetEngineStats>
where
    Self::Context: ToEnvelope<Self, UpdateModel>
        + ToEnvelope<Self, StageModel>
        + ToEnvelope<Self, CommitModel>
        + ToEnvelope<Self, AbortStage>
        + ToEnvelope<Self, CancelInFlight>
        + ToEnvelope<Self, ServedVersions>
        + ToEnvelope<Self, GetEngineStats>,
{
}

impl<A> EngineActor for A
where
    A: Actor
        + Handler<UpdateModel>
        + Handler<StageModel>
        + Handler<CommitModel>
        + Handler<AbortStage>
        + Handler<CancelInFlight>
        + Handler<ServedVersions>
        + Handler<GetEngineStats>,
    A::Context: ToEnvelope<A, UpdateModel>
        + ToEnvelope<A, StageModel>
        + ToEnvelope<A, CommitModel>
        + ToEnvelope<A, AbortStage>
        + ToEnvelope<A, CancelInFlight>
        + ToEnvelope<A, ServedVersions>
        + ToEnvelope<A, GetEngineStats>,
{
}

// ANCHOR: engine_ref
crate::protocol::role_ref! {
    /// One engine's weight plane, in this process or another: what the controller drives
    /// (the same recipients either way). What the engine serves beside is [`Requests`].
    pub struct EngineRef {
        /// Loads (`_receive_weights_scheme`).
        update: UpdateModel,
        /// Stages a version for a fleet-wide commit.
        stage: StageModel,
        /// Serves the staged version.
        commit: CommitModel,
        /// Drops the staged version.
        abort: AbortStage,
        /// Cancels in-flight episodes.
        cancel: CancelInFlight,
        /// Versions served.
        versions: ServedVersions,
        /// Load statistics.
        stats: GetEngineStats,
    }
    /// The reference of an engine started in this process.
    pub fn local(engine);
    /// The reference of an engine another process serves (see [`EngineRef::serve`]):
    /// every message forwards through `engine`'s connection, with its deadline.
    ///
    /// # Panics
    /// Outside a running actix system (the forwarding proxies are actors).
    pub fn remote(engine);
    /// Serves this engine's weight plane on `node` under `target`, for other processes.
    pub fn serve;
}

crate::protocol::role_ref! {
    /// What an acting engine serves: actions for observations.
    pub struct ActRef {
        /// Actions for a batch of observations.
        act: ActBatch,
    }
    /// The reference of an acting engine started in this process.
    pub fn local(engine);
    /// The reference of an acting engine another process serves.
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(engine);
    /// Serves the engine's actions on `node` under `target`.
    pub fn serve;
}

crate::protocol::role_ref! {
    /// What a generating engine serves: completions for prompts, and scores of given
    /// completions.
    pub struct GenerateRef {
        /// Completions for prompts.
        generate: Generate,
        /// Scores of given completions (a KL reference's log-probabilities).
        score: Score,
    }
    /// The reference of a generating engine started in this process.
    pub fn local(engine);
    /// The reference of a generating engine another process serves.
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(engine);
    /// Serves the engine's completions and scores on `node` under `target`.
    pub fn serve;
}
// ANCHOR_END: engine_ref

/// Which requests an engine serves beside its weight plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Actions for observations ([`ActRef`]).
    Acting,
    /// Completions and scores ([`GenerateRef`]).
    Generating,
}

/// The requests one engine serves: an acting engine's actions, or a generating engine's
/// completions and scores. No engine carries a request it would refuse.
#[derive(Debug, Clone)]
pub enum Requests {
    /// An acting engine.
    Act(ActRef),
    /// A generating engine.
    Generate(GenerateRef),
}

/// One engine: the weight plane the controller drives, and the requests it serves.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    /// Its weight plane.
    pub weights: EngineRef,
    /// What it serves.
    pub requests: Requests,
}

impl EngineHandle {
    /// An acting engine of this process.
    pub fn acting<A>(engine: &Addr<A>) -> Self
    where
        A: EngineActor + Handler<ActBatch>,
        A::Context: ToEnvelope<A, UpdateModel>
            + ToEnvelope<A, StageModel>
            + ToEnvelope<A, CommitModel>
            + ToEnvelope<A, AbortStage>
            + ToEnvelope<A, CancelInFlight>
            + ToEnvelope<A, ServedVersions>
            + ToEnvelope<A, GetEngineStats>
            + ToEnvelope<A, ActBatch>,
    {
        Self {
            weights: EngineRef::local(engine),
            requests: Requests::Act(ActRef::local(engine)),
        }
    }

    /// A generating engine of this process.
    pub fn generating<A>(engine: &Addr<A>) -> Self
    where
        A: EngineActor + Handler<Generate> + Handler<Score>,
        A::Context: ToEnvelope<A, UpdateModel>
            + ToEnvelope<A, StageModel>
            + ToEnvelope<A, CommitModel>
            + ToEnvelope<A, AbortStage>
            + ToEnvelope<A, CancelInFlight>
            + ToEnvelope<A, ServedVersions>
            + ToEnvelope<A, GetEngineStats>
            + ToEnvelope<A, Generate>
            + ToEnvelope<A, Score>,
    {
        Self {
            weights: EngineRef::local(engine),
            requests: Requests::Generate(GenerateRef::local(engine)),
        }
    }

    /// An engine of `family` another process serves ([`EngineHandle::serve`]).
    ///
    /// # Panics
    /// Outside a running actix system.
    pub fn remote(engine: &RemoteAddr, family: Family) -> Self {
        Self {
            weights: EngineRef::remote(engine),
            requests: match family {
                Family::Acting => Requests::Act(ActRef::remote(engine)),
                Family::Generating => Requests::Generate(GenerateRef::remote(engine)),
            },
        }
    }

    /// Serves the engine's weight plane and requests on `node` under `target`.
    pub fn serve(&self, node: &refit_node::Node, target: uuid::Uuid) {
        self.weights.serve(node, target);
        match &self.requests {
            Requests::Act(a) => a.serve(node, target),
            Requests::Generate(g) => g.serve(node, target),
        }
    }

    /// Its actions.
    ///
    /// # Errors
    /// [`Error::Config`] for a generating engine.
    pub fn act(&self) -> Result<&ActRef> {
        match &self.requests {
            Requests::Act(a) => Ok(a),
            Requests::Generate(_) => Err(Error::Config(
                "a generating engine serves completions, not actions".into(),
            )),
        }
    }

    /// Its completions and scores.
    ///
    /// # Errors
    /// [`Error::Config`] for an acting engine.
    pub fn generate(&self) -> Result<&GenerateRef> {
        match &self.requests {
            Requests::Generate(g) => Ok(g),
            Requests::Act(_) => Err(Error::Config(
                "an acting engine serves actions, not completions".into(),
            )),
        }
    }
}
// ANCHOR_END: engine_ref
