//! The closed vocabulary of ops a layer may use.
//!
//! A layer's forward and backward are written once against [`Executor`]; the
//! CPU executor defines what every op means, and every other executor is
//! tested against it. Each op comes with its backward as a separate method so
//! that a backend can fuse and recompute as it likes (attention keeps only
//! the log-sum-exp of each row, never the T×T probabilities).
//!
//! Layout conventions (all row-major, last dimension contiguous):
//! - activations are `[B, T, C]` or, for attention, `[B, T, H, D]` — the
//!   layout a projection produces directly, so no transpose is ever needed;
//! - "rows" of a tensor means all leading dimensions flattened, so `[B, T, C]`
//!   is read as `[B·T, C]` by row-wise ops (norms, bias, cross-entropy);
//! - token ids and targets are small host slices: they are copied to the
//!   device by the executor when it needs them.

use std::ops::Range;

use crate::{
    AddNormOut, AttentionGrads, AttentionOut, AttnMask, ClampedGlu, ComputePrecision, CrossEntropyOut, DType,
    DeltaRuleGrads, DeltaRuleOut, Docs, Download, Dropout, Error, Glu, HostRegistration, HostSlice,
    HostTensor, Landed, LossTerms, MatmulGrads, MatmulNeeds, Noise, NormGrads, NormOut, Result, Rope, Shape,
    SoftCap, TransportInfo, TransportStats, Transpose, WeightSlot, WeightUpload, compose_add_layernorm,
    compose_add_layernorm_backward, compose_add_rmsnorm, compose_add_rmsnorm_backward,
    compose_matmul_backward_gelu, compose_matmul_backward_glu, compose_matmul_backward_swiglu,
    compose_matmul_gelu, compose_matmul_glu, compose_matmul_swiglu,
};

/// What every executor's tensor handle can say about itself without a copy.
pub trait TensorHandle {
    fn shape(&self) -> &Shape;
    fn dtype(&self) -> DType;

    fn dims(&self) -> &[usize] {
        self.shape().dims()
    }

    fn numel(&self) -> usize {
        self.shape().numel()
    }
}

/// Executor-owned memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryStats {
    pub live_bytes: u64,
    pub peak_bytes: u64,
}

/// Where an executor's tensors live, and how much room its own memory has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorMemory {
    /// Host memory, beside the tier (the CPU executor, software GPUs).
    Host,
    /// A device's own memory: its size where the device reports one.
    Device(Option<u64>),
}

/// Bytes of f32 logits a default LM-head chunk holds where an executor's
/// tensors live in host memory (the CPU executor, software GPUs): they add
/// to the process's peak beside the tier, so they are kept small.
pub const HOST_LOGITS_CHUNK_BYTES: usize = 64 << 20;

/// The same on a GPU's own memory, which the streamed step leaves mostly
/// free. Large enough that the head's weight-gradient product, whose K is
/// the chunk's rows, is bound by compute and not by reading and writing
/// the f32 `[V, C]` gradient once per chunk: at 256 rows that product does
/// 64 FLOP per byte moved, a fifth of what an H100's f16 tensor cores need
/// per byte of its memory bandwidth; Qwen2.5-7B's 152k vocabulary gets
/// 1664 rows (5 chunks for 8 × 1024 tokens, not 32).
pub const DEVICE_LOGITS_CHUNK_BYTES: usize = 1 << 30;

pub trait Executor {
    type Tensor: TensorHandle;

    /// Human-readable name of the backend and device.
    fn name(&self) -> String;

    // ---- data movement -------------------------------------------------

