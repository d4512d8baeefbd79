// How both SIMT matmul kernels (matmul.wgsl, matmul_interior.wgsl) store
// a thread's outputs, one vec4 of accumulators at a time, so that their
// accumulator arrays are indexed by constants only.

fn c_index(c_base: u32, gm: u32, gn: u32) -> u32 {
    if (p.flags & TRANS_C) != 0u {
        return c_base + gn * p.ldc + gm;
    }
    return c_base + gm * p.ldc + gn;
}

// The epilogue's operands of the output at column gn (zero past C's edge).
fn operands_at(c_base: u32, gm: u32, gn: u32) -> vec2<f32> {
    if gn >= p.n {
        return vec2<f32>(0.0);
    }
    return epilogue_operands(c_index(c_base, gm, gn));
}

// Four outputs of row gm from column gn0 (those inside C): unscaled, plus
// bias, plus C when accumulating, through the epilogue. The epilogue's
// operands of all four are loaded first, so that their loads are in flight
// together rather than each after the stores of the output before it.
fn store_c4(v: vec4<f32>, c_base: u32, gm: u32, gn0: u32) {
    if gm >= p.m {
        return;
    }
    let x0 = operands_at(c_base, gm, gn0);
    let x1 = operands_at(c_base, gm, gn0 + 1u);
    let x2 = operands_at(c_base, gm, gn0 + 2u);
    let x3 = operands_at(c_base, gm, gn0 + 3u);
    let xa = vec4<f32>(x0.x, x1.x, x2.x, x3.x);
    let xb = vec4<f32>(x0.y, x1.y, x2.y, x3.y);
    for (var c = 0u; c < 4u; c++) {
        let gn = gn0 + c;
        if gn >= p.n {
            return;
        }
        var x = unscale(v[c]);
        if (p.flags & HAS_BIAS) != 0u {
            x += bias[p.bias_off + gn];
        }
        let idx = c_index(c_base, gm, gn);
        if (p.flags & ACCUMULATE) != 0u {
            x += C[idx];
        }
        C[idx] = epilogue_with(idx, x, vec2<f32>(xa[c], xb[c]));
    }
}
