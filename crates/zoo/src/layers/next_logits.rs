//! The forward generation runs: a sequence's next tokens through the
//! embedding, every block and the head, to the logits after the last one.
//! The caller says where each layer's weights come from, so the same
//! forward serves a model uploaded once and one streamed from the host a
//! layer at a time.

use std::borrow::Borrow;

use megatrain_tensor::{Executor, Result as TensorResult, Shape};

use super::{
    KvCache, block_forward, block_forward_cached, embedding_forward, embedding_forward_at, head_logits,
};
use crate::{ModelConfig, ZooError};

/// Logits `[B, V]` after the last of each row of `ids` (`batch` sequences
/// of one length, row-major), with layer `l`'s weights (table
/// order; 0 the embedding, `num_layers + 1` the head) from `weights(l)`,
/// asked for once each, in order. The embedding's are held until the head
/// has run (a tied head reads them); a block's are dropped before the next
/// block's are asked for, so a streamed caller may reuse their residence
/// once the next call comes.
///
/// With `cache`, `ids` follow the positions it holds and join it
/// ([`block_forward_cached`]); without, they are the whole sequences.
pub fn next_logits<E, W, Er>(
    cfg: &ModelConfig,
    ex: &E,
    ids: &[u32],
    batch: usize,
    mut cache: Option<&mut KvCache<E::Tensor>>,
    mut weights: impl FnMut(usize) -> Result<W, Er>,
) -> Result<Vec<f32>, Er>
where
    E: Executor,
    W: Borrow<[E::Tensor]>,
    Er: From<ZooError>,
{
    if batch == 0 || ids.is_empty() || !ids.len().is_multiple_of(batch) {
        return Err(ZooError::invalid(
            "next_logits",
            format!("{} ids are not {batch} sequences of one length ≥ 1", ids.len()),
        )
        .into());
    }
    let t = ids.len() / batch;
    let emb = weights(0)?;
    let mut x = match cache.as_deref() {
        Some(c) => embedding_forward_at(cfg, ex, emb.borrow(), ids, batch, c.len())?,
        None => embedding_forward(cfg, ex, emb.borrow(), ids, batch, t, None)?,
    };
    for layer in 0..cfg.num_layers {
        let w = weights(layer + 1)?;
        x = match cache.as_deref_mut() {
            Some(c) => block_forward_cached(cfg, ex, layer, w.borrow(), &x, c)?,
            None => block_forward(cfg, ex, layer, w.borrow(), &x, None)?.0,
        };
    }
    let head = weights(cfg.num_layers + 1)?;
    let last = last_rows(ex, &x, batch, t, cfg.hidden_size).map_err(ZooError::from)?;
    let tied = cfg.tie_word_embeddings.then(|| &emb.borrow()[0]);
    let logits = head_logits(cfg, ex, head.borrow(), tied, &last)?;
    let mut out = vec![0.0; batch * cfg.vocab_size];
    ex.download_into(&logits, &mut out).map_err(ZooError::from)?;
    Ok(out)
}

/// The last position of each of the `b` rows of `x: [B, T, C]`, `[B, C]`.
fn last_rows<E: Executor>(ex: &E, x: &E::Tensor, b: usize, t: usize, c: usize) -> TensorResult<E::Tensor> {
    if b == 1 {
        return ex.slice_rows(x, t - 1, 1);
    }
    let mut out = ex.zeros(&Shape::new([b, c]))?;
    for r in 0..b {
        ex.write_rows(&mut out, r, &ex.slice_rows(x, r * t + t - 1, 1)?)?;
    }
    Ok(out)
}
