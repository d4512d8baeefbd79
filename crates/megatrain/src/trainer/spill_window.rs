//! The optimizer's side of the disk tier: spilled layers are updated chunk
//! by chunk from a [`SpillWindow`] (read ahead in the order the optimizer
//! meets them, written behind), never through their memory maps.
//!
//! The window is started before the forward of the micro-batch that
//! updates, so the first spilled layers, which the backward reaches first
//! (the spilled layers are the model's suffix, and the backward runs last
//! layer first), are already in RAM when their gradients land. AdamW is
//! elementwise, so a layer updated chunk by chunk gets the same bits as one
//! updated whole; the step count advances once per layer.

use std::ops::Range;

use megatrain_adamw::{AdamW, DecayMask, SlabState, SlabUpdate};
use megatrain_tier::{HostTier, LayerSlab, SpillStats, SpillWindow, SpilledLayer, WindowConfig};

use super::optimizer::{adamw_transport, chosen_grad, part_mask, update_slab};
use super::reduce::DistState;
use super::{Result, StepMetrics, TrainError};

/// The tier's spilled layers in the backward's order (last layer first),
/// each cut to this rank's range where the optimizer is sharded (a rank
/// reads and writes only its shard of the spill files).
fn spilled(tier: &HostTier, dist: Option<&DistState>) -> Result<Vec<SpilledLayer>> {
    let own = dist.filter(|d| d.config.shard_optimizer);
    tier.spilled_backward()
        .into_iter()
        .map(|l| match own {
            Some(d) => {
                let r = d.own(l.layer);
                Ok(l.only(r)?)
            }
            None => Ok(l),
        })
        .collect()
}

/// A window over the tier's spilled layers in the backward's order (last
/// layer first), or `None` when nothing is spilled.
pub(super) fn start_backward(
    tier: &HostTier,
    dist: Option<&DistState>,
    config: WindowConfig,
) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    Ok(Some(SpillWindow::start(spilled(tier, dist)?, config)?))
}

/// The same, first layer first (the clipping mode updates in table order).
pub(super) fn start_forward(
    tier: &HostTier,
    dist: Option<&DistState>,
    config: WindowConfig,
) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    let mut layers = spilled(tier, dist)?;
    layers.reverse();
    Ok(Some(SpillWindow::start(layers, config)?))
}

/// Adds a finished window's numbers to the step's.
pub(super) fn record(m: &mut StepMetrics, s: &SpillStats) {
    m.spill_read_bytes += s.bytes_read;
    m.spill_written_bytes += s.bytes_written;
    m.spill_disk_ms += s.disk_busy_ms;
    m.spill_wait_ms += s.wait_ms;
    m.spill_gb_s = if m.spill_disk_ms > 0.0 {
        (m.spill_read_bytes + m.spill_written_bytes) as f64 / (m.spill_disk_ms / 1e3) / 1e9
    } else {
        0.0
    };
}

/// AdamW on elements `r` of one layer (`grad` holds exactly those, or
/// `None` for the held gradient): through the window when the layer is
/// spilled and a window is open, else in place ([`update_slab`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn update_any(
    slab: &mut LayerSlab,
    grad: Option<&[f32]>,
    r: Range<usize>,
    window: Option<&SpillWindow>,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<()> {
    match window {
        Some(w) if slab.is_spilled() && slab.numel() > 0 => {
            update_spilled(slab, grad, r, w, adamw, mask, lr, grad_scale)
        }
        _ => update_slab(slab, grad, r, adamw, mask, lr, grad_scale),
    }
}

/// The window hands a layer out in chunks of its own size, in order; a
/// gradient chunk must end on one of their boundaries (the trainer's
/// transfer chunk is a multiple of the window's, see `transfer_chunk`).
#[allow(clippy::too_many_arguments)]
fn update_spilled(
    slab: &mut LayerSlab,
    grad: Option<&[f32]>,
    r: Range<usize>,
    window: &SpillWindow,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<()> {
    let index = slab.index();
    let numel = slab.numel();
    let parts = slab.parts_in(r.clone());
    let (mut grad, zero) = chosen_grad(index, grad, parts.grads)?;
    let mut transport = parts.transport;
    let first = *parts.step;
    let mut next_step = first;
    let mut done = r.start;
    while done < r.end {
        let mut chunk = window.next(index)?;
        let w = chunk.range();
        if w.start != done || w.end > r.end {
            return Err(TrainError::Internal(format!(
                "layer {index}: spill chunk {w:?} does not fit gradient chunk {r:?} at {done}"
            )));
        }
        let sub = part_mask(mask, w.clone(), numel)?;
        let t = adamw_transport(&mut transport, w.start - r.start..w.end - r.start);
        let (p, m, v) = chunk.parts_mut();
        let mut state = SlabState::at_step(first);
        let update = SlabUpdate::new(p, grad.part(w.start - r.start..w.end - r.start), m, v)
            .decay(&sub)
            .transport(t)
            .zero_grad(zero)
            .grad_scale(grad_scale);
        adamw.step(&mut state, lr, update)?;
        next_step = state.step();
        window.give_back(chunk)?;
        done = w.end;
    }
    if r.end == numel {
        *parts.step = next_step;
        // Held gradients stay on their memory map: drop their pages.
        slab.evict()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::optimizer::sub_mask;
    use super::*;

    /// A slab's mask cut to each rank's range, for ranks of every size.
    #[test]
    fn mask_cut_agrees_with_the_whole_mask() {
        let mask = DecayMask::from_ranges(20, [2..5, 8..9, 12..20]).unwrap();
        for size in 1..=6 {
            for r in crate::dist::shard_ranges(20, size) {
                let cut = part_mask(&mask, r.clone(), 20).unwrap();
                for (i, g) in r.clone().enumerate() {
                    assert_eq!(cut.decays(i), mask.decays(g), "range {r:?} element {g}");
                }
                if let DecayMask::Ranges { len, .. } = *cut {
                    assert_eq!(len, r.len());
                }
            }
        }
        assert_eq!(*part_mask(&DecayMask::All, 3..7, 20).unwrap(), DecayMask::All);
    }

    #[test]
    fn sub_masks_rebase_and_clip() {
        let m = DecayMask::from_ranges(10, [1..3, 5..9]).unwrap();
        let s = sub_mask(&m, 2..7).unwrap();
        let flags: Vec<bool> = (0..5).map(|i| s.decays(i)).collect();
        assert_eq!(flags, [true, false, false, true, true]);
        assert_eq!(sub_mask(&DecayMask::All, 3..4).unwrap(), DecayMask::All);
    }
}
