//! DeepSeek-V3's block: Llama's (pre-RMSNorms, residuals, the MLP dense or
//! routed: [`Mlp`]) around multi-head latent attention ([`crate::Mla`]);
//! Kimi Linear's attention blocks too, which rotate nothing (their "rope"
//! part of q and of the shared key passes as it is).
//!
//! q comes through a low-rank pair with an RMSNorm between (or one
//! `q_proj`); one projection gives the latent of k and v and, beside it,
//! the rotated part of a key that every head shares; the latent's RMSNorm
//! and `kv_b_proj` give each head's k (its unrotated part) and v. Each
//! head's q and k are `[nope | rope]` (RoPE on the second part, in
//! neighbouring pairs under `rope_interleave`), values are `v_head_dim`
//! wide. The attention op takes one head width, so the narrower of q/k and
//! v is padded with zeros (which change no score and no output) and its
//! scale is set through q. The shared rotated key reaches every head by a
//! product with a stack of identities, whose backward sums the heads'
//! gradients.

use megatrain_tensor::{
    AddNormOut, AttentionOut, Executor, HostSlice, MatmulNeeds, NormOut, TensorHandle, Transpose,
};

use super::Seq;
use super::block_llama::{Mlp, MlpSaved};
use super::moe::{RouterAux, RouterStats};
use super::{Branches, dropout_branch, dropped};
use super::{Linear, check_weights, lin, needs, put, shape};
use crate::{Mla, ModelConfig, Result, ZooError};

/// How q is projected: a low-rank pair with its norm, or one product.
#[derive(Debug, Clone, Copy)]
enum QProj {
    Lora { a: Linear, norm: usize, b: Linear },
    Full(Linear),
}

/// Positions of a block's tensors in its table (mirrors `tables.rs`'s
/// `push_mla`, then the MLP's).
#[derive(Debug, Clone, Copy)]
struct Layout {
    ln1: usize,
    q: QProj,
    kv_a: Linear,
    kv_norm: usize,
    kv_b: Linear,
    o: Linear,
    ln2: usize,
    mlp: Mlp,
    len: usize,
}

impl Layout {
    fn new(cfg: &ModelConfig, m: &Mla, layer: usize) -> Layout {
        let mut n = 0;
        let mut next = || {
            n += 1;
            n - 1
        };
        fn lin(bias: bool, next: &mut dyn FnMut() -> usize) -> Linear {
            let w = next();
            (w, bias.then(&mut *next))
        }
        let ln1 = next();
        let q = match m.q_lora_rank {
            Some(_) => {
                let a = lin(cfg.qkv_bias, &mut next);
                let norm = next();
                let b = lin(false, &mut next);
                QProj::Lora { a, norm, b }
            }
            None => QProj::Full(lin(false, &mut next)),
        };
        let kv_a = lin(cfg.qkv_bias, &mut next);
        let kv_norm = next();
        let kv_b = lin(false, &mut next);
        let o = lin(cfg.o_bias, &mut next);
        let ln2 = next();
        let mlp = Mlp::new(cfg, layer, &mut next);
        Layout {
            ln1,
            q,
            kv_a,
            kv_norm,
            kv_b,
            o,
            ln2,
            mlp,
            len: n,
        }
    }
}

/// What a DeepSeek-V3 block's backward needs from its forward.
#[derive(Debug)]
pub struct MlaSaved<T> {
    x: T,
    n1: NormOut<T>,
    /// q's low-rank projection before its norm, and the norm.
    q_lora: Option<(T, NormOut<T>)>,
    /// The latent before its norm, and the norm.
    latent: T,
    kvn: NormOut<T>,
    /// The shared key's rotated part `[B·T, rope]`, and the stack of
    /// identities that gives it to every head.
    k_rot: T,
    heads: T,
    /// q (scaled), k and v as the attention read them, padded to one
    /// width, and its output.
    q: T,
    k: T,
    v: T,
    att: AttentionOut<T>,
    a: T,
    x2: T,
    n2: NormOut<T>,
    mlp: MlpSaved<T>,
    drops: Branches,
}

