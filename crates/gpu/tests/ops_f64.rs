//! Every op of a training step, forward and backward, on the GPU, on the
//! f32 CPU reference and on the float64 executor, from the same inputs.
//!
//! `ops.rs` compares the GPU with the CPU; when the two disagree by more
//! than a bound, this says which of them is off: a kernel that is merely
//! rounded differently (another summation order, the driver's `exp`, FMA
//! contraction) is about as far from the f64 result as the CPU is, while a
//! wrong kernel is far further. The bound is relative to the CPU's own
//! error, with a floor of a few f32 ulps of the norm for ops the CPU gets
//! almost exactly. Shapes are llama-tiny's and gpt2-nano's, awkward where
//! they can be. Run with `--nocapture` to see the table on a new device.

mod common;

use common::*;
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{
    AttnMask, Executor, F64Executor, HostTensor, LossTerms, MatmulNeeds, Rope, SoftCap, TensorHandle,
    Transpose,
};

/// A GPU result may be this many times further from f64 than the CPU's.
const RATIO: f64 = 4.0;
/// ... or this far, whichever is larger (8 ulps of the norm).
const FLOOR: f64 = 1e-6;

struct Inputs {
    x: HostTensor,
    w: HostTensor,
    w2: HostTensor,
    bias: HostTensor,
    gain: HostTensor,
    dy: HostTensor,
    dmm: HostTensor,
    q: HostTensor,
    k: HostTensor,
    v: HostTensor,
    datt: HostTensor,
    logits: HostTensor,
    table: HostTensor,
    ids: Vec<u32>,
    targets: Vec<i32>,
}

// Rows 2×37, width 96, MLP 160, 4 query heads over 2 KV heads of 24, vocab 67.
const ROWS: usize = 74;
const C: usize = 96;
const F: usize = 160;
const V: usize = 67;

fn inputs(seed: u64) -> Inputs {
    Inputs {
        x: rand_host(seed, &[ROWS, C]),
        w: rand_host(seed ^ 1, &[F, C]),
        w2: rand_host(seed ^ 2, &[ROWS, F]),
        bias: rand_host(seed ^ 3, &[F]),
        gain: rand_host(seed ^ 4, &[C]),
        dy: rand_host(seed ^ 5, &[ROWS, C]),
        dmm: rand_host(seed ^ 6, &[ROWS, F]),
        q: rand_host(seed ^ 7, &[2, 37, 4, 24]),
        k: rand_host(seed ^ 8, &[2, 37, 2, 24]),
        v: rand_host(seed ^ 9, &[2, 37, 2, 24]),
        datt: rand_host(seed ^ 10, &[2, 37, 4, 24]),
        logits: rand_host(seed ^ 11, &[ROWS, V]),
        table: rand_host(seed ^ 12, &[V, C]),
        ids: (0..ROWS as u32).map(|i| (i * 31 + 5) % V as u32).collect(),
        targets: (0..ROWS as i32)
            .map(|i| if i % 9 == 4 { -100 } else { (i * 17 + 3) % V as i32 })
            .collect(),
    }
}

