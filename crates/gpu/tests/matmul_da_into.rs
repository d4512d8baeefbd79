//! `matmul_backward_da_into` on the GPU: the input gradient added into an
//! accumulator by the product's own ACCUMULATE store has the bits of
//! `matmul_backward` then `add_assign` on the same executor, and agrees
//! with the CPU executor's within the usual tolerance: on the SIMT checked
//! kernel, the 128-wide interior tiles with their edges, the SIMT f16
//! kernel and the emulated tensor-core kernel under F16 precision, for
//! f32-, bf16- and f16-stored weights, batched rows and a transposed `a`
//! (the gradient stored transposed). Where the product would take several
//! passes over K (operands bound as several ranges, K past the loop
//! budget) the executor composes the two ops, so the bits still match.

mod common;

use common::*;
use megatrain_gpu::{CoopTile, F16Matmul, GpuExecutor, GpuOptions};
use megatrain_tensor::{ComputePrecision, CpuExecutor, DType, Executor, HostTensor, MatmulNeeds, Transpose};

struct Case {
    lead: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
}

/// Rows × C against a weight of V × C (NT, the blocks' layout) or C × V
/// (NN), `a` transposed (TN, TT), and a long K. The second to fourth have whole
/// 128-tiles of the gradient ([2·70, 132] or [140, 132]) and a K of 48 (a
/// multiple of the interior kernels' K step) next to edge strips.
fn cases() -> Vec<Case> {
    let c = |lead: &[usize], m, k, n, t| Case {
        lead: lead.to_vec(),
        m,
        k,
        n,
        t,
    };
    vec![
        c(&[], 37, 45, 70, Transpose::NT),
        c(&[2], 70, 132, 48, Transpose::NT),
        c(&[2], 70, 132, 48, Transpose::NN),
        c(&[], 140, 132, 48, Transpose::TN),
        c(&[2], 30, 50, 40, Transpose::TT),
        // K (the product's: n) past a small loop budget's 128.
        c(&[], 37, 45, 150, Transpose::NT),
    ]
}

fn hosts(c: &Case, seed: u64, b_dtype: DType) -> [HostTensor; 4] {
    let mut sa = c.lead.clone();
    sa.extend(if c.t.a { [c.k, c.m] } else { [c.m, c.k] });
    let sb = if c.t.b { vec![c.n, c.k] } else { vec![c.k, c.n] };
    let mut sd = c.lead.clone();
    sd.extend([c.m, c.n]);
    [
        rand_host(seed, &sa),
        rand_host(seed + 1, &sb).to_dtype(b_dtype),
        rand_host(seed + 2, &sd),
        rand_host(seed + 3, &sa),
    ]
}

