// The interior of a SIMT matmul C = op(A) @ op(B) (+ bias) (+ C): whole
// 128x128 tiles of C, K a multiple of BK, operands aligned to 4 elements.
// matmul.wgsl computes the M and N edge strips around it. What matmul.wgsl
// decides per element at run time is fixed here, so the K loop holds no
// flag and no bounds check: the operand layouts (TA, TB, from the generated
// prelude, crates/gpu/src/simt.rs), full tiles, and the B loader `load_b4`.
//
// - Global reads are vec4s along each operand's contiguous dimension.
// - Double buffering: the next K step's tiles are read into registers
//   before the current step's products, and written to the other half of
//   workgroup memory after them, so one barrier per step suffices (a half
//   is overwritten only after every thread has passed the barrier that
//   ended the step reading it).
// - Each thread owns 8x8 outputs as two 4-row blocks 64 rows apart times
//   two 4-column blocks 64 columns apart: per k it reads 4 vec4s of
//   workgroup memory for 64 FMAs, and the 16 threads along a row read 16
//   consecutive vec4s (no bank conflicts).
// Workgroup memory: 2 halves x BK x (BM + BN) f32 = 32 KiB, lavapipe's limit
// (NVIDIA has 48 KiB).

const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 16u;
const AV: u32 = BM / 4u; // vec4s per k-row of the A tile
const BV: u32 = BN / 4u;

@group(0) @binding(1) var<storage, read> A4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> C: array<f32>;

// [half][k][m / 4] and [half][k][n / 4].
var<workgroup> As: array<vec4<f32>, 2u * BK * AV>;
var<workgroup> Bs: array<vec4<f32>, 2u * BK * BV>;

// The two vec4s of each tile this thread carries from global memory into
// workgroup memory per K step (BM * BK / 4 = 512 vec4s over 256 threads).
var<private> ra: array<vec4<f32>, 2>;
var<private> rb: array<vec4<f32>, 2>;

fn op_a4(v: vec4<f32>) -> vec4<f32> {
    return vec4(op_a(v.x), op_a(v.y), op_a(v.z), op_a(v.w));
}

fn op_b4(v: vec4<f32>) -> vec4<f32> {
    return vec4(op_b(v.x), op_b(v.y), op_b(v.z), op_b(v.w));
}

// Element offsets of the vec4s thread `li` reads for the tiles at (m0, k0)
// and (k0, n0). Consecutive threads walk the contiguous dimension.
fn a_index(li: u32, a_base: u32, m0: u32, k0: u32) -> u32 {
    if TA {
        // A is [K, M]: 32 vec4s per k-row of the tile.
        return a_base + (k0 + li / AV) * p.lda + m0 + 4u * (li % AV);
    }
    // A is [M, K]: 4 vec4s per m-row of the tile.
    return a_base + (m0 + li / 4u) * p.lda + k0 + 4u * (li % 4u);
}

fn b_index(li: u32, b_base: u32, n0: u32, k0: u32) -> u32 {
    if TB {
        // B is [N, K]: 4 vec4s per n-row of the tile.
        return b_base + (n0 + li / 4u) * p.ldb + k0 + 4u * (li % 4u);
    }
    // B is [K, N]: 32 vec4s per k-row of the tile.
    return b_base + (k0 + li / BV) * p.ldb + n0 + 4u * (li % BV);
}

fn load_tiles(li: u32, a_base: u32, b_base: u32, m0: u32, n0: u32, k0: u32) {
    // 512 vec4s per tile: the second vec4 of a thread is 256 further on,
    // which is 8 k-rows (TA) or 64 m-rows (not TA) further.
    let a_step = select(64u * p.lda, 8u * p.lda, TA);
    let b_step = select(8u * p.ldb, 64u * p.ldb, TB);
    let ia = a_index(li, a_base, m0, k0);
    let ib = b_index(li, b_base, n0, k0);
    ra[0] = A4[ia >> 2u];
    ra[1] = A4[(ia + a_step) >> 2u];
    rb[0] = load_b4(ib);
    rb[1] = load_b4(ib + b_step);
}

