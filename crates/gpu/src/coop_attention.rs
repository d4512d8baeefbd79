//! The tensor-core flash-attention family: WGSL for each pass and head
//! dimension, put together from the sections of `shaders/attention_coop.wgsl`
//! and generated code (constants, workgroup-memory layout and the fragment
//! loads, multiply-adds and stores), like the matmul family of `crate::coop`.
//! The emulated variants run the same kernels with the cooperative-matrix
//! operations in plain WGSL (smaller tiles, to fit 32 KiB of workgroup
//! memory in f32), so that lavapipe checks their indexing and masking.

use std::fmt::Write;

use crate::coop::section as matmul_section;

const SCALE: &str = include_str!("../../../shaders/matmul_scale.wgsl");
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
}

/// Sizes of a variant: subgroups (16 resident rows each) and the rows of
/// each streamed tile.
#[derive(Debug, Clone, Copy)]
pub struct AttnTile {
    pub sg: u32,
    pub bc: u32,
}

impl AttnTile {
    /// Rows of the resident block.
    pub fn br(&self) -> u32 {
        self.sg * 16
    }
}

impl CoopAttention {
    /// The head dimensions the family is generated for (the zoo's).
    pub const HEAD_DIMS: [u32; 4] = [64, 80, 96, 128];

    pub fn all() -> Vec<CoopAttention> {
        let mut v = Vec::new();
        for pass in [AttnPass::Fwd, AttnPass::Dq, AttnPass::Dkv] {
            for d in Self::HEAD_DIMS {
                for emulated in [false, true] {
                    v.push(CoopAttention { pass, d, emulated });
                }
            }
        }
        v
    }

    pub fn tile(&self) -> AttnTile {
        match (self.emulated, self.pass) {
            // The forward's D = 64 at the hardware's BC, which fits 32 KiB
            // in f32, so that its rounds of two O fragments run here too.
            (true, AttnPass::Fwd) if self.d <= 64 => AttnTile { sg: 1, bc: 32 },
            (true, _) => AttnTile { sg: 1, bc: 16 },
            (false, AttnPass::Fwd) => AttnTile { sg: 4, bc: 32 },
            (false, _) => AttnTile { sg: 2, bc: 32 },
        }
    }

    /// Offsets (in halfs) of the f16 regions in `sm` and its length:
    /// (Q_S, K_S, V_S, DO_S, P_S, DS_S, SM). Unused regions are empty.
    fn layout(&self) -> [u32; 7] {
        let t = self.tile();
        let (lds, ldp, br, bc) = (self.d + 8, t.bc + 8, t.br(), t.bc);
        match self.pass {
            AttnPass::Fwd => {
                let k = br * lds;
                let v = k + bc * lds;
                let p = v + bc * lds;
                [0, k, v, p, p, p + br * ldp, p + br * ldp]
            }
            AttnPass::Dq => {
                let dout = br * lds;
                let k = 2 * br * lds;
                let v = k + bc * lds;
                let p = v + bc * lds;
                [0, k, v, dout, p, p + br * ldp, p + 2 * br * ldp]
            }
            AttnPass::Dkv => {
                let v = br * lds;
                let q = 2 * br * lds;
                let dout = q + bc * lds;
                let p = dout + bc * lds;
                [q, 0, v, dout, p, p + br * ldp, p + 2 * br * ldp]
            }
        }
    }

    fn scratch_regions(&self) -> u32 {
        if self.pass == AttnPass::Fwd { 1 } else { 2 }
    }

    fn stat_len(&self) -> u32 {
        let t = self.tile();
        2 * t.br().max(t.bc)
    }

    /// Bytes of workgroup memory the variant declares.
    pub fn workgroup_bytes(&self) -> u32 {
        let t = self.tile();
        let half = if self.emulated { 4 } else { 2 };
        self.layout()[6] * half + self.scratch_regions() * t.sg * 16 * t.bc * 4 + self.stat_len() * 4
    }

