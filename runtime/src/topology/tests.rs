use super::*;
use crate::sync_policy::SyncMode;

const BASE: &str = r#"
[run]
command = ["prog", "topology"]
on_failure = "continue"
seed = 7
wait_s = 30.0

[sync]
sync_mode = "batch-async"
staleness_threshold = 2
validate_freq = 5
[sync.timeouts]
load_s = 10.0

[stop]
target_return = 475.0
max_updates = 500
max_time_s = 300.0

[[model]]
id = "policy"
[model.params]
batch_frames = 2048

[[model]]
id = "critic"

[[host]]
name = "a"
addr = "10.77.0.1"

[[host]]
name = "b"
addr = "10.77.0.2"

[[process]]
name = "learner"
host = "a"
roles = ["trainer", "controller", "evaluator"]

[[process]]
name = "near"
host = "a"
roles = ["engine", "rollout"]
rollout_workers = 3

[[process]]
name = "far"
host = "b"
replicas = 2
roles = ["engine", "rollout"]

[links]
weights = "auto"
"#;

/// A minimal one-host file with `extra` appended.
fn small(extra: &str) -> String {
    format!(
        r#"
[run]
command = ["prog"]
[[model]]
id = "policy"
[[process]]
name = "learner"
roles = ["trainer", "controller"]
[[process]]
name = "actor"
replicas = 2
roles = ["engine", "rollout"]
{extra}"#
    )
}

/// The error for `text`, asserting it is a topology error naming `key` and containing
/// every one of `words`.
/// What a caller with a link factory knows of three transports (the real factory lives in
/// `refit-transports`; the runtime only asks).
fn reach_of(name: &str) -> Result<Reach> {
    match name {
        "inproc" => Ok(Reach::Process),
        "shm" => Ok(Reach::Host),
        "tcp" => Ok(Reach::Network),
        other => Err(Error::Config(format!(
            "unknown transport `{other}` (known: inproc, shm, tcp)"
        ))),
    }
}

/// Parsed, and its links checked against [`reach_of`].
fn checked(text: &str) -> Result<Topology> {
    let t = Topology::parse(text)?;
    t.check_links(reach_of)?;
    Ok(t)
}

fn refused(text: &str, key: &str, words: &[&str]) -> String {
    let e = checked(text).expect_err("the file must be refused");
    let Error::Topology { key: k, reason } = &e else {
        panic!("not a topology error: {e}");
    };
    assert_eq!(k, key, "{e}");
    let msg = e.to_string();
    for w in words {
        assert!(msg.contains(w), "{w:?} not in: {msg}");
    }
    assert!(!reason.is_empty());
    msg
}

#[test]
fn full_file_parses_into_sections_and_ranks() {
    let t = Topology::parse(BASE).unwrap();
    assert_eq!(t.run.command, ["prog", "topology"]);
    assert_eq!(t.run.on_failure, OnFailure::Continue);
    assert_eq!(t.run.seed, 7);
    assert_eq!(t.wait(), Duration::from_secs(30));
    assert_eq!(t.sync.sync_mode, SyncMode::BatchAsync);
    assert_eq!(t.sync.validate_freq, 5);
    assert_eq!(t.sync.timeouts.load_s, 10.0);
    assert_eq!(t.sync.models, t.model_ids());
    assert_eq!(t.model_ids().len(), 2);
    assert_eq!(t.model_ids()[0].as_str(), "policy");
    assert_eq!(t.model_ids()[1].as_str(), "critic");
    let policy = t.model(&t.model_ids()[0]).unwrap();
    assert_eq!(policy.params["batch_frames"].as_integer(), Some(2048));
    assert_eq!(t.stop().target_return, Some(475.0));
    assert_eq!(t.stop().max_updates, Some(500));
    assert_eq!(t.world_size(), 4);
    assert_eq!(t.master_host().unwrap(), "10.77.0.1");
    let r0 = t.rank(0).unwrap();
    assert_eq!(
        (r0.process.as_str(), r0.replica, r0.host.name.as_str()),
        ("learner", 0, "a")
    );
    assert_eq!(r0.roles, [Role::Trainer, Role::Controller, Role::Evaluator]);
    assert_eq!(r0.rollout_workers, 0);
    let r1 = t.rank(1).unwrap();
    assert_eq!((r1.process.as_str(), r1.rollout_workers), ("near", 3));
    let r3 = t.rank(3).unwrap();
    assert_eq!(
        (r3.process.as_str(), r3.replica, r3.host.address().unwrap()),
        ("far", 1, "10.77.0.2")
    );
    // no count of its own: the model's `params.workers`, else 1
    assert_eq!(r3.rollout_workers, 0);
    assert_eq!(t.rollout_workers(3, &t.model_ids()[0]), 1);
    assert_eq!(t.rollout_workers(1, &t.model_ids()[0]), 3);
    assert_eq!(t.rollout_workers(0, &t.model_ids()[0]), 0);
    assert_eq!(t.engine_ranks(), [1, 2, 3]);
    assert_eq!(t.ranks_with(Role::Evaluator), [0]);
    let e = t.rank(4).unwrap_err().to_string();
    assert!(
        e.contains("RANK") && e.contains('4') && e.contains("world size 4"),
        "{e}"
    );
}

