//! Remote actors: in-process (two nodes in one process) and across real processes.
//!
//! The process tests re-run this test binary (`std::env::current_exe()`) as the child
//! `child_serves_the_test_actor`, selected by `REFIT_REMOTE_CHILD=1`: the child serves
//! [`TestActor`] on a loopback node and prints `REFIT_REMOTE_READY <addr>`; run without that variable
//! that test returns at once.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use refit_actors::remote::{RemoteAddr, RemoteMessage, serve};
use refit_actors::{Error, RemoteFailure, Result};
use refit_node::{ClusterToken, Node};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

const CHILD_ENV: &str = "REFIT_REMOTE_CHILD";
const TARGET_ENV: &str = "REFIT_REMOTE_TARGET";
const TOKEN: &str = "remote-actor-test-token";
const ACTOR: &str = "test-actor";

// ---- the test actor and its messages ----

/// Adds two numbers.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct Add(u64, u64);
impl RemoteMessage for Add {
    const NAME: &'static str = "test.add";
}

/// Fails with a configuration error carrying the text.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct Fail(String);
impl RemoteMessage for Fail {
    const NAME: &'static str = "test.fail";
}

/// Answers `Error::Cancelled` with this generation.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct Cancel(u64);
impl RemoteMessage for Cancel {
    const NAME: &'static str = "test.cancel";
}

/// Never answers (the handler sleeps an hour).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<()>")]
struct Hang;
impl RemoteMessage for Hang {
    const NAME: &'static str = "test.hang";
}

/// Counts calls; answers a plain `u64` (no room for an error).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "u64")]
struct Bump;
impl RemoteMessage for Bump {
    const NAME: &'static str = "test.bump";
}

/// Sleeps this many milliseconds, then counts a call as `Bump` does.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "u64")]
struct SlowBump(u64);
impl RemoteMessage for SlowBump {
    const NAME: &'static str = "test.slow_bump";
}

/// Appends its number to the actor's log (fire and forget).
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
struct Record(u64);
impl RemoteMessage for Record {
    const NAME: &'static str = "test.record";
}

/// Answers the numbers `Record` appended, in the order they were handled.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Vec<u64>")]
struct Log;
impl RemoteMessage for Log {
    const NAME: &'static str = "test.log";
}

/// Stops the actor.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "()")]
struct Stop;
impl RemoteMessage for Stop {
    const NAME: &'static str = "test.stop";
}

/// Sent under `Add`'s name with another shape: the server cannot decode it.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct AddWrongShape {
    text: String,
}
impl RemoteMessage for AddWrongShape {
    const NAME: &'static str = "test.add";
}

/// A message the server does not serve.
#[derive(Debug, Message, Serialize, Deserialize)]
#[rtype(result = "Result<u64>")]
struct Unknown;
impl RemoteMessage for Unknown {
    const NAME: &'static str = "test.unknown";
}

#[derive(Default)]
struct TestActor {
    bumps: u64,
    log: Vec<u64>,
}

impl Handler<SlowBump> for TestActor {
    type Result = ResponseActFuture<Self, u64>;
    fn handle(&mut self, SlowBump(ms): SlowBump, _: &mut Context<Self>) -> Self::Result {
        Box::pin(
            actix_rt::time::sleep(Duration::from_millis(ms))
                .into_actor(self)
                .map(|(), act, _| {
                    act.bumps += 1;
                    act.bumps
                }),
        )
    }
}

impl Handler<Record> for TestActor {
    type Result = ();
    fn handle(&mut self, Record(n): Record, _: &mut Context<Self>) {
        self.log.push(n);
    }
}

impl Handler<Log> for TestActor {
    type Result = MessageResult<Log>;
    fn handle(&mut self, _: Log, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.log.clone())
    }
}

impl Actor for TestActor {
    type Context = Context<Self>;
}

impl Handler<Add> for TestActor {
    type Result = Result<u64>;
    fn handle(&mut self, Add(a, b): Add, _: &mut Context<Self>) -> Result<u64> {
        Ok(a + b)
    }
}

impl Handler<Fail> for TestActor {
    type Result = Result<u64>;
    fn handle(&mut self, Fail(why): Fail, _: &mut Context<Self>) -> Result<u64> {
        Err(Error::Config(why))
    }
}

