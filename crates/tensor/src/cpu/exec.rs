//! [`Executor`] for the reference kernels: shape and dtype validation, then a
//! call into [`reference`]. Nothing here panics on user input.

use std::marker::PhantomData;

use rayon::prelude::*;

use crate::cpu::f16_operands::rounded;
use crate::cpu::matmul::packed_of;
use crate::cpu::packed::{self, Widen};
use crate::cpu::reference::{self as r, AttnDims};
use crate::cpu::tensor::{Store, each_store};
use crate::cpu::{CpuTensor, Real};
use crate::{
    AddNormOut, AttentionGrads, AttentionOut, AttnMask, ClampedGlu, ComputePrecision, CrossEntropyOut, DType,
    DeltaRuleDims, DeltaRuleGrads, DeltaRuleOut, Docs, Dropout, Error, Executor, HostSlice, HostTensor,
    LossTerms, MatmulGrads, MatmulNeeds, Noise, NormGrads, NormOut, Result, Rope, Shape, SoftCap,
    TensorHandle, Transpose, attention_cached_dims, attention_sinks_dims, causal_conv1d_dims,
    clamped_glu_out, delta_gates_dims, delta_rule_cached_dims, delta_rule_dims, dropout_layout,
    sigmoid_mul_check,
};

/// The reference executor computing in `F`. Use the aliases.
#[derive(Debug, Clone, Copy, Default)]
pub struct RefExecutor<F> {
    precision: ComputePrecision,
    compute: PhantomData<F>,
}

/// The f32 reference executor: the semantics every backend must match.
pub type CpuExecutor = RefExecutor<f32>;
/// The same kernels in f64.
pub type F64Executor = RefExecutor<f64>;

impl<F: Real> RefExecutor<F> {
    pub const fn new() -> Self {
        RefExecutor {
            precision: ComputePrecision::F32,
            compute: PhantomData,
        }
    }

    /// The same executor with matmul operands in `precision`.
    pub const fn with_precision(precision: ComputePrecision) -> Self {
        RefExecutor {
            precision,
            compute: PhantomData,
        }
    }
}

pub(super) type T<F> = CpuTensor<F>;

/// The values of a tensor that must be stored as f32 (activations, grads,
/// norm weights, biases).
pub(super) fn f32_data<'a, F: Real>(op: &'static str, t: &'a T<F>) -> Result<&'a [F]> {
    match t.dtype() {
        DType::F32 => Ok(t.data()),
        got => Err(Error::DType {
            op,
            expected: DType::F32,
            got,
        }),
    }
}

/// A tensor of `shape` over `store` (whose length the caller has matched).
fn out_store<F: Real>(shape: Shape, store: Store<F>) -> T<F> {
    T::from_store(shape, store)
}

pub(super) fn same_shape<F>(op: &'static str, what: &str, a: &T<F>, b: &T<F>) -> Result<()> {
    if a.shape() == b.shape() {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            format!("{what}: {} vs {}", a.shape(), b.shape()),
        ))
    }
}

pub(super) fn out<F: Real>(shape: Shape, data: Vec<F>) -> T<F> {
    T::new_unchecked(shape, data)
}

/// `[C]` weight matching the last dim of `x`, with `C > 0`.
/// Elements `range` of `t` into `out` as [`Executor::download`] gives them
/// (narrowed to f32, then rounded to the stored dtype), without copying
/// the rest of the tensor.
fn narrow_range<F: Real>(
    op: &'static str,
    t: &T<F>,
    range: std::ops::Range<usize>,
    out: &mut [f32],
) -> Result<()> {
    if range.start > range.end || range.end > t.numel() || range.len() != out.len() {
        return Err(Error::shape(
            op,
            format!(
                "elements {range:?} of {} into a destination of {}",
                t.shape(),
                out.len()
            ),
        ));
    }
    const CHUNK: usize = 1 << 15;
    match packed_of(t) {
        // Stored 16-bit values widen exactly: that is their download.
        Some(p) => p.widen_block(range.start, CHUNK, CHUNK, out, Widen::Exact),
        None => {
            let src = &t.data()[range];
            // The rounding `to_host` applies for the stored dtype (the same
            // conversions as `convert`): none for f32.
            out.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &x)| *o = x.narrow_f32()));
        }
    }
    Ok(())
}

pub(super) fn norm_weight<F: Real>(op: &'static str, x: &T<F>, w: &T<F>, name: &str) -> Result<()> {
    let c = x.shape().last();
    if x.dims().is_empty() || c == 0 {
        return Err(Error::shape(
            op,
            format!("x {} has no last dimension to normalise", x.shape()),
        ));
    }
    if w.dims() != [c] {
        return Err(Error::shape(
            op,
            format!("{name} {} must be [{c}] for x {}", w.shape(), x.shape()),
        ));
    }
    Ok(())
}

pub(super) fn row_stat<F: Real>(op: &'static str, x: &T<F>, s: &T<F>, name: &str) -> Result<()> {
    if s.numel() != x.shape().rows() {
        return Err(Error::shape(
            op,
            format!(
                "{name} {} must hold one value per row of x {} ({})",
                s.shape(),
                x.shape(),
                x.shape().rows()
            ),
        ));
    }
    Ok(())
}

