//! The routed MLP of Mixtral's, Qwen3-MoE's, OLMoE's, Qwen2-MoE's and
//! GPT-OSS's and GLM-4.5's sparse blocks (Qwen2-MoE's with a gated
//! shared expert beside the routed ones, GLM-4.5's with an ungated one;
//! GPT-OSS's router and experts with biases, each expert's gate and up
//! one interleaved product through a clamped SwiGLU; GLM-4.5's router
//! DeepSeek-V3's, [`Router::Sigmoid`]).
//!
//! A linear router scores every expert for each token; the host reads the
//! scores (`[N, E]`, small beside the block), takes their softmax and
//! each token's top k, and from them each expert's rows: which tokens it
//! serves and with what weight. An expert gathers its rows of the input
//! (`embedding` over the input as a table), runs its SwiGLU MLP, scales
//! each output row by its weight (`scale_rows`) and scatter-adds it into
//! the block's output (`embedding_backward`, whose ids are unique within
//! an expert). The routing is kept for the backward, which therefore
//! takes the same experts: a recomputed forward routes identically, since
//! it scores the same input with the same weights.
//!
//! The backward gathers each expert's rows of the output gradient; their
//! dot products with the expert's unscaled outputs (`row_dots`) are the
//! gradients of its routing weights, which the host carries back through
//! the top-k renormalisation and the softmax to the router's scores and
//! uploads for the router's own backward. The selection itself has no
//! gradient, as in transformers.
//!
//! As transformers does, the softmax is taken in f32 or wider (here f64,
//! from scores the executor downloads as f32) and an expert no token
//! chose costs nothing forward and gives zero gradients.

use megatrain_tensor::{ClampedGlu, Executor, HostSlice, TensorHandle, Transpose};

use super::{GluLinears, GluSaved, Linear, glu_mlp, glu_mlp_backward, needs, put, shape};
use crate::{ModelConfig, Moe, Result, Router, ZooError};

/// Positions in a block's table of its router and experts: the router at
/// `router` (with GPT-OSS's bias), expert e's gate, up and down at
/// `first + 3e` and the two after it, then a shared expert's gate, up,
/// down and sigmoid gate (as `tables.rs` pushes them). GPT-OSS's
/// (`clamped`) lie one kind at a time from `first`: every expert's gate/up,
/// their biases, their downs, their biases.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Experts {
    pub router: Linear,
    /// DeepSeek-V3's correction bias of the choice.
    pub correction: Option<usize>,
    pub first: usize,
    pub count: usize,
    /// A shared expert's gate, up and down, and Qwen2-MoE's gate of it.
    pub shared: Option<([usize; 3], Option<usize>)>,
    pub clamped: Option<ClampedGlu>,
}

impl Experts {
    /// Table slots an expert has.
    pub(crate) fn slots_per_expert(clamped: bool) -> usize {
        if clamped { 4 } else { 3 }
    }

    /// The slots of expert `e`'s gate, up and down projections.
    fn of(&self, e: usize) -> [usize; 3] {
        let g = self.first + 3 * e;
        [g, g + 1, g + 2]
    }

    /// GPT-OSS's expert `e`: its gate/up product and its down product,
    /// each `(weight, bias)`.
    fn clamped_of(&self, e: usize) -> [Linear; 2] {
        let at = |kind: usize| self.first + kind * self.count + e;
        [(at(0), Some(at(1))), (at(2), Some(at(3)))]
    }

    /// Every slot of expert `e`.
    fn slots(&self, e: usize) -> Vec<usize> {
        match self.clamped {
            Some(_) => (0..4).map(|kind| self.first + kind * self.count + e).collect(),
            None => self.of(e).to_vec(),
        }
    }

    /// Expert `e`'s projections (no biases).
    fn linears(&self, e: usize) -> GluLinears {
        self.of(e).map(|i| (i, None))
    }

    /// The shared expert's projections and its gate's slot.
    fn shared(&self) -> Option<(GluLinears, Option<usize>)> {
        self.shared.map(|(p, gate)| (p.map(|i| (i, None)), gate))
    }
}

/// The tokens one expert serves, and what its forward left.
#[derive(Debug)]
struct ExpertSaved<T> {
    expert: usize,
    /// Rows of the block's `[N, C]` input, ascending.
    rows: Vec<u32>,
    /// Each row's routing weight.
    weights: Vec<f64>,
    /// Each row's rank among its token's k choices.
    ranks: Vec<usize>,
    x: T,
    mlp: ExpertMlp<T>,
    /// The expert's outputs before their weights.
    y: T,
}

/// What an expert's MLP forward leaves for its backward: a GLU MLP's, or
/// GPT-OSS's interleaved gate/up product and the clamped SwiGLU of it.
#[derive(Debug)]
enum ExpertMlp<T> {
    Glu(GluSaved<T>),
    Clamped { gate_up: T, s: T, c: ClampedGlu },
}

