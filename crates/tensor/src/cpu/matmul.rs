//! [`Executor::matmul`](crate::Executor::matmul) and its backward on the
//! reference executor: validation, then the reference GEMMs; a bf16/f16
//! `b` goes through [`packed`], widened a panel at a time.

use crate::cpu::Real;
use crate::cpu::exec::{RefExecutor, T, f32_data, out};
use crate::cpu::f16_operands::{scale_round, unscale};
use crate::cpu::packed::{self, Packed, Panel, Widen};
use crate::cpu::reference::{self as r, MatmulDims};
use crate::cpu::tensor::Store;
use crate::{
    ComputePrecision, Error, Executor, MatmulGrads, MatmulNeeds, Result, Shape, TensorHandle, Transpose,
    f16_scale_exponent,
};

/// The elements of a bf16/f16-stored tensor; `None` for an f32-stored one.
pub(super) fn packed_of<F>(t: &T<F>) -> Option<Packed<'_>> {
    match t.store() {
        Store::Wide(_) => None,
        Store::BF16(v) => Some(Packed::BF16(v)),
        Store::F16(v) => Some(Packed::F16(v)),
    }
}

/// Sizes and output shape of a matmul, from the operand shapes.
fn matmul_dims<F>(op: &'static str, a: &T<F>, b: &T<F>, t: Transpose) -> Result<(MatmulDims, Shape)> {
    let (ad, bd) = (a.dims(), b.dims());
    let err = |why: &str| {
        Error::shape(
            op,
            format!("a {} b {} (transpose {t:?}): {why}", a.shape(), b.shape()),
        )
    };
    if ad.len() < 2 {
        return Err(err("a must have rank >= 2"));
    }
    let lead = &ad[..ad.len() - 2];
    let (m, k) = if t.a {
        (ad[ad.len() - 1], ad[ad.len() - 2])
    } else {
        (ad[ad.len() - 2], ad[ad.len() - 1])
    };
    let b_batched = match bd.len() {
        2 => false,
        n if n == ad.len() && &bd[..n - 2] == lead => true,
        _ => return Err(err("b must be 2-D or have the leading dims of a")),
    };
    let (bk, n) = if t.b {
        (bd[bd.len() - 1], bd[bd.len() - 2])
    } else {
        (bd[bd.len() - 2], bd[bd.len() - 1])
    };
    if bk != k {
        return Err(err(&format!("inner dims differ ({k} vs {bk})")));
    }
    let mut oshape = lead.to_vec();
    oshape.extend([m, n]);
    let batch = lead.iter().product();
    Ok((
        MatmulDims {
            batch,
            m,
            k,
            n,
            b_batched,
        },
        Shape::new(oshape),
    ))
}

