//! Documents packed in a row ([`Docs`]) against each document alone in a
//! row of its own: attention forward and backward, RoPE, the Gated
//! DeltaNet's short convolution and its delta rule must give the same
//! numbers token for token, and the backwards must match finite
//! differences under the packed documents.

use megatrain_tensor::testing::{delta_rule_inputs, dot, grad_check, random_f64, rel_norm_err};
use megatrain_tensor::{
    AttnMask, CpuTensor, DELTA_RULE_CHUNK, Docs, Executor, F64Executor, Rope, RopeScaling, Shape, SoftCap,
    TensorHandle,
};

type T = CpuTensor<f64>;
const EX: F64Executor = F64Executor::new();

fn rand_t(seed: u64, shape: &[usize]) -> T {
    T::from_vec(shape.to_vec(), random_f64(seed, Shape::from(shape).numel())).unwrap()
}

/// Tokens `a..z` of row `b` of `x: [B, T, ..]`, as a `[1, z − a, ..]`.
fn span(x: &T, b: usize, a: usize, z: usize) -> T {
    let (t, rest) = (x.dims()[1], &x.dims()[2..]);
    let per: usize = rest.iter().product();
    let data = x.data()[(b * t + a) * per..(b * t + z) * per].to_vec();
    T::from_vec([&[1, z - a], rest].concat(), data).unwrap()
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
        for mask in masks.clone() {
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
    let analytic = [g.dq.data(), g.dk.data(), g.dv.data()];
    grad_check("attention under documents", &[q, k, v], &analytic, |i| {
        dot(
            EX.attention(&i[0], &i[1], &i[2], mask.clone())
                .unwrap()
                .out
                .data(),
            cot.data(),
        )
    });
}

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
        .rope(&q, Rope::plain(1e4, 0).with_docs(Some(docs.clone())))
        .unwrap_err()
        .to_string();
    assert!(e.contains("documents of a [1, 5] batch"), "{e}");
    let (x, w) = (rand_t(2, &[2, 5, 3]), rand_t(3, &[3, 2]));
    let e = EX
        .causal_conv1d_silu(&x, &w, Some(&docs))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("causal_conv1d_silu") && e.contains("[1, 5] batch"),
        "{e}"
    );
    let e = EX
        .causal_conv1d_silu_backward(&x, &w, &x, Some(&docs))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("causal_conv1d_silu_backward") && e.contains("[1, 5] batch"),
        "{e}"
    );
    let [q, k, v, g, beta] = delta_rule_inputs(4, [2, 5, 1, 1, 2, 2], false);
    let e = EX
        .gated_delta_rule(&q, &k, &v, &g, &beta, Some(&docs))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gated_delta_rule") && e.contains("[1, 5] batch"),
        "{e}"
    );
}

/// Rows of a short convolution's documents: shorter than its K = 4 taps,
/// of one token, and a row of one document.
const CONV_STARTS: [&[usize]; 2] = [&[0, 3, 4], &[0]];

/// The convolution restarts at each document: y and dx token for token,
/// and dw the sum of each document's own.
#[test]
fn causal_conv1d_of_packed_rows_is_each_document_alone() {
    let (b, t, c, k) = (2, 9, 3, 4);
    let starts: Vec<Vec<usize>> = CONV_STARTS.iter().map(|s| s.to_vec()).collect();
    let docs = Docs::new(t, &starts).unwrap();
    let x = T::from_vec(
        vec![b, t, c],
        random_f64(60, b * t * c).iter().map(|v| 2.0 * v).collect(),
    )
    .unwrap();
    let w = rand_t(61, &[c, k]);
    let dy = rand_t(62, &[b, t, c]);
    let y = EX.causal_conv1d_silu(&x, &w, Some(&docs)).unwrap();
    let (dx, dw) = EX.causal_conv1d_silu_backward(&x, &w, &dy, Some(&docs)).unwrap();
    let mut dw_alone = vec![0.0; c * k];
    for (row, a, z) in documents(t, &starts) {
        let what = format!("conv row {row} tokens {a}..{z}");
        let xa = span(&x, row, a, z);
        let ya = EX.causal_conv1d_silu(&xa, &w, None).unwrap();
        let (dxa, dwa) = EX
            .causal_conv1d_silu_backward(&xa, &w, &span(&dy, row, a, z), None)
            .unwrap();
        assert_same(&what, span(&y, row, a, z).data(), ya.data());
        assert_same(&what, span(&dx, row, a, z).data(), dxa.data());
        dw_alone.iter_mut().zip(dwa.data()).for_each(|(s, d)| *s += d);
    }
    assert_same("conv dw", dw.data(), &dw_alone);
    // Without the documents the second and third would read the first.
    let plain = EX.causal_conv1d_silu(&x, &w, None).unwrap();
    assert!(rel_norm_err(plain.data(), y.data()) > 1e-3);
}

