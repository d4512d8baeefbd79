// Attention operands under the F16 compute precision (precision.rs): each
// element scaled by its tensor's power of two (matmul_scale.wgsl, from the
// max|x| in `scales[slot]`), rounded to f16 (nearest-even, on the bits as
// the CPU reference does) and scaled back. The attention kernels then read
// values that are exact in f16 after the scale: the SIMT kernels use them
// as they are, the tensor-core kernels convert them to f16 without loss.

struct Params {
    n: u32, x_off: u32, y_off: u32, slot: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> y_out: array<f32>;

@compute @workgroup_size(256)
fn round_operand(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                 @builtin(local_invocation_index) lid: u32) {
    let i = (wid.y * nwg.x + wid.x) * 256u + lid;
    if i < p.n {
        let e = scale_exponent(p.slot);
        y_out[p.y_off + i] = apply(round_f16(apply(x_in[p.x_off + i], pow2_steps(-e))), pow2_steps(e));
    }
}
