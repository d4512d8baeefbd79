//! Attention under the F16 compute precision on the GPU against the CPU
//! executor's F16 reference (crates/tensor/src/precision.rs): the SIMT
//! kernels on the rounded operands (every adapter; the reference exactly,
//! up to summation order), the tensor-core flash-attention family with its
//! cooperative-matrix operations emulated in plain WGSL (every adapter: the
//! same generated kernels, smaller tiles), and the real tensor-core kernels
//! where the adapter has cooperative matrices. The tensor-core kernels
//! round P and dS to f16 as well, which the reference does not model: they
//! are held to 2e-3.

mod common;

use std::sync::Arc;

use common::*;
use megatrain_gpu::{AttnProbe, F16Attention, F16Operands, GpuContext, GpuExecutor, GpuOptions};
use megatrain_tensor::testing::{random_tensor, rel_norm_err};
use megatrain_tensor::{
    AttnMask, ComputePrecision, CpuExecutor, Docs, Dropout, Executor, HostTensor, SoftCap,
};

const TOL_COOP: f64 = 2e-3;
const TOL_SIMT: f64 = 1e-5;

fn executor(c: Arc<GpuContext>, kind: F16Attention) -> Option<GpuExecutor> {
    executor_with(c, kind, false, F16Operands::default())
}

fn executor_with(
    c: Arc<GpuContext>,
    kind: F16Attention,
    copy_attention_operands: bool,
    f16_operands: F16Operands,
) -> Option<GpuExecutor> {
    executor_opts(
        c,
        kind,
        GpuOptions {
            copy_attention_operands,
            f16_operands,
            ..Default::default()
        },
    )
}

fn executor_opts(c: Arc<GpuContext>, kind: F16Attention, opts: GpuOptions) -> Option<GpuExecutor> {
    if kind == F16Attention::Coop && !c.has_cooperative_matrix() {
        eprintln!(
            "adapter '{}' has no 16x16x16 f16 cooperative matrices: tensor-core attention NOT tested here",
            c.info.name
        );
        return None;
    }
    let mut g = GpuExecutor::with_options(
        c,
        GpuOptions {
            poison_outputs: true,
            f16_attention: kind,
            ..opts
        },
    );
    g.set_compute_precision(ComputePrecision::F16).unwrap();
    Some(g)
}

#[derive(Debug, Clone, Copy)]
struct Case {
    b: usize,
    t: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// Keys a query sees (a sliding window); 0: every key up to it.
    w: usize,
    /// The scores' soft cap (Gemma 2's); 0: none.
    cap: f32,
    /// Where each row's packed documents begin (`Docs::new`); empty: none.
    docs: &'static [&'static [usize]],
}

impl Case {
    fn mask(&self) -> AttnMask {
        let mask = match self.w {
            0 => AttnMask::CAUSAL,
            w => AttnMask::sliding(w),
        };
        let mask = mask.with_docs((!self.docs.is_empty()).then(|| {
            let starts: Vec<Vec<usize>> = self.docs.iter().map(|s| s.to_vec()).collect();
            Docs::new(self.t, &starts).unwrap()
        }));
        if self.cap > 0.0 {
            mask.with_softcap(SoftCap::new(self.cap, "test").unwrap())
        } else {
            mask
        }
    }

    /// The same shape in a sliding window of `w` keys.
    const fn window(self, w: usize) -> Case {
        Case { w, ..self }
    }

    /// The same case with its scores soft-capped at `cap`.
    const fn capped(self, cap: f32) -> Case {
        Case { cap, ..self }
    }

    /// The same shape with documents packed in its rows, beginning at
    /// `docs[b]` in row b.
    const fn packed(self, docs: &'static [&'static [usize]]) -> Case {
        Case { docs, ..self }
    }

    /// A scaled score as the softmax sees it (soft-capped where the case
    /// says), and its derivative with respect to the scaled score.
    fn shape(&self, s: f64) -> (f64, f64) {
        if self.cap > 0.0 {
            let cap = self.cap as f64;
            let t = (s / cap).tanh();
            (cap * t, 1.0 - t * t)
        } else {
            (s, 1.0)
        }
    }
}

struct Inputs {
    q: HostTensor,
    k: HostTensor,
    v: HostTensor,
    dout: HostTensor,
}

fn inputs(c: Case, seed: u64) -> Inputs {
    // Magnitudes apart, so each tensor's own scale matters.
    let scaled = |h: HostTensor, s: f32| {
        HostTensor::from_f32(h.shape().clone(), h.to_f32_vec().iter().map(|x| x * s).collect()).unwrap()
    };
    Inputs {
        q: scaled(random_tensor(seed, [c.b, c.t, c.hq, c.d]), 2.0),
        k: scaled(random_tensor(seed + 1, [c.b, c.t, c.hkv, c.d]), 1.5),
        v: scaled(random_tensor(seed + 2, [c.b, c.t, c.hkv, c.d]), 300.0),
        dout: scaled(random_tensor(seed + 3, [c.b, c.t, c.hq, c.d]), 1e-4),
    }
}

/// Forward and (when `backward`) backward of `g` against the CPU F16
/// reference. Returns the error of a pass the adapter refuses.
fn check(g: &GpuExecutor, c: Case, seed: u64, tol: f64, backward: bool) -> Result<(), String> {
    check_inputs(g, c, inputs(c, seed), tol, backward)
}

/// Inputs whose scores rise along the keys (K's rows at position j scaled
/// by 1 + j/4, each query's max rising tile after tile by more than the
/// forward's RAISE), so that the tensor-core forward rescales O; and
/// positions where K is 0, where rows keep their max.
fn rising(c: Case, seed: u64) -> Inputs {
    let mut x = inputs(c, seed);
    let row = c.hkv * c.d;
    let k: Vec<f32> =
        x.k.to_f32_vec()
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let j = i / row % c.t;
                if j % 8 == 3 {
                    0.0
                } else {
                    v * (1.0 + j as f32 / 4.0)
                }
            })
            .collect();
    x.k = HostTensor::from_f32(x.k.shape().clone(), k).unwrap();
    x
}

