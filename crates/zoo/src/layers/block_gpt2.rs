//! GPT-2 block: pre-LayerNorm attention and GELU MLP with biases; `Conv1D`
//! weights are `[in, out]` and read untransposed.

use megatrain_tensor::{AddNormOut, AttentionOut, Executor, MatmulNeeds, NormOut, TensorHandle, Transpose};

use super::Seq;
use super::{Branches, dropout_branch, dropped};
use super::{check_weights, linear, matmul_backward_gelu, matmul_gelu, shape};
use crate::{ModelConfig, Result};

const LN1_W: usize = 0;
const LN1_B: usize = 1;
const ATTN_W: usize = 2;
const ATTN_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_W: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const MLP_W: usize = 10;
const MLP_B: usize = 11;
const N: usize = 12;

#[derive(Debug)]
pub struct Gpt2Saved<T> {
    x: T,
    n1: NormOut<T>,
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    /// Attention output as `[B, T, C]`.
    a: T,
    x2: T,
    n2: NormOut<T>,
    f: T,
    g: T,
    drops: Branches,
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, Gpt2Saved<E::Tensor>)> {
    check_weights(w, N, "gpt2 block_forward")?;
    let eps = cfg.norm_eps as f32;
    let c = cfg.hidden_size;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let heads = shape(&[b, t, cfg.num_heads, cfg.head_dim]);
    let drops = seq.branches();

    let n1 = ex.layernorm(x, &w[LN1_W], &w[LN1_B], eps)?;
    let qkv = linear(ex, &n1.y, &w[ATTN_W], Some(&w[ATTN_B]), Transpose::NN)?;
    let mut parts = ex.split_last(&qkv, &[c, c, c])?.into_iter();
    let mut next = || ex.reshape(&parts.next().expect("three parts"), &heads);
    let (q, k, v) = (next()?, next()?, next()?);
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(0))?;
    let a = ex.reshape(&att.out, &shape(&[b, t, c]))?;
    let o = linear(ex, &a, &w[PROJ_W], Some(&w[PROJ_B]), Transpose::NN)?;
    let o = dropout_branch(ex, o, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_layernorm(x, &o, &w[LN2_W], &w[LN2_B], eps)?;
    let (f, g) = matmul_gelu(cfg, ex, &n2.y, &w[FC_W], Some(&w[FC_B]), Transpose::NN)?;
    let m = linear(ex, &g, &w[MLP_W], Some(&w[MLP_B]), Transpose::NN)?;
    let m = dropout_branch(ex, m, drops.mlp)?;
    let y = ex.add(&x2, &m)?;
    let saved = Gpt2Saved {
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
    w: &[E::Tensor],
    s: &Gpt2Saved<E::Tensor>,
    dy: &E::Tensor,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    check_weights(w, N, "gpt2 block_backward")?;
    let c = cfg.hidden_size;
    let (b, t) = (dy.dims()[0], dy.dims()[1]);
    let take = |o: Option<E::Tensor>| o.expect("requested gradient");

    // MLP.
    // The projection's input gradient carried on through GELU.
    let dm = dropped(ex, s.drops.mlp, dy)?;
    let gm = matmul_backward_gelu(
        cfg,
        ex,
        &s.g,
        &w[MLP_W],
        dm.as_ref().unwrap_or(dy),
        Transpose::NN,
        MatmulNeeds::ALL,
        &s.f,
    )?;
    let df = take(gm.da);
    let gfc = ex.matmul_backward(&s.n2.y, &w[FC_W], &df, Transpose::NN, MatmulNeeds::ALL)?;
    // x2 flows on past the norm: its gradient is the norm's plus dy.
    let n2 = ex.add_layernorm_backward(
        &s.x2,
        &w[LN2_W],
        s.n2.mean.as_ref().expect("layernorm mean"),
        &s.n2.rstd,
        &take(gfc.da),
        dy,
    )?;
    let dx2 = n2.dx;

    // Attention.
    let dproj = dropped(ex, s.drops.attn, &dx2)?;
    let dproj = dproj.as_ref().unwrap_or(&dx2);
    let gp = ex.matmul_backward(&s.a, &w[PROJ_W], dproj, Transpose::NN, MatmulNeeds::ALL)?;
    let da = ex.reshape(&take(gp.da), &shape(&[b, t, cfg.num_heads, cfg.head_dim]))?;
    let ga = ex.attention_backward(&s.q, &s.k, &s.v, &s.att, &da)?;
    let flat = shape(&[b, t, c]);
    let (dq, dk, dv) = (
        ex.reshape(&ga.dq, &flat)?,
        ex.reshape(&ga.dk, &flat)?,
        ex.reshape(&ga.dv, &flat)?,
    );
    let dqkv = ex.concat_last(&[&dq, &dk, &dv])?;
    let gattn = ex.matmul_backward(&s.n1.y, &w[ATTN_W], &dqkv, Transpose::NN, MatmulNeeds::ALL)?;
    let n1 = ex.add_layernorm_backward(
        &s.x,
        &w[LN1_W],
        s.n1.mean.as_ref().expect("layernorm mean"),
        &s.n1.rstd,
        &take(gattn.da),
        &dx2,
    )?;
    let dx = n1.dx;

    let grads = vec![
        n1.dw,
        n1.db.expect("layernorm bias grad"),
        take(gattn.db),
        take(gattn.dbias),
        take(gp.db),
        take(gp.dbias),
        n2.dw,
        n2.db.expect("layernorm bias grad"),
        take(gfc.db),
        take(gfc.dbias),
        take(gm.db),
        take(gm.dbias),
    ];
    Ok((dx, grads))
}
