//! Collector workers as real processes (this test binary re-run as the worker), fed with
//! weights through shared memory (opened by name through the link factory) and talking to
//! their collector through its node: the synchronous and the asynchronous process
//! collectors, the cascade (an update pushed to the parent, or to the parent's own upstream
//! scheme, lands in every worker), workers that die, fail or lose their collector, and
//! strangers calling the collector's node.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashSet;
use std::io::Write;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use refit::actors::process::{
    COLLECTOR_TARGET, DELIVER, HELLO, POLL, ProcessAsyncCollector, ProcessConfig,
    ProcessSyncCollector, WORKER_LINK_ENV, WorkerLink, serve_worker, worker_receiver,
};
use refit::actors::{
    CartPole, Collector, Env, MlpPolicy, PpoConfig, PpoTrainer, StepResult, UpdatePolicyWeights,
};
use refit::node::{ClusterToken, Node};
use refit::prelude::*;
use refit::transports::inproc::{InProcReceiver, InProcSender};

type Linked = Box<dyn refit::runtime::SenderTransport>;

/// CartPole that sleeps `step_ms` in every step and fails at step `fail_at` (both from the
/// worker's environment: `REFIT_TEST_STEP_MS`, `REFIT_TEST_FAIL_AT`).
struct TestPole {
    inner: CartPole,
    step_ms: u64,
    fail_at: Option<u64>,
    steps: u64,
}

impl Env for TestPole {
    fn obs_dim(&self) -> usize {
        self.inner.obs_dim()
    }
    fn num_actions(&self) -> usize {
        self.inner.num_actions()
    }
    fn reset(&mut self, seed: Option<u64>) -> refit::rl::Result<Vec<f32>> {
        self.inner.reset(seed)
    }
    fn step(&mut self, action: usize) -> refit::rl::Result<StepResult> {
        self.steps += 1;
        if self.fail_at == Some(self.steps) {
            return Err(refit::rl::Error::env(0, "the test broke it"));
        }
        if self.step_ms > 0 {
            std::thread::sleep(Duration::from_millis(self.step_ms));
        }
        self.inner.step(action)
    }
}

fn var(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap())
}

