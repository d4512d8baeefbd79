// How both SIMT matmul kernels (matmul.wgsl, matmul_interior.wgsl) store
// a thread's outputs, one vec4 of accumulators at a time, so that their
// accumulator arrays are indexed by constants only.

// Four outputs of row gm from column gn0 (those inside C): unscaled, plus
// bias, plus C when accumulating, through the epilogue.
fn store_c4(v: vec4<f32>, c_base: u32, gm: u32, gn0: u32) {
    if gm >= p.m {
        return;
    }
    for (var c = 0u; c < 4u; c++) {
        let gn = gn0 + c;
        if gn >= p.n {
            return;
        }
        var x = unscale(v[c]);
        if (p.flags & HAS_BIAS) != 0u {
            x += bias[p.bias_off + gn];
        }
        var idx = c_base + gm * p.ldc + gn;
        if (p.flags & TRANS_C) != 0u {
            idx = c_base + gn * p.ldc + gm;
        }
        if (p.flags & ACCUMULATE) != 0u {
            x += C[idx];
        }
        C[idx] = epilogue(idx, x);
    }
}
