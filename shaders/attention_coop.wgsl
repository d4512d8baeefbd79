//// common
// Flash attention on tensor cores (cooperative matrices, f16 operands, f32
// accumulation) under the F16 compute precision (precision.rs): causal
// (in a sliding window where p.window > 0, within packed documents where
// p.docs != 0: attention_mask.wgsl), grouped-query, layouts as attention.wgsl (q/out/dout [B, T, Hq, D], k/v
// [B, T, Hkv, D], lse and delta [B, Hq, T]). Q, K, V and dO arrive as f16
// copies under their tensors' powers of two 2^-e (f16_copy.wgsl: rounded
// as the F16 precision rounds), staged as they are; or (F16Operands::Stage)
// as f32, which staging scales by 2^-e and converts to f16 (Q, K and V as
// they are; dO rounded by round_operand in attention_f16.wgsl, because the
// delta kernel reads it unstaged, and staging it again is exact). Each
// product is scaled back by the sum of its operands' exponents in f32.
//
// Three kernels, each put together per head dimension by
// crates/gpu/src/coop_attention.rs, which generates the constants and the
// unrolled fragment code (every index and stride handed to a cooperative
// load or store is a `let`: naga's SPIR-V writer needs it):
// - fwd: a block of BR query rows (all query heads of a kv group, position
//   by position, so the group shares every K/V tile) stays in workgroup
//   memory; K/V tiles of BC keys stream through it, S = QKᵀ per subgroup
//   goes through workgroup memory for the online softmax (f32), P is
//   rounded to f16 and O += PV accumulates in cooperative accumulators
//   (Q's fragments are loaded once, P's once per tile), rescaled through
//   workgroup memory only when a row's max rises by more than RAISE; tiles
//   past the block's last position, or before its first position's window
//   (or document), are never loaded.
// - dq: the same blocks with dO; per K/V tile S and dP = dO·Vᵀ, P from the
//   saved lse, dS = P∘(dP − delta) rounded to f16 under the power of two
//   that bounds it, dQ += dS·K in cooperative accumulators.
// - dkv: a block of BR keys of one kv head stays resident; for every query
//   head of the group, query tiles from the block's first key to the
//   window's (or document's) end of its last stream through: Sᵀ = KQᵀ, dPᵀ = VdOᵀ, dV += Pᵀ·dO and dK += dSᵀ·Q accumulate in
//   cooperative accumulators, complete sums with no atomics.
// Where a tile shares regions (AttnTile::share) the resident block (Q; Q
// and dO; K and V) is staged only to load its fragments into registers,
// in the region the streamed tiles then take, and in slices of its columns
// (AttnTile::split, rows LDQ apart) where it would not fit whole.
// Every loop bound is uniform across the workgroup (barriers inside).
// Between a tile's products and the lanes' work on their results (S and dP
// through s_s, the softmax's halves of a row, P and dS back into f16
// tiles) only a subgroup's own rows are touched: `row_sync()` (generated)
// is a workgroup barrier, or under LOCAL (tile suffix `l`, on adapters
// whose subgroups are the 32 lanes of these kernels' subgroups) a
// subgroup barrier, so that subgroups wait for each other only where the
// streamed tiles are staged; the forward's rescale is then the subgroup's
// own choice (`raised`, by vote).
// Storage variables are not named A, B or C.

