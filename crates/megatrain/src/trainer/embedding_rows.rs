//! The embedding table's rows a step looks up
//! ([`super::TrainerConfig::compact_embedding`]).
//!
//! An untied embedding's forward reads only the rows of the step's token
//! ids, and its backward writes only those rows' gradients: every other
//! row's gradient is zero. So the step uploads just those rows, as a
//! table of its own indexed by each id's place among them, and brings
//! just their gradients down; the rest of the table's AdamW (its moments
//! decay, its decay and momentum still move p) needs no gradient at all
//! and runs while the device computes the forward, instead of after the
//! whole backward with the device idle. For Qwen2.5-7B at 8×1024 tokens
//! that is at most 8,192 of 152,064 rows: 59 MB up instead of 1.1 GB,
//! 117 MB of gradients down instead of 2.2 GB, and about 130 ms of the
//! host's AdamW moved off the step's end. The same bits either way:
//! AdamW is elementwise, a zero read from nowhere is the zero the scatter
//! would have left ([`megatrain_adamw::Grad::Zero`]), and the layer's
//! step count (bias correction) moves once, after its looked-up rows.

use std::ops::Range;

use megatrain_adamw::{Grad, SlabState, SlabUpdate};
use megatrain_tensor::{Executor, HostSlice, Shape, WeightUpload, upload_weight};
use megatrain_tier::{HostTier, LayerSlab, TransportRef};
use megatrain_zoo::ModelConfig;
use rayon::prelude::*;

use super::optimizer::part_mask;
use super::update::{Hyper, adamw_transport};
use super::upload::weight_uploads;
use super::{Result, TrainError};

/// The distinct token ids of a step, and each input's place among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StepRows {
    /// Ascending.
    pub ids: Vec<u32>,
    /// Each input's index in `ids`: the compact table's ids.
    pub remapped: Vec<u32>,
    /// The compact table's rows: as many as the step has inputs (or the
    /// vocabulary rows, if fewer), the ids' first and zeros after, so that
    /// every step asks the executor for the same shapes (its buffers and
    /// bind groups reused, not made per step).
    pub rows: usize,
}

impl StepRows {
    /// The rows `inputs` look up in a table of `vocab` rows.
    pub fn of(inputs: &[u32], vocab: usize) -> Self {
        let mut ids = inputs.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let remapped = inputs
            .iter()
            .map(|i| ids.binary_search(i).expect("every input is among the ids") as u32)
            .collect();
        let rows = inputs.len().min(vocab).max(ids.len());
        StepRows { ids, remapped, rows }
    }

    /// `cfg` as the compact table sees it: the pad token (whose row the
    /// lookup gives no gradient) is its place among the ids, or none.
    pub fn model(&self, cfg: &ModelConfig) -> ModelConfig {
        let mut c = cfg.clone();
        c.pad_token_id = cfg
            .pad_token_id
            .and_then(|p| u32::try_from(p).ok())
            .and_then(|p| self.ids.binary_search(&p).ok());
        c
    }

    /// Runs of consecutive ids: each run's rows in the table and its first
    /// row in the compact table.
    fn runs(&self) -> Vec<(Range<usize>, usize)> {
        let mut runs: Vec<(Range<usize>, usize)> = Vec::new();
        for (j, &id) in self.ids.iter().enumerate() {
            let id = id as usize;
            match runs.last_mut() {
                Some((r, _)) if r.end == id => r.end += 1,
                _ => runs.push((id..id + 1, j)),
            }
        }
        runs
    }

    /// Uploads the rows `ids` of `slab`'s transport copy (its one tensor,
    /// `[V, C]`) as one `[rows, C]` table (zeros past the ids'), in the
    /// dtype a whole load would hold it. Returns it and the bytes uploaded.
    pub fn upload<E: Executor>(&self, ex: &E, slab: &LayerSlab) -> Result<(E::Tensor, u64)> {
        let table = slab.table();
        let (c, whole) = table_dims(slab)?;
        let dtype = weight_uploads(slab)[0].dtype;
        let shape = Shape::from(&[self.rows, c][..]);
        let runs = self.runs();
        if let Some((r, _)) = runs.last().filter(|(r, _)| r.end > whole) {
            return Err(TrainError::Internal(format!(
                "token id {} past the embedding's {whole} rows ({})",
                r.end - 1,
                table.iter().next().map_or("", |p| p.name.as_str())
            )));
        }
        let n = self.rows * c;
        // A copy a run (whole rows at memcpy speed), then the zeros.
        fn gather<T: Copy + Default>(
            all: &[T],
            runs: &[(Range<usize>, usize)],
            c: usize,
            n: usize,
        ) -> Vec<T> {
            let mut v = Vec::with_capacity(n);
            for (r, _) in runs {
                v.extend_from_slice(&all[r.start * c..r.end * c]);
            }
            v.resize(n, T::default());
            v
        }
        // Each arm gathers into its own buffer; one upload takes it.
        let (f32s, bf16s, f16s);
        let data = match slab.transport() {
            TransportRef::F32(all) => {
                f32s = gather(all, &runs, c, n);
                HostSlice::F32(&f32s)
            }
            TransportRef::BF16(all) => {
                bf16s = gather(all, &runs, c, n);
                HostSlice::BF16(&bf16s)
            }
            TransportRef::F16(all) => {
                f16s = gather(all, &runs, c, n);
                HostSlice::F16(&f16s)
            }
        };
        let bytes = (data.len() * data.dtype().size_in_bytes()) as u64;
        let t = upload_weight(
            ex,
            &WeightUpload {
                shape: &shape,
                data,
                dtype,
            },
        )?;
        Ok((t, bytes))
    }

