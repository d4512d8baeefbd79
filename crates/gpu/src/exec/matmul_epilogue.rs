//! Matmuls whose store applies the activation beside them
//! (`shaders/matmul_epilogue.wgsl`): GELU, SwiGLU and GeGLU where their input is
//! produced (forward), and their backward where their output's gradient
//! is produced, so that the activation costs no pass of its own over the
//! MLP's intermediates. Where the epilogue cannot see whole sums
//! (`matmul_epi` says so: K split over dispatches) the product and the
//! standalone activation kernel run one after the other.

use megatrain_tensor::{Error, Glu, MatmulGrads, MatmulNeeds, Result, Transpose, check_act_operand};

use super::matmul::{DaOut, Scales};
use super::{GpuExecutor, View, need_f32};
use crate::tensor::GpuTensor;

/// Where the epilogue's kind sits in the params' flags (`EPI_SHIFT` in
/// `shaders/matmul_params.wgsl`).
pub(super) const EPI_SHIFT: u32 = 5;

/// Which products apply their activation at their store
/// ([`GpuOptions::epilogues`](super::GpuOptions), `MEGATRAIN_EPILOGUES`)
/// and which write the product for the standalone activation kernel to
/// read. The values agree within a few ulps (the activation's arithmetic
/// compiled into another kernel), so this is a measurement setting: on
/// the H200 the fused SwiGLU backward took 12.9 ms at Qwen2.5-7B's down
/// projection (8192×18944×3584), twice the plain product of that size,
/// where the unfused pair should take about 7.5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Epilogues {
    /// Every product that can (K whole in one dispatch).
    #[default]
    All,
    /// The forward's products (GELU's and the GLUs' inputs); the
    /// backward's write the activation's output gradient for its kernel.
    Forward,
    /// None: every activation its own kernel.
    None,
}

impl Epilogues {
    pub(super) fn forward(self) -> bool {
        self != Epilogues::None
    }

    pub(super) fn backward(self) -> bool {
        self == Epilogues::All
    }
}

impl std::fmt::Display for Epilogues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Epilogues::All => "all",
            Epilogues::Forward => "forward",
            Epilogues::None => "none",
        })
    }
}

