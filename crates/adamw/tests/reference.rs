//! The fused f32 pass against the f64 reference, and the properties of the
//! transport copy, the decay mask, gradient zeroing and scaling, chunking
//! and argument checking.

mod common;

use common::{Ref, grads, params, rel_err, rng};
use half::{bf16, f16};
use megatrain_adamw::{AdamW, AdamWConfig, AdamWError, DecayMask, Grad, SlabState, SlabUpdate, Transport};

const CFG: AdamWConfig = AdamWConfig {
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.1,
};

/// A warm-up then cosine-like schedule: lr changes on every call.
fn lr_at(step: usize) -> f32 {
    let peak = 1e-3f32;
    if step < 10 {
        peak * (step + 1) as f32 / 10.0
    } else {
        peak * (0.55 + 0.45 * ((step as f32) * 0.05).cos())
    }
}

fn assert_step_matches(got: (&[f32], &[f32], &[f32]), want: &Ref, what: &str) -> (f64, f64, f64) {
    let (p, m, v) = got;
    let (mut wp, mut wm, mut wv) = (0f64, 0f64, 0f64);
    for i in 0..p.len() {
        wp = wp.max(rel_err(p[i], want.p[i]));
        wv = wv.max(rel_err(v[i], want.v[i]));
        // m changes sign; measure it against the scale the update divides it by.
        let scale = want.m[i].abs().max(want.v[i].sqrt());
        wm = wm.max(((m[i] as f64) - want.m[i]).abs() / scale);
    }
    assert!(
        wp <= 1e-6 && wv <= 1e-6 && wm <= 1e-6,
        "{what}: errors p {wp:e} m {wm:e} v {wv:e}"
    );
    (wp, wm, wv)
}

/// Every one of 100 steps, from the f32 state the slab is in, matches the
/// f64 reference step to 1e-6 relative; and the whole 100-step f32
/// trajectory stays within what f32 storage of p allows: one rounding of p
/// per step, so at most 100·2^-24 ≈ 6e-6 relative, and about 1e-6 in
/// practice (a random walk of roundings).
#[test]
fn hundred_steps_match_f64_reference_to_1e_6() {
    let n = 10_007;
    let mut r = rng(1);
    let mut p = params(&mut r, n);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mask = DecayMask::from_ranges(n, [0..4000, 4100..9000]).unwrap();
    let mut trajectory = Ref::new(&p);
    let opt = AdamW::new(CFG).unwrap().with_chunk_len(1000);
    let mut state = SlabState::new();
    let mut worst_step = (0f64, 0f64, 0f64);
    for step in 0..100 {
        let mut g = grads(&mut r, n);
        let lr = lr_at(step);
        let mut one_step = Ref::from_state(&p, &m, &v, state.step());
        one_step.step(&CFG, lr as f64, &g, 1.0, &mask);
        trajectory.step(&CFG, lr as f64, &g, 1.0, &mask);
        opt.step(
            &mut state,
            lr,
            SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).decay(&mask),
        )
        .unwrap();
        let e = assert_step_matches((&p, &m, &v), &one_step, &format!("step {}", step + 1));
        worst_step = (
            worst_step.0.max(e.0),
            worst_step.1.max(e.1),
            worst_step.2.max(e.2),
        );
    }
    assert_eq!(state.step(), 100);
    let worst_p = (0..n).map(|i| rel_err(p[i], trajectory.p[i])).fold(0.0, f64::max);
    let worst_v = (0..n).map(|i| rel_err(v[i], trajectory.v[i])).fold(0.0, f64::max);
    println!(
        "worst per-step error (p, m, v) {worst_step:?}; 100-step trajectory p {worst_p:e} v {worst_v:e}"
    );
    assert!(
        worst_p <= 100.0 * 2f64.powi(-24),
        "trajectory p relative error {worst_p:e}"
    );
    assert!(worst_v <= 1e-6, "trajectory v relative error {worst_v:e}");
}

