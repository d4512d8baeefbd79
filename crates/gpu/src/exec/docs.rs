//! Documents packed in a batch's rows ([`Docs`]) as the attention kernels
//! (attention_mask.wgsl), rope.wgsl, conv1d.wgsl and delta_rule.wgsl read
//! them: `Docs::bounds()` on the device. A training step attends, rotates
//! and runs its Gated DeltaNets with the same documents in every layer,
//! forward and backward, so the last bounds uploaded are kept
//! and an equal `Docs` (the same `Arc`, compared by pointer first) reuses
//! them instead of writing the queue again.

use std::sync::Mutex;

use megatrain_tensor::{Docs, Result};

use super::{GpuExecutor, View, u};
use crate::tensor::GpuTensor;

/// The last documents uploaded and their bounds on the device.
#[derive(Default)]
pub(crate) struct DocsCache(Mutex<Option<(Docs, GpuTensor)>>);

/// What a kernel binds for an op's documents: their bounds, or none (the
/// executor's dummy binding, which the kernels never read).
pub(crate) struct DocsBounds {
    bounds: Option<GpuTensor>,
    t: usize,
    /// B·T: how far each token's end lies past its start.
    n: usize,
}

impl GpuExecutor {
    /// The device bounds of `docs`, uploaded unless they are the last ones.
    pub(crate) fn docs_bounds(&self, docs: Option<&Docs>) -> Result<DocsBounds> {
        let Some(docs) = docs else {
            return Ok(DocsBounds {
                bounds: None,
                t: 0,
                n: 0,
            });
        };
        let mut last = self.docs.0.lock().unwrap();
        let bounds = match last.as_ref() {
            Some((d, t)) if d == docs => t.clone(),
            _ => {
                let t = self.upload_words(docs.bounds())?;
                *last = Some((docs.clone(), t.clone()));
                t
            }
        };
        Ok(DocsBounds {
            bounds: Some(bounds),
            t: docs.seq_len(),
            n: docs.rows() * docs.seq_len(),
        })
    }
}

impl DocsBounds {
    /// The binding: every row's bounds (a batch chunk finds its rows by
    /// [`Self::params`]), or the dummy.
    pub(crate) fn view<'a>(&'a self, ex: &'a GpuExecutor) -> Result<View<'a>> {
        match &self.bounds {
            Some(b) => ex.full(b),
            None => Ok(ex.dummy()),
        }
    }

    /// The starts of tokens `r0 .. r0 + n` of the batch's B·T alone, or the
    /// dummy: what a kernel that reads no ends binds for a chunk of rows,
    /// which fits a binding wherever a word a token of its operands does.
    pub(crate) fn starts_view<'a>(&'a self, ex: &'a GpuExecutor, r0: usize, n: usize) -> Result<View<'a>> {
        match &self.bounds {
            Some(b) => ex.view(b, r0, n),
            None => Ok(ex.dummy()),
        }
    }

    /// Whether there are documents to bind.
    pub(crate) fn some(&self) -> bool {
        self.bounds.is_some()
    }

    /// The attention kernels' `docs`, `docs_off` and `docs_ends` for a
    /// chunk of rows from `b0`, bound as `view`: all 0 without documents.
    pub(crate) fn params(&self, view: &View<'_>, b0: usize) -> [u32; 3] {
        match self.bounds {
            Some(_) => [1, view.elem_off + u(b0 * self.t), u(self.n)],
            None => [0; 3],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal documents, the same or built anew, bind the bounds uploaded
    /// for the first; other documents get bounds of their own.
    #[test]
    fn equal_documents_reuse_the_last_bounds() {
        let Ok(g) = GpuExecutor::from_env() else {
            eprintln!("no adapter: the bounds' cache NOT tested here");
            return;
        };
        let docs = |s: &[usize]| Docs::new(6, &[s.to_vec()]).unwrap();
        let at = |d: &Docs| {
            let t = g.docs_bounds(Some(d)).unwrap().bounds.unwrap();
            (t.buffer().clone(), t.offset)
        };
        let a = docs(&[0, 2]);
        let first = at(&a);
        assert!(at(&a) == first && at(&a.clone()) == first && at(&docs(&[0, 2])) == first);
        assert!(at(&docs(&[0, 3])) != first);
        let none = g.docs_bounds(None).unwrap();
        let view = none.view(&g).unwrap();
        assert_eq!((none.some(), none.params(&view, 1)), (false, [0; 3]));
    }
}
