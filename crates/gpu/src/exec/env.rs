//! Kernel families named in the environment, for comparing them on one GPU
//! without a rebuild (`megatrain train`, `cargo xtask bench-throughput`).
//! Each changes the order of f32 sums, so they are measurement settings,
//! not run options; so is how downloads reach the optimizer and how
//! uploads leave the host, which change no value. (`MEGATRAIN_SHADER_CHECKS` is read where the executor
//! is made instead, so that it reaches the test suites too.)

use super::{Epilogues, F16Attention, F16Matmul, F16Maxima, F16Operands, GpuOptions};
use crate::{CoopTile, GpuError};

/// `auto`, `simt`, a tensor-core tile (`coop64`, `coop128`, `coop256x128`, `coop128x256w16`, `coop128x256`, `coop128w4`,
/// `coop64db`, `coop16x64`, or a shape written out as `TileShape::name`
/// writes it, e.g. `coop128x128x64_2x2_prefetch_g8`) or one with `_sw`
/// (emulated).
pub const F16_MATMUL_ENV: &str = "MEGATRAIN_F16_MATMUL";
/// `auto`, `simt`, `coop` or `coop_sw` (emulated).
pub const F16_ATTENTION_ENV: &str = "MEGATRAIN_F16_ATTENTION";
/// The tensor-core attention's tiles, `pass=tile` pairs joined by commas
/// (`fwd=sg2bc64s,dq=sg2bc32s,dkv=sg1bc32`; `AttnTile::name`), or `default`.
pub const F16_ATTENTION_TILES_ENV: &str = "MEGATRAIN_F16_ATTENTION_TILES";
/// `copy` or `stage`: where the tensor-core matmuls convert f32 operands.
pub const F16_OPERANDS_ENV: &str = "MEGATRAIN_F16_OPERANDS";
/// `fold` or `scan`: where the max|x| of a product's output comes from.
pub const F16_MAXIMA_ENV: &str = "MEGATRAIN_F16_MAXIMA";
/// `all`, `forward` or `none`: which products apply their activation at
/// their store ([`Epilogues`]).
pub const EPILOGUES_ENV: &str = "MEGATRAIN_EPILOGUES";
/// `in_place` or `copy`: how gradient downloads reach the optimizer (no
/// effect on any value).
pub const DOWNLOADS_ENV: &str = "MEGATRAIN_DOWNLOADS";
/// `chunk` or `layer`: where a layer's gradient chunks are copied from on
/// a device with a copy queue (no effect on any value).
pub const DOWNLOAD_STAGING_ENV: &str = "MEGATRAIN_DOWNLOAD_STAGING";

impl std::str::FromStr for F16Matmul {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let all = std::iter::once(F16Matmul::Auto)
            .chain([F16Matmul::Simt])
            .chain(CoopTile::ALL.iter().map(|&t| F16Matmul::Coop(t)))
            .chain(CoopTile::ALL.iter().map(|&t| F16Matmul::CoopEmulated(t)));
        named(s, all).or_else(|named_err| {
            // A tile shape written out (coop_tile.rs), for timing shapes.
            let (base, emulated) = match s.strip_suffix("_sw") {
                Some(b) => (b, true),
                None => (s, false),
            };
            match crate::TileShape::parse(base) {
                Ok(shape) if emulated => Ok(F16Matmul::CoopEmulated(CoopTile::Shape(shape))),
                Ok(shape) => Ok(F16Matmul::Coop(CoopTile::Shape(shape))),
                Err(shape_err) => Err(format!("{named_err}, or a tile shape; as a shape, {shape_err}")),
            }
        })
    }
}

impl std::fmt::Display for F16Attention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            F16Attention::Auto => "auto",
            F16Attention::Simt => "simt",
            F16Attention::Coop => "coop",
            F16Attention::CoopEmulated => "coop_sw",
        })
    }
}

impl std::str::FromStr for F16Attention {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        use F16Attention::*;
        named(s, [Auto, Simt, Coop, CoopEmulated].into_iter())
    }
}

impl std::str::FromStr for F16Operands {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(s, [F16Operands::Copy, F16Operands::Stage].into_iter())
    }
}

impl std::str::FromStr for F16Maxima {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(s, [F16Maxima::Fold, F16Maxima::Scan].into_iter())
    }
}

impl std::str::FromStr for Epilogues {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(
            s,
            [Epilogues::All, Epilogues::Forward, Epilogues::None].into_iter(),
        )
    }
}

impl std::str::FromStr for crate::Uploads {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(
            s,
            [crate::Uploads::Auto, crate::Uploads::Direct, crate::Uploads::Copy].into_iter(),
        )
    }
}

impl std::str::FromStr for crate::DownloadStaging {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(
            s,
            [crate::DownloadStaging::Chunk, crate::DownloadStaging::Layer].into_iter(),
        )
    }
}

