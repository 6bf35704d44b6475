//! Element-level deltas: a span of a new version written as its byte-wise XOR against the
//! same span of a base version, in a compact form, so the bytes on the wire follow what
//! changed rather than which tensors or buckets did.
//!
//! The span is cut into chunks of [`CHUNK`] bytes; each chunk is written in whichever of
//! four forms is smallest (a chunk whose runs take at most a sixteenth of it goes as runs
//! without the planes being tried):
//!
//! - **same**: no byte changed (one byte on the wire);
//! - **runs**: the changed bytes, as runs of XOR bytes with the gaps between them (a sparse
//!   update: a learner that touched 2% of the elements, weights quantised to bf16 or fp8
//!   whose small steps leave most elements unchanged);
//! - **planes**: the XOR bytes split into byte planes by element width (the top bytes of
//!   the elements, sign and exponent, in one plane; the low mantissa bytes in others), each
//!   plane as runs or raw (a dense small step of f32 weights: every element changes, but
//!   only in its low bytes);
//! - **raw**: the new bytes themselves.
//!
//! The form is XOR, so [`apply`] turns a copy of the base into the new version in place.
//! Nothing here checks that the base is the one the encoder used: the callers verify the
//! result against the new version's checksums (which the TCP transport does per piece, so
//! a wrong base is refused naming the tensor).
//!
//! Wire form: a varint chunk size, then one frame per chunk: a tag byte, then the form's
//! payload (runs: a varint payload length, then `[varint gap, varint len, len bytes]`
//! repeated, the gap counted from the end of the previous run; planes: the width byte, then
//! per plane a tag (runs, as above, or raw: one byte per element), then the bytes past the
//! last whole element, raw XOR; raw: the chunk's bytes).

use crate::error::{Error, Result};

/// Bytes per chunk (each chunk picks its own form).
pub const CHUNK: usize = 64 << 10;

/// Zero bytes inside a run that are kept in it rather than ending it (a new run costs at
/// least two bytes of header).
const MERGE_GAP: usize = 3;

const SAME: u8 = 0;
const RUNS: u8 = 1;
const PLANES: u8 = 2;
const RAW: u8 = 3;

/// Encodes `new` against `base` (of the same length), appending to `out`. `width` is the
/// element size the plane form splits by (the dtype's size; 1 turns that form off).
///
/// # Errors
/// [`Error::Wire`] when the two spans differ in length, or `width` is 0 or over 255.
pub fn encode(base: &[u8], new: &[u8], width: usize, out: &mut Vec<u8>) -> Result<()> {
    if base.len() != new.len() {
        return Err(Error::Wire(format!(
            "element delta of {} bytes against a base of {}",
            new.len(),
            base.len()
        )));
    }
    let width = u8::try_from(width)
        .ok()
        .filter(|&w| w > 0)
        .ok_or_else(|| Error::Wire(format!("element delta of width {width}")))?;
    put_varint(out, CHUNK as u64);
    let mut xor = vec![0u8; CHUNK.min(new.len())];
    let mut scratch = Scratch::default();
    for (b, n) in base.chunks(CHUNK).zip(new.chunks(CHUNK)) {
        let x = xor.get_mut(..n.len()).unwrap_or_default();
        for ((x, b), n) in x.iter_mut().zip(b).zip(n) {
            *x = b ^ n;
        }
        encode_chunk(x, n, width, &mut scratch, out);
    }
    Ok(())
}

/// Buffers the encoder reuses from chunk to chunk.
#[derive(Default)]
struct Scratch {
    /// The chunk's runs.
    runs: Vec<u8>,
    /// One byte plane of the chunk.
    plane: Vec<u8>,
    /// That plane's runs.
    plane_runs: Vec<u8>,
}

/// Writes a runs frame (tag, length, runs).
fn put_runs(out: &mut Vec<u8>, runs: &[u8]) {
    out.push(RUNS);
    put_varint(out, runs.len() as u64);
    out.extend_from_slice(runs);
}

