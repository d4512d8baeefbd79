//! The max|x| that scales each f32 operand of an f16 product (the F16
//! compute precision): found by an absmax scan once per value of a tensor
//! and remembered with it, or stored by the op that wrote the tensor as
//! per-workgroup (per-row) maxima that the first f16 reader folds.

use std::sync::atomic::Ordering;

use megatrain_tensor::{ComputePrecision, DType, Result, Shape};

use super::{GpuExecutor, Op, View, grid_for, u};
use crate::kernels::Kernel;
use crate::tensor::{Derived, GpuTensor, Max};

/// Slot of `shaders/matmul_scale.wgsl`'s `NO_SCALE`: an operand used as
/// stored (f16 weights).
pub(super) const NO_SCALE: u32 = u32::MAX;

/// Where the max|x| of an op's output (a product's, a norm's, RoPE's,
/// attention's, the cross-entropy's) comes from when an f16 product reads
/// it next. Both give the same f32, so the same bits everywhere;
/// `Scan` is for timing the fold against the scans it saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F16Maxima {
    /// Folded by the op as it stores its output (where it stores each
    /// element once, with its final value).
    #[default]
    Fold,
    /// Found by an absmax scan of the output when it is first read.
    Scan,
}

impl std::fmt::Display for F16Maxima {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            F16Maxima::Fold => "fold",
            F16Maxima::Scan => "scan",
        })
    }
}

impl GpuExecutor {
    /// Whether producers fold their outputs' maxima as they store them:
    /// under F16, with the maxima remembered and not left to the scans.
    pub(crate) fn folds_maxima(&self) -> bool {
        self.precision == ComputePrecision::F16 && self.cache_maxima && self.f16_maxima == F16Maxima::Fold
    }

    /// max|x| of elements `start..start + count` of `t` folded by `kernel`
    /// (absmax.wgsl's f32 or bf16 entry) into word `slot` of `words`, in
    /// ranges that fit one binding (one element per 4-byte "row"). Also
    /// folds the per-workgroup (per-row) maxima producers store, which are
    /// max_bits already.
    pub(crate) fn absmax_into(
        &self,
        op: &mut Op<'_>,
        kernel: Kernel,
        t: &GpuTensor,
        (start, count): (usize, usize),
        words: &GpuTensor,
        slot: u32,
    ) -> Result<()> {
        let out = self.full(words)?;
        for (s, n) in self.row_chunks(count, &[1])? {
            if n == 0 {
                continue;
            }
            let v = self.view(t, start + s, n)?;
            let params = [u(n), v.elem_off, slot, 0];
            op.dispatch(kernel, &params, &[v, out], grid_for(n.div_ceil(256 * 16)));
        }
        Ok(())
    }

    /// `slots` words for a producer's partial maxima (max_bits, one per
    /// workgroup or row), where it keeps them (`fold`).
    pub(crate) fn maxima_slots(&self, fold: bool, slots: usize) -> Result<Option<GpuTensor>> {
        match fold {
            true => Ok(Some(self.alloc_f32([slots])?)),
            false => Ok(None),
        }
    }

