//! Dropout in every block family (the embedding's output, the residual
//! branches' outputs, the attention's probabilities): the whole model's
//! backward under a fixed mask against central finite differences of its
//! loss in float64, for every HF fixture; the same key draws the same
//! masks, and another key other ones.

use crate::common;

use common::{CASES, fixture, read_golden};
use megatrain_tensor::cpu::CpuTensor;
use megatrain_tensor::testing::random_f64;
use megatrain_tensor::{Docs, F64Executor};
use megatrain_zoo::layers::{Dropouts, RouterAux, Rows, block_forward, embedding_forward, head_logits};
use megatrain_zoo::{LoadedModel, forward_backward, load_hf_dir, upload_layer};

const EX: F64Executor = F64Executor::new();

struct Case {
    model: LoadedModel,
    ids: Vec<u32>,
    targets: Vec<i32>,
    batch: usize,
    seq: usize,
}

fn case(name: &str) -> Case {
    let model = load_hf_dir(fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let golden = read_golden(name);
    let ids = &golden["input_ids"];
    Case {
        ids: ids.values.iter().map(|&v| v as u32).collect(),
        targets: golden["targets"].values.iter().map(|&v| v as i32).collect(),
        batch: ids.shape[0],
        seq: ids.shape[1],
        model,
    }
}

impl Case {
    fn weights(&self, slabs: &[Vec<f32>]) -> Vec<Vec<CpuTensor<f64>>> {
        self.model
            .tables
            .iter()
            .zip(slabs)
            .map(|(t, s)| upload_layer(&EX, t, s).unwrap())
            .collect()
    }

    /// The loss and every layer's gradient as one slab a layer.
    fn run(&self, slabs: &[Vec<f32>], rows: Rows<'_>) -> (f64, Vec<Vec<f64>>) {
        let w = self.weights(slabs);
        let out = forward_backward(
            &self.model.config,
            &EX,
            &w,
            &self.ids,
            &self.targets,
            (self.batch, self.seq, rows),
            4,
        )
        .unwrap();
        let grads = self
            .model
            .tables
            .iter()
            .zip(&out.grads)
            .map(|(table, g)| {
                let mut slab = vec![0.0; table.numel()];
                for (spec, t) in table.iter().zip(g) {
                    slab[spec.range()].copy_from_slice(t.data());
                }
                slab
            })
            .collect();
        (out.loss, grads)
    }
}

fn rows(hidden: f64, attention: f64, key: u64) -> Rows<'static> {
    Rows {
        docs: None,
        dropout: Dropouts::new(hidden, attention, key).unwrap(),
    }
}

/// The loss at `slabs` with entry `i` of layer `l` moved by `by` (the
/// slabs are f32: the step is one f32 can hold exactly around the entry),
/// through the forward alone and all in f64: [`forward_backward`] sums
/// per-row losses it reads as f32, too coarse for a central difference.
fn loss_at(c: &Case, slabs: &[Vec<f32>], (l, i): (usize, usize), by: f32, r: Rows<'_>) -> f64 {
    let mut s = slabs.to_vec();
    s[l][i] += by;
    let (cfg, w) = (&c.model.config, c.weights(&s));
    let n = cfg.num_layers;
    let mut x = embedding_forward(cfg, &EX, &w[0], &c.ids, c.batch, c.seq, r).unwrap();
    let mut stats = Vec::new();
    for (layer, wl) in w[1..=n].iter().enumerate() {
        let (y, saved) = block_forward(cfg, &EX, layer, wl, &x, r).unwrap();
        stats.extend(saved.router_stats(cfg, None));
        x = y;
    }
    let tied = cfg.tie_word_embeddings.then(|| &w[0][0]);
    let logits = head_logits(cfg, &EX, &w[n + 1], tied, &x).unwrap();
    let v = cfg.vocab_size;
    let (mut sum, mut counted) = (0.0, 0);
    for (row, &t) in logits.data().chunks(v).zip(&c.targets) {
        if t >= 0 {
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
            let lse = m + row.iter().map(|&z| (z - m).exp()).sum::<f64>().ln();
            sum += lse - row[t as usize];
            counted += 1;
        }
    }
    sum / counted as f64 + RouterAux::new(cfg, &stats, 1.0, None).map_or(0.0, |a| a.loss)
}

/// `name`'s backward under `r` against central differences: per layer, the
/// two entries of largest gradient and two at random, each at three steps,
/// one of which must agree (the mixtures' losses carry noise near 1e-7,
/// their routing, which small steps magnify, and GPT-OSS's clamped SwiGLU
/// bends its loss within 2^-10 of some entries; a mask the backward missed
/// is off by tens of percent at every step). Returns the entries checked.
fn check_finite_differences(name: &str, c: &Case, r: Rows<'_>) -> usize {
    let slabs = c.model.slabs.clone();
    let (loss, grads) = c.run(&slabs, r);
    let (plain, _) = c.run(&slabs, Rows { dropout: None, ..r });
    assert!(
        (loss - plain).abs() > 1e-6 * plain.abs(),
        "{name}: dropout changed nothing ({loss} vs {plain})"
    );
    let mut checked = 0;
    for (l, g) in grads.iter().enumerate() {
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        let random = random_f64(l as u64 + 77, 2)
            .into_iter()
            .map(|u| ((u + 1.0) / 2.0 * g.len() as f64) as usize % g.len());
        for i in order.into_iter().take(2).chain(random) {
            let scale = g.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-3);
            let close = |fd: f64| (fd - g[i]).abs() <= 5e-4 * scale + 5e-3 * fd.abs().max(g[i].abs());
            let fds: Vec<f64> = [-10, -12, -14]
                .map(|e| {
                    let h = 2f32.powi(e);
                    (loss_at(c, &slabs, (l, i), h, r) - loss_at(c, &slabs, (l, i), -h, r)) / (2.0 * h as f64)
                })
                .to_vec();
            assert!(
                fds.iter().any(|&fd| close(fd)),
                "{name}: layer {l} entry {i}: backward {} vs finite differences {fds:?}",
                g[i]
            );
            checked += 1;
        }
    }
    checked
}

