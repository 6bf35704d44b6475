//! Shard 0 and its shards as actors of one process (local references; the wire form of the
//! messages is the remote tests' business): a version assembled from every shard, and the
//! updates a shard fails, named, with the previous version still the last published.
#![allow(clippy::unwrap_used)]

use std::sync::Mutex;

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use refit_runtime::{DType, Manifest, ModelId, Version, WeightSet};

use super::assembly::Assembly;
use super::lead::ShardLead;
use super::member::{LeadLink, Publish, ShardMember};
use crate::actor::Trainer;
use crate::batch::Batch;
use crate::error::{Error, Result};
use crate::learner::{LearnStats, Learner};
use crate::link::WeightOutlet;
use crate::protocol::trainer::{AssemblyRef, ShardRef, ShardWritten, TrainAndPublish, TrainShard};

fn id() -> ModelId {
    ModelId::new("policy").unwrap()
}

fn manifest() -> Arc<Manifest> {
    refit_runtime::testing::manifest(&[
        ("w1", DType::F32, &[4, 64]),
        ("b1", DType::F32, &[64]),
        ("w2", DType::F32, &[64, 2]),
    ])
}

/// A learner whose every exported byte depends on its shard and version.
struct Fake {
    shard: u8,
    version: Version,
    /// Blocks this long in updates that export this version or later.
    stall: Option<(Version, Duration)>,
}

impl Fake {
    /// At version `at` (1: as after the first export of setting up).
    fn boxed(shard: u8, at: u64) -> Box<dyn Learner> {
        Box::new(Self {
            shard,
            version: Version(at),
            stall: None,
        })
    }
}

fn byte(shard: u8, version: Version, i: usize) -> u8 {
    (i as u64)
        .wrapping_mul(13)
        .wrapping_add(version.0 * 5 + u64::from(shard) * 71) as u8
}

impl Learner for Fake {
    fn update(&mut self, _: &Batch) -> refit_rl::Result<LearnStats> {
        if let Some((from, pause)) = self.stall
            && self.version.next() >= from
        {
            std::thread::sleep(pause);
        }
        Ok(LearnStats::new().with("shard", f64::from(self.shard)))
    }
    fn export(&mut self) -> refit_rl::Result<WeightSet> {
        self.version = self.version.next();
        let mut ws = WeightSet::zeroed(id(), manifest());
        ws.set_version(self.version);
        for (i, b) in ws.bytes_mut()?.iter_mut().enumerate() {
            *b = byte(self.shard, self.version, i);
        }
        Ok(ws)
    }
    fn manifest(&self) -> Arc<Manifest> {
        manifest()
    }
    fn version(&self) -> Version {
        self.version
    }
}

/// Keeps every version published.
#[derive(Clone, Default)]
struct Published(Arc<Mutex<Vec<Arc<WeightSet>>>>);

impl WeightOutlet for Published {
    fn publish(&mut self, weights: Arc<WeightSet>) -> refit_runtime::Result<Version> {
        let v = weights.version();
        self.0.lock().unwrap().push(weights);
        Ok(v)
    }
}

impl Published {
    fn versions(&self) -> Vec<Version> {
        self.0.lock().unwrap().iter().map(|w| w.version()).collect()
    }
}

/// A shard that is gone: its actor stops as soon as it starts.
struct Gone;

