//! The ops' arguments and results beside the [`Executor`](crate::Executor)
//! trait: which operands a matmul reads transposed, which gradients a
//! backward must produce, and what each forward and backward returns.

use crate::{DType, Docs, Dropout, Error, Result, RopeScaling, Shape};

/// Which matmul operands are read transposed. `a` is `[.., M, K]`, or
/// `[.., K, M]` when `a` is set; `b` is `[K, N]`, or `[N, K]` when `b` is set
/// (the `nn.Linear` weight layout `[out, in]` is `b` transposed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Transpose {
    pub a: bool,
    pub b: bool,
}

impl Transpose {
    pub const NN: Transpose = Transpose { a: false, b: false };
    pub const NT: Transpose = Transpose { a: false, b: true };
    pub const TN: Transpose = Transpose { a: true, b: false };
    pub const TT: Transpose = Transpose { a: true, b: true };
}

/// The activation that gates a GLU MLP's up projection: `act(gate) · up`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU (Llama's): silu(gate) · up.
    Silu,
    /// GeGLU (Gemma's): gelu(gate) · up, GELU's tanh approximation.
    Gelu,
}

impl Glu {
    /// The name of the fused forward op ([`Executor::matmul_swiglu`](crate::Executor::matmul_swiglu) or [`Executor::matmul_geglu`](crate::Executor::matmul_geglu)).
    pub fn matmul_op(self) -> &'static str {
        match self {
            Glu::Silu => "matmul_swiglu",
            Glu::Gelu => "matmul_geglu",
        }
    }

    /// The name of the fused backward op.
    pub fn matmul_backward_op(self) -> &'static str {
        match self {
            Glu::Silu => "matmul_backward_swiglu",
            Glu::Gelu => "matmul_backward_geglu",
        }
    }
}

/// GPT-OSS's clamped SwiGLU's constants (`swiglu_alpha`, `swiglu_limit`):
/// `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
/// `y = g · σ(alpha · g) · (u + 1)`. Kept as f64, as the configs give
/// them, so that the f64 reference computes with 1.702 and not its f32
/// rounding; f32 executors round them once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClampedGlu {
    pub alpha: f64,
    pub limit: f64,
}

impl ClampedGlu {
    /// Refuses an `alpha` or `limit` that is not positive and finite,
    /// naming `op`.
    pub fn new(alpha: f64, limit: f64, op: &'static str) -> Result<ClampedGlu> {
        let c = ClampedGlu { alpha, limit };
        c.check(op)?;
        Ok(c)
    }

    /// [`ClampedGlu::new`]'s check, for constants built field by field
    /// (every executor checks them with this).
    pub fn check(self, op: &'static str) -> Result<()> {
        let ok = |x: f64| x.is_finite() && x > 0.0;
        if ok(self.alpha) && ok(self.limit) {
            Ok(())
        } else {
            Err(Error::invalid(
                op,
                format!(
                    "a clamped SwiGLU's alpha and limit must be positive and finite, not {} and {}",
                    self.alpha, self.limit
                ),
            ))
        }
    }
}

/// `[.., F]`, the output shape of a clamped SwiGLU of `gate_up: [.., 2F]`
/// (gate and up interleaved), or an error naming `op` where the last
/// dimension is odd (every executor checks with this).
pub fn clamped_glu_out(op: &'static str, gate_up: &Shape) -> Result<Shape> {
    let dims = gate_up.dims();
    match dims.last() {
        Some(&w) if w % 2 == 0 => {
            let mut d = dims.to_vec();
            *d.last_mut().expect("not empty") = w / 2;
            Ok(Shape::new(d))
        }
        _ => Err(Error::shape(
            op,
            format!("gate_up {gate_up} must have an even last dimension: its gate and up interleaved"),
        )),
    }
}

/// Which gradients a matmul backward must produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatmulNeeds {
    pub da: bool,
    pub db: bool,
    pub dbias: bool,
}

impl MatmulNeeds {
    pub const ALL: MatmulNeeds = MatmulNeeds {
        da: true,
        db: true,
        dbias: true,
    };
}

