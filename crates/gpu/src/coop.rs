//! The tensor-core matmul family: WGSL for each variant, put together from
//! the sections of `shaders/matmul_coop.wgsl` and generated code (tile
//! constants, the unrolled fragment loads, multiply-adds and stores, and
//! the unrolled operand loaders).
//!
//! A variant is an instantiation, not a branch: layout (ta, tb, tc), tile
//! shape, edge handling and the B operand's storage are all compile-time
//! constants of its pipeline, so the inner loop holds no runtime flag.

use std::fmt::Write;

const SCALE: &str = include_str!("../../../shaders/matmul_scale.wgsl");
const COOP: &str = include_str!("../../../shaders/matmul_coop.wgsl");

pub use crate::coop_tile::{CoopTile, KLoop, TileShape, WORKGROUP_BYTES_MAX};

/// One tensor-core matmul pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CoopMatmul {
    pub tile: CoopTile,
    pub ta: bool,
    pub tb: bool,
    /// Store C transposed ([N, M]).
    pub tc: bool,
    /// Bounds-checked scalar loads and stores (tiles on the M/N edges, K not
    /// a multiple of the K step, or operands not aligned for vector loads);
    /// otherwise whole tiles through vector loads.
    pub edge: bool,
    /// B is stored as f16 (a weight's f16 transport copy, or an operand's
    /// f16 copy under its scale), else f32.
    pub b_f16: bool,
    /// A is stored as f16 (an operand's f16 copy under its scale), else
    /// f32, scaled and converted as it is staged. Only with `b_f16`: the
    /// operands are copied together.
    pub a_f16: bool,
    /// The same kernel with the cooperative-matrix operations emulated in
    /// plain WGSL and f16 values held in f32: runs on any adapter (slowly),
    /// so that the kernels' indexing, staging, double buffering and
    /// epilogue are checked where no tensor cores are.
    pub emulated: bool,
    /// With the matmul epilogue (as `SimtMatmul::epi`).
    pub epi: bool,
    /// A timing probe in place of the K loop: a wrong product
    /// ([`CoopProbe`]). `None` in every variant the executor runs unless
    /// [`crate::GpuOptions::coop_probe`] asks.
    pub probe: Option<CoopProbe>,
}

/// The tensor-core matmul with parts of its K loop taken out, to find
/// where its time goes on a GPU: a Vulkan driver compiles the shader
/// into code of its own that no profiler we can reach through wgpu shows,
/// so the kernel is timed again with one part after another put back.
/// Each probe computes a wrong product (its operands are read once, or
/// not at all); only the matmul bench runs them (`MEGATRAIN_COOP_PROBE`),
/// through [`crate::GpuOptions::coop_probe`]. From the least of the loop
/// to the most; the real kernel adds each step's reads from global memory
/// to [`CoopProbe::Staging`]. Every probe runs the real kernel's
/// multiply-adds, stores and epilogue, so its time reads as the real
/// product's FLOPs at that rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CoopProbe {
    /// The multiply-adds alone, on fragments loaded once before the loop.
    Mma,
    /// And each step's fragment loads from the operand tiles in workgroup
    /// memory (staged once, before the loop), a different 16 of the K step
    /// each step so that no compiler hoists them.
    Fragments,
    /// And the loop's two workgroup barriers a step.
    Barriers,
    /// And each step's staging of the operand registers into workgroup
    /// memory (read from global memory once, before the loop): the
    /// one-buffer loop (`single`, `prefetch`) but for its global reads.
    Staging,
}