struct Params {
    t: u32, hq: u32, hkv: u32, group: u32,
    scale: f32, q_off: u32, k_off: u32, v_off: u32,
    o_off: u32, lse_off: u32, do_off: u32, dq_off: u32,
    dk_off: u32, dv_off: u32, dd_off: u32, q_slot: u32,
    k_slot: u32, v_slot: u32, do_slot: u32, max_off: u32,
    // attention_mask.wgsl's.
    window: u32, docs: u32, docs_off: u32, docs_ends: u32,
    drop_threshold: u32, drop_key0: u32, drop_key1: u32, drop_scale: f32,
    drop_batch0: u32, _pad0: u32, _pad1: u32, _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The operands are read four elements at a time, along D (a multiple of
// 16): the host runs these kernels only where each operand's element offset
// is a multiple of 4 and its binding starts on 16 bytes, so every index
// into these arrays is an element index divided by 4. Q, K and V are read
// through the `in_…` sections of the variant (read_q, read_k, read_v,
// put_in4): f32, scaled and converted as they are staged, or their f16
// copies (f16_copy.wgsl), staged as they are.

const THREADS: u32 = SG * 32u;
// Rows of the resident block: 16 per subgroup.
const BR: u32 = SG * 16u;
// Padded rows (8 halfs: the 16-byte alignment cooperative loads want, and
// consecutive rows on different banks).
const LDS: u32 = D + 8u;
const LDP: u32 = BC + 8u;
// One f32 region of 16 x BC per subgroup (S; dP in the backward).
const SCR: u32 = SG * 16u * BC;

// All of a kernel's workgroup memory is one variable, in this order: the
// f16 tiles at offset 0, every region of them (and the f32 scratch after
// them) a multiple of 16 bytes long. Cooperative loads and stores need
// their pointers 16-byte aligned (VUID-RuntimeSpirv-OpCooperativeMatrixLoadKHR-08986),
// and how a driver places separate variables is its own: with the small
// atomics as variables of their own, NVIDIA's (580.159.04, H200) read the
// tiles as if shifted, the forward's output off by a relative 1.4, while
// lavapipe, which needs no alignment, was right. The two atomics are in
// every pass's struct (the dq pass uses neither).
struct Shared {
    sm: array<half, SM>,
    s_s: array<f32, NSCR * SCR>,
    stat_s: array<f32, STAT>,
    // Set by any row whose max was raised past an earlier one in the
    // forward's tile (`fwd`).
    rescale: atomic<u32>,
    // The largest max_bits a workgroup wrote (`out_max`).
    wg_max: atomic<u32>,
}

var<workgroup> wg: Shared;

var<private> li: u32;
var<private> e_q: i32;
var<private> e_k: i32;
var<private> e_v: i32;
var<private> e_do: i32;

fn q_at(b: u32, t: u32, h: u32, c: u32) -> u32 {
    return ((b * p.t + t) * p.hq + h) * D + c;
}

fn kv_at(b: u32, t: u32, g: u32, c: u32) -> u32 {
    return ((b * p.t + t) * p.hkv + g) * D + c;
}

fn row_at(b: u32, h: u32, t: u32) -> u32 {
    return (b * p.hq + h) * p.t + t;
}

// Row r of a query block of kv head g starting at position p0: position
// p0 + r / group (clamped into T for loads), head g·group + r % group.
struct QRow {
    pos: u32,
    head: u32,
    valid: bool,
}

fn q_row(p0: u32, np: u32, g: u32, r: u32) -> QRow {
    let pi = r / p.group;
    let pos = p0 + pi;
    return QRow(min(pos, p.t - 1u), g * p.group + r % p.group, pi < np && pos < p.t);
}

// Each operand's scaling into f16's range, and the products' back out of
// it, found once per invocation (`init_steps`) rather than per element of
// every staged tile.
var<private> down_q: Pow2Steps;
var<private> down_k: Pow2Steps;
var<private> down_v: Pow2Steps;
var<private> down_do: Pow2Steps;
var<private> down_ds: Pow2Steps;
var<private> up_s: Pow2Steps;
var<private> up_dp: Pow2Steps;

fn init_steps() {
    down_q = pow2_steps(-e_q);
    down_k = pow2_steps(-e_k);
    down_v = pow2_steps(-e_v);
    down_do = pow2_steps(-e_do);
    down_ds = pow2_steps(-ds_exponent());
    up_s = pow2_steps(e_q + e_k);
    up_dp = pow2_steps(e_do + e_v);
}

fn scaled(x: f32, s: Pow2Steps) -> half {
    return to_half(apply(x, s));
}

fn put_half4(at: u32, h: vec4<half>) {
    wg.sm[at] = h.x;
    wg.sm[at + 1u] = h.y;
    wg.sm[at + 2u] = h.z;
    wg.sm[at + 3u] = h.w;
}

// Four elements scaled into f16's range and converted, to wg.sm[at..at + 4].
fn put4(at: u32, x: vec4<f32>, s: Pow2Steps) {
    put_half4(at, to_half4(apply4(x, s)));
}

// Columns c0..c0 + cw of K's and V's rows j0.. (n of them) of kv head g
// into the tiles at kb and vb, rows ld apart: all of D, or a slice of dkv's
// resident block (AttnTile::split).
fn stage_kv(kb: u32, vb: u32, b: u32, j0: u32, g: u32, n: u32, c0: u32, cw: u32, ld: u32) {
    for (var e = li; e < n * cw / 4u; e += THREADS) {
        let r = e / (cw / 4u);
        let c = e % (cw / 4u) * 4u;
        let j = j0 + r;
        var k4 = In4(0.0);
        var v4 = In4(0.0);
        if j < p.t {
            let i = kv_at(b, j, g, c0 + c);
            k4 = read_k((p.k_off + i) / 4u);
            v4 = read_v((p.v_off + i) / 4u);
        }
        put_in4(kb + r * ld + c, k4, down_k);
        put_in4(vb + r * ld + c, v4, down_v);
    }
}

// log2 of the power of two that bounds |dS| in the backward: |dP| ≤
// D·max|dO|·max|V| < D·2^(e_do+15)·2^(e_v+15), |delta| the same, so dS·2^-e
// stays under 2^15 (f16's largest finite value is 65504).
fn ds_exponent() -> i32 {
    return e_do + e_v + 16 + DLOG2;
}

// The column a lane takes at step k of its half of a 16 x BC tile in s_s
// (two lanes a row, half its columns each), rotated by the row: the rows
// are BC floats apart, so lanes all at column k would read one bank (each
// read serialised 16 ways); rotated, the 32 lanes read 32 banks.
fn half_col(lane: u32, k: u32) -> u32 {
    return lane / 16u * (BC / 2u) + (k + lane) % (BC / 2u);
}

//// in_f32
alias In4 = vec4<f32>;

fn put_in4(at: u32, x: In4, s: Pow2Steps) {
    put4(at, x, s);
}

//// in_f16_hw
// f16 copies made under each operand's scale: staged as they are (the
// product's scale back by 2^(e_q + e_k) is unchanged).
alias In4 = vec4<f16>;

fn put_in4(at: u32, x: In4, s: Pow2Steps) {
    put_half4(at, x);
}

//// in_vec
// Q, K and V as vectors of In4 (after in_f32 or in_f16_hw).
@group(0) @binding(1) var<storage, read> q_in: array<In4>;
@group(0) @binding(2) var<storage, read> k_in: array<In4>;
@group(0) @binding(3) var<storage, read> v_in: array<In4>;

fn read_q(i: u32) -> In4 {
    return q_in[i];
}

fn read_k(i: u32) -> In4 {
    return k_in[i];
}

fn read_v(i: u32) -> In4 {
    return v_in[i];
}

//// in_f16_sw
// The same copies as stored (two per u32, element 2j low), held in f32 as
// the emulated variants hold every f16 value.
alias In4 = vec4<f32>;
@group(0) @binding(1) var<storage, read> q_in: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read> k_in: array<vec2<u32>>;
@group(0) @binding(3) var<storage, read> v_in: array<vec2<u32>>;

fn unpack4(w: vec2<u32>) -> In4 {
    return vec4(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn read_q(i: u32) -> In4 {
    return unpack4(q_in[i]);
}

fn read_k(i: u32) -> In4 {
    return unpack4(k_in[i]);
}

fn read_v(i: u32) -> In4 {
    return unpack4(v_in[i]);
}

fn put_in4(at: u32, x: In4, s: Pow2Steps) {
    put_half4(at, x);
}

//// do_vec
@group(0) @binding(7) var<storage, read> do_in: array<In4>;

fn read_do(i: u32) -> In4 {
    return do_in[i];
}

//// do_f16_sw
@group(0) @binding(7) var<storage, read> do_in: array<vec2<u32>>;

fn read_do(i: u32) -> In4 {
    return unpack4(do_in[i]);
}

//// fwd
@group(0) @binding(4) var<storage, read_write> o_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> lse_io: array<f32>;

// O stays in cooperative accumulators for the whole key loop (generated
// code: o0, o1, ...), which cannot be scaled row by row. So a row's running
// max is raised only when a tile's scores pass it by more than RAISE (e^RAISE
// = 256: P ≤ 256 is still exact to f16's relative precision, and the sums
// are f32), and only then do the accumulators go through s_s to be
// rescaled; the max a row ends on is any bound of its scores within RAISE,
// which changes the sums' rounding, not their value. Until a row's first
// scores it holds -3e38, and its first raise needs no rescaling (O and the
// sum are still 0).
const RAISE: f32 = 5.545177;
const NO_MAX: f32 = -3.0e38;

// Lanes r and r + 16 share row r of the subgroup's 16, half its columns
// each: the row's running max (the same in both) and this lane's half of
// its running sum.
var<private> m_run: f32;
var<private> l_run: f32;

// Columns c0..c0 + cw of the block's Q (all of them, or a slice:
// AttnTile::split), at row stride LDQ.
fn stage_q(b: u32, p0: u32, np: u32, g: u32, c0: u32, cw: u32) {
    for (var e = li; e < BR * cw / 4u; e += THREADS) {
        let r = e / (cw / 4u);
        let c = e % (cw / 4u) * 4u;
        let row = q_row(p0, np, g, r);
        var x = In4(0.0);
        if row.valid {
            x = read_q((p.q_off + q_at(b, row.pos, row.head, c0 + c)) / 4u);
        }
        put_in4(Q_S + r * LDQ + c, x, down_q);
    }
}

// Whether this lane's row had its max raised past an earlier one in the
// last tile (both lanes of a row agree): the subgroup's vote decides its
// rescale where rows synchronise within subgroups (LOCAL).
var<private> raised: bool;

// Online softmax of one tile of S (f32, from s_s): P (f16) into P_S and the
// rows' rescaling factors into wg.stat_s[BR..], `rescale` set (`raised`,
// under LOCAL) where one is not 1 for a row that had a max. Each lane takes
// half a row (half_col: the 32 lanes on 32 different banks, where one lane
// a row at the same column put them all on one); the halves' maxima meet
// through stat_s, whose factors from the last tile were read before the
// row_sync ahead of this tile's products. Called by every lane (it holds a
// barrier).
//
// One pass over the scores: P against the running max, which a row keeps
// unless a score passes it by more than RAISE, and the halves' maxima on
// the way; only a row whose max rises (its first scores, or rarely after)
// takes P again against the new max (p_half_row). The probabilities, the
// sums and their order are the two-pass way's (softmax_tile_two_pass: the
// maxima first), bit for bit where the compiler contracts both alike.
// Rows synchronised across the workgroup (not LOCAL) flag a max that
// will rise before their halves meet (either half's scores decide it):
// `rescale` bit 0 where a row takes P again, bit 1 where O is rescaled as
// well (a max raised past an earlier one, not a row's first scores), so
// that after that barrier the workgroup knows both; where no row takes P
// again, every P was written before it and the products may read them at
// once (the two-pass way reads the flag after another two barriers).
fn softmax_tile(sg: u32, lane: u32, b: u32, j0: u32, p0: u32, np: u32, g: u32) {
    let r = sg * 16u + lane % 16u;
    let row = q_row(p0, np, g, r);
    let base = sg * 16u * BC + (lane % 16u) * BC;
    let hi = lane >= 16u;
    var pm = m_run;
    // l_run · exp(0), exactly.
    var l = l_run;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        var pr = 0.0;
        if sees(b, row.pos, j0 + c) {
            let x = apply(wg.s_s[base + c], up_s) * p.scale;
            pm = max(pm, x);
            pr = exp(x - m_run);
        }
        l += pr;
        wg.sm[P_S + r * LDP + c] = to_half(pr * drop_factor(b, row.head, row.pos, j0 + c));
    }
    if !LOCAL && pm > m_run + RAISE {
        atomicOr(&wg.rescale, select(1u, 3u, m_run != NO_MAX));
    }
    let m = row_max(r, hi, pm);
    let corr = exp(m_run - m);
    if m != m_run {
        l = p_half_row(lane, b, j0, row, r, base, m, l_run * corr);
    }
    end_tile(r, hi, m, corr, l, false);
}

// The two-pass way (AttnTile::two_pass): the row's max first, then P.
fn softmax_tile_two_pass(sg: u32, lane: u32, b: u32, j0: u32, p0: u32, np: u32, g: u32) {
    let r = sg * 16u + lane % 16u;
    let row = q_row(p0, np, g, r);
    let base = sg * 16u * BC + (lane % 16u) * BC;
    let hi = lane >= 16u;
    var pm = m_run;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        if sees(b, row.pos, j0 + c) {
            pm = max(pm, apply(wg.s_s[base + c], up_s) * p.scale);
        }
    }
    let m = row_max(r, hi, pm);
    let corr = exp(m_run - m);
    end_tile(r, hi, m, corr, p_half_row(lane, b, j0, row, r, base, m, l_run * corr), true);
}

// The row's max for this tile from this lane's half's `pm` (both lanes of
// a row get the same): the running max, raised to the tile's only where
// it passes it by more than RAISE. Each lane reads only its partner's
// slot, so the low lane may put the factor in the high lane's slot at
// once (end_tile).
fn row_max(r: u32, hi: bool, pm: f32) -> f32 {
    wg.stat_s[select(r, BR + r, hi)] = pm;
    row_sync();
    let mx = max(pm, wg.stat_s[select(BR + r, r, hi)]);
    var m = m_run;
    if mx > m_run + RAISE {
        m = mx;
    }
    return m;
}

// This lane's half of row r's P against max m (f16, into P_S), and its
// sum from l0 on.
fn p_half_row(lane: u32, b: u32, j0: u32, row: QRow, r: u32, base: u32, m: f32, l0: f32) -> f32 {
    var l = l0;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        var pr = 0.0;
        if sees(b, row.pos, j0 + c) {
            pr = exp(apply(wg.s_s[base + c], up_s) * p.scale - m);
        }
        l += pr;
        // The sums are of every probability; the values are weighted by the
        // kept ones (dropout).
        wg.sm[P_S + r * LDP + c] = to_half(pr * drop_factor(b, row.head, row.pos, j0 + c));
    }
    return l;
}

// The tile's row statistics: the factor for the rows' rescale, the vote
// for it (and, with `flag`, `rescale` set for a raised max), the running
// max and this lane's half of the running sum.
fn end_tile(r: u32, hi: bool, m: f32, corr: f32, l: f32, flag: bool) {
    raised = m != m_run && m_run != NO_MAX;
    if !hi {
        wg.stat_s[BR + r] = corr;
        if raised && flag && !LOCAL {
            atomicStore(&wg.rescale, 1u);
        }
    }
    m_run = m;
    l_run = l;
}

// Block u of the subgroup's s_s region (an accumulator on its way through)
// scaled row by row by the tile's factors.
fn rescale_rows(sg: u32, lane: u32, u: u32) {
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let i = sg * 16u * BC + u * 256u + e;
        wg.s_s[i] = wg.s_s[i] * wg.stat_s[BR + sg * 16u + e / 16u];
    }
}

