//! Attention under the F16 compute precision: operands rounded to f16 under
//! their tensor's power-of-two scale, by copies (`shaders/attention_f16.wgsl`)
//! for the SIMT kernels, or for the tensor-core flash-attention family
//! (`crate::coop_attention`), where it applies, into f16 copies of Q, K, V
//! and dO (`exec/f16_copy.rs`; or as it stages them, under
//! `F16Operands::Stage`).

use megatrain_tensor::{AttentionGrads, AttentionOut, Error, Result};

use super::attention::{Dims, F16Attention};
use super::maxima::NO_SCALE;
use super::{F16Operands, GpuExecutor, Op, View, f, grid_for, u};
use crate::coop_attention::{AttnPass, CoopAttention};
use crate::kernels::Kernel;
use crate::tensor::GpuTensor;

/// attention_coop.wgsl's `NO_MAX_SLOT`: the pass stores no maxima.
const NO_MAX_SLOT: u32 = u32::MAX;

impl GpuExecutor {
    /// The attention family in use for `dims` under F16: `Some(emulated)`
    /// for the tensor-core kernels, `None` for SIMT. `Auto` takes the
    /// tensor cores only where they matched the SIMT kernels on this device
    /// (`attention_check.rs`), and the SIMT kernels at a head dimension the
    /// family has no kernels for or with a soft cap, which it does not
    /// apply; the family asked for by name is refused there. The backward
    /// asks with the forward's mask, so it takes the forward's family.
    pub(crate) fn coop_attention_kernel(&self, op: &'static str, dims: &Dims) -> Result<Option<bool>> {
        let d = dims.d;
        let family = CoopAttention::HEAD_DIMS.contains(&(d as u32));
        let named = |emulated: bool| match (family, dims.mask.softcap) {
            (true, None) => Ok(Some(emulated)),
            (false, _) => Err(Error::invalid(
                op,
                format!(
                    "F16Attention::{:?} was asked for, but the tensor-core attention has no kernels \
                     for head dim {d} (only {:?}; F16Attention::Auto or Simt runs the SIMT kernels there)",
                    self.f16_attention,
                    CoopAttention::HEAD_DIMS
                ),
            )),
            (true, Some(cap)) => Err(Error::invalid(
                op,
                format!(
                    "F16Attention::{:?} was asked for, but the tensor-core attention has no soft cap \
                     (the mask's is {}; F16Attention::Auto or Simt runs the SIMT kernels there)",
                    self.f16_attention,
                    cap.get()
                ),
            )),
        };
        match self.f16_attention {
            F16Attention::Auto => Ok((family
                && dims.mask.softcap.is_none()
                && self.ctx.has_cooperative_matrix()
                && self.coop_attention_checked(d))
            .then_some(false)),
            F16Attention::Simt => Ok(None),
            F16Attention::Coop => named(false),
            F16Attention::CoopEmulated => named(true),
        }
    }

    /// The attention kernel family `Auto` resolves to on this adapter
    /// (at a head dimension where its check passes:
    /// [`crate::GpuContext::coop_attention_refused`] lists the others).
    pub fn f16_attention_kernel(&self) -> F16Attention {
        match self.f16_attention {
            F16Attention::Auto if self.ctx.has_cooperative_matrix() => F16Attention::Coop,
            F16Attention::Auto => F16Attention::Simt,
            k => k,
        }
    }

    /// The buffer of max|x| of `xs` (slot i for `xs[i]`) the scales come
    /// from, and for each `xs[i]` with `round[i]` a copy rounded to f16
    /// under its tensor's power-of-two scale and scaled back
    /// (precision.rs). The tensor-core kernels need no such copy of what
    /// they only stage: they read f16 copies ([`Self::f16_copy`]), or scale
    /// by the same power of two and convert to f16 as they stage, and either
    /// rounds each element exactly as the rounded copy would.
    pub(crate) fn round_operands(
        &self,
        name: &'static str,
        xs: &[&GpuTensor],
        round: &[bool],
    ) -> Result<(Vec<Option<GpuTensor>>, GpuTensor)> {
        let mut op = self.op(name);
        let (maxima, slots) = self
            .operand_maxima(&mut op, xs)?
            .ok_or_else(|| Error::invalid(name, "operands are rounded only under F16"))?;
        let mut out = Vec::with_capacity(xs.len());
        for ((x, slot), &r) in xs.iter().zip(slots).zip(round) {
            if !r {
                out.push(None);
                continue;
            }
            let y = self.alloc_f32(x.shape.clone())?;
            let scales = self.full(&maxima)?;
            for (start, count) in self.row_chunks(x.numel(), &[1])? {
                if count == 0 {
                    continue;
                }
                let (xv, yv) = (self.view(x, start, count)?, self.view(&y, start, count)?);
                let params = [u(count), xv.elem_off, yv.elem_off, slot];
                op.dispatch(
                    Kernel::AttnRound16,
                    &params,
                    &[xv, yv, scales],
                    grid_for(count.div_ceil(256)),
                );
            }
            out.push(Some(y));
        }
        op.finish()?;
        Ok((out, maxima))
    }