/// The worker process; a no-op in a normal test run.
#[test]
fn worker_entry() {
    if std::env::var_os(WORKER_LINK_ENV).is_none() {
        return;
    }
    // the worker's stdout is its own (written to the descriptor itself: the test harness
    // captures `println!`): even text that looked like the old framing disturbs nothing
    writeln!(std::io::stdout(), "REFIT-W1 worker output on stdout").unwrap();
    let w: usize = std::env::var("REFIT_WORKER_INDEX")
        .unwrap()
        .parse()
        .unwrap();
    let envs = (0..2)
        .map(|i| TestPole {
            inner: CartPole::new((w * 2 + i) as u64),
            step_ms: var("REFIT_TEST_STEP_MS").unwrap_or(0),
            fail_at: var("REFIT_TEST_FAIL_AT"),
            steps: 0,
        })
        .collect();
    let c = Collector::builder(envs, MlpPolicy::cartpole().unwrap())
        .frames_per_batch(200)
        .seed(w as u64)
        .build()
        .unwrap();
    if let Err(e) = serve_worker(c, w, worker_receiver().unwrap(), Duration::from_secs(20)) {
        let _ = writeln!(std::io::stderr(), "worker {w}: {e}");
        std::process::exit(1);
    }
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

fn sync_config(batch_timeout: Duration) -> ProcessConfig {
    ProcessConfig {
        batch_timeout,
        ..ProcessConfig::default()
    }
}

/// A sync collector of `workers` worker processes, each command changed by `tweak` (its
/// worker index, its command) before it starts.
fn collector(
    workers: usize,
    batch_timeout: Duration,
    tweak: impl Fn(usize, &mut Command),
) -> (ProcessSyncCollector<Linked>, PpoTrainer) {
    let (sender, mut commands, trainer, initial) = setup(workers);
    for (w, c) in commands.iter_mut().enumerate() {
        tweak(w, c);
    }
    (
        ProcessSyncCollector::spawn(sender, commands, vec![initial], sync_config(batch_timeout))
            .unwrap(),
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
    let (mut c, mut trainer) = collector(2, Duration::from_secs(30), |_, _| {});
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
    let (mut c, _trainer) = collector(2, Duration::from_secs(30), |_, _| {});
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
    // the same bound as the first batches get: a loaded CI machine runs debug workers slowly
    c.wait_for_workers(Duration::from_secs(60)).unwrap();
    until_every_worker_has(&mut c, &[0, 1], Version(2));
    c.shutdown().unwrap();
}

#[test]
fn an_update_pushed_upstream_cascades_through_the_parent_to_every_worker_process() {
    // sync parent: the batch after the push is all v2
    // ANCHOR: cascade
    let (mut c, mut trainer) = collector(2, Duration::from_secs(30), |_, _| {});
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

#[test]
fn a_worker_killed_mid_collection_is_reported_gone_at_once_naming_it() {
    // every step takes 20 ms: a 200-frame batch takes 4 s, so the kill lands inside it
    let (mut c, _trainer) = collector(2, Duration::from_secs(300), |_, cmd| {
        cmd.env("REFIT_TEST_STEP_MS", "20");
    });
    let pid = c.worker_pids()[1];
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        kill(pid);
    });
    let t = Instant::now();
    let err = c.next_batch().unwrap_err();
    let took = t.elapsed();
    killer.join().unwrap();
    match &err {
        refit::rl::Error::WorkerGone { worker: 1, reason } => {
            assert!(reason.contains("signal"), "{err}");
        }
        other => panic!("not worker 1 gone: {other}"),
    }
    // reported when its connection closed, not at the 300 s batch deadline nor after worker
    // 0's batch
    assert!(took < Duration::from_secs(30), "reported after {took:?}");
    // and named again, not waited on, by the next call
    let again = c.next_batch().unwrap_err();
    assert!(again.to_string().contains("worker 1 is gone"), "{again}");
    c.shutdown().unwrap();
}

#[test]
fn a_worker_error_is_reported_as_that_workers_error() {
    let (mut c, _trainer) = collector(2, Duration::from_secs(30), |w, cmd| {
        if w == 1 {
            // its first batch is fine, its second fails
            cmd.env("REFIT_TEST_FAIL_AT", "150");
        }
    });
    c.next_batch().unwrap().unwrap();
    let err = c.next_batch().unwrap_err();
    match &err {
        refit::rl::Error::Worker { worker: 1, source } => {
            assert!(source.to_string().contains("the test broke it"), "{err}");
        }
        other => panic!("not worker 1's error: {other}"),
    }
    // the failed worker stops on its own
    let pid = c.worker_pids()[1];
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) {
        assert!(Instant::now() < deadline, "worker 1 still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
    c.shutdown().unwrap();
}

/// True while process `pid` runs (not gone, not a zombie).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // the state is the field after the parenthesised command name
        Ok(stat) => !matches!(
            stat.rsplit(')')
                .next()
                .and_then(|s| s.trim().chars().next()),
            Some('Z' | 'X') | None
        ),
        Err(_) => false,
    }
}

