//! The per-layer API as the streamed trainer drives it: checkpointed forward
//! (activations dropped) then recompute, micro-batches and head chunks that
//! compose through `grad_scale`, the tied gradient flowing into the
//! embedding, and input errors.

use crate::common;

use common::{fixture, read_golden};
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{CpuExecutor, CpuTensor, Executor, LossTerms};
use megatrain_zoo::layers::{
    MIN_CHUNK_ROWS, Tied, block_backward, block_forward, embedding_backward, embedding_forward,
    embedding_grads, head_forward_backward, head_loss,
};
use megatrain_zoo::{
    LoadedModel, ZooError, default_chunk_rows, forward_backward, load_hf_dir, preset, upload_layer,
};

type W = Vec<Vec<CpuTensor<f32>>>;

fn setup(case: &str) -> (LoadedModel, W, Vec<u32>, Vec<i32>, usize, usize) {
    let m = load_hf_dir(fixture(case)).unwrap();
    let ex = CpuExecutor::new();
    let w: W = m
        .tables
        .iter()
        .zip(&m.slabs)
        .map(|(t, s)| upload_layer(&ex, t, s).unwrap())
        .collect();
    let g = read_golden(case);
    let (b, t) = (g["input_ids"].shape[0], g["input_ids"].shape[1]);
    let ids = g["input_ids"].values.iter().map(|&v| v as u32).collect();
    let tg = g["targets"].values.iter().map(|&v| v as i32).collect();
    (m, w, ids, tg, b, t)
}

fn flat(t: &CpuTensor<f32>) -> Vec<f64> {
    t.data().iter().map(|&x| x as f64).collect()
}

/// One micro-batch through the layers the way the trainer streams them:
/// forward keeping only block inputs, then per block recompute + backward.
/// Gradients are accumulated into `acc` (per layer, table order).
#[allow(clippy::too_many_arguments)]
fn streamed_micro_batch(
    m: &LoadedModel,
    w: &W,
    ids: &[u32],
    targets: &[i32],
    b: usize,
    t: usize,
    grad_scale: f32,
    acc: &mut Option<W>,
) -> f64 {
    let ex = CpuExecutor::new();
    let cfg = &m.config;
    let l = cfg.num_layers;
    let mut inputs = vec![embedding_forward(cfg, &ex, &w[0], ids, b, t, None).unwrap()];
    for (i, wl) in w[1..=l].iter().enumerate() {
        let (y, _dropped) = block_forward(cfg, &ex, i, wl, &inputs[i], None).unwrap();
        inputs.push(y);
    }
    let tied = cfg.tie_word_embeddings.then(|| Tied::Trained(&w[0][0]));
    let head = head_forward_backward(
        cfg,
        &ex,
        &w[l + 1],
        tied,
        &inputs[l],
        targets,
        grad_scale,
        LossTerms::NONE,
        3,
    )
    .unwrap();
    let mut grads: W = vec![vec![]; l + 2];
    grads[l + 1] = head.grads;
    let mut dx = head.dx;
    for i in (0..l).rev() {
        let (_, saved) = block_forward(cfg, &ex, i, &w[i + 1], &inputs[i], None).unwrap(); // recompute
        let (d, g) = block_backward(cfg, &ex, i, &w[i + 1], &saved, &dx, None).unwrap();
        grads[i + 1] = g;
        dx = d;
    }
    grads[0] = embedding_backward(cfg, &ex, &w[0], ids, (b, t, None), &dx, head.tied_grad).unwrap();
    match acc {
        None => *acc = Some(grads),
        Some(a) => {
            for (al, gl) in a.iter_mut().zip(&grads) {
                for (x, y) in al.iter_mut().zip(gl) {
                    ex.add_assign(x, y).unwrap();
                }
            }
        }
    }
    megatrain_zoo::layers::sum_losses(&ex, &head.losses).unwrap()
}

#[test]
fn streamed_micro_batches_equal_the_whole_batch() {
    for case in ["gpt2", "qwen2", "qwen3"] {
        let (m, w, ids, targets, b, t) = setup(case);
        let whole = forward_backward(
            &m.config,
            &CpuExecutor::new(),
            &w,
            &ids,
            &targets,
            (b, t, None),
            1000,
        )
        .unwrap();
        let counted = targets.iter().filter(|&&x| x != -100).count();
        let scale = 1.0 / counted as f32;
        let mut acc = None;
        let mut loss_sum = 0.0;
        for mb in 0..b {
            let r = mb * t..(mb + 1) * t;
            loss_sum += streamed_micro_batch(&m, &w, &ids[r.clone()], &targets[r], 1, t, scale, &mut acc);
        }
        let loss = loss_sum / counted as f64;
        assert!(
            ((loss - whole.loss) / whole.loss).abs() < 1e-6,
            "{case}: {loss} vs {}",
            whole.loss
        );
        for (l, (a, g)) in acc.unwrap().iter().zip(&whole.grads).enumerate() {
            for (i, (x, y)) in a.iter().zip(g).enumerate() {
                let e = rel_norm_err(&flat(x), &flat(y));
                assert!(e < 1e-5, "{case}: layer {l} tensor {i}: {e:e}");
            }
        }
    }
}

