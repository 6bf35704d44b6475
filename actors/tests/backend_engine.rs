//! The backend engine (the engine of vLLM or a Python object): requests batched and answered
//! with the versions that made their tokens, a commit that waits for the running batch and
//! pauses for its load alone, a version the backend refuses leaving the previous one
//! served, a backend's bad answers refused naming the field, cancelled episodes.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod generating;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use actix::prelude::*;
use refit_actors::actor::{BackendEngine, EngineBackend, GeneratorBackend};
use refit_actors::generation::{Completion, SamplingParams};
use refit_actors::protocol::engine::{
    AbortStage, CancelInFlight, CommitModel, Generate, GetEngineStats, Score, ServedVersions,
    StageModel, UpdateModel,
};
use refit_actors::{Error, Result};
use refit_runtime::sync_policy::PauseMode;
use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use generating::{Gate, Gated, bigram, policy, table, walk, within};

/// A backend that can refuse a version and drop its answers' log-probabilities; with
/// `streams`, it takes each version in tensor by tensor at its commit (the tensors are
/// written into a version of its own as they come, as a real engine writes them into its
/// served model, then loaded).
struct Faulty<B> {
    inner: B,
    /// A version refused: its stage, or its first tensor when streamed.
    refuse: Option<Version>,
    streams: bool,
    /// Stages the engine asked of the backend (none for a streaming model).
    stages: Arc<AtomicU64>,
    /// Tensors streamed in, over all commits.
    tensors: Arc<AtomicU64>,
    /// A version whose commit fails.
    fail_commit: Option<Version>,
    drop_logprobs: AtomicBool,
    aborts: Arc<AtomicU64>,
    interrupts: Arc<AtomicU64>,
}

impl<B> Faulty<B> {
    /// `inner`, refusing nothing and failing nothing.
    fn new(inner: B) -> Self {
        Self {
            inner,
            refuse: None,
            streams: false,
            stages: Arc::default(),
            tensors: Arc::default(),
            fail_commit: None,
            drop_logprobs: AtomicBool::new(false),
            aborts: Arc::default(),
            interrupts: Arc::default(),
        }
    }
}

