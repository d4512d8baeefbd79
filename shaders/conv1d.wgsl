// The gated delta net's short convolution: a depthwise causal conv1d of K
// taps over each sequence of x: [B, T, C] (rows b·T + t), then SiLU;
// y[r, c] = silu(Σ_i w[c, i] · x[r − K + 1 + i, c]), the taps reaching
// before the sequence's start reading 0. The host binds a chunk of rows
// r0 .. r0 + n / c with `hl` rows of x before it (the taps' reach, fewer
// at the tensor's start), so a row's position in its sequence is
// (r0 + row) mod T. With documents packed in the rows (docs != 0:
// megatrain_tensor's Docs) each document is a sequence: DOCS holds the
// first position (in its batch row) of the document of the chunk's row
// `row` at docs_off + row, for the chunk's rows and the K − 1 after; where
// docs is 0 DOCS is a dummy binding that nothing reads. One thread per
// element (or, for dw, per block of rows
// and tap); the grid may be 2-D past 65535 workgroups, hence `flat_id`.

struct Params {
    // Threads of this dispatch: elements of the chunk, or (conv_dw_part)
    // its blocks times C·K.
    n: u32, c: u32, k: u32, t: u32,
    r0: u32, hl: u32, rows: u32, blk_rows: u32,
    x_off: u32, w_off: u32, d_off: u32, y_off: u32,
    docs: u32, docs_off: u32, _p0: u32, _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> W: array<f32>;
// dy (conv_dpre), or the pre-activation's gradient (conv_dx, conv_dw_part),
// bound from the chunk's first row.
@group(0) @binding(3) var<storage, read> DY: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read> DOCS: array<u32>;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// How many rows of its sequence come before the chunk's row `row`.
fn before(row: u32) -> u32 {
    let ti = (p.r0 + row) % p.t;
    if p.docs != 0u {
        return ti - DOCS[p.docs_off + row];
    }
    return ti;
}

// How many rows of its sequence come after it, at most K − 1 (all a tap
// reaches): within its batch row, those whose document starts where its
// own does.
fn after(row: u32) -> u32 {
    let most = min(p.t - 1u - (p.r0 + row) % p.t, p.k - 1u);
    if p.docs == 0u {
        return most;
    }
    let s = DOCS[p.docs_off + row];
    var a = 0u;
    while a < most && DOCS[p.docs_off + row + a + 1u] == s {
        a++;
    }
    return a;
}

// The pre-activation of the chunk's element i, taps in the reference's
// order (i = 0 first), those before the sequence's start skipped.
fn pre(i: u32) -> f32 {
    let row = i / p.c;
    let ch = i % p.c;
    var s = 0.0;
    for (var j = (p.k - 1u) - min(before(row), p.k - 1u); j < p.k; j++) {
        s += W[p.w_off + ch * p.k + j] * X[p.x_off + (row + p.hl + j + 1u - p.k) * p.c + ch];
    }
    return s;
}

@compute @workgroup_size(256)
fn conv_silu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let z = pre(i);
        Y[p.y_off + i] = z * sigmoid(z);
    }
}

// dy · silu'(pre): the gradient of the pre-activation, which both dx and
// dw read at K rows each.
@compute @workgroup_size(256)
fn conv_dpre(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let z = pre(i);
        let s = sigmoid(z);
        Y[p.y_off + i] = DY[p.d_off + i] * s * (1.0 + z * (1.0 - s));
    }
}

// dx[r, c] = Σ_i w[c, i] · d[r + K − 1 − i, c] over the rows inside the
// sequence: d (DY) bound from the chunk's first row, up to K − 1 rows past
// its last.
@compute @workgroup_size(256)
fn conv_dx(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let row = i / p.c;
        let ch = i % p.c;
        var s = 0.0;
        for (var j = (p.k - 1u) - after(row); j < p.k; j++) {
            s += W[p.w_off + ch * p.k + j] * DY[p.d_off + (row + p.k - 1u - j) * p.c + ch];
        }
        Y[p.y_off + i] = s;
    }
}

// One partial of dw per block of `blk_rows` rows of the chunk and tap
// (c, i): Σ over the block's rows in order of d[r, c] · x[r − K + 1 + i, c],
// into row (block) of a [blocks, C·K] array whose column sums, in order,
// are dw: no atomics, the same sum every run.
@compute @workgroup_size(256)
fn conv_dw_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let ck = p.c * p.k;
        let blk = i / ck;
        let ch = (i % ck) / p.k;
        let j = i % p.k;
        let first = blk * p.blk_rows;
        let last = min(first + p.blk_rows, p.rows);
        var s = 0.0;
        for (var row = first; row < last; row++) {
            if before(row) + j + 1u >= p.k {
                s += DY[p.d_off + row * p.c + ch] * X[p.x_off + (row + p.hl + j + 1u - p.k) * p.c + ch];
            }
        }
        Y[p.y_off + i] = s;
    }
}
