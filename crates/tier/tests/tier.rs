mod common;

use common::{fill, tables};
use half::{bf16, f16};
use megatrain_tier::{
    Backing, BytesByKind, HostTier, LayerSlab, PAGE, TierConfig, TierError, TransportDType, TransportRef,
    plan,
};

#[test]
fn accounting_is_exact_by_kind() {
    // 1024 elements per layer = exactly one page of f32, half a page of
    // bf16 (rounded to one page): per layer 4 KiB p, 8 KiB m+v, 4 KiB bf16.
    let t = tables(&[(32, 31), (16, 63)]); // 32*31+31 = 1023, 16*63+63 = 1071
    let n: Vec<usize> = t.iter().map(|t| t.numel()).collect();
    assert_eq!(n, vec![1023, 1071]);
    let cfg = TierConfig {
        transport: TransportDType::BF16,
        ..TierConfig::default()
    };
    let tier = HostTier::new(t.clone(), cfg.clone()).unwrap();
    let r = tier.report();
    let page = PAGE as u64;
    assert_eq!(
        r.ram,
        BytesByKind {
            params: page + 2 * page,
            moments: 2 * (page + 2 * page),
            transport: page + page,
            gradients: 0,
            staging: 0,
        }
    );
    assert_eq!(r.disk, BytesByKind::default());
    assert_eq!(r.n_params, 1023 + 1071);
    assert_eq!(r.first_spilled, None);

    let cfg = TierConfig {
        transport: TransportDType::F32,
        hold_grads: true,
        ..TierConfig::default()
    };
    let r = HostTier::new(t, cfg).unwrap().report();
    assert_eq!(r.ram.transport, 3 * page);
    assert_eq!(r.ram.gradients, 3 * page);
}

#[test]
fn bytes_per_param_is_14_for_bf16_without_grads() {
    // Page-multiple layers: no padding, so the ratio is exactly the design's.
    let t = tables(&[(2047, 2048), (4095, 2048)]);
    let cfg = TierConfig {
        transport: TransportDType::BF16,
        ..TierConfig::default()
    };
    let r = plan(&t, &cfg).unwrap();
    assert_eq!(r.ram_bytes_per_param(), 14.0);
    let cfg = TierConfig {
        hold_grads: true,
        ..TierConfig::default()
    };
    assert_eq!(plan(&t, &cfg).unwrap().ram_bytes_per_param(), 20.0);
    let cfg = TierConfig {
        transport: TransportDType::F16,
        ..TierConfig::default()
    };
    assert_eq!(plan(&t, &cfg).unwrap().ram_bytes_per_param(), 14.0);
}

#[test]
fn plan_equals_actual() {
    let dir = tempfile::tempdir().unwrap();
    let t = tables(&[(3, 5), (40, 33), (1, 1), (100, 129), (7, 9)]);
    for transport in [TransportDType::F32, TransportDType::BF16, TransportDType::F16] {
        for hold_grads in [false, true] {
            for budget in [None, Some(0u64), Some(200_000), Some(1 << 40)] {
                let cfg = TierConfig {
                    shard: None,
                    shared_transport: None,
                    transport,
                    hold_grads,
                    grads_on_device: Vec::new(),
                    ram_budget_bytes: budget,
                    spill_dir: Some(dir.path().to_path_buf()),
                };
                let planned = plan(&t, &cfg);
                let actual = HostTier::new(t.clone(), cfg.clone());
                match (planned, actual) {
                    (Ok(p), Ok(a)) => assert_eq!(p, a.report(), "{cfg:?}"),
                    (Err(p), Err(a)) => assert_eq!(p.to_string(), a.to_string()),
                    (p, a) => panic!("plan {p:?} vs actual {:?} for {cfg:?}", a.map(|a| a.report())),
                }
            }
        }
    }
}

