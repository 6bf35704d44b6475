//! The scheduler with a bigram model whose versions count up (v1) or down (v2), so every
//! greedy token shows which version produced it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::thread::ThreadId;
use std::time::Duration;

use refit_runtime::{Manifest, ModelId, Version, WeightSet};

use super::*;
use crate::bigram::{Bigram, BigramCache, BigramWeights};
use crate::generation::{Finish, StepInput};

const VOCAB: usize = 10;

fn model() -> ModelId {
    ModelId::new("policy").unwrap()
}

/// Version `v` of a table whose greedy walk goes `prev -> prev + v` (mod the vocabulary).
fn table(g: &Bigram, v: u64) -> WeightSet {
    g.weight_set(model(), Version(v), move |p, n| {
        if n as usize == (p as usize + v as usize) % VOCAB {
            3.0
        } else {
            0.0
        }
    })
    .unwrap()
}

fn staged(g: &Bigram, v: u64) -> Arc<BigramWeights> {
    Arc::new(g.stage(&table(g, v)).unwrap())
}

/// The greedy continuation of `last` under version `v`.
fn walk(last: Token, v: u64, n: usize) -> Vec<Token> {
    let mut t = last as usize;
    (0..n)
        .map(|_| {
            t = (t + v as usize) % VOCAB;
            t as Token
        })
        .collect()
}

fn scheduler(mode: PauseMode, max_batch: usize) -> Scheduler<Bigram> {
    let g = Bigram::new(VOCAB, 32).unwrap();
    let w = staged(&g, 1);
    Scheduler::new(g, SchedulerConfig::new(model(), max_batch, mode))
        .unwrap()
        .with_weights(w, Version(1))
}

type Answers = BTreeMap<RequestId, Result<Completion>>;

/// Steps until nothing is left; answers every request that ended, and the swaps made.
fn run(s: &mut Scheduler<impl Generator>, answers: &mut Answers) -> Vec<Swap> {
    let mut swaps = Vec::new();
    for _ in 0..1000 {
        if !s.has_work() {
            return swaps;
        }
        let r = s.step();
        swaps.extend(r.swap);
        answers.extend(r.finished);
    }
    panic!("the scheduler never ran out of work");
}

fn done(answers: &Answers, id: RequestId) -> &Completion {
    answers[&id].as_ref().unwrap()
}

#[test]
fn a_late_short_request_finishes_before_an_early_long_one() {
    let mut s = scheduler(PauseMode::Keep, 8);
    let long = s.submit(vec![0], SamplingParams::greedy(12), None).unwrap();
    let mut order = Vec::new();
    for _ in 0..3 {
        order.extend(s.step().finished.into_iter().map(|(id, _)| id));
    }
    let short = s.submit(vec![5], SamplingParams::greedy(2), None).unwrap();
    let mut answers = Answers::new();
    while s.has_work() {
        let r = s.step();
        // both sequences share every step until the short one leaves
        assert!(r.tokens <= 2);
        for (id, c) in r.finished {
            order.push(id);
            answers.insert(id, c);
        }
    }
    assert_eq!(order, vec![short, long]);
    assert_eq!(done(&answers, short).tokens, walk(5, 1, 2));
    assert_eq!(done(&answers, short).finish, Finish::Length);
    // batching changed nothing in the long one's tokens
    assert_eq!(done(&answers, long).tokens, walk(0, 1, 12));
    assert_eq!(done(&answers, long).versions, vec![Version(1); 12]);
    assert_eq!(s.stats().tokens, 14);
    // 12 steps: the short one rode along in two of them
    assert_eq!(s.stats().steps, 12);
}