impl Handler<Cancel> for TestActor {
    type Result = Result<u64>;
    fn handle(&mut self, Cancel(epoch): Cancel, _: &mut Context<Self>) -> Result<u64> {
        Err(Error::Cancelled { epoch })
    }
}

impl Handler<Hang> for TestActor {
    type Result = ResponseFuture<Result<()>>;
    fn handle(&mut self, _: Hang, _: &mut Context<Self>) -> Self::Result {
        Box::pin(async {
            actix_rt::time::sleep(Duration::from_secs(3600)).await;
            Ok(())
        })
    }
}

impl Handler<Bump> for TestActor {
    type Result = u64;
    fn handle(&mut self, _: Bump, _: &mut Context<Self>) -> u64 {
        self.bumps += 1;
        self.bumps
    }
}

impl Handler<Stop> for TestActor {
    type Result = ();
    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

/// Serves every message of a started `TestActor` on `node` under `target`.
fn serve_test_actor(node: &Node, target: Uuid, addr: &Addr<TestActor>) {
    serve::<Add>(node, target, addr.clone().recipient());
    serve::<Fail>(node, target, addr.clone().recipient());
    serve::<Cancel>(node, target, addr.clone().recipient());
    serve::<Hang>(node, target, addr.clone().recipient());
    serve::<Bump>(node, target, addr.clone().recipient());
    serve::<Stop>(node, target, addr.clone().recipient());
    serve::<Record>(node, target, addr.clone().recipient());
    serve::<SlowBump>(node, target, addr.clone().recipient());
    serve::<Log>(node, target, addr.clone().recipient());
}

fn token() -> ClusterToken {
    ClusterToken::new(TOKEN).expect("a valid test token")
}

/// The failure of a remote call, checking that the error names the actor and the message.
fn failure_of(e: &Error, message: &str) -> RemoteFailure {
    match e {
        Error::Remote {
            actor,
            message: m,
            failure,
        } => {
            assert_eq!(actor, ACTOR, "{e}");
            assert_eq!(*m, message, "{e}");
            let text = e.to_string();
            assert!(text.contains(ACTOR) && text.contains(message), "{text}");
            failure.clone()
        }
        other => panic!("expected a remote error of `{message}`, got {other}"),
    }
}

/// Round trip, typed answered errors, refusals that leave the server serving, a plain
/// answer through `send` and through a proxy `Recipient`.
async fn check_calls(remote: &RemoteAddr) {
    assert_eq!(remote.send(Add(2, 3)).await.unwrap().unwrap(), 5);

    // an error the actor answers comes back typed, naming actor and message
    let e = remote
        .send(Fail("no such knob".into()))
        .await
        .unwrap()
        .unwrap_err();
    match failure_of(&e, "test.fail") {
        RemoteFailure::Failed { error } => assert!(error.contains("no such knob"), "{error}"),
        other => panic!("expected Failed, got {other:?}"),
    }
    // `Cancelled` keeps its variant (rollouts branch on it)
    let e = remote.send(Cancel(7)).await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Cancelled { epoch: 7 }), "{e}");

    // a message the node does not serve, and one it cannot decode, are refused...
    let e = remote.send(Unknown).await.unwrap_err();
    assert!(
        matches!(
            failure_of(&e, "test.unknown"),
            RemoteFailure::Refused { .. }
        ),
        "{e}"
    );
    let e = remote
        .send(AddWrongShape { text: "x".into() })
        .await
        .unwrap_err();
    match failure_of(&e, "test.add") {
        RemoteFailure::Refused { reason } => assert!(reason.contains("test.add"), "{reason}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    // ... and so are raw bytes that are not msgpack at all
    let raw = remote
        .peer()
        .call_raw_async(
            remote.target(),
            "test.add",
            vec![0xc1, 0xff],
            remote.deadline(),
        )
        .await;
    assert!(raw.is_err(), "garbage was accepted");
    // the server still serves
    assert_eq!(remote.send(Add(40, 2)).await.unwrap().unwrap(), 42);

    // a plain answer, directly and through a proxy recipient
    let first = remote.send(Bump).await.unwrap();
    let bump: Recipient<Bump> = remote.recipient();
    assert_eq!(bump.send(Bump).await.unwrap(), first + 1);
    let add: Recipient<Add> = remote.recipient();
    assert_eq!(add.send(Add(1, 1)).await.unwrap().unwrap(), 2);
}

/// A hung handler hits the caller's deadline, naming actor and message.
async fn check_deadline(remote: &RemoteAddr) {
    let deadline = Duration::from_millis(500);
    let t = Instant::now();
    let e = remote.send_within(Hang, deadline).await.unwrap_err();
    let took = t.elapsed();
    assert!(
        matches!(failure_of(&e, "test.hang"), RemoteFailure::Timeout { after } if after == deadline),
        "{e}"
    );
    assert!(took >= deadline, "gave up early: {took:?}");
    assert!(took < deadline + Duration::from_secs(10), "took {took:?}");
    // the same through a proxy recipient: the error is the answer
    let hang: Recipient<Hang> = remote.clone().with_deadline(deadline).recipient();
    let e = hang.send(Hang).await.unwrap().unwrap_err();
    assert!(
        matches!(failure_of(&e, "test.hang"), RemoteFailure::Timeout { .. }),
        "{e}"
    );
}

// ---- in process: two nodes ----

/// A server node with the test actor and a client handle to it, in this process.
fn in_process<F, Fut>(body: F)
where
    F: FnOnce(Node, Addr<TestActor>, RemoteAddr) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let server = Node::loopback(token()).unwrap();
    let client = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async move {
        let target = Uuid::new_v4();
        let actor = TestActor::default().start();
        serve_test_actor(&server, target, &actor);
        let remote = RemoteAddr::connect(
            &client,
            server.addr(),
            target,
            ACTOR,
            Duration::from_secs(20),
        )
        .await
        .unwrap();
        // the body gets clones: the node and the actor live until it is done
        body(server.clone(), actor.clone(), remote).await;
        drop((server, actor));
    });
}