    /// AdamW on every row of `slab` not among the ids, from a gradient of
    /// zeros: the step count stays for [`StepRows::update_touched`].
    pub fn update_untouched(&self, slab: &mut LayerSlab, h: &Hyper<'_>) -> Result<()> {
        let (c, rows) = table_dims(slab)?;
        let mut from = 0;
        let mut gaps = Vec::new();
        for (r, _) in self.runs() {
            gaps.push(from..r.start);
            from = r.end;
        }
        gaps.push(from..rows);
        let gaps = gaps
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| (g.start * c..g.end * c, None))
            .collect();
        update_runs(slab, gaps, h, false)
    }

    /// AdamW on the rows among the ids from `grad`, the compact table's
    /// gradients (`[rows, C]`, the ids' first), moving the step count once.
    pub fn update_touched(&self, slab: &mut LayerSlab, grad: &[f32], h: &Hyper<'_>) -> Result<()> {
        let (c, _) = table_dims(slab)?;
        if grad.len() != self.rows * c {
            return Err(TrainError::Internal(format!(
                "layer {}: {} gradients for {} rows of {c}",
                slab.index(),
                grad.len(),
                self.rows
            )));
        }
        let runs = self
            .runs()
            .into_iter()
            .map(|(rows, at)| {
                (
                    rows.start * c..rows.end * c,
                    Some(&grad[at * c..(at + rows.len()) * c]),
                )
            })
            .collect();
        update_runs(slab, runs, h, true)
    }
}

/// AdamW on each of `runs` of `slab`'s elements (ascending, disjoint) from
/// its gradient (`None`: zeros read from nowhere), the runs side by side
/// on the rayon pool (a step's ids are thousands of short runs: one update
/// each, one after another, would spend more time starting them than
/// updating), the squares summed in the runs' order. With `ends` the
/// layer's step count then moves on, once.
fn update_runs(
    slab: &mut LayerSlab,
    runs: Vec<(Range<usize>, Option<&[f32]>)>,
    h: &Hyper<'_>,
    ends: bool,
) -> Result<()> {
    let (index, numel) = (slab.index(), slab.numel());
    if !matches!(slab.transport_writes(), [w] if *w == (0..numel)) {
        return Err(TrainError::Internal(format!(
            "layer {index}: the embedding's rows alone with a transport copy shared by ranks"
        )));
    }
    let parts = slab.parts_mut();
    let step = parts.step;
    let (mut p, mut m, mut v, mut t) = (parts.params, parts.m, parts.v, parts.transport);
    let mut at = 0;
    let mut tasks = Vec::with_capacity(runs.len());
    for (r, g) in runs {
        if r.start < at || r.end > numel || g.is_some_and(|g| g.len() != r.len()) {
            return Err(TrainError::Internal(format!(
                "layer {index}: run {r:?} of {numel} after element {at}"
            )));
        }
        let skip = r.start - at;
        let (_, rest) = std::mem::take(&mut p).split_at_mut(skip);
        let (pr, rest) = rest.split_at_mut(r.len());
        p = rest;
        let (_, rest) = std::mem::take(&mut m).split_at_mut(skip);
        let (mr, rest) = rest.split_at_mut(r.len());
        m = rest;
        let (_, rest) = std::mem::take(&mut v).split_at_mut(skip);
        let (vr, rest) = rest.split_at_mut(r.len());
        v = rest;
        let (_, rest) = t.split_at_mut(skip);
        let (tr, rest) = rest.split_at_mut(r.len());
        t = rest;
        at = r.end;
        tasks.push((r, g, pr, mr, vr, tr));
    }
    let at_step = *step;
    let squares = tasks
        .into_par_iter()
        .map(|(r, g, p, m, v, mut t)| {
            let mask = part_mask(h.mask, r.clone(), numel)?;
            let grad = match g {
                Some(g) => Grad::Read(g),
                None => Grad::Zero(r.len()),
            };
            let u = SlabUpdate::new(p, grad, m, v)
                .decay(&mask)
                .grad_scale(h.grad_scale)
                .transport(adamw_transport(&mut t, 0..r.len()));
            Ok(h.adamw.step(&mut SlabState::at_step(at_step), h.lr, u)?.grad_sq)
        })
        .collect::<Result<Vec<f64>>>()?;
    if let Some(g) = h.grad_sq {
        g.add(index, squares.iter().sum());
    }
    if ends {
        *step += 1;
    }
    Ok(())
}

