//! The gated delta rule (Qwen3-Next's linear attention), one step at a time
//! as transformers' `torch_recurrent_gated_delta_rule` writes it, on the
//! whole `[Dk, Dv]` state of each (batch, value head); with a decay per key
//! channel where g is `[B, T, Hv, Dk]` (Kimi Linear's KDA, transformers'
//! `recurrent_kimi_delta_attention`): row i of the state decays by
//! `exp(g[i])`.
//!
//! The backward never inverts the recurrence (`1 − β‖k‖²` may be ~0 and
//! `exp(g)` tiny): it replays each chunk of [`DELTA_RULE_CHUNK`] steps from
//! the state the forward checkpointed at its start.
//!
//! With documents packed in the rows the state is zero again at each
//! document's first step (fla's `cu_seqlens`): no document reads another's
//! state, and no gradient flows back across a document's start.

use rayon::prelude::*;

use crate::cpu::Real;
use crate::{DELTA_RULE_CHUNK, DeltaRuleDims, Docs};

/// The operands, row-major: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`,
/// g `[B, T, Hv]` or `[B, T, Hv, Dk]` ([`DeltaRuleDims::decays`] a step and
/// head), beta `[B, T, Hv]`; the documents of the `[B, T]` rows, if any.
#[derive(Clone, Copy)]
pub struct DeltaRuleIn<'a, F> {
    pub q: &'a [F],
    pub k: &'a [F],
    pub v: &'a [F],
    pub g: &'a [F],
    pub beta: &'a [F],
    pub docs: Option<&'a Docs>,
}

/// One (batch, value head)'s view of the operands at step t.
struct Step<'a, F> {
    q: &'a [F],
    k: &'a [F],
    v: &'a [F],
    /// `exp(g)`: one for every row of the state, or one a row (key channel).
    alpha: Vec<F>,
    beta: F,
}

impl<F: Real> Step<'_, F> {
    /// The decay of state row `i`.
    fn alpha(&self, i: usize) -> F {
        self.alpha[i % self.alpha.len()]
    }
}

impl<'a, F: Real> DeltaRuleIn<'a, F> {
    fn check(&self, d: DeltaRuleDims) {
        let (bt, what) = (d.b * d.t, "gated_delta_rule: operand lengths");
        assert_eq!(self.q.len(), bt * d.hk * d.dk, "{what}");
        assert_eq!(self.k.len(), bt * d.hk * d.dk, "{what}");
        assert_eq!(self.v.len(), bt * d.hv * d.dv, "{what}");
        assert_eq!(self.g.len(), bt * d.hv * d.decays(), "{what}");
        assert_eq!(self.beta.len(), bt * d.hv, "{what}");
    }

    /// Whether step t of row b starts a document after the row's first,
    /// which starts from the zero state.
    fn resets(&self, b: usize, t: usize) -> bool {
        t > 0 && self.docs.is_some_and(|d| d.start(b, t) == t)
    }

    fn step(&self, d: DeltaRuleDims, b: usize, h: usize, t: usize) -> Step<'a, F> {
        let row = b * d.t + t;
        let kq = (row * d.hk + h / d.group()) * d.dk;
        let v = (row * d.hv + h) * d.dv;
        let na = d.decays();
        let g = &self.g[(row * d.hv + h) * na..][..na];
        Step {
            q: &self.q[kq..kq + d.dk],
            k: &self.k[kq..kq + d.dk],
            v: &self.v[v..v + d.dv],
            alpha: g.iter().map(|g| g.exp()).collect(),
            beta: self.beta[row * d.hv + h],
        }
    }
}

/// `s ← α s` (row i by its own α where the decay is per channel) then the
/// delta rule's write of `k`, `s: [Dk, Dv]`; returns `m = sᵀk` of the
/// decayed state (the value the state held for `k`).
fn advance<F: Real>(s: &mut [F], x: &Step<'_, F>, dv: usize) -> Vec<F> {
    for (i, row) in s.chunks_mut(dv).enumerate() {
        let a = x.alpha(i);
        row.iter_mut().for_each(|e| *e = *e * a);
    }
    let mut m = vec![F::zero(); dv];
    for (row, &ki) in s.chunks(dv).zip(x.k) {
        m.iter_mut().zip(row).for_each(|(m, &e)| *m = *m + ki * e);
    }
    for (row, &ki) in s.chunks_mut(dv).zip(x.k) {
        for ((e, &vj), &mj) in row.iter_mut().zip(x.v).zip(&m) {
            *e = *e + ki * x.beta * (vj - mj);
        }
    }
    m
}

/// Per (b, h) in order: its outputs `[T, Dv]` and checkpoints `[C, Dk, Dv]`.
fn forward_head<F: Real>(x: DeltaRuleIn<'_, F>, d: DeltaRuleDims, b: usize, h: usize) -> (Vec<F>, Vec<F>) {
    let mut s = vec![F::zero(); d.dk * d.dv];
    let mut saved = Vec::with_capacity(d.chunks() * s.len());
    let out = run_head(x, d, (b, h), &mut s, Some(&mut saved));
    (out, saved)
}