/// p, g, m, v of a fresh slab after one step with `transport` and `zero`.
fn one_step(p0: &[f32], g0: &[f32], transport: Transport<'_>, zero: bool) -> [Vec<f32>; 4] {
    let n = p0.len();
    let (mut p, mut g, mut m, mut v) = (p0.to_vec(), g0.to_vec(), vec![0.0; n], vec![0.0; n]);
    let opt = AdamW::new(CFG).unwrap().with_chunk_len(333);
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
        .transport(transport)
        .zero_grad(zero);
    opt.step(&mut SlabState::new(), 1e-3, u).unwrap();
    [p, g, m, v]
}

/// A gradient of zeros read from nowhere ([`Grad::Zero`]: the rows of an
/// embedding no token looked up) updates p, m, v and every kind of
/// transport copy to the bits a gradient of zeros in memory does, over a
/// decay mask, chunk seams and more elements than its block of zeros, and
/// reports no square.
#[test]
fn zero_gradients_update_like_zeros_in_memory() {
    let n = 9001;
    let mut r = rng(11);
    let p0 = params(&mut r, n);
    let m0 = grads(&mut r, n);
    let v0: Vec<f32> = grads(&mut r, n).iter().map(|x| x * x).collect();
    let zeros = vec![0.0f32; n];
    let mask = DecayMask::from_ranges(n, [0..1000, 1500..8000]).unwrap();
    for chunk in [333, 100_000] {
        let opt = AdamW::new(CFG).unwrap().with_chunk_len(chunk);
        let run = |zero: bool, kind: usize| {
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let (mut c16, mut cb, mut c32) = (vec![f16::ZERO; n], vec![bf16::ZERO; n], vec![0.0f32; n]);
            let transport = match kind {
                0 => Transport::F16(&mut c16),
                1 => Transport::Bf16(&mut cb),
                2 => Transport::F32(&mut c32),
                _ => Transport::None,
            };
            let grad = match zero {
                true => Grad::Zero(n),
                false => Grad::Read(&zeros),
            };
            let u = SlabUpdate::new(&mut p, grad, &mut m, &mut v)
                .decay(&mask)
                .transport(transport)
                .grad_scale(0.5);
            let stats = opt.step(&mut SlabState::at_step(5), 1e-3, u).unwrap();
            let bits = |x: &[f32]| x.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
            (
                stats.grad_sq,
                bits(&p),
                bits(&m),
                bits(&v),
                c16.iter().map(|c| c.to_bits()).collect::<Vec<_>>(),
                cb.iter().map(|c| c.to_bits()).collect::<Vec<_>>(),
                bits(&c32),
            )
        };
        for kind in 0..4 {
            let (a, b) = (run(true, kind), run(false, kind));
            assert_eq!(a.0, 0.0);
            assert!(a == b, "chunk {chunk}, transport {kind}");
            assert_ne!(a.1, p0.iter().map(|y| y.to_bits()).collect::<Vec<_>>());
        }
    }
}