#[test]
fn in_process_round_trip_errors_and_refusals() {
    in_process(|_server, _actor, remote| async move { check_calls(&remote).await });
}

#[test]
fn in_process_hung_handler_hits_the_deadline() {
    in_process(|_server, _actor, remote| async move { check_deadline(&remote).await });
}

#[test]
fn in_process_concurrent_calls_each_get_their_own_answer() {
    in_process(|_server, _actor, remote| async move {
        let calls: Vec<_> = (0..64u64)
            .map(|i| {
                let remote = remote.clone();
                actix_rt::spawn(async move { (i, remote.send(Add(i, 1000 * i)).await) })
            })
            .collect();
        for call in calls {
            let (i, answer) = call.await.unwrap();
            assert_eq!(answer.unwrap().unwrap(), 1001 * i);
        }
    });
}

/// One sender's calls reach the actor in the order they were sent, even when none waits
/// for the previous one's answer (the node decodes each call and puts it in the actor's
/// mailbox as its frame arrives). Below the mailbox's capacity (16): a call that finds it
/// full waits for room.
#[test]
fn in_process_calls_of_one_sender_are_handled_in_order() {
    in_process(|_server, _actor, remote| async move {
        for round in 0..20u64 {
            let record = remote.recipient::<Record>();
            for i in 0..12 {
                record.do_send(Record(round * 100 + i));
            }
            // the log is asked on another path: wait until the round is in
            let deadline = Instant::now() + Duration::from_secs(10);
            let log = loop {
                let log = remote.send(Log).await.unwrap();
                if log.len() as u64 == (round + 1) * 12 {
                    break log;
                }
                assert!(Instant::now() < deadline, "round {round}: {log:?}");
                actix_rt::time::sleep(Duration::from_millis(5)).await;
            };
            let sent: Vec<u64> = (0..12).map(|i| round * 100 + i).collect();
            assert_eq!(log[log.len() - 12..], sent[..], "round {round}");
        }
    });
}

