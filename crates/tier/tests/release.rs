//! Releasing the pages of a range: what a rank of a sharded optimizer does
//! with the parts of a layer's state it does not own.

use megatrain_tensor::ParamTable;
use megatrain_tier::{
    AlignedBuf, Backing, HostTier, LayerSlab, PAGE, TierConfig, TierError, TransportDType, TransportRef,
    save_checkpoint,
};

#[test]
fn release_drops_whole_pages_inside_the_range_and_keeps_the_rest() {
    let per_page = PAGE / 4;
    let mut b = AlignedBuf::<f32>::zeroed(3 * per_page + 10).unwrap();
    b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 + 1.0);
    // From the middle of page 0 to the middle of page 2: only page 1 is whole.
    b.release(per_page / 2..2 * per_page + 5).unwrap();
    for (i, &x) in b.iter().enumerate() {
        let released = (per_page..2 * per_page).contains(&i);
        // Anonymous pages handed back read as zero: proof they were released.
        let want = if released { 0.0 } else { i as f32 + 1.0 };
        assert_eq!(x, want, "element {i}");
    }
}

#[test]
fn a_slab_keeps_its_owned_range_of_params_and_moments() {
    let n = 5 * PAGE / 4;
    let mut t = ParamTable::new();
    t.push("w", [n], true).unwrap();
    let mut slab = LayerSlab::new(0, t, TransportDType::F32, false, &Backing::Ram).unwrap();
    slab.params_mut().fill(7.0);
    slab.m_mut().fill(7.0);
    slab.v_mut().fill(7.0);
    let keep = 2 * PAGE / 4..3 * PAGE / 4;
    slab.release_outside(keep.clone()).unwrap();
    for buf in [slab.params(), slab.m(), slab.v()] {
        assert!(buf[keep.clone()].iter().all(|&x| x == 7.0));
        assert!(buf[..keep.start].iter().all(|&x| x == 0.0));
        assert!(buf[keep.end..].iter().all(|&x| x == 0.0));
    }
}

/// A tier kept for forwards hands back every layer's params and moments
/// (they read as zero: released), keeps its transport copies, and refuses
/// a checkpoint, which would write the zeros.
#[test]
fn a_tier_kept_for_forwards_holds_its_transport_copies_alone() {
    let n = 3 * PAGE / 4;
    let tables = (0..2)
        .map(|l| {
            let mut t = ParamTable::new();
            t.push(format!("l{l}.w"), [n], true).unwrap();
            t
        })
        .collect();
    let config = TierConfig {
        transport: TransportDType::BF16,
        ..TierConfig::default()
    };
    let mut tier = HostTier::new(tables, config).unwrap();
    for slab in tier.layers_mut() {
        slab.params_mut().fill(1.5);
        slab.m_mut().fill(2.0);
    }
    tier.refresh_all_transport();
    assert!(!tier.is_transport_only());
    tier.keep_transport_only().unwrap();
    assert!(tier.is_transport_only());
    for slab in tier.layers() {
        assert!(slab.params().iter().chain(slab.m().iter()).all(|&x| x == 0.0));
        let TransportRef::BF16(copy) = slab.transport() else {
            panic!("a bf16 copy")
        };
        assert!(copy.iter().all(|x| x.to_f32() == 1.5));
    }
    let dir = tempfile::tempdir().unwrap();
    let err = save_checkpoint(dir.path(), &tier, &serde_json::json!({})).unwrap_err();
    assert!(matches!(err, TierError::TransportOnly { .. }), "{err}");
    assert!(err.to_string().contains("transport copies"), "{err}");
    assert!(!dir.path().join("checkpoint.json").exists());
}
