//! Collector behaviour: trajectory ids, hooks, the carrier, versions, async updates.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use refit_rl::{
    ActionOut, Batch, CartPole, Collector, Device, Env, Error, MlpPolicy, MultiAsyncCollector,
    MultiConfig, MultiSyncCollector, Policy, PpoConfig, PpoTrainer, ReplayBuffer, RingBuffer,
    StepResult, TrajPool, UpdatePolicyWeights, WeightSource,
};
use refit_runtime::protocol::Group;
use refit_runtime::{
    ArenaStrategy, DType, HasWeights, Manifest, ModelId, Strategy, Version, WeightSet,
};

/// A policy whose one weight, `tag`, is written as the log-probability of every action,
/// so each transition shows which weights acted.
#[derive(Debug, Clone, Default)]
struct TagPolicy {
    tag: f32,
}

fn tag_manifest() -> Manifest {
    Manifest::builder()
        .tensor("tag", DType::F32, &[1])
        .build()
        .unwrap()
}

impl HasWeights for TagPolicy {
    fn weight_manifest(&self) -> refit_runtime::Result<Manifest> {
        Ok(tag_manifest())
    }
    fn write_weights(&self, out: &mut WeightSet) -> refit_runtime::Result<()> {
        out.view_mut::<f32>("tag")?[0] = self.tag;
        Ok(())
    }
    fn read_weights(&mut self, weights: &WeightSet) -> refit_runtime::Result<()> {
        self.tag = weights.view::<f32>("tag")?[0];
        Ok(())
    }
}

impl Policy for TagPolicy {
    fn act(&mut self, obs: &[f32], _rng: &mut SmallRng) -> ActionOut {
        // Balance a little so episodes are not all length 9.
        ActionOut {
            action: usize::from(obs[2] + 0.5 * obs[3] > 0.0),
            log_prob: self.tag,
        }
    }
    fn obs_dim(&self) -> usize {
        4
    }
    fn num_actions(&self) -> usize {
        2
    }
}

fn tag_weights(v: u64) -> WeightSet {
    let mut ws = WeightSet::zeroed(ModelId::new("policy").unwrap(), Arc::new(tag_manifest()));
    ws.view_mut::<f32>("tag").unwrap()[0] = v as f32;
    ws.set_version(Version(v));
    ws
}

fn short_envs(n: usize, seed: u64, max_steps: u32) -> Vec<CartPole> {
    (0..n)
        .map(|i| {
            CartPole::new(seed + i as u64)
                .with_max_episode_steps(max_steps)
                .with_index(i)
        })
        .collect()
}

fn check_traj_ids(batches: &[Batch]) {
    // each id belongs to one (worker, env) stream and its steps count up from where they were
    let mut owner: BTreeMap<u64, (usize, usize, u32)> = BTreeMap::new();
    for b in batches {
        for t in &b.transitions {
            let id = t.traj_id.expect("tracked");
            match owner.get_mut(&id) {
                None => {
                    owner.insert(id, (t.worker, t.env, t.step));
                }
                Some((w, e, last)) => {
                    assert_eq!((*w, *e), (t.worker, t.env), "traj {id} on two streams");
                    assert_eq!(t.step, *last + 1, "traj {id} skips a step");
                    *last = t.step;
                }
            }
        }
    }
    let ends: Vec<u64> = batches
        .iter()
        .flat_map(|b| &b.episodes)
        .map(|e| e.traj_id.unwrap())
        .collect();
    let unique: HashSet<_> = ends.iter().collect();
    assert_eq!(unique.len(), ends.len(), "an id was reused after a reset");
    assert!(ends.len() > 10, "resets happened: {}", ends.len());
}