impl CoopProbe {
    pub const ALL: [CoopProbe; 4] = [
        CoopProbe::Mma,
        CoopProbe::Fragments,
        CoopProbe::Barriers,
        CoopProbe::Staging,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CoopProbe::Mma => "mma",
            CoopProbe::Fragments => "fragments",
            CoopProbe::Barriers => "barriers",
            CoopProbe::Staging => "staging",
        }
    }

    /// The K loop of this probe (in place of `//{{LOOP}}` in `main`):
    /// `loads` are one K slice's fragment loads (at `kk`, from `abuf` and
    /// `bbuf`) and `products` its multiply-adds, a statement a line, not
    /// indented; `step` is a whole K step of both (the real loops'
    /// `//{{MMA}}`).
    fn k_loop(self, loads: &str, products: &str, step: &str) -> String {
        let ind = |text: &str, by: &str| -> String { text.lines().map(|l| format!("{by}{l}\n")).collect() };
        let stage_once = "    fetch_a(a_base, m0, 0u);\n    fetch_b(b_base, n0, 0u);\n    stage_a(0u);\n    stage_b(0u);\n    workgroupBarrier();\n    let abuf = 0u;\n    let bbuf = 0u;\n";
        let slices = |bar: &str| {
            format!(
                "{stage_once}    for (var t = 0u; t < nk; t++) {{\n{bar}        for (var k16 = 0u; k16 < BK; k16 += 16u) {{\n            let kk = (k16 + t * 16u) % BK;\n{}{}        }}\n{bar}    }}\n",
                ind(loads, "            "),
                ind(products, "            ")
            )
        };
        match self {
            CoopProbe::Mma => format!(
                "{stage_once}    let kk = 0u;\n{}    for (var t = 0u; t < nk; t++) {{\n        for (var k16 = 0u; k16 < BK; k16 += 16u) {{\n{}        }}\n    }}\n",
                ind(loads, "    "),
                ind(products, "            ")
            ),
            CoopProbe::Fragments => slices(""),
            CoopProbe::Barriers => slices("        workgroupBarrier();\n"),
            CoopProbe::Staging => format!(
                "    fetch_a(a_base, m0, 0u);\n    fetch_b(b_base, n0, 0u);\n    for (var t = 0u; t < nk; t++) {{\n        stage_a(0u);\n        stage_b(0u);\n        workgroupBarrier();\n        let abuf = 0u;\n        let bbuf = 0u;\n{step}        workgroupBarrier();\n    }}\n"
            ),
        }
    }
}

impl CoopMatmul {
    /// Every variant, for compiling them all (tests) and warming up.
    pub fn all() -> Vec<CoopMatmul> {
        CoopTile::ALL.into_iter().flat_map(CoopMatmul::variants).collect()
    }

    /// The timing probes of the variants the bench and the tests run them
    /// on: the default tile's and the emulated tiles' products of f16
    /// copies, every layout and edge, emulated or not, without epilogue.
    pub fn all_probes() -> Vec<CoopMatmul> {
        [CoopTile::DEFAULT, CoopTile::Small64, CoopTile::Simple64]
            .into_iter()
            .flat_map(CoopMatmul::variants)
            .filter(|v| v.a_f16 && v.b_f16 && !v.epi)
            .flat_map(CoopMatmul::probes)
            .collect()
    }

    /// This variant with each timing probe in place of its K loop
    /// ([`CoopProbe`]).
    pub fn probes(self) -> Vec<CoopMatmul> {
        CoopProbe::ALL
            .into_iter()
            .map(|p| CoopMatmul {
                probe: Some(p),
                ..self
            })
            .collect()
    }

    /// Every variant of one tile: layouts, edges, epilogue, emulation, and
    /// f32 or f16 B with f32 A, or f16 A with f16 B.
    pub fn variants(tile: CoopTile) -> Vec<CoopMatmul> {
        (0..256u32)
            .map(|bits| {
                let f = |i: u32| (bits >> i) & 1 == 1;
                CoopMatmul {
                    tile,
                    ta: f(0),
                    tb: f(1),
                    tc: f(2),
                    edge: f(3),
                    b_f16: f(4),
                    emulated: f(5),
                    epi: f(6),
                    a_f16: f(7),
                    probe: None,
                }
            })
            .filter(|v| v.b_f16 || !v.a_f16)
            .collect()
    }

