// Dropout masks from a counter-based hash (megatrain-tensor's dropout.rs,
// whose `mix` and `keeps` these are, bit for bit): an element's fate is a
// function of (key, row, column), so a recomputed forward and the backward
// draw the forward's mask without storing it. Put before dropout.wgsl and
// attention_mask.wgsl, which call `dropout_keeps`.

fn dropout_mix(x: u32) -> u32 {
    var h = x;
    h = h ^ (h >> 16u);
    h = h * 0x7feb352du;
    h = h ^ (h >> 15u);
    h = h * 0x846ca68bu;
    return h ^ (h >> 16u);
}

fn dropout_hash(key0: u32, key1: u32, row: u32, col: u32) -> u32 {
    return dropout_mix(dropout_mix(dropout_mix(key0 ^ row) ^ col) ^ key1);
}

// Kept where the hash is at least `threshold` (p · 2³²).
fn dropout_keeps(key0: u32, key1: u32, threshold: u32, row: u32, col: u32) -> bool {
    return dropout_hash(key0, key1, row, col) >= threshold;
}

// Noise::value: u in [−1, 1) from the hash's top 24 bits (exact in f32:
// the conversion, the power-of-two scale and the subtraction round
// nothing), times the magnitude.
fn noise_value(key0: u32, key1: u32, magnitude: f32, row: u32, col: u32) -> f32 {
    let u = f32(dropout_hash(key0, key1, row, col) >> 8u) * (1.0 / 8388608.0) - 1.0;
    return u * magnitude;
}