fn check_inputs(g: &GpuExecutor, c: Case, x: Inputs, tol: f64, backward: bool) -> Result<(), String> {
    check_under(g, c, c.mask(), x, tol, backward)
}

/// [`check`] of the case with its probabilities dropped (p = 0.2, the
/// mask's rows counted from batch row 3).
fn check_dropped(g: &GpuExecutor, c: Case, seed: u64) -> Result<(), String> {
    let d = Dropout::new(0.2, seed, "test")
        .unwrap()
        .map(|d| d.at_batch_row(3));
    check_under(g, c, c.mask().with_dropout(d), inputs(c, seed), TOL_COOP, true)
}

fn check_under(
    g: &GpuExecutor,
    c: Case,
    mask: AttnMask,
    x: Inputs,
    tol: f64,
    backward: bool,
) -> Result<(), String> {
    let cpu = CpuExecutor::with_precision(ComputePrecision::F16);
    let (cq, ck, cv, cd) = (
        cpu.upload(&x.q).unwrap(),
        cpu.upload(&x.k).unwrap(),
        cpu.upload(&x.v).unwrap(),
        cpu.upload(&x.dout).unwrap(),
    );
    let rf = cpu.attention(&cq, &ck, &cv, mask.clone()).unwrap();
    let (gq, gk, gv, gd) = (up(g, &x.q), up(g, &x.k), up(g, &x.v), up(g, &x.dout));
    let of = g
        .attention(&gq, &gk, &gv, mask.clone())
        .map_err(|e| e.to_string())?;
    let what = |s: &str| format!("{c:?} {s}");
    let (go, ro) = (down(g, &of.out), down_cpu(&cpu, &rf.out));
    let (gl, rl) = (down(g, &of.lse), down_cpu(&cpu, &rf.lse));
    // Every output's error is printed before any is asserted: where a
    // kernel is wrong, which outputs are tells which pass and product.
    let mut line = format!(
        "{c:?}: relative error out {:.2e} lse {:.2e}",
        rel_norm_err(&go, &ro),
        rel_norm_err(&gl, &rl)
    );
    let grads = if backward {
        let rg = cpu.attention_backward(&cq, &ck, &cv, &rf, &cd).unwrap();
        let og = g
            .attention_backward(&gq, &gk, &gv, &of, &gd)
            .map_err(|e| e.to_string())?;
        let gs = [&og.dq, &og.dk, &og.dv].map(|t| down(g, t));
        let rs = [&rg.dq, &rg.dk, &rg.dv].map(|t| down_cpu(&cpu, t));
        for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(gs.iter().zip(&rs)) {
            line.push_str(&format!(" {name} {:.2e}", rel_norm_err(a, b)));
        }
        Some((gs, rs))
    } else {
        None
    };
    eprintln!("{line}");
    assert_close(&what("out"), &go, &ro, tol);
    assert_close(&what("lse"), &gl, &rl, tol);
    if let Some(([gdq, gdk, gdv], [rdq, rdk, rdv])) = grads {
        let [tq, tk] = dqk_terms(c, &x);
        assert_cancelling_close(&what("dq"), &gdq, &rdq, tol, tq);
        assert_cancelling_close(&what("dk"), &gdk, &rdk, tol, tk);
        assert_close(&what("dv"), &gdv, &rdv, tol);
    }
    Ok(())
}

/// dS = P ∘ (dP − rowsum(dO ∘ O)) cancels: where a query sees a single key
/// (T = 1) dQ and dK are exactly 0, and every kernel leaves what its own
/// summation order makes of dP − D (the tensor cores' differs from the f32
/// sum of D). So dQ and dK are held to `tol` of themselves or to `TERMS` of
/// the norm of their terms' magnitudes, whichever is larger: scale · Σⱼ
/// P_ij (|dO_i|·|V_j|) |K_j| for dQ (|Q_i| for dK), times the soft cap's
/// slope where the case has one, in f64 from the inputs.
/// A missing or wrong term is off by a fair fraction of that norm.
const TERMS: f64 = 1e-5;

fn dqk_terms(c: Case, x: &Inputs) -> [f64; 2] {
    let (q, k, v, o) = (
        x.q.to_f32_vec(),
        x.k.to_f32_vec(),
        x.v.to_f32_vec(),
        x.dout.to_f32_vec(),
    );
    let (d, group) = (c.d, c.hq / c.hkv);
    let scale = 1.0 / (d as f64).sqrt();
    let row = |t: &[f32], b: usize, i: usize, h: usize, heads: usize| {
        let at = ((b * c.t + i) * heads + h) * d;
        t[at..at + d].iter().map(|&y| y as f64).collect::<Vec<_>>()
    };
    let mut tq = vec![0f64; c.b * c.t * c.hq * d];
    let mut tk = vec![0f64; c.b * c.t * c.hkv * d];
    for b in 0..c.b {
        for h in 0..c.hq {
            for i in 0..c.t {
                let (qi, oi) = (row(&q, b, i, h, c.hq), row(&o, b, i, h, c.hq));
                let j0 = c.mask().first_key(b, i);
                let s: Vec<(f64, f64)> = (j0..=i)
                    .map(|j| {
                        c.shape(
                            scale
                                * qi.iter()
                                    .zip(row(&k, b, j, h / group, c.hkv))
                                    .map(|(a, b)| a * b)
                                    .sum::<f64>(),
                        )
                    })
                    .collect();
                let m = s.iter().map(|y| y.0).fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|y| (y.0 - m).exp()).sum();
                for (j, &(sj, slope)) in (j0..).zip(&s) {
                    let (kj, vj) = (row(&k, b, j, h / group, c.hkv), row(&v, b, j, h / group, c.hkv));
                    let dp: f64 = oi.iter().zip(&vj).map(|(a, b)| (a * b).abs()).sum();
                    let a = scale * (sj - m).exp() / z * dp * slope;
                    let (iq, ik) = (
                        ((b * c.t + i) * c.hq + h) * d,
                        ((b * c.t + j) * c.hkv + h / group) * d,
                    );
                    for e in 0..d {
                        tq[iq + e] += a * kj[e].abs();
                        tk[ik + e] += a * qi[e].abs();
                    }
                }
            }
        }
    }
    let norm = |t: &[f64]| t.iter().map(|y| y * y).sum::<f64>().sqrt();
    [norm(&tq), norm(&tk)]
}

