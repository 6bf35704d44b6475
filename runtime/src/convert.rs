//! Strategies on the real path: the layout and dtypes a receiver wants, applied to every
//! update by an adapter around any transport end.
//!
//! An engine declares what it wants per model with a [`Want`] (layout rules, then cast
//! rules, both written against the trainer's names: the cast rules name the tensors the
//! layout produces). [`Conversions::plan`] checks the wants against the trainer's manifests
//! once, at connect, and computes the engine's. Then one of two adapters applies the plan to
//! every version, whichever transport carries the bytes:
//!
//! - [`ConvertingSender`] wraps a sender transport created with the *target* manifests: the
//!   trainer publishes its own layout, the adapter converts once per version and the wire
//!   carries the engine's layout (bf16 halves the bytes; one conversion serves every
//!   receiver). Receivers need nothing: they see the target manifests at connect.
//! - [`ConvertingReceiver`] wraps a receiver transport: the wire carries the trainer's
//!   layout, the adapter plans at connect from what the sender announced and converts each
//!   group before the scheme admits it (each receiver converts to its own wants; the
//!   sender knows nothing of them).
//!
//! Either way the scheme's admission runs as before: on the sender against the trainer's
//! manifests, on the receiver against the converted ones, so a bad update is refused whole,
//! naming the tensor, and the previous version stays served. Each conversion is timed as
//! [`Phase::Convert`] and counted in [`ConvertStats`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::cast::{CastPlan, CastRules};
use crate::error::{Error, Result};
use crate::ids::{ModelId, Version};
use crate::layout::{LayoutPlan, LayoutRules, Segment};
use crate::manifest::Manifest;
use crate::metrics::{self, Phase};
use crate::protocol::{Group, Manifests};
use crate::scheme::{ReceiverTransport, SenderTransport};
use crate::weights::WeightSet;

/// What an engine wants for one model: a layout (rename, fuse, split, transpose), then
/// dtypes (bf16, f16, fp8 with scales). Neither given: the model passes unchanged.
#[derive(Debug, Default)]
pub struct Want {
    layout: Option<LayoutRules>,
    cast: Option<CastRules>,
}

impl Want {
    /// Nothing yet (the model passes unchanged).
    pub fn new() -> Self {
        Self::default()
    }

    /// The engine's layout, as rules over the trainer's tensor names.
    #[must_use]
    pub fn layout(mut self, rules: LayoutRules) -> Self {
        self.layout = Some(rules);
        self
    }

    /// The engine's dtypes, as rules over the names the layout produces.
    #[must_use]
    pub fn cast(mut self, rules: CastRules) -> Self {
        self.cast = Some(rules);
        self
    }
}

/// What an engine wants, per model; models it names nothing for pass unchanged.
#[derive(Debug, Default)]
pub struct Wants(BTreeMap<ModelId, Want>);

impl Wants {
    /// No model converted.
    pub fn new() -> Self {
        Self::default()
    }

    /// `model` is converted as `want` says (a second call for one model replaces the first).
    #[must_use]
    pub fn model(mut self, model: ModelId, want: Want) -> Self {
        self.0.insert(model, want);
        self
    }
}

/// One model's checked conversion: a layout plan, then a cast plan.
///
/// With both, the cast reads the trainer's bytes where the layout would take them from (one
/// pass, no laid-out copy), unless the layout reorders elements (a transpose) or per-block
/// fp8 scales cover a tensor the layout assembles from several: those go through the
/// laid-out copy, with the same result.
///
/// On the adapters' path ([`Conversions::apply_group`]) arenas are reused: the layout's
/// intermediate arena, and up to [`RECYCLED`] converted versions that nobody holds any
/// more, so a version is converted into memory already faulted in (a fresh arena costs
/// about as much as the conversion itself). Clones share these arenas.
#[derive(Clone, Debug)]
pub struct Conversion {
    source: Arc<Manifest>,
    target: Arc<Manifest>,
    layout: Option<LayoutPlan>,
    cast: Option<CastPlan>,
    /// With both a layout and a cast: where the layout would put each of the trainer's bytes,
    /// so the cast reads them from the trainer's arena in one pass (none when the layout
    /// reorders elements, e.g. a transpose: the cast then reads a laid-out copy).
    runs: Option<Arc<Vec<Vec<Segment>>>>,
    scratch: Arc<Mutex<Scratch>>,
}