impl std::str::FromStr for crate::Downloads {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        named(s, [crate::Downloads::InPlace, crate::Downloads::Copy].into_iter())
    }
}

/// The value whose name is `s`, or the list of names.
pub(crate) fn named<T: std::fmt::Display>(s: &str, all: impl Iterator<Item = T>) -> Result<T, String> {
    let mut names = Vec::new();
    for v in all {
        let name = v.to_string();
        if name == s {
            return Ok(v);
        }
        names.push(name);
    }
    Err(format!("one of {}", names.join(", ")))
}

fn from_env<T: std::str::FromStr<Err = String>>(var: &'static str) -> Result<Option<T>, GpuError> {
    match std::env::var(var) {
        Ok(v) if !v.is_empty() => v.parse().map(Some).map_err(|expected| GpuError::Env {
            var,
            value: v,
            expected,
        }),
        _ => Ok(None),
    }
}

impl GpuOptions {
    /// These options with the kernel families [`F16_MATMUL_ENV`] and
    /// [`F16_ATTENTION_ENV`] name, the tiles [`F16_ATTENTION_TILES_ENV`] names, and the ways [`F16_OPERANDS_ENV`],
    /// [`F16_MAXIMA_ENV`], [`EPILOGUES_ENV`], [`DOWNLOADS_ENV`], [`DOWNLOAD_STAGING_ENV`] and [`crate::UPLOADS_ENV`]
    /// name, where set; a value that names none is refused with the list
    /// of names.
    pub fn with_env(mut self) -> Result<Self, GpuError> {
        if let Some(m) = from_env(F16_MATMUL_ENV)? {
            self.f16_matmul = m;
        }
        if let Some(a) = from_env(F16_ATTENTION_ENV)? {
            self.f16_attention = a;
        }
        if let Some(t) = from_env(F16_ATTENTION_TILES_ENV)? {
            self.attention_tiles = t;
        }
        if let Some(o) = from_env(F16_OPERANDS_ENV)? {
            self.f16_operands = o;
        }
        if let Some(m) = from_env(F16_MAXIMA_ENV)? {
            self.f16_maxima = m;
        }
        if let Some(e) = from_env(EPILOGUES_ENV)? {
            self.epilogues = e;
        }
        if let Some(d) = from_env(DOWNLOADS_ENV)? {
            self.downloads = d;
        }
        if let Some(s) = from_env(DOWNLOAD_STAGING_ENV)? {
            self.download_staging = s;
        }
        if let Some(u) = from_env(crate::UPLOADS_ENV)? {
            self.uploads = u;
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_parses_back_from_its_name() {
        for t in CoopTile::ALL {
            for m in [F16Matmul::Coop(t), F16Matmul::CoopEmulated(t)] {
                assert_eq!(m.to_string().parse::<F16Matmul>(), Ok(m));
            }
        }
        assert_eq!("simt".parse::<F16Matmul>(), Ok(F16Matmul::Simt));
        assert_eq!("auto".parse::<F16Matmul>(), Ok(F16Matmul::Auto));
        for a in [
            F16Attention::Auto,
            F16Attention::Simt,
            F16Attention::Coop,
            F16Attention::CoopEmulated,
        ] {
            assert_eq!(a.to_string().parse::<F16Attention>(), Ok(a));
        }
        for o in [F16Operands::Copy, F16Operands::Stage] {
            assert_eq!(o.to_string().parse::<F16Operands>(), Ok(o));
        }
        for m in [F16Maxima::Fold, F16Maxima::Scan] {
            assert_eq!(m.to_string().parse::<F16Maxima>(), Ok(m));
        }
        for e in [Epilogues::All, Epilogues::Forward, Epilogues::None] {
            assert_eq!(e.to_string().parse::<Epilogues>(), Ok(e));
        }
        for s in [crate::DownloadStaging::Chunk, crate::DownloadStaging::Layer] {
            assert_eq!(s.to_string().parse::<crate::DownloadStaging>(), Ok(s));
        }
        for d in [crate::Downloads::InPlace, crate::Downloads::Copy] {
            assert_eq!(d.to_string().parse::<crate::Downloads>(), Ok(d));
        }
        for u in [crate::Uploads::Auto, crate::Uploads::Direct, crate::Uploads::Copy] {
            assert_eq!(u.to_string().parse::<crate::Uploads>(), Ok(u));
        }
        use crate::CopyQueueChoice as Q;
        for q in [Q::Auto, Q::Off, Q::Shared] {
            assert_eq!(q.to_string().parse::<Q>(), Ok(q));
        }
        let e = "on".parse::<Q>().unwrap_err();
        assert!(e.contains("auto") && e.contains("shared"), "{e}");
        let e = "coop256".parse::<F16Matmul>().unwrap_err();
        assert!(e.contains("coop128x256") && e.contains("simt"), "{e}");
        // Shapes written out, hardware and emulated.
        for name in CoopTile::SWEEP {
            let t = CoopTile::parse(name).unwrap();
            assert_eq!(name.parse::<F16Matmul>(), Ok(F16Matmul::Coop(t)));
            let sw = format!("{name}_sw");
            assert_eq!(sw.parse::<F16Matmul>(), Ok(F16Matmul::CoopEmulated(t)));
            assert_eq!(F16Matmul::CoopEmulated(t).to_string(), sw);
        }
        let t = "fwd=sg8bc16sp,dq=sg4bc16pl,dkv=sg2bc16plq"
            .parse::<crate::AttnTiles>()
            .unwrap();
        let (f, q, kv) = (t.fwd.unwrap(), t.dq.unwrap(), t.dkv.unwrap());
        assert!(f.share && f.prefetch && !f.local);
        assert!(!q.share && q.prefetch && q.local && !q.fused_dq);
        assert!(kv.prefetch && kv.local && kv.fused_dq);
        assert_eq!(t.to_string(), "fwd=sg8bc16sp,dq=sg4bc16pl,dkv=sg2bc16plq");
        assert_eq!((f.split, q.split, kv.split), (1, 1, 1));
        let t = "fwd=sg16bc16splr4,dq=sg8bc16sr4"
            .parse::<crate::AttnTiles>()
            .unwrap();
        let (f, q) = (t.fwd.unwrap(), t.dq.unwrap());
        assert!(f.share && f.prefetch && f.local && f.split == 4 && f.sg == 16);
        assert!(q.share && !q.prefetch && q.split == 4 && q.sg == 8);
        assert_eq!(t.to_string(), "fwd=sg16bc16splr4,dq=sg8bc16sr4");
        let t = "fwd=sg16bc16spdlr4,dkv=sg2bc16pdq"
            .parse::<crate::AttnTiles>()
            .unwrap();
        let (f, kv) = (t.fwd.unwrap(), t.dkv.unwrap());
        assert!(f.share && f.prefetch && f.double && f.local && f.split == 4);
        assert!(!kv.share && kv.prefetch && kv.double && !kv.local && kv.fused_dq);
        assert!(!q.double);
        assert_eq!(t.to_string(), "fwd=sg16bc16spdlr4,dkv=sg2bc16pdq");
        let t = "fwd=sg16bc16spdtr4".parse::<crate::AttnTiles>().unwrap();
        let f = t.fwd.unwrap();
        assert!(f.double && f.two_pass && !f.local && f.split == 4);
        assert_eq!(t.to_string(), "fwd=sg16bc16spdtr4");
        for tiles in crate::AttnTiles::SWEEP {
            let t = tiles.parse::<crate::AttnTiles>().unwrap();
            assert_eq!(t.to_string(), tiles);
            assert_eq!(t.to_string().parse::<crate::AttnTiles>(), Ok(t));
        }
        assert_eq!(
            "default".parse::<crate::AttnTiles>(),
            Ok(crate::AttnTiles::default())
        );
        assert_eq!(crate::AttnTiles::default().to_string(), "default");
        for (bad, why) in [
            ("fwd=sg4bc24", "multiple of 16"),
            ("fwd=sg1bc64", "at most one each"),
            ("dkv=sg2bc32sq", "cannot be shared"),
            ("bwd=sg2bc32", "not a pass"),
            ("fwd:sg2bc32", "want pass=tile"),
            ("fwd=sg0bc32", "subgroups"),
            ("fwd=bc32", "want sg"),
            ("fwd=sgxbc32", "not a number"),
            // Shared, then prefetched: in that order only.
            ("fwd=sg4bc16ps", "not a number"),
            ("dq=sg2bc16pq", "only dkv"),
            // Slices of the resident block: shared regions, 1 to 8.
            ("fwd=sg8bc16pr2", "needs shared regions"),
            ("fwd=sg8bc16sr0", "slices"),
            ("fwd=sg8bc16sr9", "slices"),
            ("dkv=sg2bc16r2", "needs shared regions"),
            ("fwd=sg8bc16sr", "not a number"),
            // Double buffers staged from prefetched registers, and after p.
            ("fwd=sg8bc16sd", "prefetched registers"),
            ("dkv=sg2bc16d", "prefetched registers"),
            ("fwd=sg8bc16sdp", "not a number"),
            // A softmax of two passes: the forward's.
            ("dq=sg4bc16t", "only the forward"),
        ] {
            let e = bad.parse::<crate::AttnTiles>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = "coop128x128x64_2x4_double".parse::<F16Matmul>().unwrap_err();
        assert!(e.contains("coop128w4") && e.contains("workgroup memory"), "{e}");
    }
}
