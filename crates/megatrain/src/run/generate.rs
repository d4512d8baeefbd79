//! Text generation: seeded temperature / top-k / top-p sampling from a
//! model whose layers are uploaded once ([`Resident`]) or streamed from the
//! host tier a layer at a time for every forward (a [`Trainer`]'s, for a
//! model larger than the device). Each block keeps what it needs of the
//! positions so far ([`KvCache`]: keys and values, or a Gated DeltaNet's
//! state), so a token costs one position's forward; every token past the
//! context (whose window slides) re-runs the last `context` positions
//! instead.

use megatrain_tensor::{Executor, upload_weight};
use megatrain_tier::{TransportDType, TransportMut, TransportRef, refresh_transport};
use megatrain_zoo::layers::{KvCache, next_logits};
use megatrain_zoo::{HfCheckpoint, ModelConfig, upload_layer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::error::{Result, RunError};
use crate::trainer::{Trainer, uploads_of};

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
    /// Then those at least this share of the most likely one's
    /// probability, in [0, 1] (0: all).
    pub min_p: f64,
    /// Before anything else, the logits of ids already in the sequence
    /// (the prompt's included) divided by this where positive and
    /// multiplied where negative (CTRL's penalty, as transformers applies
    /// it); > 0, 1 for none.
    pub repetition_penalty: f64,
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

/// How a model's authors ask it to be sampled: the keys of its
/// `generation_config.json` that transformers' `generate` reads, where the
/// file says `do_sample` (a file without it, as GPT-2's, names only
/// special ids, and leaves the caller's defaults). `do_sample: false` is
/// greedy; `true` samples, each key it leaves out at transformers' own
/// default (temperature 1, top-k 50, top-p 1, no min-p, no penalty).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerationConfig {
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub min_p: f64,
    pub repetition_penalty: f64,
}

impl GenerationConfig {
    /// `dir`'s `generation_config.json` where it has one that says
    /// `do_sample`; a value of the wrong kind is refused, naming the file
    /// and key.
    pub fn of_dir(dir: &std::path::Path) -> Result<Option<Self>> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(RunError::io(&path))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| RunError::file(&path, e.to_string()))?;
        let Some(sample) = v.get("do_sample") else {
            return Ok(None);
        };
        let bad = |key: &str| RunError::file(&path, format!("{key}: {} is not a number in range", v[key]));
        let number = |key: &str, default: f64| match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(default),
            Some(x) => x
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad(key)),
        };
        let sample = sample.as_bool().ok_or_else(|| bad("do_sample"))?;
        let out = GenerationConfig {
            temperature: match sample {
                true => number("temperature", 1.0)?,
                false => 0.0,
            },
            top_k: number("top_k", 50.0)? as usize,
            top_p: number("top_p", 1.0)?,
            min_p: number("min_p", 0.0)?,
            repetition_penalty: number("repetition_penalty", 1.0)?,
        };
        if !(out.top_p > 0.0 && out.top_p <= 1.0) {
            return Err(bad("top_p"));
        }
        if out.min_p > 1.0 {
            return Err(bad("min_p"));
        }
        if out.repetition_penalty <= 0.0 {
            return Err(bad("repetition_penalty"));
        }
        Ok(Some(out))
    }
}

/// What generation runs: a model's forward from ids to the logits after
/// the last of them, on an executor `E`, wherever its weights are.
pub trait LanguageModel<E: Executor> {
    fn config(&self) -> &ModelConfig;
    /// Logits `[B, V]` after the last of each row of `ids`, `batch`
    /// sequences of one length, row-major: with `cache`, ids that follow
    /// the positions it holds (their keys and values join it); without,
    /// the whole sequences.
    fn logits(&self, ids: &[u32], batch: usize, cache: Option<&mut KvCache<E::Tensor>>) -> Result<Vec<f32>>;
}

/// A model's weights resident on an executor: every layer uploaded once.
pub struct Resident<'e, E: Executor> {
    ex: &'e E,
    pub model: ModelConfig,
    weights: Vec<Vec<E::Tensor>>,
}

impl<'e, E: Executor> Resident<'e, E> {
    pub fn load(ex: &'e E, ckpt: &HfCheckpoint) -> Result<Self> {
        Self::load_as(ex, ckpt, TransportDType::F32)
    }

    /// [`Resident::load`] through a `transport` copy: the weights the
    /// executor sees are those training with that precision uploads (bf16
    /// or f16 rounded, matrices held 16-bit, vectors widened).
    pub fn load_as(ex: &'e E, ckpt: &HfCheckpoint, transport: TransportDType) -> Result<Self> {
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
        Ok(Resident { ex, model, weights })
    }
}

