//! The decoding thread of one model: a [`Scheduler`] fed through a channel, so that a
//! decoding step never blocks an arbiter. Commands are taken between steps (that is where
//! requests join, versions swap and cancellations land); with nothing to do the thread
//! sleeps on the channel, and it ends when the engine drops its end.

use std::collections::HashMap;
use std::sync::mpsc::{self, TryRecvError};
use std::sync::{Arc, Mutex, PoisonError};

use refit_runtime::{ModelId, Version};
use tokio::sync::oneshot;

use crate::error::{Error, Result};
use crate::generation::{Completion, Generator, SamplingParams, Token};
use crate::scheduler::{RequestId, Scheduler, SchedulerStats, Swap};

use super::GenModelStatus;

/// What the engine asks of a decoding thread.
pub(super) enum Command<W> {
    /// A request; answered when it ends (or at once when refused).
    Submit {
        prompt: Vec<Token>,
        params: SamplingParams,
        epoch: Option<u64>,
        reply: oneshot::Sender<Result<Completion>>,
    },
    /// A scoring request; answered when it ends (or at once when refused).
    Score {
        prompt: Vec<Token>,
        tokens: Vec<Token>,
        temperature: f32,
        epoch: Option<u64>,
        reply: oneshot::Sender<Result<Completion>>,
    },
    /// A staged version; answered at its swap (or when refused or withdrawn).
    Offer {
        weights: Arc<W>,
        version: Version,
        reply: oneshot::Sender<Result<Swap>>,
    },
    /// Gives up on an offered version that has not been swapped in; its offer is answered
    /// with `why`.
    Withdraw { version: Version, why: Error },
    /// Ends the requests of cancellation epochs older than `below`.
    Cancel { below: u64 },
}

/// The engine's end of a decoding thread's channel.
pub(super) type Commands<W> = mpsc::Sender<Command<W>>;

/// What the engine reads of a decoding thread without asking it.
#[derive(Debug, Default)]
pub(super) struct View {
    /// The version served (`None` before the first weights).
    pub(super) served: Option<Version>,
    /// The newest version handed to the thread (set by the load once its offer is in the
    /// channel).
    pub(super) offered: Option<Version>,
    /// Sequences running after the last step.
    pub(super) running: usize,
    /// Requests waiting after the last step.
    pub(super) waiting: usize,
    /// The scheduler's statistics after the last step.
    pub(super) stats: SchedulerStats,
}

/// The shared [`View`].
#[derive(Debug, Default)]
pub(super) struct Shared(Mutex<View>);

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, View> {
        // the view is two plain values, consistent whatever a panicking writer did
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The version served.
    pub(super) fn served(&self) -> Option<Version> {
        self.lock().served
    }

    /// The scheduler's statistics.
    pub(super) fn stats(&self) -> SchedulerStats {
        self.lock().stats.clone()
    }

    /// Records that `version` was handed to the thread.
    pub(super) fn offered(&self, version: Version) {
        let mut v = self.lock();
        v.offered = v.offered.max(Some(version));
    }

    /// What a status query answers.
    pub(super) fn status(&self) -> GenModelStatus {
        let v = self.lock();
        GenModelStatus {
            served: v.served,
            offered: v.offered,
            running: v.running,
            waiting: v.waiting,
            stats: v.stats.clone(),
        }
    }
}

/// Starts the decoding thread of `model`.
///
/// # Errors
/// [`Error::Config`] naming the model when the thread cannot start.
pub(super) fn spawn<G: Generator>(
    model: &ModelId,
    scheduler: Scheduler<G>,
) -> Result<(Commands<G::Weights>, Arc<Shared>)> {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared(Mutex::new(View {
        served: scheduler.served_version(),
        offered: scheduler.served_version(),
        running: 0,
        waiting: 0,
        stats: scheduler.stats().clone(),
    })));
    let view = Arc::clone(&shared);
    std::thread::Builder::new()
        .name(format!("refit-decode-{model}"))
        .spawn(move || Decoder::new(scheduler, view).run(&rx))
        .map_err(|e| {
            Error::Config(format!(
                "cannot start the decoding thread of model `{model}`: {e}"
            ))
        })?;
    Ok((tx, shared))
}