/// Expert `e`'s MLP of its rows `x`: the output and what its backward needs.
fn expert_forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    l: &Experts,
    e: usize,
    x: &E::Tensor,
) -> Result<(E::Tensor, ExpertMlp<E::Tensor>)> {
    let Some(c) = l.clamped else {
        let (y, saved) = glu_mlp(cfg, ex, x, w, l.linears(e))?;
        return Ok((y, ExpertMlp::Glu(saved)));
    };
    // GPT-OSS's weights are `[in, out]` (`x @ w`), as its checkpoints hold them.
    let [(gu, gub), (d, db)] = l.clamped_of(e);
    let nn = Transpose::NN;
    let gate_up = ex.matmul(x, &w[gu], gub.map(|i| &w[i]), nn)?;
    let s = ex.swiglu_clamped(&gate_up, c)?;
    let y = ex.matmul(&s, &w[d], db.map(|i| &w[i]), nn)?;
    Ok((y, ExpertMlp::Clamped { gate_up, s, c }))
}

/// The backward of [`expert_forward`] from `dy`: the expert's weight
/// gradients stored at their slots, the gradient of its rows returned.
#[allow(clippy::too_many_arguments)]
fn expert_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    l: &Experts,
    e: usize,
    x: &E::Tensor,
    saved: &ExpertMlp<E::Tensor>,
    dy: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let (gate_up, s, c) = match saved {
        ExpertMlp::Glu(saved) => {
            let dx = glu_mlp_backward(cfg, ex, x, w, l.linears(e), saved, dy, None, grads)?;
            return Ok(dx.expect("returned without `into`"));
        }
        ExpertMlp::Clamped { gate_up, s, c } => (gate_up, s, *c),
    };
    let [up, down] = l.clamped_of(e);
    let nn = Transpose::NN;
    let mut gd = ex.matmul_backward(s, &w[down.0], dy, nn, needs(down.1))?;
    let ds = gd.da.take().expect("requested gradient");
    put(grads, down, gd);
    let dgate_up = ex.swiglu_clamped_backward(gate_up, &ds, c)?;
    let mut gu = ex.matmul_backward(x, &w[up.0], &dgate_up, nn, needs(up.1))?;
    let dx = gu.da.take().expect("requested gradient");
    put(grads, up, gu);
    Ok(dx)
}

/// A shared expert: its products' activations, its output before the
/// gate, and each token's gate `sigmoid(x · w)` (Qwen2-MoE's; empty for
/// GLM-4.5's, which has none).
#[derive(Debug)]
struct SharedSaved<T> {
    mlp: GluSaved<T>,
    y: T,
    sig: Vec<f64>,
}

/// What a routed MLP's backward needs from its forward.
#[derive(Debug)]
pub struct MoeSaved<T> {
    num_experts: usize,
    shared: Option<SharedSaved<T>>,
    /// Each token's router probabilities, `[N, E]`.
    probs: Vec<f64>,
    /// Each token's k chosen experts, best first, `[N, k]`.
    picks: Vec<usize>,
    experts: Vec<ExpertSaved<T>>,
}

impl<T> MoeSaved<T> {
    /// What the load-balancing loss reads of this block's routing: over
    /// every token, or those `tokens` marks.
    pub fn stats(&self, tokens: Option<&[bool]>) -> RouterStats {
        let e = self.num_experts;
        let n = self.probs.len() / e;
        let k = self.picks.len() / n.max(1);
        let counts = |t: usize| tokens.is_none_or(|m| m.get(t).copied().unwrap_or(false));
        let mut chosen = vec![0.0; e];
        let mut probs = vec![0.0; e];
        for t in (0..n).filter(|&t| counts(t)) {
            self.picks[t * k..(t + 1) * k]
                .iter()
                .for_each(|&x| chosen[x] += 1.0);
            let row = &self.probs[t * e..(t + 1) * e];
            probs.iter_mut().zip(row).for_each(|(s, p)| *s += p);
        }
        RouterStats {
            tokens: (0..n).filter(|&t| counts(t)).count(),
            chosen,
            probs,
            digest: picks_digest(&self.picks, k, counts),
        }
    }
}

