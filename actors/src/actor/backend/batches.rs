//! The requests a backend engine holds for its next batch, the batch, and the answers: plain
//! code, no actor.

use std::collections::{BTreeMap, VecDeque};

use refit_runtime::{ModelId, Version};
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::generation::{
    Completion, Finish, LOGPROB_ROUNDING, check_logprobs, check_per_token, clamp_logprobs,
};
use crate::protocol::engine::{Generate, Score};

use super::EngineBackend;

/// A request for a batch.
#[derive(Debug)]
pub(super) enum Request {
    /// Completions.
    Generate(Generate),
    /// Scores.
    Score(Score),
}

impl Request {
    fn model(&self) -> &ModelId {
        match self {
            Self::Generate(g) => &g.model,
            Self::Score(s) => &s.model,
        }
    }

    fn epoch(&self) -> Option<u64> {
        match self {
            Self::Generate(g) => g.epoch,
            Self::Score(s) => s.epoch,
        }
    }
}

type Reply = oneshot::Sender<Result<Completion>>;

/// A request of an episode cancelled since (its epoch is not the engine's).
fn stale(asked: Option<u64>, epoch: u64) -> bool {
    asked.is_some_and(|e| e != epoch)
}

/// Requests waiting for a batch, in their order of arrival.
#[derive(Debug, Default)]
pub(super) struct Pending {
    waiting: VecDeque<(Request, Reply)>,
}

impl Pending {
    pub(super) fn push(&mut self, req: Request, reply: Reply) {
        self.waiting.push_back((req, reply));
    }

    /// Answers every waiting request of another epoch than `epoch` as cancelled: how many.
    pub(super) fn cancel_other_than(&mut self, epoch: u64) -> u64 {
        let mut cancelled = 0;
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for (req, reply) in self.waiting.drain(..) {
            if stale(req.epoch(), epoch) {
                let _ = reply.send(Err(Error::Cancelled { epoch }));
                cancelled += 1;
            } else {
                kept.push_back((req, reply));
            }
        }
        self.waiting = kept;
        cancelled
    }

    /// Takes the requests whose model serves a version (a model with none yet keeps its
    /// requests until its first version is served).
    pub(super) fn take_ready(&mut self, served: &BTreeMap<ModelId, Version>) -> Batch {
        let mut batch = Batch::default();
        let mut kept = VecDeque::new();
        for (req, reply) in self.waiting.drain(..) {
            if served.get(req.model()).copied().unwrap_or(Version::ZERO) == Version::ZERO {
                kept.push_back((req, reply));
                continue;
            }
            match req {
                Request::Generate(g) => batch.generate.push((g, reply)),
                Request::Score(s) => batch.score.push((s, reply)),
            }
        }
        self.waiting = kept;
        batch
    }
}

/// One batch: the completions and the scores asked, each with where its answer goes.
#[derive(Debug, Default)]
pub(super) struct Batch {
    generate: Vec<(Generate, Reply)>,
    score: Vec<(Score, Reply)>,
}

impl Batch {
    pub(super) fn is_empty(&self) -> bool {
        self.generate.is_empty() && self.score.is_empty()
    }

    /// Runs the batch on `backend` (blocking): one call for the completions, one for the
    /// scores, each answer checked and given its versions (the version `served` at the
    /// batch's start for each token the backend left unlabelled; unless `in_flight`: a
    /// version may be committed during the batch, and the backend must label every token
    /// it generates or scores). Requests of another epoch than `epoch` (cancelled while
    /// they waited for their turn) are not run: they are answered cancelled.
    pub(super) fn run<B: EngineBackend>(
        mut self,
        backend: &B,
        served: &BTreeMap<ModelId, Version>,
        epoch: u64,
        in_flight: bool,
    ) -> Answered {
        let mut out = Answered::default();
        for (g, reply) in self.generate.extract_if(.., |(g, _)| stale(g.epoch, epoch)) {
            out.answers
                .push((reply, g.epoch, Err(Error::Cancelled { epoch })));
        }
        for (s, reply) in self.score.extract_if(.., |(s, _)| stale(s.epoch, epoch)) {
            out.answers
                .push((reply, s.epoch, Err(Error::Cancelled { epoch })));
        }
        // in flight, a version may land between the batch's start and any answer: the
        // backend labels what it generated and what it scored
        let (name, labels) = (backend.name(), (!in_flight).then_some(served));
        if !self.generate.is_empty() {
            let (reqs, replies): (Vec<Generate>, Vec<Reply>) = self.generate.into_iter().unzip();
            let answers = backend.generate(&reqs, served);
            let models = reqs.iter().map(|r| (&r.model, r.epoch));
            out.take(&name, models, replies, answers, labels);
        }
        if !self.score.is_empty() {
            let (reqs, replies): (Vec<Score>, Vec<Reply>) = self.score.into_iter().unzip();
            let answers = backend.score(&reqs, served);
            let models = reqs.iter().map(|r| (&r.model, r.epoch));
            out.take(&name, models, replies, answers, labels);
        }
        out
    }
}

