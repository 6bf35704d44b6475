//! The pause of a generating engine per update, on the path a run takes, for
//! `refit bench --engine-pause` (not a stable API).
//!
//! For each size a GPT-style model ([`TransformerConfig::of_bytes`]) is initialised in the
//! trainer's layout (f32, separate q/k/v). Then, in one run:
//!
//! - **baselines**: a `memcpy` of the engine's bytes (the trainer's model in the engine's
//!   layout, fused and bf16), on one thread and split as the transports split theirs;
//! - **the transport alone**, for each link: a version of the engine's bytes published
//!   through a link opened by the link factory, and fetched by its receiver through the
//!   [`WeightInlet`](refit_actors::WeightInlet) an engine uses, with no engine: what the bytes
//!   cost to move;
//! - **the engine**, for each link and pause mode: a [`GenerationEngine`](refit_actors::actor::GenerationEngine) serving a
//!   [`TransformerGenerator`](refit_rl::transformer::TransformerGenerator) (and a second one staging, as a run builds them), fed through
//!   the link with the trainer-to-engine conversion on the send path
//!   ([`ConvertingSender`](refit_runtime::convert::ConvertingSender) with
//!   [`TransformerConfig::want`]), while clients keep several
//!   requests decoding. Each update: the trainer publishes the next version, the engine is
//!   asked to load it ([`UpdateModel`](refit_actors::protocol::engine::UpdateModel)) and answers its
//!   [`LoadReport`](refit_actors::protocol::engine::LoadReport): `paused` (the swap
//!   at a step boundary: the time no token is produced because of the update) and `staged`
//!   (fetch and stage, beside generation). A decoding step's time is measured between
//!   updates from the engine's step counter.
//!
//! Every figure is a list of samples; `refit bench` prints medians and ratios.

mod clients;
mod engine_run;
mod transport;

use std::sync::Arc;
use std::time::Duration;

use refit_rl::transformer::TransformerConfig;
use refit_runtime::convert::{Conversions, Wants};
use refit_runtime::{Manifests, ModelId, Version};

use refit_actors::generation::PauseMode;
use refit_actors::{Error, Result};

pub use engine_run::{EngineFigures, UpdateFigures};
pub use transport::TransportFigures;

/// Vocabulary of the benchmark's models.
pub const VOCAB: usize = 64;
/// Context of the benchmark's models (prompt plus completion).
pub const CONTEXT: usize = 64;
/// The deadline of every wait of the bench (a connect, a load, a step window).
const WAIT: Duration = Duration::from_secs(300);

/// What one run measures.
#[derive(Clone, Debug, PartialEq)]
pub struct PauseBenchConfig {
    /// Models, by the bytes of their engine layout (bf16, what the link moves): the
    /// trainer's f32 model is about twice that, and so is what the engine serves (its
    /// staged f32).
    pub sizes: Vec<usize>,
    /// Transports, by link-factory name (`shm`, `inproc`, ...).
    pub links: Vec<String>,
    /// Pause modes; each link and mode gets an engine of its own.
    pub modes: Vec<PauseMode>,
    /// Timed updates per engine (and transport runs per link).
    pub updates: usize,
    /// Untimed updates first (fresh arenas and slots are touched then).
    pub warmup: usize,
    /// Requests kept decoding during every update.
    pub requests: usize,
    /// Tokens of the longest request (lengths vary from half of it).
    pub max_tokens: u32,
    /// Threads of the decoding generator and of the staging one, each.
    pub threads: usize,
}

impl Default for PauseBenchConfig {
    fn default() -> Self {
        Self {
            sizes: vec![1 << 20, 100 << 20, 1 << 30],
            links: vec!["shm".into()],
            modes: vec![PauseMode::Keep],
            updates: 5,
            warmup: 1,
            requests: 4,
            max_tokens: 16,
            threads: 1,
        }
    }
}

impl PauseBenchConfig {
    /// Checks the counts.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field.
    pub fn check(&self) -> Result<()> {
        let bad = |what: &str| Err(Error::Config(format!("engine pause bench: {what}")));
        if self.sizes.is_empty() || self.links.is_empty() || self.modes.is_empty() {
            return bad("sizes, links and modes need at least one value each");
        }
        if self.updates == 0 || self.requests == 0 || self.threads == 0 {
            return bad("updates, requests and threads must be at least 1");
        }
        if self.max_tokens < 2 || self.max_tokens as usize + 8 > CONTEXT {
            return bad(&format!(
                "max_tokens must be in 2..={} (the context is {CONTEXT})",
                CONTEXT - 8
            ));
        }
        Ok(())
    }
}

