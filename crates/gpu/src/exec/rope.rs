//! Rotary embedding, and the device tables of its angles.
//!
//! The cos/sin tables are built on the host in f64 (an f32 angle pos·θ^(−2i/D)
//! loses ~1e-4 rad at positions in the thousands), with the CPU reference's
//! own function, so both executors rotate by the same f32 values. They are
//! built once per (θ, scaling, D) and kept on the device: a Qwen2.5-7B step at
//! T = 1024 rotates 168 times, and rebuilding the table each time cost the
//! recording thread 11 M `sin_cos` per step and two queue writes per call,
//! each of which could force the pending batch onto the queue.

use std::collections::HashMap;
use std::sync::Mutex;

use megatrain_tensor::cpu::reference::rope_tables_for;
use megatrain_tensor::{Error, Result, Rope};

use super::{GpuExecutor, f, grid_for, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// `STORE_MAX`, `INTERLEAVED` and `DOCS` of `shaders/rope.wgsl`.
const STORE_MAX: u32 = 1;
const INTERLEAVED: u32 = 2;
const DOCS: u32 = 4;

/// Positions a new table covers at least: a training step's T is usually
/// within it, and a generation growing one token at a time rebuilds only
/// when it doubles past the end.
const MIN_POSITIONS: usize = 256;

/// The angle tables of one (θ, scaling, rotated D): `[positions, D/2]`
/// each, position 0 first.
pub(crate) struct RopeTable {
    positions: usize,
    cos: GpuTensor,
    sin: GpuTensor,
}

/// Tables by [`TableKey`]. A table that grows replaces the old one, whose
/// buffer goes back to the pool while an op may still be pending on it;
/// that is safe as for any temporary: a later op that writes it comes after
/// in queue order, and a queue write into it first submits the pending
/// batch (`batch.rs`).
#[derive(Default)]
pub(crate) struct RopeTables(Mutex<HashMap<TableKey, RopeTable>>);

/// θ's bits, the scaling's key, the rotated D.
type TableKey = (u64, [u64; 7], usize);

impl GpuExecutor {
    /// The tables of `rope`'s θ and scaling for heads of `dim`, cos and
    /// sin, covering at least positions `0..end`; builds or grows them when
    /// they do not.
    fn rope_table(&self, rope: &Rope, dim: usize, end: usize) -> Result<(GpuTensor, GpuTensor)> {
        let mut map = self.rope_tables.0.lock().unwrap();
        let key = (rope.theta.to_bits(), rope.scaling.key(end), dim);
        if let Some(t) = map.get(&key).filter(|t| t.positions >= end) {
            return Ok((t.cos.clone(), t.sin.clone()));
        }
        let have = map.get(&key).map_or(0, |t| t.positions);
        let positions = end.max(2 * have).max(MIN_POSITIONS);
        let from_zero = Rope {
            offset: 0,
            ..rope.clone()
        };
        // The frequencies of this call's positions, over the table's.
        let (cos, sin) = rope_tables_for::<f32>(positions, dim, &from_zero, end);
        let table = RopeTable {
            positions,
            cos: self.upload_words(bytemuck::cast_slice(&cos))?,
            sin: self.upload_words(bytemuck::cast_slice(&sin))?,
        };
        let out = (table.cos.clone(), table.sin.clone());
        map.insert(key, table);
        Ok(out)
    }

    pub(crate) fn rope_impl(&self, x: &GpuTensor, rope: Rope, sign: f32) -> Result<GpuTensor> {
        let name = if sign > 0.0 { "rope" } else { "rope_backward" };
        need_f32(name, x)?;
        let d = x.dims();
        if d.len() != 4 {
            return Err(Error::shape(name, format!("x {} must be [B, T, H, D]", x.shape)));
        }
        let (t, h, dim) = (d[1], d[2], d[3]);
        if let Some(docs) = &rope.docs {
            docs.check(name, d[0], t)?;
        }
        let rot = rope
            .rotated(name, dim)
            .map_err(|e| Error::shape(name, format!("x {}: {e}", x.shape)))?;
        let half = rot / 2;
        // Per row: a pair per rotated two, and the entries passed through.
        let per_row = dim - half;
        let y = self.alloc_f32(x.shape.clone())?;
        let rows = d[0] * t * h;
        if rows == 0 || per_row == 0 {
            return Ok(y);
        }
        let end = rope.offset.checked_add(t).filter(|&e| u32::try_from(e).is_ok());
        let end = end.ok_or_else(|| {
            Error::shape(
                name,
                format!("positions {} + T = {t} pass the kernel's u32 range", rope.offset),
            )
        })?;
        let (cos_t, sin_t) = self.rope_table(&rope, rot, end)?;
        // Only the call's positions are bound: a table grown by a long
        // generation may pass the storage-binding limit as a whole. A
        // packed document's tokens take the rows of its own positions,
        // `Rope::position` − offset, which stay within the call's T.
        let (cv, sv) = (
            self.view(&cos_t, rope.offset * half, t * half)?,
            self.view(&sin_t, rope.offset * half, t * half)?,
        );
        debug_assert_eq!(cv.elem_off, sv.elem_off, "the two tables are laid out alike");
        let mut op = self.op(name);
        let chunks = self.row_chunks(rows, &[dim])?;
        let grid = |nr: usize| grid_for((nr * per_row).div_ceil(256));
        // Under F16 one max word per workgroup (`STORE_MAX` in rope.wgsl),
        // remembered with y and folded when a product first reads it.
        let slots: usize = chunks
            .iter()
            .map(|&(_, nr)| grid(nr).iter().map(|&g| g as usize).product::<usize>())
            .sum();
        let partials = self.maxima_slots(self.folds_maxima(), slots)?;
        let docs = self.docs_bounds(rope.docs.as_ref())?;
        let docs_view = docs.view(self)?;
        let mut flags = partials.as_ref().map_or(0, |_| STORE_MAX);
        if rope.interleaved {
            flags |= INTERLEAVED;
        }
        if docs.some() {
            flags |= DOCS;
        }
        let mut base = 0;
        for (r0, nr) in chunks {
            let xv = self.view(x, r0 * dim, nr * dim)?;
            let yv = self.view(&y, r0 * dim, nr * dim)?;
            let maxv = self.maxima_view(&partials, (0, slots), yv)?;
            let params = [
                u(nr * per_row),
                u(t),
                u(h),
                u(half),
                xv.elem_off,
                yv.elem_off,
                u(r0),
                f(sign),
                cv.elem_off,
                flags,
                maxv.elem_off + u(base),
                u(dim),
                // Each token's start from row 0's: rope.wgsl indexes it by
                // the token's index in the whole batch.
                docs_view.elem_off,
            ];
            let g = grid(nr);
            op.dispatch(Kernel::Rope, &params, &[xv, cv, sv, yv, maxv, docs_view], g);
            base += g.iter().map(|&g| g as usize).product::<usize>();
        }
        self.remember_maxima_slots(&y, partials);
        op.finish()?;
        Ok(y)
    }
}
