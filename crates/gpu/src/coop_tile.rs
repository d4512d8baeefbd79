//! The workgroup tiles of the tensor-core matmuls: the named ones the
//! executor runs, and any other shape written out by name
//! (`coop128x128x64_2x2_prefetch_g8`), so that one GPU session can time a
//! sweep of shapes without a rebuild (`MEGATRAIN_F16_MATMUL`, and the
//! matmul bench's `MEGATRAIN_COOP_SWEEP`).

/// Workgroup memory the tuned variants may use: NVIDIA's Vulkan limit.
pub const WORKGROUP_BYTES_MAX: u32 = 48 << 10;

/// Most invocations a workgroup of a written-out tile may have (NVIDIA's
/// and lavapipe's limit; the named tiles keep to 256, what every adapter
/// the context accepts offers).
pub const THREADS_MAX: u32 = 1024;

/// The workgroup tiles of the tensor-core kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CoopTile {
    /// 64x64, 4 subgroups of 2x2 fragments, K step 32, one buffer and two
    /// barriers per step: the shape of the kernel first checked on an H100
    /// (29 TFLOP/s), kept beside the tuned ones as a reference.
    Simple64,
    /// 128x128, 8 subgroups of 4x2 fragments, K step 32, double-buffered:
    /// the default until the H200 sweep of 2026-11-28 (BENCHMARKS.md).
    Tile128,
    /// 256x128, 8 subgroups of 4x4 fragments, K step 32 on one buffer with
    /// the next step's tiles prefetched into registers, workgroups walking
    /// 8 tile rows (L2 order): the default from the H200 sweep of
    /// 2026-11-28 to that of 2026-12-01. On the H200 it ran 8192³ at 166
    /// TFLOP/s and the 7B MLP product at 159, where Tile128 ran 124 and
    /// 117 (session 28's sweep, the fastest at the 7B shape).
    Tile256x128,
    /// 128x256, 16 subgroups (2x8) of 4x2 fragments, K step 32 prefetched
    /// as Tile256x128's, 8 tile rows a group: the default. The H200 sweep
    /// of 2026-12-01 ran 8192³ at 186.7 TFLOP/s and the 7B MLP product at
    /// 163.1, where Tile256x128 ran 166.7 and 155.3 in the same run.
    Tile128x256w16,
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
    /// Any other shape that [`TileShape::check`] accepts, named by
    /// [`TileShape::name`]: for timing shapes before one is made a named
    /// tile.
    Shape(TileShape),
}

/// How a K step's operand tiles reach workgroup memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KLoop {
    /// One buffer: each step reads its tiles from global memory, stages
    /// them, and multiplies (two barriers a step, no loads in flight
    /// during the products).
    Single,
    /// One buffer, the next step's tiles read into registers before this
    /// step's products and staged after them (two barriers a step): the
    /// loads in flight as with two buffers, in half the workgroup memory,
    /// so a longer K step fits.
    Prefetch,
    /// Two buffers: the next step's tiles read before this step's products
    /// and staged into the other buffer after them (one barrier a step).
    Double,
}

impl KLoop {
    fn name(self) -> &'static str {
        match self {
            KLoop::Single => "single",
            KLoop::Prefetch => "prefetch",
            KLoop::Double => "double",
        }
    }

    /// Operand buffers in workgroup memory.
    pub fn buffers(self) -> u32 {
        match self {
            KLoop::Double => 2,
            KLoop::Single | KLoop::Prefetch => 1,
        }
    }
}

/// Sizes of a [`CoopTile`]: the workgroup's tile of C, its K step, how its
/// subgroups divide the tile, how the K loop stages operands, and the
/// order in which workgroups take the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TileShape {
    pub bm: u32,
    pub bn: u32,
    pub bk: u32,
    /// Subgroups along M and along N.
    pub sg_m: u32,
    pub sg_n: u32,
    pub k_loop: KLoop,
    /// Consecutive workgroups walk down `group_m` tile rows before the
    /// next tile column (1: along a row of tiles, as dispatched), so that
    /// the workgroups resident at once share their operand tiles in L2.
    pub group_m: u32,
}

impl TileShape {
    /// 16x16 fragments per subgroup along M and N.
    pub fn frags(&self) -> (u32, u32) {
        (self.bm / self.sg_m / 16, self.bn / self.sg_n / 16)
    }

    pub fn threads(&self) -> u32 {
        self.sg_m * self.sg_n * 32
    }

    /// `coop{BM}x{BN}x{BK}_{SG_M}x{SG_N}_{single|prefetch|double}`, and
    /// `_g{G}` where workgroups walk G tile rows.
    pub fn name(&self) -> String {
        let mut s = format!(
            "coop{}x{}x{}_{}x{}_{}",
            self.bm,
            self.bn,
            self.bk,
            self.sg_m,
            self.sg_n,
            self.k_loop.name()
        );
        if self.group_m > 1 {
            s.push_str(&format!("_g{}", self.group_m));
        }
        s
    }

