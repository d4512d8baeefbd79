// B operand stored as bf16, two per u32 (element 2j in the low half, as the
// little-endian host bytes lie). A bf16 is the top half of an f32, so decoding
// is a shift; accumulation stays f32.
@group(0) @binding(2) var<storage, read> B: array<u32>;

fn load_b(i: u32) -> f32 {
    let w = B[i >> 1u];
    let bits = select(w & 0xffff0000u, w << 16u, (i & 1u) == 0u);
    return bitcast<f32>(bits);
}
