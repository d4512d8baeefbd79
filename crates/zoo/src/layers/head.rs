//! Last layer: final norm, LM head and softmax cross-entropy, processed in
//! chunks of rows so that the `B×T×V` logits never exist at once.

use megatrain_tensor::{Executor, LossTerms, MatmulNeeds, NormGrads, NormOut, TensorHandle, Transpose};

use super::{IGNORE_INDEX, check_weights, shape};
use crate::{ModelConfig, Result, ZooError};

/// The fewest rows of a default head chunk.
pub const MIN_CHUNK_ROWS: usize = 256;

/// The default `chunk_rows` for a vocabulary of `vocab` tokens on an
/// executor whose chunk may hold `logits_bytes` of f32 logits
/// ([`Executor::logits_chunk_bytes`](megatrain_tensor::Executor::logits_chunk_bytes)):
/// at least [`MIN_CHUNK_ROWS`], more (a multiple of 128, the GPU matmul's
/// large tile) while one chunk's logits fit. Each chunk runs the head's ops
/// once more, so a small vocabulary (65 characters: one chunk for any
/// batch) should not pay for the chunking a large one needs. In host
/// memory a 32k vocabulary gets 512 rows and a 152k one 256 (156 MB of
/// logits); on a GPU 8320 and 1664.
pub fn default_chunk_rows(vocab: usize, logits_bytes: usize) -> usize {
    let fit = logits_bytes / (4 * vocab.max(1));
    (fit / 128 * 128).max(MIN_CHUNK_ROWS)
}

/// The embedding table a tied head multiplies by, and whether it trains:
/// a frozen one (`TrainerConfig::frozen_layers` past the embedding) takes
/// no gradient, so the head's backward skips its product.
#[derive(Debug)]
pub enum Tied<'a, T> {
    Trained(&'a T),
    Frozen(&'a T),
}

// By hand: derived, they would ask `T: Copy` of the table.
impl<T> Clone for Tied<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Tied<'_, T> {}

impl<'a, T> Tied<'a, T> {
    /// `table` trained where `trained`.
    pub fn new(table: &'a T, trained: bool) -> Self {
        match trained {
            true => Tied::Trained(table),
            false => Tied::Frozen(table),
        }
    }

    pub fn table(self) -> &'a T {
        match self {
            Tied::Trained(t) | Tied::Frozen(t) => t,
        }
    }
}

/// What [`head_forward_backward`] returns.
#[derive(Debug)]
pub struct HeadOut<T> {
    /// Each chunk's per-row losses, not yet read: [`sum_losses`] gives the
    /// sum of −log p(target) over counted rows (divide by the step's counted
    /// targets for the mean). A read inside the head would make the host
    /// wait for the device before it has recorded any of the backward,
    /// leaving the device idle while it does; the trainer reads them at the
    /// step's end, where it waits anyway.
    pub losses: Vec<T>,
    /// With a z-loss, each chunk's per-row z·lse², read as `losses` are.
    pub z_losses: Vec<T>,
    /// With label smoothing, each chunk's per-row cross-entropy against the
    /// uniform target, read as `losses` are.
    pub uniform_losses: Vec<T>,
    /// Targets that were not `IGNORE_INDEX`.
    pub counted: usize,
    /// `[B, T, C]`.
    pub dx: T,
    /// Gradients of the head's own table, in table order.
    pub grads: Vec<T>,
    /// With tied embeddings that train: the gradient for the embedding
    /// table `[V, C]`, to be accumulated into the embedding layer's
    /// gradient.
    pub tied_grad: Option<T>,
}

/// The final norm's tensors: a gain, and a bias for most LayerNorms.
fn n_norm(cfg: &ModelConfig) -> usize {
    if cfg.arch.norm_has_bias() { 2 } else { 1 }
}

fn n_weights(cfg: &ModelConfig) -> usize {
    n_norm(cfg) + usize::from(!cfg.tie_word_embeddings) + usize::from(cfg.arch.has_head_bias())
}