// The rows' sums (the two halves') into wg.stat_s[..BR], and lse out. The
// tile loop ended after the products, which read no statistics; write_o
// reads the sums after the barrier that follows O's way into s_s.
fn finish_sums(sg: u32, lane: u32, b: u32, p0: u32, np: u32, g: u32) {
    let r = sg * 16u + lane % 16u;
    wg.stat_s[select(r, BR + r, lane >= 16u)] = l_run;
    workgroupBarrier();
    if lane < 16u {
        let row = q_row(p0, np, g, r);
        let l = wg.stat_s[r] + wg.stat_s[BR + r];
        if row.valid {
            lse_io[p.lse_off + row_at(b, row.head, row.pos)] = m_run + log(l);
        }
        wg.stat_s[r] = l;
    }
}

// Fragment df of O, block u of the subgroup's s_s region, out divided by
// its rows' sums.
fn write_o(sg: u32, lane: u32, df: u32, u: u32, b: u32, p0: u32, np: u32, g: u32) {
    let f = pow2_steps(e_v);
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let rr = sg * 16u + e / 16u;
        let row = q_row(p0, np, g, rr);
        if row.valid {
            let oi = p.o_off + q_at(b, row.pos, row.head, df * 16u + e % 16u);
            let o = apply(wg.s_s[sg * 16u * BC + u * 256u + e], f) / wg.stat_s[rr];
            o_out[oi] = o;
            note_max(o);
        }
    }
}

