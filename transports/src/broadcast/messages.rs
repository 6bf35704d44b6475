//! The control messages rank 0 broadcasts before the bytes they announce, framed on the
//! communicator: an 8-byte little-endian length (0 is a heartbeat), then the msgpack body.

use std::time::Instant;

use refit_runtime::{
    BucketHeader, Error, Manifest, Mismatch, ModelId, Result, TensorSpec, Version, wire,
};
use serde::{Deserialize, Serialize};

use crate::collective::Communicator;

/// Largest control message a receiver accepts.
const MAX_CONTROL: usize = wire::MAX_CONTROL_MESSAGE;

/// The version of the broadcast transport's protocol (its control messages and the bytes
/// that follow them) this build speaks: rank 0 opens every generation with it, and a
/// receiver of another version leaves the generation naming both.
pub const PROTOCOL_VERSION: u32 = 1;

/// The name of the protocol in errors.
pub(super) const PROTOCOL_NAME: &str = "broadcast";

/// What rank 0 broadcasts on the control plane.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Control {
    /// Sent once per generation, first of all, whatever the version: rank 0's
    /// [`PROTOCOL_VERSION`].
    Hello {
        /// The sender's protocol version.
        protocol: u32,
    },
    /// Sent once per generation, after the hello: every model's manifest.
    Manifests(Vec<(ModelId, Manifest)>),
    /// Announces one bucket; its bytes follow as one broadcast.
    Prepare(Prepare),
    /// The sender shuts down: receivers report it gone at once (an NCCL peer does not see
    /// the other ranks leave; only this message, or its idle timeout, tells it).
    Goodbye,
}

/// The prepare message of one bucket: what the next broadcast carries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prepare {
    /// The model.
    pub model: ModelId,
    /// The version the bytes belong to.
    pub version: Version,
    /// Publish number of the group (acks name it).
    pub seq: u64,
    /// Position of the model in its group (an update of several models lands whole).
    pub model_index: u32,
    /// Models in the group.
    pub model_count: u32,
    /// Buckets of this model's plan.
    pub bucket_count: u32,
    /// The plan's bucket size.
    pub bucket_size: u64,
    /// Schema hash of the sender's manifest.
    pub schema_hash: u64,
    /// The tensors this bucket touches: names, dtypes, shapes, offsets.
    pub tensors: Vec<TensorSpec>,
    /// The bucket: index, arena range, pieces, checksum.
    pub header: BucketHeader,
}

impl Prepare {
    /// Checks the announced tensors and schema against the agreed manifest.
    ///
    /// # Errors
    /// [`Error::Tensor`] naming the first tensor that differs; [`Error::Schema`] when the
    /// schema hashes differ.
    pub fn check(&self, agreed: &Manifest) -> Result<()> {
        let model = &self.model;
        for t in &self.tensors {
            let Some(a) = agreed.get(&t.name) else {
                return Err(Error::tensor(model, &t.name, Mismatch::Unexpected));
            };
            let problem = if a.dtype != t.dtype {
                Some(Mismatch::DType {
                    expected: a.dtype,
                    found: t.dtype,
                })
            } else if a.shape != t.shape {
                Some(Mismatch::Shape {
                    expected: a.shape.clone(),
                    found: t.shape.clone(),
                })
            } else if a.offset != t.offset || a.len != t.len {
                Some(Mismatch::Size {
                    expected: a.len,
                    found: t.len,
                })
            } else {
                None
            };
            if let Some(p) = problem {
                return Err(Error::tensor(model, &t.name, p));
            }
        }
        if self.schema_hash != agreed.schema_hash() {
            return Err(Error::Schema {
                model: model.clone(),
                expected: agreed.schema_hash(),
                found: self.schema_hash,
            });
        }
        Ok(())
    }
}

/// Rank 0: broadcasts a control message (length, then body).
pub(super) fn send<C: Communicator>(comm: &mut C, msg: &Control, deadline: Instant) -> Result<()> {
    let body = wire::encode(msg)?;
    comm.broadcast_send(&(body.len() as u64).to_le_bytes(), deadline)?;
    comm.broadcast_send(&body, deadline)
}

/// Rank 0: broadcasts a heartbeat (a zero length).
pub(super) fn heartbeat<C: Communicator>(comm: &mut C, deadline: Instant) -> Result<()> {
    comm.broadcast_send(&0u64.to_le_bytes(), deadline)
}

/// A receiver: the next control message (`None` for a heartbeat). The length is awaited
/// until `idle`, the body until `busy`.
pub(super) fn recv<C: Communicator>(
    comm: &mut C,
    idle: Instant,
    busy: Instant,
) -> Result<Option<Control>> {
    let mut len = [0u8; 8];
    comm.broadcast_host(&mut len, 0, idle)?;
    let len = u64::from_le_bytes(len);
    if len == 0 {
        return Ok(None);
    }
    let len = usize::try_from(len)
        .ok()
        .filter(|l| *l <= MAX_CONTROL)
        .ok_or_else(|| {
            let e = Error::Wire(format!(
                "control message of {len} bytes exceeds the {MAX_CONTROL}-byte limit"
            ));
            comm.abort(&e.to_string());
            e
        })?;
    let mut body = vec![0u8; len];
    comm.broadcast_host(&mut body, 0, busy)?;
    wire::decode(&body, MAX_CONTROL).map(Some).inspect_err(|e| {
        comm.abort(&e.to_string());
    })
}