/// A collector process for the test below: starts two workers, collects once, writes the
/// workers' pids to the file `REFIT_TEST_PIDS` names, and waits to be killed.
#[test]
fn collector_entry() {
    let Some(out) = std::env::var_os("REFIT_TEST_PIDS") else {
        return;
    };
    let (mut c, _trainer) = collector(2, Duration::from_secs(30), |_, _| {});
    c.next_batch().unwrap().unwrap();
    let pids: Vec<String> = c.worker_pids().iter().map(u32::to_string).collect();
    let tmp = std::path::PathBuf::from(&out).with_extension("tmp");
    std::fs::write(&tmp, pids.join(" ")).unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn workers_whose_collector_dies_exit_on_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pids");
    let mut parent = Command::new(std::env::current_exe().unwrap())
        .args(["collector_entry", "--exact", "--test-threads=1", "--quiet"])
        .env("REFIT_TEST_PIDS", &out)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let pids: Vec<u32> = loop {
        if let Ok(text) = std::fs::read_to_string(&out) {
            break text.split(' ').map(|p| p.parse().unwrap()).collect();
        }
        assert!(
            parent.try_wait().unwrap().is_none(),
            "the collector process ended early"
        );
        assert!(Instant::now() < deadline, "no pids from the collector");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(pids.len(), 2);
    assert!(pids.iter().all(|p| alive(*p)));
    parent.kill().unwrap();
    parent.wait().unwrap();
    // idle workers: their poll fails as the connection closes
    let deadline = Instant::now() + Duration::from_secs(20);
    while pids.iter().any(|p| alive(*p)) {
        assert!(
            Instant::now() < deadline,
            "workers {pids:?} outlived their collector"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(serde::Serialize)]
struct ForgedHello {
    worker: usize,
}

#[derive(serde::Serialize)]
struct ForgedPoll {
    worker: usize,
    done: u64,
}

#[test]
fn strangers_calling_the_collectors_node_are_refused_without_disturbing_it() {
    let (sender, commands, _trainer, initial) = setup(2);
    let token = commands[0]
        .get_envs()
        .find(|(k, _)| *k == "REFIT_TOKEN")
        .and_then(|(_, v)| v)
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let mut c = ProcessSyncCollector::spawn(
        sender,
        commands,
        vec![initial],
        sync_config(Duration::from_secs(30)),
    )
    .unwrap();
    assert_eq!(c.next_batch().unwrap().unwrap().frames, 400);
    let wait = Duration::from_secs(5);

    // without the cluster token: refused by the node
    let stranger = Node::loopback(ClusterToken::random()).unwrap();
    let err = stranger.connect(c.addr(), wait).unwrap_err();
    assert!(
        matches!(err, refit::node::Error::Unauthorized { .. }),
        "{err}"
    );

    // with the token: calls that do not decode, or that speak for a worker other than
    // this connection's, are refused
    let insider = Node::loopback(ClusterToken::new(token).unwrap()).unwrap();
    let peer = insider.connect(c.addr(), wait).unwrap();
    let refused = |method: &str, e: refit::node::Error, needle: &str| {
        let msg = e.to_string();
        assert!(
            matches!(e, refit::node::Error::Remote { .. }) && msg.contains(needle),
            "{method}: {msg}"
        );
    };
    let e = peer
        .call::<_, ()>(COLLECTOR_TARGET, DELIVER, &"not a batch", wait)
        .unwrap_err();
    refused(DELIVER, e, "wire");
    let e = peer
        .call::<_, ()>(COLLECTOR_TARGET, HELLO, &ForgedHello { worker: 0 }, wait)
        .unwrap_err();
    refused(HELLO, e, "already connected");
    let e = peer
        .call::<_, ()>(COLLECTOR_TARGET, HELLO, &ForgedHello { worker: 9 }, wait)
        .unwrap_err();
    refused(HELLO, e, "no worker 9");
    let forged = ForgedPoll { worker: 1, done: 0 };
    let e = peer
        .call::<_, ()>(COLLECTOR_TARGET, POLL, &forged, wait)
        .unwrap_err();
    refused(POLL, e, "not worker 1's");
    drop(peer);
    insider.shutdown();

    // the workers noticed nothing: both deliver, with every frame
    for _ in 0..2 {
        let b = c.next_batch().unwrap().unwrap();
        assert_eq!(b.frames, 400);
        let workers: HashSet<usize> = b.transitions.iter().map(|t| t.worker).collect();
        assert_eq!(workers, HashSet::from([0, 1]));
    }
    c.shutdown().unwrap();
}
