//! The tensor-core flash-attention family: WGSL for each pass and head
//! dimension, put together from the sections of `shaders/attention_coop.wgsl`
//! and generated code (constants, workgroup-memory layout and the fragment
//! loads, multiply-adds and stores), like the matmul family of `crate::coop`.
//! The emulated variants run the same kernels with the cooperative-matrix
//! operations in plain WGSL (smaller tiles, to fit 32 KiB of workgroup
//! memory in f32), so that lavapipe checks their indexing and masking.

use std::fmt::Write;

use crate::coop::section as matmul_section;
pub use crate::coop_attention_tile::{AttnTile, AttnTiles};

const SCALE: &str = include_str!("../../../shaders/matmul_scale.wgsl");
const MAX_BITS: &str = include_str!("../../../shaders/max_bits.wgsl");
const ATTN: &str = include_str!("../../../shaders/attention_coop.wgsl");

/// The three kernels of one attention forward and backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnPass {
    /// Forward: out and lse.
    Fwd,
    /// dQ, a query block per workgroup.
    Dq,
    /// dK and dV, a key block per workgroup.
    Dkv,
}

/// One tensor-core attention pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CoopAttention {
    pub pass: AttnPass,
    /// Head dimension, one of [`CoopAttention::HEAD_DIMS`].
    pub d: u32,
    /// Cooperative-matrix operations emulated in plain WGSL.
    pub emulated: bool,
    /// Q, K, V (and dO) are read as their f16 copies under their scales
    /// (`F16Operands::Copy`), else as f32, scaled and converted as they are
    /// staged.
    pub f16_in: bool,
    /// A tile other than the pass's default ([`CoopAttention::tile`]), for
    /// timing tiles (`MEGATRAIN_F16_ATTENTION_TILES`).
    pub shape: Option<AttnTile>,
    /// The kernel with part of its loop over streamed tiles taken out, for
    /// timing: wrong results ([`AttnProbe`]). `None` in every variant the
    /// executor runs unless [`crate::GpuOptions::attention_probe`] asks.
    pub probe: Option<AttnProbe>,
}

/// The tensor-core attention's kernels with part of their loop over
/// streamed tiles taken out, to find where their time goes on a GPU whose
/// driver's code no profiler we can reach shows (as [`crate::CoopProbe`]
/// does for the matmul). Each gives wrong results; only the attention
/// bench runs them (`MEGATRAIN_ATTN_PROBE`), through
/// [`crate::GpuOptions::attention_probe`]. Every probe keeps the real
/// loop's tiles (the causal bounds, the skipped tiles), its products, the
/// scores' way through workgroup memory and back as P (and dS), and its
/// barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttnProbe {
    /// The first streamed tile staged, and no other read or staged (K and
    /// V in the forward and dq, the first head's Q and dO in dk/dv): the
    /// real loop but for each tile's global reads and staging.
    Staged,
    /// That, and the lanes' work between the products replaced by plain
    /// conversions of the scores (the same lanes reading S, and dP, and
    /// writing P, and dS): the forward's online softmax (P = S·scale, the
    /// sums added), the backward's P and dS (S·scale and dP·scale), so no
    /// exponential, mask, max or statistic.
    Plain,
}

impl AttnProbe {
    pub const ALL: [AttnProbe; 2] = [AttnProbe::Staged, AttnProbe::Plain];

    pub fn name(self) -> &'static str {
        match self {
            AttnProbe::Staged => "staged",
            AttnProbe::Plain => "plain",
        }
    }
}

/// Head dimensions up to which dK/dV keeps K's and V's fragments in
/// registers (2·D/16 of them, 4 registers each on a 32-lane subgroup, beside
/// 2·D/16 accumulators of 8).
const KV_RESIDENT_D: u32 = 80;

impl CoopAttention {
    /// The head dimensions the family is generated for (the zoo's).
    pub const HEAD_DIMS: [u32; 4] = [64, 80, 96, 128];

    /// The hardware variants of every tile set [`AttnTiles::SWEEP`] names.
    pub fn swept() -> Vec<CoopAttention> {
        let mut v = Vec::new();
        for tiles in AttnTiles::SWEEP {
            let tiles: AttnTiles = tiles.parse().expect("a sweep's tiles parse");
            for base in CoopAttention::all().into_iter().filter(|b| !b.emulated) {
                v.push(CoopAttention {
                    shape: tiles.get(base.pass),
                    ..base
                });
            }
        }
        v
    }

    /// The timing probes ([`AttnProbe`]) of every pass on its default
    /// tiles, every head dimension, emulated or not, f16 or f32 inputs.
    pub fn all_probes() -> Vec<CoopAttention> {
        CoopAttention::all()
            .into_iter()
            .flat_map(|v| AttnProbe::ALL.map(|p| CoopAttention { probe: Some(p), ..v }))
            .collect()
    }

    pub fn all() -> Vec<CoopAttention> {
        let mut v = Vec::new();
        for pass in [AttnPass::Fwd, AttnPass::Dq, AttnPass::Dkv] {
            for d in Self::HEAD_DIMS {
                for emulated in [false, true] {
                    for f16_in in [false, true] {
                        v.push(CoopAttention {
                            pass,
                            d,
                            emulated,
                            f16_in,
                            shape: None,
                            probe: None,
                        });
                    }
                }
            }
        }
        v
    }

    pub fn tile(&self) -> AttnTile {
        let t = |sg, bc| AttnTile {
            sg,
            bc,
            share: false,
            prefetch: false,
            double: false,
            two_pass: false,
            local: false,
            fused_dq: false,
            split: 1,
        };
        match (self.shape, self.emulated, self.pass) {
            (Some(s), ..) => s,
            // The forward's D = 64 at the hardware's BC, which fits 32 KiB
            // in f32, so that its rounds of two O fragments run here too.
            (None, true, AttnPass::Fwd) if self.d <= 64 => t(1, 32),
            (None, true, _) => t(1, 16),
            // The H200 sweeps at B4 T2048 32/8 D128 (BENCHMARKS.md). 2026-11-28:
            // the forward on 8 subgroups and 16-key tiles with Q staged under
            // the streamed tiles, 3.56 ms where sg4bc32 took 6.87; dq on 4
            // subgroups with 16-key tiles. 2026-11-29: the forward's streamed
            // tiles prefetched, 3.51 ms where without 4.08 in the same run;
            // dkv on 3 subgroups, the backward 17.1 ms where on 2 it took 23.4.
            // 2026-12-01: the resident block staged in four slices, so that
            // twice the subgroups share each streamed tile (the forward on
            // 16, dq and dk/dv on 8, K and V in registers): per kernel 3.03,
            // 3.40 and 6.20 ms where the defaults before took 3.56, 6.84 and
            // 11.49 in the same run.
            (None, false, AttnPass::Fwd) => AttnTile {
                share: true,
                prefetch: true,
                split: 4,
                ..t(16, 16)
            },
            (None, false, AttnPass::Dq | AttnPass::Dkv) => AttnTile {
                share: true,
                prefetch: true,
                split: 4,
                ..t(8, 16)
            },
        }
    }

