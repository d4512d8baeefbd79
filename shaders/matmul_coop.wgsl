//// common
// Tensor-core matmul (cooperative matrices, f16 operands, f32 accumulation)
// with the F16 compute precision of crates/tensor/src/precision.rs:
// C[b] = unscale(f16(sa·op(A[b])) @ f16(sb·op(B[b]))) (+ bias) (+ C).
//
// A workgroup computes a BM x BN tile of C; its SG_M x SG_N subgroups (32
// lanes each, on adapters whose subgroups are exactly 32 wide) each own an
// FM x FN block of 16x16 f32 accumulators. Per K step of BK the workgroup
// stages the A and B tiles in workgroup memory as f16 — f16-stored operands
// (weights, and the f16 copies of f32 operands: f16_copy.wgsl) as they
// are, f32 ones scaled and converted on the way (F16Operands::Stage) — in
// the operand's own global orientation, so that the global reads coalesce
// and the fragments are read with coopLoad (column-major) or coopLoadT
// (row-major) to match. Rows are padded by 8 halfs (16 bytes: the
// alignment cooperative loads want) so that consecutive rows start on
// different banks. The K loop (crates/gpu/src/coop_tile.rs, KLoop) has
// the next tile's global reads in flight (in registers) while the current
// one is multiplied, with two buffers and one barrier per step
// (loop_double) or with one buffer and two (loop_prefetch: half the
// workgroup memory, so a longer K step fits); loop_single reads, stages
// and multiplies in turn.
//
// The sections of this file are put together per variant by
// crates/gpu/src/coop.rs, which also generates the constants, the
// unrolled fragment code (every index and stride handed to a cooperative
// load or store is a `let` of its own: naga's SPIR-V writer cannot emit
// one built inside the call) and the unrolled operand loaders over the
// sections' `fetch_X_at` / `stage_X_at` (each register a private variable:
// an array indexed in a loop the driver does not unroll lives in local
// memory); one set of operand sections serves A and B, X put in. Interior variants read only whole tiles with
// K a multiple of BK, through vector loads; edge variants check every index
// and read scalars. Storage variables are not named A, B or C, which the
// cooperative-matrix extension reserves.

@group(0) @binding(3) var<storage, read> bias_in: array<f32>;
@group(0) @binding(4) var<storage, read_write> c_out: array<f32>;

const THREADS: u32 = SG_M * SG_N * 32u;
// Operand tiles as they lie in global memory are A_ROWS x A_COLS and
// B_ROWS x B_COLS, columns contiguous (generated constants).
const LDA_S: u32 = A_COLS + 8u;
const LDB_S: u32 = B_COLS + 8u;
const A_TILE: u32 = A_ROWS * LDA_S;
const B_TILE: u32 = B_ROWS * LDB_S;

var<workgroup> a_s: array<half, NBUF * A_TILE>;
var<workgroup> b_s: array<half, NBUF * B_TILE>;
// One 16x16 f32 fragment per subgroup on its way out (row-major).
var<workgroup> c_s: array<f32, SG_M * SG_N * 256u>;

var<private> sc: OperandScales;
var<private> li: u32;

// The row and column within a fragment of element r (0..8) of those lane
// `lane` stores: consecutive lanes walk C's contiguous dimension.
fn fragment_rc(lane: u32, r: u32) -> vec2<u32> {
    let idx = lane + r * 32u;
    return vec2<u32>(select(idx / 16u, idx % 16u, TC), select(idx % 16u, idx / 16u, TC));
}

fn c_index(c_base: u32, gm: u32, gn: u32) -> u32 {
    return c_base + select(gm * p.ldc + gn, gn * p.ldc + gm, TC);
}

// The epilogue's operands (epilogue_operands) of the eight elements a
// lane stores of one fragment, elements 0..3 in the lo vectors and 4..7
// in the hi: loaded before the fragment goes out through c_s, so that
// their loads are in flight together and across the barrier rather than
// each after the stores of the element before it (which may alias them as
// far as the compiler knows). Without an epilogue they are zeros, loaded
// from nowhere.
struct FragOperands {
    x0lo: vec4<f32>,
    x0hi: vec4<f32>,
    x1lo: vec4<f32>,
    x1hi: vec4<f32>,
}

fn operands_at(lane: u32, r: u32, c_base: u32, fm: u32, fn0: u32) -> vec2<f32> {
    let rc = fragment_rc(lane, r);
    let gm = fm + rc.x;
    let gn = fn0 + rc.y;
    if EDGE && (gm >= p.m || gn >= p.n) {
        return vec2<f32>(0.0);
    }
    return epilogue_operands(c_index(c_base, gm, gn));
}

