//! Embedding gather and its scatter-add backward.

use crate::cpu::Real;
use crate::{Error, Result};

pub(crate) fn check_ids(op: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().enumerate().find(|&(_, &id)| id as usize >= vocab) {
        Some((pos, &id)) => Err(Error::TokenOutOfRange { op, id, pos, vocab }),
        None => Ok(()),
    }
}

/// Rows `ids` of `table: [vocab, c]`, result `[ids.len(), c]`.
pub fn embedding<F: Real>(ids: &[u32], table: &[F], c: usize) -> Result<Vec<F>> {
    let vocab = table.len().checked_div(c).unwrap_or(0);
    assert_eq!(table.len(), vocab * c, "embedding: table length");
    check_ids("embedding", ids, vocab)?;
    let mut out = Vec::with_capacity(ids.len() * c);
    for &id in ids {
        out.extend_from_slice(&table[id as usize * c..][..c]);
    }
    Ok(out)
}

/// `dtable[ids[i]] += dout[i]` for every `i` (repeated ids accumulate).
/// Checks every id before writing anything.
pub fn embedding_backward<F: Real>(ids: &[u32], dout: &[F], dtable: &mut [F], c: usize) -> Result<()> {
    let vocab = dtable.len().checked_div(c).unwrap_or(0);
    assert_eq!(dtable.len(), vocab * c, "embedding_backward: dtable length");
    assert_eq!(dout.len(), ids.len() * c, "embedding_backward: dout length");
    check_ids("embedding_backward", ids, vocab)?;
    for (pos, &id) in ids.iter().enumerate() {
        let row = &mut dtable[id as usize * c..][..c];
        row.iter_mut()
            .zip(&dout[pos * c..][..c])
            .for_each(|(a, &g)| *a = *a + g);
    }
    Ok(())
}
