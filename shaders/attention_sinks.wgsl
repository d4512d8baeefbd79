// GPT-OSS's attention sinks: a learned logit per query head joins every
// row's softmax with no value vector, which scales the plain attention's
// row (b, t, h) of O: [B, T, Hq, D] by σ(lse[b, h, t] − sink[h]). The host
// binds whole batches, or rows t0.. of one batch (`nt` rows of T each
// batch), with the bound batches' whole lse slabs ([Hq, T] each): so the
// kernels find a row's lse from its place in the chunk. One thread per
// element (sink_scale) or per row (sink_rows); the grid may be 2-D past
// 65535 workgroups, hence `flat_id`.

struct Params {
    // Elements (sink_scale) or rows (sink_rows) of this chunk.
    n: u32, t: u32, hq: u32, d: u32,
    t0: u32, nt: u32, x_off: u32, lse_off: u32,
    sink_off: u32, g_off: u32, y_off: u32, _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// O (forward), dO_s (backward's dout) or O_s (sink_rows).
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> LSE: array<f32>;
@group(0) @binding(3) var<storage, read> SINK: array<f32>;
// dO_s (sink_rows).
@group(0) @binding(4) var<storage, read> G: array<f32>;
@group(0) @binding(5) var<storage, read_write> Y: array<f32>;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// lse[b, h, t] − sink[h] of the chunk's row r (rows in O's order, b, t, h).
fn logit(r: u32) -> f32 {
    let h = r % p.hq;
    let bt = r / p.hq;
    let l = LSE[p.lse_off + ((bt / p.nt) * p.hq + h) * p.t + p.t0 + bt % p.nt];
    return l - SINK[p.sink_off + h];
}

// Y = X · σ(lse − sink), row by row: the sink attention's output from the
// plain one's, and the plain backward's dout from the sink's.
@compute @workgroup_size(256)
fn sink_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Y[p.y_off + i] = X[p.x_off + i] * sigmoid(logit(i / p.d));
    }
}

// Y[r] = −(dO_s · O_s)(1 − σ) of row r, the sink's gradient from that row
// (summed over the rows of each head by the host's column sums, in a fixed
// order). 1 − σ is σ(sink − lse): it keeps its digits where σ is near 1.
@compute @workgroup_size(256)
fn sink_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = flat_id(wid, nwg, lid);
    if r < p.n {
        let xb = p.x_off + r * p.d;
        let gb = p.g_off + r * p.d;
        var dot = 0.0;
        for (var e = 0u; e < p.d; e++) {
            dot += X[xb + e] * G[gb + e];
        }
        Y[p.y_off + r] = -dot * sigmoid(-logit(r));
    }
}
