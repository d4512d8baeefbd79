//! Attention of new queries over a cache of keys and values, for
//! generation (attention_cached.wgsl): one workgroup a query row, in f32
//! whatever the compute precision, as `Executor::attention_cached` says.

use megatrain_tensor::{AttentionOut, AttnMask, Result, Shape, attention_cached_dims};

use super::{GpuExecutor, f, grid_for, need_f32, u};
use crate::GpuError;
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Output entries a workgroup's 64 threads own, 4 each
/// (attention_cached.wgsl).
const MAX_HEAD_DIM: usize = 256;
/// Keys a workgroup scores at once (attention_cached.wgsl's WG).
const BLOCK: usize = 64;

impl GpuExecutor {
    pub(crate) fn attention_cached_impl(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        len: usize,
        mask: AttnMask,
    ) -> Result<AttentionOut<GpuTensor>> {
        const OP: &str = "attention_cached";
        for x in [q, k, v] {
            need_f32(OP, x)?;
        }
        let c = attention_cached_dims(OP, &q.shape, &k.shape, &v.shape, len, &mask)?;
        if c.d > MAX_HEAD_DIM {
            return Err(GpuError::Unsupported {
                op: OP,
                detail: format!("head dimension {} is past the kernel's {MAX_HEAD_DIM}", c.d),
            }
            .into());
        }
        // Each block of keys runs loops of D (the scores) and of the block
        // (its max, its sum and each owned output entry): llvmpipe ends a
        // loop past its budget, so a row's whole walk must stay under it.
        let keys = mask.window.map_or(len, |w| w.min(len));
        let iterations = keys.div_ceil(BLOCK) * (c.d + (2 + MAX_HEAD_DIM / BLOCK) * BLOCK);
        if iterations > self.loop_budget {
            return Err(GpuError::Unsupported {
                op: OP,
                detail: format!(
                    "{keys} cached keys of head dimension {} take {iterations} loop iterations a row, \
                     past the device's loop budget of {}",
                    c.d, self.loop_budget
                ),
            }
            .into());
        }
        let out = self.alloc_f32(q.shape.clone())?;
        let lse = self.alloc_f32(Shape::new([c.b, c.hq, c.tq]))?;
        let rows = c.b * c.hq * c.tq;
        // One row of B reads only its cache's first `len` positions.
        let kv_count = match c.b {
            1 => len * c.hkv * c.d,
            _ => k.numel(),
        };
        let (qv, kv, vv) = (
            self.full(q)?,
            self.view(k, 0, kv_count)?,
            self.view(v, 0, kv_count)?,
        );
        let (ov, lv) = (self.full(&out)?, self.full(&lse)?);
        let scale = 1.0 / (c.d as f32).sqrt();
        let params = [
            u(c.b),
            u(c.tq),
            u(c.tc),
            u(len),
            u(c.hq),
            u(c.hkv),
            u(c.d),
            mask.window.map_or(0, u),
            f(scale),
            mask.softcap.map_or(0, |s| f(s.get())),
            qv.elem_off,
            kv.elem_off,
            vv.elem_off,
            ov.elem_off,
            lv.elem_off,
            u(rows),
        ];
        let mut op = self.op(OP);
        op.dispatch(Kernel::AttnCached, &params, &[qv, kv, vv, ov, lv], grid_for(rows));
        op.finish()?;
        Ok(AttentionOut { out, lse, mask })
    }
}