    /// Offsets (in halfs) of the f16 regions in `sm` and its length:
    /// (Q_S, K_S, V_S, DO_S, P_S, DS_S, SM). Unused regions are empty.
    /// With a shared tile the resident block (the forward's Q, dq's Q and
    /// dO, dkv's K and V) and the streamed tiles both start at 0
    /// (`AttnTile::share`), the resident block's rows `ldq` apart.
    fn layout(&self) -> [u32; 7] {
        let t = self.tile();
        let (lds, ldq, ldp, br, bc) = (self.d + 8, self.ldq(), t.bc + 8, t.br(), t.bc);
        // The streamed tiles' second copy, after the first.
        let two = self.stream();
        match self.pass {
            AttnPass::Fwd => {
                let k = if t.share { 0 } else { br * ldq };
                let v = k + bc * lds;
                let p = v + bc * lds + two;
                let end = (p + br * ldp).max(br * ldq);
                [0, k, v, p, p, p + br * ldp, end]
            }
            AttnPass::Dq => {
                let dout = br * ldq;
                let k = if t.share { 0 } else { 2 * br * ldq };
                let v = k + bc * lds;
                let p = v + bc * lds + two;
                let end = (p + 2 * br * ldp).max(2 * br * ldq);
                [0, k, v, dout, p, p + br * ldp, end]
            }
            AttnPass::Dkv => {
                let v = br * ldq;
                let q = if t.share { 0 } else { 2 * br * ldq };
                let dout = q + bc * lds;
                let p = dout + bc * lds + two;
                let end = (p + 2 * br * ldp).max(2 * br * ldq);
                [q, 0, v, dout, p, p + br * ldp, end]
            }
        }
    }

    /// The resident block in slices ([`AttnTile::split`]): fragments of D
    /// per slice (the last may have fewer) and the slices, for D's `d / 16`
    /// fragments; at most that many slices, whatever the tile asks.
    fn slices(&self) -> (u32, u32) {
        let nd = self.d / 16;
        let per = nd.div_ceil(self.tile().split.clamp(1, nd));
        (per, nd.div_ceil(per))
    }

    /// Row stride (halfs) of the resident block (the forward's Q, dq's Q
    /// and dO, dkv's K and V; LDQ in the shader): a slice's columns, padded
    /// as every tile is; D's where it is staged whole (no shared regions).
    fn ldq(&self) -> u32 {
        match self.tile().share {
            true => 16 * self.slices().0 + 8,
            false => self.d + 8,
        }
    }

    /// Whether the forward's rows flag their rescale before their halves
    /// meet (`softmax_tile`: the one-pass softmax on rows synchronised
    /// across the workgroup), so that no workgroup-uniform load of the
    /// flag follows.
    fn early_flag(&self) -> bool {
        let t = self.tile();
        self.pass == AttnPass::Fwd && !t.local && !t.two_pass
    }

    /// Whether the streamed tiles are double buffered
    /// ([`AttnTile::double`]); a probe's loop stages its first tile alone,
    /// in one copy.
    fn double(&self) -> bool {
        self.tile().double && self.probe.is_none()
    }

    /// Halfs from a streamed tile's first copy to its second (STREAM in
    /// the shader: both operands' tiles, K and V or Q and dO), 0 where
    /// there is one.
    fn stream(&self) -> u32 {
        if self.double() {
            2 * self.tile().bc * (self.d + 8)
        } else {
            0
        }
    }

