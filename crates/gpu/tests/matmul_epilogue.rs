//! The matmuls fused with an activation on the GPU (the epilogues of
//! `shaders/matmul_epilogue.wgsl`): `matmul_gelu`, `matmul_swiglu`,
//! `matmul_geglu` and their backwards against the same
//! executor's composition of the unfused ops (the product's bits exactly;
//! the activation within `ULPS`, see there) and against the CPU reference,
//! on awkward shapes, batched rows, a batched `b` and a transposed `a`
//! (C stored transposed): the SIMT 64 and 128 tiles (interior + edges),
//! the SIMT f16 kernel, the emulated tensor-core kernels, operands bound
//! as a grid of sub-blocks, and K split over dispatches (the composed
//! fallback), whose path is checked through the op profile.

mod common;

use common::*;
use megatrain_gpu::{CoopTile, Epilogues, F16Matmul, GpuExecutor, GpuOptions, GpuTensor};
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, Executor, Glu, HostTensor, MatmulNeeds, Transpose,
    compose_matmul_backward_gelu, compose_matmul_backward_glu, compose_matmul_backward_swiglu,
    compose_matmul_gelu, compose_matmul_glu, compose_matmul_swiglu,
};

/// How far the fused activation may be from the standalone kernel's, in
/// ulps: both run activation_fns.wgsl's f32 operations on the same f32
/// input, but each pipeline is compiled on its own and a driver may
/// contract a·b + c into an FMA in one and not the other. (On lavapipe
/// they agree to the bit.)
const ULPS: u32 = 2;

struct Case {
    lead: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
    /// `b` batched like `a` rather than shared.
    bb: bool,
}

/// Forward products `[lead, m, k] @ op(b) -> [lead, m, n]`; the backward's
/// fused product is `dout @ op(b)ᵀ -> [lead, m, k]` with K = n. The second
/// and third have whole 128-tiles (and 64-tiles) beside edge strips in the
/// backward and the forward product respectively.
fn cases() -> Vec<Case> {
    let c = |lead: &[usize], m, k, n, t, bb| Case {
        lead: lead.to_vec(),
        m,
        k,
        n,
        t,
        bb,
    };
    vec![
        c(&[], 37, 45, 70, Transpose::NT, false),
        c(&[2], 70, 140, 160, Transpose::NT, false),
        c(&[], 130, 144, 132, Transpose::NN, false),
        c(&[], 24, 140, 130, Transpose::TN, false),
        c(&[3], 20, 33, 41, Transpose::NN, true),
    ]
}

fn shapes(c: &Case) -> [Vec<usize>; 3] {
    let mut sa = c.lead.clone();
    sa.extend(if c.t.a { [c.k, c.m] } else { [c.m, c.k] });
    let mut sb = if c.bb { c.lead.clone() } else { vec![] };
    sb.extend(if c.t.b { [c.n, c.k] } else { [c.k, c.n] });
    let mut sy = c.lead.clone();
    sy.extend([c.m, c.n]);
    [sa, sb, sy]
}

fn ulps(x: f32, y: f32) -> u32 {
    // Sign-magnitude to a monotonic integer line.
    let key = |v: f32| {
        let b = v.to_bits() as i64;
        if b < 0x8000_0000 { b } else { 0x8000_0000 - b }
    };
    (key(x) - key(y)).unsigned_abs().min(u32::MAX as u64) as u32
}

fn assert_bits(what: &str, got: &[f32], want: &[f32], max_ulps: u32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (&x, &y))| (ulps(x, y), i))
        .max()
        .unwrap_or((0, 0));
    assert!(
        got.iter().all(|x| x.is_finite()) && worst.0 <= max_ulps,
        "{what}: element {} is {} ulps off ({} vs {})",
        worst.1,
        worst.0,
        got[worst.1],
        want[worst.1]
    );
}

