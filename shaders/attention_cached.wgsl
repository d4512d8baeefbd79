// Attention of new queries over a cache of keys and values (generation):
// q [B, Tq, Hq, D] are the last Tq of `len` positions; k, v [B, Tc, Hkv, D]
// hold every key and value so far in their first `len` positions. Query i
// sits at position len − Tq + i and sees keys from its window's first to
// itself. One workgroup a query row (its flat index is the row's place in
// lse [B, Hq, Tq]): its 64 threads score a block of 64 keys at a time, one
// key each, and keep the online softmax's running max and sum; each owns
// the output entries d ≡ tid (mod 64), D ≤ 256. A decoding step reads each
// cached key once, so this is bound by memory, not by products: plain f32
// arithmetic, as the CPU reference computes it. Put activation_fns.wgsl
// before this file (the soft cap's tanh_precise).

const WG: u32 = 64u;
const NO_SCORE: f32 = -3.0e38;

struct Params {
    b: u32, tq: u32, tc: u32, len: u32,
    hq: u32, hkv: u32, d: u32, window: u32,
    scale: f32, softcap: f32, q_off: u32, k_off: u32,
    v_off: u32, o_off: u32, lse_off: u32, rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K: array<f32>;
@group(0) @binding(3) var<storage, read> V: array<f32>;
@group(0) @binding(4) var<storage, read_write> O: array<f32>;
@group(0) @binding(5) var<storage, read_write> LSE: array<f32>;

var<workgroup> q_s: array<f32, 256>;
// A block's scores, then its probabilities.
var<workgroup> s_s: array<f32, 64>;

@compute @workgroup_size(64)
fn attn_cached(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    // Uniform across the workgroup, so every barrier below is reached by all.
    let row = wid.y * nwg.x + wid.x;
    if row >= p.rows {
        return;
    }
    let tid = lid.x;
    let ti = row % p.tq;
    let h = (row / p.tq) % p.hq;
    let b = row / (p.tq * p.hq);
    let g = h / (p.hq / p.hkv);
    let pos = p.len - p.tq + ti;
    var j0 = 0u;
    if p.window > 0u && pos + 1u > p.window {
        j0 = pos + 1u - p.window;
    }
    let q_row = p.q_off + ((b * p.tq + ti) * p.hq + h) * p.d;
    for (var x = tid; x < p.d; x += WG) {
        q_s[x] = Q[q_row + x];
    }
    workgroupBarrier();

    var m = NO_SCORE;
    var l = 0.0;
    var o = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var jb = j0; jb <= pos; jb += WG) {
        let j = jb + tid;
        var s = NO_SCORE;
        if j <= pos {
            let kr = p.k_off + ((b * p.tc + j) * p.hkv + g) * p.d;
            var dot = 0.0;
            for (var x = 0u; x < p.d; x++) {
                dot += q_s[x] * K[kr + x];
            }
            s = dot * p.scale;
            if p.softcap > 0.0 {
                s = p.softcap * tanh_precise(s / p.softcap);
            }
        }
        s_s[tid] = s;
        workgroupBarrier();
        let n = min(WG, pos + 1u - jb);
        var bm = NO_SCORE;
        for (var i = 0u; i < n; i++) {
            bm = max(bm, s_s[i]);
        }
        let m_new = max(m, bm);
        let factor = exp(m - m_new);
        workgroupBarrier();
        if j <= pos {
            s_s[tid] = exp(s - m_new);
        }
        workgroupBarrier();
        var bl = 0.0;
        for (var i = 0u; i < n; i++) {
            bl += s_s[i];
        }
        l = l * factor + bl;
        for (var c = 0u; c < 4u; c++) {
            let x = tid + c * WG;
            if x < p.d {
                var acc = 0.0;
                for (var i = 0u; i < n; i++) {
                    acc += s_s[i] * V[p.v_off + ((b * p.tc + jb + i) * p.hkv + g) * p.d + x];
                }
                o[c] = o[c] * factor + acc;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    let o_row = p.o_off + ((b * p.tq + ti) * p.hq + h) * p.d;
    for (var c = 0u; c < 4u; c++) {
        let x = tid + c * WG;
        if x < p.d {
            O[o_row + x] = o[c] / l;
        }
    }
    if tid == 0u {
        LSE[p.lse_off + row] = m + log(l);
    }
}