//// out_max
// Under F16 the forward's O and the dkv pass's dV are operands of the
// projections' f16 products: unless max_off is NO_MAX_SLOT each workgroup
// stores the max_bits (max_bits.wgsl) of what it wrote at out_max[max_off
// + its index], which absmax.wgsl folds when a product first reads them,
// so nothing scans them. Folded through a workgroup atomic (workgroup
// scope: the memory model naga declares allows it, as it does `rescale`).
@group(0) @binding(12) var<storage, read_write> out_max: array<u32>;

const NO_MAX_SLOT: u32 = 0xffffffffu;

var<private> my_max: u32;

fn init_max() {
    if li == 0u {
        atomicStore(&wg.wg_max, 0u);
    }
}

fn note_max(x: f32) {
    my_max = max(my_max, max_bits(x));
}

// Called by every invocation after its last store (uniform: max_off is the
// dispatch's).
fn store_max(wid: vec3<u32>, nwg: vec3<u32>) {
    if p.max_off == NO_MAX_SLOT {
        return;
    }
    atomicMax(&wg.wg_max, my_max);
    workgroupBarrier();
    if li == 0u {
        out_max[p.max_off + (wid.z * nwg.y + wid.y) * nwg.x + wid.x] = atomicLoad(&wg.wg_max);
    }
}

