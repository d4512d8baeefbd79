// RMSNorm and LayerNorm over the last dimension, forward and backward, and
// the same fused with the residual add in front of them (`add_*`): the
// forward writes h = x + r beside the norm of h, the backward adds the
// stream's gradient dh to dx, so neither needs a pass of its own. Also the
// row dot products of a mixture-of-experts block's routing-weight gradient
// (`row_dots`). One workgroup of 256 threads per row; sums reduce through
// workgroup memory.

struct Params {
    rows: u32, c: u32, eps: f32, flags: u32,
    x_off: u32, w_off: u32, b3_off: u32, o4_off: u32,
    o5_off: u32, o6_off: u32, r7_off: u32, r8_off: u32,
    r9_off: u32, o10_off: u32, blk_rows: u32, max_off: u32,
}

const HAS_MEAN: u32 = 1u;
const HAS_DB: u32 = 2u;
// Each row's max|O4| into OMAX[max_off + row] (see store_row_max).
const STORE_MAX: u32 = 4u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<f32>;
// LayerNorm bias in the forward, dy in the backward.
@group(0) @binding(3) var<storage, read> B3: array<f32>;
@group(0) @binding(4) var<storage, read_write> O4: array<f32>;
@group(0) @binding(5) var<storage, read_write> O5: array<f32>;
@group(0) @binding(6) var<storage, read_write> O6: array<f32>;
// rstd and mean as inputs of the backward.
@group(0) @binding(7) var<storage, read> R7: array<f32>;
@group(0) @binding(8) var<storage, read> R8: array<f32>;
// The residual r in the fused forwards, the stream's gradient dh in the
// fused backwards.
@group(0) @binding(9) var<storage, read> R9: array<f32>;
// h = x + r, written by the fused forwards.
@group(0) @binding(10) var<storage, read_write> O10: array<f32>;
// Per-row maxima of the row kernels' output (max_bits.wgsl's bits).
@group(0) @binding(11) var<storage, read_write> OMAX: array<u32>;

var<workgroup> red: array<f32, 256>;
var<workgroup> red2: array<f32, 256>;

fn row_id(wid: vec3<u32>, nwg: vec3<u32>) -> u32 {
    return wid.y * nwg.x + wid.x;
}

// Sums `a` and `b` over the workgroup; every thread gets the totals.
fn reduce2(t: u32, a: f32, b: f32) -> vec2<f32> {
    red[t] = a;
    red2[t] = b;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if t < s {
            red[t] += red[t + s];
            red2[t] += red2[t + s];
        }
        workgroupBarrier();
    }
    let r = vec2<f32>(red[0], red2[0]);
    workgroupBarrier();
    return r;
}

// Under F16 a norm's output (y forward, dx backward) is an operand of the
// f16 products that follow: with STORE_MAX each row's max is stored by
// store_row_max (row_max.wgsl).

@compute @workgroup_size(256)
fn rms_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    var ss = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let x = X[base + i];
        ss += x * x;
    }
    let tot = reduce2(t, ss, 0.0);
    let rstd = inverseSqrt(tot.x / f32(p.c) + p.eps);
    var m = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let y = X[base + i] * rstd * W[p.w_off + i];
        O4[p.o4_off + row * p.c + i] = y;
        m = max(m, max_bits(y));
    }
    store_row_max(t, row, m);
    if t == 0u {
        O5[p.o5_off + row] = rstd;
    }
}

@compute @workgroup_size(256)
fn ln_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    var s = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        s += X[base + i];
    }
    let mean = reduce2(t, s, 0.0).x / f32(p.c);
    // Two passes (mean, then centred squares) for accuracy on offset data.
    var ss = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let d = X[base + i] - mean;
        ss += d * d;
    }
    let rstd = inverseSqrt(reduce2(t, ss, 0.0).x / f32(p.c) + p.eps);
    var m = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let y = (X[base + i] - mean) * rstd * W[p.w_off + i] + B3[p.b3_off + i];
        O4[p.o4_off + row * p.c + i] = y;
        m = max(m, max_bits(y));
    }
    store_row_max(t, row, m);
    if t == 0u {
        O5[p.o5_off + row] = rstd;
        O6[p.o6_off + row] = mean;
    }
}

