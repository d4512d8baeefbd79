//! Cross-entropy with label smoothing against PyTorch's
//! `F.cross_entropy(..., label_smoothing=ε)` in float64
//! (`fixtures/label_smoothing.json`, made by `tools/make_loss_golden.py`):
//! the per-row smoothed loss (1 − ε)·loss + ε·uniform, its mean over the
//! counted rows, and that mean's gradient, which is `dlogits` at
//! `grad_scale` = 1 / counted.

use megatrain_tensor::{CpuExecutor, CpuTensor, Executor, F64Executor, LossTerms};
use serde_json::Value;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

fn close(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: {got} vs PyTorch's {want}"
    );
}

#[test]
fn label_smoothing_matches_pytorch() {
    let doc: Value = serde_json::from_str(include_str!("fixtures/label_smoothing.json")).unwrap();
    let (rows, vocab) = (
        doc["rows"].as_u64().unwrap() as usize,
        doc["vocab"].as_u64().unwrap() as usize,
    );
    let ignore = doc["ignore_index"].as_i64().unwrap() as i32;
    let targets: Vec<i32> = floats(&doc["targets"]).iter().map(|&t| t as i32).collect();
    let counted = targets.iter().filter(|&&t| t != ignore).count();
    let logits = floats(&doc["logits"]);
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 4);
    let (e64, e32) = (F64Executor::new(), CpuExecutor::new());
    let x64 = CpuTensor::<f64>::from_vec([rows, vocab], logits.clone()).unwrap();
    let narrow = logits.iter().map(|&x| x as f32).collect();
    let x32 = CpuTensor::<f32>::from_vec([rows, vocab], narrow).unwrap();
    for case in cases {
        let eps = case["label_smoothing"].as_f64().unwrap();
        let terms = LossTerms::smoothing(eps as f32);
        let scale = 1.0 / counted as f32;
        let o = e64.cross_entropy(&x64, &targets, ignore, scale, terms).unwrap();
        let uniform = o.uniform_losses.as_ref().map(|u| u.data().to_vec());
        assert_eq!(uniform.is_some(), eps > 0.0, "ε {eps}");
        let smoothed: Vec<f64> = (0..rows)
            .map(|r| (1.0 - eps) * o.losses.data()[r] + eps * uniform.as_ref().map_or(0.0, |u| u[r]))
            .collect();
        for (r, (&got, want)) in smoothed.iter().zip(floats(&case["per_row"])).enumerate() {
            close(&format!("ε {eps} row {r}"), got, want, 1e-12);
        }
        let mean = smoothed.iter().sum::<f64>() / counted as f64;
        close(
            &format!("ε {eps} mean"),
            mean,
            case["mean"].as_f64().unwrap(),
            1e-12,
        );
        // grad_scale passes through f32: 1/5 is not exact there.
        let k = 1.0 / (scale as f64 * counted as f64);
        for (i, (&got, want)) in o.dlogits.data().iter().zip(floats(&case["dlogits"])).enumerate() {
            close(&format!("ε {eps} dlogits[{i}]"), got * k, want, 1e-12);
        }
        // The f32 executor, to f32's precision.
        let o32 = e32.cross_entropy(&x32, &targets, ignore, scale, terms).unwrap();
        let u32s = o32.uniform_losses.as_ref().map(|u| u.data().to_vec());
        for (r, want) in floats(&case["per_row"]).into_iter().enumerate() {
            let got =
                (1.0 - eps) * o32.losses.data()[r] as f64 + eps * u32s.as_ref().map_or(0.0, |u| u[r] as f64);
            close(&format!("f32 ε {eps} row {r}"), got, want, 1e-5);
        }
        for (i, (&got, want)) in o32
            .dlogits
            .data()
            .iter()
            .zip(floats(&case["dlogits"]))
            .enumerate()
        {
            close(&format!("f32 ε {eps} dlogits[{i}]"), got as f64, want, 1e-5);
        }
    }
}
