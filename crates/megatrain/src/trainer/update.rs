//! AdamW on a part of one layer: the single update every optimizer path
//! of the step runs (the worker's chunks, clipping mode, the data parallel
//! worker's shards, the optimizer-only mode), in RAM or through the spill
//! window, writing the layer's transport copy in the same pass.

use std::ops::Range;
use std::sync::Mutex;

use megatrain_adamw::{AdamW, BlockNorms, DecayMask, Grad, SlabState, SlabUpdate, Transport};
use megatrain_tier::{LayerSlab, SpillWindow, TransportMut};

use super::TrainError;
use super::optimizer::part_mask;
use crate::dist::Elem;

/// What [`update_part`] is asked to do to one layer.
pub(super) struct Part<'g> {
    /// The summed gradient of exactly elements `r` (read only: where it
    /// landed, or a reduction's receive buffer), or `None` for the layer's
    /// held gradient.
    pub grad: Option<&'g [f32]>,
    /// The elements updated (possibly none: a rank's shard may miss a
    /// chunk).
    pub r: Range<usize>,
    /// The elements of the held gradient zeroed for the next step; they
    /// hold `r` (a rank of a sharded optimizer also zeroes the stale sums
    /// around its shard).
    pub zero: Range<usize>,
    /// This is the layer's last update of the step: its step count (bias
    /// correction) moves on, once whatever the number of chunks, and a
    /// spilled layer's pages are dropped.
    pub ends: bool,
}

impl<'g> Part<'g> {
    /// Elements `r` of a layer of `numel` elements, ending it where they
    /// reach its end.
    pub fn of(numel: usize, grad: Option<&'g [f32]>, r: Range<usize>) -> Part<'g> {
        Part {
            grad,
            ends: r.end == numel,
            zero: r.clone(),
            r,
        }
    }
}

/// The hyperparameters of one step's updates.
#[derive(Clone, Copy)]
pub(super) struct Hyper<'a> {
    pub adamw: &'a AdamW,
    /// The whole layer's decay mask.
    pub mask: &'a DecayMask,
    pub lr: f32,
    pub grad_scale: f32,
    /// Where the squares of the applied gradients are summed, where the
    /// step reports their norm.
    pub grad_sq: Option<&'a GradSquares>,
}

/// Per layer, Σ g² of the gradients the step's updates applied (from
/// [`megatrain_adamw::StepStats`]), for the norm the step reports.
#[derive(Debug, Default)]
pub(super) struct GradSquares(Mutex<Vec<f64>>);

impl GradSquares {
    /// Zeros for a step over `layers` layers.
    pub fn reset(&self, layers: usize) {
        let mut v = self.0.lock().expect("grad squares poisoned");
        v.clear();
        v.resize(layers, 0.0);
    }

    pub(super) fn add(&self, layer: usize, x: f64) {
        let mut v = self.0.lock().expect("grad squares poisoned");
        if let Some(s) = v.get_mut(layer) {
            *s += x;
        }
    }

    /// Each layer's sum.
    pub fn per_layer(&self) -> Vec<f64> {
        self.0.lock().expect("grad squares poisoned").clone()
    }
}

/// Per layer, Σ g² of the held gradient block by block, summed by the
/// optimizer worker as the last micro-batch's chunks are added in (while
/// they are in cache, beside the device's backward), so that clipping's
/// norm after the backward has only the blocks that straddle chunks left
/// to read; the same bits as a norm taken all at the end.
#[derive(Debug, Default)]
pub(super) struct HeldNorms(Mutex<Vec<BlockNorms>>);

impl HeldNorms {
    /// Nothing summed, for layers of `numels` elements.
    pub fn reset(&self, numels: impl Iterator<Item = usize>) {
        *self.0.lock().expect("held norms poisoned") = numels.map(BlockNorms::new).collect();
    }

