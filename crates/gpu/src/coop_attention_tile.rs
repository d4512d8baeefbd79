//! The tensor-core attention's tiles: each pass's default
//! (`CoopAttention::tile`) and any other named `sg{N}bc{M}[s][p]`, per pass
//! (`MEGATRAIN_F16_ATTENTION_TILES`, and the attention bench's
//! `MEGATRAIN_ATTN_SWEEP`), as `crate::coop_tile` names the matmul's.

use crate::coop_attention::AttnPass;

/// Sizes of a variant: subgroups (16 resident rows each) and the rows of
/// each streamed tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnTile {
    pub sg: u32,
    pub bc: u32,
    /// The resident block (the forward's Q, dq's Q and dO, dkv's K and V)
    /// staged in the region the streamed tiles use: its fragments are in
    /// registers before the first streamed tile is staged (after a
    /// barrier), so the region is free by then. Less workgroup memory, for
    /// larger tiles; dkv then holds K's and V's fragments in registers at
    /// every D (without `s`, only up to D = 80).
    pub share: bool,
    /// The next streamed tile read from global memory into registers
    /// while the current one is multiplied, and staged from them after the
    /// barrier that ends it (as the matmul's `loop_prefetch`), so that its
    /// reads' latency is hidden behind the tile's products rather than
    /// waited out between two barriers.
    pub prefetch: bool,
    /// Two copies of the streamed tiles' regions, used in turn (with
    /// `prefetch`): the next tile is staged from its registers into the
    /// other copy once the current one's products are issued, so one
    /// workgroup barrier a tile (after that staging) does what two did
    /// (before it, for the last tile's readers; after it, for the next
    /// tile's). dk/dv's streamed statistics (lse, delta) are doubled too.
    pub double: bool,
    /// The forward only: each tile's softmax in two passes over the
    /// scores (the rows' maxima, then P), and the rescale flag read by a
    /// workgroup-uniform load after them, as before 2026-12-02, where the
    /// default takes one pass (P against the running max, again only for
    /// rows whose max rises: `softmax_tile` in
    /// `shaders/attention_coop.wgsl`) and reads the flag after the
    /// barrier where a row's halves meet (two workgroup barriers a tile
    /// fewer). The same probabilities and sums; kept to time the two
    /// against each other.
    pub two_pass: bool,
    /// Rows synchronised within their subgroup between a tile's products
    /// and the lanes' work on them (`row_sync`: a subgroup barrier, not a
    /// workgroup one; `shaders/attention_coop.wgsl`). Only where the
    /// adapter's subgroups are the kernels' 32 lanes (not lavapipe's 8,
    /// nor the emulated variants).
    pub local: bool,
    /// dk/dv only: dQ accumulated by the same kernel (FlashAttention-2's
    /// backward), each tile's dSᵀ·K added to dQ with f32 atomics, so the
    /// dq pass, which recomputes S and dP, does not run. dQ's sums then
    /// come in whatever order the workgroups reach them: not bit for bit
    /// the same from run to run.
    pub fused_dq: bool,
    /// The resident block (with `share`) staged in this many slices of its
    /// columns, each slice's fragments loaded into registers before the
    /// next is staged in the same region: the region then holds BR rows of
    /// D/`split` columns, not of D, so that 8 or 16 subgroups (128 or 256
    /// resident rows) fit 48 KiB of workgroup memory beside the streamed
    /// tiles. 1: the whole block at once. Slices are whole fragments
    /// (⌈D/16 ÷ N⌉ of them, the last one fewer), so a head dimension of
    /// fewer than N fragments gets one slice per fragment.
    pub split: u32,
}

impl AttnTile {
    /// Rows of the resident block.
    pub fn br(&self) -> u32 {
        self.sg * 16
    }

    /// `sg{SG}bc{BC}`, with `s` where the regions are shared, `p` where
    /// the streamed tiles are prefetched, `d` where they are double
    /// buffered, `t` where the forward's softmax takes two passes, `l`
    /// where rows synchronise within their subgroup, `q` where dk/dv
    /// accumulates dQ too and `r{N}` where the resident block is staged in
    /// N slices.
    pub fn name(&self) -> String {
        format!(
            "sg{}bc{}{}{}{}{}{}{}{}",
            self.sg,
            self.bc,
            if self.share { "s" } else { "" },
            if self.prefetch { "p" } else { "" },
            if self.double { "d" } else { "" },
            if self.two_pass { "t" } else { "" },
            if self.local { "l" } else { "" },
            if self.fused_dq { "q" } else { "" },
            if self.split > 1 {
                format!("r{}", self.split)
            } else {
                String::new()
            }
        )
    }