/// How many converted versions a [`Conversion`] keeps for reuse once nobody else holds them.
pub const RECYCLED: usize = 3;

/// Arenas kept for reuse.
#[derive(Debug, Default)]
struct Scratch {
    /// The layout's output, when a cast follows.
    laid: Option<WeightSet>,
    /// Converted versions handed out; one is reused once it is the only holder.
    outputs: Vec<Arc<WeightSet>>,
}

impl Conversion {
    /// Checks `want` against the trainer's manifest `source` and computes the engine's.
    ///
    /// # Errors
    /// [`Error::Layout`] or [`Error::Cast`] naming the rule or the tensor, as
    /// [`LayoutPlan::new`] and [`CastPlan::new`] report them.
    pub fn new(source: &Arc<Manifest>, want: &Want) -> Result<Self> {
        let layout = want
            .layout
            .as_ref()
            .map(|r| LayoutPlan::new(source, r))
            .transpose()?;
        let laid = layout
            .as_ref()
            .map_or_else(|| Arc::clone(source), |l| Arc::clone(l.target()));
        let cast = want
            .cast
            .as_ref()
            .map(|r| CastPlan::new(&laid, r))
            .transpose()?;
        let target = cast
            .as_ref()
            .map_or_else(|| Arc::clone(&laid), |c| Arc::clone(c.target()));
        let runs = match (&layout, &cast) {
            (Some(l), Some(c)) => l.segments().filter(|runs| c.takes_runs(runs)).map(Arc::new),
            _ => None,
        };
        Ok(Self {
            source: Arc::clone(source),
            target,
            layout,
            cast,
            runs,
            scratch: Arc::default(),
        })
    }

    /// The trainer's manifest.
    pub fn source(&self) -> &Arc<Manifest> {
        &self.source
    }

    /// The engine's manifest.
    pub fn target(&self) -> &Arc<Manifest> {
        &self.target
    }

    /// The layout step, if any.
    pub fn layout(&self) -> Option<&LayoutPlan> {
        self.layout.as_ref()
    }

    /// The cast step, if any.
    pub fn cast(&self) -> Option<&CastPlan> {
        self.cast.as_ref()
    }

    /// Converts one version (same model and version) to the engine's manifest.
    ///
    /// # Errors
    /// A schema error naming the tensor when `weights` does not have the trainer's manifest;
    /// [`Error::Cast`] when a scaled fp8 tensor holds a non-finite value.
    pub fn apply(&self, weights: &WeightSet) -> Result<WeightSet> {
        self.source
            .check_same_schema(weights.model(), weights.manifest())?;
        match (&self.layout, &self.cast) {
            (Some(_), Some(c)) if let Some(runs) = &self.runs => {
                let mut out = WeightSet::zeroed(weights.model().clone(), Arc::clone(&self.target));
                c.apply_runs(weights.bytes(), runs, weights.version(), &mut out)?;
                Ok(out)
            }
            (Some(l), Some(c)) => c.apply(&l.apply(weights)?),
            (Some(l), None) => l.apply(weights),
            (None, Some(c)) => c.apply(weights),
            (None, None) => Ok(weights.clone()),
        }
    }

