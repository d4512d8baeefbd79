//! Fused causal attention (online-softmax forward, recomputing backward).

use megatrain_tensor::{AttentionGrads, AttentionOut, Error, Result};

use super::{GpuExecutor, f, need_f32, u};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// Largest head dimension the kernels hold in registers (attention.wgsl DM).
const MAX_HEAD_DIM: usize = 128;
/// Rows per workgroup (attention.wgsl RB).
const RB: usize = 64;

struct Dims {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
}

impl GpuExecutor {
    fn attn_dims(op: &'static str, q: &GpuTensor, k: &GpuTensor, v: &GpuTensor) -> Result<Dims> {
        for x in [q, k, v] {
            need_f32(op, x)?;
        }
        let (qd, kd) = (q.dims(), k.dims());
        if qd.len() != 4 || kd.len() != 4 || k.shape != v.shape {
            return Err(Error::shape(
                op,
                format!("q {}, k {}, v {} must be [B, T, H, D]", q.shape, k.shape, v.shape),
            ));
        }
        if qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] || kd[2] == 0 || qd[2] % kd[2] != 0 {
            return Err(Error::shape(
                op,
                format!(
                    "q {} and k {}: B, T, D must match and Hq be a multiple of Hkv",
                    q.shape, k.shape
                ),
            ));
        }
        if qd[3] > MAX_HEAD_DIM {
            return Err(Error::invalid(
                op,
                format!("head dim {} exceeds the kernel's {MAX_HEAD_DIM}", qd[3]),
            ));
        }
        Ok(Dims {
            b: qd[0],
            t: qd[1],
            hq: qd[2],
            hkv: kd[2],
            d: qd[3],
        })
    }

    pub(crate) fn attention_impl(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
    ) -> Result<AttentionOut<GpuTensor>> {
        let d = Self::attn_dims("attention", q, k, v)?;
        let out = self.alloc_f32(q.shape.clone())?;
        let lse = self.alloc_f32([d.b, d.hq, d.t])?;
        let (qe, ke, le) = (d.t * d.hq * d.d, d.t * d.hkv * d.d, d.hq * d.t);
        let scale = 1.0 / (d.d as f32).sqrt();
        let mut op = self.op("attention");
        for (b0, nb) in self.row_chunks(d.b, &[qe, ke, le])? {
            let qv = self.view(q, b0 * qe, nb * qe)?;
            let kv = self.view(k, b0 * ke, nb * ke)?;
            let vv = self.view(v, b0 * ke, nb * ke)?;
            let ov = self.view(&out, b0 * qe, nb * qe)?;
            let lv = self.view(&lse, b0 * le, nb * le)?;
            let params = [
                u(d.t),
                u(d.hq),
                u(d.hkv),
                u(d.d),
                f(scale),
                qv.elem_off,
                kv.elem_off,
                vv.elem_off,
                ov.elem_off,
                lv.elem_off,
                0,
                0,
                0,
                0,
                0,
                0,
            ];
            let grid = [d.t.div_ceil(RB) as u32, d.hq as u32, nb as u32];
            op.dispatch(Kernel::AttnFwd, &params, &[qv, kv, vv, ov, lv], grid);
        }
        op.finish()?;
        Ok(AttentionOut { out, lse })
    }

    pub(crate) fn attention_backward_impl(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        fwd: &AttentionOut<GpuTensor>,
        dout: &GpuTensor,
    ) -> Result<AttentionGrads<GpuTensor>> {
        let name = "attention_backward";
        let d = Self::attn_dims(name, q, k, v)?;
        need_f32(name, dout)?;
        if dout.shape != q.shape || fwd.out.shape != q.shape || fwd.lse.numel() != d.b * d.hq * d.t {
            return Err(Error::shape(
                name,
                format!(
                    "dout {}, out {}, lse {} for q {}",
                    dout.shape, fwd.out.shape, fwd.lse.shape, q.shape
                ),
            ));
        }
        let dq = self.alloc_f32(q.shape.clone())?;
        let dk = self.alloc_f32(k.shape.clone())?;
        let dv = self.alloc_f32(v.shape.clone())?;
        let delta = self.alloc_f32([d.b, d.hq, d.t])?;
        let (qe, ke, le) = (d.t * d.hq * d.d, d.t * d.hkv * d.d, d.hq * d.t);
        let scale = 1.0 / (d.d as f32).sqrt();
        let mut op = self.op(name);
        for (b0, nb) in self.row_chunks(d.b, &[qe, ke, le])? {
            let qv = self.view(q, b0 * qe, nb * qe)?;
            let kv = self.view(k, b0 * ke, nb * ke)?;
            let vv = self.view(v, b0 * ke, nb * ke)?;
            let ov = self.view(&fwd.out, b0 * qe, nb * qe)?;
            let lv = self.view(&fwd.lse, b0 * le, nb * le)?;
            let dov = self.view(dout, b0 * qe, nb * qe)?;
            let dqv = self.view(&dq, b0 * qe, nb * qe)?;
            let dkv = self.view(&dk, b0 * ke, nb * ke)?;
            let dvv = self.view(&dv, b0 * ke, nb * ke)?;
            let ddv = self.view(&delta, b0 * le, nb * le)?;
            let params = [
                u(d.t),
                u(d.hq),
                u(d.hkv),
                u(d.d),
                f(scale),
                qv.elem_off,
                kv.elem_off,
                vv.elem_off,
                ov.elem_off,
                lv.elem_off,
                dov.elem_off,
                dqv.elem_off,
                dkv.elem_off,
                dvv.elem_off,
                ddv.elem_off,
                0,
            ];
            let rows = d.t.div_ceil(RB) as u32;
            op.dispatch(
                Kernel::AttnDelta,
                &params,
                &[ov, dov, ddv],
                [rows, d.hq as u32, nb as u32],
            );
            op.dispatch(
                Kernel::AttnDq,
                &params,
                &[qv, kv, vv, lv, dov, dqv, ddv],
                [rows, d.hq as u32, nb as u32],
            );
            op.dispatch(
                Kernel::AttnDkv,
                &params,
                &[qv, kv, vv, lv, dov, dkv, dvv, ddv],
                [rows, d.hkv as u32, nb as u32],
            );
        }
        op.finish()?;
        Ok(AttentionGrads { dq, dk, dv })
    }
}
