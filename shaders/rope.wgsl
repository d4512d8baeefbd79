// Rotary embedding, half-split (`rotate_half`) layout over the first 2·half
// entries of each row of d (the rest copied: a partial rotary factor, as
// Phi-4-mini's 96 of 128). One invocation per pair or copied entry: per
// row, d − half of them. cos/sin come from a
// table the host computed in f64 ([positions, D/2], kept on the device),
// because an f32 angle pos·inv_freq loses ~1e-4 rad at positions in the
// thousands. The bound range starts at or before the sequence's first
// position; tab_off is where that position's row starts in it.

struct Params {
    n: u32, t: u32, h: u32, half: u32,
    x_off: u32, y_off: u32, row0: u32, sign: f32,
    tab_off: u32, flags: u32, max_off: u32, d: u32,
    docs_off: u32,
}

// Under F16 the rotated q and k (and their gradients) are f16 operands of
// attention and the projections' backward: with STORE_MAX each workgroup
// stores the max_bits (max_bits.wgsl) of what it wrote in OMAX[max_off +
// its index], which absmax.wgsl folds when a product first reads them, so
// nothing scans them.
const STORE_MAX: u32 = 1u;
// Pairs of neighbours (2j, 2j + 1), GLM's layout, rather than (j, j + half).
const INTERLEAVED: u32 = 2u;
// Documents packed in the rows: a token's position counts from its
// document's first, which DOCS holds at docs_off + its index b·T + i
// (megatrain_tensor's Docs::bounds). The table's rows are still a row's
// positions from the call's first: a document's tokens take its first rows.
const DOCS: u32 = 4u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> COS: array<f32>;
@group(0) @binding(3) var<storage, read> SIN: array<f32>;
@group(0) @binding(4) var<storage, read_write> Y: array<f32>;
@group(0) @binding(5) var<storage, read_write> OMAX: array<u32>;
@group(0) @binding(6) var<storage, read> DOC_START: array<u32>;

var<workgroup> wmax: atomic<u32>;

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let wg = wid.y * nwg.x + wid.x;
    let i = wg * 256u + lid.x;
    var m = 0u;
    if i < p.n {
        let per = p.d - p.half;
        let row = i / per;
        let j = i % per;
        let d = p.d;
        if j < p.half {
            let tok = (p.row0 + row) / p.h;
            var pos = tok % p.t;
            if (p.flags & DOCS) != 0u {
                pos -= DOC_START[p.docs_off + tok];
            }
            let c = COS[p.tab_off + pos * p.half + j];
            let s = SIN[p.tab_off + pos * p.half + j] * p.sign;
            var a = j;
            var b = j + p.half;
            if (p.flags & INTERLEAVED) != 0u {
                a = 2u * j;
                b = 2u * j + 1u;
            }
            let x1 = X[p.x_off + row * d + a];
            let x2 = X[p.x_off + row * d + b];
            let y1 = x1 * c - x2 * s;
            let y2 = x2 * c + x1 * s;
            Y[p.y_off + row * d + a] = y1;
            Y[p.y_off + row * d + b] = y2;
            m = max(max_bits(y1), max_bits(y2));
        } else {
            // Entry half + j, past the rotated 2·half.
            let x = X[p.x_off + row * d + p.half + j];
            Y[p.y_off + row * d + p.half + j] = x;
            m = max_bits(x);
        }
    }
    // The flags are the same for the whole dispatch: uniform.
    if (p.flags & STORE_MAX) != 0u {
        atomicMax(&wmax, m);
        workgroupBarrier();
        if lid.x == 0u {
            OMAX[p.max_off + wg] = atomicLoad(&wmax);
        }
    }
}