/// The LM head matrix `[V, C]` (the head's own, or the tied embedding
/// table) and its bias `[V]` where it has one (Phi-2's, last in the table).
fn head_matrix<'a, E: Executor>(
    cfg: &ModelConfig,
    w: &'a [E::Tensor],
    tied: Option<&'a E::Tensor>,
    op: &'static str,
) -> Result<(&'a E::Tensor, Option<&'a E::Tensor>)> {
    check_weights(w, n_weights(cfg), op)?;
    let bias = cfg
        .arch
        .has_head_bias()
        .then(|| w.last().expect("the bias is last"));
    let m = match (cfg.tie_word_embeddings, tied) {
        (true, Some(t)) => t,
        (true, None) => return Err(ZooError::invalid(op, "tied head needs the embedding table")),
        (false, None) => &w[n_norm(cfg)],
        (false, Some(_)) => return Err(ZooError::invalid(op, "untied head was given an embedding table")),
    };
    if m.dims() != [cfg.vocab_size, cfg.hidden_size] {
        return Err(ZooError::invalid(
            op,
            format!(
                "head matrix has shape {:?}, expected [{}, {}]",
                m.dims(),
                cfg.vocab_size,
                cfg.hidden_size
            ),
        ));
    }
    Ok((m, bias))
}

/// The final norm's gain where it is not its stored weight: Gemma's
/// `1 + w`, and with a factor s on the logits folded in (logits · s =
/// W·(x̂ ∘ g) · s = W·(x̂ ∘ g·s): Granite's 1/`logits_scaling`, Cohere's
/// `logit_scale`; the norm has no bias then); `None` where it is. Its
/// gradient is then that of g·s, to be multiplied by s ([`unfold_gain`]).
fn folded_gain<E: Executor>(cfg: &ModelConfig, ex: &E, w: &[E::Tensor]) -> Result<Option<E::Tensor>> {
    let offset = match cfg.arch.norm_gain_offset() {
        Some(c) => Some(ex.add_scalar(&w[0], c)?),
        None => None,
    };
    let g = offset.as_ref().unwrap_or(&w[0]);
    Ok(match cfg.logits_factor() {
        Some(s) if !cfg.arch.norm_has_bias() => Some(ex.scale(g, s)?),
        _ => offset,
    })
}

/// The gradient of the stored gain from that of the folded one.
fn unfold_gain<E: Executor>(cfg: &ModelConfig, ex: &E, dg: E::Tensor) -> Result<E::Tensor> {
    Ok(match cfg.logits_factor() {
        Some(s) if !cfg.arch.norm_has_bias() => ex.scale(&dg, s)?,
        _ => dg,
    })
}

/// The logits of the normed rows `n`, soft-capped where the family caps
/// them (Gemma's `final_logit_softcapping`).
fn logits<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    n: &E::Tensor,
    wh: &E::Tensor,
    bias: Option<&E::Tensor>,
) -> Result<E::Tensor> {
    let z = ex.matmul(n, wh, bias, Transpose::NT)?;
    Ok(match cfg.final_softcap {
        Some(cap) => ex.softcap(z, cap)?,
        None => z,
    })
}

/// The final LayerNorm's bias: the head's, or zeros where it has none
/// (Cohere's); `None` for RMSNorm.
fn norm_bias<E: Executor>(cfg: &ModelConfig, ex: &E, w: &[E::Tensor]) -> Result<Option<E::Tensor>> {
    Ok(match (cfg.arch.has_layernorm(), cfg.arch.norm_has_bias()) {
        (true, true) => Some(ex.reshape(&w[1], w[1].shape())?),
        (true, false) => Some(ex.zeros(w[0].shape())?),
        (false, _) => None,
    })
}

fn norm_fwd<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    (gain, bias): (&E::Tensor, Option<&E::Tensor>),
    x: &E::Tensor,
) -> Result<NormOut<E::Tensor>> {
    let eps = cfg.norm_eps as f32;
    Ok(match bias {
        Some(b) => ex.layernorm(x, gain, b, eps)?,
        None => ex.rmsnorm(x, gain, eps)?,
    })
}

fn norm_bwd<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    gain: &E::Tensor,
    x: &E::Tensor,
    n: &NormOut<E::Tensor>,
    dy: &E::Tensor,
) -> Result<NormGrads<E::Tensor>> {
    Ok(if cfg.arch.has_layernorm() {
        ex.layernorm_backward(x, gain, n.mean.as_ref().expect("layernorm mean"), &n.rstd, dy)?
    } else {
        ex.rmsnorm_backward(x, gain, &n.rstd, dy)?
    })
}

fn rows_of<T: TensorHandle>(cfg: &ModelConfig, x: &T, op: &'static str) -> Result<usize> {
    if x.shape().last() != cfg.hidden_size {
        return Err(ZooError::invalid(
            op,
            format!(
                "x has shape {:?}, last dimension must be {}",
                x.dims(),
                cfg.hidden_size
            ),
        ));
    }
    Ok(x.shape().rows())
}

