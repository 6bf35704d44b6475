//! [`Plan`]: a checked conversion from one manifest to another, computed once and applied to
//! every version. A layout ([`LayoutPlan`](crate::LayoutPlan): rename, fuse, split,
//! transpose) and a cast ([`CastPlan`](crate::CastPlan): dtypes, fp8 with scales) are plans
//! that differ only in their operations ([`Ops`]).

use std::sync::Arc;

use crate::error::Result;
use crate::manifest::Manifest;
use crate::weights::WeightSet;

mod sealed {
    pub trait Sealed {}

    /// Proof that both manifests were checked: only [`Plan::apply_into`](super::Plan)
    /// makes one, so no caller reaches [`Ops::write`](super::Ops::write) around the checks.
    #[derive(Clone, Copy, Debug)]
    pub struct Checked(pub(super) ());
}

/// The operations of one kind of [`Plan`] (a layout's, a cast's); implemented in this crate
/// only.
pub trait Ops: sealed::Sealed + Sized {
    /// Writes every byte of `out`, a weight set of the plan's target manifest, from
    /// `weights`, one of its source manifest (both checked, as `checked` proves), and gives
    /// `out` their version.
    #[doc(hidden)]
    fn write(
        plan: &Plan<Self>,
        weights: &WeightSet,
        out: &mut WeightSet,
        checked: sealed::Checked,
    ) -> Result<()>;
}

/// A checked conversion from a source manifest to a target manifest, computed once (by the
/// kind's `new`) and applied to every version.
#[derive(Clone, Debug)]
pub struct Plan<O> {
    pub(crate) source: Arc<Manifest>,
    pub(crate) target: Arc<Manifest>,
    pub(crate) ops: O,
}

impl<O: Ops> Plan<O> {
    pub(crate) fn of(source: &Manifest, target: Manifest, ops: O) -> Self {
        Self {
            source: Arc::new(source.clone()),
            target: Arc::new(target),
            ops,
        }
    }

    /// The manifest the plan was made for (the trainer's, for the first plan of a
    /// conversion).
    pub fn source(&self) -> &Arc<Manifest> {
        &self.source
    }

    /// The manifest the plan produces.
    pub fn target(&self) -> &Arc<Manifest> {
        &self.target
    }

    /// Converts one version (same model and version).
    ///
    /// # Errors
    /// [`Error::Tensor`](crate::Error::Tensor) (naming the tensor) or
    /// [`Error::Schema`](crate::Error::Schema) when `weights` does not have the source
    /// manifest; a cast's [`Error::Cast`](crate::Error::Cast) naming the tensor and element
    /// when a scaled fp8 tensor holds a NaN or infinity.
    pub fn apply(&self, weights: &WeightSet) -> Result<WeightSet> {
        let mut out = WeightSet::zeroed(weights.model().clone(), Arc::clone(&self.target));
        self.apply_into(weights, &mut out)?;
        Ok(out)
    }

    /// As [`Plan::apply`], into a weight set of the target manifest whose every byte is
    /// overwritten (reused by the converting adapters, so a version does not fault in a
    /// fresh arena).
    pub(crate) fn apply_into(&self, weights: &WeightSet, out: &mut WeightSet) -> Result<()> {
        self.source
            .check_same_schema(weights.model(), weights.manifest())?;
        self.target.check_same_schema(out.model(), out.manifest())?;
        O::write(self, weights, out, sealed::Checked(()))
    }
}

pub(crate) use sealed::{Checked, Sealed};
