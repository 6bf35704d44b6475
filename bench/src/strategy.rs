//! The cost of converting to an engine's layout on the real send path, for `refit bench`
//! (not a stable API).
//!
//! A transformer-shaped f32 model of about the requested size is built deterministically;
//! an engine wants q/k/v and gate/up fused, names changed and every tensor in bf16 (or fp8
//! e4m3 with per-tensor scales). Updates go through a real scheme pair over a transport the
//! caller supplies (a [`Link`]: shared memory in `refit bench`, the in-process transport in
//! the unit test), wrapped in [`ConvertingSender`] or [`ConvertingReceiver`], and the
//! adapter's own clock ([`ConvertStats::last`]) gives the conversion time of each update.
//! The same updates without a conversion, and a `memcpy` of the payload, are measured in
//! the same run. Figures are over the trainer's payload (the f32 bytes read).

use std::sync::Arc;
use std::time::{Duration, Instant};

use refit_runtime::cast::{CastRules, CastTo};
use refit_runtime::convert::{
    Conversions, ConvertStats, ConvertingReceiver, ConvertingSender, Want, Wants,
};
use refit_runtime::delta::{Delta, Granularity};
use refit_runtime::dtype::DType;
use refit_runtime::ids::{ModelId, Version};
use refit_runtime::layout::LayoutRules;
use refit_runtime::manifest::Manifest;
use refit_runtime::protocol::Manifests;
use refit_runtime::scheme::{ReceiverInit, ReceiverTransport, SenderInit, SenderTransport};
use refit_runtime::weights::WeightSet;
use refit_runtime::{Error, Result};

/// How long one connect or update may take.
const WAIT: Duration = Duration::from_secs(120);

/// Makes one connected-to-be pair of transport ends over the given manifests.
pub trait Link {
    /// The sending end.
    type S: SenderTransport + 'static;
    /// The receiving end.
    type R: ReceiverTransport + 'static;
    /// The transport's name, for the figures.
    fn name(&self) -> &'static str;
    /// A fresh sender carrying `manifests`, and one receiver of it.
    ///
    /// # Errors
    /// Whatever creating the transport reports.
    fn make(&mut self, manifests: &Manifests) -> Result<(Self::S, Self::R)>;
}

/// One measured operation, one sample per run.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// What was measured.
    pub name: String,
    /// Source bytes processed per run.
    pub bytes: usize,
    /// Seconds of each run.
    pub samples: Vec<f64>,
}

impl Figure {
    /// The median run, in seconds.
    pub fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(f64::total_cmp);
        match s.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => s[n / 2],
            n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
        }
    }

    /// Median throughput, in GB/s (10^9 bytes).
    pub fn gb_per_s(&self) -> f64 {
        self.bytes as f64 / 1e9 / self.median()
    }

    /// Median cost, in seconds per GB.
    pub fn s_per_gb(&self) -> f64 {
        self.median() / (self.bytes as f64 / 1e9)
    }
}

/// The figures of one run (see [`run`] for the list).
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyBench {
    /// Payload bytes of the trainer's model.
    pub bytes: usize,
    /// The measurements.
    pub figures: Vec<Figure>,
}

impl StrategyBench {
    /// The figure named `name`.
    pub fn figure(&self, name: &str) -> Option<&Figure> {
        self.figures.iter().find(|f| f.name == name)
    }
}

impl std::fmt::Display for StrategyBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{:<20} {:>10} {:>10} {:>10}",
            "operation (median)", "ms", "GB/s", "s/GB"
        )?;
        for x in &self.figures {
            writeln!(
                f,
                "{:<20} {:>10.2} {:>10.2} {:>10.3}",
                x.name,
                x.median() * 1e3,
                x.gb_per_s(),
                x.s_per_gb()
            )?;
        }
        Ok(())
    }
}

const H: usize = 256;

fn model(bytes: usize) -> Result<Manifest> {
    let per_layer = (4 * H * H + 3 * 2 * H * H) * 4;
    let mut b = Manifest::builder();
    for i in 0..(bytes / per_layer).max(1) {
        for (n, rows) in [
            ("q", H),
            ("k", H),
            ("v", H),
            ("o", H),
            ("gate", 2 * H),
            ("up", 2 * H),
        ] {
            b.push(format!("layers.{i}.{n}"), DType::F32, &[rows, H]);
        }
        b.push(format!("layers.{i}.down"), DType::F32, &[H, 2 * H]);
    }
    b.build()
}

/// The engine's wants: fused q/k/v and gate/up, its names, every tensor cast to `to`.
pub(crate) fn engine_want(to: CastTo) -> Want {
    Want::new()
        .layout(
            LayoutRules::new()
                .fuse(
                    ["layers.{i}.q", "layers.{i}.k", "layers.{i}.v"],
                    "model.layers.{i}.qkv",
                    0,
                )
                .rename("layers.{i}.o", "model.layers.{i}.o")
                .fuse(
                    ["layers.{i}.gate", "layers.{i}.up"],
                    "model.layers.{i}.gate_up",
                    0,
                )
                .rename("layers.{i}.down", "model.layers.{i}.down"),
        )
        .cast(CastRules::new().dtype(DType::F32, to))
}

