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

/// Workgroup memory the tuned variants may use: NVIDIA's Vulkan limit.
pub const WORKGROUP_BYTES_MAX: u32 = 48 << 10;

/// The workgroup tiles of the tensor-core kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CoopTile {
    /// 64x64, 4 subgroups of 2x2 fragments, K step 32, one buffer and two
    /// barriers per step: the shape of the kernel first checked on an H100
    /// (29 TFLOP/s), kept beside the tuned ones as a reference.
    Simple64,
    /// 128x128, 8 subgroups of 4x2 fragments, K step 32, double-buffered.
    Tile128,
    /// 128x256, 8 subgroups of 4x4 fragments, K step 16, double-buffered.
    Tile128x256,
    /// 128x128, 4 subgroups of 4x4 fragments, K step 32, double-buffered:
    /// Tile128's tile with 8 fragment loads per 16 products (Tile128 has 6
    /// per 8) and half the threads, each carrying twice the operand
    /// registers.
    Tile128w4,
    /// 64x64, 4 subgroups of 2x2 fragments, K step 16, double-buffered:
    /// the tuned tiles' code at a size whose software-emulated variant fits
    /// lavapipe's 32 KiB of workgroup memory.
    Small64,
    /// 16x64, 2 subgroups of 1x2 fragments, K step 16, double-buffered: an
    /// uneven fragment block and subgroup grid, for the same purpose.
    Small16x64,
}

/// Sizes of a [`CoopTile`]: the workgroup's tile of C, its K step, and how
/// its subgroups divide the tile.
#[derive(Debug, Clone, Copy)]
pub struct TileShape {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    /// Subgroups along M and along N.
    pub sg_m: u32,
    pub sg_n: u32,
    pub double_buffer: bool,
}

impl TileShape {
    /// 16x16 fragments per subgroup along M and N.
    pub fn frags(&self) -> (u32, u32) {
        (self.bm / self.sg_m / 16, self.bn / self.sg_n / 16)
    }

    pub fn threads(&self) -> u32 {
        self.sg_m * self.sg_n * 32
    }
}

impl CoopTile {
    pub const ALL: [CoopTile; 6] = [
        CoopTile::Simple64,
        CoopTile::Tile128,
        CoopTile::Tile128x256,
        CoopTile::Tile128w4,
        CoopTile::Small64,
        CoopTile::Small16x64,
    ];

    pub fn shape(self) -> TileShape {
        match self {
            CoopTile::Simple64 => TileShape {
                bm: 64,
                bn: 64,
                bk: 32,
                sg_m: 2,
                sg_n: 2,
                double_buffer: false,
            },
            CoopTile::Tile128 => TileShape {
                bm: 128,
                bn: 128,
                bk: 32,
                sg_m: 2,
                sg_n: 4,
                double_buffer: true,
            },
            CoopTile::Tile128x256 => TileShape {
                bm: 128,
                bn: 256,
                bk: 16,
                sg_m: 2,
                sg_n: 4,
                double_buffer: true,
            },
            CoopTile::Tile128w4 => TileShape {
                bm: 128,
                bn: 128,
                bk: 32,
                sg_m: 2,
                sg_n: 2,
                double_buffer: true,
            },
            CoopTile::Small64 => TileShape {
                bm: 64,
                bn: 64,
                bk: 16,
                sg_m: 2,
                sg_n: 2,
                double_buffer: true,
            },
            CoopTile::Small16x64 => TileShape {
                bm: 16,
                bn: 64,
                bk: 16,
                sg_m: 1,
                sg_n: 2,
                double_buffer: true,
            },
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopTile::Simple64 => "coop64",
            CoopTile::Tile128 => "coop128",
            CoopTile::Tile128x256 => "coop128x256",
            CoopTile::Tile128w4 => "coop128w4",
            CoopTile::Small64 => "coop64db",
            CoopTile::Small16x64 => "coop16x64",
        }
    }
}

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
}

