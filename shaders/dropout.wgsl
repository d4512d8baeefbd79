// Dropout of a tensor, and uniform noise added to one (`uniform_noise`:
// NEFTune), one thread per element (the hash is dropout_mask.wgsl's, put
// before this file). Dropout's backward is the same kernel on the
// output's gradient; the noise's passes the gradient unchanged.

// x is viewed as batch rows of `rows` mask rows of `cols`; this dispatch
// covers its elements first .. first + n (the host splits a tensor that
// no one binding holds), and batch row r of x is row batch0 + r of the
// whole batch.
struct Params {
    n: u32, ox: u32, oy: u32, first: u32,
    key0: u32, key1: u32, threshold: u32, scale: f32,
    cols: u32, rows: u32, batch0: u32, _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

// Row r of the tensor is row r % rows of batch row r / rows.
fn mask_row(e: u32) -> u32 {
    let r = e / p.cols;
    return (p.batch0 + r / p.rows) * p.rows + r % p.rows;
}

@compute @workgroup_size(256)
fn dropout(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid.x;
    if i < p.n {
        let e = p.first + i;
        var y = 0.0;
        if dropout_keeps(p.key0, p.key1, p.threshold, mask_row(e), e % p.cols) {
            y = X[p.ox + i] * p.scale;
        }
        Y[p.oy + i] = y;
    }
}

// `scale` holds the noise's magnitude; `threshold` is unused.
@compute @workgroup_size(256)
fn uniform_noise(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid.x;
    if i < p.n {
        let e = p.first + i;
        Y[p.oy + i] = X[p.ox + i] + noise_value(p.key0, p.key1, p.scale, mask_row(e), e % p.cols);
    }
}