//// bwd
// dO is read through the variant's `do_…` section (read_do), as Q, K and V
// through its `in_…` one: the rounded f32 copy (which the delta kernel
// reads too), scaled and converted as it is staged, or its f16 copy.
@group(0) @binding(6) var<storage, read> lse_in: array<f32>;
@group(0) @binding(11) var<storage, read> dd_in: array<f32>;

// P and dS of one tile, f16: P at P_S and dS·2^-ds_exponent() at DS_S, row
// `rr` of the tile's 16 x BC block of this subgroup, column c. S and dP
// are in s_s (regions 0 and 1); `ok` is the causal (and edge) mask, `fd`
// the dropout's factor (drop_factor), which P (for dV) and dP take and
// delta already has.
fn p_ds(sg: u32, rr: u32, c: u32, ok: bool, lse: f32, delta: f32, fd: f32) {
    let si = sg * 16u * BC + rr * BC + c;
    var pr = 0.0;
    var ds = 0.0;
    if ok {
        pr = exp(apply(wg.s_s[si], up_s) * p.scale - lse);
        ds = pr * (apply(wg.s_s[SCR + si], up_dp) * fd - delta);
        pr = pr * fd;
    }
    let pi = (sg * 16u + rr) * LDP + c;
    wg.sm[P_S + pi] = to_half(pr);
    wg.sm[DS_S + pi] = scaled(ds, down_ds);
}