fn rope_dims<F>(op: &'static str, x: &T<F>, rope: &Rope) -> Result<[usize; 4]> {
    match *x.dims() {
        [b, t, h, d] => {
            rope.rotated(op, d)
                .map_err(|e| Error::shape(op, format!("x {}: {e}", x.shape())))?;
            if let Some(docs) = &rope.docs {
                docs.check(op, b, t)?;
            }
            Ok([b, t, h, d])
        }
        _ => Err(Error::shape(op, format!("x {} must be [B, T, H, D]", x.shape()))),
    }
}

fn attn_dims<F>(op: &'static str, q: &T<F>, k: &T<F>, v: &T<F>) -> Result<AttnDims> {
    let err = |why: &str| {
        Error::shape(
            op,
            format!("q {} k {} v {}: {why}", q.shape(), k.shape(), v.shape()),
        )
    };
    let ([b, t, hq, d], [kb, kt, hkv, kd]) = (
        <[usize; 4]>::try_from(q.dims()).map_err(|_| err("q must be [B, T, Hq, D]"))?,
        <[usize; 4]>::try_from(k.dims()).map_err(|_| err("k must be [B, T, Hkv, D]"))?,
    );
    if k.shape() != v.shape() {
        return Err(err("k and v shapes differ"));
    }
    if (kb, kt, kd) != (b, t, d) {
        return Err(err("B, T and D of q and k/v differ"));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(err("Hq must be a multiple of Hkv"));
    }
    Ok(AttnDims {
        b,
        t,
        hq,
        hkv,
        d,
        mask: AttnMask::CAUSAL,
    })
}

/// The gated delta rule's operands (q, k, v, g, beta), each stored as f32.
fn delta_rule_in<'a, F: Real>(
    op: &'static str,
    x: [&'a T<F>; 5],
    d: DeltaRuleDims,
    docs: Option<&'a Docs>,
) -> Result<r::DeltaRuleIn<'a, F>> {
    if let Some(docs) = docs {
        docs.check(op, d.b, d.t)?;
    }
    let [q, k, v, g, beta] = x;
    Ok(r::DeltaRuleIn {
        docs,
        q: f32_data(op, q)?,
        k: f32_data(op, k)?,
        v: f32_data(op, v)?,
        g: f32_data(op, g)?,
        beta: f32_data(op, beta)?,
    })
}

impl<F: Real> Executor for RefExecutor<F> {
    type Tensor = CpuTensor<F>;

    fn name(&self) -> String {
        let operands = match self.precision {
            ComputePrecision::F32 => String::new(),
            ComputePrecision::F16 => ", f16 matmul operands".to_string(),
        };
        format!(
            "cpu-reference ({}{operands}, {} threads)",
            F::NAME,
            rayon::current_num_threads()
        )
    }

    fn set_compute_precision(&mut self, p: ComputePrecision) -> Result<()> {
        self.precision = p;
        Ok(())
    }

    fn compute_precision(&self) -> ComputePrecision {
        self.precision
    }

    fn upload(&self, t: &HostTensor) -> Result<T<F>> {
        Ok(T::from_host(t))
    }

    fn download(&self, t: &T<F>) -> Result<HostTensor> {
        Ok(t.to_host())
    }

    /// Straight from the slice, 16-bit data kept 16-bit: the transport
    /// copies of weights arrive here.
    fn upload_slice(&self, shape: &Shape, data: HostSlice<'_>) -> Result<T<F>> {
        T::from_slice("upload_slice", shape, data)
    }

    fn download_into(&self, t: &T<F>, out: &mut [f32]) -> Result<()> {
        narrow_range("download_into", t, 0..t.numel(), out)
    }

    /// The range only, with no whole-tensor copy: the trainer fetches every
    /// gradient this way, in chunks.
    fn download_range_into(&self, t: &T<F>, range: std::ops::Range<usize>, out: &mut [f32]) -> Result<()> {
        narrow_range("download_range_into", t, range, out)
    }

    fn memory_stats(&self) -> Option<crate::MemoryStats> {
        Some(crate::cpu::tensor::memory_stats())
    }

    fn reset_peak_memory(&self) {
        crate::cpu::tensor::reset_peak_memory();
    }

    fn zeros(&self, shape: &Shape) -> Result<T<F>> {
        Ok(out(shape.clone(), vec![F::zero(); shape.numel()]))
    }

    fn reshape(&self, t: &T<F>, shape: &Shape) -> Result<T<F>> {
        if shape.numel() != t.numel() {
            return Err(Error::shape(
                "reshape",
                format!("{} to {}: element counts differ", t.shape(), shape),
            ));
        }
        Ok(out_store(shape.clone(), t.store().clone()))
    }

    fn slice_rows(&self, t: &T<F>, start: usize, len: usize) -> Result<T<F>> {
        let (rows, last) = (t.shape().rows(), t.shape().last());
        if start.checked_add(len).is_none_or(|end| end > rows) {
            return Err(Error::shape(
                "slice_rows",
                format!("rows {start}..{start}+{len} of {}", t.shape()),
            ));
        }
        let store = each_store!(t.store(), v => r::slice_rows(v, last, start, len));
        Ok(out_store(Shape::new([len, last]), store))
    }

