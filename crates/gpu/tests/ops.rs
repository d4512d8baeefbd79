//! Every non-matmul op, forward and backward, against the CPU reference on
//! random inputs of awkward shapes; each also runs on an executor whose
//! bindings are capped at 4 KiB, which forces the multi-range paths.

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions};
use megatrain_tensor::{
    AttnMask, ClampedGlu, DType, Docs, Dropout, Executor, F64Executor, HostTensor, LossTerms, Noise, Rope,
    RopeScaling, Shape, SoftCap, TensorHandle,
};
use proptest::prelude::*;

fn both() -> Vec<&'static GpuExecutor> {
    [gpu(), gpu_small_bindings()].into_iter().flatten().collect()
}

fn up(g: &GpuExecutor, h: &HostTensor) -> megatrain_gpu::GpuTensor {
    g.upload(h).unwrap()
}

macro_rules! cpu_up {
    ($c:expr, $h:expr) => {
        $c.upload($h).unwrap()
    };
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10))]

    #[test]
    fn elementwise_and_activations(rows in 1usize..40, cols in 1usize..70, seed in any::<u64>()) {
        let c = cpu();
        let x = rand_host(seed, &[rows, cols]);
        let y = rand_host(seed ^ 9, &[rows, cols]);
        let dy = rand_host(seed ^ 7, &[rows, cols]);
        let (cx, cy, cdy) = (cpu_up!(c, &x), cpu_up!(c, &y), cpu_up!(c, &dy));
        // The sizes of the terms the gelus' results are differences of
        // (x·(1 + tanh) cancels at large negative x): ½‖x4‖ of gelu(x4),
        // ‖dy‖ of its backward, ½‖x4∘y‖ and ‖dy∘y‖ of GeGLU's.
        let (xs, ys, dys) = (x.to_f32_vec(), y.to_f32_vec(), dy.to_f32_vec());
        let ones = vec![1.0f32; xs.len()];
        let gelu_terms = product_norm(&xs, &ones, 3.0);
        let grad_terms = product_norm(&dys, &ones, 1.0);
        let geglu_terms = product_norm(&xs, &ys, 3.0);
        let geglu_grad_terms = product_norm(&dys, &ys, 1.0);
        for g in both() {
            let (gx, gy, gdy) = (up(g, &x), up(g, &y), up(g, &dy));
            assert_close("add", &down(g, &g.add(&gx, &gy).unwrap()), &down_cpu(&c, &c.add(&cx, &cy).unwrap()), TOL_F32);
            assert_close("scale", &down(g, &g.scale(&gx, -1.7).unwrap()), &down_cpu(&c, &c.scale(&cx, -1.7).unwrap()), TOL_F32);
            let mut acc = up(g, &y);
            g.add_assign(&mut acc, &gx).unwrap();
            assert_close("add_assign", &down(g, &acc), &down_cpu(&c, &c.add(&cx, &cy).unwrap()), TOL_F32);
            // Scaled so that gelu/silu see their tails too.
            let gx4 = g.scale(&gx, 6.0).unwrap();
            let cx4 = c.scale(&cx, 6.0).unwrap();
            assert_close_terms("gelu", &down(g, &g.gelu(&gx4).unwrap()), &down_cpu(&c, &c.gelu(&cx4).unwrap()),
                gelu_terms, TOL_F32);
            assert_close_terms("gelu_backward", &down(g, &g.gelu_backward(&gx4, &gdy).unwrap()),
                &down_cpu(&c, &c.gelu_backward(&cx4, &cdy).unwrap()), grad_terms, TOL_F32);
            assert_close_terms("gelu_erf", &down(g, &g.gelu_erf(&gx4).unwrap()), &down_cpu(&c, &c.gelu_erf(&cx4).unwrap()),
                gelu_terms, TOL_F32);
            assert_close_terms("gelu_erf_backward", &down(g, &g.gelu_erf_backward(&gx4, &gdy).unwrap()),
                &down_cpu(&c, &c.gelu_erf_backward(&cx4, &cdy).unwrap()), grad_terms, TOL_F32);
            assert_close("swiglu", &down(g, &g.swiglu(&gx4, &gy).unwrap()), &down_cpu(&c, &c.swiglu(&cx4, &cy).unwrap()), TOL_F32);
            let (dg, du) = g.swiglu_backward(&gx4, &gy, &gdy).unwrap();
            let (rg, ru) = c.swiglu_backward(&cx4, &cy, &cdy).unwrap();
            assert_close("swiglu dgate", &down(g, &dg), &down_cpu(&c, &rg), TOL_F32);
            assert_close("swiglu dup", &down(g, &du), &down_cpu(&c, &ru), TOL_F32);
            assert_close_terms("geglu", &down(g, &g.geglu(&gx4, &gy).unwrap()), &down_cpu(&c, &c.geglu(&cx4, &cy).unwrap()),
                geglu_terms, TOL_F32);
            let (dg, du) = g.geglu_backward(&gx4, &gy, &gdy).unwrap();
            let (rg, ru) = c.geglu_backward(&cx4, &cy, &cdy).unwrap();
            assert_close_terms("geglu dgate", &down(g, &dg), &down_cpu(&c, &rg), geglu_grad_terms, TOL_F32);
            // dup = dy·gelu(g): gelu's terms times dy's.
            assert_close_terms("geglu dup", &down(g, &du), &down_cpu(&c, &ru),
                product_norm(&xs, &dys, 3.0), TOL_F32);
            assert_close("add_scalar", &down(g, &g.add_scalar(&gx, 1.25).unwrap()), &down_cpu(&c, &c.add_scalar(&cx, 1.25).unwrap()), TOL_F32);
            // A cap of 2 bends most of x4 (to ±6) and saturates its tails.
            let cap = SoftCap::new(2.0, "test").unwrap();
            let (gs, cs) = (g.softcap(gx4.clone(), cap).unwrap(), c.softcap(cx4.clone(), cap).unwrap());
            assert_close("softcap", &down(g, &gs), &down_cpu(&c, &cs), TOL_F32);
            assert_close("softcap_backward", &down(g, &g.softcap_backward(&gs, gdy.clone(), cap).unwrap()),
                &down_cpu(&c, &c.softcap_backward(&cs, cdy.clone(), cap).unwrap()), TOL_F32);
        }
    }

    #[test]
    fn layout_ops(rows in 1usize..30, a in 1usize..20, b in 1usize..20, seed in any::<u64>()) {
        let c = cpu();
        let x = rand_host(seed, &[rows, a + b + 3]);
        let cx = cpu_up!(c, &x);
        for g in both() {
            let gx = up(g, &x);
            let gp = g.split_last(&gx, &[a, b, 3]).unwrap();
            let cp = c.split_last(&cx, &[a, b, 3]).unwrap();
            for (p, q) in gp.iter().zip(&cp) {
                assert_close("split_last", &down(g, p), &down_cpu(&c, q), 0.0);
            }
            let cat = g.concat_last(&[&gp[2], &gp[0], &gp[1]]).unwrap();
            let ccat = c.concat_last(&[&cp[2], &cp[0], &cp[1]]).unwrap();
            assert_close("concat_last", &down(g, &cat), &down_cpu(&c, &ccat), 0.0);
            let start = rows / 3;
            let len = rows - start;
            let s = g.slice_rows(&gx, start, len).unwrap();
            assert_close("slice_rows", &down(g, &s), &down_cpu(&c, &c.slice_rows(&cx, start, len).unwrap()), 0.0);
            // write_rows into a reshaped alias must not show through the original.
            let mut dst = g.reshape(&gx, &Shape::new([rows, a + b + 3])).unwrap();
            let before = down(g, &gx);
            let src = g.scale(&s, 2.0).unwrap();
            g.write_rows(&mut dst, start, &src).unwrap();
            let mut cdst = c.upload(&x).unwrap();
            c.write_rows(&mut cdst, start, &c.scale(&c.slice_rows(&cx, start, len).unwrap(), 2.0).unwrap()).unwrap();
            assert_close("write_rows", &down(g, &dst), &down_cpu(&c, &cdst), 0.0);
            assert_eq!(down(g, &gx), before, "in-place write leaked into a shared buffer");
        }
    }

    #[test]
    fn norms(rows in 1usize..20, cols in 1usize..300, seed in any::<u64>()) {
        let c = cpu();
        let x = rand_host(seed, &[rows, cols]);
        let w = rand_host(seed ^ 1, &[cols]);
        let b = rand_host(seed ^ 2, &[cols]);
        let dy = rand_host(seed ^ 3, &[rows, cols]);
        let (cx, cw, cb, cdy) = (cpu_up!(c, &x), cpu_up!(c, &w), cpu_up!(c, &b), cpu_up!(c, &dy));
        let f = F64Executor::new();
        let (fx, fw, fb, fdy) = (cpu_up!(f, &x), cpu_up!(f, &w), cpu_up!(f, &b), cpu_up!(f, &dy));
        let down_f = |t: &<F64Executor as Executor>::Tensor| f.download(t).unwrap().to_f32_vec();
        let fr = f.rmsnorm(&fx, &fw, 1e-5).unwrap();
        let rms_dx = down_f(&f.rmsnorm_backward(&fx, &fw, &fr.rstd, &fdy).unwrap().dx);
        let fl = f.layernorm(&fx, &fw, &fb, 1e-5).unwrap();
        let ln_dx = down_f(&f.layernorm_backward(&fx, &fw, fl.mean.as_ref().unwrap(), &fl.rstd, &fdy).unwrap().dx);
        let (rms_rstd, ln_rstd) = (down_f(&fr.rstd), down_f(&fl.rstd));
        let (wh, dyh) = (w.to_f32_vec(), dy.to_f32_vec());
        for g in both() {
            let (gx, gw, gb, gdy) = (up(g, &x), up(g, &w), up(g, &b), up(g, &dy));
            let o = g.rmsnorm(&gx, &gw, 1e-5).unwrap();
            let r = c.rmsnorm(&cx, &cw, 1e-5).unwrap();
            assert_close("rmsnorm y", &down(g, &o.y), &down_cpu(&c, &r.y), TOL_F32);
            assert_close("rmsnorm rstd", &down(g, &o.rstd), &down_cpu(&c, &r.rstd), TOL_F32);
            let gg = g.rmsnorm_backward(&gx, &gw, &o.rstd, &gdy).unwrap();
            let rg = c.rmsnorm_backward(&cx, &cw, &r.rstd, &cdy).unwrap();
            assert_dx_close("rmsnorm dx", &down(g, &gg.dx), &rms_dx, &rms_rstd, &wh, &dyh);
            assert_close("rmsnorm dw", &down(g, &gg.dw), &down_cpu(&c, &rg.dw), TOL_F32);

            let o = g.layernorm(&gx, &gw, &gb, 1e-5).unwrap();
            let r = c.layernorm(&cx, &cw, &cb, 1e-5).unwrap();
            assert_close("layernorm y", &down(g, &o.y), &down_cpu(&c, &r.y), TOL_F32);
            assert_close("layernorm mean", &down(g, o.mean.as_ref().unwrap()), &down_cpu(&c, r.mean.as_ref().unwrap()), TOL_F32);
            let gg = g.layernorm_backward(&gx, &gw, o.mean.as_ref().unwrap(), &o.rstd, &gdy).unwrap();
            let rg = c.layernorm_backward(&cx, &cw, r.mean.as_ref().unwrap(), &r.rstd, &cdy).unwrap();
            assert_dx_close("layernorm dx", &down(g, &gg.dx), &ln_dx, &ln_rstd, &wh, &dyh);
            assert_close("layernorm dw", &down(g, &gg.dw), &down_cpu(&c, &rg.dw), TOL_F32);
            assert_close("layernorm db", &down(g, gg.db.as_ref().unwrap()), &down_cpu(&c, rg.db.as_ref().unwrap()), TOL_F32);
        }
    }

    #[test]
    fn rope_both_ways(b in 1usize..3, t in 1usize..20, h in 1usize..4, half in 1usize..12,
                      pass in 0usize..4, interleaved in any::<bool>(), offset in 0usize..3000,
                      seed in any::<u64>()) {
        let c = cpu();
        // `pass` entries after the rotated ones go through unrotated.
        let x = rand_host(seed, &[b, t, h, 2 * half + pass]);
        let rope = Rope { rotary_dim: (pass > 0).then_some(2 * half), interleaved, ..Rope::plain(10000.0, offset) };
        let cx = cpu_up!(c, &x);
        for g in both() {
            let gx = up(g, &x);
            assert_close("rope", &down(g, &g.rope(&gx, rope.clone()).unwrap()), &down_cpu(&c, &c.rope(&cx, rope.clone()).unwrap()), TOL_F32);
            assert_close("rope_backward", &down(g, &g.rope_backward(&gx, rope.clone()).unwrap()),
                &down_cpu(&c, &c.rope_backward(&cx, rope.clone()).unwrap()), TOL_F32);
        }
    }

    #[test]
    fn rope_within_packed_documents(b in 1usize..4, t in 1usize..24, h in 1usize..3, half in 1usize..8,
                                    pass in 0usize..3, interleaved in any::<bool>(), offset in 0usize..3000,
                                    seed in any::<u64>()) {
        let c = cpu();
        let x = rand_host(seed, &[b, t, h, 2 * half + pass]);
        let rope = Rope { rotary_dim: (pass > 0).then_some(2 * half), interleaved, ..Rope::plain(10000.0, offset) }
            .with_docs(Some(random_docs(seed ^ 5, b, t)));
        let cx = cpu_up!(c, &x);
        for g in both() {
            let gx = up(g, &x);
            assert_close("rope", &down(g, &g.rope(&gx, rope.clone()).unwrap()), &down_cpu(&c, &c.rope(&cx, rope.clone()).unwrap()), TOL_F32);
            assert_close("rope_backward", &down(g, &g.rope_backward(&gx, rope.clone()).unwrap()),
                &down_cpu(&c, &c.rope_backward(&cx, rope.clone()).unwrap()), TOL_F32);
        }
    }

    #[test]
    fn attention_gqa(b in 1usize..3, t in 1usize..80, hkv in 1usize..3, group in 1usize..4,
                     d in prop::sample::select(vec![1usize, 4, 7, 16, 32, 64]),
                     window in prop::sample::select(vec![0usize, 0, 1, 3, 17, 70]),
                     cap in prop::sample::select(vec![0.0f32, 0.0, 0.4, 50.0]), seed in any::<u64>()) {
        let c = cpu();
        let hq = hkv * group;
        let mask = if window == 0 { AttnMask::CAUSAL } else { AttnMask::sliding(window) };
        let mask = if cap > 0.0 { mask.with_softcap(SoftCap::new(cap, "test").unwrap()) } else { mask };
        let q = rand_host(seed, &[b, t, hq, d]);
        let k = rand_host(seed ^ 1, &[b, t, hkv, d]);
        let v = rand_host(seed ^ 2, &[b, t, hkv, d]);
        let dout = rand_host(seed ^ 3, &[b, t, hq, d]);
        let (cq, ck, cv, cd) = (cpu_up!(c, &q), cpu_up!(c, &k), cpu_up!(c, &v), cpu_up!(c, &dout));
        let r = c.attention(&cq, &ck, &cv, mask.clone()).unwrap();
        let rg = c.attention_backward(&cq, &ck, &cv, &r, &cd).unwrap();
        let gs: Vec<&GpuExecutor> = if t * hq * d * 4 + 256 <= 4096 { both() } else { gpu().into_iter().collect() };
        for g in gs {
            let (gq, gk, gv, gd) = (up(g, &q), up(g, &k), up(g, &v), up(g, &dout));
            let o = g.attention(&gq, &gk, &gv, mask.clone()).unwrap();
            assert_close("attention out", &down(g, &o.out), &down_cpu(&c, &r.out), TOL_F32);
            assert_close("attention lse", &down(g, &o.lse), &down_cpu(&c, &r.lse), TOL_F32);
            let gg = g.attention_backward(&gq, &gk, &gv, &o, &gd).unwrap();
            assert_close("attention dq", &down(g, &gg.dq), &down_cpu(&c, &rg.dq), TOL_F32);
            assert_close("attention dk", &down(g, &gg.dk), &down_cpu(&c, &rg.dk), TOL_F32);
            assert_close("attention dv", &down(g, &gg.dv), &down_cpu(&c, &rg.dv), TOL_F32);
        }
    }

    #[test]
    fn embedding_gather_scatter(v in 1usize..60, cols in 1usize..40, n in 0usize..50, seed in any::<u64>()) {
        let c = cpu();
        let table = rand_host(seed, &[v, cols]);
        let dout = rand_host(seed ^ 1, &[n, cols]);
        let dtable0 = rand_host(seed ^ 2, &[v, cols]);
        // Few distinct ids so that repeats (the racy case) are common.
        let ids: Vec<u32> = (0..n).map(|i| ((seed >> (i % 32)) as usize % v.min(5)) as u32).collect();
        let (ct, cdo) = (cpu_up!(c, &table), cpu_up!(c, &dout));
        let want = down_cpu(&c, &c.embedding(&ids, &ct).unwrap());
        let mut cdt = cpu_up!(c, &dtable0);
        c.embedding_backward(&ids, &cdo, &mut cdt).unwrap();
        for g in both() {
            let gt = up(g, &table);
            assert_close("embedding", &down(g, &g.embedding(&ids, &gt).unwrap()), &want, 0.0);
            let t16 = table.to_dtype(DType::BF16);
            let want16 = down_cpu(&c, &c.embedding(&ids, &cpu_up!(c, &t16.to_dtype(DType::F32))).unwrap());
            assert_close("embedding bf16", &down(g, &g.embedding(&ids, &up(g, &t16)).unwrap()), &want16, 0.0);
            let th = table.to_dtype(DType::F16);
            let wanth = down_cpu(&c, &c.embedding(&ids, &cpu_up!(c, &th.to_dtype(DType::F32))).unwrap());
            assert_close("embedding f16", &down(g, &g.embedding(&ids, &up(g, &th)).unwrap()), &wanth, 0.0);
            let mut gdt = up(g, &dtable0);
            g.embedding_backward(&ids, &up(g, &dout), &mut gdt).unwrap();
            assert_close("embedding_backward", &down(g, &gdt), &down_cpu(&c, &cdt), TOL_F32);
            prop_assert!(g.embedding(&[v as u32], &gt).is_err());
        }
    }

    #[test]
    fn cross_entropy_rows(n in 1usize..30, v in 2usize..600, seed in any::<u64>()) {
        let c = cpu();
        let logits = rand_host(seed, &[n, v]);
        let targets: Vec<i32> = (0..n).map(|i| if i % 4 == 3 { -100 } else { ((seed >> (i % 40)) % v as u64) as i32 }).collect();
        let cl = cpu_up!(c, &logits);
        let scale = 1.0 / n as f32;
        // Plain, PaLM's z-loss, a large one, label smoothing alone and
        // beside a z-loss.
        for terms in [
            LossTerms::NONE,
            LossTerms::z(1e-4),
            LossTerms::z(0.05),
            LossTerms::smoothing(0.1),
            LossTerms { z_loss: 1e-4, label_smoothing: 0.3 },
        ] {
            let r = c.cross_entropy(&c.scale(&cl, 8.0).unwrap(), &targets, -100, scale, terms).unwrap();
            for g in both() {
                let gl = g.scale(&up(g, &logits), 8.0).unwrap();
                let o = g.cross_entropy(&gl, &targets, -100, scale, terms).unwrap();
                assert_close("ce losses", &down(g, &o.losses), &down_cpu(&c, &r.losses), TOL_F32);
                assert_close("ce dlogits", &down(g, &o.dlogits), &down_cpu(&c, &r.dlogits), TOL_F32);
                for (what, got, want, on) in [
                    ("ce z losses", &o.z_losses, &r.z_losses, terms.z_loss > 0.0),
                    ("ce uniform losses", &o.uniform_losses, &r.uniform_losses, terms.label_smoothing > 0.0),
                ] {
                    match (got, want) {
                        (Some(gz), Some(cz)) => assert_close(what, &down(g, gz), &down_cpu(&c, cz), TOL_F32),
                        (None, None) => prop_assert!(!on),
                        _ => prop_assert!(false, "{what} on one executor only"),
                    }
                }
                prop_assert!(g.cross_entropy(&gl, &vec![v as i32; n], -100, scale, terms).is_err());
            }
        }
        for g in both() {
            let gl = up(g, &logits);
            prop_assert!(g.cross_entropy(&gl, &targets, -100, scale, LossTerms::z(-1e-3)).is_err());
            prop_assert!(g.cross_entropy(&gl, &targets, -100, scale, LossTerms::smoothing(1.5)).is_err());
        }
    }
}