impl<B: EngineBackend> EngineBackend for Faulty<B> {
    fn name(&self) -> String {
        "faulty".into()
    }
    fn streams(&self) -> bool {
        self.streams
    }
    fn manifest(&self, model: &ModelId) -> Result<Arc<Manifest>> {
        self.inner.manifest(model)
    }
    fn stage(&self, weights: Arc<WeightSet>) -> Result<()> {
        self.stages.fetch_add(1, Ordering::SeqCst);
        if Some(weights.version()) == self.refuse {
            return Err(Error::Generator {
                model: weights.model().to_string(),
                reason: "tensor `table`: shape refused by the backend".into(),
            });
        }
        self.inner.stage(weights)
    }
    fn commit(&self, model: &ModelId, version: Version) -> Result<Option<Duration>> {
        if Some(version) == self.fail_commit {
            return Err(Error::Generator {
                model: model.to_string(),
                reason: "the load failed".into(),
            });
        }
        self.inner.commit(model, version)
    }
    fn commit_streamed(
        &self,
        model: &ModelId,
        _version: Version,
        stream: &refit_actors::actor::TensorStream,
    ) -> Result<()> {
        let manifest = self.inner.manifest(model)?;
        let mut landing = WeightSet::zeroed(model.clone(), Arc::clone(&manifest));
        let mut apply = |one: WeightSet| -> Result<()> {
            if Some(one.version()) == self.refuse {
                return Err(Error::Generator {
                    model: model.to_string(),
                    reason: "tensor `table` refused by the streamed backend".into(),
                });
            }
            for t in one.manifest().tensors() {
                landing
                    .tensor_bytes_mut(&t.name)
                    .unwrap()
                    .copy_from_slice(&one.bytes()[t.range()]);
            }
            landing.set_version(one.version());
            self.tensors.fetch_add(1, Ordering::SeqCst);
            Ok(())
        };
        // the version asked, a newer one, or an older one that came whole in time
        let streamed = stream.run(&mut apply)?;
        // a second run is refused: one stream per commit
        let again = stream.run(&mut |_| Ok(())).unwrap_err().to_string();
        assert!(again.contains("streamed already"), "{again}");
        self.inner.stage(Arc::new(landing))?;
        self.inner.commit(model, streamed).map(|_| ())
    }
    fn abort(&self, model: &ModelId) {
        self.aborts.fetch_add(1, Ordering::Relaxed);
        self.inner.abort(model);
    }
    fn interrupt(&self, model: &ModelId, version: Version) {
        self.interrupts.fetch_add(1, Ordering::SeqCst);
        self.inner.interrupt(model, version);
    }
    fn generate(
        &self,
        batch: &[Generate],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>> {
        let mut out = self.inner.generate(batch, served);
        if self.drop_logprobs.load(Ordering::Relaxed) {
            for c in out.iter_mut().flatten() {
                c.logprobs.clear();
            }
        }
        out
    }
    fn score(
        &self,
        batch: &[Score],
        served: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>> {
        self.inner.score(batch, served)
    }
}

type InProcSender = refit_runtime::Sender<refit_transports::inproc::InProcSender>;

/// A sender of the bigram's versions and an engine of `backend` fed by it (commits wait
/// for the running batch).
fn engine<B: EngineBackend>(backend: B) -> (Addr<BackendEngine<B>>, InProcSender) {
    engine_in(backend, PauseMode::Wait)
}

/// An engine of Refit's own backend under `mode`, whose forward passes go through the
/// gate answered beside it, closed; the count of its interrupts beside it too.
fn gated(
    mode: PauseMode,
) -> (
    Arc<Gate>,
    Arc<AtomicU64>,
    Addr<BackendEngine<GatedBackend>>,
    InProcSender,
) {
    let gate = Gate::closed();
    let inner = GeneratorBackend::new()
        .with_model(policy(), Gated::new(&gate), Gated::new(&gate), 8)
        .unwrap();
    let interrupts = Arc::new(AtomicU64::new(0));
    let backend = Faulty {
        interrupts: Arc::clone(&interrupts),
        ..Faulty::new(inner)
    };
    let (e, sender) = engine_in(backend, mode);
    (gate, interrupts, e, sender)
}

type GatedBackend = Faulty<GeneratorBackend<Gated>>;

/// [`engine`] under the pause mode `mode`.
fn engine_in<B: EngineBackend>(
    backend: B,
    mode: PauseMode,
) -> (Addr<BackendEngine<B>>, InProcSender) {
    let m = policy();
    let (sender, receiver) = generating::scheme(&m, &bigram(), table(&m, 1));
    let inlet: Box<dyn refit_actors::WeightInlet> = Box::new(receiver);
    let addr = BackendEngine::new(Arc::new(backend), vec![(m, inlet)])
        .unwrap()
        .pause_mode(mode)
        .start();
    (addr, sender)
}

fn ask(last: u32, epoch: Option<u64>) -> Generate {
    Generate {
        model: policy(),
        prompt: vec![last],
        params: SamplingParams::greedy(3),
        epoch,
    }
}

async fn update<B: EngineBackend>(e: &Addr<BackendEngine<B>>, v: u64) -> Result<Version> {
    let msg = UpdateModel {
        model: policy(),
        version: Version(v),
        timeout: Duration::from_secs(10),
    };
    within("an update", e.send(msg))
        .await
        .unwrap()
        .map(|r| r.version)
}

#[actix_rt::test]
async fn completions_carry_the_version_that_made_them() {
    let backend = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 8)
        .unwrap();
    let (e, mut sender) = engine(backend);
    // a request before any version waits for the first one
    let early = e.send(ask(2, None));
    actix_rt::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let c = within("the early request", early).await.unwrap().unwrap();
    assert_eq!((c.tokens, c.versions), (walk(2, 1, 3), vec![Version(1); 3]));
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    assert_eq!(update(&e, 2).await.unwrap(), Version(2));
    // many requests at once go in batches; each answered under v2
    let asks: Vec<_> = (0..6).map(|t| e.send(ask(t, None))).collect();
    for (t, a) in asks.into_iter().enumerate() {
        let c = within("a request", a).await.unwrap().unwrap();
        assert_eq!(c.tokens, walk(t as u32, 2, 3));
        assert_eq!(c.versions, vec![Version(2); 3]);
        assert_eq!(c.logprobs.len(), 3);
    }
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(2)));
    let stats = e.send(GetEngineStats).await.unwrap();
    assert_eq!((stats.loads, stats.tokens), (2, 21));
}

