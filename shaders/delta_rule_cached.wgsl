// The gated delta rule continuing from a given state, for generation over
// a cache (delta_rule.wgsl is the training forward and backward): per
// (batch b, value head h) a state S [Dk, Dv] read from and left in STATE;
// each step S ← exp(g)·S; δ = β(v − Sᵀk); S ← S + k δᵀ; o = Sᵀq. A state's
// columns evolve independently, so one thread owns a column and walks the
// steps t0..t1 (the host splits T under the loop budget) with it in
// memory: no sums across threads, in the CPU reference's order.

struct Params {
    t: u32, hk: u32, hv: u32, dk: u32,
    dv: u32, grp: u32, gw: u32, n: u32,
    q_off: u32, k_off: u32, v_off: u32, g_off: u32,
    beta_off: u32, out_off: u32, s_off: u32, t0: u32,
    t1: u32, _p0: u32, _p1: u32, _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K: array<f32>;
@group(0) @binding(3) var<storage, read> V: array<f32>;
@group(0) @binding(4) var<storage, read> GA: array<f32>;
@group(0) @binding(5) var<storage, read> BE: array<f32>;
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(7) var<storage, read_write> STATE: array<f32>;

@compute @workgroup_size(64)
fn dr_cached(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if i >= p.n {
        return;
    }
    let c = i % p.dv;
    let bh = i / p.dv;
    let h = bh % p.hv;
    let b = bh / p.hv;
    // S[r, c] of this (b, h) at s0 + r·Dv.
    let s0 = p.s_off + bh * p.dk * p.dv + c;
    for (var t = p.t0; t < p.t1; t++) {
        let row = b * p.t + t;
        let kq = (row * p.hk + h / p.grp) * p.dk;
        let ga = p.g_off + (row * p.hv + h) * p.gw;
        var m = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            let e = STATE[s0 + r * p.dv] * exp(GA[ga + r % p.gw]);
            STATE[s0 + r * p.dv] = e;
            m += K[p.k_off + kq + r] * e;
        }
        let beta = BE[p.beta_off + row * p.hv + h];
        let vm = V[p.v_off + (row * p.hv + h) * p.dv + c] - m;
        var o = 0.0;
        for (var r = 0u; r < p.dk; r++) {
            let e = STATE[s0 + r * p.dv] + K[p.k_off + kq + r] * beta * vm;
            STATE[s0 + r * p.dv] = e;
            o += Q[p.q_off + kq + r] * e;
        }
        OUT[p.out_off + (row * p.hv + h) * p.dv + c] = o;
    }
}