    /// The tile [`AttnTile::name`] writes, checked for `pass`.
    pub fn parse(s: &str, pass: AttnPass) -> Result<AttnTile, String> {
        let bad = |why: &str| {
            format!(
                "attention tile '{s}': {why} (e.g. sg4bc32, sg2bc64s, sg8bc16spl, sg2bc16pq, sg16bc16spr4, sg16bc16spdr4)"
            )
        };
        // The suffixes, last first: `name` writes them in the order s, p,
        // d, t, l, q, r{N}.
        let (body, split) = match s.rsplit_once('r') {
            Some((body, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                (body, n.parse::<u32>().map_err(|_| bad(&format!("'{n}' slices")))?)
            }
            _ => (s, 1),
        };
        let (body, fused_dq) = strip_flag(body, 'q');
        let (body, local) = strip_flag(body, 'l');
        let (body, two_pass) = strip_flag(body, 't');
        let (body, double) = strip_flag(body, 'd');
        let (body, prefetch) = strip_flag(body, 'p');
        let (body, share) = strip_flag(body, 's');
        let (sg, bc) = body
            .strip_prefix("sg")
            .and_then(|r| r.split_once("bc"))
            .ok_or_else(|| bad("want sg{SG}bc{BC}, then s for shared regions, p for prefetched tiles, d for double-buffered ones, t for the forward's two-pass softmax, l for subgroup-local rows, q for dQ in dk/dv, r{N} for the resident block in N slices"))?;
        let num = |x: &str| {
            x.parse::<u32>()
                .map_err(|_| bad(&format!("'{x}' is not a number")))
        };
        let t = AttnTile {
            sg: num(sg)?,
            bc: num(bc)?,
            share,
            prefetch,
            double,
            two_pass,
            local,
            fused_dq,
            split,
        };
        t.check(pass).map_err(|why| bad(&why))?;
        Ok(t)
    }

    /// Whether the generator builds this tile for `pass` (workgroup memory
    /// is the adapter's to judge, at dispatch).
    pub fn check(&self, pass: AttnPass) -> Result<(), String> {
        if self.sg == 0 || 32 * self.sg > crate::coop_tile::THREADS_MAX {
            return Err(format!(
                "{} subgroups: from 1 to {}",
                self.sg,
                crate::coop_tile::THREADS_MAX / 32
            ));
        }
        if self.bc == 0 || !self.bc.is_multiple_of(16) {
            return Err(format!("{} keys a tile: a positive multiple of 16", self.bc));
        }
        // The statistics of a streamed tile are loaded one row an invocation.
        if self.bc > 32 * self.sg {
            return Err(format!(
                "{} keys a tile for {} invocations: at most one each",
                self.bc,
                32 * self.sg
            ));
        }
        // The next tile's copy is staged from the registers it was read into.
        if self.double && !self.prefetch {
            return Err("double-buffered tiles (d) are staged from prefetched registers (p)".into());
        }
        // dk/dv's dQ reads K's tile in every streamed tile's products.
        if self.share && self.fused_dq {
            return Err("dQ in dk/dv (q) reads K's tile throughout: its region cannot be shared (s)".into());
        }
        if self.two_pass && pass != AttnPass::Fwd {
            return Err("only the forward has a softmax of its own (t)".into());
        }
        if self.fused_dq && pass != AttnPass::Dkv {
            return Err("only dkv accumulates dQ (q)".into());
        }
        if self.split == 0 || self.split > 8 {
            return Err(format!(
                "{} slices of the resident block: from 1 to 8 (D / 16 at D = 128)",
                self.split
            ));
        }
        // Slices stage the block in turn in one region, which only a block
        // held in registers (`s`) leaves free for the next.
        if self.split > 1 && !self.share {
            return Err("a resident block staged in slices (r) needs shared regions (s)".into());
        }
        Ok(())
    }
}

/// `s` without its last character where that is `flag`, and whether it was.
fn strip_flag(s: &str, flag: char) -> (&str, bool) {
    s.strip_suffix(flag).map_or((s, false), |body| (body, true))
}

/// A tile for each pass: `None` keeps the pass's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnTiles {
    pub fwd: Option<AttnTile>,
    pub dq: Option<AttnTile>,
    pub dkv: Option<AttnTile>,
}