#[actix_rt::test]
async fn a_commit_waits_for_the_running_batch_and_pauses_only_for_its_load() {
    let (gate, _, e, mut sender) = gated(PauseMode::Wait);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    // a batch runs (held at its first forward pass), then v2 arrives
    let running = e.send(ask(0, None));
    gate.wait_entered(1).await;
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let load = e.send(UpdateModel {
        model: policy(),
        version: Version(2),
        timeout: Duration::from_secs(20),
    });
    let load = actix_rt::spawn(load);
    actix_rt::time::sleep(Duration::from_millis(300)).await;
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(
        served.get(&policy()),
        Some(&Version(1)),
        "no commit inside a batch"
    );
    gate.open();
    let c = within("the running batch", running).await.unwrap().unwrap();
    assert_eq!(c.versions, vec![Version(1); 3], "{c:?}");
    let report = within("the load", load).await.unwrap().unwrap().unwrap();
    assert_eq!(report.version, Version(2));
    assert!(report.paused < Duration::from_millis(250), "{report:?}");
    let stats = e.send(GetEngineStats).await.unwrap();
    assert!(
        stats.drained_total >= Duration::from_millis(250),
        "{stats:?}"
    );
    let c = within("a request after", e.send(ask(0, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(0, 2, 3), vec![Version(2); 3]));
}

/// Under `pause_mode = "abort"` Refit's own backend (a generator behind the contract) ends
/// the running batch at its next step when a commit comes: the request is answered aborted
/// by v2 with the v1 tokens made before, and v2 is served once the batch ended.
#[actix_rt::test]
async fn under_abort_a_commit_ends_the_generators_running_batch_at_its_next_step() {
    let (gate, interrupts, e, mut sender) = gated(PauseMode::Abort);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    // a batch runs (held at its first forward pass), then v2 comes and interrupts it
    let mut long = ask(0, None);
    long.params = SamplingParams::greedy(6);
    let running = e.send(long);
    gate.wait_entered(1).await;
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let e2 = e.clone();
    let load = actix_rt::spawn(async move { update(&e2, 2).await });
    // (v1's commit interrupted too: no batch ran)
    generating::until("v2's interrupt", || interrupts.load(Ordering::SeqCst) > 1).await;
    gate.open();
    let c = within("the running batch", running).await.unwrap().unwrap();
    assert_eq!(c.finish, refit_actors::Finish::Aborted { by: Version(2) });
    assert!(c.tokens.len() < 6, "{c:?}");
    assert_eq!(c.versions, vec![Version(1); c.tokens.len()]);
    assert_eq!(within("the load", load).await.unwrap().unwrap(), Version(2));
    let stats = e.send(GetEngineStats).await.unwrap();
    assert_eq!(stats.aborted, 1, "{stats:?}");
    // spent by the commit: the next batch runs whole under v2
    let c = within("a request after", e.send(ask(0, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(0, 2, 3), vec![Version(2); 3]));
}

#[actix_rt::test]
async fn refused_versions_and_bad_answers_are_typed_errors_and_v1_stays_served() {
    let inner = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 8)
        .unwrap();
    let backend = Faulty {
        refuse: Some(Version(2)),
        ..Faulty::new(inner)
    };
    let (e, mut sender) = engine(backend);
    // a request of an episode cancelled while it waits for the first version
    let doomed = e.send(ask(1, Some(0)));
    actix_rt::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(e.send(CancelInFlight).await.unwrap(), 1);
    let err = within("the cancelled request", doomed)
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Cancelled { epoch: 1 }), "{err}");
    let err = within("a late request", e.send(ask(1, Some(0))))
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Cancelled { .. }), "{err}");

    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let err = update(&e, 2).await.unwrap_err().to_string();
    assert!(err.contains("table") && err.contains("refused"), "{err}");
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(1)));
    let c = within("a request", e.send(ask(4, Some(1))))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.tokens, walk(4, 1, 3), "v1 still serves");
    // the next version loads whole
    let _ = sender.send_async(vec![table(&policy(), 3)]).unwrap();
    assert_eq!(update(&e, 3).await.unwrap(), Version(3));
    let c = within("a request", e.send(ask(0, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(0, 3, 3), vec![Version(3); 3]));
}

