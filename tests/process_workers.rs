//! Collector workers as real processes (this test binary re-run as the worker), fed with
//! weights through shared memory (opened by name through the link factory): the synchronous and the asynchronous process collectors,
//! and the cascade (an update pushed to the parent, or to the parent's own upstream scheme,
//! lands in every worker).
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::actors::process::{
    ProcessAsyncCollector, ProcessConfig, ProcessSyncCollector, WORKER_LINK_ENV, WorkerLink,
    serve_worker, worker_receiver,
};
use refit::actors::{CartPole, Collector, MlpPolicy, PpoConfig, PpoTrainer, UpdatePolicyWeights};
use refit::prelude::*;
use refit::transports::inproc::{InProcReceiver, InProcSender};

type Linked = Box<dyn refit::runtime::SenderTransport>;

/// The worker process; a no-op in a normal test run.
#[test]
fn worker_entry() {
    if std::env::var_os(WORKER_LINK_ENV).is_none() {
        return;
    }
    let w: usize = std::env::var("REFIT_WORKER_INDEX")
        .unwrap()
        .parse()
        .unwrap();
    let envs = (0..2).map(|i| CartPole::new((w * 2 + i) as u64)).collect();
    let c = Collector::builder(envs, MlpPolicy::cartpole().unwrap())
        .frames_per_batch(200)
        .seed(w as u64)
        .build()
        .unwrap();
    serve_worker(c, w, worker_receiver().unwrap(), Duration::from_secs(20)).unwrap();
}

/// The shared-memory sender for `workers` worker processes, their commands, and a trainer.
fn setup(workers: usize) -> (Linked, Vec<Command>, PpoTrainer, WeightSet) {
    let mut trainer = PpoTrainer::new(PpoConfig::default()).unwrap();
    let initial = trainer.export().unwrap();
    let link = WorkerLink::open("shm", std::slice::from_ref(&initial), workers).unwrap();
    let commands = (0..workers)
        .map(|w| {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args(["worker_entry", "--exact", "--test-threads=1", "--quiet"])
                .env("REFIT_WORKER_INDEX", w.to_string());
            link.configure(&mut c).unwrap();
            c
        })
        .collect();
    (link.sender, commands, trainer, initial)
}

fn collector(
    workers: usize,
    batch_timeout: Duration,
) -> (ProcessSyncCollector<Linked>, PpoTrainer) {
    let (sender, commands, trainer, initial) = setup(workers);
    let config = ProcessConfig {
        batch_timeout,
        ..ProcessConfig::default()
    };
    (
        ProcessSyncCollector::spawn(sender, commands, vec![initial], config).unwrap(),
        trainer,
    )
}

fn async_collector(workers: usize) -> (ProcessAsyncCollector<Linked>, PpoTrainer) {
    let (sender, commands, trainer, initial) = setup(workers);
    let config = ProcessConfig {
        batch_timeout: Duration::from_secs(30),
        ..ProcessConfig::default()
    };
    (
        ProcessAsyncCollector::spawn(sender, commands, vec![initial], config).unwrap(),
        trainer,
    )
}

/// An upstream in-process scheme whose receiver feeds a parent collector: the trainer's
/// end (sender) and the parent's (receiver), connected with `initial`.
fn upstream(initial: &WeightSet) -> (Sender<InProcSender>, Receiver<InProcReceiver>) {
    let manifests =
        Manifests::new([(initial.model().clone(), Arc::clone(initial.manifest()))]).unwrap();
    let hub = InProc::new();
    let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let wait = Duration::from_secs(20);
    let r = std::thread::spawn(move || receiver.connect(wait).unwrap());
    let sender = SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![initial.clone()], wait)
        .unwrap();
    (sender, r.join().unwrap())
}