/// RoPE's angle tables are built once per (θ, scaling, D) and grown when a call
/// reaches past them: every call gives the CPU's rotation (on a fresh
/// executor, so the first call builds), and a warm call records only its
/// dispatch — no queue write, so nothing forces the pending batch out.
/// Rope within packed documents of rows longer than the first table's 256
/// positions, from offset 0 and 5000, half-split and interleaved, with a
/// partial rotary dimension: every token turned by its position in its
/// document (which no turn by its position in the row matches).
#[test]
fn rope_within_packed_documents_of_long_rows() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let x = rand_host(7, &[2, 300, 2, 16]);
    let docs = packed(300, &[&[0, 1, 100, 299], &[0, 150]]);
    let (cx, gx) = (cpu_up!(c, &x), up(g, &x));
    for (offset, interleaved) in [(0, false), (5000, false), (3, true)] {
        let plain = Rope {
            rotary_dim: Some(12),
            interleaved,
            ..Rope::plain(1e4, offset)
        };
        let rope = plain.clone().with_docs(Some(docs.clone()));
        let got = down(g, &g.rope(&gx, rope.clone()).unwrap());
        let what = format!("offset {offset}, interleaved {interleaved}");
        assert_close(
            &format!("rope, {what}"),
            &got,
            &down_cpu(&c, &c.rope(&cx, rope.clone()).unwrap()),
            TOL_F32,
        );
        assert_close(
            &format!("rope_backward, {what}"),
            &down(g, &g.rope_backward(&gx, rope.clone()).unwrap()),
            &down_cpu(&c, &c.rope_backward(&cx, rope).unwrap()),
            TOL_F32,
        );
        assert_ne!(
            got,
            down(g, &g.rope(&gx, plain).unwrap()),
            "{what}: the documents changed nothing"
        );
    }
    // Warm rounds with the same documents and with equal ones built anew
    // (a step's every layer, forward and backward) cost the host what
    // rounds without documents do: no submission forced by a queue write,
    // no allocation (that equal documents reuse the bounds uploaded for
    // the first: exec/docs.rs).
    let again = packed(300, &[&[0, 1, 100, 299], &[0, 150]]);
    let counted = |docs: [Option<&Docs>; 2]| {
        let g = GpuExecutor::with_options(
            g.context().clone(),
            GpuOptions {
                poison_outputs: true,
                ..Default::default()
            },
        );
        let gx = up(&g, &x);
        let round = |i: usize| {
            let rope = Rope::plain(1e4, 17).with_docs(docs[i % 2].cloned());
            g.rope_backward(&g.rope(&gx, rope.clone()).unwrap(), rope)
                .unwrap()
        };
        // Three rounds warm the pool and the tables.
        for i in 0..3 {
            round(i);
        }
        let before = g.host_work();
        let back = (0..4).map(round).last().unwrap();
        let work = g.host_work() - before;
        assert_close(
            "rope round trip",
            &down(&g, &back),
            x.to_f32_vec().as_slice(),
            1e-6,
        );
        (
            work.submit.ops,
            work.submit.op_submissions,
            work.submit.transfer_submissions,
            work.device_allocations,
        )
    };
    assert_eq!(counted([Some(&docs), Some(&again)]), counted([None, None]));
}

#[test]
fn rope_tables_are_kept_grown_and_shared() {
    let Some(ctx) = ctx() else { return };
    let c = cpu();
    for g in [
        GpuExecutor::new(ctx.clone()),
        GpuExecutor::with_options(
            ctx.clone(),
            megatrain_gpu::GpuOptions {
                max_binding_bytes: Some(4096),
                ..Default::default()
            },
        ),
    ] {
        let x = rand_host(3, &[2, 19, 3, 14]);
        let y = rand_host(4, &[1, 19, 2, 8]);
        let (gx, gy, cx, cy) = (up(&g, &x), up(&g, &y), cpu_up!(c, &x), cpu_up!(c, &y));
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 64.0,
        };
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_positions: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 1.1386,
        };
        let long_rope = RopeScaling::LongRope {
            short: vec![1.0, 1.2, 1.5, 1.9, 2.4, 3.0, 3.7].into(),
            long: vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0].into(),
            original_max_positions: 64.0,
            attention_factor: 1.3,
        };
        // Past the first table, back inside it, another θ, another D, far
        // past, then the same θ with each scaling (tables of their own);
        // each whole and rotating only 6 entries of the heads of 14 and 8
        // (tables of a 6-wide head, the rest passed through), in halves and
        // in neighbouring pairs (GLM's).

        for case in [
            (0, 1e4, RopeScaling::None),
            (5000, 1e4, RopeScaling::None),
            (3, 1e4, RopeScaling::None),
            (7, 5e5, RopeScaling::None),
            (40_000, 1e4, RopeScaling::None),
            (7, 1e4, llama3),
            (7, 1e4, yarn),
            (7, 1e4, RopeScaling::None),
            (300, 1e4, RopeScaling::Linear { factor: 2.0 }),
            // Short factors (positions end at 26 ≤ 64), long ones, and
            // short ones again (not from the long table).
            (7, 1e4, long_rope.clone()),
            (300, 1e4, long_rope.clone()),
            (7, 1e4, long_rope.clone()),
        ]
        .into_iter()
        .flat_map(|(o, t, s)| {
            [(None, false), (Some(6), false), (Some(6), true)].map(|(r, i)| (o, t, s.clone(), r, i))
        }) {
            let (offset, theta, scaling, rotary_dim, interleaved) = case;
            let rope = Rope {
                theta,
                offset,
                scaling,
                rotary_dim,
                interleaved,
                docs: None,
            };
            for (gt, ct) in [(&gx, &cx), (&gy, &cy)] {
                assert_close(
                    "rope",
                    &down(&g, &g.rope(gt, rope.clone()).unwrap()),
                    &down_cpu(&c, &c.rope(ct, rope.clone()).unwrap()),
                    TOL_F32,
                );
                assert_close(
                    "rope_backward",
                    &down(&g, &g.rope_backward(gt, rope.clone()).unwrap()),
                    &down_cpu(&c, &c.rope_backward(ct, rope.clone()).unwrap()),
                    TOL_F32,
                );
            }
        }
        let rope = Rope::plain(1e4, 17);
        let round = || {
            g.rope_backward(&g.rope(&gx, rope.clone()).unwrap(), rope.clone())
                .unwrap()
        };
        // Two rounds warm the pool to what a round needs beside the last
        // result; the last four are counted.
        let mut back = round();
        let mut before = g.host_work();
        for i in 0..6 {
            if i == 2 {
                before = g.host_work();
            }
            back = round();
        }
        let work = g.host_work() - before;
        assert_eq!(
            (
                work.submit.ops,
                work.submit.op_submissions,
                work.device_allocations
            ),
            (8, 0, 0),
            "{work:?}"
        );
        assert_close(
            "rope round trip",
            &down(&g, &back),
            x.to_f32_vec().as_slice(),
            1e-6,
        );
    }
}

#[test]
fn bf16_upload_round_trips_with_odd_length() {
    let Some(g) = gpu() else { return };
    let h = rand_host(5, &[3, 7]).to_dtype(DType::BF16);
    let t = g.upload(&h).unwrap();
    assert_eq!(g.download(&t).unwrap(), h);
}

#[test]
fn f16_upload_round_trips_with_odd_length() {
    let Some(g) = gpu() else { return };
    let h = rand_host(5, &[3, 7]).to_dtype(DType::F16);
    let t = g.upload(&h).unwrap();
    assert_eq!(g.download(&t).unwrap(), h);
    let mut out = vec![0.0; 21];
    g.download_into(&t, &mut out).unwrap();
    assert_eq!(out, h.to_f32_vec());
}

#[test]
fn zeros_are_zero_and_arena_reuses_buffers() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::new(ctx);
    let z = g.zeros(&Shape::new([5, 9])).unwrap();
    assert!(down(&g, &z).iter().all(|&x| x == 0.0));
    let live = g.memory().live_bytes;
    assert!(live >= 5 * 9 * 4);
    drop(z);
    assert_eq!(g.memory().live_bytes, 0);
    let allocs = g.memory().allocations;
    let z2 = g.zeros(&Shape::new([9, 5])).unwrap();
    assert_eq!(
        g.memory().allocations,
        allocs,
        "same size class must come from the pool"
    );
    assert_eq!(g.memory().peak_bytes, live);
    drop(z2);
    g.trim_pool();
    assert_eq!(g.memory().pooled_bytes, 0);
}