#[test]
fn small_budget_spills_a_suffix_to_disk() {
    let dir = tempfile::tempdir().unwrap();
    // Four layers of 4096 elements (+64 bias): each 5 pages f32 per block.
    let t = tables(&[(64, 64); 4]);
    let per_layer_f32 = 5 * PAGE as u64; // 4160 f32 = 16640 B -> 5 pages
    let transport_all = 4 * 3 * PAGE as u64; // 4160 bf16 = 8320 B -> 3 pages
    // Room for the transport copies and exactly two layers' p, m, v.
    let budget = transport_all + 2 * 3 * per_layer_f32;
    let cfg = TierConfig {
        shard: None,
        shared_transport: None,
        transport: TransportDType::BF16,
        hold_grads: false,
        grads_on_device: Vec::new(),
        ram_budget_bytes: Some(budget),
        spill_dir: Some(dir.path().to_path_buf()),
    };
    let mut tier = HostTier::new(t.clone(), cfg.clone()).unwrap();
    let r = tier.report();
    assert_eq!(r.first_spilled, Some(2));
    assert_eq!(r.layers_spilled(), 2);
    assert_eq!(r.ram.total(), budget);
    assert_eq!(r.disk.params, 2 * per_layer_f32);
    assert_eq!(r.disk.moments, 4 * per_layer_f32);
    assert_eq!(r.disk.transport, 0);
    let spilled: Vec<bool> = tier.layers().iter().map(LayerSlab::is_spilled).collect();
    assert_eq!(spilled, vec![false, false, true, true]);

    // Spilled layers behave like RAM ones.
    fill(&mut tier, 3);
    let l3 = tier.layer(3).unwrap();
    let w: Vec<f32> = l3.param("layers.3.w").unwrap().to_vec();
    assert_eq!(w.len(), 4096);
    match l3.transport() {
        TransportRef::BF16(t) => assert_eq!(
            t[..4096],
            w.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()
        ),
        _ => panic!("expected bf16 transport"),
    }

    // One byte less and layer 1 no longer fits.
    let r = plan(
        &t,
        &TierConfig {
            ram_budget_bytes: Some(budget - 1),
            ..cfg.clone()
        },
    )
    .unwrap();
    assert_eq!(r.first_spilled, Some(1));

    // Without a spill directory the same budget is an error with numbers.
    let err = HostTier::new(
        t.clone(),
        TierConfig {
            spill_dir: None,
            ..cfg.clone()
        },
    )
    .unwrap_err();
    assert!(
        matches!(err, TierError::BudgetExceeded { budget: b, .. } if b == budget),
        "{err}"
    );
    let err = plan(
        &t,
        &TierConfig {
            ram_budget_bytes: Some(transport_all - 1),
            ..cfg
        },
    )
    .unwrap_err();
    assert!(matches!(err, TierError::TransportOverBudget { needed, .. } if needed == transport_all));
}

#[test]
fn blocks_are_page_aligned_and_views_follow_the_table() {
    let cfg = TierConfig {
        hold_grads: true,
        ..TierConfig::default()
    };
    let mut tier = HostTier::new(tables(&[(3, 5), (2, 7)]), cfg).unwrap();
    for layer in tier.layers() {
        for block in [layer.params(), layer.m(), layer.v(), layer.grads().unwrap()] {
            assert_eq!(block.as_ptr() as usize % PAGE, 0);
            assert_eq!(block.len(), layer.numel());
        }
        assert_eq!(layer.transport().as_bytes().as_ptr() as usize % PAGE, 0);
    }
    let layer = tier.layer_mut(0).unwrap();
    layer
        .param_mut("layers.0.b")
        .unwrap()
        .copy_from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(layer.params()[15..20], [1.0, 2.0, 3.0, 4.0, 5.0]);
    assert!(layer.params()[..15].iter().all(|&x| x == 0.0));
    let err = layer.param("layers.1.b").unwrap_err();
    assert!(
        matches!(&err, TierError::UnknownParam { layer: 0, name } if name == "layers.1.b"),
        "{err}"
    );
    assert_eq!(tier.find_param("layers.1.w").unwrap().0, 1);
    assert!(tier.find_param("nope").is_none());
    assert!(matches!(
        tier.layer(2),
        Err(TierError::LayerOutOfRange { index: 2, len: 2 })
    ));
}

