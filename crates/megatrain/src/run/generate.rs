//! Text generation: seeded temperature / top-k / top-p sampling from a model whose
//! layers are all uploaded once (fine for the small models one samples
//! while learning; a streamed version would upload layer by layer per
//! token). Each block keeps what it needs of the positions so far
//! ([`KvCache`]: keys and values, or a Gated DeltaNet's state), so a token
//! costs one position's forward; every token past the context (whose
//! window slides) re-runs the last `context` positions instead.

use megatrain_tensor::{Executor, Shape, upload_weight};
use megatrain_tier::{TransportDType, TransportMut, TransportRef, refresh_transport};
use megatrain_zoo::layers::{
    KvCache, block_forward, block_forward_cached, embedding_forward, embedding_forward_at, head_logits,
};
use megatrain_zoo::{HfCheckpoint, ModelConfig, upload_layer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::error::{Result, RunError};
use crate::trainer::uploads_of;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleOptions {
    pub tokens: usize,
    /// 0: greedy.
    pub temperature: f64,
    /// Keep the k most likely tokens (0 or ≥ vocabulary: all).
    pub top_k: usize,
    /// Then the fewest of them whose probabilities sum to at least this,
    /// in (0, 1] (1: all).
    pub top_p: f64,
    pub seed: u64,
    /// Ids the tokenizer can decode: only those below it are picked (a
    /// model's embedding rows are often padded past its tokenizer's
    /// vocabulary: Phi-3's 32064 for 32011 tokens). 0: every id.
    pub decodable: usize,
    /// Keep what each block needs of the positions so far for the next
    /// token (keys and values, a Gated DeltaNet's state); `false` re-runs
    /// every position for every token.
    pub kv_cache: bool,
}

/// A model's weights resident on an executor.
pub struct Resident<E: Executor> {
    pub model: ModelConfig,
    weights: Vec<Vec<E::Tensor>>,
}

impl<E: Executor> Resident<E> {
    pub fn load(ex: &E, ckpt: &HfCheckpoint) -> Result<Self> {
        Self::load_as(ex, ckpt, TransportDType::F32)
    }

    /// [`Resident::load`] through a `transport` copy: the weights the
    /// executor sees are those training with that precision uploads (bf16
    /// or f16 rounded, matrices held 16-bit, vectors widened).
    pub fn load_as(ex: &E, ckpt: &HfCheckpoint, transport: TransportDType) -> Result<Self> {
        let model = ckpt.config.clone();
        let mut weights = Vec::with_capacity(model.num_layers_total());
        for l in 0..model.num_layers_total() {
            let (table, slab) = ckpt.read_layer(l)?;
            let uploads = |copy| -> Result<Vec<E::Tensor>> {
                Ok(uploads_of(&table, copy)
                    .iter()
                    .map(|u| upload_weight(ex, u))
                    .collect::<std::result::Result<_, _>>()?)
            };
            weights.push(match transport {
                TransportDType::F32 => upload_layer(ex, &table, &slab)?,
                TransportDType::BF16 => {
                    let mut c = vec![half::bf16::ZERO; slab.len()];
                    refresh_transport(&slab, &mut TransportMut::BF16(&mut c));
                    uploads(TransportRef::BF16(&c))?
                }
                TransportDType::F16 => {
                    let mut c = vec![half::f16::ZERO; slab.len()];
                    refresh_transport(&slab, &mut TransportMut::F16(&mut c));
                    uploads(TransportRef::F16(&c))?
                }
            });
        }
        Ok(Resident { model, weights })
    }

    /// Logits `[V]` after the last of `ids`.
    pub fn next_logits(&self, ex: &E, ids: &[u32]) -> Result<Vec<f32>> {
        let cfg = &self.model;
        let t = ids.len();
        let mut x = embedding_forward(cfg, ex, &self.weights[0], ids, 1, t, None)?;
        for (layer, w) in self.weights[1..=cfg.num_layers].iter().enumerate() {
            x = block_forward(cfg, ex, layer, w, &x, None)?.0;
        }
        self.last_logits(ex, &x, t)
    }

    /// [`Resident::next_logits`] of `ids` that follow the positions `cache`
    /// holds; their keys and values join it.
    pub fn next_logits_cached(
        &self,
        ex: &E,
        cache: &mut KvCache<E::Tensor>,
        ids: &[u32],
    ) -> Result<Vec<f32>> {
        let cfg = &self.model;
        let mut x = embedding_forward_at(cfg, ex, &self.weights[0], ids, cache.len())?;
        for (layer, w) in self.weights[1..=cfg.num_layers].iter().enumerate() {
            x = block_forward_cached(cfg, ex, layer, w, &x, cache)?;
        }
        self.last_logits(ex, &x, ids.len())
    }

    /// The head's logits of the last of the `t` rows of `x: [1, t, C]`.
    fn last_logits(&self, ex: &E, x: &E::Tensor, t: usize) -> Result<Vec<f32>> {
        let cfg = &self.model;
        let x2 = ex.reshape(x, &Shape::new(vec![t, cfg.hidden_size]))?;
        let last = ex.slice_rows(&x2, t - 1, 1)?;
        let tied = cfg.tie_word_embeddings.then(|| &self.weights[0][0]);
        let logits = head_logits(cfg, ex, &self.weights[cfg.num_layers + 1], tied, &last)?;
        let mut out = vec![0.0; cfg.vocab_size];
        ex.download_into(&logits, &mut out)?;
        Ok(out)
    }
}

/// Picks a token from `logits` (temperature, then top-k, then top-p as
/// transformers' logits warpers apply them: of the k most likely, the
/// fewest whose probabilities sum to at least `top_p`, 1 keeping all),
/// deterministic in `rng`.
pub fn pick(logits: &[f32], temperature: f64, top_k: usize, top_p: f64, rng: &mut StdRng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    if temperature <= 0.0 {
        return argmax();
    }
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i].is_finite()).collect();
    if order.is_empty() {
        return argmax();
    }
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if top_k > 0 && top_k < order.len() {
        order.truncate(top_k);
    }
    let max = logits[order[0]] as f64;
    let mut weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / temperature).exp())
        .collect();
    if top_p < 1.0 {
        let all: f64 = weights.iter().sum();
        let mut sum = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                sum += w;
                sum >= top_p * all
            })
            .map_or(weights.len(), |i| i + 1);
        weights.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = weights.iter().sum();
    let mut u = rng.random::<f64>() * total;
    for (k, w) in weights.iter().enumerate() {
        if u < *w {
            return order[k] as u32;
        }
        u -= w;
    }
    order[order.len() - 1] as u32
}