#[test]
fn auto_resolves_by_placement() {
    let t = Topology::parse(BASE).unwrap();
    let nearest = TransportKind::Nearest;
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 0),
        nearest(Reach::Process)
    );
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 1),
        nearest(Reach::Host)
    );
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 2),
        nearest(Reach::Network)
    );
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 2, 3),
        nearest(Reach::Host)
    );
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 99),
        nearest(Reach::Network)
    );
}

#[test]
fn one_process_resolves_to_inproc_and_explicit_settings_are_kept() {
    let one = r#"
[run]
command = ["prog"]
[[model]]
id = "policy"
[[process]]
name = "all"
roles = ["trainer", "controller", "engine", "rollout"]
"#;
    let t = Topology::parse(one).unwrap();
    assert_eq!(t.world_size(), 1);
    assert_eq!(t.engine_ranks(), [0]);
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 0),
        TransportKind::Nearest(Reach::Process)
    );
    assert_eq!(t.hosts, [HostSection::local()]);
    assert_eq!(t.master_host().unwrap(), "127.0.0.1");
    let named = |n: &str| TransportKind::Named(n.into());
    let t = checked(&format!("{one}[links]\nweights = \"inproc\"\n")).unwrap();
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 0),
        named("inproc")
    );
    let t = checked(&small("[links]\nweights = \"tcp\"\n")).unwrap();
    assert_eq!(t.weights_transport(&t.model_ids()[0], 0, 1), named("tcp"));
    // names are the factory's, any case
    let t = checked(&small("[links]\nweights = \"SHM\"\n")).unwrap();
    assert_eq!(t.weights_transport(&t.model_ids()[0], 0, 2), named("shm"));
    assert!(!t.links.checksum, "the checksum is off unless asked for");
    let t = checked(&small("[links]\nweights = \"shm\"\nchecksum = true\n")).unwrap();
    assert!(t.links.checksum);
    assert_eq!(
        t.links.delta,
        Deltas::Buckets,
        "bucket deltas unless asked otherwise"
    );
    assert_eq!(
        t.links.sharded,
        Sharded::Gather,
        "shard 0 gathers unless asked"
    );
    let t = checked(&small("[links]\ndelta = \"elements\"\n")).unwrap();
    assert_eq!(t.links.delta, Deltas::Elements);
    let t = checked(&small("[links]\nsharded = \"mesh\"\n")).unwrap();
    assert_eq!(t.links.sharded, Sharded::Mesh);
    let e = checked(&small("[links]\nsharded = \"scatter\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("scatter") && e.contains("mesh"), "{e}");
    let e = checked(&small("[links]\ndelta = \"xor\"\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("xor") && e.contains("elements"), "{e}");
    // what engines verify of the weights they serve: off unless asked for
    assert_eq!(t.models[0].verify, Verify::Off);
    let with = |v: &str| {
        small("").replace(
            "id = \"policy\"\n",
            &format!("id = \"policy\"\nverify = {v}\n"),
        )
    };
    for v in [Verify::Names, Verify::Startup, Verify::Hashes] {
        let t = checked(&with(&format!("\"{}\"", v.as_str()))).unwrap();
        assert_eq!(t.models[0].verify, v);
    }
    let t = checked(&with("\"hashes\"")).unwrap();
    // a ladder: each value does what the ones before it do
    assert!(Verify::Off < Verify::Names && Verify::Names < Verify::Startup);
    assert!(Verify::Startup < Verify::Hashes);
    let e = checked(&with("\"sha\"")).unwrap_err().to_string();
    assert!(e.contains("startup") && e.contains("hashes"), "{e}");
    // how a version is committed across the engines: all, unless a quorum is asked for
    assert_eq!(t.models[0].commit, Commit::All);
    let commit = |v: &str| {
        small("").replace(
            "id = \"policy\"\n",
            &format!("id = \"policy\"\ncommit = {v}\n"),
        )
    };
    let t = checked(&commit("{ quorum = 1 }")).unwrap();
    assert_eq!(t.models[0].commit, Commit::Quorum(1));
    for (bad, says) in [
        ("{ quorum = 0 }", "model[policy].commit"),
        ("{ quorum = 9 }", "a quorum of 9 engines, but the model has"),
        ("\"most\"", "most"),
    ] {
        let e = checked(&commit(bad)).unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    // Defaults: one host, processes on it, abort, 60 s.
    let t = Topology::parse(&small("")).unwrap();
    assert_eq!(t.processes[1].host, "local");
    assert_eq!(t.run.on_failure, OnFailure::Abort);
    assert_eq!(t.wait(), Duration::from_secs(60));
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 1),
        TransportKind::Nearest(Reach::Host)
    );
    assert_eq!(t.sync.sync_mode, SyncMode::Sync);
}

#[test]
fn unknown_keys_are_named_with_their_table() {
    refused(
        &small("replicaz = 2\n"),
        "process[actor].replicaz",
        &["unknown field `replicaz`", "replicas"],
    );
    refused(
        &BASE.replace("seed = 7", "sead = 7"),
        "run.sead",
        &["unknown field `sead`"],
    );
    refused(
        &BASE.replace("load_s = 10.0", "load = 10.0"),
        "sync.timeouts.load",
        &["unknown field"],
    );
    refused(
        &BASE.replace("validate_freq = 5", "validate_frequency = 5"),
        "sync.validate_frequency",
        &["sync_mode"],
    );
    refused(
        &BASE.replace("max_updates", "max_update"),
        "stop.max_update",
        &["unknown field"],
    );
    refused(
        &BASE.replace("addr = \"10.77.0.2\"", "address = \"10.77.0.2\""),
        "host[b].address",
        &["unknown field"],
    );
    refused(
        &small("[links]\nweight = \"shm\"\n"),
        "links.weight",
        &["unknown field"],
    );
    refused(
        &small("[extra]\nx = 1\n"),
        "extra",
        &["unknown field `extra`"],
    );
    refused(
        &small("[[model]]\nid = \"v\"\nparam = 1\n"),
        "model[v].param",
        &["unknown field"],
    );
}

#[test]
fn unknown_values_are_named() {
    refused(
        &small("[links]\nweights = \"rdma\"\n"),
        "links.weights",
        &["unknown transport `rdma`", "inproc", "shm", "tcp"],
    );
    refused(
        &small("").replace("[\"engine\", \"rollout\"]", "[\"engine\", \"collector\"]"),
        "process[actor].roles",
        &["collector", "rollout"],
    );
    refused(
        &small("").replace(
            "command = [\"prog\"]",
            "command = [\"prog\"]\non_failure = \"retry\"",
        ),
        "run.on_failure",
        &["retry", "continue"],
    );
    refused(
        &BASE.replace("\"batch-async\"", "\"eventually\""),
        "sync.sync_mode",
        &["eventually"],
    );
    refused(
        &small("").replace("replicas = 2", "replicas = -1"),
        "process[actor].replicas",
        &["-1"],
    );
    refused("[run\ncommand = 1", "run", &["line"]);
}

#[test]
fn missing_sections_are_named() {
    refused("[[model]]\nid = \"p\"\n", "run", &["missing field `run`"]);
    refused(
        &small("").replace("command = [\"prog\"]", "seed = 1"),
        "run.command",
        &["empty", "process `learner` has no `command` of its own"],
    );
    refused(
        &small("").replace("command = [\"prog\"]", "command = []"),
        "run.command",
        &["empty"],
    );
    refused(
        &small("").replace("[[model]]\nid = \"policy\"\n", ""),
        "model",
        &["no [[model]]"],
    );
    refused(
        "[run]\ncommand = [\"p\"]\n[[model]]\nid = \"p\"\n",
        "process",
        &["no [[process]]"],
    );
    refused(
        &small("").replace("id = \"policy\"", "id = \"\""),
        "model[#1].id",
        &["empty"],
    );
}

#[test]
fn bad_values_are_named() {
    refused(
        &small("").replace("command = [\"prog\"]", "command = [\"prog\"]\nwait_s = 0.0"),
        "run.wait_s",
        &["positive"],
    );
    refused(
        &small("[stop]\nmax_time_s = -3.0\n"),
        "stop.max_time_s",
        &["-3"],
    );
    refused(
        &small("[stop]\nmax_updates = 0\n"),
        "stop.max_updates",
        &["at least 1"],
    );
    refused(
        &small("[sync]\nmodels = [\"x\"]\n"),
        "sync.models",
        &["[[model]]"],
    );
    refused(
        &small("[sync]\nsync_mode = \"batch-async\"\nstaleness_threshold = 0\n"),
        "sync",
        &["staleness_threshold"],
    );
    refused(
        &small("[sync.timeouts]\neval_s = 0.0\n"),
        "sync",
        &["timeouts.eval_s"],
    );
}

#[test]
fn duplicates_are_named() {
    refused(
        &small("[[model]]\nid = \"policy\"\n"),
        "model.id",
        &["model `policy` is declared twice"],
    );
    refused(
        &small("[[process]]\nname = \"actor\"\nroles = [\"engine\"]\n"),
        "process.name",
        &["process `actor` is declared twice"],
    );
    refused(
        &BASE.replace("name = \"b\"", "name = \"a\""),
        "host.name",
        &["host `a` is declared twice"],
    );
    refused(
        &small("").replace("[\"engine\", \"rollout\"]", "[\"engine\", \"engine\"]"),
        "process[actor].roles",
        &["`actor`", "`engine` twice"],
    );
}

#[test]
fn impossible_placements_are_refused_naming_the_process() {
    refused(
        &small("[links]\nweights = \"inproc\"\n"),
        "links.weights",
        &["`inproc`", "process `actor`", "another process"],
    );
    refused(
        &BASE.replace("weights = \"auto\"", "weights = \"shm\""),
        "links.weights",
        &["`shm`", "process `far`", "host `b`", "another host"],
    );
    refused(
        &small("").replace("[\"trainer\", \"controller\"]", "[\"trainer\"]"),
        "process[learner].roles",
        &["rank 0", "must hold `controller`"],
    );
    refused(
        &small("").replace("[\"trainer\", \"controller\"]", "[\"controller\"]"),
        "process.roles",
        &["no process holds the `trainer` role for model `policy`"],
    );
    refused(
        &small("").replace(
            "[\"engine\", \"rollout\"]",
            "[\"engine\", \"rollout\", \"controller\"]",
        ),
        "process[actor].roles",
        &["process `actor` holds `controller`", "`learner`"],
    );
    refused(
        &small("[[process]]\nname = \"t2\"\nroles = [\"trainer\"]\n"),
        "process[t2].roles",
        &["model `policy` is trained by processes `learner` and `t2`"],
    );
    refused(
        &small("").replace("name = \"learner\"", "name = \"learner\"\nreplicas = 2"),
        "process[learner].replicas",
        &["must run once"],
    );
    refused(
        &small("[[process]]\nname = \"judge\"\nroles = [\"evaluator\"]\n"),
        "process[judge].roles",
        &["`evaluator`", "rank 0"],
    );
    refused(
        &small("").replace("replicas = 2", "models = [\"critic\"]"),
        "process[actor].models",
        &["model `critic`", "not declared", "policy"],
    );
    refused(
        &small("").replace("replicas = 2", "models = []"),
        "process[actor].models",
        &["serves no model"],
    );
    refused(
        &small("").replace("replicas = 2", "models = [\"policy\", \"policy\"]"),
        "process[actor].models",
        &["twice"],
    );
    refused(
        &small("[[process]]\nname = \"t\"\nroles = [\"trainer\"]\n").replace(
            "[\"trainer\", \"controller\"]",
            "[\"controller\"]\nmodels = [\"policy\"]",
        ),
        "process[learner].models",
        &["without a trainer, engine or rollout role"],
    );
    refused(
        &small("").replace("name = \"actor\"", "name = \"actor\"\nhost = \"gpu9\""),
        "process[actor].host",
        &["`actor`", "`gpu9`", "not declared"],
    );
    refused(
        &BASE.replace("host = \"b\"\n", ""),
        "process[far].host",
        &["`far`", "names no host", "2 hosts"],
    );
    refused(
        &small("").replace("[\"engine\", \"rollout\"]", "[\"rollout\"]"),
        "process[actor].roles",
        &["`actor`", "`rollout` without an `engine`"],
    );
    refused(
        &small("").replace("[\"engine\", \"rollout\"]", "[\"trainer\"]\nmodels = []"),
        "process[actor].models",
        &["serves no model"],
    );
    refused(
        &small("")
            .replace(
                "\n[[process]]\nname = \"actor\"",
                "\n[[process]]\nname = \"actor\"\nmodels = [\"policy\"]",
            )
            .replace("[\"engine\", \"rollout\"]", "[\"trainer\"]")
            .replace("[\"trainer\", \"controller\"]", "[\"controller\"]"),
        "process.roles",
        &["no process holds the `engine` role for model `policy`"],
    );
    refused(
        &small("").replace("replicas = 2", "replicas = 0"),
        "process[actor].replicas",
        &["`actor`", "replicas = 0"],
    );
    refused(
        &small("").replace("replicas = 2", "replicas = 4000000000"),
        "process[actor].replicas",
        &["at most"],
    );
    refused(
        &small("").replace("replicas = 2", "rollout_workers = 0"),
        "process[actor].rollout_workers",
        &["`actor`", "rollout_workers = 0"],
    );
    refused(
        &small("").replace(
            "[\"trainer\", \"controller\"]",
            "[\"trainer\", \"controller\"]\nrollout_workers = 2",
        ),
        "process[learner].rollout_workers",
        &["without the `rollout` role"],
    );
    refused(
        &small("").replace("[\"trainer\", \"controller\"]", "[]"),
        "process[learner].roles",
        &["no roles"],
    );
    refused(
        &BASE.replace("addr = \"10.77.0.2\"", "addr = \"\""),
        "host[b].addr",
        &["not an address"],
    );
    refused(
        &small("").replace("name = \"actor\"", "name = \"an actor\""),
        "process.name",
        &["\"an actor\""],
    );
}

#[test]
fn placements_beyond_rank_0_parse_as_the_file_says() {
    // a trainer on a rank of its own, engines on rank 0 and elsewhere
    let t = checked(
        r#"
[run]
command = ["prog"]
[[model]]
id = "policy"
[[process]]
name = "lead"
roles = ["controller", "evaluator", "engine", "rollout"]
[[process]]
name = "learner"
roles = ["trainer"]
[[process]]
name = "actor"
roles = ["engine", "rollout"]
"#,
    )
    .unwrap();
    let p = t.model_ids()[0].clone();
    assert_eq!(t.trainer_ranks(&p), [1]);
    assert_eq!(t.engine_ranks_of(&p), [0, 2]);
    assert_eq!(
        t.weights_transport(&p, 1, 0),
        TransportKind::Nearest(Reach::Host)
    );
    // two models, each trained by its own process, one engine set; one model over TCP
    let t = checked(
        r#"
[run]
command = ["prog"]
[[model]]
id = "solver"
link = "tcp"
[[model]]
id = "verifier"
[[process]]
name = "lead"
roles = ["controller", "evaluator"]
[[process]]
name = "solver-trainer"
roles = ["trainer"]
models = ["solver"]
[[process]]
name = "verifier-trainer"
roles = ["trainer"]
models = ["verifier"]
[[process]]
name = "actor"
replicas = 2
roles = ["engine", "rollout"]
"#,
    )
    .unwrap();
    let (s, v) = (t.model_ids()[0].clone(), t.model_ids()[1].clone());
    assert_eq!(
        (t.trainer_ranks(&s), t.trainer_ranks(&v)),
        (vec![1], vec![2])
    );
    assert_eq!(t.engine_ranks_of(&s), [3, 4]);
    assert_eq!(
        t.weights_transport(&s, 1, 3),
        TransportKind::Named("tcp".into())
    );
    assert_eq!(
        t.weights_transport(&v, 2, 3),
        TransportKind::Nearest(Reach::Host)
    );
    assert!(t.rank(1).unwrap().serves(Role::Trainer, &s));
    assert!(!t.rank(1).unwrap().serves(Role::Trainer, &v));
    // a trainer process with replicas is a sharded trainer: its ranks, in order
    let t = checked(&small("").replace(
        "[\"trainer\", \"controller\"]",
        "[\"controller\"]\n[[process]]\nname = \"shards\"\nreplicas = 2\nroles = [\"trainer\"]",
    ))
    .unwrap();
    assert_eq!(t.trainer_ranks(&t.model_ids()[0]), [1, 2]);
    // a per-model link is checked against its own engines, named by its key
    refused(
        &small("").replace("id = \"policy\"", "id = \"policy\"\nlink = \"inproc\""),
        "model[policy].link",
        &["`inproc`", "model `policy`", "another process"],
    );
}

#[test]
fn conversions_keepalive_and_eval_targets_are_checked() {
    let convert = |rules: &str| {
        small("").replace(
            "id = \"policy\"",
            &format!("id = \"policy\"\n[model.convert]\n{rules}\n"),
        )
    };
    let t = checked(&convert(
        "layout = [{ fuse = [\"a.{i}.q\", \"a.{i}.k\"], to = \"a.{i}.qk\", axis = 0 }]\n\
         keep_unmatched = true\ncast = [{ dtype = \"f32\", to = \"bf16\" }]",
    ))
    .unwrap();
    assert!(t.models[0].convert.is_some());
    refused(
        &convert("layout = [{ rename = \"a\", keep = \"b\", to = \"c\" }]"),
        "model[policy].convert.layout[0]",
        &["exactly one of"],
    );
    refused(
        &convert("layout = [{ split = \"a\", to = \"b\" }]"),
        "model[policy].convert.layout[0]",
        &["list of names"],
    );
    refused(
        &convert("cast = [{ dtype = \"f33\", to = \"bf16\" }]"),
        "model[policy].convert.cast[0]",
        &["`f33`"],
    );
    refused(
        &convert("cast = [{ tensors = \"*\", to = \"int4\" }]"),
        "model[policy].convert.cast[0]",
        &["`int4`", "bf16"],
    );
    refused(
        &small("").replace(
            "command = [\"prog\"]",
            "command = [\"prog\"]\nkeepalive_s = 2.0\ndead_after_s = 1.0",
        ),
        "run.dead_after_s",
        &["more than run.keepalive_s"],
    );
    refused(
        &small("[stop]\ntarget_eval = nan\n"),
        "stop.target_eval",
        &["finite"],
    );
    let t = checked(&small("")).unwrap();
    assert_eq!(t.keepalive(), Duration::from_secs(1));
    assert_eq!(t.dead_after(), Duration::from_secs(5));
}

#[test]
fn file_errors_name_the_path() {
    let p = std::path::Path::new("conf/topo.toml");
    let e = Topology::parse_file(&small("[links]\nweights = 5\n"), p)
        .unwrap_err()
        .to_string();
    assert!(e.contains("conf/topo.toml") && e.contains("links"), "{e}");
    assert_eq!(Topology::parse_file(&small(""), p).unwrap().world_size(), 3);
}

#[test]
fn hosts_without_an_address_wait_for_the_scheduler() {
    let file = BASE.replace("addr = \"10.77.0.2\"\n", "");
    assert_ne!(file, BASE);
    let t = Topology::parse(&file).unwrap();
    let b = t.hosts.iter().find(|h| h.name == "b").unwrap();
    assert_eq!(b.addr, None);
    let e = b.address().unwrap_err().to_string();
    assert!(
        e.contains("`host[b].addr`")
            && e.contains("SLURM_STEP_NODELIST")
            && e.contains("REFIT_K8S_SERVICE")
            && e.contains("--set host.b.addr=ADDRESS"),
        "{e}"
    );
    // an override fills it, as the launcher's does
    let t =
        Topology::parse_with(&file, &[Override::parse("host[b].addr=\"node2\"").unwrap()]).unwrap();
    assert_eq!(
        t.hosts
            .iter()
            .find(|h| h.name == "b")
            .unwrap()
            .address()
            .unwrap(),
        "node2"
    );
}

#[test]
fn every_example_topology_parses() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/topologies");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let t = Topology::parse_file(&std::fs::read_to_string(&path).unwrap(), &path)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(t.world_size() >= 1);
            seen += 1;
        }
    }
    assert!(seen >= 1, "no topology in {}", dir.display());
    let t = Topology::parse(&std::fs::read_to_string(dir.join("reference.toml")).unwrap()).unwrap();
    assert_eq!(t.world_size(), 4);
    assert_eq!(t.engine_ranks(), [1, 2, 3]);
    assert_eq!(t.rank(3).unwrap().process, "judge");
    assert_eq!(
        t.weights_transport(&t.model_ids()[0], 0, 1),
        TransportKind::Nearest(Reach::Host)
    );
}