/// What [`Executor::matmul_backward_into`](crate::Executor::matmul_backward_into) needs of its accumulator: f32,
/// of `b`'s shape (every executor checks it with this).
pub fn check_db_acc(acc_shape: &Shape, acc_dtype: DType, b_shape: &Shape) -> Result<()> {
    const OP: &str = "matmul_backward_into";
    if acc_dtype != DType::F32 {
        return Err(Error::DType {
            op: OP,
            expected: DType::F32,
            got: acc_dtype,
        });
    }
    if acc_shape != b_shape {
        return Err(Error::shape(
            OP,
            format!("db_acc {acc_shape} must have b's shape {b_shape}"),
        ));
    }
    Ok(())
}

/// What a cross-entropy's gradient is of beyond −log p(target): each term
/// is off at 0, where the plain loss's bits are unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossTerms {
    /// z ≥ 0 adds z·lse² per counted row (PaLM's auxiliary loss, which
    /// keeps the softmax's normaliser near 1).
    pub z_loss: f32,
    /// ε in [0, 1] trains against (1 − ε)·onehot + ε/V instead of the
    /// one-hot target, as `torch.nn.functional.cross_entropy(...,
    /// label_smoothing=ε)` and transformers' `label_smoothing_factor` do.
    pub label_smoothing: f32,
}

impl LossTerms {
    /// The plain cross-entropy.
    pub const NONE: LossTerms = LossTerms {
        z_loss: 0.0,
        label_smoothing: 0.0,
    };

    /// A z-loss alone.
    pub fn z(z_loss: f32) -> Self {
        LossTerms { z_loss, ..Self::NONE }
    }

    /// Label smoothing alone.
    pub fn smoothing(label_smoothing: f32) -> Self {
        LossTerms {
            label_smoothing,
            ..Self::NONE
        }
    }

    /// z finite and ≥ 0, ε in [0, 1]; an error naming the value otherwise.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(crate::Error::invalid("cross_entropy", what));
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return bad(format!("z_loss {} must be finite and >= 0", self.z_loss));
        }
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return bad(format!(
                "label_smoothing {} must be in [0, 1]",
                self.label_smoothing
            ));
        }
        Ok(())
    }
}

/// What [`Executor::matmul_backward_da_into`](crate::Executor::matmul_backward_da_into) needs of its accumulator:
/// f32, of `a`'s shape (every executor checks it with this).
pub fn check_da_acc(acc_shape: &Shape, acc_dtype: DType, a_shape: &Shape) -> Result<()> {
    const OP: &str = "matmul_backward_da_into";
    if acc_dtype != DType::F32 {
        return Err(Error::DType {
            op: OP,
            expected: DType::F32,
            got: acc_dtype,
        });
    }
    if acc_shape != a_shape {
        return Err(Error::shape(
            OP,
            format!("da_acc {acc_shape} must have a's shape {a_shape}"),
        ));
    }
    Ok(())
}

#[derive(Debug)]
pub struct MatmulGrads<T> {
    pub da: Option<T>,
    /// Same shape as `b`; summed over the batch when `b` was broadcast.
    pub db: Option<T>,
    /// `[N]`, summed over every row of the output.
    pub dbias: Option<T>,
}

/// Output of a norm forward: the normalised tensor and the per-row statistics
/// the backward needs (`mean` is `None` for RMSNorm).
#[derive(Debug)]
pub struct NormOut<T> {
    pub y: T,
    /// `[rows]`; `None` for RMSNorm.
    pub mean: Option<T>,
    /// `[rows]`: 1 / sqrt(var + eps) (or mean square + eps for RMSNorm).
    pub rstd: T,
}

/// Output of a residual add fused with the norm that follows it
/// ([`Executor::add_rmsnorm`](crate::Executor::add_rmsnorm), [`Executor::add_layernorm`](crate::Executor::add_layernorm)).
#[derive(Debug)]
pub struct AddNormOut<T> {
    /// The residual stream `x + r`, which flows on past the norm.
    pub h: T,
    /// The norm of `h`, with the statistics its backward needs.
    pub norm: NormOut<T>,
}

#[derive(Debug)]
pub struct NormGrads<T> {
    pub dx: T,
    pub dw: T,
    /// `None` for RMSNorm.
    pub db: Option<T>,
}