    /// The pipeline of `pass` for this shape, refused with the reason where
    /// the adapter cannot run it (workgroup memory, the loop cap of drivers
    /// that have one).
    fn coop_variant(
        &self,
        name: &'static str,
        pass: AttnPass,
        d: &Dims,
        emulated: bool,
    ) -> Result<CoopAttention> {
        let v = CoopAttention {
            pass,
            d: d.d as u32,
            emulated,
            f16_in: self.f16_operands == F16Operands::Copy,
            shape: self.attention_tiles.get(pass),
            probe: self.attention_probe,
        };
        let t = v.tile();
        if emulated && t.share {
            return Err(Error::invalid(
                name,
                format!("{}: shared regions need real cooperative matrices", v.label()),
            ));
        }
        let atomics = self.ctx.features.contains(wgpu::Features::SHADER_FLOAT32_ATOMIC);
        // The hardware variant's SPIR-V is ours (`Kernel::own_spirv`).
        if t.fused_dq && !(atomics && (emulated || self.ctx.has_own_spirv())) {
            return Err(Error::invalid(
                name,
                format!(
                    "{}: dQ in dk/dv needs f32 atomics in storage buffers (and, on tensor cores, a Vulkan device)",
                    v.label()
                ),
            ));
        }
        if t.local && (emulated || !self.ctx.has_subgroup_local_rows()) {
            return Err(Error::invalid(
                name,
                format!(
                    "{}: subgroup-local rows need real cooperative matrices on 32-lane subgroups with subgroup barriers",
                    v.label()
                ),
            ));
        }
        let group = d.hq / d.hkv;
        if pass != AttnPass::Dkv && group > t.br() as usize {
            return Err(Error::invalid(
                name,
                format!(
                    "{}: a block of {} rows cannot hold a group of {group} query heads",
                    v.label(),
                    t.br()
                ),
            ));
        }
        let have = self.ctx.workgroup_bytes();
        if v.workgroup_bytes() > have {
            return Err(Error::invalid(
                name,
                format!(
                    "{} needs {} B of workgroup memory, the adapter has {have}",
                    v.label(),
                    v.workgroup_bytes()
                ),
            ));
        }
        let tiles = match pass {
            AttnPass::Fwd | AttnPass::Dq => d.t.div_ceil(t.bc as usize),
            AttnPass::Dkv => (d.hq / d.hkv) * d.t.div_ceil(t.bc as usize),
        };
        let loops = tiles.saturating_mul(v.loops_per_tile());
        if loops > self.loop_budget {
            return Err(Error::invalid(
                name,
                format!(
                    "{} at T = {}, group {}: ~{loops} loop iterations per invocation exceed the adapter's cap of {}",
                    v.label(),
                    d.t,
                    d.hq / d.hkv,
                    self.loop_budget
                ),
            ));
        }
        Ok(v)
    }

    /// Q, K, V (and dO) as the kernels of [`Self::coop_variant`] read them:
    /// under [`F16Operands::Copy`] their f16 copies (`maxima` holds their
    /// max in slots 0, 1, 2 (, 3)), remembered with the tensors so that the
    /// backward finds the forward's; else `None`, the tensors themselves.
    fn coop_inputs<const N: usize>(
        &self,
        op: &mut Op<'_>,
        xs: [&GpuTensor; N],
        maxima: &GpuTensor,
    ) -> Result<Option<[GpuTensor; N]>> {
        if self.f16_operands != F16Operands::Copy {
            return Ok(None);
        }
        let mut copies = Vec::with_capacity(N);
        for (slot, x) in xs.into_iter().enumerate() {
            copies.push(self.f16_copy(op, x, maxima, slot as u32)?);
        }
        Ok(Some(copies.try_into().expect("one copy per operand")))
    }

