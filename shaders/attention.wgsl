// Fused causal attention with grouped-query heads, in a sliding window
// where p.window > 0, within packed documents where p.docs != 0
// (attention_mask.wgsl), the scores soft-capped where
// p.softcap > 0 (attention_params.wgsl's `capped`). No T×T matrix ever
// exists in device memory: the forward keeps a running max and sum per query row
// (online softmax) and stores only out and lse; the backward recomputes the
// probabilities from lse. Layouts: q/out/dout [B, T, Hq, D], k/v [B, T, Hkv, D],
// lse and delta [B, Hq, T]. One thread owns one row; tiles of the other side
// stream through workgroup memory. D ≤ DM.
//
// Each kernel may be dispatched several times over consecutive ranges
// [r_begin, r_end) of the streamed side (keys for fwd/dq, queries for dkv),
// carrying its state in the output buffers between dispatches (FIRST starts
// it, LAST finishes it). The host splits only where the driver caps the loop
// iterations of one invocation (llvmpipe stops every loop after 65535
// back-edges in total, silently); one dispatch elsewhere.

// As written, the kernels of any D ≤ 128. The host (kernels.rs,
// `AttnHeadDim`) compiles variants with D compiled in, and for D up to 256
// with DM = 256 on tiles of half the rows (KB = 8, QB = 4), so that the
// tiles still fit the same 2 × 2048 floats.
const DM: u32 = 128u;
const RB: u32 = 64u; // rows (threads) per workgroup
const KB: u32 = 16u; // key rows per tile in forward and dq
const QB: u32 = 8u;  // query rows per tile in dk/dv

// 16 KiB in all, the WebGPU minimum for workgroup memory. dkv uses only
// QB * DM ≤ 1024 entries of each for its tiles and keeps the tile's lse and
// delta rows at STATS.
var<workgroup> T1: array<f32, 2048>; // ≥ KB * DM
var<workgroup> T2: array<f32, 2048>;
const STATS: u32 = 1024u;

// Loads KB key and value rows starting at j0 of kv head g into T1 / T2.
fn load_kv_tile(b: u32, g: u32, j0: u32, tid: u32) {
    for (var e = tid; e < KB * p.d; e += RB) {
        let j = j0 + e / p.d;
        let dd = e % p.d;
        var kv = vec2<f32>(0.0);
        if j < p.t {
            let i = kv_idx(b, j, g) + dd;
            kv = vec2<f32>(K[p.k_off + i], V[p.v_off + i]);
        }
        T1[e] = kv.x;
        T2[e] = kv.y;
    }
}

// With STORE_MAX in a LAST dispatch: the workgroup's largest of the
// invocations' `m` into OMAX, folded pairwise through T1 (after the barrier
// no invocation reads the tile any more) as u32 bits in f32 slots, which
// they keep: they are never NaN. Called by every invocation (uniform: the
// flags are the dispatch's).
fn store_max(tid: u32, m: u32, wid: vec3<u32>, nwg: vec3<u32>) {
    if (p.flags & (LAST | STORE_MAX)) != (LAST | STORE_MAX) {
        return;
    }
    workgroupBarrier();
    T1[tid] = bitcast<f32>(m);
    workgroupBarrier();
    for (var n = RB / 2u; n > 0u; n /= 2u) {
        if tid < n {
            T1[tid] = bitcast<f32>(max(bitcast<u32>(T1[tid]), bitcast<u32>(T1[tid + n])));
        }
        workgroupBarrier();
    }
    if tid == 0u {
        OMAX[p.max_off + (wid.z * nwg.y + wid.y) * nwg.x + wid.x] = bitcast<u32>(T1[0]);
    }
}

