//! Matmul forward and backward against the CPU reference, including the
//! packed-bf16 and packed-f16 B paths and operands bound as several ranges.

mod common;

use common::matmul_case::{Case, abs_terms, case, interior_cases, operands};
use common::*;
use megatrain_gpu::{GpuExecutor, GpuOptions};
use megatrain_tensor::{DType, Executor, MatmulNeeds, Transpose};
use proptest::prelude::*;

/// Forward and backward of one case; `b_dtype` bf16 or f16 uploads b packed
/// and compares with the CPU run on the rounded b, so that only summation
/// order differs and the f32 tolerance still applies. Each result is judged
/// against the size of the terms it sums (the same products of the
/// operands' absolute values, [`abs_terms`]): random terms of both signs
/// can cancel to a sum far below them, where two summation orders differ by
/// more than `TOL_F32` of the sum itself without either being wrong, while
/// a wrong or missing tile is off by a fair fraction of its terms.
fn check(g: &GpuExecutor, c: &Case, b_dtype: DType) {
    let cpu = cpu();
    let (a, b, bias, dout) = operands(c);
    let b = b.to_dtype(b_dtype);
    let b_ref = b.to_dtype(DType::F32);
    let (ga, gb, gbias, gd) = (
        g.upload(&a).unwrap(),
        g.upload(&b).unwrap(),
        g.upload(&bias).unwrap(),
        g.upload(&dout).unwrap(),
    );
    let (ca, cb, cbias, cd) = (
        cpu.upload(&a).unwrap(),
        cpu.upload(&b_ref).unwrap(),
        cpu.upload(&bias).unwrap(),
        cpu.upload(&dout).unwrap(),
    );
    let terms = abs_terms(&cpu, c, [&a, &b_ref, &bias, &dout]);
    let y = g.matmul(&ga, &gb, c.bias.then_some(&gbias), c.t).unwrap();
    let yr = cpu.matmul(&ca, &cb, c.bias.then_some(&cbias), c.t).unwrap();
    assert_close_terms(
        &format!("matmul {c:?}"),
        &down(g, &y),
        &down_cpu(&cpu, &yr),
        terms[0],
        TOL_F32,
    );

    let gr = g.matmul_backward(&ga, &gb, &gd, c.t, MatmulNeeds::ALL).unwrap();
    let rr = cpu.matmul_backward(&ca, &cb, &cd, c.t, MatmulNeeds::ALL).unwrap();
    for (i, (name, got, want)) in [
        ("da", &gr.da, &rr.da),
        ("db", &gr.db, &rr.db),
        ("dbias", &gr.dbias, &rr.dbias),
    ]
    .into_iter()
    .enumerate()
    {
        assert_close_terms(
            &format!("{name} {c:?}"),
            &down(g, got.as_ref().unwrap()),
            &down_cpu(&cpu, want.as_ref().unwrap()),
            terms[i + 1],
            TOL_F32,
        );
    }
    assert_eq!(gr.db.as_ref().unwrap().dims(), b.dims());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn matmul_matches_cpu(c in case(90, 4)) {
        let Some(g) = gpu() else { return Ok(()) };
        check(g, &c, DType::F32);
    }

    #[test]
    fn matmul_bf16_b_matches_cpu_on_rounded_b(c in case(70, 4)) {
        let Some(g) = gpu() else { return Ok(()) };
        check(g, &c, DType::BF16);
    }

    #[test]
    fn matmul_f16_b_matches_cpu_on_rounded_b(c in case(70, 4)) {
        let Some(g) = gpu() else { return Ok(()) };
        check(g, &c, DType::F16);
    }

    #[test]
    fn matmul_128_tile_matches_cpu(c in case(200, 4)) {
        let Some(g) = gpu_big_tile() else { return Ok(()) };
        check(g, &c, DType::F32);
        check(g, &c, DType::BF16);
    }

    #[test]
    fn matmul_split_into_binding_ranges(c in case(70, 4)) {
        let Some(g) = gpu_small_bindings() else { return Ok(()) };
        check(g, &c, DType::F32);
        check(g, &c, DType::BF16);
        check(g, &c, DType::F16);
    }
}

#[test]
fn interior_tiles_and_edges_match_cpu_for_every_layout_and_b() {
    let Some(g) = gpu_big_tile() else { return };
    for c in interior_cases() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            check(g, &c, dtype);
        }
    }
}

