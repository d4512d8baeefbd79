//! Llama-family block (Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3,
//! Granite, GLM, Gemma 3; Mixtral, Qwen3-MoE, OLMoE and Qwen2-MoE with
//! their routed MLPs, `moe.rs`): pre-RMSNorm attention with RoPE and
//! grouped-query heads, SwiGLU MLP (Gemma's GeGLU). Optional q/k/v and o
//! biases, MLP biases, Qwen3's and Gemma's per-head RMSNorm of q and k
//! before RoPE, and GLM-4-0414's and Gemma's RMSNorms of the attention's
//! and the MLP's outputs before the residual adds. Gemma's norms' gains
//! are `1 + w` ([`Gains`]).
//! `nn.Linear` weights are `[out, in]`, read with `Transpose::NT`.

use megatrain_tensor::{AddNormOut, AttentionOut, Executor, NormOut, TensorHandle};

use super::Seq;
use super::moe::{self, Experts, MoeSaved, RouterAux, RouterStats};
use super::{
    AttnSaved, Gains, GluSaved, Linear, attention_backward_from_output, check_weights, glu_mlp,
    glu_mlp_backward, lin, qkv_backward, shape,
};
use super::{Branches, dropout_branch, dropped};
use crate::{ModelConfig, Result, Router, ZooError};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    ln1: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// GPT-OSS's sink logit per head.
    sinks: Option<usize>,
    qk_norm: Option<(usize, usize)>,
    /// The norms of the attention's and the MLP's outputs (GLM-4-0414).
    post_attn: Option<usize>,
    ln2: usize,
    mlp: Mlp,
    post_mlp: Option<usize>,
    len: usize,
}

/// A block's MLP: dense, or routed among experts (a mixture of experts'
/// sparse blocks). DeepSeek-V3's block (`block_mla.rs`) has it too.
#[derive(Debug, Clone, Copy)]
pub(super) enum Mlp {
    Dense { gate: Linear, up: Linear, down: Linear },
    Routed(Experts),
}

impl Mlp {
    /// Block `layer`'s MLP, its table slots drawn from `next` in the
    /// order `tables.rs` pushes them.
    pub(super) fn new(cfg: &ModelConfig, layer: usize, next: &mut impl FnMut() -> usize) -> Mlp {
        match cfg.moe.as_ref().filter(|m| m.routes(layer)) {
            Some(moe) => {
                let router = (next(), moe.clamped.is_some().then(&mut *next));
                let correction = matches!(moe.router, Router::Sigmoid { .. }).then(&mut *next);
                let first = next();
                let per = Experts::slots_per_expert(moe.clamped.is_some());
                (1..per * moe.num_experts).for_each(|_| {
                    next();
                });
                let shared = moe
                    .shared_expert
                    .map(|_| ([next(), next(), next()], moe.shared_gated.then(&mut *next)));
                Mlp::Routed(Experts {
                    router,
                    correction,
                    first,
                    count: moe.num_experts,
                    shared,
                    clamped: moe.clamped,
                })
            }
            None => {
                let mut lin = |bias: bool| {
                    let w = next();
                    (w, bias.then(&mut *next))
                };
                let gate = lin(cfg.mlp_bias);
                let up = lin(cfg.mlp_bias);
                let down = lin(cfg.mlp_bias);
                Mlp::Dense { gate, up, down }
            }
        }
    }

    /// The MLP of `x` (the block's normed input): its output and what its
    /// backward needs.
    pub(super) fn forward<E: Executor>(
        self,
        cfg: &ModelConfig,
        ex: &E,
        w: &[E::Tensor],
        x: &E::Tensor,
    ) -> Result<(E::Tensor, MlpSaved<E::Tensor>)> {
        Ok(match (self, &cfg.moe) {
            (Mlp::Dense { gate, up, down }, _) => {
                let (d, saved) = glu_mlp(cfg, ex, x, w, [gate, up, down])?;
                (d, MlpSaved::Dense(saved))
            }
            (Mlp::Routed(experts), Some(moe)) => {
                let (d, saved) = moe::forward(cfg, moe, ex, w, experts, x)?;
                (d, MlpSaved::Routed(saved))
            }
            (Mlp::Routed(_), None) => unreachable!("a routed layout comes from the config's experts"),
        })
    }

