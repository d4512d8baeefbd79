//! The ops of generation over a cache against the whole-sequence ops.
//! Attention: the last Tq rows of a causal attention over `len` positions
//! are what Tq new queries over a cache of those `len` keys give, under
//! windows and soft caps, with GQA; positions past `len` are never read.
//! The delta rule: steps taken a few at a time from the state the last
//! ones left are the whole sequence's. Bad shapes are refused by name.

use megatrain_tensor::testing::{delta_rule_inputs, random_f64};
use megatrain_tensor::{AttnMask, CpuTensor, Docs, Executor, F64Executor, Shape, SoftCap, TensorHandle};

type T = CpuTensor<f64>;
const EX: F64Executor = F64Executor::new();

fn rand_t(seed: u64, shape: &[usize]) -> T {
    T::from_vec(shape.to_vec(), random_f64(seed, Shape::from(shape).numel())).unwrap()
}

/// Positions `a..z` of every row of `x: [B, T, H, D]`.
fn positions(x: &T, a: usize, z: usize) -> T {
    let [b, t, h, d] = <[usize; 4]>::try_from(x.dims()).unwrap();
    let per = h * d;
    let data = (0..b)
        .flat_map(|bi| x.data()[(bi * t + a) * per..(bi * t + z) * per].to_vec())
        .collect();
    T::from_vec(vec![b, z - a, h, d], data).unwrap()
}

/// `x: [B, len, H, D]` in a cache of `tc` positions whose rest is NaN, so
/// that a read past `len` shows in every output it touches.
fn in_cache(x: &T, tc: usize) -> T {
    let [b, len, h, d] = <[usize; 4]>::try_from(x.dims()).unwrap();
    let per = h * d;
    let data = (0..b)
        .flat_map(|bi| {
            let mut row = x.data()[bi * len * per..(bi + 1) * len * per].to_vec();
            row.resize(tc * per, f64::NAN);
            row
        })
        .collect();
    T::from_vec(vec![b, tc, h, d], data).unwrap()
}

