//! Serving the framework's actors, and the engine handle of a remote engine.
//!
//! Generic over the actor type (any actor that handles the messages), so they serve an
//! engine, controller, pool or evaluator of any policy or environment.

use actix::dev::ToEnvelope;
use actix::{Actor, Addr, Handler};
use refit_node::Node;
use uuid::Uuid;

use super::addr::RemoteAddr;
use super::serve::serve;
use crate::actor::{
    ActBatch, AwaitRollout, BatchReady, CancelInFlight, CheckRollout, EngineHandle, Generate,
    GetStatus, NotifyVersion, PushFragment, RolloutDone, RunEval, ServedVersions, UpdateModel,
};

/// Serves an inference engine's remote messages under `target`: `UpdateModel`
/// (`_receive_weights_scheme`), `CancelInFlight`, `ServedVersions` and `ActBatch`.
pub fn serve_engine<A>(node: &Node, target: Uuid, engine: &Addr<A>)
where
    A: Actor
        + Handler<UpdateModel>
        + Handler<CancelInFlight>
        + Handler<ServedVersions>
        + Handler<ActBatch>,
    A::Context: ToEnvelope<A, UpdateModel>
        + ToEnvelope<A, CancelInFlight>
        + ToEnvelope<A, ServedVersions>
        + ToEnvelope<A, ActBatch>,
{
    serve::<UpdateModel>(node, target, engine.clone().recipient());
    serve::<CancelInFlight>(node, target, engine.clone().recipient());
    serve::<ServedVersions>(node, target, engine.clone().recipient());
    serve::<ActBatch>(node, target, engine.clone().recipient());
}

/// Serves a generating engine's remote messages under `target`: `UpdateModel`
/// (`_receive_weights_scheme`), `CancelInFlight`, `ServedVersions` and `Generate`
/// (`engine.generate`); [`engine_handle`] makes its `EngineHandle` as for an action engine.
pub fn serve_gen_engine<A>(node: &Node, target: Uuid, engine: &Addr<A>)
where
    A: Actor
        + Handler<UpdateModel>
        + Handler<CancelInFlight>
        + Handler<ServedVersions>
        + Handler<Generate>,
    A::Context: ToEnvelope<A, UpdateModel>
        + ToEnvelope<A, CancelInFlight>
        + ToEnvelope<A, ServedVersions>
        + ToEnvelope<A, Generate>,
{
    serve::<UpdateModel>(node, target, engine.clone().recipient());
    serve::<CancelInFlight>(node, target, engine.clone().recipient());
    serve::<ServedVersions>(node, target, engine.clone().recipient());
    serve::<Generate>(node, target, engine.clone().recipient());
}

/// The [`EngineHandle`] of an engine served with [`serve_engine`] by another process: what
/// a controller takes, forwarding through proxies (see [`RemoteAddr::recipient`]).
///
/// # Panics
/// Outside a running actix system, as [`RemoteAddr::recipient`].
pub fn engine_handle(engine: &RemoteAddr) -> EngineHandle {
    EngineHandle {
        update: engine.recipient(),
        cancel: engine.recipient(),
        versions: engine.recipient(),
    }
}

/// Serves a weight-sync controller's remote messages under `target`: `AwaitRollout`,
/// `CheckRollout`, `RolloutDone`, `BatchReady`, `NotifyVersion` and `GetStatus`.
pub fn serve_controller<A>(node: &Node, target: Uuid, controller: &Addr<A>)
where
    A: Actor
        + Handler<AwaitRollout>
        + Handler<CheckRollout>
        + Handler<RolloutDone>
        + Handler<BatchReady>
        + Handler<NotifyVersion>
        + Handler<GetStatus>,
    A::Context: ToEnvelope<A, AwaitRollout>
        + ToEnvelope<A, CheckRollout>
        + ToEnvelope<A, RolloutDone>
        + ToEnvelope<A, BatchReady>
        + ToEnvelope<A, NotifyVersion>
        + ToEnvelope<A, GetStatus>,
{
    serve::<AwaitRollout>(node, target, controller.clone().recipient());
    serve::<CheckRollout>(node, target, controller.clone().recipient());
    serve::<RolloutDone>(node, target, controller.clone().recipient());
    serve::<BatchReady>(node, target, controller.clone().recipient());
    serve::<NotifyVersion>(node, target, controller.clone().recipient());
    serve::<GetStatus>(node, target, controller.clone().recipient());
}

/// Serves a trajectory pool's `PushFragment` under `target` (rollout workers in other
/// processes push their fragments through a proxy `Recipient<PushFragment>`).
pub fn serve_pool<A>(node: &Node, target: Uuid, pool: &Addr<A>)
where
    A: Actor + Handler<PushFragment>,
    A::Context: ToEnvelope<A, PushFragment>,
{
    serve::<PushFragment>(node, target, pool.clone().recipient());
}

/// Serves an evaluator's `RunEval` under `target`.
pub fn serve_evaluator<A>(node: &Node, target: Uuid, evaluator: &Addr<A>)
where
    A: Actor + Handler<RunEval>,
    A::Context: ToEnvelope<A, RunEval>,
{
    serve::<RunEval>(node, target, evaluator.clone().recipient());
}
