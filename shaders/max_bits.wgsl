// |x| as f32 bits, which order as the magnitudes do (so a max over u32 is
// exact, whatever the order of the reduction), with NaN as 0: the max of
// an f16 operand skips NaN as the host's f32::max does, and keeps
// infinity (which makes the operand's scale exponent 0). absmax.wgsl's
// scans and the maxima that producers keep as they store
// (matmul_epilogue.wgsl, norm.wgsl, rope.wgsl) use it alike.
fn max_bits(x: f32) -> u32 {
    let a = bitcast<u32>(x) & 0x7fffffffu;
    return select(a, 0u, a > 0x7f800000u);
}
