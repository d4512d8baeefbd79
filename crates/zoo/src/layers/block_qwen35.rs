//! Qwen3.5's block (and OLMo Hybrid's Gated DeltaNet blocks, whose
//! attention blocks are OLMo 3's, `block_olmo2.rs`): Llama's pre-norm residual block (RMSNorm gains stored
//! as `1 + w`'s weight, [`Gains`]; the MLP dense or routed, [`Mlp`])
//! around one of two token mixers, as the config's `layer_types` say
//! ([`crate::LinearAttn`]):
//!
//! - a Gated DeltaNet: one product gives the mixed `[q | k | v]`, a causal
//!   depthwise convolution with SiLU mixes it over time; q and k are
//!   l2-normalised (q also scaled by `key_dim^−½`); the decays
//!   `g = −exp(A_log)·softplus(a + dt_bias)` and the rates `β = σ(b)` come
//!   from products of their own; the gated delta rule's output goes through
//!   an RMSNorm (its gain stored as itself) times `silu(z)`, then `out_proj`.
//! - full attention whose q projection gives each head's query and, beside
//!   it, a gate: per-head q/k norms, RoPE on part of each head, and the
//!   attention's output times `σ(gate)` before `o_proj`.
//!
//! The l2 norms are RMSNorms of unit gain: `x / √(Σx² + ε)` is
//! `rmsnorm(x; ε / n) · n^−½` for `n` entries (q's then scaled by `n^−½`
//! once more).

use megatrain_tensor::{
    AddNormOut, AttentionOut, DeltaRuleGrads, DeltaRuleOut, Docs, Executor, HostSlice, NormOut, TensorHandle,
    Transpose,
};

use super::Seq;
use super::block_llama::{Mlp, MlpSaved};
use super::moe::{RouterAux, RouterStats};
use super::{Branches, dropout_branch, dropped};
use super::{Gains, Linear, check_weights, lin, needs, put, qkv_backward, shape};
use crate::{Arch, LinearAttn, ModelConfig, Result, ZooError};

/// transformers' `l2norm` epsilon in the Gated DeltaNet (not the model's
/// `rms_norm_eps`).
const L2_EPS: f64 = 1e-6;

/// A Gated DeltaNet's input products: Qwen3.5's four, Qwen3-Next's two,
/// each of whose outputs holds, key head after key head, that head's q and
/// k, then its value heads' v and z (`qkvz`), or their b and a (`ba`), or
/// OLMo Hybrid's six.
#[derive(Debug, Clone, Copy)]
enum InProj {
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    Fused {
        qkvz: Linear,
        ba: Linear,
    },
    /// OLMo Hybrid's: q, k, v, z (its `g_proj`), b and a each apart.
    Apart {
        q: Linear,
        k: Linear,
        v: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
}

/// The convolution's weights: one `[channels, 1, taps]`, or OLMo Hybrid's
/// q, k and v pieces of it (its checkpoints store them apart).
#[derive(Debug, Clone, Copy)]
pub(super) enum Conv {
    One(usize),
    Apart([usize; 3]),
}

/// Table slots of a Gated DeltaNet (mirrors `tables.rs`'s
/// `push_qwen35_mixer`).
#[derive(Debug, Clone, Copy)]
struct DeltaNet {
    proj: InProj,
    conv: Conv,
    dt_bias: usize,
    a_log: usize,
    norm: usize,
    out: Linear,
}

/// Table slots of the gated full attention.
#[derive(Debug, Clone, Copy)]
struct GatedAttn {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: usize,
    k_norm: usize,
}

#[derive(Debug, Clone, Copy)]
enum Mixer {
    DeltaNet(DeltaNet),
    Attention(GatedAttn),
}

#[derive(Debug, Clone, Copy)]
struct Layout {
    ln1: usize,
    mixer: Mixer,
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
        fn lin(bias: bool, next: &mut dyn FnMut() -> usize) -> Linear {
            let w = next();
            (w, bias.then(&mut *next))
        }
        let ln1 = next();
        let mixer = match cfg.is_linear_block(layer) {
            true => Mixer::DeltaNet(DeltaNet {
                proj: match cfg.arch {
                    Arch::Qwen3Next => InProj::Fused {
                        qkvz: lin(false, &mut next),
                        ba: lin(false, &mut next),
                    },
                    Arch::OlmoHybrid => InProj::Apart {
                        q: lin(false, &mut next),
                        k: lin(false, &mut next),
                        v: lin(false, &mut next),
                        z: lin(false, &mut next),
                        b: lin(false, &mut next),
                        a: lin(false, &mut next),
                    },
                    _ => InProj::Split {
                        qkv: lin(false, &mut next),
                        z: lin(false, &mut next),
                        b: lin(false, &mut next),
                        a: lin(false, &mut next),
                    },
                },
                conv: match cfg.arch {
                    Arch::OlmoHybrid => Conv::Apart([next(), next(), next()]),
                    _ => Conv::One(next()),
                },
                dt_bias: next(),
                a_log: next(),
                norm: next(),
                out: lin(false, &mut next),
            }),
            false => Mixer::Attention(GatedAttn {
                q: lin(cfg.qkv_bias, &mut next),
                k: lin(cfg.qkv_bias, &mut next),
                v: lin(cfg.qkv_bias, &mut next),
                o: lin(cfg.o_bias, &mut next),
                q_norm: next(),
                k_norm: next(),
            }),
        };
        let ln2 = next();
        let mlp = Mlp::new(cfg, layer, &mut next);
        Layout {
            ln1,
            mixer,
            ln2,
            mlp,
            len: n,
        }
    }

