//! Layer math, written once against [`Executor`].
//!
//! Every function takes the layer's weights as `&[E::Tensor]` in the order of
//! the layer's [`ParamTable`](megatrain_tensor::ParamTable) (so the caller
//! decides where they live: host uploads, device weight slots, bf16
//! transport copies for matmul operands) and returns gradients as
//! `Vec<E::Tensor>` in the same order.
//!
//! - [`embedding_forward`] / [`embedding_backward`] — layer 0;
//! - [`block_forward`] → `(y, BlockSaved)`, [`block_backward`] — the decoder
//!   blocks (GPT-2's, the Llama family's, OLMo's, StarCoder2's, Phi-2's,
//!   Cohere 2's, GPT-NeoX's); drop
//!   `BlockSaved` for a checkpointed forward, keep it when recomputing;
//! - [`head_forward_backward`] — final norm, LM head and cross-entropy in
//!   chunks of rows, and its backward; [`head_logits`] and [`head_loss`] run
//!   forward only.
//!
//! A tied head reads the embedding table (passed as `tied`) and returns its
//! gradient for it separately; [`embedding_backward`] accumulates onto it.

/// The [`AttnSaved`] view of a block's saved tensors `$s` (every block's
/// saved struct names them `a`, `q`, `k`, `v` and `att`), with the slot of
/// its attention's sinks where it has them.
macro_rules! attn_saved {
    ($s:expr) => {
        attn_saved!($s, None)
    };
    ($s:expr, $sinks:expr) => {
        AttnSaved {
            a: &$s.a,
            q: &$s.q,
            k: &$s.k,
            v: &$s.v,
            att: &$s.att,
            sinks: $sinks,
        }
    };
}

mod block_cohere2;
mod block_gpt2;
mod block_kimi;
mod block_llama;
mod block_mla;
mod block_neox;
mod block_olmo2;
mod block_phi;
mod block_qwen35;
mod block_starcoder2;
mod dropout;
mod embedding;
mod head;
mod kv_cache;
mod moe;
mod next_logits;

use megatrain_tensor::{
    AttentionOut, Executor, Glu, MatmulGrads, MatmulNeeds, Shape, TensorHandle, Transpose,
};

pub use block_cohere2::Cohere2Saved;
pub use block_gpt2::Gpt2Saved;
pub use block_kimi::KimiSaved;
pub use block_llama::LlamaSaved;
pub use block_mla::MlaSaved;
pub use block_neox::NeoxSaved;
pub use block_olmo2::Olmo2Saved;
pub use block_phi::PhiSaved;
pub use block_qwen35::Qwen35Saved;
pub use block_starcoder2::Starcoder2Saved;
pub(crate) use dropout::{Branches, Site, dropout_branch, dropped};
pub use dropout::{Dropouts, Rows};
pub use embedding::{embedding_backward, embedding_forward, embedding_forward_at, embedding_grads};
pub use head::{
    HeadOut, MIN_CHUNK_ROWS, Tied, default_chunk_rows, head_forward_backward, head_logits, head_loss,
    sum_losses,
};
pub(crate) use kv_cache::Seq;
pub use kv_cache::{KvCache, LayerCache};
pub use moe::{MoeSaved, RouterAux, RouterStats, routing_digest};
pub use next_logits::next_logits;

use crate::{Arch, ModelConfig, Result, ZooError};

/// Targets equal to this are not counted in the loss (HF convention).
pub const IGNORE_INDEX: i32 = -100;

/// Activations a block's backward needs, as its forward left them.
#[derive(Debug)]
pub enum BlockSaved<T> {
    Gpt2(Box<Gpt2Saved<T>>),
    Llama(Box<LlamaSaved<T>>),
    Olmo2(Box<Olmo2Saved<T>>),
    Starcoder2(Box<Starcoder2Saved<T>>),
    Phi(Box<PhiSaved<T>>),
    Cohere2(Box<Cohere2Saved<T>>),
    Neox(Box<NeoxSaved<T>>),
    Mla(Box<MlaSaved<T>>),
    Qwen35(Box<Qwen35Saved<T>>),
    Kimi(Box<KimiSaved<T>>),
}

