//! Fused ops composed from the plain ones: the provided defaults of the
//! [`Executor`] trait's fusions (what an executor without a fused kernel
//! runs), and the reference each fused kernel is compared with.

use crate::{
    AddNormOut, DType, Error, Executor, Glu, MatmulGrads, MatmulNeeds, NormGrads, Result, Shape,
    TensorHandle, Transpose,
};

/// [`Executor::add_rmsnorm`] from the unfused ops (its provided default).
pub fn compose_add_rmsnorm<E: Executor + ?Sized>(
    ex: &E,
    x: &E::Tensor,
    r: &E::Tensor,
    w: &E::Tensor,
    eps: f32,
) -> Result<AddNormOut<E::Tensor>> {
    let h = ex.add(x, r)?;
    let norm = ex.rmsnorm(&h, w, eps)?;
    Ok(AddNormOut { h, norm })
}

/// [`Executor::add_rmsnorm_backward`] from the unfused ops.
pub fn compose_add_rmsnorm_backward<E: Executor + ?Sized>(
    ex: &E,
    h: &E::Tensor,
    w: &E::Tensor,
    rstd: &E::Tensor,
    dy: &E::Tensor,
    dh: &E::Tensor,
) -> Result<NormGrads<E::Tensor>> {
    same_dims("add_rmsnorm_backward", h, dh)?;
    let mut g = ex.rmsnorm_backward(h, w, rstd, dy)?;
    ex.add_assign(&mut g.dx, dh)?;
    Ok(g)
}

/// [`Executor::add_layernorm`] from the unfused ops.
pub fn compose_add_layernorm<E: Executor + ?Sized>(
    ex: &E,
    x: &E::Tensor,
    r: &E::Tensor,
    w: &E::Tensor,
    b: &E::Tensor,
    eps: f32,
) -> Result<AddNormOut<E::Tensor>> {
    let h = ex.add(x, r)?;
    let norm = ex.layernorm(&h, w, b, eps)?;
    Ok(AddNormOut { h, norm })
}

/// [`Executor::add_layernorm_backward`] from the unfused ops.
pub fn compose_add_layernorm_backward<E: Executor + ?Sized>(
    ex: &E,
    h: &E::Tensor,
    w: &E::Tensor,
    mean: &E::Tensor,
    rstd: &E::Tensor,
    dy: &E::Tensor,
    dh: &E::Tensor,
) -> Result<NormGrads<E::Tensor>> {
    same_dims("add_layernorm_backward", h, dh)?;
    let mut g = ex.layernorm_backward(h, w, mean, rstd, dy)?;
    ex.add_assign(&mut g.dx, dh)?;
    Ok(g)
}

/// Checks an activation operand of a fused matmul: f32, of `want`'s shape
/// (`want_what` names that shape in the error).
pub fn check_act_operand<T: TensorHandle>(
    op: &'static str,
    name: &str,
    x: &T,
    want: &Shape,
    want_what: &str,
) -> Result<()> {
    if x.dtype() != DType::F32 {
        return Err(Error::DType {
            op,
            expected: DType::F32,
            got: x.dtype(),
        });
    }
    if x.shape() != want {
        return Err(Error::shape(
            op,
            format!("{name} {} must have {want_what} {want}", x.shape()),
        ));
    }
    Ok(())
}

/// [`Executor::matmul_gelu`] from the unfused ops.
pub fn compose_matmul_gelu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    bias: Option<&E::Tensor>,
    t: Transpose,
) -> Result<(E::Tensor, E::Tensor)> {
    let f = ex.matmul(a, b, bias, t)?;
    let g = ex.gelu(&f)?;
    Ok((f, g))
}

/// [`Executor::matmul_swiglu`] from the unfused ops.
pub fn compose_matmul_swiglu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    bias: Option<&E::Tensor>,
    t: Transpose,
    gate: &E::Tensor,
) -> Result<(E::Tensor, E::Tensor)> {
    compose_matmul_glu(ex, a, b, bias, t, gate, Glu::Silu)
}

/// [`Executor::matmul_swiglu`] or [`Executor::matmul_geglu`] (as `glu`
/// says) from the unfused ops.
pub fn compose_matmul_glu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    bias: Option<&E::Tensor>,
    t: Transpose,
    gate: &E::Tensor,
    glu: Glu,
) -> Result<(E::Tensor, E::Tensor)> {
    let up = ex.matmul(a, b, bias, t)?;
    check_act_operand(glu.matmul_op(), "gate", gate, up.shape(), "the product's shape")?;
    let s = match glu {
        Glu::Silu => ex.swiglu(gate, &up)?,
        Glu::Gelu => ex.geglu(gate, &up)?,
    };
    Ok((up, s))
}

/// [`Executor::matmul_backward_gelu`] from the unfused ops.
pub fn compose_matmul_backward_gelu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    dout: &E::Tensor,
    t: Transpose,
    needs: MatmulNeeds,
    pre: &E::Tensor,
) -> Result<MatmulGrads<E::Tensor>> {
    check_act_operand("matmul_backward_gelu", "pre", pre, a.shape(), "a's shape")?;
    let mut g = ex.matmul_backward(a, b, dout, t, MatmulNeeds { da: true, ..needs })?;
    let da = g.da.take().expect("da was requested");
    g.da = Some(ex.gelu_backward(pre, &da)?);
    Ok(g)
}

/// [`Executor::matmul_backward_swiglu`] from the unfused ops.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn compose_matmul_backward_swiglu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    dout: &E::Tensor,
    t: Transpose,
    needs: MatmulNeeds,
    gate: &E::Tensor,
    up: &E::Tensor,
) -> Result<(MatmulGrads<E::Tensor>, E::Tensor, E::Tensor)> {
    compose_matmul_backward_glu(ex, a, b, dout, t, needs, gate, up, Glu::Silu)
}

/// [`Executor::matmul_backward_swiglu`] or
/// [`Executor::matmul_backward_geglu`] (as `glu` says) from the unfused ops.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn compose_matmul_backward_glu<E: Executor + ?Sized>(
    ex: &E,
    a: &E::Tensor,
    b: &E::Tensor,
    dout: &E::Tensor,
    t: Transpose,
    needs: MatmulNeeds,
    gate: &E::Tensor,
    up: &E::Tensor,
    glu: Glu,
) -> Result<(MatmulGrads<E::Tensor>, E::Tensor, E::Tensor)> {
    let op = glu.matmul_backward_op();
    check_act_operand(op, "gate", gate, a.shape(), "a's shape")?;
    check_act_operand(op, "up", up, a.shape(), "a's shape")?;
    let mut g = ex.matmul_backward(a, b, dout, t, MatmulNeeds { da: true, ..needs })?;
    let ds = g.da.take().expect("da was requested");
    let (dgate, dup) = match glu {
        Glu::Silu => ex.swiglu_backward(gate, up, &ds)?,
        Glu::Gelu => ex.geglu_backward(gate, up, &ds)?,
    };
    Ok((g, dgate, dup))
}

/// `add_assign` accepts any equal element count; the residual gradient
/// must have the stream's shape.
fn same_dims<T: TensorHandle>(op: &'static str, h: &T, dh: &T) -> Result<()> {
    if h.shape() == dh.shape() {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            format!("residual gradient dh {} must match h {}", dh.shape(), h.shape()),
        ))
    }
}