/// A batch's answers, each with where it goes and its request's epoch.
#[derive(Debug, Default)]
pub(super) struct Answered {
    answers: Vec<(Reply, Option<u64>, Result<Completion>)>,
}

impl Answered {
    fn take<'a>(
        &mut self,
        backend: &str,
        requests: impl ExactSizeIterator<Item = (&'a ModelId, Option<u64>)>,
        replies: Vec<Reply>,
        answers: Vec<Result<Completion>>,
        served: Option<&BTreeMap<ModelId, Version>>,
    ) {
        let (asked, answered) = (requests.len(), answers.len());
        let mut answers = answers.into_iter();
        for ((model, epoch), reply) in requests.zip(replies) {
            let version = served.map(|s| s.get(model).copied().unwrap_or(Version::ZERO));
            let answer = match answers.next() {
                // a backend that answers more than it was asked cannot be held to any
                Some(a) if answered <= asked => {
                    a.and_then(|c| fill_versions(c, version, backend, model))
                }
                _ => Err(Error::Generator {
                    model: model.to_string(),
                    reason: format!(
                        "the {backend} backend answered {answered} of {asked} requests"
                    ),
                }),
            };
            self.answers.push((reply, epoch, answer));
        }
    }

    /// Sends every answer (a request of another epoch than `epoch` is answered as
    /// cancelled): what the answers counted.
    pub(super) fn answer(self, epoch: u64) -> Counts {
        let mut counts = Counts::default();
        for (reply, asked, answer) in self.answers {
            let answer = if stale(asked, epoch) {
                counts.cancelled += 1;
                Err(Error::Cancelled { epoch })
            } else {
                answer
            };
            if let Ok(c) = &answer {
                counts.tokens += c.tokens.len() as u64;
                counts.aborted += u64::from(matches!(c.finish, Finish::Aborted { .. }));
            }
            let _ = reply.send(answer);
        }
        counts
    }
}

/// What a batch's answers counted, for the engine's statistics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Counts {
    /// Tokens generated or scored.
    pub(super) tokens: u64,
    /// Requests answered cancelled.
    pub(super) cancelled: u64,
    /// Completions an update ended (`abort`).
    pub(super) aborted: u64,
}

