//! Generation over a cache: each block keeps on the executor what it needs
//! of the positions so far (an attention block their keys and values, a
//! Gated DeltaNet its convolution's last inputs and its state), so a new
//! token costs one position's products and one row of attention over the
//! cache instead of the whole sequence again (transformers' `DynamicCache`).
//!
//! The blocks run the same code as in training; only where their tokens
//! sit changes ([`Seq`]): RoPE starts at the cache's length, and attention
//! appends the new keys and values to the cache and reads it
//! ([`Executor::attention_cached`]); a Gated DeltaNet's convolution reads
//! the inputs it cached before its new ones, and its delta rule continues
//! from the state the last steps left
//! ([`Executor::gated_delta_rule_cached`]). So every block family is
//! served without a decoding path of its own.

use megatrain_tensor::{AttentionOut, AttnMask, DeltaRuleOut, Docs, Executor, Rope, Shape, TensorHandle};

use super::dropout::{Branches, Rows, Site};

use crate::{ModelConfig, Result, ZooError};

/// Positions an attention block's keys and values are first made for.
const MIN_POSITIONS: usize = 64;

/// Where a block's tokens sit: rows of whole sequences (training,
/// evaluation, with the documents packed in them where there are), or the
/// next tokens of sequences of one length whose earlier positions a cache
/// holds, a row each.
pub(crate) enum Seq<'a, T> {
    /// Rows of block `layer` (its index in the layer table: 1 + the
    /// block's), whose sites draw their dropout masks by it.
    Rows {
        rows: Rows<'a>,
        layer: usize,
    },
    Cached(&'a mut LayerCache<T>),
}