#[test]
fn launch_keys_of_a_process_reach_its_ranks() {
    let t = Topology::parse(&small(
        r#"command = ["engine-prog", "--fast"]
env = { CUDA_VISIBLE_DEVICES = "1", MODE = "x y" }
restart = "on-failure"
max_restarts = 5
bind = "0.0.0.0"
port = 41000
[[process]]
name = "judge"
roles = ["engine"]
restart = "on-failure"
"#,
    ))
    .unwrap();
    let (r0, r1, r2, r3) = (
        t.rank(0).unwrap(),
        t.rank(1).unwrap(),
        t.rank(2).unwrap(),
        t.rank(3).unwrap(),
    );
    // rank 0 keeps the defaults: `[run] command`, no env, never restarted, no bind or port
    assert_eq!(r0.command, ["prog"]);
    assert!(r0.env.is_empty());
    assert_eq!((r0.restart, r0.max_restarts), (Restart::Never, 0));
    assert_eq!((r0.bind, r0.port), (None, None));
    for (r, replica) in [(&r1, 0u16), (&r2, 1)] {
        assert_eq!(r.command, ["engine-prog", "--fast"]);
        assert_eq!(r.env["CUDA_VISIBLE_DEVICES"], "1");
        assert_eq!(r.env["MODE"], "x y");
        assert_eq!((r.restart, r.max_restarts), (Restart::OnFailure, 5));
        assert_eq!(r.bind, Some(std::net::IpAddr::from([0, 0, 0, 0])));
        assert_eq!(r.port, Some(41000 + replica), "copy {replica}");
    }
    assert_eq!(r3.command, ["prog"]);
    assert_eq!(
        (r3.restart, r3.max_restarts),
        (Restart::OnFailure, DEFAULT_MAX_RESTARTS)
    );
    // one host: local ranks are the ranks
    for r in [&r0, &r1, &r2, &r3] {
        assert_eq!((r.local_rank, r.local_world_size), (r.rank, 4));
    }
}

