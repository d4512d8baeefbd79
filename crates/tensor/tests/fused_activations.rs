//! The matmuls fused with an activation (`matmul_gelu`, `matmul_swiglu`,
//! `matmul_backward_gelu`, `matmul_backward_swiglu`): on the reference
//! executors they are the composition of the unfused ops, bit for bit; the
//! fused backwards are the gradients of the fused forwards by central
//! finite differences in f64; bad operands are errors naming them.

use megatrain_tensor::testing::{dot, grad_check, random_f64};
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, CpuTensor, Executor, F64Executor, Glu, HostTensor, MatmulNeeds, Shape,
    Transpose, compose_matmul_backward_gelu, compose_matmul_backward_glu, compose_matmul_backward_swiglu,
    compose_matmul_gelu, compose_matmul_glu, compose_matmul_swiglu,
};

type T = CpuTensor<f64>;
const EX: F64Executor = F64Executor::new();

fn rand_t(seed: u64, shape: &[usize], scale: f64) -> T {
    let v = random_f64(seed, Shape::from(shape).numel());
    T::from_vec(shape.to_vec(), v.iter().map(|x| scale * x).collect()).unwrap()
}

/// (lead dims, m, k, n, transpose, b batched like a).
fn cases() -> Vec<(Vec<usize>, usize, usize, usize, Transpose, bool)> {
    vec![
        (vec![], 3, 4, 5, Transpose::NN, false),
        (vec![2], 3, 4, 5, Transpose::NT, false),
        (vec![], 4, 3, 5, Transpose::TN, false),
        (vec![2], 2, 3, 4, Transpose::NN, true),
    ]
}

fn shapes(lead: &[usize], m: usize, k: usize, n: usize, t: Transpose, bb: bool) -> [Vec<usize>; 3] {
    let mut sa = lead.to_vec();
    sa.extend(if t.a { [k, m] } else { [m, k] });
    let mut sb = if bb { lead.to_vec() } else { vec![] };
    sb.extend(if t.b { [n, k] } else { [k, n] });
    let mut sy = lead.to_vec();
    sy.extend([m, n]);
    [sa, sb, sy]
}

#[test]
fn matmul_backward_gelu_is_the_gradient_through_gelu() {
    for (seed, (lead, m, k, n, t, bb)) in cases().into_iter().enumerate() {
        let seed = 100 * seed as u64;
        let [sa, sb, sy] = shapes(&lead, m, k, n, t, bb);
        // Pre-activations over [-4, 4]: both tails of the tanh.
        let (pre, b, bias) = (
            rand_t(seed, &sa, 4.0),
            rand_t(seed + 1, &sb, 1.0),
            rand_t(seed + 2, &[n], 1.0),
        );
        let cot = rand_t(seed + 3, &sy, 1.0);
        let a = EX.gelu(&pre).unwrap();
        let g = EX
            .matmul_backward_gelu(&a, &b, &cot, t, MatmulNeeds::ALL, &pre)
            .unwrap();
        let (dpre, db, dbias) = (g.da.unwrap(), g.db.unwrap(), g.dbias.unwrap());
        let name = format!("gelu {lead:?} {t:?} b batched {bb}");
        grad_check(
            &name,
            &[pre, b, bias],
            &[dpre.data(), db.data(), dbias.data()],
            |x| {
                let a = EX.gelu(&x[0]).unwrap();
                dot(EX.matmul(&a, &x[1], Some(&x[2]), t).unwrap().data(), cot.data())
            },
        );
    }
}

#[test]
fn matmul_backward_swiglu_is_the_gradient_through_swiglu() {
    for (seed, (lead, m, k, n, t, bb)) in cases().into_iter().enumerate() {
        let seed = 100 * seed as u64 + 7;
        let [sa, sb, sy] = shapes(&lead, m, k, n, t, bb);
        let (gate, up) = (rand_t(seed, &sa, 3.0), rand_t(seed + 1, &sa, 1.0));
        let b = rand_t(seed + 2, &sb, 1.0);
        let cot = rand_t(seed + 3, &sy, 1.0);
        let a = EX.swiglu(&gate, &up).unwrap();
        let (g, dgate, dup) = EX
            .matmul_backward_swiglu(&a, &b, &cot, t, MatmulNeeds::ALL, &gate, &up)
            .unwrap();
        assert!(g.da.is_none(), "the swiglu backward returns no da");
        let name = format!("swiglu {lead:?} {t:?} b batched {bb}");
        grad_check(
            &name,
            &[gate, up, b],
            &[dgate.data(), dup.data(), g.db.unwrap().data()],
            |x| {
                let a = EX.swiglu(&x[0], &x[1]).unwrap();
                dot(EX.matmul(&a, &x[2], None, t).unwrap().data(), cot.data())
            },
        );
    }
}

fn host(seed: u64, shape: &[usize]) -> HostTensor {
    megatrain_tensor::testing::random_tensor(seed, Shape::new(shape.to_vec()))
}

