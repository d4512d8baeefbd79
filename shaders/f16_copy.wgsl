// The f16 copy of an f32 operand of the tensor-core kernels under its
// tensor's scale (matmul_scale.wgsl): element i is x[i]·2^-e rounded to the
// nearest f16, ties to even, as the F16 precision and its CPU reference
// round (crates/tensor/src/precision.rs). The rounding is done here on the
// bits (f16_bits_rne) rather than by a conversion to f16, whose rounding WGSL
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

// The f16 bits of x rounded to the nearest f16, ties to even: what
// f16_bits(round_f16(x)) was, in integer arithmetic on x's bits in one
// pass (a few operations on the common path, where the two took about
// forty; the copy of a 7B layer's MLP activations ran at a third of the
// H200's bandwidth). Past 65504 (from 65520 on) ±infinity; NaN the quiet
// 0x7e00 with x's sign; f16 subnormals kept, an integer number of 2^-24;
// below 2^-25 (2^-25 itself a tie) a signed zero. f32 subnormals are
// integers here too, so adapters that flush them give the same bits.
fn f16_bits_rne(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if a >= 0x38800000u {
        if a >= 0x477ff000u {
            return sign | select(0x7c00u, 0x7e00u, a > 0x7f800000u);
        }
        // Rebias the exponent (127 → 15) and round off 13 bits; a carry
        // out of the significand moves into the exponent, as it should.
        let t = a - 0x38000000u;
        return sign | ((t + 0xfffu + ((t >> 13u) & 1u)) >> 13u);
    }
    let e = a >> 23u;
    if e < 102u {
        return sign;
    }
    // x = m·2^(e-150): units of 2^-24 are m >> (126 - e), rounded (up to
    // 0x400, the least normal f16's bits).
    return sign | shift_rne((a & 0x7fffffu) | 0x800000u, 126u - e);
}

// Output words per invocation, each WORDS_STEP apart: the scale is
// derived once for four words, and each of the four loads and stores is
// consecutive across the workgroup's lanes.
const WORDS: u32 = 4u;
const WORDS_STEP: u32 = 256u;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let base = (wid.y * nwg.x + wid.x) * (WORDS * WORDS_STEP) + lid;
    let s = pow2_steps(-scale_exponent(p.slot));
    for (var k = 0u; k < WORDS; k++) {
        let w = base + k * WORDS_STEP;
        let i = 2u * w;
        if i >= p.n {
            return;
        }
        var word = f16_bits_rne(apply(x_in[p.x_off + i], s));
        if i + 1u < p.n {
            word |= f16_bits_rne(apply(x_in[p.x_off + i + 1u], s)) << 16u;
        }
        y_out[p.y_off + w] = word;
    }
}
