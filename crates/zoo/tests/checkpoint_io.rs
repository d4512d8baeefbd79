//! Loading and exporting HF checkpoint directories: round trips (single file,
//! shards, bf16), and the errors for broken files, each naming the file and
//! the tensor.

use crate::common;

use std::path::Path;

use common::{CASES, fixture};
use megatrain_tensor::DType;
use megatrain_zoo::{
    ExportOptions, HfCheckpoint, INDEX_FILE, ZooError, export_hf_dir, load_hf_dir, reshard_safetensors,
};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{Value, json};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Name and shape of every tensor of a safetensors file, sorted by name.
fn tensor_shapes(path: &std::path::Path) -> Vec<(String, Vec<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec()))
        .collect();
    out.sort();
    out
}

fn slabs(m: &megatrain_zoo::LoadedModel) -> Vec<&[f32]> {
    m.slabs.iter().map(Vec::as_slice).collect()
}

#[test]
fn export_then_load_is_exact_for_every_case() {
    for case in CASES {
        let m = load_hf_dir(fixture(case)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        export_hf_dir(
            dir.path(),
            &m.config,
            &m.tables,
            &slabs(&m),
            ExportOptions::default(),
        )
        .unwrap();
        // The names and shapes transformers saved (Phi-3's fused tensors
        // joined again); of a multimodal model, its text model's alone
        // (Gemma 3's under `language_model.`, Qwen3.5's under
        // `model.language_model.` beside `lm_head`; no `mtp.` tensors).
        // GPT-OSS's MXFP4 experts (`_blocks` [E, R, C/32, 16] and
        // `_scales`) come out widened, [E, C, R], under their own names.
        let saved = tensor_shapes(&fixture(case).join("model.safetensors"));
        let mut text_only: Vec<_> = saved
            .into_iter()
            .filter(|(n, _)| !n.ends_with("_scales"))
            .filter_map(|(n, shape)| match (m.config.text_of, n.strip_suffix("_blocks")) {
                (_, Some(n)) => Some((n.to_string(), vec![shape[0], shape[2] * 32, shape[1]])),
                (Some(_), None) => match n.strip_prefix("model.language_model.") {
                    Some(rest) => Some((format!("model.{rest}"), shape)),
                    None if n == "lm_head.weight" => Some((n, shape)),
                    None => n.strip_prefix("language_model.").map(|n| (n.to_string(), shape)),
                },
                (None, None) => Some((n, shape)),
            })
            .collect();
        text_only.sort();
        assert_eq!(
            tensor_shapes(&dir.path().join("model.safetensors")),
            text_only,
            "{case}"
        );
        let back = load_hf_dir(dir.path()).unwrap();
        assert_eq!(back.slabs, m.slabs, "{case}");
        assert_eq!(back.tables, m.tables, "{case}");
        let mut cfg = back.config.clone();
        cfg.raw = None;
        cfg.dtype = None;
        let mut orig = m.config.clone();
        orig.raw = None;
        orig.dtype = None;
        orig.text_of = None;
        assert_eq!(cfg, orig, "{case}");
        assert_eq!(back.config.dtype.as_deref(), Some("float32"), "{case}");
    }
}

#[test]
fn tied_export_has_no_lm_head_and_untied_has_one() {
    for (case, tied) in [("gpt2", true), ("llama_gqa", false)] {
        let m = load_hf_dir(fixture(case)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        export_hf_dir(
            dir.path(),
            &m.config,
            &m.tables,
            &slabs(&m),
            ExportOptions::default(),
        )
        .unwrap();
        let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("lm_head.weight").is_ok(), !tied, "{case}");
        if case == "gpt2" {
            // Conv1D layout [in, out].
            assert_eq!(
                st.tensor("transformer.h.0.mlp.c_fc.weight").unwrap().shape(),
                [48, 192]
            );
        }
    }
}

#[test]
fn sharded_bf16_export_round_trips_through_the_index() {
    let m = load_hf_dir(fixture("llama_tied_bf16")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        dtype: DType::BF16,
        max_shard_bytes: Some(30_000),
    };
    export_hf_dir(dir.path(), &m.config, &m.tables, &slabs(&m), opts).unwrap();
    assert!(dir.path().join(INDEX_FILE).exists());
    let shards = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("model-")
        })
        .count();
    assert!(shards >= 2, "{shards} shards");
    let back = load_hf_dir(dir.path()).unwrap();
    // The fixture is stored in bf16, so bf16 export loses nothing.
    assert_eq!(back.slabs, m.slabs);
    assert_eq!(back.config.dtype.as_deref(), Some("bfloat16"));
}

