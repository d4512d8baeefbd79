//! OLMo 2 block (OLMo 3's, EXAONE 4's): norms after the sublayers instead
//! of before them, `y = h + norm_ff(mlp(h))` with `h = x + norm_att(attn(x))`,
//! and RMSNorms of q and k before RoPE, over their whole projections (OLMo)
//! or per head (EXAONE 4, whose full-attention blocks have no RoPE).
//! Attention and the SwiGLU MLP are Llama's; optional attention biases.

use megatrain_tensor::{AttentionOut, Executor, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{AttnSaved, Linear, attention_backward_from_output, check_weights, lin, needs, put, shape};
use super::{Branches, dropped};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
#[derive(Debug, Clone, Copy)]
struct Layout {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: usize,
    k_norm: usize,
    post_att: usize,
    gate: usize,
    up: usize,
    down: usize,
    post_ff: usize,
    len: usize,
}

impl Layout {
    fn new(cfg: &ModelConfig) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        let mut lin = |bias: bool| {
            let w = next();
            (w, bias.then(&mut next))
        };
        let (q, k, v) = (lin(cfg.qkv_bias), lin(cfg.qkv_bias), lin(cfg.qkv_bias));
        let o = lin(cfg.o_bias);
        let (q_norm, k_norm, post_att) = (next(), next(), next());
        let (gate, up, down, post_ff) = (next(), next(), next(), next());
        Layout {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            post_att,
            gate,
            up,
            down,
            post_ff,
            len: n,
        }
    }
}

#[derive(Debug)]
pub struct Olmo2Saved<T> {
    x: T,
    /// q and k projections before their norms, `[B, T, H·D]` (`[B, T, H, D]`
    /// with norms per head), and the norms.
    q_pre: T,
    qn: NormOut<T>,
    k_pre: T,
    kn: NormOut<T>,
    /// Rotated q, k and v, `[B, T, H, D]`.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    /// The attention output before its norm, and the norm.
    o: T,
    on: NormOut<T>,
    h: T,
    gate: T,
    up: T,
    s: T,
    /// The MLP output before its norm, and the norm.
    m: T,
    mn: NormOut<T>,
    drops: Branches,
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, Olmo2Saved<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "olmo2 block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let qs = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let ks = shape(&[b, t, cfg.num_kv_heads, cfg.head_dim]);

    let (mut q_pre, mut k_pre) = (lin(ex, x, w, l.q)?, lin(ex, x, w, l.k)?);
    if cfg.arch.has_head_qk_norms() {
        (q_pre, k_pre) = (ex.reshape(&q_pre, &qs)?, ex.reshape(&k_pre, &ks)?);
    }
    let v = ex.reshape(&lin(ex, x, w, l.v)?, &ks)?;
    let qn = ex.rmsnorm(&q_pre, &w[l.q_norm], eps)?;
    let kn = ex.rmsnorm(&k_pre, &w[l.k_norm], eps)?;
    let (q, k) = (ex.reshape(&qn.y, &qs)?, ex.reshape(&kn.y, &ks)?);
    let (q, k) = match cfg.has_rope(layer) {
        true => (
            ex.rope(&q, seq.rope(cfg, layer))?,
            ex.rope(&k, seq.rope(cfg, layer))?,
        ),
        false => (q, k),
    };
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let o = lin(ex, &a, w, l.o)?;
    let on = ex.rmsnorm(&o, &w[l.post_att], eps)?;
    let drops = seq.branches();
    let on_d = dropped(ex, drops.attn, &on.y)?;
    let h = ex.add(x, on_d.as_ref().unwrap_or(&on.y))?;
    let gate = ex.matmul(&h, &w[l.gate], None, Transpose::NT)?;
    // The up projection with the activation applied where it is stored.
    let (up, s) = ex.matmul_swiglu(&h, &w[l.up], None, Transpose::NT, &gate)?;
    let m = ex.matmul(&s, &w[l.down], None, Transpose::NT)?;
    let mn = ex.rmsnorm(&m, &w[l.post_ff], eps)?;
    let mn_d = dropped(ex, drops.mlp, &mn.y)?;
    let y = ex.add(&h, mn_d.as_ref().unwrap_or(&mn.y))?;
    let saved = Olmo2Saved {
        x: ex.reshape(x, x.shape())?,
        q_pre,
        qn,
        k_pre,
        kn,
        q,
        k,
        v,
        att,
        a,
        o,
        on,
        h,
        gate,
        up,
        s,
        m,
        mn,
        drops,
    };
    Ok((y, saved))
}

pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &Olmo2Saved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "olmo2 block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // MLP: dy reaches h directly and through norm_ff(mlp(h)).
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let gmn = ex.rmsnorm_backward(&s.m, &w[l.post_ff], &s.mn.rstd, dm.as_ref().unwrap_or(dy))?;
    grads[l.post_ff] = Some(gmn.dw);
    let (gd, dgate, dup) = ex.matmul_backward_swiglu(
        &s.s,
        &w[l.down],
        &gmn.dx,
        Transpose::NT,
        needs(None),
        &s.gate,
        &s.up,
    )?;
    grads[l.down] = gd.db;
    let mut gg = ex.matmul_backward(&s.h, &w[l.gate], &dgate, Transpose::NT, needs(None))?;
    let mut dh = take(gg.da.take());
    let gu = ex.matmul_backward_da_into(&s.h, &w[l.up], &dup, Transpose::NT, needs(None), &mut dh)?;
    grads[l.gate] = gg.db;
    grads[l.up] = gu.db;
    let dh = ex.add(&dh, dy)?;

    // Attention: dh reaches x directly and through norm_att(attn(x)).
    let da = dropped(ex, s.drops.attn, &dh)?;
    let gon = ex.rmsnorm_backward(&s.o, &w[l.post_att], &s.on.rstd, da.as_ref().unwrap_or(&dh))?;
    grads[l.post_att] = Some(gon.dw);
    let (dq, dk, dv) =
        attention_backward_from_output(cfg, ex, layer, w, l.o, attn_saved!(s), &gon.dx, &mut grads)?;
    // As the norms saw q and k: whole projections, or heads.
    let dq = ex.reshape(&dq, s.q_pre.shape())?;
    let dk = ex.reshape(&dk, s.k_pre.shape())?;
    let gq = ex.rmsnorm_backward(&s.q_pre, &w[l.q_norm], &s.qn.rstd, &dq)?;
    let gk = ex.rmsnorm_backward(&s.k_pre, &w[l.k_norm], &s.kn.rstd, &dk)?;
    grads[l.q_norm] = Some(gq.dw);
    grads[l.k_norm] = Some(gk.dw);
    let dq = ex.reshape(&gq.dx, &shape(&[b, t, cfg.q_dim()]))?;
    let dk = ex.reshape(&gk.dx, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&dv, &shape(&[b, t, cfg.kv_dim()]))?;
    // q's, k's and v's input gradients summed into dh, which already holds
    // the residual's.
    let mut dx = dh;
    for (d, lw) in [(&dq, l.q), (&dk, l.k), (&dv, l.v)] {
        let g = ex.matmul_backward_da_into(&s.x, &w[lw.0], d, Transpose::NT, needs(lw.1), &mut dx)?;
        put(&mut grads, lw, g);
    }
    let grads = grads.into_iter().map(take).collect();
    Ok((dx, grads))
}
