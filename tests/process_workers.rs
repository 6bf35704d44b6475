//! Collector workers as real processes (this test binary re-run as the worker), fed with
//! weights through shared memory.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::actors::process::{ProcessConfig, ProcessSyncCollector, serve_worker};
use refit::actors::{CartPole, Collector, MlpPolicy, PpoConfig, PpoTrainer, UpdatePolicyWeights};
use refit::prelude::*;
use refit::runtime::wire;

const ROLE: &str = "REFIT_WORKER_TOKEN";

/// The worker process; a no-op in a normal test run.
#[test]
fn worker_entry() {
    let Ok(token) = std::env::var(ROLE) else {
        return;
    };
    let w: usize = std::env::var("REFIT_WORKER_INDEX")
        .unwrap()
        .parse()
        .unwrap();
    let spec: ShmReceiverSpec = wire::from_token(&token).unwrap();
    let envs = (0..2).map(|i| CartPole::new((w * 2 + i) as u64)).collect();
    let c = Collector::builder(envs, MlpPolicy::cartpole().unwrap())
        .frames_per_batch(200)
        .seed(w as u64)
        .build()
        .unwrap();
    serve_worker(
        c,
        w,
        ReceiverInit::new(ShmReceiver::new(spec), None),
        Duration::from_secs(20),
    )
    .unwrap();
}

fn collector(
    workers: usize,
    batch_timeout: Duration,
) -> (ProcessSyncCollector<ShmSender>, PpoTrainer) {
    let mut trainer = PpoTrainer::new(PpoConfig::default()).unwrap();
    let initial = trainer.export().unwrap();
    let manifests =
        Manifests::new([(initial.model().clone(), Arc::clone(initial.manifest()))]).unwrap();
    let sender = ShmSender::create(
        &ShmConfig {
            expected_receivers: workers,
            ..ShmConfig::default()
        },
        &manifests,
    )
    .unwrap();
    let token = wire::to_token(&sender.receiver_spec()).unwrap();
    let commands = (0..workers)
        .map(|w| {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args(["worker_entry", "--exact", "--test-threads=1", "--quiet"])
                .env(ROLE, &token)
                .env("REFIT_WORKER_INDEX", w.to_string());
            c
        })
        .collect();
    let config = ProcessConfig {
        batch_timeout,
        ..ProcessConfig::default()
    };
    (
        ProcessSyncCollector::spawn(sender, commands, vec![initial], config).unwrap(),
        trainer,
    )
}

#[test]
fn worker_processes_collect_with_fresh_weights_and_unique_trajectories() {
    let (mut c, mut trainer) = collector(2, Duration::from_secs(30));
    let mut ids = HashSet::new();
    let mut per_worker_ids: Vec<HashSet<u64>> = vec![HashSet::new(); 2];
    for round in 0..4 {
        let batch = c.next_batch().unwrap().unwrap();
        assert_eq!(batch.frames, 400);
        let expected = trainer.version();
        for t in &batch.transitions {
            // the weights published before this batch acted in all of it
            assert_eq!(t.version, expected, "round {round}");
            let id = t.traj_id.unwrap();
            per_worker_ids[t.worker].insert(id);
            ids.insert((t.worker, id));
        }
        let ws = trainer.export().unwrap();
        c.update_weights(ws).unwrap();
    }
    // trajectory ids never collide across worker processes
    assert!(per_worker_ids[0].is_disjoint(&per_worker_ids[1]));
    assert!(!per_worker_ids[0].is_empty() && !per_worker_ids[1].is_empty());
    c.shutdown().unwrap();
}

#[test]
fn a_dead_worker_process_is_reported_not_waited_on() {
    let (mut c, _trainer) = collector(2, Duration::from_secs(30));
    c.next_batch().unwrap().unwrap();
    let pid = c.worker_pids()[1];
    kill(pid);
    let t = Instant::now();
    let err = c.next_batch().unwrap_err();
    assert!(err.to_string().contains("worker 1 is gone"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// Kills a child process with SIGKILL.
fn kill(pid: u32) {
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}