    /// `sb`, the streamed tiles' copy the loop is on, added to their
    /// regions' offsets where they are double buffered.
    fn sb(&self) -> &'static str {
        if self.double() { " + sb" } else { "" }
    }

    fn scratch_regions(&self) -> u32 {
        if self.pass == AttnPass::Fwd { 1 } else { 2 }
    }

    fn stat_len(&self) -> u32 {
        let t = self.tile();
        let streamed = if self.double() && self.pass == AttnPass::Dkv {
            // dk/dv's two copies of the streamed rows' lse and delta.
            4 * t.bc
        } else {
            0
        };
        (2 * t.br().max(t.bc)).max(streamed)
    }

    /// Bytes of each member of the variant's `Shared`, in order: the
    /// tiles, the f32 scratch, the statistics, `rescale` and `wg_max`.
    fn shared_members(&self) -> [u32; 4] {
        let t = self.tile();
        let half = if self.emulated { 4 } else { 2 };
        [
            self.layout()[6] * half,
            self.scratch_regions() * t.sg * 16 * t.bc * 4,
            self.stat_len() * 4,
            4 * 2,
        ]
    }

    /// Bytes of workgroup memory the variant declares.
    pub fn workgroup_bytes(&self) -> u32 {
        self.shared_members().iter().sum()
    }

    pub fn label(&self) -> String {
        let pass = match self.pass {
            AttnPass::Fwd => "fwd",
            AttnPass::Dq => "dq",
            AttnPass::Dkv => "dkv",
        };
        format!(
            "flash_{pass}_d{}{}{}{}{}",
            self.d,
            if self.emulated { "_sw" } else { "" },
            if self.f16_in { "_in16" } else { "" },
            self.shape.map_or(String::new(), |t| format!("_{}", t.name())),
            self.probe
                .map_or(String::new(), |p| format!("_probe_{}", p.name()))
        )
    }

    /// Loop iterations one invocation runs per streamed tile (emulated
    /// multiply-adds counted as plain loops), for the loop budget of
    /// drivers that cap them (llvmpipe).
    pub fn loops_per_tile(&self) -> usize {
        let t = self.tile();
        let (d, bc, threads) = (self.d as usize, t.bc as usize, 32 * t.sg as usize);
        let frags = (d / 16) * (bc / 16);
        // An emulated 16x16x16 multiply-add: 8 rows of 16 plus the row loop.
        let mma = if self.emulated { 8 * 17 + 1 } else { 1 };
        let products = match self.pass {
            AttnPass::Fwd => 2,
            AttnPass::Dq => 3,
            // dQ's blocks too where dk/dv adds them (`fused_dq`).
            AttnPass::Dkv => 4 + usize::from(t.fused_dq),
        };
        products * frags * (mma + 1) + 2 * bc * d / threads + 4 * bc + d
    }

    /// The WGSL of this variant (entry point `main`).
    pub fn source(&self) -> String {
        let t = self.tile();
        assert!(self.d.is_multiple_of(16) && t.bc.is_multiple_of(16));
        // Emulated fragments are read where they lie, in the loop: the
        // resident block must stay staged.
        assert!(
            !(t.share && self.emulated),
            "{}: shared regions on emulated fragments",
            self.label()
        );
        let [q_s, k_s, v_s, do_s, p_s, ds_s, sm] = self.layout();
        let mut out = String::with_capacity(32 << 10);
        assert!(
            !(t.local && self.emulated),
            "{}: subgroup-local rows on emulated fragments",
            self.label()
        );
        if !self.emulated {
            out.push_str("enable f16;\nenable wgpu_cooperative_matrix;\n");
        }
        if t.local || self.early_flag() {
            // A subgroup's rescale runs cooperative loads and stores under
            // its own vote: uniform within the subgroup, as the extension
            // asks, which naga's workgroup-wide analysis cannot tell; the
            // one-pass softmax's under `rescale`, loaded by every
            // invocation after the barrier behind its last store.
            out.push_str("diagnostic(off, derivative_uniformity);\n");
        }
        out.push('\n');
        let _ = writeln!(out, "// Variant {}", self.label());
        let _ = writeln!(
            out,
            "const D: u32 = {}u;\nconst DLOG2: i32 = {};\nconst SG: u32 = {}u;\nconst BC: u32 = {}u;",
            self.d,
            self.d.next_power_of_two().trailing_zeros(),
            t.sg,
            t.bc
        );
        let _ = writeln!(
            out,
            "const Q_S: u32 = {q_s}u;\nconst K_S: u32 = {k_s}u;\nconst V_S: u32 = {v_s}u;\nconst DO_S: u32 = {do_s}u;\nconst P_S: u32 = {p_s}u;\nconst DS_S: u32 = {ds_s}u;\nconst SM: u32 = {sm}u;\nconst LDQ: u32 = {}u;",
            self.ldq()
        );
        if self.double() {
            let _ = writeln!(out, "const STREAM: u32 = {}u;", self.stream());
        }
        let _ = writeln!(
            out,
            "const NSCR: u32 = {}u;\nconst STAT: u32 = {}u;\nconst LOCAL: bool = {};\n\nfn row_sync() {{\n    {}();\n}}\n",
            self.scratch_regions(),
            self.stat_len(),
            t.local,
            if t.local {
                "subgroupBarrier"
            } else {
                "workgroupBarrier"
            }
        );
        out.push_str(SCALE);
        out.push_str(MAX_BITS);
        out.push_str(matmul_section(if self.emulated { "half_sw" } else { "half_hw" }));
        out.push_str(section("common"));
        out.push_str(crate::kernels::DROPOUT_MASK);
        out.push_str(crate::kernels::ATTENTION_MASK);
        let inputs: &[&str] = match (self.f16_in, self.emulated) {
            (false, _) => &["in_f32", "in_vec"],
            (true, false) => &["in_f16_hw", "in_vec"],
            (true, true) => &["in_f16_sw"],
        };
        for name in inputs {
            out.push_str(section(name));
        }
        if self.emulated {
            out.push_str(&crate::coop::emulation("wg.sm", "wg.sm", "wg.s_s"));
        }
        if self.pass != AttnPass::Dq {
            out.push_str(section("out_max"));
        }
        match self.pass {
            AttnPass::Fwd => out.push_str(section("fwd")),
            AttnPass::Dq | AttnPass::Dkv => {
                out.push_str(section("bwd"));
                out.push_str(section(if self.f16_in && self.emulated {
                    "do_f16_sw"
                } else {
                    "do_vec"
                }));
                out.push_str(section(if self.pass == AttnPass::Dq { "dq" } else { "dkv" }));
                if t.fused_dq {
                    out.push_str(section("dq_atomic"));
                }
            }
        }
        if t.prefetch {
            out.push_str(&self.prefetch_fns());
        }
        if self.probe == Some(AttnProbe::Plain) {
            out.push_str(if self.pass == AttnPass::Fwd {
                PLAIN_TILE
            } else {
                PLAIN_DS_TILE
            });
        }
        out.push_str(&self.main());
        out
    }

    /// Registers (`In4`s) each invocation holds per operand of a
    /// prefetched tile: BC rows of D, four elements each, over the
    /// workgroup.
    fn prefetch_regs(&self) -> u32 {
        let t = self.tile();
        (t.bc * self.d / 4).div_ceil(32 * t.sg)
    }

    /// A prefetching variant's loaders: `fetch_…` reads the streamed tile
    /// (the forward's and dq's K and V rows j0.., dkv's Q and dO rows i0..
    /// of head h with their lse and delta) into private variables, one a
    /// register (unrolled: an array indexed in a loop lives in local
    /// memory where the driver does not unroll it), and `put_…` stages
    /// them as `stage_kv` / `stage_q_tile` would have.
    fn prefetch_fns(&self) -> String {
        let n = self.prefetch_regs();
        let dkv = self.pass == AttnPass::Dkv;
        // Double buffered, `put_…` stages into the copy `sb` (and dk/dv's
        // statistics at `st`) that the caller names.
        let (sb, st) = (self.sb(), if self.double() { "st + " } else { "" });
        let (x, y) = if dkv { ("pq", "pd") } else { ("pk", "pv") };
        let mut m = String::from("\n// Prefetched tile (generated).\n");
        for r in 0..n {
            let _ = writeln!(m, "var<private> {x}{r}: In4;\nvar<private> {y}{r}: In4;");
        }
        // The element and its row and column; `{body}` where it is in the tile.
        let each = |m: &mut String, body: &dyn Fn(u32) -> String| {
            for r in 0..n {
                let _ = writeln!(
                    m,
                    "    {{\n        let e = li + {r}u * THREADS;\n        if e < BC * D / 4u {{\n            let r = e / (D / 4u);\n            let c = e % (D / 4u) * 4u;\n{}        }}\n    }}",
                    body(r)
                );
            }
        };
        if dkv {
            m.push_str("var<private> p_ld: vec2<f32>;\n\nfn fetch_q_tile(b: u32, i0: u32, h: u32) {\n");
            each(&mut m, &|r| {
                format!(
                    "            let i = i0 + r;\n            {x}{r} = In4(0.0);\n            {y}{r} = In4(0.0);\n            if i < p.t {{\n                let qi = q_at(b, i, h, c);\n                {x}{r} = read_q((p.q_off + qi) / 4u);\n                {y}{r} = read_do((p.do_off + qi) / 4u);\n            }}\n"
                )
            });
            m.push_str("    p_ld = vec2<f32>(0.0);\n    let i = i0 + li;\n    if li < BC && i < p.t {\n        let ri = row_at(b, h, i);\n        p_ld = vec2<f32>(lse_in[p.lse_off + ri], dd_in[p.dd_off + ri]);\n    }\n}\n\n");
            m.push_str(if self.double() {
                "fn put_q_tile(sb: u32, st: u32) {\n"
            } else {
                "fn put_q_tile() {\n"
            });
            each(&mut m, &|r| {
                format!(
                    "            put_in4(Q_S{sb} + r * LDS + c, {x}{r}, down_q);\n            put_in4(DO_S{sb} + r * LDS + c, {y}{r}, down_do);\n"
                )
            });
            let _ = write!(
                m,
                "    if li < BC {{\n        wg.stat_s[{st}li] = p_ld.x;\n        wg.stat_s[{st}BC + li] = p_ld.y;\n    }}\n}}\n"
            );
        } else {
            m.push_str("\nfn fetch_kv(b: u32, j0: u32, g: u32) {\n");
            each(&mut m, &|r| {
                format!(
                    "            let j = j0 + r;\n            {x}{r} = In4(0.0);\n            {y}{r} = In4(0.0);\n            if j < p.t {{\n                let i = kv_at(b, j, g, c);\n                {x}{r} = read_k((p.k_off + i) / 4u);\n                {y}{r} = read_v((p.v_off + i) / 4u);\n            }}\n"
                )
            });
            m.push_str(if self.double() {
                "}\n\nfn put_kv(sb: u32) {\n"
            } else {
                "}\n\nfn put_kv() {\n"
            });
            each(&mut m, &|r| {
                format!(
                    "            put_in4(K_S{sb} + r * LDS + c, {x}{r}, down_k);\n            put_in4(V_S{sb} + r * LDS + c, {y}{r}, down_v);\n"
                )
            });
            m.push_str("}\n");
        }
        m
    }

    /// The top of the loop over the streamed K/V tiles of the forward and
    /// dq, from the first key tile to `kend`: a barrier (the last tile's
    /// products are done with the region), the tile staged, a barrier;
    /// prefetching, the tile is staged from registers and the next one's
    /// reads issued after the second barrier (the first one's before the
    /// loop, `first_fetch`).
    fn kv_loop_head(&self) -> &'static str {
        // Double buffered: the first tile staged once the resident block's
        // fragments are loaded from the region (the barrier before it);
        // each next one read into registers at the top of the loop and
        // staged into the other copy at its end (`stream_tail`).
        if self.double() {
            return "    workgroupBarrier();\n    put_kv(0u);\n    workgroupBarrier();\n    var sb = 0u;\n    for (var j0 = j_first; j0 < kend; j0 += BC) {\n        let more = j0 + BC < kend;\n        if more {\n            fetch_kv(b, j0 + BC, g);\n        }\n";
        }
        // A probe's loop stages the first tile alone and reads no other.
        if self.probe.is_some() {
            return if self.tile().prefetch {
                "    for (var j0 = j_first; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        if j0 == j_first {\n            put_kv();\n        }\n        workgroupBarrier();\n"
            } else {
                "    for (var j0 = j_first; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        if j0 == j_first {\n            stage_kv(K_S, V_S, b, j0, g, BC, 0u, D, LDS);\n        }\n        workgroupBarrier();\n"
            };
        }
        if self.tile().prefetch {
            "    for (var j0 = j_first; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        put_kv();\n        workgroupBarrier();\n        if j0 + BC < kend {\n            fetch_kv(b, j0 + BC, g);\n        }\n"
        } else {
            "    for (var j0 = j_first; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        stage_kv(K_S, V_S, b, j0, g, BC, 0u, D, LDS);\n        workgroupBarrier();\n"
        }
    }

    /// The end of a double-buffered loop's iteration (nothing otherwise):
    /// the next tile, where there is one, staged from its registers into
    /// the copy the products did not read, and the one barrier of the
    /// tile: after it every subgroup is done with this tile's copy (the
    /// next but one is staged there) and sees the next one's.
    fn stream_tail(&self, indent: &str) -> String {
        if !self.double() {
            return String::new();
        }
        let put = if self.pass == AttnPass::Dkv {
            "put_q_tile(STREAM - sb, 2u * BC - st)"
        } else {
            "put_kv(STREAM - sb)"
        };
        let mut t = format!(
            "{indent}if more {{\n{indent}    {put};\n{indent}}}\n{indent}workgroupBarrier();\n{indent}sb = STREAM - sb;\n"
        );
        if self.pass == AttnPass::Dkv {
            let _ = writeln!(t, "{indent}st = 2u * BC - st;");
        }
        t
    }

    /// Before the resident block is staged: the K/V loop's bounds and,
    /// prefetching, its first tile's reads (into registers only, so they
    /// may be in flight while the block is staged, even in a region the
    /// tiles share with it).
    fn kv_loop_bounds(&self) -> &'static str {
        if self.tile().prefetch {
            "    let np = BR / p.group;\n    let p0 = wid.x * np;\n    let kend = min(p.t, p0 + np);\n    let j_first = first_key(b, p0) / BC * BC;\n    if j_first < kend {\n        fetch_kv(b, j_first, g);\n    }\n"
        } else {
            "    let np = BR / p.group;\n    let p0 = wid.x * np;\n    let kend = min(p.t, p0 + np);\n    let j_first = first_key(b, p0) / BC * BC;\n"
        }
    }

    /// The backward's P and dS of a tile: `real`, or a probe's plain
    /// conversions ([`AttnProbe::Plain`]).
    fn ds_tile_call(&self, real: &'static str) -> &'static str {
        match self.probe {
            Some(AttnProbe::Plain) => "plain_ds_tile(sg, lane);",
            _ => real,
        }
    }

    fn main(&self) -> String {
        let g = Gen { emu: self.emulated };
        let nd = self.d / 16;
        let nb = pv_blocks(self.tile().bc / 16, nd);
        let mut m = String::new();
        m.push_str(
            "\n@compute @workgroup_size(THREADS, 1, 1)\nfn main(\n    @builtin(workgroup_id) wid: vec3<u32>,\n    @builtin(num_workgroups) nwg: vec3<u32>,\n    @builtin(local_invocation_index) local_index: u32,\n) {\n",
        );
        m.push_str(
            "    li = local_index;\n    e_q = scale_exponent(p.q_slot);\n    e_k = scale_exponent(p.k_slot);\n    e_v = scale_exponent(p.v_slot);\n    e_do = scale_exponent(p.do_slot);\n    init_steps();\n    let sg = li / 32u;\n    let lane = li % 32u;\n    let b = wid.z;\n    let g = wid.y;\n    let lds = LDS;\n    let ldp = LDP;\n    let ldc = BC;\n    let ld16 = 16u;\n    let ldq = LDQ;\n    let cs = sg * 16u * BC;\n",
        );
        if self.pass != AttnPass::Dq {
            m.push_str("    init_max();\n");
        }
        let _ = writeln!(m, "    var acc = {};", g.zero());
        let kf = self.tile().bc / 16;
        // acc = the 16 x 16 scores of R·Cᵀ over D: R the A fragments `rows`
        // (as `fragments` loaded them), C the 16 rows of the tile at `cols`
        // that `f` picks; stored to the workgroup scratch at `at + f·16`
        // (named `name` in the shader).
        let score =
            |m: &mut String, indent: &str, rows: &Frags, cols: &str, f: &str, name: &str, at: &str| {
                let _ = writeln!(m, "{indent}acc = {};", g.zero());
                let b = format!("{cols} + {f} * 16u * LDS");
                product(m, &g, indent, "acc", rows, (&b, "16u", "lds", false), nd);
                let _ = writeln!(
                    m,
                    "{indent}let {name} = {at} + {f} * 16u;\n{indent}{}",
                    g.store("acc", name, "ldc")
                );
            };
        match self.pass {
            AttnPass::Fwd => self.forward(&mut m, &g, nd, nb),
            AttnPass::Dq => {
                for f in 0..nd {
                    let _ = writeln!(m, "    var dq{f} = {};", g.zero());
                }
                m.push_str(self.kv_loop_bounds());
                let stage = |c0, cw| format!("stage_q_do(b, p0, np, g, {c0}u, {cw}u)");
                self.stage_resident(&mut m, &g, &stage, &[&Q_ROWS, &DO_ROWS]);
                m.push_str(self.kv_loop_head());
                m.push_str("        for (var jf = 0u; jf < BC / 16u; jf++) {\n");
                let (ks, vs) = (format!("K_S{}", self.sb()), format!("V_S{}", self.sb()));
                score(&mut m, "            ", &Q_ROWS, &ks, "jf", "ci", "cs");
                score(&mut m, "            ", &DO_ROWS, &vs, "jf", "ct", "SCR + cs");
                let _ = write!(
                    m,
                    "        }}\n        row_sync();\n        {}\n        row_sync();\n",
                    self.ds_tile_call("ds_tile_dq(sg, lane, b, j0, p0, np, g);")
                );
                fragments(&mut m, &g, "        ", &DS_ROWS, kf);
                for f in 0..nd {
                    let b = format!("{ks} + {}u", 16 * f);
                    product(
                        &mut m,
                        &g,
                        "        ",
                        &format!("dq{f}"),
                        &DS_ROWS,
                        (&b, "16u * LDS", "lds", true),
                        kf,
                    );
                }
                m.push_str(&self.stream_tail("        "));
                m.push_str("    }\n");
                for f in 0..nd {
                    let _ = writeln!(
                        m,
                        "    workgroupBarrier();\n    {}",
                        g.store(&format!("dq{f}"), "cs", "ld16")
                    );
                    let _ = writeln!(
                        m,
                        "    workgroupBarrier();\n    store_dq(sg, lane, {f}u, b, p0, np, g);"
                    );
                }
            }
            AttnPass::Dkv => {
                for f in 0..nd {
                    let _ = writeln!(m, "    var dk{f} = {};\n    var dv{f} = {};", g.zero(), g.zero());
                }
                m.push_str("    let j0 = wid.x * BR;\n    let i_first = j0 / BC * BC;\n    let i_end = query_end(b, j0 + BR - 1u);\n");
                if self.tile().prefetch {
                    // Registers only: in flight while the key block is staged.
                    m.push_str("    fetch_q_tile(b, i_first, g * p.group);\n");
                }
                // K's and V's fragments stay in registers for the whole
                // kernel up to D = KV_RESIDENT_D, or where the tile shares
                // their region with the streamed ones (`s`, staged in
                // slices); past it otherwise, beside the 2·D/16
                // accumulators, they would spill, so they are loaded per
                // tile. (Emulated fragments are never loaded ahead.)
                let resident = !self.emulated && (self.d <= KV_RESIDENT_D || self.tile().share);
                if self.tile().share {
                    let stage = |c0, cw| format!("stage_kv(K_S, V_S, b, j0, g, BR, {c0}u, {cw}u, LDQ)");
                    self.stage_resident(&mut m, &g, &stage, &[&K_ROWS, &V_ROWS]);
                } else {
                    m.push_str("    stage_kv(K_S, V_S, b, j0, g, BR, 0u, D, LDQ);\n");
                    if resident {
                        m.push_str("    workgroupBarrier();\n");
                        fragments(&mut m, &g, "    ", &K_ROWS, nd);
                        fragments(&mut m, &g, "    ", &V_ROWS, nd);
                    }
                }
                if self.probe.is_some() {
                    // A probe stages the first head's first tile alone.
                    let stage = if self.tile().prefetch {
                        "put_q_tile()"
                    } else {
                        "stage_q_tile(b, i0, h)"
                    };
                    let _ = write!(
                        m,
                        "    for (var hh = 0u; hh < p.group; hh++) {{\n        let h = g * p.group + hh;\n        for (var i0 = i_first; i0 < i_end; i0 += BC) {{\n            workgroupBarrier();\n            if hh == 0u && i0 == i_first {{\n                {stage};\n            }}\n            workgroupBarrier();\n"
                    );
                } else if self.double() {
                    // As the forward's (`kv_loop_head`), the next tile
                    // the next of this head's or the first of the next
                    // head's, and none after the last head's last.
                    m.push_str("    workgroupBarrier();\n    put_q_tile(0u, 0u);\n    workgroupBarrier();\n    var sb = 0u;\n    var st = 0u;\n    for (var hh = 0u; hh < p.group; hh++) {\n        let h = g * p.group + hh;\n        for (var i0 = i_first; i0 < i_end; i0 += BC) {\n            var more = true;\n            if i0 + BC < i_end {\n                fetch_q_tile(b, i0 + BC, h);\n            } else if hh + 1u < p.group {\n                fetch_q_tile(b, i_first, h + 1u);\n            } else {\n                more = false;\n            }\n");
                } else if self.tile().prefetch {
                    // The next tile is the next of this head's, or the
                    // first of the next head's (every head has one: i_first
                    // ≤ j0 < i_end).
                    m.push_str("    for (var hh = 0u; hh < p.group; hh++) {\n        let h = g * p.group + hh;\n        for (var i0 = i_first; i0 < i_end; i0 += BC) {\n            workgroupBarrier();\n            put_q_tile();\n            workgroupBarrier();\n            if i0 + BC < i_end {\n                fetch_q_tile(b, i0 + BC, h);\n            } else if hh + 1u < p.group {\n                fetch_q_tile(b, i_first, h + 1u);\n            }\n");
                } else {
                    m.push_str("    for (var hh = 0u; hh < p.group; hh++) {\n        let h = g * p.group + hh;\n        for (var i0 = i_first; i0 < i_end; i0 += BC) {\n            workgroupBarrier();\n            stage_q_tile(b, i0, h);\n            workgroupBarrier();\n");
                }
                m.push_str("            for (var qf = 0u; qf < BC / 16u; qf++) {\n");
                if !resident {
                    fragments(&mut m, &g, "                ", &K_ROWS, nd);
                }
                let (qs, dos) = (format!("Q_S{}", self.sb()), format!("DO_S{}", self.sb()));
                score(&mut m, "                ", &K_ROWS, &qs, "qf", "ci", "cs");
                if !resident {
                    fragments(&mut m, &g, "                ", &V_ROWS, nd);
                }
                score(&mut m, "                ", &V_ROWS, &dos, "qf", "ct", "SCR + cs");
                let _ = write!(
                    m,
                    "            }}\n            row_sync();\n            {}\n            row_sync();\n",
                    self.ds_tile_call(if self.double() {
                        "ds_tile_dkv(sg, lane, b, j0, i0, h, st);"
                    } else {
                        "ds_tile_dkv(sg, lane, b, j0, i0, h, 0u);"
                    })
                );
                fragments(&mut m, &g, "            ", &P_ROWS, kf);
                fragments(&mut m, &g, "            ", &DS_ROWS, kf);
                for f in 0..nd {
                    let (bv, bk) = (format!("{dos} + {}u", 16 * f), format!("{qs} + {}u", 16 * f));
                    product(
                        &mut m,
                        &g,
                        "            ",
                        &format!("dv{f}"),
                        &P_ROWS,
                        (&bv, "16u * LDS", "lds", true),
                        kf,
                    );
                    product(
                        &mut m,
                        &g,
                        "            ",
                        &format!("dk{f}"),
                        &DS_ROWS,
                        (&bk, "16u * LDS", "lds", true),
                        kf,
                    );
                }
                if self.tile().fused_dq {
                    self.fused_dq(&mut m, &g, nd);
                }
                m.push_str(&self.stream_tail("            "));
                m.push_str("        }\n    }\n");
                for f in 0..nd {
                    for (name, is_k) in [("dk", true), ("dv", false)] {
                        let _ = writeln!(
                            m,
                            "    workgroupBarrier();\n    {}",
                            g.store(&format!("{name}{f}"), "cs", "ld16")
                        );
                        let _ = writeln!(
                            m,
                            "    workgroupBarrier();\n    store_dkv(sg, lane, {f}u, b, j0, g, {is_k});"
                        );
                    }
                }
                m.push_str("    store_max(wid, nwg);\n");
            }
        }
        m.push_str("}\n");
        m
    }

    /// dk/dv's dQ for the tile (`AttnTile::fused_dq`): the (BC/16)·(D/16)
    /// blocks of dSᵀ·K dealt round the subgroups, each summed over the
    /// workgroup's keys (every subgroup's rows of dSᵀ, so behind a
    /// workgroup barrier), then through the subgroup's two s_s regions in
    /// turn to `add_dq`.
    fn fused_dq(&self, m: &mut String, g: &Gen, nd: u32) {
        let t = self.tile();
        let blocks = t.bc / 16 * nd;
        let per = blocks.div_ceil(t.sg);
        if t.local {
            m.push_str("            workgroupBarrier();\n");
        }
        for u in 0..per {
            let _ = writeln!(
                m,
                "            {{\n                let blk = min(sg + {u}u * SG, {}u);\n                let qf = blk / {nd}u;\n                let df = blk % {nd}u;\n                acc = {};",
                blocks - 1,
                g.zero()
            );
            // A: dSᵀ's block (queries qf, keys kf) read column-major from
            // DS_S, whose rows are keys; B: K's (keys kf, columns df).
            if g.emu {
                let _ = writeln!(
                    m,
                    "                for (var kf = 0u; kf < SG; kf++) {{\n                    let ia = DS_S + kf * 16u * LDP + qf * 16u;\n                    let ib = K_S + kf * 16u * LDS + df * 16u;\n                    acc = {};\n                }}",
                    g.mma(
                        &g.load("A", "ia", "ldp", false),
                        &g.load("B", "ib", "lds", true),
                        "acc"
                    )
                );
            } else {
                for kf in 0..t.sg {
                    let _ = writeln!(
                        m,
                        "                {{\n                    let ia = DS_S + {}u * LDP + qf * 16u;\n                    let ib = K_S + {}u * LDS + df * 16u;\n                    let fa = {};\n                    acc = {};\n                }}",
                        16 * kf,
                        16 * kf,
                        g.load("A", "ia", "ldp", false),
                        g.mma("fa", &g.load("B", "ib", "lds", true), "acc")
                    );
                }
            }
            let _ = writeln!(
                m,
                "                let at = {}cs;\n                {}\n                row_sync();\n                add_dq(lane, at, sg + {u}u * SG < {blocks}u, qf, df, b, i0, h);",
                if u % 2 == 1 { "SCR + " } else { "" },
                g.store("acc", "at", "ld16")
            );
            if u + 2 < per {
                m.push_str("                row_sync();\n");
            }
            m.push_str("            }\n");
        }
    }

    /// The resident block staged and the fragments of each of `rows`
    /// loaded, slice by slice ([`AttnTile::split`]): the slice's columns
    /// staged (`stage(first column, columns)`: the shader's call), a
    /// barrier, its fragments loaded, and a barrier before the next slice
    /// takes the region (the last one's is the streamed loop's first).
    fn stage_resident(&self, m: &mut String, g: &Gen, stage: &dyn Fn(u32, u32) -> String, rows: &[&Frags]) {
        let nd = self.d / 16;
        let (per, slices) = self.slices();
        for s in 0..slices {
            let (f0, f1) = (s * per, ((s + 1) * per).min(nd));
            if s > 0 {
                m.push_str("    workgroupBarrier();\n");
            }
            let _ = writeln!(
                m,
                "    {};\n    workgroupBarrier();",
                stage(16 * f0, 16 * (f1 - f0))
            );
            for a in rows {
                fragments_from(m, g, "    ", a, f0..f1);
            }
        }
    }

    /// The forward's body: Q's fragments loaded once, O in `nd`
    /// accumulators for the whole key loop, `nb` of them through s_s per
    /// pair of barriers when rows are rescaled and at the end.
    fn forward(&self, m: &mut String, g: &Gen, nd: u32, nb: u32) {
        let kf = self.tile().bc / 16;
        m.push_str(self.kv_loop_bounds());
        m.push_str("    m_run = NO_MAX;\n    l_run = 0.0;\n");
        let stage = |c0, cw| format!("stage_q(b, p0, np, g, {c0}u, {cw}u)");
        self.stage_resident(m, g, &stage, &[&Q_ROWS]);
        for f in 0..nd {
            let _ = writeln!(m, "    var o{f} = {};", g.zero());
        }
        m.push_str(self.kv_loop_head());
        // S = Q Kᵀ, 16 x BC per subgroup, into s_s.
        let _ = writeln!(
            m,
            "        for (var jf = 0u; jf < BC / 16u; jf++) {{\n            acc = {};",
            g.zero()
        );
        product(
            m,
            g,
            "            ",
            "acc",
            &Q_ROWS,
            (&format!("K_S{} + jf * 16u * LDS", self.sb()), "16u", "lds", false),
            nd,
        );
        // The rows' P and factors are in before the products read them:
        // through the workgroup-uniform load of `rescale` (the two-pass
        // softmax), or (LOCAL) a subgroup barrier, the subgroup then
        // choosing its rescale alone; or (the one-pass softmax) the
        // barrier where a row's halves meet, `rescale` set before it: where
        // a row takes P again a barrier after it (P and the factors taken
        // again, the scores read for them), and where one rescales O, O
        // through the scratch.
        let (rescale_if, sync) = if self.tile().local {
            ("row_sync();\n        if subgroupAny(raised) {", "row_sync")
        } else if self.early_flag() {
            (
                "let flags = atomicLoad(&wg.rescale);\n        if flags != 0u {\n            workgroupBarrier();\n            if flags > 1u {",
                "workgroupBarrier",
            )
        } else {
            ("if workgroupUniformLoad(&wg.rescale) != 0u {", "workgroupBarrier")
        };
        let _ = writeln!(
            m,
            "            let ci = cs + jf * 16u;\n            {}\n        }}\n        row_sync();\n        {}\n        {rescale_if}",
            g.store("acc", "ci", "ldc"),
            if self.probe == Some(AttnProbe::Plain) {
                // The one-pass softmax's barrier where the halves meet.
                if self.early_flag() {
                    "plain_tile(sg, lane);\n        row_sync();"
                } else {
                    "plain_tile(sg, lane);"
                }
            } else if self.tile().two_pass {
                "softmax_tile_two_pass(sg, lane, b, j0, p0, np, g);"
            } else {
                "softmax_tile(sg, lane, b, j0, p0, np, g);"
            }
        );
        through_scratch(m, g, (nd, nb), "            ", (true, sync), |m, _, u| {
            let _ = writeln!(m, "                rescale_rows(sg, lane, {u}u);");
        });
        if self.early_flag() {
            m.push_str("            }\n");
        }
        if !self.tile().local {
            m.push_str(
                "            if li == 0u {\n                atomicStore(&wg.rescale, 0u);\n            }\n",
            );
        }
        m.push_str("        }\n");
        // O += P V, P's fragments loaded once per tile.
        fragments(m, g, "        ", &P_ROWS, kf);
        for f in 0..nd {
            let b = format!("V_S{} + {}u", self.sb(), 16 * f);
            product(
                m,
                g,
                "        ",
                &format!("o{f}"),
                &P_ROWS,
                (&b, "16u * LDS", "lds", true),
                kf,
            );
        }
        m.push_str(&self.stream_tail("        "));
        m.push_str("    }\n    finish_sums(sg, lane, b, p0, np, g);\n");
        through_scratch(m, g, (nd, nb), "    ", (false, "workgroupBarrier"), |m, df, u| {
            let _ = writeln!(m, "        write_o(sg, lane, {df}u, {u}u, b, p0, np, g);");
        });
        m.push_str("    store_max(wid, nwg);\n");
    }
}

