// The f32 attention kernels of attention.wgsl with each row's D split over
// L lanes of a subgroup, for head dimensions that are multiples of 16: a
// lane keeps NV = D / 16 vec4s of each row vector (q, the output
// accumulator, dq, k, v, dk, dv), elements 4(vL + lane).. of the row, so
// the row state a thread holds is a quarter of attention.wgsl's and fits in
// registers up to D = 128 (there 2D to 4D floats per thread live in local
// memory on GPUs). A dot product is the lanes' partial sums added with two
// subgroup shuffles, so the four lanes of a row must be consecutive lanes
// of one subgroup (invocations 4r..4r+3 of the workgroup, which GPUs and
// lavapipe put in one subgroup of at least 4). Every lane of a row computes
// the same softmax statistics.
//
// Same flags, ranges, layouts, soft cap (attention_params.wgsl's `capped`
// and `capped_slope`, so tanh_precise from activation_fns.wgsl) and order
// of each row's sums over keys as attention.wgsl; a dot product adds its D
// terms in another order (delta too: this file's `attn_delta`). Control
// flow is uniform in every loop that shuffles (the cap's branch is on a
// uniform): keys past a row's causal limit (or before its window or document, or
// past the range, or past T) are computed and masked, the row's state kept by a select (so a
// masked key's values never reach it, not even as 0 · inf), and a tile's
// rows all take the same path. The host generates the prelude (`const D`)
// and repeats each `// unroll` block NV times with UV = 0, 1, …
// (crates/gpu/src/kernels.rs), so every array index is a constant.

const L: u32 = 4u;
const NV: u32 = D / 16u; // vec4s of a row per lane
const D4: u32 = D / 4u; // vec4s of a row
const RB: u32 = 64u; // rows per workgroup
const THREADS: u32 = RB * L;
const KB: u32 = 16u; // rows of the streamed side per tile

var<workgroup> T1: array<vec4<f32>, KB * D4>;
var<workgroup> T2: array<vec4<f32>, KB * D4>;
// Per-row statistics of a dkv query tile (lse, delta), and the workgroup's
// maxima folded by `store_max`.
var<workgroup> S1: array<f32, THREADS>;
var<workgroup> S2: array<f32, KB>;

fn ld_q(i: u32) -> vec4<f32> {
    return vec4(Q[i], Q[i + 1u], Q[i + 2u], Q[i + 3u]);
}

fn ld_k(i: u32) -> vec4<f32> {
    return vec4(K[i], K[i + 1u], K[i + 2u], K[i + 3u]);
}

fn ld_v(i: u32) -> vec4<f32> {
    return vec4(V[i], V[i + 1u], V[i + 2u], V[i + 3u]);
}

fn ld_do(i: u32) -> vec4<f32> {
    return vec4(DO[i], DO[i + 1u], DO[i + 2u], DO[i + 3u]);
}

// The row's dot product from each lane's part.
fn row_sum(x: f32) -> f32 {
    let y = x + subgroupShuffleXor(x, 1u);
    return y + subgroupShuffleXor(y, 2u);
}

fn max4(m: u32, x: vec4<f32>) -> u32 {
    return max(max(m, max(max_bits(x.x), max_bits(x.y))), max(max_bits(x.z), max_bits(x.w)));
}

// KB rows of k and v (kv head g) from j0 into T1 / T2, zero past T.
fn load_kv_tile(b: u32, g: u32, j0: u32, li: u32) {
    for (var e = li; e < KB * D4; e += THREADS) {
        let j = j0 + e / D4;
        var k = vec4<f32>(0.0);
        var v = vec4<f32>(0.0);
        if j < p.t {
            let i = kv_idx(b, j, g) + 4u * (e % D4);
            k = ld_k(p.k_off + i);
            v = ld_v(p.v_off + i);
        }
        T1[e] = k;
        T2[e] = v;
    }
}