// grid: (ceil(T / RB), Hq, B)
@compute @workgroup_size(64)
fn attn_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) tid: u32) {
    let b = wid.z;
    let h = wid.y;
    let g = h / (p.hq / p.hkv);
    let i = wid.x * RB + tid;
    let valid = i < p.t;
    let first = (p.flags & FIRST) != 0u;
    var q: array<f32, DM>;
    var acc: array<f32, DM>;
    var m = -3.0e38;
    var l = 0.0;
    // Running state between key ranges: unnormalised acc in O, max in LSE,
    // sum in DD.
    let oi = p.o_off + q_idx(b, i, h);
    let ri = row_idx(b, h, i);
    if valid {
        let qi = p.q_off + q_idx(b, i, h);
        for (var dd = 0u; dd < p.d; dd++) {
            q[dd] = Q[qi + dd] * p.scale;
            acc[dd] = select(O[oi + dd], 0.0, first);
        }
        if !first {
            m = LSE[p.lse_off + ri];
            l = DD[p.dd_off + ri];
        }
    }
    // Keys before the window (or document) of the block's first row are
    // never loaded.
    let kend = min(min(p.t, wid.x * RB + RB), p.r_end);
    let fk = first_key(b, i);
    for (var j0 = max(p.r_begin, first_key(b, wid.x * RB)); j0 < kend; j0 += KB) {
        workgroupBarrier();
        load_kv_tile(b, g, j0, tid);
        workgroupBarrier();
        if valid {
            let jn = min(min(KB, i + 1u - min(i + 1u, j0)), p.r_end - j0);
            for (var jj = fk - min(fk, j0); jj < jn; jj++) {
                var raw = 0.0;
                for (var dd = 0u; dd < p.d; dd++) {
                    raw += q[dd] * T1[jj * p.d + dd];
                }
                let s = capped(raw);
                let mn = max(m, s);
                let corr = exp(m - mn);
                let pr = exp(s - mn);
                l = l * corr + pr;
                // The sum is of every probability; the values are weighted
                // by the kept ones (dropout).
                let pd = pr * drop_factor(b, h, i, j0 + jj);
                for (var dd = 0u; dd < p.d; dd++) {
                    acc[dd] = acc[dd] * corr + pd * T2[jj * p.d + dd];
                }
                m = mn;
            }
        }
    }
    var omax = 0u;
    if valid {
        if (p.flags & LAST) != 0u {
            let inv = 1.0 / l;
            for (var dd = 0u; dd < p.d; dd++) {
                let o = acc[dd] * inv;
                O[oi + dd] = o;
                omax = max(omax, max_bits(o));
            }
            LSE[p.lse_off + ri] = m + log(l);
        } else {
            for (var dd = 0u; dd < p.d; dd++) {
                O[oi + dd] = acc[dd];
            }
            LSE[p.lse_off + ri] = m;
            DD[p.dd_off + ri] = l;
        }
    }
    store_max(tid, omax, wid, nwg);
}

// delta = rowsum(dout · out), one thread per (b, h, i). grid: (ceil(T/RB), Hq, B)
@compute @workgroup_size(64)
fn attn_delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let b = wid.z;
    let h = wid.y;
    let i = wid.x * RB + tid;
    if i >= p.t {
        return;
    }
    let oi = q_idx(b, i, h);
    var s = 0.0;
    for (var dd = 0u; dd < p.d; dd++) {
        s += DO[p.do_off + oi + dd] * O[p.o_off + oi + dd];
    }
    DD[p.dd_off + row_idx(b, h, i)] = s;
}

// dq_i = scale · Σ_j p_ij (dout_i·v_j · f_ij − delta_i) slope_ij k_j,
// slope_ij the capped_slope of the capped score (1 without a cap), f_ij the
// dropout's factor (drop_factor; delta is already of the dropped weights).
// grid: (ceil(T/RB), Hq, B)
@compute @workgroup_size(64)
fn attn_dq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let b = wid.z;
    let h = wid.y;
    let g = h / (p.hq / p.hkv);
    let i = wid.x * RB + tid;
    let valid = i < p.t;
    var q: array<f32, DM>;
    var dout: array<f32, DM>;
    var dq: array<f32, DM>;
    var lse = 0.0;
    var delta = 0.0;
    if valid {
        let qi = q_idx(b, i, h);
        let first = (p.flags & FIRST) != 0u;
        for (var dd = 0u; dd < p.d; dd++) {
            q[dd] = Q[p.q_off + qi + dd] * p.scale;
            dout[dd] = DO[p.do_off + qi + dd];
            dq[dd] = select(DQ[p.dq_off + qi + dd], 0.0, first);
        }
        lse = LSE[p.lse_off + row_idx(b, h, i)];
        delta = DD[p.dd_off + row_idx(b, h, i)];
    }
    // Keys before the window (or document) of the block's first row are
    // never loaded.
    let kend = min(min(p.t, wid.x * RB + RB), p.r_end);
    let fk = first_key(b, i);
    for (var j0 = max(p.r_begin, first_key(b, wid.x * RB)); j0 < kend; j0 += KB) {
        workgroupBarrier();
        load_kv_tile(b, g, j0, tid);
        workgroupBarrier();
        if valid {
            let jn = min(min(KB, i + 1u - min(i + 1u, j0)), p.r_end - j0);
            for (var jj = fk - min(fk, j0); jj < jn; jj++) {
                var s = 0.0;
                var dp = 0.0;
                for (var dd = 0u; dd < p.d; dd++) {
                    s += q[dd] * T1[jj * p.d + dd];
                    dp += dout[dd] * T2[jj * p.d + dd];
                }
                let y = capped(s);
                let ds = exp(y - lse) * (dp * drop_factor(b, h, i, j0 + jj) - delta) * capped_slope(y);
                for (var dd = 0u; dd < p.d; dd++) {
                    dq[dd] += ds * T1[jj * p.d + dd];
                }
            }
        }
    }
    if valid {
        let qi = p.dq_off + q_idx(b, i, h);
        let sc = select(1.0, p.scale, (p.flags & LAST) != 0u);
        for (var dd = 0u; dd < p.d; dd++) {
            DQ[qi + dd] = dq[dd] * sc;
        }
    }
}

