// Elementwise ops and layout copies. One thread per element; the grid may be
// 2-D when there are more than 65535 workgroups, hence `flat_id`.

struct Params {
    n: u32, o0: u32, o1: u32, o2: u32,
    s: f32, rows: u32, w: u32, flags: u32,
    src_stride: u32, src_col: u32, dst_stride: u32, dst_col: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> Y: array<f32>;
@group(0) @binding(3) var<storage, read_write> Z: array<f32>;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

@compute @workgroup_size(256)
fn add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = X[p.o0 + i] + Y[p.o1 + i];
    }
}

@compute @workgroup_size(256)
fn add_assign(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = Z[p.o2 + i] + X[p.o0 + i];
    }
}

@compute @workgroup_size(256)
fn scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = p.s * X[p.o0 + i];
    }
}

@compute @workgroup_size(256)
fn add_scalar(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = X[p.o0 + i] + p.s;
    }
}

// Row r of X (rows of p.w elements) times Y[p.o1 + r]: a mixture-of-experts
// block's routing weights, uploaded by the host as f32.
@compute @workgroup_size(256)
fn scale_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = X[p.o0 + i] * Y[p.o1 + i / p.w];
    }
}

// Z = cap · tanh(Z / cap) in place (cap in p.s), Gemma's final logit
// soft-capping: a chunk of logits is capped without a second copy of it.
// tanh_precise is activation_fns.wgsl's (put before this file).
@compute @workgroup_size(256)
fn softcap(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        Z[p.o2 + i] = p.s * tanh_precise(Z[p.o2 + i] / p.s);
    }
}

// dy (Z) ·= 1 − (y / cap)² in place, from the capped y (X).
@compute @workgroup_size(256)
fn softcap_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let t = X[p.o0 + i] / p.s;
        Z[p.o2 + i] = Z[p.o2 + i] * (1.0 - t * t);
    }
}

// Copies a block of `w` columns of every row: the body of split_last / concat_last.
@compute @workgroup_size(256)
fn copy_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i < p.n {
        let r = i / p.w;
        let c = i % p.w;
        Z[p.o2 + r * p.dst_stride + p.dst_col + c] = X[p.o0 + r * p.src_stride + p.src_col + c];
    }
}

// Column sums of a [rows, w] matrix (the bias gradient); flags & 1 accumulates
// into Z so that row chunks can be summed one after another.
@compute @workgroup_size(256)
fn sum_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = flat_id(wid, nwg, lid);
    if c < p.w {
        var s = 0.0;
        for (var r = 0u; r < p.rows; r++) {
            s += X[p.o0 + r * p.w + c];
        }
        if (p.flags & 1u) != 0u {
            s += Z[p.o2 + c];
        }
        Z[p.o2 + c] = s;
    }
}

// The first half of a long sum_rows: workgroup (x, y) sums rows
// y·blk_rows.. (blk_rows in `src_stride`) of 256 columns into row y of Z,
// so that many workgroups share a long column; sum_rows then adds Z's rows.
@compute @workgroup_size(256)
fn sum_rows_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let c = wid.x * 256u + lid.x;
    if c < p.w {
        let r0 = wid.y * p.src_stride;
        let r1 = min(r0 + p.src_stride, p.rows);
        var s = 0.0;
        for (var r = r0; r < r1; r++) {
            s += X[p.o0 + r * p.w + c];
        }
        Z[p.o2 + wid.y * p.w + c] = s;
    }
}