#[test]
fn bad_requests_are_refused_naming_the_field_and_others_go_on() {
    let mut s = scheduler(PauseMode::Keep, 8);
    let ok = s.submit(vec![1], SamplingParams::greedy(6), None).unwrap();
    s.step();
    let bad: Vec<(Vec<Token>, SamplingParams, &str)> = vec![
        (vec![], SamplingParams::greedy(2), "prompt"),
        (vec![1, VOCAB as Token], SamplingParams::greedy(2), "prompt"),
        (vec![0; 32], SamplingParams::greedy(1), "prompt"),
        (vec![0; 30], SamplingParams::greedy(3), "max_tokens"),
        (vec![1], SamplingParams::greedy(0), "max_tokens"),
        (
            vec![1],
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::new(2, 0)
            },
            "temperature",
        ),
        (
            vec![1],
            SamplingParams {
                stop: Some(VOCAB as Token),
                ..SamplingParams::greedy(2)
            },
            "stop",
        ),
    ];
    for (prompt, params, field) in bad {
        match s.submit(prompt.clone(), params, None) {
            Err(Error::BadRequest { field: f, reason }) => {
                assert_eq!(f, field, "{prompt:?} {params:?}: {reason}");
            }
            other => panic!("{prompt:?} {params:?} answered {other:?}"),
        }
    }
    assert_eq!((s.running(), s.waiting()), (1, 0));
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    assert_eq!(done(&answers, ok).tokens, walk(1, 1, 6));
    // a request that fits the context exactly is served
    let full = s
        .submit(vec![0; 30], SamplingParams::greedy(2), None)
        .unwrap();
    run(&mut s, &mut answers);
    assert_eq!(done(&answers, full).tokens, walk(0, 1, 2));
}

#[test]
fn keep_mode_swaps_at_the_next_boundary_and_the_sequence_shows_it() {
    let mut s = scheduler(PauseMode::Keep, 8);
    let id = s.submit(vec![0], SamplingParams::greedy(8), None).unwrap();
    for _ in 0..3 {
        assert!(s.step().finished.is_empty());
    }
    let w2 = staged(s.generator(), 2);
    assert_eq!(s.offer(w2, Version(2)).unwrap(), None);
    let mut answers = Answers::new();
    let swaps = run(&mut s, &mut answers);
    assert_eq!(swaps.len(), 1);
    assert_eq!((swaps[0].from, swaps[0].to), (Some(Version(1)), Version(2)));
    assert_eq!(swaps[0].aborted, 0);
    let c = done(&answers, id);
    assert_eq!(c.finish, Finish::Length);
    let mut versions = vec![Version(1); 3];
    versions.extend([Version(2); 5]);
    assert_eq!(c.versions, versions);
    // three tokens counting up by one, then five counting up by two from there
    let mut expected = walk(0, 1, 3);
    expected.extend(walk(3, 2, 5));
    assert_eq!(c.tokens, expected);
    assert_eq!(s.served_version(), Some(Version(2)));
}

#[test]
fn abort_mode_ends_running_sequences_with_their_tokens_so_far() {
    let mut s = scheduler(PauseMode::Abort, 8);
    let running = s.submit(vec![0], SamplingParams::greedy(8), None).unwrap();
    for _ in 0..3 {
        s.step();
    }
    let queued = s.submit(vec![4], SamplingParams::greedy(3), None).unwrap();
    let w2 = staged(s.generator(), 2);
    s.offer(w2, Version(2)).unwrap();
    let r = s.step();
    let swap = r.swap.clone().unwrap();
    assert_eq!((swap.to, swap.aborted), (Version(2), 1));
    let mut answers: Answers = r.finished.into_iter().collect();
    let c = done(&answers, running).clone();
    assert_eq!(c.finish, Finish::Aborted { by: Version(2) });
    assert_eq!(c.tokens, walk(0, 1, 3));
    assert_eq!(c.versions, vec![Version(1); 3]);
    // the waiting request joined after the swap, under version 2 only
    run(&mut s, &mut answers);
    let q = done(&answers, queued);
    assert_eq!(q.tokens, walk(4, 2, 3));
    assert_eq!(q.versions, vec![Version(2); 3]);
    assert_eq!(s.stats().aborted, 1);
}

#[test]
fn wait_mode_drains_under_the_old_version_then_swaps() {
    let mut s = scheduler(PauseMode::Wait, 8);
    let a = s.submit(vec![0], SamplingParams::greedy(6), None).unwrap();
    let b = s.submit(vec![2], SamplingParams::greedy(3), None).unwrap();
    s.step();
    let w2 = staged(s.generator(), 2);
    s.offer(w2, Version(2)).unwrap();
    // a request that arrives during the drain waits for the new version
    let late = s.submit(vec![7], SamplingParams::greedy(2), None).unwrap();
    let mut answers = Answers::new();
    let mut swapped_at = None;
    for step in 0..100 {
        if !s.has_work() {
            break;
        }
        let r = s.step();
        if s.served_version() == Some(Version(1)) {
            assert_eq!(s.waiting(), 1, "nothing joins during the drain");
            assert!(s.running() <= 2);
        }
        if let Some(sw) = r.swap {
            assert_eq!(sw.mode, PauseMode::Wait);
            swapped_at = Some(step);
            // the swap came in the step where the last old sequence left
            assert!(r.finished.iter().any(|(id, _)| *id == a));
        }
        answers.extend(r.finished);
    }
    assert!(swapped_at.is_some());
    assert_eq!(done(&answers, a).tokens, walk(0, 1, 6));
    assert_eq!(done(&answers, a).versions, vec![Version(1); 6]);
    assert_eq!(done(&answers, a).finish, Finish::Length);
    assert_eq!(done(&answers, b).versions, vec![Version(1); 3]);
    assert_eq!(done(&answers, late).tokens, walk(7, 2, 2));
    assert_eq!(done(&answers, late).versions, vec![Version(2); 2]);
    assert_eq!(s.stats().swaps, 1);
}

