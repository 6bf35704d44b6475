//! What a rank is started with ([`RankSetup`]), kept whole in its context.

use std::sync::Arc;

use refit_node::{ClusterToken, LaunchEnv};
use refit_runtime::topology::Topology;

use super::workload::Workload;
use super::{InletWrapper, StopRule};
use crate::roles::ModelSpec;

/// What a rank is started with; kept whole in its context ([`RankCtx::setup`](super::start::RankCtx::setup)).
pub(crate) struct RankSetup {
    /// The run's topology.
    pub(crate) topo: Arc<Topology>,
    /// Where this process stands in the launched job.
    pub(crate) launch: LaunchEnv,
    /// The cluster's token.
    pub(crate) token: ClusterToken,
    /// The run's models as the roles see them.
    pub(crate) specs: Vec<ModelSpec>,
    /// What the run hosts for each model.
    pub(crate) work: Arc<dyn Workload>,
    /// When the run stops.
    pub(crate) stop: StopRule,
    /// Validation episodes per model on eval steps.
    pub(crate) eval_episodes: usize,
    /// Wraps every engine inlet, when set.
    pub(crate) wrap_inlet: Option<InletWrapper>,
    /// Which start of this rank (0, then one more per restart).
    pub(crate) incarnation: u32,
}
