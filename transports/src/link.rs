//! Transports as values: a link factory and the receiver spec it ships.
//!
//! Every transport module contributes one [`LinkFactory`] (a unit struct in its own file)
//! and one line to [`LINKS`]. From then on the CLI (`--transports`), the bench, process
//! workers and the topologies reach it by name, and nothing else names it:
//!
//! - the sending side calls [`open`] (or [`LinkFactory::open`]): a boxed sender end, and the
//!   [`ReceiverSpec`] its receivers connect with;
//! - the spec travels to the receiving side by any means (serde: the rendezvous store, an
//!   argument as [`ReceiverSpec::to_token`] text, a file) and holds no secret: each side
//!   reads its cluster token from its own configuration ([`LinkOptions::token`], the node it
//!   runs, or `REFIT_TOKEN` / `REFIT_TOKEN_FILE`);
//! - the receiving side calls [`ReceiverSpec::receiver`]: a boxed receiver end, to connect
//!   with [`ReceiverInit`](refit_runtime::ReceiverInit).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use refit_runtime::{DType, Manifest, Manifests, ModelId, ReceiverInit, SenderInit, WeightSet};
//! use refit_transports::link::{self, LinkOptions};
//!
//! # fn main() -> refit_runtime::Result<()> {
//! let id = ModelId::new("policy")?;
//! let manifest = Arc::new(Manifest::builder().tensor("w", DType::F32, &[4]).build()?);
//! let manifests = Manifests::new([(id.clone(), Arc::clone(&manifest))])?;
//! let mut initial = WeightSet::zeroed(id, manifest);
//! initial.set_version(refit_runtime::Version(1));
//!
//! // "inproc" could come from a flag or a topology file: the factory parses it
//! let opened = link::find("inproc")?.open(&manifests, &LinkOptions::default())?;
//! let spec = opened.spec.clone(); // serde: ship it anywhere
//! let receiver = ReceiverInit::new(spec.receiver(&LinkOptions::default())?, None);
//! let wait = Duration::from_secs(5);
//! let r = std::thread::spawn(move || receiver.connect(wait));
//! let sender = SenderInit::new(opened.sender, manifests).connect(vec![initial], wait)?;
//! let receiver = r.join().expect("receiver thread")?;
//! # drop((sender, receiver));
//! # Ok(())
//! # }
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use refit_node::{ClusterToken, Node};
use refit_runtime::topology::TransportKind;
use refit_runtime::{Error, Manifests, ReceiverTransport, Result, SenderTransport, wire};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

// ANCHOR: registry
/// Every transport the factory knows, in the order `refit bench` measures them. A new
/// transport adds its [`LinkFactory`] here: one line.
pub static LINKS: &[&dyn LinkFactory] = &[
    &crate::inproc::InProcLink,
    &crate::shm::ShmLink,
    &crate::tcp::TcpLink,
    &crate::file::FileLink,
    &crate::broadcast::BroadcastLink,
    &crate::nccl::NcclLink,
    &crate::cuda_ipc::CudaIpcLink,
];
// ANCHOR_END: registry

pub use refit_runtime::topology::{Deltas, Reach};