#[test]
fn a_version_not_newer_is_refused_and_the_old_one_stays() {
    let mut s = scheduler(PauseMode::Keep, 8);
    let w1 = staged(s.generator(), 1);
    let e = s.offer(w1, Version(1)).unwrap_err();
    assert!(
        e.to_string().contains("version 1 refused") && e.to_string().contains("`policy`"),
        "{e}"
    );
    let w3 = staged(s.generator(), 3);
    s.offer(w3, Version(3)).unwrap();
    // a version older than the pending one is refused too
    let w2 = staged(s.generator(), 2);
    assert!(s.offer(w2, Version(2)).is_err());
    assert_eq!(s.pending_version(), Some(Version(3)));
    // a newer one supersedes the pending one, which is never served
    let w4 = staged(s.generator(), 4);
    assert_eq!(s.offer(w4, Version(4)).unwrap(), Some(Version(3)));
    let id = s.submit(vec![0], SamplingParams::greedy(2), None).unwrap();
    let mut answers = Answers::new();
    let swaps = run(&mut s, &mut answers);
    assert_eq!(swaps.len(), 1);
    assert_eq!(done(&answers, id).versions, vec![Version(4); 2]);
    // a withdrawn version is not served either
    let w5 = staged(s.generator(), 5);
    s.offer(w5, Version(5)).unwrap();
    assert!(!s.withdraw(Version(6)));
    assert!(s.withdraw(Version(5)));
    assert!(!s.has_work());
    assert_eq!(s.served_version(), Some(Version(4)));
}

#[test]
fn cancel_ends_cancellable_requests_only() {
    let mut s = scheduler(PauseMode::Keep, 2);
    let old = s
        .submit(vec![0], SamplingParams::greedy(9), Some(0))
        .unwrap();
    let free = s.submit(vec![1], SamplingParams::greedy(9), None).unwrap();
    let queued = s
        .submit(vec![2], SamplingParams::greedy(9), Some(0))
        .unwrap();
    let current = s
        .submit(vec![3], SamplingParams::greedy(2), Some(1))
        .unwrap();
    s.step();
    s.step();
    let cancelled: BTreeMap<_, _> = s.cancel(1).into_iter().collect();
    assert_eq!(cancelled.len(), 2);
    assert_eq!(cancelled[&old].finish, Finish::Cancelled);
    assert_eq!(cancelled[&old].tokens, walk(0, 1, 2));
    assert_eq!(cancelled[&queued].finish, Finish::Cancelled);
    assert!(cancelled[&queued].tokens.is_empty());
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    assert_eq!(done(&answers, free).tokens, walk(1, 1, 9));
    assert_eq!(done(&answers, current).tokens, walk(3, 1, 2));
    assert_eq!(s.stats().cancelled, 2);
}

#[test]
fn abort_ends_every_request_with_its_tokens_so_far() {
    let mut s = scheduler(PauseMode::Keep, 1);
    let running = s.submit(vec![0], SamplingParams::greedy(9), None).unwrap();
    let queued = s
        .submit(vec![2], SamplingParams::greedy(9), Some(0))
        .unwrap();
    s.step();
    s.step();
    let aborted: BTreeMap<_, _> = s.abort(Version(5)).into_iter().collect();
    let by = Finish::Aborted { by: Version(5) };
    assert_eq!(aborted.len(), 2);
    assert_eq!(aborted[&running].finish, by);
    assert_eq!(aborted[&running].tokens, walk(0, 1, 2));
    assert_eq!(aborted[&queued].finish, by);
    assert!(aborted[&queued].tokens.is_empty());
    assert!(!s.has_work());
    assert_eq!((s.stats().aborted, s.stats().cancelled), (2, 0));
}

