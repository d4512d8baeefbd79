//! Layer 0: token embedding (plus GPT-2's learned positions).

use megatrain_tensor::{Docs, Executor, Noise, Shape, TensorHandle};

use super::{Rows, Site, check_weights, dropout_branch, dropped, shape};
use crate::{ModelConfig, Result, ZooError};

fn check_ids(cfg: &ModelConfig, ids: &[u32], batch: usize, seq: usize, op: &'static str) -> Result<()> {
    if ids.len() != batch * seq {
        return Err(ZooError::invalid(
            op,
            format!("{} token ids for batch {batch} × seq {seq}", ids.len()),
        ));
    }
    if let Some((pos, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= cfg.vocab_size)
    {
        return Err(ZooError::TokenOutOfRange {
            id,
            pos,
            vocab: cfg.vocab_size,
        });
    }
    cfg.check_seq_len(seq)
}

/// GPT-2's position of each token: from its row's first token, or its
/// document's where the rows hold several.
fn positions(batch: usize, seq: usize, docs: Option<&Docs>) -> Vec<u32> {
    (0..batch)
        .flat_map(|b| (0..seq).map(move |i| docs.map_or(i, |d| d.position(b, i)) as u32))
        .collect()
}

fn check_docs(docs: Option<&Docs>, batch: usize, seq: usize, op: &'static str) -> Result<()> {
    match docs {
        Some(d) => Ok(d.check(op, batch, seq)?),
        None => Ok(()),
    }
}

fn n_weights(cfg: &ModelConfig) -> usize {
    if cfg.arch.is_gpt2() { 2 } else { 1 }
}

/// `ids` (`batch × seq`, row-major) → `x: [B, T, C]`; the documents
/// packed in the rows ([`Rows::docs`]) count their positions from their
/// own first tokens; a training forward's dropout ([`Rows::dropout`])
/// drops the output.
pub fn embedding_forward<'a, E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    ids: &[u32],
    batch: usize,
    seq: usize,
    rows: impl Into<Rows<'a>>,
) -> Result<E::Tensor> {
    let rows = rows.into();
    check_weights(w, n_weights(cfg), "embedding_forward")?;
    check_ids(cfg, ids, batch, seq, "embedding_forward")?;
    check_docs(rows.docs, batch, seq, "embedding_forward")?;
    let noise = rows.embedding_noise(seq, cfg.hidden_size);
    let x = embed(cfg, ex, w, ids, (batch, seq, noise), || {
        positions(batch, seq, rows.docs)
    })?;
    dropout_branch(ex, x, rows.site(0, Site::Embedding))
}

/// [`embedding_forward`] of the next tokens of `batch` sequences of one
/// length (`ids` row-major, as many a row), the first at position `start`
/// (generation over a cache: `[B, ids.len() / B, C]`).
pub fn embedding_forward_at<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    ids: &[u32],
    batch: usize,
    start: usize,
) -> Result<E::Tensor> {
    let seq = ids.len() / batch.max(1);
    check_weights(w, n_weights(cfg), "embedding_forward_at")?;
    check_ids(cfg, ids, batch, seq, "embedding_forward_at")?;
    cfg.check_seq_len(start + seq)?;
    embed(cfg, ex, w, ids, (batch, seq, None), || {
        (0..batch)
            .flat_map(|_| start..start + seq)
            .map(|p| p as u32)
            .collect()
    })
}

/// The table's rows for `ids` (plus `noise`, NEFTune's, where the forward
/// trains with it), the positions' rows where the family has them, and
/// the family's scale: `[batch, seq, C]`.
fn embed<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    ids: &[u32],
    (batch, seq, noise): (usize, usize, Option<Noise>),
    positions: impl FnOnce() -> Vec<u32>,
) -> Result<E::Tensor> {
    let mut x = ex.embedding(ids, &w[0])?;
    if let Some(n) = noise {
        // The noise counts rows of sequences, as dropout masks do.
        let rows = ex.add_noise(&ex.reshape(&x, &shape(&[batch, seq, cfg.hidden_size]))?, &n)?;
        x = ex.reshape(&rows, &shape(&[batch * seq, cfg.hidden_size]))?;
    }
    if cfg.arch.is_gpt2() {
        let p = ex.embedding(&positions(), &w[1])?;
        ex.add_assign(&mut x, &p)?;
    }
    // Granite and Gemma scale what the table gives.
    if let Some(s) = cfg.embedding_factor() {
        x = ex.scale(&x, s)?;
    }
    Ok(ex.reshape(&x, &shape(&[batch, seq, cfg.hidden_size]))?)
}

