//! Elementwise ops, activations and layout copies.

use megatrain_tensor::{
    DType, Dropout, Error, Glu, Noise, Result, Shape, SoftCap, dropout_layout, sigmoid_mul_check,
};

use super::{GpuExecutor, Op, View, f, grid_for, need_f32, rows_and_width, same_shape, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

impl GpuExecutor {
    /// Runs a one-thread-per-element kernel over `n` elements of every
    /// operand (inputs then outputs, in binding order), in chunks that fit a
    /// binding. `params(count, elem_offsets)` builds the uniform block.
    pub(crate) fn run_elementwise(
        &self,
        name: &'static str,
        kernel: Kernel,
        operands: &[&GpuTensor],
        n: usize,
        params: impl Fn(usize, &[u32]) -> Vec<u32>,
    ) -> Result<()> {
        let ones: Vec<(&GpuTensor, usize)> = operands.iter().map(|&t| (t, 1)).collect();
        self.run_elementwise_wide(name, kernel, &ones, n, params)
    }

    /// [`Self::run_elementwise`] over `n` threads whose operands hold
    /// `width` elements a thread each (`(tensor, width)`: GPT-OSS's
    /// interleaved gate/up pairs beside their one output).
    pub(crate) fn run_elementwise_wide(
        &self,
        name: &'static str,
        kernel: Kernel,
        operands: &[(&GpuTensor, usize)],
        n: usize,
        params: impl Fn(usize, &[u32]) -> Vec<u32>,
    ) -> Result<()> {
        self.run_elementwise_from(name, kernel, operands, n, |_, count, offs| params(count, offs))
    }

    /// [`Self::run_elementwise_wide`] whose `params(start, count,
    /// elem_offsets)` also learns the first thread of each chunk.
    pub(crate) fn run_elementwise_from(
        &self,
        name: &'static str,
        kernel: Kernel,
        operands: &[(&GpuTensor, usize)],
        n: usize,
        params: impl Fn(usize, usize, &[u32]) -> Vec<u32>,
    ) -> Result<()> {
        let widths: Vec<usize> = operands.iter().map(|&(_, w)| w).collect();
        let mut op = self.op(name);
        for (start, count) in self.row_chunks(n, &widths)? {
            let views: Vec<View<'_>> = operands
                .iter()
                .map(|&(t, w)| self.view(t, start * w, count * w))
                .collect::<Result<_>>()?;
            let offs: Vec<u32> = views.iter().map(|v| v.elem_off).collect();
            op.dispatch(
                kernel,
                &params(start, count, &offs),
                &views,
                grid_for(count.div_ceil(256)),
            );
        }
        op.finish()
    }

    pub(crate) fn add_impl(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        need_f32("add", a)?;
        need_f32("add", b)?;
        same_shape("add", a, b)?;
        let c = self.alloc_f32(a.shape.clone())?;
        self.run_elementwise("add", Kernel::Add, &[a, b, &c], a.numel(), |n, o| {
            vec![u(n), o[0], o[1], o[2], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(c)
    }

    pub(crate) fn add_assign_impl(&self, acc: &mut GpuTensor, x: &GpuTensor) -> Result<()> {
        need_f32("add_assign", acc)?;
        need_f32("add_assign", x)?;
        if acc.numel() != x.numel() {
            return Err(Error::shape(
                "add_assign",
                format!("{} vs {}", acc.shape, x.shape),
            ));
        }
        self.make_unique(acc)?;
        self.run_elementwise("add_assign", Kernel::AddAssign, &[x, acc], x.numel(), |n, o| {
            vec![u(n), o[0], 0, o[1], 0, 0, 0, 0, 0, 0, 0, 0]
        })
    }

    pub(crate) fn scale_impl(&self, x: &GpuTensor, s: f32) -> Result<GpuTensor> {
        need_f32("scale", x)?;
        let y = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise("scale", Kernel::Scale, &[x, &y], x.numel(), |n, o| {
            vec![u(n), o[0], 0, o[1], f(s), 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    pub(crate) fn dropout_impl(&self, x: &GpuTensor, d: &Dropout) -> Result<GpuTensor> {
        let scale = d.scale() as f32;
        self.hashed_impl(
            "dropout",
            Kernel::Dropout,
            x,
            (d.key(), d.batch0()),
            (d.threshold(), scale),
        )
    }

    pub(crate) fn add_noise_impl(&self, x: &GpuTensor, n: &Noise) -> Result<GpuTensor> {
        let m = n.magnitude();
        self.hashed_impl(
            "add_noise",
            Kernel::UniformNoise,
            x,
            (n.key(), n.batch0()),
            (0, m),
        )
    }

    /// `x` through one of dropout.wgsl's kernels, which hash each element's
    /// mask row and column under `key` (rows counted from `batch0`) and
    /// take a threshold and an f32 factor.
    fn hashed_impl(
        &self,
        op: &'static str,
        k: Kernel,
        x: &GpuTensor,
        ([key0, key1], batch0): ([u32; 2], u32),
        (threshold, factor): (u32, f32),
    ) -> Result<GpuTensor> {
        need_f32(op, x)?;
        let (_, rows, cols) = dropout_layout(op, &x.shape)?;
        let y = self.alloc_f32(x.shape.clone())?;
        if x.numel() == 0 {
            return Ok(y);
        }
        self.run_elementwise_from(op, k, &[(x, 1), (&y, 1)], x.numel(), |first, n, o| {
            vec![
                u(n),
                o[0],
                o[1],
                u(first),
                key0,
                key1,
                threshold,
                f(factor),
                u(cols),
                u(rows),
                batch0,
                0,
            ]
        })?;
        Ok(y)
    }

    pub(crate) fn add_scalar_impl(&self, x: &GpuTensor, c: f32) -> Result<GpuTensor> {
        need_f32("add_scalar", x)?;
        let y = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise("add_scalar", Kernel::AddScalar, &[x, &y], x.numel(), |n, o| {
            vec![u(n), o[0], 0, o[1], f(c), 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    /// Row `r` of `x` times `w[r]`, the weights rounded to f32 and
    /// uploaded beside it.
    pub(crate) fn scale_rows_impl(&self, x: &GpuTensor, w: &[f64]) -> Result<GpuTensor> {
        const OP: &str = "scale_rows";
        need_f32(OP, x)?;
        let (rows, c) = rows_and_width(x);
        if x.shape.rank() == 0 || rows != w.len() {
            return Err(Error::shape(
                OP,
                format!("x {} has {rows} rows, given {} weights", x.shape, w.len()),
            ));
        }
        let y = self.alloc_f32(x.shape.clone())?;
        if y.numel() == 0 {
            return Ok(y);
        }
        let words: Vec<u32> = w.iter().map(|&s| f(s as f32)).collect();
        let wt = self.upload_words(&words)?;
        let mut op = self.op(OP);
        for (r0, nr) in self.row_chunks(rows, &[c])? {
            let xv = self.view(x, r0 * c, nr * c)?;
            let wv = self.view(&wt, r0, nr)?;
            let yv = self.view(&y, r0 * c, nr * c)?;
            let n = nr * c;
            let params = [
                u(n),
                xv.elem_off,
                wv.elem_off,
                yv.elem_off,
                0,
                u(nr),
                u(c),
                0,
                0,
                0,
                0,
                0,
            ];
            op.dispatch(
                Kernel::ScaleRows,
                &params,
                &[xv, wv, yv],
                grid_for(n.div_ceil(256)),
            );
        }
        op.keep(wt);
        op.finish()?;
        Ok(y)
    }

    /// Caps `x` in place (a copy first where its buffer is shared).
    pub(crate) fn softcap_impl(&self, mut x: GpuTensor, cap: SoftCap) -> Result<GpuTensor> {
        need_f32("softcap", &x)?;
        self.make_unique(&mut x)?;
        self.run_elementwise("softcap", Kernel::Softcap, &[&x], x.numel(), |n, o| {
            vec![u(n), 0, 0, o[0], f(cap.get()), 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(x)
    }

    /// Scales `dy` in place by the cap's slope at the capped `y`.
    pub(crate) fn softcap_backward_impl(
        &self,
        y: &GpuTensor,
        mut dy: GpuTensor,
        cap: SoftCap,
    ) -> Result<GpuTensor> {
        const OP: &str = "softcap_backward";
        need_f32(OP, y)?;
        need_f32(OP, &dy)?;
        same_shape(OP, y, &dy)?;
        self.make_unique(&mut dy)?;
        self.run_elementwise(OP, Kernel::SoftcapBwd, &[y, &dy], y.numel(), |n, o| {
            vec![u(n), o[0], 0, o[1], f(cap.get()), 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(dy)
    }

    /// `out` (w wide) = the column sums of the `rows` rows of `x`, in
    /// order, added to `out` where `accumulate`.
    pub(super) fn dispatch_sum_rows(
        &self,
        op: &mut Op<'_>,
        x: View<'_>,
        rows: usize,
        w: usize,
        out: View<'_>,
        accumulate: bool,
    ) {
        let params = [
            u(rows * w),
            x.elem_off,
            0,
            out.elem_off,
            0,
            u(rows),
            u(w),
            accumulate as u32,
            0,
            0,
            0,
            0,
        ];
        op.dispatch(Kernel::SumRows, &params, &[x, out], grid_for(w.div_ceil(256)));
    }

    /// Column sums of `x` read as `[rows, w]`. Past 64 rows a chunk is
    /// summed in blocks of rows by a 2-D grid into partial rows, which
    /// `sum_rows` then adds in order (one thread per column walking every
    /// row leaves a large GPU idle); where the partials would not fit one
    /// binding, one pass does it.
    pub(crate) fn sum_rows(&self, x: &GpuTensor, w: usize) -> Result<GpuTensor> {
        let rows = x.numel() / w.max(1);
        let out = self.alloc_f32([w])?;
        let mut op = self.op("sum_rows");
        let ov = self.full(&out)?;
        let max_blocks = (self.max_binding_bytes() / (4 * w as u64).max(1)).min(65535) as usize;
        for (i, (r0, nr)) in self.loop_chunks(rows, &[w])?.into_iter().enumerate() {
            let mut xv = self.view(x, r0 * w, nr * w)?;
            let mut n = nr;
            let blocks = nr.div_ceil(64).min(max_blocks);
            let partial = if blocks > 1 {
                let blk_rows = nr.div_ceil(blocks);
                let blocks = nr.div_ceil(blk_rows);
                let part = self.alloc_f32([blocks, w])?;
                let pv = self.full(&part)?;
                let params = [
                    0,
                    xv.elem_off,
                    0,
                    pv.elem_off,
                    0,
                    u(nr),
                    u(w),
                    0,
                    u(blk_rows),
                    0,
                    0,
                    0,
                ];
                op.dispatch(
                    Kernel::SumRowsPart,
                    &params,
                    &[xv, pv],
                    [u(w.div_ceil(256)), u(blocks), 1],
                );
                n = blocks;
                Some(part)
            } else {
                None
            };
            if let Some(part) = &partial {
                xv = self.full(part)?;
            }
            self.dispatch_sum_rows(&mut op, xv, n, w, ov, i > 0);
            if let Some(part) = partial {
                op.keep(part);
            }
        }
        op.finish()?;
        Ok(out)
    }

    /// `act(gate) · up`, the activation as `glu` says.
    pub(crate) fn glu_impl(&self, glu: Glu, gate: &GpuTensor, up: &GpuTensor) -> Result<GpuTensor> {
        let (name, kernel) = match glu {
            Glu::Silu => ("swiglu", Kernel::Swiglu),
            Glu::Gelu => ("geglu", Kernel::Geglu),
        };
        need_f32(name, gate)?;
        need_f32(name, up)?;
        same_shape(name, gate, up)?;
        let y = self.alloc_f32(gate.shape.clone())?;
        self.run_elementwise(name, kernel, &[gate, up, &y], y.numel(), |n, o| {
            vec![u(n), o[0], o[1], 0, o[2], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    /// (dgate, dup) of [`glu_impl`](Self::glu_impl).
    pub(crate) fn glu_backward_impl(
        &self,
        glu: Glu,
        gate: &GpuTensor,
        up: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        let (name, kernel) = match glu {
            Glu::Silu => ("swiglu_backward", Kernel::SwigluBwd),
            Glu::Gelu => ("geglu_backward", Kernel::GegluBwd),
        };
        for t in [gate, up, dy] {
            need_f32(name, t)?;
        }
        same_shape(name, gate, up)?;
        same_shape(name, gate, dy)?;
        let dg = self.alloc_f32(gate.shape.clone())?;
        let du = self.alloc_f32(gate.shape.clone())?;
        self.run_elementwise(name, kernel, &[gate, up, dy, &dg, &du], dg.numel(), |n, o| {
            vec![u(n), o[0], o[1], o[2], o[3], o[4], 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok((dg, du))
    }

    pub(crate) fn gelu_impl(&self, x: &GpuTensor) -> Result<GpuTensor> {
        need_f32("gelu", x)?;
        let y = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise("gelu", Kernel::Gelu, &[x, &y], y.numel(), |n, o| {
            vec![u(n), o[0], 0, 0, o[1], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    pub(crate) fn gelu_backward_impl(&self, x: &GpuTensor, dy: &GpuTensor) -> Result<GpuTensor> {
        need_f32("gelu_backward", x)?;
        need_f32("gelu_backward", dy)?;
        same_shape("gelu_backward", x, dy)?;
        let dx = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise(
            "gelu_backward",
            Kernel::GeluBwd,
            &[x, dy, &dx],
            dx.numel(),
            |n, o| vec![u(n), o[0], o[1], 0, o[2], 0, 0, 0, 0, 0, 0, 0, 0],
        )?;
        Ok(dx)
    }

    pub(crate) fn gelu_erf_impl(&self, x: &GpuTensor) -> Result<GpuTensor> {
        need_f32("gelu_erf", x)?;
        let y = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise("gelu_erf", Kernel::GeluErf, &[x, &y], y.numel(), |n, o| {
            vec![u(n), o[0], 0, 0, o[1], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    pub(crate) fn gelu_erf_backward_impl(&self, x: &GpuTensor, dy: &GpuTensor) -> Result<GpuTensor> {
        const OP: &str = "gelu_erf_backward";
        need_f32(OP, x)?;
        need_f32(OP, dy)?;
        same_shape(OP, x, dy)?;
        let dx = self.alloc_f32(x.shape.clone())?;
        self.run_elementwise(OP, Kernel::GeluErfBwd, &[x, dy, &dx], dx.numel(), |n, o| {
            vec![u(n), o[0], o[1], 0, o[2], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(dx)
    }

    /// `x · σ(gate)` (Qwen3-Next's gated attention output).
    pub(crate) fn sigmoid_mul_impl(&self, gate: &GpuTensor, x: &GpuTensor) -> Result<GpuTensor> {
        const OP: &str = "sigmoid_mul";
        need_f32(OP, gate)?;
        need_f32(OP, x)?;
        sigmoid_mul_check(OP, &gate.shape, &x.shape, None)?;
        let y = self.alloc_f32(gate.shape.clone())?;
        self.run_elementwise(OP, Kernel::SigmoidMul, &[gate, x, &y], y.numel(), |n, o| {
            vec![u(n), o[0], o[1], 0, o[2], 0, 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok(y)
    }

    /// (dgate, dx) of [`sigmoid_mul_impl`](Self::sigmoid_mul_impl).
    pub(crate) fn sigmoid_mul_backward_impl(
        &self,
        gate: &GpuTensor,
        x: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        const OP: &str = "sigmoid_mul_backward";
        for t in [gate, x, dy] {
            need_f32(OP, t)?;
        }
        sigmoid_mul_check(OP, &gate.shape, &x.shape, Some(&dy.shape))?;
        let dg = self.alloc_f32(gate.shape.clone())?;
        let dx = self.alloc_f32(gate.shape.clone())?;
        let operands = [gate, x, dy, &dg, &dx];
        self.run_elementwise(OP, Kernel::SigmoidMulBwd, &operands, dg.numel(), |n, o| {
            vec![u(n), o[0], o[1], o[2], o[3], o[4], 0, 0, 0, 0, 0, 0, 0]
        })?;
        Ok((dg, dx))
    }

    // ---- layout ---------------------------------------------------------

    pub(crate) fn reshape_impl(&self, t: &GpuTensor, shape: &Shape) -> Result<GpuTensor> {
        if shape.numel() != t.numel() {
            return Err(Error::shape("reshape", format!("{} to {shape}", t.shape)));
        }
        Ok(GpuTensor {
            buf: t.buf.clone(),
            offset: t.offset,
            shape: shape.clone(),
            dtype: t.dtype,
            derived: t.derived.clone(),
        })
    }

    fn byte_range(op: &'static str, t: &GpuTensor, start: usize, len: usize) -> Result<(u64, u64)> {
        let es = t.dtype.size_in_bytes();
        let (s, n) = ((start * es) as u64, (len * es) as u64);
        if s % 4 != 0 || n % 4 != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "{} rows of a {} tensor must start and end on 4-byte boundaries",
                    t.dtype, t.shape
                ),
            ));
        }
        Ok((s, n))
    }

    pub(crate) fn slice_rows_impl(&self, t: &GpuTensor, start: usize, len: usize) -> Result<GpuTensor> {
        let rows = t.shape.rows();
        let last = t.shape.last();
        if start + len > rows {
            return Err(Error::shape(
                "slice_rows",
                format!("rows {start}..{} of {} (rows = {rows})", start + len, t.shape),
            ));
        }
        let out = self.alloc(Shape::new([len, last]), t.dtype)?;
        let (s, n) = Self::byte_range("slice_rows", t, start * last, len * last)?;
        let mut op = self.op("slice_rows");
        op.copy(t.buffer(), t.offset + s, out.buffer(), 0, n);
        op.finish()?;
        Ok(out)
    }

    pub(crate) fn write_rows_impl(&self, dst: &mut GpuTensor, start: usize, src: &GpuTensor) -> Result<()> {
        let last = dst.shape.last();
        if src.shape.last() != last || src.dtype != dst.dtype {
            return Err(Error::shape(
                "write_rows",
                format!(
                    "src {} ({}) into dst {} ({})",
                    src.shape, src.dtype, dst.shape, dst.dtype
                ),
            ));
        }
        let n_rows = src.shape.rows();
        if start + n_rows > dst.shape.rows() {
            return Err(Error::shape(
                "write_rows",
                format!("rows {start}..{} of {}", start + n_rows, dst.shape),
            ));
        }
        self.make_unique(dst)?;
        let (s, n) = Self::byte_range("write_rows", dst, start * last, n_rows * last)?;
        let mut op = self.op("write_rows");
        op.copy(src.buffer(), src.offset, dst.buffer(), dst.offset + s, n);
        op.finish()
    }

    /// Copies `w` columns per row from `src` (row stride `ss`, column `sc`) to
    /// `dst` (row stride `ds`, column `dc`).
    #[allow(clippy::too_many_arguments)]
    fn copy_cols(
        &self,
        op: &mut super::Op<'_>,
        src: &GpuTensor,
        ss: usize,
        sc: usize,
        dst: &GpuTensor,
        ds: usize,
        dc: usize,
        w: usize,
        rows: usize,
    ) -> Result<()> {
        for (r0, nr) in self.row_chunks(rows, &[ss, ds])? {
            let sv = self.view(src, r0 * ss, nr * ss)?;
            let dv = self.view(dst, r0 * ds, nr * ds)?;
            let params = [
                u(nr * w),
                sv.elem_off,
                0,
                dv.elem_off,
                0,
                u(nr),
                u(w),
                0,
                u(ss),
                u(sc),
                u(ds),
                u(dc),
            ];
            op.dispatch(
                Kernel::CopyCols,
                &params,
                &[sv, dv],
                grid_for((nr * w).div_ceil(256)),
            );
        }
        Ok(())
    }

    pub(crate) fn split_last_impl(&self, t: &GpuTensor, sizes: &[usize]) -> Result<Vec<GpuTensor>> {
        need_f32("split_last", t)?;
        let last = t.shape.last();
        if sizes.iter().sum::<usize>() != last {
            return Err(Error::shape(
                "split_last",
                format!("sizes {sizes:?} do not sum to the last dim of {}", t.shape),
            ));
        }
        let rows = t.shape.rows();
        let mut op = self.op("split_last");
        let mut out = Vec::with_capacity(sizes.len());
        let mut col = 0;
        for &w in sizes {
            let p = self.alloc(t.shape.with_last(w), DType::F32)?;
            self.copy_cols(&mut op, t, last, col, &p, w, 0, w, rows)?;
            col += w;
            out.push(p);
        }
        op.finish()?;
        Ok(out)
    }

    pub(crate) fn concat_last_impl(&self, parts: &[&GpuTensor]) -> Result<GpuTensor> {
        let first = parts
            .first()
            .ok_or_else(|| Error::invalid("concat_last", "no parts"))?;
        let lead = &first.dims()[..first.shape.rank().saturating_sub(1)];
        let mut last = 0;
        for p in parts {
            need_f32("concat_last", p)?;
            if &p.dims()[..p.shape.rank().saturating_sub(1)] != lead {
                return Err(Error::shape(
                    "concat_last",
                    format!("{} vs {}", p.shape, first.shape),
                ));
            }
            last += p.shape.last();
        }
        let out = self.alloc(first.shape.with_last(last), DType::F32)?;
        let rows = first.shape.rows();
        let mut op = self.op("concat_last");
        let mut col = 0;
        for p in parts {
            let w = p.shape.last();
            self.copy_cols(&mut op, p, w, 0, &out, last, col, w, rows)?;
            col += w;
        }
        op.finish()?;
        Ok(out)
    }
}