/// Which keys each query row attends to, and how its scores are shaped
/// before the softmax. Every mask is causal; with a sliding window
/// (Mistral's, Phi-3's) query `i` sees only the `window` keys
/// `i + 1 − window ..= i`, as transformers' `sliding_window_overlay` does
/// (`kv_idx > q_idx − sliding_window`). With a soft cap (Gemma 2's
/// `attn_logit_softcapping`) each scaled score `s` becomes
/// `cap · tanh(s / cap)` before the mask and the softmax. With documents
/// packed in the rows ([`Docs`]) a query sees only its own document's keys
/// as well: its keys are still one contiguous span, ending at itself.
#[derive(Debug, Clone, PartialEq, Eq, Default, Hash)]
pub struct AttnMask {
    /// Keys a query sees, itself included; `None`: every key up to it.
    pub window: Option<usize>,
    /// `None`: the scores as they are.
    pub softcap: Option<SoftCap>,
    /// `None`: each row is one sequence.
    pub docs: Option<Docs>,
    /// Dropout of the probabilities (after the softmax, before they weight
    /// the values; the softmax's sum and the saved log-sum-exp are of the
    /// kept and dropped alike, as `torch`'s dropout of the weights has
    /// it): key `j` of query `i` of head `h` of batch row `b` is column
    /// `j` of mask row [`Dropout::row`]`(b, Hq·T, h·T + i)`. `None`: none
    /// (evaluation, generation).
    pub dropout: Option<Dropout>,
}

/// A soft cap `cap > 0` (finite): `x ↦ cap · tanh(x / cap)`, which bounds
/// `x` to (−cap, cap) and is the identity near 0. Its derivative,
/// `1 − tanh²`, is `1 − (y / cap)²` of the capped `y`, so a backward needs
/// only what the forward stored.
#[derive(Debug, Clone, Copy)]
pub struct SoftCap(f32);

impl SoftCap {
    /// Refuses a cap that is not positive and finite, naming `op`.
    pub fn new(cap: f32, op: &'static str) -> Result<SoftCap> {
        if cap.is_finite() && cap > 0.0 {
            Ok(SoftCap(cap))
        } else {
            Err(Error::invalid(
                op,
                format!("a soft cap must be positive and finite, not {cap}"),
            ))
        }
    }

    pub fn get(self) -> f32 {
        self.0
    }
}

// By bits, so that the cap can key pipelines and caches (a cap is never NaN).
impl PartialEq for SoftCap {
    fn eq(&self, other: &SoftCap) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for SoftCap {}

impl std::hash::Hash for SoftCap {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

impl AttnMask {
    /// Every key up to the query's own.
    pub const CAUSAL: AttnMask = AttnMask {
        window: None,
        softcap: None,
        docs: None,
        dropout: None,
    };

    pub fn sliding(window: usize) -> AttnMask {
        AttnMask {
            window: Some(window),
            ..AttnMask::CAUSAL
        }
    }

    /// The same mask within the documents of `docs` (`None`: within rows).
    pub fn with_docs(self, docs: Option<Docs>) -> AttnMask {
        AttnMask { docs, ..self }
    }

    /// The same mask with its probabilities dropped by `dropout`.
    pub fn with_dropout(self, dropout: Option<Dropout>) -> AttnMask {
        AttnMask { dropout, ..self }
    }

    /// The same mask with its scores soft-capped at `cap`.
    pub fn with_softcap(self, cap: SoftCap) -> AttnMask {
        AttnMask {
            softcap: Some(cap),
            ..self
        }
    }

    /// A window of 0 keys would leave a row nothing to attend to; documents
    /// must be those of the `[b, t]` batch attended.
    pub fn check(&self, op: &'static str, b: usize, t: usize) -> Result<()> {
        if self.window == Some(0) {
            return Err(Error::invalid(op, "a sliding window of 0 keys"));
        }
        match &self.docs {
            Some(d) => d.check(op, b, t),
            None => Ok(()),
        }
    }

    /// The first key query `i` of row `b` sees.
    pub fn first_key(&self, b: usize, i: usize) -> usize {
        let w = match self.window {
            Some(w) => (i + 1).saturating_sub(w),
            None => 0,
        };
        self.docs.as_ref().map_or(w, |d| w.max(d.start(b, i)))
    }

