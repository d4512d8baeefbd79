//! One random matmul case (shapes, layout, batching, bias) and its
//! operands, shared by the f32 and f16 matmul tests.

use megatrain_tensor::{HostTensor, Transpose};
use proptest::prelude::*;

use super::rand_host;

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