    /// As [`Conversion::apply`], into a recycled arena when one is free.
    fn apply_shared(&self, weights: &WeightSet) -> Result<Arc<WeightSet>> {
        self.source
            .check_same_schema(weights.model(), weights.manifest())?;
        if self.layout.is_none() && self.cast.is_none() {
            return Ok(Arc::new(weights.clone()));
        }
        let mut scratch = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let model = weights.model();
        let mut out = match scratch
            .outputs
            .iter_mut()
            .position(|a| Arc::get_mut(a).is_some())
        {
            Some(i) => scratch.outputs.swap_remove(i),
            None => Arc::new(WeightSet::zeroed(model.clone(), Arc::clone(&self.target))),
        };
        let dst = Arc::get_mut(&mut out).ok_or(Error::State("a recycled arena is shared"))?;
        match (&self.layout, &self.cast) {
            (Some(_), Some(c)) if let Some(runs) = &self.runs => {
                c.apply_runs(weights.bytes(), runs, weights.version(), dst)?;
            }
            (Some(l), Some(c)) => {
                let mut laid = match scratch.laid.take() {
                    Some(w) if w.model() == model => w,
                    _ => WeightSet::zeroed(model.clone(), Arc::clone(l.target())),
                };
                let r = l
                    .apply_into(weights, &mut laid)
                    .and_then(|()| c.apply_into(&laid, dst));
                scratch.laid = Some(laid);
                r?;
            }
            (Some(l), None) => l.apply_into(weights, dst)?,
            (None, Some(c)) => c.apply_into(weights, dst)?,
            (None, None) => {}
        }
        if scratch.outputs.len() < RECYCLED {
            scratch.outputs.push(Arc::clone(&out));
        }
        Ok(out)
    }
}

/// Every model's conversion, planned once at connect.
#[derive(Clone, Debug)]
pub struct Conversions {
    source: Manifests,
    target: Manifests,
    plans: BTreeMap<ModelId, Conversion>,
}

impl Conversions {
    /// Checks `wants` against the trainer's manifests and computes the engine's.
    ///
    /// # Errors
    /// [`Error::UnknownModel`] when a want names a model `source` does not have; the layout
    /// and cast errors of [`Conversion::new`].
    pub fn plan(source: &Manifests, wants: &Wants) -> Result<Self> {
        let mut plans = BTreeMap::new();
        for (model, want) in &wants.0 {
            plans.insert(model.clone(), Conversion::new(source.get(model)?, want)?);
        }
        let target = Manifests::new(source.iter().map(|(id, m)| {
            let m = plans.get(id).map_or(m, Conversion::target);
            (id.clone(), Arc::clone(m))
        }))?;
        Ok(Self {
            source: source.clone(),
            target,
            plans,
        })
    }

    /// The trainer's manifests.
    pub fn source(&self) -> &Manifests {
        &self.source
    }

    /// The engine's manifests (models without a want as they are).
    pub fn target(&self) -> &Manifests {
        &self.target
    }

    /// One model's conversion, if it has one.
    pub fn get(&self, model: &ModelId) -> Option<&Conversion> {
        self.plans.get(model)
    }

    /// Converts every weight set of `group` that has a conversion; the others pass as they
    /// are (the same `Arc`). All or nothing: the first failure refuses the whole group.
    ///
    /// # Errors
    /// As [`Conversion::apply`].
    pub fn apply_group(&self, group: &Group) -> Result<Group> {
        group
            .iter()
            .map(|w| match self.plans.get(w.model()) {
                Some(c) => c.apply_shared(w),
                None => Ok(Arc::clone(w)),
            })
            .collect()
    }

    fn converts(&self, group: &Group) -> bool {
        group.iter().any(|w| self.plans.contains_key(w.model()))
    }
}

/// What an adapter has converted so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ConvertStats {
    /// Groups converted.
    pub groups: u64,
    /// Trainer-layout payload bytes read by those conversions.
    pub source_bytes: u64,
    /// Time spent converting, in total.
    pub total: Duration,
    /// Time the last conversion took.
    pub last: Duration,
}

impl ConvertStats {
    /// Seconds per GB (10^9 source bytes), over every conversion so far; `NaN` before any.
    pub fn s_per_gb(&self) -> f64 {
        self.total.as_secs_f64() / (self.source_bytes as f64 / 1e9)
    }
}

