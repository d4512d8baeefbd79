// What the attention kernels share (attention.wgsl, one thread per row;
// attention_lanes.wgsl, a row's D split over lanes): their parameters,
// flags and bindings, where a row lies in q/k/v [B, T, H, D] and in the
// per-row statistics [B, Hq, T], and the scores' soft cap (`capped`, which
// calls activation_fns.wgsl's tanh_precise: put that file before this).

struct Params {
    t: u32, hq: u32, hkv: u32, d: u32,
    scale: f32, q_off: u32, k_off: u32, v_off: u32,
    o_off: u32, lse_off: u32, do_off: u32, dq_off: u32,
    dk_off: u32, dv_off: u32, dd_off: u32, flags: u32,
    r_begin: u32, r_end: u32, max_off: u32, window: u32,
    // Gemma 2's soft cap of the scaled scores, 0 for none: `capped` below,
    // which both families (attention.wgsl, attention_lanes.wgsl) apply.
    // Then packed documents (attention_mask.wgsl).
    softcap: f32, docs: u32, docs_off: u32, docs_ends: u32,
    // Dropout of the probabilities (attention_mask.wgsl's `drop_factor`).
    drop_threshold: u32, drop_key0: u32, drop_key1: u32, drop_scale: f32,
    drop_batch0: u32, _pad0: u32, _pad1: u32, _pad2: u32,
}

const FIRST: u32 = 1u;
const LAST: u32 = 2u;
// Under F16 attention's out (forward) and dv (backward) are operands of
// the projections' f16 products: with STORE_MAX each workgroup of the LAST
// dispatch stores the max_bits (max_bits.wgsl) of what it wrote at
// OMAX[max_off + its index], which absmax.wgsl folds when a product first
// reads them, so nothing scans them.
const STORE_MAX: u32 = 4u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K: array<f32>;
@group(0) @binding(3) var<storage, read> V: array<f32>;
@group(0) @binding(4) var<storage, read_write> O: array<f32>;
@group(0) @binding(5) var<storage, read_write> LSE: array<f32>;
@group(0) @binding(6) var<storage, read> DO: array<f32>;
@group(0) @binding(7) var<storage, read_write> DQ: array<f32>;
@group(0) @binding(8) var<storage, read_write> DK: array<f32>;
@group(0) @binding(9) var<storage, read_write> DV: array<f32>;
@group(0) @binding(10) var<storage, read_write> DD: array<f32>;
@group(0) @binding(11) var<storage, read_write> OMAX: array<u32>;

fn q_idx(b: u32, t: u32, h: u32) -> u32 {
    return ((b * p.t + t) * p.hq + h) * p.d;
}

fn kv_idx(b: u32, t: u32, g: u32) -> u32 {
    return ((b * p.t + t) * p.hkv + g) * p.d;
}

fn row_idx(b: u32, h: u32, t: u32) -> u32 {
    return (b * p.hq + h) * p.t + t;
}

// A scaled score as the softmax sees it: where p.softcap > 0 (Gemma 2),
// cap · tanh(s / cap), so that lse is of the capped scores; tanh_precise
// (activation_fns.wgsl) because a driver's tanh through exp is inf/inf past
// |s / cap| ≈ 44, which small caps reach, and near 0 loses digits that a
// cap of 50 multiplies into every score. A branch on a uniform rather
// than compiled-in variants with and without a cap: every invocation takes
// the same side, it costs a compare beside each score's D-long dot product,
// and variants would double the pipelines of every head dimension.
fn capped(s: f32) -> f32 {
    if p.softcap > 0.0 {
        return p.softcap * tanh_precise(s / p.softcap);
    }
    return s;
}

// d capped(s) / ds from the capped y: 1 − (y / cap)², 1 without a cap. The
// backward multiplies each dS by it; the 1/√D of the scaled score stays
// where it was (q or k pre-scaled, dq or dk scaled by the LAST dispatch).
fn capped_slope(y: f32) -> f32 {
    if p.softcap > 0.0 {
        let c = y / p.softcap;
        return 1.0 - c * c;
    }
    return 1.0;
}