#[test]
fn traj_ids_are_unique_across_workers_and_resets() {
    let hub = refit_transports::inproc::InProc::new();
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let c = Collector::builder(short_envs(2, 10 * w, 20), TagPolicy::default())
                .frames_per_batch(30)
                .build()
                .unwrap();
            (c, hub.receiver())
        })
        .collect();
    let mut multi = MultiSyncCollector::spawn(
        hub.sender().unwrap(),
        workers,
        vec![tag_weights(1)],
        MultiConfig::default(),
    )
    .unwrap();
    let batches: Vec<Batch> = (&mut multi).take(6).map(|b| b.unwrap()).collect();
    check_traj_ids(&batches);
    let workers: HashSet<usize> = batches
        .iter()
        .flat_map(|b| &b.transitions)
        .map(|t| t.worker)
        .collect();
    assert_eq!(workers.len(), 3);
    assert_eq!(batches[0].frames, 90);
    multi.shutdown().unwrap();

    // the pool itself, hammered from threads
    let pool = TrajPool::new();
    let ids: Vec<u64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let p = pool.clone();
                s.spawn(move || (0..1000).map(|_| p.next_id()).collect::<Vec<_>>())
            })
            .collect();
        hs.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 4000);
}

struct Logged {
    inner: CartPole,
    log: Arc<Mutex<Vec<String>>>,
}

impl Env for Logged {
    fn obs_dim(&self) -> usize {
        4
    }
    fn num_actions(&self) -> usize {
        2
    }
    fn reset(&mut self, seed: Option<u64>) -> refit_rl::Result<Vec<f32>> {
        self.inner.reset(seed)
    }
    fn step(&mut self, action: usize) -> refit_rl::Result<StepResult> {
        self.log.lock().unwrap().push("step".into());
        self.inner.step(action)
    }
}

struct LoggedSource {
    log: Arc<Mutex<Vec<String>>>,
    next: u64,
}

impl WeightSource for LoggedSource {
    fn initial(&self) -> Vec<Arc<WeightSet>> {
        vec![Arc::new(tag_weights(1))]
    }
    fn poll(&mut self) -> refit_runtime::Result<Option<Group>> {
        self.log.lock().unwrap().push("weights".into());
        self.next += 1;
        Ok(Some(vec![Arc::new(tag_weights(self.next))]))
    }
}

#[test]
fn hooks_run_in_the_documented_order() {
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let l = |s: &'static str| {
        let log = Arc::clone(&log);
        move || log.lock().unwrap().push(s.into())
    };
    let (pre, pp, post) = (l("pre"), l("postproc"), l("post"));
    let env = Logged {
        inner: CartPole::new(0),
        log: Arc::clone(&log),
    };
    let mut c = Collector::builder(vec![env], TagPolicy::default())
        .frames_per_batch(3)
        .split_trajs(true)
        .pre_collect_hook(move || {
            pre();
            Ok(())
        })
        .postproc(move |b| {
            pp();
            Ok(b)
        })
        .post_collect_hook(move |b| {
            post();
            assert_eq!(b.frames, 3);
            Ok(())
        })
        .build()
        .unwrap();
    c.attach_weight_source(Box::new(LoggedSource {
        log: Arc::clone(&log),
        next: 1,
    }))
    .unwrap();
    assert_eq!(c.policy_version(), Version(1));
    for _ in 0..2 {
        let b = c.next_batch().unwrap().unwrap();
        assert!(b.trajectories.is_some());
    }
    let got = log.lock().unwrap().clone();
    let one = ["weights", "pre", "step", "step", "step", "postproc", "post"];
    let expected: Vec<&str> = one.iter().chain(one.iter()).copied().collect();
    assert_eq!(got, expected);
    assert_eq!(c.policy_version(), Version(3));

    // a failing hook stops collection with its error
    let mut bad = Collector::builder(vec![CartPole::new(0)], TagPolicy::default())
        .pre_collect_hook(|| Err(Error::hook("pre_collect_hook", "profiler is gone")))
        .build()
        .unwrap();
    let e = bad.next_batch().unwrap_err().to_string();
    assert_eq!(e, "pre_collect_hook failed: profiler is gone");
}

#[test]
fn carrier_resumes_a_trajectory_across_batches() {
    let mut c = Collector::builder(vec![CartPole::new(3)], TagPolicy::default())
        .frames_per_batch(7)
        .build()
        .unwrap();
    let a = c.next_batch().unwrap().unwrap();
    let b = c.next_batch().unwrap().unwrap();
    let last = a.transitions.last().unwrap();
    let first = &b.transitions[0];
    assert!(!last.done(), "the balancing policy survives 7 steps");
    assert_eq!(first.obs, last.next_obs);
    assert_eq!(first.traj_id, last.traj_id);
    assert_eq!(first.step, last.step + 1);
    assert_eq!(first.step, 7);
    // and within a batch, obs follow next_obs
    for w in a.transitions.windows(2) {
        assert_eq!(w[1].obs, w[0].next_obs);
    }
}

