//! The generating engine: requests in flight across an update in each pause mode, refused
//! versions through a real inlet, continuous batching, bad input, cancellation, and a
//! Generate across nodes.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod generating;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_actors::actor::{
    AbortStage, CancelInFlight, CommitModel, GenModel, Generate, GenerationEngine, GetEngineStats,
    GetGenStatus, LoadWeights, Score, ServedVersions, StageModel, UpdateModel,
};
use refit_actors::bigram::Bigram;
use refit_actors::generation::{Completion, Finish, PauseMode, SamplingParams, Token};
use refit_actors::{Error, RemoteFailure, WeightInlet};
use refit_runtime::{ModelId, Version};

use generating::*;

fn generate(model: &ModelId, prompt: &[Token], max_tokens: u32) -> Generate {
    Generate {
        model: model.clone(),
        prompt: prompt.to_vec(),
        params: SamplingParams::greedy(max_tokens),
        epoch: None,
    }
}

async fn answer(
    what: &str,
    r: impl std::future::Future<Output = Result<refit_actors::Result<Completion>, MailboxError>>,
) -> Completion {
    within(what, r).await.unwrap().unwrap()
}

/// A request of 12 tokens is held at its 4th forward pass (3 tokens generated under v1) while
/// version 2 is staged and handed to the decoding thread; a second request arrives after the
/// offer. Answers the first request and the second, once the load is over.
async fn across_an_update(mode: PauseMode) -> (Completion, Completion) {
    let gate = Gate::closed();
    let engine = gated_engine(mode, &gate);
    let long = engine.send(generate(&policy(), &[0], 12));
    gate.allow(3);
    gate.wait_entered(4).await;
    let load = engine.send(LoadWeights {
        weights: Arc::new(table(&policy(), 2)),
    });
    wait_offered(&engine, &policy(), Version(2)).await;
    let late = engine.send(generate(&policy(), &[5], 3));
    // the late request is in the decoding thread's channel once the engine answered this
    within("status", engine.send(GetGenStatus)).await.unwrap();
    gate.open();
    let long = answer("the long request", long).await;
    let late = answer("the late request", late).await;
    let loaded = within("the load", load).await.unwrap().unwrap();
    assert_eq!(loaded, Version(2));
    let served = within("versions", engine.send(ServedVersions))
        .await
        .unwrap();
    assert_eq!(served[&policy()], Version(2));
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!(stats.loads, 1);
    assert_eq!(stats.aborted, u64::from(mode == PauseMode::Abort));
    (long, late)
}

#[actix_rt::test]
async fn keep_mode_a_sequence_in_flight_continues_under_the_new_version() {
    let (long, late) = across_an_update(PauseMode::Keep).await;
    // the 4th forward pass was under way with v1 when v2 was offered: 4 tokens of v1, then
    // the same sequence (its cache kept) goes on under v2
    let mut versions = vec![Version(1); 4];
    versions.extend([Version(2); 8]);
    assert_eq!(long.versions, versions);
    let mut tokens = walk(0, 1, 4);
    tokens.extend(walk(4, 2, 8));
    assert_eq!(long.tokens, tokens);
    assert_eq!(long.finish, Finish::Length);
    assert_eq!(late.versions, vec![Version(2); 3]);
    assert_eq!(late.tokens, walk(5, 2, 3));
}

#[actix_rt::test]
async fn abort_mode_ends_a_sequence_in_flight_with_its_tokens_so_far() {
    let (long, late) = across_an_update(PauseMode::Abort).await;
    assert_eq!(long.finish, Finish::Aborted { by: Version(2) });
    assert_eq!(long.tokens, walk(0, 1, 4));
    assert_eq!(long.versions, vec![Version(1); 4]);
    assert_eq!(long.logprobs.len(), 4);
    assert_eq!(late.tokens, walk(5, 2, 3));
    assert_eq!(late.versions, vec![Version(2); 3]);
}