#[test]
fn local_ranks_count_within_each_host() {
    let t = Topology::parse(BASE).unwrap();
    let local: Vec<(u32, u32)> = t
        .ranks()
        .iter()
        .map(|r| (r.local_rank, r.local_world_size))
        .collect();
    // learner and near on `a`, the two copies of far on `b`
    assert_eq!(local, [(0, 2), (1, 2), (0, 2), (1, 2)]);
}

/// `hosts` places each copy of a process on its own host (a trainer sharded across
/// machines): ranks, local ranks and the links' reach follow; a count that is not the
/// copies', an undeclared host, `host` beside it or one `bind` for several hosts is refused.
#[test]
fn hosts_place_each_copy_of_a_process_on_its_own_host() {
    let spread = BASE.replace(
        "name = \"far\"\nhost = \"b\"\nreplicas = 2",
        "name = \"far\"\nhosts = [\"a\", \"b\"]\nreplicas = 2",
    );
    assert_ne!(spread, BASE);
    let t = Topology::parse(&spread).unwrap();
    let hosts: Vec<(&str, u32, u32)> = t
        .ranks()
        .iter()
        .map(|r| (r.host.name.as_str(), r.local_rank, r.local_world_size))
        .collect();
    // learner, near and far's copy 0 on `a`; far's copy 1 alone on `b`
    assert_eq!(hosts, [("a", 0, 3), ("a", 1, 3), ("a", 2, 3), ("b", 0, 1)]);
    let policy = ModelId::new("policy").unwrap();
    assert_eq!(
        t.weights_transport(&policy, 0, 2),
        TransportKind::Nearest(Reach::Host)
    );
    assert_eq!(
        t.weights_transport(&policy, 0, 3),
        TransportKind::Nearest(Reach::Network)
    );
    for (from, to, says) in [
        (
            "hosts = [\"a\", \"b\"]",
            "hosts = [\"a\"]",
            "names 1 hosts for 2 copies",
        ),
        (
            "hosts = [\"a\", \"b\"]",
            "hosts = [\"a\", \"z\"]",
            "host `z`, which is not declared",
        ),
        (
            "hosts = [\"a\", \"b\"]",
            "host = \"a\"\nhosts = [\"a\", \"b\"]",
            "both `host` and `hosts`",
        ),
        (
            "replicas = 2",
            "replicas = 2\nbind = \"0.0.0.0\"",
            "one `bind` address cannot",
        ),
    ] {
        let text = spread.replacen(from, to, 1);
        assert_ne!(text, spread, "{to}");
        let e = Topology::parse(&text).unwrap_err().to_string();
        assert!(e.contains("process[far]") && e.contains(says), "{to}: {e}");
    }
}

