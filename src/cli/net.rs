//! `refit node`, `refit serve`, `refit pull`: nodes, a safetensors file (or a Hugging Face
//! model folder) served as a sender agent, and a model pulled to a safetensors file over the
//! TCP transport.
//!
//! Every input (files, folders, specs, flags) is checked before the cluster token is asked
//! for: a user who typed a wrong path hears about the path, not about a token. Each refusal
//! is one line, `refit: error: ...`, and exit code 1.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use refit::metrics_page::METRICS_ADDR_ENV;
use refit::node::{ClusterToken, Node, NodeConfig, Store, TOKEN_ENV, TOKEN_FILE_ENV};
use refit::runtime::{
    Error, Manifests, ModelId, ReceiverInit, SenderInit, SenderTransport, Version, WeightSet, wire,
};
use refit::transports::link::{self, LINKS, LinkFactory, LinkOptions, Reach, ReceiverSpec};
use refit::transports::tcp::{
    TcpConfig, TcpEndpoint, TcpLink, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender,
    TransferMode,
};

/// A command's result: a library error, or a refusal of the user's input worded for them
/// (a `String`), printed alike as one line.
type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

/// Where the cluster token comes from: the environment or an owner-only file, never the
/// command line (which `ps` and shell history show).
#[derive(Debug, clap::Args)]
pub(crate) struct TokenArgs {
    /// A file holding the cluster token, readable by its owner only (`refit token FILE`
    /// makes one). Without it: the token in `REFIT_TOKEN`, or in the file
    /// `REFIT_TOKEN_FILE` names (setting both is refused). Asked for only once every other
    /// input has been checked.
    #[arg(
        long,
        value_name = "FILE",
        env = TOKEN_FILE_ENV,
        hide_env_values = true,
        // an empty value is let through, to be told as such (clap's path parser calls it a
        // missing value of --token-file, which a user who set a variable does not recognise)
        value_parser = clap::builder::OsStringValueParser::new()
    )]
    token_file: Option<OsString>,
}

/// Arguments of `refit token`.
#[derive(Debug, clap::Args)]
pub(crate) struct TokenFileArgs {
    /// The file to create (mode 0600; an existing file is never overwritten).
    file: PathBuf,
}

/// Arguments of `refit node`.
#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:29500")]
    bind: SocketAddr,
    /// Serve a rendezvous store on this node (as rank 0 does at MASTER_ADDR:MASTER_PORT).
    #[arg(long)]
    store: bool,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long = "for-s", visible_alias = "seconds", value_name = "SECONDS")]
    for_s: Option<u64>,
    #[command(flatten)]
    token: TokenArgs,
}

/// Arguments of `refit serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// The model to serve: a safetensors file, or a Hugging Face model folder (its
    /// `model.safetensors.index.json` and the shards it names, served as one model; or its
    /// single `model.safetensors`), what `vllm serve` takes.
    #[arg(value_name = "FILE|FOLDER")]
    file: PathBuf,
    /// The model id receivers see.
    #[arg(long, default_value = "policy")]
    model: String,
    /// The transport receivers pull with: `tcp` (any host; the spec `refit pull` reads) or
    /// any other of the link factory that reaches other processes (`shm`, `file`,
    /// `broadcast`), whose spec Refit's receivers and the Python package (`refit.Receiver`)
    /// read. `inproc` reaches only the serving process and is refused.
    #[arg(long, default_value = "tcp")]
    link: String,
    /// Receivers to wait for (up to five minutes) before version 1 is published; the
    /// broadcast chain needs its count (`--link broadcast --receivers N`).
    #[arg(long, default_value_t = 0)]
    receivers: usize,
    /// A checksum per version, verified by every receiver before it admits the version
    /// (shm: a version damaged in its slot after the write is refused whole; tcp, file and
    /// broadcast check theirs whatever this says).
    #[arg(long)]
    checksum: bool,
    /// Address to listen on (loopback unless you say otherwise; tcp).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:0")]
    bind: SocketAddr,
    /// Address receivers are told to use (default: the bound one; required when binding an
    /// unspecified address such as 0.0.0.0; port 0 means the bound port).
    #[arg(long, value_name = "HOST:PORT")]
    advertise: Option<SocketAddr>,
    /// Also write the spec (the sender's address and id; it holds no token) to this file.
    #[arg(long, value_name = "FILE")]
    spec_file: Option<PathBuf>,
    /// Re-read the file when it changes and publish it as the next version (a file only:
    /// a folder's shards change one by one, so a folder is refused with --watch).
    #[arg(long)]
    watch: bool,
    /// Bytes per bucket of the transfer plan (a multiple of 64; tensors larger than a bucket
    /// are cut across buckets).
    #[arg(long, default_value = "16MiB", value_parser = refit_bench::stats::parse_bytes)]
    bucket_size: usize,
    /// Serve the update phase timings (Prometheus text format) at http://ADDR/metrics
    /// (port 0: any free port; the page's address is printed).
    #[arg(long, value_name = "HOST:PORT", env = METRICS_ADDR_ENV, hide_env_values = true)]
    metrics_addr: Option<SocketAddr>,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long = "for-s", visible_alias = "seconds", value_name = "SECONDS")]
    for_s: Option<u64>,
    #[command(flatten)]
    token: TokenArgs,
}

