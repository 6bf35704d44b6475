//! Type-erased ends of a weight-sync scheme, re-exported from the weight plane
//! ([`refit_runtime::link`]), where they live: an engine's inlet and a trainer's outlet
//! never pass through the RL crate.

pub use refit_runtime::link::{WeightInlet, WeightOutlet};