/// Checks a backend's completion and gives each token its version: a completion with no
/// versions gets `served` for every token.
///
/// # Errors
/// [`Error::Generator`] naming the model, the backend and the field when `logprobs` or
/// `versions` is not one per token (no versions at all where `served` is `None`: a commit
/// may have landed inside the batch, so only the backend knows), or a log-probability is
/// not finite or above [`LOGPROB_ROUNDING`](crate::generation::LOGPROB_ROUNDING) (a
/// learner would learn from it as a behaviour probability); one in between is rounding,
/// taken as 0.
pub(super) fn fill_versions(
    mut c: Completion,
    served: Option<Version>,
    backend: &str,
    model: &ModelId,
) -> Result<Completion> {
    let refused = |what: String| Error::Generator {
        model: model.to_string(),
        reason: format!("the {backend} backend answered {what}"),
    };
    if c.versions.is_empty() {
        let Some(served) = served else {
            return Err(refused(
                "no versions: it commits versions during a batch (keep mode), so it must \
                 label each token with the version that made it"
                    .into(),
            ));
        };
        c.versions = vec![served; c.tokens.len()];
    }
    check_per_token(
        c.tokens.len(),
        &[
            ("logprobs", Some(c.logprobs.len())),
            ("versions", Some(c.versions.len())),
        ],
    )
    .and_then(|()| check_logprobs(&c.logprobs, LOGPROB_ROUNDING))
    .map_err(refused)?;
    clamp_logprobs(&mut c.logprobs);
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::{Finish, SamplingParams};

    fn model() -> ModelId {
        ModelId::new("policy").unwrap()
    }

    fn gen_req(epoch: Option<u64>) -> Request {
        Request::Generate(Generate {
            model: model(),
            prompt: vec![1, 2],
            params: SamplingParams::greedy(4),
            epoch,
        })
    }

    fn completion(n: usize) -> Completion {
        Completion {
            tokens: vec![3; n],
            logprobs: vec![-0.5; n],
            versions: Vec::new(),
            finish: Finish::Length,
        }
    }

    #[test]
    fn requests_wait_for_their_models_first_version_and_cancels_answer_the_old() {
        let mut p = Pending::default();
        let (tx0, mut rx0) = oneshot::channel();
        let (tx1, _rx1) = oneshot::channel();
        p.push(gen_req(Some(0)), tx0);
        p.push(gen_req(None), tx1);
        let none = BTreeMap::from([(model(), Version::ZERO)]);
        assert!(p.take_ready(&none).is_empty(), "no version served yet");
        assert_eq!(p.cancel_other_than(1), 1);
        assert!(matches!(
            rx0.try_recv(),
            Ok(Err(Error::Cancelled { epoch: 1 }))
        ));
        let one = BTreeMap::from([(model(), Version(1))]);
        let b = p.take_ready(&one);
        assert_eq!((b.generate.len(), b.score.len()), (1, 0));
        assert!(p.waiting.is_empty());
    }

    #[test]
    fn completions_get_their_versions_and_bad_ones_are_refused_naming_the_field() {
        let m = model();
        let fill = |c, v| fill_versions(c, Some(v), "test", &m);
        let c = fill(completion(3), Version(4)).unwrap();
        assert_eq!(c.versions, vec![Version(4); 3]);
        // a backend's own versions are kept (a keep-mode update inside a sequence)
        let mut two = completion(2);
        two.versions = vec![Version(1), Version(2)];
        let c = fill(two, Version(2)).unwrap();
        assert_eq!(c.versions, vec![Version(1), Version(2)]);
        let mut bad = completion(2);
        bad.logprobs.clear();
        let e = fill(bad, Version(1)).unwrap_err().to_string();
        assert!(
            e.contains("logprobs") && e.contains("`policy`") && e.contains("test"),
            "{e}"
        );
        let mut bad = completion(2);
        bad.versions = vec![Version(1)];
        let e = fill(bad, Version(1)).unwrap_err().to_string();
        assert!(e.contains("versions"), "{e}");
        // a backend that commits during its batches labels its tokens itself
        let e = fill_versions(completion(2), None, "test", &m).unwrap_err();
        assert!(e.to_string().contains("no versions"), "{e}");
        let mut labelled = completion(2);
        labelled.versions = vec![Version(3), Version(4)];
        assert!(fill_versions(labelled, None, "test", &m).is_ok());
        // rounding above 0 is taken as 0, what every learner takes
        let mut round = completion(2);
        round.logprobs[0] = 5e-5;
        assert_eq!(fill(round, Version(1)).unwrap().logprobs[0], 0.0);
        for p in [f32::NAN, 0.5] {
            let mut bad = completion(2);
            bad.logprobs[1] = p;
            let e = fill(bad, Version(1)).unwrap_err().to_string();
            assert!(e.contains("logprobs[1]"), "{e}");
        }
    }

    #[test]
    fn a_backend_answering_too_few_fails_the_rest_and_old_epochs_are_cancelled() {
        let mut a = Answered::default();
        let (tx0, mut rx0) = oneshot::channel();
        let (tx1, mut rx1) = oneshot::channel();
        let (tx2, mut rx2) = oneshot::channel();
        let m = model();
        let served = BTreeMap::from([(m.clone(), Version(2))]);
        let reqs = [(&m, None), (&m, Some(0)), (&m, None)];
        // the first one an update ended (`abort`): counted, answered with its tokens
        let mut aborted = completion(2);
        aborted.finish = Finish::Aborted { by: Version(3) };
        a.take(
            "test",
            reqs.into_iter(),
            vec![tx0, tx1, tx2],
            vec![Ok(aborted), Ok(completion(1))],
            Some(&served),
        );
        let counts = Counts {
            tokens: 2,
            cancelled: 1,
            aborted: 1,
        };
        assert_eq!(a.answer(1), counts);
        // (a request of epoch 0 when the engine is at 1 is answered cancelled)
        assert_eq!(
            rx0.try_recv().unwrap().unwrap().versions,
            vec![Version(2); 2]
        );
        assert!(matches!(rx1.try_recv(), Ok(Err(Error::Cancelled { .. }))));
        let e = rx2.try_recv().unwrap().unwrap_err().to_string();
        assert!(e.contains("answered 2 of 3"), "{e}");
    }
}
