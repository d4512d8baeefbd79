// Fused softmax cross-entropy: one workgroup per row computes the max, the
// sum of exponentials, the loss and the scaled gradient in one pass over the
// row (three reads, one write); logits never leave the device. With a
// z-loss factor z ≠ 0, the row's z·lse² goes to LOSS[z_off + row] and the
// gradient is of loss + z·lse²: softmax scaled by 1 + 2z·lse (exactly 1
// where z = 0, so the plain loss's bits are unchanged). With label
// smoothing eps ≠ 0 the target is (1 − eps)·onehot + eps/V: the row's
// lse − mean(x) (its cross-entropy against the uniform target) goes to
// LOSS[u_off + row], which takes a fourth pass's sum of the logits, and
// the gradient loses eps/V everywhere and 1 − eps at the target (exactly
// 0 and 1 where eps = 0).

struct Params {
    rows: u32, v: u32, ignore: i32, scale: f32,
    x_off: u32, t_off: u32, l_off: u32, d_off: u32,
    flags: u32, max_off: u32, z: f32, z_off: u32,
    eps: f32, u_off: u32,
}

// Under F16 the logits' gradient is the head's f16 products' operand: with
// STORE_MAX each row's workgroup stores the max_bits (max_bits.wgsl) of
// the gradient it wrote at OMAX[max_off + row] (row_max.wgsl), which
// absmax.wgsl folds when a product first reads it, so nothing scans it.
const STORE_MAX: u32 = 1u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> TGT: array<i32>;
@group(0) @binding(3) var<storage, read_write> LOSS: array<f32>;
@group(0) @binding(4) var<storage, read_write> DL: array<f32>;
@group(0) @binding(5) var<storage, read_write> OMAX: array<u32>;

var<workgroup> red: array<f32, 256>;

fn reduce_max(t: u32, a: f32) -> f32 {
    red[t] = a;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if t < s {
            red[t] = max(red[t], red[t + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_sum(t: u32, a: f32) -> f32 {
    red[t] = a;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if t < s {
            red[t] += red[t + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn cross_entropy(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) t: u32) {
    let row = wid.y * nwg.x + wid.x;
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.v;
    let dbase = p.d_off + row * p.v;
    let tgt = TGT[p.t_off + row];
    if tgt == p.ignore {
        for (var i = t; i < p.v; i += 256u) {
            DL[dbase + i] = 0.0;
        }
        if t == 0u {
            LOSS[p.l_off + row] = 0.0;
            if p.z != 0.0 {
                LOSS[p.z_off + row] = 0.0;
            }
            if p.eps != 0.0 {
                LOSS[p.u_off + row] = 0.0;
            }
        }
        store_row_max(t, row, 0u);
        return;
    }
    var mx = -3.0e38;
    for (var i = t; i < p.v; i += 256u) {
        mx = max(mx, X[base + i]);
    }
    mx = reduce_max(t, mx);
    var s = 0.0;
    for (var i = t; i < p.v; i += 256u) {
        s += exp(X[base + i] - mx);
    }
    s = reduce_sum(t, s);
    let lse = mx + log(s);
    // p.eps is uniform, so every invocation takes the branch or none does
    // and the reduction's barriers stay in uniform control flow.
    var mean = 0.0;
    if p.eps != 0.0 {
        var sx = 0.0;
        for (var i = t; i < p.v; i += 256u) {
            sx += X[base + i];
        }
        mean = reduce_sum(t, sx) / f32(p.v);
    }
    let inv = (1.0 + 2.0 * p.z * lse) / s;
    let hot = 1.0 - p.eps;
    let flat = p.eps / f32(p.v);
    let ut = u32(tgt);
    var m = 0u;
    for (var i = t; i < p.v; i += 256u) {
        var pr = exp(X[base + i] - mx) * inv - flat;
        if i == ut {
            pr -= hot;
        }
        let g = p.scale * pr;
        DL[dbase + i] = g;
        m = max(m, max_bits(g));
    }
    if t == 0u {
        LOSS[p.l_off + row] = lse - X[base + ut];
        if p.z != 0.0 {
            LOSS[p.z_off + row] = p.z * lse * lse;
        }
        if p.eps != 0.0 {
            LOSS[p.u_off + row] = lse - mean;
        }
    }
    store_row_max(t, row, m);
}