impl<T> MlaSaved<T> {
    /// The routing statistics of a routed block's forward.
    pub(super) fn router_stats(&self, tokens: Option<&[bool]>) -> Option<RouterStats> {
        self.mlp.router_stats(tokens)
    }
}

/// The widths of a block's attention: the padded head width the op runs
/// at, and what q is multiplied by so that its `width^−½` scales the
/// scores as the model's `softmax_scale` does.
fn widths(cfg: &ModelConfig, m: &Mla) -> (usize, f64) {
    let d = m.qk_head_dim().max(m.v_head_dim);
    (d, m.softmax_scale(&cfg.rope_scaling) * (d as f64).sqrt())
}

/// `x: [.., w]` with zeros after it to `to` entries.
fn pad<E: Executor>(ex: &E, x: E::Tensor, to: usize) -> Result<E::Tensor> {
    let dims = x.dims();
    let w = dims[dims.len() - 1];
    if w == to {
        return Ok(x);
    }
    let mut zd = dims.to_vec();
    *zd.last_mut().expect("not empty") = to - w;
    Ok(ex.concat_last(&[&x, &ex.zeros(&shape(&zd))?])?)
}

/// The first `w` entries of the last dimension of `x`.
fn unpad<E: Executor>(ex: &E, x: E::Tensor, w: usize) -> Result<E::Tensor> {
    let last = x.dims()[x.dims().len() - 1];
    if last == w {
        return Ok(x);
    }
    Ok(ex.split_last(&x, &[w, last - w])?.swap_remove(0))
}

/// A `[heads · r, r]` stack of identities: `k @ Sᵀ` repeats `k: [N, r]`
/// for every head, and its backward sums the heads.
fn identities<E: Executor>(ex: &E, heads: usize, r: usize) -> Result<E::Tensor> {
    let mut s = vec![0.0f32; heads * r * r];
    for h in 0..heads {
        for i in 0..r {
            s[(h * r + i) * r + i] = 1.0;
        }
    }
    Ok(ex.upload_slice(&shape(&[heads * r, r]), HostSlice::F32(&s))?)
}

/// The epsilon of the latents' norms: Kimi Linear's are built with
/// transformers' RMSNorm default (1e-6), whatever its `rms_norm_eps`.
fn latent_eps(cfg: &ModelConfig) -> f32 {
    match cfg.arch {
        crate::Arch::KimiLinear => 1e-6,
        _ => cfg.norm_eps as f32,
    }
}

