mod common;

use std::path::{Path, PathBuf};

use common::{fill, tables};
use megatrain_tier::shard::layer_ranges;
use megatrain_tier::{
    HostTier, MODEL_FILE, OPTIMIZER_FILE, STEPS_TENSOR, Shard, TierConfig, TierError, TransportDType,
    TransportRef, load_checkpoint, read_checkpoint_meta, read_latest, save_checkpoint,
    verify_checkpoint_file, write_latest,
};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::json;

const DIMS: [(usize, usize); 3] = [(3, 5), (7, 4), (2, 9)];

fn new_tier(spill: Option<&Path>) -> HostTier {
    let cfg = TierConfig {
        shard: None,
        transport: TransportDType::BF16,
        hold_grads: false,
        grads_on_device: Vec::new(),
        // Room for the transport copies and layer 0 only: layers 1, 2 spill.
        ram_budget_bytes: spill.map(|_| 3 * 4096 + 3 * 4096),
        spill_dir: spill.map(Path::to_path_buf),
        shared_transport: None,
    };
    HostTier::new(tables(&DIMS), cfg).unwrap()
}

fn saved(seed: u32) -> (tempfile::TempDir, PathBuf, HostTier) {
    let run = tempfile::tempdir().unwrap();
    let ckpt = run.path().join("step-000010");
    let mut tier = new_tier(None);
    fill(&mut tier, seed);
    save_checkpoint(&ckpt, &tier, &json!({"step": 10, "lr": 3e-4})).unwrap();
    (run, ckpt, tier)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn assert_same(a: &HostTier, b: &HostTier) {
    for (x, y) in a.layers().iter().zip(b.layers()) {
        assert_eq!(bits(x.params()), bits(y.params()));
        assert_eq!(bits(x.m()), bits(y.m()));
        assert_eq!(bits(x.v()), bits(y.v()));
        assert_eq!(x.step(), y.step());
    }
}

#[test]
fn round_trip_is_bit_exact_into_a_spilled_tier() {
    let (_run, ckpt, tier) = saved(5);
    let spill = tempfile::tempdir().unwrap();
    let mut back = new_tier(Some(spill.path()));
    assert_eq!(back.report().first_spilled, Some(1));
    let meta = load_checkpoint(&ckpt, &mut back).unwrap();
    assert_same(&tier, &back);
    assert_eq!(meta.layer_steps, vec![105, 106, 107]);
    assert_eq!(meta.extra, json!({"step": 10, "lr": 3e-4}));
    assert_eq!(meta.n_params, tier.n_params());
    // Transport copies were refreshed from the loaded params.
    for layer in back.layers() {
        let TransportRef::BF16(t) = layer.transport() else {
            panic!("bf16")
        };
        assert!(
            t.iter()
                .zip(layer.params())
                .all(|(a, b)| *a == half::bf16::from_f32(*b))
        );
    }
    // Only the three files, no temporaries.
    let mut names: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["checkpoint.json", "model.safetensors", "optimizer.safetensors"]
    );
}

#[test]
fn model_file_is_plain_hf_safetensors() {
    let (_run, ckpt, tier) = saved(1);
    let bytes = std::fs::read(ckpt.join(MODEL_FILE)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 6);
    let w = st.tensor("layers.1.w").unwrap();
    assert_eq!((w.dtype(), w.shape()), (Dtype::F32, &[7usize, 4][..]));
    let want: Vec<u8> = tier.layers()[1]
        .param("layers.1.w")
        .unwrap()
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(w.data(), &want[..]);
    let (_, md) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(md.metadata().as_ref().unwrap()["format"], "pt");
    let opt = std::fs::read(ckpt.join(OPTIMIZER_FILE)).unwrap();
    let st = SafeTensors::deserialize(&opt).unwrap();
    assert!(st.tensor("layers.2.b.exp_avg").is_ok() && st.tensor("layers.2.b.exp_avg_sq").is_ok());
    assert_eq!(st.tensor(STEPS_TENSOR).unwrap().dtype(), Dtype::U64);
}

