//! `matmul_backward_into` on the GPU: the weight gradient added into an
//! accumulator by the product's own ACCUMULATE store has the bits of
//! `matmul_backward` then `add_assign` on the same executor (when K fits
//! one dispatch), and agrees with the CPU executor's accumulation within
//! the usual tolerance: on the SIMT checked kernel, the 128-wide interior
//! tiles with their edges, the SIMT f16 kernel and the emulated
//! tensor-core kernel under F16 precision, for f32-, bf16- and f16-stored
//! weights and batched rows. Awkward shapes; the head's layout (NT) first.

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

/// The shapes of the tests: rows × C against a weight of V × C (NT) or
/// C × V (NN), or with `a` transposed (TN, 2-D: one sum per element). The
/// second and third have whole 128-tiles of the gradient and 24 rows (a
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
        c(&[2], 12, 132, 260, Transpose::NT),
        c(&[2], 12, 260, 132, Transpose::NN),
        c(&[], 24, 140, 130, Transpose::TN),
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
        rand_host(seed + 3, &sb),
    ]
}

const NEEDS: MatmulNeeds = MatmulNeeds {
    da: true,
    db: false,
    dbias: false,
};

fn check(g: &GpuExecutor, cpu: &CpuExecutor, what: &str, exact: bool) {
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
            let gr = g
                .matmul_backward_into(&ga, &gb, &gd, c.t, NEEDS, &mut acc)
                .unwrap();
            assert!(gr.db.is_none(), "{what}: a db was returned");
            let got = down(g, &acc);

            let r = g.matmul_backward(&ga, &gb, &gd, c.t, MatmulNeeds::ALL).unwrap();
            let mut want = g.upload(&acc0).unwrap();
            g.add_assign(&mut want, r.db.as_ref().unwrap()).unwrap();
            let want = down(g, &want);
            if exact {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&got) == bits(&want),
                    "{what}: accumulated db differs from db + add_assign"
                );
            }
            assert_close(&format!("{what}: into vs then-add"), &got, &want, TOL_F32);
            assert_close(
                &format!("{what}: da"),
                &down(g, gr.da.as_ref().unwrap()),
                &down(g, r.da.as_ref().unwrap()),
                0.0,
            );

            let (ca, cb, cd) = (
                cpu.upload(&a).unwrap(),
                cpu.upload(&b).unwrap(),
                cpu.upload(&d).unwrap(),
            );
            let mut cacc = cpu.upload(&acc0).unwrap();
            cpu.matmul_backward_into(&ca, &cb, &cd, c.t, NEEDS, &mut cacc)
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
    check(g, &cpu(), "simt64", true);
    let Some(g) = gpu_big_tile() else { return };
    check(g, &cpu(), "simt128", true);
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
    check(&g, &cpu, "simt f16", true);
    let coop = GpuOptions {
        f16_matmul: F16Matmul::CoopEmulated(CoopTile::Small64),
        ..Default::default()
    };
    let Some(g) = with(coop, ComputePrecision::F16) else {
        return;
    };
    check(&g, &cpu, "emulated tensor cores", true);
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
        check(&g, &cpu, &format!("tensor cores {}", tile.name()), true);
    }
}

/// Operands bound as several ranges: K (the rows) split over dispatches
/// whose partial sums land in the accumulator one by one, so only close.
#[test]
fn split_k_accumulates_within_tolerance() {
    let Some(g) = gpu_small_bindings() else { return };
    check(g, &cpu(), "small bindings", false);
}
