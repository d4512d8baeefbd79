//! The GPU's attention over a cache of keys and values (generation)
//! against the CPU's, on awkward shapes: one and several new queries,
//! GQA, windows, soft caps, head dimensions 7 to 256, more keys than one
//! block of the kernel, and a cache whose positions past `len` are NaN (a
//! read of them shows in every output it touches).

mod common;

use common::*;
use megatrain_tensor::{AttnMask, Executor, HostTensor, Shape, SoftCap};

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
