//! [`OrderedCpu`]: the CPU executor with reductions in a fixed order, so
//! that a run is reproducible bit for bit (and so resumes exactly).
//!
//! `CpuExecutor`'s RMSNorm and LayerNorm backward sum the gain (and bias)
//! gradients with a rayon `fold`/`reduce`, whose grouping follows work
//! stealing: under load, two identical runs round differently. Those two
//! ops are cheap (O(rows · C)), so this wrapper runs them on a one-thread
//! pool, where the grouping is always the same, and passes every other op
//! (all element-wise, per-row, or a GEMM that does not split the inner
//! dimension) straight through. When `crates/tensor` reduces in a fixed
//! order itself, this wrapper can go.

use megatrain_tensor::{
    AttentionGrads, AttentionOut, CpuExecutor, CpuTensor, CrossEntropyOut, Executor, HostSlice, HostTensor,
    MatmulGrads, MatmulNeeds, MemoryStats, NormGrads, NormOut, Result, Rope, Shape, Transpose,
};

pub struct OrderedCpu {
    inner: CpuExecutor,
    one: rayon::ThreadPool,
}

impl Default for OrderedCpu {
    fn default() -> Self {
        Self::new()
    }
}

impl OrderedCpu {
    pub fn new() -> Self {
        OrderedCpu {
            inner: CpuExecutor::new(),
            one: rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(|_| "megatrain-ordered".into())
                .build()
                .expect("a one-thread pool can always be built"),
        }
    }
}

type T = CpuTensor<f32>;

impl Executor for OrderedCpu {
    type Tensor = T;

    fn name(&self) -> String {
        format!("{} (ordered reductions)", self.inner.name())
    }
    fn upload(&self, t: &HostTensor) -> Result<T> {
        self.inner.upload(t)
    }
    fn download(&self, t: &T) -> Result<HostTensor> {
        self.inner.download(t)
    }
    fn zeros(&self, shape: &Shape) -> Result<T> {
        self.inner.zeros(shape)
    }
    fn reshape(&self, t: &T, shape: &Shape) -> Result<T> {
        self.inner.reshape(t, shape)
    }
    fn slice_rows(&self, t: &T, start: usize, len: usize) -> Result<T> {
        self.inner.slice_rows(t, start, len)
    }
    fn write_rows(&self, dst: &mut T, start: usize, src: &T) -> Result<()> {
        self.inner.write_rows(dst, start, src)
    }
    fn split_last(&self, t: &T, sizes: &[usize]) -> Result<Vec<T>> {
        self.inner.split_last(t, sizes)
    }
    fn concat_last(&self, parts: &[&T]) -> Result<T> {
        self.inner.concat_last(parts)
    }
    fn upload_slice(&self, shape: &Shape, data: HostSlice<'_>) -> Result<T> {
        self.inner.upload_slice(shape, data)
    }
    fn download_into(&self, t: &T, out: &mut [f32]) -> Result<()> {
        self.inner.download_into(t, out)
    }
    fn memory_stats(&self) -> Option<MemoryStats> {
        self.inner.memory_stats()
    }
    fn reset_peak_memory(&self) {
        self.inner.reset_peak_memory()
    }
    fn add(&self, a: &T, b: &T) -> Result<T> {
        self.inner.add(a, b)
    }
    fn add_assign(&self, acc: &mut T, x: &T) -> Result<()> {
        self.inner.add_assign(acc, x)
    }
    fn scale(&self, x: &T, s: f32) -> Result<T> {
        self.inner.scale(x, s)
    }
    fn matmul(&self, a: &T, b: &T, bias: Option<&T>, t: Transpose) -> Result<T> {
        self.inner.matmul(a, b, bias, t)
    }
    fn matmul_backward(
        &self,
        a: &T,
        b: &T,
        dout: &T,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<T>> {
        self.inner.matmul_backward(a, b, dout, t, needs)
    }
    fn rmsnorm(&self, x: &T, w: &T, eps: f32) -> Result<NormOut<T>> {
        self.inner.rmsnorm(x, w, eps)
    }
    fn rmsnorm_backward(&self, x: &T, w: &T, rstd: &T, dy: &T) -> Result<NormGrads<T>> {
        self.one.install(|| self.inner.rmsnorm_backward(x, w, rstd, dy))
    }
    fn layernorm(&self, x: &T, w: &T, b: &T, eps: f32) -> Result<NormOut<T>> {
        self.inner.layernorm(x, w, b, eps)
    }
    fn layernorm_backward(&self, x: &T, w: &T, mean: &T, rstd: &T, dy: &T) -> Result<NormGrads<T>> {
        self.one
            .install(|| self.inner.layernorm_backward(x, w, mean, rstd, dy))
    }
    fn rope(&self, x: &T, rope: Rope) -> Result<T> {
        self.inner.rope(x, rope)
    }
    fn rope_backward(&self, dy: &T, rope: Rope) -> Result<T> {
        self.inner.rope_backward(dy, rope)
    }
    fn attention(&self, q: &T, k: &T, v: &T) -> Result<AttentionOut<T>> {
        self.inner.attention(q, k, v)
    }
    fn attention_backward(
        &self,
        q: &T,
        k: &T,
        v: &T,
        fwd: &AttentionOut<T>,
        dout: &T,
    ) -> Result<AttentionGrads<T>> {
        self.inner.attention_backward(q, k, v, fwd, dout)
    }
    fn swiglu(&self, gate: &T, up: &T) -> Result<T> {
        self.inner.swiglu(gate, up)
    }
    fn swiglu_backward(&self, gate: &T, up: &T, dy: &T) -> Result<(T, T)> {
        self.inner.swiglu_backward(gate, up, dy)
    }
    fn gelu(&self, x: &T) -> Result<T> {
        self.inner.gelu(x)
    }
    fn gelu_backward(&self, x: &T, dy: &T) -> Result<T> {
        self.inner.gelu_backward(x, dy)
    }
    fn embedding(&self, ids: &[u32], table: &T) -> Result<T> {
        self.inner.embedding(ids, table)
    }
    fn embedding_backward(&self, ids: &[u32], dout: &T, dtable: &mut T) -> Result<()> {
        self.inner.embedding_backward(ids, dout, dtable)
    }
    fn cross_entropy(
        &self,
        logits: &T,
        targets: &[i32],
        ignore_index: i32,
        grad_scale: f32,
    ) -> Result<CrossEntropyOut<T>> {
        self.inner
            .cross_entropy(logits, targets, ignore_index, grad_scale)
    }
}