/// Rewrites a safetensors file through `edit` (name, dtype, shape, bytes).
fn rewrite(path: &Path, edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut ts);
    let views: Vec<_> = ts
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Loading `ckpt` fails with an error naming `file` and `tensor`, and the
/// tier is left untouched.
fn load_fails(ckpt: &Path, file: &str, tensor: &str) -> TierError {
    let mut tier = new_tier(None);
    fill(&mut tier, 77);
    let before = bits(tier.layers()[0].params());
    let err = load_checkpoint(ckpt, &mut tier).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&ckpt.join(file).display().to_string()), "{msg}");
    assert!(msg.contains(&format!("'{tensor}'")), "{msg}");
    assert_eq!(
        bits(tier.layers()[0].params()),
        before,
        "tier modified by a failed load"
    );
    err
}

#[test]
fn missing_tensor_is_named() {
    let (_run, ckpt, _) = saved(2);
    rewrite(&ckpt.join(MODEL_FILE), |ts| ts.retain(|t| t.0 != "layers.2.b"));
    let err = load_fails(&ckpt, MODEL_FILE, "layers.2.b");
    assert!(matches!(err, TierError::MissingTensor { .. }));

    let (_run, ckpt, _) = saved(2);
    rewrite(&ckpt.join(OPTIMIZER_FILE), |ts| {
        ts.retain(|t| t.0 != STEPS_TENSOR)
    });
    assert!(matches!(
        load_fails(&ckpt, OPTIMIZER_FILE, STEPS_TENSOR),
        TierError::MissingTensor { .. }
    ));
}

#[test]
fn wrong_shape_is_named() {
    let (_run, ckpt, _) = saved(2);
    rewrite(&ckpt.join(OPTIMIZER_FILE), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "layers.0.w.exp_avg_sq").unwrap();
        t.2 = vec![5, 3];
    });
    let err = load_fails(&ckpt, OPTIMIZER_FILE, "layers.0.w.exp_avg_sq");
    assert!(
        matches!(err, TierError::WrongShape { expected, got, .. } if expected == [3, 5] && got == [5, 3])
    );
}

#[test]
fn wrong_dtype_is_named() {
    let (_run, ckpt, _) = saved(2);
    rewrite(&ckpt.join(MODEL_FILE), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "layers.1.b").unwrap();
        t.1 = Dtype::F16;
        t.3.truncate(t.3.len() / 2);
    });
    let err = load_fails(&ckpt, MODEL_FILE, "layers.1.b");
    assert!(matches!(err, TierError::WrongDType { .. }));
    assert!(err.to_string().contains("F16"), "{err}");
}

#[test]
fn unexpected_tensor_is_named() {
    let (_run, ckpt, _) = saved(2);
    rewrite(&ckpt.join(MODEL_FILE), |ts| {
        ts.push(("lm_head.weight".into(), Dtype::F32, vec![1], vec![0; 4]))
    });
    assert!(matches!(
        load_fails(&ckpt, MODEL_FILE, "lm_head.weight"),
        TierError::UnexpectedTensor { .. }
    ));
}