#[test]
fn dropout_backward_matches_finite_differences_in_every_family() {
    let r = rows(0.3, 0.2, 0x5eed);
    let checked: usize = CASES
        .iter()
        .map(|&name| check_finite_differences(name, &case(name), r))
        .sum();
    assert!(checked > 100, "{checked} entries checked");
}

/// Within documents packed in the rows: the attention's probabilities of
/// each document's keys dropped, positions and a Gated DeltaNet's state
/// per document, as the backward replays them.
#[test]
fn dropout_within_packed_documents_matches_finite_differences() {
    for name in ["gpt2", "llama_gqa", "qwen3_5", "gpt_oss"] {
        let c = case(name);
        let starts: Vec<Vec<usize>> = (0..c.batch).map(|b| vec![0, 1 + b, c.seq / 2]).collect();
        let docs = Docs::new(c.seq, &starts).unwrap();
        let r = Rows {
            docs: Some(&docs),
            ..rows(0.3, 0.2, 0xd0c5)
        };
        check_finite_differences(name, &c, r);
    }
}

#[test]
fn a_key_draws_the_same_masks_and_another_key_others() {
    for name in ["gpt2", "llama_gqa", "qwen3_5"] {
        let c = case(name);
        let slabs = &c.model.slabs;
        let (a, ga) = c.run(slabs, rows(0.2, 0.2, 1));
        let (b, gb) = c.run(slabs, rows(0.2, 0.2, 1));
        assert_eq!((a, &ga), (b, &gb), "{name}");
        let (other, _) = c.run(slabs, rows(0.2, 0.2, 2));
        assert_ne!(a, other, "{name}");
        // Each kind of site alone changes the loss.
        let (plain, _) = c.run(slabs, Rows::default());
        for (h, p) in [(0.2, 0.0), (0.0, 0.2)] {
            assert_ne!(
                c.run(slabs, rows(h, p, 1)).0,
                plain,
                "{name}: hidden {h} attention {p}"
            );
        }
    }
}

fn noisy(neftune: f64, key: u64) -> Rows<'static> {
    Rows {
        docs: None,
        dropout: Dropouts::with_noise(0.0, 0.0, neftune, key).unwrap(),
    }
}

/// NEFTune's noise on the lookup: the backward of the noisy forward
/// against its finite differences in every family (the noise is in the
/// forward only, the backward passes through it).
#[test]
fn neftune_backward_matches_finite_differences_in_every_family() {
    let checked: usize = CASES
        .iter()
        .map(|&name| check_finite_differences(name, &case(name), noisy(5.0, 0x4ef7)))
        .sum();
    assert!(checked > 100, "{checked} entries checked");
}

/// The noise is uniform within α / √(T·C) of the lookup (before GPT-2's
/// positions are added: the difference is the noise), another key's is
/// other noise, and α = 0 is no noise.
#[test]
fn neftune_noise_has_its_magnitude() {
    for name in ["gpt2", "llama_gqa"] {
        let c = case(name);
        let (cfg, w) = (&c.model.config, c.weights(&c.model.slabs));
        let x = |r: Rows<'_>| {
            embedding_forward(cfg, &EX, &w[0], &c.ids, c.batch, c.seq, r)
                .unwrap()
                .data()
                .to_vec()
        };
        let plain = x(Rows::default());
        let alpha = 5.0;
        let m = alpha / ((c.seq * cfg.hidden_size) as f64).sqrt();
        let a = x(noisy(alpha, 1));
        let d: Vec<f64> = a.iter().zip(&plain).map(|(a, p)| a - p).collect();
        assert!(d.iter().all(|v| v.abs() <= m * (1.0 + 1e-6)), "{name}");
        let mean_abs = d.iter().map(|v| v.abs()).sum::<f64>() / d.len() as f64;
        // U(−m, m): E|u| = m/2.
        assert!(
            (mean_abs / m - 0.5).abs() < 0.1,
            "{name}: mean |noise| {mean_abs} of {m}"
        );
        assert_ne!(a, x(noisy(alpha, 2)), "{name}");
        assert_eq!(a, x(noisy(alpha, 1)), "{name}");
        assert!(Dropouts::with_noise(0.0, 0.0, 0.0, 1).unwrap().is_none());
    }
    for bad in [-1.0, f64::NAN, f64::INFINITY, 1e39] {
        let e = Dropouts::with_noise(0.0, 0.0, bad, 1).unwrap_err().to_string();
        assert!(e.contains("NEFTune") && e.contains(&bad.to_string()), "{e}");
    }
}

#[test]
fn probabilities_outside_the_range_are_refused_by_name() {
    for (h, p) in [(-0.1, 0.0), (0.0, 1.0), (f64::NAN, 0.0), (0.5, 2.0)] {
        let e = Dropouts::new(h, p, 1).unwrap_err().to_string();
        assert!(e.contains("dropout") && e.contains("[0, 0.99]"), "{e}");
    }
    assert!(Dropouts::new(0.0, 0.0, 1).unwrap().is_none());
}