// One thread per key row j of kv head g: loops over every query head of the
// group and every query i ≥ j, so dk/dv are complete sums with no atomics.
// grid: (ceil(T/RB), Hkv, B)
@compute @workgroup_size(64)
fn attn_dkv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) tid: u32) {
    let b = wid.z;
    let g = wid.y;
    let group = p.hq / p.hkv;
    let j = wid.x * RB + tid;
    let valid = j < p.t;
    var k: array<f32, DM>;
    var v: array<f32, DM>;
    var dk: array<f32, DM>;
    var dv: array<f32, DM>;
    if valid {
        let ki = kv_idx(b, j, g);
        let first = (p.flags & FIRST) != 0u;
        for (var dd = 0u; dd < p.d; dd++) {
            k[dd] = K[p.k_off + ki + dd] * p.scale;
            v[dd] = V[p.v_off + ki + dd];
            dk[dd] = select(DK[p.dk_off + ki + dd], 0.0, first);
            dv[dd] = select(DV[p.dv_off + ki + dd], 0.0, first);
        }
    }
    let i_start = max(wid.x * RB, p.r_begin);
    // Queries past the window (or document) of the block's last key are
    // never loaded.
    let i_end = min(min(p.t, p.r_end), query_end(b, wid.x * RB + RB - 1u));
    for (var hh = 0u; hh < group; hh++) {
        let h = g * group + hh;
        for (var i0 = i_start; i0 < i_end; i0 += QB) {
            workgroupBarrier();
            for (var e = tid; e < QB * p.d; e += RB) {
                let i = i0 + e / p.d;
                var qd = vec2<f32>(0.0);
                if i < p.t {
                    let qi = q_idx(b, i, h) + e % p.d;
                    qd = vec2<f32>(Q[p.q_off + qi], DO[p.do_off + qi]);
                }
                T1[e] = qd.x;
                T2[e] = qd.y;
            }
            if tid < QB {
                let i = i0 + tid;
                var ld = vec2<f32>(0.0);
                if i < p.t {
                    ld = vec2<f32>(LSE[p.lse_off + row_idx(b, h, i)], DD[p.dd_off + row_idx(b, h, i)]);
                }
                T1[STATS + tid] = ld.x;
                T2[STATS + tid] = ld.y;
            }
            workgroupBarrier();
            if valid {
                for (var ii = 0u; ii < QB; ii++) {
                    let i = i0 + ii;
                    if sees(b, i, j) && i < i_end {
                        var s = 0.0;
                        var dp = 0.0;
                        for (var dd = 0u; dd < p.d; dd++) {
                            s += k[dd] * T1[ii * p.d + dd];
                            dp += v[dd] * T2[ii * p.d + dd];
                        }
                        let y = capped(s);
                        let pr = exp(y - T1[STATS + ii]);
                        let fd = drop_factor(b, h, i, j);
                        let ds = pr * (dp * fd - T2[STATS + ii]) * capped_slope(y);
                        let pd = pr * fd;
                        for (var dd = 0u; dd < p.d; dd++) {
                            dv[dd] += pd * T2[ii * p.d + dd];
                            dk[dd] += ds * T1[ii * p.d + dd];
                        }
                    }
                }
            }
        }
    }
    var vmax = 0u;
    if valid {
        let ki = kv_idx(b, j, g);
        let sc = select(1.0, p.scale, (p.flags & LAST) != 0u);
        for (var dd = 0u; dd < p.d; dd++) {
            DK[p.dk_off + ki + dd] = dk[dd] * sc;
            DV[p.dv_off + ki + dd] = dv[dd];
            vmax = max(vmax, max_bits(dv[dd]));
        }
    }
    store_max(tid, vmax, wid, nwg);
}