fn assert_cancelling_close(what: &str, got: &[f32], want: &[f32], tol: f64, terms: f64) {
    assert_written(what, got, want);
    let diff = got
        .iter()
        .zip(want)
        .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let want_norm = want.iter().map(|&b| (b as f64).powi(2)).sum::<f64>().sqrt();
    let bound = (tol * want_norm).max(TERMS * terms);
    assert!(
        diff <= bound,
        "{what}: error norm {diff:e} > {bound:e} (tol {tol:e} of {want_norm:e}, {TERMS:e} of the terms' {terms:e})"
    );
}

fn up(g: &GpuExecutor, h: &HostTensor) -> megatrain_gpu::GpuTensor {
    g.upload(h).unwrap()
}

/// Awkward shapes: T not a multiple of any tile, T = 1, GQA 6/2 and 8/1,
/// D = 80, B > 1.
const CASES: [Case; 4] = [
    Case {
        b: 2,
        t: 37,
        hq: 6,
        hkv: 2,
        d: 80,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 1,
        t: 1,
        hq: 4,
        hkv: 1,
        d: 64,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 1,
        t: 20,
        hq: 8,
        hkv: 1,
        d: 64,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 2,
        t: 29,
        hq: 2,
        hkv: 2,
        d: 96,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
];
/// Sliding windows: one key, a window inside one key tile, one past the
/// first row block of GQA 8/1, and the D = 128 case's keys of the window
/// more than one tile long.
const WINDOWED: [Case; 4] = [
    CASES[0].window(1),
    CASES[0].window(5),
    CASES[2].window(3),
    CASE_128.window(33),
];

/// Documents packed in the rows: B = 2 laid out differently (a one-token
/// document at a row's end, a row of one document) at GQA 6/2, D = 80; in
/// a window of 3 at GQA 8/1 (a one-token document first); and D = 96 with
/// a document starting inside each row's second key tile.
const PACKED: [Case; 3] = [
    CASES[0].packed(&[&[0, 5, 6, 36], &[0]]),
    CASES[2].window(3).packed(&[&[0, 1, 10]]),
    CASES[3].packed(&[&[0, 20], &[0, 17, 28]]),
];

/// D = 128: the forward everywhere; the emulated backward's tiles exceed
/// 32 KiB of workgroup memory in f32 and are refused where that is the cap.
const CASE_128: Case = Case {
    b: 1,
    t: 41,
    hq: 3,
    hkv: 1,
    d: 128,
    w: 0,
    cap: 0.0,
    docs: &[],
};

#[test]
fn simt_kernels_match_the_reference_on_rounded_operands() {
    let Some(g) = ctx().and_then(|c| executor(c, F16Attention::Simt)) else {
        return;
    };
    for (i, c) in CASES.into_iter().chain([CASE_128]).enumerate() {
        check(&g, c, 10 + i as u64, TOL_SIMT, true).unwrap();
    }
    for (i, c) in WINDOWED.into_iter().enumerate() {
        check(&g, c, 15 + i as u64, TOL_SIMT, true).unwrap();
    }
    for (i, c) in PACKED
        .into_iter()
        .chain([CASE_128.packed(&[&[0, 1, 20]])])
        .enumerate()
    {
        check(&g, c, 120 + i as u64, TOL_SIMT, true).unwrap();
    }
}

/// Head dimension 256 (Gemma 2's and 3's), which the tensor-core family
/// and the lanes kernels do not take: Gemma 3 1B's four query heads on one
/// kv head at T = 37 (partial tiles) and T = 1, in a window of 5, and the
/// general wide kernels at D = 200 over two batches.
const CASES_256: [Case; 4] = [
    Case {
        b: 1,
        t: 37,
        hq: 4,
        hkv: 1,
        d: 256,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 1,
        t: 1,
        hq: 4,
        hkv: 1,
        d: 256,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 1,
        t: 37,
        hq: 4,
        hkv: 1,
        d: 256,
        w: 5,
        cap: 0.0,
        docs: &[],
    },
    Case {
        b: 2,
        t: 20,
        hq: 2,
        hkv: 2,
        d: 200,
        w: 0,
        cap: 0.0,
        docs: &[],
    },
];

/// At D = 256 `Auto` runs the SIMT kernels (their wide variants) on the
/// rounded operands whatever the adapter has, held to the SIMT tolerance.
#[test]
fn head_dim_256_runs_the_simt_kernels_on_rounded_operands() {
    let Some(g) = ctx().and_then(|c| executor(c, F16Attention::Auto)) else {
        return;
    };
    for (i, case) in CASES_256.into_iter().enumerate() {
        let start = std::time::Instant::now();
        check(&g, case, 90 + i as u64, TOL_SIMT, true).unwrap();
        eprintln!("{case:?}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// The tensor-core family asked for by name at a head dimension it has
/// no kernels for (256) is refused, naming it, forward and backward.
#[test]
fn tensor_core_kernels_refuse_head_dims_they_lack() {
    let Some(c) = ctx() else { return };
    for kind in [F16Attention::CoopEmulated, F16Attention::Coop] {
        let Some(g) = executor(c.clone(), kind) else {
            continue;
        };
        let case = Case {
            b: 1,
            t: 5,
            hq: 2,
            hkv: 1,
            d: 256,
            w: 0,
            cap: 0.0,
            docs: &[],
        };
        let x = inputs(case, 95);
        let (q, k, v, dout) = (up(&g, &x.q), up(&g, &x.k), up(&g, &x.v), up(&g, &x.dout));
        let refused = |e: megatrain_tensor::Error| {
            let e = e.to_string();
            assert!(
                e.contains("head dim 256") && e.contains(&format!("{kind:?}")),
                "{e}"
            );
        };
        refused(
            g.attention(&q, &k, &v, AttnMask::CAUSAL)
                .expect_err("no D = 256 kernels"),
        );
        let fwd = megatrain_tensor::AttentionOut {
            out: up(&g, &x.dout),
            lse: up(&g, &HostTensor::zeros([1, 2, 5])),
            mask: AttnMask::CAUSAL,
        };
        refused(
            g.attention_backward(&q, &k, &v, &fwd, &dout)
                .expect_err("no D = 256 kernels"),
        );
    }
}

/// Soft-capped scores (Gemma 2's), which the tensor-core family does not
/// apply: `Auto` runs the SIMT kernels on the rounded operands, the
/// backward as the forward's mask says, held to the SIMT tolerance, at
/// head dimensions the tensor cores (80, 64) would take uncapped, and at
/// 256. Both SIMT families: the lanes kernels (the default at 80, 64 and
/// Gemma 2 27B's 128, multiples of 16 up to 128) and one thread per row
/// (every case). Scores here are about ±1 (q, k scaled by 2 and 1.5):
/// caps of 0.5 and 1 bend most, Gemma 2's 50 few.
#[test]
fn soft_capped_scores_run_the_simt_kernels_under_auto() {
    let Some(c) = ctx() else { return };
    let Some(lanes) = executor(c.clone(), F16Attention::Auto) else {
        return;
    };
    let one_row = GpuOptions {
        one_row_attention: true,
        ..Default::default()
    };
    let Some(one_row) = executor_opts(c.clone(), F16Attention::Auto, one_row) else {
        return;
    };
    let cases = [
        CASES[0].capped(0.5),
        WINDOWED[2].capped(1.0),
        CASE_128.capped(50.0),
        CASES_256[2].capped(0.5),
    ];
    for (family, g) in [("lanes", &lanes), ("one row", &one_row)] {
        for (i, case) in cases.into_iter().enumerate() {
            if family == "lanes" && !c.attention_lanes(case.d) {
                assert_eq!(
                    case.d, 256,
                    "{}: no lanes attention at D = {}",
                    c.info.name, case.d
                );
                continue;
            }
            let start = std::time::Instant::now();
            check(g, case, 200 + i as u64, TOL_SIMT, true).unwrap();
            eprintln!("{family}, {case:?}: {:.1} s", start.elapsed().as_secs_f64());
        }
    }
}

/// The tensor-core family asked for by name with a soft cap, which it does
/// not apply, is refused, naming the cap, forward and backward (the
/// backward by the forward's mask).
#[test]
fn tensor_core_kernels_refuse_a_soft_cap() {
    let Some(c) = ctx() else { return };
    for kind in [F16Attention::CoopEmulated, F16Attention::Coop] {
        let Some(g) = executor(c.clone(), kind) else {
            continue;
        };
        let case = Case {
            b: 1,
            t: 5,
            hq: 2,
            hkv: 1,
            d: 64,
            w: 0,
            cap: 0.0,
            docs: &[],
        }
        .capped(30.0);
        let x = inputs(case, 97);
        let (q, k, v, dout) = (up(&g, &x.q), up(&g, &x.k), up(&g, &x.v), up(&g, &x.dout));
        let refused = |e: megatrain_tensor::Error| {
            let e = e.to_string();
            assert!(
                e.contains("soft cap") && e.contains("30") && e.contains(&format!("{kind:?}")),
                "{e}"
            );
        };
        refused(
            g.attention(&q, &k, &v, case.mask())
                .expect_err("no soft cap in the tensor-core kernels"),
        );
        let fwd = megatrain_tensor::AttentionOut {
            out: up(&g, &x.dout),
            lse: up(&g, &HostTensor::zeros([1, 2, 5])),
            mask: case.mask(),
        };
        refused(
            g.attention_backward(&q, &k, &v, &fwd, &dout)
                .expect_err("no soft cap in the tensor-core kernels"),
        );
    }
}

/// The emulated kernels of head dimension `d` against the reference, on a
/// device of their own (`own_ctx`), so that the four compile side by side.
fn emulated_kernels_match_the_reference(d: usize) {
    let Some(g) = own_ctx().and_then(|c| executor(c, F16Attention::CoopEmulated)) else {
        return;
    };
    for (i, c) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == d) {
        check(&g, c, 20 + i as u64, TOL_COOP, true).unwrap();
    }
    for (i, c) in PACKED.into_iter().enumerate().filter(|(_, c)| c.d == d) {
        check(&g, c, 130 + i as u64, TOL_COOP, true).unwrap();
    }
    if d == 64 {
        // The emulated forward at D = 64 has the hardware's key tile (32):
        // three tiles, the last partial, O's fragments going out two at a
        // time (at the end, and where a row's max rises: `rising`).
        let tiles = Case {
            b: 1,
            t: 70,
            hq: 2,
            hkv: 1,
            d: 64,
            w: 0,
            cap: 0.0,
            docs: &[],
        };
        check(&g, tiles, 25, TOL_COOP, false).unwrap();
        check_inputs(&g, tiles, rising(tiles, 26), TOL_COOP, true).unwrap();
        // In windows: tiles before a block's window skipped, a query tile
        // past a key block's window never staged.
        for (i, c) in [tiles.window(20), tiles.window(1), CASES[2].window(3)]
            .into_iter()
            .enumerate()
        {
            check(&g, c, 27 + i as u64, TOL_COOP, true).unwrap();
        }
        // Within packed documents: the forward's blocks from position 40
        // skip the first key tile, the first key blocks' query tiles end
        // at 40; with rising scores, and in a window.
        let packed = tiles.packed(&[&[0, 1, 40, 69]]);
        check(&g, packed, 135, TOL_COOP, true).unwrap();
        check_inputs(&g, packed, rising(packed, 136), TOL_COOP, true).unwrap();
        check(&g, packed.window(20), 137, TOL_COOP, true).unwrap();
        // Dropout of the probabilities: P's kept entries scaled in the
        // forward's and dk/dv's tiles, dP's in dq's and dk/dv's.
        for (i, c) in [tiles, packed.window(20), CASES[2]].into_iter().enumerate() {
            check_dropped(&g, c, 150 + i as u64).unwrap();
        }
    }
    if d == CASE_128.d {
        check(&g, CASE_128, 30, TOL_COOP, false).unwrap();
        check_inputs(&g, CASE_128, rising(CASE_128, 31), TOL_COOP, false).unwrap();
        if let Err(e) = check(&g, CASE_128, 30, TOL_COOP, true) {
            assert!(e.contains("workgroup memory"), "{e}");
            eprintln!("emulated D = 128 backward refused here: {e}");
        }
    }
}

/// The timing probes (`AttnProbe`, the attention bench's
/// `MEGATRAIN_ATTN_PROBE`) run the kernels' own loops: over one streamed
/// tile `Staged` gives the real forward's and backward's bits (out, lse,
/// dq, dk, dv), over several it gives others (it stages the first tile
/// alone), and `Plain` (no softmax, no P or dS from the statistics) gives
/// others from the first tile. On the default tiles (16 keys, prefetched),
/// the hardware's where the adapter has cooperative matrices, else the
/// emulated ones (lavapipe in CI); naga and spirv-val check every probe's
/// hardware variant in CI (`coop_naga.rs`, `spirv_val.rs`).
#[test]
fn timing_probes_run_the_kernels_own_loops() {
    let Some(c) = own_ctx() else { return };
    let kind = if c.has_cooperative_matrix() {
        F16Attention::Coop
    } else {
        F16Attention::CoopEmulated
    };
    let bits = |g: &GpuExecutor, x: &Inputs| {
        let (q, k, v) = (up(g, &x.q), up(g, &x.k), up(g, &x.v));
        let f = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
        let d = g.attention_backward(&q, &k, &v, &f, &up(g, &x.dout)).unwrap();
        [&f.out, &f.lse, &d.dq, &d.dk, &d.dv].map(|t| {
            g.download(t)
                .unwrap()
                .to_f32_vec()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        })
    };
    // One head a kv head: dk/dv streams one head's query tiles.
    let case = |t| Case {
        b: 1,
        t,
        hq: 1,
        hkv: 1,
        d: 64,
        w: 0,
        cap: 0.0,
        docs: &[],
    };
    let (one, several) = (inputs(case(16), 40), inputs(case(53), 41));
    let on = |probe| {
        let opts = GpuOptions {
            attention_probe: probe,
            ..Default::default()
        };
        executor_opts(c.clone(), kind, opts).expect("emulated kernels run anywhere")
    };
    let real = on(None);
    let (real_one, real_several) = (bits(&real, &one), bits(&real, &several));
    let staged = on(Some(AttnProbe::Staged));
    let got = bits(&staged, &one);
    for (i, name) in ["out", "lse", "dq", "dk", "dv"].into_iter().enumerate() {
        assert!(
            got[i] == real_one[i],
            "staged: one tile, {name} not the real bits"
        );
    }
    let got = bits(&staged, &several);
    for (i, name) in [(0, "out"), (2, "dq"), (3, "dk")] {
        assert!(
            got[i] != real_several[i],
            "staged: several tiles gave the real {name}"
        );
    }
    let got = bits(&on(Some(AttnProbe::Plain)), &one);
    for (i, name) in [(0, "out"), (2, "dq"), (3, "dk"), (4, "dv")] {
        assert!(got[i] != real_one[i], "plain: gave the real {name}");
    }
}

/// The forward's softmax in one pass over each tile's scores (P against
/// the running max, again for rows whose max rises) against two (the
/// maxima first, `t`): the same out and lse, bit for bit on lavapipe,
/// whose compiler contracts both alike (elsewhere within the reference's
/// tolerance, which every other test holds the default to). Maxima that
/// rise tile after tile, a window, documents and dropout, over several
/// tiles a block; emulated where the adapter has no cooperative matrices.
#[test]
fn one_pass_softmax_gives_the_two_pass_probabilities() {
    let Some(c) = own_ctx() else { return };
    let (kind, tiles) = if c.has_cooperative_matrix() {
        (F16Attention::Coop, ["fwd=sg4bc16spr4", "fwd=sg4bc16sptr4"])
    } else {
        (F16Attention::CoopEmulated, ["fwd=sg1bc32", "fwd=sg1bc32t"])
    };
    let on = |tiles: &str| {
        let opts = GpuOptions {
            attention_tiles: tiles.parse().unwrap(),
            ..Default::default()
        };
        executor_opts(c.clone(), kind, opts).expect("emulated kernels run anywhere")
    };
    let (one, two) = (on(tiles[0]), on(tiles[1]));
    let fwd = |g: &GpuExecutor, x: &Inputs, mask: AttnMask| {
        let (q, k, v) = (up(g, &x.q), up(g, &x.k), up(g, &x.v));
        let f = g.attention(&q, &k, &v, mask).unwrap();
        [&f.out, &f.lse].map(|t| g.download(t).unwrap().to_f32_vec())
    };
    let long = Case {
        b: 2,
        t: 83,
        hq: 4,
        hkv: 2,
        d: 64,
        w: 0,
        cap: 0.0,
        docs: &[],
    };
    let dropped = Dropout::new(0.2, 7, "test").unwrap().map(|d| d.at_batch_row(1));
    let runs = [
        (long, rising(long, 130), long.mask()),
        (long, inputs(long, 131), long.mask()),
        (long.window(21), inputs(long, 132), long.window(21).mask()),
        (
            long.packed(&[&[0, 1, 40], &[0, 60]]),
            rising(long, 133),
            long.packed(&[&[0, 1, 40], &[0, 60]]).mask(),
        ),
        (long, inputs(long, 134), long.mask().with_dropout(dropped)),
        (CASES[1], inputs(CASES[1], 135), CASES[1].mask()),
    ];
    for (case, x, mask) in runs {
        let (a, b) = (fwd(&one, &x, mask.clone()), fwd(&two, &x, mask));
        if c.is_lavapipe_coop() || !c.has_cooperative_matrix() {
            for (i, name) in ["out", "lse"].into_iter().enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&a[i]) == bits(&b[i]),
                    "{case:?}: {name} not the two-pass bits"
                );
            }
        } else {
            assert_close(&format!("{case:?} out"), &a[0], &b[0], 1e-5);
            assert_close(&format!("{case:?} lse"), &a[1], &b[1], 1e-6);
        }
    }
}