/// [`AttnProbe::Plain`]'s stand-in for `softmax_tile`: the same lanes
/// read the same scores and write P, with no exponential, mask or max.
const PLAIN_TILE: &str = "
// Timing probe (AttnProbe::Plain, generated): P = S·scale in f16, the sums
// added; no exponential, mask, max or exchange between a row's lanes.
fn plain_tile(sg: u32, lane: u32) {
    let r = sg * 16u + lane % 16u;
    let base = sg * 16u * BC + (lane % 16u) * BC;
    var l = l_run;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        let pr = wg.s_s[base + c] * p.scale;
        l += pr;
        wg.sm[P_S + r * LDP + c] = to_half(pr);
    }
    l_run = l;
}
";

/// [`AttnProbe::Plain`]'s stand-in for `ds_tile_dq` and `ds_tile_dkv`: the
/// same lanes read S and dP and write P and dS, with no exponential, mask
/// or statistic.
const PLAIN_DS_TILE: &str = "
// Timing probe (AttnProbe::Plain, generated): P = S·scale and dS =
// dP·scale in f16; no exponential, mask or statistic.
fn plain_ds_tile(sg: u32, lane: u32) {
    let rr = lane % 16u;
    for (var k = 0u; k < BC / 2u; k++) {
        let c = half_col(lane, k);
        let si = sg * 16u * BC + rr * BC + c;
        let pi = (sg * 16u + rr) * LDP + c;
        wg.sm[P_S + pi] = to_half(wg.s_s[si] * p.scale);
        wg.sm[DS_S + pi] = to_half(wg.s_s[SCR + si] * p.scale);
    }
}
";

