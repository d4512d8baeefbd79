// The gated delta rule (Qwen3-Next's linear attention), in f32. Per
// (batch b, value head h) a state S: [Dk, Dv], zero at t = 0; each step
// S ← exp(g)·S; δ = β(v − Sᵀk); S ← S + k δᵀ; o = Sᵀq. Value head h reads
// key head h / grp. Where g is per key channel (gw = Dk, Kimi Linear's KDA)
// row i of S decays by exp(g[i]); else gw = 1, one decay for all rows.
// With documents packed in the rows (docs != 0: megatrain_tensor's Docs)
// S is zero again at each document's first step t, where DOCS[docs_off +
// b·T + t] (the first position of its document) is t itself, and no dS
// flows back past it; where docs is 0 DOCS is a dummy nothing reads.
//
// A workgroup owns COLS = 32 columns of one (b, h)'s state (columns evolve
// independently), held in registers: thread (r, c) = (tid / 8, tid % 8)
// keeps rows r + 32n (n < 4, so Dk ≤ 128) of columns c + 8m (m < 4). The
// sums over rows (Sᵀk, Sᵀq, the backward's kᵀdS) go through `red`, one
// partial per row group; the backward's sums over columns (dq, dk) through
// `rq`/`rk`, one partial per column group, then across column blocks and
// the value heads of a key head by dr_group_sum: a fixed order, no atomics.
// A per-channel dg is a sum over columns too: one partial per row and
// column block (through `rq`, free by then), summed like dk's.
//
// The host binds one piece of whole batches (b is the piece's) and runs
// chunks c0..c1 of C steps per dispatch (a loop budget): the forward
// starts from the state it checkpointed at chunk c0; the backward walks
// its chunks last to first and hands dS to the next dispatch through the
// scratch. The backward's partials hold one time window of `w_len` steps
// from `w0` (whole chunks, c0..c1 inside it), so they do not grow with T;
// the host sums each window's into dq, dk, dg, dβ before the next.

const C: u32 = 64u;
const COLS: u32 = 32u;
const RG: u32 = 32u;
const CG: u32 = 8u;
const NR: u32 = 4u;
const NCOL: u32 = 4u;
const WG: u32 = 256u;