/// Decoder block `layer` (0-based; its attention mask and RoPE may be its
/// own: [`ModelConfig::attn_mask`], [`ModelConfig::rope`]): `x: [B, T, C]`
/// → `y: [B, T, C]`. Where the rows hold several documents each
/// ([`Rows::docs`]), these attend, count positions and run a Gated
/// DeltaNet's convolution and state each on its own
/// ([`Docs`](megatrain_tensor::Docs)); a training
/// forward's dropout ([`Rows::dropout`]) drops the attention's
/// probabilities and the residual branches' outputs. The backward follows
/// what the forward saved (its masks too).
pub fn block_forward<'a, E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    rows: impl Into<Rows<'a>>,
) -> Result<(E::Tensor, BlockSaved<E::Tensor>)> {
    check_x(cfg, x, "block_forward")?;
    check_layer(cfg, layer, "block_forward")?;
    cfg.check_seq_len(x.dims()[1])?;
    let rows = rows.into();
    forward(
        cfg,
        ex,
        layer,
        w,
        x,
        &mut Seq::Rows {
            rows,
            layer: 1 + layer,
        },
    )
}

/// [`block_forward`] of the next tokens of one sequence, `x: [1, T, C]`,
/// whose earlier positions `cache` holds: their keys and values join the
/// cache and the queries attend over all of it, or a Gated DeltaNet
/// continues from its kept state (generation; nothing is saved for a
/// backward).
pub fn block_forward_cached<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    cache: &mut KvCache<E::Tensor>,
) -> Result<E::Tensor> {
    check_x(cfg, x, "block_forward_cached")?;
    check_layer(cfg, layer, "block_forward_cached")?;
    let n = cache.layers.len();
    let kv = cache.layers.get_mut(layer).ok_or_else(|| {
        ZooError::invalid(
            "block_forward_cached",
            format!("block {layer} of a cache of {n} blocks"),
        )
    })?;
    Ok(forward(cfg, ex, layer, w, x, &mut Seq::Cached(kv))?.0)
}

fn forward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    x: &E::Tensor,
    seq: &mut Seq<'_, E::Tensor>,
) -> Result<(E::Tensor, BlockSaved<E::Tensor>)> {
    match cfg.arch {
        Arch::Gpt2 => {
            let (y, s) = block_gpt2::forward(cfg, ex, w, x, seq)?;
            Ok((y, BlockSaved::Gpt2(Box::new(s))))
        }
        // OLMo Hybrid's Gated DeltaNet blocks; its attention blocks are
        // OLMo 3's (below).
        Arch::OlmoHybrid if cfg.is_linear_block(layer) => {
            let (y, s) = block_qwen35::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Qwen35(Box::new(s))))
        }
        Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4 | Arch::OlmoHybrid => {
            let (y, s) = block_olmo2::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Olmo2(Box::new(s))))
        }
        Arch::Starcoder2 => {
            let (y, s) = block_starcoder2::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Starcoder2(Box::new(s))))
        }
        Arch::Phi => {
            let (y, s) = block_phi::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Phi(Box::new(s))))
        }
        Arch::Cohere | Arch::Cohere2 => {
            let (y, s) = block_cohere2::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Cohere2(Box::new(s))))
        }
        Arch::GptNeox => {
            let (y, s) = block_neox::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Neox(Box::new(s))))
        }
        // Kimi Linear's delta-attention blocks; its others are latent
        // attention's (below).
        Arch::KimiLinear if cfg.is_linear_block(layer) => {
            let (y, s) = block_kimi::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Kimi(Box::new(s))))
        }
        Arch::DeepseekV2 | Arch::DeepseekV3 | Arch::KimiLinear => {
            let (y, s) = block_mla::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Mla(Box::new(s))))
        }
        Arch::Qwen35 | Arch::Qwen35Moe | Arch::Qwen3Next => {
            let (y, s) = block_qwen35::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Qwen35(Box::new(s))))
        }
        _ => {
            let (y, s) = block_llama::forward(cfg, ex, layer, w, x, seq)?;
            Ok((y, BlockSaved::Llama(Box::new(s))))
        }
    }
}