/// The figures of one size.
#[derive(Debug)]
pub struct SizeFigures {
    /// The model's shape.
    pub config: TransformerConfig,
    /// Bytes of the engine's layout (bf16): what the link moves.
    pub wire_bytes: usize,
    /// Bytes of the trainer's layout (f32); the engine serves as many (staged f32).
    pub trainer_bytes: usize,
    /// The fastest simple copy (`memcpy` or streaming stores,
    /// [`refit_runtime::copy::fastest_copy`]) of `wire_bytes` between touched buffers, one
    /// thread.
    pub memcpy: Vec<Duration>,
    /// The fastest simple copy split across `split_threads` threads.
    pub memcpy_split: Vec<Duration>,
    /// Threads of `memcpy_split`.
    pub split_threads: usize,
    /// The transport alone, per link.
    pub transports: Vec<TransportFigures>,
    /// The engine, per link and mode.
    pub engines: Vec<EngineFigures>,
}

/// Runs the bench on an actix system of its own (call it outside one); `progress` hears a
/// line before each part.
///
/// # Errors
/// A bad configuration; any failure of the measured path (a link that cannot open, a load
/// refused, a request failing, a deadline passed), naming the size, link and mode.
pub fn run(cfg: &PauseBenchConfig, progress: &mut dyn FnMut(&str)) -> Result<Vec<SizeFigures>> {
    cfg.check()?;
    let mut out = Vec::with_capacity(cfg.sizes.len());
    for &size in &cfg.sizes {
        out.push(one_size(cfg, size, progress)?);
    }
    Ok(out)
}

fn model_id() -> Result<ModelId> {
    Ok(ModelId::new("policy")?)
}

fn one_size(
    cfg: &PauseBenchConfig,
    size: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<SizeFigures> {
    let model = model_id()?;
    let shape = TransformerConfig::of_bytes(2 * size, VOCAB, CONTEXT);
    progress(&format!(
        "engine pause: a model of {} layers of width {} ({} MiB in the engine's layout): init",
        shape.layers,
        shape.d_model,
        (shape.params() * 2) >> 20
    ));
    let mut trainer = shape.init_weights(model.clone(), 1)?;
    trainer.set_version(Version(1));
    let trainer = Arc::new(trainer);
    let source = Manifests::new([(model.clone(), Arc::clone(trainer.manifest()))])?;
    let conversions = Conversions::plan(
        &source,
        &Wants::new().model(model.clone(), TransformerConfig::want()),
    )?;
    let trainer_bytes = trainer.manifest().total_len();

    // the engine's bytes, converted once: the baselines and the transport alone move them
    let (wire_bytes, memcpy, memcpy_split, split_threads, transports) = {
        let conversion = conversions
            .get(&model)
            .ok_or_else(|| Error::Config(format!("model `{model}`: no conversion was planned")))?;
        let mut wire = conversion.apply(&trainer)?;
        wire.set_version(Version(1));
        let wire = Arc::new(wire);
        let rounds = cfg.updates.max(3);
        let copy = |threads| {
            refit_runtime::copy::fastest_copy(wire.bytes(), rounds, threads)
                .times()
                .to_vec()
        };
        let memcpy = copy(1);
        let split_threads = refit_runtime::copy::copy_threads();
        let memcpy_split = copy(split_threads);
        let mut transports = Vec::with_capacity(cfg.links.len());
        for link in &cfg.links {
            progress(&format!("engine pause: the {link} transport alone"));
            transports.push(transport::measure(
                link,
                &wire,
                conversions.target(),
                cfg.warmup,
                cfg.updates,
            )?);
        }
        (
            wire.manifest().total_len(),
            memcpy,
            memcpy_split,
            split_threads,
            transports,
        )
    };

    let mut engines = Vec::with_capacity(cfg.links.len() * cfg.modes.len());
    let mut trainer = trainer;
    for link in &cfg.links {
        for &mode in &cfg.modes {
            progress(&format!(
                "engine pause: an engine fed over {link}, {mode} mode"
            ));
            let run = engine_run::EngineRun {
                link,
                mode,
                shape,
                conversions: &conversions,
                cfg,
            };
            let (figures, back) = run.measure(trainer)?;
            trainer = back;
            engines.push(figures);
        }
    }
    Ok(SizeFigures {
        config: shape,
        wire_bytes,
        trainer_bytes,
        memcpy,
        memcpy_split,
        split_threads,
        transports,
        engines,
    })
}

#[cfg(test)]
mod tests;
