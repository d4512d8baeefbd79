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

// Kept where the hash is at least `threshold` (p · 2³²).
fn dropout_keeps(key0: u32, key1: u32, threshold: u32, row: u32, col: u32) -> bool {
    return dropout_mix(dropout_mix(dropout_mix(key0 ^ row) ^ col) ^ key1) >= threshold;
}