#[actix_rt::test]
async fn wait_mode_drains_under_the_old_version_then_swaps() {
    let gate = Gate::closed();
    let engine = gated_engine(PauseMode::Wait, &gate);
    let long = engine.send(generate(&policy(), &[0], 12));
    gate.allow(3);
    gate.wait_entered(4).await;
    let load = engine.send(LoadWeights {
        weights: Arc::new(table(&policy(), 2)),
    });
    wait_offered(&engine, &policy(), Version(2)).await;
    let late = engine.send(generate(&policy(), &[5], 3));
    within("status", engine.send(GetGenStatus)).await.unwrap();
    // let the drain run 4 more steps: the late request waits, v1 is still served
    gate.allow(4);
    gate.wait_entered(8).await;
    let status = within("status", engine.send(GetGenStatus)).await.unwrap()[&policy()].clone();
    assert_eq!(
        (status.served, status.offered),
        (Some(Version(1)), Some(Version(2)))
    );
    assert_eq!((status.running, status.waiting), (1, 1), "{status:?}");
    gate.open();
    let long = answer("the long request", long).await;
    let late = answer("the late request", late).await;
    // the whole long request ran under v1, the late one under v2
    assert_eq!(long.tokens, walk(0, 1, 12));
    assert_eq!(long.versions, vec![Version(1); 12]);
    assert_eq!(long.finish, Finish::Length);
    assert_eq!(late.tokens, walk(5, 2, 3));
    assert_eq!(late.versions, vec![Version(2); 3]);
    assert_eq!(within("the load", load).await.unwrap().unwrap(), Version(2));
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!((stats.loads, stats.aborted, stats.tokens), (1, 0, 15));
}

#[actix_rt::test]
async fn a_late_short_request_finishes_before_an_early_long_one() {
    let gate = Gate::closed();
    let engine = gated_engine(PauseMode::Keep, &gate);
    let long = engine.send(generate(&policy(), &[0], 20));
    gate.allow(2);
    gate.wait_entered(3).await;
    let short = engine.send(generate(&policy(), &[7], 2));
    within("status", engine.send(GetGenStatus)).await.unwrap();
    // the 3rd pass (long only), then two passes with both: the short one is done
    gate.allow(3);
    let short = answer("the short request", short).await;
    assert_eq!(short.tokens, walk(7, 1, 2));
    assert!(
        gate.entered() <= 6,
        "the long request needs 20 passes; only 5 were allowed"
    );
    let status = within("status", engine.send(GetGenStatus)).await.unwrap()[&policy()].clone();
    assert_eq!(status.running, 1, "the long request is still decoding");
    gate.open();
    let long = answer("the long request", long).await;
    assert_eq!(long.tokens, walk(0, 1, 20));
    // 20 passes in all: the short request rode along in two of them
    assert_eq!(status.stats.steps, 5);
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!(stats.tokens, 22);
}

#[actix_rt::test]
async fn bad_requests_get_a_typed_error_naming_the_field_while_others_are_served() {
    let g = bigram();
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(GenModel::new(policy(), g.clone(), g).initial(Arc::new(table(&policy(), 1))))
        .unwrap()
        .start();
    let good = engine.send(generate(&policy(), &[2], 30));
    let nan = SamplingParams {
        temperature: f32::NAN,
        ..SamplingParams::new(3, 1)
    };
    let bad: Vec<(Vec<Token>, SamplingParams, &str)> = vec![
        (vec![1, VOCAB as Token], SamplingParams::greedy(2), "prompt"),
        (vec![0; CONTEXT + 1], SamplingParams::greedy(1), "prompt"),
        (
            vec![0; CONTEXT - 2],
            SamplingParams::greedy(5),
            "max_tokens",
        ),
        (vec![1], nan, "temperature"),
        (vec![1], SamplingParams::greedy(0), "max_tokens"),
        (vec![], SamplingParams::greedy(1), "prompt"),
    ];
    let asked: Vec<_> = bad
        .iter()
        .map(|(prompt, params, _)| {
            engine.send(Generate {
                model: policy(),
                prompt: prompt.clone(),
                params: *params,
                epoch: None,
            })
        })
        .collect();
    for (r, (prompt, _, field)) in asked.into_iter().zip(&bad) {
        match within("a bad request", r).await.unwrap() {
            Err(Error::BadRequest { field: f, reason }) => {
                assert_eq!(f, *field, "prompt of {} tokens: {reason}", prompt.len());
            }
            other => panic!("prompt of {} tokens answered {other:?}", prompt.len()),
        }
    }
    let unknown = within("unknown model", engine.send(generate(&id("nope"), &[1], 1)))
        .await
        .unwrap()
        .unwrap_err();
    assert!(unknown.to_string().contains("`nope`"), "{unknown}");
    let good = answer("the good request", good).await;
    assert_eq!(good.tokens, walk(2, 1, 30));
    assert_eq!(good.versions, vec![Version(1); 30]);
}