/// Encodes one chunk whose XOR is `x` and whose new bytes are `new`.
fn encode_chunk(x: &[u8], new: &[u8], width: u8, scratch: &mut Scratch, out: &mut Vec<u8>) {
    if x.iter().all(|&b| b == 0) {
        out.push(SAME);
        return;
    }
    let len = x.len();
    scratch.runs.clear();
    let runs = runs(x, len, &mut scratch.runs);
    // a sparse chunk: runs win, and the planes are not worth trying
    if runs.is_some_and(|n| n <= len / 16) {
        put_runs(out, &scratch.runs);
        return;
    }
    // the frames' sizes, tag and length included
    let runs_len = runs.map(|n| 1 + varint_len(n as u64) + n);
    let at = out.len();
    if width > 1 && len >= usize::from(width) {
        out.push(PLANES);
        planes(x, width, scratch, out);
        let planes_len = out.len() - at;
        if planes_len <= len && runs_len.is_none_or(|r| planes_len <= r) {
            return;
        }
        out.truncate(at);
    }
    match runs_len {
        Some(r) if r <= len => put_runs(out, &scratch.runs),
        _ => {
            out.push(RAW);
            out.extend_from_slice(new);
        }
    }
}

/// Writes the runs of nonzero bytes of `x` into `out` (cleared by the caller) and answers
/// their length, or `None` once that passes `limit`.
fn runs(x: &[u8], limit: usize, out: &mut Vec<u8>) -> Option<usize> {
    let start = out.len();
    let (mut i, mut last_end) = (0, 0);
    while i < x.len() {
        i = skip_zeros(x, i);
        if i == x.len() {
            break;
        }
        let run_start = i;
        let mut zeros = 0;
        while i < x.len() && zeros < MERGE_GAP {
            zeros = if x[i] == 0 { zeros + 1 } else { 0 };
            i += 1;
        }
        let run_end = i - zeros;
        put_varint(out, (run_start - last_end) as u64);
        put_varint(out, (run_end - run_start) as u64);
        out.extend_from_slice(&x[run_start..run_end]);
        last_end = run_end;
        if out.len() - start > limit {
            return None;
        }
    }
    Some(out.len() - start)
}

/// The index of the first nonzero byte of `x` at or after `i` (`x.len()` if none), eight
/// bytes at a time where it can.
fn skip_zeros(x: &[u8], mut i: usize) -> usize {
    while let Some(word) = x.get(i..i + 8) {
        if word.iter().any(|&b| b != 0) {
            break;
        }
        i += 8;
    }
    while i < x.len() && x[i] == 0 {
        i += 1;
    }
    i
}

/// Writes `x` split into `width` byte planes (each as runs or raw), then its tail.
fn planes(x: &[u8], width: u8, scratch: &mut Scratch, out: &mut Vec<u8>) {
    let w = usize::from(width);
    let n = x.len() / w;
    out.push(width);
    let Scratch {
        plane, plane_runs, ..
    } = scratch;
    plane.resize(n, 0);
    for p in 0..w {
        for (i, b) in plane.iter_mut().enumerate() {
            *b = x[i * w + p];
        }
        plane_runs.clear();
        match runs(plane, n.saturating_sub(4), plane_runs) {
            Some(_) => put_runs(out, plane_runs),
            None => {
                out.push(RAW);
                out.extend_from_slice(plane);
            }
        }
    }
    out.extend_from_slice(&x[n * w..]);
}