fn check_targets(rows: usize, targets: &[i32], vocab: usize, op: &'static str) -> Result<()> {
    if targets.len() != rows {
        return Err(ZooError::invalid(
            op,
            format!("{} targets for {rows} rows", targets.len()),
        ));
    }
    if let Some((pos, &t)) = targets
        .iter()
        .enumerate()
        .find(|(_, t)| **t != IGNORE_INDEX && (**t < 0 || **t as usize >= vocab))
    {
        return Err(ZooError::invalid(
            op,
            format!(
                "target {t} at position {pos} is outside the vocabulary of {vocab} (ignore index is {IGNORE_INDEX})"
            ),
        ));
    }
    Ok(())
}

/// Final norm + LM head + cross-entropy and their backward, `chunk_rows`
/// rows of `x: [B, T, C]` at a time. `targets` has one entry per row
/// (`IGNORE_INDEX` for none); `grad_scale` is 1 / (counted targets of the
/// whole step), so chunks and micro-batches add up to the mean's gradient.
/// `terms` adds a z-loss and label smoothing to what the gradient is of
/// (`Executor::cross_entropy`).
#[allow(clippy::too_many_arguments)]
pub fn head_forward_backward<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    tied: Option<Tied<'_, E::Tensor>>,
    x: &E::Tensor,
    targets: &[i32],
    grad_scale: f32,
    terms: LossTerms,
    chunk_rows: usize,
) -> Result<HeadOut<E::Tensor>> {
    const OP: &str = "head_forward_backward";
    let (wh, bias) = head_matrix::<E>(cfg, w, tied.map(Tied::table), OP)?;
    let trains_matrix = !matches!(tied, Some(Tied::Frozen(_)));
    let rows = rows_of(cfg, x, OP)?;
    check_targets(rows, targets, cfg.vocab_size, OP)?;
    if chunk_rows == 0 {
        return Err(ZooError::invalid(OP, "chunk_rows must be positive"));
    }
    let c = cfg.hidden_size;
    let x2 = ex.reshape(x, &shape(&[rows, c]))?;
    let folded = folded_gain(cfg, ex, w)?;
    let gain = folded.as_ref().unwrap_or(&w[0]);
    let bias_n = norm_bias(cfg, ex, w)?;
    let mut dx = ex.zeros(&shape(&[rows, c]))?;
    let mut dwh: Option<E::Tensor> = None;
    let mut dbias: Option<E::Tensor> = None;
    let mut dnorm: Option<(E::Tensor, Option<E::Tensor>)> = None;
    // Left unread (see `HeadOut::losses`).
    let mut chunk_losses = Vec::new();
    let mut chunk_z = Vec::new();
    let mut chunk_uniform = Vec::new();
    let mut start = 0;
    while start < rows {
        let len = chunk_rows.min(rows - start);
        let tgt = &targets[start..start + len];
        let xc = ex.slice_rows(&x2, start, len)?;
        let n = norm_fwd(cfg, ex, (gain, bias_n.as_ref()), &xc)?;
        let logits = logits(cfg, ex, &n.y, wh, bias)?;
        let ce = ex.cross_entropy(&logits, tgt, IGNORE_INDEX, grad_scale, terms)?;
        chunk_losses.push(ce.losses);
        chunk_z.extend(ce.z_losses);
        chunk_uniform.extend(ce.uniform_losses);
        let dlogits = match cfg.final_softcap {
            Some(cap) => ex.softcap_backward(&logits, ce.dlogits, cap)?,
            None => ce.dlogits,
        };
        drop(logits);
        // The first chunk's gradient starts the sum; later chunks add
        // theirs in place, with no head-sized temporary per chunk.
        let needs = MatmulNeeds {
            da: true,
            db: trains_matrix && dwh.is_none(),
            dbias: bias.is_some(),
        };
        let (dy, t) = (&dlogits, Transpose::NT);
        let mut g = match &mut dwh {
            Some(acc) => ex.matmul_backward_into(&n.y, wh, dy, t, needs, acc)?,
            None => {
                let mut g = ex.matmul_backward(&n.y, wh, dy, t, needs)?;
                dwh = g.db.take();
                g
            }
        };
        match (&mut dbias, g.dbias.take()) {
            (Some(acc), Some(d)) => ex.add_assign(acc, &d)?,
            (None, d) => dbias = d,
            (Some(_), None) => {}
        }
        let ng = norm_bwd(cfg, ex, gain, &xc, &n, &g.da.expect("requested"))?;
        match &mut dnorm {
            Some((dw, db)) => {
                ex.add_assign(dw, &ng.dw)?;
                if let (Some(acc), Some(b)) = (db, &ng.db) {
                    ex.add_assign(acc, b)?;
                }
            }
            None => dnorm = Some((ng.dw, ng.db)),
        }
        ex.write_rows(&mut dx, start, &ng.dx)?;
        start += len;
    }
    let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let (dnw, dnb) = match dnorm {
        Some(d) => d,
        None => (
            ex.zeros(w[0].shape())?,
            cfg.arch
                .has_layernorm()
                .then(|| ex.zeros(w[1].shape()))
                .transpose()?,
        ),
    };
    let dwh = match (dwh, trains_matrix) {
        (Some(d), _) => Some(d),
        (None, true) => Some(ex.zeros(wh.shape())?),
        (None, false) => None,
    };
    let mut grads = vec![unfold_gain(cfg, ex, dnw)?];
    grads.extend(dnb.filter(|_| cfg.arch.norm_has_bias()));
    let tied_grad = match cfg.tie_word_embeddings {
        true => dwh,
        false => {
            grads.extend(dwh);
            None
        }
    };
    if let Some(b) = bias {
        grads.push(match dbias {
            Some(d) => d,
            None => ex.zeros(b.shape())?,
        });
    }
    Ok(HeadOut {
        losses: chunk_losses,
        z_losses: chunk_z,
        uniform_losses: chunk_uniform,
        counted,
        dx: ex.reshape(&dx, x.shape())?,
        grads,
        tied_grad,
    })
}

