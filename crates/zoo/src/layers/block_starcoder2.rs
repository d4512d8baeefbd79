//! StarCoder2 block: GPT-2's pre-LayerNorm (with biases) and GELU MLP
//! (`c_fc`, `c_proj`; GELU's tanh approximation) around the Llama family's
//! attention: separate q/k/v projections, grouped-query heads, RoPE and the
//! sliding window. Every linear layer has a bias under `use_bias` (the
//! released models' setting). `nn.Linear` weights are `[out, in]`, read
//! with `Transpose::NT`.

use megatrain_tensor::{AddNormOut, AttentionOut, Executor, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{
    AttnSaved, Linear, attention_backward_from_output, check_weights, gelu_mlp_backward, lin, matmul_gelu,
    qkv_backward, shape,
};
use super::{Branches, dropout_branch, dropped};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
#[derive(Debug, Clone, Copy)]
struct Layout {
    ln1: (usize, usize),
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ln2: (usize, usize),
    fc: Linear,
    proj: Linear,
    len: usize,
}

impl Layout {
    fn new(cfg: &ModelConfig) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        let ln1 = (next(), next());
        let bias = cfg.qkv_bias;
        let mut lin = || {
            let w = next();
            (w, bias.then(&mut next))
        };
        let (q, k, v, o) = (lin(), lin(), lin(), lin());
        let ln2 = (next(), next());
        let mut lin = || {
            let w = next();
            (w, bias.then(&mut next))
        };
        let (fc, proj) = (lin(), lin());
        Layout {
            ln1,
            q,
            k,
            v,
            o,
            ln2,
            fc,
            proj,
            len: n,
        }
    }
}

#[derive(Debug)]
pub struct Starcoder2Saved<T> {
    x: T,
    n1: NormOut<T>,
    /// Rotated q, k and v, `[B, T, H, D]`.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    x2: T,
    n2: NormOut<T>,
    /// The MLP's product before and after GELU.
    f: T,
    g: T,
    drops: Branches,
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, Starcoder2Saved<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "starcoder2 block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let qs = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let ks = shape(&[b, t, cfg.num_kv_heads, cfg.head_dim]);
    let rope = seq.rope(cfg, layer);

    let n1 = ex.layernorm(x, &w[l.ln1.0], &w[l.ln1.1], eps)?;
    let q = ex.reshape(&lin(ex, &n1.y, w, l.q)?, &qs)?;
    let k = ex.reshape(&lin(ex, &n1.y, w, l.k)?, &ks)?;
    let v = ex.reshape(&lin(ex, &n1.y, w, l.v)?, &ks)?;
    let q = ex.rope(&q, rope.clone())?;
    let k = ex.rope(&k, rope)?;
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let drops = seq.branches();
    let o = dropout_branch(ex, lin(ex, &a, w, l.o)?, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_layernorm(x, &o, &w[l.ln2.0], &w[l.ln2.1], eps)?;
    let (f, g) = matmul_gelu(cfg, ex, &n2.y, &w[l.fc.0], l.fc.1.map(|i| &w[i]), Transpose::NT)?;
    let m = dropout_branch(ex, lin(ex, &g, w, l.proj)?, drops.mlp)?;
    let y = ex.add(&x2, &m)?;
    let saved = Starcoder2Saved {
        x: ex.reshape(x, x.shape())?,
        n1,
        q,
        k,
        v,
        att,
        a,
        x2,
        n2,
        f,
        g,
        drops,
    };
    Ok((y, saved))
}

pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &Starcoder2Saved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "starcoder2 block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // MLP.
    // The projection's input gradient carried on through GELU.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dm = dm.as_ref().unwrap_or(dy);
    let dn2 = gelu_mlp_backward(cfg, ex, w, (l.fc, l.proj), &s.n2.y, (&s.f, &s.g), dm, &mut grads)?;
    // x2 flows on past the norm: its gradient is the norm's plus dy.
    let n2 = ex.add_layernorm_backward(
        &s.x2,
        &w[l.ln2.0],
        s.n2.mean.as_ref().expect("layernorm mean"),
        &s.n2.rstd,
        &dn2,
        dy,
    )?;
    grads[l.ln2.0] = Some(n2.dw);
    grads[l.ln2.1] = Some(n2.db.expect("layernorm bias grad"));
    let dx2 = n2.dx;

    // Attention.
    let da = dropped(ex, s.drops.attn, &dx2)?;
    let (dq, dk, dv) = attention_backward_from_output(
        cfg,
        ex,
        layer,
        w,
        l.o,
        attn_saved!(s),
        da.as_ref().unwrap_or(&dx2),
        &mut grads,
    )?;
    let dq = ex.reshape(&dq, &shape(&[b, t, cfg.q_dim()]))?;
    let dk = ex.reshape(&dk, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&dv, &shape(&[b, t, cfg.kv_dim()]))?;
    let dn1 = qkv_backward(ex, &s.n1.y, w, [(&dq, l.q), (&dk, l.k), (&dv, l.v)], &mut grads)?;
    let n1 = ex.add_layernorm_backward(
        &s.x,
        &w[l.ln1.0],
        s.n1.mean.as_ref().expect("layernorm mean"),
        &s.n1.rstd,
        &dn1,
        &dx2,
    )?;
    grads[l.ln1.0] = Some(n1.dw);
    grads[l.ln1.1] = Some(n1.db.expect("layernorm bias grad"));
    let dx = n1.dx;
    let grads = grads.into_iter().map(take).collect();
    Ok((dx, grads))
}