/// Settings the factory passes to a transport; each transport reads the ones it uses and
/// ignores the others. `Default` is what a plain `--transports NAME` gets.
#[derive(Clone, Debug, Default)]
pub struct LinkOptions {
    /// Sender: receivers its `connect` waits for before returning (default 0: whoever
    /// attaches).
    pub expected_receivers: usize,
    /// The node to serve or pull on (TCP): the sender agent runs on it and receivers use its
    /// token. Default: a sender starts a loopback node of its own.
    pub node: Option<Node>,
    /// The cluster token when there is no node (TCP). Default: `REFIT_TOKEN` or
    /// `REFIT_TOKEN_FILE`; a sender without either makes a random one.
    pub token: Option<ClusterToken>,
    /// Sender: where the transport's files go (shared-memory segments: default
    /// `/dev/shm`; file transport: default a new directory in the system's temporary
    /// folder, removed when the sender end drops).
    pub dir: Option<PathBuf>,
    /// Receiver: the deadline of one remote call (TCP; default the transport's own).
    pub call_timeout: Option<Duration>,
    /// Receiver: keep every version in memory of its own. By default a shared-memory
    /// receiver serves each version from the slot the sender wrote it into (one copy for any
    /// number of receivers, see [`ShmReadMode`](crate::shm::ShmReadMode)); transports whose
    /// receivers always own their bytes (TCP) ignore it.
    pub private_copies: bool,
    /// Sender: a checksum per version, verified by every receiver before it admits the
    /// version (shared memory: [`ShmConfig::checksum`](crate::shm::ShmConfig::checksum)).
    /// TCP checks every bucket whatever this says.
    pub checksum: bool,
    /// Receiver: what a version after the first carries when the receiver holds an earlier
    /// one (TCP: `Off` pulls every byte, `Buckets` the buckets of changed tensors,
    /// `Elements` those as element-level deltas). Transports that move every byte ignore
    /// it.
    pub deltas: Deltas,
    /// Receiver: apply every version as it streams in ([`ReceiverTransport::stream_next`]),
    /// keeping no copy of it: TCP receivers then hold a few buckets' worth of tensors (at
    /// least the largest) during an update, not the model (and relay nothing, and pull every
    /// byte, over two streams). Transports that receive versions whole still hand them over
    /// tensor by tensor.
    pub streaming: bool,
    /// The CUDA device this end uses (GPU links: `nccl`, `cuda-ipc`). Default:
    /// [`CUDA_DEVICE_ENV`] when set, else 0 (each process sees the GPUs its
    /// `CUDA_VISIBLE_DEVICES` lets it see).
    pub device: Option<usize>,
}

/// The variable naming the CUDA device of a GPU link's end when [`LinkOptions::device`] is
/// unset (`REFIT_CUDA_DEVICE=1`).
pub const CUDA_DEVICE_ENV: &str = "REFIT_CUDA_DEVICE";

impl LinkOptions {
    /// The token of `self.token`, else the node's, else the environment's.
    ///
    /// # Errors
    /// As [`ClusterToken::from_env`].
    pub fn token_or_env(&self) -> Result<Option<ClusterToken>> {
        if let Some(t) = &self.token {
            return Ok(Some(t.clone()));
        }
        if let Some(n) = &self.node {
            return Ok(Some(n.token().clone()));
        }
        Ok(ClusterToken::from_env()?)
    }

    /// The CUDA device of this end: [`LinkOptions::device`], else [`CUDA_DEVICE_ENV`], else 0.
    ///
    /// # Errors
    /// [`Error::Config`] when the variable is set but is not a device ordinal.
    pub fn cuda_device(&self) -> Result<usize> {
        if let Some(d) = self.device {
            return Ok(d);
        }
        match std::env::var(CUDA_DEVICE_ENV) {
            Ok(v) => v.trim().parse().map_err(|_| {
                Error::Config(format!(
                    "{CUDA_DEVICE_ENV}={v:?} is not a CUDA device ordinal (0, 1, ...)"
                ))
            }),
            Err(_) => Ok(0),
        }
    }
}

/// Where a transport's versions live between its two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkMemory {
    /// Host memory (shared segments, arenas, files, sockets).
    Host,
    /// GPU memory: the link exists in every build, but opens only in one with the `cuda`
    /// feature, on a process with a usable device (and NCCL loaded, when `nccl`).
    Gpu {
        /// The link needs NCCL beside the driver.
        nccl: bool,
    },
}

/// What a transport is, as data: each [`LinkFactory`] answers one, and the factory's
/// descriptive calls read it.
#[derive(Debug, Clone, Copy)]
pub struct LinkTraits {
    /// The name users write (`--transports`, `[links]`), lowercase.
    pub name: &'static str,
    /// One line for help texts.
    pub about: &'static str,
    /// How far apart its two ends may be.
    pub reach: Reach,
    /// True when each receiver holds the weights in memory of its own (as opposed to
    /// sharing the sender's) with default [`LinkOptions`]: `refit bench` caps its sizes for
    /// such transports.
    pub receivers_copy: bool,
    /// Where versions move.
    pub memory: LinkMemory,
}