    /// Grid of a pass: query blocks (all heads of a group per block) or key
    /// blocks, by kv head and batch.
    fn coop_grid(v: &CoopAttention, d: &Dims, nb: usize) -> [u32; 3] {
        let br = v.tile().br() as usize;
        let blocks = match v.pass {
            AttnPass::Fwd | AttnPass::Dq => d.t.div_ceil(br / (d.hq / d.hkv)),
            AttnPass::Dkv => d.t.div_ceil(br),
        };
        [blocks as u32, d.hkv as u32, nb as u32]
    }

    pub(crate) fn attention_coop(
        &self,
        d: &Dims,
        [q, k, v]: [&GpuTensor; 3],
        maxima: &GpuTensor,
        emulated: bool,
    ) -> Result<AttentionOut<GpuTensor>> {
        let name = "attention";
        let var = self.coop_variant(name, AttnPass::Fwd, d, emulated)?;
        let out = self.alloc_f32(q.shape.clone())?;
        let lse = self.alloc_f32([d.b, d.hq, d.t])?;
        let (qe, ke, le) = (d.t * d.hq * d.d, d.t * d.hkv * d.d, d.hq * d.t);
        let mut op = self.op(name);
        let copies = self.coop_inputs(&mut op, [q, k, v], maxima)?;
        let [q, k, v] = copies.as_ref().map_or([q, k, v], |c| [&c[0], &c[1], &c[2]]);
        let sv = self.full(maxima)?;
        let blocks = Self::coop_grid(&var, d, 1)[0] as usize * d.hkv;
        let slots = self.maxima_slots(self.folds_maxima(), blocks * d.b)?;
        let docs = self.docs_bounds(d.mask.docs.as_ref())?;
        let docs_view = docs.view(self)?;
        for (b0, nb) in self.row_chunks(d.b, &[qe, ke, le])? {
            let qv = self.view(q, b0 * qe, nb * qe)?;
            let kv = self.view(k, b0 * ke, nb * ke)?;
            let vv = self.view(v, b0 * ke, nb * ke)?;
            let ov = self.view(&out, b0 * qe, nb * qe)?;
            let lv = self.view(&lse, b0 * le, nb * le)?;
            let mv = self.maxima_view(&slots, (b0 * blocks, nb * blocks), ov)?;
            vec4_ready(name, &[("q", &qv), ("k", &kv), ("v", &vv)])?;
            let offs = [
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
            ];
            let max_off = if slots.is_some() { mv.elem_off } else { NO_MAX_SLOT };
            let docs_params = docs.params(&docs_view, b0);
            let params = coop_params(d, offs, [0, 1, 2, NO_SCALE], max_off, docs_params, b0);
            let grid = Self::coop_grid(&var, d, nb);
            op.dispatch(
                Kernel::AttnCoop(var),
                &params,
                &[qv, kv, vv, ov, sv, lv, mv, docs_view],
                grid,
            );
        }
        op.finish()?;
        self.remember_maxima_slots(&out, slots);
        Ok(AttentionOut {
            out,
            lse,
            mask: d.mask.clone(),
        })
    }

