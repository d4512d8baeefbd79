//! The fused inner loop. Written once, generically, then compiled twice:
//! with AVX2+FMA enabled (chosen at run time when the CPU has them) and for
//! the baseline target. Stable Rust only: `#[target_feature]` on a plain
//! function plus `is_x86_feature_detected!`, no nightly SIMD.
//!
//! Every slice is cut to the same length before the loop so that LLVM drops
//! the bounds checks and vectorises; the loop body has no branches (the
//! decay mask is resolved outside into uniform pieces, the transport kind
//! is a type parameter). The gradient's sum of squares ([`sum_sq`]) and its
//! zeroing run after the loop, over the piece it left in cache
//! (`optimizer::run_leaf`).

use std::sync::atomic::{AtomicBool, Ordering};

use half::{bf16, f16};
use megatrain_tensor::convert::f32_to_f16_sat_bits;

use crate::bf16::f32_to_bf16_bits;

/// Per-call scalars, already folded: nothing in the loop depends on `t`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Consts {
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
    /// `1 / sqrt(1 − β2^t)`.
    pub inv_sqrt_bc2: f32,
    /// `1 − lr·wd` on decayed pieces; exactly 1 elsewhere.
    pub decay_factor: f32,
    pub grad_scale: f32,
}

/// How `a·b + c` is evaluated: fused where the CPU has FMA, separately
/// rounded elsewhere (where `mul_add` would be a slow libm call).
pub(crate) trait Arith {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

pub(crate) struct Fused;
pub(crate) struct Plain;

impl Arith for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

impl Arith for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// Where the updated parameter's transport copy goes.
pub(crate) trait Sink {
    /// Cuts the sink to exactly `n` elements (callers guarantee the length).
    fn cut(self, n: usize) -> Self;
    fn put(&mut self, i: usize, p: f32);
}

pub(crate) struct NoSink;
pub(crate) struct Bf16Sink<'a>(pub &'a mut [bf16]);
pub(crate) struct F32Sink<'a>(pub &'a mut [f32]);
pub(crate) struct F16Sink<'a>(pub &'a mut [f16]);

impl Sink for NoSink {
    #[inline(always)]
    fn cut(self, _: usize) -> Self {
        self
    }
    #[inline(always)]
    fn put(&mut self, _: usize, _: f32) {}
}

impl Sink for Bf16Sink<'_> {
    #[inline(always)]
    fn cut(self, n: usize) -> Self {
        Bf16Sink(&mut self.0[..n])
    }
    #[inline(always)]
    fn put(&mut self, i: usize, p: f32) {
        self.0[i] = bf16::from_bits(f32_to_bf16_bits(p));
    }
}

impl Sink for F16Sink<'_> {
    #[inline(always)]
    fn cut(self, n: usize) -> Self {
        F16Sink(&mut self.0[..n])
    }
    #[inline(always)]
    fn put(&mut self, i: usize, p: f32) {
        self.0[i] = f16::from_bits(f32_to_f16_sat_bits(p));
    }
}

impl Sink for F32Sink<'_> {
    #[inline(always)]
    fn cut(self, n: usize) -> Self {
        F32Sink(&mut self.0[..n])
    }
    #[inline(always)]
    fn put(&mut self, i: usize, p: f32) {
        self.0[i] = p;
    }
}

/// One AdamW step over equally long pieces of p, g, m, v (and the sink).
#[inline(always)]
fn update<A: Arith, S: Sink>(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], sink: S) {
    let n = p.len();
    let (g, m, v, mut sink) = (&g[..n], &mut m[..n], &mut v[..n], sink.cut(n));
    for i in 0..n {
        let gi = g[i] * k.grad_scale;
        let mi = A::mul_add(k.beta1, m[i], k.one_minus_beta1 * gi);
        let vi = A::mul_add(k.beta2, v[i], k.one_minus_beta2 * gi * gi);
        let denom = A::mul_add(vi.sqrt(), k.inv_sqrt_bc2, k.eps);
        // Decay and update in one rounding of p (with FMA): p is the value
        // whose f32 rounding error accumulates over a run.
        let pi = A::mul_add(p[i], k.decay_factor, -(k.step_size * (mi / denom)));
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        sink.put(i, pi);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn update_avx2<S: Sink>(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], sink: S) {
    update::<Fused, S>(k, p, g, m, v, sink)
}

fn update_baseline<S: Sink>(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], sink: S) {
    update::<Plain, S>(k, p, g, m, v, sink)
}

/// Whether the AVX2+FMA build of the loops runs on this CPU (std caches
/// the answer, so asking per chunk costs an atomic load).
#[inline]
pub fn simd_path() -> &'static str {
    if has_avx2_fma() { "avx2+fma" } else { "baseline" }
}