#[test]
fn profile_reports_each_op_kind() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::new(ctx);
    g.set_profiling(true);
    let a = g.upload(&rand_host(1, &[64, 64])).unwrap();
    let y = g.matmul(&a, &a, None, megatrain_tensor::Transpose::NN).unwrap();
    let _ = g.gelu(&y).unwrap();
    let report = g.profile_report();
    assert!(report.contains("matmul") && report.contains("gelu"), "{report}");
    let snap = g.profile().snapshot();
    assert!(snap.iter().all(|(_, t)| t.count >= 1));
    // With timestamps, each op's dispatches are timed too, by kernel.
    if g.timing_source() == megatrain_gpu::TimingSource::GpuTimestamps {
        let kernels = g.profile().kernel_snapshot();
        for op in ["matmul/", "gelu/"] {
            assert!(
                kernels.iter().any(|(k, t)| k.starts_with(op) && t.count >= 1),
                "{kernels:?}"
            );
        }
        // An op of clears alone is bracketed by passes of its own and timed
        // on the device as well, not by the wall clock around its submit.
        g.profile().clear();
        let _z = megatrain_tensor::Executor::zeros(&g, &megatrain_tensor::Shape::new([3584])).unwrap();
        let zeros = |rows: Vec<(String, megatrain_gpu::OpTiming)>| {
            rows.into_iter()
                .find(|(k, _)| k == "zeros/ClearOrCopy")
                .map(|(_, t)| t)
        };
        let k = zeros(g.profile().kernel_snapshot()).expect("zeros timed by kernel");
        let op = g
            .profile()
            .snapshot()
            .into_iter()
            .find(|(o, _)| *o == "zeros")
            .unwrap()
            .1;
        assert_eq!((k.count, k.total_ns), (op.count, op.total_ns));
        let _ = g.matmul(&a, &a, None, megatrain_tensor::Transpose::NN).unwrap();
        // A matmul's rows are named by its M×N×K.
        assert!(
            kernels
                .iter()
                .any(|(k, _)| k.starts_with("matmul/") && k.contains(" 64x64x64 [")),
            "{kernels:?}"
        );
    }
}

/// Attention forward and backward of `g` against the CPU's on random
/// inputs of (B, T, Hq, Hkv, D) drawn from `seed`, causal and in a sliding
/// window of `window` keys.
/// `g`'s adapter running the f32 attention on one thread a row
/// (attention.wgsl) even where subgroup lanes are there.
fn one_row(g: &GpuExecutor) -> GpuExecutor {
    GpuExecutor::with_options(
        g.context().clone(),
        GpuOptions {
            poison_outputs: true,
            one_row_attention: true,
            ..Default::default()
        },
    )
}

fn attention_matches_cpu(
    g: &GpuExecutor,
    (b, t, hq, hkv, d): (usize, usize, usize, usize, usize),
    window: usize,
    seed: u64,
    what: &str,
) {
    for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
        attention_matches_cpu_in(
            g,
            (b, t, hq, hkv, d),
            mask.clone(),
            seed,
            &format!("{what}, {mask:?}"),
        );
    }
}

fn attention_matches_cpu_in(
    g: &GpuExecutor,
    (b, t, hq, hkv, d): (usize, usize, usize, usize, usize),
    mask: AttnMask,
    seed: u64,
    what: &str,
) {
    let c = cpu();
    let q = rand_host(seed, &[b, t, hq, d]);
    let k = rand_host(seed + 1, &[b, t, hkv, d]);
    let v = rand_host(seed + 2, &[b, t, hkv, d]);
    let dout = rand_host(seed + 3, &[b, t, hq, d]);
    let (cq, ck, cv, cd) = (cpu_up!(c, &q), cpu_up!(c, &k), cpu_up!(c, &v), cpu_up!(c, &dout));
    let r = c.attention(&cq, &ck, &cv, mask.clone()).unwrap();
    let rg = c.attention_backward(&cq, &ck, &cv, &r, &cd).unwrap();
    let (gq, gk, gv, gd) = (up(g, &q), up(g, &k), up(g, &v), up(g, &dout));
    let o = g.attention(&gq, &gk, &gv, mask.clone()).unwrap();
    let of = |s: &str| format!("{what}: {s}");
    assert_close(&of("out"), &down(g, &o.out), &down_cpu(&c, &r.out), TOL_F32);
    assert_close(&of("lse"), &down(g, &o.lse), &down_cpu(&c, &r.lse), TOL_F32);
    let gg = g.attention_backward(&gq, &gk, &gv, &o, &gd).unwrap();
    assert_close(&of("dq"), &down(g, &gg.dq), &down_cpu(&c, &rg.dq), TOL_F32);
    assert_close(&of("dk"), &down(g, &gg.dk), &down_cpu(&c, &rg.dk), TOL_F32);
    assert_close(&of("dv"), &down(g, &gg.dv), &down_cpu(&c, &rg.dv), TOL_F32);
}

#[test]
fn attention_head_dims_several_row_blocks() {
    // Each D on both f32 families: a row over four subgroup lanes
    // (attention_lanes.wgsl, D a multiple of 16, where the adapter has
    // subgroups) and one thread per row (attention.wgsl: D = 128 fills the
    // general kernels' register arrays, 48 runs them below it, 32 and 64
    // run the kernels with D compiled in, `ATTN_HEAD_DIMS`). T = 150 spans
    // three 64-row blocks with a ragged last one. (D past 128:
    // `attention_head_dim_256`.)
    let Some(lanes) = gpu() else { return };
    let one_row = one_row(lanes);
    for d in [128, 48, 64, 32] {
        assert!(
            lanes.context().attention_lanes(d),
            "{}: no lanes attention at D = {d}",
            lanes.context().info
        );
    }
    for (family, g) in [("lanes", lanes), ("one row", &one_row)] {
        for d in [128, 48, 64, 32] {
            // A window of 40: the second and third row blocks start on keys
            // inside a tile, and key blocks end their queries early.
            attention_matches_cpu(
                g,
                (1, 150, 4, 2, d),
                40,
                11 + d as u64,
                &format!("{family}, D = {d}"),
            );
        }
        let too_wide = up(g, &rand_host(1, &[1, 2, 1, 257]));
        assert!(
            g.attention(&too_wide, &too_wide, &too_wide, AttnMask::CAUSAL)
                .is_err()
        );
    }
}

/// Dropout of the probabilities on both f32 families and over 4 KiB
/// bindings (each batch chunk's rows counted from the mask's first batch
/// row), causal, in a window, within packed documents and soft-capped: the
/// CPU's mask, forward and backward; and it drops something.
#[test]
fn attention_dropout_matches_cpu() {
    let Some(lanes) = gpu() else { return };
    let one_row = one_row(lanes);
    let mut families = vec![("lanes", lanes), ("one row", &one_row)];
    let drop = |p: f64, batch0: usize| {
        Dropout::new(p, 0xabad_cafe_f00d, "test")
            .unwrap()
            .map(|d| d.at_batch_row(batch0))
    };
    let cap = SoftCap::new(2.0, "test").unwrap();
    // The last shape's batch rows (896 bytes of q) come 4 to a 4 KiB
    // binding: its second chunk starts at batch row 4.
    let shapes = [
        ((3, 37, 4, 2, 32), 901),
        ((2, 70, 2, 1, 48), 902),
        ((6, 7, 2, 1, 16), 903),
    ];
    for (n, (shape, seed)) in shapes.into_iter().enumerate() {
        if n == 2 {
            families.extend(gpu_small_bindings().map(|s| ("4 KiB bindings", s)));
        }
        let docs = random_docs(seed, shape.0, shape.1);
        let masks = [
            AttnMask::CAUSAL.with_dropout(drop(0.2, 0)),
            AttnMask::sliding(9).with_dropout(drop(0.5, 5)),
            AttnMask::CAUSAL.with_docs(Some(docs)).with_dropout(drop(0.1, 1)),
            AttnMask::CAUSAL.with_softcap(cap).with_dropout(drop(0.3, 2)),
        ];
        for (family, g) in &families {
            for mask in &masks {
                attention_matches_cpu_in(
                    g,
                    shape,
                    mask.clone(),
                    seed,
                    &format!("{family}, {shape:?}, {mask:?}"),
                );
            }
        }
        let c = cpu();
        let q = cpu_up!(c, &rand_host(seed, &[shape.0, shape.1, shape.2, shape.4]));
        let k = cpu_up!(c, &rand_host(seed + 1, &[shape.0, shape.1, shape.3, shape.4]));
        let v = cpu_up!(c, &rand_host(seed + 2, &[shape.0, shape.1, shape.3, shape.4]));
        let plain = down_cpu(&c, &c.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap().out);
        let dropped = c.attention(&q, &k, &v, masks[0].clone()).unwrap();
        let kept = c.attention(&q, &k, &v, AttnMask::CAUSAL).unwrap();
        assert!(
            megatrain_tensor::testing::rel_norm_err(&down_cpu(&c, &dropped.out), &plain) > 0.05,
            "{shape:?}: nothing dropped"
        );
        // The log-sum-exp is of every probability, kept or dropped.
        assert_eq!(down_cpu(&c, &dropped.lse), down_cpu(&c, &kept.lse));
    }
}

/// Head dimension 256 (Gemma 2's and 3's): past the lanes kernels' 128, on
/// the one-row kernels' wide variants (DM = 256 on tiles of 8 keys and 4
/// queries), D = 256 compiled in and the general ones reading D from the
/// parameters (200, 129). Gemma 3 1B's four query heads on one kv head at
/// T = 37 (a partial key tile and row block; windows of 5 keys, inside a
/// tile and across two), T = 1, and two batches of T = 70 (a second row
/// block starting inside a window of 20); each causal and in its window.
#[test]
fn attention_head_dim_256() {
    let Some(g) = gpu() else { return };
    assert!(!g.context().attention_lanes(256));
    for (shape, window, seed) in [
        ((1, 37, 4, 1, 256), 5, 101),
        ((1, 1, 4, 1, 256), 1, 102),
        ((2, 70, 2, 1, 256), 20, 103),
        ((1, 37, 4, 1, 200), 9, 104),
        ((1, 19, 2, 2, 129), 3, 105),
    ] {
        let start = std::time::Instant::now();
        attention_matches_cpu(g, shape, window, seed, &format!("{shape:?}"));
        eprintln!("{shape:?}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// D = 256 split into ranges of the wide tiles' 8 keys (forward, dq) and
/// 4 queries (dk/dv) by a small loop budget, as on llvmpipe at long T.
#[test]
fn attention_head_dim_256_split_under_a_small_loop_budget() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            loop_budget: Some(2000),
            ..Default::default()
        },
    );
    attention_matches_cpu(&g, (1, 37, 4, 1, 256), 11, 111, "D = 256 in ranges");
}

/// Soft-capped scores (Gemma 2's `attn_logit_softcapping`) on the one-row
/// kernels of every head-dimension variant (lanes kernels off): D = 16
/// (`Any`), 64 (compiled in), 256 (compiled in, wide tiles) and 200
/// (`AnyWide`); GQA, a partial key tile and row block (T = 37, 70), causal
/// and in a window. Inputs in [−1, 1] give scores of about ±1/3 (±1 at
/// most for these D), so caps of 0.3 and 1 bend most of them and saturate
/// some, and Gemma 2's 50 barely any.
#[test]
fn attention_soft_capped_head_dims() {
    let Some(ctx) = ctx() else { return };
    let g = &GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            one_row_attention: true,
            ..Default::default()
        },
    );
    let cap = |c: f32| SoftCap::new(c, "test").unwrap();
    for (shape, window, caps, seed) in [
        ((2, 37, 4, 2, 16), 5, [0.3, 50.0], 301),
        ((1, 70, 4, 1, 64), 20, [1.0, 50.0], 302),
        ((1, 37, 4, 1, 256), 9, [0.3, 50.0], 303),
        ((1, 37, 2, 1, 200), 9, [0.5, 1.0], 304),
    ] {
        let start = std::time::Instant::now();
        for c in caps {
            for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
                let mask = mask.with_softcap(cap(c));
                attention_matches_cpu_in(g, shape, mask.clone(), seed, &format!("{shape:?}, {mask:?}"));
            }
        }
        eprintln!("{shape:?}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Soft-capped scores on the lanes kernels (attention_lanes.wgsl, D a
/// multiple of 16 up to 128, which the default executor runs them at):
/// D = 16 with GQA, 64, and Gemma 2 27B's 128 over several row blocks
/// (T = 70, 150), causal and in a window, at caps of 0.5 (most scores bent)
/// and Gemma 2's 50, forward and backward against the CPU.
#[test]
fn attention_soft_capped_lanes() {
    let Some(g) = gpu() else { return };
    let cap = |c: f32| SoftCap::new(c, "test").unwrap();
    for (shape, window, seed) in [
        ((2, 37, 4, 2, 16), 5, 321),
        ((1, 70, 4, 1, 64), 20, 322),
        ((1, 150, 2, 1, 128), 40, 323),
    ] {
        assert!(
            g.context().attention_lanes(shape.4),
            "{}: no lanes attention at D = {}",
            g.context().info,
            shape.4
        );
        let start = std::time::Instant::now();
        for c in [0.5, 50.0] {
            for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
                let mask = mask.with_softcap(cap(c));
                attention_matches_cpu_in(
                    g,
                    shape,
                    mask.clone(),
                    seed,
                    &format!("lanes, {shape:?}, {mask:?}"),
                );
            }
        }
        eprintln!("lanes {shape:?}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Soft-capped scores split into key and query ranges by a small loop
/// budget (the cap carried through every dispatch): D = 256 on the wide
/// tiles and D = 24 on the narrow ones, and the lanes kernels at D = 32
/// (a budget of 100 cuts T = 100 into ranges of 16, as in
/// `work_split_under_a_small_loop_budget`).
#[test]
fn attention_soft_capped_split_under_a_small_loop_budget() {
    let Some(ctx) = ctx() else { return };
    let with_budget = |budget: usize| {
        GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                poison_outputs: true,
                loop_budget: Some(budget),
                ..Default::default()
            },
        )
    };
    let (g, lanes) = (with_budget(2000), with_budget(100));
    assert!(lanes.context().attention_lanes(32));
    let cap = SoftCap::new(0.5, "test").unwrap();
    for (g, shape, window, seed) in [
        (&g, (1, 37, 4, 1, 256), 11, 311),
        (&g, (2, 70, 4, 2, 24), 37, 312),
        (&lanes, (2, 100, 4, 2, 32), 37, 313),
    ] {
        for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
            let mask = mask.with_softcap(cap);
            attention_matches_cpu_in(
                g,
                shape,
                mask.clone(),
                seed,
                &format!("{shape:?} in ranges, {mask:?}"),
            );
        }
    }
}