/// The steps of (b, h) from state `s` (`[Dk, Dv]`, left as the last step
/// leaves it): its outputs `[T, Dv]`, and the state at each chunk's start
/// into `saved` where given.
fn run_head<F: Real>(
    x: DeltaRuleIn<'_, F>,
    d: DeltaRuleDims,
    (b, h): (usize, usize),
    s: &mut [F],
    mut saved: Option<&mut Vec<F>>,
) -> Vec<F> {
    let mut out = Vec::with_capacity(d.t * d.dv);
    for t in 0..d.t {
        if x.resets(b, t) {
            s.fill(F::zero());
        }
        // After the reset: a chunk's replay starts from what its first step
        // reads.
        if t % DELTA_RULE_CHUNK == 0
            && let Some(saved) = saved.as_mut()
        {
            saved.extend_from_slice(s);
        }
        let st = x.step(d, b, h, t);
        advance(s, &st, d.dv);
        let mut o = vec![F::zero(); d.dv];
        for (row, &qi) in s.chunks(d.dv).zip(st.q) {
            o.iter_mut().zip(row).for_each(|(o, &e)| *o = *o + qi * e);
        }
        out.extend(o);
    }
    out
}

/// The forward continuing from `state` (`[B, Hv, Dk, Dv]`, what the steps
/// before left; updated to what the last step leaves): `out [B, T, Hv,
/// Dv]`. Generation over a cache: no documents, no checkpoints.
pub fn gated_delta_rule_cached<F: Real>(x: DeltaRuleIn<'_, F>, d: DeltaRuleDims, state: &mut [F]) -> Vec<F> {
    x.check(d);
    assert!(x.docs.is_none(), "gated_delta_rule_cached: no documents");
    let n = d.dk * d.dv;
    assert_eq!(
        state.len(),
        d.b * d.hv * n,
        "gated_delta_rule_cached: state length"
    );
    let heads: Vec<Vec<F>> = state
        .par_chunks_mut(n)
        .enumerate()
        .map(|(bh, s)| run_head(x, d, (bh / d.hv, bh % d.hv), s, None))
        .collect();
    let mut out = vec![F::zero(); d.b * d.t * d.hv * d.dv];
    for (bh, o) in heads.iter().enumerate() {
        place_head(&mut out, d, bh, o);
    }
    out
}

/// (b, h) = `bh`'s outputs `[T, Dv]` into `out [B, T, Hv, Dv]`.
fn place_head<F: Real>(out: &mut [F], d: DeltaRuleDims, bh: usize, o: &[F]) {
    let (b, h) = (bh / d.hv, bh % d.hv);
    for (t, row) in o.chunks(d.dv).enumerate() {
        let at = ((b * d.t + t) * d.hv + h) * d.dv;
        out[at..at + d.dv].copy_from_slice(row);
    }
}

/// `(out [B, T, Hv, Dv], saved [B, Hv, ⌈T/C⌉, Dk, Dv])`.
pub fn gated_delta_rule<F: Real>(x: DeltaRuleIn<'_, F>, d: DeltaRuleDims) -> (Vec<F>, Vec<F>) {
    x.check(d);
    let heads: Vec<_> = (0..d.b * d.hv)
        .into_par_iter()
        .map(|bh| forward_head(x, d, bh / d.hv, bh % d.hv))
        .collect();
    let mut out = vec![F::zero(); d.b * d.t * d.hv * d.dv];
    let mut saved = Vec::with_capacity(d.b * d.hv * d.chunks() * d.dk * d.dv);
    for (bh, (o, s)) in heads.into_iter().enumerate() {
        place_head(&mut out, d, bh, &o);
        saved.extend(s);
    }
    (out, saved)
}

/// One (b, h)'s gradients: dq, dk `[T, Dk]` (of this value head alone),
/// dv `[T, Dv]`, dg `[T, decays]`, dbeta `[T]`.
struct HeadGrads<F> {
    dq: Vec<F>,
    dk: Vec<F>,
    dv: Vec<F>,
    dg: Vec<F>,
    dbeta: Vec<F>,
}

