//! `refit node`, `refit serve`, `refit pull`: nodes, a safetensors file served as a sender
//! agent, and a model pulled to a safetensors file over the TCP transport.

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
    Error, Manifests, ModelId, ReceiverInit, Result, SenderInit, SenderTransport, Version,
    WeightSet, wire,
};
use refit::transports::link::{self, LinkFactory, LinkOptions, Reach, ReceiverSpec};
use refit::transports::tcp::{
    TcpConfig, TcpEndpoint, TcpLink, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender,
    TransferMode,
};

/// Where the cluster token comes from: the environment or an owner-only file, never the
/// command line (which `ps` and shell history show).
#[derive(Debug, clap::Args)]
pub(crate) struct TokenArgs {
    /// A file holding the cluster token, readable by its owner only (`refit token FILE`
    /// makes one). Without it: the token in `REFIT_TOKEN`, or in the file
    /// `REFIT_TOKEN_FILE` names (setting both is refused).
    #[arg(long, value_name = "FILE", env = TOKEN_FILE_ENV, hide_env_values = true)]
    token_file: Option<PathBuf>,
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
    #[arg(long)]
    seconds: Option<u64>,
    #[command(flatten)]
    token: TokenArgs,
}

/// Arguments of `refit serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// The safetensors file to serve.
    file: PathBuf,
    /// The model id receivers see.
    #[arg(long, default_value = "policy")]
    model: String,
    /// The transport receivers pull with: `tcp` (any host; the spec `refit pull` reads) or
    /// any other of the link factory (`shm`, `file`, `broadcast`), whose spec Refit's
    /// receivers and the Python package (`refit.Receiver`) read.
    #[arg(long, default_value = "tcp")]
    link: String,
    /// Receivers to wait for (up to five minutes) before version 1 is published; the
    /// broadcast chain needs its count.
    #[arg(long, default_value_t = 0)]
    receivers: usize,
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
    /// Re-read the file when it changes and publish it as the next version.
    #[arg(long)]
    watch: bool,
    /// Bytes per bucket of the transfer plan (a multiple of 64; tensors larger than a bucket
    /// are cut across buckets).
    #[arg(long, default_value = "16MiB", value_parser = super::stats::parse_bytes)]
    bucket_size: usize,
    /// Serve the update phase timings (Prometheus text format) at http://ADDR/metrics
    /// (port 0: any free port; the page's address is printed).
    #[arg(long, value_name = "HOST:PORT", env = METRICS_ADDR_ENV, hide_env_values = true)]
    metrics_addr: Option<SocketAddr>,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    seconds: Option<u64>,
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
    /// Pull every byte (`full`) or only what changed (`delta`; the same for a first pull).
    #[arg(long, default_value = "full", value_parser = ["full", "delta"])]
    mode: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
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
    // goes through `from_env`, which refuses it beside `REFIT_TOKEN`
    let from_env = std::env::var_os(TOKEN_FILE_ENV);
    let flag = args
        .token_file
        .as_ref()
        .filter(|p| from_env.as_deref() != Some(p.as_os_str()));
    if let Some(path) = flag {
        return Ok(ClusterToken::from_file(path)?);
    }
    ClusterToken::from_env()?.ok_or_else(|| {
        Error::Config(format!(
            "no cluster token: set {TOKEN_ENV}, or give --token-file FILE (or set \
             {TOKEN_FILE_ENV}) naming a file only its owner can read; `refit token FILE` \
             makes one"
        ))
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
        run_for(args.seconds, || Ok(()))?;
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

/// `refit serve`: a safetensors file served as a sender agent.
pub(crate) fn serve(args: ServeArgs) -> ExitCode {
    exit((|| {
        // shared memory and files reach processes of this host only: no token to present
        let factory = link::find(&args.link)?;
        let token = match token(&args.token) {
            Ok(t) => Some(t),
            Err(_) if factory.reach() != Reach::Network => None,
            Err(e) => return Err(e),
        };
        if args.bind.ip().is_unspecified() && args.advertise.is_none() {
            return Err(Error::Config(format!(
                "--bind {} is an unspecified address, which receivers cannot connect to: give \
                 --advertise HOST:PORT, the address they reach this host at",
                args.bind
            )));
        }
        if let Some(addr) = args.metrics_addr {
            let bound = super::metrics::serve(addr)?;
            println!("metrics: http://{bound}/metrics");
        }
        let model = ModelId::new(&args.model)?;
        // watched from before the first read: a change made while receivers connect is
        // published once they have
        let watch = args.watch.then(|| Watch::new(&args.file));
        let mut weights = WeightSet::read_safetensors(&args.file, Some(&model))?;
        weights.set_version(Version(1));
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
/// each settled change of it as the next version, until `--seconds` pass.
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
    run_for(args.seconds, || {
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
    sender.shutdown()
}

/// `refit pull`: pulls the newest version of a served model into a safetensors file.
pub(crate) fn pull(args: PullArgs) -> ExitCode {
    exit((|| {
        let token = token(&args.token)?;
        let spec_text = match (&args.spec, &args.spec_file) {
            (Some(s), _) => s.clone(),
            (None, Some(p)) => std::fs::read_to_string(p).map_err(|e| Error::Path {
                context: "reading the receiver spec",
                path: p.clone(),
                source: e,
            })?,
            (None, None) => return Err(Error::State("give --spec or --spec-file")),
        };
        let text = spec_text.trim().trim_start_matches("spec:").trim();
        // `refit serve`'s endpoint, or a tcp link spec (a Refit or Python sender's `spec`)
        let endpoint: TcpEndpoint = match ReceiverSpec::from_token(text) {
            Ok(spec) => {
                spec.check_transport(&TcpLink)?;
                spec.params()?
            }
            Err(_) => wire::from_token(text)?,
        };
        let spec = TcpReceiverSpec::new(endpoint, &token);
        let cfg = TcpReceiverConfig {
            streams: args.streams.max(1),
            mode: if args.mode == "delta" {
                TransferMode::Delta
            } else {
                TransferMode::Full
            },
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
        let result = ReceiverInit::new(receiver, None).connect(Duration::from_secs(args.timeout));
        drop(done);
        let _ = ticker.join();
        bar.finish_and_clear();
        let receiver = result?;
        let model = match &args.model {
            Some(m) => ModelId::new(m)?,
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