/// Under F16 the fused products fold max|x| of both their outputs as they
/// store them (`operand_maxima.rs` has the plain products): what `g`
/// remembers for `t` is what a scan finds.
fn assert_remembered_max(g: &GpuExecutor, what: &str, t: &GpuTensor) {
    if g.compute_precision() == ComputePrecision::F16 {
        let want = down(g, t).iter().fold(0f32, |m, x| m.max(x.abs()));
        assert_eq!(g.remembered_max(t).unwrap(), Some(want), "{what}: remembered max");
    }
}

/// Every fused op of every case on `g`, against `g`'s composition and
/// `cpu`'s fused op (the reference composition).
fn check(g: &GpuExecutor, cpu: &CpuExecutor, what: &str) {
    let mut seed = 0;
    for c in cases() {
        seed += 20;
        let what = format!(
            "{what} lead {:?} m {} k {} n {} {:?} b batched {}",
            c.lead, c.m, c.k, c.n, c.t, c.bb
        );
        let [sa, sb, sy] = shapes(&c);
        // Activation inputs spread over [-4, 4]: both tails of each.
        let wide = |s, shape: &[usize]| {
            let h = rand_host(s, shape);
            HostTensor::from_f32(
                h.shape().clone(),
                h.to_f32_vec().iter().map(|x| 4.0 * x).collect(),
            )
            .unwrap()
        };
        let hosts = [
            rand_host(seed, &sa),
            rand_host(seed + 1, &sb),
            rand_host(seed + 2, &[c.n]),
            wide(seed + 3, &sy),
            wide(seed + 4, &sa),
            rand_host(seed + 5, &sa),
            rand_host(seed + 6, &sy),
        ];
        let up = |h: &HostTensor| g.upload(h).unwrap();
        let [a, b, bias, gate, pre, upm, dout] = hosts.each_ref().map(up);
        let cup = |h: &HostTensor| cpu.upload(h).unwrap();
        let [ca, cb, cbias, cgate, cpre, cupm, cdout] = hosts.each_ref().map(cup);
        let d = |t: &GpuTensor| down(g, t);
        let dc = |t: &<CpuExecutor as Executor>::Tensor| down_cpu(cpu, t);
        let t = c.t;

        // GELU forward: f = a @ b + bias, gelu(f).
        let (f, act) = g.matmul_gelu(&a, &b, Some(&bias), t).unwrap();
        let (wf, wact) = compose_matmul_gelu(g, &a, &b, Some(&bias), t).unwrap();
        assert_bits(&format!("{what}: gelu fwd f"), &d(&f), &d(&wf), 0);
        assert_bits(&format!("{what}: gelu fwd g"), &d(&act), &d(&wact), ULPS);
        assert_remembered_max(g, &format!("{what}: gelu fwd f"), &f);
        assert_remembered_max(g, &format!("{what}: gelu fwd g"), &act);
        let (rf, ract) = cpu.matmul_gelu(&ca, &cb, Some(&cbias), t).unwrap();
        assert_close(&format!("{what}: gelu fwd f vs CPU"), &d(&f), &dc(&rf), TOL_F32);
        assert_close(
            &format!("{what}: gelu fwd g vs CPU"),
            &d(&act),
            &dc(&ract),
            TOL_F32,
        );

        // SwiGLU forward: up = a @ b + bias, silu(gate) · up.
        let (u, s) = g.matmul_swiglu(&a, &b, Some(&bias), t, &gate).unwrap();
        let (wu, ws) = compose_matmul_swiglu(g, &a, &b, Some(&bias), t, &gate).unwrap();
        assert_bits(&format!("{what}: swiglu fwd up"), &d(&u), &d(&wu), 0);
        assert_bits(&format!("{what}: swiglu fwd s"), &d(&s), &d(&ws), ULPS);
        assert_remembered_max(g, &format!("{what}: swiglu fwd up"), &u);
        assert_remembered_max(g, &format!("{what}: swiglu fwd s"), &s);
        let (_, rs) = cpu.matmul_swiglu(&ca, &cb, Some(&cbias), t, &cgate).unwrap();
        assert_close(&format!("{what}: swiglu fwd s vs CPU"), &d(&s), &dc(&rs), TOL_F32);

        // GELU backward: the gradient of pre through a = gelu(pre).
        let gr = g
            .matmul_backward_gelu(&a, &b, &dout, t, MatmulNeeds::ALL, &pre)
            .unwrap();
        let wr = compose_matmul_backward_gelu(g, &a, &b, &dout, t, MatmulNeeds::ALL, &pre).unwrap();
        let rr = cpu
            .matmul_backward_gelu(&ca, &cb, &cdout, t, MatmulNeeds::ALL, &cpre)
            .unwrap();
        assert_remembered_max(g, &format!("{what}: gelu bwd da"), gr.da.as_ref().unwrap());
        let da = d(gr.da.as_ref().unwrap());
        assert_bits(
            &format!("{what}: gelu bwd da"),
            &da,
            &d(wr.da.as_ref().unwrap()),
            ULPS,
        );
        assert_close(
            &format!("{what}: gelu bwd da vs CPU"),
            &da,
            &dc(rr.da.as_ref().unwrap()),
            TOL_F32,
        );
        for (x, y, name) in [(&gr.db, &wr.db, "db"), (&gr.dbias, &wr.dbias, "dbias")] {
            assert_bits(
                &format!("{what}: gelu bwd {name}"),
                &d(x.as_ref().unwrap()),
                &d(y.as_ref().unwrap()),
                0,
            );
        }

        // SwiGLU backward: dgate, dup through a = swiglu(gate, up).
        let needs = MatmulNeeds {
            da: true,
            db: true,
            dbias: false,
        };
        let (gr, dg, du) = g
            .matmul_backward_swiglu(&a, &b, &dout, t, needs, &pre, &upm)
            .unwrap();
        let (wr, wdg, wdu) = compose_matmul_backward_swiglu(g, &a, &b, &dout, t, needs, &pre, &upm).unwrap();
        let (_, rdg, rdu) = cpu
            .matmul_backward_swiglu(&ca, &cb, &cdout, t, needs, &cpre, &cupm)
            .unwrap();
        assert!(
            gr.da.is_none() && gr.dbias.is_none(),
            "{what}: only db was asked for"
        );
        assert_bits(&format!("{what}: swiglu bwd dgate"), &d(&dg), &d(&wdg), ULPS);
        assert_bits(&format!("{what}: swiglu bwd dup"), &d(&du), &d(&wdu), ULPS);
        assert_remembered_max(g, &format!("{what}: swiglu bwd dgate"), &dg);
        assert_remembered_max(g, &format!("{what}: swiglu bwd dup"), &du);
        assert_bits(
            &format!("{what}: swiglu bwd db"),
            &d(gr.db.as_ref().unwrap()),
            &d(wr.db.as_ref().unwrap()),
            0,
        );
        assert_close(
            &format!("{what}: swiglu bwd dgate vs CPU"),
            &d(&dg),
            &dc(&rdg),
            TOL_F32,
        );
        assert_close(
            &format!("{what}: swiglu bwd dup vs CPU"),
            &d(&du),
            &dc(&rdu),
            TOL_F32,
        );

        // GeGLU, forward and backward: gelu(gate) · up.
        let (u, s) = g.matmul_geglu(&a, &b, Some(&bias), t, &gate).unwrap();
        let (wu, ws) = compose_matmul_glu(g, &a, &b, Some(&bias), t, &gate, Glu::Gelu).unwrap();
        assert_bits(&format!("{what}: geglu fwd up"), &d(&u), &d(&wu), 0);
        assert_bits(&format!("{what}: geglu fwd s"), &d(&s), &d(&ws), ULPS);
        assert_remembered_max(g, &format!("{what}: geglu fwd s"), &s);
        let (_, rs) = cpu.matmul_geglu(&ca, &cb, Some(&cbias), t, &cgate).unwrap();
        assert_close(&format!("{what}: geglu fwd s vs CPU"), &d(&s), &dc(&rs), TOL_F32);
        let (gr, dg, du) = g
            .matmul_backward_geglu(&a, &b, &dout, t, needs, &pre, &upm)
            .unwrap();
        let (_, wdg, wdu) =
            compose_matmul_backward_glu(g, &a, &b, &dout, t, needs, &pre, &upm, Glu::Gelu).unwrap();
        let (_, rdg, rdu) = cpu
            .matmul_backward_geglu(&ca, &cb, &cdout, t, needs, &cpre, &cupm)
            .unwrap();
        assert!(gr.da.is_none(), "{what}: geglu da was not asked for");
        assert_bits(&format!("{what}: geglu bwd dgate"), &d(&dg), &d(&wdg), ULPS);
        assert_bits(&format!("{what}: geglu bwd dup"), &d(&du), &d(&wdu), ULPS);
        assert_remembered_max(g, &format!("{what}: geglu bwd dgate"), &dg);
        assert_close(
            &format!("{what}: geglu bwd dgate vs CPU"),
            &d(&dg),
            &dc(&rdg),
            TOL_F32,
        );
        assert_close(
            &format!("{what}: geglu bwd dup vs CPU"),
            &d(&du),
            &dc(&rdu),
            TOL_F32,
        );
    }
}