/// FNV-1a over each counted token's index and its k experts, best first:
/// equal for two forwards that sent every counted token to the same
/// experts in the same order (and, but for a collision, only then).
fn picks_digest(picks: &[usize], k: usize, counts: impl Fn(usize) -> bool) -> u64 {
    let mut h = FNV_OFFSET;
    for (t, chosen) in picks.chunks(k.max(1)).enumerate().filter(|&(t, _)| counts(t)) {
        for x in std::iter::once(t).chain(chosen.iter().copied()) {
            h = fnv(h, x as u64);
        }
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `stats`' digests (one forward's routed blocks, in order) folded into
/// `so_far` (the digest of the forwards before it, if any routed): `None`
/// while no block has routed.
pub fn routing_digest(so_far: Option<u64>, stats: &[RouterStats]) -> Option<u64> {
    stats
        .iter()
        .fold(so_far, |h, s| Some(fnv(h.unwrap_or(FNV_OFFSET), s.digest)))
}

/// One more 8-byte value into an FNV-1a hash.
fn fnv(h: u64, x: u64) -> u64 {
    x.to_le_bytes()
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// What a routed block's forward tells the routers' load-balancing loss:
/// over its `tokens`, how often each expert was among a token's k, and
/// the sum of each expert's router probability.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterStats {
    pub tokens: usize,
    pub chosen: Vec<f64>,
    pub probs: Vec<f64>,
    /// Which experts each of the tokens chose, as a hash: two forwards
    /// routed those tokens alike where it is equal.
    pub digest: u64,
}

/// The routers' load-balancing loss of one forward, as transformers adds
/// it under `output_router_logits`: `coef · E · Σ_e f_e · P_e`, where over
/// the tokens of every routed block together f_e is the share of choices
/// that went to expert e (k a token) and P_e its mean router
/// probability. The choices carry no gradient, so the loss's gradient
/// with respect to each token's probability of expert e is the same
/// constant in every routed block: `dprob[e]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterAux {
    pub loss: f64,
    pub dprob: Vec<f64>,
    /// The tokens the loss averages over, and so the only ones whose
    /// probabilities take `dprob` (`None`: every token).
    pub tokens: Option<Vec<bool>>,
}

impl RouterAux {
    /// The loss of the routed blocks' `stats` from one forward, times
    /// `weight` (the share of a step's loss this forward's is: a step of
    /// several micro-batches averages theirs); `None` where the model
    /// adds no such loss or no block routed. `tokens`: the tokens `stats`
    /// were taken over ([`super::BlockSaved::router_stats`]).
    pub fn new(
        cfg: &ModelConfig,
        stats: &[RouterStats],
        weight: f64,
        tokens: Option<&[bool]>,
    ) -> Option<RouterAux> {
        let moe = cfg.moe.as_ref()?;
        let coef = moe.aux_loss_coef?;
        let e = moe.num_experts;
        let n = stats.iter().map(|s| s.tokens).sum::<usize>() as f64;
        if n == 0.0 {
            return None;
        }
        let mean = |f: fn(&RouterStats) -> &[f64], x: usize| stats.iter().map(|s| f(s)[x]).sum::<f64>() / n;
        let share: Vec<f64> = (0..e).map(|x| mean(|s| &s.chosen, x)).collect();
        let prob: Vec<f64> = (0..e).map(|x| mean(|s| &s.probs, x)).collect();
        let scale = weight * coef * e as f64;
        Some(RouterAux {
            loss: scale * share.iter().zip(&prob).map(|(f, p)| f * p).sum::<f64>(),
            dprob: share.iter().map(|f| scale * f / n).collect(),
            tokens: tokens.map(<[bool]>::to_vec),
        })
    }
}

/// The routing of `n` tokens from their router scores: each token's
/// softmax over the experts and its `k` most probable (ties to the lower
/// index), with their weights (renormalised over the k under
/// `norm_topk`).
fn route(scores: &[f64], n: usize, moe: &Moe) -> (Vec<f64>, Vec<usize>, Vec<f64>) {
    let (e, k) = (moe.num_experts, moe.top_k);
    let probs = softmax_rows(scores, e);
    let mut picks = vec![0usize; n * k];
    let mut weights = vec![0.0f64; n * k];
    for t in 0..n {
        let p = &probs[t * e..(t + 1) * e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|a, b| best_first(p, a, b));
        let chosen = &order[..k];
        let total: f64 = chosen.iter().map(|&x| p[x]).sum();
        for (j, &x) in chosen.iter().enumerate() {
            picks[t * k + j] = x;
            weights[t * k + j] = match moe.norm_topk {
                true => p[x] / total,
                false => p[x],
            };
        }
    }
    (probs, picks, weights)
}

/// Each row of `e` scores' softmax.
fn softmax_rows(scores: &[f64], e: usize) -> Vec<f64> {
    let mut probs = vec![0.0f64; scores.len()];
    for (p, row) in probs.chunks_mut(e).zip(scores.chunks(e)) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
        p.iter_mut().zip(row).for_each(|(p, &s)| *p = (s - max).exp());
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|p| *p /= sum);
    }
    probs
}

/// Experts `a` and `b` ordered by `v`, best first, ties to the lower
/// index. total_cmp orders a NaN (a diverged run's) above every number:
/// a pick is still some k distinct experts.
fn best_first(v: &[f64], a: &usize, b: &usize) -> std::cmp::Ordering {
    v[*b].total_cmp(&v[*a]).then(a.cmp(b))
}

