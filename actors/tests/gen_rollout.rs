//! Generating rollouts, the pool and validation: per-token versions reach the trainer's
//! batch, aborted completions are generated again so groups stay whole, stale sequences
//! are dropped whole by their oldest token, and the controller drives a generating engine
//! and its evaluator through an eval step.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod generating;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_actors::WeightInlet;
use refit_actors::actor::{
    Admission, AwaitSynced, EngineRef, GenEvaluator, GenModel, GenRolloutConfig, GenRolloutWorker,
    GenerationEngine, GetEngineStats, PoolBatch, PushFragment, RunEval, StartRollouts,
    StopRollouts, TakeBatch, TrajectoryPool, VersionNotifier, WeightSyncController,
};
use refit_actors::batch::{Batch, EpisodeStats, Sequence};
use refit_actors::generation::{Finish, PauseMode, Token};
use refit_actors::task::Task;
use refit_runtime::Version;
use refit_runtime::sync_policy::{SyncConfig, SyncMode};

use generating::*;

/// A worker of 2 prompts x 2 completions of 6 tokens per fragment, its engine held by
/// `gate`, its controller fully async, its pool handing out one fragment per batch.
struct Rig {
    engine: Addr<GenerationEngine<Gated>>,
    worker: Addr<GenRolloutWorker<CountUp>>,
    pool: Addr<TrajectoryPool>,
}

fn rig(mode: PauseMode, gate: &Arc<Gate>) -> Rig {
    let engine = gated_engine(mode, gate);
    let controller = WeightSyncController::new(
        &SyncConfig::with_mode(SyncMode::FullyAsync),
        vec![policy()],
        vec![EngineRef::local(&engine)],
        None,
    )
    .unwrap()
    .start();
    // room for every fragment the worker makes before the test takes the first one
    let pool = TrajectoryPool::new(policy(), 4, None, None)
        .with_capacity_batches(10_000)
        .start();
    let cfg = GenRolloutConfig {
        prompts_per_fragment: 2,
        group_size: 2,
        seed: 9,
        timeout: DEADLINE,
        ..GenRolloutConfig::new(policy(), 3)
    };
    let worker = GenRolloutWorker::new(
        cfg,
        CountUp { max_tokens: 6 },
        engine.clone().recipient(),
        &controller,
        pool.clone().recipient(),
    )
    .unwrap()
    .start();
    Rig {
        engine,
        worker,
        pool,
    }
}