    /// Words `start..start + count` of a producer's partial maxima as its
    /// binding. Without them the kernel has no STORE_MAX and never writes
    /// the binding, so `stand_in` (the output's own view, read-write
    /// already) is bound.
    pub(crate) fn maxima_view<'a>(
        &self,
        slots: &'a Option<GpuTensor>,
        (start, count): (usize, usize),
        stand_in: View<'a>,
    ) -> Result<View<'a>> {
        match slots {
            Some(t) => self.view(t, start, count),
            None => Ok(stand_in),
        }
    }

    /// Remembers all of `slots` (from [`Self::maxima_slots`], filled by ops
    /// recorded so far) as `out`'s max.
    pub(crate) fn remember_maxima_slots(&self, out: &GpuTensor, slots: Option<GpuTensor>) {
        if let Some(t) = slots {
            let n = t.numel();
            self.remember_partial_maxima(out, vec![(t, 0, n)]);
        }
    }

    /// Remembers the partial maxima `ranges` (filled by ops recorded so
    /// far) as the max of `t`'s contents as they are now.
    pub(crate) fn remember_partial_maxima(&self, t: &GpuTensor, ranges: Vec<(GpuTensor, usize, usize)>) {
        self.output_maxima_stored.fetch_add(1, Ordering::Relaxed);
        Derived::set_max(t, t.buf.generation(), Max::Partials(ranges));
    }

    /// Records max|x| of each operand into a fresh scales buffer (f16
    /// weights get no slot: they are used as stored). `None` under F32.
    ///
    /// Each operand's max is found once per value of its contents: a scan's
    /// word is remembered with the tensor ([`Derived`]) and later ops copy
    /// those 4 bytes into their own scales buffer. The kernels keep one
    /// binding of one buffer with a slot per operand, so a copy costs
    /// nothing in them, and the words need no shared home whose slots would
    /// have to be allocated, freed and grown under cached bind groups.
    pub(crate) fn operand_maxima(
        &self,
        op: &mut Op<'_>,
        operands: &[&GpuTensor],
    ) -> Result<Option<(GpuTensor, Vec<u32>)>> {
        if self.precision != ComputePrecision::F16 {
            return Ok(None);
        }
        let buf = self.alloc(Shape::new([operands.len()]), DType::F32)?;
        op.clear(buf.buffer(), buf.byte_len());
        let mut slots = Vec::with_capacity(operands.len());
        let mut found = Vec::new();
        for (i, t) in operands.iter().enumerate() {
            let kernel = match t.dtype {
                DType::F16 => {
                    slots.push(NO_SCALE);
                    continue;
                }
                DType::F32 => Kernel::AbsmaxF32,
                DType::BF16 => Kernel::AbsmaxBf16,
            };
            slots.push(i as u32);
            let at = 4 * i as u64;
            if self.cache_maxima {
                match Derived::max(t) {
                    Some(Max::Word(word)) => {
                        op.copy(word.buffer(), word.offset, buf.buffer(), at, 4);
                        continue;
                    }
                    // What the op that stored t left, folded on first use.
                    // The op keeps them: t's max becomes the word below,
                    // and a buffer back in the pool could be handed out
                    // (and poisoned) within this op.
                    Some(Max::Partials(ranges)) => {
                        for (p, start, n) in ranges {
                            self.absmax_into(op, Kernel::AbsmaxF32, &p, (start, n), &buf, i as u32)?;
                            op.keep(p);
                        }
                        found.push((*t, t.buf.generation(), at));
                        continue;
                    }
                    None => found.push((*t, t.buf.generation(), at)),
                }
            }
            self.absmax_scans.fetch_add(1, Ordering::Relaxed);
            self.absmax_scan_bytes.fetch_add(t.byte_len(), Ordering::Relaxed);
            self.absmax_into(op, kernel, t, (0, t.numel()), &buf, i as u32)?;
        }
        for (t, generation, at) in found {
            let word = self.alloc(Shape::new([1]), DType::F32)?;
            op.copy(buf.buffer(), at, word.buffer(), 0, 4);
            Derived::set_max(t, generation, Max::Word(word));
        }
        Ok(Some((buf, slots)))
    }

    /// The number of operand max scans (absmax passes over a whole
    /// tensor) recorded so far: with the maxima remembered, one per value of
    /// each f32/bf16 operand of an f16 product.
    pub fn operand_max_scans(&self) -> u64 {
        self.absmax_scans.load(Ordering::Relaxed)
    }

    /// Bytes the operand max scans have read so far.
    pub fn operand_max_scan_bytes(&self) -> u64 {
        self.absmax_scan_bytes.load(Ordering::Relaxed)
    }

    /// max|x| of `t`'s contents as the f16 products have it remembered
    /// (found by a scan, or folded by the product that stored `t`), if it
    /// is current. Reads the device: for tests and diagnostics.
    pub fn remembered_max(&self, t: &GpuTensor) -> Result<Option<f32>> {
        match Derived::max(t) {
            Some(Max::Word(word)) => Ok(Some(self.download_host(&word)?.to_f32_vec()[0])),
            // Folded here as absmax.wgsl would: a max over the bits.
            Some(Max::Partials(ranges)) => {
                let mut m = 0u32;
                for (p, start, n) in ranges {
                    let words = self.download_host(&p)?.to_f32_vec();
                    m = words[start..start + n].iter().fold(m, |m, w| m.max(w.to_bits()));
                }
                Ok(Some(f32::from_bits(m)))
            }
            None => Ok(None),
        }
    }

    /// The number of outputs whose producers kept their maxima while
    /// storing them (each saving a scan, when an f16 product reads it).
    pub fn output_maxima_stored(&self) -> u64 {
        self.output_maxima_stored.load(Ordering::Relaxed)
    }
}