/// An activation applied at a product's store, with its operands (each of
/// C's shape and layout).
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    /// The product is the activation's output gradient: C = gelu'(pre) ⊙ it.
    GeluBwd { pre: &'a GpuTensor },
    /// The product is ds of `act(gate) · up`: C = dgate, `dup` = dup.
    GluBwd {
        glu: Glu,
        gate: &'a GpuTensor,
        up: &'a GpuTensor,
        dup: &'a GpuTensor,
    },
    /// C = the product f, `g` = gelu(f).
    GeluFwd { g: &'a GpuTensor },
    /// C = the product up, `s` = act(gate) · up.
    GluFwd {
        glu: Glu,
        gate: &'a GpuTensor,
        s: &'a GpuTensor,
    },
}

impl<'a> Epilogue<'a> {
    /// `EPI_*` of `shaders/matmul_params.wgsl`.
    pub(super) fn kind(&self) -> u32 {
        match self {
            Epilogue::GeluBwd { .. } => 1,
            Epilogue::GluBwd { glu: Glu::Silu, .. } => 2,
            Epilogue::GeluFwd { .. } => 3,
            Epilogue::GluFwd { glu: Glu::Silu, .. } => 4,
            Epilogue::GluBwd { glu: Glu::Gelu, .. } => 5,
            Epilogue::GluFwd { glu: Glu::Gelu, .. } => 6,
        }
    }

    /// The tensors bound as aux0, aux1 and aux_out.
    pub(super) fn operands(&self) -> [Option<&'a GpuTensor>; 3] {
        match *self {
            Epilogue::GeluBwd { pre } => [Some(pre), None, None],
            Epilogue::GluBwd { gate, up, dup, .. } => [Some(gate), Some(up), Some(dup)],
            Epilogue::GeluFwd { g } => [None, None, Some(g)],
            Epilogue::GluFwd { gate, s, .. } => [Some(gate), None, Some(s)],
        }
    }
}

impl GpuExecutor {
    /// The epilogue's bindings for the C view `c` of elements
    /// `start..start + count`: each operand over the same range, so that
    /// the kernel indexes them as it indexes C. Unused inputs are the dummy;
    /// an unused output is C's own view (never written: the kind decides).
    pub(super) fn epi_views<'a>(
        &'a self,
        e: Epilogue<'a>,
        c: View<'a>,
        start: usize,
        count: usize,
    ) -> Result<[View<'a>; 3]> {
        let view = |t: Option<&'a GpuTensor>, unused: View<'a>| -> Result<View<'a>> {
            let Some(t) = t else { return Ok(unused) };
            let v = self.view(t, start, count)?;
            // f32 tensors start on the binding alignment, so a range has the
            // same element offset in each; the kernel relies on it.
            if v.elem_off != c.elem_off {
                return Err(Error::invalid(
                    "matmul epilogue",
                    format!("operand offset {} differs from C's {}", v.elem_off, c.elem_off),
                ));
            }
            Ok(v)
        };
        let [x0, x1, out] = e.operands();
        Ok([view(x0, self.dummy())?, view(x1, self.dummy())?, view(out, c)?])
    }

    /// `op(a) @ op(b) + bias` into a fresh C and the activation of it:
    /// GELU, or a GLU (SwiGLU, GeGLU) with `gate`. Returns (C, activation).
    pub(crate) fn matmul_act_impl(
        &self,
        name: &'static str,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
        gate: Option<(Glu, &GpuTensor)>,
    ) -> Result<(GpuTensor, GpuTensor)> {
        let g = self.geometry(name, a, b, t)?;
        if let Some(bias) = bias {
            need_f32(name, bias)?;
            if bias.dims() != [g.n] {
                return Err(Error::shape(name, format!("bias {} for N = {}", bias.shape, g.n)));
            }
        }
        let mut out_dims = g.batch_dims.clone();
        out_dims.extend([g.m, g.n]);
        let c = self.alloc_f32(out_dims)?;
        if let Some((_, gate)) = gate {
            check_act_operand(name, "gate", gate, &c.shape, "the product's shape")?;
        }
        let y = self.alloc_f32(c.shape.clone())?;
        let epi = match gate {
            Some((glu, gate)) => Epilogue::GluFwd { glu, gate, s: &y },
            None => Epilogue::GeluFwd { g: &y },
        };
        let mut op = self.op(name);
        let maxima = self.operand_maxima(&mut op, &[a, b])?;
        let scales = maxima.as_ref().map(|(buf, s)| Scales {
            buf,
            a: s[0],
            b: s[1],
        });
        let d = g.forward();
        if self.epilogues.forward() && self.matmul_epi(&mut op, a, b, bias, &c, d, scales, Some(epi))? {
            op.finish()?;
            return Ok((c, y));
        }
        drop(y);
        self.matmul_raw(&mut op, a, b, bias, &c, d, scales)?;
        op.finish()?;
        let y = match gate {
            Some((glu, gate)) => self.glu_impl(glu, gate, &c)?,
            None => self.gelu_impl(&c)?,
        };
        Ok((c, y))
    }

    /// GELU's backward fused into `matmul_backward`'s `da` product: the
    /// returned `da` is the gradient of `pre`. One op with the weight's
    /// and bias's gradients.
    pub(crate) fn matmul_backward_gelu_impl(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        pre: &GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        const OP: &str = "matmul_backward_gelu";
        check_act_operand(OP, "pre", pre, &a.shape, "a's shape")?;
        let da = self.alloc_f32(a.shape.clone())?;
        let epi = DaOut::Epi(&da, Epilogue::GeluBwd { pre });
        let (mut g, fused) =
            self.backward(OP, a, b, dout, t, MatmulNeeds { da: false, ..needs }, epi, None)?;
        g.da = Some(if fused {
            da
        } else {
            self.gelu_backward_impl(pre, &da)?
        });
        Ok(g)
    }

    /// A GLU's (SwiGLU's, GeGLU's) backward fused into `matmul_backward`'s
    /// `da` product: returns the other gradients, dgate and dup. One op
    /// with the weight's and bias's gradients.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    pub(crate) fn matmul_backward_glu_impl(
        &self,
        glu: Glu,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        gate: &GpuTensor,
        up: &GpuTensor,
    ) -> Result<(MatmulGrads<GpuTensor>, GpuTensor, GpuTensor)> {
        let op = glu.matmul_backward_op();
        check_act_operand(op, "gate", gate, &a.shape, "a's shape")?;
        check_act_operand(op, "up", up, &a.shape, "a's shape")?;
        let dgate = self.alloc_f32(a.shape.clone())?;
        let dup = self.alloc_f32(a.shape.clone())?;
        let epi = DaOut::Epi(
            &dgate,
            Epilogue::GluBwd {
                glu,
                gate,
                up,
                dup: &dup,
            },
        );
        let (g, fused) = self.backward(op, a, b, dout, t, MatmulNeeds { da: false, ..needs }, epi, None)?;
        let (dgate, dup) = if fused {
            (dgate, dup)
        } else {
            drop(dup);
            self.glu_backward_impl(glu, gate, up, &dgate)?
        };
        Ok((g, dgate, dup))
    }
}