#[test]
fn the_batch_size_holds_and_requests_join_as_others_leave() {
    let mut s = scheduler(PauseMode::Keep, 2);
    let lens = [2, 5, 4];
    let ids: Vec<_> = (0..3)
        .map(|i| {
            s.submit(vec![i as Token], SamplingParams::greedy(lens[i]), None)
                .unwrap()
        })
        .collect();
    let r = s.step();
    assert_eq!((r.tokens, s.running(), s.waiting()), (2, 2, 1));
    let mut answers = Answers::new();
    answers.extend(r.finished);
    answers.extend(s.step().finished);
    // the first one left after two tokens; the third joins at the next step
    assert!(answers.contains_key(&ids[0]));
    assert_eq!(s.waiting(), 1);
    let r = s.step();
    assert_eq!((s.running(), s.waiting()), (2, 0));
    answers.extend(r.finished);
    run(&mut s, &mut answers);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            done(&answers, *id).tokens,
            walk(i as Token, 1, lens[i] as usize)
        );
    }
}

#[test]
fn the_stop_token_ends_a_sequence_and_is_kept() {
    let mut s = scheduler(PauseMode::Keep, 2);
    let params = SamplingParams {
        stop: Some(4),
        ..SamplingParams::greedy(9)
    };
    let id = s.submit(vec![1], params, None).unwrap();
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    assert_eq!(done(&answers, id).tokens, vec![2, 3, 4]);
    assert_eq!(done(&answers, id).finish, Finish::Stop);
}

#[test]
fn sampled_requests_are_reproducible_from_their_seed_and_logprobs_match() {
    let run_one = |seed: u64, others: usize| {
        let g = Bigram::new(VOCAB, 64).unwrap();
        // a flat-ish table: sampling has real choices
        let ws = g
            .weight_set(model(), Version(1), |p, n| {
                ((p * 7 + n * 3) % 5) as f32 * 0.3
            })
            .unwrap();
        let w = Arc::new(g.stage(&ws).unwrap());
        let table = w.table().to_vec();
        let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 8, PauseMode::Keep))
            .unwrap()
            .with_weights(w, Version(1));
        // other requests in the batch do not change this one's draws
        for i in 0..others {
            s.submit(vec![i as Token], SamplingParams::new(20, i as u64), None)
                .unwrap();
        }
        let params = SamplingParams {
            temperature: 0.7,
            ..SamplingParams::new(20, seed)
        };
        let id = s.submit(vec![3], params, None).unwrap();
        let mut answers = Answers::new();
        run(&mut s, &mut answers);
        (done(&answers, id).clone(), table)
    };
    let (a, table) = run_one(11, 0);
    let (b, _) = run_one(11, 3);
    let (c, _) = run_one(12, 0);
    assert_eq!(a, b);
    assert_ne!(a.tokens, c.tokens);
    // each logprob is the token's under softmax(row / 0.7) of the previous token's row
    let mut prev = 3usize;
    for (t, lp) in a.tokens.iter().zip(&a.logprobs) {
        let row = &table[prev * VOCAB..(prev + 1) * VOCAB];
        let z: f64 = row.iter().map(|l| (f64::from(*l) / 0.7).exp()).sum();
        let expected = f64::from(row[*t as usize]) / 0.7 - z.ln();
        assert!(
            (f64::from(*lp) - expected).abs() < 1e-5,
            "{lp} vs {expected}"
        );
        prev = *t as usize;
    }
}

#[test]
fn requests_queue_until_the_first_version_arrives() {
    let g = Bigram::new(VOCAB, 32).unwrap();
    let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 4, PauseMode::Wait)).unwrap();
    let id = s.submit(vec![0], SamplingParams::greedy(2), None).unwrap();
    assert!(!s.has_work());
    assert_eq!(s.served_version(), None);
    let w = staged(s.generator(), 3);
    s.offer(w, Version(3)).unwrap();
    let mut answers = Answers::new();
    let swaps = run(&mut s, &mut answers);
    assert_eq!(swaps[0].from, None);
    assert_eq!(done(&answers, id).tokens, walk(0, 3, 2));
}

// ---- a backend that fails, and one whose weights tell where they are dropped ----

/// A bigram model whose forward fails while `fail` holds, and whose staged weights and
/// caches report the thread they are dropped on.
struct Probe {
    inner: Bigram,
    fail: bool,
    dropped: mpsc::Sender<(Version, ThreadId)>,
    caches: Option<mpsc::Sender<ThreadId>>,
}

