//! `refit node`, `refit serve`, `refit pull`: nodes, a safetensors file served as a sender
//! agent, and a model pulled to a safetensors file over the TCP transport.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use refit::runtime::node::{ClusterToken, Node, NodeConfig, Store, TOKEN_ENV};
use refit::runtime::{
    Error, Manifests, ModelId, ReceiverInit, Result, SenderInit, Version, WeightSet, wire,
};
use refit::transports::tcp::{
    TcpConfig, TcpReceiver, TcpReceiverConfig, TcpReceiverSpec, TcpSender, TransferMode,
};

/// Arguments of `refit node`.
#[derive(Debug, clap::Args)]
pub(crate) struct NodeArgs {
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, default_value = "127.0.0.1:29500")]
    bind: SocketAddr,
    /// Serve a rendezvous store on this node (as rank 0 does at MASTER_ADDR:MASTER_PORT).
    #[arg(long)]
    store: bool,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    seconds: Option<u64>,
}

/// Arguments of `refit serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// The safetensors file to serve.
    file: PathBuf,
    /// The model id receivers see.
    #[arg(long, default_value = "policy")]
    model: String,
    /// Address to listen on (loopback unless you say otherwise).
    #[arg(long, default_value = "127.0.0.1:0")]
    bind: SocketAddr,
    /// Address receivers are told to use (default: the bound one).
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Also write the receiver spec (a secret: it holds the token) to this file.
    #[arg(long)]
    spec_file: Option<PathBuf>,
    /// Re-read the file when it changes and publish it as the next version.
    #[arg(long)]
    watch: bool,
    /// Serve the update phase timings (Prometheus text format) at http://ADDR/metrics.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    seconds: Option<u64>,
}

/// Arguments of `refit pull`.
#[derive(Debug, clap::Args)]
pub(crate) struct PullArgs {
    /// Where to write the model (atomically: a temporary file, then a rename).
    out: PathBuf,
    /// The receiver spec printed by `refit serve` (hex).
    #[arg(
        long,
        conflicts_with = "spec_file",
        required_unless_present = "spec_file"
    )]
    spec: Option<String>,
    /// A file holding the receiver spec.
    #[arg(long)]
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

fn token() -> Result<ClusterToken> {
    if let Some(t) = ClusterToken::from_env()? {
        return Ok(t);
    }
    let t = ClusterToken::random();
    eprintln!(
        "refit: no {TOKEN_ENV} set; generated one (share it with the other nodes):\n  \
         export {TOKEN_ENV}={}",
        t.expose()
    );
    Ok(t)
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
        let node = Node::start(NodeConfig::loopback(token()?).with_bind(args.bind))?;
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

fn mtime(path: &PathBuf) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// `refit serve`: a safetensors file served as a sender agent.
pub(crate) fn serve(args: ServeArgs) -> ExitCode {
    exit((|| {
        if let Some(addr) = args.metrics_addr {
            let bound = super::metrics::serve(addr)?;
            println!("metrics: http://{bound}/metrics");
        }
        let model = ModelId::new(&args.model)?;
        let mut weights = WeightSet::read_safetensors(&args.file, Some(&model))?;
        weights.set_version(Version(1));
        let manifests = Manifests::new([(model.clone(), Arc::clone(weights.manifest()))])?;
        let config = TcpConfig {
            bind: args.bind,
            advertise: args.advertise,
            token: Some(token()?),
            ..TcpConfig::default()
        };
        let transport = TcpSender::bind(config, &manifests)?;
        let spec = wire::to_token(&transport.receiver_spec())?;
        if let Some(path) = &args.spec_file {
            refit::runtime::write_atomically(path, spec.as_bytes())?;
        }
        eprintln!(
            "serving `{model}` ({} tensors, {} bytes) from {} at {}",
            weights.manifest().len(),
            weights.manifest().total_len(),
            args.file.display(),
            transport.addr()
        );
        println!("spec: {spec}");
        let mut sender =
            SenderInit::new(transport, manifests).connect(vec![weights], Duration::from_secs(5))?;
        let mut seen = mtime(&args.file);
        let mut version = Version(1);
        run_for(args.seconds, || {
            if !args.watch || mtime(&args.file) == seen {
                return Ok(());
            }
            seen = mtime(&args.file);
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
    })())
}

/// `refit pull`: pulls the newest version of a served model into a safetensors file.
pub(crate) fn pull(args: PullArgs) -> ExitCode {
    exit((|| {
        let spec_text = match (&args.spec, &args.spec_file) {
            (Some(s), _) => s.clone(),
            (None, Some(p)) => std::fs::read_to_string(p).map_err(|e| Error::Path {
                context: "reading the receiver spec",
                path: p.clone(),
                source: e,
            })?,
            (None, None) => return Err(Error::State("give --spec or --spec-file")),
        };
        let spec: TcpReceiverSpec =
            wire::from_token(spec_text.trim().trim_start_matches("spec:").trim())?;
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
        let receiver = TcpReceiver::new(spec).with_config(cfg);
        let pulled = receiver.progress();
        let done = Arc::new(AtomicBool::new(false));
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {bytes} pulled ({binary_bytes_per_sec}) {elapsed}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        let ticker = {
            let (bar, done, pulled) = (bar.clone(), Arc::clone(&done), Arc::clone(&pulled));
            std::thread::spawn(move || {
                while !done.load(Ordering::Acquire) {
                    bar.set_position(pulled.load(Ordering::Relaxed));
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let started = Instant::now();
        let result = ReceiverInit::new(receiver, None).connect(Duration::from_secs(args.timeout));
        done.store(true, Ordering::Release);
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
        weights.write_safetensors(&args.out)?;
        let took = started.elapsed();
        let bytes = weights.manifest().total_len();
        eprintln!(
            "pulled `{model}` version {} ({bytes} bytes) in {took:.2?} ({:.0} MiB/s) into {}",
            weights.version(),
            bytes as f64 / (1 << 20) as f64 / took.as_secs_f64().max(1e-9),
            args.out.display()
        );
        receiver.shutdown()
    })())
}