#[test]
fn emulated_tensor_core_kernels_match_the_reference_d64() {
    emulated_kernels_match_the_reference(64);
}

#[test]
fn emulated_tensor_core_kernels_match_the_reference_d80() {
    emulated_kernels_match_the_reference(80);
}

#[test]
fn emulated_tensor_core_kernels_match_the_reference_d96() {
    emulated_kernels_match_the_reference(96);
}

#[test]
fn emulated_tensor_core_kernels_match_the_reference_d128() {
    emulated_kernels_match_the_reference(128);
}

#[test]
fn tensor_core_kernels_match_the_reference() {
    let Some(g) = ctx().and_then(|c| executor(c, F16Attention::Coop)) else {
        return;
    };
    for (i, c) in CASES.into_iter().chain([CASE_128]).enumerate() {
        check(&g, c, 40 + i as u64, TOL_COOP, true).unwrap();
    }
    // Several blocks of every kind, the diagonal tiles at many offsets.
    let big = Case {
        b: 2,
        t: 300,
        hq: 32,
        hkv: 8,
        d: 128,
        w: 0,
        cap: 0.0,
        docs: &[],
    };
    check(&g, big, 50, TOL_COOP, true).unwrap();
    check_inputs(&g, big, rising(big, 51), TOL_COOP, true).unwrap();
    for (i, c) in WINDOWED.into_iter().chain([big.window(100)]).enumerate() {
        check(&g, c, 52 + i as u64, TOL_COOP, true).unwrap();
    }
    let big_packed = big.packed(&[&[0, 1, 130, 131, 299], &[0]]);
    for (i, c) in PACKED
        .into_iter()
        .chain([big_packed, big_packed.window(100)])
        .enumerate()
    {
        check(&g, c, 140 + i as u64, TOL_COOP, true).unwrap();
    }
    for (i, c) in [big, big_packed.window(100), CASE_128].into_iter().enumerate() {
        check_dropped(&g, c, 160 + i as u64).unwrap();
    }
}

