//! proptest over slab lengths and chunk sizes: 0, 1, odd, not multiples of
//! the chunk or the SIMD width, with decay ranges falling anywhere.

mod common;

use common::{Ref, grads, params, rng};
use half::bf16;
use megatrain_adamw::{AdamW, AdamWConfig, DecayMask, SlabState, SlabUpdate, Transport};
use proptest::prelude::*;

const CFG: AdamWConfig = AdamWConfig {
    beta1: 0.8,
    beta2: 0.99,
    eps: 1e-6,
    weight_decay: 0.05,
};

fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(0usize),
        Just(1),
        2usize..40,
        (1usize..40).prop_map(|k| 8 * k - 1),
        (1usize..40).prop_map(|k| 16 * k + 1),
        100usize..2000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn any_length_matches_reference_and_half(
        n in lengths(),
        chunk in prop_oneof![Just(1usize), Just(3), Just(8), Just(33), Just(1 << 15)],
        cuts in proptest::collection::vec(0usize..2000, 0..6),
        seed in any::<u64>(),
        zero in any::<bool>(),
    ) {
        let mut r = rng(seed);
        let mut p = params(&mut r, n);
        let mut g = grads(&mut r, n);
        let g0 = g.clone();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut copy = vec![bf16::ZERO; n];
        // Pairs of cut points become decayed ranges.
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(n)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mask = DecayMask::from_ranges(n, cuts.chunks_exact(2).map(|c| c[0]..c[1])).unwrap();
        let mut reference = Ref::new(&p);
        let opt = AdamW::new(CFG).unwrap().with_chunk_len(chunk);
        let mut st = SlabState::new();
        for step in 0..2 {
            reference.step(&CFG, 1e-2, &g0, 1.0, &mask);
            if step == 1 { g.copy_from_slice(&g0); }
            let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
                .decay(&mask)
                .transport(Transport::Bf16(&mut copy))
                .zero_grad(zero);
            opt.step(&mut st, 1e-2, u).unwrap();
        }
        for i in 0..n {
            let want = reference.p[i];
            prop_assert!(((p[i] as f64) - want).abs() <= 1e-6 * want.abs(), "p[{}] {} vs {}", i, p[i], want);
            prop_assert_eq!(copy[i].to_bits(), bf16::from_f32(p[i]).to_bits());
            prop_assert_eq!(g[i], if zero { 0.0 } else { g0[i] });
        }
    }
}