/// Operands larger than one binding are multiplied block by block; blocks
/// of whole tiles still run on the interior pipelines, at offsets inside
/// their ranges.
#[test]
fn interior_tiles_inside_binding_ranges_match_cpu() {
    let Some(c) = ctx() else { return };
    let g = GpuExecutor::with_options(
        c,
        GpuOptions {
            poison_outputs: true,
            matmul_tile: Some(128),
            max_binding_bytes: Some(128 << 10),
            ..Default::default()
        },
    );
    for (i, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
        .into_iter()
        .enumerate()
    {
        let c = Case {
            batch: vec![],
            m: 300,
            n: 260,
            k: 272,
            t,
            shared_b: true,
            bias: i % 2 == 1,
            seed: 90 + i as u64,
        };
        check(&g, &c, DType::F32);
        check(&g, &c, DType::BF16);
    }
}

#[test]
fn matmul_larger_than_tiles_all_transposes() {
    let Some(g) = gpu() else { return };
    for (i, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
        .into_iter()
        .enumerate()
    {
        let c = Case {
            batch: vec![2],
            m: 130,
            n: 67,
            k: 200,
            t,
            shared_b: i % 2 == 0,
            bias: true,
            seed: 7 + i as u64,
        };
        check(g, &c, DType::F32);
    }
}

#[test]
fn bf16_against_f32_weights_is_within_bf16_rounding() {
    // The bf16 path's error against the unrounded f32 weight is the weight's
    // rounding (relative 2^-9 per element), averaged over K: well under 1e-2.
    let Some(g) = gpu() else { return };
    let cpu = cpu();
    let a = rand_host(1, &[33, 100]);
    let b = rand_host(2, &[100, 45]);
    let y = g
        .matmul(
            &g.upload(&a).unwrap(),
            &g.upload(&b.to_dtype(DType::BF16)).unwrap(),
            None,
            Transpose::NN,
        )
        .unwrap();
    let yr = cpu
        .matmul(
            &cpu.upload(&a).unwrap(),
            &cpu.upload(&b).unwrap(),
            None,
            Transpose::NN,
        )
        .unwrap();
    assert_close("bf16 vs f32", &down(g, &y), &down_cpu(&cpu, &yr), 4e-3);
}

#[test]
fn matmul_shape_errors_are_errors() {
    let Some(g) = gpu() else { return };
    let a = g.upload(&rand_host(1, &[3, 4])).unwrap();
    let b = g.upload(&rand_host(2, &[5, 6])).unwrap();
    assert!(g.matmul(&a, &b, None, Transpose::NN).is_err());
}

/// A weight just over the device's own storage-binding limit (128 MiB on
/// lavapipe): the LM-head layout [V, C], used by matmul (NT), its backward
/// and the embedding gather. Skipped where the limit is far larger.
#[test]
fn weight_over_the_device_binding_limit() {
    let Some(g) = gpu() else { return };
    let limit = g.max_binding_bytes() as usize;
    let c = 1024;
    let v = limit / (4 * c) + 40;
    if v * c * 4 > 300 << 20 {
        eprintln!("binding limit {limit} B: a weight over it is too big for a test here, skipping");
        return;
    }
    let cpu = cpu();
    let x = rand_host(1, &[3, c]);
    let w = rand_host(2, &[v, c]);
    let (gx, gw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let (cx, cw) = (cpu.upload(&x).unwrap(), cpu.upload(&w).unwrap());
    let y = g.matmul(&gx, &gw, None, Transpose::NT).unwrap();
    let yr = cpu.matmul(&cx, &cw, None, Transpose::NT).unwrap();
    assert_close("lm head", &down(g, &y), &down_cpu(&cpu, &yr), TOL_F32);
    let needs = MatmulNeeds {
        da: true,
        db: false,
        dbias: false,
    };
    let gr = g.matmul_backward(&gx, &gw, &y, Transpose::NT, needs).unwrap();
    let rr = cpu.matmul_backward(&cx, &cw, &yr, Transpose::NT, needs).unwrap();
    assert_close(
        "lm head da",
        &down(g, gr.da.as_ref().unwrap()),
        &down_cpu(&cpu, rr.da.as_ref().unwrap()),
        TOL_F32,
    );
    let ids = [0, (v - 1) as u32, (v / 2) as u32];
    let e = g.embedding(&ids, &gw).unwrap();
    let er = cpu.embedding(&ids, &cw).unwrap();
    assert_close(
        "embedding of a big table",
        &down(g, &e),
        &down_cpu(&cpu, &er),
        0.0,
    );
}

/// llvmpipe ends every loop of an invocation after 65535 iterations in total
/// (silently: the outputs are garbage). A K of 70000 in one dispatch does
/// that on lavapipe; the executor splits K under its loop budget instead.
#[test]
fn long_k_is_split_under_the_loop_budget() {
    let Some(g) = gpu() else { return };
    let cpu = cpu();
    let a = rand_host(1, &[3, 70_000]);
    let b = rand_host(2, &[5, 70_000]);
    let y = g
        .matmul(
            &g.upload(&a).unwrap(),
            &g.upload(&b).unwrap(),
            None,
            Transpose::NT,
        )
        .unwrap();
    let yr = cpu
        .matmul(
            &cpu.upload(&a).unwrap(),
            &cpu.upload(&b).unwrap(),
            None,
            Transpose::NT,
        )
        .unwrap();
    assert_close("K = 70000", &down(g, &y), &down_cpu(&cpu, &yr), TOL_F32);
}
