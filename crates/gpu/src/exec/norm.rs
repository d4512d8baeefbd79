//! RMSNorm and LayerNorm, alone or fused with the residual add before them,
//! and the row dot products that share their row reduction.

use megatrain_tensor::{Error, NormGrads, NormOut, Result};

use super::{GpuExecutor, f, grid_for, need_f32, rows_and_width, same_shape, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Rows one workgroup of the split weight-gradient sum covers.
const DW_BLOCK_ROWS: usize = 64;

/// The uniform block of `shaders/norm.wgsl`: element offsets of the
/// operand at each binding number.
#[derive(Default)]
struct NormParams {
    rows: u32,
    c: u32,
    eps: u32,
    flags: u32,
    x: u32,
    w: u32,
    b3: u32,
    o4: u32,
    o5: u32,
    o6: u32,
    r7: u32,
    r8: u32,
    r9: u32,
    o10: u32,
    blk_rows: u32,
    max_off: u32,
}

impl NormParams {
    fn words(&self) -> [u32; 16] {
        [
            self.rows,
            self.c,
            self.eps,
            self.flags,
            self.x,
            self.w,
            self.b3,
            self.o4,
            self.o5,
            self.o6,
            self.r7,
            self.r8,
            self.r9,
            self.o10,
            self.blk_rows,
            self.max_off,
        ]
    }
}

/// `STORE_MAX` of `shaders/norm.wgsl`.
const STORE_MAX: u32 = 4;

fn store_max(rowmax: &Option<GpuTensor>) -> u32 {
    if rowmax.is_some() { STORE_MAX } else { 0 }
}

impl GpuExecutor {
    fn check_norm(op: &'static str, x: &GpuTensor, w: &GpuTensor) -> Result<(usize, usize)> {
        need_f32(op, x)?;
        need_f32(op, w)?;
        let c = x.shape.last();
        if w.dims() != [c] {
            return Err(Error::shape(
                op,
                format!("weight {} for rows of {c} in {}", w.shape, x.shape),
            ));
        }
        Ok((x.shape.rows(), c))
    }

    /// The norm of `x`, or with `res` the norm of `h = x + res` (returned
    /// beside it) in the same kernel.
    pub(crate) fn norm_fwd(
        &self,
        x: &GpuTensor,
        res: Option<&GpuTensor>,
        w: &GpuTensor,
        b: Option<&GpuTensor>,
        eps: f32,
    ) -> Result<(Option<GpuTensor>, NormOut<GpuTensor>)> {
        let name = match (res.is_some(), b.is_some()) {
            (false, false) => "rmsnorm",
            (false, true) => "layernorm",
            (true, false) => "add_rmsnorm",
            (true, true) => "add_layernorm",
        };
        let (rows, c) = Self::check_norm(name, x, w)?;
        if let Some(b) = b {
            need_f32(name, b)?;
            same_shape(name, w, b)?;
        }
        if let Some(r) = res {
            need_f32(name, r)?;
            same_shape(name, x, r)?;
        }
        let h = res.map(|_| self.alloc_f32(x.shape.clone())).transpose()?;
        let y = self.alloc_f32(x.shape.clone())?;
        let rstd = self.alloc_f32([rows])?;
        let mean = b.map(|_| self.alloc_f32([rows])).transpose()?;
        let wv = self.full(w)?;
        let bv = b.map(|b| self.full(b)).transpose()?;
        let mut op = self.op(name);
        let rowmax = self.maxima_slots(self.folds_maxima(), rows)?;
        for (r0, nr) in self.row_chunks(rows, &[c])? {
            let xv = self.view(x, r0 * c, nr * c)?;
            let yv = self.view(&y, r0 * c, nr * c)?;
            let maxv = self.maxima_view(&rowmax, (r0, nr), yv)?;
            let rv = self.view(&rstd, r0, nr)?;
            let mv = mean.as_ref().map(|m| self.view(m, r0, nr)).transpose()?;
            let resv = res.map(|t| self.view(t, r0 * c, nr * c)).transpose()?;
            let hv = h.as_ref().map(|t| self.view(t, r0 * c, nr * c)).transpose()?;
            let p = NormParams {
                rows: u(nr),
                c: u(c),
                eps: f(eps),
                x: xv.elem_off,
                w: wv.elem_off,
                b3: bv.map_or(0, |v| v.elem_off),
                o4: yv.elem_off,
                o5: rv.elem_off,
                o6: mv.map_or(0, |v| v.elem_off),
                r9: resv.map_or(0, |v| v.elem_off),
                o10: hv.map_or(0, |v| v.elem_off),
                flags: store_max(&rowmax),
                max_off: maxv.elem_off,
                ..Default::default()
            }
            .words();
            let grid = grid_for(nr);
            match (bv, mv, resv, hv) {
                (Some(bv), Some(mv), Some(resv), Some(hv)) => op.dispatch(
                    Kernel::AddLnFwd,
                    &p,
                    &[xv, wv, bv, yv, rv, mv, resv, hv, maxv],
                    grid,
                ),
                (Some(bv), Some(mv), None, None) => {
                    op.dispatch(Kernel::LnFwd, &p, &[xv, wv, bv, yv, rv, mv, maxv], grid)
                }
                (None, None, Some(resv), Some(hv)) => {
                    op.dispatch(Kernel::AddRmsFwd, &p, &[xv, wv, yv, rv, resv, hv, maxv], grid)
                }
                _ => op.dispatch(Kernel::RmsFwd, &p, &[xv, wv, yv, rv, maxv], grid),
            }
        }
        self.remember_maxima_slots(&y, rowmax);
        op.finish()?;
        Ok((h, NormOut { y, mean, rstd }))
    }

    /// The norm's backward; with `dres`, the residual stream's gradient is
    /// added to `dx` in the same kernel.
    pub(crate) fn norm_bwd(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        mean: Option<&GpuTensor>,
        rstd: &GpuTensor,
        dy: &GpuTensor,
        dres: Option<&GpuTensor>,
    ) -> Result<NormGrads<GpuTensor>> {
        let name = match (dres.is_some(), mean.is_some()) {
            (false, false) => "rmsnorm_backward",
            (false, true) => "layernorm_backward",
            (true, false) => "add_rmsnorm_backward",
            (true, true) => "add_layernorm_backward",
        };
        let (rows, c) = Self::check_norm(name, x, w)?;
        need_f32(name, dy)?;
        same_shape(name, x, dy)?;
        if let Some(d) = dres {
            need_f32(name, d)?;
            same_shape(name, x, d)?;
        }
        for s in std::iter::once(rstd).chain(mean) {
            need_f32(name, s)?;
            if s.numel() != rows {
                return Err(Error::shape(
                    name,
                    format!("row statistic {} for {rows} rows", s.shape),
                ));
            }
        }
        let dx = self.alloc_f32(x.shape.clone())?;
        let dw = self.zeros_f32([c])?;
        let db = match mean {
            Some(_) => Some(self.zeros_f32([c])?),
            None => None,
        };
        let wv = self.full(w)?;
        let dwv = self.full(&dw)?;
        let mut op = self.op(name);
        let rowmax = self.maxima_slots(self.folds_maxima(), rows)?;
        for (r0, nr) in self.loop_chunks(rows, &[c])? {
            let xv = self.view(x, r0 * c, nr * c)?;
            let dyv = self.view(dy, r0 * c, nr * c)?;
            let dxv = self.view(&dx, r0 * c, nr * c)?;
            let maxv = self.maxima_view(&rowmax, (r0, nr), dxv)?;
            let rv = self.view(rstd, r0, nr)?;
            let mv = match mean {
                Some(m) => self.view(m, r0, nr)?,
                None => self.dummy(),
            };
            let resv = dres.map(|d| self.view(d, r0 * c, nr * c)).transpose()?;
            let p = NormParams {
                rows: u(nr),
                c: u(c),
                x: xv.elem_off,
                w: wv.elem_off,
                b3: dyv.elem_off,
                o4: dxv.elem_off,
                r7: rv.elem_off,
                r8: mv.elem_off,
                r9: resv.map_or(0, |v| v.elem_off),
                flags: store_max(&rowmax),
                max_off: maxv.elem_off,
                ..Default::default()
            }
            .words();
            let grid = grid_for(nr);
            match (mean.is_some(), resv) {
                (true, Some(resv)) => op.dispatch(
                    Kernel::AddLnBwd,
                    &p,
                    &[xv, wv, dyv, dxv, rv, mv, resv, maxv],
                    grid,
                ),
                (true, None) => op.dispatch(Kernel::LnBwd, &p, &[xv, wv, dyv, dxv, rv, mv, maxv], grid),
                (false, Some(resv)) => {
                    op.dispatch(Kernel::AddRmsBwd, &p, &[xv, wv, dyv, dxv, rv, resv, maxv], grid)
                }
                (false, None) => op.dispatch(Kernel::RmsBwd, &p, &[xv, wv, dyv, dxv, rv, maxv], grid),
            }
            // dw (and db): column sums; a scratch stands in for db under RMSNorm.
            let scratch = if db.is_none() {
                Some(self.alloc_f32([1])?)
            } else {
                None
            };
            let dbv = match (&db, &scratch) {
                (Some(db), _) => self.full(db)?,
                (None, Some(s)) => self.full(s)?,
                (None, None) => unreachable!("scratch exists when db does not"),
            };
            let flags = (mean.is_some() as u32) | (db.is_some() as u32) << 1;
            self.norm_dw(&mut op, nr, c, flags, [xv, dyv, rv, mv], dwv, dbv)?;
            if let Some(s) = scratch {
                op.keep(s);
            }
        }
        self.remember_maxima_slots(&dx, rowmax);
        op.finish()?;
        Ok(NormGrads { dx, dw, db })
    }

    /// `[rows]`: the dot product of each row of `a` with the same row of
    /// `b`, one workgroup per row.
    pub(crate) fn row_dots_impl(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        const OP: &str = "row_dots";
        need_f32(OP, a)?;
        need_f32(OP, b)?;
        if a.shape != b.shape || a.shape.rank() == 0 {
            return Err(Error::shape(
                OP,
                format!(
                    "a {} and b {} must be the same shape of rank ≥ 1",
                    a.shape, b.shape
                ),
            ));
        }
        let (rows, c) = rows_and_width(a);
        let out = self.alloc_f32([rows])?;
        if rows == 0 {
            return Ok(out);
        }
        let mut op = self.op(OP);
        for (r0, nr) in self.row_chunks(rows, &[c])? {
            let av = self.view(a, r0 * c, nr * c)?;
            let bv = self.view(b, r0 * c, nr * c)?;
            let ov = self.view(&out, r0, nr)?;
            let p = NormParams {
                rows: u(nr),
                c: u(c),
                x: av.elem_off,
                b3: bv.elem_off,
                o5: ov.elem_off,
                ..Default::default()
            }
            .words();
            op.dispatch(Kernel::RowDots, &p, &[av, bv, ov], grid_for(nr));
        }
        op.finish()?;
        Ok(out)
    }

    /// Column sums dw += Σ dy·x̂ (and db += Σ dy) over `rows` rows. One
    /// thread per column is too few threads for long columns on a large
    /// GPU: rows are summed in blocks by a 2-D grid into a scratch of
    /// partial rows, then the partials in order (a fixed association).
    /// Where the scratch would not fit one binding, or there is one block,
    /// a single pass does it.
    #[allow(clippy::too_many_arguments)]
    fn norm_dw(
        &self,
        op: &mut super::Op<'_>,
        rows: usize,
        c: usize,
        flags: u32,
        [xv, dyv, rv, mv]: [super::View<'_>; 4],
        dwv: super::View<'_>,
        dbv: super::View<'_>,
    ) -> Result<()> {
        let max_blocks = (self.max_binding_bytes() / (8 * c as u64).max(1)).min(65535) as usize;
        let blocks = rows.div_ceil(DW_BLOCK_ROWS).min(max_blocks);
        let col_groups = c.div_ceil(256);
        if blocks <= 1 {
            let p = NormParams {
                rows: u(rows),
                c: u(c),
                flags,
                x: xv.elem_off,
                b3: dyv.elem_off,
                o4: dwv.elem_off,
                o5: dbv.elem_off,
                r7: rv.elem_off,
                r8: mv.elem_off,
                ..Default::default()
            };
            op.dispatch(
                Kernel::NormDw,
                &p.words(),
                &[xv, dyv, dwv, dbv, rv, mv],
                grid_for(col_groups),
            );
            return Ok(());
        }
        let blk_rows = rows.div_ceil(blocks);
        let blocks = rows.div_ceil(blk_rows);
        let partial = self.alloc_f32([blocks * 2 * c])?;
        let pv = self.full(&partial)?;
        let p = NormParams {
            rows: u(rows),
            c: u(c),
            flags,
            x: xv.elem_off,
            b3: dyv.elem_off,
            o6: pv.elem_off,
            r7: rv.elem_off,
            r8: mv.elem_off,
            blk_rows: u(blk_rows),
            ..Default::default()
        };
        op.dispatch(
            Kernel::NormDwPart,
            &p.words(),
            &[xv, dyv, pv, rv, mv],
            [u(col_groups), u(blocks), 1],
        );
        let p = NormParams {
            rows: u(blocks),
            c: u(c),
            flags,
            o4: dwv.elem_off,
            o5: dbv.elem_off,
            o6: pv.elem_off,
            ..Default::default()
        };
        op.dispatch(
            Kernel::NormDwSum,
            &p.words(),
            &[dwv, dbv, pv],
            grid_for(col_groups),
        );
        op.keep(partial);
        Ok(())
    }
}
