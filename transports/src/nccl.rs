//! The `nccl` link: the broadcast transport ([`crate::broadcast`]) over the NCCL
//! collective backend, for trainers and engines on GPUs of one host or many.
//!
//! It is the broadcast transport with another [`Connector`]: per version and per bucket
//! rank 0 broadcasts a prepare message (model, version, the bucket's tensors, its checksum)
//! and then the bucket's bytes; receivers check the prepare against the agreed manifest,
//! receive the bytes into the version they assemble, verify the checksum and hand the whole
//! group to the scheme, which applies it atomically. One NCCL communicator per membership
//! generation (`NcclCommunicator`, feature `cuda`), its unique id set by rank 0
//! in the rendezvous store the sender serves; acks go through the same store.
//!
//! [`NcclLink::open_over`] and [`NcclLink::join_over`] are the link's two ends over any
//! connector: [`LinkFactory::open`] and [`LinkFactory::receiver`] call them with NCCL's
//! options, and the scheme suite (`transports/tests/scheme_suite.rs`) runs this very code
//! over the CPU collective, so the protocol is tested in CI without a GPU.
//!
//! Without the `cuda` feature the link still exists (its name resolves, its reach is
//! known), but [`LinkFactory::built`], `open` and `receiver` answer "not compiled with
//! CUDA", naming the feature; with it, but without a usable GPU or `libnccl`, they answer
//! with the probe's reason. Nothing panics.
//!
//! One GPU holds one rank of a communicator: on a single GPU the trainer can only be alone
//! in its group; a trainer and an engine sharing a GPU use the `cuda-ipc` link.

use refit_runtime::{Manifests, ReceiverTransport, Result};

use crate::broadcast::{
    BroadcastReceiver, BroadcastSender, Connector, GroupEnd, join_group, open_group,
};
use crate::link::{
    LinkFactory, LinkMemory, LinkOptions, LinkTraits, OpenedLink, Reach, ReceiverSpec,
};

const NAME: &str = "nccl";

/// Bytes per bucket of the `nccl` link: large enough that a bucket's broadcast runs at
/// device bandwidth through the pinned pipeline (16 MiB chunks), small enough that a receiver
/// refusing a bucket wastes little.
pub const BUCKET_SIZE: usize = 64 << 20;

/// NCCL broadcast in the link factory.
#[derive(Debug, Clone, Copy)]
pub struct NcclLink;

impl NcclLink {
    /// Rank 0 of an `nccl` link over any connector: what [`LinkFactory::open`] runs with
    /// NCCL's options (`connector` makes each generation's communicator from the end's
    /// token and address). The spec names `nccl`.
    ///
    /// # Errors
    /// As [`open_group`].
    pub fn open_over<K: Connector>(
        &self,
        options: &LinkOptions,
        connector: impl FnOnce(&GroupEnd) -> K,
    ) -> Result<(BroadcastSender<K>, ReceiverSpec)> {
        open_group(self, options, BUCKET_SIZE, connector)
    }

    /// A receiver end of an `nccl` link's spec over any connector: what
    /// [`LinkFactory::receiver`] runs with NCCL's options.
    ///
    /// # Errors
    /// As [`join_group`].
    pub fn join_over<K: Connector>(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
        connector: impl FnOnce(&GroupEnd) -> K,
    ) -> Result<BroadcastReceiver<K>> {
        join_group(self, spec, options, connector)
    }
}

impl LinkFactory for NcclLink {
    fn traits(&self) -> &'static LinkTraits {
        &LinkTraits {
            name: NAME,
            about: "processes on GPUs of any hosts: rank 0 broadcasts every bucket once through NCCL (feature `cuda`)",
            // NCCL reaches ranks over NVLink, PCIe, sockets or InfiniBand
            reach: Reach::Network,
            // each receiver assembles versions in arenas of its own
            receivers_copy: true,
            memory: LinkMemory::Gpu { nccl: true },
        }
    }
    fn sender_end(&self, _manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        with_cuda::open(self, options)
    }
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        with_cuda::receiver(self, spec, options)
    }
}