/// A matmul's `b` as the executor stores it.
#[derive(Clone, Copy)]
enum Operand<'a, F> {
    Wide(&'a [F]),
    Packed(Packed<'a>),
}

/// Elements of a weight gradient computed at once when it is accumulated
/// ([`Executor::matmul_backward_into`]): 16 MiB of f32 against the 2.2 GB
/// of a 152k × 3584 head's gradient.
const DB_PANEL: usize = 1 << 22;

/// [`r::matmul_backward`] under [`ComputePrecision::F16`]: both products
/// (dout · op(b)ᵀ and op(a)ᵀ · dout) read scaled, rounded operands and are
/// unscaled; `dbias` is a sum of `dout` in f32, not a product.
fn f16_matmul_backward<F: Real>(
    a: &[F],
    b: Operand<'_, F>,
    dout: &[F],
    d: MatmulDims,
    t: Transpose,
    needs: MatmulNeeds,
    db_acc: Option<&mut [F]>,
) -> MatmulGrads<Vec<F>> {
    let dq = scale_round(dout);
    let da = needs.da.then(|| {
        let (mut da, eb) = match b {
            Operand::Wide(b) => {
                let bq = scale_round(b);
                (r::matmul_da(&bq.values, &dq.values, d, t), bq.exponent)
            }
            Operand::Packed(pb) => {
                let eb = f16_scale_exponent(pb.max_abs());
                let w = Widen::F16Scaled(eb);
                (packed::matmul_da(pb, &dq.values, d, t, w, Panel::DEFAULT), eb)
            }
        };
        unscale(&mut da, dq.exponent + eb);
        da
    });
    let db = needs.db.then(|| {
        let aq = scale_round(a);
        let mut db = r::matmul_db(&aq.values, &dq.values, d, t);
        unscale(&mut db, dq.exponent + aq.exponent);
        db
    });
    if let Some(acc) = db_acc {
        let aq = scale_round(a);
        let e = dq.exponent + aq.exponent;
        r::matmul_db_acc(&aq.values, &dq.values, d, t, acc, DB_PANEL, |p| unscale(p, e));
    }
    MatmulGrads {
        da,
        db,
        dbias: needs.dbias.then(|| r::bias_grad(dout, d.n)),
    }
}

impl<F: Real> RefExecutor<F> {
    /// [`Executor::matmul`] with a bf16/f16-stored `b`, widened a panel at a
    /// time: the same bits as on the widened `b`.
    fn packed_matmul(
        &self,
        a: &[F],
        b: Packed<'_>,
        bias: Option<&[F]>,
        d: MatmulDims,
        t: Transpose,
    ) -> Vec<F> {
        let mut y = match self.compute_precision() {
            ComputePrecision::F32 => packed::matmul(a, b, d, t, Widen::Exact, Panel::DEFAULT),
            ComputePrecision::F16 => {
                let aq = scale_round(a);
                let eb = f16_scale_exponent(b.max_abs());
                let w = Widen::F16Scaled(eb);
                let mut y = packed::matmul(&aq.values, b, d, t, w, Panel::DEFAULT);
                unscale(&mut y, aq.exponent + eb);
                y
            }
        };
        if let Some(bias) = bias {
            // After the product (and its unscaling), as on a widened `b`.
            r::add_bias(&mut y, bias);
        }
        y
    }

    pub(super) fn matmul_impl(&self, a: &T<F>, b: &T<F>, bias: Option<&T<F>>, t: Transpose) -> Result<T<F>> {
        let (d, oshape) = matmul_dims("matmul", a, b, t)?;
        let bias = match bias {
            Some(bias) if bias.dims() != [d.n] => {
                return Err(Error::shape(
                    "matmul",
                    format!("bias {} must be [{}]", bias.shape(), d.n),
                ));
            }
            Some(bias) => Some(f32_data("matmul", bias)?),
            None => None,
        };
        let a = f32_data("matmul", a)?;
        if let Some(pb) = packed_of(b) {
            return Ok(out(oshape, self.packed_matmul(a, pb, bias, d, t)));
        }
        let y = match self.compute_precision() {
            ComputePrecision::F32 => r::matmul(a, b.data(), bias, d, t),
            ComputePrecision::F16 => {
                let (a, b) = (scale_round(a), scale_round(b.data()));
                let mut y = r::matmul(&a.values, &b.values, None, d, t);
                unscale(&mut y, a.exponent + b.exponent);
                if let Some(bias) = bias {
                    // The bias is added in f32, after the product.
                    r::add_bias(&mut y, bias);
                }
                y
            }
        };
        Ok(out(oshape, y))
    }

    pub(super) fn matmul_backward_impl(
        &self,
        a: &T<F>,
        b: &T<F>,
        dout: &T<F>,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<T<F>>> {
        self.backward(a, b, dout, t, needs, None)
    }

    pub(super) fn matmul_backward_into_impl(
        &self,
        a: &T<F>,
        b: &T<F>,
        dout: &T<F>,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: &mut T<F>,
    ) -> Result<MatmulGrads<T<F>>> {
        crate::check_db_acc(db_acc.shape(), db_acc.dtype(), b.shape())?;
        let needs = MatmulNeeds { db: false, ..needs };
        self.backward(a, b, dout, t, needs, Some(db_acc.data_mut()))
    }

    /// Both backward entry points; `db_acc` receives `b`'s gradient added
    /// in (then `needs.db` is false).
    fn backward(
        &self,
        a: &T<F>,
        b: &T<F>,
        dout: &T<F>,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: Option<&mut [F]>,
    ) -> Result<MatmulGrads<T<F>>> {
        let op = "matmul_backward";
        let (d, oshape) = matmul_dims(op, a, b, t)?;
        if dout.shape() != &oshape {
            return Err(Error::shape(
                op,
                format!("dout {} must be {oshape}", dout.shape()),
            ));
        }
        let (av, dv) = (f32_data(op, a)?, f32_data(op, dout)?);
        let bv = match packed_of(b) {
            Some(pb) => Operand::Packed(pb),
            None => Operand::Wide(b.data()),
        };
        let g = match (self.compute_precision(), bv) {
            (ComputePrecision::F32, bv) => {
                let g = match bv {
                    Operand::Wide(bw) => r::matmul_backward(av, bw, dv, d, t, needs),
                    Operand::Packed(pb) => MatmulGrads {
                        da: needs
                            .da
                            .then(|| packed::matmul_da(pb, dv, d, t, Widen::Exact, Panel::DEFAULT)),
                        db: needs.db.then(|| r::matmul_db(av, dv, d, t)),
                        dbias: needs.dbias.then(|| r::bias_grad(dv, d.n)),
                    },
                };
                if let Some(acc) = db_acc {
                    r::matmul_db_acc(av, dv, d, t, acc, DB_PANEL, |_| {});
                }
                g
            }
            (ComputePrecision::F16, bv) => f16_matmul_backward(av, bv, dv, d, t, needs, db_acc),
        };
        Ok(MatmulGrads {
            da: g.da.map(|v| out(a.shape().clone(), v)),
            db: g.db.map(|v| out(b.shape().clone(), v)),
            dbias: g.dbias.map(|v| out(Shape::new([d.n]), v)),
        })
    }
}