#[test]
fn a_transition_carries_the_version_that_acted() {
    let mut c = Collector::builder(short_envs(2, 0, 500), TagPolicy::default())
        .frames_per_batch(10)
        .build()
        .unwrap();
    let b0 = c.next_batch().unwrap().unwrap();
    assert!(
        b0.transitions
            .iter()
            .all(|t| t.version == Version::ZERO && t.log_prob == 0.0)
    );
    for v in [1u64, 2, 5] {
        c.update_weights(tag_weights(v)).unwrap();
        let b = c.next_batch().unwrap().unwrap();
        for t in &b.transitions {
            assert_eq!(t.version, Version(v));
            assert_eq!(t.log_prob, v as f32, "the weights of version {v} acted");
        }
    }
    // versions only grow; unstamped weights get the next version
    assert!(c.update_weights(tag_weights(4)).is_err());
    c.update_weights(tag_weights(0)).unwrap();
    assert_eq!(c.policy_version(), Version(6));
    // from a model, and from a registered model
    c.update_policy_weights_from(&TagPolicy { tag: 42.0 })
        .unwrap();
    assert_eq!(c.policy_version(), Version(7));
    assert!(matches!(
        c.update_policy_weights(),
        Err(Error::NoRegisteredPolicy)
    ));
    let trainer_side = Arc::new(Mutex::new(TagPolicy { tag: 9.0 }));
    c.register_policy(Arc::clone(&trainer_side));
    c.update_policy_weights().unwrap();
    let b = c.next_batch().unwrap().unwrap();
    assert!(
        b.transitions
            .iter()
            .all(|t| t.log_prob == 9.0 && t.version == Version(8))
    );
}

#[test]
fn update_many_is_atomic() {
    let critic_m = Arc::new(
        Manifest::builder()
            .tensor("w", DType::F32, &[3])
            .build()
            .unwrap(),
    );
    let critic = ModelId::new("critic").unwrap();
    let mut c = Collector::builder(vec![CartPole::new(0)], TagPolicy::default())
        .aux_model(critic.clone(), Arc::clone(&critic_m))
        .build()
        .unwrap();
    let good_critic = WeightSet::zeroed(critic.clone(), Arc::clone(&critic_m));
    c.update_many(vec![tag_weights(1), good_critic]).unwrap();
    assert_eq!(c.version_of(&critic), Version(1));
    assert_eq!(c.policy().tag, 1.0);
    // a critic with the wrong shape: neither lands
    let wrong = Arc::new(
        Manifest::builder()
            .tensor("w", DType::F32, &[4])
            .build()
            .unwrap(),
    );
    let bad_critic = WeightSet::zeroed(critic.clone(), wrong);
    let e = c
        .update_many(vec![tag_weights(2), bad_critic])
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor `w`"), "{e}");
    assert_eq!(c.policy().tag, 1.0);
    assert_eq!(c.policy_version(), Version(1));
    assert!(c.model_weights(&critic).is_some());
    // update_model checks the id
    assert!(matches!(
        c.update_model(&critic, tag_weights(3)),
        Err(Error::ModelMismatch { .. })
    ));
}

