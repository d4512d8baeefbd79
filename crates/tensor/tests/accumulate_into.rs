//! `Executor::matmul_backward_into` and `matmul_backward_da_into` on the
//! reference executors: the weight (`db`) or input (`da`) gradient added
//! into an accumulator has, bit for bit, what `matmul_backward` then
//! `add_assign` give (`fl(acc + fl(g))` per element), under both compute
//! precisions, with f32-, bf16- and f16-stored weights, batched rows and
//! every transpose; the other gradients are those of `matmul_backward`.
//! The weight-sized cases span two of the 2^22-element panels the
//! accumulation computes at a time.

use megatrain_tensor::testing::random_f32;
use megatrain_tensor::{
    ComputePrecision, CpuExecutor, DType, Executor, F64Executor, HostTensor, MatmulGrads, MatmulNeeds,
    Result, Transpose,
};

const ALL_T: [Transpose; 4] = [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT];

fn host(seed: u64, shape: &[usize]) -> HostTensor {
    HostTensor::from_f32(shape.to_vec(), random_f32(seed, shape.iter().product())).unwrap()
}

/// Which gradient the op under test adds into the accumulator.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Acc {
    /// `matmul_backward_da_into`: the accumulator has `a`'s shape.
    Da,
    /// `matmul_backward_into`: the accumulator has `b`'s shape.
    Db,
}

