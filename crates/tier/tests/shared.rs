//! Transport copies shared by a machine's ranks: every rank's tier maps one
//! file, each writes only its ranks' ranges of it, together they make the
//! copy one tier of its own makes, and each counts its share of it, with a
//! sharded optimizer's tiers (a share of p, m, v each) and with whole ones
//! (a replicated optimizer).

mod common;

use std::path::Path;

use megatrain_tensor::ParamTable;
use megatrain_tier::{
    HostTier, Shard, SharedTransport, TierConfig, TransportDType, create_shared_transport, padded_bytes, plan,
};

/// Awkward sizes: a layer under a page, one of several pages whose shards
/// straddle pages, one that spills under the budget below.
const DIMS: [(usize, usize); 4] = [(3, 5), (7, 1001), (2, 9), (9, 1500)];

fn config(shard: Option<Shard>, spill: Option<&Path>, shared: Option<SharedTransport>) -> TierConfig {
    TierConfig {
        transport: TransportDType::BF16,
        hold_grads: false,
        grads_on_device: Vec::new(),
        // Layers 0..2 in RAM, 3 on disk.
        ram_budget_bytes: spill.map(|_| 64 << 10),
        spill_dir: spill.map(Path::to_path_buf),
        shard,
        shared_transport: shared,
    }
}

/// Writes the same parameters into `tier` as into every other one, and
/// the transport copy (this tier's ranges of it where it is shared).
fn fill(tier: &mut HostTier) {
    for slab in tier.layers_mut() {
        let l = slab.index();
        slab.fill_params(|p| {
            for (i, x) in p.iter_mut().enumerate() {
                *x = ((i * 7 + l * 131) % 1009) as f32 / 97.0 - 5.0;
            }
            Ok::<_, megatrain_tier::TierError>(())
        })
        .unwrap();
        slab.settle().unwrap();
    }
}

fn copies(tier: &HostTier) -> Vec<Vec<u8>> {
    tier.layers()
        .iter()
        .map(|s| s.transport().as_bytes().to_vec())
        .collect()
}

fn alone(tables: &[ParamTable]) -> Vec<Vec<u8>> {
    let mut t = HostTier::new(tables.to_vec(), config(None, None, None)).unwrap();
    fill(&mut t);
    copies(&t)
}

#[test]
fn ranks_write_their_ranges_of_one_copy() {
    let tables = common::tables(&DIMS);
    let want = alone(&tables);
    let dir = tempfile::tempdir().unwrap();
    for (ranks, sharded) in [(2, true), (3, true), (3, false)] {
        for spill in [false, true] {
            let spill_dir = dir.path().join("spill");
            let spill = spill.then_some(spill_dir.as_path());
            let file = create_shared_transport(dir.path(), &tables, TransportDType::BF16).unwrap();
            let mut tiers: Vec<HostTier> = (0..ranks)
                .map(|rank| {
                    let shared = SharedTransport {
                        path: file.path().to_path_buf(),
                        file: None,
                        writes: vec![rank],
                        ranks,
                        local: ranks,
                    };
                    let shard = sharded.then_some(Shard { rank, ranks });
                    let cfg = config(shard, spill, Some(shared));
                    HostTier::new(tables.clone(), cfg).unwrap()
                })
                .collect();
            drop(file);
            assert_eq!(tiers[0].has_spill(), spill.is_some());
            // All but the last rank have written: its ranges are still zero
            // in every rank's view, the others' are the copy.
            for t in &mut tiers[..ranks - 1] {
                fill(t);
            }
            let last = &tiers[ranks - 1];
            for (l, slab) in last.layers().iter().enumerate() {
                let writes = slab.transport_writes();
                assert_eq!(writes.len(), 1);
                let copy = slab.transport();
                for (i, pair) in copy.as_bytes().chunks(2).enumerate() {
                    let theirs = !writes[0].contains(&i);
                    let expect = if theirs {
                        &want[l][2 * i..2 * i + 2]
                    } else {
                        &[0, 0][..]
                    };
                    assert_eq!(pair, expect, "{ranks} ranks, layer {l}, element {i}");
                }
            }
            fill(&mut tiers[ranks - 1]);
            for t in &tiers {
                assert_eq!(copies(t), want, "{ranks} ranks, spill {}", spill.is_some());
            }
            // Each counts its share of the copies, as the plan does.
            let whole: u64 = tables.iter().map(|t| padded_bytes(t.numel(), 2)).sum();
            for t in &tiers {
                let r = t.report();
                assert_eq!(r.ram.transport, whole.div_ceil(ranks as u64));
                assert_eq!(r, plan(&tables, t.config()).unwrap());
            }
        }
    }
}

#[test]
fn a_file_made_for_another_model_or_cut_for_other_ranks_is_refused() {
    let tables = common::tables(&DIMS);
    let dir = tempfile::tempdir().unwrap();
    let other = create_shared_transport(dir.path(), &tables[..2], TransportDType::BF16).unwrap();
    let shared = SharedTransport {
        path: other.path().to_path_buf(),
        file: None,
        writes: vec![0],
        ranks: 2,
        local: 2,
    };
    let shard = Some(Shard { rank: 0, ranks: 2 });
    let err = HostTier::new(tables.clone(), config(shard, None, Some(shared.clone()))).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains(&other.path().display().to_string()) && msg.contains("bytes"),
        "{msg}"
    );
    let three = Some(Shard { rank: 0, ranks: 3 });
    let err = HostTier::new(tables.clone(), config(three, None, Some(shared.clone()))).unwrap_err();
    assert!(
        err.to_string()
            .contains("cut for 2 ranks, but the optimizer is sharded over 3"),
        "{err}"
    );
    let bad = SharedTransport {
        writes: vec![2],
        ..shared
    };
    let err = HostTier::new(tables, config(shard, None, Some(bad))).unwrap_err();
    assert!(err.to_string().contains("rank 2 of 2 ranks"), "{err}");
}