    /// The shape [`TileShape::name`] writes, checked.
    pub fn parse(s: &str) -> Result<TileShape, String> {
        let bad = |why: &str| format!("tile '{s}': {why} (e.g. coop128x128x64_2x2_prefetch_g8)");
        let rest = s.strip_prefix("coop").ok_or_else(|| bad("no 'coop' prefix"))?;
        let parts: Vec<&str> = rest.split('_').collect();
        if !(3..=4).contains(&parts.len()) {
            return Err(bad("want BMxBNxBK_SGMxSGN_LOOP[_gG]"));
        }
        let nums = |p: &str, n: usize, what: &str| -> Result<Vec<u32>, String> {
            let v: Vec<u32> = p
                .split('x')
                .map(|x| x.parse::<u32>())
                .collect::<Result<_, _>>()
                .map_err(|_| bad(&format!("{what} '{p}' is not numbers joined by x")))?;
            if v.len() != n {
                return Err(bad(&format!("{what} '{p}' wants {n} numbers")));
            }
            Ok(v)
        };
        let t = nums(parts[0], 3, "tile")?;
        let sg = nums(parts[1], 2, "subgroup grid")?;
        let k_loop = match parts[2] {
            "single" => KLoop::Single,
            "prefetch" => KLoop::Prefetch,
            "double" => KLoop::Double,
            other => {
                return Err(bad(&format!(
                    "K loop '{other}' is not single, prefetch or double"
                )));
            }
        };
        let group_m = match parts.get(3) {
            None => 1,
            Some(g) => g
                .strip_prefix('g')
                .and_then(|g| g.parse::<u32>().ok())
                .filter(|&g| g >= 1)
                .ok_or_else(|| bad(&format!("'{g}' is not g followed by a group of at least 1")))?,
        };
        let shape = TileShape {
            bm: t[0],
            bn: t[1],
            bk: t[2],
            sg_m: sg[0],
            sg_n: sg[1],
            k_loop,
            group_m,
        };
        shape.check().map_err(|why| bad(&why))?;
        Ok(shape)
    }

    /// Whether the kernel generator can build this shape and NVIDIA's
    /// limits hold it (hardware variants: f16 tiles; the emulated ones
    /// hold f32 and may not fit where this does).
    pub fn check(&self) -> Result<(), String> {
        let s = self;
        if s.sg_m == 0 || s.sg_n == 0 || s.bk == 0 || s.group_m == 0 {
            return Err("sizes and the group must be positive".into());
        }
        if !s.bm.is_multiple_of(16 * s.sg_m) || !s.bn.is_multiple_of(16 * s.sg_n) || s.bm == 0 || s.bn == 0 {
            return Err(format!(
                "{}x{} does not split into {}x{} subgroups of whole 16x16 fragments",
                s.bm, s.bn, s.sg_m, s.sg_n
            ));
        }
        if !s.bk.is_multiple_of(16) {
            return Err(format!("K step {} is not a multiple of 16", s.bk));
        }
        let threads = s.threads();
        if threads > THREADS_MAX {
            return Err(format!("{threads} invocations, more than {THREADS_MAX}"));
        }
        // The loaders give every invocation whole vec4s of each tile.
        for (what, elems) in [("A", s.bm * s.bk), ("B", s.bk * s.bn)] {
            if !elems.is_multiple_of(4 * threads) {
                return Err(format!(
                    "the {what} tile's {elems} elements are not whole vec4s for each of {threads} invocations"
                ));
            }
        }
        let bytes = s.workgroup_bytes(2);
        if bytes > WORKGROUP_BYTES_MAX {
            return Err(format!(
                "{bytes} B of workgroup memory, more than {WORKGROUP_BYTES_MAX}"
            ));
        }
        Ok(())
    }

    /// Workgroup memory with `elem`-byte tile elements: the operand tiles
    /// (rows padded by 8, in either orientation the larger) and one f32
    /// fragment per subgroup.
    pub(crate) fn workgroup_bytes(&self, elem: u32) -> u32 {
        let s = self;
        let padded = |r: u32, c: u32| (r * (c + 8)).max(c * (r + 8));
        s.k_loop.buffers() * (padded(s.bm, s.bk) + padded(s.bk, s.bn)) * elem + s.sg_m * s.sg_n * 1024
    }
}

impl CoopTile {
    /// The tile `F16Matmul::Auto` takes where it matches the SIMT kernel.
    pub const DEFAULT: CoopTile = CoopTile::Tile128x256w16;

    pub const ALL: [CoopTile; 8] = [
        CoopTile::Simple64,
        CoopTile::Tile128,
        CoopTile::Tile256x128,
        CoopTile::Tile128x256w16,
        CoopTile::Tile128x256,
        CoopTile::Tile128w4,
        CoopTile::Small64,
        CoopTile::Small16x64,
    ];

