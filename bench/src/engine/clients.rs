//! Clients that keep requests decoding on an engine, and what the bench reads of the
//! engine while they do (its status, the time of a decoding step).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use actix_rt::task::JoinHandle;
use refit_rl::transformer::TransformerGenerator;
use refit_runtime::ModelId;

use super::WAIT;
use refit_actors::actor::{GenModelStatus, Generate, GenerationEngine, GetGenStatus};
use refit_actors::generation::{SamplingParams, Token};
use refit_actors::protocol::engine::{CancelInFlight, EngineStats, GetEngineStats};
use refit_actors::{Error, Result};

pub(super) type Engine = Addr<GenerationEngine<TransformerGenerator>>;

/// How often the bench reads the engine's status while it times steps or waits for it.
const POLL: Duration = Duration::from_millis(1);
/// The least number of steps one step-time window spans.
const WINDOW_STEPS: u64 = 2;
/// The least duration of one step-time window.
const WINDOW_TIME: Duration = Duration::from_millis(50);

/// `n` clients, each sending one cancellable request after another (prompts of 4 tokens,
/// `max_tokens / 2` to `max_tokens` sampled tokens) until [`Clients::stop`].
pub(super) struct Clients {
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<Result<u64>>>,
}

impl Clients {
    pub(super) fn start(
        engine: &Engine,
        model: &ModelId,
        n: usize,
        max_tokens: u32,
        vocab: usize,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|i| {
                let (engine, model, stop) = (engine.clone(), model.clone(), Arc::clone(&stop));
                actix_rt::spawn(client(engine, model, i as u64, max_tokens, vocab, stop))
            })
            .collect();
        Self { stop, tasks }
    }

    /// Stops the clients: requests in flight are cancelled at the engine's next step
    /// boundary; answers the requests they completed, or the first failure.
    pub(super) async fn stop(self, engine: &Engine) -> Result<u64> {
        self.stop.store(true, Ordering::Release);
        within(
            "cancelling the clients' requests",
            engine.send(CancelInFlight),
        )
        .await?;
        let mut done = 0;
        let mut first_err = None;
        for t in self.tasks {
            match actix_rt::time::timeout(WAIT, t).await {
                Ok(Ok(Ok(n))) => done += n,
                Ok(Ok(Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Ok(Err(e)) => {
                    first_err.get_or_insert(Error::Actor(format!("a bench client failed: {e}")));
                }
                Err(_) => {
                    first_err.get_or_insert(timed_out("a bench client to stop"));
                }
            }
        }
        first_err.map_or(Ok(done), Err)
    }
}

/// One client: a request after another until stopped or cancelled; a failed request ends
/// it with the failure.
async fn client(
    engine: Engine,
    model: ModelId,
    i: u64,
    max_tokens: u32,
    vocab: usize,
    stop: Arc<AtomicBool>,
) -> Result<u64> {
    let mut done = 0u64;
    while !stop.load(Ordering::Acquire) {
        let first = (i * 7 + done * 3) as usize;
        let prompt: Vec<Token> = (0..4).map(|k| ((first + k) % vocab) as Token).collect();
        // lengths from half of max_tokens to all of it, so that requests started together
        // do not end together
        let half = max_tokens / 2;
        let tokens = half + ((i + done * 5) % u64::from(max_tokens - half + 1)) as u32;
        let ask = Generate {
            model: model.clone(),
            prompt,
            params: SamplingParams::new(tokens, i * 1_000_003 + done),
            epoch: Some(0),
        };
        match within("a bench request", engine.send(ask)).await? {
            Ok(_) => done += 1,
            // the bench is stopping: CancelInFlight refuses this epoch from now on
            Err(Error::Cancelled { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// `what`'s answer within the bench's deadline.
pub(super) async fn within<T>(
    what: &str,
    f: impl Future<Output = std::result::Result<T, MailboxError>>,
) -> Result<T> {
    match actix_rt::time::timeout(WAIT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::Actor(format!("{what}: the engine is gone ({e})"))),
        Err(_) => Err(timed_out(what)),
    }
}

fn timed_out(what: &str) -> Error {
    Error::Runtime(refit_runtime::Error::Timeout {
        what: format!("engine pause bench: {what}"),
        after: WAIT,
    })
}

/// The engine's status of `model`.
pub(super) async fn status(engine: &Engine, model: &ModelId) -> Result<GenModelStatus> {
    within("the engine's status", engine.send(GetGenStatus))
        .await?
        .remove(model)
        .ok_or_else(|| Error::Runtime(refit_runtime::Error::UnknownModel(model.clone())))
}

/// The engine's statistics.
pub(super) async fn stats(engine: &Engine) -> Result<EngineStats> {
    within("the engine's statistics", engine.send(GetEngineStats)).await
}

/// Waits until `n` sequences of `model` are running; answers the status that showed them
/// (read again later, it may show them finished: short requests end between two reads on a
/// loaded machine).
pub(super) async fn wait_running(
    engine: &Engine,
    model: &ModelId,
    n: usize,
) -> Result<GenModelStatus> {
    let deadline = Instant::now() + WAIT;
    loop {
        let now = status(engine, model).await?;
        if now.running >= n {
            return Ok(now);
        }
        if Instant::now() > deadline {
            return Err(timed_out(&format!("{n} requests running")));
        }
        actix_rt::time::sleep(POLL).await;
    }
}

/// The mean time of one decoding step over a window of at least [`WINDOW_STEPS`] steps and
/// [`WINDOW_TIME`], from the step counter's change that opens it to the one that closes it
/// (read every [`POLL`]).
pub(super) async fn step_time(engine: &Engine, model: &ModelId) -> Result<Duration> {
    let deadline = Instant::now() + WAIT;
    let next_change = |after: u64| async move {
        loop {
            let steps = status(engine, model).await?.stats.steps;
            if steps != after {
                return Ok::<_, Error>((steps, Instant::now()));
            }
            if Instant::now() > deadline {
                return Err(timed_out("a decoding step"));
            }
            actix_rt::time::sleep(POLL).await;
        }
    };
    let now = status(engine, model).await?.stats.steps;
    let (s0, t0) = next_change(now).await?;
    let (mut s1, mut t1) = (s0, t0);
    while s1 < s0 + WINDOW_STEPS || t1 - t0 < WINDOW_TIME {
        (s1, t1) = next_change(s1).await?;
    }
    Ok((t1 - t0) / u32::try_from(s1 - s0).unwrap_or(u32::MAX))
}