#[inline]
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs the loop on the best build this CPU supports.
#[inline]
pub(crate) fn dispatch<S: Sink>(k: &Consts, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], sink: S) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU reports AVX2 and FMA, the features the function enables.
        unsafe { update_avx2(k, p, g, m, v, sink) };
        return;
    }
    update_baseline(k, p, g, m, v, sink)
}

/// Whether this CPU converts f32 to f16 in hardware (`vcvtps2ph`).
#[inline]
pub(crate) fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[i] = f32_to_f16_sat_bits(src[i])` with the CPU's conversion
/// instruction, eight at a time; false (and nothing written) without F16C.
/// The select chain of [`f32_to_f16_sat_bits`] costs the fused pass about
/// a third more than bf16's one select (BENCHMARKS.md, CPU AdamW); one
/// `vcvtps2ph` per eight elements does the rounding, after a clamp that
/// keeps finite values in range.
pub(crate) fn to_f16_sat(src: &[f32], dst: &mut [f16]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU reports AVX and F16C, the features the function enables.
        unsafe {
            match PLAIN_COPY_STORES.load(Ordering::Relaxed) {
                false => to_f16_sat_f16c::<true>(src, dst),
                true => to_f16_sat_f16c::<false>(src, dst),
            }
        };
        return true;
    }
    let _ = (src, dst);
    false
}

/// Plain stores for the f16 copy instead of streaming ones, for timing
/// the two in one process ([`set_plain_copy_stores`]).
static PLAIN_COPY_STORES: AtomicBool = AtomicBool::new(false);

/// Writes the hardware-converted f16 transport copy with plain stores
/// (`true`) or streaming ones (`false`, the default) from now on, in this
/// process. Same bits either way; for `xtask bench-adamw`, which times
/// both.
#[doc(hidden)]
pub fn set_plain_copy_stores(plain: bool) {
    PLAIN_COPY_STORES.store(plain, Ordering::Relaxed);
}

/// With `STREAM` the copy is written with streaming (non-temporal) stores:
/// nothing reads it until the next step's upload, and a plain store first
/// reads each line of it from memory (write-allocate), 2 bytes a parameter
/// more of the ~30 the bandwidth-bound update moves.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn to_f16_sat_f16c<const STREAM: bool>(src: &[f32], dst: &mut [f16]) {
    use std::arch::x86_64::{
        __m128i, _CMP_LT_OQ, _MM_FROUND_TO_NEAREST_INT, _mm_sfence, _mm_storeu_si128, _mm_stream_si128,
        _mm256_and_ps, _mm256_blendv_ps, _mm256_castsi256_ps, _mm256_cmp_ps, _mm256_cvtps_ph,
        _mm256_loadu_ps, _mm256_max_ps, _mm256_min_ps, _mm256_set1_epi32, _mm256_set1_ps,
    };
    let n = src.len();
    let dst = &mut dst[..n];
    let hi = _mm256_set1_ps(65504.0);
    let lo = _mm256_set1_ps(-65504.0);
    let inf = _mm256_set1_ps(f32::INFINITY);
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // Streaming stores need 16-byte alignment: scalar up to it (a piece of
    // an aligned block starts at any element).
    let head = dst.as_ptr().align_offset(16).min(n);
    let body = head + (n - head) / 8 * 8;
    let scalar = |d: &mut [f16], s: &[f32]| {
        for (d, &x) in d.iter_mut().zip(s) {
            *d = f16::from_bits(f32_to_f16_sat_bits(x));
        }
    };
    scalar(&mut dst[..head], &src[..head]);
    let mut i = head;
    while i < body {
        // SAFETY: i + 8 <= body <= n, the length of both slices; dst + i is
        // 16-byte aligned (f16 is 2 bytes, head aligned it, i − head is a
        // multiple of 8).
        unsafe {
            let x = _mm256_loadu_ps(src.as_ptr().add(i));
            // Finite values clamp to ±65504 (which the conversion keeps);
            // ±inf and NaN pass through, NaN quieted with its high payload
            // kept, as `f32_to_f16_sat_bits` does.
            let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_and_ps(x, abs), inf);
            let clamped = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_blendv_ps(x, clamped, finite));
            let at = dst.as_mut_ptr().add(i).cast::<__m128i>();
            match STREAM {
                true => _mm_stream_si128(at, h),
                false => _mm_storeu_si128(at, h),
            }
        }
        i += 8;
    }
    scalar(&mut dst[body..], &src[body..]);
    // Streaming stores are weakly ordered: fence before anyone reads `dst`.
    if STREAM {
        _mm_sfence();
    }
}

/// Sum of squares in f64 with eight independent accumulators, so the loop
/// vectorises without reassociating anything LLVM may not reassociate.
#[inline(always)]
fn sum_sq_body(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            let y = c[j] as f64;
            acc[j] += y * y;
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&y| (y as f64) * (y as f64)).sum();
    acc.iter().sum::<f64>() + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum_sq_avx2(x: &[f32]) -> f64 {
    sum_sq_body(x)
}

pub(crate) fn sum_sq(x: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU reports AVX2 and FMA, the features the function enables.
        return unsafe { sum_sq_avx2(x) };
    }
    sum_sq_body(x)
}

#[inline(always)]
fn triad_body(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    let n = a.len();
    let (b, c) = (&b[..n], &c[..n]);
    for i in 0..n {
        a[i] = b[i] + s * c[i];
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn triad_avx2(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    triad_body(a, b, c, s)
}

pub(crate) fn triad(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU reports AVX2 and FMA, the features the function enables.
        unsafe { triad_avx2(a, b, c, s) };
        return;
    }
    triad_body(a, b, c, s)
}

/// The triad with streaming (non-temporal) stores for `a`: no
/// write-allocate read of `a`, so the counted 12 B per element are the bytes
/// that move. Returns false (and does nothing) without AVX.
pub(crate) fn triad_stream(a: &mut [f32], b: &[f32], c: &[f32], s: f32) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU reports AVX, the feature the function enables.
        unsafe { triad_stream_avx(a, b, c, s) };
        return true;
    }
    let _ = (a, b, c, s);
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
fn triad_stream_avx(a: &mut [f32], b: &[f32], c: &[f32], s: f32) {
    use std::arch::x86_64::_mm256_stream_ps;
    use std::arch::x86_64::{_mm_sfence, _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps};
    let n = a.len();
    let (b, c) = (&b[..n], &c[..n]);
    // Streaming stores need 32-byte alignment: plain stores up to it.
    let head = a.as_ptr().align_offset(32).min(n);
    let body_end = head + (n - head) / 8 * 8;
    let sv = _mm256_set1_ps(s);
    let mut i = 0;
    while i < head {
        a[i] = b[i] + s * c[i];
        i += 1;
    }
    while i < body_end {
        // SAFETY: i + 8 <= body_end <= n = len of a, b, c; a + i is 32-byte aligned.
        unsafe {
            let x = _mm256_add_ps(
                _mm256_loadu_ps(b.as_ptr().add(i)),
                _mm256_mul_ps(sv, _mm256_loadu_ps(c.as_ptr().add(i))),
            );
            _mm256_stream_ps(a.as_mut_ptr().add(i), x);
        }
        i += 8;
    }
    while i < n {
        a[i] = b[i] + s * c[i];
        i += 1;
    }
    // Streaming stores are weakly ordered: fence before anyone reads `a`.
    _mm_sfence();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hardware conversion gives `f32_to_f16_sat_bits`'s bits on the
    /// edges (ties, the range's end, subnormals, ±0, ±inf, NaN payloads)
    /// and on random bit patterns, in the SIMD body and the scalar tail.
    #[test]
    fn hardware_f16_conversion_matches_the_saturating_one() {
        let mut xs: Vec<f32> = [
            0x3F80_1000u32, // 1 + 2^-11: a tie, even below
            0x3F80_3000,    // 1 + 3·2^-11: a tie, odd below
            0x477F_E000,    // 65504
            0x477F_EFFF,    // just under 65520
            0x477F_F000,    // 65520: rounds to infinity unsaturated
            0x4780_0000,    // 65536
            0x7F7F_FFFF,    // f32::MAX
            0x3380_0000,    // 2^-24, the smallest f16 subnormal
            0x3300_0000,    // 2^-25: a tie with zero
            0x3300_0001,    // just over it
            0x387F_E000,    // just under 2^-14
            0x0000_0001,    // the smallest f32 subnormal
            0x8000_0000,    // -0
            0x7F80_0000,    // inf
            0x7F80_0001,    // a signalling NaN, low payload
            0x7FC0_0000,    // the quiet NaN
            0x7FA5_5555,    // signalling, high payload
        ]
        .iter()
        .flat_map(|&b| [f32::from_bits(b), -f32::from_bits(b)])
        .collect();
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        xs.extend((0..100_003).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f32::from_bits((state >> 32) as u32)
        }));
        // Streaming stores from an odd element on (the scalar head, the
        // aligned body, the tail), and plain ones.
        for (plain, skip) in [(false, 0), (false, 3), (true, 0)] {
            let mut got = vec![f16::ZERO; xs.len()];
            set_plain_copy_stores(plain);
            let converted = to_f16_sat(&xs[skip..], &mut got[skip..]);
            set_plain_copy_stores(false);
            if !converted {
                eprintln!("no F16C on this CPU: the hardware conversion is not used here");
                return;
            }
            for (x, h) in xs[skip..].iter().zip(&got[skip..]) {
                assert_eq!(
                    h.to_bits(),
                    f32_to_f16_sat_bits(*x),
                    "plain {plain}: {:#010x} ({x:e})",
                    x.to_bits()
                );
            }
        }
    }
}