/// Tiles other than the passes' defaults (`AttnTiles`), emulated: a
/// forward block of 32 rows over 16-key tiles (the largest other tile
/// lavapipe's 32 KiB hold in f32), on the D = 64 cases, the partial key
/// tiles and the rising maxima; and the shared regions, which need real
/// cooperative matrices (emulated fragments are read where they lie),
/// refused by name.
#[test]
fn emulated_tensor_core_kernels_with_other_tiles_match_the_reference() {
    let tiles = |s: &str| GpuOptions {
        attention_tiles: s.parse().unwrap(),
        ..Default::default()
    };
    let Some(g) = own_ctx().and_then(|c| executor_opts(c, F16Attention::CoopEmulated, tiles("fwd=sg2bc16")))
    else {
        return;
    };
    for (i, c) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == 64) {
        check(&g, c, 60 + i as u64, TOL_COOP, true).unwrap();
    }
    let long = Case {
        b: 1,
        t: 70,
        hq: 2,
        hkv: 1,
        d: 64,
        w: 0,
        cap: 0.0,
        docs: &[],
    };
    check(&g, long, 65, TOL_COOP, true).unwrap();
    check_inputs(&g, long, rising(long, 66), TOL_COOP, false).unwrap();
    // Every pass's streamed tiles prefetched into registers: the first
    // tile's reads before the resident block is staged, each next one's
    // while the current is multiplied; dkv's across its heads (GQA 8/1),
    // and past tiles a window skips.
    let pre = executor_opts(
        g.context().clone(),
        F16Attention::CoopEmulated,
        tiles("fwd=sg2bc16p,dq=sg1bc16p,dkv=sg1bc16p"),
    )
    .unwrap();
    // dQ added by dk/dv with f32 atomics (no dq pass), where the adapter
    // has them (lavapipe does): from every key block and query head of a
    // group into the same rows, 16-key blocks on T = 70.
    let fused = executor_opts(
        g.context().clone(),
        F16Attention::CoopEmulated,
        tiles("dkv=sg1bc16pq"),
    )
    .unwrap();
    if g.context()
        .features
        .contains(wgpu::Features::SHADER_FLOAT32_ATOMIC)
    {
        for (i, c) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == 64) {
            check(&fused, c, 100 + i as u64, TOL_COOP, true).unwrap();
        }
        check(&fused, long, 105, TOL_COOP, true).unwrap();
        check_inputs(&fused, long, rising(long, 106), TOL_COOP, true).unwrap();
        check(&fused, long.window(20), 107, TOL_COOP, true).unwrap();
        check(&fused, long.packed(&[&[0, 1, 40, 69]]), 109, TOL_COOP, true).unwrap();
    } else {
        let e = check(&fused, long, 108, TOL_COOP, true).unwrap_err();
        assert!(e.contains("f32 atomics"), "{e}");
    }
    for (i, c) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == 64) {
        check(&pre, c, 80 + i as u64, TOL_COOP, true).unwrap();
    }
    check(&pre, long, 85, TOL_COOP, true).unwrap();
    check_inputs(&pre, long, rising(long, 86), TOL_COOP, true).unwrap();
    // Within packed documents, the prefetched tiles past a document's end
    // never staged.
    let packed = [long.packed(&[&[0, 1, 40, 69]]), PACKED[1]];
    for (i, c) in [long.window(20), CASES[2].window(3)]
        .into_iter()
        .chain(packed)
        .enumerate()
    {
        check(&pre, c, 87 + i as u64, TOL_COOP, true).unwrap();
    }
    // The forward's streamed tiles double buffered (one barrier a tile):
    // each next tile staged into the copy the last one's products did not
    // read, over several tiles, rising maxima, a window and documents.
    // (dq's and dk/dv's exceed lavapipe's 32 KiB in f32 at D = 64: their
    // double buffers run on tensor cores, below.)
    let double = executor_opts(
        g.context().clone(),
        F16Attention::CoopEmulated,
        tiles("fwd=sg1bc16pd"),
    )
    .unwrap();
    for (i, c) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == 64) {
        check(&double, c, 110 + i as u64, TOL_COOP, false).unwrap();
    }
    check_inputs(&double, long, rising(long, 115), TOL_COOP, false).unwrap();
    for (i, c) in [long.window(20), long.packed(&[&[0, 1, 40, 69]])]
        .into_iter()
        .enumerate()
    {
        check(&double, c, 116 + i as u64, TOL_COOP, false).unwrap();
    }
    let shared = executor_opts(
        g.context().clone(),
        F16Attention::CoopEmulated,
        tiles("fwd=sg2bc16s"),
    )
    .unwrap();
    let e = check(&shared, long, 67, TOL_COOP, false).unwrap_err();
    assert!(
        e.contains("sg2bc16s") && e.contains("real cooperative matrices"),
        "{e}"
    );
}