/// Code for the cooperative-matrix operations, real or emulated.
struct Gen {
    emu: bool,
}

impl Gen {
    fn zero(&self) -> &'static str {
        if self.emu {
            "array<f32, 8>()"
        } else {
            "coop_mat16x16<f32, C>()"
        }
    }

    fn load(&self, role: &str, idx: &str, stride: &str, row_major: bool) -> String {
        if self.emu {
            format!("Frag({idx}, {stride}, {row_major})")
        } else {
            let f = if row_major { "coopLoadT" } else { "coopLoad" };
            format!("{f}<coop_mat16x16<f16, {role}>>(&wg.sm[{idx}], {stride})")
        }
    }

    fn mma(&self, a: &str, b: &str, c: &str) -> String {
        if self.emu {
            format!("emu_mma({a}, {b}, {c}, lane)")
        } else {
            format!("coopMultiplyAdd({a}, {b}, {c})")
        }
    }

    /// An accumulator loaded back from s_s (row-major, as `store` left it).
    fn load_c(&self, idx: &str, stride: &str) -> String {
        if self.emu {
            format!("emu_load_t({idx}, {stride}, lane)")
        } else {
            format!("coopLoadT<coop_mat16x16<f32, C>>(&wg.s_s[{idx}], {stride})")
        }
    }

    fn store(&self, acc: &str, idx: &str, stride: &str) -> String {
        if self.emu {
            format!("emu_store_t({acc}, {idx}, {stride}, lane);")
        } else {
            format!("coopStoreT({acc}, &wg.s_s[{idx}], {stride});")
        }
    }
}