struct Params {
    t: u32, hk: u32, hv: u32, dk: u32,
    dv: u32, grp: u32, nb: u32, nc: u32,
    q_off: u32, k_off: u32, v_off: u32, g_off: u32,
    beta_off: u32, out_off: u32, saved_off: u32, dout_off: u32,
    scratch_off: u32, parts_off: u32, nbatch: u32, c0: u32,
    c1: u32, gs_n: u32, gs_w: u32, gs_p: u32,
    gs_y: u32, gs_ys: u32, gs_ps: u32, w0: u32,
    w_len: u32, gw: u32, docs: u32, docs_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> K: array<f32>;
@group(0) @binding(3) var<storage, read> V: array<f32>;
@group(0) @binding(4) var<storage, read> GA: array<f32>;
@group(0) @binding(5) var<storage, read> BE: array<f32>;
// The forward's output; the backward's dv.
@group(0) @binding(6) var<storage, read_write> OUT: array<f32>;
// [B, Hv, NC, Dk, Dv]: the state at the start of every chunk.
@group(0) @binding(7) var<storage, read_write> SAVED: array<f32>;
@group(0) @binding(8) var<storage, read> DOUT: array<f32>;
// Per workgroup: the chunk's states before each step ([C, Dk, COLS]), its
// Sᵀk ([C, COLS]) and dS carried between dispatches ([Dk, COLS]).
@group(0) @binding(9) var<storage, read_write> SCRATCH: array<f32>;
// The backward's partials of one time window: dq, dk ([B, w_len, Hk,
// grp·nb, Dk] each), dg ([B, w_len, Hv, nb, gw]), dβ ([B, w_len, Hv, nb]).
@group(0) @binding(10) var<storage, read_write> PARTS: array<f32>;
@group(0) @binding(11) var<storage, read_write> SUMS: array<f32>;
@group(0) @binding(12) var<storage, read> DOCS: array<u32>;

var<workgroup> k_s: array<f32, 128>;
var<workgroup> q_s: array<f32, 128>;
// exp(g) of each row of the state (all equal where gw = 1).
var<workgroup> a_s: array<f32, 128>;
// [RG, COLS]: per row group partial sums of each column.
var<workgroup> red: array<f32, 1024>;
// [128, CG]: per column group partial sums of each row (dq, dk; rq then
// the per-channel dα).
var<workgroup> rq: array<f32, 1024>;
var<workgroup> rk: array<f32, 1024>;
// Per column: δ; dout (backward); dδ; the dβ and dα terms.
var<workgroup> col_d: array<f32, 32>;
var<workgroup> col_o: array<f32, 32>;
var<workgroup> col_dd: array<f32, 32>;
var<workgroup> col_b: array<f32, 32>;
var<workgroup> col_a: array<f32, 32>;

// Whether step t of the piece's batch row `row` (b·T + t) starts a
// document after the row's first: the state it reads is zero.
fn resets(row: u32, t: u32) -> bool {
    return p.docs != 0u && t > 0u && DOCS[p.docs_off + row] == t;
}

// Zeroes the thread's block of a state (or of dS).
fn clear(s: ptr<function, array<f32, 16>>) {
    for (var e = 0u; e < 16u; e++) {
        (*s)[e] = 0.0;
    }
}

fn scratch_base(b: u32, h: u32, jb: u32) -> u32 {
    let per = C * p.dk * COLS + C * COLS + p.dk * COLS;
    return p.scratch_off + ((b * p.hv + h) * p.nb + jb) * per;
}

fn saved_at(b: u32, h: u32, c: u32, i: u32, j: u32) -> u32 {
    return p.saved_off + (((b * p.hv + h) * p.nc + c) * p.dk + i) * p.dv + j;
}

// The thread's block of the state into chunk `ch`'s checkpoint.
fn save_state(s: ptr<function, array<f32, 16>>, b: u32, h: u32, ch: u32, r: u32, c: u32, j0: u32) {
    for (var e = 0u; e < 16u; e++) {
        let i = r + RG * (e / NCOL);
        let j = j0 + c + CG * (e % NCOL);
        if i < p.dk && j < p.dv {
            SAVED[saved_at(b, h, ch, i, j)] = (*s)[e];
        }
    }
}

// k_t and q_t of key head kh, and exp(g) of each state row at gate row gi
// (its one decay, or row i's where g is per channel), into workgroup
// memory.
fn stage(row: u32, kh: u32, gi: u32, tid: u32) {
    if tid < p.dk {
        let at = (row * p.hk + kh) * p.dk + tid;
        k_s[tid] = K[p.k_off + at];
        q_s[tid] = Q[p.q_off + at];
        a_s[tid] = exp(GA[p.g_off + gi * p.gw + tid % p.gw]);
    }
}

// Σ over the row groups of column jl's partials in `red`.
fn column_sum(jl: u32) -> f32 {
    var s = 0.0;
    for (var rr = 0u; rr < RG; rr++) {
        s += red[rr * COLS + jl];
    }
    return s;
}

// s ← α s (row i by a_s[i]), and each column's partial of m = sᵀk into
// `red`.
fn decay_and_read(s: ptr<function, array<f32, 16>>, r: u32, c: u32) {
    for (var m = 0u; m < NCOL; m++) {
        var part = 0.0;
        for (var n = 0u; n < NR; n++) {
            let i = r + RG * n;
            if i < p.dk {
                let e = n * NCOL + m;
                (*s)[e] *= a_s[i];
                part += k_s[i] * (*s)[e];
            }
        }
        red[r * COLS + c + CG * m] = part;
    }
}

// δ_j = β(v_j − m_j) of column `tid` (< COLS) into col_d; returns m_j.
fn delta_of(gi: u32, j0: u32, tid: u32, beta: f32) -> f32 {
    let m = column_sum(tid);
    var d = 0.0;
    if j0 + tid < p.dv {
        d = beta * (V[p.v_off + gi * p.dv + j0 + tid] - m);
    }
    col_d[tid] = d;
    return m;
}

@compute @workgroup_size(256)
fn dr_fwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let jb = wid.x;
    let h = wid.y;
    let b = wid.z;
    let r = tid / CG;
    let c = tid % CG;
    let j0 = jb * COLS;
    let kh = h / p.grp;
    var s: array<f32, 16>;
    for (var n = 0u; n < NR; n++) {
        for (var m = 0u; m < NCOL; m++) {
            let i = r + RG * n;
            let j = j0 + c + CG * m;
            var x = 0.0;
            if p.c0 > 0u && i < p.dk && j < p.dv {
                x = SAVED[saved_at(b, h, p.c0, i, j)];
            }
            s[n * NCOL + m] = x;
        }
    }
    let t1 = min(p.t, p.c1 * C);
    for (var t = p.c0 * C; t < t1; t++) {
        let row = b * p.t + t;
        let gi = row * p.hv + h;
        workgroupBarrier();
        if resets(row, t) {
            clear(&s);
        }
        // After the reset: the backward's replay starts from what the
        // chunk's first step reads.
        if t % C == 0u {
            save_state(&s, b, h, t / C, r, c, j0);
        }
        stage(row, kh, gi, tid);
        workgroupBarrier();
        let beta = BE[p.beta_off + gi];
        decay_and_read(&s, r, c);
        workgroupBarrier();
        if tid < COLS {
            delta_of(gi, j0, tid, beta);
        }
        workgroupBarrier();
        for (var m = 0u; m < NCOL; m++) {
            let jl = c + CG * m;
            var o = 0.0;
            for (var n = 0u; n < NR; n++) {
                let i = r + RG * n;
                if i < p.dk {
                    let e = n * NCOL + m;
                    s[e] += k_s[i] * col_d[jl];
                    o += q_s[i] * s[e];
                }
            }
            red[r * COLS + jl] = o;
        }
        workgroupBarrier();
        if tid < COLS && j0 + tid < p.dv {
            OUT[p.out_off + gi * p.dv + j0 + tid] = column_sum(tid);
        }
    }
    // The next dispatch starts from here.
    if p.c1 < p.nc {
        save_state(&s, b, h, p.c1, r, c, j0);
    }
}

