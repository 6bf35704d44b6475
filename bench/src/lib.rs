//! Refit's benchmarks, in one place: what `refit bench` measures. The `refit` tool parses
//! the command line into [`BenchArgs`] and calls [`run`]; everything measured, the physical
//! baselines of the same run and the tables printed live here.
//!
//! - [`links`]: every link of the factory (shared memory, TCP, files, NCCL) against the
//!   baselines of the same run (`memcpy`, a raw loopback stream, first-touch of new memory),
//!   with receivers in processes of their own (the `refit` binary re-executed as
//!   `refit __bench-child`, answered by [`child`]); the TCP pull of `refit pull` and the mesh
//!   of sharded senders.
//! - [`strategy`]: the weight strategies (where a conversion runs, deltas) over a link.
//! - `engine` and `engine_pause` (feature `actors`): a generating engine's pause per update
//!   beside the transport's time for the same bytes, a decoding step and `memcpy`.
//! - [`stats`]: the samples' summary (min, median, p99, max) and the byte sizes of the
//!   command line.
//!
//! Not a stable API: its items change with what `refit bench` prints.

#[cfg(feature = "actors")]
pub mod engine;
#[cfg(feature = "actors")]
mod engine_pause;
pub mod links;
pub mod stats;
pub mod strategy;

pub use links::{BenchArgs, ChildArgs, EngineArgs, child, run};
