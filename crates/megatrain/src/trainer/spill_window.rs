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

use megatrain_tier::{HostTier, SpillStats, SpillWindow, SpilledLayer, WindowConfig};

use super::carry::Deferred;
use super::reduce::DistState;
use super::{Result, StepMetrics};

/// The tier's spilled layers from layer `from` on (the frozen ones before
/// are never updated) in the backward's order (last layer first), each
/// cut to this rank's range where the optimizer is sharded (a rank reads
/// and writes only its shard of the spill files).
fn spilled(tier: &HostTier, dist: Option<&DistState>, from: usize) -> Result<Vec<SpilledLayer>> {
    let own = dist.filter(|d| d.config.shard_optimizer);
    tier.spilled_backward()
        .into_iter()
        .filter(|l| l.layer >= from)
        .map(|l| match own {
            Some(d) => {
                let r = d.own(l.layer);
                Ok(l.only(r)?)
            }
            None => Ok(l),
        })
        .collect()
}

/// A window over the tier's spilled layers from layer `from` on, in the
/// backward's order (last layer first), or `None` when nothing is spilled.
pub(super) fn start_backward(
    tier: &HostTier,
    dist: Option<&DistState>,
    config: WindowConfig,
    from: usize,
) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    Ok(Some(SpillWindow::start(spilled(tier, dist, from)?, config)?))
}

/// The same, first layer first (clipping's updates run in table order,
/// after the backward or deferred into the next forward).
pub(super) fn start_forward(
    tier: &HostTier,
    dist: Option<&DistState>,
    config: WindowConfig,
    from: usize,
) -> Result<Option<SpillWindow>> {
    if !tier.has_spill() {
        return Ok(None);
    }
    let mut layers = spilled(tier, dist, from)?;
    layers.reverse();
    Ok(Some(SpillWindow::start(layers, config)?))
}

/// The window the clipped updates deferred into a forward
/// ([`Deferred`]) read their spilled layers through, or `None` when
/// nothing is deferred or spilled.
pub(super) fn start_deferred(
    tier: &HostTier,
    dist: Option<&DistState>,
    config: WindowConfig,
    deferred: Option<Deferred>,
) -> Result<Option<SpillWindow>> {
    match deferred {
        Some(d) => start_forward(tier, dist, config, d.next),
        None => Ok(None),
    }
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

#[cfg(test)]
mod tests {
    use super::super::optimizer::{part_mask, sub_mask};
    use megatrain_adamw::DecayMask;

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