/// A call is handled at most once: nothing retries it. One whose deadline passes while the
/// actor works on it fails with a timeout at the caller, and the actor still finishes it,
/// once: the next count shows exactly one more.
#[test]
fn in_process_a_call_past_its_deadline_is_handled_once_not_retried() {
    in_process(|_server, _actor, remote| async move {
        let before = remote.send(Bump).await.unwrap();
        let late = remote
            .send_within(SlowBump(300), Duration::from_millis(50))
            .await;
        assert!(
            matches!(
                late.as_ref().map_err(|e| failure_of(e, "test.slow_bump")),
                Err(RemoteFailure::Timeout { .. })
            ),
            "{late:?}"
        );
        actix_rt::time::sleep(Duration::from_millis(600)).await;
        let after = remote.send(Bump).await.unwrap();
        assert_eq!(
            after,
            before + 2,
            "the late call was handled {} times",
            after - before - 1
        );
    });
}

#[test]
fn in_process_stopped_actor_is_a_typed_error() {
    in_process(|_server, _actor, remote| async move {
        remote.send(Stop).await.unwrap();
        // the mailbox closes once the actor has stopped
        let t = Instant::now();
        let e = loop {
            match remote.send(Add(1, 2)).await {
                Err(e) => break e,
                Ok(_) if t.elapsed() < Duration::from_secs(10) => {
                    actix_rt::time::sleep(Duration::from_millis(10)).await;
                }
                Ok(_) => panic!("the actor still answers after Stop"),
            }
        };
        assert!(
            matches!(
                failure_of(&e, "test.add"),
                RemoteFailure::ActorStopped { .. }
            ),
            "{e}"
        );
    });
}

#[test]
fn in_process_node_shutdown_fails_pending_calls() {
    in_process(|server, _actor, remote| async move {
        let pending = actix_rt::spawn({
            let remote = remote.clone();
            async move { remote.send_within(Hang, Duration::from_secs(60)).await }
        });
        actix_rt::time::sleep(Duration::from_millis(200)).await;
        let t = Instant::now();
        server.shutdown();
        let e = pending.await.unwrap().unwrap_err();
        assert!(
            matches!(failure_of(&e, "test.hang"), RemoteFailure::PeerGone { .. }),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    });
}

// ---- across processes ----

/// The child side of the process tests (a no-op unless `REFIT_REMOTE_CHILD=1`): serves the
/// test actor and prints `REFIT_REMOTE_READY <addr>`; exits when its stdin closes (the parent is gone)
/// or after two minutes.
#[test]
fn child_serves_the_test_actor() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("1") {
        return;
    }
    let target: Uuid = std::env::var(TARGET_ENV)
        .expect("the parent names the target")
        .parse()
        .expect("a uuid");
    std::thread::spawn(|| {
        // the parent holds our stdin: end of file means it is gone
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        std::process::exit(0);
    });
    let node = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async move {
        let actor = TestActor::default().start();
        serve_test_actor(&node, target, &actor);
        println!("\nREFIT_REMOTE_READY {}", node.addr());
        actix_rt::time::sleep(Duration::from_secs(120)).await;
    });
}

/// A child process serving the test actor; killed and reaped on drop.
struct ServerProcess {
    child: Child,
    addr: std::net::SocketAddr,
    target: Uuid,
}

impl ServerProcess {
    fn start() -> Self {
        let target = Uuid::new_v4();
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_serves_the_test_actor",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            .env(TARGET_ENV, target.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout)
                .lines()
                .map_while(std::io::Result::ok)
            {
                // libtest may print on the same line before it
                if let Some((_, addr)) = line.split_once("REFIT_REMOTE_READY ") {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a.parse().unwrap(),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child did not report its address: {e}");
            }
        };
        Self {
            child,
            addr,
            target,
        }
    }

    async fn connect(&self, client: &Node) -> RemoteAddr {
        RemoteAddr::connect(
            client,
            self.addr,
            self.target,
            ACTOR,
            Duration::from_secs(20),
        )
        .await
        .unwrap()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn process_round_trip_errors_and_refusals() {
    let server = ServerProcess::start();
    let client = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async {
        let remote = server.connect(&client).await;
        check_calls(&remote).await;
    });
}

#[test]
fn process_hung_handler_hits_the_deadline() {
    let server = ServerProcess::start();
    let client = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async {
        let remote = server.connect(&client).await;
        check_deadline(&remote).await;
        // the server is still serving after the cut-off call
        assert_eq!(remote.send(Add(1, 2)).await.unwrap().unwrap(), 3);
    });
}