/// The experts of the `topk_groups` groups of `per` with the best
/// `merit` (one a group), best first by `choice`: what DeepSeek's routers
/// pick a token's k from.
fn open_experts(choice: &[f64], merit: &[f64], per: usize, topk_groups: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..merit.len()).collect();
    order.sort_by(|a, b| best_first(merit, a, b));
    let mut open: Vec<usize> = order[..topk_groups]
        .iter()
        .flat_map(|&g| g * per..(g + 1) * per)
        .collect();
    open.sort_by(|a, b| best_first(choice, a, b));
    open
}

/// The routed MLP of `x: [B, T, C]` (the block's normed input): `[B, T, C]`.
pub(crate) fn forward<E: Executor>(
    cfg: &ModelConfig,
    moe: &Moe,
    ex: &E,
    w: &[E::Tensor],
    l: Experts,
    x: &E::Tensor,
) -> Result<(E::Tensor, MoeSaved<E::Tensor>)> {
    let (b, t, c) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let n = b * t;
    let x2 = ex.reshape(x, &shape(&[n, c]))?;
    let ne = moe.num_experts;
    let router_bias = l.router.1.map(|i| &w[i]);
    let scores = ex.matmul(&x2, &w[l.router.0], router_bias, Transpose::NT)?;
    // A shared expert's gate comes down with the scores, as their last
    // column: one wait.
    let gate = l.shared().and_then(|(_, g)| g);
    let (scores, cols) = match gate {
        Some(si) => {
            let z = ex.matmul(&x2, &w[si], None, Transpose::NT)?;
            (ex.concat_last(&[&scores, &z])?, ne + 1)
        }
        None => (scores, ne),
    };
    // DeepSeek-V3's correction bias, a constant of the checkpoint, comes
    // down first: its wait runs the router's product too, and the scores'
    // then finds the device idle.
    let correction = match l.correction {
        Some(ci) => {
            let mut b = vec![0.0f32; ne];
            ex.download_into(&w[ci], &mut b)?;
            b.into_iter().map(f64::from).collect()
        }
        None => Vec::new(),
    };
    let mut host = vec![0.0f32; n * cols];
    ex.download_into(&scores, &mut host)?;
    let rows = host.chunks(cols);
    let sig: Vec<f64> = match gate {
        Some(_) => rows
            .clone()
            .map(|r| 1.0 / (1.0 + (-(r[ne] as f64)).exp()))
            .collect(),
        None => Vec::new(),
    };
    let host: Vec<f64> = rows.flat_map(|r| r[..ne].iter().map(|&v| v as f64)).collect();
    let (probs, picks, weights) = match moe.router {
        Router::Softmax => route(&host, n, moe),
        Router::Sigmoid { .. } => route_sigmoid(&host, &correction, n, moe),
        Router::SoftmaxGroups { .. } => route_softmax_groups(&host, n, moe),
    };
    // Each expert's rows (ascending), their weights and ranks.
    let mut serves: Vec<(Vec<u32>, Vec<f64>, Vec<usize>)> = vec![Default::default(); l.count];
    for (i, (&p, &wt)) in picks.iter().zip(&weights).enumerate() {
        let (rows, ws, ranks) = &mut serves[p];
        rows.push((i / moe.top_k) as u32);
        ws.push(wt);
        ranks.push(i % moe.top_k);
    }
    let mut out = ex.zeros(&shape(&[n, c]))?;
    let mut experts = Vec::new();
    for (e, (rows, ws, ranks)) in serves.into_iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let xe = ex.embedding(&rows, &x2)?;
        let (y, mlp) = expert_forward(cfg, ex, w, &l, e, &xe)?;
        ex.embedding_backward(&rows, &ex.scale_rows(&y, &ws)?, &mut out)?;
        experts.push(ExpertSaved {
            expert: e,
            rows,
            weights: ws,
            ranks,
            x: xe,
            mlp,
            y,
        });
    }
    let shared = match l.shared() {
        Some((linears, gate)) => {
            let (y, mlp) = glu_mlp(cfg, ex, &x2, w, linears)?;
            match gate {
                Some(_) => ex.add_assign(&mut out, &ex.scale_rows(&y, &sig)?)?,
                None => ex.add_assign(&mut out, &y)?,
            }
            Some(SharedSaved { mlp, y, sig })
        }
        None => None,
    };
    let saved = MoeSaved {
        num_experts: moe.num_experts,
        shared,
        probs,
        picks,
        experts,
    };
    Ok((ex.reshape(&out, &shape(&[b, t, c]))?, saved))
}