/// A subgroup's row-major A fragments along a row of 16 x 16 blocks of a
/// workgroup tile: fragment k at `base + 16·k`, row stride `stride`.
struct Frags {
    name: &'static str,
    base: &'static str,
    stride: &'static str,
}

const fn frags(name: &'static str, base: &'static str, stride: &'static str) -> Frags {
    Frags { name, base, stride }
}

const Q_ROWS: Frags = frags("q", "Q_S + sg * 16u * LDQ", "ldq");
const DO_ROWS: Frags = frags("dof", "DO_S + sg * 16u * LDQ", "ldq");
const K_ROWS: Frags = frags("kr", "K_S + sg * 16u * LDQ", "ldq");
const V_ROWS: Frags = frags("vr", "V_S + sg * 16u * LDQ", "ldq");
const P_ROWS: Frags = frags("pf", "P_S + sg * 16u * LDP", "ldp");
const DS_ROWS: Frags = frags("dsf", "DS_S + sg * 16u * LDP", "ldp");

/// On hardware, `let {name}{k}` = fragment k for k < n, loaded once (used
/// by every `product` until the tile changes). Emulated, a fragment is
/// where it lies in workgroup memory, so nothing is loaded ahead.
fn fragments(m: &mut String, g: &Gen, indent: &str, a: &Frags, n: u32) {
    fragments_from(m, g, indent, a, 0..n);
}