/// Rewrites `model.safetensors` of a copied fixture with one tensor changed.
fn rewrite_tensor(dir: &Path, name: &str, dtype: Dtype, shape: Vec<usize>, remove: bool) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    if remove {
        owned.retain(|t| t.0 != name);
    } else {
        let t = owned.iter_mut().find(|t| t.0 == name).unwrap();
        let n: usize = shape.iter().product();
        t.1 = dtype;
        t.2 = shape;
        t.3 = vec![0u8; n * dtype.bitsize() / 8];
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn broken_copy(case: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture(case), dir.path());
    dir
}

fn message(e: ZooError) -> String {
    e.to_string()
}

#[test]
fn truncated_file_names_file_and_tensor() {
    let dir = broken_copy("llama_gqa");
    let path = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len - 100).unwrap();
    let err = HfCheckpoint::open(dir.path())
        .err()
        .expect("truncated file must fail");
    assert!(matches!(err, ZooError::Safetensors { .. }), "{err:?}");
    let msg = message(err);
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(msg.contains("truncated") && msg.contains("tensor '"), "{msg}");

    // A file shorter than its own header length.
    f.set_len(5).unwrap();
    let msg = message(HfCheckpoint::open(dir.path()).err().unwrap());
    assert!(
        msg.contains("model.safetensors") && msg.contains("truncated"),
        "{msg}"
    );
}

#[test]
fn wrong_dtype_names_file_and_tensor() {
    let dir = broken_copy("llama_gqa");
    let name = "model.layers.1.mlp.up_proj.weight";
    rewrite_tensor(dir.path(), name, Dtype::I32, vec![88, 48], false);
    let err = load_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ZooError::TensorDType { .. }), "{err:?}");
    let msg = message(err);
    assert!(
        msg.contains("model.safetensors") && msg.contains(name) && msg.contains("I32"),
        "{msg}"
    );
}

#[test]
fn missing_tensor_names_file_and_tensor() {
    let dir = broken_copy("qwen2");
    let name = "model.layers.0.self_attn.k_proj.bias";
    rewrite_tensor(dir.path(), name, Dtype::F32, vec![], true);
    let err = load_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ZooError::MissingTensor { .. }), "{err:?}");
    let msg = message(err);
    assert!(msg.contains("model.safetensors") && msg.contains(name), "{msg}");
}

/// A multimodal checkpoint's text tensors are named where it holds them.
#[test]
fn multimodal_errors_name_the_text_stack_tensor() {
    let dir = broken_copy("gemma3_mm");
    let name = "language_model.model.layers.2.mlp.up_proj.weight";
    rewrite_tensor(dir.path(), name, Dtype::F32, vec![80, 47], false);
    let msg = message(load_hf_dir(dir.path()).unwrap_err());
    assert!(msg.contains(name) && msg.contains("47"), "{msg}");
    rewrite_tensor(dir.path(), name, Dtype::F32, vec![], true);
    let err = load_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ZooError::MissingTensor { .. }), "{err:?}");
    assert!(message(err).contains(name));
}

/// Its text stack under transformers 4.5x's other prefix
/// (`model.language_model.`) loads the same, and the export is the text
/// model alone, under its own names.
#[test]
fn multimodal_text_stack_loads_under_either_prefix_and_exports_alone() {
    let want = load_hf_dir(fixture("gemma3_mm")).unwrap();
    assert_eq!(want.config.text_of, Some("Gemma3ForConditionalGeneration"));
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("gemma3_mm"), dir.path());
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| match n.strip_prefix("language_model.model.") {
            Some(rest) => (format!("model.language_model.{rest}"), t),
            None => (n, t),
        })
        .collect();
    safetensors::serialize_to_file(renamed, None, &file).unwrap();
    let got = load_hf_dir(dir.path()).unwrap();
    assert_eq!(got.slabs, want.slabs);

    let out = tempfile::tempdir().unwrap();
    let slabs: Vec<&[f32]> = got.slabs.iter().map(Vec::as_slice).collect();
    export_hf_dir(
        out.path(),
        &got.config,
        &got.tables,
        &slabs,
        ExportOptions::default(),
    )
    .unwrap();
    let names: Vec<String> = tensor_shapes(&out.path().join("model.safetensors"))
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.starts_with("model.") && !n.contains("language_model")),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains("vision")));
    let back = load_hf_dir(out.path()).unwrap();
    assert_eq!((back.config.text_of, back.slabs), (None, got.slabs));
    assert_eq!(back.config.raw.unwrap()["architectures"][0], "Gemma3ForCausalLM");
}

