// Rotary embedding, half-split (`rotate_half`) layout. cos/sin come from a
// table the host computed in f64 ([positions, D/2], kept on the device),
// because an f32 angle pos·inv_freq loses ~1e-4 rad at positions in the
// thousands. The bound range starts at or before the sequence's first
// position; tab_off is where that position's row starts in it.

struct Params {
    n: u32, t: u32, h: u32, half: u32,
    x_off: u32, y_off: u32, row0: u32, sign: f32,
    tab_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> COS: array<f32>;
@group(0) @binding(3) var<storage, read> SIN: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid.x;
    if i >= p.n {
        return;
    }
    let row = i / p.half;
    let j = i % p.half;
    let pos = ((p.row0 + row) / p.h) % p.t;
    let c = COS[p.tab_off + pos * p.half + j];
    let s = SIN[p.tab_off + pos * p.half + j] * p.sign;
    let d = 2u * p.half;
    let x1 = X[p.x_off + row * d + j];
    let x2 = X[p.x_off + row * d + j + p.half];
    Y[p.y_off + row * d + j] = x1 * c - x2 * s;
    Y[p.y_off + row * d + j + p.half] = x2 * c + x1 * s;
}