#[test]
fn truncated_file_names_the_cut_tensor() {
    let (_run, ckpt, _) = saved(2);
    let path = ckpt.join(MODEL_FILE);
    let bytes = std::fs::read(&path).unwrap();
    // The data section is in layer and table order: layers.2.b is last.
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let err = load_fails(&ckpt, MODEL_FILE, "layers.2.b");
    assert!(matches!(err, TierError::Corrupt { .. }));
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn garbage_header_names_the_file() {
    let (_run, ckpt, _) = saved(2);
    let path = ckpt.join(OPTIMIZER_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..16].copy_from_slice(b"\xff\xfe garbx");
    std::fs::write(&path, &bytes).unwrap();
    let mut tier = new_tier(None);
    let err = load_checkpoint(&ckpt, &mut tier).unwrap_err();
    assert!(matches!(err, TierError::Corrupt { tensor: None, .. }), "{err}");
    assert!(err.to_string().contains(&path.display().to_string()), "{err}");

    std::fs::write(&path, b"short").unwrap();
    let err = load_checkpoint(&ckpt, &mut tier).unwrap_err();
    assert!(matches!(err, TierError::Corrupt { .. }), "{err}");
}

/// Flips one bit of `tensor`'s data in `file`, the file's layout unchanged.
fn flip_bit(ckpt: &Path, file: &str, tensor: &str) {
    rewrite(&ckpt.join(file), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == tensor).unwrap();
        t.3[1] ^= 0x10;
    });
}

#[test]
fn a_flipped_bit_in_the_data_is_named_by_its_crc() {
    for (file, tensor) in [
        (MODEL_FILE, "layers.1.w"),
        (OPTIMIZER_FILE, "layers.2.b.exp_avg_sq"),
        (OPTIMIZER_FILE, STEPS_TENSOR),
    ] {
        let (_run, ckpt, _) = saved(3);
        assert!(verify_checkpoint_file(&ckpt, file).is_ok());
        flip_bit(&ckpt, file, tensor);
        let path = ckpt.join(file).display().to_string();
        for err in [
            load_checkpoint(&ckpt, &mut new_tier(None)).unwrap_err(),
            verify_checkpoint_file(&ckpt, file).unwrap_err(),
        ] {
            let msg = err.to_string();
            assert!(matches!(err, TierError::Corrupt { .. }), "{msg}");
            assert!(
                msg.contains(&path) && msg.contains(&format!("'{tensor}'")),
                "{msg}"
            );
            assert!(msg.contains("CRC-32"), "{msg}");
        }
    }
}

#[test]
fn crcs_are_checked_where_a_checkpoint_has_them() {
    let meta_path = |ckpt: &Path| ckpt.join("checkpoint.json");
    let edit_meta = |ckpt: &Path, edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(meta_path(ckpt)).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(meta_path(ckpt), serde_json::to_vec(&v).unwrap()).unwrap();
    };
    // One per tensor of each file, in checkpoint.json.
    let (_run, ckpt, tier) = saved(6);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(meta_path(&ckpt)).unwrap()).unwrap();
    assert_eq!(v["crc32"][MODEL_FILE].as_object().unwrap().len(), 6);
    assert_eq!(v["crc32"][OPTIMIZER_FILE].as_object().unwrap().len(), 13);

    // A checkpoint written before CRCs loads as before.
    edit_meta(&ckpt, &|v| {
        v.as_object_mut().unwrap().remove("crc32");
    });
    let mut back = new_tier(None);
    load_checkpoint(&ckpt, &mut back).unwrap();
    assert_same(&tier, &back);
    assert!(verify_checkpoint_file(&ckpt, MODEL_FILE).is_ok());

    // A table without a tensor is refused before anything is written.
    let (_run, ckpt, _) = saved(6);
    edit_meta(&ckpt, &|v| {
        v["crc32"][MODEL_FILE]
            .as_object_mut()
            .unwrap()
            .remove("layers.0.b");
    });
    let err = load_fails(&ckpt, "checkpoint.json", "layers.0.b");
    assert!(matches!(err, TierError::Meta { .. }), "{err}");
    assert!(matches!(
        verify_checkpoint_file(&ckpt, MODEL_FILE),
        Err(TierError::Meta { .. })
    ));

    // So is one that is not hex.
    let (_run, ckpt, _) = saved(6);
    edit_meta(&ckpt, &|v| {
        v["crc32"][OPTIMIZER_FILE]["layers.0.b.exp_avg"] = "zz".into()
    });
    let err = load_checkpoint(&ckpt, &mut new_tier(None)).unwrap_err();
    assert!(
        matches!(err, TierError::Meta { .. }) && err.to_string().contains("layers.0.b.exp_avg"),
        "{err}"
    );
}