/// Documents packed in a batch's rows, row b's beginning at `starts[b]`.
fn packed(t: usize, starts: &[&[usize]]) -> Docs {
    let starts: Vec<Vec<usize>> = starts.iter().map(|s| s.to_vec()).collect();
    Docs::new(t, &starts).unwrap()
}

/// Documents at random places in `b` rows of `t`, about one token in four
/// beginning one (so rows of a single document, and documents of one
/// token, come up).
fn random_docs(seed: u64, b: usize, t: usize) -> Docs {
    let mut s = seed;
    let mut next = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s >> 33
    };
    let starts: Vec<Vec<usize>> = (0..b)
        .map(|_| {
            let mut v = vec![0];
            v.extend((1..t).filter(|_| next() % 4 == 0));
            v
        })
        .collect();
    Docs::new(t, &starts).unwrap()
}

/// Attention within documents packed in the rows, forward and backward
/// against the CPU (which computes each document alone), on both f32
/// families: GQA 4/2 at T = 150, three 64-row blocks. Row 0 holds a
/// one-token document at 0 and 1, one of 68 tokens, one of 79 and a
/// one-token document at the row's end: the last row block's queries
/// (128..) skip the key tiles before 70, and the first key block's keys
/// (..64) every query from 70 on. Row 1 is a single document. Causal, in
/// windows shorter and longer than the documents, and soft-capped.
#[test]
fn attention_within_packed_documents() {
    let Some(lanes) = gpu() else { return };
    let one_row = one_row(lanes);
    let cap = SoftCap::new(0.5, "test").unwrap();
    let docs = packed(150, &[&[0, 1, 2, 70, 149], &[0]]);
    let masks = [
        AttnMask::CAUSAL,
        AttnMask::sliding(5),
        AttnMask::sliding(100),
        AttnMask::CAUSAL.with_softcap(cap),
        AttnMask::sliding(40).with_softcap(cap),
    ];
    for (family, g) in [("lanes", lanes), ("one row", &one_row)] {
        let start = std::time::Instant::now();
        for (i, mask) in masks.iter().enumerate() {
            let mask = mask.clone().with_docs(Some(docs.clone()));
            attention_matches_cpu_in(
                g,
                (2, 150, 4, 2, 32),
                mask.clone(),
                400 + i as u64,
                &format!("{family}, {mask:?}"),
            );
        }
        eprintln!("{family}: {:.1} s", start.elapsed().as_secs_f64());
    }
}

/// Packed documents on every head-dimension variant of the one-row kernels
/// and on the lanes kernels, at shapes no tile divides: T = 37 with GQA 6/2
/// over three rows laid out differently (a one-token document, one of 14,
/// a single document, a one-token document at the end); D = 7 (`Any`),
/// 48 (lanes), 256 (compiled in, the wide tiles of 8 keys and 4 queries)
/// and 200 (`AnyWide`); and batch chunks of one row (bindings of 4 KiB),
/// whose documents are found from the chunk's first row.
#[test]
fn attention_within_packed_documents_head_dims_and_chunks() {
    let Some(ctx) = ctx() else { return };
    let one_row = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            one_row_attention: true,
            ..Default::default()
        },
    );
    let docs37 = packed(37, &[&[0, 5, 6, 20], &[0], &[0, 36]]);
    let docs37b = packed(37, &[&[0, 9, 30]]);
    let lanes = gpu().unwrap();
    for (g, shape, docs, window, seed) in [
        (&one_row, (3, 37, 6, 2, 7), &docs37, 4, 410),
        (lanes, (3, 37, 6, 2, 48), &docs37, 4, 411),
        (&one_row, (1, 37, 4, 1, 256), &docs37b, 11, 412),
        (&one_row, (1, 37, 2, 1, 200), &docs37b, 3, 413),
    ] {
        let start = std::time::Instant::now();
        for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
            let mask = mask.with_docs(Some(docs.clone()));
            attention_matches_cpu_in(g, shape, mask.clone(), seed, &format!("{shape:?}, {mask:?}"));
        }
        eprintln!("{shape:?}: {:.1} s", start.elapsed().as_secs_f64());
    }
    let small = gpu_small_bindings().unwrap();
    let docs = packed(20, &[&[0, 7], &[0], &[0, 1, 19]]);
    for mask in [AttnMask::CAUSAL, AttnMask::sliding(3)] {
        let mask = mask.with_docs(Some(docs.clone()));
        attention_matches_cpu_in(
            small,
            (3, 20, 2, 1, 16),
            mask.clone(),
            414,
            &format!("4 KiB bindings, {mask:?}"),
        );
    }
}

/// Packed documents split into key and query ranges by a small loop
/// budget (r_begin / r_end: a range may hold no key of a row's document,
/// or only some): the lanes kernels at D = 32 in ranges of 16 (T = 100),
/// the one-row kernels at D = 256 and D = 24.
#[test]
fn attention_within_packed_documents_split_under_a_small_loop_budget() {
    let Some(ctx) = ctx() else { return };
    let with_budget = |budget: usize| {
        GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                poison_outputs: true,
                loop_budget: Some(budget),
                ..Default::default()
            },
        )
    };
    let (g, lanes) = (with_budget(2000), with_budget(100));
    for (g, shape, docs, window, seed) in [
        (
            &lanes,
            (2, 100, 4, 2, 32),
            packed(100, &[&[0, 10, 50, 51], &[0, 99]]),
            37,
            420,
        ),
        (&g, (1, 37, 4, 1, 256), packed(37, &[&[0, 9, 30]]), 11, 421),
        (
            &g,
            (2, 70, 4, 2, 24),
            packed(70, &[&[0, 33], &[0, 1, 2, 60]]),
            37,
            422,
        ),
    ] {
        for mask in [AttnMask::CAUSAL, AttnMask::sliding(window)] {
            let mask = mask.with_docs(Some(docs.clone()));
            attention_matches_cpu_in(
                g,
                shape,
                mask.clone(),
                seed,
                &format!("{shape:?} in ranges, {mask:?}"),
            );
        }
    }
}

/// Attention refuses documents of another batch than its own.
#[test]
fn attention_and_rope_refuse_documents_of_another_batch() {
    let Some(g) = gpu() else { return };
    let x = up(g, &rand_host(1, &[2, 5, 1, 4]));
    for docs in [packed(5, &[&[0]]), packed(6, &[&[0], &[0]])] {
        let mask = AttnMask::CAUSAL.with_docs(Some(docs.clone()));
        let e = g.attention(&x, &x, &x, mask).unwrap_err().to_string();
        assert!(e.contains("batch"), "{e}");
        let e = g
            .rope(&x, Rope::plain(1e4, 0).with_docs(Some(docs)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("batch"), "{e}");
    }
}

/// The soft cap on its own, both ways, over more elements than a
/// workgroup's 256 and not a multiple of them, at a cap that bends most
/// of the inputs (scaled to ±6) and at Gemma 2's final-logit 30. Both caps
/// run on clones of the same inputs: an in-place op that wrote through a
/// buffer another handle shares would fail the second.
#[test]
fn softcap_both_ways_past_one_workgroup() {
    let c = cpu();
    let x = rand_host(321, &[7, 211]);
    let dy = rand_host(322, &[7, 211]);
    let (cx, cdy) = (c.scale(&cpu_up!(c, &x), 6.0).unwrap(), cpu_up!(c, &dy));
    for g in both() {
        let (gx, gdy) = (g.scale(&up(g, &x), 6.0).unwrap(), up(g, &dy));
        for cap in [0.5, 30.0] {
            let cap = SoftCap::new(cap, "test").unwrap();
            let (gy, cy) = (
                g.softcap(gx.clone(), cap).unwrap(),
                c.softcap(cx.clone(), cap).unwrap(),
            );
            assert_close(
                &format!("softcap {cap:?}"),
                &down(g, &gy),
                &down_cpu(&c, &cy),
                TOL_F32,
            );
            assert_close(
                &format!("softcap_backward {cap:?}"),
                &down(g, &g.softcap_backward(&gy, gdy.clone(), cap).unwrap()),
                &down_cpu(&c, &c.softcap_backward(&cy, cdy.clone(), cap).unwrap()),
                TOL_F32,
            );
        }
    }
}

/// Shapes for `scale_rows` and `row_dots`: one element, rank 3, rows past
/// a workgroup's 256 columns, more rows than one 4 KiB binding holds, and
/// no rows (or no columns) at all.
const ROW_SHAPES: [&[usize]; 7] = [
    &[1, 1],
    &[3, 5, 7],
    &[37, 129],
    &[2, 300, 67],
    &[5],
    &[0, 5],
    &[2, 0, 4],
];

/// A mixture-of-experts block's routing weights on each row (`scale_rows`,
/// with weights of more digits than f32 holds, zero and negative ones) and
/// their gradient (`row_dots`) against the CPU's; no rows gives an empty
/// result.
#[test]
fn scale_rows_and_row_dots_match_cpu() {
    let c = cpu();
    for (i, &dims) in ROW_SHAPES.iter().enumerate() {
        let seed = 400 + i as u64;
        let (x, y) = (rand_host(seed, dims), rand_host(seed ^ 5, dims));
        let (cx, cy) = (cpu_up!(c, &x), cpu_up!(c, &y));
        let rows = x.shape().numel().checked_div(*dims.last().unwrap()).unwrap_or(0);
        let w: Vec<f64> = (0..rows)
            .map(|r| match r % 5 {
                0 => 1.0 / 3.0,
                1 => 0.0,
                2 => -2.5e-3,
                _ => 1.0 + r as f64 * std::f64::consts::PI,
            })
            .collect();
        let want_s = down_cpu(&c, &c.scale_rows(&cx, &w).unwrap());
        let want_d = c.row_dots(&cx, &cy).unwrap();
        assert_eq!(want_d.dims(), [rows], "{dims:?}");
        let want_d = down_cpu(&c, &want_d);
        for g in both() {
            let (gx, gy) = (up(g, &x), up(g, &y));
            let s = g.scale_rows(&gx, &w).unwrap();
            assert_eq!(s.dims(), dims, "{dims:?}");
            assert_close(&format!("scale_rows {dims:?}"), &down(g, &s), &want_s, 0.0);
            let d = g.row_dots(&gx, &gy).unwrap();
            assert_eq!(d.dims(), [rows], "{dims:?}");
            assert_close(&format!("row_dots {dims:?}"), &down(g, &d), &want_d, TOL_F32);
        }
    }
}

/// Dropout draws the CPU's mask bit for bit (the same hash, the same f32
/// scale), on shapes of every rank it takes, split over 4 KiB bindings too,
/// and counts rows from the batch row it is told; rank 1 is refused.
#[test]
fn dropout_matches_cpu_bit_for_bit() {
    let c = cpu();
    let shapes: [&[usize]; 5] = [&[1, 1], &[3, 5, 7], &[37, 129], &[2, 300, 67], &[2, 3, 4, 5]];
    for (i, &dims) in shapes.iter().enumerate() {
        let x = rand_host(700 + i as u64, dims);
        for (p, batch0) in [(0.1, 0), (0.5, 3), (0.9, 1 << 20)] {
            let d = Dropout::new(p, 0xfeed_0000 + i as u64, "test")
                .unwrap()
                .unwrap()
                .at_batch_row(batch0);
            let want = down_cpu(&c, &c.dropout(&cpu_up!(c, &x), &d).unwrap());
            let zeros = want.iter().filter(|&&v| v == 0.0).count() as f64 / want.len() as f64;
            if want.len() > 1000 {
                assert!((zeros - p).abs() < 0.05, "{dims:?} p {p}: {zeros} zeroed");
            }
            for g in both() {
                let got = down(g, &g.dropout(&up(g, &x), &d).unwrap());
                assert_close(&format!("dropout {dims:?} p {p}"), &got, &want, 0.0);
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dims:?} p {p}"
                );
            }
        }
    }
    let d = Dropout::new(0.5, 1, "test").unwrap().unwrap();
    for g in both() {
        let e = g
            .dropout(&up(g, &rand_host(1, &[5])), &d)
            .unwrap_err()
            .to_string();
        assert!(e.contains("dropout") && e.contains("[B, …, C]"), "{e}");
    }
}

/// Uniform noise (NEFTune's) is the CPU's: the same hash and the same
/// exact u, one product and one sum in f32 (which a driver may fuse into
/// one FMA: a rounding apart at most), on every rank it takes, split over
/// 4 KiB bindings too, rows counted from the batch row it is told; rank 1
/// is refused.
#[test]
fn uniform_noise_matches_cpu() {
    let c = cpu();
    let shapes: [&[usize]; 5] = [&[1, 1], &[3, 5, 7], &[37, 129], &[2, 300, 67], &[2, 3, 4, 5]];
    for (i, &dims) in shapes.iter().enumerate() {
        let x = rand_host(900 + i as u64, dims);
        for (m, batch0) in [(0.01, 0), (0.5, 3), (3.0, 1 << 20)] {
            let n = Noise::new(m, 0xbeef_0000 + i as u64, "test")
                .unwrap()
                .unwrap()
                .at_batch_row(batch0);
            let want = down_cpu(&c, &c.add_noise(&cpu_up!(c, &x), &n).unwrap());
            let xs = x.to_f32_vec();
            let bound = m as f32 * (1.0 + 1e-6) + 1e-6;
            assert!(
                want.iter().zip(&xs).all(|(y, x)| (y - x).abs() <= bound),
                "{dims:?} m {m}"
            );
            for g in both() {
                let got = down(g, &g.add_noise(&up(g, &x), &n).unwrap());
                for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                    let ulp = (b.abs().max(f32::MIN_POSITIVE) * f32::EPSILON).max(m as f32 * f32::EPSILON);
                    assert!(
                        (a - b).abs() <= ulp,
                        "{dims:?} m {m} element {k}: GPU {a}, CPU {b}"
                    );
                }
            }
        }
    }
    let n = Noise::new(0.5, 1, "test").unwrap().unwrap();
    for g in both() {
        let e = g
            .add_noise(&up(g, &rand_host(1, &[5])), &n)
            .unwrap_err()
            .to_string();
        assert!(e.contains("add_noise") && e.contains("[B, …, C]"), "{e}");
    }
}