fn backward_head<F: Real>(
    x: DeltaRuleIn<'_, F>,
    saved: &[F],
    dout: &[F],
    d: DeltaRuleDims,
    (b, h): (usize, usize),
) -> HeadGrads<F> {
    let (dk, dv, n, na) = (d.dk, d.dv, d.dk * d.dv, d.decays());
    let mut gr = HeadGrads {
        dq: vec![F::zero(); d.t * dk],
        dk: vec![F::zero(); d.t * dk],
        dv: vec![F::zero(); d.t * dv],
        dg: vec![F::zero(); d.t * d.decays()],
        dbeta: vec![F::zero(); d.t],
    };
    // dL/dS of the state after the step being undone, carried backwards.
    let mut ds = vec![F::zero(); n];
    for c in (0..d.chunks()).rev() {
        let (t0, t1) = (c * DELTA_RULE_CHUNK, ((c + 1) * DELTA_RULE_CHUNK).min(d.t));
        let at = ((b * d.hv + h) * d.chunks() + c) * n;
        // The state each step of the chunk reads, replayed from its start.
        let mut before = vec![saved[at..at + n].to_vec()];
        for t in t0 + 1..t1 {
            let mut s = before[t - 1 - t0].clone();
            advance(&mut s, &x.step(d, b, h, t - 1), dv);
            if x.resets(b, t) {
                s.fill(F::zero());
            }
            before.push(s);
        }
        for t in (t0..t1).rev() {
            let st = x.step(d, b, h, t);
            let prev = &before[t - t0];
            let mut s = prev.clone();
            let m = advance(&mut s, &st, dv);
            let a: Vec<F> = prev
                .iter()
                .enumerate()
                .map(|(e, &x)| st.alpha(e / dv) * x)
                .collect();
            let dot = &dout[((b * d.t + t) * d.hv + h) * dv..][..dv];
            let (dq, dkt) = (&mut gr.dq[t * dk..][..dk], &mut gr.dk[t * dk..][..dk]);
            let mut ddelta = vec![F::zero(); dv];
            for i in 0..dk {
                let (srow, dsrow) = (&s[i * dv..][..dv], &mut ds[i * dv..][..dv]);
                for j in 0..dv {
                    dsrow[j] = dsrow[j] + st.q[i] * dot[j];
                    dq[i] = dq[i] + dot[j] * srow[j];
                    ddelta[j] = ddelta[j] + st.k[i] * dsrow[j];
                    let delta = st.beta * (st.v[j] - m[j]);
                    dkt[i] = dkt[i] + delta * dsrow[j];
                }
            }
            let dm: Vec<F> = ddelta.iter().map(|&e| -st.beta * e).collect();
            for j in 0..dv {
                gr.dv[t * dv + j] = st.beta * ddelta[j];
                gr.dbeta[t] = gr.dbeta[t] + (st.v[j] - m[j]) * ddelta[j];
            }
            // dα of each decay: over the whole state, or over each row's
            // columns where the decay is per row.
            let mut dalpha = vec![F::zero(); na];
            for (i, (dki, &ki)) in dkt.iter_mut().zip(st.k).enumerate() {
                let ai = st.alpha(i);
                for (j, &dmj) in dm.iter().enumerate() {
                    let e = i * dv + j;
                    let da = ds[e] + ki * dmj;
                    *dki = *dki + a[e] * dmj;
                    dalpha[i % na] = dalpha[i % na] + prev[e] * da;
                    ds[e] = ai * da;
                }
            }
            for (l, &da) in dalpha.iter().enumerate() {
                gr.dg[t * na + l] = st.alpha[l] * da;
            }
            // The previous document's last state was dropped here.
            if x.resets(b, t) {
                ds.fill(F::zero());
            }
        }
    }
    gr
}

/// `(dq, dk, dv, dg, dbeta)` of [`gated_delta_rule`] from its `saved`
/// checkpoints and `dout`; dq and dk summed over the value heads of each key
/// head in order.
pub fn gated_delta_rule_backward<F: Real>(
    x: DeltaRuleIn<'_, F>,
    saved: &[F],
    dout: &[F],
    d: DeltaRuleDims,
) -> [Vec<F>; 5] {
    x.check(d);
    assert_eq!(
        saved.len(),
        d.saved_shape().numel(),
        "gated_delta_rule_backward: saved length"
    );
    assert_eq!(dout.len(), x.v.len(), "gated_delta_rule_backward: dout length");
    let heads: Vec<_> = (0..d.b * d.hv)
        .into_par_iter()
        .map(|bh| backward_head(x, saved, dout, d, (bh / d.hv, bh % d.hv)))
        .collect();
    let mut dq = vec![F::zero(); x.q.len()];
    let mut dk = vec![F::zero(); x.k.len()];
    let mut dv = vec![F::zero(); x.v.len()];
    let mut dg = vec![F::zero(); x.g.len()];
    let mut dbeta = vec![F::zero(); x.beta.len()];
    for (bh, gr) in heads.iter().enumerate() {
        let (b, h) = (bh / d.hv, bh % d.hv);
        for t in 0..d.t {
            let row = b * d.t + t;
            let kq = (row * d.hk + h / d.group()) * d.dk;
            for i in 0..d.dk {
                dq[kq + i] = dq[kq + i] + gr.dq[t * d.dk + i];
                dk[kq + i] = dk[kq + i] + gr.dk[t * d.dk + i];
            }
            let at = (row * d.hv + h) * d.dv;
            dv[at..at + d.dv].copy_from_slice(&gr.dv[t * d.dv..][..d.dv]);
            let (na, at) = (d.decays(), row * d.hv + h);
            dg[at * na..][..na].copy_from_slice(&gr.dg[t * na..][..na]);
            dbeta[row * d.hv + h] = gr.dbeta[t];
        }
    }
    [dq, dk, dv, dg, dbeta]
}