#[test]
fn checkpoint_of_another_model_is_refused_by_its_metadata() {
    let (_run, ckpt, _) = saved(2);
    let mut other = HostTier::new(tables(&[(3, 5), (7, 4)]), TierConfig::default()).unwrap();
    let err = load_checkpoint(&ckpt, &mut other).unwrap_err();
    assert!(matches!(err, TierError::Meta { .. }), "{err}");
    assert!(err.to_string().contains("checkpoint.json"), "{err}");
    std::fs::write(ckpt.join("checkpoint.json"), b"{\"format\": \"other\"}").unwrap();
    assert!(matches!(read_checkpoint_meta(&ckpt), Err(TierError::Meta { .. })));
}

#[test]
fn latest_pointer_survives_a_crash_mid_checkpoint() {
    let (run, ckpt, tier) = saved(4);
    let run = run.path();
    assert_eq!(read_latest(run).unwrap(), None);
    write_latest(run, "step-000010").unwrap();
    assert_eq!(read_latest(run).unwrap(), Some(ckpt.clone()));

    // A crash while writing the next checkpoint and its pointer: stray
    // temporaries, no checkpoint.json in the new directory.
    let next = run.join("step-000020");
    std::fs::create_dir(&next).unwrap();
    std::fs::write(next.join(".model.safetensors.tmp-999-0"), b"partial").unwrap();
    std::fs::write(run.join(".latest.tmp-999-0"), b"step-000020\n").unwrap();
    std::fs::write(ckpt.join(".optimizer.safetensors.tmp-999-1"), b"partial").unwrap();

    assert_eq!(read_latest(run).unwrap(), Some(ckpt.clone()));
    let mut back = new_tier(None);
    load_checkpoint(&read_latest(run).unwrap().unwrap(), &mut back).unwrap();
    assert_same(&tier, &back);
    let err = load_checkpoint(&next, &mut back).unwrap_err();
    assert!(
        matches!(&err, TierError::Io { path, .. } if path.ends_with("checkpoint.json")),
        "{err}"
    );

    // Overwriting a checkpoint in place first invalidates it.
    let mut changed = new_tier(None);
    fill(&mut changed, 9);
    save_checkpoint(&ckpt, &changed, &json!(null)).unwrap();
    load_checkpoint(&ckpt, &mut back).unwrap();
    assert_same(&changed, &back);

    write_latest(run, "step-000020").unwrap();
    assert_eq!(read_latest(run).unwrap(), Some(next));
}

#[test]
fn latest_pointer_rejects_paths() {
    let run = tempfile::tempdir().unwrap();
    for bad in ["", "..", "a/b", "../x", ".x.tmp-1"] {
        assert!(
            matches!(write_latest(run.path(), bad), Err(TierError::Meta { .. })),
            "{bad:?}"
        );
    }
    std::fs::write(run.path().join("latest"), "../../etc\n").unwrap();
    let err = read_latest(run.path()).unwrap_err();
    assert!(err.to_string().contains("latest"), "{err}");
}