/// The README main job (gpt2-nano over 65 characters, 12 × 64 rows) runs
/// its head in one chunk; in host memory TinyLlama's 32k vocabulary in 512
/// rows, Qwen's 152k in the minimum of 256, on a GPU in 8320 and 1664;
/// past the minimum a chunk's logits fit.
#[test]
fn default_head_chunk_follows_the_vocabulary_and_the_memory() {
    use megatrain_tensor::{DEVICE_LOGITS_CHUNK_BYTES as DEVICE, HOST_LOGITS_CHUNK_BYTES as HOST};
    let nano = preset("gpt2-nano", Some(65)).unwrap();
    assert!(default_chunk_rows(nano.vocab_size, HOST) >= 12 * 64);
    for (name, host, device) in [
        ("tinyllama-1.1b", 512, 8320),
        ("qwen2.5-7b", 256, 1664),
        ("qwen2.5-14b", 256, 1664),
    ] {
        let v = preset(name, None).unwrap().vocab_size;
        assert_eq!(default_chunk_rows(v, HOST), host, "{name}");
        assert_eq!(default_chunk_rows(v, DEVICE), device, "{name}");
    }
    for budget in [HOST, DEVICE] {
        for v in [1, 65, 1000, 50257, 65535, 65536, 70000, 152064] {
            let rows = default_chunk_rows(v, budget);
            assert!(
                rows >= MIN_CHUNK_ROWS && rows.is_multiple_of(128),
                "vocabulary {v}: {rows}"
            );
            assert!(
                rows == MIN_CHUNK_ROWS || rows * v * 4 <= budget,
                "vocabulary {v}: {rows}"
            );
        }
    }
}

#[test]
fn head_chunking_does_not_change_results() {
    let (m, w, ids, targets, b, t) = setup("llama_tied_bf16");
    let ex = CpuExecutor::new();
    let runs: Vec<_> = [1, 4, b * t]
        .iter()
        .map(|&c| forward_backward(&m.config, &ex, &w, &ids, &targets, (b, t, None), c).unwrap())
        .collect();
    for r in &runs[1..] {
        assert!((r.loss - runs[0].loss).abs() < 1e-6);
        for (a, g) in r.grads.iter().flatten().zip(runs[0].grads.iter().flatten()) {
            assert!(rel_norm_err(&flat(a), &flat(g)) < 1e-6);
        }
    }
    let x = {
        let mut x = embedding_forward(&m.config, &ex, &w[0], &ids, b, t, None).unwrap();
        for (i, wl) in w[1..=m.config.num_layers].iter().enumerate() {
            x = block_forward(&m.config, &ex, i, wl, &x, None).unwrap().0;
        }
        x
    };
    let (sum, counted) = head_loss(&m.config, &ex, &w[3], Some(&w[0][0]), &x, &targets, 5).unwrap();
    assert!((sum / counted as f64 - runs[0].loss).abs() < 1e-6);
}

