//! Where everything lives in the board and data segments.
//!
//! Board segment (one per scheme):
//!
//! ```text
//! 0    magic u64 | layout u32 | n_models u32 | n_slots u32 | max_receivers u32
//! 24   flags u32 | state u32 | commit_seq u32 (seqlock + futex) | ack_seq u32 (futex)
//! 40   directory_len u64 | generation u64
//! 64   per model: version u64, slot u64                         (MAX_MODELS entries)
//! 192  the sender's owner record (pid, lease, start time, pid namespace, heartbeat)
//! 256  per receiver (RECEIVER_STRIDE bytes): state u32, +8 owner record, +40 behind u32,
//!      +64 acked version per model u64, +128 pins[model][slot] u32
//! DIR  msgpack of the directory (manifests, data segment paths), page-aligned
//! ```
//!
//! Data segment (one per model): room for `n_slots` slots, each a page of header (`seq u64`
//! even when stable and odd while written, `version u64`, `checksum u64` when the board's
//! flags say so) followed by the arena, page-aligned. The file is sparse: the sender
//! allocates the slots it starts with ([`ShmConfig::slots`](super::ShmConfig::slots)) and
//! the others only when readers hold on to old versions (see the sender's slot policy).

/// "REFITSHM".
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"REFITSHM");
/// The board's layout version, the shm transport's protocol version: a receiver refuses a
/// board of another layout naming both versions
/// ([`Error::Protocol`](refit_runtime::Error::Protocol)). 3: growable data segments, a
/// per-version checksum, the receivers' `behind` word (2: a fixed slot count; 1: bare pids).
pub const LAYOUT: u32 = 3;
/// The name of the layout in errors.
pub(crate) const LAYOUT_NAME: &str = "shm board layout";
pub(crate) const PAGE: usize = 4096;
/// Most models one scheme carries.
pub const MAX_MODELS: usize = 8;
/// Most slots per model.
pub const MAX_SLOTS: usize = 8;

pub(crate) const OFF_MAGIC: usize = 0;
pub(crate) const OFF_LAYOUT: usize = 8;
pub(crate) const OFF_N_MODELS: usize = 12;
pub(crate) const OFF_N_SLOTS: usize = 16;
pub(crate) const OFF_MAX_RECEIVERS: usize = 20;
/// Board flags ([`FLAG_CHECKSUM`]).
pub(crate) const OFF_FLAGS: usize = 24;
pub(crate) const OFF_STATE: usize = 28;
pub(crate) const OFF_COMMIT_SEQ: usize = 32;
pub(crate) const OFF_ACK_SEQ: usize = 36;
pub(crate) const OFF_DIR_LEN: usize = 40;
pub(crate) const OFF_GENERATION: usize = 48;
pub(crate) const OFF_ENTRIES: usize = 64;
/// The sender's owner record (see `lease`).
pub(crate) const OFF_SENDER: usize = 192;
pub(crate) const ENTRY_STRIDE: usize = 16;
pub(crate) const OFF_RECEIVERS: usize = 256;
pub(crate) const RECEIVER_STRIDE: usize = 512;
pub(crate) const R_STATE: usize = 0;
/// A receiver's owner record (see `lease`), relative to its entry.
pub(crate) const R_OWNER: usize = 8;
/// Set (1) by the sender when the receiver held a slot two versions old: the receiver reads
/// its next version into private memory instead of pinning it, and clears it (u32).
pub(crate) const R_BEHIND: usize = 40;
pub(crate) const R_ACKED: usize = 64;
pub(crate) const R_PINS: usize = 128;

/// Every version carries a checksum in its slot header, verified by the readers.
pub(crate) const FLAG_CHECKSUM: u32 = 1;

/// Slot header: the sequence (even when stable, odd while written), u64.
pub(crate) const SLOT_SEQ: usize = 0;
/// Slot header: the version it holds, u64.
pub(crate) const SLOT_VERSION: usize = 8;
/// Slot header: the arena's checksum ([`super::checksum`]), u64, when [`FLAG_CHECKSUM`].
pub(crate) const SLOT_CHECKSUM: usize = 16;

pub(crate) const STATE_INIT: u32 = 0;
pub(crate) const STATE_LIVE: u32 = 1;
pub(crate) const STATE_SHUTDOWN: u32 = 2;

pub(crate) const RECEIVER_FREE: u32 = 0;
pub(crate) const RECEIVER_CLAIMED: u32 = 1;
/// An entry being freed (by the sender's reaper or its own receiver): nobody claims it, and
/// whoever moved it here puts it back to claimed if the owner turns out to be live.
pub(crate) const RECEIVER_FREEING: u32 = 2;

pub(crate) fn entry_version(model: usize) -> usize {
    OFF_ENTRIES + model * ENTRY_STRIDE
}
pub(crate) fn entry_slot(model: usize) -> usize {
    OFF_ENTRIES + model * ENTRY_STRIDE + 8
}
pub(crate) fn receiver(idx: usize) -> usize {
    OFF_RECEIVERS + idx * RECEIVER_STRIDE
}
pub(crate) fn behind(idx: usize) -> usize {
    receiver(idx) + R_BEHIND
}
pub(crate) fn acked(idx: usize, model: usize) -> usize {
    receiver(idx) + R_ACKED + model * 8
}
pub(crate) fn pin(idx: usize, model: usize, slot: usize) -> usize {
    receiver(idx) + R_PINS + (model * MAX_SLOTS + slot) * 4
}
pub(crate) fn directory_offset(max_receivers: usize) -> usize {
    round_up(receiver(max_receivers))
}
pub(crate) fn round_up(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}
/// Bytes from one slot's start to the next's.
pub(crate) fn slot_stride(arena_len: usize) -> usize {
    PAGE + round_up(arena_len.max(1))
}

const _: () = assert!(OFF_ENTRIES + MAX_MODELS * ENTRY_STRIDE <= OFF_SENDER);
const _: () = assert!(OFF_SENDER + super::lease::REC_LEN <= OFF_RECEIVERS);
const _: () = assert!(R_OWNER + super::lease::REC_LEN <= R_BEHIND);
const _: () = assert!(R_BEHIND + 4 <= R_ACKED);
const _: () = assert!(SLOT_CHECKSUM + 8 <= PAGE);
const _: () = assert!(R_PINS + MAX_MODELS * MAX_SLOTS * 4 <= RECEIVER_STRIDE);
const _: () = assert!(R_ACKED + MAX_MODELS * 8 <= R_PINS);
