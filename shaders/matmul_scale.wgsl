// Per-tensor power-of-two scaling of f16 matmul operands: the F16 compute
// precision of crates/tensor/src/precision.rs, bit for bit. `scales` holds
// max|X| of each operand as f32 bits (absmax.wgsl); the exponent is derived
// here from those bits exactly as `f16_scale_exponent` does, so that the
// device and the CPU scale every operand by the same power of two.

@group(0) @binding(5) var<storage, read> scales: array<u32>;

// Slot index meaning "not scaled": f16-stored weights are f16 already, and
// x·2^-e rounds back to x for them (e = 0 keeps them as they are).
const NO_SCALE: u32 = 0xffffffffu;

// `F16_OPERAND_BOUND_LOG2 - 1`: the scaled maximum lies in [2^14, 2^15).
const SCALED_MAX_LOG2: i32 = 14;

fn scale_exponent(slot: u32) -> i32 {
    if slot == NO_SCALE {
        return 0;
    }
    let a = scales[slot] & 0x7fffffffu;
    if a == 0u || a >= 0x7f800000u {
        return 0;
    }
    var e: i32;
    if a >= 0x00800000u {
        e = i32(a >> 23u) - 127;
    } else {
        e = -127 - (i32(countLeadingZeros(a)) - 9);
    }
    return e - SCALED_MAX_LOG2;
}

// 2^e for e in [-126, 127]: built from its bits, so exact on every adapter
// (exp2 need not be).
fn pow2(e: i32) -> f32 {
    return bitcast<f32>(u32(e + 127) << 23u);
}

// x·2^e is applied as x·f[0]·f[1]·f[2] with the steps of `mul_pow2` on the
// host (2^127 or 2^-126 at a time, then the rest), so that tiny and huge
// operands scale exactly and the rounding of an out-of-range product is
// the host's. Unused steps are 1.0, which changes no bit.
struct Pow2Steps {
    f0: f32,
    f1: f32,
    f2: f32,
    // f0 = f1 = 1, so x·f2 alone is x·f0·f1·f2 bit for bit: so for every
    // operand whose max lies within 2^±113 and every product scale within
    // 2^±126, and the kernels pay one multiply per element, not three.
    one: bool,
}

fn pow2_steps(e: i32) -> Pow2Steps {
    var s = Pow2Steps(1.0, 1.0, 1.0, true);
    var r = e;
    if r > 127 {
        s.f0 = pow2(127);
        r -= 127;
    } else if r < -126 {
        s.f0 = pow2(-126);
        r += 126;
    }
    if r > 127 {
        s.f1 = pow2(127);
        r -= 127;
    } else if r < -126 {
        s.f1 = pow2(-126);
        r += 126;
    }
    s.f2 = pow2(r);
    s.one = s.f0 == 1.0 && s.f1 == 1.0;
    return s;
}

// The three scalings of one product: A and B down into f16's range, the
// f32 result back up by 2^(e_A + e_B).
struct OperandScales {
    a: Pow2Steps,
    b: Pow2Steps,
    out: Pow2Steps,
}

fn operand_scales(a_slot: u32, b_slot: u32) -> OperandScales {
    let ea = scale_exponent(a_slot);
    let eb = scale_exponent(b_slot);
    return OperandScales(pow2_steps(-ea), pow2_steps(-eb), pow2_steps(ea + eb));
}

// The branch is uniform: one product's scales are the same everywhere.
fn apply(x: f32, s: Pow2Steps) -> f32 {
    if s.one {
        return x * s.f2;
    }
    return x * s.f0 * s.f1 * s.f2;
}

fn apply4(x: vec4<f32>, s: Pow2Steps) -> vec4<f32> {
    if s.one {
        return x * s.f2;
    }
    return x * s.f0 * s.f1 * s.f2;
}

// m >> d (d in 1..=31) rounded to the nearest integer, ties to even.
fn shift_rne(m: u32, d: u32) -> u32 {
    let q = m >> d;
    let r = m & ((1u << d) - 1u);
    let half = 1u << (d - 1u);
    return q + select(0u, 1u, r > half || (r == half && (q & 1u) == 1u));
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
    let q = shift_rne((a & 0x7fffffu) | 0x800000u, d);
    // q ≤ 2^11 units of the quantum 2^(e - 150 + d), exactly an f32.
    let quantum = select(-24, i32(e) - 137, e >= 113u);
    let v = f32(q) * pow2(quantum);
    return bitcast<f32>(bitcast<u32>(v) | sign);
}
