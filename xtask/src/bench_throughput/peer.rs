//! The PyTorch peer (`benches/torch_peer.py`), run only where `torch` imports.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatrain_zoo::ModelConfig;
use serde_json::{Value, json};

use super::spec::Spec;

/// The interpreter: the repository's `.venv` when present, else `python3`.
fn python(root: &Path) -> PathBuf {
    let venv = root.join(".venv/bin/python");
    if venv.exists() { venv } else { "python3".into() }
}

/// `Ok(python)` when `import torch` works, else why not.
pub fn available(root: &Path) -> Result<PathBuf, String> {
    let py = python(root);
    match Command::new(&py).args(["-c", "import torch"]).output() {
        Ok(o) if o.status.success() => Ok(py),
        Ok(_) => Err("torch not importable".into()),
        Err(e) => Err(format!("{} not runnable: {e}", py.display())),
    }
}

/// The peer's description of `model` trained as `spec` says.
pub fn peer_spec(spec: &Spec, model: &ModelConfig, mode: &str) -> anyhow::Result<Value> {
    let arch = if model.arch.is_gpt2() {
        "gpt2"
    } else {
        anyhow::ensure!(
            !model.qk_norm
                && !model.o_bias
                && !model.mlp_bias
                && !model.arch.has_post_norms()
                && !model.arch.has_sandwich_norms()
                && !model.arch.has_layernorm(),
            "the peer has no {:?} variant (q/k norms, o/mlp biases, OLMo's, GLM-4-0414's or StarCoder2's norms)",
            model.arch
        );
        "llama"
    };
    // A window shorter than the sequence skips work the peer's causal
    // attention would do: the ratio would not compare like with like.
    if let Some(w) = model.sliding_window {
        anyhow::ensure!(
            w >= spec.seq_len,
            "the peer has no sliding window ({w} keys, shorter than the {} tokens of a sequence)",
            spec.seq_len
        );
    }
    Ok(json!({
        "arch": arch,
        "vocab": model.vocab_size,
        "hidden": model.hidden_size,
        "layers": model.num_layers,
        "heads": model.num_heads,
        "kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "inter": model.intermediate_size,
        "eps": model.norm_eps,
        // The peer rotates whole heads by unscaled frequencies: a RoPE
        // scaling changes the angles, a partial rotation a few copies, not
        // the work.
        "theta": model.rope_theta,
        "tie": model.tie_word_embeddings,
        "qkv_bias": model.qkv_bias,
        "batch": spec.batch,
        "seq": spec.seq_len,
        // PyTorch's first steps are slow (allocator, kernels): more of
        // both, as the steps are cheap at these sizes.
        "steps": spec.steps.max(5),
        "warmup": spec.warmup.max(2),
        "lr": spec.lr,
        "autocast": spec.peer_autocast(),
        "modes": [mode],
    }))
}

/// Runs each peer mode in its own process (so each peak RSS is its own).
pub fn run(root: &Path, py: &Path, spec: &Spec, model: &ModelConfig) -> Vec<Value> {
    let script = root.join("benches/torch_peer.py");
    ["memory", "streamed"]
        .iter()
        .map(|mode| {
            let result = peer_spec(spec, model, mode).and_then(|arg| {
                eprintln!("  [{}] torch peer, {mode}", spec.label);
                let out = Command::new(py).arg(&script).arg(arg.to_string()).output()?;
                anyhow::ensure!(
                    out.status.success(),
                    "{} failed: {}",
                    script.display(),
                    String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
                );
                let line = String::from_utf8_lossy(&out.stdout);
                Ok(serde_json::from_str::<Value>(line.lines().last().unwrap_or(""))?)
            });
            result.unwrap_or_else(|e| json!({"mode": mode, "error": e.to_string()}))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_throughput::spec::test_spec;

    #[test]
    fn autocast_only_beside_16_bit_gpu_runs() {
        let spec = test_spec();
        let model = spec.model().unwrap();
        let on = |device: &str, precision: &str| {
            let s = Spec {
                device: device.into(),
                precision: precision.into(),
                ..spec.clone()
            };
            peer_spec(&s, &model, "memory").unwrap()["autocast"].clone()
        };
        assert_eq!(on("gpu", "f16"), json!("bf16"));
        assert_eq!(on("gpu", "bf16"), json!("bf16"));
        assert_eq!(on("gpu", "f32"), Value::Null);
        assert_eq!(on("cpu", "bf16"), Value::Null);
    }
}