#[test]
fn refresh_transport_rounds_to_nearest_even() {
    let mut tier = HostTier::new(
        tables(&[(1, 2)]),
        TierConfig {
            transport: TransportDType::BF16,
            ..TierConfig::default()
        },
    )
    .unwrap();
    let layer = tier.layer_mut(0).unwrap();
    // 1 + 2^-8 ties down to 1; 1 + 3*2^-8 ties up to 1 + 2^-6.
    let vals = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), -0.0, f32::NAN];
    layer.params_mut().copy_from_slice(&vals);
    layer.refresh_transport();
    let TransportRef::BF16(t) = layer.transport() else {
        panic!("bf16")
    };
    assert_eq!(t[0].to_f32(), 1.0);
    assert_eq!(t[1].to_f32(), 1.0 + 2f32.powi(-6));
    assert_eq!(t[2].to_bits(), 0x8000);
    assert!(t[3].is_nan());

    let mut tier = HostTier::new(tables(&[(1, 2)]), TierConfig::default()).unwrap();
    let layer = tier.layer_mut(0).unwrap();
    layer.params_mut().copy_from_slice(&vals);
    layer.refresh_transport();
    let TransportRef::F32(t) = layer.transport() else {
        panic!("f32")
    };
    assert!(t.iter().zip(&vals).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn f16_refresh_rounds_to_nearest_even_and_saturates() {
    let mut tier = HostTier::new(
        tables(&[(2, 2)]),
        TierConfig {
            transport: TransportDType::F16,
            ..TierConfig::default()
        },
    )
    .unwrap();
    let layer = tier.layer_mut(0).unwrap();
    // 1 + 2^-11 ties down to 1; 1 + 3*2^-11 ties up to 1 + 2^-9; 1e5 is
    // past f16's range and saturates instead of becoming infinity.
    let vals = [
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1e5,
        -7e4,
        f32::NAN,
        -0.0,
    ];
    layer.params_mut().copy_from_slice(&vals);
    layer.refresh_transport();
    let TransportRef::F16(t) = layer.transport() else {
        panic!("f16")
    };
    assert_eq!(t[0].to_f32(), 1.0);
    assert_eq!(t[1].to_f32(), 1.0 + 2f32.powi(-9));
    assert_eq!(t[2].to_f32(), 65504.0);
    assert_eq!(t[3].to_f32(), -65504.0);
    assert!(t[4].is_nan());
    assert_eq!(t[5].to_bits(), 0x8000);
    assert_eq!(layer.transport().as_bytes().len(), 12);
}

#[test]
fn duplicate_names_across_layers_are_rejected() {
    let mut t = tables(&[(2, 2), (2, 2)]);
    t[1].push("layers.0.w", [1], false).unwrap();
    let err = HostTier::new(t, TierConfig::default()).unwrap_err();
    assert!(matches!(&err, TierError::DuplicateParam { name, first: 0, second: 1 } if name == "layers.0.w"));
}

#[test]
fn transport_dtype_parses_and_names_itself() {
    assert_eq!("bf16".parse::<TransportDType>().unwrap(), TransportDType::BF16);
    assert_eq!("fp32".parse::<TransportDType>().unwrap(), TransportDType::F32);
    assert_eq!("f16".parse::<TransportDType>().unwrap(), TransportDType::F16);
    assert_eq!("fp16".parse::<TransportDType>().unwrap(), TransportDType::F16);
    assert!("int8".parse::<TransportDType>().is_err());
    assert_eq!(TransportDType::BF16.to_string(), "bf16");
    assert_eq!(TransportDType::F16.to_string(), "f16");
    assert_eq!(TransportDType::F16.size_in_bytes(), 2);
}

#[test]
fn empty_layers_are_fine() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = tables(&[(0, 3), (2, 0)]);
    t.push(megatrain_tensor::ParamTable::new());
    let cfg = TierConfig {
        ram_budget_bytes: Some(PAGE as u64), // the one non-empty transport copy
        spill_dir: Some(dir.path().to_path_buf()),
        ..TierConfig::default()
    };
    let mut tier = HostTier::new(t.clone(), cfg.clone()).unwrap();
    tier.refresh_all_transport();
    let r = tier.report();
    assert_eq!(r, plan(&t, &cfg).unwrap());
    assert_eq!(
        (r.first_spilled, r.ram.total(), r.disk.total()),
        (Some(0), PAGE as u64, 3 * PAGE as u64)
    );
    let _ = LayerSlab::new(9, t[2].clone(), TransportDType::BF16, true, &Backing::Ram).unwrap();
}

mod odd_sizes {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn any_shapes_account_align_and_round_trip_views(
            dims in proptest::collection::vec((0usize..70, 0usize..70), 1..5),
            transport in 0usize..3,
            grads in any::<bool>(),
            budget in proptest::option::of(0u64..400_000),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let t = tables(&dims);
            let cfg = TierConfig {
                shard: None,
                shared_transport: None,
                transport: [TransportDType::F32, TransportDType::BF16, TransportDType::F16][transport],
                hold_grads: grads,
                grads_on_device: Vec::new(),
                ram_budget_bytes: budget,
                spill_dir: Some(dir.path().to_path_buf()),
            };
            let planned = plan(&t, &cfg);
            let Ok(planned) = planned else {
                let over = matches!(planned, Err(TierError::TransportOverBudget { .. }));
                prop_assert!(over, "unexpected plan error");
                return Ok(());
            };
            let mut tier = HostTier::new(t, cfg).unwrap();
            prop_assert_eq!(&tier.report(), &planned);
            if let Some(b) = budget { prop_assert!(planned.ram.total() <= b); }
            fill(&mut tier, 1);
            for layer in tier.layers() {
                if layer.numel() > 0 {
                    prop_assert_eq!(layer.params().as_ptr() as usize % PAGE, 0);
                }
                let mut seen = 0;
                for spec in layer.table().iter() {
                    let v = layer.param(&spec.name).unwrap();
                    prop_assert_eq!(v, &layer.params()[spec.range()]);
                    seen += v.len();
                }
                prop_assert_eq!(seen, layer.numel());
                match layer.transport() {
                    TransportRef::F32(x) => prop_assert!(x == layer.params()),
                    TransportRef::BF16(x) => prop_assert!(x.iter().zip(layer.params()).all(|(a, b)| *a == bf16::from_f32(*b))),
                    TransportRef::F16(x) => prop_assert!(x.iter().zip(layer.params()).all(|(a, b)| *a == f16::from_f32(*b))),
                }
            }
        }
    }
}