#[test]
fn simt_tiles_fuse_on_interior_and_edges() {
    let Some(g) = gpu() else { return };
    check(g, &cpu(), "simt64");
    let Some(g) = gpu_big_tile() else { return };
    check(g, &cpu(), "simt128");
}

#[test]
fn f16_kernels_fuse() {
    let cpu = CpuExecutor::with_precision(ComputePrecision::F16);
    let Some(g) = simt128_f16() else {
        return;
    };
    check(&g, &cpu, "simt f16");
    for tile in [CoopTile::Small64, CoopTile::Small16x64] {
        let coop = GpuOptions {
            f16_matmul: F16Matmul::CoopEmulated(tile),
            ..Default::default()
        };
        let g = gpu_with(coop, ComputePrecision::F16).expect("adapter");
        check(&g, &cpu, &format!("emulated tensor cores {}", tile.name()));
    }
    for (tile, g) in hardware_tiles("epilogues") {
        check(&g, &cpu, &format!("tensor cores {}", tile.name()));
    }
}

/// Operands bound as a grid of sub-blocks (the epilogue's operands follow
/// C's blocks), and where K is split too, the composed fallback.
#[test]
fn sub_blocks_and_split_k() {
    let Some(g) = gpu_small_bindings() else { return };
    check(g, &cpu(), "small bindings");
    let split = GpuOptions {
        loop_budget: Some(1),
        ..Default::default()
    };
    let g = gpu_with(split, ComputePrecision::F32).expect("adapter");
    check(&g, &cpu(), "K split");
}