/// More rows than one grid dimension's 65535 workgroups: `row_dots` runs
/// one workgroup per row on a 2-D grid.
#[test]
fn row_dots_past_one_grid_dimension() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let (x, y) = (rand_host(61, &[65_600, 2]), rand_host(62, &[65_600, 2]));
    let want = down_cpu(&c, &c.row_dots(&cpu_up!(c, &x), &cpu_up!(c, &y)).unwrap());
    let w: Vec<f64> = (0..65_600).map(|r| r as f64 * 1e-3 - 7.0).collect();
    let want_s = down_cpu(&c, &c.scale_rows(&cpu_up!(c, &x), &w).unwrap());
    let (gx, gy) = (up(g, &x), up(g, &y));
    assert_close(
        "row_dots of 65600 rows",
        &down(g, &g.row_dots(&gx, &gy).unwrap()),
        &want,
        TOL_F32,
    );
    assert_close(
        "scale_rows of 65600 rows",
        &down(g, &g.scale_rows(&gx, &w).unwrap()),
        &want_s,
        0.0,
    );
}

/// A weight count that is not the row count, mismatched shapes, a scalar
/// and a non-f32 tensor are errors naming the op, as on the CPU.
#[test]
fn scale_rows_and_row_dots_refuse_bad_shapes() {
    let c = cpu();
    let x = rand_host(1, &[3, 4]);
    let other = rand_host(2, &[4, 3]);
    let scalar = HostTensor::from_f32(Shape::new(Vec::<usize>::new()), vec![1.0]).unwrap();
    let (cx, co, cs) = (cpu_up!(c, &x), cpu_up!(c, &other), cpu_up!(c, &scalar));
    for w in [&[1.0; 2][..], &[1.0; 4], &[], &[1.0; 12]] {
        assert!(c.scale_rows(&cx, w).is_err(), "cpu, {} weights", w.len());
    }
    assert!(c.scale_rows(&cs, &[1.0]).is_err() && c.row_dots(&cs, &cs).is_err());
    assert!(c.row_dots(&cx, &co).is_err());
    for g in both() {
        let (gx, go, gs) = (up(g, &x), up(g, &other), up(g, &scalar));
        for w in [&[1.0; 2][..], &[1.0; 4], &[], &[1.0; 12]] {
            let e = g.scale_rows(&gx, w).expect_err("wrong weight count").to_string();
            assert!(e.contains("scale_rows") && e.contains("[3, 4]"), "{e}");
        }
        let e = g
            .scale_rows(&gs, &[1.0])
            .expect_err("a scalar has no rows")
            .to_string();
        assert!(e.contains("scale_rows"), "{e}");
        let e = g.row_dots(&gx, &go).expect_err("mismatched shapes").to_string();
        assert!(
            e.contains("row_dots") && e.contains("[3, 4]") && e.contains("[4, 3]"),
            "{e}"
        );
        let e = g
            .row_dots(&gs, &gs)
            .expect_err("a scalar has no rows")
            .to_string();
        assert!(e.contains("row_dots"), "{e}");
        let gb = up(g, &x.to_dtype(DType::BF16));
        assert!(g.scale_rows(&gb, &[1.0; 3]).is_err());
        assert!(g.row_dots(&gb, &gx).is_err() && g.row_dots(&gx, &gb).is_err());
    }
}

/// The soft cap's tanh (activation_fns.wgsl's `tanh_precise`) within a few
/// ulps of float64's over [−60, 60], at arguments down to the smallest
/// normal f32 (where a tanh through exp returns 0) and at the largest, and
/// never NaN.
#[test]
fn softcap_tanh_is_within_a_few_ulps_everywhere() {
    let Some(g) = gpu() else { return };
    let mut xs: Vec<f32> = (0..=200_000).map(|i| (i as f32 - 100_000.0) * 6e-4).collect();
    for sign in [1.0f32, -1.0] {
        xs.extend((0..=760).map(|i| sign * 10f32.powf(-37.9 + i as f32 * 0.1)));
        xs.extend([0.625, 0.624_999_94, 0.625_000_06, f32::MAX].map(|x| sign * x));
    }
    let n = xs.len();
    let x = HostTensor::from_f32(Shape::new([n]), xs.clone()).unwrap();
    let y = down(
        g,
        &g.softcap(up(g, &x), SoftCap::new(1.0, "test").unwrap()).unwrap(),
    );
    let worst = xs
        .iter()
        .zip(&y)
        .map(|(&x, &y)| {
            assert!(y.is_finite(), "tanh({x}) = {y}");
            let exact = (x as f64).tanh();
            let ulp = (exact.abs() as f32).max(f32::MIN_POSITIVE) as f64 * f32::EPSILON as f64;
            ((y as f64 - exact).abs() / ulp, x)
        })
        .fold((0.0, 0.0), |w, e| if e.0 > w.0 { e } else { w });
    eprintln!("worst {:.2} ulps at {}", worst.0, worst.1);
    assert!(worst.0 <= 4.0, "tanh({}) {} ulps off", worst.1, worst.0);
}

/// A head dimension past the f32 kernels' 256 is refused by name, forward
/// and backward.
#[test]
fn attention_head_dims_past_256_are_refused() {
    let Some(g) = gpu() else { return };
    for d in [257, 264] {
        let x = up(g, &rand_host(1, &[1, 2, 2, d]));
        let e = g
            .attention(&x, &x, &x, AttnMask::CAUSAL)
            .expect_err("D past 256")
            .to_string();
        assert!(e.contains(&format!("head dim {d}")) && e.contains("256"), "{e}");
        let fwd = megatrain_tensor::AttentionOut {
            out: up(g, &rand_host(2, &[1, 2, 2, d])),
            lse: g.zeros(&Shape::new([1, 2, 2])).unwrap(),
            mask: AttnMask::CAUSAL,
        };
        let e = g
            .attention_backward(&x, &x, &x, &fwd, &x)
            .expect_err("D past 256")
            .to_string();
        assert!(e.contains(&format!("head dim {d}")) && e.contains("256"), "{e}");
    }
}

/// The other ops of a Gemma block on heads of 256: RoPE (θ of its local
/// and global layers, positions far along) both ways, and the per-head
/// RMSNorm of q and k over rows of 256, forward and backward.
#[test]
fn rope_and_head_norm_at_head_dim_256() {
    let c = cpu();
    let f = F64Executor::new();
    let x = rand_host(121, &[2, 37, 4, 256]);
    let w = rand_host(122, &[256]);
    let dy = rand_host(123, &[2, 37, 4, 256]);
    let (cx, cw, cdy) = (cpu_up!(c, &x), cpu_up!(c, &w), cpu_up!(c, &dy));
    let (fx, fw, fdy) = (cpu_up!(f, &x), cpu_up!(f, &w), cpu_up!(f, &dy));
    let down_f = |t: &<F64Executor as Executor>::Tensor| f.download(t).unwrap().to_f32_vec();
    let fr = f.rmsnorm(&fx, &fw, 1e-6).unwrap();
    let exact_dx = down_f(&f.rmsnorm_backward(&fx, &fw, &fr.rstd, &fdy).unwrap().dx);
    let rstd = down_f(&fr.rstd);
    for (i, g) in both().into_iter().enumerate() {
        let (gx, gw, gdy) = (up(g, &x), up(g, &w), up(g, &dy));
        // Not under 4 KiB bindings: a call binds its positions' rows of
        // the angle tables whole (37 × 128 here).
        let ropes = if i == 0 {
            vec![Rope::plain(1e4, 0), Rope::plain(1e6, 3000)]
        } else {
            Vec::new()
        };
        for rope in ropes {
            assert_close(
                "rope, D = 256",
                &down(g, &g.rope(&gx, rope.clone()).unwrap()),
                &down_cpu(&c, &c.rope(&cx, rope.clone()).unwrap()),
                TOL_F32,
            );
            assert_close(
                "rope_backward, D = 256",
                &down(g, &g.rope_backward(&gx, rope.clone()).unwrap()),
                &down_cpu(&c, &c.rope_backward(&cx, rope.clone()).unwrap()),
                TOL_F32,
            );
        }
        let o = g.rmsnorm(&gx, &gw, 1e-6).unwrap();
        let r = c.rmsnorm(&cx, &cw, 1e-6).unwrap();
        assert_close("head rmsnorm y", &down(g, &o.y), &down_cpu(&c, &r.y), TOL_F32);
        assert_close(
            "head rmsnorm rstd",
            &down(g, &o.rstd),
            &down_cpu(&c, &r.rstd),
            TOL_F32,
        );
        let gg = g.rmsnorm_backward(&gx, &gw, &o.rstd, &gdy).unwrap();
        let rg = c.rmsnorm_backward(&cx, &cw, &r.rstd, &cdy).unwrap();
        let (wh, dyh) = (w.to_f32_vec(), dy.to_f32_vec());
        assert_dx_close("head rmsnorm dx", &down(g, &gg.dx), &exact_dx, &rstd, &wh, &dyh);
        assert_close(
            "head rmsnorm dw",
            &down(g, &gg.dw),
            &down_cpu(&c, &rg.dw),
            TOL_F32,
        );
    }
}

#[test]
fn in_place_ops_do_not_leak_through_shared_buffers() {
    let Some(g) = gpu() else { return };
    let x = rand_host(3, &[4, 6]);
    let a = up(g, &x);
    let mut alias = g.reshape(&a, &Shape::new([6, 4])).unwrap();
    g.add_assign(&mut alias, &a).unwrap();
    assert_eq!(down(g, &a), x.to_f32_vec());
    let doubled: Vec<f32> = x.to_f32_vec().iter().map(|v| v * 2.0).collect();
    assert_eq!(down(g, &alias), doubled);
    let mut table = g.reshape(&a, &Shape::new([4, 6])).unwrap();
    g.embedding_backward(&[1, 1], &up(g, &rand_host(4, &[2, 6])), &mut table)
        .unwrap();
    assert_eq!(down(g, &a), x.to_f32_vec());
}

/// Attention (both f32 families), norm and embedding backward split over several dispatches (as
/// on llvmpipe for long sequences), forced here by a tiny loop budget.
#[test]
fn work_split_under_a_small_loop_budget() {
    let Some(ctx) = ctx() else { return };
    let opts = megatrain_gpu::GpuOptions {
        poison_outputs: true,
        loop_budget: Some(2000),
        ..Default::default()
    };
    let g = &GpuExecutor::with_options(ctx, opts);
    let c = cpu();
    attention_matches_cpu(g, (2, 100, 4, 2, 24), 37, 21, "one row, D = 24");
    // A key costs the lanes kernels (D = 32) about one loop iteration, so
    // it takes a smaller budget to split them: 100 cuts T = 100 into key
    // and query ranges of 16.
    let lanes = &GpuExecutor::with_options(
        g.context().clone(),
        megatrain_gpu::GpuOptions {
            poison_outputs: true,
            loop_budget: Some(100),
            ..Default::default()
        },
    );
    assert!(lanes.context().attention_lanes(32));
    attention_matches_cpu(lanes, (2, 100, 4, 2, 32), 37, 25, "lanes, D = 32");

    let rows = 4500;
    let x = rand_host(31, &[rows, 3]);
    let w = rand_host(32, &[3]);
    let dy = rand_host(33, &[rows, 3]);
    let (cx, cw, cdy) = (cpu_up!(c, &x), cpu_up!(c, &w), cpu_up!(c, &dy));
    let (gx, gw, gdy) = (up(g, &x), up(g, &w), up(g, &dy));
    let n = g.rmsnorm(&gx, &gw, 1e-5).unwrap();
    let nr = c.rmsnorm(&cx, &cw, 1e-5).unwrap();
    let gn = g.rmsnorm_backward(&gx, &gw, &n.rstd, &gdy).unwrap();
    let rn = c.rmsnorm_backward(&cx, &cw, &nr.rstd, &cdy).unwrap();
    assert_close(
        "rmsnorm dw over many rows",
        &down(g, &gn.dw),
        &down_cpu(&c, &rn.dw),
        TOL_F32,
    );
    let bw = rand_host(34, &[3, 3]);
    let needs = megatrain_tensor::MatmulNeeds {
        da: false,
        db: false,
        dbias: true,
    };
    let t = megatrain_tensor::Transpose::NN;
    let gm = g.matmul_backward(&gx, &up(g, &bw), &gdy, t, needs).unwrap();
    let cm = c.matmul_backward(&cx, &cpu_up!(c, &bw), &cdy, t, needs).unwrap();
    let (gb, cb) = (gm.dbias.unwrap(), cm.dbias.unwrap());
    // A 4500-term f32 sum of random signs: its rounding error grows with the
    // term count while the result grows only as its square root, so two
    // summation orders differ by ~n·2^-24·Σ|x|/|Σx| ≈ 1e-5 here.
    assert_close(
        "bias gradient over many rows",
        &down(g, &gb),
        &down_cpu(&c, &cb),
        1e-4,
    );
    let ids: Vec<u32> = (0..rows as u32).map(|i| i % 7).collect();
    let mut gt = g.zeros(&Shape::new([7, 3])).unwrap();
    let mut ct = c.zeros(&Shape::new([7, 3])).unwrap();
    g.embedding_backward(&ids, &gdy, &mut gt).unwrap();
    c.embedding_backward(&ids, &cdy, &mut ct).unwrap();
    assert_close(
        "scatter-add of many repeats",
        &down(g, &gt),
        &down_cpu(&c, &ct),
        TOL_F32,
    );
}

