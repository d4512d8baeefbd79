//! Storage bindings: a tensor's elements as aligned byte ranges of its
//! buffer, and row chunks that keep every range under the binding limit
//! and every kernel loop under the loop budget.

use megatrain_tensor::Result;

use super::GpuExecutor;
use crate::GpuError;
use crate::tensor::GpuTensor;

/// A byte range of a buffer bound as one storage binding, and where element 0
/// of the range the kernel wants lies inside it.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) buf: &'a wgpu::Buffer,
    pub(crate) offset: u64,
    pub(crate) size: u64,
    pub elem_off: u32,
}

impl GpuExecutor {
    /// Binds elements `start..start+count` of `t` (in its dtype's units).
    pub(crate) fn view<'a>(&self, t: &'a GpuTensor, start: usize, count: usize) -> Result<View<'a>> {
        let esize = t.dtype.size_in_bytes();
        debug_assert_eq!(
            t.offset % self.align,
            0,
            "slot tensors start on the binding alignment"
        );
        // Slot tensors sit at an aligned offset in a shared buffer: compute
        // the range as if the tensor began the buffer, then shift it.
        let v = self.view_buf(t.buffer(), esize, start, count, t.buf.class_bytes() - t.offset)?;
        Ok(View {
            offset: v.offset + t.offset,
            ..v
        })
    }

    pub(crate) fn full<'a>(&self, t: &'a GpuTensor) -> Result<View<'a>> {
        self.view(t, 0, t.numel())
    }

    fn view_buf<'a>(
        &self,
        buf: &'a wgpu::Buffer,
        esize: usize,
        start: usize,
        count: usize,
        buf_bytes: u64,
    ) -> Result<View<'a>> {
        let start_b = (start * esize) as u64;
        let end_b = (((start + count) * esize) as u64).div_ceil(4) * 4;
        let offset = start_b - start_b % self.align;
        let size = (end_b - offset).max(4).min(buf_bytes - offset);
        if size > self.max_binding {
            return Err(GpuError::Unsupported {
                op: "bind",
                detail: format!(
                    "a range of {size} bytes exceeds the storage binding limit of {} bytes",
                    self.max_binding
                ),
            }
            .into());
        }
        Ok(View {
            buf,
            offset,
            size,
            elem_off: (start - (offset as usize) / esize) as u32,
        })
    }

    pub(crate) fn dummy(&self) -> View<'_> {
        View {
            buf: &self.dummy,
            offset: 0,
            size: 256,
            elem_off: 0,
        }
    }

    /// Splits `rows` rows into chunks such that each operand, `row_elems[i]`
    /// f32 elements per row, fits one binding (with room for the alignment).
    pub(crate) fn row_chunks(&self, rows: usize, row_elems: &[usize]) -> Result<Vec<(usize, usize)>> {
        let widest = row_elems.iter().copied().max().unwrap_or(1).max(1) as u64 * 4;
        let room = self.max_binding.saturating_sub(self.align);
        let per = (room / widest) as usize;
        if per == 0 {
            return Err(GpuError::Unsupported {
                op: "bind",
                detail: format!(
                    "one row of {widest} bytes exceeds the storage binding limit of {} bytes",
                    self.max_binding
                ),
            }
            .into());
        }
        let mut out = Vec::new();
        let mut r = 0;
        while r < rows {
            let n = per.min(rows - r);
            out.push((r, n));
            r += n;
        }
        if out.is_empty() {
            out.push((0, 0));
        }
        Ok(out)
    }

    /// `row_chunks`, further split so that a kernel looping over the rows of
    /// its chunk stays within the loop budget.
    pub(crate) fn loop_chunks(&self, rows: usize, row_elems: &[usize]) -> Result<Vec<(usize, usize)>> {
        let cap = self.loop_budget.saturating_sub(64).max(1);
        let mut out = Vec::new();
        for (r0, n) in self.row_chunks(rows, row_elems)? {
            if n == 0 {
                out.push((r0, 0));
            }
            let mut r = r0;
            while r < r0 + n {
                let m = cap.min(r0 + n - r);
                out.push((r, m));
                r += m;
            }
        }
        Ok(out)
    }
}