#[test]
fn shape_disagreeing_with_config_names_file_and_tensor() {
    let dir = broken_copy("qwen3");
    let name = "model.layers.0.self_attn.q_norm.weight";
    rewrite_tensor(dir.path(), name, Dtype::F32, vec![12], false);
    let err = load_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ZooError::TensorShape { .. }), "{err:?}");
    let msg = message(err);
    assert!(
        msg.contains("model.safetensors") && msg.contains(name) && msg.contains("[16]"),
        "{msg}"
    );

    // Config edited instead of the file: same error, the config's view wins.
    let dir = broken_copy("llama_gqa");
    let cfg = dir.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"intermediate_size\": 88", "\"intermediate_size\": 90");
    std::fs::write(&cfg, text).unwrap();
    let msg = message(load_hf_dir(dir.path()).unwrap_err());
    assert!(
        msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[90, 48]"),
        "{msg}"
    );
}

#[test]
fn missing_shard_in_index_names_the_shard() {
    let m = load_hf_dir(fixture("gpt2")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = ExportOptions {
        dtype: DType::F32,
        max_shard_bytes: Some(60_000),
    };
    export_hf_dir(dir.path(), &m.config, &m.tables, &slabs(&m), opts).unwrap();
    let shard = dir.path().join("model-00002-of-00004.safetensors");
    assert!(shard.exists());
    std::fs::remove_file(&shard).unwrap();
    let msg = message(HfCheckpoint::open(dir.path()).err().unwrap());
    assert!(msg.contains("model-00002-of-00004.safetensors"), "{msg}");
}

#[test]
fn gpt2_names_without_transformer_prefix_load() {
    // The original OpenAI GPT-2 conversion has `h.0.attn...`, `wte.weight`.
    let dir = broken_copy("gpt2");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n.strip_prefix("transformer.").unwrap_or(&n).to_string(), v))
        .collect();
    let out = dir.path().join("renamed.safetensors");
    safetensors::serialize_to_file(views, None, &out).unwrap();
    std::fs::rename(&out, &path).unwrap();
    let a = load_hf_dir(fixture("gpt2")).unwrap();
    let b = load_hf_dir(dir.path()).unwrap();
    assert_eq!(a.slabs, b.slabs);
}

/// `narrow_safetensors` writes a file again with its f32 tensors rounded to
/// bf16 or f16 (nearest even, as `convert` rounds and torch's `.to()`
/// does), every other tensor and the metadata as they were; to f32 it
/// writes the same tensors.
#[test]
fn narrowing_a_file_rounds_its_f32_tensors_and_keeps_the_rest() {
    use megatrain_tensor::convert;
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("m.safetensors");
    // Values around rounding boundaries, a subnormal, large and signed ones.
    let w: Vec<f32> = (0..37)
        .map(|i| (i as f32 - 18.0) * 1.000_123_4 * 2f32.powi(i % 7 - 3))
        .chain([1.0 + 2f32.powi(-8), 65504.0, 1e-7, -0.0])
        .collect();
    let ids: Vec<u8> = (0..12).collect();
    let views = vec![
        (
            "w".to_string(),
            TensorView::new(Dtype::F32, vec![41], bytemuck::cast_slice(&w)).unwrap(),
        ),
        (
            "ids".to_string(),
            TensorView::new(Dtype::U8, vec![3, 4], &ids).unwrap(),
        ),
    ];
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta.clone()), &src).unwrap();
    for (dtype, want) in [
        (
            DType::BF16,
            bytemuck::cast_slice(&convert::f32_to_bf16(&w)).to_vec(),
        ),
        (
            DType::F16,
            bytemuck::cast_slice(&convert::f32_to_f16(&w)).to_vec(),
        ),
        (DType::F32, bytemuck::cast_slice(&w).to_vec()),
    ] {
        let dst = dir.path().join(format!("{dtype}.safetensors"));
        megatrain_zoo::narrow_safetensors(&src, &dst, dtype).unwrap();
        let bytes = std::fs::read(&dst).unwrap();
        let (_, got_meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(got_meta.metadata().as_ref(), Some(&meta));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("w").unwrap();
        assert_eq!((t.shape(), t.data()), (&[41][..], &want[..]), "{dtype}");
        let u = st.tensor("ids").unwrap();
        assert_eq!(
            (u.dtype(), u.shape(), u.data()),
            (Dtype::U8, &[3, 4][..], &ids[..])
        );
    }
    let err = megatrain_zoo::narrow_safetensors(&dir.path().join("none"), &dir.path().join("x"), DType::BF16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("none"), "{err}");
}