/// One transport as the factory sees it: what it is ([`LinkTraits`]), and how to open a
/// sender end and connect receiver ends from a [`ReceiverSpec`].
pub trait LinkFactory: Send + Sync + 'static {
    /// What the transport is.
    fn traits(&self) -> &'static LinkTraits;
    /// The name users write (`--transports`, `[links]`), lowercase.
    fn name(&self) -> &'static str {
        self.traits().name
    }
    /// One line for help texts.
    fn about(&self) -> &'static str {
        self.traits().about
    }
    /// How far apart its two ends may be.
    fn reach(&self) -> Reach {
        self.traits().reach
    }
    /// As [`LinkTraits::receivers_copy`].
    fn receivers_copy(&self) -> bool {
        self.traits().receivers_copy
    }
    /// True when versions move through GPU memory: `refit bench` sets such a link against a
    /// device-to-device copy of the same bytes, measured in the same run.
    fn on_device(&self) -> bool {
        matches!(self.traits().memory, LinkMemory::Gpu { .. })
    }
    /// Whether this build carries the transport. The links behind a cargo feature (`nccl`
    /// and `cuda-ipc` need `cuda`) exist in every build, so names resolve everywhere; without
    /// their feature they answer here with the reason and how to build with it, and
    /// [`reach_of`] (what topology validation asks) refuses them with it.
    ///
    /// # Errors
    /// [`Error::Transport`] naming the transport, the missing feature and how to build it.
    fn built(&self) -> Result<()> {
        match self.traits().memory {
            LinkMemory::Host => Ok(()),
            LinkMemory::Gpu { .. } => crate::gpu::link_built(self.name()),
        }
    }
    /// Whether this process can open the transport now: [`LinkFactory::built`], and for GPU
    /// links a usable GPU (the probe's answer). `open` and `receiver` fail with the same
    /// error; `refit probe` and `refit bench` print it.
    ///
    /// # Errors
    /// As [`LinkFactory::built`]; the probe's reason (no driver, no device, no NCCL).
    fn usable(&self, options: &LinkOptions) -> Result<()> {
        match self.traits().memory {
            LinkMemory::Host => self.built(),
            LinkMemory::Gpu { nccl } => crate::gpu::link_usable(self.name(), options, nccl),
        }
    }
    /// Opens the sender end for `manifests`, once [`LinkFactory::usable`] said yes; nothing
    /// is published yet.
    ///
    /// # Errors
    /// As [`LinkFactory::usable`]; the transport's setup errors (a segment that cannot be
    /// created, a port that cannot be bound, a directory that cannot be written).
    fn open(&self, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
        self.usable(options)?;
        self.sender_end(manifests, options)
    }
    /// A receiver end for `spec`, to connect with
    /// [`ReceiverInit`](refit_runtime::ReceiverInit), once the spec was found to be this
    /// transport's and [`LinkFactory::usable`] said yes.
    ///
    /// # Errors
    /// A spec of another transport, naming both; as [`LinkFactory::usable`]; a spec this
    /// transport cannot decode, a missing token, a link that cannot reach this process.
    fn receiver(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>> {
        spec.check_named(self.name())?;
        self.usable(options)?;
        self.receiver_end(spec, options)
    }
    /// What [`LinkFactory::open`] does past its checks: the transport's own sender end.
    ///
    /// # Errors
    /// The transport's setup errors.
    fn sender_end(&self, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink>;
    /// What [`LinkFactory::receiver`] does past its checks: the transport's own receiver
    /// end for `spec`.
    ///
    /// # Errors
    /// A spec this transport cannot decode, a missing token, a link that cannot reach this
    /// process.
    fn receiver_end(
        &self,
        spec: &ReceiverSpec,
        options: &LinkOptions,
    ) -> Result<Box<dyn ReceiverTransport>>;
}

impl std::fmt::Debug for dyn LinkFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LinkFactory({})", self.name())
    }
}