    /// The shapes the matmul bench times when `MEGATRAIN_COOP_SWEEP` is
    /// `default` (BENCHMARKS.md says why each), tile by tile at both of its
    /// shapes, so the first matter most: around the default. The H200
    /// sweep of 2026-12-01 reached six tiles in 90 s: 16 subgroups won
    /// (128x256 on 2x8, the default since: 186.7 TFLOP/s at 8192³; 256x128
    /// on 8x2: 177.8, on 4x4: 175.1 and the best at the 7B shape, 166.0
    /// against 163.1), 256x256x16 collapsed (40.2), a K step of 16
    /// double-buffered (155.1) and one buffer without prefetch (161.7) lost
    /// to prefetch. So: the default's 16 subgroups as 4x4, its walks, the
    /// two runners-up, a K step of 16 on its shape (two buffers of it do
    /// not fit), then the unreached 128x256 on 8 and 128x128x64, and one
    /// buffer.
    pub const SWEEP: [&'static str; 9] = [
        "coop128x256x32_4x4_prefetch_g8",
        "coop128x256x32_2x8_prefetch_g4",
        "coop128x256x32_2x8_prefetch_g16",
        "coop256x128x32_4x4_prefetch_g8",
        "coop256x128x32_8x2_prefetch_g8",
        "coop128x256x16_2x8_prefetch_g8",
        "coop128x256x32_2x4_prefetch_g8",
        "coop128x128x64_2x4_prefetch_g8",
        "coop256x128x32_4x2_single_g8",
    ];

    pub fn shape(self) -> TileShape {
        let t = |bm, bn, bk, sg_m, sg_n, k_loop| TileShape {
            bm,
            bn,
            bk,
            sg_m,
            sg_n,
            k_loop,
            group_m: 1,
        };
        match self {
            CoopTile::Simple64 => t(64, 64, 32, 2, 2, KLoop::Single),
            CoopTile::Tile128 => t(128, 128, 32, 2, 4, KLoop::Double),
            CoopTile::Tile128x256 => t(128, 256, 16, 2, 4, KLoop::Double),
            CoopTile::Tile128w4 => t(128, 128, 32, 2, 2, KLoop::Double),
            CoopTile::Small64 => t(64, 64, 16, 2, 2, KLoop::Double),
            CoopTile::Small16x64 => t(16, 64, 16, 1, 2, KLoop::Double),
            CoopTile::Tile256x128 => TileShape {
                group_m: 8,
                ..t(256, 128, 32, 4, 2, KLoop::Prefetch)
            },
            CoopTile::Tile128x256w16 => TileShape {
                group_m: 8,
                ..t(128, 256, 32, 2, 8, KLoop::Prefetch)
            },
            CoopTile::Shape(s) => s,
        }
    }

    pub fn name(self) -> String {
        match self {
            CoopTile::Simple64 => "coop64",
            CoopTile::Tile128 => "coop128",
            CoopTile::Tile256x128 => "coop256x128",
            CoopTile::Tile128x256w16 => "coop128x256w16",
            CoopTile::Tile128x256 => "coop128x256",
            CoopTile::Tile128w4 => "coop128w4",
            CoopTile::Small64 => "coop64db",
            CoopTile::Small16x64 => "coop16x64",
            CoopTile::Shape(s) => return s.name(),
        }
        .to_string()
    }

    /// A named tile, or a shape written out ([`TileShape::parse`]).
    pub fn parse(s: &str) -> Result<CoopTile, String> {
        if let Some(t) = CoopTile::ALL.into_iter().find(|t| t.name() == s) {
            return Ok(t);
        }
        TileShape::parse(s).map(CoopTile::Shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for t in CoopTile::ALL {
            assert_eq!(CoopTile::parse(&t.name()), Ok(t));
            // Each named tile's shape, written out, is accepted too.
            let s = t.shape();
            assert_eq!(TileShape::parse(&s.name()), Ok(s), "{}", t.name());
        }
        for name in CoopTile::SWEEP {
            let t = CoopTile::parse(name).unwrap();
            assert_eq!(t.name(), name);
        }
    }

    #[test]
    fn bad_shapes_say_why() {
        let cases = [
            ("coop128x128", "BMxBNxBK"),
            ("tile128x128x32_2x2_double", "prefix"),
            ("coop128x128x32_2x2_triple", "'triple'"),
            ("coop128x128x24_2x2_double", "multiple of 16"),
            ("coop128x96x32_2x4_double", "whole 16x16 fragments"),
            ("coop128x128x64_2x4_double", "workgroup memory"),
            ("coop256x256x32_8x8_prefetch", "invocations"),
            ("coop16x64x16_1x4_double", "whole vec4s"),
            ("coop128x128x32_2x2_double_g0", "'g0'"),
            ("coop128x128x32_2x2_double_8", "'8'"),
            ("coop128x128xk_2x2_double", "not numbers"),
        ];
        for (name, why) in cases {
            let e = CoopTile::parse(name).unwrap_err();
            assert!(e.contains(why) && e.contains(name), "{name}: {e}");
        }
    }
}