    /// The norms whose gains are stored offset (all but the DeltaNet's).
    fn offset_norms(&self) -> Vec<usize> {
        let mut v = vec![self.ln1, self.ln2];
        if let Mixer::Attention(a) = self.mixer {
            v.extend([a.q_norm, a.k_norm]);
        }
        v
    }
}

/// What a Gated DeltaNet's backward needs from its forward.
#[derive(Debug)]
struct DeltaNetSaved<T> {
    /// q, k and v as the rule read them, and what made them.
    inputs: RuleInputs<T>,
    /// The decays' and rates' logits `[B·T, Hv]`, and the gates they gave
    /// `[B, T, Hv]`.
    a: T,
    b: T,
    g: T,
    beta: T,
    rule: DeltaRuleOut<T>,
    /// The rule's output through its norm, and `z` `[B, T, Hv, Dv]`.
    normed: NormOut<T>,
    z: T,
    /// `out_proj`'s input `[B, T, Hv·Dv]`.
    gated: T,
}

/// What the gated attention's backward needs from its forward.
#[derive(Debug)]
struct GatedAttnSaved<T> {
    /// q and k before their norms, with the norms.
    q: (T, NormOut<T>),
    k: (T, NormOut<T>),
    gate: T,
    /// Rotated q, k and v as the attention read them.
    qr: T,
    kr: T,
    v: T,
    att: AttentionOut<T>,
    /// `o_proj`'s input `[B, T, q_dim]`.
    a: T,
}

#[derive(Debug)]
enum MixerSaved<T> {
    DeltaNet(DeltaNetSaved<T>),
    Attention(GatedAttnSaved<T>),
}

/// What a Qwen3.5 block's backward needs from its forward.
#[derive(Debug)]
pub struct Qwen35Saved<T> {
    x: T,
    n1: NormOut<T>,
    mixer: MixerSaved<T>,
    x2: T,
    n2: NormOut<T>,
    mlp: MlpSaved<T>,
    drops: Branches,
}

impl<T> Qwen35Saved<T> {
    /// The routing statistics of a routed block's forward.
    pub(super) fn router_stats(&self, tokens: Option<&[bool]>) -> Option<RouterStats> {
        self.mlp.router_stats(tokens)
    }
}