impl<T> BlockSaved<T> {
    /// What a routed block's forward tells the routers' load-balancing
    /// loss ([`RouterAux`]); `None` for a dense block, and where `cfg`
    /// adds no such loss (the sums run over every token and expert, or
    /// over `tokens` where given: a batch's rows of records leave out
    /// their padding, as transformers leaves out what an attention mask
    /// masks).
    pub fn router_stats(&self, cfg: &ModelConfig, tokens: Option<&[bool]>) -> Option<RouterStats> {
        cfg.moe.as_ref()?.aux_loss_coef?;
        match self {
            BlockSaved::Llama(s) => s.router_stats(tokens),
            BlockSaved::Mla(s) => s.router_stats(tokens),
            BlockSaved::Qwen35(s) => s.router_stats(tokens),
            BlockSaved::Kimi(s) => s.router_stats(tokens),
            _ => None,
        }
    }
}

/// Backward of block `layer`: returns `dx` and the weight gradients.
/// `aux` is the routers' load-balancing loss of the forward that saved
/// `saved` ([`RouterAux::new`] over every routed block's
/// [`BlockSaved::router_stats`]): required where the model adds one
/// (`output_router_logits`), `None` otherwise.
pub fn block_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    saved: &BlockSaved<E::Tensor>,
    dy: &E::Tensor,
    aux: Option<&RouterAux>,
) -> Result<(E::Tensor, Vec<E::Tensor>)> {
    check_layer(cfg, layer, "block_backward")?;
    match saved {
        BlockSaved::Gpt2(s) if cfg.arch == Arch::Gpt2 => block_gpt2::backward(cfg, ex, w, s, dy),
        BlockSaved::Olmo2(s) if cfg.arch.has_post_norms() => block_olmo2::backward(cfg, ex, layer, w, s, dy),
        BlockSaved::Starcoder2(s) if cfg.arch == Arch::Starcoder2 => {
            block_starcoder2::backward(cfg, ex, layer, w, s, dy)
        }
        BlockSaved::Phi(s) if cfg.arch == Arch::Phi => block_phi::backward(cfg, ex, layer, w, s, dy),
        BlockSaved::Cohere2(s) if cfg.arch.is_cohere() => block_cohere2::backward(cfg, ex, layer, w, s, dy),
        BlockSaved::Neox(s) if cfg.arch == Arch::GptNeox => block_neox::backward(cfg, ex, layer, w, s, dy),
        BlockSaved::Mla(s) if cfg.arch.has_mla() => block_mla::backward(cfg, ex, layer, w, s, dy, aux),
        BlockSaved::Kimi(s) if cfg.arch == Arch::KimiLinear => {
            block_kimi::backward(cfg, ex, layer, w, s, dy, aux)
        }
        BlockSaved::Qwen35(s) if cfg.arch.has_linear_attn() => {
            block_qwen35::backward(cfg, ex, layer, w, s, dy, aux)
        }
        BlockSaved::Llama(s) if !cfg.arch.has_layernorm() && !cfg.arch.has_post_norms() => {
            block_llama::backward(cfg, ex, layer, w, s, dy, aux)
        }
        _ => Err(ZooError::invalid(
            "block_backward",
            format!("saved activations do not belong to a {:?} block", cfg.arch),
        )),
    }
}

fn check_layer(cfg: &ModelConfig, layer: usize, op: &'static str) -> Result<()> {
    if layer >= cfg.num_layers {
        return Err(ZooError::invalid(
            op,
            format!("block {layer} of a model of {} blocks", cfg.num_layers),
        ));
    }
    Ok(())
}

pub(crate) fn check_weights<T>(w: &[T], expected: usize, op: &'static str) -> Result<()> {
    if w.len() != expected {
        return Err(ZooError::invalid(
            op,
            format!("got {} weight tensors, the layer's table has {expected}", w.len()),
        ));
    }
    Ok(())
}

fn check_x<T: TensorHandle>(cfg: &ModelConfig, x: &T, op: &'static str) -> Result<()> {
    let d = x.dims();
    if d.len() != 3 || d[2] != cfg.hidden_size {
        return Err(ZooError::invalid(
            op,
            format!("x has shape {:?}, expected [B, T, {}]", d, cfg.hidden_size),
        ));
    }
    Ok(())
}