    /// Elements `r` of `layer`'s held gradient `g` are final.
    pub fn note(&self, layer: usize, g: &[f32], r: Range<usize>) {
        if let Some(n) = self.0.lock().expect("held norms poisoned").get_mut(layer) {
            n.note(g, r);
        }
    }

    /// Σ g² of `layer`'s held gradient `g`.
    pub fn finish(&self, layer: usize, g: &[f32]) -> f64 {
        let v = self.0.lock().expect("held norms poisoned");
        match v.get(layer) {
            Some(n) => n.finish(g),
            None => BlockNorms::new(g.len()).finish(g),
        }
    }
}

/// Elements `r` of a transport copy, as the fused AdamW pass writes them.
pub(super) fn adamw_transport<'a>(t: &'a mut TransportMut<'_>, r: Range<usize>) -> Transport<'a> {
    match t {
        TransportMut::F32(t) => Transport::F32(&mut t[r]),
        TransportMut::BF16(t) => Transport::Bf16(&mut t[r]),
        TransportMut::F16(t) => Transport::F16(&mut t[r]),
    }
}

/// The transport copy's first element, as an all-gather moves it.
fn transport_base(t: &mut TransportMut<'_>) -> (*mut u8, Elem) {
    match t {
        TransportMut::F32(t) => (t.as_mut_ptr().cast(), Elem::F32),
        TransportMut::BF16(t) => (t.as_mut_ptr().cast(), Elem::U16),
        TransportMut::F16(t) => (t.as_mut_ptr().cast(), Elem::U16),
    }
}

/// `piece` cut where the ranges `writes` (sorted, disjoint) begin and end:
/// each part, and whether it lies in one of them.
fn segments(piece: &Range<usize>, writes: &[Range<usize>]) -> Vec<(Range<usize>, bool)> {
    let mut out = Vec::new();
    let mut at = piece.start;
    for w in writes {
        let (lo, hi) = (w.start.max(at), w.end.min(piece.end));
        if lo >= hi {
            continue;
        }
        if at < lo {
            out.push((at..lo, false));
        }
        out.push((lo..hi, true));
        at = hi;
    }
    if at < piece.end {
        out.push((at..piece.end, false));
    }
    out
}