/// The names of every transport, comma-separated (for help and error texts).
pub fn known() -> String {
    LINKS
        .iter()
        .map(|l| l.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The transport called `name` (case-insensitive, surrounding spaces ignored).
///
/// # Errors
/// [`Error::Config`] naming `name` and every known transport.
pub fn find(name: &str) -> Result<&'static dyn LinkFactory> {
    let wanted = name.trim();
    LINKS
        .iter()
        .copied()
        .find(|l| l.name().eq_ignore_ascii_case(wanted))
        .ok_or_else(|| Error::Config(format!("unknown transport `{wanted}` (known: {})", known())))
}

/// Parses a comma-separated list of names (`tcp,shm`), each once, in the order written.
///
/// # Errors
/// As [`find`] for the first unknown name; [`Error::Config`] for an empty list.
pub fn parse_list(names: &str) -> Result<Vec<&'static dyn LinkFactory>> {
    let mut out: Vec<&'static dyn LinkFactory> = Vec::new();
    for n in names.split(',').filter(|n| !n.trim().is_empty()) {
        let l = find(n)?;
        if !out.iter().any(|o| o.name() == l.name()) {
            out.push(l);
        }
    }
    if out.is_empty() {
        return Err(Error::Config(format!(
            "no transport named (known: {})",
            known()
        )));
    }
    Ok(out)
}

/// The transport of a topology link ([`Topology::weights_transport`]): the one it names,
/// or for `auto` the first registered transport of exactly the reach the link needs
/// (in-process, then shared memory, then TCP with today's registry).
///
/// [`Topology::weights_transport`]: refit_runtime::topology::Topology::weights_transport
///
/// # Errors
/// As [`find`]; [`Error::Config`] when no transport has the reach.
pub fn for_kind(kind: &TransportKind) -> Result<&'static dyn LinkFactory> {
    match kind {
        TransportKind::Named(name) => find(name),
        TransportKind::Nearest(reach) => LINKS
            .iter()
            .copied()
            .find(|l| l.reach() == *reach)
            .ok_or_else(|| {
                Error::Config(format!("no transport reaches {reach} (known: {})", known()))
            }),
    }
}

/// The reach of the transport called `name`: what
/// [`Topology::check_links`](refit_runtime::topology::Topology::check_links) asks. A
/// transport this build does not carry (a GPU link without the `cuda` feature) is refused
/// with [`LinkFactory::built`]'s reason.
///
/// # Errors
/// As [`find`] and [`LinkFactory::built`].
pub fn reach_of(name: &str) -> Result<Reach> {
    let link = find(name)?;
    link.built()?;
    Ok(link.reach())
}

/// Opens the sender end of the transport called `name`.
///
/// # Errors
/// As [`find`] and [`LinkFactory::open`].
pub fn open(name: &str, manifests: &Manifests, options: &LinkOptions) -> Result<OpenedLink> {
    find(name)?.open(manifests, options)
}

/// A sender end just opened, and what its receivers need.
pub struct OpenedLink {
    /// The sending end, to connect with [`SenderInit`](refit_runtime::SenderInit).
    pub sender: Box<dyn SenderTransport>,
    /// What receivers connect with; ship it anywhere.
    pub spec: ReceiverSpec,
    /// Files and directories the link made that must go at the end of the run, whatever
    /// happens to the sender's owner (see [`OpenedLink::cleanup`]).
    pub leftovers: Vec<PathBuf>,
}

impl std::fmt::Debug for OpenedLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedLink")
            .field("sender", &self.sender.name())
            .field("spec", &self.spec)
            .field("leftovers", &self.leftovers)
            .finish()
    }
}

impl OpenedLink {
    /// Removes `paths` (files or directories, as in [`OpenedLink::leftovers`]); one already
    /// gone is fine, one that cannot be removed is logged.
    pub fn cleanup(paths: &[PathBuf]) {
        for p in paths {
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
            match removed {
                Ok(()) => tracing::debug!(path = %p.display(), "removed a link's leftover"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(path = %p.display(), "cannot remove a link's leftover: {e}")
                }
            }
        }
    }
}

/// A sender end that removes paths it owns (a directory the factory made for it) once it
/// is dropped, after the end itself.
pub struct RemoveOnDrop<T: SenderTransport> {
    inner: T,
    paths: Vec<PathBuf>,
}

impl<T: SenderTransport> RemoveOnDrop<T> {
    /// `inner`, then `paths` removed when this drops.
    pub fn new(inner: T, paths: Vec<PathBuf>) -> Self {
        Self { inner, paths }
    }
}