    /// Rows and columns (columns contiguous) of the A and B tiles as they lie
    /// in global memory, which is also how they are staged.
    fn operand_tiles(&self) -> ((u32, u32), (u32, u32)) {
        let s = self.tile.shape();
        let a = if self.ta { (s.bk, s.bm) } else { (s.bm, s.bk) };
        let b = if self.tb { (s.bn, s.bk) } else { (s.bk, s.bn) };
        (a, b)
    }

    /// Bytes of workgroup memory: the f16 operand tiles (padded rows, one or
    /// two buffers) and one f32 fragment per subgroup for the epilogue.
    pub fn workgroup_bytes(&self) -> u32 {
        self.workgroup_arrays().iter().map(|a| a.1).sum()
    }

    /// Bytes of each workgroup array the variant declares.
    fn workgroup_arrays(&self) -> [(&'static str, u32); 3] {
        let s = self.tile.shape();
        let ((ar, ac), (br, bc)) = self.operand_tiles();
        let bufs = s.k_loop.buffers();
        let elem = if self.emulated { 4 } else { 2 };
        [
            ("a_s", bufs * ar * (ac + 8) * elem),
            ("b_s", bufs * br * (bc + 8) * elem),
            ("c_s", s.sg_m * s.sg_n * 256 * 4),
        ]
    }

    pub fn label(&self) -> String {
        format!(
            "{}{}_{}{}{}{}{}{}{}{}",
            self.tile.name(),
            if self.emulated { "_sw" } else { "" },
            if self.ta { "T" } else { "N" },
            if self.tb { "T" } else { "N" },
            if self.tc { "_tc" } else { "" },
            if self.edge { "_edge" } else { "" },
            if self.a_f16 { "_a16" } else { "" },
            if self.b_f16 { "_b16" } else { "" },
            if self.epi { "_epi" } else { "" },
            self.probe
                .map_or(String::new(), |p| format!("_probe_{}", p.name()))
        )
    }

    /// The WGSL of this variant (entry point `main`).
    pub fn source(&self) -> String {
        let s = self.tile.shape();
        let (fm, fnn) = s.frags();
        let ((ar, ac), (br, bc)) = self.operand_tiles();
        let threads = s.threads();
        // Whole vec4s per thread in the vector loaders, whole elements in
        // the scalar ones: true of every shape above, checked here so that a
        // new shape cannot silently skip part of a tile.
        assert_eq!((ar * ac) % (4 * threads), 0, "{self:?}: A tile per thread");
        assert_eq!((br * bc) % (4 * threads), 0, "{self:?}: B tile per thread");
        assert!(s.bk.is_multiple_of(16) && ac.is_multiple_of(4) && bc.is_multiple_of(4));
        assert_eq!(threads, 32 * s.sg_m * s.sg_n);

        let mut out = String::with_capacity(16 << 10);
        if !self.emulated {
            out.push_str("enable f16;\nenable wgpu_cooperative_matrix;\n\n");
        }
        let b = |x: bool| if x { "true" } else { "false" };
        let _ = writeln!(out, "// Variant {}", self.label());
        let _ = writeln!(
            out,
            "const BM: u32 = {}u;\nconst BN: u32 = {}u;\nconst BK: u32 = {}u;",
            s.bm, s.bn, s.bk
        );
        let _ = writeln!(
            out,
            "const SG_M: u32 = {}u;\nconst SG_N: u32 = {}u;\nconst FM: u32 = {fm}u;\nconst FN: u32 = {fnn}u;",
            s.sg_m, s.sg_n
        );
        let _ = writeln!(
            out,
            "const NBUF: u32 = {}u;\nconst GROUP_M: u32 = {}u;",
            s.k_loop.buffers(),
            s.group_m
        );
        let _ = writeln!(
            out,
            "const TA: bool = {};\nconst TB: bool = {};\nconst TC: bool = {};\nconst EDGE: bool = {};",
            b(self.ta),
            b(self.tb),
            b(self.tc),
            b(self.edge)
        );
        let _ = writeln!(
            out,
            "const A_ROWS: u32 = {ar}u;\nconst A_COLS: u32 = {ac}u;\nconst B_ROWS: u32 = {br}u;\nconst B_COLS: u32 = {bc}u;\n"
        );
        out.push_str(crate::kernels::MATMUL_PARAMS);
        out.push_str(SCALE);
        out.push_str(section(if self.emulated { "half_sw" } else { "half_hw" }));
        out.push_str(&crate::kernels::epilogue_source(
            self.epi,
            true,
            crate::kernels::FoldScratch::CoopFragments,
        ));
        out.push_str(section("common"));
        if self.emulated {
            out.push_str(&emulation("a_s", "b_s", "c_s"));
        }
        for (x, stored_f16) in [('a', self.a_f16), ('b', self.b_f16)] {
            let storage: &[&str] = match (stored_f16, self.edge, self.emulated) {
                (false, false, _) => &["f32_vec"],
                (false, true, _) => &["f32_edge"],
                (true, false, false) => &["f16_hw", "f16_vec"],
                (true, true, false) => &["f16_edge_hw", "f16_edge"],
                (true, false, true) => &["f16_sw", "f16_vec"],
                (true, true, true) => &["f16_edge_sw", "f16_edge"],
            };
            for name in storage {
                out.push_str(&operand_section(name, x));
            }
            out.push_str(&operand_section(if self.edge { "x_edge" } else { "x_vec" }, x));
        }
        let per_reg = if self.edge { 1 } else { 4 };
        out.push_str(&operand_registers('a', "m0", ar * ac / per_reg / threads));
        out.push_str(&operand_registers('b', "n0", br * bc / per_reg / threads));

        let mut acc = String::new();
        let acc_ty = if self.emulated {
            "array<f32, 8>"
        } else {
            "coop_mat16x16<f32, C>"
        };
        for i in 0..fm {
            for j in 0..fnn {
                let _ = writeln!(acc, "    var acc{i}_{j} = {acc_ty}();");
            }
        }
        let load = |role: &str, buf: &str, idx: &str, stride: &str, row_major: bool| {
            if self.emulated {
                format!("Frag({idx}, {stride}, {row_major})")
            } else {
                let f = if row_major { "coopLoadT" } else { "coopLoad" };
                format!("{f}<coop_mat16x16<f16, {role}>>(&{buf}[{idx}], {stride})")
            }
        };

        // One K slice's fragment loads (at kk, from buffers abuf and bbuf)
        // and multiply-adds, a statement a line; a K step is BK / 16 of
        // them. A is staged [m][k] (row-major fragments) unless transposed,
        // B [k][n] unless transposed.
        let mut loads = String::new();
        for i in 0..fm {
            let idx = if self.ta {
                format!("abuf + kk * LDA_S + wm0 + {}u", 16 * i)
            } else {
                format!("abuf + (wm0 + {}u) * LDA_S + kk", 16 * i)
            };
            let _ = writeln!(loads, "let ia{i} = {idx};");
            let f = load("A", "a_s", &format!("ia{i}"), "lda_s", !self.ta);
            let _ = writeln!(loads, "let fa{i} = {f};");
        }
        for j in 0..fnn {
            let idx = if self.tb {
                format!("bbuf + (wn0 + {}u) * LDB_S + kk", 16 * j)
            } else {
                format!("bbuf + kk * LDB_S + wn0 + {}u", 16 * j)
            };
            let _ = writeln!(loads, "let ib{j} = {idx};");
            let f = load("B", "b_s", &format!("ib{j}"), "ldb_s", !self.tb);
            let _ = writeln!(loads, "let fb{j} = {f};");
        }
        let mut products = String::new();
        for i in 0..fm {
            for j in 0..fnn {
                let _ = if self.emulated {
                    writeln!(products, "acc{i}_{j} = emu_mma(fa{i}, fb{j}, acc{i}_{j}, lane);")
                } else {
                    writeln!(
                        products,
                        "acc{i}_{j} = coopMultiplyAdd(fa{i}, fb{j}, acc{i}_{j});"
                    )
                };
            }
        }
        let mut mma = String::from("        for (var kk = 0u; kk < BK; kk += 16u) {\n");
        for line in loads.lines().chain(products.lines()) {
            let _ = writeln!(mma, "            {line}");
        }
        mma.push_str("        }\n");

        let mut epi = String::new();
        for i in 0..fm {
            for j in 0..fnn {
                let _ = writeln!(
                    epi,
                    "    let xo{i}_{j} = fragment_operands(lane, c_base, m0 + wm0 + {}u, n0 + wn0 + {}u);",
                    16 * i,
                    16 * j
                );
                let _ = if self.emulated {
                    writeln!(epi, "    emu_store_t(acc{i}_{j}, cs, ld16, lane);")
                } else {
                    writeln!(epi, "    coopStoreT(acc{i}_{j}, &c_s[cs], ld16);")
                };
                epi.push_str("    workgroupBarrier();\n");
                let _ = writeln!(
                    epi,
                    "    store_fragment(cs, lane, c_base, m0 + wm0 + {}u, n0 + wn0 + {}u, xo{i}_{j});",
                    16 * i,
                    16 * j
                );
                epi.push_str("    workgroupBarrier();\n");
            }
        }

        let body = match self.probe {
            Some(probe) => probe.k_loop(&loads, &products, &mma),
            None => section(match s.k_loop {
                KLoop::Single => "loop_single",
                KLoop::Prefetch => "loop_prefetch",
                KLoop::Double => "loop_double",
            })
            .replace("//{{MMA}}\n", &mma),
        };
        let main = section("main")
            .replace("//{{ACCUMULATORS}}\n", &acc)
            .replace("//{{LOOP}}\n", &body)
            .replace("//{{EPILOGUE}}\n", &epi);
        out.push_str(&main);
        out
    }
}

/// `fetch_X` (global memory into this thread's registers for the next K
/// step) and `stage_X` (those registers into workgroup buffer `buf`) of
/// operand `x`, over its `n` registers per thread: the sections'
/// `fetch_X_at` / `stage_X_at` unrolled, each register a private variable
/// of its own. A private array would do in a loop, but one index a compiler
/// does not resolve puts the whole array in local memory.
fn operand_registers(x: char, origin: &str, n: u32) -> String {
    let reg = x.to_ascii_uppercase();
    let mut out = String::new();
    for i in 0..n {
        let _ = writeln!(out, "var<private> r{x}{i}: {reg}Reg;");
    }
    let _ = writeln!(out, "\nfn fetch_{x}(base: u32, {origin}: u32, k0: u32) {{");
    for i in 0..n {
        let _ = writeln!(out, "    r{x}{i} = fetch_{x}_at({i}u, base, {origin}, k0);");
    }
    let _ = writeln!(out, "}}\n\nfn stage_{x}(buf: u32) {{");
    for i in 0..n {
        let _ = writeln!(out, "    stage_{x}_at({i}u, buf, r{x}{i});");
    }
    out.push_str("}\n\n");
    out
}

/// Section `name` of matmul_coop.wgsl for operand `x` (`'a'` or `'b'`):
/// the operand's names, leading dimension, scale, binding, orientation
/// (X_KROWS: the tile's rows run along K) and outer extent put in for X.
fn operand_section(name: &str, x: char) -> String {
    let up = x.to_ascii_uppercase();
    let (krows, outer, binding) = match x {
        'a' => ("TA", "p.m", 1),
        _ => ("(!TB)", "p.n", 2),
    };
    section(name)
        .replace("@binding(BINDING)", &format!("@binding({binding})"))
        .replace("X_KROWS", krows)
        .replace("X_OUTER", outer)
        .replace("LDX_S", &format!("LD{up}_S"))
        .replace("X_COLS", &format!("{up}_COLS"))
        .replace("X_TILE", &format!("{up}_TILE"))
        .replace("XReg", &format!("{up}Reg"))
        .replace("p.ldX", &format!("p.ld{x}"))
        .replace("sc.X", &format!("sc.{x}"))
        .replace("X_in", &format!("{x}_in"))
        .replace("X_s[", &format!("{x}_s["))
        .replace("_X_at", &format!("_{x}_at"))
        .replace("_X4", &format!("_{x}4"))
        .replace("_X1", &format!("_{x}1"))
}

/// The software cooperative-matrix operations (matmul_coop.wgsl's
/// `emulation` section) over the named workgroup arrays: the staged
/// operands and the fragment on its way out.
pub(crate) fn emulation(a: &str, b: &str, out: &str) -> String {
    section("emulation")
        .replace("EMU_A", a)
        .replace("EMU_B", b)
        .replace("EMU_OUT", out)
}

/// The text of `//// name` up to the next section of matmul_coop.wgsl.
pub(crate) fn section(name: &str) -> &'static str {
    crate::kernels::wgsl_section(COOP, "matmul_coop.wgsl", name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The named tiles' variants and the hardware ones of every shape the
    /// bench sweeps.
    fn named_and_swept() -> Vec<CoopMatmul> {
        let swept = CoopTile::SWEEP.iter().map(|n| CoopTile::parse(n).unwrap());
        CoopMatmul::all()
            .into_iter()
            .chain(swept.flat_map(CoopMatmul::variants).filter(|v| !v.emulated))
            .collect()
    }

    #[test]
    fn every_variant_fits_nvidia_workgroup_memory() {
        for v in named_and_swept().into_iter().filter(|v| !v.emulated) {
            let bytes = v.workgroup_bytes();
            assert!(bytes <= WORKGROUP_BYTES_MAX, "{}: {bytes} B", v.label());
        }
    }

    /// Cooperative loads and stores need 16-byte aligned pointers, and a
    /// driver places workgroup variables in an order of its own: with every
    /// array a multiple of 16 bytes long, each starts on 16 bytes whatever
    /// the order (attention_coop.wgsl's `Shared` says what happened where
    /// one was not).
    #[test]
    fn every_workgroup_array_is_a_multiple_of_16_bytes() {
        for v in named_and_swept().into_iter().filter(|v| !v.emulated) {
            for (name, bytes) in v.workgroup_arrays() {
                assert_eq!(bytes % 16, 0, "{} {name}: {bytes} B", v.label());
            }
        }
    }

    /// What `TileShape::check` accepts is what the generator builds and
    /// what fits: its own count of workgroup memory bounds the variants'.
    #[test]
    fn a_checked_shape_bounds_its_variants_workgroup_memory() {
        for v in named_and_swept().into_iter().filter(|v| !v.emulated) {
            let shape = v.tile.shape();
            assert_eq!(shape.check(), Ok(()), "{}", v.label());
            assert!(v.workgroup_bytes() <= shape.workgroup_bytes(2), "{}", v.label());
        }
    }

    #[test]
    fn every_marker_is_replaced() {
        for v in named_and_swept() {
            let src = v.source();
            assert!(!src.contains("//{{"), "{}: marker left", v.label());
            assert!(!src.contains("////"), "{}: section header left", v.label());
            // The operand sections' placeholders, outside comments.
            let code: String = src.lines().map(|l| l.split("//").next().unwrap_or("")).collect();
            let placeholders = [
                "_X_at", "X_COLS", "X_TILE", "X_KROWS", "X_OUTER", "X_in", "X_s[", "LDX_S", "_X4", "_X1",
                "XReg", "p.ldX", "sc.X", "BINDING",
            ];
            for placeholder in placeholders {
                assert!(!code.contains(placeholder), "{}: {placeholder} left", v.label());
            }
        }
    }
}