fn bits<E: Executor>(ex: &E, t: &E::Tensor) -> Vec<u32> {
    ex.download(t)
        .unwrap()
        .to_f32_vec()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Each fused op against its composition on one executor: the same bits.
fn fused_equals_composition<E: Executor>(ex: &E, what: &str) {
    for (seed, (lead, m, k, n, t, bb)) in cases().into_iter().enumerate() {
        let seed = 1000 + 10 * seed as u64;
        let what = format!("{what} {lead:?} {t:?} b batched {bb}");
        let [sa, sb, sy] = shapes(&lead, m, k, n, t, bb);
        let up = |h: HostTensor| ex.upload(&h).unwrap();
        let (a, b, bias) = (
            up(host(seed, &sa)),
            up(host(seed + 1, &sb)),
            up(host(seed + 2, &[n])),
        );
        let (gate, y2, dout) = (
            up(host(seed + 3, &sy)),
            up(host(seed + 4, &sa)),
            up(host(seed + 5, &sy)),
        );

        let (f, g) = ex.matmul_gelu(&a, &b, Some(&bias), t).unwrap();
        let (cf, cg) = compose_matmul_gelu(ex, &a, &b, Some(&bias), t).unwrap();
        assert_eq!(
            (bits(ex, &f), bits(ex, &g)),
            (bits(ex, &cf), bits(ex, &cg)),
            "{what}: matmul_gelu"
        );

        let (u, s) = ex.matmul_swiglu(&a, &b, Some(&bias), t, &gate).unwrap();
        let (cu, cs) = compose_matmul_swiglu(ex, &a, &b, Some(&bias), t, &gate).unwrap();
        assert_eq!(
            (bits(ex, &u), bits(ex, &s)),
            (bits(ex, &cu), bits(ex, &cs)),
            "{what}: matmul_swiglu"
        );

        let (u, s) = ex.matmul_geglu(&a, &b, Some(&bias), t, &gate).unwrap();
        let (cu, cs) = compose_matmul_glu(ex, &a, &b, Some(&bias), t, &gate, Glu::Gelu).unwrap();
        assert_eq!(
            (bits(ex, &u), bits(ex, &s)),
            (bits(ex, &cu), bits(ex, &cs)),
            "{what}: matmul_geglu"
        );

        let gr = ex
            .matmul_backward_gelu(&a, &b, &dout, t, MatmulNeeds::ALL, &y2)
            .unwrap();
        let cr = compose_matmul_backward_gelu(ex, &a, &b, &dout, t, MatmulNeeds::ALL, &y2).unwrap();
        for (x, y, name) in [
            (&gr.da, &cr.da, "da"),
            (&gr.db, &cr.db, "db"),
            (&gr.dbias, &cr.dbias, "dbias"),
        ] {
            assert_eq!(
                bits(ex, x.as_ref().unwrap()),
                bits(ex, y.as_ref().unwrap()),
                "{what}: gelu {name}"
            );
        }

        let (gr, dg, du) = ex
            .matmul_backward_swiglu(&a, &b, &dout, t, MatmulNeeds::ALL, &y2, &a)
            .unwrap();
        let (cr, cdg, cdu) =
            compose_matmul_backward_swiglu(ex, &a, &b, &dout, t, MatmulNeeds::ALL, &y2, &a).unwrap();
        assert_eq!(
            (bits(ex, &dg), bits(ex, &du)),
            (bits(ex, &cdg), bits(ex, &cdu)),
            "{what}: swiglu"
        );
        assert_eq!(
            bits(ex, gr.db.as_ref().unwrap()),
            bits(ex, cr.db.as_ref().unwrap()),
            "{what}: swiglu db"
        );

        let (_, dg, du) = ex
            .matmul_backward_geglu(&a, &b, &dout, t, MatmulNeeds::ALL, &y2, &a)
            .unwrap();
        let (_, cdg, cdu) =
            compose_matmul_backward_glu(ex, &a, &b, &dout, t, MatmulNeeds::ALL, &y2, &a, Glu::Gelu).unwrap();
        assert_eq!(
            (bits(ex, &dg), bits(ex, &du)),
            (bits(ex, &cdg), bits(ex, &cdu)),
            "{what}: geglu"
        );
    }
}

#[test]
fn reference_executors_fuse_by_composing() {
    fused_equals_composition(&CpuExecutor::new(), "cpu f32");
    fused_equals_composition(&CpuExecutor::with_precision(ComputePrecision::F16), "cpu f16");
    fused_equals_composition(&F64Executor::new(), "f64");
}

#[test]
fn bad_activation_operands_are_named() {
    let ex = CpuExecutor::new();
    let up = |h: HostTensor| ex.upload(&h).unwrap();
    let (a, b, dout) = (up(host(1, &[3, 4])), up(host(2, &[4, 5])), up(host(3, &[3, 5])));
    let wrong = up(host(4, &[4, 3]));
    let e = ex
        .matmul_backward_gelu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("pre [4, 3]") && e.contains("a's shape"), "{e}");
    let e = ex
        .matmul_backward_swiglu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &a, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("up [4, 3]"), "{e}");
    let e = ex
        .matmul_swiglu(&a, &b, None, Transpose::NN, &wrong)
        .unwrap_err()
        .to_string();
    assert!(e.contains("gate [4, 3]") && e.contains("product"), "{e}");
    let bf = up(host(5, &[3, 4]).to_dtype(megatrain_tensor::DType::BF16));
    let e = ex
        .matmul_backward_gelu(&a, &b, &dout, Transpose::NN, MatmulNeeds::ALL, &bf)
        .unwrap_err()
        .to_string();
    assert!(e.contains("matmul_backward_gelu"), "{e}");
}