impl<T: SenderTransport> std::fmt::Debug for RemoveOnDrop<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoveOnDrop")
            .field("inner", &self.inner.name())
            .field("paths", &self.paths)
            .finish()
    }
}

impl<T: SenderTransport> Drop for RemoveOnDrop<T> {
    fn drop(&mut self) {
        let _ = self.inner.shutdown();
        OpenedLink::cleanup(&self.paths);
    }
}

impl<T: SenderTransport> SenderTransport for RemoveOnDrop<T> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn connect(&mut self, initial: &refit_runtime::Group, deadline: Instant) -> Result<()> {
        self.inner.connect(initial, deadline)
    }
    fn publish(&mut self, group: &refit_runtime::Group, deadline: Instant) -> Result<()> {
        self.inner.publish(group, deadline)
    }
    fn wait_acks(
        &mut self,
        entries: &[(refit_runtime::ModelId, refit_runtime::Version)],
        deadline: Instant,
    ) -> Result<()> {
        self.inner.wait_acks(entries, deadline)
    }
    fn shutdown(&mut self) -> Result<()> {
        self.inner.shutdown()
    }
}

/// What a receiver needs to connect to one sender end: the transport's name and its own
/// description (msgpack inside), plus a line for people. Serde makes it travel; it holds no
/// secret.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReceiverSpec {
    transport: String,
    #[serde(with = "serde_bytes")]
    params: Vec<u8>,
    about: String,
}

impl std::fmt::Debug for ReceiverSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverSpec")
            .field("transport", &self.transport)
            .field("about", &self.about)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Display for ReceiverSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.transport, self.about)
    }
}

impl ReceiverSpec {
    /// The spec of a `transport` end described by `params` (its own serde type, which must
    /// hold no secret); `about` is a line for logs (`board /dev/shm/...`).
    ///
    /// # Errors
    /// [`Error::Wire`] when `params` cannot be encoded.
    pub fn new<P: Serialize>(
        transport: &dyn LinkFactory,
        params: &P,
        about: impl Into<String>,
    ) -> Result<Self> {
        Ok(Self {
            transport: transport.name().to_owned(),
            params: wire::encode(params)?,
            about: about.into(),
        })
    }

    /// The transport's name.
    pub fn transport(&self) -> &str {
        &self.transport
    }