pub(crate) fn shape(d: &[usize]) -> Shape {
    Shape::from(d)
}

/// `x @ w(ᵀ) + b` with an optional bias.
pub(crate) fn linear<E: Executor>(
    ex: &E,
    x: &E::Tensor,
    w: &E::Tensor,
    b: Option<&E::Tensor>,
    t: Transpose,
) -> Result<E::Tensor> {
    Ok(ex.matmul(x, w, b, t)?)
}

/// A linear layer of a block's table: weight `wi`, optional bias `bi`.
pub(crate) type Linear = (usize, Option<usize>);

/// `x @ wᵀ + b` of the `nn.Linear` at `(wi, bi)` of a block's weights.
fn lin<E: Executor>(ex: &E, x: &E::Tensor, w: &[E::Tensor], (wi, bi): Linear) -> Result<E::Tensor> {
    linear(ex, x, &w[wi], bi.map(|i| &w[i]), Transpose::NT)
}

/// The input gradient of the q, k and v projections that read `x` (k's and
/// v's added into q's by the products themselves), their weight and bias
/// gradients stored at their table slots.
fn qkv_backward<E: Executor, const N: usize>(
    ex: &E,
    x: &E::Tensor,
    w: &[E::Tensor],
    parts: [(&E::Tensor, Linear); N],
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let mut dx: Option<E::Tensor> = None;
    for (d, lw) in parts {
        let g = match &mut dx {
            Some(acc) => ex.matmul_backward_da_into(x, &w[lw.0], d, Transpose::NT, needs(lw.1), acc)?,
            None => {
                let mut g = ex.matmul_backward(x, &w[lw.0], d, Transpose::NT, needs(lw.1))?;
                dx = g.da.take();
                g
            }
        };
        put(grads, lw, g);
    }
    Ok(dx.expect("the first part's input gradient, requested"))
}

/// The saved tensors of a block's attention: its input `a` of the output
/// projection ([B, T, q_dim]), q, k, v as the kernel read them, and its
/// forward's output (a sink attention's: `attention_sinks` of it); the
/// table slot of its sinks.
pub(crate) struct AttnSaved<'s, T> {
    pub a: &'s T,
    pub q: &'s T,
    pub k: &'s T,
    pub v: &'s T,
    pub att: &'s AttentionOut<T>,
    pub sinks: Option<usize>,
}

/// The attention's backward from `dout`, the gradient of its output
/// projection `o`'s output: the projection's weight (and bias) gradients
/// stored at their table slots, then dq, dk, dv as [B, T, heads, D], with
/// RoPE undone on dq and dk where block `layer` has it.
#[allow(clippy::too_many_arguments)]
fn attention_backward_from_output<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    layer: usize,
    w: &[E::Tensor],
    o: Linear,
    s: AttnSaved<'_, E::Tensor>,
    dout: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<(E::Tensor, E::Tensor, E::Tensor)> {
    let (b, t) = (dout.dims()[0], dout.dims()[1]);
    let mut go = ex.matmul_backward(s.a, &w[o.0], dout, Transpose::NT, needs(o.1))?;
    let da = go.da.take().expect("requested gradient");
    let da = ex.reshape(&da, &shape(&[b, t, cfg.num_heads, cfg.head_dim]))?;
    put(grads, o, go);
    let da = match s.sinks {
        Some(i) => {
            let (da, dsinks) = ex.attention_sinks_backward(&s.att.out, &s.att.lse, &w[i], &da)?;
            grads[i] = Some(dsinks);
            da
        }
        None => da,
    };
    let ga = ex.attention_backward(s.q, s.k, s.v, s.att, &da)?;
    let (dq, dk) = match cfg.has_rope(layer) {
        true => (
            ex.rope_backward(&ga.dq, cfg.rope(layer).with_docs(s.att.mask.docs.clone()))?,
            ex.rope_backward(&ga.dk, cfg.rope(layer).with_docs(s.att.mask.docs.clone()))?,
        ),
        false => (ga.dq, ga.dk),
    };
    Ok((dq, dk, ga.dv))
}

