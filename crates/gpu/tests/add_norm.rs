//! The residual add fused with RMSNorm / LayerNorm, forward and backward,
//! against the CPU reference on awkward shapes: widths that are not
//! multiples of the 256-thread workgroup (and wider than one pass of it),
//! row counts split over several binding ranges (4 KiB bindings), over
//! blocks of rows in the weight-gradient sums (more than 64 rows) and over
//! several dispatches of those sums (a small loop budget).

mod common;

use common::*;
use megatrain_gpu::{GpuExecutor, GpuTensor};
use megatrain_tensor::{CpuTensor, Executor, F64Executor, HostTensor};
use proptest::prelude::*;

struct Case {
    x: HostTensor,
    r: HostTensor,
    w: HostTensor,
    b: HostTensor,
    dy: HostTensor,
    dh: HostTensor,
}

impl Case {
    fn new(seed: u64, rows: usize, cols: usize) -> Case {
        Case {
            x: rand_host(seed, &[rows, cols]),
            r: rand_host(seed ^ 1, &[rows, cols]),
            w: rand_host(seed ^ 2, &[cols]),
            b: rand_host(seed ^ 3, &[cols]),
            dy: rand_host(seed ^ 4, &[rows, cols]),
            dh: rand_host(seed ^ 5, &[rows, cols]),
        }
    }
}

/// Every output of the four ops on `ex`, named, in a fixed order.
fn outputs<E: Executor>(
    ex: &E,
    c: &Case,
    down: impl Fn(&E::Tensor) -> Vec<f32>,
) -> Vec<(&'static str, Vec<f32>)> {
    let up = |h: &HostTensor| ex.upload(h).unwrap();
    let (x, r, w, b, dy, dh) = (up(&c.x), up(&c.r), up(&c.w), up(&c.b), up(&c.dy), up(&c.dh));
    let rms = ex.add_rmsnorm(&x, &r, &w, 1e-5).unwrap();
    let rg = ex
        .add_rmsnorm_backward(&rms.h, &w, &rms.norm.rstd, &dy, &dh)
        .unwrap();
    let ln = ex.add_layernorm(&x, &r, &w, &b, 1e-5).unwrap();
    let mean = ln.norm.mean.as_ref().unwrap();
    let lg = ex
        .add_layernorm_backward(&ln.h, &w, mean, &ln.norm.rstd, &dy, &dh)
        .unwrap();
    vec![
        ("add_rmsnorm h", down(&rms.h)),
        ("add_rmsnorm y", down(&rms.norm.y)),
        ("add_rmsnorm rstd", down(&rms.norm.rstd)),
        ("add_rmsnorm_backward dx", down(&rg.dx)),
        ("add_rmsnorm_backward dw", down(&rg.dw)),
        ("add_layernorm h", down(&ln.h)),
        ("add_layernorm y", down(&ln.norm.y)),
        ("add_layernorm mean", down(mean)),
        ("add_layernorm rstd", down(&ln.norm.rstd)),
        ("add_layernorm_backward dx", down(&lg.dx)),
        ("add_layernorm_backward dw", down(&lg.dw)),
        ("add_layernorm_backward db", down(lg.db.as_ref().unwrap())),
    ]
}

fn check(g: &GpuExecutor, c: &Case, dw_tol: f64) {
    let cpu = cpu();
    let want = outputs(&cpu, c, |t: &CpuTensor<f32>| down_cpu(&cpu, t));
    let got = outputs(g, c, |t: &GpuTensor| down(g, t));
    let f64 = F64Executor::new();
    let exact = outputs(&f64, c, |t: &<F64Executor as Executor>::Tensor| {
        f64.download(t).unwrap().to_f32_vec()
    });
    let named = |n: &str| &exact.iter().find(|(m, _)| *m == n).expect("output").1;
    let (w, dy) = (c.w.to_f32_vec(), c.dy.to_f32_vec());
    for (((name, got), (_, want)), (_, exact)) in got.iter().zip(&want).zip(&exact) {
        // h is one f32 add on both sides: exact. A norm's dx is a
        // difference of near-equal terms (judged against float64 and the
        // terms' size), and a column sum over many rows rounds with the
        // count (`dw_tol`).
        if name.ends_with("dx") {
            let norm = name.split('_').nth(1).expect("add_<norm>_backward dx");
            let rstd = named(&format!("add_{norm} rstd"));
            assert_dx_close(name, got, exact, rstd, &w, &dy);
            continue;
        }
        let tol = match *name {
            "add_rmsnorm h" | "add_layernorm h" => 0.0,
            n if n.ends_with("dw") || n.ends_with("db") => dw_tol,
            _ => TOL_F32,
        };
        assert_close(name, got, want, tol);
    }
}

