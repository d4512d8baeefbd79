// The f16 copy of an f32 operand of the tensor-core kernels under its
// tensor's scale (matmul_scale.wgsl): element i is x[i]·2^-e rounded to the
// nearest f16, ties to even, as the F16 precision and its CPU reference
// round (crates/tensor/src/precision.rs). The rounding is done here in f32
// (round_f16) rather than by a conversion to f16, whose rounding WGSL
// leaves to the implementation (on Mesa 26's lavapipe, `f16(x)` here did
// not round ties to even, though its staged vectors in the tensor-core
// kernels do). The
// tensor-core kernels then read half the bytes per element and convert
// nothing in their inner loop, and an operand read by several products (or
// by every column tile of one, every query block of an attention) is
// converted once per value of its contents (crates/gpu/src/exec/f16_copy.rs).
// Stored two per u32, element 2j in the low half, as every f16 tensor on
// the device.

struct Params {
    n: u32, x_off: u32, y_off: u32, slot: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x_in: array<f32>;
@group(0) @binding(2) var<storage, read_write> y_out: array<u32>;

// The f16 bits of v, an f32 that round_f16 produced (so exactly an f16
// value, or ±infinity, or NaN): built from its bits, since pack2x16float
// leaves f16 subnormals to the implementation.
fn f16_bits(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return sign | 0x7e00u;
    }
    if a == 0x7f800000u {
        return sign | 0x7c00u;
    }
    // Below 2^-14: a subnormal f16 (or zero), an integer number of 2^-24
    // (a normal f32, so adapters that flush f32 subnormals keep it).
    if a < 0x38800000u {
        return sign | u32(bitcast<f32>(a) * 16777216.0);
    }
    return sign | (((a >> 23u) - 112u) << 10u) | ((a >> 13u) & 0x3ffu);
}

fn copied(x: f32, s: Pow2Steps) -> u32 {
    return f16_bits(round_f16(apply(x, s)));
}

// One output word (two elements) per invocation: consecutive lanes read
// consecutive pairs, and no word is shared between invocations.
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wid.y * nwg.x + wid.x) * 256u + lid;
    let i = 2u * w;
    if i >= p.n {
        return;
    }
    let s = pow2_steps(-scale_exponent(p.slot));
    var word = copied(x_in[p.x_off + i], s);
    if i + 1u < p.n {
        word |= copied(x_in[p.x_off + i + 1u], s) << 16u;
    }
    y_out[p.y_off + w] = word;
}