    pub(crate) fn attention_backward_coop(
        &self,
        d: &Dims,
        [q, k, v, dout]: [&GpuTensor; 4],
        fwd: &AttentionOut<GpuTensor>,
        maxima: &GpuTensor,
        emulated: bool,
    ) -> Result<AttentionGrads<GpuTensor>> {
        let name = "attention_backward";
        let vdkv = self.coop_variant(name, AttnPass::Dkv, d, emulated)?;
        // dk/dv adds dQ in (AttnTile::fused_dq): no dq pass.
        let fused = vdkv.tile().fused_dq;
        let vdq = match fused {
            true => None,
            false => Some(self.coop_variant(name, AttnPass::Dq, d, emulated)?),
        };
        let mut op = self.op(name);
        let copies = self.coop_inputs(&mut op, [q, k, v, dout], maxima)?;
        op.finish()?;
        let [q, k, v, dout_in] = copies
            .as_ref()
            .map_or([q, k, v, dout], |c| [&c[0], &c[1], &c[2], &c[3]]);
        let sv = self.full(maxima)?;
        let blocks = Self::coop_grid(&vdkv, d, 1)[0] as usize * d.hkv;
        let slots = self.maxima_slots(self.folds_maxima(), blocks * d.b)?;
        let grads = self.attention_backward_chunks(
            d,
            [q, k, v, dout],
            dout_in,
            fwd,
            Kernel::AttnDelta,
            vdq.is_none(),
            |op, b0, nb, c| {
                let mv = self.maxima_view(&slots, (b0 * blocks, nb * blocks), c.dv)?;
                vec4_ready(name, &[("q", &c.q), ("k", &c.k), ("v", &c.v), ("dO", &c.dout_in)])?;
                let offs = [
                    c.q.elem_off,
                    c.k.elem_off,
                    c.v.elem_off,
                    0,
                    c.lse.elem_off,
                    c.dout_in.elem_off,
                    c.dq.elem_off,
                    c.dk.elem_off,
                    c.dv.elem_off,
                    c.delta.elem_off,
                ];
                let max_off = if slots.is_some() { mv.elem_off } else { NO_MAX_SLOT };
                let params = coop_params(d, offs, [0, 1, 2, 3], max_off, c.docs_params, c.b0);
                let grid = Self::coop_grid(&vdkv, d, nb);
                let Some(vdq) = vdq else {
                    let views = [
                        c.q, c.k, c.v, sv, c.lse, c.dout_in, c.dq, c.dk, c.dv, c.delta, mv, c.docs,
                    ];
                    op.dispatch(Kernel::AttnCoop(vdkv), &params, &views, grid);
                    return Ok(());
                };
                op.dispatch(
                    Kernel::AttnCoop(vdq),
                    &coop_params(d, offs, [0, 1, 2, 3], NO_MAX_SLOT, c.docs_params, c.b0),
                    &[c.q, c.k, c.v, sv, c.lse, c.dout_in, c.dq, c.delta, c.docs],
                    Self::coop_grid(&vdq, d, nb),
                );
                let views = [
                    c.q, c.k, c.v, sv, c.lse, c.dout_in, c.dk, c.dv, c.delta, mv, c.docs,
                ];
                op.dispatch(Kernel::AttnCoop(vdkv), &params, &views, grid);
                Ok(())
            },
        )?;
        self.remember_maxima_slots(&grads.dv, slots);
        Ok(grads)
    }
}

/// The tensor-core kernels read q, k, v and dO as vec4s: each binding must
/// start on 16 bytes and each element offset be a multiple of 4. It holds by
/// construction (D is a multiple of 16, batch chunks start on whole rows,
/// bindings on the storage offset alignment); this says so where it fails.
fn vec4_ready(name: &'static str, views: &[(&str, &View<'_>)]) -> Result<()> {
    for (what, v) in views {
        if v.offset % 16 != 0 || v.elem_off % 4 != 0 {
            return Err(Error::invalid(
                name,
                format!(
                    "{what} is bound at byte {} + element {}; the tensor-core kernels need 16-byte vectors",
                    v.offset, v.elem_off
                ),
            ));
        }
    }
    Ok(())
}

/// attention_coop.wgsl's `Params`: offsets of q, k, v, out, lse, dout, dq,
/// dk, dv, delta, the scale slots of q, k, v, dout, where the output's
/// maxima go (`NO_MAX_SLOT`: nowhere), the window and the documents'
/// parameters (`DocsBounds::params`), then the dropout's for the chunk
/// that starts at batch row `b0` ([`Dims::dropout_params`]).
fn coop_params(
    d: &Dims,
    o: [u32; 10],
    slots: [u32; 4],
    max_off: u32,
    docs: [u32; 3],
    b0: usize,
) -> [u32; 32] {
    let mut p = [0u32; 32];
    p[..24].copy_from_slice(&[
        u(d.t),
        u(d.hq),
        u(d.hkv),
        u(d.hq / d.hkv),
        f(1.0 / (d.d as f32).sqrt()),
        o[0],
        o[1],
        o[2],
        o[3],
        o[4],
        o[5],
        o[6],
        o[7],
        o[8],
        o[9],
        slots[0],
        slots[1],
        slots[2],
        slots[3],
        max_off,
        d.window,
        docs[0],
        docs[1],
        docs[2],
    ]);
    p[24..].copy_from_slice(&d.dropout_params(b0));
    p
}
