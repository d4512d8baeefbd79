// Tiled f32 matmul on a sub-block (m, n, k) of operands with leading
// dimensions lda/ldb/ldc, so that large operands can be processed in chunks:
// C[b] = op(A[b]) @ op(B[b]) (+ bias) (+ C if accumulating).
// 64x64 output tile per workgroup of 16x16 threads, 4x4 outputs per thread held
// in registers; the k-loop reads vec4s from workgroup memory (one vec4 of A
// rows and one of B columns feed 16 FMAs). Edges are bounds-checked so that
// any M, N, K works. The B operand loader (`load_b`) comes from a prelude:
// matmul_f32.wgsl or matmul_bf16.wgsl.

struct Params {
    m: u32, n: u32, k: u32, flags: u32,
    a_off: u32, b_off: u32, c_off: u32, bias_off: u32,
    a_bstride: u32, b_bstride: u32, c_bstride: u32, lda: u32,
    ldb: u32, ldc: u32, _p0: u32, _p1: u32,
}

const TRANS_A: u32 = 1u;
const TRANS_B: u32 = 2u;
const HAS_BIAS: u32 = 4u;
const ACCUMULATE: u32 = 8u;
const TRANS_C: u32 = 16u;

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 16u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> A: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> C: array<f32>;

// As[k * 16 + m / 4][m % 4]: for each k, the 64 rows of the tile as 16 vec4s.
var<workgroup> As: array<vec4<f32>, 256>;
var<workgroup> Bs: array<vec4<f32>, 256>;

@compute @workgroup_size(16, 16, 1)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let ta = (p.flags & TRANS_A) != 0u;
    let tb = (p.flags & TRANS_B) != 0u;
    let a_base = p.a_off + wid.z * p.a_bstride;
    let b_base = p.b_off + wid.z * p.b_bstride;
    let m0 = wid.y * BM;
    let n0 = wid.x * BN;
    let tx = lid.x;
    let ty = lid.y;

    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) {
        acc[i] = vec4<f32>(0.0);
    }

    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        // Each thread loads 4 elements of each tile; consecutive threads walk
        // the operand's contiguous dimension so global reads coalesce.
        for (var r = 0u; r < 4u; r++) {
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
            As[kk * 16u + m / 4u][m % 4u] = v;

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
            Bs[kk * 16u + n / 4u][n % 4u] = w;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let a = As[kk * 16u + ty];
            let b = Bs[kk * 16u + tx];
            acc[0] += a.x * b;
            acc[1] += a.y * b;
            acc[2] += a.z * b;
            acc[3] += a.w * b;
        }
        workgroupBarrier();
    }

    let c_base = p.c_off + wid.z * p.c_bstride;
    for (var i = 0u; i < 4u; i++) {
        let gm = m0 + ty * 4u + i;
        if gm >= p.m {
            break;
        }
        for (var j = 0u; j < 4u; j++) {
            let gn = n0 + tx * 4u + j;
            if gn >= p.n {
                break;
            }
            var v = acc[i][j];
            if (p.flags & HAS_BIAS) != 0u {
                v += bias[p.bias_off + gn];
            }
            var idx = c_base + gm * p.ldc + gn;
            if (p.flags & TRANS_C) != 0u {
                idx = c_base + gn * p.ldc + gm;
            }
            if (p.flags & ACCUMULATE) != 0u {
                v += C[idx];
            }
            C[idx] = v;
        }
    }
}