impl CoopMatmul {
    /// Every variant, for compiling them all (tests) and warming up.
    pub fn all() -> Vec<CoopMatmul> {
        let mut v = Vec::new();
        for tile in CoopTile::ALL {
            for bits in 0..256u32 {
                let f = |i: u32| (bits >> i) & 1 == 1;
                if f(7) && !f(4) {
                    continue;
                }
                v.push(CoopMatmul {
                    tile,
                    ta: f(0),
                    tb: f(1),
                    tc: f(2),
                    edge: f(3),
                    b_f16: f(4),
                    emulated: f(5),
                    epi: f(6),
                    a_f16: f(7),
                });
            }
        }
        v
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
        let bufs = if s.double_buffer { 2 } else { 1 };
        let elem = if self.emulated { 4 } else { 2 };
        [
            ("a_s", bufs * ar * (ac + 8) * elem),
            ("b_s", bufs * br * (bc + 8) * elem),
            ("c_s", s.sg_m * s.sg_n * 256 * 4),
        ]
    }

    pub fn label(&self) -> String {
        format!(
            "{}{}_{}{}{}{}{}{}{}",
            self.tile.name(),
            if self.emulated { "_sw" } else { "" },
            if self.ta { "T" } else { "N" },
            if self.tb { "T" } else { "N" },
            if self.tc { "_tc" } else { "" },
            if self.edge { "_edge" } else { "" },
            if self.a_f16 { "_a16" } else { "" },
            if self.b_f16 { "_b16" } else { "" },
            if self.epi { "_epi" } else { "" }
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
        let _ = writeln!(out, "const NBUF: u32 = {}u;", if s.double_buffer { 2 } else { 1 });
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

        // One K step of the fragments in buffer (abuf, bbuf).
        let mut mma = String::new();
        mma.push_str("        for (var kk = 0u; kk < BK; kk += 16u) {\n");
        // A is staged [m][k] (row-major fragments) unless transposed, B
        // [k][n] unless transposed.
        for i in 0..fm {
            let idx = if self.ta {
                format!("abuf + kk * LDA_S + wm0 + {}u", 16 * i)
            } else {
                format!("abuf + (wm0 + {}u) * LDA_S + kk", 16 * i)
            };
            let _ = writeln!(mma, "            let ia{i} = {idx};");
            let f = load("A", "a_s", &format!("ia{i}"), "lda_s", !self.ta);
            let _ = writeln!(mma, "            let fa{i} = {f};");
        }
        for j in 0..fnn {
            let idx = if self.tb {
                format!("bbuf + (wn0 + {}u) * LDB_S + kk", 16 * j)
            } else {
                format!("bbuf + kk * LDB_S + wn0 + {}u", 16 * j)
            };
            let _ = writeln!(mma, "            let ib{j} = {idx};");
            let f = load("B", "b_s", &format!("ib{j}"), "ldb_s", !self.tb);
            let _ = writeln!(mma, "            let fb{j} = {f};");
        }
        for i in 0..fm {
            for j in 0..fnn {
                let _ = if self.emulated {
                    writeln!(
                        mma,
                        "            acc{i}_{j} = emu_mma(fa{i}, fb{j}, acc{i}_{j}, lane);"
                    )
                } else {
                    writeln!(
                        mma,
                        "            acc{i}_{j} = coopMultiplyAdd(fa{i}, fb{j}, acc{i}_{j});"
                    )
                };
            }
        }
        mma.push_str("        }\n");

        let mut epi = String::new();
        for i in 0..fm {
            for j in 0..fnn {
                let _ = if self.emulated {
                    writeln!(epi, "    emu_store_t(acc{i}_{j}, cs, ld16, lane);")
                } else {
                    writeln!(epi, "    coopStoreT(acc{i}_{j}, &c_s[cs], ld16);")
                };
                epi.push_str("    workgroupBarrier();\n");
                let _ = writeln!(
                    epi,
                    "    store_fragment(cs, lane, c_base, m0 + wm0 + {}u, n0 + wn0 + {}u);",
                    16 * i,
                    16 * j
                );
                epi.push_str("    workgroupBarrier();\n");
            }
        }

        let body = section(if s.double_buffer {
            "loop_double"
        } else {
            "loop_single"
        })
        .replace("//{{MMA}}\n", &mma);
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

    #[test]
    fn every_variant_fits_nvidia_workgroup_memory() {
        for v in CoopMatmul::all().into_iter().filter(|v| !v.emulated) {
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
        for v in CoopMatmul::all().into_iter().filter(|v| !v.emulated) {
            for (name, bytes) in v.workgroup_arrays() {
                assert_eq!(bytes % 16, 0, "{} {name}: {bytes} B", v.label());
            }
        }
    }

    #[test]
    fn every_marker_is_replaced() {
        for v in CoopMatmul::all() {
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
