//! The checksum of every transport and file: xxh3-64 (XXH3's 64-bit hash), in one place.
//!
//! The implementation picks its vector unit when the process runs (AVX2 where the x86-64
//! CPU has it, SSE2 otherwise; NEON on aarch64), not the one the build targeted: the default
//! x86-64 target has SSE2 alone, and the transports hash every byte they move, on both
//! ends, in the path of every update. The digests are XXH3's whatever the unit (the tests
//! check XXH3's reference values on the unit the machine running them picks), so parties of
//! different builds or machines agree.

use std::hash::Hasher as _;

use twox_hash::xxhash3_64::{DEFAULT_SECRET_LENGTH, RawHasher, SecretBuffer};

/// xxh3-64 of `bytes` (seed 0).
#[inline]
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// xxh3-64 of `bytes` under `seed`.
#[inline]
pub fn xxh3_64_with_seed(bytes: &[u8], seed: u64) -> u64 {
    twox_hash::XxHash3_64::oneshot_with_seed(seed, bytes)
}

/// xxh3-64 of bytes given in pieces: the digest equals [`xxh3_64`] of their concatenation,
/// however they are cut. It allocates nothing (XXH3's default secret is static).
pub struct Xxh3(RawHasher<&'static [u8; DEFAULT_SECRET_LENGTH]>);

impl Xxh3 {
    /// Nothing hashed yet (seed 0).
    pub fn new() -> Self {
        Self(RawHasher::new(SecretBuffer::default()))
    }

    /// Back to nothing hashed.
    pub fn reset(&mut self) {
        *self = Self::new();
    }

    /// Hashes the next piece.
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    /// The digest of every piece so far (more may follow).
    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

impl Default for Xxh3 {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Xxh3 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Xxh3").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern() -> Vec<u8> {
        (0..1_000_003usize).map(|i| (i * 131 % 251) as u8).collect()
    }

    /// XXH3-64's reference digests, on the vector unit this machine picks (the empty
    /// input's is the one XXH3's authors publish; the others are those of the port this
    /// project used before): a different digest would make this build refuse every other
    /// build's bytes.
    #[test]
    fn the_digests_are_xxh3s_reference_digests() {
        assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(xxh3_64(b"abc"), 0x78af_5f94_892f_3950);
        let p = pattern();
        assert_eq!(xxh3_64(&p), 0x8667_eb50_3171_6db6);
        assert_eq!(xxh3_64_with_seed(&p, 7), 0xf5fe_b680_73f5_b2ac);
        assert_ne!(xxh3_64_with_seed(&p, 7), xxh3_64(&p));
    }

    #[test]
    fn a_digest_in_pieces_is_the_digest_of_the_whole() {
        let p = pattern();
        for cut in [1, 63, 64, 4093, 1 << 16] {
            let mut h = Xxh3::new();
            for c in p.chunks(cut) {
                h.update(c);
            }
            assert_eq!(h.digest(), xxh3_64(&p), "pieces of {cut} bytes");
        }
        assert_eq!(Xxh3::default().digest(), xxh3_64(b""));
        let mut h = Xxh3::new();
        h.update(b"not this");
        h.reset();
        h.update(&p);
        assert_eq!(h.digest(), xxh3_64(&p), "after a reset");
    }
}