impl<T: TensorHandle> Seq<'_, T> {
    /// The documents packed in the rows (a cached sequence has none).
    pub(crate) fn docs(&self) -> Option<&Docs> {
        match self {
            Seq::Rows { rows, .. } => rows.docs,
            Seq::Cached(_) => None,
        }
    }

    /// The dropouts of this block's residual branches in a training
    /// forward (none in generation): each branch's output goes through its
    /// own ([`super::dropout::dropout_branch`]) and the backward replays it.
    pub(crate) fn branches(&self) -> Branches {
        match self {
            Seq::Rows { rows, layer } => Branches {
                attn: rows.site(*layer, Site::AttnOut),
                mlp: rows.site(*layer, Site::MlpOut),
            },
            Seq::Cached(_) => Branches::default(),
        }
    }

    /// Block `layer`'s rotation of these tokens: from each row's (or
    /// document's) first token, or from the first position after the cache.
    pub(crate) fn rope(&self, cfg: &ModelConfig, layer: usize) -> Rope {
        let rope = cfg.rope(layer);
        match self {
            Seq::Rows { rows, .. } => rope.with_docs(rows.docs.cloned()),
            Seq::Cached(kv) => Rope {
                offset: rope.offset + kv.len,
                ..rope
            },
        }
    }

    /// Attention of q over k and v under `mask`: the rows' own, or the new
    /// keys and values appended to the cache and q over all of it (over
    /// the new ones alone where the cache was empty).
    pub(crate) fn attend<E: Executor<Tensor = T>>(
        &mut self,
        ex: &E,
        q: &T,
        k: &T,
        v: &T,
        mask: AttnMask,
    ) -> Result<AttentionOut<T>> {
        match self {
            Seq::Rows { rows, layer } => {
                let mask = mask
                    .with_docs(rows.docs.cloned())
                    .with_dropout(rows.site(*layer, Site::Attention));
                Ok(ex.attention(q, k, v, mask)?)
            }
            Seq::Cached(kv) => {
                // A sequence's first forward (a prompt) is the whole
                // sequence's attention: the training kernel runs it (on a
                // GPU the tensor cores' flash attention, not a row at a
                // time).
                let first = kv.len == 0;
                kv.append(ex, k, v)?;
                if first {
                    return Ok(ex.attention(q, k, v, mask)?);
                }
                let (k, v) = (kv.k.as_ref().expect("appended"), kv.v.as_ref().expect("appended"));
                Ok(ex.attention_cached(q, k, v, kv.len, mask)?)
            }
        }
    }

    /// The causal convolution with SiLU of `x: [B, T, C]` under `w: [C,
    /// K]`: within the rows' documents, or after the last K − 1 inputs the
    /// cache holds (zeros at a sequence's start), which these then replace.
    pub(crate) fn conv<E: Executor<Tensor = T>>(&mut self, ex: &E, x: &T, w: &T) -> Result<T> {
        let c = match self {
            Seq::Rows { rows, .. } => return Ok(ex.causal_conv1d_silu(x, w, rows.docs)?),
            Seq::Cached(c) => c,
        };
        let (b, t, ch, k) = (x.dims()[0], x.dims()[1], x.dims()[2], w.dims()[1]);
        let keep = k.saturating_sub(1);
        if keep == 0 {
            return Ok(ex.causal_conv1d_silu(x, w, None)?);
        }
        // Each row's kept inputs, then its new ones: [B, K − 1 + T, C].
        let span = keep + t;
        let flat = |x: &T, n| ex.reshape(x, &Shape::new([n, ch]));
        let mut joined = ex.zeros(&Shape::new([b, span, ch]))?;
        let xs = flat(x, b * t)?;
        let prev = c.conv.as_ref().map(|p| flat(p, b * keep)).transpose()?;
        for r in 0..b {
            if let Some(p) = &prev {
                ex.write_rows(&mut joined, r * span, &ex.slice_rows(p, r * keep, keep)?)?;
            }
            ex.write_rows(&mut joined, r * span + keep, &ex.slice_rows(&xs, r * t, t)?)?;
        }
        let y = flat(&ex.causal_conv1d_silu(&joined, w, None)?, b * span)?;
        let joined = flat(&joined, b * span)?;
        let (mut out, mut kept) = (
            ex.zeros(&Shape::new([b, t, ch]))?,
            ex.zeros(&Shape::new([b, keep, ch]))?,
        );
        for r in 0..b {
            ex.write_rows(&mut out, r * t, &ex.slice_rows(&y, r * span + keep, t)?)?;
            ex.write_rows(&mut kept, r * keep, &ex.slice_rows(&joined, r * span + t, keep)?)?;
        }
        c.conv = Some(kept);
        Ok(out)
    }

    /// The gated delta rule of q, k, v, g and beta (`q: [B, T, Hk, Dk]`,
    /// `v: [B, T, Hv, Dv]`): within the rows' documents, or continuing from
    /// the state the cache holds (zero at a sequence's start), which the
    /// new steps then advance. A cached forward is never differentiated:
    /// its `saved` is its output again, not checkpoints.
    pub(crate) fn delta_rule<E: Executor<Tensor = T>>(
        &mut self,
        ex: &E,
        [q, k, v, g, beta]: [&T; 5],
    ) -> Result<DeltaRuleOut<T>> {
        let c = match self {
            Seq::Rows { rows, .. } => return Ok(ex.gated_delta_rule(q, k, v, g, beta, rows.docs)?),
            Seq::Cached(c) => c,
        };
        let (b, t, hv, dv, dk) = (v.dims()[0], v.dims()[1], v.dims()[2], v.dims()[3], q.dims()[3]);
        c.advance(t)?;
        let state = match &mut c.state {
            Some(s) => s,
            None => c.state.insert(ex.zeros(&Shape::new([b, hv, dk, dv]))?),
        };
        let out = ex.gated_delta_rule_cached(q, k, v, g, beta, state)?;
        Ok(DeltaRuleOut {
            saved: ex.reshape(&out, out.shape())?,
            out,
            docs: None,
        })
    }
}

/// What one block keeps of the positions so far of B sequences of one
/// length: an attention block their keys and values `[B, P, Hkv, D]`
/// (made at the first append, with its rows, heads and head dimension, and
/// grown as positions come, P at most `cap`), of which the first `len`
/// positions are filled; a Gated DeltaNet block its convolution's last
/// K − 1 inputs `[B, K − 1, C]` and its delta rule's state
/// `[B, Hv, Dk, Dv]`.
pub struct LayerCache<T> {
    k: Option<T>,
    v: Option<T>,
    conv: Option<T>,
    state: Option<T>,
    len: usize,
    cap: usize,
}

impl<T> LayerCache<T> {
    /// Counts `n` more positions, refusing them past the capacity.
    fn advance(&mut self, n: usize) -> Result<()> {
        if self.len + n > self.cap {
            return Err(ZooError::invalid(
                "KvCache",
                format!(
                    "{} positions past {} cached fill more than its {}",
                    n, self.len, self.cap
                ),
            ));
        }
        self.len += n;
        Ok(())
    }