/// An engine whose backend drops every log-probability: the request is refused naming the
/// field (a learner would otherwise learn from zeros).
#[actix_rt::test]
async fn a_completion_without_logprobs_is_refused_naming_the_field() {
    let inner = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 8)
        .unwrap();
    let backend = Faulty {
        drop_logprobs: AtomicBool::new(true),
        ..Faulty::new(inner)
    };
    let (e, _sender) = engine(backend);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let err = within("a request", e.send(ask(0, None)))
        .await
        .unwrap()
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::Generator { .. })
            && text.contains("0 logprobs for 3 tokens")
            && text.contains("faulty"),
        "{text}"
    );
}

/// Whatever way a staged version goes uncommitted (an abort, its hold running out, a load
/// taking its place, a commit of another version), the backend is told to drop it, and
/// what it serves does not change.
#[actix_rt::test]
async fn every_version_left_uncommitted_is_dropped_by_the_backend() {
    let inner = GeneratorBackend::new()
        .with_model(policy(), bigram(), bigram(), 8)
        .unwrap();
    let aborts = Arc::new(AtomicU64::new(0));
    let backend = Faulty {
        aborts: Arc::clone(&aborts),
        ..Faulty::new(inner)
    };
    let (e, mut sender) = engine(backend);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let stage = |v: u64, hold: Duration| StageModel {
        model: policy(),
        version: Version(v),
        timeout: Duration::from_secs(10),
        hold,
    };
    let long = Duration::from_secs(30);
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    // an abort
    let st = within("a stage", e.send(stage(2, long)))
        .await
        .unwrap()
        .unwrap();
    assert!(st.fresh);
    e.send(AbortStage { model: policy() }).await.unwrap();
    assert_eq!(aborts.load(Ordering::Relaxed), 1);
    // a hold running out
    within("a stage", e.send(stage(2, Duration::from_millis(100))))
        .await
        .unwrap()
        .unwrap();
    actix_rt::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(aborts.load(Ordering::Relaxed), 2);
    // a commit of another version than the one staged
    within("a stage", e.send(stage(2, long)))
        .await
        .unwrap()
        .unwrap();
    let wrong = CommitModel {
        model: policy(),
        version: Version(3),
        timeout: Duration::from_secs(10),
    };
    let err = e.send(wrong).await.unwrap().unwrap_err().to_string();
    assert!(err.contains("v3") && err.contains("v2"), "{err}");
    assert_eq!(aborts.load(Ordering::Relaxed), 3);
    // a load taking a staged version's place: dropped first, then the load goes through
    within("a stage", e.send(stage(2, long)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(update(&e, 2).await.unwrap(), Version(2));
    assert_eq!(aborts.load(Ordering::Relaxed), 4);
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(2)));
}

/// A commit the backend fails: the version is dropped by the backend, the one served before
/// stays served and keeps answering; a request cancelled while its batch runs is answered
/// cancelled when the batch ends.
#[actix_rt::test]
async fn a_failed_commit_leaves_the_served_version_and_a_running_cancelled_request_ends() {
    let gate = Gate::closed();
    let inner = GeneratorBackend::new()
        .with_model(policy(), Gated::new(&gate), Gated::new(&gate), 8)
        .unwrap();
    let aborts = Arc::new(AtomicU64::new(0));
    let backend = Faulty {
        fail_commit: Some(Version(2)),
        aborts: Arc::clone(&aborts),
        ..Faulty::new(inner)
    };
    let (e, mut sender) = engine(backend);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let err = update(&e, 2).await.unwrap_err().to_string();
    assert!(err.contains("the load failed"), "{err}");
    assert_eq!(
        aborts.load(Ordering::Relaxed),
        1,
        "the staged version is dropped"
    );
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(1)));
    // a request of epoch 0 runs (held at the gate); the episode is cancelled meanwhile
    let running = e.send(ask(5, Some(0)));
    gate.wait_entered(1).await;
    assert_eq!(e.send(CancelInFlight).await.unwrap(), 1);
    gate.open();
    let err = within("the cancelled request", running)
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Cancelled { epoch: 1 }), "{err}");
    let c = within("a request", e.send(ask(5, Some(1))))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.tokens, walk(5, 1, 3), "v1 still serves");
    let stats = e.send(GetEngineStats).await.unwrap();
    assert_eq!(stats.cancelled, 1, "{stats:?}");
}