/// Which path ran, from the op profile: the fused ops record no
/// standalone activation unless K is split over dispatches (here past 128,
/// with the smallest loop budget).
#[test]
fn activation_kernels_run_only_where_k_is_split() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            profile: true,
            loop_budget: Some(1),
            ..Default::default()
        },
    );
    for (k_split, m, k, n) in [(false, 37, 45, 70), (true, 30, 140, 160)] {
        let up = |s, shape: &[usize]| g.upload(&rand_host(s, shape)).unwrap();
        let (a, b, dout) = (up(1, &[m, k]), up(2, &[k, n]), up(3, &[m, n]));
        let (gate, pre) = (up(4, &[m, n]), up(5, &[m, k]));
        g.profile().clear();
        g.matmul_gelu(&a, &b, None, Transpose::NN).unwrap();
        g.matmul_swiglu(&a, &b, None, Transpose::NN, &gate).unwrap();
        g.matmul_backward_gelu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &pre)
            .unwrap();
        g.matmul_backward_swiglu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &pre, &a)
            .unwrap();
        g.synchronize().unwrap();
        let ops: Vec<&str> = g.profile().snapshot().iter().map(|(op, _)| *op).collect();
        for act in ["gelu", "swiglu", "gelu_backward", "swiglu_backward"] {
            assert_eq!(ops.contains(&act), k_split, "K {k} N {n}: {act} in {ops:?}");
        }
        for fused in [
            "matmul_gelu",
            "matmul_swiglu",
            "matmul_backward_gelu",
            "matmul_backward_swiglu",
        ] {
            assert!(ops.contains(&fused), "{fused} in {ops:?}");
        }
    }
}