/// The backward of [`forward`] from `dy: [B, T, C]`: the input's gradient,
/// the router's and every expert's weight gradients stored at their
/// table slots.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<E: Executor>(
    cfg: &ModelConfig,
    moe: &Moe,
    ex: &E,
    w: &[E::Tensor],
    l: Experts,
    x: &E::Tensor,
    s: &MoeSaved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let (b, t, c) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    let (n, k, ne) = (b * t, moe.top_k, moe.num_experts);
    let aux = match (aux, moe.aux_loss_coef) {
        (Some(a), Some(_)) if a.dprob.len() == ne && a.tokens.as_ref().is_none_or(|m| m.len() == n) => {
            Some((a.dprob.as_slice(), a.tokens.as_deref()))
        }
        (None, None) => None,
        (a, c) => {
            let given = a.map_or("none".to_string(), |a| {
                format!(
                    "one for {} experts{}",
                    a.dprob.len(),
                    a.tokens
                        .as_ref()
                        .map_or(String::new(), |m| format!(" over {} of {n} tokens", m.len()))
                )
            });
            return Err(ZooError::invalid(
                "moe backward",
                format!(
                    "the model's load-balancing loss coefficient is {c:?} over {ne} experts; its gradient given: {given}"
                ),
            ));
        }
    };
    if s.probs.len() != n * ne {
        return Err(ZooError::invalid(
            "moe backward",
            format!(
                "routing saved for {} tokens, the input has {n}",
                s.probs.len() / ne
            ),
        ));
    }
    let x2 = ex.reshape(x, &shape(&[n, c]))?;
    let dy2 = ex.reshape(dy, &shape(&[n, c]))?;
    let mut dx = ex.zeros(&shape(&[n, c]))?;
    // Each expert's rows' d loss / d routing weight, brought to the host
    // together after the experts' backward (one wait, not one an expert).
    let mut dots = Vec::with_capacity(s.experts.len());
    for es in &s.experts {
        let dys = ex.embedding(&es.rows, &dy2)?;
        dots.push(ex.row_dots(&dys, &es.y)?);
        let dye = ex.scale_rows(&dys, &es.weights)?;
        let dxe = expert_backward(cfg, ex, w, &l, es.expert, &es.x, &es.mlp, &dye, grads)?;
        ex.embedding_backward(&es.rows, &dxe, &mut dx)?;
    }
    // The shared expert's output gradient, a gate's with the experts'
    // routing weights' (a last row-dot, for each token).
    let gate = l.shared().and_then(|(_, g)| g);
    if let (Some((linears, _)), Some(sh)) = (l.shared(), &s.shared) {
        let dys = match gate {
            Some(_) => {
                dots.push(ex.row_dots(&dy2, &sh.y)?);
                ex.scale_rows(&dy2, &sh.sig)?
            }
            None => ex.reshape(&dy2, dy2.shape())?,
        };
        glu_mlp_backward(cfg, ex, &x2, w, linears, &sh.mlp, &dys, Some(&mut dx), grads)?;
    }
    // The correction bias takes no gradient (transformers' buffer).
    if let Some(ci) = l.correction {
        grads[ci] = Some(ex.zeros(w[ci].shape())?);
    }
    // The experts no token chose.
    for slot in (0..l.count).flat_map(|e| l.slots(e)) {
        if grads[slot].is_none() {
            grads[slot] = Some(ex.zeros(w[slot].shape())?);
        }
    }
    let shared_rows = if gate.is_some() && s.shared.is_some() {
        n
    } else {
        0
    };
    let mut host = vec![0.0f32; s.experts.iter().map(|es| es.rows.len()).sum::<usize>() + shared_rows];
    if !dots.is_empty() {
        ex.download_into(&ex.concat_last(&dots.iter().collect::<Vec<_>>())?, &mut host)?;
    }
    // For each token's k choices.
    let mut dweights = vec![0.0f64; n * k];
    let mut at = 0;
    for es in &s.experts {
        for (&row, &rank) in es.rows.iter().zip(&es.ranks) {
            dweights[row as usize * k + rank] = host[at] as f64;
            at += 1;
        }
    }
    if let (Some(si), Some(sh)) = (gate, &s.shared) {
        // d sigmoid(z) / dz = σ(1 − σ).
        let dz: Vec<f32> = host[at..]
            .iter()
            .zip(&sh.sig)
            .map(|(&d, &g)| (d as f64 * g * (1.0 - g)) as f32)
            .collect();
        let dz = ex.upload_slice(&shape(&[n, 1]), HostSlice::F32(&dz))?;
        let gs = ex.matmul_backward_da_into(&x2, &w[si], &dz, Transpose::NT, needs(None), &mut dx)?;
        grads[si] = gs.db;
    }
    let dscores = match moe.router {
        Router::Softmax => router_backward(&s.probs, &s.picks, &dweights, aux, n, moe),
        Router::Sigmoid { .. } => sigmoid_router_backward(&s.probs, &s.picks, &dweights, n, moe),
        // w = scale · p, never renormalised (`norm_topk` is false).
        Router::SoftmaxGroups { scale, .. } => {
            let scaled: Vec<f64> = dweights.iter().map(|d| d * scale).collect();
            router_backward(&s.probs, &s.picks, &scaled, aux, n, moe)
        }
    };
    let ds = ex.upload_slice(&shape(&[n, ne]), HostSlice::F32(&dscores))?;
    let gr = ex.matmul_backward_da_into(
        &x2,
        &w[l.router.0],
        &ds,
        Transpose::NT,
        needs(l.router.1),
        &mut dx,
    )?;
    put(grads, l.router, gr);
    Ok(ex.reshape(&dx, &shape(&[b, t, c]))?)
}