#[test]
fn every_process_may_bring_its_own_command() {
    let text = small("command = [\"b\"]\n")
        .replace("command = [\"prog\"]\n", "")
        .replace(
            "roles = [\"trainer\", \"controller\"]",
            "roles = [\"trainer\", \"controller\"]\ncommand = [\"a\", \"1\"]",
        );
    let t = Topology::parse(&text).unwrap();
    assert!(t.run.command.is_empty());
    assert_eq!(t.rank(0).unwrap().command, ["a", "1"]);
    assert_eq!(t.rank(2).unwrap().command, ["b"]);
}

#[test]
fn bad_launch_keys_are_named() {
    refused(
        &small("command = []\n"),
        "process[actor].command",
        &["empty"],
    );
    refused(
        &small("command = [\"\"]\n"),
        "process[actor].command",
        &["program"],
    );
    refused(
        &small("command = \"prog\"\n"),
        "process[actor].command",
        &["expected a sequence"],
    );
    refused(
        &small("env = { RANK = \"1\" }\n"),
        "process[actor].env.RANK",
        &["`RANK`", "refit launch"],
    );
    refused(
        &small("env = { \"A=B\" = \"1\" }\n"),
        "process[actor].env",
        &["\"A=B\"", "not an environment variable name"],
    );
    refused(
        &small("env = { N = 1 }\n"),
        "process[actor].env",
        &["expected a string"],
    );
    refused(
        &small("restart = \"always\"\n"),
        "process[actor].restart",
        &["always", "on-failure"],
    );
    refused(
        &small("max_restarts = 2\n"),
        "process[actor].max_restarts",
        &["without restart = \"on-failure\""],
    );
    refused(
        &small("restart = \"on-failure\"\nmax_restarts = 0\n"),
        "process[actor].max_restarts",
        &["max_restarts = 0"],
    );
    refused(
        &small("restart = \"on-failure\"\nmax_restarts = -1\n"),
        "process[actor].max_restarts",
        &["-1"],
    );
    refused(
        &small("").replace(
            "roles = [\"trainer\", \"controller\"]",
            "roles = [\"trainer\", \"controller\"]\nrestart = \"on-failure\"",
        ),
        "process[learner].restart",
        &["rank 0", "only with a [checkpoint] section"],
    );
    // with checkpoints, rank 0's failure restarts the run from the last one
    let t = checked(&format!(
        "{}[checkpoint]\ndir = \"ckpt\"\nevery = 5\n",
        small("").replace(
            "roles = [\"trainer\", \"controller\"]",
            "roles = [\"trainer\", \"controller\"]\nrestart = \"on-failure\"",
        )
    ))
    .unwrap();
    assert_eq!(t.processes[0].restart, Restart::OnFailure);
    // a trainer rank other than rank 0 cannot restart alone: rank 0's restart covers it
    refused(
        &format!(
            "{}[[process]]\nname = \"shards\"\nreplicas = 2\nroles = [\"trainer\"]\nrestart = \"on-failure\"\n",
            small("")
        ),
        "process[shards].restart",
        &["`shards` holds a trainer", "rank 0's process (`learner`)"],
    );
    assert_eq!(
        t.checkpoint.as_ref().map(|c| (c.every, c.keep)),
        Some((5, 2))
    );
    refused(
        &small("bind = \"everywhere\"\n"),
        "process[actor].bind",
        &["\"everywhere\"", "not an IP address"],
    );
    refused(&small("port = 0\n"), "process[actor].port", &["port = 0"]);
    refused(&small("port = 70000\n"), "process[actor].port", &["70000"]);
    refused(
        &small("port = 65535\n"),
        "process[actor].port",
        &["65535", "2 replicas"],
    );
    // two processes on one host asking for one port
    refused(
        &small("port = 5000\n[[process]]\nname = \"judge\"\nroles = [\"engine\"]\nport = 5001\n"),
        "process[judge].port",
        &["`judge`", "`actor`", "5000..=5001", "host `local`"],
    );
    // on two hosts, the same port is fine
    Topology::parse(
        &BASE
            .replace("replicas = 2\n", "replicas = 2\nport = 7000\n")
            .replace(
                "rollout_workers = 3\n",
                "rollout_workers = 3\nport = 7000\n",
            ),
    )
    .unwrap();
}