/// The backward of a GELU MLP, `out(gelu(f))` with `f = inp(x)` (`g` the
/// saved GELU output), from `dy`: its weight and bias gradients stored at
/// their table slots, the gradient of `x` returned.
#[allow(clippy::too_many_arguments)]
fn gelu_mlp_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    (inp, out): (Linear, Linear),
    x: &E::Tensor,
    (f, g): (&E::Tensor, &E::Tensor),
    dy: &E::Tensor,
    grads: &mut [Option<E::Tensor>],
) -> Result<E::Tensor> {
    let mut gm = matmul_backward_gelu(cfg, ex, g, &w[out.0], dy, Transpose::NT, needs(out.1), f)?;
    let df = gm.da.take().expect("requested gradient");
    put(grads, out, gm);
    let mut gi = ex.matmul_backward(x, &w[inp.0], &df, Transpose::NT, needs(inp.1))?;
    let dx = gi.da.take().expect("requested gradient");
    put(grads, inp, gi);
    Ok(dx)
}

/// Stores a linear layer's weight and bias gradients at their table slots.
fn put<T>(grads: &mut [Option<T>], (wi, bi): Linear, g: MatmulGrads<T>) {
    grads[wi] = g.db;
    if let Some(bi) = bi {
        grads[bi] = g.dbias;
    }
}

/// `(f, gelu(f))` of `f = x @ w(ᵀ) + b`: the tanh GELU applied where the
/// product is stored, or the exact (erf) one after it where the config's
/// activation is that (`exact_gelu`: GPT-NeoX's and GPT-2's `gelu`).
fn matmul_gelu<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    x: &E::Tensor,
    w: &E::Tensor,
    b: Option<&E::Tensor>,
    t: Transpose,
) -> Result<(E::Tensor, E::Tensor)> {
    if cfg.exact_gelu {
        let f = ex.matmul(x, w, b, t)?;
        let g = ex.gelu_erf(&f)?;
        return Ok((f, g));
    }
    Ok(ex.matmul_gelu(x, w, b, t)?)
}

/// The backward of `gelu(f) @ w(ᵀ)` given `g = gelu(f)` and `f`, its input
/// gradient carried on through the GELU to `f` (as [`matmul_gelu`] chose it).
#[allow(clippy::too_many_arguments)]
fn matmul_backward_gelu<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    g: &E::Tensor,
    w: &E::Tensor,
    dy: &E::Tensor,
    t: Transpose,
    needs: MatmulNeeds,
    f: &E::Tensor,
) -> Result<MatmulGrads<E::Tensor>> {
    if cfg.exact_gelu {
        let mut gm = ex.matmul_backward(g, w, dy, t, needs)?;
        gm.da = gm.da.map(|dg| ex.gelu_erf_backward(f, &dg)).transpose()?;
        return Ok(gm);
    }
    Ok(ex.matmul_backward_gelu(g, w, dy, t, needs, f)?)
}

/// The gradients a linear layer's backward produces: the input's, the
/// weight's, and the bias's where it has one.
fn needs(bias: Option<usize>) -> MatmulNeeds {
    MatmulNeeds {
        da: true,
        db: true,
        dbias: bias.is_some(),
    }
}

/// The RMSNorm gains of a block whose family stores them offset (Gemma's
/// `1 + w`), computed from their weights; read through [`Gains::get`],
/// which gives the weight itself where there is no offset. The gradient
/// of a gain is its weight's.
pub(crate) struct Gains<T>(Vec<Option<T>>);

impl<T> Gains<T> {
    /// The gains of the norms at table slots `norms`.
    pub(crate) fn new<E: Executor<Tensor = T>>(
        cfg: &ModelConfig,
        ex: &E,
        w: &[T],
        norms: &[usize],
    ) -> Result<Self> {
        let mut g: Vec<Option<T>> = (0..w.len()).map(|_| None).collect();
        if let Some(c) = cfg.arch.norm_gain_offset() {
            for &i in norms {
                g[i] = Some(ex.add_scalar(&w[i], c)?);
            }
        }
        Ok(Gains(g))
    }

    pub(crate) fn get<'a>(&'a self, w: &'a [T], i: usize) -> &'a T {
        self.0[i].as_ref().unwrap_or(&w[i])
    }
}