/// `GpuOptions::epilogues` (`MEGATRAIN_EPILOGUES`): `forward` leaves the
/// backward's activations to their own kernels, `none` the forward's too,
/// and each gives what the fused products give, within `ULPS`.
#[test]
fn epilogues_setting_unfuses_the_backward_or_all() {
    let Some(ctx) = ctx() else { return };
    let (m, k, n) = (37, 45, 70);
    let run = |epilogues: Epilogues| {
        let g = GpuExecutor::with_options(
            ctx.clone(),
            GpuOptions {
                profile: true,
                epilogues,
                ..Default::default()
            },
        );
        let up = |s, shape: &[usize]| g.upload(&rand_host(s, shape)).unwrap();
        let (a, b, dout) = (up(1, &[m, k]), up(2, &[k, n]), up(3, &[m, n]));
        let (gate, pre) = (up(4, &[m, n]), up(5, &[m, k]));
        let (f, act) = g.matmul_gelu(&a, &b, None, Transpose::NN).unwrap();
        let (u, s) = g.matmul_swiglu(&a, &b, None, Transpose::NN, &gate).unwrap();
        let gr = g
            .matmul_backward_gelu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &pre)
            .unwrap();
        let (_, dg, du) = g
            .matmul_backward_swiglu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &pre, &a)
            .unwrap();
        let values: Vec<Vec<f32>> = [&f, &act, &u, &s, gr.da.as_ref().unwrap(), &dg, &du]
            .iter()
            .map(|t| down(&g, t))
            .collect();
        let ops: Vec<&str> = g.profile().snapshot().iter().map(|(op, _)| *op).collect();
        let ran = |act: &str| ops.contains(&act);
        (
            [
                ran("gelu"),
                ran("swiglu"),
                ran("gelu_backward"),
                ran("swiglu_backward"),
            ],
            values,
        )
    };
    let (ran, fused) = run(Epilogues::All);
    assert_eq!(ran, [false; 4]);
    for (setting, forward, backward) in [(Epilogues::Forward, false, true), (Epilogues::None, true, true)] {
        let (ran, values) = run(setting);
        assert_eq!(ran, [forward, forward, backward, backward], "{setting}");
        for (i, (got, want)) in values.iter().zip(&fused).enumerate() {
            assert_bits(&format!("{setting}: output {i}"), got, want, ULPS);
        }
    }
}

