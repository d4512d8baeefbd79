//! Embedding gather / scatter-add and fused cross-entropy.

use megatrain_tensor::{CrossEntropyOut, DType, Error, LossTerms, Result, Shape};

use super::{GpuExecutor, f, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

impl GpuExecutor {
    fn check_ids(op: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
        if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
            return Err(Error::TokenOutOfRange { op, id, pos, vocab });
        }
        Ok(())
    }

    /// Row ranges of a `[V, C]` table that each fit one binding.
    fn table_chunks(&self, v: usize, c: usize, dtype: DType) -> Result<Vec<(usize, usize)>> {
        // bf16 and f16 rows are half as wide; the chunker counts f32 elements.
        let w = if dtype != DType::F32 { c.div_ceil(2) + 1 } else { c };
        self.row_chunks(v, &[w])
    }

    pub(crate) fn embedding_impl(&self, ids: &[u32], table: &GpuTensor) -> Result<GpuTensor> {
        let name = "embedding";
        if table.shape.rank() != 2 {
            return Err(Error::shape(
                name,
                format!("table {} ({}) must be [V, C]", table.shape, table.dtype),
            ));
        }
        let (v, c) = (table.dims()[0], table.dims()[1]);
        Self::check_ids(name, ids, v)?;
        let out = self.alloc_f32([ids.len(), c])?;
        if ids.is_empty() {
            return Ok(out);
        }
        let kernel = match table.dtype {
            DType::F32 => Kernel::GatherF32,
            DType::BF16 => Kernel::GatherBf16,
            DType::F16 => Kernel::GatherF16,
        };
        let mut op = self.op(name);
        // Positions and table rows both in chunks that fit one binding.
        for (p0, np) in self.row_chunks(ids.len(), &[c])? {
            let ids_t = self.upload_words(&ids[p0..p0 + np])?;
            let (iv, ov) = (self.full(&ids_t)?, self.view(&out, p0 * c, np * c)?);
            for (r0, nr) in self.table_chunks(v, c, table.dtype)? {
                let tv = self.view(table, r0 * c, nr * c)?;
                let params = [u(np), u(c), u(r0), u(r0 + nr), tv.elem_off, ov.elem_off, 0, 0];
                op.dispatch(kernel, &params, &[iv, tv, ov], grid_for((np * c).div_ceil(256)));
            }
            op.keep(ids_t);
        }
        op.finish()?;
        Ok(out)
    }

    pub(crate) fn embedding_backward_impl(
        &self,
        ids: &[u32],
        dout: &GpuTensor,
        dtable: &mut GpuTensor,
    ) -> Result<()> {
        let name = "embedding_backward";
        need_f32(name, dout)?;
        need_f32(name, dtable)?;
        if dtable.shape.rank() != 2 || dout.dims() != [ids.len(), dtable.dims()[1]] {
            return Err(Error::shape(
                name,
                format!(
                    "dout {} and dtable {} for {} ids",
                    dout.shape,
                    dtable.shape,
                    ids.len()
                ),
            ));
        }
        let (v, c) = (dtable.dims()[0], dtable.dims()[1]);
        Self::check_ids(name, ids, v)?;
        if ids.is_empty() {
            return Ok(());
        }
        self.make_unique(dtable)?;
        let mut op = self.op(name);
        for (p0, np) in self.loop_chunks(ids.len(), &[c])? {
            // Group positions by id on the host so that each (id, column) is
            // one thread's sum: no two threads ever add into the same element.
            let chunk = &ids[p0..p0 + np];
            let mut order: Vec<u32> = (0..np as u32).collect();
            order.sort_by_key(|&p| chunk[p as usize]);
            let mut uniq = Vec::new();
            let mut offs = Vec::new();
            for (i, &p) in order.iter().enumerate() {
                if i == 0 || chunk[p as usize] != chunk[order[i - 1] as usize] {
                    uniq.push(chunk[p as usize]);
                    offs.push(i as u32);
                }
            }
            offs.push(order.len() as u32);
            // One upload of a size set by the shape alone, not by how many
            // distinct ids the batch has: the same pooled buffer and the
            // same bindings (so the cached bind group) every step, and one
            // queue write instead of three.
            let words = self.align as usize / 4;
            let seg = |n: usize| n.div_ceil(words).max(1) * words;
            let (at_offs, at_pos) = (seg(np), seg(np) + seg(np + 1));
            let mut packed = vec![0u32; at_pos + np];
            packed[..uniq.len()].copy_from_slice(&uniq);
            packed[at_offs..at_offs + offs.len()].copy_from_slice(&offs);
            packed[at_pos..].copy_from_slice(&order);
            let index_t = self.upload_words(&packed)?;
            let (uv, ofv, pv) = (
                self.view(&index_t, 0, np)?,
                self.view(&index_t, at_offs, np + 1)?,
                self.view(&index_t, at_pos, np)?,
            );
            debug_assert!([uv, ofv, pv].iter().all(|v| v.elem_off == 0));
            let dov = self.view(dout, p0 * c, np * c)?;
            for (r0, nr) in self.table_chunks(v, c, DType::F32)? {
                let tv = self.view(dtable, r0 * c, nr * c)?;
                let params = [
                    u(uniq.len()),
                    u(c),
                    u(r0),
                    u(r0 + nr),
                    tv.elem_off,
                    dov.elem_off,
                    0,
                    0,
                ];
                let grid = grid_for((uniq.len() * c).div_ceil(256));
                op.dispatch(Kernel::ScatterAdd, &params, &[uv, tv, ofv, pv, dov], grid);
            }
            op.keep(index_t);
        }
        op.finish()
    }

    pub(crate) fn cross_entropy_impl(
        &self,
        logits: &GpuTensor,
        targets: &[i32],
        ignore_index: i32,
        grad_scale: f32,
        terms: LossTerms,
    ) -> Result<CrossEntropyOut<GpuTensor>> {
        let name = "cross_entropy";
        need_f32(name, logits)?;
        terms.check()?;
        if logits.shape.rank() != 2 || logits.dims()[0] != targets.len() {
            return Err(Error::shape(
                name,
                format!("logits {} for {} targets", logits.shape, targets.len()),
            ));
        }
        let (n, v) = (logits.dims()[0], logits.dims()[1]);
        if let Some((pos, &t)) = targets
            .iter()
            .enumerate()
            .find(|(_, t)| **t != ignore_index && (**t < 0 || **t as usize >= v))
        {
            return Err(Error::invalid(
                name,
                format!("target {t} at row {pos} is outside the vocabulary of {v}"),
            ));
        }
        // With a z-loss or label smoothing, the rows' z terms and uniform
        // losses follow the losses in the same buffer (the kernel's one
        // LOSS binding), each from a 256-byte boundary.
        let (z, eps) = (terms.z_loss, terms.label_smoothing);
        let stride = n.div_ceil(64) * 64;
        let z_at = if z > 0.0 { stride } else { 0 };
        let u_at = if eps > 0.0 { z_at + stride } else { 0 };
        let len = u_at.max(z_at) + n;
        let all = self.alloc_f32([len])?;
        let dlogits = self.alloc_f32([n, v])?;
        let tgt = self.upload_words(bytemuck::cast_slice(targets))?;
        let fold = self.folds_maxima();
        let slots = self.maxima_slots(fold, n)?;
        let mut op = self.op(name);
        // Every chunk binds all the losses (and z terms, uniform losses): a
        // few bytes a row.
        let lv = self.view(&all, 0, len)?;
        // Chunked over rows: each chunk's logits and gradient fit one binding.
        for (r0, nr) in self.row_chunks(n, &[v])? {
            let xv = self.view(logits, r0 * v, nr * v)?;
            let tv = self.view(&tgt, r0, nr)?;
            let dv = self.view(&dlogits, r0 * v, nr * v)?;
            let mv = self.maxima_view(&slots, (r0, nr), dv)?;
            let params = [
                u(nr),
                u(v),
                ignore_index as u32,
                f(grad_scale),
                xv.elem_off,
                tv.elem_off,
                lv.elem_off + u(r0),
                dv.elem_off,
                // cross_entropy.wgsl's STORE_MAX.
                fold as u32,
                mv.elem_off,
                f(z),
                lv.elem_off + u(z_at + r0),
                f(eps),
                lv.elem_off + u(u_at + r0),
            ];
            op.dispatch(Kernel::CrossEntropy, &params, &[xv, tv, lv, dv, mv], grid_for(nr));
        }
        op.finish()?;
        self.remember_maxima_slots(&dlogits, slots);
        let part = |at: usize| GpuTensor {
            buf: all.buf.clone(),
            offset: all.offset + 4 * at as u64,
            shape: Shape::new([n]),
            dtype: DType::F32,
            derived: Default::default(),
        };
        Ok(CrossEntropyOut {
            losses: part(0),
            dlogits,
            z_losses: (z > 0.0).then(|| part(z_at)),
            uniform_losses: (eps > 0.0).then(|| part(u_at)),
        })
    }
}