/// As [`fragments`], fragments `ks` of a row staged from its fragment
/// `ks.start` on (a slice of the resident block): `{name}{k}` at `base +
/// 16·(k − ks.start)`.
fn fragments_from(m: &mut String, g: &Gen, indent: &str, a: &Frags, ks: std::ops::Range<u32>) {
    if g.emu {
        return;
    }
    let k0 = ks.start;
    for k in ks {
        let _ = writeln!(
            m,
            "{indent}let i{0}{k} = {1} + {2}u;\n{indent}let {0}{k} = {3};",
            a.name,
            a.base,
            16 * (k - k0),
            g.load("A", &format!("i{}{k}", a.name), a.stride, true)
        );
    }
}

/// acc += Σ_k A_k · B_k over k < n: A_k fragment k of `a`, B_k the 16 x 16
/// fragment at `b.0 + k·b.1` (stride `b.2`, row-major or not), loaded
/// where it is used. Unrolled on hardware (A from registers); a loop when
/// emulated, where every multiply-add is a loop of its own that lavapipe's
/// compiler would otherwise inline at each of the unrolled sites.
fn product(m: &mut String, g: &Gen, indent: &str, acc: &str, a: &Frags, b: (&str, &str, &str, bool), n: u32) {
    if g.emu {
        let _ = writeln!(
            m,
            "{indent}for (var kk = 0u; kk < {n}u; kk++) {{\n{indent}    let ia = {} + kk * 16u;\n{indent}    let ib = {} + kk * {};\n{indent}    {acc} = {};\n{indent}}}",
            a.base,
            b.0,
            b.1,
            g.mma(
                &g.load("A", "ia", a.stride, true),
                &g.load("B", "ib", b.2, b.3),
                acc
            )
        );
        return;
    }
    for k in 0..n {
        let _ = writeln!(
            m,
            "{indent}{{\n{indent}    let ib = {} + {k}u * {};\n{indent}    {acc} = {};\n{indent}}}",
            b.0,
            b.1,
            g.mma(&format!("{}{k}", a.name), &g.load("B", "ib", b.2, b.3), acc)
        );
    }
}

/// The forward's `nd` accumulators o0, o1, ... through the subgroup's s_s
/// region, `nb` per round: stored, a barrier (`sync`: the WGSL function
/// called), `visit(fragment, block)` per fragment (the lanes' work on
/// them), a barrier; and with `back`, loaded again (the rescale), with a
/// barrier before the next round reuses the region.
fn through_scratch(
    m: &mut String,
    g: &Gen,
    (nd, nb): (u32, u32),
    indent: &str,
    (back, sync): (bool, &str),
    visit: impl Fn(&mut String, u32, u32),
) {
    for d0 in (0..nd).step_by(nb as usize) {
        let _ = writeln!(m, "{indent}{{");
        for u in 0..nb {
            let _ = writeln!(
                m,
                "{indent}    let c{u} = cs + {}u;\n{indent}    {}",
                256 * u,
                g.store(&format!("o{}", d0 + u), &format!("c{u}"), "ld16")
            );
        }
        let _ = writeln!(m, "{indent}    {sync}();");
        for u in 0..nb {
            visit(m, d0 + u, u);
        }
        let _ = writeln!(m, "{indent}    {sync}();");
        if back {
            for u in 0..nb {
                let _ = writeln!(
                    m,
                    "{indent}    o{} = {};",
                    d0 + u,
                    g.load_c(&format!("c{u}"), "ld16")
                );
            }
            let _ = writeln!(m, "{indent}    {sync}();");
        }
        let _ = writeln!(m, "{indent}}}");
    }
}

/// Fragments of O the forward takes through s_s per pair of barriers: as
/// many as the subgroup's region holds (`blocks`), cut to a divisor of the
/// `fragments` of D so that every round is whole.
fn pv_blocks(blocks: u32, fragments: u32) -> u32 {
    (1..=blocks)
        .rev()
        .find(|b| fragments.is_multiple_of(*b))
        .unwrap_or(1)
}