    /// The factory of its transport.
    ///
    /// # Errors
    /// As [`find`]: a spec from a process that knows a transport this one does not.
    pub fn link(&self) -> Result<&'static dyn LinkFactory> {
        find(&self.transport)
    }

    /// The transport's own description, for the factory that made it.
    ///
    /// # Errors
    /// [`Error::Config`] naming the transport when the description does not decode as `P`.
    pub fn params<P: DeserializeOwned>(&self) -> Result<P> {
        wire::decode(&self.params, wire::MAX_CONTROL_MESSAGE).map_err(|e| {
            Error::Config(format!(
                "a {} receiver spec that does not decode: {e}",
                self.transport
            ))
        })
    }

    /// A receiver end for this spec, made by its transport's factory.
    ///
    /// # Errors
    /// As [`ReceiverSpec::link`] and [`LinkFactory::receiver`].
    pub fn receiver(&self, options: &LinkOptions) -> Result<Box<dyn ReceiverTransport>> {
        self.link()?.receiver(self, options)
    }

    /// The spec as one line of hex text (for argv or the environment).
    ///
    /// # Errors
    /// [`Error::Wire`] when it cannot be encoded.
    pub fn to_token(&self) -> Result<String> {
        wire::to_token(self)
    }

    /// The spec from [`ReceiverSpec::to_token`]'s text.
    ///
    /// # Errors
    /// [`Error::Wire`] for text that is not such a line, calling it a receiver spec.
    pub fn from_token(token: &str) -> Result<Self> {
        wire::from_text(token, "receiver spec")
    }

    /// Refuses a spec made by another factory than `link`.
    ///
    /// # Errors
    /// [`Error::Config`] naming both transports.
    pub fn check_transport(&self, link: &dyn LinkFactory) -> Result<()> {
        self.check_named(link.name())
    }

    fn check_named(&self, transport: &str) -> Result<()> {
        if self.transport == transport {
            Ok(())
        } else {
            Err(Error::Config(format!(
                "a {} receiver spec handed to the {transport} transport",
                self.transport
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_lowercase_and_found() {
        for (i, l) in LINKS.iter().enumerate() {
            assert_eq!(l.name(), l.name().to_lowercase());
            assert!(
                LINKS[..i].iter().all(|o| o.name() != l.name()),
                "{}",
                l.name()
            );
            assert_eq!(find(l.name()).unwrap().name(), l.name());
            assert_eq!(
                find(&format!(" {} ", l.name().to_uppercase()))
                    .unwrap()
                    .name(),
                l.name()
            );
        }
    }

    #[test]
    fn unknown_names_are_refused_naming_the_known_ones() {
        let e = find("rdma").unwrap_err().to_string();
        assert!(e.contains("`rdma`"), "{e}");
        for l in LINKS {
            assert!(e.contains(l.name()), "{e}");
        }
        let e = parse_list("tcp,carrier-pigeon").unwrap_err().to_string();
        assert!(e.contains("carrier-pigeon") && e.contains("shm"), "{e}");
        assert!(parse_list(" , ").is_err());
        let l: Vec<_> = parse_list("tcp,shm,tcp").unwrap();
        assert_eq!(
            l.iter().map(|l| l.name()).collect::<Vec<_>>(),
            ["tcp", "shm"]
        );
    }

    #[test]
    fn topology_links_resolve_by_name_or_nearest_reach() {
        let named = TransportKind::Named("file".into());
        assert_eq!(for_kind(&named).unwrap().name(), "file");
        for (reach, name) in [
            (Reach::Process, "inproc"),
            (Reach::Host, "shm"),
            (Reach::Network, "tcp"),
        ] {
            assert_eq!(
                for_kind(&TransportKind::Nearest(reach)).unwrap().name(),
                name
            );
            assert_eq!(reach_of(name).unwrap(), reach);
        }
        let e = for_kind(&TransportKind::Named("rdma".into())).unwrap_err();
        assert!(e.to_string().contains("known: inproc"), "{e}");
    }

    /// The GPU links resolve by name in every build and are never what `auto` picks; their
    /// reach is checked, and without `cuda` `reach_of` refuses them with the reason.
    #[test]
    fn gpu_links_resolve_by_name_and_auto_never_picks_them() {
        for (name, reach) in [("nccl", Reach::Network), ("cuda-ipc", Reach::Host)] {
            let l = find(name).unwrap();
            assert_eq!(l.reach(), reach);
            let checked = reach_of(name);
            assert_eq!(checked.is_ok(), cfg!(feature = "cuda"), "{checked:?}");
            match checked {
                Ok(r) => assert_eq!(r, reach),
                Err(e) => {
                    let e = e.to_string();
                    assert!(
                        e.contains(name) && e.contains("not compiled with CUDA"),
                        "{e}"
                    );
                }
            }
            for r in [Reach::Process, Reach::Host, Reach::Network] {
                assert_ne!(for_kind(&TransportKind::Nearest(r)).unwrap().name(), name);
            }
        }
    }

    #[test]
    fn the_cuda_device_comes_from_the_options_or_the_environment() {
        let o = LinkOptions {
            device: Some(3),
            ..LinkOptions::default()
        };
        assert_eq!(o.cuda_device().unwrap(), 3);
        // (the variable is not set in the test environment)
        if std::env::var_os(CUDA_DEVICE_ENV).is_none() {
            assert_eq!(LinkOptions::default().cuda_device().unwrap(), 0);
        }
    }

    #[test]
    fn a_spec_for_another_transport_is_refused() {
        let spec = ReceiverSpec::new(&crate::shm::ShmLink, &7u32, "x").unwrap();
        let e = crate::tcp::TcpLink
            .receiver(&spec, &LinkOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("shm") && e.contains("tcp"), "{e}");
        let bad = ReceiverSpec {
            transport: "shm".into(),
            params: vec![0xc1],
            about: String::new(),
        };
        let e = bad
            .receiver(&LinkOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("shm") && e.contains("decode"), "{e}");
    }
}
