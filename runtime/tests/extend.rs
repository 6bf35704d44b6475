//! Extending Refit, as the book's architecture page shows it: a transport of one's own (a
//! pair of std channels, one receiver) and a strategy of one's own (a model that keeps its
//! parameters as `f64` and ships them as one `f32` tensor), driven through the whole scheme
//! lifecycle with nothing but the core crate.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use refit_runtime::wait::{Wait, poll_until, wait_until};
use refit_runtime::{
    DType, Error, Group, Manifest, Manifests, ModelId, ReceiverInit, ReceiverTransport, Result,
    SenderInit, SenderTransport, Strategy, Version, WeightSet,
};

// ANCHOR: mailbox_transport
/// What travels from the sender to its receiver.
#[derive(Debug)]
enum Down {
    /// The manifests, once, at connect.
    Hello(Manifests),
    /// One atomic group of weight sets.
    Group(Group),
}

/// The sending end: one channel down, one channel of acknowledgements up.
#[derive(Debug)]
struct MailSender {
    manifests: Manifests,
    down: mpsc::Sender<Down>,
    up: mpsc::Receiver<Vec<(ModelId, Version)>>,
    acked: BTreeSet<(ModelId, Version)>,
}

/// The receiving end.
#[derive(Debug)]
struct MailReceiver {
    down: mpsc::Receiver<Down>,
    up: mpsc::Sender<Vec<(ModelId, Version)>>,
}

/// A connected pair of ends for models of `manifests` (`init`: local, nothing is sent yet).
fn mailbox(manifests: Manifests) -> (MailSender, MailReceiver) {
    let (down_tx, down_rx) = mpsc::channel();
    let (up_tx, up_rx) = mpsc::channel();
    let sender = MailSender {
        manifests,
        down: down_tx,
        up: up_rx,
        acked: BTreeSet::new(),
    };
    (
        sender,
        MailReceiver {
            down: down_rx,
            up: up_tx,
        },
    )
}

fn gone(who: &str) -> Error {
    Error::PeerGone {
        peer: format!("mailbox {who}"),
        reason: "its channel closed".into(),
    }
}

impl SenderTransport for MailSender {
    fn name(&self) -> &'static str {
        "mailbox"
    }

    fn connect(&mut self, initial: &Group, deadline: Instant) -> Result<()> {
        self.down
            .send(Down::Hello(self.manifests.clone()))
            .map_err(|_| gone("receiver"))?;
        self.publish(initial, deadline)
    }

    fn publish(&mut self, group: &Group, _deadline: Instant) -> Result<()> {
        // a pointer copy per weight set: the receiver shares the sender's arenas
        self.down
            .send(Down::Group(group.clone()))
            .map_err(|_| gone("receiver"))
    }

    fn wait_acks(&mut self, entries: &[(ModelId, Version)], deadline: Instant) -> Result<()> {
        let (up, acked) = (&self.up, &mut self.acked);
        // the core's deadline wait: look, park until the next ack or the deadline, look again
        wait_until(
            deadline,
            None,
            |arrived: &mut Option<Vec<_>>| {
                acked.extend(arrived.take().unwrap_or_default());
                let closed = loop {
                    match up.try_recv() {
                        Ok(more) => acked.extend(more),
                        Err(mpsc::TryRecvError::Empty) => break false,
                        Err(mpsc::TryRecvError::Disconnected) => break true,
                    }
                };
                let missing: Vec<_> = entries.iter().filter(|e| !acked.contains(e)).collect();
                match (missing.is_empty(), closed) {
                    (true, _) => Ok(Wait::Done(())),
                    (false, true) => Err(gone("receiver")),
                    (false, false) => Ok(Wait::Pending(format!("{missing:?}"))),
                }
            },
            |_, left| up.recv_timeout(left).ok(),
            |missing| format!("the mailbox receiver to acknowledge {missing}"),
        )
    }

    fn shutdown(&mut self) -> Result<()> {
        Ok(()) // the channels close when the ends drop
    }
}

impl ReceiverTransport for MailReceiver {
    fn name(&self) -> &'static str {
        "mailbox"
    }

    fn connect(&mut self, deadline: Instant) -> Result<Manifests> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.down.recv_timeout(left) {
            Ok(Down::Hello(m)) => Ok(m),
            Ok(Down::Group(_)) => Err(Error::Wire("weights before the manifests".into())),
            Err(RecvTimeoutError::Timeout) => Err(Error::Timeout {
                what: "the mailbox sender's manifests".into(),
                after: left,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(gone("sender")),
        }
    }

    fn next_group(&mut self, deadline: Instant) -> Result<Option<Group>> {
        let down = &self.down;
        poll_until(
            deadline,
            None,
            |parked: &mut Option<std::result::Result<Down, RecvTimeoutError>>| {
                let next = parked
                    .take()
                    .unwrap_or_else(|| down.recv_timeout(Duration::ZERO));
                match next {
                    Ok(Down::Group(g)) => Ok(Wait::Done(g)),
                    Ok(Down::Hello(_)) => Err(Error::Wire("manifests sent twice".into())),
                    Err(RecvTimeoutError::Timeout) => Ok(Wait::Pending(())),
                    Err(RecvTimeoutError::Disconnected) => Err(gone("sender")),
                }
            },
            |_, left| Some(down.recv_timeout(left)),
        )
    }

    fn ack(&mut self, applied: &[(ModelId, Version)]) -> Result<()> {
        self.up.send(applied.to_vec()).map_err(|_| gone("sender"))
    }

    fn shutdown(&mut self) -> Result<()> {
        Ok(())
    }
}
// ANCHOR_END: mailbox_transport