/// Where the conversion runs, if anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    None,
    Sender,
    Receiver,
}

/// Times of `reps` updates (after one untimed) through a scheme over `link`: the whole
/// update (publish, receive, ack) and the adapter's conversion of each.
fn updates<L: Link>(
    link: &mut L,
    versions: &[WeightSet],
    reps: usize,
    side: Side,
    to: CastTo,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let id = versions[0].model().clone();
    let trainer = Manifests::new([(id.clone(), Arc::clone(versions[0].manifest()))])?;
    let wants = || Wants::new().model(id.clone(), engine_want(to));
    let conversions = Conversions::plan(&trainer, &wants())?;
    let carried = match side {
        Side::Sender => conversions.target(),
        Side::None | Side::Receiver => &trainer,
    };
    let (s, r) = link.make(carried)?;
    let initial = versions[0].clone();
    match side {
        Side::None => drive(
            SenderInit::new(s, trainer),
            r,
            initial,
            versions,
            reps,
            |_, _| None,
        ),
        Side::Sender => drive(
            SenderInit::new(ConvertingSender::new(s, conversions), trainer),
            r,
            initial,
            versions,
            reps,
            |s, _| Some(s.stats()),
        ),
        Side::Receiver => drive(
            SenderInit::new(s, trainer),
            ConvertingReceiver::new(r, wants()),
            initial,
            versions,
            reps,
            |_, r| Some(r.stats()),
        ),
    }
}

fn drive<S, R>(
    init: SenderInit<S>,
    r: R,
    initial: WeightSet,
    versions: &[WeightSet],
    reps: usize,
    stats: impl Fn(&S, &R) -> Option<ConvertStats>,
) -> Result<(Vec<f64>, Vec<f64>)>
where
    S: SenderTransport + 'static,
    R: ReceiverTransport + 'static,
{
    let joiner = std::thread::spawn(move || ReceiverInit::new(r, None).connect(WAIT));
    let mut tx = init.with_ack_timeout(WAIT).connect(vec![initial], WAIT)?;
    let mut rx = joiner
        .join()
        .map_err(|_| Error::State("receiver connect thread panicked"))??;
    let (mut whole, mut converting) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let mut w = versions[(rep + 1) % versions.len()].clone();
        w.set_version(Version(rep as u64 + 2));
        let t = Instant::now();
        let pending = tx.send_async(vec![w])?;
        if rx.receive(WAIT)?.is_none() {
            return Err(Error::Timeout {
                what: "a benchmark update".into(),
                after: WAIT,
            });
        }
        tx.wait(&pending, WAIT)?;
        let took = t.elapsed().as_secs_f64();
        if rep > 0 {
            whole.push(took);
            if let Some(s) = stats(tx.transport(), rx.transport()) {
                converting.push(s.last.as_secs_f64());
            }
        }
    }
    rx.shutdown()?;
    tx.shutdown()?;
    Ok((whole, converting))
}