impl AttnTiles {
    pub fn get(&self, pass: AttnPass) -> Option<AttnTile> {
        match pass {
            AttnPass::Fwd => self.fwd,
            AttnPass::Dq => self.dq,
            AttnPass::Dkv => self.dkv,
        }
    }

    /// The tile sets the attention bench times when `MEGATRAIN_ATTN_SWEEP`
    /// is `default` (BENCHMARKS.md says why): each fits NVIDIA's 48 KiB of
    /// workgroup memory at D = 128 and below. The bench may be cut short,
    /// so the first sets are the ones that matter most, and it times the
    /// backward as dq and dk/dv together, each kernel in the set's profiled
    /// run, so a set may try one thing on the forward and another on the
    /// backward. The H200 sweep of 2026-12-01 found the resident block in
    /// four slices (`r4`) fastest on every pass, with twice the subgroups
    /// sharing each streamed tile (the forward on 16, dq and dk/dv on 8):
    /// the defaults since, first. Then, against them: the forward's
    /// softmax in two passes (`t`, as before 2026-12-02), and the
    /// backward's streamed tiles double buffered (`d`: one workgroup
    /// barrier a tile where the defaults wait at two); the forward's
    /// double buffered, and the backward's with rows synchronised within
    /// subgroups too (`l`: the forward's 2.81 ms against 3.03 there, dq's
    /// 3.23 against 3.40); the forward's with both, and the backward's
    /// with `l` alone; the forward's with `l` alone, and the backward's in
    /// eight slices; the forward's 32-key tiles with dq and dk/dv on 4
    /// subgroups in slices; and the fastest set of that sweep. (`d`, `t`
    /// and eight slices never yet timed; 12 and 6 subgroups, and the
    /// defaults of 2026-11-29, timed then, are left out.)
    pub const SWEEP: [&'static str; 7] = [
        "fwd=sg16bc16spr4,dq=sg8bc16spr4,dkv=sg8bc16spr4",
        "fwd=sg16bc16sptr4,dq=sg8bc16spdr4,dkv=sg8bc16spdr4",
        "fwd=sg16bc16spdr4,dq=sg8bc16spdlr4,dkv=sg8bc16spdlr4",
        "fwd=sg16bc16spdlr4,dq=sg8bc16splr4,dkv=sg8bc16splr4",
        "fwd=sg16bc16splr4,dq=sg8bc16spr8,dkv=sg8bc16spr8",
        "fwd=sg8bc32spr4,dq=sg4bc16spr4,dkv=sg4bc16spr4",
        "fwd=sg16bc16splr4,dq=sg8bc16splr4,dkv=sg4bc16sp",
    ];
}

impl std::fmt::Display for AttnTiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [("fwd", self.fwd), ("dq", self.dq), ("dkv", self.dkv)]
            .into_iter()
            .filter_map(|(p, t)| t.map(|t| format!("{p}={}", t.name())))
            .collect();
        f.write_str(if parts.is_empty() { "default" } else { "" })?;
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for AttnTiles {
    type Err = String;

    /// `pass=tile` pairs joined by commas (`fwd=sg2bc64s,dkv=sg1bc32`), or
    /// `default`.
    fn from_str(s: &str) -> Result<AttnTiles, String> {
        let mut t = AttnTiles::default();
        if s == "default" {
            return Ok(t);
        }
        for part in s.split(',') {
            let (pass, tile) = part
                .split_once('=')
                .ok_or_else(|| format!("'{part}': want pass=tile, the pass fwd, dq or dkv"))?;
            let (slot, pass) = match pass {
                "fwd" => (&mut t.fwd, AttnPass::Fwd),
                "dq" => (&mut t.dq, AttnPass::Dq),
                "dkv" => (&mut t.dkv, AttnPass::Dkv),
                other => return Err(format!("'{other}' is not a pass: fwd, dq or dkv")),
            };
            *slot = Some(AttnTile::parse(tile, pass)?);
        }
        Ok(t)
    }
}
