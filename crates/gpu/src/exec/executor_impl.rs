//! The `Executor` trait, delegating to the op implementations.

use megatrain_tensor::{
    AddNormOut, AttentionGrads, AttentionOut, AttnMask, ClampedGlu, ComputePrecision, CrossEntropyOut, DType,
    DeltaRuleGrads, DeltaRuleOut, Docs, Download, Dropout, Executor, Glu, HostRegistration, HostSlice,
    HostTensor, Landed, LossTerms, MatmulGrads, MatmulNeeds, MemoryStats, Noise, NormGrads, NormOut, Result,
    Rope, Shape, SoftCap, TransportInfo, Transpose, WeightSlot, WeightUpload,
};

use super::GpuExecutor;
use crate::tensor::GpuTensor;

/// The device memory the noop device (host floor) stands for: an H100's
/// 80 GB.
const HOST_FLOOR_DEVICE_BYTES: u64 = 80_000_000_000;

impl Executor for GpuExecutor {
    type Tensor = GpuTensor;

    /// The adapter, and under F16 the kernel families in use (records of
    /// runs with `MEGATRAIN_F16_MATMUL` / `_ATTENTION` say which ran), with
    /// the head dimensions where `auto` let the tensor-core attention go,
    /// and the tile where it let the tensor-core matmul go.
    fn name(&self) -> String {
        match self.precision {
            ComputePrecision::F16 => {
                let refused: String = self
                    .ctx
                    .coop_attention_refused()
                    .iter()
                    .map(|(d, why)| format!("; D {d}: {why}"))
                    .chain(
                        self.ctx
                            .coop_matmul_refused()
                            .iter()
                            .map(|(_, why)| format!("; {why}")),
                    )
                    .collect();
                format!(
                    "gpu: {} (f16 kernels: matmul {}, attention {}{refused})",
                    self.ctx.info,
                    self.f16_matmul_kernel(),
                    self.f16_attention_kernel()
                )
            }
            ComputePrecision::F32 => format!("gpu: {}", self.ctx.info),
        }
    }

    /// F16 runs on every adapter: on tensor cores where it has cooperative
    /// matrices, else on the SIMT kernel rounding operands the same way.
    fn set_compute_precision(&mut self, p: ComputePrecision) -> Result<()> {
        if p == ComputePrecision::F16
            && matches!(self.f16_matmul, crate::F16Matmul::Coop(_))
            && !self.ctx.has_cooperative_matrix()
        {
            return Err(crate::GpuError::Unsupported {
                op: "set_compute_precision",
                detail: format!(
                    "tensor-core matmuls were asked for, but adapter '{}' has no 16x16x16 f16 cooperative matrices",
                    self.ctx.info.name
                ),
            }
            .into());
        }
        if p == ComputePrecision::F16
            && self.f16_attention == crate::F16Attention::Coop
            && !self.ctx.has_cooperative_matrix()
        {
            return Err(crate::GpuError::Unsupported {
                op: "set_compute_precision",
                detail: format!(
                    "tensor-core attention was asked for, but adapter '{}' has no 16x16x16 f16 cooperative matrices",
                    self.ctx.info.name
                ),
            }
            .into());
        }
        self.precision = p;
        Ok(())
    }

    fn compute_precision(&self) -> ComputePrecision {
        self.precision
    }

    fn upload(&self, t: &HostTensor) -> Result<GpuTensor> {
        self.upload_host(t)
    }

    fn download(&self, t: &GpuTensor) -> Result<HostTensor> {
        self.download_host(t)
    }

    fn upload_slice(&self, shape: &Shape, data: HostSlice<'_>) -> Result<GpuTensor> {
        let (dtype, bytes): (DType, &[u8]) = match data {
            HostSlice::F32(v) => (DType::F32, bytemuck::cast_slice(v)),
            HostSlice::BF16(v) => (DType::BF16, bytemuck::cast_slice(v)),
            HostSlice::F16(v) => (DType::F16, bytemuck::cast_slice(v)),
        };
        self.upload_bytes(shape, dtype, bytes)
    }

    fn download_into(&self, t: &GpuTensor, out: &mut [f32]) -> Result<()> {
        self.download_into_f32(t, out)
    }

