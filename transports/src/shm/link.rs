//! The shared-memory transport in the link factory.

use refit_runtime::{Manifests, ReceiverTransport, Result};

use super::{ShmConfig, ShmReadMode, ShmReceiver, ShmReceiverSpec, ShmSender};
use crate::link::{
    LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};

/// Shared memory in the link factory: the spec is the board's path ([`ShmReceiverSpec`]);
/// the segment files are the link's leftovers. Receivers read each version where the sender
/// wrote it ([`ShmReadMode::ZeroCopy`]) unless [`LinkOptions::private_copies`]; the sender
/// checksums every version when [`LinkOptions::checksum`].
#[derive(Debug, Clone, Copy)]
pub struct ShmLink;

impl ShmLink {
    /// As [`LinkFactory::open`], with the sender end as the concrete [`ShmSender`] (for
    /// callers that fill lent slots in place with [`ShmSender::loan`]).
    ///
    /// # Errors
    /// As [`ShmSender::create`].
    pub fn open_typed(
        &self,
        manifests: &Manifests,
        options: &LinkOptions,
    ) -> Result<(ShmSender, ReceiverSpec)> {
        let mut config = ShmConfig {
            expected_receivers: options.expected_receivers,
            checksum: options.checksum,
            ..ShmConfig::default()
        };
        if let Some(dir) = &options.dir {
            config.dir.clone_from(dir);
        }
        let sender = ShmSender::create(&config, manifests)?;
        let spec = sender.receiver_spec();
        let about = format!("board {}", spec.board.display());
        let spec = ReceiverSpec::new(self, &spec, about)?;
        Ok((sender, spec))
    }
}

impl LinkFactory for ShmLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: super::NAME,
            about: "processes of one host: slots in shared memory, readers map them in place",
            reach: Reach::Host,
            receivers_copy: false,
            memory: LinkMemory::Host,
        }
    }
    fn sender_end(&self, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        let (sender, spec) = self.open_typed(manifests, options)?;
        Ok(opened(sender, spec))
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        let s: ShmReceiverSpec = spec.params()?;
        let mode = if options.private_copies {
            ShmReadMode::Copy
        } else {
            ShmReadMode::ZeroCopy
        };
        Ok(Box::new(ShmReceiver::new(s).with_mode(mode)))
    }
}

/// The link opened over `sender` (an `shm` or `cuda-ipc` sender end): its segments are the
/// leftovers.
pub(crate) fn opened(sender: ShmSender, spec: ReceiverSpec) -> OpenedLink {
    OpenedLink {
        spec,
        leftovers: sender.segment_paths(),
        sender: Box::new(sender),
    }
}