// ANCHOR: own_strategy
/// A model that keeps its parameters in `f64`.
struct Critic {
    w: Vec<f64>,
}

/// Ships a [`Critic`] as one `f32` tensor `w`, all or nothing.
struct F32Wire;

impl Strategy<Critic> for F32Wire {
    fn manifest(&self, model: &Critic) -> Result<Manifest> {
        Manifest::builder()
            .tensor("w", DType::F32, &[model.w.len()])
            .build()
    }

    fn extract(&self, model: &Critic, out: &mut WeightSet) -> Result<()> {
        let w = out.view_mut::<f32>("w")?;
        same_len(w, model)?;
        for (dst, src) in w.iter_mut().zip(&model.w) {
            *dst = *src as f32;
        }
        Ok(())
    }

    fn apply(&self, weights: &WeightSet, model: &mut Critic) -> Result<()> {
        let w = weights.view::<f32>("w")?;
        // checked before anything is written: the model stays as it was
        same_len(w, model)?;
        model.w = w.iter().map(|x| f64::from(*x)).collect();
        Ok(())
    }
}

fn same_len(w: &[f32], model: &Critic) -> Result<()> {
    if w.len() == model.w.len() {
        return Ok(());
    }
    Err(Error::Strategy(format!(
        "tensor `w` holds {} values, the critic {}",
        w.len(),
        model.w.len()
    )))
}
// ANCHOR_END: own_strategy

const T: Duration = Duration::from_secs(20);

fn export(strategy: &F32Wire, model: &Critic, version: u64) -> WeightSet {
    let manifest = Arc::new(strategy.manifest(model).unwrap());
    let mut ws = WeightSet::zeroed(ModelId::new("critic").unwrap(), manifest);
    strategy.extract(model, &mut ws).unwrap();
    ws.set_version(Version(version));
    ws
}

#[test]
fn an_own_transport_and_strategy_run_the_whole_lifecycle() {
    let strategy = F32Wire;
    let trainer = Critic {
        w: vec![0.5, -1.25, 3.0],
    };
    let first = export(&strategy, &trainer, 1);
    let manifests =
        Manifests::new([(first.model().clone(), Arc::clone(first.manifest()))]).unwrap();

    // init (local) on both ends, then connect: manifests agreed, version 1 delivered and acked
    let (tx, rx) = mailbox(manifests.clone());
    let expected = manifests.clone();
    let engine = std::thread::spawn(move || ReceiverInit::new(rx, Some(expected)).connect(T));
    let mut sender = SenderInit::new(tx, manifests)
        .with_ack_timeout(T)
        .connect(vec![first], T)
        .unwrap();
    let mut receiver = engine.join().unwrap().unwrap();
    let mut served = Critic { w: vec![0.0; 3] };
    let critic = ModelId::new("critic").unwrap();
    strategy
        .apply(&receiver.current(&critic).unwrap(), &mut served)
        .unwrap();
    assert_eq!(served.w, trainer.w);

    // send version 2 while the receiver takes it on its own thread; acks come back
    let trainer = Critic {
        w: vec![1.0, 2.0, -0.125],
    };
    let next = export(&strategy, &trainer, 2);
    let engine = std::thread::spawn(move || {
        let update = receiver
            .receive(T)
            .unwrap()
            .expect("version 2 within the deadline");
        (receiver, update.entries())
    });
    assert_eq!(
        sender.send(next).unwrap(),
        vec![(critic.clone(), Version(2))]
    );
    let (mut receiver, entries) = engine.join().unwrap();
    assert_eq!(entries, vec![(critic.clone(), Version(2))]);
    strategy
        .apply(&receiver.current(&critic).unwrap(), &mut served)
        .unwrap();
    assert_eq!(served.w, trainer.w);

    // a stale version is refused by the core's protocol, whatever the transport
    let stale = export(&strategy, &trainer, 2);
    assert!(matches!(
        sender.send(stale),
        Err(Error::StaleVersion { .. })
    ));

    // nothing new before the deadline is `None`, not an error
    assert!(
        receiver
            .receive(Duration::from_millis(50))
            .unwrap()
            .is_none()
    );

    // a weight set of another size is refused by the strategy; the model keeps its weights
    let mut small = Critic { w: vec![0.0; 2] };
    let err = strategy
        .apply(&receiver.current(&critic).unwrap(), &mut small)
        .unwrap_err();
    assert!(err.to_string().contains("tensor `w`"), "{err}");
    assert_eq!(small.w, vec![0.0; 2]);

    // a dead sender is an error on the receiver, never a hang
    drop(sender);
    let t = Instant::now();
    let err = receiver.receive(T).unwrap_err();
    assert!(matches!(err, Error::PeerGone { .. }), "{err}");
    assert!(t.elapsed() < T, "the receiver waited out its deadline");
}

#[test]
fn an_own_transport_reports_a_missing_ack_as_a_timeout() {
    let strategy = F32Wire;
    let model = Critic { w: vec![1.0] };
    let first = export(&strategy, &model, 1);
    let manifests =
        Manifests::new([(first.model().clone(), Arc::clone(first.manifest()))]).unwrap();
    let (tx, rx) = mailbox(manifests.clone());
    // the receiver end exists (the channel stays open) but never acknowledges
    let err = SenderInit::new(tx, manifests)
        .connect(vec![first], Duration::from_millis(200))
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(err.to_string().contains("acknowledge"), "{err}");
    drop(rx);
}