/// Reads batches until every worker in `workers` delivered one made by `version` alone;
/// checks that no worker goes back to an older version afterwards.
fn until_every_worker_has(
    c: &mut ProcessAsyncCollector<Linked>,
    workers: &[usize],
    version: Version,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = HashSet::new();
    while seen.len() < workers.len() {
        assert!(
            Instant::now() < deadline,
            "workers {workers:?}: only {seen:?} reached v{version}"
        );
        let b = c.next_worker_batch().unwrap().unwrap();
        assert!(
            workers.contains(&b.worker),
            "batch from worker {}",
            b.worker
        );
        let (lo, hi) = b.batch.version_range().unwrap();
        assert_eq!(hi, b.version);
        if seen.contains(&b.worker) {
            assert_eq!(lo, version, "worker {} went back to v{lo}", b.worker);
        }
        if lo == version {
            seen.insert(b.worker);
        }
    }
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

#[test]
fn async_worker_processes_stream_batches_and_an_update_reaches_every_worker() {
    let (mut c, mut trainer) = async_collector(2);
    let mut workers = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while workers.len() < 2 {
        assert!(
            Instant::now() < deadline,
            "only workers {workers:?} delivered"
        );
        let b = c.next_worker_batch().unwrap().unwrap();
        assert_eq!(b.batch.frames, 200);
        assert_eq!(b.version, Version(1));
        assert!(b.batch.transitions.iter().all(|t| t.worker == b.worker));
        workers.insert(b.worker);
    }
    // TorchRL's update_policy_weights_ on the parent: through each worker's receiver
    let v2 = trainer.export().unwrap();
    c.update_weights(v2).unwrap();
    c.wait_for_workers(Duration::from_secs(30)).unwrap();
    until_every_worker_has(&mut c, &[0, 1], Version(2));
    c.shutdown().unwrap();
}

#[test]
fn an_update_pushed_upstream_cascades_through_the_parent_to_every_worker_process() {
    // sync parent: the batch after the push is all v2
    // ANCHOR: cascade
    let (mut c, mut trainer) = collector(2, Duration::from_secs(30));
    // the trainer's scheme reaches the parent; the parent's scheme reaches its workers
    let v2 = trainer.export().unwrap(); // newer than the workers' v1: forwarded at attach
    let (mut top, parent_end) = upstream(&v2);
    c.attach_weight_source(Box::new(parent_end)).unwrap();
    let b = c.next_batch().unwrap().unwrap();
    assert_eq!(b.version_range(), Some((Version(2), Version(2))));
    let v3 = trainer.export().unwrap();
    let pending = top.send_async(vec![v3]).unwrap();
    let b = c.next_batch().unwrap().unwrap();
    assert_eq!(b.version_range(), Some((Version(3), Version(3))));
    let mut workers: Vec<usize> = b.transitions.iter().map(|t| t.worker).collect();
    workers.dedup();
    assert_eq!(workers, vec![0, 1]);
    // the parent acknowledged upstream once it forwarded
    top.wait(&pending, Duration::from_secs(10)).unwrap();
    // ANCHOR_END: cascade
    c.shutdown().unwrap();

    // async parent
    let (mut c, mut trainer) = async_collector(2);
    let initial = trainer.export().unwrap(); // v2
    let (mut top, parent_end) = upstream(&initial);
    c.attach_weight_source(Box::new(parent_end)).unwrap();
    until_every_worker_has(&mut c, &[0, 1], Version(2));
    let v3 = trainer.export().unwrap();
    let pending = top.send_async(vec![v3]).unwrap();
    until_every_worker_has(&mut c, &[0, 1], Version(3));
    top.wait(&pending, Duration::from_secs(10)).unwrap();
    c.shutdown().unwrap();
}

#[test]
fn a_killed_async_worker_is_reported_with_its_status_and_the_others_go_on() {
    let (mut c, mut trainer) = async_collector(2);
    c.next_worker_batch().unwrap().unwrap();
    kill(c.worker_pids()[1]);
    let t = Instant::now();
    let err = loop {
        match c.next_worker_batch() {
            Ok(b) => assert!(t.elapsed() < Duration::from_secs(10), "{b:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "reported after {:?}",
        t.elapsed()
    );
    let msg = err.to_string();
    assert!(
        msg.contains("worker 1 is gone") && msg.contains("signal"),
        "{msg}"
    );
    assert_eq!(c.live_workers(), vec![0]);
    // the survivor goes on, and still takes updates
    let v2 = trainer.export().unwrap();
    c.update_weights(v2).unwrap();
    until_every_worker_has(&mut c, &[0], Version(2));
    c.shutdown().unwrap();
}