/// A read-only gradient (what a mapped download hands over) updates p, m, v
/// and the transport copy to the same bits as an owned one, over a decay
/// mask and chunk seams; zeroing it is refused before anything is written.
#[test]
fn read_only_gradients_update_like_owned_ones() {
    let n = 4099;
    let mut r = rng(7);
    let p0 = params(&mut r, n);
    let g0 = grads(&mut r, n);
    let mask = DecayMask::from_ranges(n, [0..1000, 1500..4000]).unwrap();
    let opt = AdamW::new(CFG).unwrap().with_chunk_len(333);
    let run = |read: bool| {
        let (mut p, mut g, mut m, mut v) = (p0.clone(), g0.clone(), vec![0.1f32; n], vec![0.2f32; n]);
        let mut copy = vec![f16::ZERO; n];
        let grad = match read {
            true => Grad::Read(&g0),
            false => Grad::Mut(&mut g),
        };
        let u = SlabUpdate::new(&mut p, grad, &mut m, &mut v)
            .decay(&mask)
            .transport(Transport::F16(&mut copy))
            .grad_scale(0.5);
        opt.step(&mut SlabState::at_step(3), 1e-3, u).unwrap();
        (p, m, v, copy.iter().map(|c| c.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(run(true), run(false));

    let (mut p, mut m, mut v) = (p0.clone(), vec![0.0f32; n], vec![0.0f32; n]);
    let mut st = SlabState::new();
    let u = SlabUpdate::new(&mut p, &g0[..], &mut m, &mut v).zero_grad(true);
    let err = opt.step(&mut st, 1e-3, u).unwrap_err();
    assert_eq!(err, AdamWError::ReadOnlyGrad);
    assert!(err.to_string().contains("read-only"));
    assert_eq!((st.step(), &p), (0, &p0));
}

#[test]
fn transport_copies_and_zeroing_are_exact() {
    let n = 5000;
    let mut r = rng(2);
    let p0 = params(&mut r, n);
    let g0 = grads(&mut r, n);
    let [p, g, m, v] = one_step(&p0, &g0, Transport::None, false);
    assert_eq!(g, g0, "gradient must be left alone without zero_grad");

    let mut copy = vec![bf16::ZERO; n];
    let [p_b, g_b, m_b, v_b] = one_step(&p0, &g0, Transport::Bf16(&mut copy), true);
    assert_eq!((&p_b, &m_b, &v_b), (&p, &m, &v));
    assert!(g_b.iter().all(|x| x.to_bits() == 0), "zero_grad writes +0.0");
    for (i, (c, x)) in copy.iter().zip(&p_b).enumerate() {
        assert_eq!(c.to_bits(), bf16::from_f32(*x).to_bits(), "element {i}");
    }

    let mut copy32 = vec![0.0f32; n];
    let [p_f, ..] = one_step(&p0, &g0, Transport::F32(&mut copy32), false);
    assert_eq!(p_f, p);
    assert_eq!(copy32, p);

    let mut copy16 = vec![f16::ZERO; n];
    let [p_h, g_h, ..] = one_step(&p0, &g0, Transport::F16(&mut copy16), true);
    assert_eq!(p_h, p);
    assert!(g_h.iter().all(|x| x.to_bits() == 0));
    for (i, (c, x)) in copy16.iter().zip(&p_h).enumerate() {
        assert_eq!(c.to_bits(), f16::from_f32(*x).to_bits(), "element {i}");
    }
}

#[test]
fn f16_copy_rounds_to_nearest_even_and_saturates_instead_of_overflowing() {
    // lr = 0 and g = 0 keep the parameters; the copy is what is tested.
    let p0 = [
        1.0 + 2f32.powi(-11),       // tie, even below: 1
        1.0 + 3.0 * 2f32.powi(-11), // tie, odd below: 1 + 2^-9
        65504.0,
        65519.0,  // rounds down to the largest f16
        65520.0,  // the tie that half rounds to infinity
        -70000.0, // past the range
        1e30,
        f32::MAX,
        2f32.powi(-25) * 1.5, // smallest f16 subnormal
        2f32.powi(-26),       // flushes to zero
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let want: [f32; 11] = [
        1.0,
        1.0 + 2f32.powi(-9),
        65504.0,
        65504.0,
        65504.0,
        -65504.0,
        65504.0,
        65504.0,
        2f32.powi(-24),
        0.0,
        -0.0,
    ];
    let n = p0.len();
    let mut p = p0.to_vec();
    let (mut g, mut m, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let mut copy = vec![f16::ZERO; n];
    let opt = AdamW::new(CFG).unwrap().with_chunk_len(3);
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).transport(Transport::F16(&mut copy));
    opt.step(&mut SlabState::new(), 0.0, u).unwrap();
    for (i, w) in want.iter().enumerate() {
        assert_eq!(copy[i].to_f32().to_bits(), w.to_bits(), "element {i} ({})", p0[i]);
    }
    assert_eq!(copy[11], f16::INFINITY, "an infinite master weight stays visible");
    assert_eq!(copy[12], f16::NEG_INFINITY);
    assert!(copy[13].is_nan());
    // In range, exactly half's rounding; out of range, saturated.
    for (i, (&c, &x)) in copy.iter().zip(&p).enumerate() {
        if x.is_finite() && x.abs() >= 65520.0 {
            assert_eq!(c.to_f32(), 65504f32.copysign(x), "element {i}");
        } else if !x.is_nan() {
            assert_eq!(c.to_bits(), f16::from_f32(x).to_bits(), "element {i}");
        }
    }
}

#[test]
fn bf16_copy_of_special_parameters_matches_half() {
    // Parameters that are NaN, infinite, huge or subnormal pass through the
    // update (lr = 0, wd irrelevant) and must round exactly like half.
    let p0 = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::from_bits(0x7F7F_8000),
        f32::from_bits(1),
        -0.0,
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
    ];
    let n = p0.len();
    let mut p = p0.to_vec();
    let (mut g, mut m, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let mut copy = vec![bf16::ZERO; n];
    let opt = AdamW::new(CFG).unwrap();
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).transport(Transport::Bf16(&mut copy));
    opt.step(&mut SlabState::new(), 0.0, u).unwrap();
    for i in 0..n {
        if p0[i].is_nan() {
            // Arithmetic may quiet a signalling NaN; it must stay a NaN.
            assert!(p[i].is_nan() && copy[i].is_nan(), "element {i}");
        } else {
            assert_eq!(p[i].to_bits(), p0[i].to_bits(), "lr 0 and g 0 keep element {i}");
        }
        assert_eq!(copy[i].to_bits(), bf16::from_f32(p[i]).to_bits(), "element {i}");
    }
}

#[test]
fn decay_mask_selects_exactly_the_decayed_elements() {
    let n = 3001;
    let mut r = rng(3);
    let p0 = params(&mut r, n);
    let g0 = grads(&mut r, n);
    let mask = DecayMask::from_ranges(n, [7..100, 1500..2999]).unwrap();
    let step = |cfg: AdamWConfig, mask: &DecayMask| {
        let (mut p, mut g, mut m, mut v) = (p0.clone(), g0.clone(), vec![0.0; n], vec![0.0; n]);
        let opt = AdamW::new(cfg).unwrap().with_chunk_len(64);
        opt.step(
            &mut SlabState::new(),
            2e-3,
            SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).decay(mask),
        )
        .unwrap();
        p
    };
    let masked = step(CFG, &mask);
    let all = step(CFG, &DecayMask::All);
    let none = step(CFG, &DecayMask::None);
    let no_wd = step(
        AdamWConfig {
            weight_decay: 0.0,
            ..CFG
        },
        &DecayMask::All,
    );
    assert_eq!(none, no_wd);
    for i in 0..n {
        let want = if mask.decays(i) { all[i] } else { none[i] };
        assert_eq!(masked[i].to_bits(), want.to_bits(), "element {i}");
    }
    assert!(
        (0..n).any(|i| all[i] != none[i]),
        "weight decay must change something"
    );
}

#[test]
fn grad_scale_equals_a_prescaled_gradient() {
    let n = 1000;
    let mut r = rng(4);
    let p0 = params(&mut r, n);
    let g0 = grads(&mut r, n);
    let scale = 0.37f32;
    let opt = AdamW::new(CFG).unwrap();
    let (mut p1, mut g1, mut m1, mut v1) = (p0.clone(), g0.clone(), vec![0.0; n], vec![0.0; n]);
    opt.step(
        &mut SlabState::new(),
        1e-3,
        SlabUpdate::new(&mut p1, &mut g1, &mut m1, &mut v1).grad_scale(scale),
    )
    .unwrap();
    let mut g2: Vec<f32> = g0.iter().map(|&x| x * scale).collect();
    let (mut p2, mut m2, mut v2) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
    opt.step(
        &mut SlabState::new(),
        1e-3,
        SlabUpdate::new(&mut p2, &mut g2, &mut m2, &mut v2),
    )
    .unwrap();
    assert_eq!((p1, m1, v1), (p2, m2, v2));
}

#[test]
fn result_does_not_depend_on_chunking_or_threads() {
    let n = 70_001;
    let mut r = rng(5);
    let p0 = params(&mut r, n);
    let g0 = grads(&mut r, n);
    let mask = DecayMask::from_ranges(n, [100..40_000, 40_001..70_000]).unwrap();
    let run = |chunk: usize, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (mut p, mut g, mut m, mut v) = (p0.clone(), g0.clone(), vec![0.0; n], vec![0.0; n]);
        let mut copy = vec![bf16::ZERO; n];
        let opt = AdamW::new(CFG).unwrap().with_chunk_len(chunk);
        pool.install(|| {
            let mut st = SlabState::new();
            for _ in 0..3 {
                let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
                    .decay(&mask)
                    .transport(Transport::Bf16(&mut copy));
                opt.step(&mut st, 1e-3, u).unwrap();
            }
        });
        (p, m, v, copy)
    };
    let base = run(usize::MAX, 1);
    for (chunk, threads) in [(1usize << 15, 2), (1000, 2), (17, 3), (8, 1)] {
        assert!(run(chunk, threads) == base, "chunk {chunk}, {threads} threads");
    }
}

#[test]
fn bad_arguments_are_typed_errors_and_write_nothing() {
    let opt = AdamW::new(CFG).unwrap();
    let mut p = vec![1.0f32; 8];
    let (mut g, mut m, mut v) = (vec![1.0f32; 8], vec![0.0f32; 8], vec![0.0f32; 7]);
    let mut st = SlabState::new();
    let err = opt
        .step(&mut st, 1e-3, SlabUpdate::new(&mut p, &mut g, &mut m, &mut v))
        .unwrap_err();
    assert_eq!(
        err,
        AdamWError::LengthMismatch {
            what: "exp_avg_sq (v)",
            expected: 8,
            got: 7
        }
    );
    assert!(err.to_string().contains("exp_avg_sq"));
    let mut v = vec![0.0f32; 8];
    let mut short = vec![bf16::ZERO; 9];
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).transport(Transport::Bf16(&mut short));
    assert!(matches!(
        opt.step(&mut st, 1e-3, u),
        Err(AdamWError::LengthMismatch {
            what: "transport copy",
            got: 9,
            ..
        })
    ));
    let mask = DecayMask::from_ranges(9, std::iter::once(0..3)).unwrap();
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).decay(&mask);
    assert!(matches!(
        opt.step(&mut st, 1e-3, u),
        Err(AdamWError::DecayMaskLength {
            mask_len: 9,
            slab_len: 8
        })
    ));
    for lr in [f32::NAN, -1e-3, f32::INFINITY] {
        let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v);
        assert!(matches!(
            opt.step(&mut st, lr, u),
            Err(AdamWError::InvalidHyper { name: "lr", .. })
        ));
    }
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v).grad_scale(f32::NAN);
    assert!(opt.step(&mut st, 1e-3, u).is_err());
    let mut full = SlabState::at_step(u64::MAX);
    let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v);
    assert_eq!(
        opt.step(&mut full, 1e-3, u),
        Err(AdamWError::StepOverflow(u64::MAX))
    );
    assert_eq!(st.step(), 0);
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.0));

    for bad in [
        AdamWConfig { beta1: 1.0, ..CFG },
        AdamWConfig { beta2: -0.1, ..CFG },
        AdamWConfig { eps: f32::NAN, ..CFG },
        AdamWConfig {
            weight_decay: -0.01,
            ..CFG
        },
    ] {
        assert!(
            matches!(AdamW::new(bad), Err(AdamWError::InvalidHyper { .. })),
            "{bad:?}"
        );
    }
}