pub(super) fn linear_attn(cfg: &ModelConfig) -> Result<&LinearAttn> {
    cfg.linear_attn.as_ref().ok_or_else(|| {
        ZooError::invalid(
            "qwen3.5 block",
            format!("a {:?} model has no Gated DeltaNet", cfg.arch),
        )
    })
}

/// The epsilon of the norm before the output gate (OLMo Hybrid's own).
fn gate_norm_eps(cfg: &ModelConfig, la: &LinearAttn) -> f32 {
    la.norm_eps.unwrap_or(cfg.norm_eps) as f32
}

/// The epsilon that makes an RMSNorm of unit gain over `n` entries `√n`
/// times the l2 norm, and the factors that then give q's (`n^−½ · n^−½`)
/// and k's (`n^−½`): applied by `scale`, which keeps them in the
/// executor's precision (an f32 gain would round `n^−½`).
fn l2_norm_parts(n: usize) -> (f32, f64, f64) {
    let inv = 1.0 / (n as f64).sqrt();
    ((L2_EPS / n as f64) as f32, inv * inv, inv)
}

pub(super) fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, Qwen35Saved<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len, "qwen3.5 block_forward")?;
    let eps = cfg.norm_eps as f32;
    let g = Gains::new(cfg, ex, w, &l.offset_norms())?;
    let n1 = ex.rmsnorm(x, g.get(w, l.ln1), eps)?;
    let (m, mixer) = match l.mixer {
        Mixer::DeltaNet(d) => {
            let (m, s) = delta_net_forward(cfg, ex, w, d, &n1.y, seq)?;
            (m, MixerSaved::DeltaNet(s))
        }
        Mixer::Attention(a) => {
            let (m, s) = gated_attention_forward(cfg, ex, layer, w, &g, a, &n1.y, seq)?;
            (m, MixerSaved::Attention(s))
        }
    };
    let drops = seq.branches();
    let m = dropout_branch(ex, m, drops.attn)?;
    let AddNormOut { h: x2, norm: n2 } = ex.add_rmsnorm(x, &m, g.get(w, l.ln2), eps)?;
    let (d, mlp) = l.mlp.forward(cfg, ex, w, &n2.y)?;
    let d = dropout_branch(ex, d, drops.mlp)?;
    let y = ex.add(&x2, &d)?;
    let saved = Qwen35Saved {
        x: ex.reshape(x, x.shape())?,
        n1,
        mixer,
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
    s: &Qwen35Saved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    let l = Layout::new(cfg, layer);
    check_weights(w, l.len, "qwen3.5 block_backward")?;
    let g = Gains::new(cfg, ex, w, &l.offset_norms())?;
    let mut grads: Vec<Option<E::Tensor>> = (0..l.len).map(|_| None).collect();

    let dm = dropped(ex, s.drops.mlp, dy)?;
    let dm = dm.as_ref().unwrap_or(dy);
    let dn2 = l
        .mlp
        .backward(cfg, ex, layer, w, &s.n2.y, &s.mlp, dm, aux, &mut grads)?;
    let n2 = ex.add_rmsnorm_backward(&s.x2, g.get(w, l.ln2), &s.n2.rstd, &dn2, dy)?;
    grads[l.ln2] = Some(n2.dw);
    let dx2 = n2.dx;
    let dmix = dropped(ex, s.drops.attn, &dx2)?;
    let dmix = dmix.as_ref().unwrap_or(&dx2);
    let dn1 = match (l.mixer, &s.mixer) {
        (Mixer::DeltaNet(d), MixerSaved::DeltaNet(ds)) => {
            delta_net_backward(cfg, ex, w, d, &s.n1.y, ds, dmix, &mut grads)?
        }
        (Mixer::Attention(a), MixerSaved::Attention(gs)) => {
            gated_attention_backward(cfg, ex, layer, w, &g, a, &s.n1.y, gs, dmix, &mut grads)?
        }
        _ => {
            return Err(ZooError::invalid(
                "qwen3.5 block_backward",
                format!("block {layer}'s saved token mixer is not the kind its layout has"),
            ));
        }
    };
    let n1 = ex.add_rmsnorm_backward(&s.x, g.get(w, l.ln1), &s.n1.rstd, &dn1, &dx2)?;
    grads[l.ln1] = Some(n1.dw);
    let grads = grads
        .into_iter()
        .map(|g| g.expect("every slot's gradient"))
        .collect();
    Ok((n1.dx, grads))
}