    /// The window as the GPU kernels take it for a sequence of `t`: 0 where
    /// it hides nothing (none, or at least `t` keys), so that `j + window`
    /// never passes `2t` there.
    pub fn kernel_window(&self, t: usize) -> u32 {
        match self.window {
            Some(w) if w < t => w as u32,
            _ => 0,
        }
    }
}

#[derive(Debug)]
pub struct AttentionOut<T> {
    /// `[B, T, Hq, D]`.
    pub out: T,
    /// `[B, Hq, T]`: log-sum-exp of each query row's scaled scores.
    pub lse: T,
    /// The mask the forward ran under, which its backward follows.
    pub mask: AttnMask,
}

/// `[B, T, Hq, D]` of an attention output `out` whose `lse` is
/// `[B, Hq, T]` and whose `sinks` are `[Hq]` (and `dout`, where given, of
/// `out`'s shape), or an error naming `op` and the shapes: what
/// [`Executor::attention_sinks`](crate::Executor::attention_sinks) and its
/// backward take (every executor checks them with this).
pub fn attention_sinks_dims(
    op: &'static str,
    out: &Shape,
    lse: &Shape,
    sinks: &Shape,
    dout: Option<&Shape>,
) -> Result<[usize; 4]> {
    let dims = <[usize; 4]>::try_from(out.dims())
        .map_err(|_| Error::shape(op, format!("out {out} must be [B, T, Hq, D]")))?;
    let [b, t, hq, _] = dims;
    if lse.dims() != [b, hq, t] {
        return Err(Error::shape(
            op,
            format!("lse {lse} must be [{b}, {hq}, {t}] for out {out}"),
        ));
    }
    if sinks.dims() != [hq] {
        return Err(Error::shape(
            op,
            format!("sinks {sinks} must be [{hq}], one per query head of out {out}"),
        ));
    }
    if let Some(d) = dout.filter(|&d| d != out) {
        return Err(Error::shape(op, format!("dout {d} must have out's shape {out}")));
    }
    Ok(dims)
}

/// The dimensions of a cached attention
/// ([`Executor::attention_cached`](crate::Executor::attention_cached)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedAttnDims {
    pub b: usize,
    /// New queries, the last `tq` of `len` positions.
    pub tq: usize,
    /// The cache's positions, of which the first `len` are read.
    pub tc: usize,
    pub len: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
}

/// The dimensions of q `[B, Tq, Hq, D]` over a cache k, v `[B, Tc, Hkv, D]`
/// of `len` positions under `mask`, or an error naming `op` and what is
/// wrong (every executor checks with this).
pub fn attention_cached_dims(
    op: &'static str,
    q: &Shape,
    k: &Shape,
    v: &Shape,
    len: usize,
    mask: &AttnMask,
) -> Result<CachedAttnDims> {
    let err = |why: String| Error::shape(op, format!("q {q} k {k} v {v}: {why}"));
    let ([b, tq, hq, d], [kb, tc, hkv, kd]) = (
        <[usize; 4]>::try_from(q.dims()).map_err(|_| err("q must be [B, Tq, Hq, D]".into()))?,
        <[usize; 4]>::try_from(k.dims()).map_err(|_| err("k must be [B, Tc, Hkv, D]".into()))?,
    );
    if k != v {
        return Err(err("k and v shapes differ".into()));
    }
    if (kb, kd) != (b, d) {
        return Err(err("B and D of q and k/v differ".into()));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(err("Hq must be a multiple of Hkv".into()));
    }
    if tq == 0 || tq > len || len > tc {
        return Err(err(format!(
            "{tq} new queries of {len} cached positions need 1 ≤ Tq ≤ len ≤ Tc"
        )));
    }
    if mask.docs.is_some() {
        return Err(Error::invalid(
            op,
            "a cache holds one sequence a row: documents cannot be packed in it",
        ));
    }
    if mask.dropout.is_some() {
        return Err(Error::invalid(
            op,
            "generation drops nothing: a cached attention takes no dropout",
        ));
    }
    Ok(CachedAttnDims {
        b,
        tq,
        tc,
        len,
        hq,
        hkv,
        d,
    })
}

/// `[B, T, C, K]` of a depthwise causal convolution's `x: [B, T, C]` and
/// `w: [C, K]` (and `dy`, `x`'s shape, for the backward), `docs` those of
/// a `[B, T]` batch, or an error naming `op` (every executor checks with
/// this). K = 0 is refused: a convolution of no taps has no meaning a
/// checkpoint could hold, and would make every output silu(0) without
/// reading `x`.
pub fn causal_conv1d_dims(
    op: &'static str,
    x: &Shape,
    w: &Shape,
    dy: Option<&Shape>,
    docs: Option<&Docs>,
) -> Result<[usize; 4]> {
    let [b, t, c] =
        <[usize; 3]>::try_from(x.dims()).map_err(|_| Error::shape(op, format!("x {x} must be [B, T, C]")))?;
    let k = match *w.dims() {
        [wc, k] if wc == c && k > 0 => k,
        _ => {
            return Err(Error::shape(
                op,
                format!("w {w} must be [{c}, K] with K ≥ 1, one row of taps per channel of x {x}"),
            ));
        }
    };
    if let Some(d) = dy.filter(|&d| d != x) {
        return Err(Error::shape(op, format!("dy {d} must have x's shape {x}")));
    }
    if let Some(docs) = docs {
        docs.check(op, b, t)?;
    }
    Ok([b, t, c, k])
}

/// `[N, H, Dk]` of the gated delta rule's gate inputs, their leading
/// dimensions flattened into the N rows as the row-wise ops read them:
/// decays per head, `a` and `b` alike `[.., H]` (Dk = 1), or per key
/// channel (Kimi Linear's), `a` `[.., H, Dk]` and `b` `[.., H]`, the rates
/// staying one a head. `a_log` and `dt_bias` are `[H·Dk]`, one per element
/// of a row of `a`; the backward's `dg` has `a`'s shape and `dbeta` `b`'s.
/// Or an error naming `op` (every executor checks with this).
pub fn delta_gates_dims(
    op: &'static str,
    a: &Shape,
    b: &Shape,
    a_log: &Shape,
    dt_bias: &Shape,
    grads: Option<(&Shape, &Shape)>,
) -> Result<[usize; 3]> {
    let per_head = b == a;
    let last = |s: &Shape| s.dims().last().copied().filter(|&n| n > 0);
    let Some(a_last) = last(a) else {
        let want = if per_head {
            "[N, H] with H"
        } else {
            "[N, H, Dk] with Dk"
        };
        return Err(Error::shape(op, format!("a {a} must be {want} ≥ 1")));
    };
    let (h, dk) = if per_head {
        (a_last, 1)
    } else if a.dims()[..a.dims().len() - 1] == *b.dims() {
        match last(b) {
            Some(h) => (h, a_last),
            None => return Err(Error::shape(op, format!("b {b} must be [N, H] with H ≥ 1"))),
        }
    } else {
        return Err(Error::shape(
            op,
            format!(
                "b {b} must have a's shape {a}, or a's without its last dimension (one rate per head of \
                 per-channel decays)"
            ),
        ));
    };
    let (c, each) = if per_head {
        (h, "head")
    } else {
        (h * dk, "channel")
    };
    for (name, p) in [("a_log", a_log), ("dt_bias", dt_bias)] {
        if p.dims() != [c] {
            return Err(Error::shape(
                op,
                format!("{name} {p} must be [{c}], one per {each} of a {a}"),
            ));
        }
    }
    if let Some((dg, dbeta)) = grads {
        for (name, d, want, whose) in [("dg", dg, a, "a"), ("dbeta", dbeta, b, "b")] {
            if d != want {
                return Err(Error::shape(
                    op,
                    format!("{name} {d} must have {whose}'s shape {want}"),
                ));
            }
        }
    }
    Ok([b.numel() / h, h, dk])
}

/// Checks that `sigmoid_mul`'s `gate`, `x` (and the backward's `dy`) have
/// one shape, naming `op` (every executor checks with this).
pub fn sigmoid_mul_check(op: &'static str, gate: &Shape, x: &Shape, dy: Option<&Shape>) -> Result<()> {
    if x != gate {
        return Err(Error::shape(op, format!("x {x} must have gate's shape {gate}")));
    }
    if let Some(d) = dy.filter(|&d| d != gate) {
        return Err(Error::shape(op, format!("dy {d} must have gate's shape {gate}")));
    }
    Ok(())
}

#[derive(Debug)]
pub struct AttentionGrads<T> {
    pub dq: T,
    pub dk: T,
    pub dv: T,
}

/// Steps between the gated delta rule's checkpointed states: the forward
/// keeps the state at the start of every chunk of this many steps, and the
/// backward replays one chunk at a time from it. Inverting the recurrence
/// instead is unstable (`1 − β‖k‖²` may be ~0, `exp(g)` tiny). Every
/// executor uses this one length, so that `saved` has one shape.
pub const DELTA_RULE_CHUNK: usize = 64;

/// What the gated delta rule's forward returns: the output and what its
/// backward needs.
#[derive(Debug, Clone)]
pub struct DeltaRuleOut<T> {
    /// `[B, T, Hv, Dv]`.
    pub out: T,
    /// Opaque to callers: the state of every (batch, value head) at the start
    /// of each chunk of [`DELTA_RULE_CHUNK`] steps, `[B, Hv, ⌈T/C⌉, Dk, Dv]`
    /// (f32, the first chunk's the zero state): `4·B·Hv·⌈T/C⌉·Dk·Dv` bytes,
    /// `Dk/C` times the size of `out` at long T.
    pub saved: T,
    /// The documents the forward ran under, which its backward follows.
    pub docs: Option<Docs>,
}

/// Gradients of the gated delta rule's five inputs, each of its input's shape.
#[derive(Debug, Clone)]
pub struct DeltaRuleGrads<T> {
    pub dq: T,
    pub dk: T,
    pub dv: T,
    pub dg: T,
    pub dbeta: T,
}

/// The sizes of a gated delta rule, from its operands' shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaRuleDims {
    pub b: usize,
    pub t: usize,
    /// Key (and query) heads.
    pub hk: usize,
    /// Value heads, a multiple of `hk`.
    pub hv: usize,
    pub dk: usize,
    pub dv: usize,
    /// g is `[B, T, Hv, Dk]`, a decay per key channel (Kimi Linear's KDA),
    /// not `[B, T, Hv]`, one per head and step (Qwen3-Next's).
    pub channel_decay: bool,
}

