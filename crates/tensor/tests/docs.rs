//! Documents packed in a row ([`Docs`]) against each document alone in a
//! row of its own: attention forward and backward and RoPE must give the
//! same numbers token for token, and the backward must match finite
//! differences under the packed mask.

use megatrain_tensor::testing::{dot, finite_diff, random_f64, rel_norm_err};
use megatrain_tensor::{
    AttnMask, CpuTensor, Docs, Executor, F64Executor, Rope, RopeScaling, Shape, SoftCap, TensorHandle,
};

type T = CpuTensor<f64>;
const EX: F64Executor = F64Executor::new();

fn rand_t(seed: u64, shape: &[usize]) -> T {
    T::from_vec(shape.to_vec(), random_f64(seed, Shape::from(shape).numel())).unwrap()
}

/// Tokens `a..z` of row `b` of `x: [B, T, H, D]`, as a `[1, z − a, H, D]`.
fn span(x: &T, b: usize, a: usize, z: usize) -> T {
    let [_, t, h, d] = <[usize; 4]>::try_from(x.dims()).unwrap();
    let data = x.data()[(b * t + a) * h * d..(b * t + z) * h * d].to_vec();
    T::from_vec(vec![1, z - a, h, d], data).unwrap()
}

/// Every document of `starts` (rows of `t`), each alone: `(row, a, z)`.
fn documents(t: usize, starts: &[Vec<usize>]) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for (b, s) in starts.iter().enumerate() {
        for (n, &a) in s.iter().enumerate() {
            out.push((b, a, s.get(n + 1).copied().unwrap_or(t)));
        }
    }
    out
}

fn assert_same(what: &str, packed: &[f64], alone: &[f64]) {
    let err = packed
        .iter()
        .zip(alone)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(err < 1e-12, "{what}: packed and alone differ by {err:e}");
}

const LAYOUTS: [(usize, usize, usize, usize, usize); 3] = [(2, 9, 4, 2, 3), (1, 7, 2, 2, 4), (2, 6, 3, 1, 2)];

fn starts_of(case: usize) -> Vec<Vec<usize>> {
    [
        vec![vec![0, 3, 4], vec![0, 8]],
        vec![vec![0, 1, 2, 5]],
        vec![vec![0], vec![0, 2]],
    ][case]
        .clone()
}

/// Packed attention is each document's own causal (or windowed, or
/// capped) attention: out, lse, dq, dk and dv, token for token.
#[test]
fn attention_of_packed_rows_is_each_document_alone() {
    let cap = SoftCap::new(0.7, "test").unwrap();
    let masks = [
        AttnMask::CAUSAL,
        AttnMask::sliding(2),
        AttnMask::CAUSAL.with_softcap(cap),
    ];
    for (case, &(b, t, hq, hkv, d)) in LAYOUTS.iter().enumerate() {
        let starts = starts_of(case);
        let docs = Docs::new(t, &starts).unwrap();
        for mask in masks.iter() {
            let seed = 10 * case as u64;
            let (q, k, v) = (
                rand_t(seed, &[b, t, hq, d]),
                rand_t(seed + 1, &[b, t, hkv, d]),
                rand_t(seed + 2, &[b, t, hkv, d]),
            );
            let cot = rand_t(seed + 3, &[b, t, hq, d]);
            let packed = mask.clone().with_docs(Some(docs.clone()));
            let fw = EX.attention(&q, &k, &v, packed).unwrap();
            let g = EX.attention_backward(&q, &k, &v, &fw, &cot).unwrap();
            for (row, a, z) in documents(t, &starts) {
                let what = format!("case {case} {mask:?} row {row} tokens {a}..{z}");
                let one = |x: &T| span(x, row, a, z);
                let fa = EX.attention(&one(&q), &one(&k), &one(&v), mask.clone()).unwrap();
                let ga = EX
                    .attention_backward(&one(&q), &one(&k), &one(&v), &fa, &one(&cot))
                    .unwrap();
                assert_same(&format!("{what} out"), one(&fw.out).data(), fa.out.data());
                for h in 0..hq {
                    let at = (row * hq + h) * t;
                    assert_same(
                        &format!("{what} lse"),
                        &fw.lse.data()[at + a..at + z],
                        &fa.lse.data()[h * (z - a)..][..z - a],
                    );
                }
                assert_same(&format!("{what} dq"), one(&g.dq).data(), ga.dq.data());
                assert_same(&format!("{what} dk"), one(&g.dk).data(), ga.dk.data());
                assert_same(&format!("{what} dv"), one(&g.dv).data(), ga.dv.data());
            }
        }
    }
}