#[test]
fn process_killed_actor_fails_within_the_deadline() {
    let mut server = ServerProcess::start();
    let client = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async {
        let remote = server.connect(&client).await;
        let bump: Recipient<Bump> = remote.recipient();
        let add: Recipient<Add> = remote.recipient();
        assert_eq!(bump.send(Bump).await.unwrap(), 1);
        let deadline = Duration::from_secs(60);
        let pending = actix_rt::spawn({
            let remote = remote.clone();
            async move { remote.send_within(Hang, deadline).await }
        });
        actix_rt::time::sleep(Duration::from_millis(300)).await;
        let t = Instant::now();
        server.kill();
        // the call in flight fails as soon as the connection drops, long before its deadline
        let e = pending.await.unwrap().unwrap_err();
        let took = t.elapsed();
        assert!(
            matches!(failure_of(&e, "test.hang"), RemoteFailure::PeerGone { .. }),
            "{e}"
        );
        assert!(took < Duration::from_secs(10), "noticed after {took:?}");
        // later calls fail at once, directly and through proxies
        let t = Instant::now();
        let e = remote.send(Add(1, 2)).await.unwrap_err();
        assert!(
            matches!(failure_of(&e, "test.add"), RemoteFailure::PeerGone { .. }),
            "{e}"
        );
        let e = add.send(Add(1, 2)).await.unwrap().unwrap_err();
        assert!(
            matches!(failure_of(&e, "test.add"), RemoteFailure::PeerGone { .. }),
            "{e}"
        );
        // a plain answer cannot hold the error: the proxy drops the reply, as a stopped
        // local actor would
        assert_eq!(bump.send(Bump).await, Err(MailboxError::Closed));
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    });
}

/// Code written against `Recipient`s, unaware of where the actor runs.
async fn use_counter(add: Recipient<Add>, bump: Recipient<Bump>) -> (u64, Vec<u64>) {
    let mut sum = 0;
    for i in 0..10 {
        sum = add.send(Add(sum, i)).await.unwrap().unwrap();
    }
    let mut bumps = Vec::new();
    for _ in 0..3 {
        bumps.push(bump.send(Bump).await.unwrap());
    }
    (sum, bumps)
}

#[test]
fn process_recipient_proxy_is_used_like_a_local_actor() {
    let server = ServerProcess::start();
    let client = Node::loopback(token()).unwrap();
    actix::System::new().block_on(async {
        let local = TestActor::default().start();
        let expected = use_counter(local.clone().recipient(), local.recipient()).await;
        assert_eq!(expected, (45, vec![1, 2, 3]));
        let remote = server.connect(&client).await;
        let got = use_counter(remote.recipient(), remote.recipient()).await;
        assert_eq!(got, expected);
    });
}

// ---- the framework's actors across nodes ----

mod framework {
    use std::sync::Arc;
    use std::time::Duration;

    use actix::prelude::*;
    use refit_actors::MlpPolicy;
    use refit_actors::actor::{
        ActBatch, AwaitSynced, CancelInFlight, CheckRollout, GetStatus, InferenceEngine,
        ServedVersions, VersionNotifier, WeightSyncController,
    };
    use refit_actors::protocol::{ControllerRef, EngineRef};
    use refit_actors::remote::RemoteAddr;
    use refit_node::Node;
    use refit_runtime::sync_policy::{Decision, SyncConfig, SyncMode};
    use refit_runtime::{
        Manifests, ModelId, Receiver, ReceiverInit, Sender, SenderInit, Version, WeightSet,
    };
    use refit_transports::inproc::{InProc, InProcReceiver, InProcSender};
    use uuid::Uuid;

    const SIZES: [usize; 3] = [4, 16, 2];

    fn weights(model: &ModelId, version: u64) -> WeightSet {
        let m = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
        refit_runtime::testing::filled(model, &m, version, version as f32 / 100.0)
    }

    /// A trainer's sender and the engine's receiver of one model, in process.
    fn scheme(model: &ModelId) -> (Sender<InProcSender>, Receiver<InProcReceiver>) {
        let manifest = Arc::new(MlpPolicy::manifest_for(&SIZES).unwrap());
        let manifests = Manifests::new([(model.clone(), manifest)]).unwrap();
        let hub = InProc::new();
        let receiver = ReceiverInit::new(hub.receiver(), Some(manifests.clone()));
        let r = std::thread::spawn(move || receiver.connect(Duration::from_secs(5)).unwrap());
        let sender = SenderInit::new(hub.sender().unwrap(), manifests)
            .connect(vec![weights(model, 1)], Duration::from_secs(5))
            .unwrap();
        (sender, r.join().unwrap())
    }