impl DeltaRuleDims {
    /// Decays a step of each value head: Dk where they are per channel,
    /// else 1.
    pub fn decays(self) -> usize {
        if self.channel_decay { self.dk } else { 1 }
    }

    /// Value heads per key head: value head `h` reads key head `h / group`.
    pub fn group(self) -> usize {
        self.hv / self.hk
    }

    /// Chunks of [`DELTA_RULE_CHUNK`] steps in a sequence.
    pub fn chunks(self) -> usize {
        self.t.div_ceil(DELTA_RULE_CHUNK)
    }

    /// The shape of [`DeltaRuleOut::saved`].
    pub fn saved_shape(self) -> Shape {
        Shape::new([self.b, self.hv, self.chunks(), self.dk, self.dv])
    }
}

/// The shapes of [`Executor::gated_delta_rule_cached`](crate::Executor::gated_delta_rule_cached):
/// the operands' as the forward's, and the state `[B, Hv, Dk, Dv]`.
pub fn delta_rule_cached_dims(op: &'static str, x: [&Shape; 5], state: &Shape) -> Result<DeltaRuleDims> {
    let d = delta_rule_dims(op, x, None)?;
    if state.dims() != [d.b, d.hv, d.dk, d.dv] {
        return Err(Error::shape(
            op,
            format!("state {state} must be [{}, {}, {}, {}]", d.b, d.hv, d.dk, d.dv),
        ));
    }
    Ok(d)
}