/// AdamW on `part` of `slab`, writing its transport copy in the same pass
/// (where the machine's ranks share the copy, only this process's ranges
/// of it, [`LayerSlab::transport_writes`]).
/// A spilled layer's p, m and v come chunk by chunk from `window` where one
/// is open (over this process's ranges; a gradient chunk then ends on the
/// window's boundaries, see `Trainer::transfer_chunk`), else the layer is
/// updated in place. The held gradient's elements `r` are zeroed in the
/// AdamW pass, the rest of `zero` after it. AdamW is elementwise, so a
/// layer updated part by part gets the bits of one updated whole.
///
/// Touches only elements `part.zero` of the layer's buffers (no reference
/// to the rest, where other chunks' collectives may be in flight, or other
/// ranks write a shared transport copy) and returns the transport copy's
/// pointer at element `zero.start`.
pub(super) fn update_part(
    slab: &mut LayerSlab,
    part: Part<'_>,
    window: Option<&SpillWindow>,
    h: Hyper<'_>,
) -> Result<(*mut u8, Elem), TrainError> {
    let Part { grad, r, zero, ends } = part;
    let (index, numel) = (slab.index(), slab.numel());
    if r.start < zero.start || r.end > zero.end || zero.end > numel {
        return Err(TrainError::Internal(format!(
            "layer {index}: update of {r:?} outside {zero:?} (of {numel})"
        )));
    }
    let window = window.filter(|_| slab.is_spilled() && numel > 0);
    // The elements of the transport copy this process writes: where the
    // machine's ranks share the copy, the rest of it is other ranks'.
    let writes = slab.transport_writes().to_vec();
    // Positions within the elements `zero` the slices cover.
    let local = |x: &Range<usize>| x.start - zero.start..x.end - zero.start;
    let base = {
        let parts = slab.parts_in(zero.clone());
        let mut transport = parts.transport;
        let base = transport_base(&mut transport);
        let mut held = parts.grads;
        // The held gradient is ours to zero as the update reads it.
        let (mut g, fused) = match (grad, held.as_deref_mut()) {
            _ if r.is_empty() => (None, false),
            (Some(g), _) => (Some(Grad::Read(g)), false),
            (None, Some(h)) => (Some(Grad::Mut(&mut h[local(&r)])), true),
            (None, None) => {
                return Err(TrainError::Internal(format!(
                    "layer {index}: no gradient to apply"
                )));
            }
        };
        // Every piece of a step at the layer's step count: the count moves
        // once, below.
        let at = |p: &Range<usize>| p.start - r.start..p.end - r.start;
        let mut sq = 0.0;
        let mut apply = |piece: Range<usize>, p: &mut [f32], m: &mut [f32], v: &mut [f32]| {
            let g = g.as_mut().expect("a non-empty range has a gradient");
            for (seg, copy) in segments(&piece, &writes) {
                let l = seg.start - piece.start..seg.end - piece.start;
                let mask = part_mask(h.mask, seg.clone(), numel)?;
                let mut update =
                    SlabUpdate::new(&mut p[l.clone()], g.part(at(&seg)), &mut m[l.clone()], &mut v[l])
                        .decay(&mask)
                        .zero_grad(fused)
                        .grad_scale(h.grad_scale);
                if copy {
                    update = update.transport(adamw_transport(&mut transport, local(&seg)));
                }
                sq += h
                    .adamw
                    .step(&mut SlabState::at_step(*parts.step), h.lr, update)?
                    .grad_sq;
            }
            Ok::<(), TrainError>(())
        };
        match window {
            Some(w) => {
                let mut done = r.start;
                while done < r.end {
                    let mut chunk = w.next(index)?;
                    let piece = chunk.range();
                    if piece.start != done || piece.end > r.end {
                        return Err(TrainError::Internal(format!(
                            "layer {index}: spill chunk {piece:?} does not fit update {r:?} at {done}"
                        )));
                    }
                    let (p, m, v) = chunk.parts_mut();
                    apply(piece.clone(), p, m, v)?;
                    w.give_back(chunk)?;
                    done = piece.end;
                }
            }
            None if !r.is_empty() => {
                let l = local(&r);
                apply(
                    r.clone(),
                    &mut parts.params[l.clone()],
                    &mut parts.m[l.clone()],
                    &mut parts.v[l],
                )?;
            }
            None => {}
        }
        if let Some(g) = h.grad_sq {
            g.add(index, sq);
        }
        if ends {
            *parts.step += 1;
        }
        if let Some(h) = held {
            let l = local(&r);
            match fused {
                true => {
                    h[..l.start].fill(0.0);
                    h[l.end..].fill(0.0);
                }
                false => h.fill(0.0),
            }
        }
        base
    };
    if ends {
        // A spilled layer's pages would otherwise stay resident and break
        // the RAM budget; the next step maps them back in.
        slab.evict()?;
    }
    Ok(base)
}

#[cfg(test)]
mod tests {
    use super::segments;

    #[test]
    fn a_piece_is_cut_where_the_written_ranges_are() {
        let w = [10..20, 30..40];
        assert_eq!(
            segments(&(0..50), &w),
            [
                (0..10, false),
                (10..20, true),
                (20..30, false),
                (30..40, true),
                (40..50, false)
            ]
        );
        assert_eq!(
            segments(&(12..35), &w),
            [(12..20, true), (20..30, false), (30..35, true)]
        );
        assert_eq!(segments(&(20..30), &w), [(20..30, false)]);
        let whole = std::iter::once(0..50).collect::<Vec<_>>();
        assert_eq!(segments(&(0..50), &whole), [(0..50, true)]);
        assert!(segments(&(5..5), &w).is_empty());
    }
}