/// Runs every op on `ex`; one named f32 result each.
fn run<E: Executor>(ex: &E, i: &Inputs) -> Vec<(&'static str, Vec<f32>)> {
    let up = |h: &HostTensor| ex.upload(h).unwrap();
    let down = |t: &E::Tensor| ex.download(t).unwrap().to_f32_vec();
    let (x, w, w2, bias, gain, dy, dmm) = (
        up(&i.x),
        up(&i.w),
        up(&i.w2),
        up(&i.bias),
        up(&i.gain),
        up(&i.dy),
        up(&i.dmm),
    );
    let mut out = Vec::new();

    let y = ex.matmul(&x, &w, Some(&bias), Transpose::NT).unwrap();
    out.push(("matmul NT + bias", down(&y)));
    let g = ex
        .matmul_backward(&x, &w, &dmm, Transpose::NT, MatmulNeeds::ALL)
        .unwrap();
    out.push(("matmul NT dA", down(g.da.as_ref().unwrap())));
    out.push(("matmul NT dB", down(g.db.as_ref().unwrap())));
    out.push(("matmul NT dbias", down(g.dbias.as_ref().unwrap())));
    let y = ex.matmul(&w2, &w, None, Transpose::NN).unwrap();
    out.push(("matmul NN", down(&y)));
    let y = ex.matmul(&x, &dy, None, Transpose::TN).unwrap();
    out.push(("matmul TN", down(&y)));

    let n = ex.rmsnorm(&x, &gain, 1e-5).unwrap();
    out.push(("rmsnorm", down(&n.y)));
    let g = ex.rmsnorm_backward(&x, &gain, &n.rstd, &dy).unwrap();
    out.push(("rmsnorm dx", down(&g.dx)));
    out.push(("rmsnorm dw", down(&g.dw)));
    let n = ex.layernorm(&x, &gain, &gain, 1e-5).unwrap();
    out.push(("layernorm", down(&n.y)));
    let g = ex
        .layernorm_backward(&x, &gain, n.mean.as_ref().unwrap(), &n.rstd, &dy)
        .unwrap();
    out.push(("layernorm dx", down(&g.dx)));
    out.push(("layernorm dw", down(&g.dw)));
    out.push(("layernorm db", down(g.db.as_ref().unwrap())));
    // The fused residual add + norm of h = x + dy, with x standing in for
    // the stream's gradient dh.
    let n = ex.add_rmsnorm(&x, &dy, &gain, 1e-5).unwrap();
    out.push(("add_rmsnorm", down(&n.norm.y)));
    let g = ex
        .add_rmsnorm_backward(&n.h, &gain, &n.norm.rstd, &dy, &x)
        .unwrap();
    out.push(("add_rmsnorm dx", down(&g.dx)));
    out.push(("add_rmsnorm dw", down(&g.dw)));
    let n = ex.add_layernorm(&x, &dy, &gain, &gain, 1e-5).unwrap();
    out.push(("add_layernorm", down(&n.norm.y)));
    let mean = n.norm.mean.as_ref().unwrap();
    let g = ex
        .add_layernorm_backward(&n.h, &gain, mean, &n.norm.rstd, &dy, &x)
        .unwrap();
    out.push(("add_layernorm dx", down(&g.dx)));
    out.push(("add_layernorm dw", down(&g.dw)));

    let (q, k, v, datt) = (up(&i.q), up(&i.k), up(&i.v), up(&i.datt));
    let rope = Rope::plain(10000.0, 3);
    let qr = ex.rope(&q, rope.clone()).unwrap();
    let kr = ex.rope(&k, rope.clone()).unwrap();
    out.push(("rope", down(&qr)));
    out.push((
        "rope backward",
        down(&ex.rope_backward(&datt, rope.clone()).unwrap()),
    ));
    let a = ex.attention(&qr, &kr, &v, AttnMask::CAUSAL).unwrap();
    out.push(("attention", down(&a.out)));
    out.push(("attention lse", down(&a.lse)));
    let g = ex.attention_backward(&qr, &kr, &v, &a, &datt).unwrap();
    out.push(("attention dq", down(&g.dq)));
    out.push(("attention dk", down(&g.dk)));
    out.push(("attention dv", down(&g.dv)));
    // Soft-capped scores: in a window at a cap that bends most of them, and
    // at Gemma 2's 50, which leaves these (about ±1) nearly as they are, so
    // that only a tanh accurate near 0 keeps them as close as the CPU's.
    let capped = [
        (
            AttnMask::sliding(16),
            0.5,
            [
                "cap 0.5 attention",
                "cap 0.5 lse",
                "cap 0.5 dq",
                "cap 0.5 dk",
                "cap 0.5 dv",
            ],
        ),
        (
            AttnMask::CAUSAL,
            50.0,
            [
                "cap 50 attention",
                "cap 50 lse",
                "cap 50 dq",
                "cap 50 dk",
                "cap 50 dv",
            ],
        ),
    ];
    for (mask, cap, names) in capped {
        let mask = mask.with_softcap(SoftCap::new(cap, "test").unwrap());
        let a = ex.attention(&qr, &kr, &v, mask).unwrap();
        let g = ex.attention_backward(&qr, &kr, &v, &a, &datt).unwrap();
        for (name, t) in names.into_iter().zip([&a.out, &a.lse, &g.dq, &g.dk, &g.dv]) {
            out.push((name, down(t)));
        }
    }

    // Scaled so that the activations see their tails.
    let x6 = ex.scale(&x, 6.0).unwrap();
    out.push(("swiglu", down(&ex.swiglu(&x6, &dy).unwrap())));
    let (dg, du) = ex.swiglu_backward(&x6, &dy, &x).unwrap();
    out.push(("swiglu dgate", down(&dg)));
    out.push(("swiglu dup", down(&du)));
    out.push(("gelu", down(&ex.gelu(&x6).unwrap())));
    out.push(("gelu backward", down(&ex.gelu_backward(&x6, &dy).unwrap())));
    out.push(("gelu_erf", down(&ex.gelu_erf(&x6).unwrap())));
    out.push((
        "gelu_erf backward",
        down(&ex.gelu_erf_backward(&x6, &dy).unwrap()),
    ));
    for (cap, names) in [
        (2.0, ["softcap 2", "softcap 2 backward"]),
        (30.0, ["softcap 30", "softcap 30 backward"]),
    ] {
        let cap = SoftCap::new(cap, "test").unwrap();
        let y = ex.softcap(ex.reshape(&x6, x6.shape()).unwrap(), cap).unwrap();
        out.push((names[0], down(&y)));
        let dy = ex.reshape(&dy, dy.shape()).unwrap();
        out.push((names[1], down(&ex.softcap_backward(&y, dy, cap).unwrap())));
    }
    // The MLP's products with the activation applied at their store: the
    // forward's [ROWS, F] product, the backward's input gradient [ROWS, F].
    let gate6 = ex.scale(&dmm, 6.0).unwrap();
    let (f, ga) = ex.matmul_gelu(&x, &w, Some(&bias), Transpose::NT).unwrap();
    out.push(("matmul_gelu f", down(&f)));
    out.push(("matmul_gelu g", down(&ga)));
    let (u, s) = ex
        .matmul_swiglu(&x, &w, Some(&bias), Transpose::NT, &gate6)
        .unwrap();
    out.push(("matmul_swiglu up", down(&u)));
    out.push(("matmul_swiglu s", down(&s)));
    let g = ex
        .matmul_backward_gelu(&w2, &w, &dy, Transpose::NN, MatmulNeeds::ALL, &gate6)
        .unwrap();
    out.push(("matmul_backward_gelu da", down(g.da.as_ref().unwrap())));
    out.push(("matmul_backward_gelu db", down(g.db.as_ref().unwrap())));
    let (_, dg, du) = ex
        .matmul_backward_swiglu(&w2, &w, &dy, Transpose::NN, MatmulNeeds::ALL, &gate6, &dmm)
        .unwrap();
    out.push(("matmul_bwd_swiglu dgate", down(&dg)));
    out.push(("matmul_bwd_swiglu dup", down(&du)));
    out.push(("add", down(&ex.add(&x, &dy).unwrap())));

    let table = up(&i.table);
    let e = ex.embedding(&i.ids, &table).unwrap();
    out.push(("embedding", down(&e)));
    let mut dtable = up(&i.table);
    ex.embedding_backward(&i.ids, &dy, &mut dtable).unwrap();
    out.push(("embedding backward", down(&dtable)));
    let l = ex
        .cross_entropy(&up(&i.logits), &i.targets, -100, 1.0 / 66.0, LossTerms::NONE)
        .unwrap();
    out.push(("cross_entropy", down(&l.losses)));
    out.push(("cross_entropy dlogits", down(&l.dlogits)));
    out
}

#[test]
fn every_op_is_as_close_to_float64_as_the_cpu_reference() {
    let Some(g) = gpu() else { return };
    let mut failures = Vec::new();
    for seed in [1u64, 2] {
        let i = inputs(seed);
        let exact = run(&F64Executor::new(), &i);
        let cpu = run(&cpu(), &i);
        let gpu = run(g, &i);
        eprintln!("seed {seed}: op, CPU vs f64, GPU vs f64 (relative norm)");
        for ((name, e), ((_, c), (_, d))) in exact.iter().zip(cpu.iter().zip(&gpu)) {
            if let Some(j) = d.iter().position(|z| !z.is_finite()) {
                failures.push(format!("{name}: element {j} is {}", d[j]));
                continue;
            }
            let (ec, eg) = (rel_norm_err(c, e), rel_norm_err(d, e));
            eprintln!("  {name:24} {ec:9.2e} {eg:9.2e}");
            if eg > (RATIO * ec).max(FLOOR) {
                failures.push(format!("{name}: GPU {eg:e} from f64, CPU {ec:e}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "ops further from f64 than rounding explains:\n{}",
        failures.join("\n")
    );
}