/// The text of `//// name` up to the next section of attention_coop.wgsl.
fn section(name: &str) -> &'static str {
    crate::kernels::wgsl_section(ATTN, "attention_coop.wgsl", name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coop::WORKGROUP_BYTES_MAX;

    /// The hardware variant of `pass` at head dimension `d` on `tile`, its
    /// inputs f16 copies.
    fn hardware(pass: AttnPass, d: u32, tile: AttnTile) -> CoopAttention {
        CoopAttention {
            pass,
            d,
            emulated: false,
            f16_in: true,
            shape: Some(tile),
            probe: None,
        }
    }

    #[test]
    fn every_swept_variant_fits_nvidia_workgroup_memory() {
        for v in CoopAttention::swept() {
            let bytes = v.workgroup_bytes();
            assert!(bytes <= WORKGROUP_BYTES_MAX, "{}: {bytes} B", v.label());
            let [sm, s_s, ..] = v.shared_members();
            assert_eq!((sm % 16, s_s % 16), (0, 0), "{}", v.label());
        }
    }

    #[test]
    fn every_variant_fits_its_workgroup_memory() {
        for v in CoopAttention::all() {
            let bytes = v.workgroup_bytes();
            if v.emulated {
                // lavapipe's 32 KiB; the backward's four D-wide tiles at
                // D = 128 do not fit and are refused at dispatch.
                let fits = bytes <= 32 << 10;
                assert_eq!(
                    fits,
                    v.pass == AttnPass::Fwd || v.d <= 96,
                    "{}: {bytes} B",
                    v.label()
                );
            } else {
                assert!(bytes <= WORKGROUP_BYTES_MAX, "{}: {bytes} B", v.label());
            }
        }
    }

    /// Double-buffered streamed tiles (`AttnTile::double`) wait at one
    /// workgroup barrier a tile where a single copy waits at two, in every
    /// pass (the rows synchronised within subgroups, `l`, so that no other
    /// workgroup barrier is in the loop), and stage into their second copy.
    #[test]
    fn double_buffered_loops_wait_once_a_tile() {
        // The workgroup barriers of the loop over streamed tiles (dk/dv's
        // over heads, around it).
        let in_loop = |v: &CoopAttention| {
            let src = v.source();
            let body = src.split_once("fn main(").unwrap().1;
            let start = body
                .find("    for (var j0")
                .or_else(|| body.find("    for (var hh"))
                .unwrap();
            let end = start + body[start..].find("\n    }\n").unwrap();
            body[start..end].matches("workgroupBarrier()").count()
        };
        for pass in [AttnPass::Fwd, AttnPass::Dq, AttnPass::Dkv] {
            for d in CoopAttention::HEAD_DIMS {
                for double in [false, true] {
                    let tile = AttnTile {
                        sg: 4,
                        bc: 16,
                        share: true,
                        prefetch: true,
                        double,
                        two_pass: false,
                        local: true,
                        fused_dq: false,
                        split: 2,
                    };
                    let v = hardware(pass, d, tile);
                    let want = if double { 1 } else { 2 };
                    assert_eq!(in_loop(&v), want, "{}", v.label());
                    assert_eq!(v.source().contains("STREAM - sb"), double, "{}", v.label());
                    // A probe stages its first tile alone, in one copy.
                    let probe = CoopAttention {
                        probe: Some(AttnProbe::Staged),
                        ..v
                    };
                    assert_eq!(in_loop(&probe), 2, "{}", probe.label());
                }
            }
        }
    }

    /// The forward's one-pass softmax on rows synchronised across the
    /// workgroup reads its rescale flag after the barrier where a row's
    /// halves meet, with no workgroup-uniform load (a barrier on each side
    /// of it) as the two-pass way (`t`) has; subgroup-local rows vote.
    #[test]
    fn the_one_pass_forward_loads_no_uniform_flag() {
        for d in CoopAttention::HEAD_DIMS {
            for emulated in [false, true] {
                let v = CoopAttention {
                    pass: AttnPass::Fwd,
                    d,
                    emulated,
                    f16_in: true,
                    shape: None,
                    probe: None,
                };
                let two = CoopAttention {
                    shape: Some(AttnTile {
                        two_pass: true,
                        ..v.tile()
                    }),
                    ..v
                };
                assert!(!v.source().contains("workgroupUniformLoad"), "{}", v.label());
                assert!(v.source().contains("atomicLoad(&wg.rescale)"), "{}", v.label());
                assert!(
                    two.source().contains("workgroupUniformLoad(&wg.rescale)"),
                    "{}",
                    two.label()
                );
            }
        }
    }

    /// `Shared` (attention_coop.wgsl) puts s_s and stat_s after the f16
    /// tiles: each starts on 16 bytes, as cooperative loads and stores need.
    #[test]
    fn scratch_starts_on_16_bytes() {
        for v in CoopAttention::all().into_iter().filter(|v| !v.emulated) {
            let [sm, s_s, ..] = v.shared_members();
            assert_eq!(sm % 16, 0, "{}: sm {sm} B", v.label());
            assert_eq!(s_s % 16, 0, "{}: s_s {s_s} B", v.label());
        }
    }

    /// A resident block staged in slices (`AttnTile::split`) stages every
    /// column of D once, a slice at a time, in a region as wide as the
    /// widest slice; and each fragment is loaded once, after its slice.
    #[test]
    fn slices_stage_every_column_once() {
        for pass in [AttnPass::Fwd, AttnPass::Dq, AttnPass::Dkv] {
            for d in CoopAttention::HEAD_DIMS {
                for split in 1..=8 {
                    let tile = AttnTile {
                        sg: 4,
                        bc: 16,
                        share: true,
                        prefetch: false,
                        double: false,
                        two_pass: false,
                        local: false,
                        fused_dq: false,
                        split,
                    };
                    let v = hardware(pass, d, tile);
                    let (per, slices) = v.slices();
                    let nd = d / 16;
                    assert!(slices <= split.max(1) && (slices - 1) * per < nd && slices * per >= nd);
                    assert_eq!(v.ldq(), 16 * per + 8);
                    let src = v.source();
                    let call = match pass {
                        AttnPass::Fwd => "    stage_q(",
                        AttnPass::Dq => "    stage_q_do(",
                        AttnPass::Dkv => "    stage_kv(K_S, V_S, b, j0, g, BR,",
                    };
                    let calls: Vec<&str> = src.lines().filter(|l| l.starts_with(call)).collect();
                    assert_eq!(calls.len() as u32, slices, "{}", v.label());
                    // Columns c0, cw of each call, in order, covering 0..D.
                    let mut next = 0;
                    for c in &calls {
                        let nums: Vec<u32> = c
                            .split(|ch: char| !ch.is_ascii_digit())
                            .filter_map(|n| n.parse().ok())
                            .collect();
                        let [.., c0, cw] = nums[..] else { panic!("{c}") };
                        assert_eq!(c0, next, "{}: {c}", v.label());
                        assert!(cw > 0 && cw <= 16 * per, "{}: {c}", v.label());
                        next += cw;
                    }
                    assert_eq!(next, d, "{}", v.label());
                    let first = match pass {
                        AttnPass::Dkv => "kr",
                        _ => "q",
                    };
                    for k in 0..nd {
                        let load = format!("let {first}{k} = ");
                        assert_eq!(src.matches(&load).count(), 1, "{}: {load}", v.label());
                    }
                }
            }
        }
    }

    #[test]
    fn pv_rounds_are_whole() {
        // (blocks in the region, fragments of D) -> fragments per round.
        for (blocks, frags, want) in [(2, 4, 2), (2, 5, 1), (2, 6, 2), (2, 8, 2), (1, 8, 1), (4, 6, 3)] {
            assert_eq!(
                pv_blocks(blocks, frags),
                want,
                "{blocks} blocks, {frags} fragments"
            );
        }
    }

    /// The regions a kernel uses at once never overlap: the resident
    /// block's and the streamed tiles' among themselves; and, unless the
    /// tile shares them (the resident block only staged before the first
    /// streamed tile), the two with each other.
    #[test]
    fn regions_do_not_overlap() {
        for v in CoopAttention::all().into_iter().chain(CoopAttention::swept()) {
            let t = v.tile();
            let [q, k, vv, dout, p, ds, sm] = v.layout();
            let (lds, ldq, ldp) = (v.d + 8, v.ldq(), t.bc + 8);
            let (qr, kr) = match v.pass {
                AttnPass::Dkv => (t.bc, t.br()),
                AttnPass::Fwd | AttnPass::Dq => (t.br(), t.bc),
            };
            // (resident, streamed) spans.
            let mut resident = Vec::new();
            let mut streamed = vec![(p, p + t.br() * ldp)];
            // The resident block's rows are ldq apart, the streamed tiles' lds.
            let (ldq_q, ldq_k) = match v.pass {
                AttnPass::Dkv => (lds, ldq),
                AttnPass::Fwd | AttnPass::Dq => (ldq, lds),
            };
            let (qs, ks) = ((q, q + qr * ldq_q), (k, k + kr * ldq_k));
            let vs = (vv, vv + kr * ldq_k);
            match v.pass {
                AttnPass::Dkv => {
                    resident.extend([ks, vs]);
                    streamed.extend([qs, (dout, dout + qr * lds), (ds, ds + t.br() * ldp)]);
                }
                AttnPass::Fwd => {
                    resident.push(qs);
                    streamed.extend([ks, vs]);
                }
                AttnPass::Dq => {
                    resident.extend([qs, (dout, dout + qr * ldq)]);
                    streamed.extend([ks, vs, (ds, ds + t.br() * ldp)]);
                }
            }
            let mut sets = vec![resident.clone(), streamed.clone()];
            if !t.share {
                sets.push(resident.into_iter().chain(streamed).collect());
            }
            for mut spans in sets {
                spans.sort();
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0, "{}: {spans:?}", v.label());
                }
                assert!(spans.last().unwrap().1 <= sm, "{}", v.label());
            }
        }
    }
}
