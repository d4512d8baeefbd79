// B operand stored as f16 (the f16 transport copy of a weight), two per u32,
// element 2j in the low half as the little-endian host bytes lie. Widening
// f16 to f32 is exact (subnormals included), so with F32 compute precision
// this is the f16-rounded weight in f32 arithmetic, and with F16 the
// operand needs no rounding of its own.
@group(0) @binding(2) var<storage, read> B: array<u32>;

fn load_b(i: u32) -> f32 {
    return unpack2x16float(B[i >> 1u])[i & 1u];
}