impl Acc {
    fn name(self) -> &'static str {
        match self {
            Acc::Da => "da",
            Acc::Db => "db",
        }
    }

    /// Every gradient but the accumulated one.
    fn needs(self) -> MatmulNeeds {
        MatmulNeeds {
            da: self == Acc::Db,
            db: self == Acc::Da,
            dbias: true,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn into<E: Executor>(
        self,
        ex: &E,
        a: &E::Tensor,
        b: &E::Tensor,
        d: &E::Tensor,
        t: Transpose,
        needs: MatmulNeeds,
        acc: &mut E::Tensor,
    ) -> Result<MatmulGrads<E::Tensor>> {
        match self {
            Acc::Da => ex.matmul_backward_da_into(a, b, d, t, needs, acc),
            Acc::Db => ex.matmul_backward_into(a, b, d, t, needs, acc),
        }
    }
}

/// The three gradients by name.
fn named<T>(g: &MatmulGrads<T>) -> [(&'static str, Option<&T>); 3] {
    [
        ("da", g.da.as_ref()),
        ("db", g.db.as_ref()),
        ("dbias", g.dbias.as_ref()),
    ]
}

struct Case {
    acc: Acc,
    lead: Vec<usize>,
    m: usize,
    k: usize,
    n: usize,
    t: Transpose,
    b_dtype: DType,
}

impl Case {
    /// `a`, `b`, `dout` and the accumulator.
    fn shapes(&self) -> [Vec<usize>; 4] {
        let Case { m, k, n, t, .. } = *self;
        let mut a = self.lead.clone();
        a.extend(if t.a { [k, m] } else { [m, k] });
        let b = if t.b { vec![n, k] } else { vec![k, n] };
        let mut d = self.lead.clone();
        d.extend([m, n]);
        let acc = match self.acc {
            Acc::Da => a.clone(),
            Acc::Db => b.clone(),
        };
        [a, b, d, acc]
    }
}

/// `(into, then)`: the accumulator after the accumulating backward, and
/// after `matmul_backward` + `add_assign`, each element's bits; also checks
/// that the other gradients agree and that the accumulated one is not
/// returned.
fn run<E: Executor>(
    ex: &E,
    c: &Case,
    seed: u64,
    bits: impl Fn(&E::Tensor) -> Vec<u64>,
) -> (Vec<u64>, Vec<u64>) {
    let [sa, sb, sd, sacc] = c.shapes();
    let a = ex.upload(&host(seed, &sa)).unwrap();
    let b = ex.upload(&host(seed + 1, &sb).to_dtype(c.b_dtype)).unwrap();
    let d = ex.upload(&host(seed + 2, &sd)).unwrap();
    let acc0 = host(seed + 3, &sacc);
    let mut acc = ex.upload(&acc0).unwrap();
    let g = c.acc.into(ex, &a, &b, &d, c.t, c.acc.needs(), &mut acc).unwrap();
    let r = ex.matmul_backward(&a, &b, &d, c.t, MatmulNeeds::ALL).unwrap();
    let mut accumulated = None;
    for ((name, got), (_, all)) in named(&g).into_iter().zip(named(&r)) {
        if name == c.acc.name() {
            assert!(got.is_none(), "{:?} returned a {name}", c.acc);
            accumulated = all;
        } else {
            assert_eq!(bits(got.unwrap()), bits(all.unwrap()), "{name}");
        }
    }
    let mut want = ex.upload(&acc0).unwrap();
    ex.add_assign(&mut want, accumulated.unwrap()).unwrap();
    (bits(&acc), bits(&want))
}

fn check(c: &Case, seed: u64) {
    let what = format!(
        "{:?} lead {:?} m {} k {} n {} {:?} b {}",
        c.acc, c.lead, c.m, c.k, c.n, c.t, c.b_dtype
    );
    for precision in [ComputePrecision::F32, ComputePrecision::F16] {
        let ex = CpuExecutor::with_precision(precision);
        let (got, want) = run(&ex, c, seed, |t| {
            t.data().iter().map(|v| v.to_bits() as u64).collect()
        });
        assert!(
            got == want,
            "f32 {precision:?} {what}: accumulated gradient differs from compute-then-add"
        );
    }
    let ex = F64Executor::new();
    let (got, want) = run(&ex, c, seed, |t| t.data().iter().map(|v| v.to_bits()).collect());
    assert!(
        got == want,
        "f64 {what}: accumulated gradient differs from compute-then-add"
    );
}

/// Every transpose, dtype of `b` and a few awkward shapes, batched or not.
fn every_layout(acc: Acc) {
    let mut seed = 1;
    for t in ALL_T {
        for (lead, m, k, n) in [(vec![], 37, 45, 70), (vec![2, 3], 5, 13, 9), (vec![3], 1, 7, 130)] {
            for b_dtype in [DType::F32, DType::BF16, DType::F16] {
                seed += 10;
                let c = Case {
                    acc,
                    lead: lead.clone(),
                    m,
                    k,
                    n,
                    t,
                    b_dtype,
                };
                check(&c, seed);
            }
        }
    }
}

#[test]
fn accumulated_weight_gradient_has_the_bits_of_compute_then_add() {
    every_layout(Acc::Db);
}

#[test]
fn accumulated_input_gradient_has_the_bits_of_compute_then_add() {
    every_layout(Acc::Da);
}

/// The LM head's layout (NT, `b` = `[V, C]`) and the NN one, with a weight
/// of more than one panel: 2100 × 2001 is 2 panels of rows, the last short
/// (and `da`'s panels of `op(b)ᵀ`, 2100 rows by 1997 columns, 2 as well).
#[test]
fn weight_of_several_panels() {
    for acc in [Acc::Db, Acc::Da] {
        for (t, b_dtype) in [(Transpose::NT, DType::F32), (Transpose::NN, DType::BF16)] {
            let c = Case {
                acc,
                lead: vec![],
                m: 7,
                k: 2001,
                n: 2100,
                t,
                b_dtype,
            };
            check(&c, 900);
        }
        // Batched rows (a of [2, 3, C]) summed into the shared weight.
        let c = Case {
            acc,
            lead: vec![2],
            m: 3,
            k: 2001,
            n: 2100,
            t: Transpose::NT,
            b_dtype: DType::F16,
        };
        check(&c, 950);
    }
}

#[test]
fn accumulator_of_the_wrong_shape_or_dtype_is_an_error() {
    let ex = CpuExecutor::new();
    let (sa, sb) = ([4, 3], [5, 3]);
    let a = ex.upload(&host(1, &sa)).unwrap();
    let b = ex.upload(&host(2, &sb)).unwrap();
    let d = ex.upload(&host(3, &[4, 5])).unwrap();
    let needs = MatmulNeeds::ALL;
    for acc in [Acc::Db, Acc::Da] {
        let mut right = if acc == Acc::Da { sa } else { sb };
        right.reverse();
        let mut wrong = ex.upload(&host(4, &right)).unwrap();
        let e = acc
            .into(&ex, &a, &b, &d, Transpose::NT, needs, &mut wrong)
            .unwrap_err();
        let (shape, name) = (format!("{right:?}"), format!("{}_acc", acc.name()));
        assert!(
            e.to_string().contains(&shape) && e.to_string().contains(&name),
            "{acc:?}: {e}"
        );
        right.reverse();
        let mut packed = ex.upload(&host(4, &right).to_dtype(DType::BF16)).unwrap();
        assert!(
            acc.into(&ex, &a, &b, &d, Transpose::NT, needs, &mut packed)
                .is_err(),
            "{acc:?}: a bf16 accumulator"
        );
    }
}