//// dq
@group(0) @binding(8) var<storage, read_write> dq_out: array<f32>;

// Columns c0..c0 + cw of the block's Q and dO (stage_q's slices), and
// with the first slice the rows' lse and delta.
fn stage_q_do(b: u32, p0: u32, np: u32, g: u32, c0: u32, cw: u32) {
    for (var e = li; e < BR * cw / 4u; e += THREADS) {
        let r = e / (cw / 4u);
        let c = e % (cw / 4u) * 4u;
        let row = q_row(p0, np, g, r);
        var q4 = In4(0.0);
        var do4 = In4(0.0);
        if row.valid {
            let i = q_at(b, row.pos, row.head, c0 + c);
            q4 = read_q((p.q_off + i) / 4u);
            do4 = read_do((p.do_off + i) / 4u);
        }
        put_in4(Q_S + r * LDQ + c, q4, down_q);
        put_in4(DO_S + r * LDQ + c, do4, down_do);
    }
    if c0 == 0u && li < BR {
        let row = q_row(p0, np, g, li);
        var ld = vec2<f32>(0.0);
        if row.valid {
            let i = row_at(b, row.head, row.pos);
            ld = vec2<f32>(lse_in[p.lse_off + i], dd_in[p.dd_off + i]);
        }
        wg.stat_s[li] = ld.x;
        wg.stat_s[BR + li] = ld.y;
    }
}

fn ds_tile_dq(sg: u32, lane: u32, b: u32, j0: u32, p0: u32, np: u32, g: u32) {
    let rr = lane % 16u;
    let r = sg * 16u + rr;
    let row = q_row(p0, np, g, r);
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        let fd = drop_factor(b, row.head, row.pos, j0 + c);
        p_ds(sg, rr, c, sees(b, row.pos, j0 + c), wg.stat_s[r], wg.stat_s[BR + r], fd);
    }
}

