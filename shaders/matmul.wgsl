// Tiled f32 matmul on a sub-block (m, n, k) of operands with leading
// dimensions lda/ldb/ldc, so that large operands can be processed in chunks:
// C[b] = op(A[b]) @ op(B[b]) (+ bias) (+ C if accumulating).
// A BM x BN output tile per workgroup of 16x16 threads, TM x TN outputs per
// thread held in registers; the k-loop reads vec4s from workgroup memory
// (TM/4 + TN/4 vec4 loads feed TM·TN FMAs). Edges are bounds-checked so that
// any M, N, K works. Preludes supply the tile constants (matmul_tile64.wgsl,
// matmul_tile128.wgsl), the B loader `load_b` (matmul_f32.wgsl,
// matmul_bf16.wgsl, matmul_f16.wgsl) and the compute precision: `op_a`,
// `op_b` applied to each operand element on its way into workgroup memory
// and `unscale` to each result (matmul_exact.wgsl; matmul_scale.wgsl with
// matmul_round16.wgsl for f16 operands), `epilogue`, applied to each
// element as it is stored (matmul_epilogue.wgsl), and `store_c4`, which
// stores them (matmul_store.wgsl).

@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> C: array<f32>;

const TM: u32 = BM / 16u;
const TN: u32 = BN / 16u;
const AV: u32 = BM / 4u; // vec4s per k-row of the A tile
const BV: u32 = BN / 4u;
const TV: u32 = TN / 4u; // vec4s of accumulators per output row
// Elements of one tile that each of the 256 threads loads.
const LOADS: u32 = BM * BK / 256u;

// As[k * AV + m / 4][m % 4]: for each k, the BM rows of the tile as vec4s.
var<workgroup> As: array<vec4<f32>, BK * BM / 4u>;
var<workgroup> Bs: array<vec4<f32>, BK * BN / 4u>;

@compute @workgroup_size(16, 16, 1)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    prepare_operands();
    let ta = (p.flags & TRANS_A) != 0u;
    let tb = (p.flags & TRANS_B) != 0u;
    let a_base = p.a_off + wid.z * p.a_bstride;
    let b_base = p.b_off + wid.z * p.b_bstride;
    let m0 = (wid.y + p.tile_y0) * BM;
    let n0 = (wid.x + p.tile_x0) * BN;
    let tx = lid.x;
    let ty = lid.y;

    // Indexed by constants only: one index a compiler cannot resolve puts
    // the whole array in local memory, every access of the K loop included.
    // Sized for the 128 tile (TM = 8, TV = 2); the 64 tile (TM = 4, TV = 1)
    // uses the first four and the compiler drops the rest.
    var acc: array<vec4<f32>, 16>;

    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        // Each thread loads LOADS elements of each tile; consecutive threads
        // walk the operand's contiguous dimension so global reads coalesce.
        for (var r = 0u; r < LOADS; r++) {
            let e = li + r * 256u;
            var m: u32;
            var kk: u32;
            if ta {
                m = e % BM;
                kk = e / BM;
            } else {
                kk = e % BK;
                m = e / BK;
            }
            let gm = m0 + m;
            let gk = k0 + kk;
            var v = 0.0;
            if gm < p.m && gk < p.k {
                if ta {
                    v = A[a_base + gk * p.lda + gm];
                } else {
                    v = A[a_base + gm * p.lda + gk];
                }
            }
            As[kk * AV + m / 4u][m % 4u] = op_a(v);

            var n: u32;
            if tb {
                kk = e % BK;
                n = e / BK;
            } else {
                n = e % BN;
                kk = e / BN;
            }
            let gn = n0 + n;
            let gk2 = k0 + kk;
            var w = 0.0;
            if gn < p.n && gk2 < p.k {
                if tb {
                    w = load_b(b_base + gn * p.ldb + gk2);
                } else {
                    w = load_b(b_base + gk2 * p.ldb + gn);
                }
            }
            Bs[kk * BV + n / 4u][n % 4u] = op_b(w);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let ar = kk * AV + ty * (TM / 4u);
            let br = kk * BV + tx * TV;
            let a0 = As[ar];
            let b0 = Bs[br];
            if TV == 1u {
                acc[0] += a0.x * b0;
                acc[1] += a0.y * b0;
                acc[2] += a0.z * b0;
                acc[3] += a0.w * b0;
            } else {
                // TM = 8, TV = 2: acc[2r + j] is row r, vec4 j.
                let a1 = As[ar + 1u];
                let b1 = Bs[br + 1u];
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
        }
        workgroupBarrier();
    }

    let c_base = p.c_off + wid.z * p.c_bstride;
    let r0 = m0 + ty * TM;
    let c0 = n0 + tx * TN;
    if TV == 1u {
        store_c4(acc[0], c_base, r0 + 0u, c0);
        store_c4(acc[1], c_base, r0 + 1u, c0);
        store_c4(acc[2], c_base, r0 + 2u, c0);
        store_c4(acc[3], c_base, r0 + 3u, c0);
    } else {
        store_c4(acc[0], c_base, r0 + 0u, c0);
        store_c4(acc[1], c_base, r0 + 0u, c0 + 4u);
        store_c4(acc[2], c_base, r0 + 1u, c0);
        store_c4(acc[3], c_base, r0 + 1u, c0 + 4u);
        store_c4(acc[4], c_base, r0 + 2u, c0);
        store_c4(acc[5], c_base, r0 + 2u, c0 + 4u);
        store_c4(acc[6], c_base, r0 + 3u, c0);
        store_c4(acc[7], c_base, r0 + 3u, c0 + 4u);
        store_c4(acc[8], c_base, r0 + 4u, c0);
        store_c4(acc[9], c_base, r0 + 4u, c0 + 4u);
        store_c4(acc[10], c_base, r0 + 5u, c0);
        store_c4(acc[11], c_base, r0 + 5u, c0 + 4u);
        store_c4(acc[12], c_base, r0 + 6u, c0);
        store_c4(acc[13], c_base, r0 + 6u, c0 + 4u);
        store_c4(acc[14], c_base, r0 + 7u, c0);
        store_c4(acc[15], c_base, r0 + 7u, c0 + 4u);
    }
    fold_maxima(li, wid, nwg);
}