/// What decides, before a run, whether its steps take an untied
/// embedding's looked-up rows alone. One test for the trainer
/// ([`RowsSetting::of`] its own configuration and tier) and for `megatrain
/// plan` (from its flags), so that the estimate models what the run does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowsSetting {
    /// [`super::TrainerConfig::compact_embedding`].
    pub compact: bool,
    /// The embedding's gradient is needed whole: clipped (its squares),
    /// reduced across ranks, or held in the tier and summed over
    /// micro-batches.
    pub whole_gradient: bool,
    /// Layers are frozen (the embedding first of them).
    pub frozen: bool,
    /// The embedding's gradients are carried into the next step.
    pub carried: bool,
    /// The embedding's slab is spilled to disk.
    pub spilled: bool,
}

impl RowsSetting {
    /// As a trainer of `config` over `tier` takes it; `ranks`: it trains
    /// data parallel.
    pub fn of(config: &super::TrainerConfig, tier: &HostTier, ranks: bool) -> Self {
        let slab = &tier.layers()[0];
        let blocks = tier.layers().len().saturating_sub(2);
        RowsSetting {
            compact: config.compact_embedding,
            whole_gradient: config.grad_clip.is_some() || ranks || slab.holds_grads(),
            frozen: config.frozen_layers > 0,
            carried: super::carried_layers(config.carry_layers, config.carry_order, blocks).first()
                == Some(&0),
            spilled: slab.is_spilled(),
        }
    }

    /// Whether steps of `model` take its embedding's rows alone: an untied
    /// embedding that is one `[V, C]` table, none of the above in the way.
    pub fn applies(&self, model: &ModelConfig) -> bool {
        self.compact
            && !(self.whole_gradient || self.frozen || self.carried || self.spilled)
            && !model.tie_word_embeddings
            && model.layer_table(0).is_ok_and(|t| t.len() == 1)
    }
}

impl<E: Executor> super::Trainer<E> {
    /// The rows of the embedding a step of one micro-batch with token ids
    /// `inputs` takes alone, or `None` where it takes the whole table
    /// ([`RowsSetting::applies`] does not, or an id is past the vocabulary:
    /// the whole table's forward names it).
    pub(super) fn step_rows(&self, inputs: &[u32]) -> Option<StepRows> {
        let model = &self.model;
        let setting = RowsSetting::of(&self.config, &self.tier, self.dist.is_some());
        (setting.applies(model) && inputs.iter().all(|&i| (i as usize) < model.vocab_size))
            .then(|| StepRows::of(inputs, model.vocab_size))
    }

    /// [`Trainer::step_rows`](super::Trainer) of a step of `tokens` tokens:
    /// as many rows as it has tokens (what the transfer-only mode moves).
    pub(super) fn looked_up_rows(&self, tokens: usize) -> Option<StepRows> {
        let ids: Vec<u32> = (0..tokens.min(self.model.vocab_size) as u32).collect();
        self.step_rows(&ids)
    }
}

/// The embedding table's row length and rows.
fn table_dims(slab: &LayerSlab) -> Result<(usize, usize)> {
    let p = slab.table().iter().next();
    match p.map(|p| p.shape.dims()) {
        Some(&[v, c]) if slab.table().len() == 1 => Ok((c, v)),
        _ => Err(TrainError::Internal(format!(
            "layer {}: not one [rows, C] table",
            slab.index()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_sorted_distinct_and_runs_are_consecutive() {
        let r = StepRows::of(&[7, 3, 4, 7, 9, 3, 5], 10);
        assert_eq!(r.ids, [3, 4, 5, 7, 9]);
        assert_eq!(r.remapped, [3, 0, 1, 3, 4, 0, 2]);
        assert_eq!(r.runs(), [(3..6, 0), (7..8, 3), (9..10, 4)]);
        // As many rows as inputs, at most the vocabulary's.
        assert_eq!(r.rows, 7);
        assert_eq!(StepRows::of(&[7, 3, 4, 7, 9, 3, 5], 6).rows, 6);
        assert!(StepRows::of(&[], 10).runs().is_empty());
    }
}