#[test]
fn async_collector_keeps_running_through_an_update() {
    let hub = refit_transports::inproc::InProc::new();
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let c = Collector::builder(short_envs(2, 100 * w, 500), TagPolicy::default())
                .frames_per_batch(50)
                .build()
                .unwrap();
            (c, hub.receiver())
        })
        .collect();
    let mut multi = MultiAsyncCollector::spawn(
        hub.sender().unwrap(),
        workers,
        vec![tag_weights(1)],
        MultiConfig {
            queue_depth: 2,
            ..MultiConfig::default()
        },
    )
    .unwrap();
    let mut seen = BTreeMap::<u64, usize>::new();
    for _ in 0..6 {
        let b = multi.next_batch().unwrap().unwrap();
        for t in &b.transitions {
            assert_eq!(t.log_prob, t.version.get() as f32);
        }
        *seen.entry(b.transitions[0].version.get()).or_default() += 1;
    }
    multi.update_weights(tag_weights(2)).unwrap();
    // workers apply it at their next batch without being stopped
    multi.wait_for_workers(Duration::from_secs(10)).unwrap();
    // Both workers must go on delivering under the new weights. How many batches one worker
    // delivers before the other is scheduled again depends on the machine's load, so the
    // bound is time (10 s), not a batch count (at least 20 batches are read).
    let mut after = HashSet::new();
    let until = Instant::now() + Duration::from_secs(10);
    let mut taken = 0;
    while (taken < 20 || after.len() < 2) && Instant::now() < until {
        let b = multi.next_batch().unwrap().unwrap();
        taken += 1;
        let v = b.version_range().unwrap();
        assert_eq!(v.0, v.1, "one version per worker batch");
        for t in &b.transitions {
            assert_eq!(t.log_prob, t.version.get() as f32);
        }
        if v.0 == Version(2) {
            after.insert(b.transitions[0].worker);
        }
    }
    assert_eq!(
        after.len(),
        2,
        "both workers kept delivering with the new weights"
    );
    assert!(seen[&1] >= 1);
    assert!(multi.frames() >= 26 * 50);
    multi.shutdown().unwrap();
}

#[test]
fn config_errors_are_typed() {
    let e = Collector::builder(vec![CartPole::new(0)], TagPolicy::default())
        .track_traj_ids(false)
        .split_trajs(true)
        .build()
        .unwrap_err();
    assert!(matches!(e, Error::SplitTrajsWithoutTrajIds));
    let e = Collector::builder(vec![CartPole::new(0)], TagPolicy::default())
        .devices(Device::Cuda(0), Device::Cpu, Device::Cpu)
        .build()
        .unwrap_err();
    assert!(matches!(e, Error::DeviceNotSupported(Device::Cuda(0))));
    assert_eq!(
        e.to_string(),
        "device cuda:0 is not supported (only cpu is implemented)"
    );
    let mut c = Collector::builder(vec![CartPole::new(0)], TagPolicy::default())
        .track_traj_ids(false)
        .frames_per_batch(5)
        .build()
        .unwrap();
    let mut b = c.next_batch().unwrap().unwrap();
    assert!(b.transitions.iter().all(|t| t.traj_id.is_none()));
    assert!(matches!(
        b.split_trajs(),
        Err(Error::SplitTrajsWithoutTrajIds)
    ));
    // a policy that does not fit the environments (6 observation values, 3 actions)
    let e = Collector::builder(short_envs(1, 0, 5), MlpPolicy::new(&[6, 8, 3]).unwrap())
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("6 values") && e.contains("give 4 values"), "{e}");
}

#[test]
fn budget_and_direct_replay_buffer_writes() {
    let rb = Arc::new(RingBuffer::new(50).unwrap());
    let mut c = Collector::builder(short_envs(2, 0, 500), TagPolicy::default())
        .frames_per_batch(20)
        .total_frames(60)
        .replay_buffer(Arc::clone(&rb) as Arc<dyn ReplayBuffer>)
        .build()
        .unwrap();
    let batches: Vec<Batch> = (&mut c).map(|b| b.unwrap()).collect();
    assert_eq!(batches.len(), 3);
    assert!(
        batches
            .iter()
            .all(|b| b.transitions.is_empty() && b.frames == 20)
    );
    assert_eq!(rb.len(), 50);
    assert_eq!(rb.total_added(), 60);
    assert_eq!(c.frames(), 60);
    let snap = rb.snapshot();
    assert_eq!(snap.len(), 50);
    // oldest first: the ring dropped the first 10 frames (5 steps of 2 envs)
    assert_eq!(snap[0].step, 5);
}

