//! GPT-NeoX block (Pythia, GPT-NeoX-20B): two LayerNorms (with biases), one
//! before the attention and one before the GELU MLP, which run side by side
//! (`y = x + attn(ln1(x)) + mlp(ln2(x))`) under `use_parallel_residual`
//! and one after the other otherwise; q, k and v from one fused
//! `query_key_value` projection laid out head by head (`[H, 3, D]` rows),
//! RoPE on part of each head, biases on every linear layer under
//! `attention_bias` (the MLP's always). `nn.Linear` weights are
//! `[out, in]`, read with `Transpose::NT`.

use megatrain_tensor::{AddNormOut, AttentionOut, Executor, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{
    AttnSaved, Linear, attention_backward_from_output, check_weights, gelu_mlp_backward, lin, matmul_gelu,
    needs, put, shape,
};
use super::{Branches, dropout_branch, dropped};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
#[derive(Debug, Clone, Copy)]
struct Layout {
    ln1: (usize, usize),
    ln2: (usize, usize),
    qkv: Linear,
    dense: Linear,
    fc1: Linear,
    fc2: Linear,
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
        let ln2 = (next(), next());
        let qkv = (next(), cfg.qkv_bias.then(&mut next));
        let dense = (next(), cfg.o_bias.then(&mut next));
        let fc1 = (next(), Some(next()));
        let fc2 = (next(), Some(next()));
        Layout {
            ln1,
            ln2,
            qkv,
            dense,
            fc1,
            fc2,
            len: n,
        }
    }
}

#[derive(Debug)]
pub struct NeoxSaved<T> {
    x: T,
    n1: NormOut<T>,
    /// Rotated q, k and v, `[B, T, H, D]`.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    /// x + attn, the second norm's input, where the MLP follows the
    /// attention (beside it, the norm reads x).
    x2: Option<T>,
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
) -> Result<(E::Tensor, NeoxSaved<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "gpt_neox block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let (h, d) = (cfg.num_heads, cfg.head_dim);
    let rope = seq.rope(cfg, layer);

    let n1 = ex.layernorm(x, &w[l.ln1.0], &w[l.ln1.1], eps)?;
    let qkv = ex.reshape(&lin(ex, &n1.y, w, l.qkv)?, &shape(&[b, t, h, 3 * d]))?;
    let mut parts = ex.split_last(&qkv, &[d, d, d])?.into_iter();
    let mut part = || parts.next().expect("three parts");
    let (q, k, v) = (part(), part(), part());
    drop(qkv);
    let q = ex.rope(&q, rope.clone())?;
    let k = ex.rope(&k, rope)?;
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let drops = seq.branches();
    let o = dropout_branch(ex, lin(ex, &a, w, l.dense)?, drops.attn)?;
    let (x2, n2) = match cfg.parallel_residual {
        true => (None, ex.layernorm(x, &w[l.ln2.0], &w[l.ln2.1], eps)?),
        false => {
            let AddNormOut { h, norm } = ex.add_layernorm(x, &o, &w[l.ln2.0], &w[l.ln2.1], eps)?;
            (Some(h), norm)
        }
    };
    let (f, g) = matmul_gelu(cfg, ex, &n2.y, &w[l.fc1.0], l.fc1.1.map(|i| &w[i]), Transpose::NT)?;
    let m = dropout_branch(ex, lin(ex, &g, w, l.fc2)?, drops.mlp)?;
    let y = match &x2 {
        None => ex.add(&ex.add(x, &o)?, &m)?,
        Some(x2) => ex.add(x2, &m)?,
    };
    let saved = NeoxSaved {
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
    s: &NeoxSaved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "gpt_neox block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // MLP.
    // The projection's input gradient carried on through GELU.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dm = dm.as_ref().unwrap_or(dy);
    let dn2 = gelu_mlp_backward(cfg, ex, w, (l.fc1, l.fc2), &s.n2.y, (&s.f, &s.g), dm, &mut grads)?;
    let mean2 = s.n2.mean.as_ref().expect("layernorm mean");
    // Side by side, the second norm's input gradient joins x's at the end;
    // one after the other, x2 = x + attn carries it with dy into the attention.
    let n2 = match &s.x2 {
        None => ex.layernorm_backward(&s.x, &w[l.ln2.0], mean2, &s.n2.rstd, &dn2)?,
        Some(x2) => ex.add_layernorm_backward(x2, &w[l.ln2.0], mean2, &s.n2.rstd, &dn2, dy)?,
    };
    grads[l.ln2.0] = Some(n2.dw);
    grads[l.ln2.1] = Some(n2.db.expect("layernorm bias grad"));
    let (dx_mlp, dx2) = match &s.x2 {
        None => (Some(n2.dx), None),
        Some(_) => (None, Some(n2.dx)),
    };
    let dres = dx2.as_ref().unwrap_or(dy);

    // Attention.
    let da = dropped(ex, s.drops.attn, dres)?;
    let da = da.as_ref().unwrap_or(dres);
    let (dq, dk, dv) =
        attention_backward_from_output(cfg, ex, layer, w, l.dense, attn_saved!(s), da, &mut grads)?;
    let dqkv = ex.reshape(
        &ex.concat_last(&[&dq, &dk, &dv])?,
        &shape(&[b, t, 3 * cfg.q_dim()]),
    )?;
    drop((dq, dk, dv));
    let mut gqkv = ex.matmul_backward(&s.n1.y, &w[l.qkv.0], &dqkv, Transpose::NT, needs(l.qkv.1))?;
    let dn1 = take(gqkv.da.take());
    put(&mut grads, l.qkv, gqkv);
    let n1 = ex.add_layernorm_backward(
        &s.x,
        &w[l.ln1.0],
        s.n1.mean.as_ref().expect("layernorm mean"),
        &s.n1.rstd,
        &dn1,
        dres,
    )?;
    grads[l.ln1.0] = Some(n1.dw);
    grads[l.ln1.1] = Some(n1.db.expect("layernorm bias grad"));
    let mut dx = n1.dx;
    if let Some(d) = dx_mlp {
        ex.add_assign(&mut dx, &d)?;
    }
    let grads = grads.into_iter().map(take).collect();
    Ok((dx, grads))
}
