//! Kimi Linear's delta-attention blocks (its attention blocks are
//! DeepSeek-V3's without RoPE, `block_mla.rs`): Llama's pre-norm residual
//! block (the MLP dense or routed: [`Mlp`]) around Kimi Delta Attention.
//!
//! q, k and v come from products of their own through one causal depthwise
//! convolution with SiLU (stored in their three pieces); q and k are
//! l2-normalised (q also scaled by `Dk^−½`), as Qwen3.5's are. The decay is
//! per key channel: a low-rank forget gate `f_b(f_a(x))` plus `dt_bias`
//! (one a channel) through softplus, times `−exp(A_log)` of its head (the
//! per-head parameter reaches each channel by a product with a 0/1
//! expansion, whose backward sums a head's channels); β = σ(`b_proj(x)`).
//! The rule's output goes through an RMSNorm times `σ(g_b(g_a(x)))`, then
//! `o_proj`.

use megatrain_tensor::{
    AddNormOut, DeltaRuleOut, Executor, HostSlice, MatmulNeeds, NormOut, TensorHandle, Transpose,
};

use super::Seq;
use super::block_llama::{Mlp, MlpSaved};
use super::block_qwen35::{Conv, RuleInputs, linear_attn, rule_inputs};
use super::moe::{RouterAux, RouterStats};
use super::{Branches, dropout_branch, dropped};
use super::{Linear, check_weights, lin, needs, put, qkv_backward, shape};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `tables.rs`'s
/// `push_kda`, then the MLP's).
#[derive(Debug, Clone, Copy)]
struct Layout {
    ln1: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    conv: Conv,
    f_a: Linear,
    f_b: Linear,
    dt_bias: usize,
    a_log: usize,
    b: Linear,
    g_a: Linear,
    g_b: Linear,
    norm: usize,
    o: Linear,
    ln2: usize,
    mlp: Mlp,
    len: usize,
}

impl Layout {
    fn new(cfg: &ModelConfig, layer: usize) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        let ln1 = next();
        let (q, k, v) = ((next(), None), (next(), None), (next(), None));
        let conv = Conv::Apart([next(), next(), next()]);
        let (f_a, f_b) = ((next(), None), (next(), None));
        let (dt_bias, a_log) = (next(), next());
        let b = (next(), None);
        let (g_a, g_b) = ((next(), None), (next(), None));
        let (norm, o) = (next(), (next(), None));
        let ln2 = next();
        let mlp = Mlp::new(cfg, layer, &mut next);
        Layout {
            ln1,
            q,
            k,
            v,
            conv,
            f_a,
            f_b,
            dt_bias,
            a_log,
            b,
            g_a,
            g_b,
            norm,
            o,
            ln2,
            mlp,
            len: n,
        }
    }
}

/// What a Kimi delta-attention block's backward needs from its forward.
#[derive(Debug)]
pub struct KimiSaved<T> {
    x: T,
    n1: NormOut<T>,
    /// q, k and v as the rule read them, and what made them.
    inputs: RuleInputs<T>,
    /// The forget gate's low-rank middle `[B, T, D]` and its logits
    /// `[B, T, H, D]`, the per-channel `A_log` and the expansion that made it.
    f_a: T,
    f: T,
    a_log: T,
    expand: T,
    /// β's logits `[B, T, H]`.
    b: T,
    g: T,
    beta: T,
    rule: DeltaRuleOut<T>,
    normed: NormOut<T>,
    /// The output gate's low-rank middle and its logits `[B, T, H, D]`.
    g_a: T,
    gate: T,
    /// `o_proj`'s input `[B, T, H·D]`.
    gated: T,
    x2: T,
    n2: NormOut<T>,
    mlp: MlpSaved<T>,
    drops: Branches,
}

impl<T> KimiSaved<T> {
    /// The routing statistics of a routed block's forward.
    pub(super) fn router_stats(&self, tokens: Option<&[bool]>) -> Option<RouterStats> {
        self.mlp.router_stats(tokens)
    }
}

/// `[H, H·D]` with row h one over its head's D channels: `a_log @ E`
/// gives each channel its head's value, and the backward sums them.
fn expansion<E: Executor>(ex: &E, heads: usize, d: usize) -> Result<E::Tensor> {
    let mut e = vec![0.0f32; heads * heads * d];
    for h in 0..heads {
        e[h * heads * d + h * d..h * heads * d + (h + 1) * d].fill(1.0);
    }
    Ok(ex.upload_slice(&shape(&[heads, heads * d]), HostSlice::F32(&e))?)
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, KimiSaved<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len, "kimi block_forward")?;
    let la = linear_attn(cfg)?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let (h, d) = (la.value_heads, la.value_dim);
    let hd = h * d;
    let n1 = ex.rmsnorm(x, &w[l.ln1], eps)?;
    let y = &n1.y;
    let mixed = ex.concat_last(&[&lin(ex, y, w, l.q)?, &lin(ex, y, w, l.k)?, &lin(ex, y, w, l.v)?])?;
    let inputs = rule_inputs(ex, la, w, l.conv, mixed, seq)?;
    let heads = shape(&[b, t, h, d]);
    let f_a = lin(ex, y, w, l.f_a)?;
    let f = ex.reshape(&lin(ex, &f_a, w, l.f_b)?, &heads)?;
    let expand = expansion(ex, h, d)?;
    let a_log = ex.matmul(
        &ex.reshape(&w[l.a_log], &shape(&[1, h]))?,
        &expand,
        None,
        Transpose::NN,
    )?;
    let a_log = ex.reshape(&a_log, &shape(&[hd]))?;
    let bl = lin(ex, y, w, l.b)?;
    let (g, beta) = ex.delta_gates(&f, &bl, &a_log, &w[l.dt_bias])?;
    let rule = inputs.rule(ex, &g, &beta, seq)?;
    let normed = ex.rmsnorm(&rule.out, &w[l.norm], eps)?;
    let g_a = lin(ex, y, w, l.g_a)?;
    let gate = ex.reshape(&lin(ex, &g_a, w, l.g_b)?, &heads)?;
    let gated = ex.reshape(&ex.sigmoid_mul(&gate, &normed.y)?, &shape(&[b, t, hd]))?;
    let drops = seq.branches();
    let out = dropout_branch(ex, lin(ex, &gated, w, l.o)?, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_rmsnorm(x, &out, &w[l.ln2], eps)?;
    let (dm, mlp) = l.mlp.forward(cfg, ex, w, &n2.y)?;
    let dm = dropout_branch(ex, dm, drops.mlp)?;
    let y_out = ex.add(&x2, &dm)?;
    let saved = KimiSaved {
        x: ex.reshape(x, x.shape())?,
        n1,
        inputs,
        f_a,
        f,
        a_log,
        expand,
        b: bl,
        g,
        beta,
        rule,
        normed,
        g_a,
        gate,
        gated,
        x2,
        n2,
        mlp,
        drops,
    };
    Ok((y_out, saved))
}