    /// The backward of [`Mlp::forward`] from `dy`: the gradient of `x`,
    /// the weights' stored at their slots in `grads`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward<E: Executor>(
        self,
        cfg: &ModelConfig,
        ex: &E,
        layer: usize,
        w: &[E::Tensor],
        x: &E::Tensor,
        saved: &MlpSaved<E::Tensor>,
        dy: &E::Tensor,
        aux: Option<&RouterAux>,
        grads: &mut [Option<E::Tensor>],
    ) -> Result<E::Tensor> {
        match (self, saved, &cfg.moe) {
            (Mlp::Dense { gate, up, down }, MlpSaved::Dense(saved), _) => {
                let d = glu_mlp_backward(cfg, ex, x, w, [gate, up, down], saved, dy, None, grads)?;
                Ok(d.expect("requested gradient"))
            }
            (Mlp::Routed(experts), MlpSaved::Routed(saved), Some(moe)) => {
                moe::backward(cfg, moe, ex, w, experts, x, saved, dy, aux, grads)
            }
            _ => Err(ZooError::invalid(
                "block_backward",
                format!("block {layer}'s saved MLP is not the kind its layout has"),
            )),
        }
    }
}

impl Layout {
    pub(crate) fn new(cfg: &ModelConfig, layer: usize) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        let ln1 = next();
        let mut lin = |bias: bool| {
            let w = next();
            (w, bias.then(&mut next))
        };
        let q = lin(cfg.qkv_bias);
        let k = lin(cfg.qkv_bias);
        let v = lin(cfg.qkv_bias);
        let o = lin(cfg.o_bias);
        let sinks = cfg.arch.has_attention_sinks().then(&mut next);
        let qk_norm = cfg.qk_norm.then(|| (next(), next()));
        let sandwich = cfg.arch.has_sandwich_norms();
        let post_attn = sandwich.then(&mut next);
        let ln2 = next();
        let mlp = Mlp::new(cfg, layer, &mut next);
        let post_mlp = sandwich.then(&mut next);
        Layout {
            ln1,
            q,
            k,
            v,
            o,
            sinks,
            qk_norm,
            post_attn,
            ln2,
            mlp,
            post_mlp,
            len: n,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The table slots of the block's norms.
    fn norms(&self) -> Vec<usize> {
        let qk = self.qk_norm.map(|(q, k)| [q, k]);
        [self.ln1, self.ln2]
            .into_iter()
            .chain(qk.into_iter().flatten())
            .chain(self.post_attn)
            .chain(self.post_mlp)
            .collect()
    }
}

/// What a block's MLP forward left for its backward.
#[derive(Debug)]
pub(super) enum MlpSaved<T> {
    Dense(GluSaved<T>),
    Routed(MoeSaved<T>),
}

impl<T> MlpSaved<T> {
    /// The routing statistics of a routed block's forward, over `tokens`
    /// where given (the others are padding).
    pub(super) fn router_stats(&self, tokens: Option<&[bool]>) -> Option<RouterStats> {
        match self {
            MlpSaved::Routed(m) => Some(m.stats(tokens)),
            MlpSaved::Dense(_) => None,
        }
    }
}

impl<T> LlamaSaved<T> {
    /// The routing statistics of a routed block's forward.
    pub(super) fn router_stats(&self, tokens: Option<&[bool]>) -> Option<RouterStats> {
        self.mlp.router_stats(tokens)
    }
}

#[derive(Debug)]
pub struct LlamaSaved<T> {
    x: T,
    n1: NormOut<T>,
    /// q and k before their norms (Qwen3 only) with the norms' outputs.
    q_pre: Option<(T, NormOut<T>)>,
    k_pre: Option<(T, NormOut<T>)>,
    /// Rotated q, k and v, `[B, T, H, D]`.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    x2: T,
    n2: NormOut<T>,
    mlp: MlpSaved<T>,
    /// The attention's and the MLP's outputs before their norms, with the
    /// norms' (GLM-4-0414).
    post_attn: Option<(T, NormOut<T>)>,
    post_mlp: Option<(T, NormOut<T>)>,
    drops: Branches,
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, LlamaSaved<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len(), "llama block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let rope = seq.rope(cfg, layer);
    let qs = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let ks = shape(&[b, t, cfg.num_kv_heads, cfg.head_dim]);
    let g = Gains::new(cfg, ex, w, &l.norms())?;