fn delta_net_forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    d: DeltaNet,
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, DeltaNetSaved<E::Tensor>)> {
    let la = linear_attn(cfg)?;
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let (hv, vw) = (la.value_heads, la.value_width());
    let Projected {
        mixed,
        z,
        b: bl,
        a: al,
    } = project(ex, la, w, d.proj, x)?;
    let inputs = rule_inputs(ex, la, w, d.conv, mixed, seq)?;
    let (gates, betas) = ex.delta_gates(&al, &bl, &w[d.a_log], &w[d.dt_bias])?;
    let gates = ex.reshape(&gates, &shape(&[b, t, hv]))?;
    let betas = ex.reshape(&betas, &shape(&[b, t, hv]))?;
    let betas = match la.beta_scale {
        1.0 => betas,
        s => ex.scale(&betas, s)?,
    };
    let rule = inputs.rule(ex, &gates, &betas, seq)?;
    let normed = ex.rmsnorm(&rule.out, &w[d.norm], gate_norm_eps(cfg, la))?;
    let gated = ex.reshape(&ex.swiglu(&z, &normed.y)?, &shape(&[b, t, vw]))?;
    let out = lin(ex, &gated, w, d.out)?;
    let saved = DeltaNetSaved {
        inputs,
        a: al,
        b: bl,
        g: gates,
        beta: betas,
        rule,
        normed,
        z,
        gated,
    };
    Ok((out, saved))
}

/// The Gated DeltaNet's backward from `dout`: the gradient of its input
/// `x`, its weights' stored at their slots in `grads`.
#[allow(clippy::too_many_arguments)]
fn delta_net_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    d: DeltaNet,
    x: &E::Tensor,
    s: &DeltaNetSaved<E::Tensor>,
    dout: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let la = linear_attn(cfg)?;
    let (b, t) = (dout.dims()[0], dout.dims()[1]);
    let (hv, dv, vw) = (la.value_heads, la.value_dim, la.value_width());
    let mut go = ex.matmul_backward(&s.gated, &w[d.out.0], dout, Transpose::NT, needs(d.out.1))?;
    let dgated = ex.reshape(
        &go.da.take().expect("requested gradient"),
        &shape(&[b, t, hv, dv]),
    )?;
    put(grads, d.out, go);
    let (dz, dnormed) = ex.swiglu_backward(&s.z, &s.normed.y, &dgated)?;
    let gn = ex.rmsnorm_backward(&s.rule.out, &w[d.norm], &s.normed.rstd, &dnormed)?;
    grads[d.norm] = Some(gn.dw);
    let gr = s.inputs.rule_backward(ex, &s.g, &s.beta, &s.rule, &gn.dx)?;
    let dmixed = s.inputs.backward(ex, la, w, d.conv, &gr, grads)?;
    let flat = |x: &E::Tensor, n: usize| ex.reshape(x, &shape(&[b, t, n]));
    let dg = ex.reshape(&gr.dg, &shape(&[b * t, hv]))?;
    let dbeta = ex.reshape(&gr.dbeta, &shape(&[b * t, hv]))?;
    let dbeta = match la.beta_scale {
        1.0 => dbeta,
        s => ex.scale(&dbeta, s)?,
    };
    let (da, db, da_log, ddt_bias) =
        ex.delta_gates_backward(&s.a, &s.b, &w[d.a_log], &w[d.dt_bias], &dg, &dbeta)?;
    grads[d.a_log] = Some(da_log);
    grads[d.dt_bias] = Some(ddt_bias);
    let (da, db) = (flat(&da, hv)?, flat(&db, hv)?);
    let dz = flat(&dz, vw)?;
    project_backward(ex, la, w, d.proj, x, [&dmixed, &dz, &db, &da], grads)
}