impl Probe {
    fn new(inner: Bigram, fail: bool, dropped: mpsc::Sender<(Version, ThreadId)>) -> Self {
        Self {
            inner,
            fail,
            dropped,
            caches: None,
        }
    }
}

struct ProbeCache {
    inner: BigramCache,
    dropped: Option<mpsc::Sender<ThreadId>>,
}

impl Drop for ProbeCache {
    fn drop(&mut self) {
        if let Some(tx) = &self.dropped {
            let _ = tx.send(std::thread::current().id());
        }
    }
}

struct ProbeWeights {
    inner: BigramWeights,
    version: Version,
    dropped: mpsc::Sender<(Version, ThreadId)>,
}

impl Drop for ProbeWeights {
    fn drop(&mut self) {
        let _ = self
            .dropped
            .send((self.version, std::thread::current().id()));
    }
}

impl Generator for Probe {
    type Weights = ProbeWeights;
    type Cache = ProbeCache;
    fn manifest(&self) -> Arc<Manifest> {
        self.inner.manifest()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn stage(&self, weights: &WeightSet) -> Result<ProbeWeights> {
        Ok(ProbeWeights {
            inner: self.inner.stage(weights)?,
            version: weights.version(),
            dropped: self.dropped.clone(),
        })
    }
    fn new_cache(&self) -> ProbeCache {
        ProbeCache {
            inner: BigramCache::default(),
            dropped: self.caches.clone(),
        }
    }
    fn forward(
        &mut self,
        weights: &ProbeWeights,
        inputs: &mut [StepInput<'_, ProbeCache>],
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if self.fail {
            return Err(Error::Config("injected backend failure".into()));
        }
        let mut inner: Vec<_> = inputs
            .iter_mut()
            .map(|i| StepInput {
                cache: &mut i.cache.inner,
                tokens: i.tokens,
            })
            .collect();
        self.inner.forward(&weights.inner, &mut inner, logits)
    }
}

#[test]
fn a_failed_step_ends_its_sequences_with_the_error_and_later_ones_are_served() {
    let (tx, _rx) = mpsc::channel();
    let inner = Bigram::new(VOCAB, 32).unwrap();
    let w = table(&inner, 1);
    let g = Probe::new(inner, true, tx);
    let w = Arc::new(g.stage(&w).unwrap());
    let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 4, PauseMode::Keep))
        .unwrap()
        .with_weights(w, Version(1));
    let a = s.submit(vec![0], SamplingParams::greedy(3), None).unwrap();
    let b = s.submit(vec![1], SamplingParams::greedy(3), None).unwrap();
    let r = s.step();
    assert_eq!(r.finished.len(), 2);
    for (id, res) in r.finished {
        assert!(id == a || id == b);
        let e = res.unwrap_err().to_string();
        assert!(
            e.contains("injected backend failure") && e.contains("`policy`"),
            "{e}"
        );
    }
    s.generator.fail = false;
    let c = s.submit(vec![2], SamplingParams::greedy(3), None).unwrap();
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    assert_eq!(done(&answers, c).tokens, walk(2, 1, 3));
}

#[test]
fn a_swapped_out_version_is_dropped_off_the_decoding_thread() {
    let (tx, rx) = mpsc::channel();
    let inner = Bigram::new(VOCAB, 32).unwrap();
    let (w1, w2) = (table(&inner, 1), table(&inner, 2));
    let g = Probe::new(inner, false, tx);
    let (w1, w2) = (
        Arc::new(g.stage(&w1).unwrap()),
        Arc::new(g.stage(&w2).unwrap()),
    );
    let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 4, PauseMode::Keep))
        .unwrap()
        .with_weights(w1, Version(1));
    let id = s.submit(vec![0], SamplingParams::greedy(4), None).unwrap();
    s.step();
    s.offer(w2, Version(2)).unwrap();
    let r = s.step();
    assert_eq!(r.swap.map(|sw| sw.to), Some(Version(2)));
    let (version, thread) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(version, Version(1));
    assert_ne!(thread, std::thread::current().id());
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    assert_eq!(
        done(&answers, id).versions,
        [1, 2, 2, 2].map(Version).to_vec()
    );
}