/// `opts.tokens` new tokens after `prompt`.
pub fn generate<E: Executor>(
    ex: &E,
    model: &Resident<E>,
    prompt: &[u32],
    opts: SampleOptions,
) -> Result<Vec<u32>> {
    generate_until(ex, model, prompt, opts, &[])
}

/// What a generation keeps between tokens, and a chat between its turns:
/// the cache of the model's blocks (where `kv_cache` asks for one) and the
/// ids whose positions it holds.
pub struct Decoder<E: Executor> {
    cache: Option<KvCache<E::Tensor>>,
    ids: Vec<u32>,
}

impl<E: Executor> Decoder<E> {
    pub fn new(model: &Resident<E>, kv_cache: bool) -> Result<Self> {
        let context = model.model.max_position_embeddings.max(1);
        let cache = match kv_cache {
            true => Some(KvCache::new(&model.model, context)?),
            false => None,
        };
        Ok(Decoder {
            cache,
            ids: Vec::new(),
        })
    }

    /// Logits `[V]` after the last of `ids`, the whole sequence so far:
    /// the positions of its start that the cache holds are not run again
    /// (all but the last id where a chat's next prompt repeats the last
    /// one; the longest common start where it renders earlier turns
    /// otherwise). Past the model's context the window slides, and its
    /// last `context` positions run without the cache.
    pub fn next_logits(&mut self, ex: &E, model: &Resident<E>, ids: &[u32]) -> Result<Vec<f32>> {
        let context = model.model.max_position_embeddings.max(1);
        let cache = match self.cache.as_mut() {
            Some(c) if !ids.is_empty() && ids.len() <= context => c,
            _ => return model.next_logits(ex, &ids[ids.len().saturating_sub(context)..]),
        };
        let same = self.ids.iter().zip(ids).take_while(|(a, b)| a == b).count();
        // The last id runs again where it is cached: its logits are wanted.
        let mut keep = same.min(ids.len() - 1);
        if !cache.truncate(keep) {
            cache.clear();
            keep = 0;
        }
        if !cache.ready_for(&model.model, ids.len()) {
            keep = 0;
        }
        let logits = model.next_logits_cached(ex, cache, &ids[keep..])?;
        self.ids.truncate(keep);
        self.ids.extend_from_slice(&ids[keep..]);
        Ok(logits)
    }
}

/// [`generate`], ending before the first token that is one of `stop` (a
/// chat model's end-of-turn and end-of-sequence ids).
pub fn generate_until<E: Executor>(
    ex: &E,
    model: &Resident<E>,
    prompt: &[u32],
    opts: SampleOptions,
    stop: &[u32],
) -> Result<Vec<u32>> {
    let mut decoder = Decoder::new(model, opts.kv_cache)?;
    generate_with(ex, model, &mut decoder, prompt, opts, stop)
}

/// [`generate_until`] through `decoder`, which keeps what the cache holds
/// of `prompt` and the reply for the next call (a chat's next turn).
pub fn generate_with<E: Executor>(
    ex: &E,
    model: &Resident<E>,
    decoder: &mut Decoder<E>,
    prompt: &[u32],
    opts: SampleOptions,
    stop: &[u32],
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(RunError::option(
            "prompt",
            "\"\"",
            "encodes to no tokens; give some text",
        ));
    }
    let vocab = model.model.vocab_size;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RunError::option(
            "prompt",
            bad,
            format!("token outside the model's vocabulary of {vocab}"),
        ));
    }
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut ids = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.tokens);
    for _ in 0..opts.tokens {
        let logits = decoder.next_logits(ex, model, &ids)?;
        let n = match opts.decodable {
            0 => logits.len(),
            d => d.min(logits.len()),
        };
        let next = pick(&logits[..n], opts.temperature, opts.top_k, opts.top_p, &mut rng);
        if stop.contains(&next) {
            break;
        }
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}