/// The kernels built from SPIR-V of our own (`GpuOptions::own_spirv`:
/// naga's module with its subgroup barriers fixed, handed to the driver
/// by `create_shader_module_passthrough` with a layout read from the
/// module), which the subgroup-local tiles need: the emulated variants at
/// D = 64 on any adapter (lavapipe in CI), and the hardware's where the
/// adapter has cooperative matrices, against the reference with poisoned
/// outputs, so that a binding the layout missed shows.
#[test]
fn kernels_from_our_own_spirv_match_the_reference() {
    let opts = || GpuOptions {
        own_spirv: true,
        ..Default::default()
    };
    let Some(c) = own_ctx() else { return };
    let g = executor_opts(c.clone(), F16Attention::CoopEmulated, opts()).unwrap();
    for (i, case) in CASES.into_iter().enumerate().filter(|(_, c)| c.d == 64) {
        check(&g, case, 90 + i as u64, TOL_COOP, true).unwrap();
    }
    let Some(g) = executor_opts(c, F16Attention::Coop, opts()) else {
        return;
    };
    for (i, case) in CASES.into_iter().chain([CASE_128]).enumerate() {
        check(&g, case, 95 + i as u64, TOL_COOP, true).unwrap();
    }
}

/// Every tile set the attention bench sweeps (`AttnTiles::SWEEP`: shared
/// regions, other block and key tiles), where the adapter has cooperative
/// matrices, on the awkward cases and several blocks of every kind, packed
/// documents among them.
#[test]
fn tensor_core_kernels_with_swept_tiles_match_the_reference() {
    for (n, tiles) in megatrain_gpu::AttnTiles::SWEEP.into_iter().enumerate() {
        let set: megatrain_gpu::AttnTiles = tiles.parse().unwrap();
        let local = [set.fwd, set.dq, set.dkv]
            .into_iter()
            .any(|t| t.is_some_and(|t| t.local));
        let opts = GpuOptions {
            attention_tiles: set,
            ..Default::default()
        };
        let Some(g) = ctx().and_then(|c| executor_opts(c, F16Attention::Coop, opts)) else {
            return;
        };
        if local && !g.context().has_subgroup_local_rows() {
            // lavapipe's 8-lane subgroups: refused by name, never run (the
            // backward too: a set may have `l` on dq and dk/dv alone).
            let e = check(&g, CASES[1], 70, TOL_COOP, true).unwrap_err();
            assert!(e.contains("subgroup-local rows"), "{e}");
            eprintln!("{tiles}: refused here, as it should be: {e}");
            continue;
        }
        for (i, c) in CASES.into_iter().chain([CASE_128]).enumerate() {
            check(&g, c, 70 + (10 * n + i) as u64, TOL_COOP, true).unwrap();
        }
        let big = Case {
            b: 1,
            t: 150,
            hq: 8,
            hkv: 2,
            d: 64,
            w: 0,
            cap: 0.0,
            docs: &[],
        };
        check_inputs(&g, big, rising(big, 79 + 10 * n as u64), TOL_COOP, true).unwrap();
        check(&g, big.window(45), 78 + 10 * n as u64, TOL_COOP, true).unwrap();
        // Packed documents: one-token ones, and tiles skipped both ways.
        let packed = big.packed(&[&[0, 1, 70, 149]]);
        check(&g, packed, 77 + 10 * n as u64, TOL_COOP, true).unwrap();
        eprintln!("{tiles}: matches");
    }
}