    let n1 = ex.rmsnorm(x, g.get(w, l.ln1), eps)?;
    // OLMoE norms the whole projections, the others each head.
    let full = cfg.arch.has_full_qk_norms();
    let (qs_norm, ks_norm) = match full {
        true => (shape(&[b, t, cfg.q_dim()]), shape(&[b, t, cfg.kv_dim()])),
        false => (qs.clone(), ks.clone()),
    };
    let q = ex.reshape(&lin(ex, &n1.y, w, l.q)?, &qs_norm)?;
    let k = ex.reshape(&lin(ex, &n1.y, w, l.k)?, &ks_norm)?;
    let v = ex.reshape(&lin(ex, &n1.y, w, l.v)?, &ks)?;
    let (q_pre, k_pre, qn, kn) = match l.qk_norm {
        Some((qi, ki)) => {
            let qn = ex.rmsnorm(&q, g.get(w, qi), eps)?;
            let kn = ex.rmsnorm(&k, g.get(w, ki), eps)?;
            let (qy, ky) = (ex.reshape(&qn.y, &qs)?, ex.reshape(&kn.y, &ks)?);
            (Some((q, qn)), Some((k, kn)), qy, ky)
        }
        None => (None, None, ex.reshape(&q, &qs)?, ex.reshape(&k, &ks)?),
    };
    // SmolLM3's NoPE blocks attend without positions.
    let (q, k) = match cfg.has_rope(layer) {
        true => (ex.rope(&qn, rope.clone())?, ex.rope(&kn, rope)?),
        false => (qn, kn),
    };
    let q = times(ex, q, cfg.q_factor())?;
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    // What the backward reads of a sink attention is its own output with
    // the plain attention's log-sum-exp (`Executor::attention_sinks`).
    let att = match l.sinks {
        Some(i) => AttentionOut {
            out: ex.attention_sinks(&att, &w[i])?,
            ..att
        },
        None => att,
    };
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let o = times(ex, lin(ex, &a, w, l.o)?, residual(cfg))?;
    let (o, post_attn) = post_norm(ex, o, l.post_attn.map(|i| g.get(w, i)), eps)?;
    let drops = seq.branches();
    let o = dropout_branch(ex, o, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_rmsnorm(x, &o, g.get(w, l.ln2), eps)?;
    let (d, mlp) = l.mlp.forward(cfg, ex, w, &n2.y)?;
    let d = times(ex, d, residual(cfg))?;
    let (d, post_mlp) = post_norm(ex, d, l.post_mlp.map(|i| g.get(w, i)), eps)?;
    let d = dropout_branch(ex, d, drops.mlp)?;
    let y = ex.add(&x2, &d)?;
    let saved = LlamaSaved {
        x: ex.reshape(x, x.shape())?,
        n1,
        q_pre,
        k_pre,
        q,
        k,
        v,
        att,
        a,
        x2,
        n2,
        mlp,
        post_attn,
        post_mlp,
        drops,
    };
    Ok((y, saved))
}

pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &LlamaSaved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len(), "llama block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let g = Gains::new(cfg, ex, w, &l.norms())?;
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len()).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // MLP.
    // The down projection's input gradient carried on through the GLU.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dpost = post_norm_backward(
        ex,
        &s.post_mlp,
        l.post_mlp,
        &g,
        w,
        dm.as_ref().unwrap_or(dy),
        &mut grads,
    )?;
    let dy_mlp = dpost.as_ref().or(dm.as_ref()).unwrap_or(dy);
    let dd = times_ref(ex, dy_mlp, residual(cfg))?;
    let dd = dd.as_ref().unwrap_or(dy_mlp);
    let dn2 = l
        .mlp
        .backward(cfg, ex, layer, w, &s.n2.y, &s.mlp, dd, aux, &mut grads)?;
    // x2 flows on past the norm: its gradient is the norm's plus dy.
    let n2 = ex.add_rmsnorm_backward(&s.x2, g.get(w, l.ln2), &s.n2.rstd, &dn2, dy)?;
    grads[l.ln2] = Some(n2.dw);
    let dx2 = n2.dx;

    // Attention.
    let da = dropped(ex, s.drops.attn, &dx2)?;
    let da = da.as_ref().unwrap_or(&dx2);
    let dpost = post_norm_backward(ex, &s.post_attn, l.post_attn, &g, w, da, &mut grads)?;
    let dx2_attn = dpost.as_ref().unwrap_or(da);
    let dout = times_ref(ex, dx2_attn, residual(cfg))?;
    let dout = dout.as_ref().unwrap_or(dx2_attn);
    let (dq, mut dk, dv) =
        attention_backward_from_output(cfg, ex, layer, w, l.o, attn_saved!(s, l.sinks), dout, &mut grads)?;
    let mut dq = times(ex, dq, cfg.q_factor())?;
    if let (Some((qi, ki)), Some((q_pre, qn)), Some((k_pre, kn))) = (l.qk_norm, &s.q_pre, &s.k_pre) {
        // In the norms' own shapes (the whole projections' for OLMoE).
        let (dq_n, dk_n) = (ex.reshape(&dq, q_pre.shape())?, ex.reshape(&dk, k_pre.shape())?);
        let gq = ex.rmsnorm_backward(q_pre, g.get(w, qi), &qn.rstd, &dq_n)?;
        let gk = ex.rmsnorm_backward(k_pre, g.get(w, ki), &kn.rstd, &dk_n)?;
        grads[qi] = Some(gq.dw);
        grads[ki] = Some(gk.dw);
        dq = gq.dx;
        dk = gk.dx;
    }
    let dq = ex.reshape(&dq, &shape(&[b, t, cfg.q_dim()]))?;
    let dk = ex.reshape(&dk, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&dv, &shape(&[b, t, cfg.kv_dim()]))?;
    let dn1 = qkv_backward(ex, &s.n1.y, w, [(&dq, l.q), (&dk, l.k), (&dv, l.v)], &mut grads)?;
    let n1 = ex.add_rmsnorm_backward(&s.x, g.get(w, l.ln1), &s.n1.rstd, &dn1, &dx2)?;
    grads[l.ln1] = Some(n1.dw);
    let dx = n1.dx;
    let grads = grads.into_iter().map(take).collect();
    Ok((dx, grads))
}