/// Starts the worker, holds its first fragment's requests at the 3rd forward pass, loads
/// version 2 and lets everything go; answers the first batch the pool hands out.
async fn first_batch_across_an_update(r: &Rig, gate: &Gate) -> PoolBatch {
    within("start", r.worker.send(StartRollouts)).await.unwrap();
    gate.allow(2);
    gate.wait_entered(3).await;
    let load = r.engine.send(refit_actors::actor::LoadWeights {
        weights: Arc::new(table(&policy(), 2)),
    });
    wait_offered(&r.engine, &policy(), Version(2)).await;
    gate.open();
    assert_eq!(within("the load", load).await.unwrap().unwrap(), Version(2));
    let batch = within(
        "a batch",
        r.pool.send(TakeBatch {
            train_version: Version(2),
            all: false,
            timeout: DEADLINE,
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let stats = within("stop", r.worker.send(StopRollouts)).await.unwrap();
    assert!(stats.error.is_none(), "{stats:?}");
    batch
}

/// Checks what every batch of this worker must hold: 2 whole groups of 2, rewards and
/// episode stats that agree with the task.
fn check_fragment(b: &Batch) {
    assert_eq!((b.frames, b.sequences.len(), b.episodes.len()), (4, 4, 4));
    let mut groups: BTreeMap<u64, Vec<&Sequence>> = BTreeMap::new();
    for s in &b.sequences {
        groups.entry(s.group).or_default().push(s);
    }
    // the worker's first fragment: its groups 0 and 1
    assert_eq!(
        groups.keys().map(|g| g & 0xff).collect::<Vec<_>>(),
        vec![0, 1]
    );
    let task = CountUp { max_tokens: 6 };
    for (g, members) in groups {
        assert_eq!(g >> 40, 3, "group ids carry the worker index");
        assert_eq!(members.len(), 2);
        assert_eq!(
            members[0].prompt, members[1].prompt,
            "a group shares its prompt"
        );
        for s in members {
            assert_eq!(s.worker, 3);
            assert_eq!(s.tokens.len(), 6);
            assert_eq!((s.logprobs.len(), s.versions.len()), (6, 6));
            let reward = task.reward(&s.prompt, &s.tokens).unwrap();
            assert_eq!(s.reward, reward.total);
            assert_eq!(s.token_rewards, reward.per_token);
        }
    }
    for (e, s) in b.episodes.iter().zip(&b.sequences) {
        assert_eq!(e.ret, f64::from(s.reward));
        assert_eq!(e.len, 6);
        assert_eq!(Some(e.version), s.versions.iter().copied().max());
    }
}

#[actix_rt::test]
async fn per_token_versions_reach_the_pools_batch() {
    let gate = Gate::closed();
    let r = rig(PauseMode::Keep, &gate);
    let taken = first_batch_across_an_update(&r, &gate).await;
    let b = &taken.batch;
    check_fragment(b);
    // every sequence's versions only grow and end at v2; the ones decoding when v2 came
    // show the change inside one sequence, with the tokens of each version
    for s in &b.sequences {
        assert!(s.versions.windows(2).all(|w| w[0] <= w[1]), "{s:?}");
        assert_eq!(s.versions.last(), Some(&Version(2)));
        assert_eq!(s.finish, Finish::Length);
        let ones = s.versions.iter().filter(|v| **v == Version(1)).count();
        let mut expected = walk(s.prompt[0], 1, ones);
        let last = expected.last().copied().unwrap_or(s.prompt[0]);
        expected.extend(walk(last, 2, 6 - ones));
        assert_eq!(s.tokens, expected, "{s:?}");
    }
    let mixed: Vec<_> = b
        .sequences
        .iter()
        .filter(|s| s.versions.contains(&Version(1)))
        .collect();
    assert!(
        !mixed.is_empty(),
        "no sequence was in flight across the update: {:?}",
        b.sequences
    );
    // at most the 3 passes before the swap were under v1; the first pass's sequences had all 3
    assert!(mixed.iter().all(|s| s.versions[3..] == [Version(2); 3]));
    assert!(mixed.iter().any(|s| s.versions[..3] == [Version(1); 3]));
    assert_eq!(b.version_range(), Some((Version(1), Version(2))));
    assert_eq!(taken.fragments.len(), 1);
    assert_eq!(taken.fragments[0].versions, (Version(1), Version(2)));
    // staleness is counted from the oldest token: v1 against a trainer at v2
    assert_eq!(taken.max_staleness, 1);
}

#[actix_rt::test]
async fn completions_aborted_by_an_update_are_generated_again_so_groups_stay_whole() {
    let gate = Gate::closed();
    let r = rig(PauseMode::Abort, &gate);
    let taken = first_batch_across_an_update(&r, &gate).await;
    let b = &taken.batch;
    check_fragment(b);
    // the aborted completions were generated again under v2: nothing aborted reaches the
    // trainer, no sequence mixes versions
    for s in &b.sequences {
        assert_eq!(s.finish, Finish::Length);
        assert_eq!(s.versions, vec![Version(2); 6], "{s:?}");
        assert_eq!(s.tokens, walk(s.prompt[0], 2, 6));
        assert_eq!(s.reward, 0.0);
    }
    let stats = within("stats", r.engine.send(GetEngineStats))
        .await
        .unwrap();
    assert!(stats.aborted >= 1, "{stats:?}");
}

fn sequence(prompt: Token, versions: &[u64]) -> Sequence {
    Sequence {
        prompt: vec![prompt],
        tokens: walk(prompt, 1, versions.len()),
        logprobs: vec![0.0; versions.len()],
        versions: versions.iter().copied().map(Version).collect(),
        reward: 1.0,
        token_rewards: None,
        group: u64::from(prompt),
        finish: Finish::Length,
        worker: 0,
        ref_logprobs: None,
    }
}

#[actix_rt::test]
async fn the_pool_drops_a_stale_sequence_whole_by_its_oldest_token() {
    let pool = TrajectoryPool::new(policy(), 2, Some(1), None).start();
    let admission = Admission {
        seq: 0,
        train_version: Version(4),
        rollout_version: Version(4),
        staleness: 0,
        waited: Duration::ZERO,
    };
    let sequences = vec![
        // its newest token is fresh, its oldest is 3 versions behind: dropped whole
        sequence(1, &[2, 3, 5, 5]),
        sequence(2, &[4, 5]),
        sequence(3, &[5, 5, 5]),
    ];
    let episodes = sequences
        .iter()
        .map(|s| EpisodeStats {
            traj_id: None,
            ret: 1.0,
            len: s.tokens.len() as u32,
            worker: 0,
            env: 0,
            version: Version(5),
        })
        .collect();
    let fragment = Batch {
        frames: sequences.len(),
        sequences,
        episodes,
        ..Batch::default()
    };
    pool.do_send(PushFragment {
        fragment,
        admission,
    });
    let taken = within(
        "a batch",
        pool.send(TakeBatch {
            train_version: Version(5),
            all: true,
            timeout: DEADLINE,
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let prompts: Vec<Token> = taken.batch.sequences.iter().map(|s| s.prompt[0]).collect();
    assert_eq!(prompts, vec![2, 3]);
    assert_eq!(taken.batch.frames, 2);
    assert_eq!(taken.dropped, 1);
    assert_eq!(taken.max_staleness, 1);
    assert_eq!(taken.batch.sequences[0].versions.len(), 2, "kept whole");
    assert_eq!(taken.totals.dropped, 1);
}

/// The controller drives a generating engine fed through a real in-process scheme with
/// the `EngineRef` it takes for any engine; on an eval step its leader cancels, loads
/// and runs the generating evaluator, which saw the model at the round's version only.
#[actix_rt::test]
async fn the_controller_loads_and_validates_a_generating_engine() {
    let m = policy();
    let (mut sender, receiver) = scheme(&m, &bigram(), table(&m, 1));
    let g = bigram();
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(
            GenModel::new(m.clone(), g.clone(), g)
                .inlet(Box::new(receiver) as Box<dyn WeightInlet>),
        )
        .unwrap()
        .start();
    let evaluator = GenEvaluator::new(
        engine.clone().recipient(),
        vec![(m.clone(), CountUp { max_tokens: 5 })],
        DEADLINE,
    )
    .start();
    let mut cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
    cfg.validate_freq = 2;
    let ctl = WeightSyncController::new(
        &cfg,
        vec![m.clone()],
        vec![EngineRef::local(&engine)],
        Some(evaluator.clone().recipient()),
    )
    .unwrap()
    .start();
    let mut notifier = VersionNotifier::new(ctl.clone(), m.clone(), cfg.clone());
    within("notify v1", notifier.notify(Version(1)))
        .await
        .unwrap();
    within("flush", notifier.flush()).await.unwrap();
    let landed = within(
        "sync v1",
        ctl.send(AwaitSynced {
            model: m.clone(),
            version: Version(1),
        }),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(landed, Version(1));
    // v1 counts up by one: every held-out completion earns the full reward
    let report = within("eval v1", evaluator.send(RunEval { step: Version(1) }))
        .await
        .unwrap()
        .unwrap();
    report.check_versions(Version(1)).unwrap();
    assert_eq!(report.models[&m].mean_return, 1.0);
    assert_eq!(report.models[&m].episodes, 3);
    // v2 is an eval step: the leader loads it everywhere and validates
    let _pending = sender.send_async(vec![table(&m, 2)]).unwrap();
    let outcome = within("notify v2", notifier.notify(Version(2)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome.version, Version(2));
    let eval = outcome.eval.expect("an eval step runs the evaluator");
    eval.check_versions(Version(2)).unwrap();
    let model_eval: &refit_actors::actor::ModelEval = &eval.models[&m];
    assert_eq!(model_eval.versions.len(), 1);
    // v2 counts up by two: no token earns the reward
    assert_eq!(model_eval.mean_return, 0.0);
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!(stats.loads, 2);
}

#[actix_rt::test]
async fn a_cancelled_fragment_is_dropped_and_the_next_one_reaches_the_pool() {
    use refit_actors::actor::CancelInFlight;
    let gate = Gate::closed();
    let r = rig(PauseMode::Keep, &gate);
    within("start", r.worker.send(StartRollouts)).await.unwrap();
    // the first fragment's requests are in the engine, held at the first pass
    gate.wait_entered(1).await;
    let epoch = within("cancel", r.engine.send(CancelInFlight))
        .await
        .unwrap();
    assert_eq!(epoch, 1);
    gate.open();
    let taken = within(
        "a batch",
        r.pool.send(TakeBatch {
            train_version: Version(1),
            all: false,
            timeout: DEADLINE,
        }),
    )
    .await
    .unwrap()
    .unwrap();
    let stats = within("stop", r.worker.send(StopRollouts)).await.unwrap();
    assert!(stats.error.is_none(), "{stats:?}");
    assert_eq!(stats.cancelled, 1, "{stats:?}");
    // the first fragment (groups 0 and 1) was dropped; the next one is whole
    let b = &taken.batch;
    let mut groups: Vec<u64> = b.sequences.iter().map(|s| s.group & 0xff).collect();
    groups.dedup();
    assert_eq!(groups, vec![2, 3]);
    assert!(b.sequences.iter().all(|s| s.finish == Finish::Length));
    assert_eq!(b.frames, 4);
}
