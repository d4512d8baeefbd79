// The parameter block of every matmul kernel (matmul.wgsl, its interior
// pipelines in matmul_interior.wgsl and the tensor-core family in
// matmul_coop.wgsl): one layout, written by crates/gpu/src/exec/matmul.rs.

struct Params {
    m: u32, n: u32, k: u32, flags: u32,
    a_off: u32, b_off: u32, c_off: u32, bias_off: u32,
    a_bstride: u32, b_bstride: u32, c_bstride: u32, lda: u32,
    ldb: u32, ldc: u32, a_scale: u32, b_scale: u32,
    // The grid's first tile (in tiles): edge strips around an interior run
    // on another pipeline. With STORE_MAX, where this dispatch's workgroups
    // store their maxima (matmul_epilogue.wgsl's `maxima_out`).
    tile_x0: u32, tile_y0: u32, max_base: u32, max_total: u32,
}

const TRANS_A: u32 = 1u;
const TRANS_B: u32 = 2u;
const HAS_BIAS: u32 = 4u;
const ACCUMULATE: u32 = 8u;
const TRANS_C: u32 = 16u;
// Bits 5..7: the epilogue applied at the store (matmul_epilogue.wgsl; only
// in the pipelines built with one).
const EPI_SHIFT: u32 = 5u;
const EPI_MASK: u32 = 7u;
const EPI_GELU_BWD: u32 = 1u;
const EPI_SWIGLU_BWD: u32 = 2u;
const EPI_GELU_FWD: u32 = 3u;
const EPI_SWIGLU_FWD: u32 = 4u;
const EPI_GEGLU_BWD: u32 = 5u;
const EPI_GEGLU_FWD: u32 = 6u;
// Fold max|x| of what is stored into the output maxima
// (matmul_epilogue.wgsl's `maxima` sections; f16 pipelines only).
const STORE_MAX: u32 = 256u;

@group(0) @binding(0) var<uniform> p: Params;
