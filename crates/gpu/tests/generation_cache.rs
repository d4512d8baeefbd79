//! The GPU's ops of generation over a cache against the CPU's, on awkward
//! shapes. Attention over a cache of keys and values: one and several new
//! queries, GQA, windows, soft caps, head dimensions 7 to 256, more keys
//! than one block of the kernel, and a cache whose positions past `len`
//! are NaN (a read of them shows in every output it touches). The delta
//! rule from a state: a few steps at a time, decays per head and per
//! channel, on the loop budget's split too.

mod common;

use common::*;
use megatrain_gpu::GpuOptions;
use megatrain_tensor::testing::delta_rule_inputs;
use megatrain_tensor::{AttnMask, ComputePrecision, Executor, HostTensor, Shape, SoftCap, TensorHandle};

/// `x: [B, len, H, D]` in a cache of `tc` positions whose rest is NaN.
fn in_cache(x: &HostTensor, tc: usize) -> HostTensor {
    let [b, len, h, d] = <[usize; 4]>::try_from(x.shape().dims()).unwrap();
    let per = h * d;
    let data = x.to_f32_vec();
    let cached = (0..b)
        .flat_map(|bi| {
            let mut row = data[bi * len * per..(bi + 1) * len * per].to_vec();
            row.resize(tc * per, f32::NAN);
            row
        })
        .collect();
    HostTensor::from_f32(Shape::new([b, tc, h, d]), cached).unwrap()
}

#[test]
fn attention_over_a_cache_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let cap = SoftCap::new(2.5, "test").unwrap();
    // (B, Tq, len, Tc, Hq, Hkv, D, mask)
    let cases = [
        (1, 1, 1, 4, 1, 1, 7, AttnMask::CAUSAL),
        (1, 1, 150, 160, 4, 2, 64, AttnMask::CAUSAL),
        (2, 3, 37, 40, 6, 2, 80, AttnMask::sliding(9)),
        (1, 5, 130, 130, 8, 2, 128, AttnMask::CAUSAL.with_softcap(cap)),
        (1, 2, 70, 90, 2, 1, 256, AttnMask::sliding(66)),
        (2, 1, 65, 65, 3, 3, 200, AttnMask::CAUSAL),
    ];
    for (i, (b, tq, len, tc, hq, hkv, d, mask)) in cases.into_iter().enumerate() {
        let seed = 1300 + 10 * i as u64;
        let q = rand_host(seed, &[b, tq, hq, d]);
        let k = in_cache(&rand_host(seed + 1, &[b, len, hkv, d]), tc);
        let v = in_cache(&rand_host(seed + 2, &[b, len, hkv, d]), tc);
        let want = c
            .attention_cached(
                &c.upload(&q).unwrap(),
                &c.upload(&k).unwrap(),
                &c.upload(&v).unwrap(),
                len,
                mask.clone(),
            )
            .unwrap();
        let got = g
            .attention_cached(
                &g.upload(&q).unwrap(),
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                len,
                mask,
            )
            .unwrap();
        let what = format!(
            "(B, Tq, len, Tc, Hq, Hkv, D) = {:?}",
            (b, tq, len, tc, hq, hkv, d)
        );
        assert_eq!(got.out.dims(), [b, tq, hq, d], "{what}");
        assert_eq!(got.lse.dims(), [b, hq, tq], "{what}");
        assert_close(
            &format!("out {what}"),
            &down(g, &got.out),
            &down_cpu(&c, &want.out),
            TOL_F32,
        );
        assert_close(
            &format!("lse {what}"),
            &down(g, &got.lse),
            &down_cpu(&c, &want.lse),
            TOL_F32,
        );
    }
}

/// What the kernel cannot take is refused by name: a head dimension past
/// 256, and (as on the CPU) a query past the cached positions.
#[test]
fn attention_over_a_cache_refuses_what_it_cannot_run() {
    let Some(g) = gpu() else { return };
    let refused = |q: &[usize], k: &[usize], len: usize, needle: &str| {
        let (q, k) = (
            g.upload(&rand_host(1, q)).unwrap(),
            g.upload(&rand_host(2, k)).unwrap(),
        );
        let e = g
            .attention_cached(&q, &k, &k, len, AttnMask::CAUSAL)
            .unwrap_err()
            .to_string();
        assert!(e.contains("attention_cached") && e.contains(needle), "{e}");
    };
    refused(&[1, 1, 2, 264], &[1, 4, 2, 264], 3, "head dimension 264");
    refused(&[1, 3, 2, 8], &[1, 4, 2, 8], 2, "1 ≤ Tq ≤ len ≤ Tc");
}

/// Steps `a..z` of every row of `x: [B, T, ..]`, in f32.
fn steps(x: &megatrain_tensor::CpuTensor<f64>, a: usize, z: usize) -> HostTensor {
    let (b, t, rest) = (x.dims()[0], x.dims()[1], &x.dims()[2..]);
    let per: usize = rest.iter().product();
    let data = (0..b)
        .flat_map(|bi| {
            x.data()[(bi * t + a) * per..(bi * t + z) * per]
                .iter()
                .map(|&v| v as f32)
        })
        .collect();
    HostTensor::from_f32(Shape::new([&[b, z - a], rest].concat()), data).unwrap()
}

#[test]
fn delta_rule_from_a_state_matches_cpu() {
    let c = cpu();
    let small_budget = GpuOptions {
        loop_budget: Some(40),
        ..Default::default()
    };
    let Some(g) = gpu() else { return };
    let split = gpu_with(small_budget, ComputePrecision::F32).unwrap();
    let cases: [([usize; 6], bool, &[usize]); 3] = [
        ([1, 9, 1, 1, 4, 3], false, &[1, 1, 4, 3]),
        ([2, 70, 1, 2, 3, 5], false, &[5, 60, 1, 4]),
        ([1, 12, 2, 2, 6, 2], true, &[7, 1, 1, 3]),
    ];
    for (i, (dims, per_channel, takes)) in cases.into_iter().enumerate() {
        let [b, _, _, hv, dk, dv] = dims;
        let x = delta_rule_inputs(500 + i as u64, dims, per_channel);
        let zeros = HostTensor::from_f32(Shape::new([b, hv, dk, dv]), vec![0.0; b * hv * dk * dv]).unwrap();
        let mut cs = c.upload(&zeros).unwrap();
        let (mut gs, mut ss) = (g.upload(&zeros).unwrap(), split.upload(&zeros).unwrap());
        let mut at = 0;
        for &n in takes {
            let xs = x.each_ref().map(|x| steps(x, at, at + n));
            let [cq, ck, cv, cg, cb] = xs.each_ref().map(|h| c.upload(h).unwrap());
            let want = c
                .gated_delta_rule_cached(&cq, &ck, &cv, &cg, &cb, &mut cs)
                .unwrap();
            let what = format!("case {i}, steps {at}..{}", at + n);
            for (ex, state, name) in [(g, &mut gs, "default"), (&split, &mut ss, "a loop budget of 40")] {
                let [q, k, v, gg, bb] = xs.each_ref().map(|h| ex.upload(h).unwrap());
                let got = ex.gated_delta_rule_cached(&q, &k, &v, &gg, &bb, state).unwrap();
                assert_close(
                    &format!("out, {what}, {name}"),
                    &down(ex, &got),
                    &down_cpu(&c, &want),
                    TOL_F32,
                );
                assert_close(
                    &format!("state, {what}, {name}"),
                    &down(ex, state),
                    &down_cpu(&c, &cs),
                    TOL_F32,
                );
            }
            at += n;
        }
    }
}