/// The shapes of the gated delta rule's forward and, given
/// `(out, saved, dout)`, backward, or an error naming `op` and the shapes:
/// every executor checks [`Executor::gated_delta_rule`](crate::Executor::gated_delta_rule)
/// and its backward with this.
pub fn delta_rule_dims(
    op: &'static str,
    [q, k, v, g, beta]: [&Shape; 5],
    bwd: Option<[&Shape; 3]>,
) -> Result<DeltaRuleDims> {
    let all = || format!("q {q} k {k} v {v} g {g} beta {beta}");
    let four = |s: &Shape, what: &str| {
        <[usize; 4]>::try_from(s.dims()).map_err(|_| Error::shape(op, format!("{}: {what}", all())))
    };
    let [b, t, hk, dk] = four(q, "q must be [B, T, Hk, Dk]")?;
    let [_, _, hv, dv] = four(v, "v must be [B, T, Hv, Dv]")?;
    if k != q {
        return Err(Error::shape(op, format!("{}: k must have q's shape", all())));
    }
    if v.dims()[..2] != [b, t] {
        return Err(Error::shape(op, format!("{}: B and T of q and v differ", all())));
    }
    if hk == 0 || dk == 0 || dv == 0 {
        return Err(Error::invalid(op, format!("{}: no heads or empty heads", all())));
    }
    if hv % hk != 0 {
        return Err(Error::shape(
            op,
            format!(
                "{}: value heads Hv = {hv} must be a multiple of key heads Hk = {hk}",
                all()
            ),
        ));
    }
    let channel_decay = g.dims() == [b, t, hv, dk];
    if !channel_decay && g.dims() != [b, t, hv] {
        return Err(Error::shape(
            op,
            format!(
                "{}: g must be [{b}, {t}, {hv}] (a decay per value head) or [{b}, {t}, {hv}, {dk}] (per key \
                 channel)",
                all()
            ),
        ));
    }
    if beta.dims() != [b, t, hv] {
        return Err(Error::shape(
            op,
            format!("{}: beta must be [{b}, {t}, {hv}]", all()),
        ));
    }
    let dims = DeltaRuleDims {
        b,
        t,
        hk,
        hv,
        dk,
        dv,
        channel_decay,
    };
    if let Some([out, saved, dout]) = bwd {
        if out != v {
            return Err(Error::shape(op, format!("fwd.out {out} must have v's shape {v}")));
        }
        if dout != v {
            return Err(Error::shape(op, format!("dout {dout} must have out's shape {v}")));
        }
        let want = dims.saved_shape();
        if *saved != want {
            return Err(Error::shape(
                op,
                format!(
                    "fwd.saved {saved} is not what the forward makes of {}: {want}",
                    all()
                ),
            ));
        }
    }
    Ok(dims)
}