/// Granite's sublayer outputs' scale before they join the residual stream.
fn residual(cfg: &ModelConfig) -> Option<f64> {
    cfg.multipliers.map(|m| m.residual)
}

/// `x` times `s`, where there is one.
fn times<E: Executor>(ex: &E, x: E::Tensor, s: Option<f64>) -> Result<E::Tensor> {
    Ok(match s {
        Some(s) => ex.scale(&x, s)?,
        None => x,
    })
}

/// `x` times `s` where there is one (`None`: `x` as it is).
fn times_ref<E: Executor>(ex: &E, x: &E::Tensor, s: Option<f64>) -> Result<Option<E::Tensor>> {
    Ok(s.map(|s| ex.scale(x, s)).transpose()?)
}

/// GLM-4-0414's and Gemma's norm of a sublayer's output (gain `w`) before
/// its residual add:
/// the normed output and what its backward needs; `x` as it is without one.
#[allow(clippy::type_complexity)]
fn post_norm<E: Executor>(
    ex: &E,
    x: E::Tensor,
    w: Option<&E::Tensor>,
    eps: f32,
) -> Result<(E::Tensor, Option<(E::Tensor, NormOut<E::Tensor>)>)> {
    let Some(w) = w else { return Ok((x, None)) };
    let n = ex.rmsnorm(&x, w, eps)?;
    Ok((ex.reshape(&n.y, n.y.shape())?, Some((x, n))))
}

/// The gradient of a sublayer's output through its post norm, from that of
/// the normed output, the norm's weight gradient stored at `at`; `None`
/// without one.
fn post_norm_backward<E: Executor>(
    ex: &E,
    saved: &Option<(E::Tensor, NormOut<E::Tensor>)>,
    at: Option<usize>,
    g: &Gains<E::Tensor>,
    w: &[E::Tensor],
    dy: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<Option<E::Tensor>> {
    let (Some((x, n)), Some(i)) = (saved, at) else {
        return Ok(None);
    };
    let n = ex.rmsnorm_backward(x, g.get(w, i), &n.rstd, dy)?;
    grads[i] = Some(n.dw);
    Ok(Some(n.dx))
}