fn mla(cfg: &ModelConfig) -> Result<Mla> {
    cfg.mla.ok_or_else(|| {
        ZooError::invalid(
            "mla block",
            format!("a {:?} model has no latent attention", cfg.arch),
        )
    })
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, MlaSaved<E::Tensor>)> {
    let m = mla(cfg)?;
    let l = Layout::new(cfg, &m, layer);
    check_weights(w, l.len, "mla block_forward")?;
    let eps = cfg.norm_eps as f32;
    let (b, t, h) = (x.dims()[0], x.dims()[1], cfg.num_heads);
    let (nope, r, vw, qk) = (m.qk_nope, m.qk_rope, m.v_head_dim, m.qk_head_dim());
    let (d, q_factor) = widths(cfg, &m);
    let rope = megatrain_tensor::Rope {
        interleaved: m.rope_interleave,
        ..seq.rope(cfg, layer)
    };

    let n1 = ex.rmsnorm(x, &w[l.ln1], eps)?;
    let (q, q_lora) = match l.q {
        QProj::Lora { a, norm, b } => {
            let qa = lin(ex, &n1.y, w, a)?;
            let qn = ex.rmsnorm(&qa, &w[norm], latent_eps(cfg))?;
            (lin(ex, &qn.y, w, b)?, Some((qa, qn)))
        }
        QProj::Full(p) => (lin(ex, &n1.y, w, p)?, None),
    };
    let q = ex.split_last(&ex.reshape(&q, &shape(&[b, t, h, qk]))?, &[nope, r])?;
    let rotates = cfg.has_rope(layer);
    let turn = |x: &E::Tensor| -> Result<E::Tensor> {
        Ok(match rotates {
            true => ex.rope(x, rope.clone())?,
            false => ex.reshape(x, x.shape())?,
        })
    };
    let q = ex.concat_last(&[&q[0], &turn(&q[1])?])?;
    let kv = ex.split_last(&lin(ex, &n1.y, w, l.kv_a)?, &[m.kv_lora_rank, r])?;
    let kvn = ex.rmsnorm(&kv[0], &w[l.kv_norm], latent_eps(cfg))?;
    let kvb = ex.reshape(&lin(ex, &kvn.y, w, l.kv_b)?, &shape(&[b, t, h, nope + vw]))?;
    let kvb = ex.split_last(&kvb, &[nope, vw])?;
    let k_rot = turn(&ex.reshape(&kv[1], &shape(&[b, t, 1, r]))?)?;
    let k_rot = ex.reshape(&k_rot, &shape(&[b * t, r]))?;
    let heads = identities(ex, h, r)?;
    let k_heads = ex.matmul(&k_rot, &heads, None, Transpose::NT)?;
    let k = ex.concat_last(&[&kvb[0], &ex.reshape(&k_heads, &shape(&[b, t, h, r]))?])?;
    let q = ex.scale(&pad(ex, q, d)?, q_factor)?;
    let (k, v) = (pad(ex, k, d)?, pad(ex, ex.reshape(&kvb[1], kvb[1].shape())?, d)?);
    let att = seq.attend(ex, &q, &k, &v, cfg.attn_mask(layer))?;
    let a = unpad(ex, ex.reshape(&att.out, att.out.shape())?, vw)?;
    let a = ex.reshape(&a, &shape(&[b, t, h * vw]))?;
    let drops = seq.branches();
    let o = dropout_branch(ex, lin(ex, &a, w, l.o)?, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_rmsnorm(x, &o, &w[l.ln2], eps)?;
    let (dm, mlp) = l.mlp.forward(cfg, ex, w, &n2.y)?;
    let dm = dropout_branch(ex, dm, drops.mlp)?;
    let y = ex.add(&x2, &dm)?;
    let latent = kv.into_iter().next().expect("split in two");
    let saved = MlaSaved {
        x: ex.reshape(x, x.shape())?,
        n1,
        q_lora,
        latent,
        kvn,
        k_rot,
        heads,
        q,
        k,
        v,
        att,
        a,
        x2,
        n2,
        mlp,
        drops,
    };
    Ok((y, saved))
}

pub(super) fn backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    s: &MlaSaved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let m = mla(cfg)?;
    let l = Layout::new(cfg, &m, layer);
    check_weights(w, l.len, "mla block_backward")?;
    let (b, t, h) = (dy.dims()[0], dy.dims()[1], cfg.num_heads);
    let (nope, r, vw, qk) = (m.qk_nope, m.qk_rope, m.v_head_dim, m.qk_head_dim());
    let (d, q_factor) = widths(cfg, &m);
    let rope = megatrain_tensor::Rope {
        interleaved: m.rope_interleave,
        ..cfg.rope(layer).with_docs(s.att.mask.docs.clone())
    };
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();
    let nt = Transpose::NT;

    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dm = dm.as_ref().unwrap_or(dy);
    let dn2 = l
        .mlp
        .backward(cfg, ex, layer, w, &s.n2.y, &s.mlp, dm, aux, &mut grads)?;
    let n2 = ex.add_rmsnorm_backward(&s.x2, &w[l.ln2], &s.n2.rstd, &dn2, dy)?;
    grads[l.ln2] = Some(n2.dw);
    let dx2 = n2.dx;

    let dproj = dropped(ex, s.drops.attn, &dx2)?;
    let mut go = ex.matmul_backward(&s.a, &w[l.o.0], dproj.as_ref().unwrap_or(&dx2), nt, needs(l.o.1))?;
    let da = go.da.take().expect("requested gradient");
    put(&mut grads, l.o, go);
    let dout = pad(ex, ex.reshape(&da, &shape(&[b, t, h, vw]))?, d)?;
    let ga = ex.attention_backward(&s.q, &s.k, &s.v, &s.att, &dout)?;
    let dq = unpad(ex, ex.scale(&ga.dq, q_factor)?, qk)?;
    let (dk, dv) = (unpad(ex, ga.dk, qk)?, unpad(ex, ga.dv, vw)?);

    // The shared rotated key: its heads' gradients summed, RoPE undone.
    let dk = ex.split_last(&dk, &[nope, r])?;
    let dk_heads = ex.reshape(&dk[1], &shape(&[b * t, h * r]))?;
    let only_da = MatmulNeeds {
        da: true,
        db: false,
        dbias: false,
    };
    let dk_rot = ex.matmul_backward(&s.k_rot, &s.heads, &dk_heads, nt, only_da)?.da;
    let dk_rot = ex.reshape(&dk_rot.expect("requested gradient"), &shape(&[b, t, 1, r]))?;
    let rotates = cfg.has_rope(layer);
    let unturn = |x: &E::Tensor| -> Result<E::Tensor> {
        Ok(match rotates {
            true => ex.rope_backward(x, rope.clone())?,
            false => ex.reshape(x, x.shape())?,
        })
    };
    let dk_rot = ex.reshape(&unturn(&dk_rot)?, &shape(&[b, t, r]))?;

    let dkvb = ex.reshape(&ex.concat_last(&[&dk[0], &dv])?, &shape(&[b, t, h * (nope + vw)]))?;
    let mut gb = ex.matmul_backward(&s.kvn.y, &w[l.kv_b.0], &dkvb, nt, needs(l.kv_b.1))?;
    let dkvn = gb.da.take().expect("requested gradient");
    put(&mut grads, l.kv_b, gb);
    let gn = ex.rmsnorm_backward(&s.latent, &w[l.kv_norm], &s.kvn.rstd, &dkvn)?;
    grads[l.kv_norm] = Some(gn.dw);
    let dkva = ex.concat_last(&[&gn.dx, &dk_rot])?;

    let dq = ex.split_last(&dq, &[nope, r])?;
    let dq = ex.concat_last(&[&dq[0], &unturn(&dq[1])?])?;
    let dq = ex.reshape(&dq, &shape(&[b, t, h * qk]))?;
    let mut dn1 = match (l.q, &s.q_lora) {
        (QProj::Lora { a, norm, b: qb }, Some((qa, qn))) => {
            let mut g = ex.matmul_backward(&qn.y, &w[qb.0], &dq, nt, needs(qb.1))?;
            let dqn = g.da.take().expect("requested gradient");
            put(&mut grads, qb, g);
            let gq = ex.rmsnorm_backward(qa, &w[norm], &qn.rstd, &dqn)?;
            grads[norm] = Some(gq.dw);
            let mut g = ex.matmul_backward(&s.n1.y, &w[a.0], &gq.dx, nt, needs(a.1))?;
            let dn1 = g.da.take().expect("requested gradient");
            put(&mut grads, a, g);
            dn1
        }
        (QProj::Full(p), None) => {
            let mut g = ex.matmul_backward(&s.n1.y, &w[p.0], &dq, nt, needs(p.1))?;
            let dn1 = g.da.take().expect("requested gradient");
            put(&mut grads, p, g);
            dn1
        }
        _ => unreachable!("the saved q projection is the layout's"),
    };
    let g = ex.matmul_backward_da_into(&s.n1.y, &w[l.kv_a.0], &dkva, nt, needs(l.kv_a.1), &mut dn1)?;
    put(&mut grads, l.kv_a, g);
    let n1 = ex.add_rmsnorm_backward(&s.x, &w[l.ln1], &s.n1.rstd, &dn1, &dx2)?;
    grads[l.ln1] = Some(n1.dw);
    let grads = grads
        .into_iter()
        .map(|g| g.expect("every slot's gradient"))
        .collect();
    Ok((n1.dx, grads))
}