    fn load_weights(&self, slot: WeightSlot, params: &[WeightUpload<'_>]) -> Result<Vec<GpuTensor>> {
        self.load_weights_impl(slot, params)
    }

    unsafe fn register_host(&self, region: &[u8]) -> Result<Option<HostRegistration>> {
        let cpu = self.ctx.adapter.get_info().device_type == wgpu::DeviceType::Cpu;
        match self.uploads {
            crate::Uploads::Copy => return Ok(None),
            crate::Uploads::Auto if cpu => return Ok(None),
            _ => {}
        }
        // SAFETY: the caller keeps `region` allocated while the
        // registration lives (this method's contract).
        let r = unsafe { crate::host_import::register(&self.ctx, region) }?;
        Ok(r.map(HostRegistration::new))
    }

    fn begin_download(&self, tensors: Vec<GpuTensor>) -> Result<Download<GpuTensor>> {
        self.begin_download_impl(tensors)
    }

    fn finish_download(&self, d: Download<GpuTensor>, out: &mut [f32]) -> Result<()> {
        self.finish_download_impl(d, out)
    }

    fn reserve_downloads(&self, elems: usize, count: usize) -> Result<()> {
        self.reserve_downloads_impl(elems, count)
    }

    fn finish_download_in_place(
        &self,
        d: Download<GpuTensor>,
    ) -> Result<std::result::Result<Landed, Download<GpuTensor>>> {
        self.finish_download_in_place_impl(d)
    }

    fn begin_download_range(
        &self,
        tensors: &[GpuTensor],
        range: std::ops::Range<usize>,
    ) -> Result<Download<GpuTensor>> {
        self.begin_download_range_impl(tensors, range)
    }

    fn prepare_transport(&self, layer_bytes: u64, grad_bytes: u64) -> Result<Option<TransportInfo>> {
        self.prepare_transport_impl(layer_bytes, grad_bytes).map(Some)
    }

    fn transport_stats(&self) -> Option<megatrain_tensor::TransportStats> {
        Some(GpuExecutor::transport_stats(self))
    }

    fn memory_stats(&self) -> Option<MemoryStats> {
        let m = self.memory();
        Some(MemoryStats {
            live_bytes: m.live_bytes,
            peak_bytes: m.peak_bytes,
        })
    }

    fn reset_peak_memory(&self) {
        GpuExecutor::reset_peak_memory(self);
    }

    fn flush(&self) {
        GpuExecutor::flush(self);
    }

    /// Host memory on a software adapter; a GPU's own memory otherwise,
    /// sized by its Vulkan device-local heap, this executor's share of it
    /// where data parallel ranks share the device
    /// ([`crate::GpuOptions::device_ranks`]). The noop device (host floor)
    /// has none to report and stands for an H100: its 80 GB, so that
    /// `--keep-activations auto` keeps there what it would keep on one.
    fn tensor_memory(&self) -> megatrain_tensor::TensorMemory {
        use megatrain_tensor::TensorMemory;
        let share = |b: u64| b / self.device_ranks as u64;
        if self.ctx.is_host_floor() {
            TensorMemory::Device(Some(share(HOST_FLOOR_DEVICE_BYTES)))
        } else if self.ctx.adapter.get_info().device_type == wgpu::DeviceType::Cpu {
            TensorMemory::Host
        } else {
            TensorMemory::Device(self.ctx.device_memory_bytes().map(share))
        }
    }

    /// A software adapter's memory is the host's. The noop device (host
    /// floor) stands for an H100 but reports a CPU (wgpu 30 ignores its
    /// `device_type` option): it chunks as a GPU does.
    fn logits_chunk_bytes(&self) -> usize {
        if self.ctx.adapter.get_info().device_type == wgpu::DeviceType::Cpu && !self.ctx.is_host_floor() {
            megatrain_tensor::HOST_LOGITS_CHUNK_BYTES
        } else {
            megatrain_tensor::DEVICE_LOGITS_CHUNK_BYTES
        }
    }

    fn zeros(&self, shape: &Shape) -> Result<GpuTensor> {
        self.zeros_f32(shape.clone())
    }

    fn reshape(&self, t: &GpuTensor, shape: &Shape) -> Result<GpuTensor> {
        self.reshape_impl(t, shape)
    }

    fn slice_rows(&self, t: &GpuTensor, start: usize, len: usize) -> Result<GpuTensor> {
        self.slice_rows_impl(t, start, len)
    }

    fn write_rows(&self, dst: &mut GpuTensor, start: usize, src: &GpuTensor) -> Result<()> {
        self.write_rows_impl(dst, start, src)
    }

    fn split_last(&self, t: &GpuTensor, sizes: &[usize]) -> Result<Vec<GpuTensor>> {
        self.split_last_impl(t, sizes)
    }

    fn concat_last(&self, parts: &[&GpuTensor]) -> Result<GpuTensor> {
        self.concat_last_impl(parts)
    }

    fn add(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        self.add_impl(a, b)
    }

    fn add_assign(&self, acc: &mut GpuTensor, x: &GpuTensor) -> Result<()> {
        self.add_assign_impl(acc, x)
    }

    fn scale(&self, x: &GpuTensor, s: f64) -> Result<GpuTensor> {
        self.scale_impl(x, s as f32)
    }

    fn add_scalar(&self, x: &GpuTensor, c: f64) -> Result<GpuTensor> {
        self.add_scalar_impl(x, c as f32)
    }

    fn scale_rows(&self, x: &GpuTensor, w: &[f64]) -> Result<GpuTensor> {
        self.scale_rows_impl(x, w)
    }

    fn dropout(&self, x: &GpuTensor, d: &Dropout) -> Result<GpuTensor> {
        self.dropout_impl(x, d)
    }

    fn add_noise(&self, x: &GpuTensor, n: &Noise) -> Result<GpuTensor> {
        self.add_noise_impl(x, n)
    }

    fn row_dots(&self, a: &GpuTensor, b: &GpuTensor) -> Result<GpuTensor> {
        self.row_dots_impl(a, b)
    }

    fn matmul(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
    ) -> Result<GpuTensor> {
        self.matmul_impl(a, b, bias, t)
    }

    fn matmul_backward(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
    ) -> Result<MatmulGrads<GpuTensor>> {
        self.matmul_backward_impl(a, b, dout, t, needs)
    }

    fn matmul_backward_into(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        db_acc: &mut GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        self.matmul_backward_into_impl(a, b, dout, t, needs, db_acc)
    }

    fn matmul_gelu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.matmul_act_impl("matmul_gelu", a, b, bias, t, None)
    }