/// Resident blocks staged in slices of their columns (`r{N}`: Q, Q and
/// dO, K and V, each slice's fragments loaded before the next is staged
/// in the same region), unevenly at D = 80 (two fragments, two, then
/// one), where the adapter has cooperative matrices, with dropout and
/// without: a small set, so that CI runs it on Mesa 26's lavapipe (the
/// sweep's sets run where a GPU is).
#[test]
fn resident_blocks_staged_in_slices_match_the_reference() {
    let tiles = "fwd=sg4bc16spr4,dq=sg2bc16spr2,dkv=sg2bc16spr4";
    let opts = GpuOptions {
        attention_tiles: tiles.parse().unwrap(),
        ..Default::default()
    };
    let Some(g) = own_ctx().and_then(|c| executor_opts(c, F16Attention::Coop, opts)) else {
        return;
    };
    // B 2, T 37, GQA 6/2, D = 80; and its probabilities dropped, on the
    // same kernels (CI's one run of the hardware's dropout).
    check(&g, CASES[0], 61, TOL_COOP, true).unwrap();
    check_dropped(&g, CASES[0], 62).unwrap();
    eprintln!("{tiles}: matches");
}

/// Every pass's streamed tiles double buffered (`d`: the next tile staged
/// from its registers into the copy the current one's products do not
/// read, one workgroup barrier a tile), on shared regions and sliced
/// resident blocks as the swept sets have them, where the adapter has
/// cooperative matrices: several tiles a block and dk/dv's across the
/// query heads of a group (GQA 6/2 at D = 80, T = 37), documents that skip
/// tiles, a sliding window and dropout. A small set, so that CI runs it on
/// Mesa 26's lavapipe.
#[test]
fn double_buffered_tiles_match_the_reference() {
    let tiles = "fwd=sg4bc16spdr4,dq=sg2bc16spdr2,dkv=sg2bc16spdr4";
    let opts = GpuOptions {
        attention_tiles: tiles.parse().unwrap(),
        ..Default::default()
    };
    let Some(g) = own_ctx().and_then(|c| executor_opts(c, F16Attention::Coop, opts)) else {
        return;
    };
    check(&g, CASES[0], 121, TOL_COOP, true).unwrap();
    check_inputs(&g, CASES[0], rising(CASES[0], 122), TOL_COOP, true).unwrap();
    check(&g, PACKED[0], 123, TOL_COOP, true).unwrap();
    check(&g, WINDOWED[1], 124, TOL_COOP, true).unwrap();
    check_dropped(&g, CASES[0], 125).unwrap();
    eprintln!("{tiles}: matches");
}

