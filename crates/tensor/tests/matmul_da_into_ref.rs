//! `Executor::matmul_backward_da_into` on the reference executors: the
//! input gradient added into an accumulator has, bit for bit, what
//! `matmul_backward` then `add_assign` give (`fl(acc + fl(da))` per
//! element), under both compute precisions, with f32-, bf16- and
//! f16-stored weights, batched rows and every transpose; `db` and `dbias`
//! are those of `matmul_backward`.

use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, DType, Executor, F64Executor, HostTensor, MatmulNeeds, Transpose,
};

const ALL_T: [Transpose; 4] = [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT];

fn host(seed: u64, shape: &[usize]) -> HostTensor {
    HostTensor::from_f32(shape.to_vec(), random_f32(seed, shape.iter().product())).unwrap()
}

struct Case {
    lead: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
    b_dtype: DType,
}

impl Case {
    fn shapes(&self) -> [Vec<usize>; 3] {
        let Case { m, k, n, t, .. } = *self;
        let mut a = self.lead.clone();
        a.extend(if t.a { [k, m] } else { [m, k] });
        let b = if t.b { vec![n, k] } else { vec![k, n] };
        let mut d = self.lead.clone();
        d.extend([m, n]);
        [a, b, d]
    }
}

/// `(into, then)`: the accumulator after `matmul_backward_da_into`, and
/// after `matmul_backward` + `add_assign`, each element's bits; also checks
/// that the other gradients agree and that no `da` is returned.
fn run<E: Executor>(
    ex: &E,
    c: &Case,
    seed: u64,
    bits: impl Fn(&E::Tensor) -> Vec<u64>,
) -> (Vec<u64>, Vec<u64>) {
    let [sa, sb, sd] = c.shapes();
    let a = ex.upload(&host(seed, &sa)).unwrap();
    let b = ex.upload(&host(seed + 1, &sb).to_dtype(c.b_dtype)).unwrap();
    let d = ex.upload(&host(seed + 2, &sd)).unwrap();
    let acc0 = host(seed + 3, &sa);
    let mut acc = ex.upload(&acc0).unwrap();
    let needs = MatmulNeeds {
        da: false,
        db: true,
        dbias: true,
    };
    let g = ex
        .matmul_backward_da_into(&a, &b, &d, c.t, needs, &mut acc)
        .unwrap();
    assert!(g.da.is_none(), "matmul_backward_da_into returned a da");
    let r = ex.matmul_backward(&a, &b, &d, c.t, MatmulNeeds::ALL).unwrap();
    assert_eq!(bits(g.db.as_ref().unwrap()), bits(r.db.as_ref().unwrap()), "db");
    assert_eq!(
        bits(g.dbias.as_ref().unwrap()),
        bits(r.dbias.as_ref().unwrap()),
        "dbias"
    );
    let mut want = ex.upload(&acc0).unwrap();
    ex.add_assign(&mut want, r.da.as_ref().unwrap()).unwrap();
    (bits(&acc), bits(&want))
}

#[test]
fn accumulated_input_gradient_has_the_bits_of_compute_then_add() {
    let mut seed = 1;
    for t in ALL_T {
        for (lead, m, k, n) in [(vec![], 37, 45, 70), (vec![2, 3], 5, 13, 9), (vec![3], 1, 7, 130)] {
            for b_dtype in [DType::F32, DType::BF16, DType::F16] {
                seed += 10;
                let c = Case {
                    lead: lead.clone(),
                    m,
                    k,
                    n,
                    t,
                    b_dtype,
                };
                let what = format!("lead {:?} m {m} k {k} n {n} {t:?} b {b_dtype}", c.lead);
                for precision in [ComputePrecision::F32, ComputePrecision::F16] {
                    let ex = CpuExecutor::with_precision(precision);
                    let (got, want) = run(&ex, &c, seed, |t| {
                        t.data().iter().map(|v| v.to_bits() as u64).collect()
                    });
                    assert!(
                        got == want,
                        "f32 {precision:?} {what}: differs from compute-then-add"
                    );
                }
                let ex = F64Executor::new();
                let (got, want) = run(&ex, &c, seed, |t| t.data().iter().map(|v| v.to_bits()).collect());
                assert!(got == want, "f64 {what}: differs from compute-then-add");
            }
        }
    }
}

#[test]
fn accumulator_of_the_wrong_shape_or_dtype_is_an_error() {
    let ex = CpuExecutor::new();
    let a = ex.upload(&host(1, &[4, 3])).unwrap();
    let b = ex.upload(&host(2, &[5, 3])).unwrap();
    let d = ex.upload(&host(3, &[4, 5])).unwrap();
    let needs = MatmulNeeds::ALL;
    let mut wrong = ex.upload(&host(4, &[3, 4])).unwrap();
    let e = ex
        .matmul_backward_da_into(&a, &b, &d, Transpose::NT, needs, &mut wrong)
        .unwrap_err();
    assert!(
        e.to_string().contains("[3, 4]") && e.to_string().contains("da_acc"),
        "{e}"
    );
    let mut packed = ex.upload(&host(4, &[4, 3]).to_dtype(DType::BF16)).unwrap();
    assert!(
        ex.matmul_backward_da_into(&a, &b, &d, Transpose::NT, needs, &mut packed)
            .is_err()
    );
}
