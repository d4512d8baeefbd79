//! Whole-model helpers over every layer in executor memory at once: what the
//! golden tests and small CPU runs use. The streamed trainer calls the layer
//! functions of [`crate::layers`] itself instead.

use megatrain_tensor::{Executor, HostSlice, LossTerms, ParamTable, TensorHandle};

use crate::layers::{
    self, IGNORE_INDEX, Rows, Tied, block_backward, block_forward, embedding_backward, embedding_forward,
    head_forward_backward, head_logits,
};
use crate::{ModelConfig, Result, ZooError};

/// Uploads one layer's slab as one f32 tensor per table entry, in table order.
pub fn upload_layer<E: Executor>(ex: &E, table: &ParamTable, slab: &[f32]) -> Result<Vec<E::Tensor>> {
    if slab.len() != table.numel() {
        return Err(ZooError::invalid(
            "upload_layer",
            format!(
                "slab holds {} elements, table needs {}",
                slab.len(),
                table.numel()
            ),
        ));
    }
    table
        .iter()
        .map(|p| Ok(ex.upload_slice(&p.shape, HostSlice::F32(&slab[p.range()]))?))
        .collect()
}

/// Downloads a layer's gradients (table order) into one slab laid out by `table`.
pub fn download_grads<E: Executor>(ex: &E, table: &ParamTable, grads: &[E::Tensor]) -> Result<Vec<f32>> {
    if grads.len() != table.len() {
        return Err(ZooError::invalid(
            "download_grads",
            format!("{} gradients for a table of {}", grads.len(), table.len()),
        ));
    }
    let mut slab = vec![0.0; table.numel()];
    for (p, g) in table.iter().zip(grads) {
        if g.dims() != p.shape.dims() {
            return Err(ZooError::invalid(
                "download_grads",
                format!(
                    "gradient of '{}' has shape {:?}, expected {}",
                    p.name,
                    g.dims(),
                    p.shape
                ),
            ));
        }
        ex.download_into(g, &mut slab[p.range()])?;
    }
    Ok(slab)
}

/// Result of [`forward_backward`].
#[derive(Debug)]
pub struct StepOut<T> {
    /// Mean cross-entropy over counted targets.
    pub loss: f64,
    pub counted: usize,
    /// Per layer, in table order; a tied head's contribution is already in
    /// the embedding layer's table gradient.
    pub grads: Vec<Vec<T>>,
}

fn tied_table<'a, T>(cfg: &ModelConfig, weights: &'a [Vec<T>]) -> Option<&'a T> {
    cfg.tie_word_embeddings.then(|| &weights[0][0])
}

fn check_layers<T>(cfg: &ModelConfig, weights: &[Vec<T>]) -> Result<()> {
    if weights.len() != cfg.num_layers_total() {
        return Err(ZooError::invalid(
            "model",
            format!(
                "{} layers of weights, model has {}",
                weights.len(),
                cfg.num_layers_total()
            ),
        ));
    }
    Ok(())
}

/// Full forward and backward with every layer's weights given. `ids` and
/// `targets` are `batch × seq` row-major; targets equal to -100 are ignored;
/// `rows`: the documents packed in the rows, where they hold several, and
/// the forward's dropout (`Option<&Docs>` for none).
#[allow(clippy::too_many_arguments)]
pub fn forward_backward<'a, E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    weights: &[Vec<E::Tensor>],
    ids: &[u32],
    targets: &[i32],
    (batch, seq, rows): (usize, usize, impl Into<Rows<'a>>),
    chunk_rows: usize,
) -> Result<StepOut<E::Tensor>> {
    check_layers(cfg, weights)?;
    let rows = rows.into();
    let mut x = embedding_forward(cfg, ex, &weights[0], ids, batch, seq, rows)?;
    let mut saved = Vec::with_capacity(cfg.num_layers);
    for (layer, w) in weights[1..=cfg.num_layers].iter().enumerate() {
        let (y, s) = block_forward(cfg, ex, layer, w, &x, rows)?;
        saved.push(s);
        x = y;
    }
    let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let grad_scale = if counted > 0 { 1.0 / counted as f32 } else { 0.0 };
    let head = head_forward_backward(
        cfg,
        ex,
        &weights[cfg.num_layers + 1],
        tied_table(cfg, weights).map(Tied::Trained),
        &x,
        targets,
        grad_scale,
        LossTerms::NONE,
        chunk_rows,
    )?;
    let mut grads: Vec<Vec<E::Tensor>> = Vec::with_capacity(cfg.num_layers_total());
    grads.push(vec![]);
    let stats: Vec<_> = saved.iter().filter_map(|s| s.router_stats(cfg, None)).collect();
    let aux = layers::RouterAux::new(cfg, &stats, 1.0, None);
    let mut dx = head.dx;
    let mut block_grads = Vec::with_capacity(cfg.num_layers);
    for (layer, (w, s)) in weights[1..=cfg.num_layers].iter().zip(&saved).enumerate().rev() {
        let (d, g) = block_backward(cfg, ex, layer, w, s, &dx, aux.as_ref())?;
        block_grads.push(g);
        dx = d;
    }
    grads[0] = embedding_backward(cfg, ex, &weights[0], ids, (batch, seq, rows), &dx, head.tied_grad)?;
    grads.extend(block_grads.into_iter().rev());
    grads.push(head.grads);
    // Cross-entropy, and the routers' load-balancing loss where the model adds it.
    let loss = if counted > 0 {
        crate::layers::sum_losses(ex, &head.losses)? / counted as f64
    } else {
        0.0
    } + aux.map_or(0.0, |a| a.loss);
    Ok(StepOut { loss, counted, grads })
}

/// Logits `[batch, seq, V]` of the whole model.
pub fn forward_logits<E: Executor>(
    cfg: &ModelConfig,
    ex: &E,
    weights: &[Vec<E::Tensor>],
    ids: &[u32],
    batch: usize,
    seq: usize,
) -> Result<E::Tensor> {
    check_layers(cfg, weights)?;
    let mut x = embedding_forward(cfg, ex, &weights[0], ids, batch, seq, None)?;
    for (layer, w) in weights[1..=cfg.num_layers].iter().enumerate() {
        x = layers::block_forward(cfg, ex, layer, w, &x, None)?.0;
    }
    head_logits(
        cfg,
        ex,
        &weights[cfg.num_layers + 1],
        tied_table(cfg, weights),
        &x,
    )
}
