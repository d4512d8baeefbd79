//! Data movement on row-major buffers read as `[rows, last]`; generic over
//! the element type so stored bf16/f16 tensors move without conversion.

/// Rows `start..start + len` of `data` read as `[_, last]`.
pub fn slice_rows<T: Copy>(data: &[T], last: usize, start: usize, len: usize) -> Vec<T> {
    data[start * last..(start + len) * last].to_vec()
}

/// Overwrites rows `start..` of `dst` with `src` (both `[_, last]`).
pub fn write_rows<T: Copy>(dst: &mut [T], last: usize, start: usize, src: &[T]) {
    dst[start * last..start * last + src.len()].copy_from_slice(src);
}

/// Splits every row of `data: [rows, sum(sizes)]` into consecutive parts.
pub fn split_last<T: Copy>(data: &[T], sizes: &[usize]) -> Vec<Vec<T>> {
    let last: usize = sizes.iter().sum();
    let rows = data.len().checked_div(last).unwrap_or(0);
    let mut parts: Vec<Vec<T>> = sizes.iter().map(|&s| Vec::with_capacity(rows * s)).collect();
    for r in 0..rows {
        let mut off = r * last;
        for (p, &s) in parts.iter_mut().zip(sizes) {
            p.extend_from_slice(&data[off..off + s]);
            off += s;
        }
    }
    parts
}

/// Inverse of [`split_last`]: `parts[i]` is `[rows, lasts[i]]`.
pub fn concat_last<T: Copy>(parts: &[&[T]], lasts: &[usize], rows: usize) -> Vec<T> {
    let total: usize = lasts.iter().sum();
    let mut out = Vec::with_capacity(rows * total);
    for r in 0..rows {
        for (p, &l) in parts.iter().zip(lasts) {
            out.extend_from_slice(&p[r * l..(r + 1) * l]);
        }
    }
    out
}