    pub fn label(&self) -> String {
        let pass = match self.pass {
            AttnPass::Fwd => "fwd",
            AttnPass::Dq => "dq",
            AttnPass::Dkv => "dkv",
        };
        format!(
            "flash_{pass}_d{}{}",
            self.d,
            if self.emulated { "_sw" } else { "" }
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
            AttnPass::Dkv => 4,
        };
        products * frags * (mma + 1) + 2 * bc * d / threads + 4 * bc + d
    }

    /// The WGSL of this variant (entry point `main`).
    pub fn source(&self) -> String {
        let t = self.tile();
        assert!(self.d.is_multiple_of(16) && t.bc.is_multiple_of(16));
        let [q_s, k_s, v_s, do_s, p_s, ds_s, sm] = self.layout();
        let mut out = String::with_capacity(32 << 10);
        if !self.emulated {
            out.push_str("enable f16;\nenable wgpu_cooperative_matrix;\n\n");
        }
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
            "const Q_S: u32 = {q_s}u;\nconst K_S: u32 = {k_s}u;\nconst V_S: u32 = {v_s}u;\nconst DO_S: u32 = {do_s}u;\nconst P_S: u32 = {p_s}u;\nconst DS_S: u32 = {ds_s}u;\nconst SM: u32 = {sm}u;"
        );
        let _ = writeln!(
            out,
            "const NSCR: u32 = {}u;\nconst STAT: u32 = {}u;\n",
            self.scratch_regions(),
            self.stat_len()
        );
        out.push_str(SCALE);
        out.push_str(matmul_section(if self.emulated { "half_sw" } else { "half_hw" }));
        out.push_str(section("common"));
        if self.emulated {
            out.push_str(&crate::coop::emulation("sm", "sm", "s_s"));
        }
        match self.pass {
            AttnPass::Fwd => out.push_str(section("fwd")),
            AttnPass::Dq => {
                out.push_str(section("bwd"));
                out.push_str(section("dq"));
            }
            AttnPass::Dkv => {
                out.push_str(section("bwd"));
                out.push_str(section("dkv"));
            }
        }
        out.push_str(&self.main());
        out
    }

    fn main(&self) -> String {
        let g = Gen { emu: self.emulated };
        let nd = self.d / 16;
        let nb = pv_blocks(self.tile().bc / 16, nd);
        let mut m = String::new();
        m.push_str(
            "\n@compute @workgroup_size(THREADS, 1, 1)\nfn main(\n    @builtin(workgroup_id) wid: vec3<u32>,\n    @builtin(local_invocation_index) local_index: u32,\n) {\n",
        );
        m.push_str(
            "    li = local_index;\n    e_q = scale_exponent(p.q_slot);\n    e_k = scale_exponent(p.k_slot);\n    e_v = scale_exponent(p.v_slot);\n    e_do = scale_exponent(p.do_slot);\n    init_steps();\n    let sg = li / 32u;\n    let lane = li % 32u;\n    let b = wid.z;\n    let g = wid.y;\n    let lds = LDS;\n    let ldp = LDP;\n    let ldc = BC;\n    let ld16 = 16u;\n    let cs = sg * 16u * BC;\n",
        );
        let _ = writeln!(m, "    var acc = {};", g.zero());
        // acc = Σ_k A(16 x 16 at a + k·a_step) · B(16 x 16 at b + k·b_step)
        // over `n` steps, both as the given orientations.
        let product = |m: &mut String,
                       indent: &str,
                       acc: &str,
                       a: (&str, &str, &str, bool),
                       b: (&str, &str, &str, bool),
                       n: &str| {
            let _ = writeln!(m, "{indent}for (var kk = 0u; kk < {n}; kk++) {{");
            let _ = writeln!(m, "{indent}    let ia = {} + kk * {};", a.0, a.1);
            let _ = writeln!(m, "{indent}    let fa = {};", g.load("A", "ia", a.2, a.3));
            let _ = writeln!(m, "{indent}    let ib = {} + kk * {};", b.0, b.1);
            let _ = writeln!(m, "{indent}    let fb = {};", g.load("B", "ib", b.2, b.3));
            let _ = writeln!(m, "{indent}    {acc} = {};", g.mma("fa", "fb", acc));
            let _ = writeln!(m, "{indent}}}");
        };
        // One 16 x 16 block of scores: acc = R·Cᵀ over D, R the subgroup's
        // 16 rows of the tile at `rows`, C the 16 rows of the tile at
        // `cols` that fragment `f` picks, stored to the workgroup scratch at
        // `at + f·16` (named `name` in the shader).
        let score = |m: &mut String, indent: &str, rows: &str, cols: &str, f: &str, name: &str, at: &str| {
            let (a, b) = (
                format!("{rows} + sg * 16u * LDS"),
                format!("{cols} + {f} * 16u * LDS"),
            );
            let at = format!("{at} + {f} * 16u");
            let _ = writeln!(m, "{indent}acc = {};", g.zero());
            product(
                m,
                indent,
                "acc",
                (&a, "16u", "lds", true),
                (&b, "16u", "lds", false),
                "D / 16u",
            );
            let _ = writeln!(
                m,
                "{indent}let {name} = {at};\n{indent}{}",
                g.store("acc", name, "ldc")
            );
        };
        match self.pass {
            AttnPass::Fwd => {
                m.push_str("    let np = BR / p.group;\n    let p0 = wid.x * np;\n    m_run = -3.0e38;\n    l_run = 0.0;\n    stage_q(b, p0, np, g);\n    let kend = min(p.t, p0 + np);\n");
                m.push_str("    for (var j0 = 0u; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        stage_kv(K_S, V_S, b, j0, g, BC);\n        workgroupBarrier();\n");
                // S = Q Kᵀ, 16 x BC per subgroup, into s_s.
                m.push_str("        for (var jf = 0u; jf < BC / 16u; jf++) {\n");
                score(&mut m, "            ", "Q_S", "K_S", "jf", "ci", "cs");
                m.push_str("        }\n        workgroupBarrier();\n        softmax_tile(sg, lane, j0, p0, np, g);\n        workgroupBarrier();\n");
                // O += P V through s_s, whose region of the subgroup holds
                // BC / 16 blocks of 16 x 16: NB fragments of D go out and
                // come back per pair of barriers (NB divides D / 16).
                let _ = writeln!(
                    m,
                    "        for (var d0 = 0u; d0 < D / 16u; d0 += {nb}u) {{\n            for (var u = 0u; u < {nb}u; u++) {{\n                let df = d0 + u;"
                );
                let _ = writeln!(m, "                acc = {};", g.zero());
                product(
                    &mut m,
                    "                ",
                    "acc",
                    ("P_S + sg * 16u * LDP", "16u", "ldp", true),
                    ("V_S + df * 16u", "16u * LDS", "lds", true),
                    "BC / 16u",
                );
                let _ = writeln!(
                    m,
                    "                let co = cs + u * 256u;\n                {}",
                    g.store("acc", "co", "ld16")
                );
                let _ = writeln!(
                    m,
                    "            }}\n            workgroupBarrier();\n            for (var u = 0u; u < {nb}u; u++) {{\n                update_o(sg, lane, d0 + u, u);\n            }}\n            workgroupBarrier();\n        }}\n    }}"
                );
                m.push_str("    finish_fwd(sg, lane, b, p0, np, g);\n");
            }
            AttnPass::Dq => {
                for f in 0..nd {
                    let _ = writeln!(m, "    var dq{f} = {};", g.zero());
                }
                m.push_str("    let np = BR / p.group;\n    let p0 = wid.x * np;\n    stage_q_do(b, p0, np, g);\n    let kend = min(p.t, p0 + np);\n");
                m.push_str("    for (var j0 = 0u; j0 < kend; j0 += BC) {\n        workgroupBarrier();\n        stage_kv(K_S, V_S, b, j0, g, BC);\n        workgroupBarrier();\n");
                m.push_str("        for (var jf = 0u; jf < BC / 16u; jf++) {\n");
                score(&mut m, "            ", "Q_S", "K_S", "jf", "ci", "cs");
                score(&mut m, "            ", "DO_S", "V_S", "jf", "ct", "SCR + cs");
                m.push_str("        }\n        workgroupBarrier();\n        ds_tile_dq(sg, lane, j0, p0, np, g);\n        workgroupBarrier();\n");
                for f in 0..nd {
                    product(
                        &mut m,
                        "        ",
                        &format!("dq{f}"),
                        ("DS_S + sg * 16u * LDP", "16u", "ldp", true),
                        (&format!("K_S + {}u", 16 * f), "16u * LDS", "lds", true),
                        "BC / 16u",
                    );
                }
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
                m.push_str("    let j0 = wid.x * BR;\n    stage_kv(K_S, V_S, b, j0, g, BR);\n");
                m.push_str("    for (var hh = 0u; hh < p.group; hh++) {\n        let h = g * p.group + hh;\n        for (var i0 = j0 / BC * BC; i0 < p.t; i0 += BC) {\n            workgroupBarrier();\n            stage_q_tile(b, i0, h);\n            workgroupBarrier();\n");
                m.push_str("            for (var qf = 0u; qf < BC / 16u; qf++) {\n");
                score(&mut m, "                ", "K_S", "Q_S", "qf", "ci", "cs");
                score(&mut m, "                ", "V_S", "DO_S", "qf", "ct", "SCR + cs");
                m.push_str("            }\n            workgroupBarrier();\n            ds_tile_dkv(sg, lane, j0, i0);\n            workgroupBarrier();\n");
                for f in 0..nd {
                    product(
                        &mut m,
                        "            ",
                        &format!("dv{f}"),
                        ("P_S + sg * 16u * LDP", "16u", "ldp", true),
                        (&format!("DO_S + {}u", 16 * f), "16u * LDS", "lds", true),
                        "BC / 16u",
                    );
                    product(
                        &mut m,
                        "            ",
                        &format!("dk{f}"),
                        ("DS_S + sg * 16u * LDP", "16u", "ldp", true),
                        (&format!("Q_S + {}u", 16 * f), "16u * LDS", "lds", true),
                        "BC / 16u",
                    );
                }
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
            }
        }
        m.push_str("}\n");
        m
    }
}

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
            format!("{f}<coop_mat16x16<f16, {role}>>(&sm[{idx}], {stride})")
        }
    }

    fn mma(&self, a: &str, b: &str, c: &str) -> String {
        if self.emu {
            format!("emu_mma({a}, {b}, {c}, lane)")
        } else {
            format!("coopMultiplyAdd({a}, {b}, {c})")
        }
    }

    fn store(&self, acc: &str, idx: &str, stride: &str) -> String {
        if self.emu {
            format!("emu_store_t({acc}, {idx}, {stride}, lane);")
        } else {
            format!("coopStoreT({acc}, &s_s[{idx}], {stride});")
        }
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
    let marker = format!("//// {name}\n");
    let start = ATTN
        .find(&marker)
        .unwrap_or_else(|| panic!("attention_coop.wgsl has no section {name}"))
        + marker.len();
    let end = ATTN[start..]
        .find("\n//// ")
        .map_or(ATTN.len(), |e| start + e + 1);
    &ATTN[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coop::WORKGROUP_BYTES_MAX;

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

    #[test]
    fn regions_do_not_overlap() {
        for v in CoopAttention::all() {
            let t = v.tile();
            let [q, k, vv, dout, p, ds, sm] = v.layout();
            let (lds, ldp) = (v.d + 8, t.bc + 8);
            let (qr, kr) = match v.pass {
                AttnPass::Dkv => (t.bc, t.br()),
                AttnPass::Fwd | AttnPass::Dq => (t.br(), t.bc),
            };
            let mut spans = vec![
                (q, q + qr * lds),
                (k, k + kr * lds),
                (vv, vv + kr * lds),
                (p, p + t.br() * ldp),
            ];
            if v.pass != AttnPass::Fwd {
                spans.push((dout, dout + qr * lds));
                spans.push((ds, ds + t.br() * ldp));
            }
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].1 <= w[1].0, "{}: {spans:?}", v.label());
            }
            assert!(spans.last().unwrap().1 <= sm, "{}", v.label());
        }
    }
}