#[test]
fn attention_backward_under_packed_mask_matches_finite_differences() {
    let (b, t, hq, hkv, d) = LAYOUTS[0];
    let docs = Docs::new(t, &starts_of(0)).unwrap();
    let mask = AttnMask::sliding(3).with_docs(Some(docs));
    let (q, k, v) = (
        rand_t(40, &[b, t, hq, d]),
        rand_t(41, &[b, t, hkv, d]),
        rand_t(42, &[b, t, hkv, d]),
    );
    let cot = rand_t(43, &[b, t, hq, d]);
    let fw = EX.attention(&q, &k, &v, mask.clone()).unwrap();
    let g = EX.attention_backward(&q, &k, &v, &fw, &cot).unwrap();
    let inputs = [q, k, v];
    for (i, an) in [g.dq.data(), g.dk.data(), g.dv.data()].into_iter().enumerate() {
        let shape = inputs[i].shape().clone();
        let num = finite_diff(inputs[i].data(), 1e-5, |x| {
            let mut ins = inputs.to_vec();
            ins[i] = T::from_vec(shape.clone(), x.to_vec()).unwrap();
            dot(
                EX.attention(&ins[0], &ins[1], &ins[2], mask.clone())
                    .unwrap()
                    .out
                    .data(),
                cot.data(),
            )
        });
        let err = rel_norm_err(an, &num);
        assert!(err < 1e-7, "input {i}: relative error {err:e}");
    }
}

/// RoPE counts each token's position from its document's first token, for
/// the plain layout, a partial rotation, the interleaved one and YaRN.
#[test]
fn rope_of_packed_rows_is_each_document_alone() {
    let yarn = RopeScaling::Yarn {
        factor: 4.0,
        original_max_positions: 4.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 1.25,
    };
    let (b, t, h, d) = (2, 9, 2, 6);
    let starts = starts_of(0);
    let docs = Docs::new(t, &starts).unwrap();
    for (scaling, rotary_dim, interleaved, offset) in [
        (RopeScaling::None, None, false, 0),
        (yarn.clone(), Some(4), false, 3),
        (yarn, Some(4), true, 0),
    ] {
        let rope = Rope {
            scaling,
            rotary_dim,
            interleaved,
            ..Rope::plain(100.0, offset)
        };
        let x = rand_t(50, &[b, t, h, d]);
        let packed = rope.clone().with_docs(Some(docs.clone()));
        let (y, dx) = (
            EX.rope(&x, packed.clone()).unwrap(),
            EX.rope_backward(&x, packed).unwrap(),
        );
        for (row, a, z) in documents(t, &starts) {
            // The frequencies are those of the packed row's length, as an
            // unpacked row padded to it has.
            let alone = |x: &T, back: bool| {
                let mut padded = vec![0.0; t * h * d];
                padded[..(z - a) * h * d].copy_from_slice(span(x, row, a, z).data());
                let p = T::from_vec(vec![1, t, h, d], padded).unwrap();
                let r = match back {
                    false => EX.rope(&p, rope.clone()),
                    true => EX.rope_backward(&p, rope.clone()),
                };
                r.unwrap().data()[..(z - a) * h * d].to_vec()
            };
            let what = format!("{rope:?} row {row} tokens {a}..{z}");
            assert_same(&what, span(&y, row, a, z).data(), &alone(&x, false));
            assert_same(&what, span(&dx, row, a, z).data(), &alone(&x, true));
        }
    }
}

#[test]
fn documents_of_another_batch_are_refused() {
    let docs = Docs::new(5, &[vec![0, 2]]).unwrap();
    let q = rand_t(1, &[2, 5, 2, 2]);
    let e = EX
        .attention(&q, &q, &q, AttnMask::CAUSAL.with_docs(Some(docs.clone())))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("documents of a [1, 5] batch given for a [2, 5] one"),
        "{e}"
    );
    let e = EX
        .rope(&q, Rope::plain(1e4, 0).with_docs(Some(docs)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("documents of a [1, 5] batch"), "{e}");
}