/// `up = a @ upᵀ + bias` and the family's GLU of it with `gate`
/// ([`Arch::glu`]): `(up, s)`.
fn matmul_glu<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    a: &E::Tensor,
    up: &E::Tensor,
    bias: Option<&E::Tensor>,
    gate: &E::Tensor,
) -> Result<(E::Tensor, E::Tensor)> {
    Ok(match cfg.arch.glu() {
        Glu::Silu => ex.matmul_swiglu(a, up, bias, Transpose::NT, gate)?,
        Glu::Gelu => ex.matmul_geglu(a, up, bias, Transpose::NT, gate)?,
    })
}

/// A GLU MLP's gate, up and down projections, at their table slots.
pub(crate) type GluLinears = [Linear; 3];

/// What a GLU MLP's forward leaves for its backward: `gate(x)`, `up(x)`
/// and the activation of their product.
#[derive(Debug)]
pub(crate) struct GluSaved<T> {
    gate: T,
    up: T,
    s: T,
}

/// `down(act(gate(x)) · up(x))` with the family's GLU: the output and
/// what its backward needs. The dense Llama-family MLP, each expert of a
/// routed one and Qwen2-MoE's shared expert.
fn glu_mlp<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    x: &E::Tensor,
    w: &[E::Tensor],
    [gate, up, down]: GluLinears,
) -> Result<(E::Tensor, GluSaved<E::Tensor>)> {
    let g = lin(ex, x, w, gate)?;
    // The up projection with the activation applied where it is stored.
    let (u, s) = matmul_glu(cfg, ex, x, &w[up.0], up.1.map(|i| &w[i]), &g)?;
    let y = lin(ex, &s, w, down)?;
    Ok((y, GluSaved { gate: g, up: u, s }))
}

/// The backward of [`glu_mlp`] from `dy`: its weight (and bias) gradients
/// stored at their table slots; the gradient of `x` added into `into`
/// where one is given (then `None`), else returned.
#[allow(clippy::too_many_arguments)]
fn glu_mlp_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    x: &E::Tensor,
    w: &[E::Tensor],
    [gate, up, down]: GluLinears,
    s: &GluSaved<E::Tensor>,
    dy: &E::Tensor,
    into: Option<&mut E::Tensor>,
    grads: &mut [Option<E::Tensor>],
) -> Result<Option<E::Tensor>> {
    let t = Transpose::NT;
    let (gd, dgate, dup) = matmul_backward_glu(cfg, ex, &s.s, &w[down.0], dy, down.1, &s.gate, &s.up)?;
    put(grads, down, gd);
    let (gg, gu, dx) = match into {
        Some(acc) => {
            let gg = ex.matmul_backward_da_into(x, &w[gate.0], &dgate, t, needs(gate.1), acc)?;
            let gu = ex.matmul_backward_da_into(x, &w[up.0], &dup, t, needs(up.1), acc)?;
            (gg, gu, None)
        }
        None => {
            let mut gg = ex.matmul_backward(x, &w[gate.0], &dgate, t, needs(gate.1))?;
            let mut dx = gg.da.take().expect("requested gradient");
            // up's input gradient added into gate's by the product itself.
            let gu = ex.matmul_backward_da_into(x, &w[up.0], &dup, t, needs(up.1), &mut dx)?;
            (gg, gu, Some(dx))
        }
    };
    put(grads, gate, gg);
    put(grads, up, gu);
    Ok(dx)
}

/// The down projection's backward carried on through the family's GLU:
/// its gradients, dgate and dup.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn matmul_backward_glu<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    s: &E::Tensor,
    down: &E::Tensor,
    dout: &E::Tensor,
    bias: Option<usize>,
    gate: &E::Tensor,
    up: &E::Tensor,
) -> Result<(MatmulGrads<E::Tensor>, E::Tensor, E::Tensor)> {
    let (t, n) = (Transpose::NT, needs(bias));
    Ok(match cfg.arch.glu() {
        Glu::Silu => ex.matmul_backward_swiglu(s, down, dout, t, n, gate, up)?,
        Glu::Gelu => ex.matmul_backward_geglu(s, down, dout, t, n, gate, up)?,
    })
}
