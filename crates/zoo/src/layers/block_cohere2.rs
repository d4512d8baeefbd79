//! Cohere block (Command R; Cohere 2's: Command R7B, Command A): one
//! LayerNorm without bias feeds the attention and the SwiGLU MLP side by
//! side, `y = x + attn(n) + mlp(n)` with `n = layernorm(x)`; q and k rotate
//! in neighbouring pairs (in Cohere 2, on the sliding blocks only). Optional biases
//! on q/k/v/o. `nn.Linear` weights are `[out, in]`, read with
//! `Transpose::NT`.

use megatrain_tensor::{AttentionOut, Executor, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{
    AttnSaved, Linear, attention_backward_from_output, check_weights, lin, needs, qkv_backward, shape,
};
use super::{Branches, dropout_branch, dropped};
use crate::{ModelConfig, Result};

/// Positions of a block's tensors in its table (mirrors `layer_table`).
#[derive(Debug, Clone, Copy)]
struct Layout {
    ln: usize,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: usize,
    up: usize,
    down: usize,
    len: usize,
}

impl Layout {
    fn new(cfg: &ModelConfig) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        let ln = next();
        let bias = cfg.qkv_bias;
        let mut lin = || {
            let w = next();
            (w, bias.then(&mut next))
        };
        let (q, k, v, o) = (lin(), lin(), lin(), lin());
        let (gate, up, down) = (next(), next(), next());
        Layout {
            ln,
            q,
            k,
            v,
            o,
            gate,
            up,
            down,
            len: n,
        }
    }
}

#[derive(Debug)]
pub struct Cohere2Saved<T> {
    x: T,
    n: NormOut<T>,
    /// q and k as attention read them (rotated in sliding blocks), and v.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    gate: T,
    up: T,
    s: T,
    drops: Branches,
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, Cohere2Saved<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "cohere2 block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let qs = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let ks = shape(&[b, t, cfg.num_kv_heads, cfg.head_dim]);

    // Cohere's LayerNorm has no bias: the op's is zeros.
    let n = ex.layernorm(x, &w[l.ln], &ex.zeros(w[l.ln].shape())?, eps)?;
    let q = ex.reshape(&lin(ex, &n.y, w, l.q)?, &qs)?;
    let k = ex.reshape(&lin(ex, &n.y, w, l.k)?, &ks)?;
    let v = ex.reshape(&lin(ex, &n.y, w, l.v)?, &ks)?;
    let (q, k) = match cfg.has_rope(layer) {
        true => (
            ex.rope(&q, seq.rope(cfg, layer))?,
            ex.rope(&k, seq.rope(cfg, layer))?,
        ),
        false => (q, k),
    };
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, cfg.q_dim()]))?;
    let drops = seq.branches();
    let o = dropout_branch(ex, lin(ex, &a, w, l.o)?, drops.attn)?;
    let gate = ex.matmul(&n.y, &w[l.gate], None, Transpose::NT)?;
    // The up projection with the activation applied where it is stored.
    let (up, s) = ex.matmul_swiglu(&n.y, &w[l.up], None, Transpose::NT, &gate)?;
    let m = dropout_branch(ex, ex.matmul(&s, &w[l.down], None, Transpose::NT)?, drops.mlp)?;
    let y = ex.add(&ex.add(x, &o)?, &m)?;
    let saved = Cohere2Saved {
        x: ex.reshape(x, x.shape())?,
        n,
        q,
        k,
        v,
        att,
        a,
        gate,
        up,
        s,
        drops,
    };
    Ok((y, saved))
}

pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &Cohere2Saved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg);
    check_weights(w, l.len, "cohere2 block_backward")?;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // dy reaches x directly, and the MLP's and the attention's outputs.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dm = dm.as_ref().unwrap_or(dy);
    let (gd, dgate, dup) =
        ex.matmul_backward_swiglu(&s.s, &w[l.down], dm, Transpose::NT, needs(None), &s.gate, &s.up)?;
    grads[l.down] = gd.db;
    let mut gg = ex.matmul_backward(&s.n.y, &w[l.gate], &dgate, Transpose::NT, needs(None))?;
    let mut dn_mlp = take(gg.da.take());
    let gu = ex.matmul_backward_da_into(&s.n.y, &w[l.up], &dup, Transpose::NT, needs(None), &mut dn_mlp)?;
    grads[l.gate] = gg.db;
    grads[l.up] = gu.db;

    let da = dropped(ex, s.drops.attn, dy)?;
    let da = da.as_ref().unwrap_or(dy);
    let (dq, dk, dv) =
        attention_backward_from_output(cfg, ex, layer, w, l.o, attn_saved!(s), da, &mut grads)?;
    let dq = ex.reshape(&dq, &shape(&[b, t, cfg.q_dim()]))?;
    let dk = ex.reshape(&dk, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&dv, &shape(&[b, t, cfg.kv_dim()]))?;
    let mut dn = qkv_backward(ex, &s.n.y, w, [(&dq, l.q), (&dk, l.k), (&dv, l.v)], &mut grads)?;
    ex.add_assign(&mut dn, &dn_mlp)?;

    // The norm's input is x, which dy also reaches directly.
    let gn = ex.add_layernorm_backward(
        &s.x,
        &w[l.ln],
        s.n.mean.as_ref().expect("layernorm mean"),
        &s.n.rstd,
        &dn,
        dy,
    )?;
    grads[l.ln] = Some(gn.dw);
    let grads = grads.into_iter().map(take).collect();
    Ok((gn.dx, grads))
}