fn fragment_operands(lane: u32, c_base: u32, fm: u32, fn0: u32) -> FragOperands {
    let x0 = operands_at(lane, 0u, c_base, fm, fn0);
    let x1 = operands_at(lane, 1u, c_base, fm, fn0);
    let x2 = operands_at(lane, 2u, c_base, fm, fn0);
    let x3 = operands_at(lane, 3u, c_base, fm, fn0);
    let x4 = operands_at(lane, 4u, c_base, fm, fn0);
    let x5 = operands_at(lane, 5u, c_base, fm, fn0);
    let x6 = operands_at(lane, 6u, c_base, fm, fn0);
    let x7 = operands_at(lane, 7u, c_base, fm, fn0);
    return FragOperands(
        vec4<f32>(x0.x, x1.x, x2.x, x3.x),
        vec4<f32>(x4.x, x5.x, x6.x, x7.x),
        vec4<f32>(x0.y, x1.y, x2.y, x3.y),
        vec4<f32>(x4.y, x5.y, x6.y, x7.y),
    );
}

// One fragment of C (rows fm.., columns fn0..) from c_s[cs..] to global
// memory: unscaled, plus bias, plus C when accumulating, through the
// epilogue (matmul_epilogue.wgsl) with the operands `x` fragment_operands
// loaded for it.
fn store_fragment(cs: u32, lane: u32, c_base: u32, fm: u32, fn0: u32, x: FragOperands) {
    for (var r = 0u; r < 8u; r++) {
        let rc = fragment_rc(lane, r);
        let gm = fm + rc.x;
        let gn = fn0 + rc.y;
        if EDGE && (gm >= p.m || gn >= p.n) {
            continue;
        }
        var v = apply(c_s[cs + rc.x * 16u + rc.y], sc.out);
        if (p.flags & HAS_BIAS) != 0u {
            v += bias_in[p.bias_off + gn];
        }
        let ci = c_index(c_base, gm, gn);
        if (p.flags & ACCUMULATE) != 0u {
            v += c_out[ci];
        }
        let q = r % 4u;
        let ops = select(vec2<f32>(x.x0lo[q], x.x1lo[q]), vec2<f32>(x.x0hi[q], x.x1hi[q]), r >= 4u);
        c_out[ci] = epilogue_with(ci, v, ops);
    }
}

// The tile (column, row) of this dispatch's grid that workgroup `wid`
// computes: as dispatched where GROUP_M is 1, else down GROUP_M tile rows
// (fewer in the last group) before the next column, so that the
// workgroups resident at once read fewer distinct A and B tiles and find
// more of them in L2. A bijection of the grid; the maxima slots stay
// indexed by `wid`.
fn grid_tile(wid: vec3<u32>, nwg: vec3<u32>) -> vec2<u32> {
    if GROUP_M == 1u {
        return wid.xy;
    }
    let lin = wid.y * nwg.x + wid.x;
    let per_group = GROUP_M * nwg.x;
    let first = lin / per_group * GROUP_M;
    let rows = min(nwg.y - first, GROUP_M);
    let i = lin % per_group;
    return vec2(i / rows, first + i % rows);
}

//// x_vec
// Operand X of an interior variant (whole tiles, K a multiple of BK), a
// vec4 at a time. crates/gpu/src/coop.rs puts in, for X, the operand's
// names (a or b), its binding for BINDING, X_KROWS (the tile's rows run
// along K: A transposed, B not) and X_OUTER (M or N). The storage sections
// below give `load_X4` (four elements from global memory) and `tile_X4`
// (those four as f16 tile values).
fn fetch_X_at(i: u32, base: u32, o0: u32, k0: u32) -> XReg {
    let v = li + i * THREADS;
    let r = v / (X_COLS / 4u);
    let c = (v % (X_COLS / 4u)) * 4u;
    let g = select((o0 + r) * p.ldX + k0 + c, (k0 + r) * p.ldX + o0 + c, X_KROWS);
    return load_X4((base + g) / 4u);
}

fn stage_X_at(i: u32, buf: u32, x: XReg) {
    let v = li + i * THREADS;
    let r = v / (X_COLS / 4u);
    let c = (v % (X_COLS / 4u)) * 4u;
    let h = tile_X4(x);
    let s = buf * X_TILE + r * LDX_S + c;
    X_s[s] = h.x;
    X_s[s + 1u] = h.y;
    X_s[s + 2u] = h.z;
    X_s[s + 3u] = h.w;
}

