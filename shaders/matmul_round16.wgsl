// F16 compute precision on the SIMT kernel (adapters without cooperative
// matrices): each operand element is scaled (matmul_scale.wgsl) and rounded
// to f16 as it is loaded into workgroup memory, products accumulate in f32,
// and the result is scaled back. The rounding is done on the f32 bits
// rather than with pack2x16float, whose rounding mode (and overflow result)
// WGSL leaves to the implementation: this way every adapter rounds to
// nearest-even, as the CPU reference (`half::f16::from_f32`) does
// (`round_f16` in matmul_scale.wgsl).

var<private> sc: OperandScales;

fn prepare_operands() {
    sc = operand_scales(p.a_scale, p.b_scale);
}

fn op_a(x: f32) -> f32 {
    return round_f16(apply(x, sc.a));
}

fn op_b(x: f32) -> f32 {
    return round_f16(apply(x, sc.b));
}

fn unscale(x: f32) -> f32 {
    return apply(x, sc.out);
}