#[cfg(feature = "cuda")]
mod with_cuda {
    use refit_runtime::{ReceiverTransport, Result};

    use super::NcclLink;
    use crate::collective::nccl::NcclOptions;
    use crate::link::{LinkOptions, OpenedLink, ReceiverSpec};

    fn options_of(options: &LinkOptions) -> Result<NcclOptions> {
        Ok(NcclOptions {
            device: options.cuda_device()?,
            ..NcclOptions::default()
        })
    }

    pub(super) fn open(link: &NcclLink, options: &LinkOptions) -> Result<OpenedLink> {
        let nccl = options_of(options)?;
        let (sender, spec) = link.open_over(options, |_| nccl)?;
        Ok(OpenedLink {
            spec,
            sender: Box::new(sender),
            leftovers: Vec::new(),
        })
    }

    pub(super) fn receiver(
        link: &NcclLink,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        let nccl = options_of(options)?;
        Ok(Box::new(link.join_over(spec, options, |_| nccl)?))
    }
}

/// The stand-in without the `cuda` feature: every call answers "not compiled with CUDA".
#[cfg(not(feature = "cuda"))]
mod with_cuda {
    use refit_runtime::{ReceiverTransport, Result};

    use super::{NAME, NcclLink};
    use crate::gpu::{GpuUnavailable, link_unavailable};
    use crate::link::{LinkOptions, OpenedLink, ReceiverSpec};

    pub(super) fn open(_: &NcclLink, _: &LinkOptions) -> Result<OpenedLink> {
        Err(link_unavailable(NAME, &GpuUnavailable::NotCompiled))
    }

    pub(super) fn receiver(
        _: &NcclLink,
        _: &ReceiverSpec,
        _: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        Err(link_unavailable(NAME, &GpuUnavailable::NotCompiled))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::CpuConfig;
    use refit_node::ClusterToken;

    /// Without a GPU (CI), both ends refuse with the reason: not compiled with CUDA (naming
    /// the feature) or the probe's; never a panic. The spec check comes first.
    #[test]
    fn gpu_nccl_link_refuses_without_a_gpu_and_says_why() {
        let options = LinkOptions {
            expected_receivers: 1,
            token: Some(ClusterToken::random()),
            ..LinkOptions::default()
        };
        let m = refit_runtime::Manifest::builder()
            .tensor("w", refit_runtime::DType::F32, &[4])
            .build()
            .unwrap();
        let id = refit_runtime::ModelId::new("policy").unwrap();
        let ms = Manifests::new([(id, std::sync::Arc::new(m))]).unwrap();
        let Err(e) = NcclLink.open(&ms, &options) else {
            assert!(crate::gpu::check_device(0, true).is_ok());
            return;
        };
        let e = e.to_string();
        assert!(e.starts_with("nccl transport: "), "{e}");
        if cfg!(feature = "cuda") {
            assert!(e.contains("no usable GPU"), "{e}");
        } else {
            assert!(
                e.contains("not compiled with CUDA") && e.contains("--features cuda"),
                "{e}"
            );
            assert!(NcclLink.built().is_err());
        }
        // the receiver side says the same, after refusing a spec of another transport
        let (_sender, spec) = NcclLink
            .open_over(&options, |end| {
                CpuConfig::new(end.token.clone()).with_bind(end.ip)
            })
            .unwrap();
        assert_eq!(spec.transport(), "nccl");
        let r = NcclLink.receiver(&spec, &options).map(|_| ()).unwrap_err();
        assert_eq!(r.to_string(), e);
        let other = ReceiverSpec::new(&crate::shm::ShmLink, &1u32, "x").unwrap();
        let r = NcclLink.receiver(&other, &options).map(|_| ()).unwrap_err();
        assert!(r.to_string().contains("a shm receiver spec"), "{r}");
    }
}
