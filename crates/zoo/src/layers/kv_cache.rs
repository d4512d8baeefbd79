//! Generation with a cache of keys and values: each block keeps the keys
//! and values of every position so far on the executor, so a new token
//! costs one position's products and one row of attention over the cache
//! instead of the whole sequence again (transformers' `DynamicCache`).
//!
//! The blocks run the same code as in training; only where their tokens
//! sit changes ([`Seq`]): RoPE starts at the cache's length, and attention
//! appends the new keys and values to the cache and reads it
//! ([`Executor::attention_cached`]). So every attention family is served
//! without a decoding path of its own. Models with linear-attention blocks
//! (the Gated DeltaNet's convolution and recurrent state) are refused: their
//! state would need a cache of its own.

use megatrain_tensor::{AttentionOut, AttnMask, Docs, Executor, Rope, Shape, TensorHandle};

use crate::{ModelConfig, Result, ZooError};

/// Where a block's tokens sit: rows of whole sequences (training,
/// evaluation, with the documents packed in them where there are), or the
/// next tokens of one sequence whose earlier keys and values a cache holds.
pub(crate) enum Seq<'a, T> {
    Rows(Option<&'a Docs>),
    Cached(&'a mut LayerKv<T>),
}

impl<T: TensorHandle> Seq<'_, T> {
    /// The documents packed in the rows (a cached sequence has none).
    pub(crate) fn docs(&self) -> Option<&Docs> {
        match self {
            Seq::Rows(d) => *d,
            Seq::Cached(_) => None,
        }
    }

    /// Block `layer`'s rotation of these tokens: from each row's (or
    /// document's) first token, or from the first position after the cache.
    pub(crate) fn rope(&self, cfg: &ModelConfig, layer: usize) -> Rope {
        let rope = cfg.rope(layer);
        match self {
            Seq::Rows(d) => rope.with_docs(d.cloned()),
            Seq::Cached(kv) => Rope {
                offset: rope.offset + kv.len,
                ..rope
            },
        }
    }

    /// Attention of q over k and v under `mask`: the rows' own, or the new
    /// keys and values appended to the cache and q over all of it.
    pub(crate) fn attend<E: Executor<Tensor = T>>(
        &mut self,
        ex: &E,
        q: &T,
        k: &T,
        v: &T,
        mask: AttnMask,
    ) -> Result<AttentionOut<T>> {
        match self {
            Seq::Rows(d) => Ok(ex.attention(q, k, v, mask.with_docs(d.cloned()))?),
            Seq::Cached(kv) => {
                kv.append(ex, k, v)?;
                let (k, v) = (kv.k.as_ref().expect("appended"), kv.v.as_ref().expect("appended"));
                Ok(ex.attention_cached(q, k, v, kv.len, mask)?)
            }
        }
    }
}

/// One block's keys and values `[1, cap, Hkv, D]`, of which the first
/// `len` positions are filled; made at the first append, with that
/// append's heads and head dimension.
pub struct LayerKv<T> {
    k: Option<T>,
    v: Option<T>,
    len: usize,
    cap: usize,
}

impl<T: TensorHandle> LayerKv<T> {
    fn append<E: Executor<Tensor = T>>(&mut self, ex: &E, k: &T, v: &T) -> Result<()> {
        let dims = k.dims().to_vec();
        let &[1, n, hkv, d] = dims.as_slice() else {
            return Err(ZooError::invalid(
                "KvCache",
                format!(
                    "keys {:?} must be [1, T, Hkv, D]: a cache holds one sequence",
                    dims
                ),
            ));
        };
        if self.len + n > self.cap {
            return Err(ZooError::invalid(
                "KvCache",
                format!(
                    "{} positions past {} cached fill more than its {}",
                    n, self.len, self.cap
                ),
            ));
        }
        for (slot, x) in [(&mut self.k, k), (&mut self.v, v)] {
            let cache = match slot {
                Some(c) => c,
                None => slot.insert(ex.zeros(&Shape::new([1, self.cap, hkv, d]))?),
            };
            // Rows of D: position p's heads are rows p·Hkv ..
            ex.write_rows(cache, self.len * hkv, x)?;
        }
        self.len += n;
        Ok(())
    }
}

/// The keys and values of every attention block of a model over one
/// sequence of at most `cap` positions.
pub struct KvCache<T> {
    pub(crate) layers: Vec<LayerKv<T>>,
    cap: usize,
    /// The positions a forward reached when the first cached keys were
    /// rotated: every cached key has that length's frequencies.
    rotated_at: Option<usize>,
}

impl<T> KvCache<T> {
    /// An empty cache for `cap` positions of `cfg`'s model; refused for
    /// models with linear-attention blocks, and for a sequence longer than
    /// GPT-2's learned positions.
    pub fn new(cfg: &ModelConfig, cap: usize) -> Result<Self> {
        if let Some(l) = (0..cfg.num_layers).find(|&l| cfg.is_linear_block(l)) {
            return Err(ZooError::invalid(
                "KvCache",
                format!(
                    "block {l} is a linear-attention block, whose recurrent state no key/value cache holds"
                ),
            ));
        }
        cfg.check_seq_len(cap)?;
        let layers = (0..cfg.num_layers)
            .map(|_| LayerKv {
                k: None,
                v: None,
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

    /// Whether `cfg`'s model can be generated from with a cache.
    pub fn supports(cfg: &ModelConfig) -> bool {
        !(0..cfg.num_layers).any(|l| cfg.is_linear_block(l))
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
            self.layers.iter_mut().for_each(|l| l.len = 0);
            self.rotated_at = Some(end);
        }
        holds
    }
}