#[test]
fn slice_upload_download_into_and_memory_stats() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::new(ctx);
    let h = rand_host(8, &[5, 3]);
    let t = g
        .upload_slice(h.shape(), megatrain_tensor::HostSlice::F32(h.as_f32().unwrap()))
        .unwrap();
    let mut out = vec![0.0; 15];
    g.download_into(&t, &mut out).unwrap();
    assert_eq!(out, h.to_f32_vec());
    let b = h.to_dtype(DType::BF16);
    let bv = match b.data() {
        megatrain_tensor::HostData::BF16(v) => v.clone(),
        _ => unreachable!(),
    };
    let tb = g
        .upload_slice(b.shape(), megatrain_tensor::HostSlice::BF16(&bv))
        .unwrap();
    g.download_into(&tb, &mut out).unwrap();
    assert_eq!(out, b.to_f32_vec());
    assert!(g.download_into(&tb, &mut [0.0; 14]).is_err());
    assert!(
        g.upload_slice(
            &Shape::new([4, 3]),
            megatrain_tensor::HostSlice::F32(h.as_f32().unwrap())
        )
        .is_err()
    );
    let m = Executor::memory_stats(&g).unwrap();
    assert!(m.live_bytes >= 15 * 4 + 15 * 2 && m.peak_bytes >= m.live_bytes);
    drop((t, tb));
    Executor::reset_peak_memory(&g);
    assert_eq!(Executor::memory_stats(&g).unwrap().peak_bytes, 0);
}

/// GPT-OSS's constants, and a limit of 0.5 that clamps most of the inputs.
fn clamped_glus() -> [ClampedGlu; 2] {
    [
        ClampedGlu::new(1.702, 7.0, "test").unwrap(),
        ClampedGlu::new(0.9, 0.5, "test").unwrap(),
    ]
}

/// GPT-OSS's gate/up product `[.., 2F]` over ±10 for `c` (gate and up
/// interleaved), with pairs exactly at its clamps' bounds (gate = limit,
/// up = ±limit, where the gradient passes) and just past them (where it
/// stops). `dims` are the output's.
fn clamped_glu_input(seed: u64, dims: &[usize], c: ClampedGlu) -> HostTensor {
    let l = c.limit as f32;
    let mut gu = rand_host(seed, &[dims.iter().product::<usize>() * 2]).to_f32_vec();
    gu.iter_mut().for_each(|x| *x *= 10.0);
    let edges = [
        (l, l),
        (l.next_up(), -l),
        (-l, l.next_up()),
        (0.25, (-l).next_down()),
    ];
    for (i, &(ge, ue)) in edges.iter().enumerate().take(gu.len() / 2) {
        (gu[2 * i], gu[2 * i + 1]) = (ge, ue);
    }
    let mut wide = dims.to_vec();
    *wide.last_mut().expect("not empty") *= 2;
    HostTensor::from_f32(Shape::new(wide), gu).unwrap()
}

/// The clamped SwiGLU both ways against the CPU's, at both constants: one
/// pair, rank 3, and past a workgroup's 256 outputs and a 4 KiB binding;
/// the bound pairs checked one by one too.
#[test]
fn swiglu_clamped_matches_cpu() {
    let c = cpu();
    for (i, dims) in [&[1][..], &[3, 5, 7], &[7, 311]].into_iter().enumerate() {
        for glu in clamped_glus() {
            let what = |s: &str| format!("{s} {dims:?} {glu:?}");
            let gate_up = clamped_glu_input(700 + i as u64, dims, glu);
            let dy = rand_host(710 + i as u64, dims);
            let (cx, cd) = (cpu_up!(c, &gate_up), cpu_up!(c, &dy));
            let want = down_cpu(&c, &c.swiglu_clamped(&cx, glu).unwrap());
            let wd = down_cpu(&c, &c.swiglu_clamped_backward(&cx, &cd, glu).unwrap());
            for g in both() {
                let (gx, gd) = (up(g, &gate_up), up(g, &dy));
                let yt = g.swiglu_clamped(&gx, glu).unwrap();
                assert_eq!(yt.shape().dims(), dims, "{}", what("output shape"));
                let y = down(g, &yt);
                assert_close(&what("swiglu_clamped"), &y, &want, TOL_F32);
                let d = down(g, &g.swiglu_clamped_backward(&gx, &gd, glu).unwrap());
                assert_close(&what("swiglu_clamped d(gate_up)"), &d, &wd, TOL_F32);
                for e in 0..d.len().min(8) {
                    assert_eq!(
                        d[e] == 0.0,
                        wd[e] == 0.0,
                        "{}: entry {e}",
                        what("gradient stopped")
                    );
                }
                for e in 0..y.len().min(4) {
                    assert!(
                        (y[e] - want[e]).abs() <= 1e-5 * want[e].abs().max(1.0),
                        "{}",
                        what("y at the bounds")
                    );
                }
            }
            if dims.iter().product::<usize>() >= 4 {
                // Gate at the limit and up at ±limit pass the gradient; past them it stops.
                let (g, u) = (|p: usize| wd[2 * p], |p: usize| wd[2 * p + 1]);
                assert!(g(0) != 0.0 && u(0) != 0.0 && u(1) != 0.0, "{}", what("bounds"));
                assert!(
                    g(1) == 0.0 && u(2) == 0.0 && u(3) == 0.0,
                    "{}",
                    what("past the bounds")
                );
            }
        }
    }
}

/// An odd width, a dy of the wrong shape, bf16 inputs and constants built
/// past `ClampedGlu::new` are errors naming the op, as on the CPU.
#[test]
fn swiglu_clamped_refuses_bad_inputs() {
    let [glu, _] = clamped_glus();
    let bad = ClampedGlu {
        alpha: 1.702,
        limit: f64::NAN,
    };
    let (x, odd) = (rand_host(1, &[3, 4]), rand_host(2, &[4, 3]));
    for g in both() {
        let (gx, go) = (up(g, &x), up(g, &odd));
        let e = g.swiglu_clamped(&go, glu).expect_err("odd width").to_string();
        assert!(
            e.contains("swiglu_clamped") && e.contains("[4, 3]") && e.contains("interleaved"),
            "{e}"
        );
        let e = g
            .swiglu_clamped_backward(&gx, &gx, glu)
            .expect_err("dy's shape")
            .to_string();
        assert!(
            e.contains("swiglu_clamped_backward") && e.contains("[3, 2]"),
            "{e}"
        );
        let e = g.swiglu_clamped(&gx, bad).expect_err("NaN limit").to_string();
        assert!(e.contains("swiglu_clamped") && e.contains("NaN"), "{e}");
        let dy = up(g, &rand_host(3, &[3, 2]));
        assert!(g.swiglu_clamped_backward(&gx, &dy, bad).is_err());
        let gb = up(g, &x.to_dtype(DType::BF16));
        assert!(g.swiglu_clamped(&gb, glu).is_err());
        assert!(
            g.swiglu_clamped_backward(&gx, &up(g, &rand_host(3, &[3, 2]).to_dtype(DType::BF16)), glu)
                .is_err()
        );
    }
}

/// Sinks for `hq` heads: σ near 1 (a sink far below the scores), near 0
/// (far above), and between.
fn sink_values(hq: usize) -> Vec<f32> {
    [-30.0, 3.0, -2.0, 0.0, 0.7, 30.0]
        .into_iter()
        .cycle()
        .take(hq)
        .collect()
}

/// The sink ops both ways against the CPU's, on the CPU attention's output
/// and log-sum-exp for (B, T, Hq, D) = (2, 5, 6, 80) (a batch is past a
/// 4 KiB binding: rows of one batch at a time there), T = 1 (whole batches
/// per binding) and a row block's worth of T = 37 at D = 64; then the
/// whole sink attention on the GPU, its attention's output and lse
/// included, against the CPU's.
#[test]
fn attention_sinks_match_cpu() {
    let c = cpu();
    for (i, (b, t, hq, d)) in [(2, 5, 6, 80), (2, 1, 6, 80), (1, 37, 4, 64)]
        .into_iter()
        .enumerate()
    {
        let seed = 800 + 10 * i as u64;
        let q = cpu_up!(c, &rand_host(seed, &[b, t, hq, d]));
        let kv = cpu_up!(c, &rand_host(seed + 1, &[b, t, 2, d]));
        let fw = c.attention(&q, &kv, &kv, AttnMask::CAUSAL).unwrap();
        let (o, lse) = (c.download(&fw.out).unwrap(), c.download(&fw.lse).unwrap());
        let sinks = HostTensor::from_f32(Shape::new([hq]), sink_values(hq)).unwrap();
        let dout = rand_host(seed + 2, &[b, t, hq, d]);
        let cs = cpu_up!(c, &sinks);
        let os = c.attention_sinks(&fw, &cs).unwrap();
        let (dx, ds) = c
            .attention_sinks_backward(&os, &fw.lse, &cs, &cpu_up!(c, &dout))
            .unwrap();
        let (want_os, want_dx, want_ds) = (down_cpu(&c, &os), down_cpu(&c, &dx), down_cpu(&c, &ds));
        for g in both() {
            let what = |s: &str| format!("{s} (B, T, Hq, D) = {:?}", (b, t, hq, d));
            let gfw = megatrain_tensor::AttentionOut {
                out: up(g, &o),
                lse: up(g, &lse),
                mask: AttnMask::CAUSAL,
            };
            let gs = up(g, &sinks);
            let gos = g.attention_sinks(&gfw, &gs).unwrap();
            assert_eq!(gos.dims(), [b, t, hq, d]);
            assert_close(&what("attention_sinks"), &down(g, &gos), &want_os, TOL_F32);
            let (gdx, gds) = g
                .attention_sinks_backward(&gos, &gfw.lse, &gs, &up(g, &dout))
                .unwrap();
            assert_eq!(gds.dims(), [hq]);
            assert_close(&what("sinks' dout"), &down(g, &gdx), &want_dx, TOL_F32);
            assert_close(&what("dsinks"), &down(g, &gds), &want_ds, TOL_F32);
        }
    }
    // End to end on the device: attention, sinks, and back through both.
    let Some(g) = gpu() else { return };
    let (b, t, hq, hkv, d) = (2, 37, 6, 2, 64);
    let (q, k, v) = (
        rand_host(901, &[b, t, hq, d]),
        rand_host(902, &[b, t, hkv, d]),
        rand_host(903, &[b, t, hkv, d]),
    );
    let sinks = HostTensor::from_f32(Shape::new([hq]), sink_values(hq)).unwrap();
    let dout = rand_host(904, &[b, t, hq, d]);
    let run_cpu = {
        let (q, k, v, s, dy) = (
            cpu_up!(c, &q),
            cpu_up!(c, &k),
            cpu_up!(c, &v),
            cpu_up!(c, &sinks),
            cpu_up!(c, &dout),
        );
        let fw = c.attention(&q, &k, &v, AttnMask::sliding(9)).unwrap();
        let fw = megatrain_tensor::AttentionOut {
            out: c.attention_sinks(&fw, &s).unwrap(),
            ..fw
        };
        let (dx, ds) = c.attention_sinks_backward(&fw.out, &fw.lse, &s, &dy).unwrap();
        let gr = c.attention_backward(&q, &k, &v, &fw, &dx).unwrap();
        [&fw.out, &ds, &gr.dq, &gr.dk, &gr.dv].map(|x| down_cpu(&c, x))
    };
    let (gq, gk, gv, gs, gd) = (up(g, &q), up(g, &k), up(g, &v), up(g, &sinks), up(g, &dout));
    let fw = g.attention(&gq, &gk, &gv, AttnMask::sliding(9)).unwrap();
    let fw = megatrain_tensor::AttentionOut {
        out: g.attention_sinks(&fw, &gs).unwrap(),
        ..fw
    };
    let (dx, ds) = g.attention_sinks_backward(&fw.out, &fw.lse, &gs, &gd).unwrap();
    let gr = g.attention_backward(&gq, &gk, &gv, &fw, &dx).unwrap();
    for (name, got, want) in ["out", "dsinks", "dq", "dk", "dv"]
        .into_iter()
        .zip([&fw.out, &ds, &gr.dq, &gr.dk, &gr.dv])
        .zip(&run_cpu)
        .map(|((n, x), w)| (n, down(g, x), w))
    {
        assert_close(&format!("sink attention {name}"), &got, want, TOL_F32);
    }
}

/// More rows (b, t, h) than one grid dimension's 65535 workgroups of 256
/// threads hold, so both kernels run on a 2-D grid: D = 1 keeps it to
/// 64 MiB a tensor. The sinks' gradient, a sum over 262,200 rows, against
/// the f64 executor's (the f32 one's sequential sum is further off).
#[test]
fn attention_sinks_past_one_grid_dimension() {
    let Some(g) = gpu() else { return };
    let (b, t, hq) = (2, 131_100, 64);
    assert!(b * t * hq > 65_535 * 256);
    let f = F64Executor::new();
    let (o, lse) = (rand_host(911, &[b, t, hq, 1]), rand_host(912, &[b, hq, t]));
    let sinks = HostTensor::from_f32(Shape::new([hq]), sink_values(hq)).unwrap();
    let dout = rand_host(913, &[b, t, hq, 1]);
    let ffw = megatrain_tensor::AttentionOut {
        out: cpu_up!(f, &o),
        lse: cpu_up!(f, &lse),
        mask: AttnMask::CAUSAL,
    };
    let fs = cpu_up!(f, &sinks);
    let fos = f.attention_sinks(&ffw, &fs).unwrap();
    let (fdx, fds) = f
        .attention_sinks_backward(&fos, &ffw.lse, &fs, &cpu_up!(f, &dout))
        .unwrap();
    let down_f = |x: &<F64Executor as Executor>::Tensor| f.download(x).unwrap().to_f32_vec();
    let gfw = megatrain_tensor::AttentionOut {
        out: up(g, &o),
        lse: up(g, &lse),
        mask: AttnMask::CAUSAL,
    };
    let gs = up(g, &sinks);
    let gos = g.attention_sinks(&gfw, &gs).unwrap();
    assert_close(
        "attention_sinks past one grid dimension",
        &down(g, &gos),
        &down_f(&fos),
        TOL_F32,
    );
    let (gdx, gds) = g
        .attention_sinks_backward(&gos, &gfw.lse, &gs, &up(g, &dout))
        .unwrap();
    assert_close(
        "sinks' dout past one grid dimension",
        &down(g, &gdx),
        &down_f(&fdx),
        TOL_F32,
    );
    assert_close("dsinks of 262,200 rows", &down(g, &gds), &down_f(&fds), 1e-4);
}

