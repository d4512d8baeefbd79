//! One random matmul case (shapes, layout, batching, bias) and its
//! operands, shared by the f32 and f16 matmul tests.

use megatrain_tensor::{Executor, HostTensor, MatmulNeeds, Transpose};
use proptest::prelude::*;

use super::{down_cpu, rand_host};

#[derive(Debug, Clone)]
pub struct Case {
    pub batch: Vec<usize>,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub t: Transpose,
    pub shared_b: bool,
    pub bias: bool,
    pub seed: u64,
}

/// M, N, K below `max`; up to one batch dimension below `max_batch`.
pub fn case(max: usize, max_batch: usize) -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(1usize..max_batch, 0..2),
        1..max,
        1..max,
        1..max,
        any::<(bool, bool, bool, bool)>(),
        any::<u64>(),
    )
        .prop_map(|(batch, m, n, k, (ta, tb, shared_b, bias), seed)| Case {
            shared_b: shared_b || batch.is_empty(),
            batch,
            m,
            n,
            k,
            t: Transpose { a: ta, b: tb },
            bias,
            seed,
        })
}

/// Random `(a, b, bias, dout)` of the case's shapes.
pub fn operands(c: &Case) -> (HostTensor, HostTensor, HostTensor, HostTensor) {
    let mut ad = c.batch.clone();
    ad.extend(if c.t.a { [c.k, c.m] } else { [c.m, c.k] });
    let mut bd = if c.shared_b { vec![] } else { c.batch.clone() };
    bd.extend(if c.t.b { [c.n, c.k] } else { [c.k, c.n] });
    let mut od = c.batch.clone();
    od.extend([c.m, c.n]);
    (
        rand_host(c.seed, &ad),
        rand_host(c.seed ^ 1, &bd),
        rand_host(c.seed ^ 2, &[c.n]),
        rand_host(c.seed ^ 3, &od),
    )
}

/// Products whose whole 128x128 tiles run on the SIMT interior pipelines
/// (K a multiple of 16, every leading dimension a multiple of 4) with M and
/// N edge strips around them, for all four layouts, batched or not; then
/// shapes just off each condition (a leading dimension of 131, K = 40),
/// which must run wholly on the checked kernel and agree all the same.
pub fn interior_cases() -> Vec<Case> {
    let mut v = Vec::new();
    for (i, t) in [Transpose::NN, Transpose::NT, Transpose::TN, Transpose::TT]
        .into_iter()
        .enumerate()
    {
        let seed = 40 + 8 * i as u64;
        let c = |batch: Vec<usize>, m, n, k, shared_b, bias, s| Case {
            batch,
            m,
            n,
            k,
            t,
            shared_b,
            bias,
            seed: seed + s,
        };
        v.push(c(vec![2], 260, 132, 48, i % 2 == 0, true, 0));
        v.push(c(vec![], 256, 128, 32, true, false, 1));
        v.push(c(vec![], 131, 256, 64, true, true, 2));
        v.push(c(vec![], 256, 260, 40, true, false, 3));
    }
    v
}

/// The norms of y, da, db and dbias computed on the operands' absolute
/// values: the size of the terms each element of those sums.
pub fn abs_terms(cpu: &megatrain_tensor::CpuExecutor, c: &Case, ops: [&HostTensor; 4]) -> [f64; 4] {
    let [a, b, bias, dout] = ops.map(|h| {
        let abs: Vec<f32> = h.to_f32_vec().iter().map(|x| x.abs()).collect();
        cpu.upload(&HostTensor::from_f32(h.shape().clone(), abs).unwrap())
            .unwrap()
    });
    let norm = |t: &<megatrain_tensor::CpuExecutor as Executor>::Tensor| {
        down_cpu(cpu, t)
            .iter()
            .map(|&x| (x as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let y = cpu.matmul(&a, &b, c.bias.then_some(&bias), c.t).unwrap();
    let r = cpu.matmul_backward(&a, &b, &dout, c.t, MatmulNeeds::ALL).unwrap();
    [
        norm(&y),
        norm(r.da.as_ref().unwrap()),
        norm(r.db.as_ref().unwrap()),
        norm(r.dbias.as_ref().unwrap()),
    ]
}