@compute @workgroup_size(256)
fn dr_bwd(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let jb = wid.x;
    let h = wid.y;
    let b = wid.z;
    let r = tid / CG;
    let c = tid % CG;
    let j0 = jb * COLS;
    let kh = h / p.grp;
    let g = h % p.grp;
    let base = scratch_base(b, h, jb);
    let m_base = base + C * p.dk * COLS;
    let carry = m_base + C * COLS;
    // dq, dk partial rows: [nbatch·w_len·Hk, grp·nb, Dk]; dg
    // [nbatch·w_len·Hv, nb, gw]; dβ [nbatch·w_len·Hv, nb], a step's row
    // its offset in the window.
    let np = p.grp * p.nb;
    let dk_region = p.nbatch * p.w_len * p.hk * np * p.dk;
    let dg_region = 2u * dk_region;
    let db_region = dg_region + p.nbatch * p.w_len * p.hv * p.nb * p.gw;
    var s: array<f32, 16>;
    var ds: array<f32, 16>;
    var sp: array<f32, 16>;
    for (var e = 0u; e < 16u; e++) {
        let i = r + RG * (e / NCOL);
        var x = 0.0;
        if p.c1 < p.nc && i < p.dk {
            x = SCRATCH[carry + i * COLS + c + CG * (e % NCOL)];
        }
        ds[e] = x;
    }
    for (var cc = p.c1; cc > p.c0; cc--) {
        let ch = cc - 1u;
        let t0 = ch * C;
        let t1 = min(p.t, t0 + C);
        for (var e = 0u; e < 16u; e++) {
            let i = r + RG * (e / NCOL);
            let j = j0 + c + CG * (e % NCOL);
            var x = 0.0;
            if i < p.dk && j < p.dv {
                x = SAVED[saved_at(b, h, ch, i, j)];
            }
            s[e] = x;
        }
        // Replay the chunk, keeping the state before each step and its Sᵀk.
        for (var t = t0; t < t1; t++) {
            let row = b * p.t + t;
            let gi = row * p.hv + h;
            if resets(row, t) {
                clear(&s);
            }
            for (var e = 0u; e < 16u; e++) {
                let i = r + RG * (e / NCOL);
                if i < p.dk {
                    SCRATCH[base + ((t - t0) * p.dk + i) * COLS + c + CG * (e % NCOL)] = s[e];
                }
            }
            workgroupBarrier();
            stage(row, kh, gi, tid);
            workgroupBarrier();
            decay_and_read(&s, r, c);
            workgroupBarrier();
            if tid < COLS {
                SCRATCH[m_base + (t - t0) * COLS + tid] = delta_of(gi, j0, tid, BE[p.beta_off + gi]);
            }
            workgroupBarrier();
            for (var e = 0u; e < 16u; e++) {
                let i = r + RG * (e / NCOL);
                if i < p.dk {
                    s[e] += k_s[i] * col_d[c + CG * (e % NCOL)];
                }
            }
        }
        // Walk it backwards, dS carried in `ds`.
        for (var tt = t1; tt > t0; tt--) {
            let t = tt - 1u;
            let row = b * p.t + t;
            let gi = row * p.hv + h;
            let beta = BE[p.beta_off + gi];
            workgroupBarrier();
            stage(row, kh, gi, tid);
            var vm = 0.0;
            if tid < COLS {
                let j = j0 + tid;
                var d = 0.0;
                var o = 0.0;
                if j < p.dv {
                    vm = V[p.v_off + gi * p.dv + j] - SCRATCH[m_base + (t - t0) * COLS + tid];
                    d = beta * vm;
                    o = DOUT[p.dout_off + gi * p.dv + j];
                }
                col_d[tid] = d;
                col_o[tid] = o;
            }
            workgroupBarrier();
            // s_t = α s_{t−1} + k δᵀ; dS += q doᵀ; dq = S_t do; dδ = dSᵀk.
            for (var n = 0u; n < NR; n++) {
                let i = r + RG * n;
                var dq = 0.0;
                if i < p.dk {
                    let alpha = a_s[i];
                    for (var m = 0u; m < NCOL; m++) {
                        let e = n * NCOL + m;
                        let jl = c + CG * m;
                        sp[e] = SCRATCH[base + ((t - t0) * p.dk + i) * COLS + jl];
                        ds[e] += q_s[i] * col_o[jl];
                        dq += col_o[jl] * (alpha * sp[e] + k_s[i] * col_d[jl]);
                    }
                    rq[i * CG + c] = dq;
                }
            }
            for (var m = 0u; m < NCOL; m++) {
                var dd = 0.0;
                for (var n = 0u; n < NR; n++) {
                    let i = r + RG * n;
                    if i < p.dk {
                        dd += k_s[i] * ds[n * NCOL + m];
                    }
                }
                red[r * COLS + c + CG * m] = dd;
            }
            workgroupBarrier();
            if tid < COLS {
                let dd = column_sum(tid);
                col_dd[tid] = dd;
                col_b[tid] = vm * dd;
                if j0 + tid < p.dv {
                    OUT[p.out_off + gi * p.dv + j0 + tid] = beta * dd;
                }
            }
            let wrow = b * p.w_len + t - p.w0;
            let prow = ((wrow * p.hk + kh) * np + g * p.nb + jb) * p.dk;
            if tid < p.dk {
                var x = 0.0;
                for (var cg = 0u; cg < CG; cg++) {
                    x += rq[tid * CG + cg];
                }
                PARTS[p.parts_off + prow + tid] = x;
            }
            workgroupBarrier();
            // dm = −β dδ; dk = dS δ + a dm; da = dS + k dmᵀ; dα = Σ s_{t−1}·da
            // (over the block, or over each row's columns into `rq` where
            // the decay is per row); dS ← α da.
            var dalpha = 0.0;
            for (var n = 0u; n < NR; n++) {
                let i = r + RG * n;
                var dkp = 0.0;
                var dar = 0.0;
                if i < p.dk {
                    let alpha = a_s[i];
                    for (var m = 0u; m < NCOL; m++) {
                        let e = n * NCOL + m;
                        let jl = c + CG * m;
                        let dm = -beta * col_dd[jl];
                        dkp += col_d[jl] * ds[e] + alpha * sp[e] * dm;
                        let da = ds[e] + k_s[i] * dm;
                        dalpha += sp[e] * da;
                        dar += sp[e] * da;
                        ds[e] = alpha * da;
                    }
                    rk[i * CG + c] = dkp;
                    rq[i * CG + c] = dar;
                }
            }
            red[tid] = dalpha;
            workgroupBarrier();
            let wgi = wrow * p.hv + h;
            if tid < p.dk {
                var x = 0.0;
                for (var cg = 0u; cg < CG; cg++) {
                    x += rk[tid * CG + cg];
                }
                PARTS[p.parts_off + dk_region + prow + tid] = x;
                if p.gw > 1u {
                    var y = 0.0;
                    for (var cg = 0u; cg < CG; cg++) {
                        y += rq[tid * CG + cg];
                    }
                    PARTS[p.parts_off + dg_region + (wgi * p.nb + jb) * p.gw + tid] = a_s[tid] * y;
                }
            }
            if tid < COLS {
                var x = 0.0;
                for (var q = 0u; q < WG / COLS; q++) {
                    x += red[tid * (WG / COLS) + q];
                }
                col_a[tid] = x;
            }
            workgroupBarrier();
            if tid == 0u {
                var da = 0.0;
                var db = 0.0;
                for (var q = 0u; q < COLS; q++) {
                    da += col_a[q];
                    db += col_b[q];
                }
                if p.gw == 1u {
                    PARTS[p.parts_off + dg_region + wgi * p.nb + jb] = a_s[0] * da;
                }
                PARTS[p.parts_off + db_region + wgi * p.nb + jb] = db;
            }
            // The previous document's last state was dropped here.
            if resets(row, t) {
                clear(&ds);
            }
        }
    }
    for (var e = 0u; e < 16u; e++) {
        let i = r + RG * (e / NCOL);
        if i < p.dk {
            SCRATCH[carry + i * COLS + c + CG * (e % NCOL)] = ds[e];
        }
    }
}

// Per batch bi < nbatch, SUMS[bi·gs_ys + e] = Σ_q PARTS[bi·gs_ps +
// (row·gs_p + q)·gs_w + i], e = row·gs_w + i < gs_n: the backward's
// partials summed over column blocks and value heads. A window's rows
// are contiguous within a batch only, hence the batch strides.
@compute @workgroup_size(256)
fn dr_group_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) tid: u32) {
    let f = (wid.y * nwg.x + wid.x) * 256u + tid;
    if f < p.nbatch * p.gs_n {
        let bi = f / p.gs_n;
        let e = f % p.gs_n;
        let row = e / p.gs_w;
        let i = e % p.gs_w;
        let at = p.parts_off + bi * p.gs_ps;
        var x = 0.0;
        for (var q = 0u; q < p.gs_p; q++) {
            x += PARTS[at + (row * p.gs_p + q) * p.gs_w + i];
        }
        SUMS[p.gs_y + bi * p.gs_ys + e] = x;
    }
}