fn max_err(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

#[test]
fn new_queries_over_a_cache_are_the_last_rows_of_the_whole_attention() {
    let cap = SoftCap::new(1.5, "test").unwrap();
    // (B, Tq, len, Tc, Hq, Hkv, D, mask)
    let cases = [
        (1, 1, 1, 1, 1, 1, 4, AttnMask::CAUSAL),
        (1, 1, 9, 12, 4, 2, 7, AttnMask::CAUSAL),
        (2, 3, 37, 40, 6, 2, 16, AttnMask::sliding(9)),
        (1, 5, 70, 70, 4, 4, 8, AttnMask::CAUSAL.with_softcap(cap)),
        (2, 70, 70, 75, 3, 1, 5, AttnMask::sliding(20).with_softcap(cap)),
    ];
    for (i, (b, tq, len, tc, hq, hkv, d, mask)) in cases.into_iter().enumerate() {
        let seed = 100 * i as u64;
        let q = rand_t(seed, &[b, len, hq, d]);
        let (k, v) = (
            rand_t(seed + 1, &[b, len, hkv, d]),
            rand_t(seed + 2, &[b, len, hkv, d]),
        );
        let whole = EX.attention(&q, &k, &v, mask.clone()).unwrap();
        let got = EX
            .attention_cached(
                &positions(&q, len - tq, len),
                &in_cache(&k, tc),
                &in_cache(&v, tc),
                len,
                mask,
            )
            .unwrap();
        let what = format!(
            "case {i}: (B, Tq, len, Tc, Hq, Hkv, D) = {:?}",
            (b, tq, len, tc, hq, hkv, d)
        );
        assert_eq!(got.out.dims(), [b, tq, hq, d], "{what}");
        assert_eq!(got.lse.dims(), [b, hq, tq], "{what}");
        let want_out = positions(&whole.out, len - tq, len);
        let err = max_err(got.out.data(), want_out.data());
        assert!(err < 1e-12, "{what}: out differs by {err}");
        let want_lse: Vec<f64> = whole
            .lse
            .data()
            .chunks(len)
            .flat_map(|row| row[len - tq..].to_vec())
            .collect();
        let err = max_err(got.lse.data(), &want_lse);
        assert!(err < 1e-12, "{what}: lse differs by {err}");
    }
}

#[test]
fn a_cache_refuses_what_it_cannot_hold() {
    let (q, k) = (rand_t(1, &[1, 2, 4, 8]), rand_t(2, &[1, 10, 2, 8]));
    let refused = |q: &T, k: &T, v: &T, len: usize, mask: AttnMask, needle: &str| {
        let e = EX.attention_cached(q, k, v, len, mask).unwrap_err().to_string();
        assert!(e.contains("attention_cached") && e.contains(needle), "{e}");
    };
    refused(&q, &k, &k, 1, AttnMask::CAUSAL, "1 ≤ Tq ≤ len ≤ Tc");
    refused(&q, &k, &k, 11, AttnMask::CAUSAL, "1 ≤ Tq ≤ len ≤ Tc");
    refused(
        &q,
        &k,
        &rand_t(3, &[1, 9, 2, 8]),
        5,
        AttnMask::CAUSAL,
        "k and v shapes differ",
    );
    refused(
        &q,
        &rand_t(4, &[1, 10, 3, 8]),
        &rand_t(4, &[1, 10, 3, 8]),
        5,
        AttnMask::CAUSAL,
        "multiple of Hkv",
    );
    refused(
        &q,
        &rand_t(5, &[1, 10, 2, 6]),
        &rand_t(5, &[1, 10, 2, 6]),
        5,
        AttnMask::CAUSAL,
        "D of q and k/v",
    );
    let docs = AttnMask::CAUSAL.with_docs(Some(Docs::new(2, &[vec![0]]).unwrap()));
    refused(&q, &k, &k, 5, docs, "documents");
}

/// Steps `a..z` of every row of `x: [B, T, ..]`.
fn steps(x: &T, a: usize, z: usize) -> T {
    let (b, t, rest) = (x.dims()[0], x.dims()[1], &x.dims()[2..]);
    let per: usize = rest.iter().product();
    let data = (0..b)
        .flat_map(|bi| x.data()[(bi * t + a) * per..(bi * t + z) * per].to_vec())
        .collect();
    T::from_vec([&[b, z - a], rest].concat(), data).unwrap()
}

#[test]
fn delta_rule_steps_from_a_state_are_the_whole_sequence() {
    // (B, T, Hk, Hv, Dk, Dv), per-channel decay, the steps a call takes:
    // across the training forward's chunk of 64 too.
    let cases: [([usize; 6], bool, &[usize]); 3] = [
        ([1, 9, 1, 1, 4, 3], false, &[1, 1, 4, 3]),
        ([2, 70, 1, 2, 3, 5], false, &[5, 60, 1, 4]),
        ([1, 12, 2, 2, 6, 2], true, &[7, 1, 1, 3]),
    ];
    for (i, (dims, per_channel, takes)) in cases.into_iter().enumerate() {
        let [b, t, _, hv, dk, dv] = dims;
        let x = delta_rule_inputs(300 + i as u64, dims, per_channel);
        let whole = EX
            .gated_delta_rule(&x[0], &x[1], &x[2], &x[3], &x[4], None)
            .unwrap();
        let mut state = T::from_vec(vec![b, hv, dk, dv], vec![0.0; b * hv * dk * dv]).unwrap();
        let mut at = 0;
        for &n in takes {
            let xs = x.each_ref().map(|x| steps(x, at, at + n));
            let got = EX
                .gated_delta_rule_cached(&xs[0], &xs[1], &xs[2], &xs[3], &xs[4], &mut state)
                .unwrap();
            let err = max_err(got.data(), steps(&whole.out, at, at + n).data());
            assert!(
                err < 1e-12,
                "case {i}: steps {at}..{}: out differs by {err}",
                at + n
            );
            at += n;
        }
        assert_eq!(at, t);
    }
    // A state of another shape is refused by name.
    let x = delta_rule_inputs(1, [1, 3, 1, 2, 4, 3], false);
    let mut wrong = T::from_vec(vec![1, 2, 3, 4], vec![0.0; 24]).unwrap();
    let e = EX
        .gated_delta_rule_cached(&x[0], &x[1], &x[2], &x[3], &x[4], &mut wrong)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gated_delta_rule_cached") && e.contains("state [1, 2, 3, 4] must be [1, 2, 4, 3]"),
        "{e}"
    );
}