// With STORE_MAX in a LAST dispatch: the workgroup's largest `m` into
// OMAX, folded pairwise through S1 (as attention.wgsl's).
fn store_max(li: u32, m: u32, wid: vec3<u32>, nwg: vec3<u32>) {
    if (p.flags & (LAST | STORE_MAX)) != (LAST | STORE_MAX) {
        return;
    }
    S1[li] = bitcast<f32>(m);
    workgroupBarrier();
    for (var n = THREADS / 2u; n > 0u; n /= 2u) {
        if li < n {
            S1[li] = bitcast<f32>(max(bitcast<u32>(S1[li]), bitcast<u32>(S1[li + n])));
        }
        workgroupBarrier();
    }
    if li == 0u {
        OMAX[p.max_off + (wid.z * nwg.y + wid.y) * nwg.x + wid.x] = bitcast<u32>(S1[0]);
    }
}

// grid: (ceil(T / RB), Hq, B)
@compute @workgroup_size(256)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let lane = li % L;
    let b = wid.z;
    let h = wid.y;
    let g = h / (p.hq / p.hkv);
    let i = wid.x * RB + li / L;
    let valid = i < p.t;
    // Rows past T read row T - 1 and store nothing.
    let ic = min(i, p.t - 1u);
    let first = (p.flags & FIRST) != 0u;
    let qi = p.q_off + q_idx(b, ic, h);
    // Running state between key ranges: unnormalised acc in O, max in LSE,
    // sum in DD.
    let oi = p.o_off + q_idx(b, ic, h);
    let ri = row_idx(b, h, ic);
    var q: array<vec4<f32>, NV>;
    var acc: array<vec4<f32>, NV>;
    // unroll
    q[UV] = ld_q(qi + 4u * (UV * L + lane)) * p.scale;
    acc[UV] = select(vec4(O[oi + 4u * (UV * L + lane)], O[oi + 4u * (UV * L + lane) + 1u], O[oi + 4u * (UV * L + lane) + 2u], O[oi + 4u * (UV * L + lane) + 3u]), vec4<f32>(0.0), first);
    // end
    var m = -3.0e38;
    var l = 0.0;
    if !first {
        m = LSE[p.lse_off + ri];
        l = DD[p.dd_off + ri];
    }
    let kend = min(min(p.t, wid.x * RB + RB), p.r_end);
    for (var j0 = max(p.r_begin, first_key(b, wid.x * RB)); j0 < kend; j0 += KB) {
        workgroupBarrier();
        load_kv_tile(b, g, j0, li);
        workgroupBarrier();
        for (var jj = 0u; jj < KB; jj++) {
            let j = j0 + jj;
            let t = jj * D4 + lane;
            var part = 0.0;
            // unroll
            part += dot(q[UV], T1[t + UV * L]);
            // end
            let s = capped(row_sum(part));
            let live = valid && sees(b, i, j) && j < p.r_end;
            let mn = select(m, max(m, s), live);
            let corr = exp(m - mn);
            let pr = select(0.0, exp(s - mn), live);
            l = l * corr + pr;
            let pd = pr * drop_factor(b, h, i, j);
            // unroll
            acc[UV] = select(acc[UV], acc[UV] * corr + pd * T2[t + UV * L], live);
            // end
            m = mn;
        }
    }
    var omax = 0u;
    if valid {
        if (p.flags & LAST) != 0u {
            let inv = 1.0 / l;
            // unroll
            let o_UV = acc[UV] * inv;
            let at_UV = oi + 4u * (UV * L + lane);
            O[at_UV] = o_UV.x;
            O[at_UV + 1u] = o_UV.y;
            O[at_UV + 2u] = o_UV.z;
            O[at_UV + 3u] = o_UV.w;
            omax = max4(omax, o_UV);
            // end
            if lane == 0u {
                LSE[p.lse_off + ri] = m + log(l);
            }
        } else {
            // unroll
            let at_UV = oi + 4u * (UV * L + lane);
            O[at_UV] = acc[UV].x;
            O[at_UV + 1u] = acc[UV].y;
            O[at_UV + 2u] = acc[UV].z;
            O[at_UV + 3u] = acc[UV].w;
            // end
            if lane == 0u {
                LSE[p.lse_off + ri] = m;
                DD[p.dd_off + ri] = l;
            }
        }
    }
    workgroupBarrier();
    store_max(li, omax, wid, nwg);
}

