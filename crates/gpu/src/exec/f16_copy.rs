//! f16 copies of the f32 operands of the tensor-core kernels (matmuls, and
//! Q, K, V and dO of the flash attention).
//!
//! An f32 operand staged by the tensor-core kernels is read at 4 bytes per
//! element and scaled and converted in their inner loop, by every workgroup
//! whose tile reads it: each element of A once per column tile of C, each
//! key and value once per query block that attends to it. Under
//! [`F16Operands::Copy`] the operand is converted once per value of its
//! contents into an f16 copy (`shaders/f16_copy.wgsl`: rounded to nearest
//! even, as the staging's conversion rounds on the adapters we know, so the
//! product's bits do not change there) that the kernels read
//! at 2 bytes per element and stage as they stage f16 weights. The copy is
//! remembered with the tensor ([`Derived`]) like its max, so the products
//! that share an operand (Q, K and V's projections; a gradient's dA and dW;
//! the attention's forward and backward) convert it once.

use std::sync::atomic::Ordering;

use megatrain_tensor::{DType, Result};

use super::{GpuExecutor, Op, grid_for, u};
use crate::kernels::Kernel;
use crate::tensor::{Derived, GpuTensor};

/// How the tensor-core kernels take f32 operands under the F16 compute
/// precision. They differ in where the conversion to f16 happens, and give
/// the same bits wherever the adapter's own conversion (which WGSL leaves to
/// the implementation) rounds to nearest even, as lavapipe's does when the
/// kernels stage (tested); the copies round to nearest even everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F16Operands {
    /// Converted once per value of their contents into f16 copies, which
    /// the kernels read.
    #[default]
    Copy,
    /// Read as f32 and converted by the kernels as they stage each tile, by
    /// the adapter's f32 → f16 conversion.
    Stage,
}

impl std::fmt::Display for F16Operands {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            F16Operands::Copy => "copy",
            F16Operands::Stage => "stage",
        })
    }
}

impl GpuExecutor {
    /// `t`'s f16 copy under the scale in word `slot` of `scales` (its max,
    /// which the op has already put there): the remembered one where it is
    /// current, else a fresh one recorded into `op`.
    pub(crate) fn f16_copy(
        &self,
        op: &mut Op<'_>,
        t: &GpuTensor,
        scales: &GpuTensor,
        slot: u32,
    ) -> Result<GpuTensor> {
        debug_assert_eq!(t.dtype, DType::F32);
        if self.cache_maxima
            && let Some(copy) = Derived::half(t)
        {
            // The op may outlive the last owner of `t` (and so of the copy)
            // before its commands have run.
            op.keep(copy.clone());
            // Reshapes share the copy: it takes the shape it is asked in.
            return Ok(GpuTensor {
                shape: t.shape.clone(),
                ..copy
            });
        }
        let generation = t.buf.generation();
        self.f16_copies.fetch_add(1, Ordering::Relaxed);
        let n = t.numel();
        let out = self.alloc(t.shape.clone(), DType::F16)?;
        let sv = self.full(scales)?;
        // Chunks of an even number of elements (whole output words) whose
        // f32 range fits one binding.
        let per = ((self.max_binding.saturating_sub(self.align) / 4) as usize / 2 * 2).max(2);
        for start in (0..n).step_by(per) {
            let count = per.min(n - start);
            let (xv, yv) = (self.view(t, start, count)?, self.view(&out, start, count)?);
            // `start` is even and the view's byte offset a multiple of 4,
            // so the copy's first element begins a word.
            debug_assert_eq!(yv.elem_off % 2, 0);
            let params = [u(count), xv.elem_off, yv.elem_off / 2, slot];
            // Four words an invocation (`WORDS` in the shader).
            let grid = grid_for(count.div_ceil(2).div_ceil(4 * 256));
            op.dispatch(Kernel::F16Copy, &params, &[xv, yv, sv], grid);
        }
        if self.cache_maxima {
            Derived::set_half(t, generation, out.clone());
        }
        op.keep(out.clone());
        Ok(out)
    }

    /// `t`'s f16 copy as the tensor-core kernels read it: element i is
    /// `t[i]`·2^-e rounded to the nearest f16 (ties to even) under the
    /// per-tensor scale 2^-e of the F16 precision, made (and remembered) as
    /// they make it. For tests and benchmarks of the conversion itself;
    /// needs the F16 precision.
    pub fn f16_operand(&self, t: &GpuTensor) -> Result<GpuTensor> {
        super::need_f32("f16_operand", t)?;
        let mut op = self.op("f16_operand");
        let Some((scales, slots)) = self.operand_maxima(&mut op, &[t])? else {
            return Err(megatrain_tensor::Error::invalid(
                "f16_operand",
                "the compute precision is not F16",
            ));
        };
        let copy = self.f16_copy(&mut op, t, &scales, slots[0])?;
        op.keep(scales);
        op.finish()?;
        Ok(copy)
    }

    /// The number of f16 operand copies made so far: with the copies
    /// remembered, one per value of each f32 operand of a tensor-core
    /// product under [`F16Operands::Copy`].
    pub fn operand_f16_copies(&self) -> u64 {
        self.f16_copies.load(Ordering::Relaxed)
    }
}
