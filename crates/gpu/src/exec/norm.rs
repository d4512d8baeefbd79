//! RMSNorm, LayerNorm and rotary embedding.

use megatrain_tensor::{Error, NormGrads, NormOut, Result, Rope};

use super::{GpuExecutor, f, grid_for, need_f32, same_shape, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

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

    pub(crate) fn norm_fwd(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        b: Option<&GpuTensor>,
        eps: f32,
    ) -> Result<NormOut<GpuTensor>> {
        let name = if b.is_some() { "layernorm" } else { "rmsnorm" };
        let (rows, c) = Self::check_norm(name, x, w)?;
        if let Some(b) = b {
            need_f32(name, b)?;
            same_shape(name, w, b)?;
        }
        let y = self.alloc_f32(x.shape.clone())?;
        let rstd = self.alloc_f32([rows])?;
        let mean = b.map(|_| self.alloc_f32([rows])).transpose()?;
        let wv = self.full(w)?;
        let mut op = self.op(name);
        for (r0, nr) in self.row_chunks(rows, &[c])? {
            let xv = self.view(x, r0 * c, nr * c)?;
            let yv = self.view(&y, r0 * c, nr * c)?;
            let rv = self.view(&rstd, r0, nr)?;
            match (b, &mean) {
                (Some(b), Some(mean)) => {
                    let bv = self.full(b)?;
                    let mv = self.view(mean, r0, nr)?;
                    let params = [
                        u(nr),
                        u(c),
                        f(eps),
                        0,
                        xv.elem_off,
                        wv.elem_off,
                        bv.elem_off,
                        yv.elem_off,
                        rv.elem_off,
                        mv.elem_off,
                        0,
                        0,
                    ];
                    op.dispatch(Kernel::LnFwd, &params, &[xv, wv, bv, yv, rv, mv], grid_for(nr));
                }
                _ => {
                    let params = [
                        u(nr),
                        u(c),
                        f(eps),
                        0,
                        xv.elem_off,
                        wv.elem_off,
                        0,
                        yv.elem_off,
                        rv.elem_off,
                        0,
                        0,
                        0,
                    ];
                    op.dispatch(Kernel::RmsFwd, &params, &[xv, wv, yv, rv], grid_for(nr));
                }
            }
        }
        op.finish()?;
        Ok(NormOut { y, mean, rstd })
    }

    pub(crate) fn norm_bwd(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        mean: Option<&GpuTensor>,
        rstd: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<NormGrads<GpuTensor>> {
        let name = if mean.is_some() {
            "layernorm_backward"
        } else {
            "rmsnorm_backward"
        };
        let (rows, c) = Self::check_norm(name, x, w)?;
        need_f32(name, dy)?;
        same_shape(name, x, dy)?;
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
        for (r0, nr) in self.loop_chunks(rows, &[c])? {
            let xv = self.view(x, r0 * c, nr * c)?;
            let dyv = self.view(dy, r0 * c, nr * c)?;
            let dxv = self.view(&dx, r0 * c, nr * c)?;
            let rv = self.view(rstd, r0, nr)?;
            let mv = match mean {
                Some(m) => self.view(m, r0, nr)?,
                None => self.dummy(),
            };
            let params = [
                u(nr),
                u(c),
                0,
                0,
                xv.elem_off,
                wv.elem_off,
                dyv.elem_off,
                dxv.elem_off,
                0,
                0,
                rv.elem_off,
                mv.elem_off,
            ];
            if mean.is_some() {
                op.dispatch(Kernel::LnBwd, &params, &[xv, wv, dyv, dxv, rv, mv], grid_for(nr));
            } else {
                op.dispatch(Kernel::RmsBwd, &params, &[xv, wv, dyv, dxv, rv], grid_for(nr));
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
            let params = [
                u(nr),
                u(c),
                0,
                flags,
                xv.elem_off,
                0,
                dyv.elem_off,
                dwv.elem_off,
                dbv.elem_off,
                0,
                rv.elem_off,
                mv.elem_off,
            ];
            op.dispatch(
                Kernel::NormDw,
                &params,
                &[xv, dyv, dwv, dbv, rv, mv],
                grid_for(c.div_ceil(256)),
            );
            if let Some(s) = scratch {
                op.keep(s);
            }
        }
        op.finish()?;
        Ok(NormGrads { dx, dw, db })
    }

    pub(crate) fn rope_impl(&self, x: &GpuTensor, rope: Rope, sign: f32) -> Result<GpuTensor> {
        let name = if sign > 0.0 { "rope" } else { "rope_backward" };
        need_f32(name, x)?;
        let d = x.dims();
        if d.len() != 4 || !d[3].is_multiple_of(2) {
            return Err(Error::shape(
                name,
                format!("x {} must be [B, T, H, D] with D even", x.shape),
            ));
        }
        let (t, h, dim) = (d[1], d[2], d[3]);
        let half = dim / 2;
        // The angle table is built in f64 on the host: exact to f32 rounding.
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for pos in 0..t {
            let p = (rope.offset + pos) as f64;
            for i in 0..half {
                let inv = rope.theta.powf(-2.0 * i as f64 / dim as f64);
                let (s, c) = (p * inv).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        let cos_t = self.upload_words(bytemuck::cast_slice(&cos))?;
        let sin_t = self.upload_words(bytemuck::cast_slice(&sin))?;
        let y = self.alloc_f32(x.shape.clone())?;
        let rows = d[0] * t * h;
        let (cv, sv) = (self.full(&cos_t)?, self.full(&sin_t)?);
        let mut op = self.op(name);
        for (r0, nr) in self.row_chunks(rows, &[dim])? {
            let xv = self.view(x, r0 * dim, nr * dim)?;
            let yv = self.view(&y, r0 * dim, nr * dim)?;
            let params = [
                u(nr * half),
                u(t),
                u(h),
                u(half),
                xv.elem_off,
                yv.elem_off,
                u(r0),
                f(sign),
            ];
            op.dispatch(
                Kernel::Rope,
                &params,
                &[xv, cv, sv, yv],
                grid_for((nr * half).div_ceil(256)),
            );
        }
        op.finish()?;
        Ok(y)
    }
}