/// Logits `[.., V]` of `x: [.., C]` (all rows at once: pass only the rows you
/// need, e.g. the last position when sampling).
pub fn head_logits<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    tied: Option<&E::Tensor>,
    x: &E::Tensor,
) -> Result<E::Tensor> {
    const OP: &str = "head_logits";
    let (wh, bias) = head_matrix::<E>(cfg, w, tied, OP)?;
    rows_of(cfg, x, OP)?;
    let folded = folded_gain(cfg, ex, w)?;
    let bias_n = norm_bias(cfg, ex, w)?;
    let n = norm_fwd(cfg, ex, (folded.as_ref().unwrap_or(&w[0]), bias_n.as_ref()), x)?;
    logits(cfg, ex, &n.y, wh, bias)
}

/// Forward-only loss: `(loss_sum, counted)`, `chunk_rows` rows at a time.
pub fn head_loss<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    tied: Option<&E::Tensor>,
    x: &E::Tensor,
    targets: &[i32],
    chunk_rows: usize,
) -> Result<(f64, usize)> {
    const OP: &str = "head_loss";
    let (wh, bias) = head_matrix::<E>(cfg, w, tied, OP)?;
    let rows = rows_of(cfg, x, OP)?;
    check_targets(rows, targets, cfg.vocab_size, OP)?;
    if chunk_rows == 0 {
        return Err(ZooError::invalid(OP, "chunk_rows must be positive"));
    }
    let x2 = ex.reshape(x, &shape(&[rows, cfg.hidden_size]))?;
    let folded = folded_gain(cfg, ex, w)?;
    let gain = folded.as_ref().unwrap_or(&w[0]);
    let bias_n = norm_bias(cfg, ex, w)?;
    let mut chunk_losses = Vec::new();
    let mut start = 0;
    while start < rows {
        let len = chunk_rows.min(rows - start);
        let xc = ex.slice_rows(&x2, start, len)?;
        let n = norm_fwd(cfg, ex, (gain, bias_n.as_ref()), &xc)?;
        let logits = logits(cfg, ex, &n.y, wh, bias)?;
        let ce = ex.cross_entropy(
            &logits,
            &targets[start..start + len],
            IGNORE_INDEX,
            0.0,
            LossTerms::NONE,
        )?;
        chunk_losses.push(ce.losses);
        start += len;
    }
    let loss_sum = sum_losses(ex, &chunk_losses)?;
    Ok((loss_sum, targets.iter().filter(|&&t| t != IGNORE_INDEX).count()))
}

/// The per-row losses of every chunk (`HeadOut::losses`) summed in f64,
/// chunk by chunk in row order. Read once all chunks are recorded: a read
/// per chunk would make the host wait for the device, and the device for
/// the host's next chunk, every chunk.
pub fn sum_losses<E: Executor>(ex: &E, chunks: &[E::Tensor]) -> Result<f64> {
    let mut sum = 0.0f64;
    for losses in chunks {
        sum += ex
            .download(losses)?
            .to_f32_vec()
            .iter()
            .map(|&l| l as f64)
            .sum::<f64>();
    }
    Ok(sum)
}
