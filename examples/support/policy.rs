//! The small policy the weight examples publish (`shm_weights`, `file_weights`): its
//! layout and the weights a trainer would produce at each version.

use std::sync::Arc;

use refit::prelude::*;

// ANCHOR: model
/// The policy's layout: a two-layer MLP.
pub(crate) fn policy_manifest() -> Result<Manifest> {
    Manifest::builder()
        .tensor("fc1.weight", DType::F32, &[64, 4])
        .tensor("fc1.bias", DType::F32, &[64])
        .tensor("fc2.weight", DType::F32, &[2, 64])
        .tensor("fc2.bias", DType::F32, &[2])
        .build()
}

/// What the trainer would produce at `version`: here every weight equals the version.
pub(crate) fn weights_at(manifest: &Arc<Manifest>, version: u64) -> Result<WeightSet> {
    let mut ws = WeightSet::zeroed(ModelId::new("policy")?, Arc::clone(manifest));
    for t in manifest.tensors() {
        ws.view_mut::<f32>(&t.name)?.fill(version as f32);
    }
    ws.set_version(Version(version));
    Ok(ws)
}
// ANCHOR_END: model
