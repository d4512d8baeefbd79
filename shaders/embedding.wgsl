// Embedding gather (f32, packed-bf16 or packed-f16 table) and its scatter-add backward.
// The table may be bound as a range of rows [row0, row1) when it is larger
// than one storage binding; each chunk writes only the outputs whose id
// falls inside it.

struct Params {
    n: u32, c: u32, row0: u32, row1: u32,
    t_off: u32, o_off: u32, _p0: u32, _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> IDS: array<u32>;
@group(0) @binding(2) var<storage, read> TABLE: array<f32>;
@group(0) @binding(3) var<storage, read> TABLE16: array<u32>;
@group(0) @binding(4) var<storage, read_write> OUT: array<f32>;
@group(0) @binding(5) var<storage, read> OFFS: array<u32>;
@group(0) @binding(6) var<storage, read> POS: array<u32>;
@group(0) @binding(7) var<storage, read> DOUT: array<f32>;

fn flat_id(wid: vec3<u32>, nwg: vec3<u32>, lid: vec3<u32>) -> u32 {
    return (wid.y * nwg.x + wid.x) * 256u + lid.x;
}

@compute @workgroup_size(256)
fn gather_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i >= p.n * p.c {
        return;
    }
    let id = IDS[i / p.c];
    if id >= p.row0 && id < p.row1 {
        OUT[p.o_off + i] = TABLE[p.t_off + (id - p.row0) * p.c + i % p.c];
    }
}

@compute @workgroup_size(256)
fn gather_bf16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i >= p.n * p.c {
        return;
    }
    let id = IDS[i / p.c];
    if id >= p.row0 && id < p.row1 {
        let e = p.t_off + (id - p.row0) * p.c + i % p.c;
        let w = TABLE16[e >> 1u];
        OUT[p.o_off + i] = bitcast<f32>(select(w & 0xffff0000u, w << 16u, (e & 1u) == 0u));
    }
}

@compute @workgroup_size(256)
fn gather_f16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i >= p.n * p.c {
        return;
    }
    let id = IDS[i / p.c];
    if id >= p.row0 && id < p.row1 {
        let e = p.t_off + (id - p.row0) * p.c + i % p.c;
        OUT[p.o_off + i] = unpack2x16float(TABLE16[e >> 1u])[e & 1u];
    }
}

// Thread per (unique id u, column c): sums the dout rows of every position
// holding that id (host-sorted: POS[OFFS[u]..OFFS[u+1]]) and adds once, so
// repeated ids never race.
@compute @workgroup_size(256)
fn scatter_add(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_id) lid: vec3<u32>) {
    let i = flat_id(wid, nwg, lid);
    if i >= p.n * p.c {
        return;
    }
    let u = i / p.c;
    let c = i % p.c;
    let id = IDS[u];
    if id < p.row0 || id >= p.row1 {
        return;
    }
    var s = 0.0;
    for (var k = OFFS[u]; k < OFFS[u + 1u]; k++) {
        s += DOUT[p.o_off + POS[k] * p.c + c];
    }
    let dst = p.t_off + (id - p.row0) * p.c + c;
    OUT[dst] = OUT[dst] + s;
}