struct Decoder<G: Generator> {
    scheduler: Scheduler<G>,
    shared: Arc<Shared>,
    replies: HashMap<RequestId, oneshot::Sender<Result<Completion>>>,
    offers: Vec<(Version, oneshot::Sender<Result<Swap>>)>,
}

impl<G: Generator> Decoder<G> {
    fn new(scheduler: Scheduler<G>, shared: Arc<Shared>) -> Self {
        Self {
            scheduler,
            shared,
            replies: HashMap::new(),
            offers: Vec::new(),
        }
    }

    fn run(mut self, rx: &mpsc::Receiver<Command<G::Weights>>) {
        loop {
            if !self.scheduler.has_work() {
                // idle: sleep until the engine asks something (or drops its end: the engine
                // is gone, and so is everyone waiting on an answer)
                match rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            if self.scheduler.has_work() {
                let report = self.scheduler.step();
                // whoever hears of this step sees its effects in the view
                self.publish();
                for (id, answer) in report.finished {
                    self.answer(id, answer);
                }
                if let Some(swap) = report.swap {
                    self.swapped(&swap);
                }
            } else {
                self.publish();
            }
        }
    }

    fn handle(&mut self, command: Command<G::Weights>) {
        match command {
            Command::Submit {
                prompt,
                params,
                epoch,
                reply,
            } => {
                let asked = self.scheduler.submit(prompt, params, epoch);
                self.asked(asked, reply);
            }
            Command::Score {
                prompt,
                tokens,
                temperature,
                epoch,
                reply,
            } => {
                let asked = self.scheduler.score(prompt, tokens, temperature, epoch);
                self.asked(asked, reply);
            }
            Command::Offer {
                weights,
                version,
                reply,
            } => match self.scheduler.offer(weights, version) {
                // a superseded offer is answered by the swap of the newer one
                Ok(_) => self.offers.push((version, reply)),
                Err(e) => drop(reply.send(Err(e.into()))),
            },
            Command::Withdraw { version, why } => {
                if self.scheduler.withdraw(version)
                    && let Some(i) = self.offers.iter().position(|(v, _)| *v == version)
                {
                    let (_, reply) = self.offers.swap_remove(i);
                    drop(reply.send(Err(why)));
                }
            }
            Command::Cancel { below } => {
                for (id, c) in self.scheduler.cancel(below) {
                    self.answer(id, Ok(c));
                }
            }
        }
    }

    /// Keeps the reply of a queued request; answers a refused one at once.
    fn asked(
        &mut self,
        asked: refit_rl::Result<RequestId>,
        reply: oneshot::Sender<Result<Completion>>,
    ) {
        match asked {
            Ok(id) => {
                self.replies.insert(id, reply);
            }
            Err(e) => drop(reply.send(Err(e.into()))),
        }
    }

    fn answer(&mut self, id: RequestId, answer: refit_rl::Result<Completion>) {
        if let Some(reply) = self.replies.remove(&id) {
            // the asker may have given up; nothing to do then
            drop(reply.send(answer.map_err(Error::from)));
        }
    }

    /// Answers every offer the swap satisfies (its version and the older ones it
    /// superseded).
    fn swapped(&mut self, swap: &Swap) {
        let (done, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.offers)
            .into_iter()
            .partition(|(v, _)| *v <= swap.to);
        self.offers = waiting;
        for (_, reply) in done {
            drop(reply.send(Ok(swap.clone())));
        }
    }

    fn publish(&self) {
        let mut v = self.shared.lock();
        v.served = self.scheduler.served_version();
        v.stats = self.scheduler.stats().clone();
        v.running = self.scheduler.running();
        v.waiting = self.scheduler.waiting();
    }
}
