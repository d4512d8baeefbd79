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
use megatrain_tier::{HostTier, LayerSlab, SpillStats, SpillWindow, WindowConfig};

use super::optimizer::{adamw_transport, chosen_grad, update_slab};
use super::{Result, StepMetrics, TrainError};

/// A window over the tier's spilled layers in the backward's order (last
/// layer first), or `None` when nothing is spilled.
pub(super) fn start_backward(tier: &HostTier, config: WindowConfig) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    Ok(Some(SpillWindow::start(tier.spilled_backward(), config)?))
}

/// The same, first layer first (the clipping mode updates in table order).
pub(super) fn start_forward(tier: &HostTier, config: WindowConfig) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    let mut layers = tier.spilled_backward();
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

/// AdamW on one layer: through the window when the layer is spilled and a
/// window is open, else in place ([`update_slab`]).
pub(super) fn update_any(
    slab: &mut LayerSlab,
    grad: Option<&mut [f32]>,
    window: Option<&SpillWindow>,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<()> {
    match window {
        Some(w) if slab.is_spilled() && slab.numel() > 0 => {
            update_spilled(slab, grad, w, adamw, mask, lr, grad_scale)
        }
        _ => update_slab(slab, grad, adamw, mask, lr, grad_scale),
    }
}

/// The decay mask of elements `r` of a slab, re-based to 0.
fn sub_mask(mask: &DecayMask, r: Range<usize>) -> Result<DecayMask> {
    Ok(match mask {
        DecayMask::All => DecayMask::All,
        DecayMask::None => DecayMask::None,
        DecayMask::Ranges { ranges, .. } => DecayMask::from_ranges(
            r.len(),
            ranges
                .iter()
                .map(|d| d.start.max(r.start)..d.end.min(r.end))
                .filter(|d| d.start < d.end)
                .map(|d| d.start - r.start..d.end - r.start),
        )?,
    })
}

fn update_spilled(
    slab: &mut LayerSlab,
    grad: Option<&mut [f32]>,
    window: &SpillWindow,
    adamw: &AdamW,
    mask: &DecayMask,
    lr: f32,
    grad_scale: f32,
) -> Result<()> {
    let index = slab.index();
    let numel = slab.numel();
    let parts = slab.parts_mut();
    let (grad, zero) = chosen_grad(index, grad, parts.grads)?;
    let mut transport = parts.transport;
    let first = *parts.step;
    let mut next_step = first;
    let mut done = 0;
    while done < numel {
        let mut chunk = window.next(index)?;
        let r = chunk.range();
        if r.start != done {
            return Err(TrainError::Internal(format!(
                "layer {index}: spill chunk starts at {} instead of {done}",
                r.start
            )));
        }
        let sub = sub_mask(mask, r.clone())?;
        let t = adamw_transport(&mut transport, r.clone());
        let (p, m, v) = chunk.parts_mut();
        let mut state = SlabState::at_step(first);
        let update = SlabUpdate::new(p, &mut grad[r.clone()], m, v)
            .decay(&sub)
            .transport(t)
            .zero_grad(zero)
            .grad_scale(grad_scale);
        adamw.step(&mut state, lr, update)?;
        next_step = state.step();
        window.give_back(chunk)?;
        done = r.end;
    }
    *parts.step = next_step;
    // Held gradients stay on their memory map: drop their pages.
    slab.evict()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_masks_rebase_and_clip() {
        let m = DecayMask::from_ranges(10, [1..3, 5..9]).unwrap();
        let s = sub_mask(&m, 2..7).unwrap();
        let flags: Vec<bool> = (0..5).map(|i| s.decays(i)).collect();
        assert_eq!(flags, [true, false, false, true, true]);
        assert_eq!(sub_mask(&DecayMask::All, 3..4).unwrap(), DecayMask::All);
    }
}