/// The gradient of the router's scores `[N, E]` from those of each
/// token's k routing weights: back through the renormalisation over the
/// k (where `norm_topk`) and the softmax; an expert not chosen has a
/// probability only the load-balancing loss reads (its `aux` gradient,
/// the same for every token it counts: all, or those its mask marks).
fn router_backward(
    probs: &[f64],
    picks: &[usize],
    dweights: &[f64],
    aux: Option<(&[f64], Option<&[bool]>)>,
    n: usize,
    moe: &Moe,
) -> Vec<f32> {
    let (e, k) = (moe.num_experts, moe.top_k);
    let mut out = vec![0.0f32; n * e];
    let mut dp = vec![0.0f64; e];
    for t in 0..n {
        let p = &probs[t * e..(t + 1) * e];
        let pk = &picks[t * k..(t + 1) * k];
        let dw = &dweights[t * k..(t + 1) * k];
        match aux {
            Some((a, m)) if m.is_none_or(|m| m[t]) => dp.copy_from_slice(a),
            _ => dp.iter_mut().for_each(|d| *d = 0.0),
        }
        match moe.norm_topk {
            // w_j = p_j / S with S = Σ p_i: dp_j = (dw_j − Σ_i dw_i w_i) / S.
            true => {
                let total: f64 = pk.iter().map(|&x| p[x]).sum();
                let mean: f64 = pk.iter().zip(dw).map(|(&x, &d)| d * p[x] / total).sum();
                for (&x, &d) in pk.iter().zip(dw) {
                    dp[x] += (d - mean) / total;
                }
            }
            false => {
                for (&x, &d) in pk.iter().zip(dw) {
                    dp[x] += d;
                }
            }
        }
        let inner: f64 = p.iter().zip(&dp).map(|(p, d)| p * d).sum();
        for (o, (p, d)) in out[t * e..(t + 1) * e].iter_mut().zip(p.iter().zip(&dp)) {
            *o = (p * (d - inner)) as f32;
        }
    }
    out
}

/// DeepSeek-V3's routing ([`Router::Sigmoid`]) of `n` tokens from their
/// router scores and the correction bias: each token's sigmoid scores
/// `[N, E]`, its k experts (the best biased scores among the experts of
/// its best groups, ties to the lower index) and their weights.
fn route_sigmoid(logits: &[f64], bias: &[f64], n: usize, moe: &Moe) -> (Vec<f64>, Vec<usize>, Vec<f64>) {
    let Router::Sigmoid {
        groups,
        topk_groups,
        scale,
    } = moe.router
    else {
        unreachable!("a sigmoid router's routing")
    };
    let (e, k) = (moe.num_experts, moe.top_k);
    let per = e / groups;
    let scores: Vec<f64> = logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let mut picks = vec![0usize; n * k];
    let mut weights = vec![0.0f64; n * k];
    for t in 0..n {
        let s = &scores[t * e..(t + 1) * e];
        let choice: Vec<f64> = s.iter().zip(bias).map(|(s, b)| s + b).collect();
        // A group's merit: the sum of its two best biased scores.
        let merit: Vec<f64> = choice
            .chunks(per)
            .map(|g| {
                let mut g = g.to_vec();
                g.sort_by(|a, b| b.total_cmp(a));
                g.iter().take(2).sum()
            })
            .collect();
        let open = open_experts(&choice, &merit, per, topk_groups);
        let chosen = &open[..k];
        let total: f64 = chosen.iter().map(|&x| s[x]).sum::<f64>() + 1e-20;
        for (j, &x) in chosen.iter().enumerate() {
            picks[t * k + j] = x;
            weights[t * k + j] = scale
                * match moe.norm_topk {
                    true => s[x] / total,
                    false => s[x],
                };
        }
    }
    (scores, picks, weights)
}

/// DeepSeek-V2's routing ([`Router::SoftmaxGroups`]) of `n` tokens from
/// their router scores: each token's softmax `[N, E]`, its k most probable
/// experts among those of its best groups (ties to the lower index), and
/// their probabilities times the scale.
fn route_softmax_groups(scores: &[f64], n: usize, moe: &Moe) -> (Vec<f64>, Vec<usize>, Vec<f64>) {
    let Router::SoftmaxGroups {
        groups,
        topk_groups,
        scale,
    } = moe.router
    else {
        unreachable!("a grouped softmax router's routing")
    };
    let (e, k) = (moe.num_experts, moe.top_k);
    let probs = softmax_rows(scores, e);
    let per = e / groups;
    let mut picks = vec![0usize; n * k];
    let mut weights = vec![0.0f64; n * k];
    for t in 0..n {
        let p = &probs[t * e..(t + 1) * e];
        let merit: Vec<f64> = p
            .chunks(per)
            .map(|g| g.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x)))
            .collect();
        let open = open_experts(p, &merit, per, topk_groups);
        for (j, &x) in open[..k].iter().enumerate() {
            picks[t * k + j] = x;
            weights[t * k + j] = scale * p[x];
        }
    }
    (probs, picks, weights)
}