//// x_edge
// Operand X of an edge variant, an element at a time, every index checked
// (`load_X1`, `tile_X1`).
fn fetch_X_at(i: u32, base: u32, o0: u32, k0: u32) -> XReg {
    let e = li + i * THREADS;
    let r = e / X_COLS;
    let c = e % X_COLS;
    let go = o0 + select(r, c, X_KROWS);
    let gk = k0 + select(c, r, X_KROWS);
    var x = XReg(0.0);
    if go < X_OUTER && gk < p.k {
        x = load_X1(base + select(go * p.ldX + gk, gk * p.ldX + go, X_KROWS));
    }
    return x;
}

fn stage_X_at(i: u32, buf: u32, x: XReg) {
    let e = li + i * THREADS;
    X_s[buf * X_TILE + (e / X_COLS) * LDX_S + e % X_COLS] = tile_X1(x);
}

//// f32_vec
// An f32 operand, scaled and converted as it is staged
// (F16Operands::Stage).
@group(0) @binding(BINDING) var<storage, read> X_in: array<vec4<f32>>;
alias XReg = vec4<f32>;

fn load_X4(i: u32) -> XReg {
    return X_in[i];
}

fn tile_X4(x: XReg) -> vec4<half> {
    return to_half4(apply4(x, sc.X));
}

//// f32_edge
@group(0) @binding(BINDING) var<storage, read> X_in: array<f32>;
alias XReg = f32;

fn load_X1(i: u32) -> XReg {
    return X_in[i];
}

fn tile_X1(x: XReg) -> half {
    return to_half(apply(x, sc.X));
}

//// f16_vec
// An f16-stored operand (a weight's f16 transport copy, or an f32
// operand's f16 copy made under its tensor's scale, f16_copy.wgsl), copied
// into the tile unchanged; `load_X4` from f16_hw or f16_sw.
alias XReg = vec4<half>;

fn tile_X4(x: XReg) -> vec4<half> {
    return x;
}

//// f16_edge
// (`load_X1` from f16_edge_hw or f16_edge_sw.)
alias XReg = half;

fn tile_X1(x: XReg) -> half {
    return x;
}

//// half_hw
// Tensor-core variants: f16 tiles, hardware conversion.
alias half = f16;

fn to_half(x: f32) -> half {
    return f16(x);
}

fn to_half4(v: vec4<f32>) -> vec4<half> {
    return vec4<f16>(v);
}

//// half_sw
// Software variants (cooperative matrices emulated in plain WGSL, for
// adapters without them or without f16 in shaders): tiles hold f16 values
// rounded in f32 (round_f16: nearest-even), products accumulate in f32.
alias half = f32;

fn to_half(x: f32) -> half {
    return round_f16(x);
}

fn to_half4(v: vec4<f32>) -> vec4<half> {
    return vec4(round_f16(v.x), round_f16(v.y), round_f16(v.z), round_f16(v.w));
}

//// f16_hw
// The f16-stored operand's loads, in hardware f16.
@group(0) @binding(BINDING) var<storage, read> X_in: array<vec4<f16>>;

fn load_X4(i: u32) -> vec4<half> {
    return X_in[i];
}

//// f16_edge_hw
@group(0) @binding(BINDING) var<storage, read> X_in: array<f16>;

fn load_X1(i: u32) -> half {
    return X_in[i];
}

//// f16_sw
// As stored on the device: two per u32, element 2j low.
@group(0) @binding(BINDING) var<storage, read> X_in: array<vec2<u32>>;

fn load_X4(i: u32) -> vec4<half> {
    let w = X_in[i];
    return vec4(unpack2x16float(w.x), unpack2x16float(w.y));
}

//// f16_edge_sw
@group(0) @binding(BINDING) var<storage, read> X_in: array<u32>;

fn load_X1(i: u32) -> half {
    return unpack2x16float(X_in[i >> 1u])[i & 1u];
}

//// emulation
// Shared with attention_coop.wgsl: each generator puts the names of its
// workgroup arrays in place of the three placeholders below (the staged
// operands, and where a fragment goes on its way out).
// A fragment is where it lies in workgroup memory (the loads and the
// multiply-adds of one K step see the same tiles); an accumulator is the 8
// elements a lane owns, element r·32 + lane of the row-major 16x16 block.
// The products are the hardware's (f16 values, f32 sums); only their order
// differs.
struct Frag {
    base: u32,
    stride: u32,
    row_major: bool,
}