/// How long [`Stepping`]'s commit waits for its step boundary.
const STEP_WAIT: Duration = Duration::from_millis(80);
/// The load [`Stepping`]'s commit reports: its pause.
const STEP_LOAD: Duration = Duration::from_millis(1);

/// A backend that commits in flight: each token of a request takes 20 ms and carries the
/// version served when it was made (or none, when it does not label its tokens). Its
/// fourth token waits (`hold` at most) for a commit to land, so one lands mid-sequence
/// however loaded the machine is, where the engine lets it. An interrupt ends its
/// sequences at the next token, until the commit.
struct Stepping {
    manifest: Arc<Manifest>,
    served: AtomicU64,
    staged: std::sync::Mutex<Option<Version>>,
    labels: bool,
    hold: Duration,
    generating: AtomicBool,
    /// A commit came while a batch ran.
    overlapped: Arc<AtomicBool>,
    /// The version an interrupt named, until the commit or an abort.
    interrupted: std::sync::Mutex<Option<Version>>,
}

impl Stepping {
    fn new(labels: bool, hold: Duration) -> Self {
        use refit_actors::Generator;
        Self {
            manifest: bigram().manifest(),
            served: AtomicU64::new(0),
            staged: std::sync::Mutex::new(None),
            labels,
            hold,
            generating: AtomicBool::new(false),
            overlapped: Arc::new(AtomicBool::new(false)),
            interrupted: std::sync::Mutex::new(None),
        }
    }

    fn interrupted(&self) -> Option<Version> {
        *self.interrupted.lock().unwrap()
    }

