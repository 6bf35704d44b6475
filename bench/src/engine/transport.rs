//! The transport alone: the engine's bytes published through a link of the factory and
//! fetched by its receiver through the inlet an engine uses, with no engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::{Manifests, ReceiverInit, SenderInit, WeightSet};
use refit_transports::link::{self, LinkOptions, OpenedLink};

use super::WAIT;
use refit_actors::link::WeightInlet;
use refit_actors::{Error, Result};

/// The transport alone, one sample per update.
#[derive(Clone, Debug, PartialEq)]
pub struct TransportFigures {
    /// The link's name.
    pub link: String,
    /// The sender's publish of a version (until receivers can see it).
    pub publish: Vec<Duration>,
    /// The receiver's fetch of it through [`WeightInlet::fetch`] (found, checked, held).
    pub fetch: Vec<Duration>,
}

impl TransportFigures {
    /// Publish plus fetch of each update: what moving the bytes took.
    pub fn moved(&self) -> Vec<Duration> {
        self.publish
            .iter()
            .zip(&self.fetch)
            .map(|(p, f)| *p + *f)
            .collect()
    }
}

/// A connected sender and the receiver it feeds.
type Pair<S> = (
    refit_runtime::Sender<S>,
    refit_runtime::Receiver<Box<dyn refit_runtime::ReceiverTransport>>,
);

/// Connects a receiver of `opened` (on a thread: a sender may wait for it) and the sender
/// with `initial`.
pub(super) fn connect_pair<S: refit_runtime::SenderTransport + 'static>(
    link: &str,
    sender: S,
    spec: &link::ReceiverSpec,
    source: Manifests,
    wire: &Manifests,
    initial: WeightSet,
) -> Result<Pair<S>> {
    let receiver = spec.receiver(&LinkOptions::default())?;
    let expected = wire.clone();
    let connecting =
        std::thread::spawn(move || ReceiverInit::new(receiver, Some(expected)).connect(WAIT));
    let sender = SenderInit::new(sender, source)
        .with_ack_timeout(WAIT)
        .connect(vec![initial], WAIT);
    let receiver = connecting
        .join()
        .map_err(|_| Error::Actor(format!("the {link} receiver's connect thread panicked")))?;
    let named = |e: refit_runtime::Error| Error::Config(format!("connecting over {link}: {e}"));
    Ok((sender.map_err(named)?, receiver.map_err(named)?))
}

/// Publishes and fetches `updates` versions of `wire` (after `warmup` untimed ones) through
/// `link`; every version views `wire`'s arena (no copy made by the bench).
pub(super) fn measure(
    link_name: &str,
    wire: &Arc<WeightSet>,
    manifests: &Manifests,
    warmup: usize,
    updates: usize,
) -> Result<TransportFigures> {
    let model = wire.model().clone();
    let options = LinkOptions {
        expected_receivers: 1,
        ..LinkOptions::default()
    };
    let opened = link::open(link_name, manifests, &options)?;
    let leftovers = opened.leftovers.clone();
    let result = (|| {
        let (mut sender, mut receiver) = connect_pair(
            link_name,
            opened.sender,
            &opened.spec,
            manifests.clone(),
            manifests,
            wire.view_as(wire.version())?,
        )?;
        let mut figures = TransportFigures {
            link: link_name.to_owned(),
            publish: Vec::with_capacity(updates),
            fetch: Vec::with_capacity(updates),
        };
        let mut version = wire.version();
        for i in 0..warmup + updates {
            version = version.next();
            let ws = Arc::new(wire.view_as(version)?);
            let t0 = Instant::now();
            let pending = sender.publish_shared(vec![ws])?;
            let t1 = Instant::now();
            let fetched = receiver.fetch(&model, version, WAIT)?;
            let t2 = Instant::now();
            if fetched.version() != version {
                return Err(Error::Actor(format!(
                    "the {link_name} receiver fetched version {} of model `{model}`, not {version}",
                    fetched.version()
                )));
            }
            drop(fetched);
            receiver.applied(&model, version)?;
            sender.wait(&pending, WAIT)?;
            if i >= warmup {
                figures.publish.push(t1 - t0);
                figures.fetch.push(t2 - t1);
            }
        }
        sender.shutdown()?;
        drop(receiver);
        Ok(figures)
    })();
    OpenedLink::cleanup(&leftovers);
    result
}