// 16 (li < THREADS), in a form Mesa's loop analysis cannot count, so that
// lavapipe keeps emu_mma's loop over k rolled. Unrolled, each call's 128
// products lay in line, and LLVM's coroutine passes (one suspension per
// barrier) took over a minute a kernel: the emulated attention at D = 64,
// three kernels, compiled in 77 s, rolled in 3 (2026-12-02). The products
// and their order are the same either way.
fn emu_k() -> u32 {
    return 16u * min(li + 1u, 1u);
}

fn emu_mma(a: Frag, b: Frag, c: array<f32, 8>, lane: u32) -> array<f32, 8> {
    var out = c;
    let nk = emu_k();
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let row = e / 16u;
        let col = e % 16u;
        var s = out[r];
        for (var kk = 0u; kk < nk; kk++) {
            let ai = select(a.base + kk * a.stride + row, a.base + row * a.stride + kk, a.row_major);
            let bi = select(b.base + col * b.stride + kk, b.base + kk * b.stride + col, b.row_major);
            s += f32(EMU_A[ai]) * f32(EMU_B[bi]);
        }
        out[r] = s;
    }
    return out;
}

fn emu_load_t(base: u32, stride: u32, lane: u32) -> array<f32, 8> {
    var c: array<f32, 8>;
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        c[r] = EMU_OUT[base + (e / 16u) * stride + e % 16u];
    }
    return c;
}

fn emu_store_t(c: array<f32, 8>, base: u32, stride: u32, lane: u32) {
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        EMU_OUT[base + (e / 16u) * stride + e % 16u] = c[r];
    }
}

//// main
@compute @workgroup_size(THREADS, 1, 1)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) local_index: u32,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    li = local_index;
    sc = operand_scales(p.a_scale, p.b_scale);
    let sg = li / 32u;
    let lane = li % 32u;
    let wm0 = (sg / SG_N) * (FM * 16u);
    let wn0 = (sg % SG_N) * (FN * 16u);
    let tile = grid_tile(wid, nwg);
    let m0 = (tile.y + p.tile_y0) * BM;
    let n0 = (tile.x + p.tile_x0) * BN;
    let a_base = p.a_off + wid.z * p.a_bstride;
    let b_base = p.b_off + wid.z * p.b_bstride;
    let c_base = p.c_off + wid.z * p.c_bstride;
    let lda_s = LDA_S;
    let ldb_s = LDB_S;
    let nk = select(p.k / BK, (p.k + BK - 1u) / BK, EDGE);
//{{ACCUMULATORS}}
//{{LOOP}}
    let cs = sg * 256u;
    let ld16 = 16u;
//{{EPILOGUE}}
    fold_maxima(li, wid, nwg);
}

//// loop_double
    fetch_a(a_base, m0, 0u);
    fetch_b(b_base, n0, 0u);
    stage_a(0u);
    stage_b(0u);
    workgroupBarrier();
    for (var t = 0u; t < nk; t++) {
        let cur = t % 2u;
        let more = t + 1u < nk;
        if more {
            fetch_a(a_base, m0, (t + 1u) * BK);
            fetch_b(b_base, n0, (t + 1u) * BK);
        }
        let abuf = cur * A_TILE;
        let bbuf = cur * B_TILE;
//{{MMA}}
        if more {
            stage_a(1u - cur);
            stage_b(1u - cur);
        }
        workgroupBarrier();
    }

//// loop_prefetch
    fetch_a(a_base, m0, 0u);
    fetch_b(b_base, n0, 0u);
    for (var t = 0u; t < nk; t++) {
        stage_a(0u);
        stage_b(0u);
        workgroupBarrier();
        if t + 1u < nk {
            fetch_a(a_base, m0, (t + 1u) * BK);
            fetch_b(b_base, n0, (t + 1u) * BK);
        }
        let abuf = 0u;
        let bbuf = 0u;
//{{MMA}}
        workgroupBarrier();
    }

//// loop_single
    for (var t = 0u; t < nk; t++) {
        fetch_a(a_base, m0, t * BK);
        fetch_b(b_base, n0, t * BK);
        stage_a(0u);
        stage_b(0u);
        workgroupBarrier();
        let abuf = 0u;
        let bbuf = 0u;
//{{MMA}}
        workgroupBarrier();
    }