impl<E: Executor> LanguageModel<E> for Resident<'_, E> {
    fn config(&self) -> &ModelConfig {
        &self.model
    }

    fn logits(&self, ids: &[u32], batch: usize, cache: Option<&mut KvCache<E::Tensor>>) -> Result<Vec<f32>> {
        next_logits(&self.model, self.ex, ids, batch, cache, |l| {
            Ok::<_, RunError>(&self.weights[l][..])
        })
    }
}

/// Streamed: every forward loads each layer's transport copy from the
/// tier into the trainer's weight slots, as an evaluation does, so the
/// device holds two blocks' weights, the embedding, the head and the cache,
/// whatever the model's size; a token then costs one pass of the model
/// over the bus.
impl<E: Executor> LanguageModel<E> for Trainer<E> {
    fn config(&self) -> &ModelConfig {
        self.model()
    }

    fn logits(&self, ids: &[u32], batch: usize, cache: Option<&mut KvCache<E::Tensor>>) -> Result<Vec<f32>> {
        Ok(self.streamed_logits(ids, batch, cache)?)
    }
}

/// Picks a token from `logits` under `o` (temperature, then top-k, then
/// top-p, then min-p, as transformers' logits warpers apply them: of the k
/// most likely, the fewest whose probabilities sum to at least `top_p`, 1
/// keeping all; of those, the ones at least `min_p` times as likely as the
/// first), deterministic in `rng`.
pub fn pick(logits: &[f32], o: &SampleOptions, rng: &mut StdRng) -> u32 {
    let (temperature, top_k, top_p) = (o.temperature, o.top_k, o.top_p);
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
    if o.min_p > 0.0 {
        // The first weight is the most likely token's, exp(0) = 1.
        let keep = weights.iter().take_while(|&&w| w >= o.min_p).count().max(1);
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
pub fn generate<E: Executor, M: LanguageModel<E> + ?Sized>(
    model: &M,
    prompt: &[u32],
    opts: SampleOptions,
) -> Result<Vec<u32>> {
    generate_until(model, prompt, opts, &[])
}

/// What a generation keeps between tokens, and a chat between its turns:
/// the cache of the model's blocks (where `kv_cache` asks for one) and the
/// ids whose positions it holds.
pub struct Decoder<E: Executor> {
    cache: Option<KvCache<E::Tensor>>,
    ids: Vec<u32>,
}

impl<E: Executor> Decoder<E> {
    pub fn new(model: &ModelConfig, kv_cache: bool) -> Result<Self> {
        let context = model.max_position_embeddings.max(1);
        let cache = match kv_cache {
            true => Some(KvCache::new(model, context)?),
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
    pub fn next_logits<M: LanguageModel<E> + ?Sized>(&mut self, model: &M, ids: &[u32]) -> Result<Vec<f32>> {
        let context = model.config().max_position_embeddings.max(1);
        let cache = match self.cache.as_mut() {
            Some(c) if !ids.is_empty() && ids.len() <= context => c,
            _ => return model.logits(&ids[ids.len().saturating_sub(context)..], 1, None),
        };
        let same = self.ids.iter().zip(ids).take_while(|(a, b)| a == b).count();
        // The last id runs again where it is cached: its logits are wanted.
        let mut keep = same.min(ids.len() - 1);
        if !cache.truncate(keep) {
            cache.clear();
            keep = 0;
        }
        if !cache.ready_for(model.config(), ids.len()) {
            keep = 0;
        }
        let logits = model.logits(&ids[keep..], 1, Some(cache))?;
        self.ids.truncate(keep);
        self.ids.extend_from_slice(&ids[keep..]);
        Ok(logits)
    }
}

/// [`generate`], ending before the first token that is one of `stop` (a
/// chat model's end-of-turn and end-of-sequence ids).
pub fn generate_until<E: Executor, M: LanguageModel<E> + ?Sized>(
    model: &M,
    prompt: &[u32],
    opts: SampleOptions,
    stop: &[u32],
) -> Result<Vec<u32>> {
    let mut decoder = Decoder::new(model.config(), opts.kv_cache)?;
    generate_with(model, &mut decoder, prompt, opts, stop, &mut |_| {})
}

/// [`generate_until`] through `decoder`, which keeps what the cache holds
/// of `prompt` and the reply for the next call (a chat's next turn).
/// `each` sees the reply so far after every token it takes (to show it as
/// it comes).
pub fn generate_with<E: Executor, M: LanguageModel<E> + ?Sized>(
    model: &M,
    decoder: &mut Decoder<E>,
    prompt: &[u32],
    opts: SampleOptions,
    stop: &[u32],
    each: &mut dyn FnMut(&[u32]),
) -> Result<Vec<u32>> {
    check_prompt(model.config(), prompt)?;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut ids = prompt.to_vec();
    let mut out = Vec::with_capacity(opts.tokens);
    for _ in 0..opts.tokens {
        let next = opts.choose(&decoder.next_logits(model, &ids)?, &ids, &mut rng);
        if stop.contains(&next) {
            break;
        }
        ids.push(next);
        out.push(next);
        each(&out);
    }
    Ok(out)
}

/// `n` samples of up to `opts.tokens` new tokens after `prompt`, made
/// together: a row each of one batch, so every forward serves them all (a
/// streamed model's weights cross the bus once a token for all of them).
/// Sample i is what [`generate_until`] gives with the seed `opts.seed + i`:
/// each row draws from a generator of its own. Each ends before its first
/// token in `stop`; a row that has ended runs on (its ids are not read)
/// until every row has, since the rows share their length.
pub fn generate_samples<E: Executor, M: LanguageModel<E> + ?Sized>(
    model: &M,
    prompt: &[u32],
    n: usize,
    opts: SampleOptions,
    stop: &[u32],
) -> Result<Vec<Vec<u32>>> {
    let cfg = model.config();
    check_prompt(cfg, prompt)?;
    if n == 0 {
        return Err(RunError::option("samples", 0, "must be ≥ 1"));
    }
    let context = cfg.max_position_embeddings.max(1);
    let mut rngs: Vec<StdRng> = (0..n as u64)
        .map(|i| StdRng::seed_from_u64(opts.seed.wrapping_add(i)))
        .collect();
    let mut rows = vec![prompt.to_vec(); n];
    let mut ended: Vec<Option<usize>> = vec![None; n];
    let mut cache = match opts.kv_cache {
        true => Some(KvCache::new(cfg, context)?),
        false => None,
    };
    // Positions of every row the cache holds.
    let mut cached = 0;
    for _ in 0..opts.tokens {
        if ended.iter().all(Option::is_some) {
            break;
        }
        let len = rows[0].len();
        let ids = |from: usize| -> Vec<u32> { rows.iter().flat_map(|r| r[from..].iter().copied()).collect() };
        let logits = match cache.as_mut() {
            Some(c) if len <= context => {
                if !c.ready_for(cfg, len) {
                    cached = 0;
                }
                let l = model.logits(&ids(cached), n, Some(c))?;
                cached = len;
                l
            }
            _ => model.logits(&ids(len.saturating_sub(context)), n, None)?,
        };
        for (i, (row, logits)) in rows.iter_mut().zip(logits.chunks(cfg.vocab_size)).enumerate() {
            let next = match ended[i] {
                Some(_) => row[len - 1],
                None => opts.choose(logits, row, &mut rngs[i]),
            };
            if ended[i].is_none() && stop.contains(&next) {
                ended[i] = Some(len);
            }
            row.push(next);
        }
    }
    Ok(rows
        .into_iter()
        .zip(ended)
        .map(|(r, end)| r[prompt.len()..end.unwrap_or(r.len())].to_vec())
        .collect())
}

/// Refuses an empty prompt and ids past the vocabulary, naming them.
fn check_prompt(cfg: &ModelConfig, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(RunError::option(
            "prompt",
            "\"\"",
            "encodes to no tokens; give some text",
        ));
    }
    let vocab = cfg.vocab_size;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RunError::option(
            "prompt",
            bad,
            format!("token outside the model's vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

impl SampleOptions {
    /// The next token after `history` (the sequence so far) from its
    /// `logits`, among the ids the tokenizer decodes: the repetition
    /// penalty on the ids of `history`, then [`pick`].
    pub fn choose(&self, logits: &[f32], history: &[u32], rng: &mut StdRng) -> u32 {
        let n = match self.decodable {
            0 => logits.len(),
            d => d.min(logits.len()),
        };
        if self.repetition_penalty == 1.0 {
            return pick(&logits[..n], self, rng);
        }
        let mut penalized = logits[..n].to_vec();
        let mut seen = vec![false; n];
        for &id in history {
            let i = id as usize;
            if i < n && !std::mem::replace(&mut seen[i], true) {
                let x = &mut penalized[i];
                *x = match *x < 0.0 {
                    true => (*x as f64 * self.repetition_penalty) as f32,
                    false => (*x as f64 / self.repetition_penalty) as f32,
                };
            }
        }
        pick(&penalized, self, rng)
    }
}