/// Converts `group` with `conversions`, timing it as [`Phase::Convert`] into `stats`.
fn convert_timed(
    conversions: &Conversions,
    group: &Group,
    transport: &'static str,
    stats: &mut ConvertStats,
) -> Result<Group> {
    if !conversions.converts(group) {
        return Ok(group.clone());
    }
    let timer = metrics::timed_group(
        Phase::Convert,
        transport,
        group.iter().map(|w| w.model().as_str()),
    );
    let started = Instant::now();
    let out = conversions.apply_group(group)?;
    let took = started.elapsed();
    timer.finish();
    stats.groups += 1;
    stats.source_bytes += group
        .iter()
        .filter(|w| conversions.plans.contains_key(w.model()))
        .map(|w| w.manifest().payload_len() as u64)
        .sum::<u64>();
    stats.total += took;
    stats.last = took;
    Ok(out)
}

/// A sender transport that converts every group to the engine's layout before `inner`
/// publishes it; see the [module docs](self).
///
/// `inner` must be created with [`Conversions::target`] (what travels); the scheme's
/// [`SenderInit`](crate::SenderInit) gets [`Conversions::source`] (what the trainer
/// publishes).
#[derive(Debug)]
pub struct ConvertingSender<T> {
    inner: T,
    conversions: Conversions,
    stats: ConvertStats,
}

impl<T: SenderTransport> ConvertingSender<T> {
    /// Wraps `inner`.
    pub fn new(inner: T, conversions: Conversions) -> Self {
        Self {
            inner,
            conversions,
            stats: ConvertStats::default(),
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The plans applied.
    pub fn conversions(&self) -> &Conversions {
        &self.conversions
    }

    /// What was converted so far.
    pub fn stats(&self) -> ConvertStats {
        self.stats
    }
}

impl<T: SenderTransport> SenderTransport for ConvertingSender<T> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        let name = self.inner.name();
        let group = convert_timed(&self.conversions, initial, name, &mut self.stats)?;
        self.inner.connect(&group, deadline)
    }

    fn publish(&mut self, group: &Group, deadline: Instant) -> Result<()> {
        let name = self.inner.name();
        let group = convert_timed(&self.conversions, group, name, &mut self.stats)?;
        self.inner.publish(&group, deadline)
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        self.inner.wait_acks(entries, deadline)
    }

    fn shutdown(&mut self) -> Result<()> {
        self.inner.shutdown()
    }
}

/// A receiver transport that converts every group `inner` delivers to the layout the
/// engine wants, before the scheme admits it; see the [module docs](self).
#[derive(Debug)]
pub struct ConvertingReceiver<T> {
    inner: T,
    wants: Wants,
    conversions: Option<Conversions>,
    stats: ConvertStats,
}

impl<T: ReceiverTransport> ConvertingReceiver<T> {
    /// Wraps `inner`; the plans are made at connect, from the manifests the sender announces.
    pub fn new(inner: T, wants: Wants) -> Self {
        Self {
            inner,
            wants,
            conversions: None,
            stats: ConvertStats::default(),
        }
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The plans, once connected.
    pub fn conversions(&self) -> Option<&Conversions> {
        self.conversions.as_ref()
    }

    /// What was converted so far.
    pub fn stats(&self) -> ConvertStats {
        self.stats
    }
}

impl<T: ReceiverTransport> ReceiverTransport for ConvertingReceiver<T> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let announced = self.inner.connect(deadline)?;
        let conversions = Conversions::plan(&announced, &self.wants)?;
        let target = conversions.target().clone();
        self.conversions = Some(conversions);
        Ok(target)
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let conversions = self
            .conversions
            .as_ref()
            .ok_or(Error::State("converting receiver used before connect"))?;
        let Some(group) = self.inner.next_group(deadline)? else {
            return Ok(None);
        };
        let name = self.inner.name();
        convert_timed(conversions, &group, name, &mut self.stats).map(Some)
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        self.inner.ack(applied)
    }

    fn meter(&self) -> Option<Arc<dyn crate::WireMeter>> {
        self.inner.meter()
    }

    fn shutdown(&mut self) -> Result<()> {
        self.inner.shutdown()
    }
}

#[cfg(test)]
mod tests;
