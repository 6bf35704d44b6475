//! The per-version checksum of shared memory ([`ShmConfig::checksum`](super::ShmConfig)):
//! xxh3-64 of every [`PIECE`] of the arena (fixed, so that every party finds the same
//! checksum whatever its thread count), then xxh3-64 of those hashes (little-endian, in
//! order) seeded with the arena's length. Pieces are hashed on several threads; the sender
//! hashes each piece of the trainer's bytes and copies it into the slot right after, while
//! it is still in cache, so a checksummed publish reads its bytes from memory once.

use refit_runtime::hash::{xxh3_64, xxh3_64_with_seed};

pub(crate) use refit_runtime::copy::PIECE;
use refit_runtime::copy::{copy_piece, share, threads_for};

fn combine(len: usize, hashes: &[u64]) -> u64 {
    let bytes: Vec<u8> = hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, len as u64)
}

/// The checksum of `bytes`, hashed on up to `threads` threads.
pub(crate) fn checksum(bytes: &[u8], threads: usize) -> u64 {
    let mut hashes = vec![0u64; bytes.len().div_ceil(PIECE)];
    share(
        threads_for(bytes.len(), threads),
        hashes.iter_mut().zip(bytes.chunks(PIECE)),
        |(h, piece)| *h = xxh3_64(piece),
    );
    combine(bytes.len(), &hashes)
}

/// Copies `src` into `dst` (same length) on up to `threads` threads and answers the
/// checksum of the bytes copied, each piece hashed right before it is copied (with
/// streaming stores for a large copy, as `refit_runtime::copy::copy_parallel`).
///
/// # Panics
/// If the lengths differ (a caller's bug: every caller sizes both from one manifest).
pub(crate) fn copy_hashed(dst: &mut [u8], src: &[u8], threads: usize) -> u64 {
    assert_eq!(dst.len(), src.len(), "copy_hashed: lengths differ");
    let whole = src.len();
    let mut hashes = vec![0u64; src.len().div_ceil(PIECE)];
    share(
        threads_for(src.len(), threads),
        hashes
            .iter_mut()
            .zip(dst.chunks_mut(PIECE).zip(src.chunks(PIECE))),
        |(h, (d, s))| {
            *h = xxh3_64(s);
            copy_piece(d, s, whole);
        },
    );
    combine(src.len(), &hashes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 % 251) as u8).collect()
    }

    #[test]
    fn every_split_agrees_and_every_byte_counts() {
        for len in [
            0,
            17,
            PIECE,
            PIECE + 1,
            refit_runtime::copy::SPLIT_FROM - 1,
            refit_runtime::copy::SPLIT_FROM + 3 * PIECE + 5,
            refit_runtime::copy::STREAM_FROM + PIECE + 3,
        ] {
            let src = pattern(len);
            let one = checksum(&src, 1);
            for threads in [2, 3, 8, 64] {
                assert_eq!(checksum(&src, threads), one, "len {len}, {threads} threads");
                let mut dst = vec![0u8; len];
                assert_eq!(copy_hashed(&mut dst, &src, threads), one, "len {len}");
                assert!(dst == src, "len {len}: copy differs");
            }
            if len > 0 {
                // one flipped bit anywhere, and the same bytes at another length, differ
                let mut bad = src.clone();
                bad[len / 2] ^= 1;
                assert_ne!(checksum(&bad, 2), one, "len {len}");
                assert_ne!(checksum(&src[..len - 1], 2), one, "len {len}");
            }
        }
    }
}