    /// One request's tokens, each 20 ms, ended early by an interrupt.
    fn sequence(&self, g: &Generate) -> Completion {
        let n = g.params.max_tokens as usize;
        let mut versions = Vec::new();
        let at = self.served.load(Ordering::SeqCst);
        for i in 0..n {
            if let Some(by) = self.interrupted() {
                return Completion {
                    tokens: vec![1; i],
                    logprobs: vec![-0.5; i],
                    versions,
                    finish: refit_actors::Finish::Aborted { by },
                };
            }
            if i == 3 {
                let deadline = std::time::Instant::now() + self.hold;
                while self.served.load(Ordering::SeqCst) == at
                    && self.interrupted().is_none()
                    && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
            std::thread::sleep(Duration::from_millis(20));
            versions.push(Version(self.served.load(Ordering::SeqCst)));
        }
        Completion {
            tokens: vec![1; n],
            logprobs: vec![-0.5; n],
            versions: if self.labels { versions } else { Vec::new() },
            finish: refit_actors::Finish::Length,
        }
    }
}

impl EngineBackend for Stepping {
    fn name(&self) -> String {
        "stepping".into()
    }
    fn commits_in_flight(&self) -> bool {
        true
    }
    fn manifest(&self, _: &ModelId) -> Result<Arc<Manifest>> {
        Ok(Arc::clone(&self.manifest))
    }
    fn stage(&self, weights: Arc<WeightSet>) -> Result<()> {
        *self.staged.lock().unwrap() = Some(weights.version());
        Ok(())
    }
    /// Waits `STEP_WAIT` for its step boundary (tokens still made), then loads in
    /// `STEP_LOAD`: the pause it answers.
    fn commit(&self, _: &ModelId, version: Version) -> Result<Option<Duration>> {
        *self.interrupted.lock().unwrap() = None;
        assert_eq!(self.staged.lock().unwrap().take(), Some(version));
        std::thread::sleep(STEP_WAIT);
        if self.generating.load(Ordering::SeqCst) {
            self.overlapped.store(true, Ordering::SeqCst);
        }
        self.served.store(version.get(), Ordering::SeqCst);
        Ok(Some(STEP_LOAD))
    }
    /// Holds until the commit (or an abort).
    fn interrupt(&self, _: &ModelId, version: Version) {
        *self.interrupted.lock().unwrap() = Some(version);
    }
    fn abort(&self, _: &ModelId) {
        *self.interrupted.lock().unwrap() = None;
    }
    fn generate(
        &self,
        batch: &[Generate],
        _: &BTreeMap<ModelId, Version>,
    ) -> Vec<Result<Completion>> {
        self.generating.store(true, Ordering::SeqCst);
        let out = batch.iter().map(|g| Ok(self.sequence(g))).collect();
        self.generating.store(false, Ordering::SeqCst);
        out
    }
}

/// Under `keep`, a backend that commits in flight is committed during the running batch
/// (the commit lands while it generates) and the sequence carries both versions; under
/// `wait` the same backend's commit waits for the batch (held 300 ms for a commit that
/// does not come: drained, never during it); under `abort` the commit interrupts the
/// batch (held 10 s otherwise): the sequence ends aborted by v2 with the v1 tokens made so
/// far, and the commit follows at once. A
/// backend that commits in flight and leaves its tokens unlabelled is refused, naming the
/// versions. The pause counted is the one the backend reports (its load), not its wait for
/// a step boundary.
#[actix_rt::test]
async fn a_backend_that_commits_in_flight_is_committed_during_the_batch_under_keep() {
    let cases = [
        (PauseMode::Keep, true),
        (PauseMode::Wait, true),
        (PauseMode::Abort, true),
        (PauseMode::Keep, false),
    ];
    for (mode, labels) in cases {
        let hold = match mode {
            PauseMode::Wait => Duration::from_millis(300),
            _ => Duration::from_secs(10),
        };
        let backend = Stepping::new(labels, hold);
        let overlapped = Arc::clone(&backend.overlapped);
        let (e, mut sender) = engine_in(backend, mode);
        assert_eq!(update(&e, 1).await.unwrap(), Version(1));
        let mut long = ask(0, None);
        long.params = SamplingParams::greedy(10);
        let running = e.send(long);
        actix_rt::time::sleep(Duration::from_millis(30)).await;
        let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
        let e2 = e.clone();
        let loaded = actix_rt::spawn(async move { update(&e2, 2).await });
        let c = within("the running batch", running).await.unwrap();
        let v = within("the load", loaded).await.unwrap();
        assert_eq!(v.unwrap(), Version(2));
        assert_eq!(overlapped.load(Ordering::SeqCst), mode == PauseMode::Keep);
        match (mode, labels) {
            (PauseMode::Keep, true) => {
                let c = c.unwrap();
                let ones = c.versions.iter().filter(|v| **v == Version(1)).count();
                assert!((1..10).contains(&ones), "{:?}", c.versions);
                assert_eq!(c.versions[..ones], vec![Version(1); ones]);
                assert_eq!(c.versions[ones..], vec![Version(2); 10 - ones]);
                // the wait for the step boundary is drained time, the load alone a pause
                let stats = e.send(GetEngineStats).await.unwrap();
                assert_eq!(stats.paused_max, STEP_LOAD, "{stats:?}");
                assert!(stats.drained_total >= STEP_WAIT - STEP_LOAD, "{stats:?}");
            }
            (PauseMode::Wait, _) => {
                assert_eq!(c.unwrap().versions, vec![Version(1); 10]);
                let stats = e.send(GetEngineStats).await.unwrap();
                assert!(
                    stats.drained_total >= Duration::from_millis(100),
                    "{stats:?}"
                );
                // out of flight the whole commit is a pause, whatever the backend says
                assert!(stats.paused_max >= STEP_WAIT, "{stats:?}");
            }
            (PauseMode::Abort, _) => {
                let c = c.unwrap();
                assert_eq!(c.finish, refit_actors::Finish::Aborted { by: Version(2) });
                let n = c.tokens.len();
                assert!(n < 10, "{c:?}");
                assert_eq!(c.versions, vec![Version(1); n]);
                let stats = e.send(GetEngineStats).await.unwrap();
                assert_eq!(stats.aborted, 1, "{stats:?}");
                // the commit waited for a token, not for the 10 s the batch would hold
                assert!(stats.drained_total < Duration::from_secs(5), "{stats:?}");
            }
            _ => {
                let e = c.unwrap_err().to_string();
                assert!(e.contains("no versions") && e.contains("stepping"), "{e}");
            }
        }
    }
}

/// The engine contract's conformance suite on a backend that commits in flight, as
/// `conformance::backend` runs it (under keep, a topology's default): every check holds
/// with commits that skip the batch's turn.
#[test]
fn a_backend_committed_in_flight_passes_the_conformance_suite() {
    let backend = Stepping::new(true, Duration::from_millis(300));
    let passed = refit_actors::conformance::backend(backend, &policy()).unwrap();
    assert_eq!(passed, refit_actors::conformance::CHECKS);
}

/// The suite on a model taken in as `apply = "streaming"` has it: each version pulled
/// inside its commit and handed to `commit_streamed` tensor by tensor, never staged, every
/// check holding; a backend that only stages is refused before any check, named.
#[test]
fn a_streaming_backend_passes_the_conformance_suite_and_one_that_stages_is_refused() {
    use refit_runtime::topology::Apply;
    let inner = || {
        GeneratorBackend::new()
            .with_model(policy(), bigram(), bigram(), 8)
            .unwrap()
    };
    let backend = Faulty {
        streams: true,
        ..Faulty::new(inner())
    };
    let (stages, tensors) = (Arc::clone(&backend.stages), Arc::clone(&backend.tensors));
    let passed =
        refit_actors::conformance::backend_applied(backend, &policy(), Apply::Streaming).unwrap();
    assert_eq!(passed, refit_actors::conformance::CHECKS);
    assert_eq!(
        stages.load(Ordering::SeqCst),
        0,
        "a streaming model was staged"
    );
    // versions 1 to 4 streamed in, the bigram's one tensor each (v4 on the way to the v9
    // that never comes)
    assert_eq!(tensors.load(Ordering::SeqCst), 4);
    let refused = refit_actors::conformance::backend_applied(
        Faulty::new(inner()),
        &policy(),
        Apply::Streaming,
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("apply = \"streaming\"")
            && refused.contains("faulty engine does not stream"),
        "{refused}"
    );
}

type StreamedBackend = Faulty<GeneratorBackend<refit_actors::bigram::Bigram>>;

/// A streaming engine of [`Faulty`] (refusing `fail_at`), fed by a sender through a
/// streaming inlet: it holds v1, the version in force, until the first commit takes it.
fn streaming_engine(
    fail_at: Option<Version>,
) -> (
    Addr<BackendEngine<StreamedBackend>>,
    InProcSender,
    Arc<AtomicU64>,
    Arc<AtomicU64>,
) {
    let m = policy();
    let manifests = refit_runtime::Manifests::new([(
        m.clone(),
        refit_actors::generation::Generator::manifest(&bigram()),
    )])
    .unwrap();
    let hub = refit_transports::inproc::InProc::new();
    let receiver = refit_runtime::ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
    let r = std::thread::spawn(move || {
        refit_runtime::link::StreamingInlet::connect(receiver, Duration::from_secs(10)).unwrap()
    });
    let sender = refit_runtime::SenderInit::new(hub.sender().unwrap(), manifests)
        .connect(vec![table(&m, 1)], Duration::from_secs(10))
        .unwrap();
    let inlet: Box<dyn refit_actors::WeightInlet> = Box::new(r.join().unwrap());
    let backend = Faulty {
        refuse: fail_at,
        streams: true,
        ..Faulty::new(
            GeneratorBackend::new()
                .with_model(m.clone(), bigram(), bigram(), 8)
                .unwrap(),
        )
    };
    let (stages, tensors) = (Arc::clone(&backend.stages), Arc::clone(&backend.tensors));
    let addr = BackendEngine::new(Arc::new(backend), vec![(m.clone(), inlet)])
        .unwrap()
        .pause_mode(PauseMode::Keep)
        .streamed(&m)
        .unwrap()
        .start();
    (addr, sender, stages, tensors)
}

#[actix_rt::test]
async fn a_streaming_model_is_pulled_inside_its_commit_and_never_staged() {
    let (e, mut sender, stages, tensors) = streaming_engine(None);
    // the version in force streams in at the first load
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let c = within("a request", e.send(ask(2, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(2, 1, 3), vec![Version(1); 3]));
    // stage then commit, as the controller drives a fleet: the stage pulls nothing
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let stage = StageModel {
        model: policy(),
        version: Version(2),
        timeout: Duration::from_secs(10),
        hold: Duration::from_secs(10),
    };
    let staged = within("the stage", e.send(stage)).await.unwrap().unwrap();
    assert_eq!(staged.version, Version(2));
    assert_eq!(tensors.load(Ordering::SeqCst), 1, "the stage pulled");
    let commit = CommitModel {
        model: policy(),
        version: Version(2),
        timeout: Duration::from_secs(10),
    };
    let report = within("the commit", e.send(commit)).await.unwrap().unwrap();
    assert_eq!(report.version, Version(2));
    assert_eq!(tensors.load(Ordering::SeqCst), 2);
    let c = within("a request", e.send(ask(2, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(2, 2, 3), vec![Version(2); 3]));
    // the engine never asked the backend to stage: no second copy of the model
    assert_eq!(stages.load(Ordering::SeqCst), 0);
    let stats = e.send(GetEngineStats).await.unwrap();
    assert_eq!(stats.loads, 2, "{stats:?}");
}

#[actix_rt::test]
async fn a_streamed_version_the_backend_refuses_leaves_the_served_one() {
    let (e, mut sender, _, _) = streaming_engine(Some(Version(2)));
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    let err = update(&e, 2).await.unwrap_err().to_string();
    // refused at its first tensor: the apply's own error, nothing applied
    assert!(err.contains("refused by the streamed backend"), "{err}");
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(1)));
    let c = within("a request", e.send(ask(2, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.versions, vec![Version(1); 3]);
    // the next version streams in whole
    let _ = sender.send_async(vec![table(&policy(), 3)]).unwrap();
    assert_eq!(update(&e, 3).await.unwrap(), Version(3));
    let c = within("a request", e.send(ask(2, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(2, 3, 3), vec![Version(3); 3]));
}

#[test]
fn a_streaming_model_on_a_backend_that_stages_is_refused_naming_both() {
    let m = policy();
    let (_sender, receiver) = generating::scheme(&m, &bigram(), table(&m, 1));
    let inlet: Box<dyn refit_actors::WeightInlet> = Box::new(receiver);
    let backend = GeneratorBackend::new()
        .with_model(m.clone(), bigram(), bigram(), 8)
        .unwrap();
    let e = BackendEngine::new(Arc::new(backend), vec![(m.clone(), inlet)])
        .unwrap()
        .streamed(&m)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`policy`") && e.contains("does not stream"),
        "{e}"
    );
}

#[actix_rt::test]
async fn a_streaming_commit_whose_version_does_not_come_serves_the_older_one_that_did_and_fails() {
    let (e, mut sender, _, tensors) = streaming_engine(None);
    assert_eq!(update(&e, 1).await.unwrap(), Version(1));
    let _ = sender.send_async(vec![table(&policy(), 2)]).unwrap();
    // v3 is asked and never published: v2 streams in whole, then the transfer's time runs out
    let msg = UpdateModel {
        model: policy(),
        version: Version(3),
        timeout: Duration::from_millis(200),
    };
    let err = within("the load", e.send(msg))
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(err.contains("v3") && err.contains("v2 came whole"), "{err}");
    assert_eq!(tensors.load(Ordering::SeqCst), 2);
    // the engine says what its model holds, and answers under it
    let served = e.send(ServedVersions).await.unwrap();
    assert_eq!(served.get(&policy()), Some(&Version(2)));
    let c = within("a request", e.send(ask(2, None)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((c.tokens, c.versions), (walk(2, 2, 3), vec![Version(2); 3]));
}