/// Sinks that are not one per head, an lse of the output's layout rather
/// than [B, Hq, T], an output not [B, T, Hq, D], a dout of another shape
/// and bf16 sinks are errors naming the op and the shapes, as on the CPU;
/// and rows past the loop budget are refused.
#[test]
fn attention_sinks_refuse_bad_shapes() {
    let (o, lse) = (rand_host(1, &[2, 3, 4, 5]), rand_host(2, &[2, 4, 3]));
    let (sinks, short) = (rand_host(3, &[4]), rand_host(4, &[3]));
    let (lse_btn, flat) = (rand_host(5, &[2, 3, 4]), rand_host(6, &[6, 4, 5]));
    for g in both() {
        let fw = |out: &HostTensor, lse: &HostTensor| megatrain_tensor::AttentionOut {
            out: up(g, out),
            lse: up(g, lse),
            mask: AttnMask::CAUSAL,
        };
        let e = g
            .attention_sinks(&fw(&o, &lse), &up(g, &short))
            .expect_err("3 sinks")
            .to_string();
        assert!(
            e.contains("attention_sinks") && e.contains("sinks [3]") && e.contains("[4]"),
            "{e}"
        );
        let e = g
            .attention_sinks(&fw(&o, &lse_btn), &up(g, &sinks))
            .expect_err("lse")
            .to_string();
        assert!(e.contains("lse [2, 3, 4]") && e.contains("[2, 4, 3]"), "{e}");
        let e = g
            .attention_sinks(&fw(&flat, &lse), &up(g, &sinks))
            .expect_err("rank 3")
            .to_string();
        assert!(e.contains("attention_sinks") && e.contains("[6, 4, 5]"), "{e}");
        let (go, gl, gs) = (up(g, &o), up(g, &lse), up(g, &sinks));
        let e = g
            .attention_sinks_backward(&go, &gl, &gs, &up(g, &flat))
            .expect_err("dout")
            .to_string();
        assert!(
            e.contains("attention_sinks_backward") && e.contains("dout [6, 4, 5]"),
            "{e}"
        );
        assert!(g.attention_sinks_backward(&go, &go, &gs, &go).is_err());
        let gb = up(g, &sinks.to_dtype(DType::BF16));
        assert!(g.attention_sinks(&fw(&o, &lse), &gb).is_err());
        assert!(g.attention_sinks_backward(&go, &gl, &gb, &go).is_err());
        assert!(g.attention_sinks_backward(&go, &gl, &gs, &go).is_ok());
    }
    // Rows longer than the loop budget (llvmpipe's would end sink_rows'
    // loop early) are refused rather than summed in part.
    let Some(ctx) = ctx() else { return };
    let opts = GpuOptions {
        loop_budget: Some(100),
        ..Default::default()
    };
    let g = GpuExecutor::with_options(ctx, opts);
    let (o, lse) = (
        up(&g, &rand_host(7, &[1, 2, 1, 200])),
        up(&g, &rand_host(8, &[1, 1, 2])),
    );
    let s = up(&g, &rand_host(9, &[1]));
    let e = g
        .attention_sinks_backward(&o, &lse, &s, &o)
        .expect_err("rows past the loop budget")
        .to_string();
    assert!(
        e.contains("attention_sinks_backward") && e.contains("loop budget"),
        "{e}"
    );
}

/// The gated delta rule's operands as Qwen3-Next feeds them, for
/// `(B, T, Hk, Hv, Dk, Dv)`: l2-normalised keys, queries normalised and
/// scaled by 1/√Dk, β in (0, 1), g < 0; and a dout.
fn delta_rule_inputs(seed: u64, [b, t, hk, hv, dk, dv]: [usize; 6]) -> [HostTensor; 6] {
    let rows = |seed, scale: f32| {
        let mut x = rand_host(seed, &[b, t, hk, dk]).to_f32_vec();
        for row in x.chunks_mut(dk) {
            let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v *= scale / n);
        }
        HostTensor::from_f32(Shape::new([b, t, hk, dk]), x).unwrap()
    };
    let per_head = |seed, f: fn(f32) -> f32| {
        let x = rand_host(seed, &[b, t, hv])
            .to_f32_vec()
            .into_iter()
            .map(f)
            .collect();
        HostTensor::from_f32(Shape::new([b, t, hv]), x).unwrap()
    };
    [
        rows(seed, 1.0 / (dk as f32).sqrt()),
        rows(seed + 1, 1.0),
        rand_host(seed + 2, &[b, t, hv, dv]),
        per_head(seed + 3, |u| -(1.0 + (2.0 * u).exp()).ln()),
        per_head(seed + 4, |u| 1.0 / (1.0 + (-3.0 * u).exp())),
        rand_host(seed + 5, &[b, t, hv, dv]),
    ]
}

/// [`delta_rule_inputs`] with g per key channel, `[B, T, Hv, Dk]` (Kimi
/// Linear's KDA), each channel's decay its own negated softplus.
fn kda_inputs(seed: u64, dims @ [b, t, _, hv, dk, _]: [usize; 6]) -> [HostTensor; 6] {
    let mut x = delta_rule_inputs(seed, dims);
    let g = rand_host(seed + 6, &[b, t, hv, dk])
        .to_f32_vec()
        .into_iter()
        .map(|u| -(1.0 + (2.0 * u).exp()).ln())
        .collect();
    x[3] = HostTensor::from_f32(Shape::new([b, t, hv, dk]), g).unwrap();
    x
}

/// GPU executors for the delta rule: the plain one, and one whose 2 MiB
/// bindings hold one batch of the larger cases (a batch's backward scratch
/// must fit one) and whose loop budget runs one chunk a dispatch (the
/// backward hands dS between dispatches).
fn delta_rule_gpus() -> Vec<GpuExecutor> {
    let Some(ctx) = ctx() else { return vec![] };
    let small = GpuOptions {
        max_binding_bytes: Some(2 << 20),
        loop_budget: Some(30_000),
        poison_outputs: true,
        ..Default::default()
    };
    let plain = GpuOptions {
        poison_outputs: true,
        ..Default::default()
    };
    vec![
        GpuExecutor::with_options(ctx.clone(), plain),
        GpuExecutor::with_options(ctx, small),
    ]
}

/// Forward, checkpoints and all five gradients against the CPU reference:
/// Dk and Dv no powers of two (24/40: two column blocks, one partly
/// empty), T = 1, T = 37, T past two chunks, Dk = 128, GQA 4/2 and 2/2,
/// three batches; and T = 1050 at Dk = 120, whose two batches' backward
/// partials pass 2 MiB: on the 2 MiB executor (a piece of both batches,
/// their scratch 1,006,592 bytes each) it walks windows of 16 chunks
/// (242 partials a step, 123,904 bytes a chunk for both: 17 would pass
/// 2 MiB), 1024 steps then 26, summed per batch.
#[test]
fn gated_delta_rule_matches_cpu() {
    assert!(
        include_str!("../../../shaders/delta_rule.wgsl").contains(&format!(
            "const C: u32 = {}u;",
            megatrain_tensor::DELTA_RULE_CHUNK
        )),
        "delta_rule.wgsl's chunk is DELTA_RULE_CHUNK"
    );
    let gpus = delta_rule_gpus();
    for (i, dims) in [
        [3, 37, 2, 4, 24, 40],
        [3, 1, 2, 2, 24, 40],
        [2, 150, 1, 2, 16, 8],
        [1, 70, 1, 1, 128, 32],
        [2, 1050, 1, 1, 120, 32],
    ]
    .into_iter()
    .enumerate()
    {
        delta_rule_matches(&gpus, dims, &delta_rule_inputs(1000 + 10 * i as u64, dims), None);
    }
}

/// The same with a decay per key channel (g `[B, T, Hv, Dk]`, Kimi
/// Linear's KDA), dg of g's shape: GQA 4/2 at Dk = 24, Dv = 40, T = 1, T
/// past two chunks, Dk = 128 (a decay per thread of the staging), Dk ≠ Dv
/// both ways, Hk = Hv; and T = 1050 at Dk = 120, whose per-channel dg
/// partials (361 a step, 184,832 bytes a chunk for both batches) cut the
/// 2 MiB executor's windows to 11 chunks: 704 steps then 346.
#[test]
fn gated_delta_rule_per_channel_decay_matches_cpu() {
    let gpus = delta_rule_gpus();
    for (i, dims) in [
        [3, 37, 2, 4, 24, 40],
        [3, 1, 2, 2, 24, 40],
        [2, 150, 1, 2, 16, 8],
        [1, 70, 1, 1, 128, 32],
        [2, 45, 3, 3, 40, 7],
        [2, 1050, 1, 1, 120, 32],
    ]
    .into_iter()
    .enumerate()
    {
        delta_rule_matches(&gpus, dims, &kda_inputs(1100 + 10 * i as u64, dims), None);
    }
}

/// With documents packed in the rows the state restarts at each, the
/// checkpoints holding the restarted states: decays per head and per key
/// channel at T past two chunks, documents of one token (one on a chunk's
/// last step, one on its first), one starting on a chunk's first step,
/// others across one boundary; on the 2 MiB executor every chunk is a
/// dispatch of its own, which starts from the checkpoint.
#[test]
fn gated_delta_rule_with_docs_matches_cpu() {
    let gpus = delta_rule_gpus();
    let dims = [2, 150, 1, 2, 16, 8];
    let docs = packed(150, &[&[0, 5, 6, 63, 64, 130], &[0, 128, 129]]);
    delta_rule_matches(&gpus, dims, &delta_rule_inputs(1300, dims), Some(&docs));
    delta_rule_matches(&gpus, dims, &kda_inputs(1310, dims), Some(&docs));
}

/// Forward, checkpoints and all five gradients of `x` on each of `gpus`
/// against the CPU reference (relative error 1e-4), within `docs`.
fn delta_rule_matches(gpus: &[GpuExecutor], dims: [usize; 6], x: &[HostTensor; 6], docs: Option<&Docs>) {
    let c = cpu();
    let cx = x.each_ref().map(|h| cpu_up!(c, h));
    let fw = c
        .gated_delta_rule(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], docs)
        .unwrap();
    let gr = c
        .gated_delta_rule_backward(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], &fw, &cx[5])
        .unwrap();
    let want = [&fw.out, &fw.saved, &gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta].map(|t| down_cpu(&c, t));
    for g in gpus {
        let gx = x.each_ref().map(|h| up(g, h));
        let fw = g
            .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], docs)
            .unwrap();
        let gr = g
            .gated_delta_rule_backward(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], &fw, &gx[5])
            .unwrap();
        let names = ["out", "saved", "dq", "dk", "dv", "dg", "dbeta"];
        let got = [&fw.out, &fw.saved, &gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta];
        for ((name, t), w) in names.into_iter().zip(got).zip(&want) {
            let what = format!(
                "gated_delta_rule {name} (B, T, Hk, Hv, Dk, Dv) = {dims:?}, g {}, {docs:?}",
                x[3].shape()
            );
            assert_close(&what, &down(g, t), w, 1e-4);
        }
    }
}

/// `rand_host` scaled by `s` (activations past SiLU's and σ's middles).
fn rand_scaled(seed: u64, dims: &[usize], s: f32) -> HostTensor {
    let v = rand_host(seed, dims)
        .to_f32_vec()
        .into_iter()
        .map(|x| x * s)
        .collect();
    HostTensor::from_f32(dims.to_vec(), v).unwrap()
}

/// The short convolution both ways against the CPU's: K = 4 with C odd
/// and past a workgroup, T = 1 and T < K (taps in the padding), K = 1, and
/// 1400 rows whose dw is summed in blocks; on the 4 KiB-binding executor
/// the rows go in chunks of a few with their taps' halo, and under a loop
/// budget of 68 (4 taps a loop) dw's blocks are cut to 4 rows. With
/// documents packed in the rows: ones shorter than K and of one token, and
/// random ones over rows cut in chunks and blocks.
#[test]
fn causal_conv1d_silu_matches_cpu() {
    let Some(ctx) = ctx() else { return };
    let tight = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            poison_outputs: true,
            loop_budget: Some(68),
            ..Default::default()
        },
    );
    let c = cpu();
    let cases = [
        [2, 5, 67, 4],
        [2, 1, 67, 4],
        [3, 3, 5, 4],
        [2, 4, 3, 1],
        [1, 7, 300, 2],
        [2, 700, 3, 4],
    ];
    let docs = [
        (1, Some(packed(9, &[&[0, 3, 4], &[0, 8]])), [2, 9, 67, 4]),
        (2, Some(random_docs(7, 2, 700)), [2, 700, 3, 4]),
    ];
    let plain = cases.into_iter().map(|c| (0, None, c));
    for (i, (n, docs, [b, t, ch, k])) in plain.chain(docs).enumerate() {
        let docs = docs.as_ref();
        let what = |s: &str| format!("{s} [{b}, {t}, {ch}] K {k}, documents {n}");
        let seed = 800 + 10 * i as u64;
        let x = rand_scaled(seed, &[b, t, ch], 2.0);
        let w = rand_host(seed + 1, &[ch, k]);
        let dy = rand_host(seed + 2, &[b, t, ch]);
        let (cx, cw, cd) = (cpu_up!(c, &x), cpu_up!(c, &w), cpu_up!(c, &dy));
        let want = down_cpu(&c, &c.causal_conv1d_silu(&cx, &cw, docs).unwrap());
        let (rdx, rdw) = c.causal_conv1d_silu_backward(&cx, &cw, &cd, docs).unwrap();
        let (rdx, rdw) = (down_cpu(&c, &rdx), down_cpu(&c, &rdw));
        for g in both().into_iter().chain([&tight]) {
            let (gx, gw, gd) = (up(g, &x), up(g, &w), up(g, &dy));
            let y = g.causal_conv1d_silu(&gx, &gw, docs).unwrap();
            assert_eq!(y.shape().dims(), [b, t, ch]);
            assert_close(&what("causal_conv1d_silu"), &down(g, &y), &want, TOL_F32);
            let (dx, dw) = g.causal_conv1d_silu_backward(&gx, &gw, &gd, docs).unwrap();
            assert_eq!(
                (dx.shape().dims(), dw.shape().dims()),
                (&[b, t, ch][..], &[ch, k][..])
            );
            assert_close(&what("causal_conv1d_silu dx"), &down(g, &dx), &rdx, TOL_F32);
            assert_close(&what("causal_conv1d_silu dw"), &down(g, &dw), &rdw, TOL_F32);
        }
    }
}