    fn matmul_swiglu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
        gate: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.matmul_act_impl("matmul_swiglu", a, b, bias, t, Some((Glu::Silu, gate)))
    }

    fn matmul_backward_gelu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        pre: &GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        self.matmul_backward_gelu_impl(a, b, dout, t, needs, pre)
    }

    fn matmul_backward_swiglu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        gate: &GpuTensor,
        up: &GpuTensor,
    ) -> Result<(MatmulGrads<GpuTensor>, GpuTensor, GpuTensor)> {
        self.matmul_backward_glu_impl(Glu::Silu, a, b, dout, t, needs, gate, up)
    }

    fn matmul_geglu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        bias: Option<&GpuTensor>,
        t: Transpose,
        gate: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.matmul_act_impl("matmul_geglu", a, b, bias, t, Some((Glu::Gelu, gate)))
    }

    fn matmul_backward_geglu(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        gate: &GpuTensor,
        up: &GpuTensor,
    ) -> Result<(MatmulGrads<GpuTensor>, GpuTensor, GpuTensor)> {
        self.matmul_backward_glu_impl(Glu::Gelu, a, b, dout, t, needs, gate, up)
    }

    fn matmul_backward_da_into(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        dout: &GpuTensor,
        t: Transpose,
        needs: MatmulNeeds,
        da_acc: &mut GpuTensor,
    ) -> Result<MatmulGrads<GpuTensor>> {
        self.matmul_backward_da_into_impl(a, b, dout, t, needs, da_acc)
    }

    fn rmsnorm(&self, x: &GpuTensor, w: &GpuTensor, eps: f32) -> Result<NormOut<GpuTensor>> {
        Ok(self.norm_fwd(x, None, w, None, eps)?.1)
    }

    fn rmsnorm_backward(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        rstd: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<NormGrads<GpuTensor>> {
        self.norm_bwd(x, w, None, rstd, dy, None)
    }

    fn layernorm(&self, x: &GpuTensor, w: &GpuTensor, b: &GpuTensor, eps: f32) -> Result<NormOut<GpuTensor>> {
        Ok(self.norm_fwd(x, None, w, Some(b), eps)?.1)
    }

    fn layernorm_backward(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        mean: &GpuTensor,
        rstd: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<NormGrads<GpuTensor>> {
        self.norm_bwd(x, w, Some(mean), rstd, dy, None)
    }

    fn add_rmsnorm(
        &self,
        x: &GpuTensor,
        r: &GpuTensor,
        w: &GpuTensor,
        eps: f32,
    ) -> Result<AddNormOut<GpuTensor>> {
        let (h, norm) = self.norm_fwd(x, Some(r), w, None, eps)?;
        Ok(AddNormOut {
            h: h.expect("the fused forward returns h"),
            norm,
        })
    }

    fn add_rmsnorm_backward(
        &self,
        h: &GpuTensor,
        w: &GpuTensor,
        rstd: &GpuTensor,
        dy: &GpuTensor,
        dh: &GpuTensor,
    ) -> Result<NormGrads<GpuTensor>> {
        self.norm_bwd(h, w, None, rstd, dy, Some(dh))
    }

    fn add_layernorm(
        &self,
        x: &GpuTensor,
        r: &GpuTensor,
        w: &GpuTensor,
        b: &GpuTensor,
        eps: f32,
    ) -> Result<AddNormOut<GpuTensor>> {
        let (h, norm) = self.norm_fwd(x, Some(r), w, Some(b), eps)?;
        Ok(AddNormOut {
            h: h.expect("the fused forward returns h"),
            norm,
        })
    }

    fn add_layernorm_backward(
        &self,
        h: &GpuTensor,
        w: &GpuTensor,
        mean: &GpuTensor,
        rstd: &GpuTensor,
        dy: &GpuTensor,
        dh: &GpuTensor,
    ) -> Result<NormGrads<GpuTensor>> {
        self.norm_bwd(h, w, Some(mean), rstd, dy, Some(dh))
    }

    fn rope(&self, x: &GpuTensor, rope: Rope) -> Result<GpuTensor> {
        self.rope_impl(x, rope, 1.0)
    }

    fn rope_backward(&self, dy: &GpuTensor, rope: Rope) -> Result<GpuTensor> {
        self.rope_impl(dy, rope, -1.0)
    }

    fn attention_cached(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        len: usize,
        mask: AttnMask,
    ) -> Result<AttentionOut<GpuTensor>> {
        self.attention_cached_impl(q, k, v, len, mask)
    }

    fn attention(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        mask: AttnMask,
    ) -> Result<AttentionOut<GpuTensor>> {
        self.attention_impl(q, k, v, mask)
    }

    fn attention_backward(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        fwd: &AttentionOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<AttentionGrads<GpuTensor>> {
        self.attention_backward_impl(q, k, v, fwd, dout)
    }

    fn attention_sinks(&self, fwd: &AttentionOut<GpuTensor>, sinks: &GpuTensor) -> Result<GpuTensor> {
        self.attention_sinks_impl(fwd, sinks)
    }

    fn attention_sinks_backward(
        &self,
        out: &GpuTensor,
        lse: &GpuTensor,
        sinks: &GpuTensor,
        dout: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.attention_sinks_backward_impl(out, lse, sinks, dout)
    }

    fn gated_delta_rule(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        g: &GpuTensor,
        beta: &GpuTensor,
        docs: Option<&Docs>,
    ) -> Result<DeltaRuleOut<GpuTensor>> {
        self.gated_delta_rule_impl([q, k, v, g, beta], docs)
    }

    fn gated_delta_rule_cached(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        g: &GpuTensor,
        beta: &GpuTensor,
        state: &mut GpuTensor,
    ) -> Result<GpuTensor> {
        self.gated_delta_rule_cached_impl([q, k, v, g, beta], state)
    }

    fn gated_delta_rule_backward(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        g: &GpuTensor,
        beta: &GpuTensor,
        fwd: &DeltaRuleOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<DeltaRuleGrads<GpuTensor>> {
        self.gated_delta_rule_backward_impl([q, k, v, g, beta], fwd, dout)
    }

    fn swiglu_clamped(&self, gate_up: &GpuTensor, c: ClampedGlu) -> Result<GpuTensor> {
        self.swiglu_clamped_impl(gate_up, c)
    }

    fn swiglu_clamped_backward(
        &self,
        gate_up: &GpuTensor,
        dy: &GpuTensor,
        c: ClampedGlu,
    ) -> Result<GpuTensor> {
        self.swiglu_clamped_backward_impl(gate_up, dy, c)
    }

    fn swiglu(&self, gate: &GpuTensor, up: &GpuTensor) -> Result<GpuTensor> {
        self.glu_impl(Glu::Silu, gate, up)
    }

    fn swiglu_backward(
        &self,
        gate: &GpuTensor,
        up: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.glu_backward_impl(Glu::Silu, gate, up, dy)
    }

    fn geglu(&self, gate: &GpuTensor, up: &GpuTensor) -> Result<GpuTensor> {
        self.glu_impl(Glu::Gelu, gate, up)
    }

    fn geglu_backward(
        &self,
        gate: &GpuTensor,
        up: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.glu_backward_impl(Glu::Gelu, gate, up, dy)
    }

    fn softcap(&self, x: GpuTensor, cap: SoftCap) -> Result<GpuTensor> {
        self.softcap_impl(x, cap)
    }

    fn softcap_backward(&self, y: &GpuTensor, dy: GpuTensor, cap: SoftCap) -> Result<GpuTensor> {
        self.softcap_backward_impl(y, dy, cap)
    }

    fn gelu_erf(&self, x: &GpuTensor) -> Result<GpuTensor> {
        self.gelu_erf_impl(x)
    }

    fn gelu_erf_backward(&self, x: &GpuTensor, dy: &GpuTensor) -> Result<GpuTensor> {
        self.gelu_erf_backward_impl(x, dy)
    }

    fn gelu(&self, x: &GpuTensor) -> Result<GpuTensor> {
        self.gelu_impl(x)
    }

    fn gelu_backward(&self, x: &GpuTensor, dy: &GpuTensor) -> Result<GpuTensor> {
        self.gelu_backward_impl(x, dy)
    }

    fn causal_conv1d_silu(&self, x: &GpuTensor, w: &GpuTensor, docs: Option<&Docs>) -> Result<GpuTensor> {
        self.causal_conv1d_silu_impl(x, w, docs)
    }

    fn causal_conv1d_silu_backward(
        &self,
        x: &GpuTensor,
        w: &GpuTensor,
        dy: &GpuTensor,
        docs: Option<&Docs>,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.causal_conv1d_silu_backward_impl(x, w, dy, docs)
    }

    fn delta_gates(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.delta_gates_impl(a, b, a_log, dt_bias)
    }

    fn delta_gates_backward(
        &self,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
        dg: &GpuTensor,
        dbeta: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor, GpuTensor, GpuTensor)> {
        self.delta_gates_backward_impl(a, b, a_log, dt_bias, dg, dbeta)
    }

    fn sigmoid_mul(&self, gate: &GpuTensor, x: &GpuTensor) -> Result<GpuTensor> {
        self.sigmoid_mul_impl(gate, x)
    }

    fn sigmoid_mul_backward(
        &self,
        gate: &GpuTensor,
        x: &GpuTensor,
        dy: &GpuTensor,
    ) -> Result<(GpuTensor, GpuTensor)> {
        self.sigmoid_mul_backward_impl(gate, x, dy)
    }

    fn embedding(&self, ids: &[u32], table: &GpuTensor) -> Result<GpuTensor> {
        self.embedding_impl(ids, table)
    }

    fn embedding_backward(&self, ids: &[u32], dout: &GpuTensor, dtable: &mut GpuTensor) -> Result<()> {
        self.embedding_backward_impl(ids, dout, dtable)
    }

    fn cross_entropy(
        &self,
        logits: &GpuTensor,
        targets: &[i32],
        ignore_index: i32,
        grad_scale: f32,
        terms: LossTerms,
    ) -> Result<CrossEntropyOut<GpuTensor>> {
        self.cross_entropy_impl(logits, targets, ignore_index, grad_scale, terms)
    }
}
