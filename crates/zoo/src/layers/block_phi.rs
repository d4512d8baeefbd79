//! Phi-1.5 / Phi-2 block: one LayerNorm (with bias) feeds the attention
//! and the GELU MLP side by side, `y = x + attn(n) + mlp(n)` with
//! `n = layernorm(x)`; q/k/v, the attention's `dense` output and the MLP's
//! `fc1`/`fc2` all with biases; RoPE on part of each head. `nn.Linear`
//! weights are `[out, in]`, read with `Transpose::NT`.

use megatrain_tensor::{AttentionOut, Executor, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{
    AttnSaved, Linear, attention_backward_from_output, check_weights, gelu_mlp_backward, lin, matmul_gelu,
    qkv_backward, shape,
};
use super::{Branches, dropout_branch, dropped};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
const LN_W: usize = 0;
const LN_B: usize = 1;
const Q: Linear = (2, Some(3));
const K: Linear = (4, Some(5));
const V: Linear = (6, Some(7));
const DENSE: Linear = (8, Some(9));
const FC1: Linear = (10, Some(11));
const FC2: Linear = (12, Some(13));
const N: usize = 14;

#[derive(Debug)]
pub struct PhiSaved<T> {
    x: T,
    n: NormOut<T>,
    /// Rotated q, k and v, `[B, T, H, D]`.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
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
) -> Result<(E::Tensor, PhiSaved<E::Tensor>)> {
    check_weights(w, N, "phi block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let qs = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let ks = shape(&[b, t, cfg.num_kv_heads, cfg.head_dim]);
    let rope = seq.rope(cfg, layer);

    let n = ex.layernorm(x, &w[LN_W], &w[LN_B], eps)?;
    let q = ex.rope(&ex.reshape(&lin(ex, &n.y, w, Q)?, &qs)?, rope.clone())?;
    let k = ex.rope(&ex.reshape(&lin(ex, &n.y, w, K)?, &ks)?, rope)?;
    let v = ex.reshape(&lin(ex, &n.y, w, V)?, &ks)?;
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let drops = seq.branches();
    let o = dropout_branch(ex, lin(ex, &a, w, DENSE)?, drops.attn)?;
    let (f, g) = matmul_gelu(cfg, ex, &n.y, &w[FC1.0], FC1.1.map(|i| &w[i]), Transpose::NT)?;
    let m = dropout_branch(ex, lin(ex, &g, w, FC2)?, drops.mlp)?;
    let y = ex.add(&ex.add(x, &o)?, &m)?;
    let saved = PhiSaved {
        x: ex.reshape(x, x.shape())?,
        n,
        q,
        k,
        v,
        att,
        a,
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
    s: &PhiSaved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    check_weights(w, N, "phi block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let mut grads: Vec<Option<E::Tensor>> = (0..N).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // dy reaches x directly, and the MLP's and the attention's outputs.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dn_mlp = gelu_mlp_backward(
        cfg,
        ex,
        w,
        (FC1, FC2),
        &s.n.y,
        (&s.f, &s.g),
        dm.as_ref().unwrap_or(dy),
        &mut grads,
    )?;

    let da = dropped(ex, s.drops.attn, dy)?;
    let da = da.as_ref().unwrap_or(dy);
    let (dq, dk, dv) =
        attention_backward_from_output(cfg, ex, layer, w, DENSE, attn_saved!(s), da, &mut grads)?;
    let dq = ex.reshape(&dq, &shape(&[b, t, cfg.q_dim()]))?;
    let dk = ex.reshape(&dk, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&dv, &shape(&[b, t, cfg.kv_dim()]))?;
    let mut dn = qkv_backward(ex, &s.n.y, w, [(&dq, Q), (&dk, K), (&dv, V)], &mut grads)?;
    ex.add_assign(&mut dn, &dn_mlp)?;

    // The norm's input is x, which dy also reaches directly.
    let gn = ex.add_layernorm_backward(
        &s.x,
        &w[LN_W],
        s.n.mean.as_ref().expect("layernorm mean"),
        &s.n.rstd,
        &dn,
        dy,
    )?;
    grads[LN_W] = Some(gn.dw);
    grads[LN_B] = Some(gn.db.expect("layernorm bias grad"));
    let grads = grads.into_iter().map(take).collect();
    Ok((gn.dx, grads))
}
