// B operand stored as f32.
@group(0) @binding(2) var<storage, read> B: array<f32>;

fn load_b(i: u32) -> f32 {
    return B[i];
}