    fn write_rows(&self, dst: &mut T<F>, start: usize, src: &T<F>) -> Result<()> {
        let (rows, last) = (dst.shape().rows(), dst.shape().last());
        let n = src.shape().rows();
        if src.shape().last() != last || start.checked_add(n).is_none_or(|end| end > rows) {
            return Err(Error::shape(
                "write_rows",
                format!("src {} into rows {start}.. of dst {}", src.shape(), dst.shape()),
            ));
        }
        if src.dtype() != dst.dtype() {
            return Err(Error::DType {
                op: "write_rows",
                expected: dst.dtype(),
                got: src.dtype(),
            });
        }
        match (dst.store_mut(), src.store()) {
            (Store::Wide(d), Store::Wide(s)) => r::write_rows(d, last, start, s),
            (Store::BF16(d), Store::BF16(s)) => r::write_rows(d, last, start, s),
            (Store::F16(d), Store::F16(s)) => r::write_rows(d, last, start, s),
            _ => unreachable!("dtypes were compared above"),
        }
        Ok(())
    }

    fn split_last(&self, t: &T<F>, sizes: &[usize]) -> Result<Vec<T<F>>> {
        let total: usize = sizes.iter().sum();
        if t.dims().is_empty() || total != t.shape().last() {
            return Err(Error::shape(
                "split_last",
                format!("sizes {sizes:?} of {}", t.shape()),
            ));
        }
        // With a zero-width last dim every part is empty anyway.
        fn parts<V: Copy>(data: &[V], sizes: &[usize]) -> Vec<Vec<V>> {
            if sizes.iter().sum::<usize>() == 0 {
                sizes.iter().map(|_| Vec::new()).collect()
            } else {
                r::split_last(data, sizes)
            }
        }
        let stores: Vec<Store<F>> = match t.store() {
            Store::Wide(v) => parts(v, sizes).into_iter().map(Store::Wide).collect(),
            Store::BF16(v) => parts(v, sizes).into_iter().map(Store::BF16).collect(),
            Store::F16(v) => parts(v, sizes).into_iter().map(Store::F16).collect(),
        };
        Ok(stores
            .into_iter()
            .zip(sizes)
            .map(|(p, &s)| out_store(t.shape().with_last(s), p))
            .collect())
    }

    fn concat_last(&self, parts: &[&T<F>]) -> Result<T<F>> {
        let Some(first) = parts.first() else {
            return Err(Error::shape("concat_last", "no parts"));
        };
        let lead = first.dims().split_last().map(|(_, l)| l).unwrap_or(&[]);
        for p in parts {
            if p.dims().is_empty() || p.dims().split_last().map(|(_, l)| l) != Some(lead) {
                let shapes: Vec<String> = parts.iter().map(|p| p.shape().to_string()).collect();
                return Err(Error::shape(
                    "concat_last",
                    format!("leading dims differ: {}", shapes.join(", ")),
                ));
            }
            if p.dtype() != first.dtype() {
                return Err(Error::DType {
                    op: "concat_last",
                    expected: first.dtype(),
                    got: p.dtype(),
                });
            }
        }
        let lasts: Vec<usize> = parts.iter().map(|p| p.shape().last()).collect();
        let rows = first.shape().rows();
        let total = lasts.iter().sum();
        // Every part has the first's dtype (checked above), so its variant.
        macro_rules! join {
            ($variant:ident) => {{
                let slices: Vec<&[_]> = parts
                    .iter()
                    .map(|p| match p.store() {
                        Store::$variant(v) => &v[..],
                        _ => unreachable!("dtypes were compared above"),
                    })
                    .collect();
                Store::$variant(r::concat_last(&slices, &lasts, rows))
            }};
        }
        let store = match first.store() {
            Store::Wide(_) => join!(Wide),
            Store::BF16(_) => join!(BF16),
            Store::F16(_) => join!(F16),
        };
        Ok(out_store(first.shape().with_last(total), store))
    }

    fn add(&self, a: &T<F>, b: &T<F>) -> Result<T<F>> {
        same_shape("add", "a vs b", a, b)?;
        let (x, y) = (f32_data("add", a)?, f32_data("add", b)?);
        Ok(out(
            a.shape().clone(),
            x.par_iter().zip(y).map(|(&x, &y)| x + y).collect(),
        ))
    }

    fn add_assign(&self, acc: &mut T<F>, x: &T<F>) -> Result<()> {
        if acc.numel() != x.numel() {
            return Err(Error::shape(
                "add_assign",
                format!("acc {} vs x {}", acc.shape(), x.shape()),
            ));
        }
        f32_data("add_assign", acc)?;
        let x = f32_data("add_assign", x)?;
        acc.data_mut()
            .par_iter_mut()
            .zip(x)
            .for_each(|(a, &x)| *a = *a + x);
        Ok(())
    }

    fn scale(&self, x: &T<F>, s: f64) -> Result<T<F>> {
        let s = F::from_f64(s);
        Ok(out(
            x.shape().clone(),
            f32_data("scale", x)?.par_iter().map(|&v| v * s).collect(),
        ))
    }

    fn add_scalar(&self, x: &T<F>, c: f64) -> Result<T<F>> {
        let c = F::from_f64(c);
        Ok(out(
            x.shape().clone(),
            f32_data("add_scalar", x)?.par_iter().map(|&v| v + c).collect(),
        ))
    }