impl Actor for Gone {
    type Context = Context<Self>;
    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

impl Handler<TrainShard> for Gone {
    type Result = Result<ShardWritten>;
    fn handle(&mut self, _: TrainShard, _: &mut Context<Self>) -> Self::Result {
        Err(Error::Actor("a stopped actor answered".into()))
    }
}

/// Shard 0 (rank 10, learning with `lead`) and one shard per entry of `members` (ranks 11,
/// 12, ...): each a learner, or `None` for a shard that is gone.
fn sharded(
    lead: Box<dyn Learner>,
    members: Vec<Option<Box<dyn Learner>>>,
    deadline: Duration,
) -> (Addr<ShardLead>, Published) {
    let published = Published::default();
    let outlet = published.clone();
    let world = members.len() + 1;
    let ranks: Vec<u32> = (10..10 + world as u32).collect();
    let addr = ShardLead::create(move |ctx| {
        let me = ctx.address();
        let refs = members
            .into_iter()
            .enumerate()
            .map(|(i, learner)| match learner {
                Some(l) => ShardRef::local(
                    &ShardMember::new(
                        id(),
                        (i + 1, world, ranks[i + 1]),
                        Trainer::hosting(l, None),
                        Publish::Lead(LeadLink::Ready(AssemblyRef::local(&me))),
                        deadline,
                    )
                    .start(),
                ),
                None => ShardRef::local(&Gone.start()),
            })
            .collect();
        let assembly = Assembly::new(id(), manifest(), ranks, Version(1)).unwrap();
        ShardLead::new(
            assembly,
            Trainer::hosting(lead, Some(Box::new(outlet))),
            refs,
            (deadline, false),
        )
    });
    (addr, published)
}

async fn update(lead: &Addr<ShardLead>) -> Result<(LearnStats, Version)> {
    lead.send(TrainAndPublish {
        batch: Batch::default(),
    })
    .await
    .unwrap()
}

fn shard_of(e: &Error) -> (Version, usize, u32, &str) {
    match e {
        Error::Shard {
            version,
            shard,
            rank,
            reason,
            ..
        } => (*version, *shard, *rank, reason),
        other => panic!("not a shard error: {other}"),
    }
}

#[actix_rt::test]
async fn three_shards_publish_versions_assembled_from_every_shard() {
    let (lead, published) = sharded(
        Fake::boxed(0, 1),
        vec![Some(Fake::boxed(1, 1)), Some(Fake::boxed(2, 1))],
        Duration::from_secs(30),
    );
    for expected in [2, 3] {
        let (stats, v) = update(&lead).await.unwrap();
        assert_eq!(v, Version(expected));
        assert_eq!(stats.values["shard"], 0.0, "shard 0's statistics");
    }
    assert_eq!(published.versions(), vec![Version(2), Version(3)]);
    let v3 = published.0.lock().unwrap()[1].clone();
    let total = manifest().total_len();
    let cut = total.div_ceil(3).div_ceil(64) * 64;
    for (i, b) in v3.bytes().iter().enumerate() {
        let shard = (i / cut) as u8;
        assert_eq!(
            *b,
            byte(shard, Version(3), i),
            "byte {i} comes from shard {shard}"
        );
    }
}

#[actix_rt::test]
async fn a_shard_exporting_another_version_fails_the_update_naming_it() {
    let (lead, published) = sharded(
        Fake::boxed(0, 1),
        vec![Some(Fake::boxed(1, 1)), Some(Fake::boxed(2, 2))],
        Duration::from_secs(30),
    );
    let e = update(&lead).await.unwrap_err();
    let (v, s, r, why) = shard_of(&e);
    assert_eq!((v, s, r), (Version(2), 2, 12), "{e}");
    assert!(why.contains("exported version 3"), "{e}");
    assert!(published.versions().is_empty(), "nothing published");
}

#[actix_rt::test]
async fn a_shard_past_the_deadline_fails_the_update_and_the_last_version_stays() {
    let slow = Box::new(Fake {
        shard: 1,
        version: Version(1),
        stall: Some((Version(3), Duration::from_secs(3))),
    });
    let (lead, published) = sharded(
        Fake::boxed(0, 1),
        vec![Some(slow)],
        Duration::from_millis(500),
    );
    assert_eq!(update(&lead).await.unwrap().1, Version(2));
    let e = update(&lead).await.unwrap_err();
    let (v, s, r, why) = shard_of(&e);
    assert_eq!((v, s, r), (Version(3), 1, 11), "{e}");
    assert!(
        why.contains("missed the deadline") || why.contains("did not answer"),
        "{e}"
    );
    assert_eq!(published.versions(), vec![Version(2)]);
}

#[actix_rt::test]
async fn a_gone_shard_fails_the_update_naming_it() {
    let (lead, published) = sharded(
        Fake::boxed(0, 1),
        vec![Some(Fake::boxed(1, 1)), None],
        Duration::from_secs(30),
    );
    let e = update(&lead).await.unwrap_err();
    let (v, s, r, why) = shard_of(&e);
    assert_eq!((v, s, r), (Version(2), 2, 12), "{e}");
    assert!(why.contains("is gone"), "{e}");
    assert!(published.versions().is_empty());
}