#[test]
fn a_scored_completion_gets_the_logprobs_it_was_sampled_with_beside_other_requests() {
    let g = Bigram::new(VOCAB, 64).unwrap();
    let ws = g
        .weight_set(model(), Version(1), |p, n| {
            ((p * 7 + n * 3) % 5) as f32 * 0.3
        })
        .unwrap();
    let w = Arc::new(g.stage(&ws).unwrap());
    let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 8, PauseMode::Keep))
        .unwrap()
        .with_weights(w, Version(1));
    let params = SamplingParams {
        temperature: 0.7,
        ..SamplingParams::new(12, 5)
    };
    let sampled = s.submit(vec![2, 4], params, None).unwrap();
    let mut answers = Answers::new();
    run(&mut s, &mut answers);
    let c = done(&answers, sampled).clone();
    // scored beside a generating request, in a batch that differs from the sampling one
    let other = s.submit(vec![1], SamplingParams::new(20, 9), None).unwrap();
    let scored = s.score(vec![2, 4], c.tokens.clone(), 0.7, None).unwrap();
    run(&mut s, &mut answers);
    let got = done(&answers, scored);
    assert_eq!(got.tokens, c.tokens);
    assert_eq!(got.finish, Finish::Length);
    assert_eq!(got.versions, vec![Version(1); c.tokens.len()]);
    for (a, b) in got.logprobs.iter().zip(&c.logprobs) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
    assert_eq!(done(&answers, other).tokens.len(), 20);
}

#[test]
fn a_scoring_request_with_bad_tokens_is_refused_naming_them() {
    let mut s = scheduler(PauseMode::Keep, 4);
    let field = |e: Error| match e {
        Error::BadRequest { field, reason } => (field, reason),
        other => panic!("{other}"),
    };
    let (f, why) = field(s.score(vec![1], vec![], 1.0, None).unwrap_err());
    assert_eq!(f, "tokens");
    assert!(why.contains("empty"), "{why}");
    let (f, why) = field(s.score(vec![1], vec![2, 99], 1.0, None).unwrap_err());
    assert_eq!(f, "tokens");
    assert!(why.contains("99") && why.contains("position 1"), "{why}");
    let (f, why) = field(s.score(vec![1; 20], vec![1; 20], 1.0, None).unwrap_err());
    assert_eq!(f, "tokens");
    assert!(why.contains("do not fit"), "{why}");
    let (f, _) = field(s.score(vec![1], vec![2], -1.0, None).unwrap_err());
    assert_eq!(f, "temperature");
    assert!(!s.has_work(), "nothing was queued");
}

#[test]
fn a_scoring_request_under_keep_mode_shows_the_versions_that_scored_it() {
    let mut s = scheduler(PauseMode::Keep, 4);
    let g = Bigram::new(VOCAB, 32).unwrap();
    let tokens = walk(0, 1, 6);
    let id = s.score(vec![0], tokens.clone(), 0.0, None).unwrap();
    let mut answers = Answers::new();
    // prefill plus two tokens under v1, then v2 arrives
    s.step();
    s.step();
    s.offer(staged(&g, 2), Version(2)).unwrap();
    run(&mut s, &mut answers);
    let c = done(&answers, id);
    assert_eq!(c.tokens, tokens, "scored tokens are the given ones");
    assert_eq!(c.versions[..2], [Version(1); 2]);
    assert!(c.versions[2..].iter().all(|v| *v == Version(2)));
    // v1 gives its own walk the high logit; v2 does not
    assert!(c.logprobs[0] > c.logprobs[3], "{:?}", c.logprobs);
}

#[test]
fn abort_mode_frees_the_aborted_caches_off_the_decoding_thread() {
    let (tx, _rx) = mpsc::channel();
    let (ctx, crx) = mpsc::channel();
    let inner = Bigram::new(VOCAB, 32).unwrap();
    let (w1, w2) = (table(&inner, 1), table(&inner, 2));
    let mut g = Probe::new(inner, false, tx);
    g.caches = Some(ctx);
    let (w1, w2) = (
        Arc::new(g.stage(&w1).unwrap()),
        Arc::new(g.stage(&w2).unwrap()),
    );
    let mut s = Scheduler::new(g, SchedulerConfig::new(model(), 4, PauseMode::Abort))
        .unwrap()
        .with_weights(w1, Version(1));
    for p in [0, 1] {
        s.submit(vec![p], SamplingParams::greedy(8), None).unwrap();
    }
    s.step();
    s.offer(w2, Version(2)).unwrap();
    let r = s.step();
    assert_eq!(r.swap.map(|sw| (sw.to, sw.aborted)), Some((Version(2), 2)));
    for _ in 0..2 {
        let thread = crx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_ne!(thread, std::thread::current().id());
    }
}