/// Gradients of the embedding layer for `dx: [B, T, C]` (the batch's
/// rows, length and documents as the forward had them). With a tied head,
/// pass the head's gradient for the shared table as `tied_grad`: the token
/// gradient is accumulated onto it, so the returned table gradient is the
/// whole gradient of the shared weight.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward<'a, E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    w: &[E::Tensor],
    ids: &[u32],
    (batch, seq, rows): (usize, usize, impl Into<Rows<'a>>),
    dx: &E::Tensor,
    tied_grad: Option<E::Tensor>,
) -> Result<Vec<E::Tensor>> {
    let shapes: Vec<Shape> = w.iter().map(|t| t.shape().clone()).collect();
    embedding_grads(cfg, ex, &shapes, ids, (batch, seq, rows), dx, tied_grad)
}

/// [`embedding_backward`] from the weights' shapes alone: the backward
/// never reads the tables, so a caller may free them after the forward
/// (the trainer does, where the head is not tied to them).
#[allow(clippy::too_many_arguments)]
pub fn embedding_grads<'a, E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    shapes: &[Shape],
    ids: &[u32],
    (batch, seq, rows): (usize, usize, impl Into<Rows<'a>>),
    dx: &E::Tensor,
    tied_grad: Option<E::Tensor>,
) -> Result<Vec<E::Tensor>> {
    let rows = rows.into();
    let docs = rows.docs;
    check_weights(shapes, n_weights(cfg), "embedding_backward")?;
    check_ids(cfg, ids, batch, seq, "embedding_backward")?;
    check_docs(docs, batch, seq, "embedding_backward")?;
    let c = cfg.hidden_size;
    if dx.numel() != batch * seq * c {
        return Err(ZooError::invalid(
            "embedding_backward",
            format!("dx has shape {:?}, expected [{batch}, {seq}, {c}]", dx.dims()),
        ));
    }
    let undropped = dropped(ex, rows.site(0, Site::Embedding), dx)?;
    let mut dx = ex.reshape(undropped.as_ref().unwrap_or(dx), &shape(&[batch * seq, c]))?;
    if let Some(s) = cfg.embedding_factor() {
        dx = ex.scale(&dx, s)?;
    }
    let table_shape = &shapes[0];
    let mut dwte = match tied_grad {
        Some(g) if g.shape() == table_shape => g,
        Some(g) => {
            return Err(ZooError::invalid(
                "embedding_backward",
                format!("tied gradient has shape {:?}, table is {table_shape}", g.dims()),
            ));
        }
        None => ex.zeros(table_shape)?,
    };
    // transformers' nn.Embedding(padding_idx = pad_token_id) gives the pad
    // token's row no gradient from the lookup (a tied head's still reaches
    // it): that row keeps what it held before the scatter.
    let pad = cfg.pad_token_id.filter(|&p| ids.contains(&(p as u32)));
    let kept = match pad {
        // A copy: the scatter writes the table in place.
        Some(p) => Some(ex.scale(&ex.slice_rows(&dwte, p, 1)?, 1.0)?),
        None => None,
    };
    ex.embedding_backward(ids, &dx, &mut dwte)?;
    if let (Some(p), Some(row)) = (pad, kept) {
        ex.write_rows(&mut dwte, p, &row)?;
    }
    let mut grads = vec![dwte];
    if cfg.arch.is_gpt2() {
        let mut dwpe = ex.zeros(&shapes[1])?;
        ex.embedding_backward(&positions(batch, seq, docs), &dx, &mut dwpe)?;
        grads.push(dwpe);
    }
    Ok(grads)
}