/// A checkpoint loaded into each rank's tier of a sharded optimizer (4
/// ranks, the last layer spilled): every rank holds its own range of each
/// layer's p, m and v with the checkpoint's bits and the whole transport
/// copy; it has handed the rest of a RAM layer back (an anonymous page
/// handed back reads as zero); a spilled layer's files hold blocks for its
/// range only, and nothing was written outside it.
#[test]
fn a_sharded_rank_loads_its_share_and_the_whole_transport_copy() {
    let dims = [(64, 63), (128, 31), (32, 127)]; // 4095, 3999, 4191 elements
    let run = tempfile::tempdir().unwrap();
    let ckpt = run.path().join("ckpt");
    let mut whole = HostTier::new(tables(&dims), TierConfig::default()).unwrap();
    fill(&mut whole, 3);
    save_checkpoint(&ckpt, &whole, &json!({})).unwrap();
    let spill = tempfile::tempdir().unwrap();
    for rank in 0..4 {
        let shard = Shard { rank, ranks: 4 };
        let cfg = TierConfig {
            // f32 transport copies (4 + 4 + 5 pages) and the two first
            // layers' shares (3 blocks of a page, plus the one a range
            // boundary straddles): the last layer spills.
            ram_budget_bytes: Some((13 + 2 * 6) * 4096),
            spill_dir: Some(spill.path().to_path_buf()),
            shard: Some(shard),
            ..TierConfig::default()
        };
        let mut tier = HostTier::new(tables(&dims), cfg.clone()).unwrap();
        assert_eq!(tier.report().first_spilled, Some(2), "rank {rank}");
        assert_eq!(tier.report(), megatrain_tier::plan(&tables(&dims), &cfg).unwrap());
        load_checkpoint(&ckpt, &mut tier).unwrap();
        for (a, b) in whole.layers().iter().zip(tier.layers()) {
            let n = a.numel();
            let own = layer_ranges(n, b.is_spilled(), 4)[rank].clone();
            assert_eq!(b.own(), own);
            assert_eq!(a.transport().as_bytes(), b.transport().as_bytes(), "rank {rank}");
            if let Some(files) = b.spilled() {
                let pages =
                    |r: &std::ops::Range<usize>| ((r.end * 4).div_ceil(4096) - r.start * 4 / 4096) as u64;
                let want = pages(&own);
                assert!(want < pages(&(0..n)));
                assert_eq!(b.reserved(), own.clone());
                for f in [&files.p, &files.m, &files.v] {
                    let got = f.allocated_bytes().unwrap();
                    assert!(
                        got <= want * 4096 && got > 0,
                        "rank {rank}: {got} bytes on disk for {want} pages"
                    );
                }
            }
            for (x, y) in [(a.params(), b.params()), (a.m(), b.m()), (a.v(), b.v())] {
                assert_eq!(bits(&x[own.clone()]), bits(&y[own.clone()]), "rank {rank}");
                if b.is_spilled() {
                    assert!(
                        y[..own.start].iter().chain(&y[own.end..]).all(|&v| v == 0.0),
                        "rank {rank}: written outside its range of a spilled layer"
                    );
                    continue;
                }
                // Whole pages outside the range were handed back.
                let page = 1024;
                let first_page_after = (own.end.div_ceil(page) * page).min(n);
                assert!(
                    y[first_page_after..].iter().all(|&v| v == 0.0),
                    "rank {rank} layer {}: pages after {own:?} kept",
                    b.index()
                );
                let last_page_before = own.start / page * page;
                assert!(
                    y[..last_page_before].iter().all(|&v| v == 0.0),
                    "rank {rank} layer {}: pages before {own:?} kept",
                    b.index()
                );
            }
        }
    }
}