#[derive(Debug)]
pub struct CrossEntropyOut<T> {
    /// `[N]`: −log p(target) per row, 0 where the target is ignored.
    pub losses: T,
    /// `[N, V]`: grad_scale · ((1 + 2z·lse)·softmax − (1 − ε)·onehot − ε/V),
    /// zero rows where ignored (z and ε the [`LossTerms`]; lse the row's
    /// log-sum-exp): the gradient of (1 − ε)·loss + ε·uniform + z·lse².
    pub dlogits: T,
    /// `[N]` where the z-loss factor z is not 0: z·lse² per row, 0 where
    /// the target is ignored.
    pub z_losses: Option<T>,
    /// `[N]` where label smoothing ε is not 0: the cross-entropy against
    /// the uniform distribution, lse − mean(logits), per row, 0 where the
    /// target is ignored. (1 − ε)·losses + ε·uniform is PyTorch's smoothed
    /// loss.
    pub uniform_losses: Option<T>,
}

/// Rotary embedding parameters: half-split `rotate_half` layout over the
/// head dimension, as Hugging Face Llama/Mistral/Qwen use it, or over its
/// leading `rotary_dim` entries, the rest passed through (Phi-3's
/// `partial_rotary_factor`: Phi-4-mini rotates 96 of 128).
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// Position of the first token of the sequence.
    pub offset: usize,
    pub scaling: RopeScaling,
    /// Leading entries of each head that rotate; `None`: all of them. Its
    /// frequencies are those of a head of this size.
    pub rotary_dim: Option<usize>,
    /// Pairs of neighbours (2i, 2i+1), GLM's (and GPT-J's) layout, rather
    /// than `rotate_half`'s (i, i + r/2).
    pub interleaved: bool,
    /// With documents packed in the rows, each token's position counts from
    /// its document's first token (plus `offset`); `None`: from the row's.
    pub docs: Option<Docs>,
}

impl Rope {
    /// Unscaled frequencies with base `theta`, from position `offset`.
    pub fn plain(theta: f64, offset: usize) -> Rope {
        Rope {
            theta,
            offset,
            scaling: RopeScaling::None,
            rotary_dim: None,
            interleaved: false,
            docs: None,
        }
    }

    /// The same rotation with positions counted within the documents of
    /// `docs` (`None`: within rows).
    pub fn with_docs(self, docs: Option<Docs>) -> Rope {
        Rope { docs, ..self }
    }

    /// Token `i` of row `b`'s position, `offset` included.
    pub fn position(&self, b: usize, i: usize) -> usize {
        self.offset + self.docs.as_ref().map_or(i, |d| d.position(b, i))
    }

    /// How many leading entries of a head of `d` rotate: `rotary_dim` or
    /// `d`, which must be even and at most `d` (and `rotary_dim` positive).
    pub fn rotated(&self, op: &'static str, d: usize) -> Result<usize> {
        let r = self.rotary_dim.unwrap_or(d);
        if r > d || !r.is_multiple_of(2) || self.rotary_dim == Some(0) {
            let what = match self.rotary_dim {
                Some(r) => format!("rotary_dim {r} of head dim {d}"),
                None => format!("head dim {d}"),
            };
            return Err(Error::shape(
                op,
                format!("{what} must be even, positive and at most the head dim"),
            ));
        }
        Ok(r)
    }
}