#[actix_rt::test]
async fn cancel_ends_cancellable_requests_in_flight_and_refuses_older_generations() {
    let gate = Gate::closed();
    let engine = gated_engine(PauseMode::Keep, &gate);
    let cancellable = |prompt: Token, epoch| Generate {
        epoch: Some(epoch),
        ..generate(&policy(), &[prompt], 10)
    };
    let old = engine.send(cancellable(0, 0));
    let free = engine.send(generate(&policy(), &[1], 10));
    gate.allow(2);
    gate.wait_entered(3).await;
    let epoch = within("cancel", engine.send(CancelInFlight)).await.unwrap();
    assert_eq!(epoch, 1);
    let refused = within("an old request", engine.send(cancellable(2, 0)))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(refused, Error::Cancelled { epoch: 1 }),
        "{refused}"
    );
    let current = engine.send(cancellable(3, 1));
    gate.open();
    let old = answer("the cancelled request", old).await;
    assert_eq!(old.finish, Finish::Cancelled);
    // the pass under way when the cancellation came finished: 3 tokens
    assert_eq!(old.tokens, walk(0, 1, 3));
    let free = answer("the request that is not cancellable", free).await;
    assert_eq!((free.finish, free.tokens.len()), (Finish::Length, 10));
    let current = answer("a request of the new epoch", current).await;
    assert_eq!(current.tokens, walk(3, 1, 10));
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!(stats.cancelled, 2, "one refused, one ended in flight");
}

