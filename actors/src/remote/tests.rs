use std::collections::BTreeSet;
use std::time::Duration;

use refit_runtime::sync_policy::{BlockReason, LeaderStep, RolloutState};
use refit_runtime::wire::{self, MAX_CONTROL_MESSAGE};
use refit_runtime::{ModelId, Version};

use super::*;
use crate::actor::{
    ActBatch, Admission, AwaitRollout, BatchReady, CancelInFlight, CheckRollout, ControllerStatus,
    GetStatus, ModelStatus, NotifyVersion, PushFragment, RolloutDone, RunEval, ServedVersions,
    SyncEvent, SyncEventKind, UpdateModel,
};
use crate::error::{Error, RemoteFailure};

#[test]
fn framework_messages_have_distinct_wire_names() {
    let names = [
        UpdateModel::NAME,
        CancelInFlight::NAME,
        ServedVersions::NAME,
        ActBatch::NAME,
        AwaitRollout::NAME,
        CheckRollout::NAME,
        RolloutDone::NAME,
        BatchReady::NAME,
        NotifyVersion::NAME,
        GetStatus::NAME,
        crate::protocol::controller::GetCounts::NAME,
        PushFragment::NAME,
        RunEval::NAME,
    ];
    let set: BTreeSet<&str> = names.iter().copied().collect();
    assert_eq!(set.len(), names.len(), "{names:?}");
    assert_eq!(UpdateModel::NAME, "_receive_weights_scheme");
}

#[test]
fn a_controller_status_round_trips_with_its_state_names() {
    let m = ModelId::new("policy").unwrap();
    let admission = Admission {
        seq: 4,
        train_version: Version(3),
        rollout_version: Version(2),
        staleness: 1,
        waited: Duration::from_millis(15),
    };
    let mut status = ControllerStatus {
        models: Default::default(),
        acquisition_paused: true,
        evals: 2,
        events: vec![
            SyncEvent {
                seq: 1,
                at: Duration::from_millis(3),
                model: Some(m.clone()),
                kind: SyncEventKind::Admitted(admission),
            },
            SyncEvent {
                seq: 2,
                at: Duration::from_millis(5),
                model: None,
                kind: SyncEventKind::Blocked(BlockReason::Staleness {
                    train: Version(3),
                    rollout: Version(1),
                }),
            },
            SyncEvent {
                seq: 3,
                at: Duration::from_millis(9),
                model: None,
                kind: SyncEventKind::Step(LeaderStep::Load(m.clone())),
            },
            SyncEvent {
                seq: 4,
                at: Duration::from_millis(11),
                model: Some(m.clone()),
                kind: SyncEventKind::Damaged("engine 1: tensor `w` differs".into()),
            },
        ],
    };
    for (i, state) in [
        RolloutState::Running,
        RolloutState::NeedSync,
        RolloutState::Syncing,
    ]
    .into_iter()
    .enumerate()
    {
        status.models.insert(
            ModelId::new(format!("m{i}")).unwrap(),
            ModelStatus {
                train_version: Version(3),
                rollout_version: Version(2),
                state,
                admissions: 7,
                blocked: 1,
                waited: Duration::from_millis(20),
                max_staleness: 1,
                loads: 2,
                failed_loads: 0,
                damaged: 1,
                fences: 1,
                fenced_for: Duration::from_millis(300),
                fenced: vec![2],
                last_error: Some("a load failed".into()),
            },
        );
    }
    let back: ControllerStatus =
        wire::decode(&wire::encode(&status).unwrap(), MAX_CONTROL_MESSAGE).unwrap();
    assert_eq!(back.models, status.models);
    assert_eq!(back.events, status.events);
    assert_eq!(
        (back.acquisition_paused, back.evals),
        (status.acquisition_paused, status.evals)
    );
}

#[test]
fn answered_errors_cross_as_wire_errors() {
    type R = crate::Result<u64>;
    // a plain error comes back as `Remote` + `Failed`, naming actor and message
    let wire_form = R::Err(Error::Config("bad knob".into())).into_wire();
    let bytes = wire::encode(&wire_form).unwrap();
    let back = R::from_wire(
        wire::decode(&bytes, MAX_CONTROL_MESSAGE).unwrap(),
        "engine-1",
        "engine.act_batch",
    );
    match back {
        Err(Error::Remote {
            actor,
            message,
            failure: RemoteFailure::Failed { error },
        }) => {
            assert_eq!((actor.as_str(), message), ("engine-1", "engine.act_batch"));
            assert!(error.contains("bad knob"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    // `Cancelled` keeps its variant; values pass through
    let back = R::from_wire(R::Err(Error::Cancelled { epoch: 3 }).into_wire(), "e", "m");
    assert!(matches!(back, Err(Error::Cancelled { epoch: 3 })));
    assert_eq!(R::from_wire(R::Ok(9).into_wire(), "e", "m").unwrap(), 9);
    // a failed call is an answer for `Result`s, nothing for plain types
    let failed = || Error::Remote {
        actor: "e".into(),
        message: "m",
        failure: RemoteFailure::Timeout {
            after: Duration::from_secs(1),
        },
    };
    assert!(matches!(R::from_failure(failed()), Some(Err(_))));
    assert!(<u64 as RemoteReply>::from_failure(failed()).is_none());
    assert!(<() as RemoteReply>::from_failure(failed()).is_none());
}

#[test]
fn a_fragment_and_a_notify_outcome_round_trip() {
    use crate::actor::{EvalReport, ModelEval, NotifyOutcome};
    use crate::batch::{Batch, EpisodeStats};
    let m = ModelId::new("policy").unwrap();
    let fragment = PushFragment {
        fragment: Batch {
            episodes: vec![EpisodeStats {
                traj_id: Some(3),
                ret: 16.0,
                len: 16,
                worker: 1,
                env: 0,
                version: Version(2),
            }],
            frames: 16,
            weight_sync: Duration::from_micros(250),
            ..Batch::default()
        },
        admission: Admission {
            seq: 1,
            train_version: Version(2),
            rollout_version: Version(2),
            staleness: 0,
            waited: Duration::ZERO,
        },
    };
    let back: PushFragment =
        wire::decode(&wire::encode(&fragment).unwrap(), MAX_CONTROL_MESSAGE).unwrap();
    assert_eq!(back.admission, fragment.admission);
    assert_eq!(back.fragment.frames, 16);
    assert_eq!(back.fragment.episodes, fragment.fragment.episodes);
    let outcome = NotifyOutcome {
        version: Version(4),
        leader: true,
        eval: Some(EvalReport {
            step: Version(4),
            models: [(
                m,
                ModelEval {
                    versions: [Version(4)].into(),
                    mean_return: 21.5,
                    episodes: 3,
                },
            )]
            .into(),
        }),
    };
    let back: NotifyOutcome =
        wire::decode(&wire::encode(&outcome).unwrap(), MAX_CONTROL_MESSAGE).unwrap();
    assert_eq!(back, outcome);
}