/// Turns `dst`, which holds the base's bytes of the span, into the new version's by the
/// encoded delta `enc` (from [`encode`] over a span of `dst.len()` bytes).
///
/// # Errors
/// [`Error::Wire`] naming the chunk when the encoding is malformed: an unknown form, a run
/// or a plane past its chunk, a length that does not fit, bytes left over or missing. `dst`
/// may then hold part of the change; callers apply into a copy they throw away on error.
pub fn apply(dst: &mut [u8], enc: &[u8]) -> Result<()> {
    let mut r = Reader { enc, at: 0 };
    let chunk = usize::try_from(r.varint()?)
        .ok()
        .filter(|&c| c > 0 && c <= 1 << 30)
        .ok_or_else(|| Error::Wire("element delta with a chunk size of 0 or over 1 GiB".into()))?;
    for (k, dst) in dst.chunks_mut(chunk).enumerate() {
        apply_chunk(dst, &mut r)
            .map_err(|e| Error::Wire(format!("element delta, chunk {k}: {e}")))?;
    }
    if r.at != enc.len() {
        return Err(Error::Wire(format!(
            "element delta: {} bytes past the last chunk",
            enc.len() - r.at
        )));
    }
    Ok(())
}

fn apply_chunk(dst: &mut [u8], r: &mut Reader<'_>) -> std::result::Result<(), String> {
    match r.byte()? {
        SAME => Ok(()),
        RUNS => {
            let len = r.len()?;
            apply_runs(dst, r.take(len)?, 1, 0)
        }
        PLANES => {
            let w = usize::from(r.byte()?);
            if w == 0 || w > dst.len() {
                return Err(format!("planes of width {w} in a chunk of {}", dst.len()));
            }
            let n = dst.len() / w;
            for p in 0..w {
                match r.byte()? {
                    RUNS => {
                        let len = r.len()?;
                        apply_runs(&mut dst[..n * w], r.take(len)?, w, p)?;
                    }
                    RAW => {
                        for (i, b) in r.take(n)?.iter().enumerate() {
                            dst[i * w + p] ^= b;
                        }
                    }
                    t => return Err(format!("plane {p} in unknown form {t}")),
                }
            }
            let tail = dst.len() - n * w;
            for (d, b) in dst[n * w..].iter_mut().zip(r.take(tail)?) {
                *d ^= b;
            }
            Ok(())
        }
        RAW => {
            let len = dst.len();
            dst.copy_from_slice(r.take(len)?);
            Ok(())
        }
        t => Err(format!("unknown form {t}")),
    }
}

/// XORs the runs of `runs` into every `stride`-th byte of `dst` from `offset` (the
/// elements' plane `offset`; stride 1: the bytes themselves).
fn apply_runs(
    dst: &mut [u8],
    runs: &[u8],
    stride: usize,
    offset: usize,
) -> std::result::Result<(), String> {
    let slots = (dst.len() - offset).div_ceil(stride);
    let mut r = Reader { enc: runs, at: 0 };
    let mut pos = 0usize;
    while r.at < runs.len() {
        let gap = r.len()?;
        let len = r.len()?;
        let start = pos
            .checked_add(gap)
            .filter(|&s| s.saturating_add(len) <= slots);
        let start = start.ok_or_else(|| format!("a run past the chunk's {slots} elements"))?;
        for (i, b) in r.take(len)?.iter().enumerate() {
            dst[(start + i) * stride + offset] ^= b;
        }
        pos = start + len;
    }
    Ok(())
}