    fn scale_rows(&self, x: &T<F>, w: &[f64]) -> Result<T<F>> {
        let xs = f32_data("scale_rows", x)?;
        let c = row_width("scale_rows", x, w.len())?;
        let mut y = xs.to_vec();
        if c > 0 {
            y.par_chunks_mut(c).zip(w).for_each(|(row, &s)| {
                let s = F::from_f64(s);
                row.iter_mut().for_each(|v| *v = *v * s);
            });
        }
        Ok(out(x.shape().clone(), y))
    }

    fn dropout(&self, x: &T<F>, d: &Dropout) -> Result<T<F>> {
        let (_, rows, cols) = dropout_layout("dropout", x.shape())?;
        let mut y = f32_data("dropout", x)?.to_vec();
        if !y.is_empty() {
            d.apply(&mut y, rows, cols, F::from_f64(d.scale()));
        }
        Ok(out(x.shape().clone(), y))
    }

    fn add_noise(&self, x: &T<F>, n: &Noise) -> Result<T<F>> {
        let (_, rows, cols) = dropout_layout("add_noise", x.shape())?;
        let mut y = f32_data("add_noise", x)?.to_vec();
        if !y.is_empty() {
            n.apply(&mut y, rows, cols, F::from_f32);
        }
        Ok(out(x.shape().clone(), y))
    }

    fn row_dots(&self, a: &T<F>, b: &T<F>) -> Result<T<F>> {
        if a.shape() != b.shape() || a.shape().rank() == 0 {
            return Err(Error::shape(
                "row_dots",
                format!(
                    "a {} and b {} must be the same shape of rank ≥ 1",
                    a.shape(),
                    b.shape()
                ),
            ));
        }
        let (av, bv) = (f32_data("row_dots", a)?, f32_data("row_dots", b)?);
        let c = *a.dims().last().expect("rank ≥ 1");
        let rows = a.numel().checked_div(c).unwrap_or(0);
        let dots = (0..rows)
            .into_par_iter()
            .map(|r| {
                let (x, y) = (&av[r * c..(r + 1) * c], &bv[r * c..(r + 1) * c]);
                x.iter().zip(y).fold(F::zero(), |acc, (&p, &q)| acc + p * q)
            })
            .collect();
        Ok(out(Shape::from(&[rows][..]), dots))
    }

    fn matmul(&self, a: &T<F>, b: &T<F>, bias: Option<&T<F>>, t: Transpose) -> Result<T<F>> {
        self.matmul_impl(a, b, bias, t)
    }