/// File tables name a layer's elements otherwise in checkpoints (Phi-3's
/// fused projections): a layer's two tensors saved as one and loaded back
/// exactly; a file table that covers another number of elements is
/// refused, naming the layer.
#[test]
fn file_tables_join_tensors_in_checkpoints() {
    let joined = |t: &megatrain_tensor::ParamTable, l: usize| {
        let mut f = megatrain_tensor::ParamTable::new();
        f.push(format!("layers.{l}.wb"), [t.numel()], true).unwrap();
        f
    };
    let with_files = |tier: &mut HostTier| {
        let files = tier
            .layers()
            .iter()
            .enumerate()
            .map(|(l, s)| joined(s.table(), l))
            .collect();
        tier.set_file_tables(files).unwrap();
    };
    let run = tempfile::tempdir().unwrap();
    let ckpt = run.path().join("step-000001");
    let mut tier = new_tier(None);
    fill(&mut tier, 9);
    with_files(&mut tier);
    save_checkpoint(&ckpt, &tier, &json!({})).unwrap();
    let bytes = std::fs::read(ckpt.join(MODEL_FILE)).unwrap();
    let mut names: Vec<String> = SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(String::from)
        .collect();
    names.sort();
    assert_eq!(names, ["layers.0.wb", "layers.1.wb", "layers.2.wb"]);
    let mut back = new_tier(None);
    with_files(&mut back);
    load_checkpoint(&ckpt, &mut back).unwrap();
    assert_same(&tier, &back);
    // A tier that names its tensors by its tables does not load them.
    assert!(load_checkpoint(&ckpt, &mut new_tier(None)).is_err());
    let mut short = megatrain_tensor::ParamTable::new();
    short.push("x", [3], true).unwrap();
    let err = tier.layers_mut()[1].set_file_table(short).unwrap_err();
    assert!(
        matches!(
            err,
            TierError::FileTable {
                layer: 1,
                file: 3,
                ..
            }
        ),
        "{err}"
    );
    let err = tier.set_file_tables(Vec::new()).unwrap_err();
    assert!(
        matches!(err, TierError::FileTables { got: 0, layers: 3 }),
        "{err}"
    );
}

#[test]
fn a_non_finite_value_is_never_saved_and_the_last_checkpoint_stays_current() {
    let (run, good, _) = saved(3);
    let run = run.path();
    write_latest(run, "step-000010").unwrap();
    let spill = tempfile::tempdir().unwrap();
    // Each of p, m and v, in a layer in RAM and in spilled ones.
    for (what, layer, at, value) in [
        ("p", 1, 20, f32::NAN),
        ("m", 2, 17, f32::INFINITY),
        ("v", 0, 0, f32::NEG_INFINITY),
        ("p", 2, 19, f32::INFINITY),
    ] {
        let mut tier = new_tier((layer != 0).then_some(spill.path()));
        fill(&mut tier, 7);
        let slab = &mut tier.layers_mut()[layer];
        let name = {
            let spec = slab
                .file_table()
                .iter()
                .find(|s| s.range().contains(&at))
                .unwrap();
            let at = at - spec.range().start;
            let name = match what {
                "p" => spec.name.clone(),
                "m" => megatrain_tier::exp_avg_name(&spec.name),
                _ => megatrain_tier::exp_avg_sq_name(&spec.name),
            };
            (name, at)
        };
        match what {
            "p" => slab.params_mut()[at] = value,
            "m" => slab.m_mut()[at] = value,
            _ => slab.v_mut()[at] = value,
        }
        let next = run.join("step-000020");
        let err = save_checkpoint(&next, &tier, &json!(null)).unwrap_err();
        match &err {
            TierError::NonFinite {
                dir,
                tensor,
                index,
                value: v,
            } => {
                assert_eq!((dir, tensor, *index), (&next, &name.0, name.1), "{err}");
                assert_eq!(v.to_bits(), value.to_bits());
            }
            e => panic!("{what} of layer {layer}: {e}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("not saved") && msg.contains(&name.0) && msg.contains("step-000020"),
            "{msg}"
        );
        // Nothing of it is left but its directory: no tensor file, no
        // temporary, no checkpoint.json; the pointer still names the last.
        let left: Vec<_> = std::fs::read_dir(&next)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        assert_eq!(read_latest(run).unwrap(), Some(good.clone()));
        load_checkpoint(&good, &mut new_tier(None)).unwrap();
    }
    // The largest finite value and subnormals are values like any other.
    let mut tier = new_tier(None);
    fill(&mut tier, 7);
    tier.layers_mut()[1].params_mut()[3] = f32::MAX;
    tier.layers_mut()[1].v_mut()[4] = f32::from_bits(1);
    save_checkpoint(&run.join("step-000030"), &tier, &json!(null)).unwrap();
}
