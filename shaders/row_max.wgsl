// With STORE_MAX in the flags, a row's max|x| (m: each of the row's 256
// invocations' max_bits of what it stored) folded through the including
// kernel's `red` (the bits unchanged in f32 slots: never NaN) into
// OMAX[max_off + row], one word per row, which absmax.wgsl folds when an
// f16 product first reads the output. The including kernel declares `p`
// (with `flags` and `max_off`), STORE_MAX, `red` (256 f32) and OMAX; every
// invocation of the row's workgroup calls it (uniform: the flags are the
// dispatch's). Used by norm.wgsl and cross_entropy.wgsl.
fn store_row_max(t: u32, row: u32, m: u32) {
    if (p.flags & STORE_MAX) == 0u {
        return;
    }
    red[t] = bitcast<f32>(m);
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if t < s {
            red[t] = bitcast<f32>(max(bitcast<u32>(red[t]), bitcast<u32>(red[t + s])));
        }
        workgroupBarrier();
    }
    if t == 0u {
        OMAX[p.max_off + row] = bitcast<u32>(red[0]);
    }
}