// delta = rowsum(dout · out), each row's D terms added in the order the
// lanes kernels add a dot product, so that dp − delta in dq and dk is
// exactly 0 where out is exactly v (a row's only key).
// grid: (ceil(T / RB), Hq, B)
@compute @workgroup_size(256)
fn attn_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % L;
    let b = wid.z;
    let h = wid.y;
    let i = wid.x * RB + li / L;
    let ic = min(i, p.t - 1u);
    let oi = q_idx(b, ic, h);
    var part = 0.0;
    // unroll
    let e_UV = oi + 4u * (UV * L + lane);
    let o_UV = vec4(O[p.o_off + e_UV], O[p.o_off + e_UV + 1u], O[p.o_off + e_UV + 2u], O[p.o_off + e_UV + 3u]);
    part += dot(ld_do(p.do_off + e_UV), o_UV);
    // end
    let s = row_sum(part);
    if i < p.t && lane == 0u {
        DD[p.dd_off + row_idx(b, h, i)] = s;
    }
}

// dq_i = scale · Σ_j p_ij (dout_i·v_j − delta_i) slope_ij k_j, slope_ij the
// capped_slope of the capped score (1 without a cap).
// grid: (ceil(T/RB), Hq, B)
@compute @workgroup_size(256)
fn attn_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % L;
    let b = wid.z;
    let h = wid.y;
    let g = h / (p.hq / p.hkv);
    let i = wid.x * RB + li / L;
    let valid = i < p.t;
    let ic = min(i, p.t - 1u);
    let first = (p.flags & FIRST) != 0u;
    let qi = q_idx(b, ic, h);
    var q: array<vec4<f32>, NV>;
    var dout: array<vec4<f32>, NV>;
    var dq: array<vec4<f32>, NV>;
    // unroll
    let e_UV = qi + 4u * (UV * L + lane);
    q[UV] = ld_q(p.q_off + e_UV) * p.scale;
    dout[UV] = ld_do(p.do_off + e_UV);
    dq[UV] = select(vec4(DQ[p.dq_off + e_UV], DQ[p.dq_off + e_UV + 1u], DQ[p.dq_off + e_UV + 2u], DQ[p.dq_off + e_UV + 3u]), vec4<f32>(0.0), first);
    // end
    let lse = LSE[p.lse_off + row_idx(b, h, ic)];
    let delta = DD[p.dd_off + row_idx(b, h, ic)];
    let kend = min(min(p.t, wid.x * RB + RB), p.r_end);
    for (var j0 = max(p.r_begin, first_key(b, wid.x * RB)); j0 < kend; j0 += KB) {
        workgroupBarrier();
        load_kv_tile(b, g, j0, li);
        workgroupBarrier();
        for (var jj = 0u; jj < KB; jj++) {
            let j = j0 + jj;
            let t = jj * D4 + lane;
            var ps = 0.0;
            var pp = 0.0;
            // unroll
            ps += dot(q[UV], T1[t + UV * L]);
            pp += dot(dout[UV], T2[t + UV * L]);
            // end
            let y = capped(row_sum(ps));
            let dp = row_sum(pp);
            let live = valid && sees(b, i, j) && j < p.r_end;
            let ds = select(0.0, exp(y - lse) * (dp * drop_factor(b, h, i, j) - delta) * capped_slope(y), live);
            // unroll
            dq[UV] = select(dq[UV], dq[UV] + ds * T1[t + UV * L], live);
            // end
        }
    }
    if valid {
        let sc = select(1.0, p.scale, (p.flags & LAST) != 0u);
        // unroll
        let x_UV = dq[UV] * sc;
        let at_UV = p.dq_off + qi + 4u * (UV * L + lane);
        DQ[at_UV] = x_UV.x;
        DQ[at_UV + 1u] = x_UV.y;
        DQ[at_UV + 2u] = x_UV.z;
        DQ[at_UV + 3u] = x_UV.w;
        // end
    }
}

