//! Records packed side by side in a row ([`Docs`]) train exactly as the
//! same records one a row, right-padded: the same loss over the same
//! counted targets, and the same gradient of every weight, for every block
//! family: attention keeps to each record, and the Gated DeltaNet's
//! convolution and recurrent state restart at its first token.

use crate::common;

use common::fixture;
use megatrain_tensor::testing::rel_norm_err;
use megatrain_tensor::{CpuExecutor, CpuTensor, Docs};
use megatrain_zoo::{LoadedModel, forward_backward, load_hf_dir, upload_layer};

const IGNORE: i32 = -100;

/// Rows of `t` tokens holding records of `lens`: three share the first
/// packed row, with a token of padding after them; the longest fills most
/// of the second.
struct Layout {
    t: usize,
    lens: [usize; 4],
}

const PACKED: [&[usize]; 2] = [&[0, 1, 2], &[3]];
const SHORT: Layout = Layout {
    t: 16,
    lens: [5, 3, 7, 13],
};
/// Past the gated delta rule's chunk of 64 steps: the second record runs
/// across the boundary (tokens 60..70), so the backward's replay from the
/// checkpoint at 64 must reset at 60 and keep the state of 64 within it.
const LONG: Layout = Layout {
    t: 80,
    lens: [60, 10, 9, 75],
};

fn weights(m: &LoadedModel) -> Vec<Vec<CpuTensor<f32>>> {
    let ex = CpuExecutor::new();
    m.tables
        .iter()
        .zip(&m.slabs)
        .map(|(t, s)| upload_layer(&ex, t, s).unwrap())
        .collect()
}

/// Token `i` of record `r`, and its target: the next token of the
/// record, none for its last.
fn record(l: &Layout, vocab: usize, r: usize) -> (Vec<u32>, Vec<i32>) {
    let ids: Vec<u32> = (0..l.lens[r])
        .map(|i| ((r * 977 + i * 7919 + 13) % vocab) as u32)
        .collect();
    let mut tg: Vec<i32> = ids[1..].iter().map(|&x| x as i32).collect();
    tg.push(IGNORE);
    (ids, tg)
}

/// Rows of `l.t` holding the records `rows[b]` back to back, right-padded
/// (id 0, target ignored), and where each row's records start.
fn rows(l: &Layout, vocab: usize, rows: &[&[usize]]) -> (Vec<u32>, Vec<i32>, Vec<Vec<usize>>) {
    let (mut ids, mut tg, mut starts) = (Vec::new(), Vec::new(), Vec::new());
    for recs in rows {
        let mut at = Vec::new();
        let mut n = 0;
        for &r in *recs {
            let (i, t) = record(l, vocab, r);
            at.push(n);
            n += i.len();
            ids.extend(i);
            tg.extend(t);
        }
        ids.extend(std::iter::repeat_n(0, l.t - n));
        tg.extend(std::iter::repeat_n(IGNORE, l.t - n));
        starts.push(at);
    }
    (ids, tg, starts)
}

#[test]
fn packed_records_train_as_each_alone() {
    for case in [
        "gpt2",
        "qwen2",
        "llama3_rope",
        "mistral_window",
        "gemma2",
        "phi2",
        "phi3_partial",
        "gpt_neox",
        "olmo2",
        "starcoder2",
        "cohere2",
        "glm",
        "deepseek_v3",
        "gpt_oss",
        "smollm3",
        "mixtral",
        "qwen3_5",
        "qwen3_next",
        "kimi_linear",
        "olmo_hybrid",
    ] {
        trains_as_each_alone(case, &SHORT);
    }
}

/// The Gated DeltaNet families with a record across a chunk boundary of
/// the delta rule's checkpoints.
#[test]
fn packed_records_across_a_delta_rule_chunk_train_as_each_alone() {
    for case in ["qwen3_5", "qwen3_next", "kimi_linear", "olmo_hybrid"] {
        trains_as_each_alone(case, &LONG);
    }
}

fn trains_as_each_alone(case: &str, l: &Layout) {
    let m = load_hf_dir(fixture(case)).unwrap();
    let (cfg, w) = (&m.config, weights(&m));
    let ex = CpuExecutor::new();
    let (v, t) = (cfg.vocab_size, l.t);
    let (ids, tg, starts) = rows(l, v, &PACKED);
    let docs = Docs::new(t, &starts).unwrap();
    let packed = forward_backward(cfg, &ex, &w, &ids, &tg, (2, t, Some(&docs)), 64).unwrap();
    let one_each: Vec<&[usize]> = vec![&[0], &[1], &[2], &[3]];
    let (ids1, tg1, _) = rows(l, v, &one_each);
    let alone = forward_backward(cfg, &ex, &w, &ids1, &tg1, (4, t, None), 64).unwrap();
    let case = format!("{case}, T = {t}");
    assert_eq!(packed.counted, alone.counted, "{case}");
    assert_eq!(
        packed.counted,
        l.lens.iter().map(|l| l - 1).sum::<usize>(),
        "{case}"
    );
    let dl = (packed.loss - alone.loss).abs() / alone.loss;
    assert!(
        dl < 1e-6,
        "{case}: loss packed {} alone {} ({dl:e})",
        packed.loss,
        alone.loss
    );
    for (l, (gp, ga)) in packed.grads.iter().zip(&alone.grads).enumerate() {
        for (j, (p, a)) in gp.iter().zip(ga).enumerate() {
            let (p, a): (Vec<f64>, Vec<f64>) = (
                p.data().iter().map(|&x| x as f64).collect(),
                a.data().iter().map(|&x| x as f64).collect(),
            );
            let err = rel_norm_err(&p, &a);
            assert!(
                err < 2e-5,
                "{case}: layer {l} weight {j}: packed vs alone {err:e}"
            );
        }
    }
    // Unmasked, the same rows let each record see the ones before it.
    let leaky = forward_backward(cfg, &ex, &w, &ids, &tg, (2, t, None), 64).unwrap();
    assert!(
        (leaky.loss - alone.loss).abs() / alone.loss > 1e-4,
        "{case}: the test can tell"
    );
}