fn store_dq(sg: u32, lane: u32, df: u32, b: u32, p0: u32, np: u32, g: u32) {
    let f = pow2_steps(ds_exponent() + e_k);
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let row = q_row(p0, np, g, sg * 16u + e / 16u);
        if row.valid {
            let i = p.dq_off + q_at(b, row.pos, row.head, df * 16u + e % 16u);
            dq_out[i] = apply(wg.s_s[sg * 16u * BC + e], f) * p.scale;
        }
    }
}

//// dkv
@group(0) @binding(9) var<storage, read_write> dk_out: array<f32>;
@group(0) @binding(10) var<storage, read_write> dv_out: array<f32>;

// Query rows i0.. (BC of them) of head h, with their lse and delta.
fn stage_q_tile(b: u32, i0: u32, h: u32) {
    for (var e = li; e < BC * D / 4u; e += THREADS) {
        let r = e / (D / 4u);
        let c = e % (D / 4u) * 4u;
        let i = i0 + r;
        var q4 = In4(0.0);
        var do4 = In4(0.0);
        if i < p.t {
            let qi = q_at(b, i, h, c);
            q4 = read_q((p.q_off + qi) / 4u);
            do4 = read_do((p.do_off + qi) / 4u);
        }
        put_in4(Q_S + r * LDS + c, q4, down_q);
        put_in4(DO_S + r * LDS + c, do4, down_do);
    }
    if li < BC {
        let i = i0 + li;
        var ld = vec2<f32>(0.0);
        if i < p.t {
            let ri = row_at(b, h, i);
            ld = vec2<f32>(lse_in[p.lse_off + ri], dd_in[p.dd_off + ri]);
        }
        wg.stat_s[li] = ld.x;
        wg.stat_s[BC + li] = ld.y;
    }
}

// Pᵀ and dSᵀ: row = key j0 + sg·16 + lane % 16, column = query i0 + c of
// head h (two lanes a row, as in ds_tile_dq); the queries' lse and delta
// at stat_s[st..] (the streamed tile's copy: AttnTile::double).
fn ds_tile_dkv(sg: u32, lane: u32, b: u32, j0: u32, i0: u32, h: u32, st: u32) {
    let rr = lane % 16u;
    let j = j0 + sg * 16u + rr;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        let i = i0 + c;
        p_ds(sg, rr, c, sees(b, i, j) && i < p.t, wg.stat_s[st + c], wg.stat_s[st + BC + c], drop_factor(b, h, i, j));
    }
}

fn store_dkv(sg: u32, lane: u32, df: u32, b: u32, j0: u32, g: u32, is_k: bool) {
    var f = pow2_steps(e_do);
    var sc = 1.0;
    if is_k {
        f = pow2_steps(ds_exponent() + e_q);
        sc = p.scale;
    }
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let j = j0 + sg * 16u + e / 16u;
        if j < p.t {
            let i = kv_at(b, j, g, df * 16u + e % 16u);
            let x = apply(wg.s_s[sg * 16u * BC + e], f) * sc;
            if is_k {
                dk_out[p.dk_off + i] = x;
            } else {
                dv_out[p.dv_off + i] = x;
                note_max(x);
            }
        }
    }
}

//// dq_atomic
// dk/dv's dQ (AttnTile::fused_dq, FlashAttention-2's backward): per query
// tile, dQ of its rows += dSᵀ·K over the workgroup's keys, one 16 x 16 block
// at a time through the subgroup's s_s (at `at`), added to dq_acc with f32
// atomics (the host zeroes it first). A subgroup with fewer blocks than
// another repeats its last one (its products stay uniform) and adds
// nothing for it (`valid`).
@group(0) @binding(8) var<storage, read_write> dq_acc: array<atomic<f32>>;

fn add_dq(lane: u32, at: u32, valid: bool, qf: u32, df: u32, b: u32, i0: u32, h: u32) {
    if !valid {
        return;
    }
    let f = pow2_steps(ds_exponent() + e_k);
    for (var r = 0u; r < 8u; r++) {
        let e = r * 32u + lane;
        let i = i0 + qf * 16u + e / 16u;
        if i < p.t {
            let x = apply(wg.s_s[at + e], f) * p.scale;
            atomicAdd(&dq_acc[p.dq_off + q_at(b, i, h, df * 16u + e % 16u)], x);
        }
    }
}