// rms_fwd of h = x + r. Each thread reads back only the h it wrote itself.
@compute @workgroup_size(256)
fn add_rms_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let xb = p.x_off + row * p.c;
    let rb = p.r9_off + row * p.c;
    let hb = p.o10_off + row * p.c;
    var ss = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let h = X[xb + i] + R9[rb + i];
        O10[hb + i] = h;
        ss += h * h;
    }
    let tot = reduce2(t, ss, 0.0);
    let rstd = inverseSqrt(tot.x / f32(p.c) + p.eps);
    var m = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let y = O10[hb + i] * rstd * W[p.w_off + i];
        O4[p.o4_off + row * p.c + i] = y;
        m = max(m, max_bits(y));
    }
    store_row_max(t, row, m);
    if t == 0u {
        O5[p.o5_off + row] = rstd;
    }
}

// ln_fwd of h = x + r.
@compute @workgroup_size(256)
fn add_ln_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let xb = p.x_off + row * p.c;
    let rb = p.r9_off + row * p.c;
    let hb = p.o10_off + row * p.c;
    var s = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let h = X[xb + i] + R9[rb + i];
        O10[hb + i] = h;
        s += h;
    }
    let mean = reduce2(t, s, 0.0).x / f32(p.c);
    var ss = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let d = O10[hb + i] - mean;
        ss += d * d;
    }
    let rstd = inverseSqrt(reduce2(t, ss, 0.0).x / f32(p.c) + p.eps);
    var m = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let y = (O10[hb + i] - mean) * rstd * W[p.w_off + i] + B3[p.b3_off + i];
        O4[p.o4_off + row * p.c + i] = y;
        m = max(m, max_bits(y));
    }
    store_row_max(t, row, m);
    if t == 0u {
        O5[p.o5_off + row] = rstd;
        O6[p.o6_off + row] = mean;
    }
}

// mean(w·dy·x) of RMSNorm's backward over row `row` (every thread gets it).
fn rms_bwd_mean(t: u32, base: u32, dbase: u32) -> f32 {
    var s = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        s += W[p.w_off + i] * B3[dbase + i] * X[base + i];
    }
    return reduce2(t, s, 0.0).x / f32(p.c);
}

// dx = rstd·(w·dy) − x·rstd³·mean(w·dy·x), column i.
fn rms_dx(i: u32, base: u32, dbase: u32, rstd: f32, m: f32) -> f32 {
    let g = W[p.w_off + i] * B3[dbase + i];
    return rstd * g - X[base + i] * rstd * rstd * rstd * m;
}

// (mean(g), mean(g·x̂)) of LayerNorm's backward, g = w·dy, x̂ = (x − mean)·rstd.
fn ln_bwd_means(t: u32, base: u32, dbase: u32, rstd: f32, mean: f32) -> vec2<f32> {
    var sg = 0.0;
    var sgx = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        let g = W[p.w_off + i] * B3[dbase + i];
        sg += g;
        sgx += g * (X[base + i] - mean) * rstd;
    }
    return reduce2(t, sg, sgx) / f32(p.c);
}

// dx = rstd·(g − mean(g) − x̂·mean(g·x̂)), column i.
fn ln_dx(i: u32, base: u32, dbase: u32, rstd: f32, mean: f32, tot: vec2<f32>) -> f32 {
    let g = W[p.w_off + i] * B3[dbase + i];
    let xh = (X[base + i] - mean) * rstd;
    return rstd * (g - tot.x - xh * tot.y);
}

@compute @workgroup_size(256)
fn rms_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    let dbase = p.b3_off + row * p.c;
    let rstd = R7[p.r7_off + row];
    let m = rms_bwd_mean(t, base, dbase);
    var mx = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let dx = rms_dx(i, base, dbase, rstd, m);
        O4[p.o4_off + row * p.c + i] = dx;
        mx = max(mx, max_bits(dx));
    }
    store_row_max(t, row, mx);
}

@compute @workgroup_size(256)
fn ln_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    let dbase = p.b3_off + row * p.c;
    let rstd = R7[p.r7_off + row];
    let mean = R8[p.r8_off + row];
    let tot = ln_bwd_means(t, base, dbase, rstd, mean);
    var mx = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let dx = ln_dx(i, base, dbase, rstd, mean, tot);
        O4[p.o4_off + row * p.c + i] = dx;
        mx = max(mx, max_bits(dx));
    }
    store_row_max(t, row, mx);
}