/// The gates both ways against the CPU's: `a + dt_bias` over about ±35,
/// across softplus's threshold 20 and far below 0; one element, N odd, H
/// past a workgroup, and `[B, T, H]` read as rows; decays per key channel
/// beside rates per head (b's chunks a fraction of a's: Dk 1, odd, a row
/// of channels past a workgroup); da_log and ddt_bias summed over rows in
/// chunks on the 4 KiB-binding executor.
#[test]
fn delta_gates_matches_cpu() {
    let c = cpu();
    let cases: [(&[usize], &[usize]); 9] = [
        (&[1, 1], &[1, 1]),
        (&[7, 5], &[7, 5]),
        (&[3, 300], &[3, 300]),
        (&[2, 33, 4], &[2, 33, 4]),
        (&[1, 1, 1], &[1, 1]),
        (&[9, 4, 1], &[9, 4]),
        (&[2, 7, 3, 5], &[2, 7, 3]),
        (&[3, 5, 2, 67], &[3, 5, 2]),
        (&[2, 9, 4, 70], &[2, 9, 4]),
    ];
    for (i, (a_dims, b_dims)) in cases.into_iter().enumerate() {
        let n: usize = b_dims[..b_dims.len() - 1].iter().product();
        let ch = a_dims.iter().product::<usize>() / n;
        let what = |s: &str| format!("{s} a {a_dims:?} b {b_dims:?}");
        let seed = 900 + 10 * i as u64;
        let a = rand_scaled(seed, a_dims, 30.0);
        let b = rand_scaled(seed + 1, b_dims, 6.0);
        let a_log = rand_host(seed + 2, &[ch]);
        let dt = rand_scaled(seed + 3, &[ch], 5.0);
        let (dg, dbeta) = (rand_host(seed + 4, a_dims), rand_host(seed + 5, b_dims));
        let cu = |x: &HostTensor| cpu_up!(c, x);
        let (ca, cb, cl, cdt) = (cu(&a), cu(&b), cu(&a_log), cu(&dt));
        let (rg, rb) = c.delta_gates(&ca, &cb, &cl, &cdt).unwrap();
        let r = c
            .delta_gates_backward(&ca, &cb, &cl, &cdt, &cu(&dg), &cu(&dbeta))
            .unwrap();
        let want = [rg, rb, r.0, r.1, r.2, r.3].map(|t| down_cpu(&c, &t));
        for g in both() {
            let (ga, gb, gl, gdt) = (up(g, &a), up(g, &b), up(g, &a_log), up(g, &dt));
            let (gg, gbeta) = g.delta_gates(&ga, &gb, &gl, &gdt).unwrap();
            let d = g
                .delta_gates_backward(&ga, &gb, &gl, &gdt, &up(g, &dg), &up(g, &dbeta))
                .unwrap();
            assert_eq!((gg.shape().dims(), gbeta.shape().dims()), (a_dims, b_dims));
            assert_eq!((d.0.shape().dims(), d.1.shape().dims()), (a_dims, b_dims));
            assert_eq!((d.2.shape().dims(), d.3.shape().dims()), (&[ch][..], &[ch][..]));
            let got = [gg, gbeta, d.0, d.1, d.2, d.3];
            for ((name, got), want) in ["g", "beta", "da", "db", "da_log", "ddt_bias"]
                .into_iter()
                .zip(&got)
                .zip(&want)
            {
                assert_close(&what(name), &down(g, got), want, TOL_F32);
            }
        }
    }
}

/// Shapes that do not fit are errors naming the op and the shapes, as on
/// the CPU; key heads past the kernels' 128 are refused.
#[test]
fn gated_delta_rule_refuses_bad_shapes() {
    let Some(g) = gpu() else { return };
    let x = delta_rule_inputs(7, [1, 3, 2, 4, 8, 8]);
    let gx = x.each_ref().map(|h| up(g, h));
    let e = g
        .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[2], None)
        .expect_err("beta of v's shape")
        .to_string();
    assert!(
        e.contains("gated_delta_rule") && e.contains("beta must be [1, 3, 4]"),
        "{e}"
    );
    let odd = up(g, &rand_host(8, &[1, 3, 3, 8]));
    let e = g
        .gated_delta_rule(&gx[0], &gx[1], &odd, &gx[3], &gx[4], None)
        .expect_err("3 value heads on 2 key heads")
        .to_string();
    assert!(e.contains("Hv = 3"), "{e}");
    let fw = g
        .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], None)
        .unwrap();
    let e = g
        .gated_delta_rule_backward(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], &fw, &gx[3])
        .expect_err("dout")
        .to_string();
    assert!(
        e.contains("gated_delta_rule_backward") && e.contains("dout [1, 3, 4]"),
        "{e}"
    );
    let e = g
        .gated_delta_rule(
            &gx[0],
            &gx[1],
            &gx[2],
            &up(g, &rand_host(10, &[1, 3, 4, 7])),
            &gx[4],
            None,
        )
        .expect_err("g of 7 channels where Dk = 8")
        .to_string();
    assert!(
        e.contains("gated_delta_rule")
            && e.contains("g must be [1, 3, 4] (a decay per value head) or [1, 3, 4, 8]"),
        "{e}"
    );
    let wide = up(g, &rand_host(9, &[1, 3, 2, 130]));
    let e = g
        .gated_delta_rule(&wide, &wide, &gx[2], &gx[3], &gx[4], None)
        .expect_err("Dk = 130")
        .to_string();
    assert!(e.contains("gated_delta_rule") && e.contains("130"), "{e}");
}

/// Runs the delta rule both ways on `g` and the CPU and compares out, dq,
/// dk, dv, dg and dβ (relative error 1e-4).
fn delta_rule_against_cpu(g: &GpuExecutor, seed: u64, dims: [usize; 6]) {
    delta_rule_inputs_against_cpu(g, dims, delta_rule_inputs(seed, dims));
}

/// [`delta_rule_against_cpu`] on the given inputs.
fn delta_rule_inputs_against_cpu(g: &GpuExecutor, dims: [usize; 6], x: [HostTensor; 6]) {
    let gx = x.each_ref().map(|h| up(g, h));
    let fw = g
        .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], None)
        .unwrap();
    let gr = g
        .gated_delta_rule_backward(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], &fw, &gx[5])
        .unwrap();
    let c = cpu();
    let cx = x.each_ref().map(|h| c.upload(h).unwrap());
    let cf = c
        .gated_delta_rule(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], None)
        .unwrap();
    let cg = c
        .gated_delta_rule_backward(&cx[0], &cx[1], &cx[2], &cx[3], &cx[4], &cf, &cx[5])
        .unwrap();
    for (name, got, want) in [
        ("out", &fw.out, &cf.out),
        ("dq", &gr.dq, &cg.dq),
        ("dk", &gr.dk, &cg.dk),
        ("dv", &gr.dv, &cg.dv),
        ("dg", &gr.dg, &cg.dg),
        ("dbeta", &gr.dbeta, &cg.dbeta),
    ] {
        assert_close(
            &format!(
                "gated_delta_rule {name} (B, T, Hk, Hv, Dk, Dv) = {dims:?}, g {}",
                x[3].shape()
            ),
            &down(g, got),
            &down_cpu(&c, want),
            1e-4,
        );
    }
}

/// The backward's partials take a time window, not the whole sequence:
/// under 128 KiB bindings, T = 2000 at (1, T, 1, 1, 8, 8) (18 partials a
/// step, 4608 bytes a chunk; its whole sequence's, 144,000 bytes, were
/// refused before) runs in windows of 28 chunks, the most under 128 KiB
/// less the alignment (129,024 bytes; 29 would take 133,632): 1792 steps
/// and then 208, so a window boundary inside the sequence, not dividing
/// it. All five gradients match the CPU. With a decay per key channel, 25
/// partials a step (6400 bytes a chunk) make windows of 20 chunks: 1280
/// steps and then 720.
#[test]
fn gated_delta_rule_backward_runs_in_time_windows() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            max_binding_bytes: Some(128 << 10),
            poison_outputs: true,
            ..Default::default()
        },
    );
    delta_rule_against_cpu(&g, 11, [1, 2000, 1, 1, 8, 8]);
    let dims = [1, 2000, 1, 1, 8, 8];
    delta_rule_inputs_against_cpu(&g, dims, kda_inputs(12, dims));
}

/// A sequence whose saved states outgrow one storage binding is refused,
/// naming the longest sequence that fits; and a sequence of that length
/// runs and matches the CPU. At (1, T, 1, 3, 72, 32) the saved states take
/// 27,648 bytes a chunk (432 a token, past q/k's 288 and v's 384), and the
/// bindings, 1.9 MB, just hold the replay scratch (1,821,696 bytes): 68
/// chunks, T = 4352, whose backward runs in 5 windows of at most 16
/// chunks. (The scratch, which must fit, is at least 65 chunks' saved
/// states at any heads, so no sequence much shorter shows this limit; the
/// backward's partials, which did at 1800 tokens here, no longer grow
/// with T.)
#[test]
fn gated_delta_rule_names_the_longest_sequence_that_fits() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            max_binding_bytes: Some(1_900_000),
            ..Default::default()
        },
    );
    let too_long = delta_rule_inputs(13, [1, 4400, 1, 3, 72, 32]);
    let gx = too_long.each_ref().map(|h| up(&g, h));
    let e = g
        .gated_delta_rule(&gx[0], &gx[1], &gx[2], &gx[3], &gx[4], None)
        .expect_err("69 chunks of saved states past 1.9 MB")
        .to_string();
    assert!(
        e.contains("gated_delta_rule") && e.contains("saved states") && e.contains("T = 4400"),
        "{e}"
    );
    let most: usize = e
        .split("sequences of at most ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no bound named: {e}"));
    assert_eq!(most, 4352, "{e}");
    delta_rule_against_cpu(&g, 14, [1, most, 1, 3, 72, 32]);
}

/// `x · σ(gate)` both ways against the CPU's, gate over ±6: one element,
/// past a workgroup and a 4 KiB binding, rank 3.
#[test]
fn sigmoid_mul_matches_cpu() {
    let c = cpu();
    for (i, dims) in [&[1][..], &[3, 311], &[7, 5, 3]].into_iter().enumerate() {
        let seed = 950 + 10 * i as u64;
        let gate = rand_scaled(seed, dims, 6.0);
        let (x, dy) = (rand_host(seed + 1, dims), rand_host(seed + 2, dims));
        let (cg, cx, cd) = (cpu_up!(c, &gate), cpu_up!(c, &x), cpu_up!(c, &dy));
        let want = down_cpu(&c, &c.sigmoid_mul(&cg, &cx).unwrap());
        let (rdg, rdx) = c.sigmoid_mul_backward(&cg, &cx, &cd).unwrap();
        for g in both() {
            let (gg, gx, gd) = (up(g, &gate), up(g, &x), up(g, &dy));
            assert_close(
                "sigmoid_mul",
                &down(g, &g.sigmoid_mul(&gg, &gx).unwrap()),
                &want,
                TOL_F32,
            );
            let (dg, dx) = g.sigmoid_mul_backward(&gg, &gx, &gd).unwrap();
            assert_close("sigmoid_mul dgate", &down(g, &dg), &down_cpu(&c, &rdg), TOL_F32);
            assert_close("sigmoid_mul dx", &down(g, &dx), &down_cpu(&c, &rdx), TOL_F32);
        }
    }
}

/// Bad shapes and bf16 inputs are errors naming the op, as on the CPU.
#[test]
fn gated_delta_small_ops_refuse_bad_inputs() {
    let (x, w, flat) = (
        rand_host(1, &[2, 3, 4]),
        rand_host(2, &[4, 2]),
        rand_host(3, &[6, 4]),
    );
    let (h, bad_h) = (rand_host(4, &[4]), rand_host(5, &[3]));
    for g in both() {
        let (gx, gw, gf) = (up(g, &x), up(g, &w), up(g, &flat));
        let e = g
            .causal_conv1d_silu(&gf, &gw, None)
            .expect_err("2-D x")
            .to_string();
        assert!(e.contains("causal_conv1d_silu") && e.contains("[6, 4]"), "{e}");
        let e = g.causal_conv1d_silu_backward(&gx, &up(g, &rand_host(6, &[3, 2])), &gx, None);
        let e = e.expect_err("w's channels").to_string();
        assert!(
            e.contains("causal_conv1d_silu_backward") && e.contains("w [3, 2]"),
            "{e}"
        );
        let (gh, gbh) = (up(g, &h), up(g, &bad_h));
        let e = g.delta_gates(&gf, &gf, &gbh, &gh).expect_err("a_log").to_string();
        assert!(e.contains("delta_gates") && e.contains("a_log [3]"), "{e}");
        let e = g.delta_gates_backward(&gf, &gf, &gh, &gh, &gf, &gx);
        let e = e.expect_err("dbeta").to_string();
        assert!(
            e.contains("delta_gates_backward") && e.contains("dbeta [2, 3, 4]"),
            "{e}"
        );
        let e = g.sigmoid_mul(&gf, &gx).expect_err("shapes").to_string();
        assert!(e.contains("sigmoid_mul") && e.contains("[2, 3, 4]"), "{e}");
        let e = g.sigmoid_mul_backward(&gf, &gf, &gx).expect_err("dy").to_string();
        assert!(
            e.contains("sigmoid_mul_backward") && e.contains("dy [2, 3, 4]"),
            "{e}"
        );
        // Decays per key channel: b one a head, the parameters one a channel.
        let (gc, gb) = (up(g, &rand_host(7, &[2, 3, 4])), up(g, &rand_host(8, &[2, 3])));
        let e = g.delta_gates(&gc, &gb, &gh, &gh).expect_err("a_log").to_string();
        assert!(
            e.contains("delta_gates") && e.contains("a_log [4] must be [12]"),
            "{e}"
        );
        let e = g.delta_gates(&gc, &gf, &gh, &gh).expect_err("b").to_string();
        assert!(e.contains("b [6, 4]") && e.contains("[2, 3, 4]"), "{e}");
        let c12 = up(g, &rand_host(9, &[12]));
        let e = g.delta_gates_backward(&gc, &gb, &c12, &c12, &gc, &gc);
        let e = e.expect_err("dbeta").to_string();
        assert!(
            e.contains("delta_gates_backward") && e.contains("dbeta [2, 3, 4] must have b's shape [2, 3]"),
            "{e}"
        );
        let bf = up(g, &flat.to_dtype(DType::BF16));
        assert!(g.sigmoid_mul(&bf, &gf).is_err());
        assert!(g.delta_gates(&bf, &bf, &gh, &gh).is_err());
    }
}