#[test]
fn mlp_policy_runs_in_a_collector_and_ppo_exports_its_layout() {
    let mut trainer = PpoTrainer::new(PpoConfig {
        epochs: 2,
        minibatch: 64,
        ..PpoConfig::default()
    })
    .unwrap();
    let ws = trainer.export().unwrap();
    assert_eq!(ws.version(), Version(1));
    assert_eq!(
        **ws.manifest(),
        MlpPolicy::manifest_for(&[4, 64, 64, 2]).unwrap()
    );
    let mut c = Collector::builder(short_envs(4, 0, 500), MlpPolicy::cartpole().unwrap())
        .frames_per_batch(256)
        .build()
        .unwrap();
    c.update_weights(ws).unwrap();
    let batch = c.next_batch().unwrap().unwrap();
    // the collector's plain-Rust forward agrees with candle's
    let t = &batch.transitions[0];
    let lp = trainer.action_log_probs(&t.obs).unwrap();
    assert!(
        (lp[t.action] - t.log_prob).abs() < 1e-5,
        "{lp:?} vs {}",
        t.log_prob
    );
    let stats = trainer.update(&batch).unwrap();
    assert_eq!(stats.samples, 256);
    assert_eq!(stats.steps, 8);
    assert!(stats.value_loss.is_finite() && stats.entropy > 0.6);
    c.update_policy_weights_from(&trainer).unwrap();
    assert_eq!(c.policy_version(), Version(2));
    let mut p = MlpPolicy::cartpole().unwrap();
    ArenaStrategy
        .apply(&trainer.export().unwrap(), &mut p)
        .unwrap();
    let lp2 = trainer.action_log_probs(&t.obs).unwrap();
    assert!((p.log_probs(&t.obs)[0] - lp2[0]).abs() < 1e-5);
}

/// CartPole that blocks inside `step` (a hung environment) once `hang_after` steps ran,
/// until the test releases it.
struct Hanging {
    inner: CartPole,
    steps: usize,
    hang_after: usize,
    release: Arc<(Mutex<bool>, std::sync::Condvar)>,
}

impl Env for Hanging {
    fn obs_dim(&self) -> usize {
        4
    }
    fn num_actions(&self) -> usize {
        2
    }
    fn reset(&mut self, seed: Option<u64>) -> refit_rl::Result<Vec<f32>> {
        self.inner.reset(seed)
    }
    fn step(&mut self, action: usize) -> refit_rl::Result<StepResult> {
        self.steps += 1;
        if self.steps > self.hang_after {
            let (lock, cv) = &*self.release;
            let mut released = lock.lock().unwrap();
            while !*released {
                released = cv.wait(released).unwrap();
            }
        }
        self.inner.step(action)
    }
}

#[test]
fn a_live_but_hung_worker_is_a_timeout_naming_it_not_a_hang() {
    let hub = refit_transports::inproc::InProc::new();
    let release = Arc::new((Mutex::new(false), std::sync::Condvar::new()));
    let workers: Vec<_> = (0..2)
        .map(|w| {
            let env = Hanging {
                inner: CartPole::new(w),
                steps: 0,
                // worker 1 hangs in its second batch; worker 0 never does
                hang_after: if w == 1 { 20 } else { usize::MAX },
                release: Arc::clone(&release),
            };
            let c = Collector::builder(vec![env], TagPolicy::default())
                .frames_per_batch(20)
                .build()
                .unwrap();
            (c, hub.receiver())
        })
        .collect();
    let deadline = Duration::from_millis(1500);
    let mut multi = MultiSyncCollector::spawn(
        hub.sender().unwrap(),
        workers,
        vec![tag_weights(1)],
        MultiConfig {
            batch_timeout: deadline,
            ..MultiConfig::default()
        },
    )
    .unwrap();
    assert_eq!(multi.next_batch().unwrap().unwrap().frames, 40);
    let t = std::time::Instant::now();
    let err = multi.next_batch().unwrap_err();
    let waited = t.elapsed();
    assert!(
        matches!(&err, Error::Runtime(e) if e.is_timeout()),
        "expected a timeout, got {err}"
    );
    assert!(err.to_string().contains("workers [1]"), "{err}");
    assert!(
        waited >= deadline - Duration::from_millis(100)
            && waited < deadline + Duration::from_secs(2),
        "{waited:?}"
    );
    // shutdown does not join the hung thread forever either: it is named and left behind
    let t = std::time::Instant::now();
    let err = multi.shutdown().unwrap_err();
    assert!(
        matches!(err, Error::WorkerGone { worker: 1, .. }),
        "expected worker 1 left running, got {err}"
    );
    assert!(err.to_string().contains("did not stop"), "{err}");
    assert!(
        t.elapsed() < deadline + Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    let (lock, cv) = &*release;
    *lock.lock().unwrap() = true;
    cv.notify_all();
}

/// The trainer's end and the parent's end of an upstream in-process scheme for the tag
/// policy, connected with `initial`.
fn tag_upstream(
    initial: WeightSet,
) -> (
    refit_runtime::Sender<refit_transports::inproc::InProcSender>,
    refit_runtime::Receiver<refit_transports::inproc::InProcReceiver>,
) {
    let manifests =
        refit_runtime::Manifests::new([(initial.model().clone(), Arc::new(tag_manifest()))])
            .unwrap();
    let hub = refit_transports::inproc::InProc::new();
    let r = refit_runtime::ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let t = std::thread::spawn(move || r.connect(Duration::from_secs(10)).unwrap());
    let s = refit_runtime::SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![initial], Duration::from_secs(10))
        .unwrap();
    (s, t.join().unwrap())
}