/// A safetensors file of f32 `tensors` with their data in the order given,
/// as a checkpoint holds its layers (the `safetensors` writer would sort
/// them by name: layer 10 before layer 2).
fn write_in_order(path: &Path, tensors: &[(&str, Vec<f32>)]) {
    let mut header = json!({"__metadata__": {"format": "pt"}});
    let mut offset = 0;
    for (name, v) in tensors {
        let end = offset + v.len() * 4;
        header[*name] = json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [offset, end]});
        offset = end;
    }
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h);
    for (_, v) in tensors {
        bytes.extend_from_slice(bytemuck::cast_slice(v));
    }
    std::fs::write(path, bytes).unwrap();
}

fn read_index(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

/// Name and stored bytes of every tensor of a safetensors file, and its
/// metadata.
#[allow(clippy::type_complexity)]
fn stored(
    path: &Path,
) -> (
    Vec<(String, Vec<u8>)>,
    Option<std::collections::HashMap<String, String>>,
) {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().to_vec()))
        .collect();
    tensors.sort();
    (tensors, meta.metadata().clone())
}

/// Shards hold the source's tensors in its order, as many as fit the limit
/// (one larger than it alone), narrowed, with its metadata; the index maps
/// each to its shard and counts their bytes.
#[test]
fn resharding_keeps_the_files_order_and_a_large_tensor_alone() {
    use megatrain_tensor::convert;
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("ckpt.safetensors");
    let t = |n: usize, at: f32| (0..n).map(|i| at + i as f32 * 0.371).collect::<Vec<f32>>();
    let tensors = [
        ("model.layers.2.w", t(100, 1.0)),
        ("model.layers.10.w", t(100, 2.0)),
        ("lm_head.weight", t(1000, 3.0)),
        ("model.layers.11.w", t(60, 4.0)),
        ("model.embed", t(60, 5.0)),
    ];
    write_in_order(&src, &tensors);
    let shard = |i: usize| format!("model-{i:05}-of-00003.safetensors");
    let want_map = json!({
        "model.layers.2.w": shard(1),
        "model.layers.10.w": shard(1),
        "lm_head.weight": shard(2),
        "model.layers.11.w": shard(3),
        "model.embed": shard(3),
    });
    // The same shards in f32 at 1000 bytes and in bf16 at 500.
    for (dtype, limit) in [(DType::F32, 1000), (DType::BF16, 500)] {
        let out = dir.path().join(dtype.to_string());
        let files = reshard_safetensors(&src, &out, dtype, Some(limit)).unwrap();
        let want_files: Vec<_> = [shard(1), shard(2), shard(3), INDEX_FILE.to_string()]
            .iter()
            .map(|f| out.join(f))
            .collect();
        assert_eq!(files, want_files, "{dtype}");
        let index = read_index(&out);
        assert_eq!(index["weight_map"], want_map, "{dtype}");
        let mut shard_bytes = 0;
        for i in 1..=3 {
            let (got, meta) = stored(&out.join(shard(i)));
            assert_eq!(meta.unwrap()["format"], "pt", "{dtype}");
            let mut want: Vec<(String, Vec<u8>)> = tensors
                .iter()
                .filter(|(n, _)| want_map[*n] == shard(i))
                .map(|(n, v)| {
                    let data = match dtype {
                        DType::BF16 => bytemuck::cast_slice(&convert::f32_to_bf16(v)).to_vec(),
                        _ => bytemuck::cast_slice(v).to_vec(),
                    };
                    (n.to_string(), data)
                })
                .collect();
            want.sort();
            assert_eq!(got, want, "{dtype} shard {i}");
            shard_bytes += got.iter().map(|(_, d)| d.len()).sum::<usize>();
        }
        let elem = dtype.size_in_bytes();
        assert_eq!(shard_bytes, 1320 * elem);
        assert_eq!(index["metadata"]["total_size"], shard_bytes, "{dtype}");
        assert!(!out.join("model.safetensors").exists());
    }
}