const NEEDS: MatmulNeeds = MatmulNeeds {
    da: false,
    db: true,
    dbias: true,
};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `in_place`: whether the executor should accumulate by the product's
/// store (else it composes).
fn check(g: &GpuExecutor, cpu: &CpuExecutor, what: &str, in_place: impl Fn(&Case) -> bool) {
    let mut seed = 0;
    for c in cases() {
        for b_dtype in [DType::F32, DType::BF16, DType::F16] {
            seed += 10;
            let what = format!(
                "{what} lead {:?} m {} k {} n {} {:?} b {b_dtype}",
                c.lead, c.m, c.k, c.n, c.t
            );
            let [a, b, d, acc0] = hosts(&c, seed, b_dtype);
            let (ga, gb, gd) = (
                g.upload(&a).unwrap(),
                g.upload(&b).unwrap(),
                g.upload(&d).unwrap(),
            );
            let mut acc = g.upload(&acc0).unwrap();
            let ops = g.submit_stats().ops;
            let gr = g
                .matmul_backward_da_into(&ga, &gb, &gd, c.t, NEEDS, &mut acc)
                .unwrap();
            let into_ops = g.submit_stats().ops - ops;
            assert!(gr.da.is_none(), "{what}: a da was returned");
            let got = down(g, &acc);

            let ops = g.submit_stats().ops;
            let r = g.matmul_backward(&ga, &gb, &gd, c.t, MatmulNeeds::ALL).unwrap();
            let bw_ops = g.submit_stats().ops - ops;
            let mut want = g.upload(&acc0).unwrap();
            g.add_assign(&mut want, r.da.as_ref().unwrap()).unwrap();
            let want = down(g, &want);
            assert_close(&format!("{what}: into vs then-add"), &got, &want, TOL_F32);
            assert!(
                bits(&got) == bits(&want),
                "{what}: accumulated da differs from da + add_assign"
            );
            for (name, x, y) in [("db", &gr.db, &r.db), ("dbias", &gr.dbias, &r.dbias)] {
                let (x, y) = (down(g, x.as_ref().unwrap()), down(g, y.as_ref().unwrap()));
                assert!(bits(&x) == bits(&y), "{what}: {name}");
            }
            // In place: the ops of matmul_backward; composed: one add_assign more.
            let extra = if in_place(&c) { 0 } else { 1 };
            assert_eq!(
                into_ops,
                bw_ops + extra,
                "{what}: ops of the accumulating backward (in place: {})",
                in_place(&c)
            );

            let (ca, cb, cd) = (
                cpu.upload(&a).unwrap(),
                cpu.upload(&b).unwrap(),
                cpu.upload(&d).unwrap(),
            );
            let mut cacc = cpu.upload(&acc0).unwrap();
            cpu.matmul_backward_da_into(&ca, &cb, &cd, c.t, NEEDS, &mut cacc)
                .unwrap();
            assert_close(
                &format!("{what}: GPU vs CPU"),
                &got,
                &down_cpu(cpu, &cacc),
                TOL_F32,
            );
        }
    }
}

fn with(opts: GpuOptions, precision: ComputePrecision) -> Option<GpuExecutor> {
    let mut g = GpuExecutor::with_options(
        ctx()?,
        GpuOptions {
            poison_outputs: true,
            ..opts
        },
    );
    g.set_compute_precision(precision).unwrap();
    Some(g)
}

#[test]
fn simt_checked_and_interior_tiles_accumulate_exactly() {
    let Some(g) = gpu() else { return };
    check(g, &cpu(), "simt64", |_| true);
    let Some(g) = gpu_big_tile() else { return };
    check(g, &cpu(), "simt128", |_| true);
}

#[test]
fn f16_kernels_accumulate_exactly() {
    let cpu = CpuExecutor::with_precision(ComputePrecision::F16);
    let simt = GpuOptions {
        f16_matmul: F16Matmul::Simt,
        matmul_tile: Some(128),
        ..Default::default()
    };
    let Some(g) = with(simt, ComputePrecision::F16) else {
        return;
    };
    check(&g, &cpu, "simt f16", |_| true);
    let coop = GpuOptions {
        f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
        ..Default::default()
    };
    let g = with(coop, ComputePrecision::F16).expect("adapter");
    check(&g, &cpu, "emulated tensor cores", |_| true);
    // The hardware tensor-core kernels, where the adapter has them.
    if !ctx().is_some_and(|c| c.has_cooperative_matrix()) {
        eprintln!("no cooperative matrices: hardware tensor-core accumulation NOT tested here");
        return;
    }
    for tile in CoopTile::ALL {
        let opts = GpuOptions {
            f16_matmul: F16Matmul::Coop(tile),
            ..Default::default()
        };
        let g = with(opts, ComputePrecision::F16).expect("adapter");
        check(&g, &cpu, &format!("tensor cores {}", tile.name()), |_| true);
    }
}

/// Operands bound as several ranges, and K split over dispatches by a
/// small loop budget: the executor falls back to composing, same bits.
#[test]
fn split_products_fall_back_to_the_same_bits() {
    let Some(g) = gpu_small_bindings() else { return };
    // Every case's operands exceed 4 KiB.
    check(g, &cpu(), "small bindings", |_| false);
    let small_budget = GpuOptions {
        loop_budget: Some(100),
        ..Default::default()
    };
    let g = with(small_budget, ComputePrecision::F32).expect("adapter");
    check(&g, &cpu(), "small loop budget", |c| c.n <= 128);
}