fn both() -> Vec<&'static GpuExecutor> {
    [gpu(), gpu_small_bindings()].into_iter().flatten().collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(8))]

    #[test]
    fn fused_add_norms_match_the_reference(rows in 1usize..160, cols in 1usize..600, seed in any::<u64>()) {
        let c = Case::new(seed, rows, cols);
        for g in both() {
            check(g, &c, TOL_F32);
        }
    }
}

/// The fused ops equal the unfused ones on the GPU too (the block's losses
/// must not move when it switches): the same sums in the same order, so
/// only a compiler's choice of fused multiply-adds may tell them apart.
#[test]
fn fused_equals_unfused_on_the_gpu() {
    let Some(g) = gpu() else { return };
    let c = Case::new(7, 33, 300);
    let up = |h: &HostTensor| g.upload(h).unwrap();
    let (x, r, w, dy, dh) = (up(&c.x), up(&c.r), up(&c.w), up(&c.dy), up(&c.dh));
    let fused = g.add_rmsnorm(&x, &r, &w, 1e-5).unwrap();
    let h = g.add(&x, &r).unwrap();
    let plain = g.rmsnorm(&h, &w, 1e-5).unwrap();
    assert_eq!(down(g, &fused.h), down(g, &h));
    assert_close("y", &down(g, &fused.norm.y), &down(g, &plain.y), 1e-6);
    let fg = g.add_rmsnorm_backward(&h, &w, &plain.rstd, &dy, &dh).unwrap();
    let mut pg = g.rmsnorm_backward(&h, &w, &plain.rstd, &dy).unwrap();
    g.add_assign(&mut pg.dx, &dh).unwrap();
    assert_close("dx", &down(g, &fg.dx), &down(g, &pg.dx), 1e-6);
    assert_close("dw", &down(g, &fg.dw), &down(g, &pg.dw), 1e-6);
}

#[test]
fn weight_gradients_split_under_a_small_loop_budget() {
    let Some(ctx) = ctx() else { return };
    let opts = megatrain_gpu::GpuOptions {
        poison_outputs: true,
        loop_budget: Some(2000),
        max_binding_bytes: Some(8192),
        ..Default::default()
    };
    let g = GpuExecutor::with_options(ctx, opts);
    // 4500-term column sums of random signs: see ops.rs for the bound.
    check(&g, &Case::new(41, 4500, 3), 1e-4);
}

#[test]
fn shape_errors_name_the_operands() {
    let Some(g) = gpu() else { return };
    let c = Case::new(3, 4, 6);
    let up = |h: &HostTensor| g.upload(h).unwrap();
    let (x, w, dy) = (up(&c.x), up(&c.w), up(&c.dy));
    let wrong = up(&rand_host(9, &[6, 4]));
    let err = g.add_rmsnorm(&x, &wrong, &w, 1e-5).unwrap_err().to_string();
    assert!(err.contains("add_rmsnorm") && err.contains("[6, 4]"), "{err}");
    let o = g.add_rmsnorm(&x, &x, &w, 1e-5).unwrap();
    let err = g
        .add_rmsnorm_backward(&o.h, &w, &o.norm.rstd, &dy, &wrong)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("add_rmsnorm_backward") && err.contains("[6, 4]"),
        "{err}"
    );
}