// rms_bwd plus the residual stream's gradient: dx = (rms_bwd's dx) + dh.
@compute @workgroup_size(256)
fn add_rms_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    let dbase = p.b3_off + row * p.c;
    let rstd = R7[p.r7_off + row];
    let m = rms_bwd_mean(t, base, dbase);
    var mx = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let o = row * p.c + i;
        let dx = rms_dx(i, base, dbase, rstd, m) + R9[p.r9_off + o];
        O4[p.o4_off + o] = dx;
        mx = max(mx, max_bits(dx));
    }
    store_row_max(t, row, mx);
}

// ln_bwd plus the residual stream's gradient.
@compute @workgroup_size(256)
fn add_ln_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let base = p.x_off + row * p.c;
    let dbase = p.b3_off + row * p.c;
    let rstd = R7[p.r7_off + row];
    let mean = R8[p.r8_off + row];
    let tot = ln_bwd_means(t, base, dbase, rstd, mean);
    var mx = 0u;
    for (var i = t; i < p.c; i += 256u) {
        let o = row * p.c + i;
        let dx = ln_dx(i, base, dbase, rstd, mean, tot) + R9[p.r9_off + o];
        O4[p.o4_off + o] = dx;
        mx = max(mx, max_bits(dx));
    }
    store_row_max(t, row, mx);
}

// O5[row] = Σ_i X[row, i] · B3[row, i]: the dot product of each row of
// two same-shaped matrices (the gradient of a row's scale).
@compute @workgroup_size(256)
fn row_dots(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) t: u32) {
    let row = row_id(wid, nwg);
    if row >= p.rows {
        return;
    }
    let xb = p.x_off + row * p.c;
    let bb = p.b3_off + row * p.c;
    var s = 0.0;
    for (var i = t; i < p.c; i += 256u) {
        s += X[xb + i] * B3[bb + i];
    }
    let tot = reduce2(t, s, 0.0);
    if t == 0u {
        O5[p.o5_off + row] = tot.x;
    }
}

// dw[c] += Σ_rows dy·x̂, db[c] += Σ_rows dy; one thread per column. Always
// accumulates (the caller zeroes first) so row chunks can follow each other.
@compute @workgroup_size(256)
fn norm_dw(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) t: u32) {
    let col = row_id(wid, nwg) * 256u + t;
    if col >= p.c {
        return;
    }
    var sw = 0.0;
    var sb = 0.0;
    for (var r = 0u; r < p.rows; r++) {
        var xh = X[p.x_off + r * p.c + col];
        if (p.flags & HAS_MEAN) != 0u {
            xh -= R8[p.r8_off + r];
        }
        xh *= R7[p.r7_off + r];
        let dy = B3[p.b3_off + r * p.c + col];
        sw += dy * xh;
        sb += dy;
    }
    O4[p.o4_off + col] += sw;
    if (p.flags & HAS_DB) != 0u {
        O5[p.o5_off + col] += sb;
    }
}

// norm_dw split over blocks of `blk_rows` rows, so that a long column is
// summed by many workgroups instead of one thread: workgroup (x, y) sums
// rows y·blk_rows.. of 256 columns into partial row y of O6 (dw in its
// first c entries, db in the next c).
@compute @workgroup_size(256)
fn norm_dw_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let col = wid.x * 256u + t;
    if col >= p.c {
        return;
    }
    let r0 = wid.y * p.blk_rows;
    let r1 = min(r0 + p.blk_rows, p.rows);
    var sw = 0.0;
    var sb = 0.0;
    for (var r = r0; r < r1; r++) {
        var xh = X[p.x_off + r * p.c + col];
        if (p.flags & HAS_MEAN) != 0u {
            xh -= R8[p.r8_off + r];
        }
        xh *= R7[p.r7_off + r];
        let dy = B3[p.b3_off + r * p.c + col];
        sw += dy * xh;
        sb += dy;
    }
    O6[p.o6_off + wid.y * 2u * p.c + col] = sw;
    O6[p.o6_off + wid.y * 2u * p.c + p.c + col] = sb;
}

// dw[c] += Σ_blocks partial (and db), the blocks in order: `rows` is the
// number of partial rows here.
@compute @workgroup_size(256)
fn norm_dw_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) t: u32) {
    let col = row_id(wid, nwg) * 256u + t;
    if col >= p.c {
        return;
    }
    var sw = 0.0;
    var sb = 0.0;
    for (var b = 0u; b < p.rows; b++) {
        sw += O6[p.o6_off + b * 2u * p.c + col];
        sb += O6[p.o6_off + b * 2u * p.c + p.c + col];
    }
    O4[p.o4_off + col] += sw;
    if (p.flags & HAS_DB) != 0u {
        O5[p.o5_off + col] += sb;
    }
}
