//! Refit's benchmarks, in one place: what `refit bench` measures. The `refit` tool parses
//! the command line into [`BenchArgs`] and calls [`run`]; everything measured, the physical
//! baselines of the same run and the tables printed live here.
//!
//! - [`links`]: every link of the factory against the baselines of the same run (`memcpy`,
//!   a raw loopback stream, first-touch of new memory, a device copy for the GPU links), the
//!   receivers of the process-crossing links in processes of their own (the `refit` binary
//!   run again as `refit __bench-child`, answered by [`child`]); the TCP pull of
//!   `refit pull`, and the mesh of sharded senders (in one process).
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

/// The hidden subcommand of the `refit` binary that runs a bench receiver process
/// ([`child`]).
pub const CHILD_COMMAND: &str = "__bench-child";