/// The tensor-core kernels round Q, K and V to f16 as they stage them
/// (scale, then f16 conversion to nearest-even), or read their f16 copies
/// made by the same conversion (`F16Operands::Copy`, the default): bit for
/// bit what they compute from rounded f32 copies, which the SIMT kernels
/// need. Forward and backward: the emulated kernels everywhere at D = 64
/// (the emulated ones at every D are checked against the reference above),
/// the hardware's on every awkward case where it exists.
#[test]
fn tensor_core_staging_rounds_exactly_as_the_copies_do() {
    // A device of its own: its emulated kernels compile beside the others'.
    let Some(c) = own_ctx() else { return };
    for kind in [F16Attention::CoopEmulated, F16Attention::Coop] {
        let ways = [
            (false, F16Operands::Stage),
            (false, F16Operands::Copy),
            (true, F16Operands::Stage),
        ];
        let Some(gs) = ways
            .iter()
            .map(|&(rounded, operands)| executor_with(c.clone(), kind, rounded, operands))
            .collect::<Option<Vec<_>>>()
        else {
            continue;
        };
        for (i, c) in CASES.into_iter().chain([CASE_128]).enumerate() {
            if kind == F16Attention::CoopEmulated && c.d != 64 {
                continue;
            }
            let x = inputs(c, 60 + i as u64);
            let run = |g: &GpuExecutor| -> Vec<Vec<u32>> {
                let up = |h: &HostTensor| g.upload(h).unwrap();
                let (q, k, v, d) = (up(&x.q), up(&x.k), up(&x.v), up(&x.dout));
                let f = g.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
                let gr = g.attention_backward(&q, &k, &v, &f, &d).unwrap();
                [&f.out, &f.lse, &gr.dq, &gr.dk, &gr.dv]
                    .iter()
                    .map(|t| {
                        g.download(t)
                            .unwrap()
                            .to_f32_vec()
                            .iter()
                            .map(|y| y.to_bits())
                            .collect()
                    })
                    .collect()
            };
            let want = run(&gs[0]);
            for (g, way) in gs[1..].iter().zip(&ways[1..]) {
                let got = run(g);
                for (j, name) in ["out", "lse", "dq", "dk", "dv"].iter().enumerate() {
                    assert!(
                        got[j] == want[j],
                        "{kind:?} {c:?}: {name} with (rounded copies, operands) = {way:?} differs from staging's"
                    );
                }
            }
            assert!(gs[1].operand_f16_copies() > 0 && gs[0].operand_f16_copies() == 0);
        }
    }
}

#[test]
fn forcing_tensor_cores_without_them_is_refused() {
    let Some(c) = ctx() else { return };
    if c.has_cooperative_matrix() {
        return;
    }
    let mut g = GpuExecutor::with_options(
        c,
        GpuOptions {
            f16_attention: F16Attention::Coop,
            ..Default::default()
        },
    );
    let e = g
        .set_compute_precision(ComputePrecision::F16)
        .unwrap_err()
        .to_string();
    assert!(e.contains("tensor-core attention"), "{e}");
}
