// max|x| of a tensor (or of a range of it, when it spans several storage
// bindings), folded into out[slot] with an atomic max on max_bits
// (max_bits.wgsl): exact, the same f32 the host's max would find. Also
// folds the per-workgroup maxima that producers store (max_bits already,
// which max_bits leaves as they are).

struct Params {
    n: u32, off: u32, slot: u32, _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> X16: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<atomic<u32>>;

// Elements per invocation: enough that one atomic per workgroup is cheap.
const PER_THREAD: u32 = 16u;

var<workgroup> wmax: atomic<u32>;

fn fold(lid: u32, m: u32) {
    atomicMax(&wmax, m);
    workgroupBarrier();
    if lid == 0u {
        atomicMax(&out[p.slot], atomicLoad(&wmax));
    }
}

@compute @workgroup_size(256)
fn absmax_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) lid: u32) {
    let base = (wid.y * nwg.x + wid.x) * 256u * PER_THREAD;
    var m = 0u;
    for (var r = 0u; r < PER_THREAD; r++) {
        let i = base + r * 256u + lid;
        if i < p.n {
            m = max(m, max_bits(X[p.off + i]));
        }
    }
    fold(lid, m);
}

// bf16 B operands (two per u32, element 2j in the low half).
@compute @workgroup_size(256)
fn absmax_bf16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) lid: u32) {
    let base = (wid.y * nwg.x + wid.x) * 256u * PER_THREAD;
    var m = 0u;
    for (var r = 0u; r < PER_THREAD; r++) {
        let i = base + r * 256u + lid;
        if i < p.n {
            let e = p.off + i;
            let w = X16[e >> 1u];
            m = max(m, max_bits(bitcast<f32>(select(w & 0xffff0000u, w << 16u, (e & 1u) == 0u))));
        }
    }
    fold(lid, m);
}
