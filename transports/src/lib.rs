//! Refit transports: each module moves bytes one way and implements the runtime's
//! [`SenderTransport`](refit_runtime::SenderTransport) and
//! [`ReceiverTransport`](refit_runtime::ReceiverTransport).
//!
//! - [`inproc`]: threads and actors of one process; publishing is a pointer swap.
//! - [`broadcast`]: trainer to many receivers through a communicator (CPU chain or NCCL),
//!   a prepare message per bucket, whole versions applied, generations when ranks change.
//! - [`nccl`]: the broadcast transport over NCCL, in the link factory as `nccl`
//!   (feature `cuda`; a stand-in that says so without it).
//! - [`cuda_ipc`]: processes on one GPU, the shared-memory transport with its slots in
//!   exported device memory, in the link factory as `cuda-ipc` (feature `cuda`; a stand-in
//!   that says so without it).
//! - [`collective`]: communicators per membership generation (broadcast, send/recv with
//!   deadlines, abort); backends for CPU (node TCP) and NCCL (feature `cuda`).
//! - [`gpu`]: the CUDA/NCCL probe, pinned host staging and CUDA IPC between processes on
//!   one GPU (feature `cuda`).
//! - [`tcp`]: processes on one host or many; a sender agent serves versions that receivers
//!   pull over parallel streams (full or delta, checksummed, relayed receiver to receiver).
//! - [`mod@file`]: a directory of safetensors files, one per version (tmp name, fsync, rename),
//!   a pointer naming the newest; readable by any safetensors reader, checksummed for Refit.
//! - [`shm`]: processes of one host; a segment per model with N slots, a seqlock header per
//!   slot, readers pinned to the slot they use, futex wake-ups.
//!
//! - [`link`]: transports as values: a factory per transport, by name, and the
//!   [`ReceiverSpec`](link::ReceiverSpec) a sender end ships to its receivers.
//!
//! Errors are the runtime's [`refit_runtime::Error`]: the transport traits return it, so a
//! second enum here would only be converted back.
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

pub mod broadcast;
pub mod collective;
pub mod cuda_ipc;
pub mod file;
pub mod gpu;
pub mod inproc;
pub mod link;
pub mod mesh;
pub mod nccl;
mod pool;
pub mod shm;
pub mod tcp;

/// Bytes a hop of a chain passes on per write (1 MiB): the CPU broadcast chain's chunk, and
/// the most a TCP relay (or sender) writes at once. Small enough that a hop delays the chain
/// by little, large enough that each write costs few system calls.
pub(crate) const FORWARD_PIECE: usize = 1 << 20;