// One row per key j of kv head g, over every query head of the group and
// every query i ≥ j in range, so dk/dv are complete sums with no atomics.
// grid: (ceil(T/RB), Hkv, B)
@compute @workgroup_size(256)
fn attn_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) li: u32) {
    let lane = li % L;
    let b = wid.z;
    let g = wid.y;
    let group = p.hq / p.hkv;
    let j = wid.x * RB + li / L;
    let valid = j < p.t;
    let jc = min(j, p.t - 1u);
    let first = (p.flags & FIRST) != 0u;
    let ki = kv_idx(b, jc, g);
    var k: array<vec4<f32>, NV>;
    var v: array<vec4<f32>, NV>;
    var dk: array<vec4<f32>, NV>;
    var dv: array<vec4<f32>, NV>;
    // unroll
    let e_UV = ki + 4u * (UV * L + lane);
    k[UV] = ld_k(p.k_off + e_UV) * p.scale;
    v[UV] = ld_v(p.v_off + e_UV);
    dk[UV] = select(vec4(DK[p.dk_off + e_UV], DK[p.dk_off + e_UV + 1u], DK[p.dk_off + e_UV + 2u], DK[p.dk_off + e_UV + 3u]), vec4<f32>(0.0), first);
    dv[UV] = select(vec4(DV[p.dv_off + e_UV], DV[p.dv_off + e_UV + 1u], DV[p.dv_off + e_UV + 2u], DV[p.dv_off + e_UV + 3u]), vec4<f32>(0.0), first);
    // end
    let i_start = max(wid.x * RB, p.r_begin);
    let i_end = min(min(p.t, p.r_end), query_end(b, wid.x * RB + RB - 1u));
    for (var hh = 0u; hh < group; hh++) {
        let h = g * group + hh;
        for (var i0 = i_start; i0 < i_end; i0 += KB) {
            workgroupBarrier();
            for (var e = li; e < KB * D4; e += THREADS) {
                let i = i0 + e / D4;
                var q = vec4<f32>(0.0);
                var d = vec4<f32>(0.0);
                if i < p.t {
                    let at = q_idx(b, i, h) + 4u * (e % D4);
                    q = ld_q(p.q_off + at);
                    d = ld_do(p.do_off + at);
                }
                T1[e] = q;
                T2[e] = d;
            }
            if li < KB {
                let i = i0 + li;
                var lse = 0.0;
                var delta = 0.0;
                if i < p.t {
                    lse = LSE[p.lse_off + row_idx(b, h, i)];
                    delta = DD[p.dd_off + row_idx(b, h, i)];
                }
                S1[li] = lse;
                S2[li] = delta;
            }
            workgroupBarrier();
            for (var ii = 0u; ii < KB; ii++) {
                let i = i0 + ii;
                let t = ii * D4 + lane;
                var ps = 0.0;
                var pp = 0.0;
                // unroll
                ps += dot(k[UV], T1[t + UV * L]);
                pp += dot(v[UV], T2[t + UV * L]);
                // end
                let y = capped(row_sum(ps));
                let dp = row_sum(pp);
                let live = valid && sees(b, i, j) && i < i_end;
                let pr = select(0.0, exp(y - S1[ii]), live);
                let fd = drop_factor(b, h, i, j);
                let ds = pr * (dp * fd - S2[ii]) * capped_slope(y);
                let pd = pr * fd;
                // unroll
                dv[UV] = select(dv[UV], dv[UV] + pd * T2[t + UV * L], live);
                dk[UV] = select(dk[UV], dk[UV] + ds * T1[t + UV * L], live);
                // end
            }
        }
    }
    var vmax = 0u;
    if valid {
        let sc = select(1.0, p.scale, (p.flags & LAST) != 0u);
        // unroll
        let at_UV = ki + 4u * (UV * L + lane);
        let x_UV = dk[UV] * sc;
        DK[p.dk_off + at_UV] = x_UV.x;
        DK[p.dk_off + at_UV + 1u] = x_UV.y;
        DK[p.dk_off + at_UV + 2u] = x_UV.z;
        DK[p.dk_off + at_UV + 3u] = x_UV.w;
        DV[p.dv_off + at_UV] = dv[UV].x;
        DV[p.dv_off + at_UV + 1u] = dv[UV].y;
        DV[p.dv_off + at_UV + 2u] = dv[UV].z;
        DV[p.dv_off + at_UV + 3u] = dv[UV].w;
        vmax = max4(vmax, dv[UV]);
        // end
    }
    workgroupBarrier();
    store_max(li, vmax, wid, nwg);
}