/// What the gated delta rule reads from the mixed `[q | k | v]` (the
/// convolution's input `[B, T, channels]`, kept for its backward): the
/// convolution with SiLU, then q and k through their l2 norms (kept before,
/// in and after their scales), and v. Every Gated DeltaNet's (Qwen3.5's,
/// OLMo Hybrid's, Kimi Linear's) whatever its products and gates. Both
/// the convolution and the rule restart at each packed document.
#[derive(Debug)]
pub(super) struct RuleInputs<T> {
    mixed: T,
    docs: Option<Docs>,
    /// The l2 norms' unit gain `[Dk]`, uploaded once for the forward and
    /// the backward alike.
    unit: T,
    q: (T, NormOut<T>, T),
    k: (T, NormOut<T>, T),
    v: T,
}

/// [`RuleInputs`] of `mixed` through the convolution `conv`, where `seq`
/// says (within the rows' documents, or after the inputs a cache holds).
pub(super) fn rule_inputs<E: Executor>(
    ex: &E,
    la: &LinearAttn,
    w: &[E::Tensor],
    conv: Conv,
    mixed: E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<RuleInputs<E::Tensor>> {
    let (b, t) = (mixed.dims()[0], mixed.dims()[1]);
    let (hk, hv, dk, dv) = (la.key_heads, la.value_heads, la.key_dim, la.value_dim);
    let (kw, vw) = (la.key_width(), la.value_width());
    let conv = seq.conv(ex, &mixed, &conv_weight(ex, la, w, conv)?)?;
    let parts = ex.split_last(&conv, &[kw, kw, vw])?;
    let q = ex.reshape(&parts[0], &shape(&[b, t, hk, dk]))?;
    let k = ex.reshape(&parts[1], &shape(&[b, t, hk, dk]))?;
    let v = ex.reshape(&parts[2], &shape(&[b, t, hv, dv]))?;
    let unit = ex.upload_slice(&shape(&[dk]), HostSlice::F32(&vec![1.0; dk]))?;
    let (l2_eps, q_scale, k_scale) = l2_norm_parts(dk);
    let qn = ex.rmsnorm(&q, &unit, l2_eps)?;
    let kn = ex.rmsnorm(&k, &unit, l2_eps)?;
    let (qs, ks) = (ex.scale(&qn.y, q_scale)?, ex.scale(&kn.y, k_scale)?);
    Ok(RuleInputs {
        mixed,
        docs: seq.docs().cloned(),
        unit,
        q: (q, qn, qs),
        k: (k, kn, ks),
        v,
    })
}

impl<T: TensorHandle> RuleInputs<T> {
    /// The gated delta rule of these inputs with decays `g` and rates
    /// `beta`, where `seq` says.
    pub(super) fn rule<E: Executor<Tensor = T>>(
        &self,
        ex: &E,
        g: &T,
        beta: &T,
        seq: &mut Seq<'_, T>,
    ) -> Result<DeltaRuleOut<T>> {
        seq.delta_rule(ex, [&self.q.2, &self.k.2, &self.v, g, beta])
    }

    /// The rule's backward from `dout`, its forward's `g`, `beta` and `fwd`.
    pub(super) fn rule_backward<E: Executor<Tensor = T>>(
        &self,
        ex: &E,
        g: &T,
        beta: &T,
        fwd: &DeltaRuleOut<T>,
        dout: &T,
    ) -> Result<DeltaRuleGrads<T>> {
        Ok(ex.gated_delta_rule_backward(&self.q.2, &self.k.2, &self.v, g, beta, fwd, dout)?)
    }

    /// The gradient of `mixed` from the rule's dq, dk and dv, the
    /// convolution's stored at its slots in `grads`.
    pub(super) fn backward<E: Executor<Tensor = T>>(
        &self,
        ex: &E,
        la: &LinearAttn,
        w: &[T],
        conv: Conv,
        gr: &DeltaRuleGrads<T>,
        grads: &mut [Option<T>],
    ) -> Result<T> {
        let (b, t) = (self.mixed.dims()[0], self.mixed.dims()[1]);
        let (kw, vw) = (la.key_width(), la.value_width());
        let (_, q_scale, k_scale) = l2_norm_parts(la.key_dim);
        let (q, qn, _) = &self.q;
        let (k, kn, _) = &self.k;
        let dq = ex
            .rmsnorm_backward(q, &self.unit, &qn.rstd, &ex.scale(&gr.dq, q_scale)?)?
            .dx;
        let dk = ex
            .rmsnorm_backward(k, &self.unit, &kn.rstd, &ex.scale(&gr.dk, k_scale)?)?
            .dx;
        let flat = |x: &T, n: usize| ex.reshape(x, &shape(&[b, t, n]));
        let dconv = ex.concat_last(&[&flat(&dq, kw)?, &flat(&dk, kw)?, &flat(&gr.dv, vw)?])?;
        let conv_w = conv_weight(ex, la, w, conv)?;
        let (dmixed, dconv_w) =
            ex.causal_conv1d_silu_backward(&self.mixed, &conv_w, &dconv, self.docs.as_ref())?;
        conv_grads(ex, w, conv, &dconv_w, grads)?;
        Ok(dmixed)
    }
}

/// The convolution's weight `[channels, taps]`: OLMo Hybrid's pieces
/// `[n, 1, taps]` one after another (their rows are its rows).
pub(super) fn conv_weight<E: Executor>(
    ex: &E,
    la: &LinearAttn,
    w: &[E::Tensor],
    conv: Conv,
) -> Result<E::Tensor> {
    let taps = la.conv_kernel;
    let whole = shape(&[la.conv_channels(), taps]);
    Ok(match conv {
        Conv::One(i) => ex.reshape(&w[i], &whole)?,
        Conv::Apart(parts) => {
            let flat = parts
                .iter()
                .map(|&i| ex.reshape(&w[i], &shape(&[w[i].numel()])))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            ex.reshape(&ex.concat_last(&flat.iter().collect::<Vec<_>>())?, &whole)?
        }
    })
}

/// Stores the convolution's gradient `dw: [channels, taps]` at its slots.
pub(super) fn conv_grads<E: Executor>(
    ex: &E,
    w: &[E::Tensor],
    conv: Conv,
    dw: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<()> {
    match conv {
        Conv::One(i) => grads[i] = Some(ex.reshape(dw, w[i].shape())?),
        Conv::Apart(parts) => {
            let flat = ex.reshape(dw, &shape(&[dw.numel()]))?;
            let sizes = parts.map(|i| w[i].numel());
            let pieces = ex.split_last(&flat, &sizes)?;
            for (&i, piece) in parts.iter().zip(&pieces) {
                grads[i] = Some(ex.reshape(piece, w[i].shape())?);
            }
        }
    }
    Ok(())
}

/// What a Gated DeltaNet's input products give: the mixed `[q | k | v]`
/// `[B, T, channels]` the convolution reads, `z` `[B, T, Hv, Dv]`, and the
/// logits of β and of the decays `[B·T, Hv]`.
struct Projected<T> {
    mixed: T,
    z: T,
    b: T,
    a: T,
}

fn project<E: Executor>(
    ex: &E,
    la: &LinearAttn,
    w: &[E::Tensor],
    proj: InProj,
    x: &E::Tensor,
) -> Result<Projected<E::Tensor>> {
    let (b, t) = (x.dims()[0], x.dims()[1]);
    let (hk, hv, dk, dv) = (la.key_heads, la.value_heads, la.key_dim, la.value_dim);
    let (kw, vw, r) = (la.key_width(), la.value_width(), hv / hk);
    Ok(match proj {
        InProj::Split { qkv, z, b: pb, a } => Projected {
            mixed: lin(ex, x, w, qkv)?,
            z: ex.reshape(&lin(ex, x, w, z)?, &shape(&[b, t, hv, dv]))?,
            b: ex.reshape(&lin(ex, x, w, pb)?, &shape(&[b * t, hv]))?,
            a: ex.reshape(&lin(ex, x, w, a)?, &shape(&[b * t, hv]))?,
        },
        InProj::Apart { q, k, v, z, b: pb, a } => Projected {
            mixed: ex.concat_last(&[&lin(ex, x, w, q)?, &lin(ex, x, w, k)?, &lin(ex, x, w, v)?])?,
            z: ex.reshape(&lin(ex, x, w, z)?, &shape(&[b, t, hv, dv]))?,
            b: ex.reshape(&lin(ex, x, w, pb)?, &shape(&[b * t, hv]))?,
            a: ex.reshape(&lin(ex, x, w, a)?, &shape(&[b * t, hv]))?,
        },
        InProj::Fused { qkvz, ba } => {
            // Key head by key head: q, k, then its r value heads' v and z.
            let p = ex.reshape(&lin(ex, x, w, qkvz)?, &shape(&[b, t, hk, 2 * dk + 2 * r * dv]))?;
            let p = ex.split_last(&p, &[dk, dk, r * dv, r * dv])?;
            let flat = |x: &E::Tensor, n: usize| ex.reshape(x, &shape(&[b, t, n]));
            let mixed = ex.concat_last(&[&flat(&p[0], kw)?, &flat(&p[1], kw)?, &flat(&p[2], vw)?])?;
            let g = ex.reshape(&lin(ex, x, w, ba)?, &shape(&[b * t, hk, 2 * r]))?;
            let g = ex.split_last(&g, &[r, r])?;
            Projected {
                mixed,
                z: ex.reshape(&p[3], &shape(&[b, t, hv, dv]))?,
                b: ex.reshape(&g[0], &shape(&[b * t, hv]))?,
                a: ex.reshape(&g[1], &shape(&[b * t, hv]))?,
            }
        }
    })
}

/// The input products' backward from the gradients of what [`project`]
/// gave, `[dmixed, dz, db, da]` (each `[B, T, width]`): the gradient of
/// `x`, the weights' stored at their slots in `grads`.
fn project_backward<E: Executor>(
    ex: &E,
    la: &LinearAttn,
    w: &[E::Tensor],
    proj: InProj,
    x: &E::Tensor,
    [dmixed, dz, db, da]: [&E::Tensor; 4],
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    match proj {
        InProj::Split { qkv, z, b, a } => {
            qkv_backward(ex, x, w, [(dmixed, qkv), (dz, z), (db, b), (da, a)], grads)
        }
        InProj::Apart { q, k, v, z, b, a } => {
            let (kw, vw) = (la.key_width(), la.value_width());
            let m = ex.split_last(dmixed, &[kw, kw, vw])?;
            let parts = [(&m[0], q), (&m[1], k), (&m[2], v), (dz, z), (db, b), (da, a)];
            qkv_backward(ex, x, w, parts, grads)
        }
        InProj::Fused { qkvz, ba } => {
            let (bt, t) = (x.dims()[0], x.dims()[1]);
            let (hk, hv, dk, dv) = (la.key_heads, la.value_heads, la.key_dim, la.value_dim);
            let (kw, vw, r) = (la.key_width(), la.value_width(), hv / hk);
            let heads = |x: &E::Tensor, n: usize| ex.reshape(x, &shape(&[bt, t, hk, n]));
            let m = ex.split_last(dmixed, &[kw, kw, vw])?;
            let dp = ex.concat_last(&[
                &heads(&m[0], dk)?,
                &heads(&m[1], dk)?,
                &heads(&m[2], r * dv)?,
                &heads(dz, r * dv)?,
            ])?;
            let dp = ex.reshape(&dp, &shape(&[bt, t, 2 * kw + 2 * vw]))?;
            let dg = ex.concat_last(&[&heads(db, r)?, &heads(da, r)?])?;
            let dg = ex.reshape(&dg, &shape(&[bt, t, 2 * hv]))?;
            qkv_backward(ex, x, w, [(&dp, qkvz), (&dg, ba)], grads)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn gated_attention_forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    g: &Gains<E::Tensor>,
    a: GatedAttn,
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, GatedAttnSaved<E::Tensor>)> {
    let eps = cfg.norm_eps as f32;
    let (b, t, d) = (x.dims()[0], x.dims()[1], cfg.head_dim);
    let (h, hkv) = (cfg.num_heads, cfg.num_kv_heads);
    let rope = seq.rope(cfg, layer);
    let qg = ex.reshape(&lin(ex, x, w, a.q)?, &shape(&[b, t, h, 2 * d]))?;
    let mut qg = ex.split_last(&qg, &[d, d])?;
    let gate = qg.pop().expect("split in two");
    let q = qg.pop().expect("split in two");
    let k = ex.reshape(&lin(ex, x, w, a.k)?, &shape(&[b, t, hkv, d]))?;
    let v = ex.reshape(&lin(ex, x, w, a.v)?, &shape(&[b, t, hkv, d]))?;
    let qn = ex.rmsnorm(&q, g.get(w, a.q_norm), eps)?;
    let kn = ex.rmsnorm(&k, g.get(w, a.k_norm), eps)?;
    let qr = ex.rope(&qn.y, rope.clone())?;
    let kr = ex.rope(&kn.y, rope)?;
    let att = seq.attend(ex, &qr, &kr, &v, cfg.attn_mask(layer))?;
    let gated = ex.sigmoid_mul(&gate, &att.out)?;
    let gated = ex.reshape(&gated, &shape(&[b, t, cfg.q_dim()]))?;
    let out = lin(ex, &gated, w, a.o)?;
    let saved = GatedAttnSaved {
        q: (q, qn),
        k: (k, kn),
        gate,
        qr,
        kr,
        v,
        att,
        a: gated,
    };
    Ok((out, saved))
}

/// The gated attention's backward from `dout`: the gradient of its input
/// `x`, its weights' stored at their slots in `grads`.
#[allow(clippy::too_many_arguments)]
fn gated_attention_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    g: &Gains<E::Tensor>,
    a: GatedAttn,
    x: &E::Tensor,
    s: &GatedAttnSaved<E::Tensor>,
    dout: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let (b, t, d) = (dout.dims()[0], dout.dims()[1], cfg.head_dim);
    let h = cfg.num_heads;
    let rope = cfg.rope(layer).with_docs(s.att.mask.docs.clone());
    let mut go = ex.matmul_backward(&s.a, &w[a.o.0], dout, Transpose::NT, needs(a.o.1))?;
    let da = ex.reshape(&go.da.take().expect("requested gradient"), &shape(&[b, t, h, d]))?;
    put(grads, a.o, go);
    let (dgate, datt) = ex.sigmoid_mul_backward(&s.gate, &s.att.out, &da)?;
    let ga = ex.attention_backward(&s.qr, &s.kr, &s.v, &s.att, &datt)?;
    let dq = ex.rope_backward(&ga.dq, rope.clone())?;
    let dk = ex.rope_backward(&ga.dk, rope)?;
    let gq = ex.rmsnorm_backward(&s.q.0, g.get(w, a.q_norm), &s.q.1.rstd, &dq)?;
    let gk = ex.rmsnorm_backward(&s.k.0, g.get(w, a.k_norm), &s.k.1.rstd, &dk)?;
    grads[a.q_norm] = Some(gq.dw);
    grads[a.k_norm] = Some(gk.dw);
    let dqg = ex.reshape(
        &ex.concat_last(&[&gq.dx, &dgate])?,
        &shape(&[b, t, 2 * cfg.q_dim()]),
    )?;
    let dk = ex.reshape(&gk.dx, &shape(&[b, t, cfg.kv_dim()]))?;
    let dv = ex.reshape(&ga.dv, &shape(&[b, t, cfg.kv_dim()]))?;
    qkv_backward(ex, x, w, [(&dqg, a.q), (&dk, a.k), (&dv, a.v)], grads)
}