    fn append<E: Executor<Tensor = T>>(&mut self, ex: &E, k: &T, v: &T) -> Result<()>
    where
        T: TensorHandle,
    {
        let dims = k.dims().to_vec();
        let &[b, n, hkv, d] = dims.as_slice() else {
            return Err(ZooError::invalid(
                "KvCache",
                format!("keys {dims:?} must be [B, T, Hkv, D]"),
            ));
        };
        let at = self.len;
        self.advance(n)?;
        for (slot, x) in [(&mut self.k, k), (&mut self.v, v)] {
            let held = slot.as_ref().map_or(0, |c| c.dims()[1]);
            if let Some(rows) = slot.as_ref().map(|c| c.dims()[0]).filter(|&r| r != b) {
                return Err(ZooError::invalid(
                    "KvCache",
                    format!("keys of {b} sequences for a cache of {rows}"),
                ));
            }
            // Rows of D: row r's position p's heads are rows (r·P + p)·Hkv ..
            if at + n > held {
                // Grown by doubling, up to the capacity: a long context
                // costs its memory only once a sequence reaches it.
                let grown = (at + n).max(2 * held).max(MIN_POSITIONS).min(self.cap);
                let mut bigger = ex.zeros(&Shape::new([b, grown, hkv, d]))?;
                if let Some(old) = slot.as_ref().filter(|_| at > 0) {
                    for r in 0..b {
                        let rows = ex.slice_rows(old, r * held * hkv, at * hkv)?;
                        ex.write_rows(&mut bigger, r * grown * hkv, &rows)?;
                    }
                }
                *slot = Some(bigger);
            }
            let cache = slot.as_mut().expect("made above");
            let p = cache.dims()[1];
            match b {
                1 => ex.write_rows(cache, at * hkv, x)?,
                _ => {
                    for r in 0..b {
                        let rows = ex.slice_rows(x, r * n * hkv, n * hkv)?;
                        ex.write_rows(cache, (r * p + at) * hkv, &rows)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Forgets every position (the buffers of keys and values are kept).
    fn clear(&mut self) {
        self.len = 0;
        self.conv = None;
        self.state = None;
    }
}

/// What every block of a model keeps of sequences of at most `cap`
/// positions: one, or several of one length (samples of one prompt, each
/// a row; the number is the first forward's).
pub struct KvCache<T> {
    pub(crate) layers: Vec<LayerCache<T>>,
    cap: usize,
    /// The positions a forward reached when the first cached keys were
    /// rotated: every cached key has that length's frequencies.
    rotated_at: Option<usize>,
}

impl<T> KvCache<T> {
    /// An empty cache for `cap` positions of `cfg`'s model; refused for a
    /// sequence longer than GPT-2's learned positions.
    pub fn new(cfg: &ModelConfig, cap: usize) -> Result<Self> {
        cfg.check_seq_len(cap)?;
        let layers = (0..cfg.num_layers)
            .map(|_| LayerCache {
                k: None,
                v: None,
                conv: None,
                state: None,
                len: 0,
                cap,
            })
            .collect();
        Ok(KvCache {
            layers,
            cap,
            rotated_at: None,
        })
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Keeps only the first `n` positions, where every block can forget
    /// the rest: an attention block can (its later keys are overwritten),
    /// a Gated DeltaNet's state cannot go back. False (and the cache as it
    /// was) where it cannot.
    pub fn truncate(&mut self, n: usize) -> bool {
        if n >= self.len() {
            return n == self.len();
        }
        if self.layers.iter().any(|l| l.state.is_some() || l.conv.is_some()) {
            return false;
        }
        self.layers.iter_mut().for_each(|l| l.len = n);
        if n == 0 {
            self.rotated_at = None;
        }
        true
    }

    /// Forgets every position.
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(LayerCache::clear);
        self.rotated_at = None;
    }

    /// Readies the cache for a forward whose positions end before `end`
    /// (those cached and the new ones). True where the cached keys'
    /// rotation holds there. RoPE scalings whose frequencies depend on how
    /// far a forward reaches (LongRoPE past its original context, dynamic
    /// NTK past the model's) change it; then the cache is emptied, to be
    /// filled again from the first position with the new frequencies, as
    /// the whole sequence run again would have them (transformers' Phi-3
    /// drops its cache at that point too).
    pub fn ready_for(&mut self, cfg: &ModelConfig, end: usize) -> bool {
        let holds = self.is_empty()
            || self.rotated_at.is_some_and(|at| {
                (0..cfg.num_layers).all(|l| {
                    let s = &cfg.rope(l).scaling;
                    s.key(at) == s.key(end)
                })
            });
        if !holds || self.is_empty() {
            self.clear();
            self.rotated_at = Some(end);
        }
        holds
    }
}