/// Arguments of `refit pull`.
#[derive(Debug, clap::Args)]
#[command(group(
    // one way to find the sender, required: a missing one names them all
    clap::ArgGroup::new("sender").required(true).args(["spec", "spec_file"])
))]
pub(crate) struct PullArgs {
    /// Where to write the model (atomically: a temporary file, then a rename).
    out: PathBuf,
    /// The sender's spec: what `refit serve` prints after `spec:`, or a tcp link's spec
    /// (a Refit or Python sender's); it holds no token.
    #[arg(long)]
    spec: Option<String>,
    /// A file holding the spec (`refit serve --spec-file FILE` writes one).
    #[arg(long, value_name = "FILE")]
    spec_file: Option<PathBuf>,
    /// The model to write (default: the only one served).
    #[arg(long)]
    model: Option<String>,
    /// Parallel streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Give up after this many seconds.
    #[arg(
        long = "timeout-s",
        visible_alias = "timeout",
        value_name = "SECONDS",
        default_value_t = 300
    )]
    timeout_s: u64,
    #[command(flatten)]
    token: TokenArgs,
}

fn exit(r: Result<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("refit: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The cluster token: `--token-file`, else `REFIT_TOKEN` or `REFIT_TOKEN_FILE`.
fn token(args: &TokenArgs) -> Result<ClusterToken> {
    // clap fills `--token-file` from `REFIT_TOKEN_FILE` too; a path that came from there
    // goes through `from_env`, which refuses it beside `REFIT_TOKEN` and tells an empty one
    let from_env = std::env::var_os(TOKEN_FILE_ENV);
    let flag = args
        .token_file
        .as_ref()
        .filter(|p| from_env.as_deref() != Some(p.as_os_str()));
    if let Some(path) = flag {
        if path.is_empty() {
            return Err(
                "--token-file is empty: give the file holding the cluster token \
                        (`refit token FILE` makes one)"
                    .into(),
            );
        }
        return Ok(ClusterToken::from_file(Path::new(path))?);
    }
    ClusterToken::from_env()?.ok_or_else(|| {
        format!(
            "no cluster token: set {TOKEN_ENV}, or give --token-file FILE (or set \
             {TOKEN_FILE_ENV}) naming a file only its owner can read; `refit token FILE` \
             makes one"
        )
        .into()
    })
}

/// `refit token`: a fresh cluster token in a new owner-only file.
pub(crate) fn token_file(args: TokenFileArgs) -> ExitCode {
    exit((|| {
        ClusterToken::create_file(&args.file)?;
        eprintln!(
            "wrote a new cluster token to {} (readable by you only); give every node the same \
             file with --token-file, or its content in {TOKEN_ENV}",
            args.file.display()
        );
        Ok(())
    })())
}

/// Sleeps until `seconds` pass (forever when `None`), waking early when `stop` is set.
fn run_for(seconds: Option<u64>, mut tick: impl FnMut() -> Result<()>) -> Result<()> {
    let end = seconds.map(|s| Instant::now() + Duration::from_secs(s));
    loop {
        if end.is_some_and(|e| Instant::now() >= e) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(500));
        tick()?;
    }
}

/// `refit node`: a node (and optionally a rendezvous store) that runs until killed.
pub(crate) fn node(args: NodeArgs) -> ExitCode {
    exit((|| {
        let node = Node::start(NodeConfig::loopback(token(&args.token)?).with_bind(args.bind))?;
        if args.store {
            Store::serve(&node);
        }
        println!(
            "node {} listening on {}{}",
            node.id(),
            node.addr(),
            if args.store {
                " (rendezvous store)"
            } else {
                ""
            }
        );
        run_for(args.for_s, || Ok(()))?;
        node.shutdown();
        Ok(())
    })())
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Tells `refit serve --watch` when the served file changed and has settled (no further
/// change for one tick, so a file being written is not read half-way). Uses the OS's file
/// events (inotify through `notify`) on the file's folder, so a file replaced by a rename
/// (how editors and atomic writers save) is followed too. Where no watcher can be set up
/// (inotify's watch limit reached, an unsupported file system) it falls back to comparing
/// the file's modification time every tick, which sees the same changes, only later.
enum Watch {
    Events {
        _watcher: notify::RecommendedWatcher,
        events: std::sync::mpsc::Receiver<notify::Result<notify::Event>>,
        name: OsString,
        pending: bool,
    },
    Poll {
        seen: Option<SystemTime>,
        pending: bool,
    },
}

impl Watch {
    fn new(path: &Path) -> Self {
        use notify::Watcher;
        let poll = || Self::Poll {
            seen: mtime(path),
            pending: false,
        };
        let Some(name) = path.file_name().map(OsString::from) else {
            return poll();
        };
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let (tx, events) = std::sync::mpsc::channel();
        let watcher = notify::recommended_watcher(tx).and_then(|mut w| {
            w.watch(&dir, notify::RecursiveMode::NonRecursive)?;
            Ok(w)
        });
        match watcher {
            Ok(w) => Self::Events {
                _watcher: w,
                events,
                name,
                pending: false,
            },
            Err(e) => {
                eprintln!(
                    "refit: cannot watch {} ({e}); polling its modification time instead",
                    dir.display()
                );
                poll()
            }
        }
    }

    /// Whether the file changed since the last publish and nothing changed in this tick.
    fn settled_change(&mut self, path: &Path) -> bool {
        match self {
            Self::Events {
                events,
                name,
                pending,
                ..
            } => {
                let mut now = false;
                while let Ok(event) = events.try_recv() {
                    let Ok(event) = event else {
                        now = true; // a watcher error: look at the file to be safe
                        continue;
                    };
                    let ours = event
                        .paths
                        .iter()
                        .any(|p| p.file_name() == Some(name.as_os_str()));
                    if ours && !event.kind.is_access() {
                        now = true;
                    }
                }
                let settled = *pending && !now;
                *pending = now;
                settled
            }
            Self::Poll { seen, pending } => {
                let m = mtime(path);
                let now = m != *seen;
                *seen = m;
                let settled = *pending && !now;
                *pending = now;
                settled
            }
        }
    }
}

/// The links of the factory that reach processes other than the serving one, by name.
fn links_beyond_this_process() -> String {
    LINKS
        .iter()
        .filter(|l| l.reach() != Reach::Process)
        .map(|l| format!("{} ({})", l.name(), l.reach()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `refit serve`: a safetensors file or a Hugging Face model folder served as a sender agent.
pub(crate) fn serve(args: ServeArgs) -> ExitCode {
    exit((|| {
        // every input first, the token last: a wrong path or flag is told as that
        let factory = link::find(&args.link)?;
        if factory.reach() == Reach::Process {
            return Err(format!(
                "--link {} reaches only the serving process, so no receiver could use its \
                 spec; links that serve other processes: {}",
                factory.name(),
                links_beyond_this_process()
            )
            .into());
        }
        if args.receivers == 0 && matches!(factory.name(), "broadcast" | "nccl") {
            return Err(format!(
                "--link {} needs --receivers N (the chain's length)",
                factory.name()
            )
            .into());
        }
        if args.bind.ip().is_unspecified() && args.advertise.is_none() {
            return Err(format!(
                "--bind {} is an unspecified address, which receivers cannot connect to: give \
                 --advertise HOST:PORT, the address they reach this host at",
                args.bind
            )
            .into());
        }
        let model = ModelId::new(&args.model)?;
        if args.watch && args.file.is_dir() {
            return Err(format!(
                "--watch follows one file, and `{}` is a folder (its shards change one by one): \
                 serve the folder without --watch, or one safetensors file with it",
                args.file.display()
            )
            .into());
        }
        // watched from before the first read: a change made while receivers connect is
        // published once they have
        let watch = args.watch.then(|| Watch::new(&args.file));
        let mut weights = WeightSet::read_model_path(&args.file, Some(&model))?;
        weights.set_version(Version(1));
        // shared memory and files reach processes of this host only: no token to present
        let token = match token(&args.token) {
            Ok(t) => Some(t),
            Err(_) if factory.reach() != Reach::Network => None,
            Err(e) => return Err(e),
        };
        if let Some(addr) = args.metrics_addr {
            let bound = super::metrics::serve(addr)?;
            println!("metrics: http://{bound}/metrics");
        }
        let manifests = Manifests::new([(model.clone(), Arc::clone(weights.manifest()))])?;
        let about = format!(
            "`{model}` ({} tensors, {} bytes) from {}",
            weights.manifest().len(),
            weights.manifest().total_len(),
            args.file.display(),
        );
        if factory.name() != TcpLink.name() {
            let options = LinkOptions {
                token,
                expected_receivers: args.receivers,
                checksum: args.checksum,
                ..LinkOptions::default()
            };
            let opened = factory.open(&manifests, &options)?;
            let spec = opened.spec.to_token()?;
            eprintln!("serving {about} over {}", opened.spec);
            return publish_file(&args, &spec, opened.sender, manifests, weights, watch);
        }
        let config = TcpConfig {
            bind: args.bind,
            advertise: args.advertise,
            token,
            bucket_size: args.bucket_size,
            expected_receivers: args.receivers,
            ..TcpConfig::default()
        };
        let transport = TcpSender::bind(config, &manifests)?;
        // the endpoint only: receivers bring their own copy of the token
        let spec = wire::to_token(&transport.endpoint())?;
        eprintln!("serving {about} at {}", transport.addr());
        publish_file(&args, &spec, transport, manifests, weights, watch)
    })())
}

/// `refit serve`'s loop: writes the spec, publishes the file as version 1, and (`--watch`)
/// each settled change of it as the next version, until `--for-s` seconds pass.
fn publish_file<T: SenderTransport>(
    args: &ServeArgs,
    spec: &str,
    transport: T,
    manifests: Manifests,
    weights: WeightSet,
    mut watch: Option<Watch>,
) -> Result<()> {
    let model = weights.model().clone();
    if let Some(path) = &args.spec_file {
        refit::runtime::write_atomically(path, spec.as_bytes())?;
    }
    println!("spec: {spec}");
    // the receivers asked for, and any that connected meanwhile (the spec is out), load
    // version 1 before it counts as published: however large the file, a receiver that
    // came early has as long as one that was waited for
    let wait = Duration::from_secs(300);
    let mut sender = SenderInit::new(transport, manifests).connect(vec![weights], wait)?;
    let mut version = Version(1);
    run_for(args.for_s, || {
        if !watch.as_mut().is_some_and(|w| w.settled_change(&args.file)) {
            return Ok(());
        }
        let mut next = match WeightSet::read_safetensors(&args.file, Some(&model)) {
            Ok(w) => w,
            Err(e) => {
                eprintln!("refit: not published: {e}");
                return Ok(());
            }
        };
        version = version.next();
        next.set_version(version);
        match sender.send_async(vec![next]) {
            Ok(_) => eprintln!("published version {version}"),
            Err(e) => eprintln!("refit: version {version} not published: {e}"),
        }
        Ok(())
    })?;
    Ok(sender.shutdown()?)
}

/// What a spec is and where to find it, for errors about one.
const SPEC_IS: &str = "a spec is the line `refit serve` prints after `spec:` (or writes with \
                       --spec-file); give it with --spec or --spec-file";

/// The sender's endpoint from a spec's text: `refit serve`'s endpoint, or a tcp link spec (a
/// Refit or Python sender's `spec`). An address, or any other line, is refused saying what
/// a spec is.
fn endpoint_of(spec_text: &str) -> Result<TcpEndpoint> {
    let text = spec_text.trim();
    let text = text.strip_prefix("spec:").unwrap_or(text).trim();
    // a spec is hex: `HOST:PORT` is an address, which receivers do not connect by
    let address = text
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
    if address {
        return Err(format!("`{text}` is an address, not a spec: {SPEC_IS}").into());
    }
    match ReceiverSpec::from_token(text) {
        Ok(spec) => {
            spec.check_transport(&TcpLink)?;
            Ok(spec.params()?)
        }
        Err(first) => wire::from_text::<TcpEndpoint>(text, "spec").map_err(|_| {
            let shown: String = text.chars().take(40).collect();
            let more = if shown.len() < text.len() { "..." } else { "" };
            let why = match first {
                Error::Wire(reason) => reason,
                other => other.to_string(),
            };
            format!("`{shown}{more}` is not a spec ({why}): {SPEC_IS}").into()
        }),
    }
}

/// Refuses an output path `refit pull` cannot write before anything is pulled: a folder, or
/// a path whose folder does not exist.
fn check_out(out: &Path) -> Result<()> {
    if out.is_dir() {
        return Err(format!(
            "`{}` is a folder: give the file to write the model to (FOLDER/model.safetensors)",
            out.display()
        )
        .into());
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(format!(
            "cannot write `{}`: its folder `{}` does not exist",
            out.display(),
            parent.display()
        )
        .into());
    }
    Ok(())
}

/// `refit pull`: pulls the newest version of a served model into a safetensors file.
pub(crate) fn pull(args: PullArgs) -> ExitCode {
    exit((|| {
        // every input first, the token last
        let spec_text = match (&args.spec, &args.spec_file) {
            (Some(s), _) => s.clone(),
            (None, Some(p)) => std::fs::read_to_string(p).map_err(|e| Error::Path {
                context: "reading the spec file",
                path: p.clone(),
                source: e,
            })?,
            (None, None) => return Err("give --spec or --spec-file".into()),
        };
        let endpoint = endpoint_of(&spec_text)?;
        check_out(&args.out)?;
        let wanted = args.model.as_deref().map(ModelId::new).transpose()?;
        let token = token(&args.token)?;
        let spec = TcpReceiverSpec::new(endpoint, &token);
        // a one-shot pull has no version to diff against: every byte is pulled
        let cfg = TcpReceiverConfig {
            streams: args.streams.max(1),
            mode: TransferMode::Full,
            relay: false,
            ..TcpReceiverConfig::default()
        };
        let files = refit::transports::tcp::PullFile::new(&args.out);
        let receiver = {
            let files = Arc::clone(&files);
            TcpReceiver::new(spec)
                .with_config(cfg)
                .with_sinks(move |model, version, manifest| files.sink(model, version, manifest))
        };
        let (pulled, total) = (receiver.progress(), receiver.progress_total());
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes} ({binary_bytes_per_sec}, eta {eta}) {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        // the bar is redrawn every 100 ms until `done` is dropped, which wakes the ticker at
        // once (a plain sleep would hold the pull's exit for up to one more tick)
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let ticker = {
            let bar = bar.clone();
            std::thread::spawn(move || {
                loop {
                    bar.set_length(total.load(Ordering::Relaxed));
                    bar.set_position(pulled.load(Ordering::Relaxed));
                    match finished.recv_timeout(Duration::from_millis(100)) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                }
            })
        };
        let started = Instant::now();
        let result = ReceiverInit::new(receiver, None).connect(Duration::from_secs(args.timeout_s));
        drop(done);
        let _ = ticker.join();
        bar.finish_and_clear();
        let receiver = result?;
        let model = match wanted {
            Some(m) => m,
            None => receiver
                .manifests()
                .ids()
                .next()
                .cloned()
                .ok_or(Error::State("the sender serves no model"))?,
        };
        let weights = receiver
            .current(&model)
            .ok_or_else(|| Error::UnknownModel(model.clone()))?;
        // the bytes went into the file as they arrived: it is synced and renamed into place
        files.commit(&weights)?;
        let (version, bytes) = (weights.version(), weights.manifest().total_len());
        drop(weights);
        receiver.shutdown()?;
        let took = started.elapsed();
        eprintln!(
            "pulled `{model}` version {version} ({bytes} bytes) in {took:.2?} ({:.0} MiB/s) into {}",
            bytes as f64 / (1 << 20) as f64 / took.as_secs_f64().max(1e-9),
            args.out.display()
        );
        Ok(())
    })())
}