/// Operands bound as a grid of sub-blocks with K whole: the epilogue's
/// operands follow C's blocks and nothing falls back (bindings of 4 KiB;
/// an NT forward and an NN backward, whose B is split along N, not K).
#[test]
fn sub_blocks_fuse_without_a_standalone_activation() {
    let Some(ctx) = ctx() else { return };
    let g = GpuExecutor::with_options(
        ctx,
        GpuOptions {
            profile: true,
            max_binding_bytes: Some(4096),
            ..Default::default()
        },
    );
    let (m, k, n) = (37, 45, 70);
    let up = |s, shape: &[usize]| g.upload(&rand_host(s, shape)).unwrap();
    let (a, w_nt, w_nn, y) = (up(1, &[m, k]), up(2, &[n, k]), up(3, &[k, n]), up(4, &[m, n]));
    let (pre, gate) = (up(5, &[m, k]), up(6, &[m, n]));
    g.profile().clear();
    let (f, act) = g.matmul_gelu(&a, &w_nt, None, Transpose::NT).unwrap();
    let (u, s) = g.matmul_swiglu(&a, &w_nt, None, Transpose::NT, &gate).unwrap();
    let gr = g
        .matmul_backward_gelu(&a, &w_nn, &y, Transpose::NN, MatmulNeeds::ALL, &pre)
        .unwrap();
    let (_, dg, du) = g
        .matmul_backward_swiglu(&a, &w_nn, &y, Transpose::NN, MatmulNeeds::ALL, &pre, &a)
        .unwrap();
    g.synchronize().unwrap();
    let ops: Vec<&str> = g.profile().snapshot().iter().map(|(op, _)| *op).collect();
    for act in ["gelu", "swiglu", "gelu_backward", "swiglu_backward"] {
        assert!(!ops.contains(&act), "{act} in {ops:?}");
    }
    // And the values: the CPU's composition.
    let cpu = cpu();
    let cup = |s, shape: &[usize]| cpu.upload(&rand_host(s, shape)).unwrap();
    let (ca, cw_nt, cw_nn, cy) = (cup(1, &[m, k]), cup(2, &[n, k]), cup(3, &[k, n]), cup(4, &[m, n]));
    let (cpre, cgate) = (cup(5, &[m, k]), cup(6, &[m, n]));
    let (rf, ract) = cpu.matmul_gelu(&ca, &cw_nt, None, Transpose::NT).unwrap();
    let (ru, rs) = cpu
        .matmul_swiglu(&ca, &cw_nt, None, Transpose::NT, &cgate)
        .unwrap();
    let rr = cpu
        .matmul_backward_gelu(&ca, &cw_nn, &cy, Transpose::NN, MatmulNeeds::ALL, &cpre)
        .unwrap();
    let (_, rdg, rdu) = cpu
        .matmul_backward_swiglu(&ca, &cw_nn, &cy, Transpose::NN, MatmulNeeds::ALL, &cpre, &ca)
        .unwrap();
    for (name, got, want) in [
        ("f", &f, &rf),
        ("gelu", &act, &ract),
        ("up", &u, &ru),
        ("s", &s, &rs),
        ("dpre", gr.da.as_ref().unwrap(), rr.da.as_ref().unwrap()),
        ("dgate", &dg, &rdg),
        ("dup", &du, &rdu),
    ] {
        assert_close(
            &format!("sub-blocks {name}"),
            &down(&g, got),
            &down_cpu(&cpu, want),
            TOL_F32,
        );
    }
}

#[test]
fn bad_activation_operands_are_named() {
    let Some(g) = gpu() else { return };
    let up = |s, shape: &[usize]| g.upload(&rand_host(s, shape)).unwrap();
    let (a, b, dout, wrong) = (up(1, &[3, 4]), up(2, &[4, 5]), up(3, &[3, 5]), up(4, &[4, 3]));
    let nn = Transpose::NN;
    let e = g.matmul_swiglu(&a, &b, None, nn, &wrong).unwrap_err().to_string();
    assert!(e.contains("gate [4, 3]") && e.contains("[3, 5]"), "{e}");
    let e = g
        .matmul_backward_gelu(&a, &b, &dout, nn, MatmulNeeds::ALL, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pre [4, 3]") && e.contains("a's shape"), "{e}");
    let e = g
        .matmul_backward_swiglu(&a, &b, &dout, nn, MatmulNeeds::ALL, &a, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("up [4, 3]"), "{e}");
    let e = g
        .matmul_backward_gelu(&a, &b, &a, nn, MatmulNeeds::ALL, &a)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dout [3, 4]"), "{e}");
    let bias = up(5, &[4]);
    let e = g.matmul_gelu(&a, &b, Some(&bias), nn).unwrap_err().to_string();
    assert!(e.contains("bias [4]") && e.contains("N = 5"), "{e}");
}
