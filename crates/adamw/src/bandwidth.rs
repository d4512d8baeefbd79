//! A STREAM-style triad, `a[i] = b[i] + s·c[i]`, run with the same chunking
//! and thread pool as the optimizer. Its bytes per second (12 B per element
//! counted, the STREAM convention) are the bandwidth bound the optimizer is
//! measured against. Use arrays much larger than the last-level cache.
//!
//! Two forms: plain stores (what compiled STREAM does with most compilers;
//! the CPU also reads each line of `a` before writing it, so 16 B move per
//! 12 counted) and streaming stores (12 B move per 12 counted). Take the
//! faster of the two as the bound.

use rayon::prelude::*;

use crate::{AdamWError, Result, kernel, optimizer::DEFAULT_CHUNK_LEN};

/// Bytes STREAM counts per triad element: read b and c, write a.
pub const TRIAD_BYTES_PER_ELEMENT: usize = 12;

pub fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32) -> Result<()> {
    check(a, b, c)?;
    a.par_chunks_mut(DEFAULT_CHUNK_LEN)
        .zip(b.par_chunks(DEFAULT_CHUNK_LEN))
        .zip(c.par_chunks(DEFAULT_CHUNK_LEN))
        .for_each(|((a, b), c)| kernel::triad(a, b, c, s));
    Ok(())
}

/// The triad with non-temporal stores for `a`. `Ok(false)` when the CPU
/// has no streaming-store path (nothing is computed then).
pub fn triad_streaming(a: &mut [f32], b: &[f32], c: &[f32], s: f32) -> Result<bool> {
    check(a, b, c)?;
    if a.is_empty() {
        return Ok(true);
    }
    let used = a
        .par_chunks_mut(DEFAULT_CHUNK_LEN)
        .zip(b.par_chunks(DEFAULT_CHUNK_LEN))
        .zip(c.par_chunks(DEFAULT_CHUNK_LEN))
        .map(|((a, b), c)| kernel::triad_stream(a, b, c, s))
        .reduce(|| true, |x, y| x && y);
    Ok(used)
}

fn check(a: &[f32], b: &[f32], c: &[f32]) -> Result<()> {
    for (what, got) in [("triad b", b.len()), ("triad c", c.len())] {
        if got != a.len() {
            return Err(AdamWError::LengthMismatch {
                what,
                expected: a.len(),
                got,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triad_computes_and_checks_lengths() {
        let n = DEFAULT_CHUNK_LEN * 2 + 5;
        let b: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let c = vec![2.0f32; n];
        let mut a = vec![0.0; n];
        triad(&mut a, &b, &c, 3.0).unwrap();
        assert!(a.iter().enumerate().all(|(i, &x)| x == i as f32 + 6.0));
        assert!(triad(&mut a, &b[1..], &c, 1.0).is_err());
        // Odd offsets exercise the unaligned head and the tail.
        let mut a2 = vec![0.0; n];
        if triad_streaming(&mut a2[1..], &b[1..], &c[1..], 3.0).unwrap() {
            assert_eq!(a2[1..], a[1..]);
        }
        assert!(triad_streaming(&mut a2, &b, &c[2..], 1.0).is_err());
    }
}