/// A checkpoint written again in shards loads as it was: bit for bit in
/// f32, rounded to bf16 in bf16.
#[test]
fn a_resharded_checkpoint_loads_back_equal() {
    use megatrain_tensor::convert;
    let src = fixture("llama_gqa");
    let want = load_hf_dir(&src).unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let out = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), out.path().join("config.json")).unwrap();
        let limit = 40_000 / 4 * dtype.size_in_bytes();
        let files = reshard_safetensors(
            &src.join("model.safetensors"),
            out.path(),
            dtype,
            Some(limit as u64),
        )
        .unwrap();
        let (index, shards) = files.split_last().unwrap();
        assert_eq!(index, &out.path().join(INDEX_FILE));
        assert!(shards.len() >= 4, "{} shards", shards.len());
        let mut total = 0;
        for f in shards {
            let (tensors, _) = stored(f);
            let bytes: usize = tensors.iter().map(|(_, d)| d.len()).sum();
            assert!(bytes <= limit || tensors.len() == 1, "{}: {bytes}", f.display());
            total += bytes;
        }
        assert_eq!(read_index(out.path())["metadata"]["total_size"], total);
        HfCheckpoint::open(out.path()).unwrap();
        let back = load_hf_dir(out.path()).unwrap();
        let rounded: Vec<Vec<f32>> = match dtype {
            DType::F32 => want.slabs.clone(),
            _ => want
                .slabs
                .iter()
                .map(|s| convert::bf16_to_f32(&convert::f32_to_bf16(s)))
                .collect(),
        };
        assert!(back.slabs == rounded, "{dtype}");
        assert_eq!(back.tables, want.tables);
    }
}

/// Exported over an earlier export, shards or one file leave no weights of
/// it that a loader would read; other files stay.
#[test]
fn switching_between_shards_and_one_file_leaves_nothing_stale() {
    let src = fixture("llama_gqa");
    let want = load_hf_dir(&src).unwrap();
    let out = tempfile::tempdir().unwrap();
    let out = out.path();
    let keep = [
        "config.json",
        "model-1-of-2.safetensors",
        "model-00001-of-00002.bin",
    ];
    std::fs::copy(src.join("config.json"), out.join("config.json")).unwrap();
    for f in &keep[1..] {
        std::fs::write(out.join(f), "not weights").unwrap();
    }
    let check = |files: Vec<std::path::PathBuf>| {
        let mut listed: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        listed.sort();
        let mut want_listed: Vec<String> = keep.iter().map(|f| f.to_string()).collect();
        want_listed.extend(
            files
                .iter()
                .map(|f| f.file_name().unwrap().to_string_lossy().into_owned()),
        );
        want_listed.sort();
        assert_eq!(listed, want_listed);
        assert!(load_hf_dir(out).unwrap().slabs == want.slabs);
        files.len()
    };
    let model = src.join("model.safetensors");
    let reshard = |limit| reshard_safetensors(&model, out, DType::F32, limit).unwrap();
    assert!(check(reshard(Some(40_000))) > 4);
    assert_eq!(check(reshard(None)), 1);
    let fewer = check(reshard(Some(80_000)));
    assert!((3..5).contains(&fewer), "{fewer}");
    assert!(check(reshard(Some(40_000))) > fewer);
    // Everything within the limit: one file, as without one.
    assert_eq!(check(reshard(Some(1 << 30))), 1);
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(&model).unwrap()
    );
    assert!(check(reshard(Some(80_000))) > 1);
    // From slabs the same.
    let slabs = slabs(&want);
    export_hf_dir(out, &want.config, &want.tables, &slabs, ExportOptions::default()).unwrap();
    assert_eq!(check(vec![out.join("model.safetensors")]), 1);
}
