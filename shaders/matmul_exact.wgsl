// F32 compute precision: operands are used as stored, with no scaling.

fn prepare_operands() {}

fn op_a(x: f32) -> f32 {
    return x;
}

fn op_b(x: f32) -> f32 {
    return x;
}

fn unscale(x: f32) -> f32 {
    return x;
}