    /// Copies a host tensor to the executor, in its own dtype (f32 for
    /// activations; bf16 is allowed for matmul `b` operands and gathered
    /// embedding tables).
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    /// Copies back, in the tensor's stored dtype.
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;
    fn zeros(&self, shape: &Shape) -> Result<Self::Tensor>;
    /// Same elements, new shape of equal count. May or may not copy.
    fn reshape(&self, t: &Self::Tensor, shape: &Shape) -> Result<Self::Tensor>;
    /// Rows `start..start+len` of `t` read as `[rows, last]`; result `[len, last]`.
    fn slice_rows(&self, t: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor>;
    /// Overwrites rows `start..start+src_rows` of `dst` (read as `[rows, last]`).
    fn write_rows(&self, dst: &mut Self::Tensor, start: usize, src: &Self::Tensor) -> Result<()>;
    /// Splits the last dimension into consecutive parts of the given sizes.
    fn split_last(&self, t: &Self::Tensor, sizes: &[usize]) -> Result<Vec<Self::Tensor>>;
    /// Inverse of `split_last`: all parts must share their leading dims.
    fn concat_last(&self, parts: &[&Self::Tensor]) -> Result<Self::Tensor>;

    /// Uploads borrowed host data without building a [`HostTensor`] first.
    /// Executors with device memory override this to write straight from
    /// the slice (the trainer uploads every layer's transport copy with it).
    fn upload_slice(&self, shape: &Shape, data: HostSlice<'_>) -> Result<Self::Tensor> {
        self.upload(&HostTensor::new(shape.clone(), data.to_host_data())?)
    }

    /// Downloads `t` widened to f32 into `out`, which must hold exactly its
    /// elements. Executors with device memory override this to skip the
    /// intermediate host tensor (the trainer fetches every gradient with it).
    fn download_into(&self, t: &Self::Tensor, out: &mut [f32]) -> Result<()> {
        if out.len() != t.numel() {
            return Err(Error::shape(
                "download_into",
                format!(
                    "tensor {} has {} elements, destination {}",
                    t.shape(),
                    t.numel(),
                    out.len()
                ),
            ));
        }
        out.copy_from_slice(&self.download(t)?.to_f32_vec());
        Ok(())
    }

    /// Loads one layer's weights into `slot` and returns them in table
    /// order. Executors with device memory keep one fixed set of buffers
    /// (and the bind groups over them) per slot; the default uploads fresh
    /// tensors.
    fn load_weights(&self, slot: WeightSlot, params: &[WeightUpload<'_>]) -> Result<Vec<Self::Tensor>> {
        let _ = slot;
        params.iter().map(|p| upload_weight(self, p)).collect()
    }

    /// Starts bringing `tensors` back to the host, widened to f32 and
    /// concatenated in order. The executor may go on with other ops before
    /// [`Executor::finish_download`] collects them.
    fn begin_download(&self, tensors: Vec<Self::Tensor>) -> Result<Download<Self::Tensor>> {
        Ok(Download::Tensors(tensors))
    }

    /// Completes a download into `out`, which must hold exactly the
    /// tensors' elements.
    fn finish_download(&self, d: Download<Self::Tensor>, out: &mut [f32]) -> Result<()> {
        match d {
            Download::Tensors(ts) => download_concat(self, &ts, out),
            Download::Ticket { id, .. } => Err(Error::shape(
                "finish_download",
                format!("ticket {id} was not issued by this executor"),
            )),
            Download::Range(r) => Err(Error::shape(
                "finish_download",
                format!("range {r:?} needs its tensors: finish it with finish_download_range"),
            )),
        }
    }

    /// Starts bringing elements `range` of the concatenation of `tensors`
    /// back, widened to f32: a part of one layer's gradients, so that no
    /// host or readback buffer has to hold a whole large layer (the trainer
    /// moves every layer in chunks this way). The caller keeps `tensors`
    /// until each range is finished with
    /// [`Executor::finish_download_range`] and may have several ranges of
    /// them in flight. The default moves nothing now: the range is read
    /// from the tensors at finish (executors whose tensors are host memory).
    fn begin_download_range(
        &self,
        tensors: &[Self::Tensor],
        range: Range<usize>,
    ) -> Result<Download<Self::Tensor>> {
        check_range("begin_download_range", tensors, &range)?;
        Ok(Download::Range(range))
    }

    /// Completes a download begun by [`Executor::begin_download_range`]
    /// into `out` (exactly the range's elements); `tensors` are the ones it
    /// was begun with.
    fn finish_download_range(
        &self,
        d: Download<Self::Tensor>,
        tensors: &[Self::Tensor],
        out: &mut [f32],
    ) -> Result<()> {
        match d {
            Download::Range(r) => {
                check_range("finish_download_range", tensors, &r)?;
                if r.len() != out.len() {
                    return Err(Error::shape(
                        "finish_download_range",
                        format!("range {r:?} into a destination of {}", out.len()),
                    ));
                }
                let mut start = 0;
                for t in tensors {
                    let (lo, hi) = (r.start.max(start), r.end.min(start + t.numel()));
                    if lo < hi {
                        let dst = &mut out[lo - r.start..hi - r.start];
                        self.download_range_into(t, lo - start..hi - start, dst)?;
                    }
                    start += t.numel();
                }
                Ok(())
            }
            other => self.finish_download(other, out),
        }
    }

    /// Readies `count` buffers for range downloads of up to `elems` f32
    /// elements each, before a step needs them: downloads finished in place
    /// stay out while the optimizer reads them, so how many are out at once
    /// depends on its pace, and buffers made up front keep a warm step from
    /// making any. The default has nothing to ready.
    fn reserve_downloads(&self, elems: usize, count: usize) -> Result<()> {
        let _ = (elems, count);
        Ok(())
    }

    /// Completes a download begun by [`Executor::begin_download_range`]
    /// where its bytes landed, when the executor can hand them over in
    /// place (f32 in host-visible memory): `Ok(Ok(values))`. Otherwise `d`
    /// comes back unfinished, `Ok(Err(d))`, for
    /// [`Executor::finish_download_range`]. The default never can.
    fn finish_download_in_place(
        &self,
        d: Download<Self::Tensor>,
    ) -> Result<std::result::Result<Landed, Download<Self::Tensor>>> {
        Ok(Err(d))
    }

    /// Downloads elements `range` of `t` widened to f32 into `out`.
    /// Executors with host tensors override this to copy only the range;
    /// the default downloads the whole tensor.
    fn download_range_into(&self, t: &Self::Tensor, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        if range.end > t.numel() || range.len() != out.len() {
            return Err(Error::shape(
                "download_range_into",
                format!(
                    "elements {range:?} of {} into a destination of {}",
                    t.shape(),
                    out.len()
                ),
            ));
        }
        if range.len() == t.numel() {
            return self.download_into(t, out);
        }
        out.copy_from_slice(&self.download(t)?.to_f32_vec()[range]);
        Ok(())
    }

    /// Lets the executor read `region` by itself from now on: a
    /// [`Executor::load_weights`] of tensors inside it becomes a copy the
    /// device makes, with no host copy first. `Ok(None)` where the
    /// executor cannot (no device, no import support, a driver refusal):
    /// loads from the region are then copied as before. The default cannot.
    ///
    /// # Safety
    /// While the registration lives, `region` stays allocated at the same
    /// address; and once a load has read from it, the caller writes those
    /// bytes again only after work queued after that load has completed
    /// (a later download finished), because the device reads them when the
    /// load's copy runs, not when `load_weights` returns.
    unsafe fn register_host(&self, region: &[u8]) -> Result<Option<HostRegistration>> {
        let _ = region;
        Ok(None)
    }

    /// Chooses how layers will move, for layers of about `layer_bytes`
    /// transport bytes and `grad_bytes` gradient bytes (by measurement
    /// where there is a choice). `None` where there is nothing to choose.
    fn prepare_transport(&self, layer_bytes: u64, grad_bytes: u64) -> Result<Option<TransportInfo>> {
        let _ = (layer_bytes, grad_bytes);
        Ok(None)
    }

    /// Where the time of this executor's transfers went so far (see
    /// [`TransportStats`]); `None` for executors without a bus.
    fn transport_stats(&self) -> Option<TransportStats> {
        None
    }

    /// Live and peak bytes of executor-owned memory, for executors that
    /// account it (a GPU's device memory); `None` where it means nothing.
    fn memory_stats(&self) -> Option<MemoryStats> {
        None
    }

    /// Starts a new peak for [`Executor::memory_stats`].
    fn reset_peak_memory(&self) {}

    /// Sets the ops called so far running without waiting for them, before
    /// the host turns to work of its own (an executor that records ops in
    /// batches would otherwise hold them until its next transfer). A no-op
    /// where each op runs as it is called.
    fn flush(&self) {}

    /// Where this executor's tensors live ([`TensorMemory::Host`] unless it
    /// has memory of its own).
    fn tensor_memory(&self) -> TensorMemory {
        TensorMemory::Host
    }

    /// Bytes of f32 logits one default LM-head chunk may hold in this
    /// executor's memory ([`HOST_LOGITS_CHUNK_BYTES`] unless it has its own).
    fn logits_chunk_bytes(&self) -> usize {
        HOST_LOGITS_CHUNK_BYTES
    }

    /// Sets the precision of every later matmul's operands (see
    /// [`ComputePrecision`]). Executors that cannot honour `F16` refuse it.
    fn set_compute_precision(&mut self, p: ComputePrecision) -> Result<()> {
        match p {
            ComputePrecision::F32 => Ok(()),
            ComputePrecision::F16 => Err(Error::invalid(
                "set_compute_precision",
                format!("{} has no f16 compute precision", self.name()),
            )),
        }
    }

    /// The precision matmul operands are computed in.
    fn compute_precision(&self) -> ComputePrecision {
        ComputePrecision::F32
    }

    // ---- elementwise ---------------------------------------------------

    /// a + b, same shapes. Its backward is the identity to both inputs.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// acc += x, same element count.
    fn add_assign(&self, acc: &mut Self::Tensor, x: &Self::Tensor) -> Result<()>;
    /// s · x, `s` rounded to the executor's precision (f32 but for the
    /// f64 reference executor, which keeps every digit of a model's factors).
    fn scale(&self, x: &Self::Tensor, s: f64) -> Result<Self::Tensor>;
    /// x + c (Gemma's norms' gains are 1 + their weights), `c` as `scale`'s.
    fn add_scalar(&self, x: &Self::Tensor, c: f64) -> Result<Self::Tensor>;
    /// Row `r` of `x` (all leading dimensions flattened) times `w[r]`, the
    /// weights rounded as `scale`'s factor (a mixture-of-experts block's
    /// routing weights, which the host computes). Its backward is itself
    /// towards `x` and [`Executor::row_dots`] towards `w`.
    fn scale_rows(&self, x: &Self::Tensor, w: &[f64]) -> Result<Self::Tensor>;
    /// `[rows]`: the dot product of each row of `a` with the same row of
    /// `b` (same shapes, rows as in `scale_rows`).
    fn row_dots(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x` (`[B, …, C]`) with each element kept and scaled by
    /// `1 / (1 − p)` or zeroed, as `d`'s mask says of it: mask row
    /// [`Dropout::row`] of batch row `b` over the middle dimensions, column
    /// its index in the last. Its backward is the same op on the output's
    /// gradient.
    fn dropout(&self, x: &Self::Tensor, d: &Dropout) -> Result<Self::Tensor>;
    /// `x` (`[B, …, C]`, laid out as for `dropout`) plus `n`'s uniform
    /// noise ([`Noise::value`] of each element's mask row and column),
    /// added in f32. Its backward passes the gradient unchanged.
    fn add_noise(&self, x: &Self::Tensor, n: &Noise) -> Result<Self::Tensor>;

    // ---- matmul --------------------------------------------------------

    /// `op(a) @ op(b) + bias`. `a` is `[.., M, K]` (see [`Transpose`]); `b`
    /// is 2-D and shared by every batch, or has the same leading dims as
    /// `a`. `bias` is `[N]`. The output is `[.., M, N]`. `b` may be bf16.
    fn matmul(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        t: Transpose,
    ) -> Result<Self::Tensor>;

    fn matmul_backward(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<Self::Tensor>>;

    /// [`matmul_backward`](Self::matmul_backward) with `b`'s gradient added
    /// into `db_acc` (f32, `b`'s shape) instead of returned: element by
    /// element `db_acc + db`, `db` as `matmul_backward` computes it, so the
    /// bits equal `matmul_backward` then [`add_assign`](Self::add_assign)
    /// (on the GPU, where `K` fits one dispatch). `needs.db` is ignored and
    /// the returned `db` is `None`. For a weight's gradient summed over
    /// chunks of rows (the LM head) without a weight-sized temporary per
    /// chunk; this default composes the two ops and holds one.
    fn matmul_backward_into(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: &mut Self::Tensor,
    ) -> Result<MatmulGrads<Self::Tensor>> {
        let mut g = self.matmul_backward(a, b, dout, t, MatmulNeeds { db: true, ..needs })?;
        let db = g.db.take().expect("db was requested");
        self.add_assign(db_acc, &db)?;
        Ok(g)
    }

    /// [`matmul_backward`](Self::matmul_backward) with `a`'s gradient added
    /// into `da_acc` (f32, `a`'s shape) instead of returned: element by
    /// element `da_acc + da`, so the bits equal `matmul_backward` then
    /// [`add_assign`](Self::add_assign). `needs.da` is ignored and the
    /// returned `da` is `None`. For an input read by several products (a
    /// block's normed input, read by q, k and v) whose gradients are summed;
    /// this default composes the two ops and holds one temporary.
    fn matmul_backward_da_into(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        da_acc: &mut Self::Tensor,
    ) -> Result<MatmulGrads<Self::Tensor>> {
        crate::check_da_acc(da_acc.shape(), da_acc.dtype(), a.shape())?;
        let mut g = self.matmul_backward(a, b, dout, t, MatmulNeeds { da: true, ..needs })?;
        let da = g.da.take().expect("da was requested");
        self.add_assign(da_acc, &da)?;
        Ok(g)
    }

    // ---- matmuls fused with the activation beside them -----------------
    //
    // An MLP's activation reads a product's output (forward) and its
    // gradient is the next product's input gradient (backward). These run
    // the product and the activation as one op, so that an executor can
    // apply the activation where the product is stored instead of in a
    // pass of its own over the largest tensors of the step. The defaults
    // compose the unfused ops: they are the reference.

    /// `f = op(a) @ op(b) + bias` and [`gelu`](Self::gelu) of it: returns
    /// `(f, gelu(f))` (`f` is what the backward needs).
    fn matmul_gelu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        t: Transpose,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        compose_matmul_gelu(self, a, b, bias, t)
    }

    /// `up = op(a) @ op(b) + bias` and [`swiglu`](Self::swiglu)`(gate, up)`:
    /// returns `(up, s)`. `gate` (f32) has the product's shape.
    fn matmul_swiglu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        t: Transpose,
        gate: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        compose_matmul_swiglu(self, a, b, bias, t, gate)
    }

    /// [`matmul_backward`](Self::matmul_backward) of a product whose `a` is
    /// `gelu(pre)`, carried on through the activation: the returned `da` is
    /// the gradient of `pre` (f32, `a`'s shape), i.e.
    /// `gelu_backward(pre, dout @ op(b)ᵀ)`. It is always computed
    /// (`needs.da` is ignored); `db` and `dbias` as `needs` says.
    fn matmul_backward_gelu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        pre: &Self::Tensor,
    ) -> Result<MatmulGrads<Self::Tensor>> {
        compose_matmul_backward_gelu(self, a, b, dout, t, needs, pre)
    }

    /// [`matmul_backward`](Self::matmul_backward) of a product whose `a` is
    /// `swiglu(gate, up)`, carried on through the activation: returns `b`'s
    /// and the bias's gradients as `needs` says (`da` is `None`), then
    /// `(dgate, dup) = swiglu_backward(gate, up, dout @ op(b)ᵀ)`. `gate` and
    /// `up` (f32) have `a`'s shape.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn matmul_backward_swiglu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        gate: &Self::Tensor,
        up: &Self::Tensor,
    ) -> Result<(MatmulGrads<Self::Tensor>, Self::Tensor, Self::Tensor)> {
        compose_matmul_backward_swiglu(self, a, b, dout, t, needs, gate, up)
    }

    /// `up = op(a) @ op(b) + bias` and [`geglu`](Self::geglu)`(gate, up)`:
    /// returns `(up, s)`, as [`matmul_swiglu`](Self::matmul_swiglu).
    fn matmul_geglu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        bias: Option<&Self::Tensor>,
        t: Transpose,
        gate: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        compose_matmul_glu(self, a, b, bias, t, gate, Glu::Gelu)
    }

    /// [`matmul_backward_swiglu`](Self::matmul_backward_swiglu) of a
    /// product whose `a` is `geglu(gate, up)`.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn matmul_backward_geglu(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        dout: &Self::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        gate: &Self::Tensor,
        up: &Self::Tensor,
    ) -> Result<(MatmulGrads<Self::Tensor>, Self::Tensor, Self::Tensor)> {
        compose_matmul_backward_glu(self, a, b, dout, t, needs, gate, up, Glu::Gelu)
    }

    // ---- norms ---------------------------------------------------------

    /// y = x / sqrt(mean(x²) + eps) · w, over the last dimension. `w` is `[C]`.
    fn rmsnorm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f32) -> Result<NormOut<Self::Tensor>>;
    fn rmsnorm_backward(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        rstd: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<NormGrads<Self::Tensor>>;

    /// y = (x − mean) / sqrt(var + eps) · w + b, over the last dimension.
    fn layernorm(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<NormOut<Self::Tensor>>;
    fn layernorm_backward(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        mean: &Self::Tensor,
        rstd: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<NormGrads<Self::Tensor>>;

    // ---- residual add fused with a norm --------------------------------
    //
    // A pre-norm block reads its residual stream through a norm at two
    // places: `h = x + r` feeds both the norm and the rest of the stream.
    // These run the add and the norm (forward) and the norm's backward and
    // the stream's gradient (backward) as one op each. The defaults compose
    // the unfused ops; an executor overrides them to save passes over the
    // activations.

    /// `h = x + r`, then `y = rmsnorm(h) · w`. Returns `h` and the norm.
    fn add_rmsnorm(
        &self,
        x: &Self::Tensor,
        r: &Self::Tensor,
        w: &Self::Tensor,
        eps: f32,
    ) -> Result<AddNormOut<Self::Tensor>> {
        compose_add_rmsnorm(self, x, r, w, eps)
    }

    /// Backward of a norm whose input `h` also flows on in the residual
    /// stream: `dx = ∂rmsnorm(h)ᵀ · dy + dh`, where `dh` is the gradient
    /// arriving through the stream. For `h = x + r` that `dx` is the
    /// gradient of both `x` and `r`.
    fn add_rmsnorm_backward(
        &self,
        h: &Self::Tensor,
        w: &Self::Tensor,
        rstd: &Self::Tensor,
        dy: &Self::Tensor,
        dh: &Self::Tensor,
    ) -> Result<NormGrads<Self::Tensor>> {
        compose_add_rmsnorm_backward(self, h, w, rstd, dy, dh)
    }

    /// `h = x + r`, then `y = layernorm(h) · w + b`. Returns `h` and the norm.
    fn add_layernorm(
        &self,
        x: &Self::Tensor,
        r: &Self::Tensor,
        w: &Self::Tensor,
        b: &Self::Tensor,
        eps: f32,
    ) -> Result<AddNormOut<Self::Tensor>> {
        compose_add_layernorm(self, x, r, w, b, eps)
    }

    /// [`Executor::add_rmsnorm_backward`] for LayerNorm.
    #[allow(clippy::too_many_arguments)]
    fn add_layernorm_backward(
        &self,
        h: &Self::Tensor,
        w: &Self::Tensor,
        mean: &Self::Tensor,
        rstd: &Self::Tensor,
        dy: &Self::Tensor,
        dh: &Self::Tensor,
    ) -> Result<NormGrads<Self::Tensor>> {
        compose_add_layernorm_backward(self, h, w, mean, rstd, dy, dh)
    }

    // ---- attention -----------------------------------------------------

    /// Rotary position embedding of `x: [B, T, H, D]` (D even), position of
    /// token t is `rope.offset + t`; inverse frequencies theta^(−2i/D).
    fn rope(&self, x: &Self::Tensor, rope: Rope) -> Result<Self::Tensor>;
    /// The rotation is orthogonal: the backward rotates `dy` by −angle.
    fn rope_backward(&self, dy: &Self::Tensor, rope: Rope) -> Result<Self::Tensor>;

    /// Causal softmax(q kᵀ / sqrt(D)) v with grouped-query heads: q is
    /// `[B, T, Hq, D]`, k and v are `[B, T, Hkv, D]`, Hq a multiple of Hkv;
    /// query head h reads kv head h / (Hq / Hkv); each query sees the keys
    /// `mask` leaves it. The backward follows the forward's mask.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        mask: AttnMask,
    ) -> Result<AttentionOut<Self::Tensor>>;
    fn attention_backward(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        fwd: &AttentionOut<Self::Tensor>,
        dout: &Self::Tensor,
    ) -> Result<AttentionGrads<Self::Tensor>>;

    /// Attention of new queries over a cache of keys and values, for
    /// generation: q `[B, Tq, Hq, D]` are the last Tq of `len` positions;
    /// k and v `[B, Tc, Hkv, D]` hold every key and value so far in their
    /// first `len` positions (`1 ≤ Tq ≤ len ≤ Tc`; the rest is not read).
    /// Query i sits at position `len − Tq + i` and sees the keys `mask`
    /// leaves it there (its window and soft cap; `mask.docs` must be
    /// `None`). Returns out `[B, Tq, Hq, D]` and lse `[B, Hq, Tq]`, so
    /// [`attention_sinks`](Self::attention_sinks) applies to it. Forward
    /// only, and computed in f32 (the executor's float) from the operands
    /// as given, whatever the compute precision: a decoding step reads
    /// each cached key once, so it is bound by memory, not products.
    fn attention_cached(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        len: usize,
        mask: AttnMask,
    ) -> Result<AttentionOut<Self::Tensor>>;

    /// GPT-OSS's attention sinks: one learned logit per query head,
    /// `sinks: [Hq]` (f32), joins every row's softmax, taking its share of
    /// the probability with no value vector. From the plain attention's
    /// `fwd` that is a rescaling of each row,
    /// `O_s[b,t,h,:] = O[b,t,h,:] · σ(lse[b,h,t] − sinks[h])` (σ the
    /// logistic sigmoid), so the attention kernels stay as they are.
    fn attention_sinks(&self, fwd: &AttentionOut<Self::Tensor>, sinks: &Self::Tensor)
    -> Result<Self::Tensor>;
    /// Backward of [`attention_sinks`](Self::attention_sinks) from its
    /// output `out` (`O_s`), the plain attention's `lse`, `sinks` and
    /// `dout` (`dO_s`), with `σ` recomputed per row. Returns
    /// `(σ · dO_s, dsinks)`, `dsinks[h] = −Σ_{b,t} (dO_s · O_s)(1 − σ)`
    /// (`[Hq]`, summed in a fixed order). The first, given to
    /// [`attention_backward`](Self::attention_backward) with
    /// `AttentionOut { out: O_s, lse, mask }`, gives exactly the sink
    /// attention's dq, dk and dv: the backward's probabilities from `lse`
    /// are the sink's divided by σ, and its `rowsum(dout ∘ out)` is then
    /// the sink softmax's own.
    fn attention_sinks_backward(
        &self,
        out: &Self::Tensor,
        lse: &Self::Tensor,
        sinks: &Self::Tensor,
        dout: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)>;

    /// The gated delta rule, the linear attention of Qwen3-Next and
    /// Qwen3.5 (transformers' `torch_recurrent_gated_delta_rule` without its
    /// l2 norm and query scaling: the caller passes q normalised and scaled,
    /// k normalised). q, k: `[B, T, Hk, Dk]`; v: `[B, T, Hv, Dv]`; beta:
    /// `[B, T, Hv]`, Hv a multiple of Hk, value head h reading key head
    /// h / (Hv / Hk). Per (b, h) a state `S: [Dk, Dv]`, zero at t = 0, and
    /// for each step: `S ← exp(g)·S; δ = β(v − Sᵀk); S ← S + k δᵀ;
    /// o = Sᵀq`. g is one decay per value head and step, `[B, T, Hv]`, or
    /// one per key channel, `[B, T, Hv, Dk]` (Kimi Linear's KDA,
    /// transformers' `recurrent_kimi_delta_attention`, which has Hk = Hv):
    /// then row i of S decays on its own, `S[i, :] ← exp(g[i])·S[i, :]`.
    /// With `docs` the state is zero again at each document's first step,
    /// as if each document ran alone (fla's `cu_seqlens`). Returns out
    /// `[B, T, Hv, Dv]` and the checkpointed states the backward replays
    /// ([`DeltaRuleOut::saved`]). Computed in f32 (or the
    /// executor's float) whatever the compute precision: the recurrence
    /// compounds every rounding over the whole sequence.
    fn gated_delta_rule(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        docs: Option<&Docs>,
    ) -> Result<DeltaRuleOut<Self::Tensor>>;
    /// [`gated_delta_rule`](Self::gated_delta_rule) of T new steps
    /// continuing from `state` `[B, Hv, Dk, Dv]` (what the steps before
    /// left; zeros at a sequence's start), which it updates to what the
    /// last step leaves: generation over a cache. Forward only, without
    /// documents or checkpoints; returns out `[B, T, Hv, Dv]`.
    fn gated_delta_rule_cached(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        state: &mut Self::Tensor,
    ) -> Result<Self::Tensor>;
    /// Backward of [`gated_delta_rule`](Self::gated_delta_rule) from its
    /// `fwd` and `dout`: each chunk's states recomputed from its checkpoint,
    /// then walked in reverse, under the forward's documents (no gradient
    /// reaches a document from the next). dq and dk are summed over the
    /// value heads that share their key head; dg has g's shape: with
    /// `A = S_{t−1}` and dA the gradient of the decayed state `exp(g)·A`, a
    /// per-head
    /// `dg_t = exp(g_t)·Σ_ij A[i, j]·dA[i, j]`, a per-channel
    /// `dg_t[i] = exp(g_t[i])·Σ_j A[i, j]·dA[i, j]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule_backward(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        fwd: &DeltaRuleOut<Self::Tensor>,
        dout: &Self::Tensor,
    ) -> Result<DeltaRuleGrads<Self::Tensor>>;

    // ---- activations ---------------------------------------------------

    /// silu(gate) · up.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// Returns (dgate, dup).
    fn swiglu_backward(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)>;

    /// GPT-OSS's clamped SwiGLU of its one gate/up product `gate_up:
    /// [.., 2F]`, gate and up interleaved (gate at 2i, up at 2i + 1 of the
    /// last dimension, as its checkpoints lay the product out): with
    /// `g = min(gate, limit)` and `u = clamp(up, −limit, limit)`, output
    /// i is `g · σ(alpha · g) · (u + 1)`; `[.., F]`. The constants of `c`
    /// rounded as `scale`'s factor.
    fn swiglu_clamped(&self, gate_up: &Self::Tensor, c: ClampedGlu) -> Result<Self::Tensor>;
    /// The gradient of `gate_up` (interleaved as it is) from `dy: [.., F]`.
    /// The clamps pass the gradient where they left the value as it was,
    /// bounds included, and stop it where they bound it (torch's `clamp`):
    /// a gate's is 0 where `gate > limit`, an up's where `|up| > limit`.
    fn swiglu_clamped_backward(
        &self,
        gate_up: &Self::Tensor,
        dy: &Self::Tensor,
        c: ClampedGlu,
    ) -> Result<Self::Tensor>;

    /// gelu(gate) · up (GeGLU, Gemma's MLP), [`gelu`](Self::gelu)'s tanh
    /// approximation.
    fn geglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// Returns (dgate, dup).
    fn geglu_backward(
        &self,
        gate: &Self::Tensor,
        up: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)>;

    /// `cap · tanh(x / cap)` (Gemma's final logit soft-capping), in `x`'s
    /// own storage where no other handle shares it: the LM head caps a
    /// chunk of logits without a second logits-sized tensor.
    fn softcap(&self, x: Self::Tensor, cap: SoftCap) -> Result<Self::Tensor>;
    /// `dx` from the capped `y` and `dy`: `dy · (1 − (y / cap)²)`, in `dy`'s
    /// storage as [`softcap`](Self::softcap) is in `x`'s.
    fn softcap_backward(&self, y: &Self::Tensor, dy: Self::Tensor, cap: SoftCap) -> Result<Self::Tensor>;

    /// The exact GELU, `0.5 · x · (1 + erf(x / √2))` (`hidden_act`
    /// `gelu`: GPT-NeoX's and Pythia's).
    fn gelu_erf(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    fn gelu_erf_backward(&self, x: &Self::Tensor, dy: &Self::Tensor) -> Result<Self::Tensor>;

    /// GELU, tanh approximation (GPT-2's `gelu_new`).
    fn gelu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    fn gelu_backward(&self, x: &Self::Tensor, dy: &Self::Tensor) -> Result<Self::Tensor>;

    // ---- the gated delta net's small ops (Qwen3-Next, Qwen3.5) ---------

    /// Depthwise causal conv1d then SiLU (the Gated DeltaNet's short
    /// convolution, no bias): `x: [B, T, C]`, `w: [C, K]` (HF's
    /// `conv1d.weight` squeezed),
    /// `y[b, t, c] = silu(Σ_{i<K} w[c, i] · x[b, t − K + 1 + i, c])`, the
    /// positions before `t = 0` of each sequence reading 0; with `docs`
    /// each document is a sequence (causal-conv1d's `seq_idx`).
    fn causal_conv1d_silu(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        docs: Option<&Docs>,
    ) -> Result<Self::Tensor>;
    /// Returns `(dx [B, T, C], dw [C, K])`; recomputes the pre-activation
    /// from `x` and `w`. `docs` as the forward's.
    fn causal_conv1d_silu_backward(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        dy: &Self::Tensor,
        docs: Option<&Docs>,
    ) -> Result<(Self::Tensor, Self::Tensor)>;

    /// The gated delta rule's gates from the projections `a` and `b` and
    /// the parameters `a_log` and `dt_bias`:
    /// `g = −exp(a_log) · softplus(a + dt_bias)` (torch's softplus: β 1,
    /// threshold 20, x itself above it), `beta = σ(b)`. The decays are one
    /// a head, `a, b: [N, H]` with `a_log, dt_bias: [H]`, or one a key
    /// channel (Kimi Linear's), `a: [N, H, Dk]` with `a_log` and `dt_bias`
    /// `[H·Dk]` (a row's channels in order), the rates staying one a head,
    /// `b: [N, H]`. Returns `(g, beta)`, of `a`'s and `b`'s shapes. (The
    /// leading dimensions `..` of `a: [.., H]` or `[.., H, Dk]` and
    /// `b: [.., H]` are read as N, as the row-wise ops read them.)
    fn delta_gates(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Tensor,
        dt_bias: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// Returns `(da, db, da_log, ddt_bias)`, of `a`'s, `b`'s, `a_log`'s
    /// and `dt_bias`'s shapes, from `dg` (`a`'s shape) and `dbeta` (`b`'s).
    #[allow(clippy::type_complexity)]
    fn delta_gates_backward(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Tensor,
        dt_bias: &Self::Tensor,
        dg: &Self::Tensor,
        dbeta: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor, Self::Tensor)>;

    /// x · σ(gate), elementwise, same shapes (Qwen3-Next's gated attention output).
    fn sigmoid_mul(&self, gate: &Self::Tensor, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// Returns (dgate, dx).
    fn sigmoid_mul_backward(
        &self,
        gate: &Self::Tensor,
        x: &Self::Tensor,
        dy: &Self::Tensor,
    ) -> Result<(Self::Tensor, Self::Tensor)>;

    // ---- embedding and loss --------------------------------------------

    /// Gathers rows of `table: [V, C]`: result `[ids.len(), C]`. An id ≥ V is
    /// an error naming it.
    fn embedding(&self, ids: &[u32], table: &Self::Tensor) -> Result<Self::Tensor>;
    /// Scatter-adds `dout: [ids.len(), C]` into `dtable: [V, C]` (accumulates,
    /// so a tied head and embedding share one gradient).
    fn embedding_backward(&self, ids: &[u32], dout: &Self::Tensor, dtable: &mut Self::Tensor) -> Result<()>;

    /// Softmax cross-entropy of `logits: [N, V]` against `targets` (len N);
    /// rows whose target equals `ignore_index` count for nothing. The caller
    /// passes `grad_scale` (1 / number of counted targets of the whole batch)
    /// so that chunks of rows can be processed independently. `terms` adds
    /// a z-loss and label smoothing to what the gradient is of (and returns
    /// their per-row parts); out of range ([`LossTerms::check`]), an error.
    fn cross_entropy(
        &self,
        logits: &Self::Tensor,
        targets: &[i32],
        ignore_index: i32,
        grad_scale: f32,
        terms: LossTerms,
    ) -> Result<CrossEntropyOut<Self::Tensor>>;
}

/// Checks that `range` lies within the concatenation of `tensors`.
fn check_range<T: TensorHandle>(op: &'static str, tensors: &[T], range: &Range<usize>) -> Result<()> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    if range.start > range.end || range.end > total {
        return Err(Error::shape(
            op,
            format!("elements {range:?} of tensors holding {total}"),
        ));
    }
    Ok(())
}

/// Downloads `tensors` widened to f32 one after another into `out`, which
/// must hold exactly their elements: [`Executor::finish_download`] of a
/// [`Download::Tensors`].
pub fn download_concat<E: Executor + ?Sized>(ex: &E, tensors: &[E::Tensor], out: &mut [f32]) -> Result<()> {
    let total: usize = tensors.iter().map(|t| t.numel()).sum();
    if total != out.len() {
        return Err(Error::shape(
            "finish_download",
            format!("{total} elements into a destination of {}", out.len()),
        ));
    }
    let mut at = 0;
    for t in tensors {
        ex.download_into(t, &mut out[at..at + t.numel()])?;
        at += t.numel();
    }
    Ok(())
}

/// One weight into a fresh tensor of its own (outside any slot), widened
/// to f32 where `w.dtype` asks for it.
pub fn upload_weight<E: Executor + ?Sized>(ex: &E, w: &WeightUpload<'_>) -> Result<E::Tensor> {
    w.validate("load_weights")?;
    if w.dtype == w.data.dtype() {
        ex.upload_slice(w.shape, w.data)
    } else {
        let mut wide = vec![0.0f32; w.data.len()];
        w.data.widen_into(&mut wide);
        ex.upload_slice(w.shape, HostSlice::F32(&wide))
    }
}