#[allow(clippy::too_many_arguments)]
pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &KimiSaved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len, "kimi block_backward")?;
    let la = linear_attn(cfg)?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let (h, d) = (la.value_heads, la.value_dim);
    let hd = h * d;
    let nt = Transpose::NT;
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let take = |g: &mut megatrain_tensor::MatmulGrads<E::Tensor>| g.da.take().expect("requested gradient");

    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dn2 = l.mlp.backward(
        cfg,
        ex,
        layer,
        w,
        &s.n2.y,
        &s.mlp,
        dm.as_ref().unwrap_or(dy),
        aux,
        &mut grads,
    )?;
    let n2 = ex.add_rmsnorm_backward(&s.x2, &w[l.ln2], &s.n2.rstd, &dn2, dy)?;
    grads[l.ln2] = Some(n2.dw);
    let dx2 = n2.dx;

    let dproj = dropped(ex, s.drops.attn, &dx2)?;
    let mut go = ex.matmul_backward(
        &s.gated,
        &w[l.o.0],
        dproj.as_ref().unwrap_or(&dx2),
        nt,
        needs(l.o.1),
    )?;
    let dgated = ex.reshape(&take(&mut go), &shape(&[b, t, h, d]))?;
    put(&mut grads, l.o, go);
    let (dgate, dnormed) = ex.sigmoid_mul_backward(&s.gate, &s.normed.y, &dgated)?;
    let dgate = ex.reshape(&dgate, &shape(&[b, t, hd]))?;
    let mut gb = ex.matmul_backward(&s.g_a, &w[l.g_b.0], &dgate, nt, needs(l.g_b.1))?;
    let dg_a = take(&mut gb);
    put(&mut grads, l.g_b, gb);
    let gn = ex.rmsnorm_backward(&s.rule.out, &w[l.norm], &s.normed.rstd, &dnormed)?;
    grads[l.norm] = Some(gn.dw);
    let gr = s.inputs.rule_backward(ex, &s.g, &s.beta, &s.rule, &gn.dx)?;

    // The gates: g per channel from f, A_log and dt_bias; β = σ(b) per head.
    let (df, db, da_log, ddt_bias) =
        ex.delta_gates_backward(&s.f, &s.b, &s.a_log, &w[l.dt_bias], &gr.dg, &gr.dbeta)?;
    grads[l.dt_bias] = Some(ddt_bias);
    let only_da = MatmulNeeds {
        da: true,
        db: false,
        dbias: false,
    };
    let head_log = ex.reshape(&w[l.a_log], &shape(&[1, h]))?;
    let da_log = ex.reshape(&da_log, &shape(&[1, hd]))?;
    let mut ge = ex.matmul_backward(&head_log, &s.expand, &da_log, Transpose::NN, only_da)?;
    grads[l.a_log] = Some(ex.reshape(&take(&mut ge), w[l.a_log].shape())?);
    let df = ex.reshape(&df, &shape(&[b, t, hd]))?;
    let mut fb = ex.matmul_backward(&s.f_a, &w[l.f_b.0], &df, nt, needs(l.f_b.1))?;
    let df_a = take(&mut fb);
    put(&mut grads, l.f_b, fb);

    // q, k, v through their l2 norms and the convolution.
    let dmixed = s.inputs.backward(ex, la, w, l.conv, &gr, &mut grads)?;
    let m = ex.split_last(&dmixed, &[hd, hd, hd])?;
    let parts = [
        (&m[0], l.q),
        (&m[1], l.k),
        (&m[2], l.v),
        (&df_a, l.f_a),
        (&db, l.b),
        (&dg_a, l.g_a),
    ];
    let dn1 = qkv_backward(ex, &s.n1.y, w, parts, &mut grads)?;
    let n1 = ex.add_rmsnorm_backward(&s.x, &w[l.ln1], &s.n1.rstd, &dn1, &dx2)?;
    grads[l.ln1] = Some(n1.dw);
    let grads = grads
        .into_iter()
        .map(|g| g.expect("every slot's gradient"))
        .collect();
    Ok((n1.dx, grads))
}
