//! The residual add fused with a norm ([`Executor::add_rmsnorm`] and
//! friends) on the reference executor: validation, then one pass per row.
//!
//! [`Executor::add_rmsnorm`]: crate::Executor::add_rmsnorm

use crate::cpu::Real;
use crate::cpu::exec::{RefExecutor, T, f32_data, norm_weight, out, row_stat, same_shape};
use crate::cpu::reference as r;
use crate::{AddNormOut, NormGrads, NormOut, Result, Shape, TensorHandle};

impl<F: Real> RefExecutor<F> {
    pub(super) fn add_rmsnorm_impl(
        &self,
        x: &T<F>,
        r: &T<F>,
        w: &T<F>,
        eps: f32,
    ) -> Result<AddNormOut<T<F>>> {
        let op = "add_rmsnorm";
        norm_weight(op, x, w, "w")?;
        same_shape(op, "x vs r", x, r)?;
        let (h, y, rstd) = r::add_rmsnorm(
            f32_data(op, x)?,
            f32_data(op, r)?,
            f32_data(op, w)?,
            F::from_f32(eps),
        );
        Ok(AddNormOut {
            h: out(x.shape().clone(), h),
            norm: NormOut {
                y: out(x.shape().clone(), y),
                mean: None,
                rstd: out(Shape::new([rstd.len()]), rstd),
            },
        })
    }

    pub(super) fn add_rmsnorm_backward_impl(
        &self,
        h: &T<F>,
        w: &T<F>,
        rstd: &T<F>,
        dy: &T<F>,
        dh: &T<F>,
    ) -> Result<NormGrads<T<F>>> {
        let op = "add_rmsnorm_backward";
        norm_weight(op, h, w, "w")?;
        row_stat(op, h, rstd, "rstd")?;
        same_shape(op, "h vs dy", h, dy)?;
        same_shape(op, "h vs dh", h, dh)?;
        let (dx, dw) = r::add_rmsnorm_backward(
            f32_data(op, h)?,
            f32_data(op, w)?,
            f32_data(op, rstd)?,
            f32_data(op, dy)?,
            f32_data(op, dh)?,
        );
        Ok(NormGrads {
            dx: out(h.shape().clone(), dx),
            dw: out(w.shape().clone(), dw),
            db: None,
        })
    }

    pub(super) fn add_layernorm_impl(
        &self,
        x: &T<F>,
        r: &T<F>,
        w: &T<F>,
        b: &T<F>,
        eps: f32,
    ) -> Result<AddNormOut<T<F>>> {
        let op = "add_layernorm";
        norm_weight(op, x, w, "w")?;
        norm_weight(op, x, b, "b")?;
        same_shape(op, "x vs r", x, r)?;
        let [h, y, mean, rstd] = r::add_layernorm(
            f32_data(op, x)?,
            f32_data(op, r)?,
            f32_data(op, w)?,
            f32_data(op, b)?,
            F::from_f32(eps),
        );
        let rows = Shape::new([rstd.len()]);
        Ok(AddNormOut {
            h: out(x.shape().clone(), h),
            norm: NormOut {
                y: out(x.shape().clone(), y),
                mean: Some(out(rows.clone(), mean)),
                rstd: out(rows, rstd),
            },
        })
    }

    pub(super) fn add_layernorm_backward_impl(
        &self,
        h: &T<F>,
        w: &T<F>,
        mean: &T<F>,
        rstd: &T<F>,
        dy: &T<F>,
        dh: &T<F>,
    ) -> Result<NormGrads<T<F>>> {
        let op = "add_layernorm_backward";
        norm_weight(op, h, w, "w")?;
        row_stat(op, h, mean, "mean")?;
        row_stat(op, h, rstd, "rstd")?;
        same_shape(op, "h vs dy", h, dy)?;
        same_shape(op, "h vs dh", h, dh)?;
        let (dx, dw, db) = r::add_layernorm_backward(
            f32_data(op, h)?,
            f32_data(op, w)?,
            f32_data(op, mean)?,
            f32_data(op, rstd)?,
            f32_data(op, dy)?,
            f32_data(op, dh)?,
        );
        Ok(NormGrads {
            dx: out(h.shape().clone(), dx),
            dw: out(w.shape().clone(), dw),
            db: Some(out(w.shape().clone(), db)),
        })
    }
}