    /// The controller drives an engine served by another node through an `EngineRef` of
    /// proxies (`UpdateModel` is `_receive_weights_scheme` on the wire, then the engine's
    /// inlet pulls); the controller itself is asked for its status over the network.
    #[test]
    fn a_controller_drives_an_engine_on_another_node() {
        let engine_node = Node::loopback(super::token()).unwrap();
        let ctl_node = Node::loopback(super::token()).unwrap();
        actix::System::new().block_on(async move {
            let m = ModelId::new("policy").unwrap();
            let (mut sender, receiver) = scheme(&m);
            let engine = InferenceEngine::empty(1)
                .with_model(
                    m.clone(),
                    MlpPolicy::new(&SIZES).unwrap(),
                    Some(Box::new(receiver)),
                )
                .unwrap()
                .start();
            let engine_id = Uuid::new_v4();
            // its weight plane and its actions, under one target
            refit_actors::protocol::engine::EngineHandle::acting(&engine)
                .serve(&engine_node, engine_id);

            let wait = Duration::from_secs(20);
            let remote_engine =
                RemoteAddr::connect(&ctl_node, engine_node.addr(), engine_id, "engine-0", wait)
                    .await
                    .unwrap();
            let handle = EngineRef::remote(&remote_engine);
            let cfg = SyncConfig::with_mode(SyncMode::FullyAsync);
            let ctl = WeightSyncController::new(&cfg, vec![m.clone()], vec![handle], None)
                .unwrap()
                .start();
            let ctl_id = Uuid::new_v4();
            ControllerRef::local(&ctl).serve(&ctl_node, ctl_id);

            let mut notifier = VersionNotifier::new(ctl.clone(), m.clone(), cfg.clone());
            for v in 1..=3 {
                if v > 1 {
                    let _pending = sender.send_async(vec![weights(&m, v)]).unwrap();
                }
                notifier.notify(Version(v)).await.unwrap();
                notifier.flush().await.unwrap();
                let landed = ctl
                    .send(AwaitSynced {
                        model: m.clone(),
                        version: Version(v),
                    })
                    .await
                    .unwrap()
                    .unwrap();
                assert_eq!(landed, Version(v));
            }
            // the engine serves v3, as seen over the network ...
            let served = remote_engine.send(ServedVersions).await.unwrap();
            assert_eq!(served[&m], Version(3));
            let acted = remote_engine
                .send(ActBatch {
                    model: m.clone(),
                    obs: vec![0.0; 8],
                    epoch: None,
                    greedy: true,
                })
                .await
                .unwrap()
                .unwrap();
            assert_eq!((acted.actions.len(), acted.version), (2, Version(3)));
            // ... and by the controller, asked from the engine's node
            let remote_ctl =
                RemoteAddr::connect(&engine_node, ctl_node.addr(), ctl_id, "controller", wait)
                    .await
                    .unwrap();
            let status = remote_ctl.send(GetStatus).await.unwrap();
            let s = &status.models[&m];
            assert_eq!((s.rollout_version, s.loads), (Version(3), 3), "{s:?}");
            assert_eq!(s.state.as_str(), "running");
            assert_eq!(status.events, ctl.send(GetStatus).await.unwrap().events);
            let check = remote_ctl
                .send(CheckRollout { model: m.clone() })
                .await
                .unwrap()
                .unwrap();
            assert_eq!(check, Decision::Continue { staleness: 0 });
            // a cancellation crosses too and answers the new generation
            let epoch = remote_engine.send(CancelInFlight).await.unwrap();
            let stale = remote_engine
                .send(ActBatch {
                    model: m.clone(),
                    obs: vec![0.0; 4],
                    epoch: Some(epoch - 1),
                    greedy: true,
                })
                .await
                .unwrap();
            assert!(
                matches!(stale, Err(refit_actors::Error::Cancelled { .. })),
                "{stale:?}"
            );
        });
    }
}
