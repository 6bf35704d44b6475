//! Byte kernels of the layout plan: concatenate, cut and transpose, exact copies only.

/// Bytes of one slab along `axis`: the product of the dims after `axis`, times the element size.
pub(crate) fn inner_bytes(shape: &[usize], axis: usize, elem: usize) -> usize {
    shape[axis + 1..].iter().product::<usize>() * elem
}

/// Number of outer blocks before `axis`.
pub(crate) fn outer(shape: &[usize], axis: usize) -> usize {
    shape[..axis].iter().product()
}

/// Concatenates `parts` along an axis: for each outer index, part 0's run, then part 1's, ...
/// `runs[k]` is part `k`'s run length in bytes (its size along the axis times the inner bytes).
pub(crate) fn concat(parts: &[&[u8]], runs: &[usize], outer: usize, dst: &mut [u8]) {
    let mut at = 0;
    for o in 0..outer {
        for (part, &run) in parts.iter().zip(runs) {
            dst[at..at + run].copy_from_slice(&part[o * run..(o + 1) * run]);
            at += run;
        }
    }
}

/// The inverse of [`concat`].
pub(crate) fn cut(src: &[u8], runs: &[usize], outer: usize, dsts: &mut [&mut [u8]]) {
    let mut at = 0;
    for o in 0..outer {
        for (dst, &run) in dsts.iter_mut().zip(runs) {
            dst[o * run..(o + 1) * run].copy_from_slice(&src[at..at + run]);
            at += run;
        }
    }
}

const TILE: usize = 32;

/// Tiled transpose over whole elements; `false` when the bytes are not aligned for `T`.
fn transpose_n<T: bytemuck::Pod>(src: &[u8], dst: &mut [u8], rows: usize, cols: usize) -> bool {
    let (Ok(src), Ok(dst)) = (
        bytemuck::try_cast_slice::<u8, T>(src),
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
    ) else {
        return false;
    };
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
    true
}

/// Transposes a row-major `[rows, cols]` matrix of `elem`-byte elements into `[cols, rows]`.
pub(crate) fn transpose(src: &[u8], dst: &mut [u8], rows: usize, cols: usize, elem: usize) {
    let done = match elem {
        1 => transpose_n::<u8>(src, dst, rows, cols),
        2 => transpose_n::<u16>(src, dst, rows, cols),
        4 => transpose_n::<u32>(src, dst, rows, cols),
        8 => transpose_n::<u64>(src, dst, rows, cols),
        _ => false,
    };
    if !done {
        for r in 0..rows {
            for c in 0..cols {
                let (s, d) = ((r * cols + c) * elem, (c * rows + r) * elem);
                dst[d..d + elem].copy_from_slice(&src[s..s + elem]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_is_exact_for_every_element_size() {
        // Offset 1 forces the unaligned fallback for elements wider than a byte.
        for (elem, skew) in [
            (1, 0),
            (2, 0),
            (2, 1),
            (3, 0),
            (4, 0),
            (4, 1),
            (8, 0),
            (8, 1),
        ] {
            let (rows, cols): (usize, usize) = (37, 70);
            let n = rows * cols * elem;
            let words: Vec<u64> = (0..(n + skew).div_ceil(8))
                .map(|i| (i as u64).wrapping_mul(0x0101_0203_0507_0b0d))
                .collect();
            let src = &bytemuck::cast_slice::<u64, u8>(&words)[skew..skew + n];
            let mut dst_words = vec![0_u64; (n + skew).div_ceil(8)];
            let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut dst_words)[skew..skew + n];
            transpose(src, dst, rows, cols, elem);
            for r in 0..rows {
                for c in 0..cols {
                    let s = (r * cols + c) * elem;
                    let d = (c * rows + r) * elem;
                    assert_eq!(src[s..s + elem], dst[d..d + elem], "elem {elem} at {r},{c}");
                }
            }
            let mut back = vec![0; src.len()];
            transpose(dst, &mut back, cols, rows, elem);
            assert_eq!(back, src);
        }
    }
}