/// Version 1 through a real in-process scheme; a corrupt version 2 (a NaN in the table) is
/// refused naming the tensor, not acknowledged, and v1 keeps generating; version 3 loads and
/// is acknowledged. A second model whose trainer publishes another layout is refused naming
/// the tensor's shape, its initial version still served.
/// The served version of every model, once `model` serves `want`.
async fn serving(engine: &Addr<GenerationEngine<Bigram>>, model: &ModelId, want: Version) {
    let t = std::time::Instant::now();
    loop {
        let served = within("versions", engine.send(ServedVersions))
            .await
            .unwrap();
        if served.get(model) == Some(&want) {
            return;
        }
        assert!(
            t.elapsed() < DEADLINE,
            "`{model}` serves {:?}, not {want}",
            served.get(model)
        );
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
}

#[actix_rt::test]
async fn a_follower_serves_its_leaders_weights_refreshed_every_k_versions_and_scores() {
    let (p, r) = (policy(), id("policy.reference"));
    let g = bigram();
    let e = GenerationEngine::new(PauseMode::Keep)
        .with_model(GenModel::follower(r.clone(), g.clone(), p.clone(), 2))
        .unwrap_err();
    assert!(e.to_string().contains("does not serve"), "{e}");
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(GenModel::new(p.clone(), g.clone(), g.clone()))
        .unwrap()
        .with_model(GenModel::follower(r.clone(), g, p.clone(), 2))
        .unwrap()
        .start();
    // refreshed at v1, v3, v5: the first version, then every 2
    for (v, reference) in [(1, 1), (2, 1), (3, 3), (4, 3), (5, 5)] {
        let loaded = within(
            "load",
            engine.send(LoadWeights {
                weights: Arc::new(table(&p, v)),
            }),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(loaded, Version(v));
        serving(&engine, &r, Version(reference)).await;
        let c = answer("reference", engine.send(generate(&r, &[0], 4))).await;
        assert_eq!(c.tokens, walk(0, reference, 4), "after v{v}");
        assert_eq!(c.versions, vec![Version(reference); 4]);
    }
    // the reference scores a completion of the policy: its own walk is likely, the
    // policy's is not
    let mine = walk(0, 5, 4);
    let score = |tokens: Vec<Token>| Score {
        model: r.clone(),
        prompt: vec![0],
        tokens,
        temperature: 1.0,
        epoch: None,
    };
    let same = answer("score", engine.send(score(mine.clone()))).await;
    assert_eq!(same.tokens, mine);
    let by_policy = answer("policy", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!(by_policy.tokens, mine);
    for (a, b) in same.logprobs.iter().zip(&by_policy.logprobs) {
        assert!(
            (a - b).abs() < 1e-6,
            "same weights, same scores: {a} vs {b}"
        );
    }
    let other = answer("score", engine.send(score(walk(0, 1, 4)))).await;
    assert!(
        other.logprobs.iter().all(|l| *l < same.logprobs[0] - 1.0),
        "{other:?}"
    );
    // the follower loads nothing itself, and its scoring is no generation in the stats
    let e = within(
        "update the follower",
        engine.send(UpdateModel {
            model: r.clone(),
            version: Version(9),
            timeout: Duration::from_secs(5),
        }),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(e.to_string().contains("follows model `policy`"), "{e}");
    let stats = within("stats", engine.send(GetEngineStats)).await.unwrap();
    assert_eq!(stats.loads, 5);
    assert_eq!(stats.tokens, 4);
    // a bad scoring request is refused naming the field; the engine goes on
    let e = within("bad score", engine.send(score(vec![0, 42])))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::BadRequest {
                field: "tokens",
                ..
            }
        ),
        "{e}"
    );
    answer("after", engine.send(score(mine))).await;
}

#[actix_rt::test]
async fn a_corrupt_or_wrong_shape_version_is_refused_and_the_old_one_keeps_generating() {
    let (p, r) = (policy(), id("reference"));
    let (mut sender, receiver) = scheme(&p, &bigram(), table(&p, 1));
    let wide = Bigram::new(VOCAB + 2, CONTEXT).unwrap();
    let wrong = |v| wide.weight_set(r.clone(), Version(v), |_, _| 0.0).unwrap();
    let (mut wrong_sender, wrong_receiver) = scheme(&r, &wide, wrong(1));
    let g = bigram();
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(
            GenModel::new(p.clone(), g.clone(), g.clone())
                .inlet(Box::new(receiver) as Box<dyn WeightInlet>),
        )
        .unwrap()
        .with_model(
            GenModel::new(r.clone(), g.clone(), g)
                .inlet(Box::new(wrong_receiver))
                .initial(Arc::new(table(&r, 1))),
        )
        .unwrap()
        .start();
    let update = |model: &ModelId, v| UpdateModel {
        model: model.clone(),
        version: Version(v),
        timeout: Duration::from_secs(10),
    };
    let served = within("versions", engine.send(ServedVersions))
        .await
        .unwrap();
    assert_eq!((served[&p], served[&r]), (Version(0), Version(1)));
    let loaded = within("load v1", engine.send(update(&p, 1)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.version, Version(1));
    let c = answer("v1", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!((c.tokens, c.versions), (walk(0, 1, 4), vec![Version(1); 4]));

    // a NaN in version 2: fetched, refused at staging, never acknowledged
    let mut corrupt = table(&p, 2);
    corrupt.view_mut::<f32>("bigram.logits").unwrap()[13] = f32::NAN;
    let pending = sender.send_async(vec![corrupt]).unwrap();
    let e = within("load v2", engine.send(update(&p, 2)))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bigram.logits") && e.contains("NaN") && e.contains("[1, 3]"),
        "{e}"
    );
    assert!(
        sender.wait(&pending, Duration::from_millis(200)).is_err(),
        "a refused version must not be acknowledged"
    );
    let c = answer("after v2", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!((c.tokens, c.versions), (walk(0, 1, 4), vec![Version(1); 4]));

    // version 3 is fine: served, then acknowledged
    let pending = sender.send_async(vec![table(&p, 3)]).unwrap();
    let loaded = within("load v3", engine.send(update(&p, 3)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.version, Version(3));
    sender.wait(&pending, Duration::from_secs(5)).unwrap();
    let c = answer("v3", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!((c.tokens, c.versions), (walk(0, 3, 4), vec![Version(3); 4]));

    // the other model: the trainer's layout is not the generator's
    let _pending = wrong_sender.send_async(vec![wrong(2)]).unwrap();
    let e = within("load a wrong shape", engine.send(update(&r, 2)))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`reference`") && e.contains("bigram.logits") && e.contains("shape"),
        "{e}"
    );
    let c = answer("reference", engine.send(generate(&r, &[4], 3))).await;
    assert_eq!((c.tokens, c.versions), (walk(4, 1, 3), vec![Version(1); 3]));
    let served = within("versions", engine.send(ServedVersions))
        .await
        .unwrap();
    assert_eq!((served[&p], served[&r]), (Version(3), Version(1)));
    // a pushed version that is not newer is refused, typed
    let e = within(
        "a stale push",
        engine.send(LoadWeights {
            weights: Arc::new(table(&p, 3)),
        }),
    )
    .await
    .unwrap()
    .unwrap_err();
    assert!(e.to_string().contains("version 3 refused"), "{e}");
}

/// Stage, then commit: a staged version is neither served nor acknowledged until its
/// commit; an aborted one is dropped and its lock given back; one held past its deadline is
/// dropped too; a commit of a version not staged is refused, naming both versions.
#[actix_rt::test]
async fn a_staged_version_is_served_only_once_committed() {
    let p = policy();
    let (mut sender, receiver) = scheme(&p, &bigram(), table(&p, 1));
    let g = bigram();
    let engine = GenerationEngine::new(PauseMode::Keep)
        .with_model(
            GenModel::new(p.clone(), g.clone(), g)
                .inlet(Box::new(receiver) as Box<dyn WeightInlet>)
                .initial(Arc::new(table(&p, 1))),
        )
        .unwrap()
        .start();
    let stage = |v, hold| StageModel {
        model: p.clone(),
        version: Version(v),
        timeout: Duration::from_secs(10),
        hold,
    };
    let commit = |v| CommitModel {
        model: p.clone(),
        version: Version(v),
        timeout: Duration::from_secs(10),
    };
    let long = Duration::from_secs(30);
    let pending = sender.send_async(vec![table(&p, 2)]).unwrap();
    let staged = within("stage v2", engine.send(stage(2, long)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((staged.version, staged.fresh), (Version(2), true));
    let c = answer("staged", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!(
        c.versions,
        vec![Version(1); 4],
        "a staged version was served"
    );
    assert!(sender.wait(&pending, Duration::from_millis(100)).is_err());
    let loaded = within("commit v2", engine.send(commit(2)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.version, Version(2));
    sender.wait(&pending, Duration::from_secs(5)).unwrap();
    let c = answer("committed", engine.send(generate(&p, &[0], 4))).await;
    assert_eq!((c.tokens, c.versions), (walk(0, 2, 4), vec![Version(2); 4]));
    // committed twice: it is served, nothing to do
    let again = within("commit v2 again", engine.send(commit(2)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((again.version, again.paused), (Version(2), Duration::ZERO));
    // aborted: dropped, the lock given back to the next load
    let _pending = sender.send_async(vec![table(&p, 3)]).unwrap();
    within("stage v3", engine.send(stage(3, long)))
        .await
        .unwrap()
        .unwrap();
    within("abort", engine.send(AbortStage { model: p.clone() }))
        .await
        .unwrap();
    let e = within("commit aborted", engine.send(commit(3)))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nothing is staged") && e.contains("v2 is served"),
        "{e}"
    );
    // held past its deadline: dropped the same way
    let _pending = sender.send_async(vec![table(&p, 4)]).unwrap();
    within("stage v4", engine.send(stage(4, Duration::from_millis(50))))
        .await
        .unwrap()
        .unwrap();
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    let e = within("commit expired", engine.send(commit(4)))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(e.contains("commit of v4 refused"), "{e}");
    let update = UpdateModel {
        model: p.clone(),
        version: Version(4),
        timeout: Duration::from_secs(10),
    };
    let loaded = within("load v4", engine.send(update))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(loaded.version, Version(4));
    // a commit of another version than the one staged is refused
    let _pending = sender.send_async(vec![table(&p, 5)]).unwrap();
    within("stage v5", engine.send(stage(5, long)))
        .await
        .unwrap()
        .unwrap();
    let e = within("commit v6", engine.send(commit(6)))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(e.contains("v5 is staged"), "{e}");
    let served = within("versions", engine.send(ServedVersions))
        .await
        .unwrap();
    assert_eq!(served[&p], Version(4));
}

/// A Generate between two nodes of this process, through the remote machinery: the
/// completion crosses whole, a bad request comes back naming the field, a cancellation
/// crosses and an old generation is refused with its variant.
#[test]
fn generate_across_nodes() {
    use refit_actors::protocol::engine::EngineHandle;
    use refit_actors::remote::RemoteAddr;
    use refit_node::{ClusterToken, Node};
    use uuid::Uuid;

    let token = ClusterToken::new("gen-engine-test-token").unwrap();
    let server = Node::loopback(token.clone()).unwrap();
    let client = Node::loopback(token).unwrap();
    actix::System::new().block_on(async move {
        let g = bigram();
        let engine = GenerationEngine::new(PauseMode::Keep)
            .with_model(
                GenModel::new(policy(), g.clone(), g).initial(Arc::new(table(&policy(), 2))),
            )
            .unwrap()
            .start();
        let target = Uuid::new_v4();
        // the weight plane and the generating engine's requests, under one target
        EngineHandle::generating(&engine).serve(&server, target);
        let remote = RemoteAddr::connect(&client, server.addr(), target, "gen-engine", DEADLINE)
            .await
            .unwrap();
        let c = remote
            .send(generate(&policy(), &[1], 5))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.tokens, walk(1, 2, 5));
        assert_eq!(c.versions, vec![Version(2); 5]);
        assert_eq!(c.logprobs.len(), 5);
        let e = remote
            .send(generate(&policy(), &[1], 0))
            .await
            .unwrap()
            .unwrap_err();
        match e.remote_failure() {
            Some(RemoteFailure::Failed { error }) => {
                assert!(error.contains("max_tokens"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        // the same engine behind a plain recipient, as a rollout worker holds it
        let r: Recipient<Generate> = remote.recipient();
        let c = r.send(generate(&policy(), &[3], 2)).await.unwrap().unwrap();
        assert_eq!(c.tokens, walk(3, 2, 2));
        let epoch = remote.send(CancelInFlight).await.unwrap();
        let refused = remote
            .send(Generate {
                epoch: Some(epoch - 1),
                ..generate(&policy(), &[1], 2)
            })
            .await
            .unwrap()
            .unwrap_err();
        assert!(matches!(refused, Error::Cancelled { .. }), "{refused}");
        let served = remote.send(ServedVersions).await.unwrap();
        assert_eq!(served[&policy()], Version(2));
    });
}