    fn matmul_backward(
        &self,
        a: &T<F>,
        b: &T<F>,
        dout: &T<F>,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<T<F>>> {
        self.matmul_backward_impl(a, b, dout, t, needs)
    }

    fn matmul_backward_into(
        &self,
        a: &T<F>,
        b: &T<F>,
        dout: &T<F>,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: &mut T<F>,
    ) -> Result<MatmulGrads<T<F>>> {
        self.matmul_backward_into_impl(a, b, dout, t, needs, db_acc)
    }

    fn rmsnorm(&self, x: &T<F>, w: &T<F>, eps: f32) -> Result<NormOut<T<F>>> {
        norm_weight("rmsnorm", x, w, "w")?;
        let (y, rstd) = r::rmsnorm(f32_data("rmsnorm", x)?, f32_data("rmsnorm", w)?, F::from_f32(eps));
        Ok(NormOut {
            y: out(x.shape().clone(), y),
            mean: None,
            rstd: out(Shape::new([rstd.len()]), rstd),
        })
    }

    fn rmsnorm_backward(&self, x: &T<F>, w: &T<F>, rstd: &T<F>, dy: &T<F>) -> Result<NormGrads<T<F>>> {
        let op = "rmsnorm_backward";
        norm_weight(op, x, w, "w")?;
        row_stat(op, x, rstd, "rstd")?;
        same_shape(op, "x vs dy", x, dy)?;
        let (dx, dw) = r::rmsnorm_backward(
            f32_data(op, x)?,
            f32_data(op, w)?,
            f32_data(op, rstd)?,
            f32_data(op, dy)?,
        );
        Ok(NormGrads {
            dx: out(x.shape().clone(), dx),
            dw: out(w.shape().clone(), dw),
            db: None,
        })
    }

    fn layernorm(&self, x: &T<F>, w: &T<F>, b: &T<F>, eps: f32) -> Result<NormOut<T<F>>> {
        let op = "layernorm";
        norm_weight(op, x, w, "w")?;
        norm_weight(op, x, b, "b")?;
        let (y, mean, rstd) = r::layernorm(
            f32_data(op, x)?,
            f32_data(op, w)?,
            f32_data(op, b)?,
            F::from_f32(eps),
        );
        let rows = Shape::new([rstd.len()]);
        Ok(NormOut {
            y: out(x.shape().clone(), y),
            mean: Some(out(rows.clone(), mean)),
            rstd: out(rows, rstd),
        })
    }

    fn layernorm_backward(
        &self,
        x: &T<F>,
        w: &T<F>,
        mean: &T<F>,
        rstd: &T<F>,
        dy: &T<F>,
    ) -> Result<NormGrads<T<F>>> {
        let op = "layernorm_backward";
        norm_weight(op, x, w, "w")?;
        row_stat(op, x, mean, "mean")?;
        row_stat(op, x, rstd, "rstd")?;
        same_shape(op, "x vs dy", x, dy)?;
        let (dx, dw, db) = r::layernorm_backward(
            f32_data(op, x)?,
            f32_data(op, w)?,
            f32_data(op, mean)?,
            f32_data(op, rstd)?,
            f32_data(op, dy)?,
        );
        Ok(NormGrads {
            dx: out(x.shape().clone(), dx),
            dw: out(w.shape().clone(), dw),
            db: Some(out(w.shape().clone(), db)),
        })
    }

    fn add_rmsnorm(&self, x: &T<F>, r: &T<F>, w: &T<F>, eps: f32) -> Result<AddNormOut<T<F>>> {
        self.add_rmsnorm_impl(x, r, w, eps)
    }

    fn add_rmsnorm_backward(
        &self,
        h: &T<F>,
        w: &T<F>,
        rstd: &T<F>,
        dy: &T<F>,
        dh: &T<F>,
    ) -> Result<NormGrads<T<F>>> {
        self.add_rmsnorm_backward_impl(h, w, rstd, dy, dh)
    }

    fn add_layernorm(&self, x: &T<F>, r: &T<F>, w: &T<F>, b: &T<F>, eps: f32) -> Result<AddNormOut<T<F>>> {
        self.add_layernorm_impl(x, r, w, b, eps)
    }

    fn add_layernorm_backward(
        &self,
        h: &T<F>,
        w: &T<F>,
        mean: &T<F>,
        rstd: &T<F>,
        dy: &T<F>,
        dh: &T<F>,
    ) -> Result<NormGrads<T<F>>> {
        self.add_layernorm_backward_impl(h, w, mean, rstd, dy, dh)
    }

    fn rope(&self, x: &T<F>, rope: Rope) -> Result<T<F>> {
        let dims = rope_dims("rope", x, &rope)?;
        Ok(out(
            x.shape().clone(),
            r::rope(f32_data("rope", x)?, dims, &rope, false),
        ))
    }

    fn rope_backward(&self, dy: &T<F>, rope: Rope) -> Result<T<F>> {
        let dims = rope_dims("rope_backward", dy, &rope)?;
        Ok(out(
            dy.shape().clone(),
            r::rope(f32_data("rope_backward", dy)?, dims, &rope, true),
        ))
    }

    fn attention(&self, q: &T<F>, k: &T<F>, v: &T<F>, mask: AttnMask) -> Result<AttentionOut<T<F>>> {
        let op = "attention";
        let d = AttnDims {
            mask,
            ..attn_dims(op, q, k, v)?
        };
        d.mask.check(op, d.b, d.t)?;
        let (qd, kd, vd) = (f32_data(op, q)?, f32_data(op, k)?, f32_data(op, v)?);
        let (o, lse) = match self.precision {
            ComputePrecision::F32 => r::attention(qd, kd, vd, &d),
            ComputePrecision::F16 => r::attention(&rounded(qd), &rounded(kd), &rounded(vd), &d),
        };
        Ok(AttentionOut {
            out: out(q.shape().clone(), o),
            lse: out(Shape::new([d.b, d.hq, d.t]), lse),
            mask: d.mask,
        })
    }

    fn attention_cached(
        &self,
        q: &T<F>,
        k: &T<F>,
        v: &T<F>,
        len: usize,
        mask: AttnMask,
    ) -> Result<AttentionOut<T<F>>> {
        let op = "attention_cached";
        let c = attention_cached_dims(op, q.shape(), k.shape(), v.shape(), len, &mask)?;
        let d = AttnDims {
            b: c.b,
            t: c.tq,
            hq: c.hq,
            hkv: c.hkv,
            d: c.d,
            mask,
        };
        let (qd, kd, vd) = (f32_data(op, q)?, f32_data(op, k)?, f32_data(op, v)?);
        let (o, lse) = r::attention_cached(qd, kd, vd, &d, c.tc, len);
        Ok(AttentionOut {
            out: out(q.shape().clone(), o),
            lse: out(Shape::new([c.b, c.hq, c.tq]), lse),
            mask: d.mask,
        })
    }

    fn attention_backward(
        &self,
        q: &T<F>,
        k: &T<F>,
        v: &T<F>,
        fwd: &AttentionOut<T<F>>,
        dout: &T<F>,
    ) -> Result<AttentionGrads<T<F>>> {
        let op = "attention_backward";
        let d = AttnDims {
            mask: fwd.mask.clone(),
            ..attn_dims(op, q, k, v)?
        };
        d.mask.check(op, d.b, d.t)?;
        same_shape(op, "q vs out", q, &fwd.out)?;
        same_shape(op, "q vs dout", q, dout)?;
        if fwd.lse.dims() != [d.b, d.hq, d.t] {
            return Err(Error::shape(
                op,
                format!("lse {} must be [{}, {}, {}]", fwd.lse.shape(), d.b, d.hq, d.t),
            ));
        }
        let (qd, kd, vd, gd) = (
            f32_data(op, q)?,
            f32_data(op, k)?,
            f32_data(op, v)?,
            f32_data(op, dout)?,
        );
        let (fo, fl) = (f32_data(op, &fwd.out)?, f32_data(op, &fwd.lse)?);
        let (dq, dk, dv) = match self.precision {
            ComputePrecision::F32 => r::attention_backward(qd, kd, vd, fo, fl, gd, &d),
            ComputePrecision::F16 => {
                let (qr, kr, vr, gr) = (rounded(qd), rounded(kd), rounded(vd), rounded(gd));
                r::attention_backward(&qr, &kr, &vr, fo, fl, &gr, &d)
            }
        };
        Ok(AttentionGrads {
            dq: out(q.shape().clone(), dq),
            dk: out(k.shape().clone(), dk),
            dv: out(v.shape().clone(), dv),
        })
    }

    fn attention_sinks(&self, fwd: &AttentionOut<T<F>>, sinks: &T<F>) -> Result<T<F>> {
        let op = "attention_sinks";
        let dims = attention_sinks_dims(op, fwd.out.shape(), fwd.lse.shape(), sinks.shape(), None)?;
        let (o, l, s) = (
            f32_data(op, &fwd.out)?,
            f32_data(op, &fwd.lse)?,
            f32_data(op, sinks)?,
        );
        Ok(out(fwd.out.shape().clone(), r::attention_sinks(o, l, s, dims)))
    }

    fn attention_sinks_backward(
        &self,
        o: &T<F>,
        lse: &T<F>,
        sinks: &T<F>,
        dout: &T<F>,
    ) -> Result<(T<F>, T<F>)> {
        let op = "attention_sinks_backward";
        let dims = attention_sinks_dims(op, o.shape(), lse.shape(), sinks.shape(), Some(dout.shape()))?;
        let (dx, ds) = r::attention_sinks_backward(
            f32_data(op, o)?,
            f32_data(op, lse)?,
            f32_data(op, sinks)?,
            f32_data(op, dout)?,
            dims,
        );
        Ok((out(o.shape().clone(), dx), out(sinks.shape().clone(), ds)))
    }

    fn gated_delta_rule(
        &self,
        q: &T<F>,
        k: &T<F>,
        v: &T<F>,
        g: &T<F>,
        beta: &T<F>,
        docs: Option<&Docs>,
    ) -> Result<DeltaRuleOut<T<F>>> {
        let op = "gated_delta_rule";
        let d = delta_rule_dims(op, [q, k, v, g, beta].map(|x| x.shape()), None)?;
        let (o, saved) = r::gated_delta_rule(delta_rule_in(op, [q, k, v, g, beta], d, docs)?, d);
        Ok(DeltaRuleOut {
            out: out(v.shape().clone(), o),
            saved: out(d.saved_shape(), saved),
            docs: docs.cloned(),
        })
    }

    fn gated_delta_rule_cached(
        &self,
        q: &T<F>,
        k: &T<F>,
        v: &T<F>,
        g: &T<F>,
        beta: &T<F>,
        state: &mut T<F>,
    ) -> Result<T<F>> {
        let op = "gated_delta_rule_cached";
        let d = delta_rule_cached_dims(op, [q, k, v, g, beta].map(|x| x.shape()), state.shape())?;
        let x = delta_rule_in(op, [q, k, v, g, beta], d, None)?;
        let Store::Wide(s) = state.store_mut() else {
            return Err(Error::DType {
                op,
                expected: DType::F32,
                got: state.dtype(),
            });
        };
        Ok(out(v.shape().clone(), r::gated_delta_rule_cached(x, d, s)))
    }

    fn gated_delta_rule_backward(
        &self,
        q: &T<F>,
        k: &T<F>,
        v: &T<F>,
        g: &T<F>,
        beta: &T<F>,
        fwd: &DeltaRuleOut<T<F>>,
        dout: &T<F>,
    ) -> Result<DeltaRuleGrads<T<F>>> {
        let op = "gated_delta_rule_backward";
        let bwd = [&fwd.out, &fwd.saved, dout].map(|x| x.shape());
        let d: DeltaRuleDims = delta_rule_dims(op, [q, k, v, g, beta].map(|x| x.shape()), Some(bwd))?;
        let x = delta_rule_in(op, [q, k, v, g, beta], d, fwd.docs.as_ref())?;
        let [dq, dk, dv, dg, dbeta] =
            r::gated_delta_rule_backward(x, f32_data(op, &fwd.saved)?, f32_data(op, dout)?, d);
        Ok(DeltaRuleGrads {
            dq: out(q.shape().clone(), dq),
            dk: out(k.shape().clone(), dk),
            dv: out(v.shape().clone(), dv),
            dg: out(g.shape().clone(), dg),
            dbeta: out(beta.shape().clone(), dbeta),
        })
    }

    fn swiglu(&self, gate: &T<F>, up: &T<F>) -> Result<T<F>> {
        same_shape("swiglu", "gate vs up", gate, up)?;
        Ok(out(
            gate.shape().clone(),
            r::swiglu(f32_data("swiglu", gate)?, f32_data("swiglu", up)?),
        ))
    }

    fn swiglu_backward(&self, gate: &T<F>, up: &T<F>, dy: &T<F>) -> Result<(T<F>, T<F>)> {
        let op = "swiglu_backward";
        same_shape(op, "gate vs up", gate, up)?;
        same_shape(op, "gate vs dy", gate, dy)?;
        let (dg, du) = r::swiglu_backward(f32_data(op, gate)?, f32_data(op, up)?, f32_data(op, dy)?);
        Ok((out(gate.shape().clone(), dg), out(gate.shape().clone(), du)))
    }

    fn swiglu_clamped(&self, gate_up: &T<F>, c: ClampedGlu) -> Result<T<F>> {
        let op = "swiglu_clamped";
        c.check(op)?;
        let out_shape = clamped_glu_out(op, gate_up.shape())?;
        let (alpha, limit) = (F::from_f64(c.alpha), F::from_f64(c.limit));
        Ok(out(
            out_shape,
            r::swiglu_clamped(f32_data(op, gate_up)?, alpha, limit),
        ))
    }

    fn swiglu_clamped_backward(&self, gate_up: &T<F>, dy: &T<F>, c: ClampedGlu) -> Result<T<F>> {
        let op = "swiglu_clamped_backward";
        c.check(op)?;
        let want = clamped_glu_out(op, gate_up.shape())?;
        if dy.shape() != &want {
            return Err(Error::shape(
                op,
                format!(
                    "dy {} must be {want}, the output of gate_up {}",
                    dy.shape(),
                    gate_up.shape()
                ),
            ));
        }
        let (alpha, limit) = (F::from_f64(c.alpha), F::from_f64(c.limit));
        let d = r::swiglu_clamped_backward(f32_data(op, gate_up)?, f32_data(op, dy)?, alpha, limit);
        Ok(out(gate_up.shape().clone(), d))
    }

    fn geglu(&self, gate: &T<F>, up: &T<F>) -> Result<T<F>> {
        same_shape("geglu", "gate vs up", gate, up)?;
        Ok(out(
            gate.shape().clone(),
            r::geglu(f32_data("geglu", gate)?, f32_data("geglu", up)?),
        ))
    }

    fn geglu_backward(&self, gate: &T<F>, up: &T<F>, dy: &T<F>) -> Result<(T<F>, T<F>)> {
        let op = "geglu_backward";
        same_shape(op, "gate vs up", gate, up)?;
        same_shape(op, "gate vs dy", gate, dy)?;
        let (dg, du) = r::geglu_backward(f32_data(op, gate)?, f32_data(op, up)?, f32_data(op, dy)?);
        Ok((out(gate.shape().clone(), dg), out(gate.shape().clone(), du)))
    }

    fn softcap(&self, mut x: T<F>, cap: SoftCap) -> Result<T<F>> {
        f32_data("softcap", &x)?;
        r::softcap(x.data_mut(), F::from_f64(cap.get() as f64));
        Ok(x)
    }

    fn softcap_backward(&self, y: &T<F>, mut dy: T<F>, cap: SoftCap) -> Result<T<F>> {
        let op = "softcap_backward";
        same_shape(op, "y vs dy", y, &dy)?;
        f32_data(op, &dy)?;
        r::softcap_backward(f32_data(op, y)?, dy.data_mut(), F::from_f64(cap.get() as f64));
        Ok(dy)
    }

    fn gelu_erf(&self, x: &T<F>) -> Result<T<F>> {
        Ok(out(x.shape().clone(), r::gelu_erf(f32_data("gelu_erf", x)?)))
    }

    fn gelu_erf_backward(&self, x: &T<F>, dy: &T<F>) -> Result<T<F>> {
        let op = "gelu_erf_backward";
        same_shape(op, "x vs dy", x, dy)?;
        Ok(out(
            x.shape().clone(),
            r::gelu_erf_backward(f32_data(op, x)?, f32_data(op, dy)?),
        ))
    }

    fn gelu(&self, x: &T<F>) -> Result<T<F>> {
        Ok(out(x.shape().clone(), r::gelu(f32_data("gelu", x)?)))
    }

    fn gelu_backward(&self, x: &T<F>, dy: &T<F>) -> Result<T<F>> {
        same_shape("gelu_backward", "x vs dy", x, dy)?;
        Ok(out(
            x.shape().clone(),
            r::gelu_backward(f32_data("gelu_backward", x)?, f32_data("gelu_backward", dy)?),
        ))
    }

    fn causal_conv1d_silu(&self, x: &T<F>, w: &T<F>, docs: Option<&Docs>) -> Result<T<F>> {
        let op = "causal_conv1d_silu";
        let dims = causal_conv1d_dims(op, x.shape(), w.shape(), None, docs)?;
        let y = r::causal_conv1d_silu(f32_data(op, x)?, f32_data(op, w)?, dims, docs);
        Ok(out(x.shape().clone(), y))
    }

    fn causal_conv1d_silu_backward(
        &self,
        x: &T<F>,
        w: &T<F>,
        dy: &T<F>,
        docs: Option<&Docs>,
    ) -> Result<(T<F>, T<F>)> {
        let op = "causal_conv1d_silu_backward";
        let dims = causal_conv1d_dims(op, x.shape(), w.shape(), Some(dy.shape()), docs)?;
        let (xd, wd, dyd) = (f32_data(op, x)?, f32_data(op, w)?, f32_data(op, dy)?);
        let (dx, dw) = r::causal_conv1d_silu_backward(xd, wd, dyd, dims, docs);
        Ok((out(x.shape().clone(), dx), out(w.shape().clone(), dw)))
    }

    fn delta_gates(&self, a: &T<F>, b: &T<F>, a_log: &T<F>, dt_bias: &T<F>) -> Result<(T<F>, T<F>)> {
        let op = "delta_gates";
        let dims = delta_gates_dims(op, a.shape(), b.shape(), a_log.shape(), dt_bias.shape(), None)?;
        let (g, beta) = r::delta_gates(
            f32_data(op, a)?,
            f32_data(op, b)?,
            f32_data(op, a_log)?,
            f32_data(op, dt_bias)?,
            dims,
        );
        Ok((out(a.shape().clone(), g), out(b.shape().clone(), beta)))
    }

    fn delta_gates_backward(
        &self,
        a: &T<F>,
        b: &T<F>,
        a_log: &T<F>,
        dt_bias: &T<F>,
        dg: &T<F>,
        dbeta: &T<F>,
    ) -> Result<(T<F>, T<F>, T<F>, T<F>)> {
        let op = "delta_gates_backward";
        let grads = Some((dg.shape(), dbeta.shape()));
        let dims = delta_gates_dims(op, a.shape(), b.shape(), a_log.shape(), dt_bias.shape(), grads)?;
        let (da, db, da_log, ddt) = r::delta_gates_backward(
            f32_data(op, a)?,
            f32_data(op, b)?,
            f32_data(op, a_log)?,
            f32_data(op, dt_bias)?,
            f32_data(op, dg)?,
            f32_data(op, dbeta)?,
            dims,
        );
        Ok((
            out(a.shape().clone(), da),
            out(b.shape().clone(), db),
            out(a_log.shape().clone(), da_log),
            out(dt_bias.shape().clone(), ddt),
        ))
    }

    fn sigmoid_mul(&self, gate: &T<F>, x: &T<F>) -> Result<T<F>> {
        let op = "sigmoid_mul";
        sigmoid_mul_check(op, gate.shape(), x.shape(), None)?;
        Ok(out(
            gate.shape().clone(),
            r::sigmoid_mul(f32_data(op, gate)?, f32_data(op, x)?),
        ))
    }

    fn sigmoid_mul_backward(&self, gate: &T<F>, x: &T<F>, dy: &T<F>) -> Result<(T<F>, T<F>)> {
        let op = "sigmoid_mul_backward";
        sigmoid_mul_check(op, gate.shape(), x.shape(), Some(dy.shape()))?;
        let (dg, dx) = r::sigmoid_mul_backward(f32_data(op, gate)?, f32_data(op, x)?, f32_data(op, dy)?);
        Ok((out(gate.shape().clone(), dg), out(gate.shape().clone(), dx)))
    }

    fn embedding(&self, ids: &[u32], table: &T<F>) -> Result<T<F>> {
        let [_, c] = *table.dims() else {
            return Err(Error::shape(
                "embedding",
                format!("table {} must be [V, C]", table.shape()),
            ));
        };
        let rows = match packed_of(table) {
            Some(p) => packed::embedding(ids, p, c)?,
            None => r::embedding(ids, table.data(), c)?,
        };
        Ok(out(Shape::new([ids.len(), c]), rows))
    }

    fn embedding_backward(&self, ids: &[u32], dout: &T<F>, dtable: &mut T<F>) -> Result<()> {
        let op = "embedding_backward";
        let [_, c] = *dtable.dims() else {
            return Err(Error::shape(
                op,
                format!("dtable {} must be [V, C]", dtable.shape()),
            ));
        };
        if dout.dims() != [ids.len(), c] {
            return Err(Error::shape(
                op,
                format!("dout {} must be [{}, {c}]", dout.shape(), ids.len()),
            ));
        }
        let dout = f32_data(op, dout)?;
        f32_data(op, dtable)?;
        r::embedding_backward(ids, dout, dtable.data_mut(), c)
    }

    fn cross_entropy(
        &self,
        logits: &T<F>,
        targets: &[i32],
        ignore_index: i32,
        grad_scale: f32,
        terms: LossTerms,
    ) -> Result<CrossEntropyOut<T<F>>> {
        let op = "cross_entropy";
        terms.check()?;
        let (rows, v) = (logits.shape().rows(), logits.shape().last());
        if logits.dims().is_empty() || rows != targets.len() {
            return Err(Error::shape(
                op,
                format!(
                    "logits {} ({rows} rows) vs {} targets",
                    logits.shape(),
                    targets.len()
                ),
            ));
        }
        let ce = r::cross_entropy(
            f32_data(op, logits)?,
            targets,
            v,
            ignore_index,
            F::from_f32(grad_scale),
            (F::from_f32(terms.z_loss), F::from_f32(terms.label_smoothing)),
        )?;
        Ok(CrossEntropyOut {
            losses: out(Shape::new([rows]), ce.losses),
            dlogits: out(logits.shape().clone(), ce.dlogits),
            z_losses: (terms.z_loss > 0.0).then(|| out(Shape::new([rows]), ce.z_losses)),
            uniform_losses: (terms.label_smoothing > 0.0).then(|| out(Shape::new([rows]), ce.uniform)),
        })
    }
}

/// The row width of `x` when it has `rows` rows (all leading dimensions
/// flattened), or a shape error naming both.
fn row_width<F: Real>(op: &'static str, x: &T<F>, rows: usize) -> Result<usize> {
    let c = x.dims().last().copied().unwrap_or(0);
    let have = x.numel().checked_div(c).unwrap_or(0);
    if x.shape().rank() == 0 || have != rows {
        return Err(Error::shape(
            op,
            format!("x {} has {have} rows, given {rows} weights", x.shape()),
        ));
    }
    Ok(c)
}