#[test]
fn causal_conv1d_backward_under_documents_matches_finite_differences() {
    let (b, t, c, k) = (2, 9, 2, 3);
    let starts: Vec<Vec<usize>> = CONV_STARTS.iter().map(|s| s.to_vec()).collect();
    let docs = Docs::new(t, &starts).unwrap();
    let x = rand_t(70, &[b, t, c]);
    let w = rand_t(71, &[c, k]);
    let cot = rand_t(72, &[b, t, c]);
    let (dx, dw) = EX.causal_conv1d_silu_backward(&x, &w, &cot, Some(&docs)).unwrap();
    grad_check("conv under documents", &[x, w], &[dx.data(), dw.data()], |i| {
        dot(
            EX.causal_conv1d_silu(&i[0], &i[1], Some(&docs)).unwrap().data(),
            cot.data(),
        )
    });
}

/// The delta rule's state starts from zero at each document: out and all
/// five gradients token for token, a decay per head and per key channel,
/// with documents of one token, one starting on a chunk's first step, and
/// ones running across one or two chunk boundaries (the backward replays
/// each chunk from its checkpoint, resets inside it included).
#[test]
fn gated_delta_rule_of_packed_rows_is_each_document_alone() {
    let c = DELTA_RULE_CHUNK;
    let t = 2 * c + 22;
    let starts = vec![vec![0, 5, 6, 60, 2 * c + 2], vec![0, c, c + 1, 2 * c - 1]];
    let docs = Docs::new(t, &starts).unwrap();
    for (seed, per_channel) in [(80, false), (90, true)] {
        let dims @ [b, _, _, hv, _, dv] = [2, t, 1, 2, 3, 2];
        let x = delta_rule_inputs(seed, dims, per_channel);
        let cot = rand_t(seed + 5, &[b, t, hv, dv]);
        let fw = EX
            .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], Some(&docs))
            .unwrap();
        assert_eq!(fw.docs.as_ref(), Some(&docs));
        let gr = EX
            .gated_delta_rule_backward(&x[0], &x[1], &x[2], &x[3], &x[4], &fw, &cot)
            .unwrap();
        let packed = [&fw.out, &gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta];
        for (row, a, z) in documents(t, &starts) {
            let xa = x.each_ref().map(|x| span(x, row, a, z));
            let fa = EX
                .gated_delta_rule(&xa[0], &xa[1], &xa[2], &xa[3], &xa[4], None)
                .unwrap();
            let ga = EX
                .gated_delta_rule_backward(
                    &xa[0],
                    &xa[1],
                    &xa[2],
                    &xa[3],
                    &xa[4],
                    &fa,
                    &span(&cot, row, a, z),
                )
                .unwrap();
            let alone = [&fa.out, &ga.dq, &ga.dk, &ga.dv, &ga.dg, &ga.dbeta];
            for (n, (p, a1)) in packed.iter().zip(alone).enumerate() {
                let what =
                    format!("delta rule (per channel {per_channel}) row {row} tokens {a}..{z}, output {n}");
                assert_same(&what, span(p, row, a, z).data(), a1.data());
            }
        }
        let plain = EX
            .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
            .unwrap();
        assert!(rel_norm_err(plain.out.data(), fw.out.data()) > 1e-3);
    }
}

/// The backward under documents against finite differences, across a chunk
/// boundary with a document starting inside each chunk.
#[test]
fn gated_delta_rule_backward_under_documents_matches_finite_differences() {
    let c = DELTA_RULE_CHUNK;
    let t = c + 6;
    let docs = Docs::new(t, &[vec![0, 3, 4, c - 2, c + 2]]).unwrap();
    for (seed, per_channel) in [(100, false), (110, true)] {
        let dims = [1, t, 1, 2, 2, 2];
        let x = delta_rule_inputs(seed, dims, per_channel);
        let fw = EX
            .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], Some(&docs))
            .unwrap();
        let cot = rand_t(seed + 5, fw.out.dims());
        let gr = EX
            .gated_delta_rule_backward(&x[0], &x[1], &x[2], &x[3], &x[4], &fw, &cot)
            .unwrap();
        let grads = [&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta].map(|g| g.data());
        grad_check(
            &format!("delta rule under documents, per channel {per_channel}"),
            &x,
            &grads,
            |i| {
                let o = EX
                    .gated_delta_rule(&i[0], &i[1], &i[2], &i[3], &i[4], Some(&docs))
                    .unwrap();
                dot(o.out.data(), cot.data())
            },
        );
    }
}
