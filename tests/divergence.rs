//! A run whose state goes non-finite while its loss is still finite (here a
//! model holding an infinity in an embedding row no batch reads) saves no
//! checkpoint of it: the run stops naming the tensor and element, and the
//! checkpoint `latest` names stays current.

use crate::common;

use std::path::Path;

use common::cli::{corpus, run, s};

fn train<'a>(model_or_preset: [&'a str; 2], data: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", model_or_preset[0], model_or_preset[1]];
    a.extend([
        "--tokenizer",
        "byte",
        "--data",
        data,
        "--out",
        out,
        "--device",
        "cpu",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        steps,
        "--save-every",
        "1",
        "--eval-every",
        "0",
        "--quiet",
    ]);
    a
}

/// Sets element `at` of `tensor` in `dir/model.safetensors` to `value`.
fn poke(dir: &Path, tensor: &str, at: usize, value: f32) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let t = tensors.iter_mut().find(|t| t.0 == tensor).unwrap();
    t.3[4 * at..4 * at + 4].copy_from_slice(&value.to_le_bytes());
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn a_non_finite_state_is_never_saved() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let data = corpus(t);
    let (a, hf, b) = (t.join("a"), t.join("hf"), t.join("b"));
    let out = run(&train(["--preset", "llama-tiny"], s(&data), s(&a), "1"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["export", "--run", s(&a), "--out", s(&hf)]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Byte 200 is in no batch of an ASCII corpus: its row gets no gradient,
    // the loss stays finite, and the update keeps the infinity.
    poke(&hf, "model.embed_tokens.weight", 200 * 64 + 3, f32::INFINITY);
    let out = run(&train(["--model", s(&hf)], s(&data), s(&b), "2"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    for needle in [
        "ckpt-1: not saved",
        "tensor 'model.embed_tokens.weight' holds inf at element 12803",
        "there is no earlier checkpoint",
    ] {
        assert!(err.contains(needle), "'{needle}' not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!b.join("ckpt-1").exists() && !b.join("latest").exists());
    // The step's record is logged, its loss finite.
    let log = std::fs::read_to_string(b.join("metrics.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert!(first["loss"].as_f64().unwrap().is_finite(), "{first}");
}