#[test]
fn per_slab_step_counts_drive_bias_correction() {
    // A slab restored at step 41 takes its 42nd step: same as the reference
    // started at t = 41 from the same moments.
    let n = 513;
    let mut r = rng(6);
    let p0 = params(&mut r, n);
    let m0: Vec<f32> = grads(&mut r, n).iter().map(|x| x * 0.1).collect();
    let v0: Vec<f32> = m0.iter().map(|x| x * x * 2.0).collect();
    let mut g = grads(&mut r, n);
    let mut reference = Ref::from_state(&p0, &m0, &v0, 41);
    reference.step(&CFG, 1e-3, &g, 1.0, &DecayMask::All);
    let (mut p, mut m, mut v) = (p0, m0, v0);
    let mut st = SlabState::at_step(41);
    AdamW::new(CFG)
        .unwrap()
        .step(&mut st, 1e-3, SlabUpdate::new(&mut p, &mut g, &mut m, &mut v))
        .unwrap();
    assert_eq!(st.step(), 42);
    for (i, (&got, &want)) in p.iter().zip(&reference.p).enumerate() {
        assert!(rel_err(got, want) <= 1e-6, "element {i}");
    }
}

#[test]
fn a_step_reports_the_square_of_the_norm_of_the_gradient_it_applied() {
    let n = 70_001;
    let mut r = rng(9);
    let g0 = grads(&mut r, n);
    let mask = DecayMask::from_ranges(n, [100..40_000, 50_000..60_000]).unwrap();
    let want: f64 = g0.iter().map(|&x| (x as f64 * 0.25).powi(2)).sum();
    let run = |chunk: usize, threads: usize, zero: bool| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (mut p, mut g, mut m, mut v) = (params(&mut rng(1), n), g0.clone(), vec![0.0; n], vec![0.0; n]);
        let opt = AdamW::new(CFG).unwrap().with_chunk_len(chunk);
        let stats = pool.install(|| {
            let u = SlabUpdate::new(&mut p, &mut g, &mut m, &mut v)
                .decay(&mask)
                .grad_scale(0.25)
                .zero_grad(zero);
            opt.step(&mut SlabState::new(), 1e-3, u).unwrap()
        });
        // Zeroing after the sum: the sum is of the gradient, not of zeros.
        assert_eq!(g.iter().all(|&x| x == 0.0), zero);
        stats.grad_sq
    };
    let base = run(1 << 15, 1, false);
    assert!((base - want).abs() <= 1e-12 * want, "{base} vs {want}");
    for (threads, zero) in [(2, false), (3, true), (1, true)] {
        assert_eq!(
            run(1 << 15, threads, zero).to_bits(),
            base.to_bits(),
            "{threads} threads"
        );
    }
    // Another chunking adds other partial sums: the same to f64 rounding.
    let other = run(1000, 2, false);
    assert!((other - base).abs() <= 1e-12 * base, "{other} vs {base}");
    // A non-finite gradient gives a non-finite norm.
    let opt = AdamW::new(CFG).unwrap();
    let (mut p, mut m, mut v) = (vec![1.0f32; 4], vec![0.0f32; 4], vec![0.0f32; 4]);
    let mut g = vec![1.0, f32::NAN, 2.0, 3.0];
    let s = opt
        .step(
            &mut SlabState::new(),
            1e-3,
            SlabUpdate::new(&mut p, &mut g, &mut m, &mut v),
        )
        .unwrap();
    assert!(s.grad_sq.is_nan());
}