/// Bytes [`put_varint`] writes for `v`.
fn varint_len(v: u64) -> usize {
    (64 - v.leading_zeros() as usize).div_ceil(7).max(1)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Reads an encoding front to back.
struct Reader<'a> {
    enc: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> std::result::Result<u8, String> {
        let b = *self.enc.get(self.at).ok_or("the encoding ends early")?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64> {
        self.varint_str().map_err(Error::Wire)
    }

    fn varint_str(&mut self) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err("a varint of more than 64 bits".into())
    }

    fn len(&mut self) -> std::result::Result<usize, String> {
        usize::try_from(self.varint_str()?).map_err(|_| "a length past the address space".into())
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.enc.len());
        let end =
            end.ok_or_else(|| format!("{n} bytes asked, {} left", self.enc.len() - self.at))?;
        let s = &self.enc[self.at..end];
        self.at = end;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic stream of pseudo-random numbers (xorshift).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn round_trip(base: &[u8], new: &[u8], width: usize) -> usize {
        let mut enc = Vec::new();
        encode(base, new, width, &mut enc).unwrap();
        let mut dst = base.to_vec();
        apply(&mut dst, &enc).unwrap();
        assert_eq!(dst, new, "decoded bytes differ");
        enc.len()
    }

    #[test]
    fn every_form_decodes_bit_identically() {
        let mut rng = Rng(7);
        let n = 3 * CHUNK / 4 + 5; // 3 chunks and a ragged tail
        let base: Vec<f32> = (0..n).map(|_| rng.unit() - 0.5).collect();
        let b = f32s(&base);
        // nothing changed: one byte per chunk and the header
        assert!(round_trip(&b, &b, 4) < 8);
        // 2% of the elements changed: about their bytes, far under the model's
        let mut sparse = base.clone();
        for _ in 0..n / 50 {
            let i = (rng.next() as usize) % n;
            sparse[i] = rng.unit();
        }
        let sent = round_trip(&b, &f32s(&sparse), 4);
        assert!(
            sent * 100 < b.len() * 5,
            "2% changed sent {sent} of {}",
            b.len()
        );
        // a small dense step: every element changes in its low bytes only
        let dense: Vec<f32> = base
            .iter()
            .map(|x| x * (1.0 + 1e-3 * (rng.unit() - 0.5)))
            .collect();
        let sent = round_trip(&b, &f32s(&dense), 4);
        assert!(
            sent * 10 < b.len() * 8,
            "a dense small step sent {sent} of {}",
            b.len()
        );
        // everything new: raw, at most a byte a chunk over the model
        let fresh: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let sent = round_trip(&b, &f32s(&fresh), 4);
        assert!(sent <= b.len() + b.len() / CHUNK + 16, "{sent}");
        // any width, odd lengths, spans shorter than a width
        for width in [1, 2, 3, 4, 8] {
            for len in [0, 1, 2, 7, 100, CHUNK + 3] {
                let base: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                let mut new = base.clone();
                for (i, x) in new.iter_mut().enumerate() {
                    if i % 7 == 0 {
                        *x ^= rng.next() as u8 | 1;
                    }
                }
                round_trip(&base, &new, width);
            }
        }
    }

    #[test]
    fn malformed_encodings_are_refused_naming_the_chunk() {
        let base = vec![1u8; CHUNK + 10];
        let mut new = base.clone();
        new[CHUNK + 3] = 9;
        new[5] = 4;
        let mut enc = Vec::new();
        encode(&base, &new, 4, &mut enc).unwrap();
        // cut short anywhere: refused, never a panic
        for cut in 0..enc.len() {
            let mut dst = base.clone();
            assert!(apply(&mut dst, &enc[..cut]).is_err(), "cut at {cut}");
        }
        // trailing bytes, a wrong span, an unknown form
        let mut long = enc.clone();
        long.push(0);
        assert!(
            apply(&mut base.clone(), &long)
                .unwrap_err()
                .to_string()
                .contains("past the last chunk")
        );
        assert!(apply(&mut vec![1u8; CHUNK + 2], &enc).is_err());
        let mut bad = enc.clone();
        // the first frame's tag follows the chunk size's three bytes
        assert_eq!(bad[3], RUNS);
        bad[3] = 9;
        let e = apply(&mut base.clone(), &bad).unwrap_err().to_string();
        assert!(e.contains("chunk 0") && e.contains("unknown form 9"), "{e}");
        // every byte flipped in turn: refused or decoded, never a panic
        for i in 0..enc.len() {
            let mut bad = enc.clone();
            bad[i] ^= 0xff;
            let _ = apply(&mut base.clone(), &bad);
        }
        assert!(encode(&base, &new[1..], 4, &mut Vec::new()).is_err());
        assert!(encode(&base, &new, 0, &mut Vec::new()).is_err());
    }
}
