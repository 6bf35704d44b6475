//! The mesh rows of `refit bench`: M trainer shards, each holding its rows of every tensor,
//! publish a version to N engines, each pulling its columns from every shard at once
//! (`refit_transports::mesh`), timed from the publish until every engine holds its part,
//! against the raw loopback TCP stream of the same bytes measured in the same run.
//!
//! Every end runs in this process: M nodes on loopback serve the shards' pulls, N threads
//! pull. Together the engines read the model once (each its 1/N, plus a checksum per
//! shard), so on one machine the ratio says what the mesh's own work costs beside one
//! socket carrying the same bytes; across hosts each shard's uplink carries 1/M of them,
//! which `examples/scripts/mesh-netns.sh` measures.

use std::sync::Arc;
use std::time::Instant;

use refit_node::{ClusterToken, Node};
use refit_runtime::mesh::{extract, slices};
use refit_runtime::{DType, Error, Manifest, ModelId, Result, Version};
use refit_transports::mesh::{MeshReceiver, MeshSender};

use super::{BoxResult, Row, WAIT, bench_token, row, tcp};
use crate::stats::{Summary, fmt_bytes};

/// A shape of the mesh: trainer shards and engines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    senders: usize,
    receivers: usize,
}

impl std::str::FromStr for Shape {
    type Err = String;

    /// `MxN`: M shards, N engines, each at least 1.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("bad mesh shape {s:?}: want MxN (shards x engines), as 2x2");
        let (m, n) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
        let (senders, receivers) = (
            m.trim().parse::<usize>().map_err(|_| bad())?,
            n.trim().parse::<usize>().map_err(|_| bad())?,
        );
        if senders == 0 || receivers == 0 {
            return Err(bad());
        }
        Ok(Self { senders, receivers })
    }
}

/// The model of the mesh rows: eight f32 matrices of 2048 columns, about `size` bytes in
/// all, rows a multiple of every shape's shards and columns of its engines.
fn manifest(size: usize, shapes: &[Shape]) -> Result<Manifest> {
    let lcm = |a: usize, b: usize| {
        let (mut x, mut y) = (a, b);
        while y != 0 {
            (x, y) = (y, x % y);
        }
        a / x * b
    };
    let rows_of = shapes.iter().map(|s| s.senders).fold(1, lcm);
    let cols = shapes
        .iter()
        .map(|s| s.receivers)
        .fold(1, lcm)
        .next_multiple_of(2048);
    let rows = (size / (8 * cols * 4)).max(1).next_multiple_of(rows_of);
    (0..8)
        .fold(Manifest::builder(), |b, i| {
            b.tensor(format!("block{i}.w"), DType::F32, &[rows, cols])
        })
        .build()
}

/// The mesh rows at `size`: the raw stream of the model's bytes, then one row per shape,
/// each over `warmup` untimed and `iters` timed versions.
///
/// # Errors
/// A node that cannot start, a plan refused, a pull that fails or times out.
pub(super) fn rows(
    shapes: &[Shape],
    size: usize,
    warmup: usize,
    iters: usize,
) -> BoxResult<Vec<Row>> {
    let m = manifest(size, shapes)?;
    let bytes = m.payload_len();
    let stream = tcp::baseline(bytes, iters.max(3))?;
    let mut rows = vec![row(
        "tcp-loopback",
        "stream (beside the mesh)",
        bytes,
        1,
        stream,
        "-",
        stream.median,
    )];
    let token = bench_token();
    let model = ModelId::new("policy")?;
    for &shape in shapes {
        eprintln!(
            "refit bench: mesh {}->{} {}",
            shape.senders,
            shape.receivers,
            fmt_bytes(bytes)
        );
        let times = time_shape(&m, &model, shape, token, warmup, iters)?;
        let each = bytes / shape.receivers;
        rows.push(row(
            "mesh",
            &format!(
                "{}->{}, {} each",
                shape.senders,
                shape.receivers,
                fmt_bytes(each)
            ),
            bytes,
            shape.receivers,
            Summary::of(&times),
            "tcp-loopback",
            stream.median,
        ));
    }
    Ok(rows)
}

/// Per timed version, the time from the shards' publish until every engine holds its part.
fn time_shape(
    m: &Manifest,
    model: &ModelId,
    shape: Shape,
    token: &ClusterToken,
    warmup: usize,
    iters: usize,
) -> BoxResult<Vec<std::time::Duration>> {
    let nodes = (0..shape.senders)
        .map(|_| Node::loopback(token.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let senders = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            MeshSender::on_node(node, model.clone(), m, slices(m, 0, i, shape.senders))
        })
        .collect::<Result<Vec<_>>>()?;
    // each shard's rows, cut once from the whole tensors: what moves is the mesh's work
    let mut data: Vec<Vec<Arc<[u8]>>> = vec![Vec::new(); senders.len()];
    for t in m.tensors() {
        let whole: Vec<u8> = (0..t.len).map(|i| (i % 251) as u8).collect();
        for (s, held) in senders.iter().zip(&mut data) {
            let part = s.parts().iter().find(|(n, _)| *n == t.name);
            if let Some((name, part)) = part {
                held.push(extract(m, name, part, &whole)?);
            }
        }
    }
    let book: Vec<_> = senders
        .iter()
        .map(|s| (s.endpoint(), s.parts().clone()))
        .collect();
    let mut receivers = (0..shape.receivers)
        .map(|j| {
            MeshReceiver::new(
                m,
                book.clone(),
                slices(m, 1, j, shape.receivers),
                token.clone(),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut times = Vec::with_capacity(iters);
    for v in 1..=(warmup + iters) as u64 {
        let t = Instant::now();
        for (s, d) in senders.iter().zip(&data) {
            s.publish(Version(v), d.clone())?;
        }
        std::thread::scope(|scope| {
            let pulls: Vec<_> = receivers
                .iter_mut()
                .map(|r| {
                    // a steady engine pulls into the buffers of the version it let go
                    scope.spawn(move || r.pull(Version(v), WAIT).map(|got| r.recycle(got)))
                })
                .collect();
            pulls
                .into_iter()
                .try_for_each(|p| p.join().map_err(|_| Error::State("a mesh pull panicked"))?)
        })?;
        if v as usize > warmup {
            times.push(t.elapsed());
        }
    }
    Ok(times)
}