/// [`router_backward`] of DeepSeek-V3's routing: from the gradients of
/// each token's k weights back through the scale, the renormalisation
/// (where `norm_topk`) and the sigmoid. The experts a token did not take
/// get none (the choice, and the correction bias with it, has none).
fn sigmoid_router_backward(
    scores: &[f64],
    picks: &[usize],
    dweights: &[f64],
    n: usize,
    moe: &Moe,
) -> Vec<f32> {
    let Router::Sigmoid { scale, .. } = moe.router else {
        unreachable!("a sigmoid router's backward")
    };
    let (e, k) = (moe.num_experts, moe.top_k);
    let mut out = vec![0.0f32; n * e];
    for t in 0..n {
        let s = &scores[t * e..(t + 1) * e];
        let pk = &picks[t * k..(t + 1) * k];
        let dw = &dweights[t * k..(t + 1) * k];
        // w_j = scale · s_j / S (S = Σ s + 1e-20): ds_j = scale · (dw_j − Σ_i dw_i s_i / S) / S.
        let total: f64 = pk.iter().map(|&x| s[x]).sum::<f64>() + 1e-20;
        let mean: f64 = pk.iter().zip(dw).map(|(&x, &d)| d * s[x] / total).sum();
        for (&x, &d) in pk.iter().zip(dw) {
            let ds = scale
                * match moe.norm_topk {
                    true => (d - mean) / total,
                    false => d,
                };
            out[t * e + x] = (ds * s[x] * (1.0 - s[x])) as f32;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(e: usize, k: usize, norm: bool) -> Moe {
        Moe {
            num_experts: e,
            top_k: k,
            expert_size: 4,
            norm_topk: norm,
            sparse_layers: None,
            aux_loss_coef: None,
            shared_expert: None,
            shared_gated: false,
            router: crate::Router::Softmax,
            clamped: None,
        }
    }

    /// `got` (a router's backward) against central differences of `loss`
    /// at `scores`, to 1e-6; `what` names the case.
    fn check_fd(what: &str, scores: &[f64], got: &[f32], loss: impl Fn(&[f64]) -> f64) {
        for i in 0..scores.len() {
            let h = 1e-6;
            let (mut up, mut dn) = (scores.to_vec(), scores.to_vec());
            up[i] += h;
            dn[i] -= h;
            let fd = (loss(&up) - loss(&dn)) / (2.0 * h);
            assert!(
                (fd - got[i] as f64).abs() < 1e-6,
                "{what} score {i}: fd {fd} vs {}",
                got[i]
            );
        }
    }

    /// The loss `Σ c_j w_j` of the routing weights, plus `Σ a_e p_e` of
    /// every probability where a load-balancing gradient `a` is given, by
    /// finite differences of the scores against `router_backward`, with
    /// and without renormalisation.
    #[test]
    fn router_backward_matches_finite_differences() {
        let scores = [0.3, -1.2, 0.9, 0.1, 2.0, -0.4, 0.05, 0.7, -0.3, 1.1];
        let (n, e, k) = (2, 5, 2);
        let coef = [0.7f64, -1.3, 0.4, 2.1];
        let balance = [0.2f64, -0.5, 0.9, 0.0, 0.3];
        for (norm, aux) in [
            (false, None),
            (true, None),
            (false, Some(&balance)),
            (true, Some(&balance)),
        ] {
            let m = moe(e, k, norm);
            let (probs, picks, _) = route(&scores, n, &m);
            let loss = |s: &[f64]| {
                let (p, pk, w) = route(s, n, &m);
                assert_eq!(pk, picks, "the step must not change the choice");
                let a: f64 = aux.map_or(0.0, |a| {
                    p.chunks(e)
                        .flat_map(|row| row.iter().zip(a))
                        .map(|(p, a)| p * a)
                        .sum()
                });
                w.iter().zip(&coef).map(|(w, c)| w * c).sum::<f64>() + a
            };
            let got = router_backward(&probs, &picks, &coef, aux.map(|a| (a.as_slice(), None)), n, &m);
            check_fd(&format!("norm {norm}"), &scores, &got, loss);
        }
    }

    /// The sigmoid router's backward against finite differences of the
    /// logits, with and without renormalisation, two groups of three of
    /// which one is open, and a correction bias that changes the choice.
    #[test]
    fn sigmoid_router_backward_matches_finite_differences() {
        let logits = [0.3, -1.2, 0.9, 0.1, 2.0, -0.4, 0.05, 0.7, -0.3, 1.1, 0.6, -0.8];
        let bias = [0.0, 0.9, 0.0, 0.0, -2.0, 0.0];
        let (n, k) = (2, 2);
        let coef = [0.7f64, -1.3, 0.4, 2.1];
        for norm in [false, true] {
            let mut m = moe(6, k, norm);
            m.router = Router::Sigmoid {
                groups: 2,
                topk_groups: 1,
                scale: 2.5,
            };
            let (scores, picks, _) = route_sigmoid(&logits, &bias, n, &m);
            assert!(
                picks[..2].contains(&1),
                "the bias lifts expert 1 into token 0's choice"
            );
            assert!(!picks.contains(&4), "and sinks expert 4 out of token 0's");
            let loss = |z: &[f64]| {
                let (_, pk, w) = route_sigmoid(z, &bias, n, &m);
                assert_eq!(pk, picks, "the step must not change the choice");
                w.iter().zip(&coef).map(|(w, c)| w * c).sum::<f64>()
            };
            let got = sigmoid_router_backward(&scores, &picks, &coef, n, &m);
            check_fd(&format!("norm {norm}"), &logits, &got, loss);
        }
    }

    /// DeepSeek-V2's grouped softmax: two groups of three, one open, the
    /// weights scaled; its backward (the softmax router's of the scaled
    /// weights' gradients) against finite differences.
    #[test]
    fn softmax_groups_limit_the_choice_and_backward_matches_finite_differences() {
        let logits = [0.3, -1.2, 0.9, 0.1, 2.0, -0.4, 0.05, 0.7, -0.3, 1.1, 0.6, 0.65];
        let (n, k) = (2, 2);
        let coef = [0.7f64, -1.3, 0.4, 2.1];
        let mut m = moe(6, k, false);
        m.router = Router::SoftmaxGroups {
            groups: 2,
            topk_groups: 1,
            scale: 2.0,
        };
        let (probs, picks, w) = route_softmax_groups(&logits, n, &m);
        // Token 0: group 1 holds the best expert (4), so 4 and 3 rather than 4 and 2.
        assert_eq!(picks[..2], [4, 3]);
        assert!((w[0] - 2.0 * probs[4]).abs() < 1e-15);
        let loss = |z: &[f64]| {
            let (_, pk, w) = route_softmax_groups(z, n, &m);
            assert_eq!(pk, picks, "the step must not change the choice");
            w.iter().zip(&coef).map(|(w, c)| w * c).sum::<f64>()
        };
        let scaled: Vec<f64> = coef.iter().map(|c| c * 2.0).collect();
        let got = router_backward(&probs, &picks, &scaled, None, n, &m);
        check_fd("grouped softmax", &logits, &got, loss);
    }

    #[test]
    fn routing_digest_tells_apart_any_counted_token_routed_otherwise() {
        let all = |_: usize| true;
        // Three tokens, two experts each.
        let picks = [0, 1, 2, 3, 1, 0];
        let d = picks_digest(&picks, 2, all);
        assert_eq!(d, picks_digest(&picks.clone(), 2, all));
        for (i, other) in [(0, 2), (3, 0), (5, 3)] {
            let mut p = picks;
            p[i] = other;
            assert_ne!(d, picks_digest(&p, 2, all), "pick {i} -> {other}");
        }
        // The order of a token's experts counts, as it weighs them.
        assert_ne!(d, picks_digest(&[1, 0, 2, 3, 1, 0], 2, all));
        // A token left out (padding) does not.
        let first_two = |t: usize| t < 2;
        assert_eq!(
            picks_digest(&picks, 2, first_two),
            picks_digest(&[0, 1, 2, 3, 3, 2], 2, first_two)
        );
        let stats = |digest| RouterStats {
            tokens: 3,
            chosen: vec![],
            probs: vec![],
            digest,
        };
        // Blocks fold in order; no routed block leaves it unset.
        let (a, b) = (stats(1), stats(2));
        assert_eq!(routing_digest(None, &[]), None);
        let ab = routing_digest(None, &[a.clone(), b.clone()]);
        assert_ne!(ab, routing_digest(None, &[b.clone(), a.clone()]));
        assert_eq!(ab, routing_digest(routing_digest(None, &[a]), &[b]));
    }

    #[test]
    fn route_takes_the_k_most_probable_and_renormalises() {
        let m = moe(4, 2, true);
        let (probs, picks, w) = route(&[0.0, 2.0, 1.0, 2.0], 1, &m);
        assert_eq!(picks, [1, 3], "ties go to the lower index");
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((w[0] - 0.5).abs() < 1e-12 && (w[1] - 0.5).abs() < 1e-12);
        let (_, _, w) = route(&[0.0, 2.0, 1.0, 2.0], 1, &moe(4, 2, false));
        assert!(
            (w[0] - probs[1]).abs() < 1e-12,
            "without renormalising, the probability itself"
        );
    }
}
