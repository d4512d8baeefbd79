// F16 compute precision on the SIMT kernel (adapters without cooperative
// matrices): each operand element is scaled (matmul_scale.wgsl) and rounded
// to f16 as it is loaded into workgroup memory, products accumulate in f32,
// and the result is scaled back. The rounding is done on the f32 bits
// rather than with pack2x16float, whose rounding mode (and overflow result)
// WGSL leaves to the implementation: this way every adapter rounds to
// nearest-even, as the CPU reference (`half::f16::from_f32`) does.

var<private> sc: OperandScales;

fn prepare_operands() {
    sc = operand_scales(p.a_scale, p.b_scale);
}

// x rounded to the nearest f16 (ties to even), as an f32: f16 keeps 11
// significant bits down to 2^-14 and a fixed quantum of 2^-24 below it.
fn round_f16(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let a = b & 0x7fffffffu;
    let sign = b & 0x80000000u;
    if a >= 0x7f800000u {
        return x;
    }
    // 65520 and above round past f16's largest finite value, 65504.
    if a >= 0x477ff000u {
        return bitcast<f32>(sign | 0x7f800000u);
    }
    let e = a >> 23u;
    // Below 2^-25 everything rounds to zero (2^-25 itself is a tie, to 0).
    if e < 102u {
        return bitcast<f32>(sign);
    }
    // Bits of the 24-bit significand below the f16 quantum.
    let d = select(13u + (113u - e), 13u, e >= 113u);
    let m = (a & 0x7fffffu) | 0x800000u;
    var q = m >> d;
    let r = m & ((1u << d) - 1u);
    let half = 1u << (d - 1u);
    if r > half || (r == half && (q & 1u) == 1u) {
        q += 1u;
    }
    // q ≤ 2^11 units of the quantum 2^(e - 150 + d), exactly an f32.
    let quantum = select(-24, i32(e) - 137, e >= 113u);
    let v = f32(q) * pow2(quantum);
    return bitcast<f32>(bitcast<u32>(v) | sign);
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