/// Measures, on a model of about `bytes` bytes, `reps` runs each (after one untimed):
///
/// | figure | what |
/// | --- | --- |
/// | `memcpy` | the fastest simple copy of the trainer's payload, one thread ([`refit_runtime::copy::fastest_copy`]) |
/// | `  tried memcpy` / `  tried streaming` | each simple copy tried |
/// | `update plain` | one update over `link` (publish, receive, ack), no conversion |
/// | `convert bf16 send` / `recv` | the adapter's conversion to fused bf16 on the sender / receiver side |
/// | `update bf16 send` / `recv` | the whole update with that conversion |
/// | `convert f16 recv` | the conversion to fused f16, receiver side |
/// | `convert fp8 recv` | the conversion to fused fp8 e4m3 (per-tensor scales), receiver side |
/// | `delta encode (3%)` | a delta of 3% changed 64 KiB blocks |
/// | `elements encode (2%)` / `apply` | an element-level delta of 2% changed elements |
///
/// # Errors
/// Whatever the transport or the conversions report (none are expected).
pub fn run<L: Link>(bytes: usize, reps: usize, link: &mut L) -> Result<StrategyBench> {
    let reps = reps.max(1);
    let manifest = Arc::new(model(bytes)?);
    let id = ModelId::new("bench")?;
    let mut base = WeightSet::zeroed(id, Arc::clone(&manifest));
    let mut state = 0x9e37_79b9_u32;
    for x in bytemuck::cast_slice_mut::<u8, f32>(base.bytes_mut()?) {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        *x = (state >> 8) as f32 / (1 << 24) as f32 - 0.5;
    }
    base.set_version(Version(1));
    let mut new = base.clone();
    new.set_version(Version(2));
    // About 3% of 64 KiB blocks change, as in a dense bf16 step.
    for (i, chunk) in new.bytes_mut()?.chunks_mut(64 * 1024).enumerate() {
        if i % 32 == 0 {
            chunk[0] ^= 1;
        }
    }
    let payload = manifest.payload_len();
    let fig = |name: String, samples: Vec<f64>| Figure {
        name,
        bytes: payload,
        samples,
    };
    let mut figures = Vec::new();

    let copies = refit_runtime::copy::fastest_copy(base.bytes(), reps, 1);
    let secs = |t: &[Duration]| t.iter().map(Duration::as_secs_f64).collect();
    figures.push(fig("memcpy".into(), secs(copies.times())));
    for (c, times) in &copies.tried {
        figures.push(fig(format!("  tried {}", c.name()), secs(times)));
    }

    let versions = [base.clone(), new.clone()];
    let (plain, _) = updates(link, &versions, reps, Side::None, CastTo::BF16)?;
    figures.push(fig("update plain".into(), plain));
    for (side, label) in [(Side::Sender, "send"), (Side::Receiver, "recv")] {
        let (whole, conv) = updates(link, &versions, reps, side, CastTo::BF16)?;
        figures.push(fig(format!("convert bf16 {label}"), conv));
        figures.push(fig(format!("update bf16 {label}"), whole));
    }
    for (to, label) in [(CastTo::F16, "f16"), (CastTo::E4M3_PER_TENSOR, "fp8")] {
        let (_, conv) = updates(link, &versions, reps, Side::Receiver, to)?;
        figures.push(fig(format!("convert {label} recv"), conv));
    }

    let mut deltas = Vec::new();
    for _ in 0..=reps {
        let t = Instant::now();
        std::hint::black_box(Delta::encode(&base, &new, Granularity::Block(64 * 1024))?);
        deltas.push(t.elapsed().as_secs_f64());
    }
    figures.push(fig("delta encode (3%)".into(), deltas.split_off(1)));
    figures.extend(
        element_deltas(&base, reps)?
            .into_iter()
            .map(|(n, t)| fig(n, t)),
    );
    Ok(StrategyBench {
        bytes: payload,
        figures,
    })
}

/// Element-level deltas ([`refit_runtime::delta::elements`]) of `base` against a version with
/// every 50th element nudged (2%): the encode and the apply, timed `reps` times after one
/// untimed run each.
fn element_deltas(base: &WeightSet, reps: usize) -> Result<Vec<(String, Vec<f64>)>> {
    use refit_runtime::delta::elements;
    let mut new = base.clone();
    for x in bytemuck::cast_slice_mut::<u8, f32>(new.bytes_mut()?)
        .iter_mut()
        .step_by(50)
    {
        *x += 1e-3;
    }
    let (mut enc, mut encodes, mut applies) = (Vec::new(), Vec::new(), Vec::new());
    let mut dst = base.bytes().to_vec();
    for _ in 0..=reps {
        enc.clear();
        let t = Instant::now();
        elements::encode(base.bytes(), new.bytes(), 4, &mut enc)?;
        encodes.push(t.elapsed().as_secs_f64());
        dst.copy_from_slice(base.bytes());
        let t = Instant::now();
        elements::apply(&mut dst, &enc)?;
        applies.push(t.elapsed().as_secs_f64());
    }
    if dst != new.bytes() {
        return Err(Error::Strategy(
            "an element delta applied to other bytes".into(),
        ));
    }
    Ok(vec![
        ("elements encode (2%)".into(), encodes.split_off(1)),
        ("elements apply (2%)".into(), applies.split_off(1)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use refit_runtime::inproc::{InProc, InProcReceiver, InProcSender};

    struct InProcLink;

    impl Link for InProcLink {
        type S = InProcSender;
        type R = InProcReceiver;
        fn name(&self) -> &'static str {
            "inproc"
        }
        fn make(&mut self, _: &Manifests) -> Result<(InProcSender, InProcReceiver)> {
            let hub = InProc::new();
            let r = hub.receiver();
            Ok((hub.sender()?, r))
        }
    }

    #[test]
    fn small_run_reports_every_figure() {
        let b = run(1 << 20, 2, &mut InProcLink).unwrap();
        let names: Vec<_> = b.figures.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "memcpy",
                "  tried memcpy",
                "  tried streaming",
                "update plain",
                "convert bf16 send",
                "update bf16 send",
                "convert bf16 recv",
                "update bf16 recv",
                "convert f16 recv",
                "convert fp8 recv",
                "delta encode (3%)",
                "elements encode (2%)",
                "elements apply (2%)"
            ]
        );
        assert_eq!(b.bytes, (4 * H * H + 6 * H * H) * 4);
        for f in &b.figures {
            assert_eq!(f.samples.len(), 2, "{f:?}");
            assert!(f.median() > 0.0 && f.gb_per_s().is_finite(), "{f:?}");
        }
        assert!(b.to_string().contains("convert bf16 recv"));
    }

    /// `cargo test --release -p refit-bench --lib strategy -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a check"]
    fn print_64_mib() {
        println!("{}", run(64 << 20, 5, &mut InProcLink).unwrap());
    }
}