#[test]
fn an_update_pushed_upstream_cascades_through_a_multi_collector_to_every_worker() {
    let workers = |hub: &refit_transports::inproc::InProc| -> Vec<_> {
        (0..2)
            .map(|w| {
                let c = Collector::builder(short_envs(2, 10 * w, 500), TagPolicy::default())
                    .frames_per_batch(40)
                    .build()
                    .unwrap();
                (c, hub.receiver())
            })
            .collect()
    };
    // sync parent: the batch after each push is made by the pushed version, in every worker
    let hub = refit_transports::inproc::InProc::new();
    let mut multi = MultiSyncCollector::spawn(
        hub.sender().unwrap(),
        workers(&hub),
        vec![tag_weights(1)],
        MultiConfig::default(),
    )
    .unwrap();
    let (mut top, parent_end) = tag_upstream(tag_weights(2));
    multi.attach_weight_source(Box::new(parent_end)).unwrap();
    for v in 2..5 {
        let pending = (v > 2).then(|| top.send_async(vec![tag_weights(v)]).unwrap());
        let b = multi.next_batch().unwrap().unwrap();
        if let Some(p) = pending {
            // the parent acknowledged upstream when it forwarded
            top.wait(&p, Duration::from_secs(10)).unwrap();
        }
        assert_eq!(b.version_range(), Some((Version(v), Version(v))));
        let mut ws: Vec<usize> = b.transitions.iter().map(|t| t.worker).collect();
        ws.dedup();
        assert_eq!(ws, vec![0, 1]);
        assert!(b.transitions.iter().all(|t| t.log_prob == v as f32));
    }
    multi.shutdown().unwrap();

    // async parent: every worker reaches the pushed version
    let hub = refit_transports::inproc::InProc::new();
    let mut multi = MultiAsyncCollector::spawn(
        hub.sender().unwrap(),
        workers(&hub),
        vec![tag_weights(1)],
        MultiConfig::default(),
    )
    .unwrap();
    let (mut top, parent_end) = tag_upstream(tag_weights(1));
    multi.attach_weight_source(Box::new(parent_end)).unwrap();
    multi.next_batch().unwrap().unwrap();
    let pending = top.send_async(vec![tag_weights(2)]).unwrap();
    // a deadline, not a count of batches: on a busy machine one worker's thread can sit
    // unscheduled while the other delivers hundreds of small batches
    let mut reached = HashSet::new();
    let mut seen = VecDeque::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let b = multi.next_batch().unwrap().unwrap();
        seen.push_back((b.transitions[0].worker, b.version_range()));
        if seen.len() > 20 {
            seen.pop_front();
        }
        if b.version_range() == Some((Version(2), Version(2))) {
            reached.insert(b.transitions[0].worker);
        }
        if reached.len() == 2 {
            break;
        }
    }
    assert_eq!(
        reached.len(),
        2,
        "workers at v2: {reached:?}; the last batches (worker, versions): {seen:?}"
    );
    top.wait(&pending, Duration::from_secs(10)).unwrap();
    multi.shutdown().unwrap();
}