/// A frozen tied table: the head's own gradients, its input's and the
/// losses are the trained table's, bit for bit, and no table gradient is
/// made (the product the backward skips).
#[test]
fn a_frozen_tied_table_takes_no_gradient() {
    let (m, w, ids, targets, b, t) = setup("llama_tied_bf16");
    let (cfg, ex) = (&m.config, CpuExecutor::new());
    assert!(cfg.tie_word_embeddings);
    let mut x = embedding_forward(cfg, &ex, &w[0], &ids, b, t, None).unwrap();
    for (i, wl) in w[1..=cfg.num_layers].iter().enumerate() {
        x = block_forward(cfg, &ex, i, wl, &x, None).unwrap().0;
    }
    let run = |trained: bool| {
        let tied = Some(Tied::new(&w[0][0], trained));
        head_forward_backward(cfg, &ex, &w[3], tied, &x, &targets, 0.25, LossTerms::NONE, 3).unwrap()
    };
    let (trained, frozen) = (run(true), run(false));
    assert!(trained.tied_grad.is_some() && frozen.tied_grad.is_none());
    assert_eq!(trained.dx.data(), frozen.dx.data());
    assert_eq!(trained.grads.len(), frozen.grads.len());
    for (a, g) in trained.grads.iter().zip(&frozen.grads) {
        assert_eq!(a.data(), g.data());
    }
    for (a, g) in trained.losses.iter().zip(&frozen.losses) {
        assert_eq!(a.data(), g.data());
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let (m, w, ids, targets, b, t) = setup("mistral_f16");
    let ex = CpuExecutor::new();
    let cfg = &m.config;
    let mut bad = ids.clone();
    bad[3] = cfg.vocab_size as u32;
    let err = forward_backward(cfg, &ex, &w, &bad, &targets, (b, t, None), 4).unwrap_err();
    assert!(matches!(err, ZooError::TokenOutOfRange { pos: 3, .. }), "{err:?}");
    let mut bad = targets.clone();
    bad[1] = -5;
    let msg = forward_backward(cfg, &ex, &w, &ids, &bad, (b, t, None), 4)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("target -5"), "{msg}");
    assert!(forward_backward(cfg, &ex, &w, &ids, &targets[1..], (b, t, None), 4).is_err());
    assert!(forward_backward(cfg, &ex, &w, &ids, &targets, (b, t, None), 0).is_err());
    // Sequences past Mistral's sliding window (16) run: the window masks
    // their earlier keys (golden case mistral_window).
    let long: Vec<u32> = (0..17).map(|i| i % 50).collect();
    assert!(embedding_forward(cfg, &ex, &w[0], &long, 1, 17, None).is_ok());
    // Weights of another layer kind.
    let x = embedding_forward(cfg, &ex, &w[0], &ids, b, t, None).unwrap();
    assert!(block_forward(cfg, &ex, 0, &w[0], &x, None).is_err());
    // A block past the model's.
    let msg = block_forward(cfg, &ex, 2, &w[1], &x, None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("block 2 of a model of 2 blocks"), "{msg}");
    let tied_head = head_forward_backward(
        cfg,
        &ex,
        &w[3],
        Some(Tied::Trained(&w[0][0])),
        &x,
        &targets,
        1.0,
        LossTerms::NONE,
        4,
    );
    assert!(tied_head.is_err(), "untied head refuses an embedding table");
}

/// transformers' `nn.Embedding(padding_idx = pad_token_id)`: the lookup
/// gives the pad token's row no gradient; a tied head's gradient for that
/// row stays (embedding_grads adds the lookup's onto it).
#[test]
fn the_pad_tokens_row_gets_no_gradient_from_the_lookup() {
    use megatrain_tensor::Shape;
    use megatrain_tensor::testing::random_tensor;
    let ex = CpuExecutor::new();
    let mut cfg = preset("llama-tiny", Some(11)).unwrap();
    cfg.pad_token_id = Some(3);
    let (b, t, c, v) = (2, 5, cfg.hidden_size, 11);
    let ids: Vec<u32> = vec![3, 1, 4, 1, 5, 9, 2, 6, 3, 3];
    let dx = ex.upload(&random_tensor(1, [b, t, c])).unwrap();
    let dxv = dx.data().to_vec();
    let tied = random_tensor(2, [v, c]);
    let shapes = [Shape::new([v, c])];
    for with_tied in [false, true] {
        let head = with_tied.then(|| ex.upload(&tied).unwrap());
        let g = embedding_grads(&cfg, &ex, &shapes, &ids, (b, t, None), &dx, head).unwrap();
        let g = g[0].data().to_vec();
        let start = |r: usize| {
            if with_tied {
                tied.to_f32_vec()[r * c..(r + 1) * c].to_vec()
            } else {
                vec![0.0; c]
            }
        };
        for r in 0..v {
            let mut want = start(r);
            if r != 3 {
                for pos in (0..ids.len()).filter(|&p| ids[p] as usize == r) {
                    for (w, x) in want.iter_mut().zip(&dxv[pos * c..(pos + 1) * c]) {
                        *w += x;
                    }
                }
            }
            assert_eq!(&g[r * c..(r + 1) * c], &want[..], "row {r}, tied {with_tied}");
        }
    }
    // Without a pad token, its row gathers its positions' gradients.
    cfg.pad_token_id = None;
    let g = embedding_grads(&cfg, &ex, &shapes, &ids, (b, t, None), &dx, None).unwrap();
    assert!(g[0].data()[3 * c..4 * c].iter().any(|&x| x != 0.0));
}