// One vec4 of each tile into workgroup memory; `e` is the vec4's index in
// the tile.
fn store_vec4s(e: u32, half: u32, ra_e: vec4<f32>, rb_e: vec4<f32>) {
    let base = half * BK;
    let a = op_a4(ra_e);
    if TA {
        As[(base + e / AV) * AV + e % AV] = a;
    } else {
        let m = e / 4u;
        let k = 4u * (e % 4u);
        As[(base + k) * AV + m / 4u][m % 4u] = a.x;
        As[(base + k + 1u) * AV + m / 4u][m % 4u] = a.y;
        As[(base + k + 2u) * AV + m / 4u][m % 4u] = a.z;
        As[(base + k + 3u) * AV + m / 4u][m % 4u] = a.w;
    }
    let b = op_b4(rb_e);
    if TB {
        let n = e / 4u;
        let k = 4u * (e % 4u);
        Bs[(base + k) * BV + n / 4u][n % 4u] = b.x;
        Bs[(base + k + 1u) * BV + n / 4u][n % 4u] = b.y;
        Bs[(base + k + 2u) * BV + n / 4u][n % 4u] = b.z;
        Bs[(base + k + 3u) * BV + n / 4u][n % 4u] = b.w;
    } else {
        Bs[(base + e / BV) * BV + e % BV] = b;
    }
}

// Private arrays are indexed by constants only (here and in the
// accumulators): one index a compiler cannot resolve puts the whole array
// in local memory, every access of the K loop included.
fn store_tiles(li: u32, half: u32) {
    store_vec4s(li, half, ra[0], rb[0]);
    store_vec4s(li + 256u, half, ra[1], rb[1]);
}

@compute @workgroup_size(16, 16, 1)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    prepare_operands();
    let a_base = p.a_off + wid.z * p.a_bstride;
    let b_base = p.b_off + wid.z * p.b_bstride;
    let m0 = (wid.y + p.tile_y0) * BM;
    let n0 = (wid.x + p.tile_x0) * BN;
    let tx = lid.x;
    let ty = lid.y;

    // acc[2 * r + h]: output row r (0..4: 4ty + r; 4..8: 64 + 4ty + r - 4),
    // columns 4tx.. (h = 0) or 64 + 4tx.. (h = 1).
    var acc: array<vec4<f32>, 16>;

    let steps = p.k / BK;
    load_tiles(li, a_base, b_base, m0, n0, 0u);
    store_tiles(li, 0u);
    workgroupBarrier();
    for (var s = 0u; s < steps; s++) {
        let more = s + 1u < steps;
        if more {
            load_tiles(li, a_base, b_base, m0, n0, (s + 1u) * BK);
        }
        let base = (s & 1u) * BK;
        for (var kk = 0u; kk < BK; kk++) {
            let ar = (base + kk) * AV;
            let br = (base + kk) * BV;
            let a0 = As[ar + ty];
            let a1 = As[ar + 16u + ty];
            let b0 = Bs[br + tx];
            let b1 = Bs[br + 16u + tx];
            acc[0] += a0.x * b0;
            acc[1] += a0.x * b1;
            acc[2] += a0.y * b0;
            acc[3] += a0.y * b1;
            acc[4] += a0.z * b0;
            acc[5] += a0.z * b1;
            acc[6] += a0.w * b0;
            acc[7] += a0.w * b1;
            acc[8] += a1.x * b0;
            acc[9] += a1.x * b1;
            acc[10] += a1.y * b0;
            acc[11] += a1.y * b1;
            acc[12] += a1.z * b0;
            acc[13] += a1.z * b1;
            acc[14] += a1.w * b0;
            acc[15] += a1.w * b1;
        }
        if more {
            store_tiles(li, (s + 1u) & 1u);
        }
        workgroupBarrier();
    }

    let c_base = p.c_off + wid.z * p.c_bstride;
    // acc[2r + h] is row r0 + r (r < 4) or r0 + 60 + r, columns c0 + 64h.
    let r0 = m0 + 4u * ty;
    let c0 = n0 + 4u * tx;
    store_c4(acc[0], c_base, r0 + 0u, c0);
    store_c4(acc[1], c_base, r0 + 0u, c0 + 64u);
    store_c4(acc[2], c_base, r0 + 1u, c0);
    store_c4(acc[3], c_base, r0 + 1u, c0 + 64u);
    store_c4(acc[4], c_base, r0 + 2u, c0);
    store_c4(acc[5], c_base, r0 + 2u, c0 + 64u);
    store_c4(acc[6], c_base, r0 + 3u, c0);
    store_c4(acc[7], c_base, r0 + 3u, c0 + 64u);
    store_c4(acc[8], c_base, r0 + 64u, c0);
    store_c4(acc[9], c_base, r0 + 64u, c0 + 64u);
    store_c4(acc[10], c_base, r0 + 65u, c0);
    store_c4(acc[11], c_base, r0 + 65u, c0 + 64u);
    store_c4(acc[12], c_base, r0 + 66u, c0);
    store_c4(acc[13], c_base, r0 + 66u, c0 + 64u);
    store_c4(acc[14], c_base, r0 + 67u, c0);
    store_c4(acc[15], c_base, r0 + 67u, c0 + 64u);
    fold_maxima(li, wid, nwg);
}
