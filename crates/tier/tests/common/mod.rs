#![allow(dead_code)]

use megatrain_tensor::ParamTable;
use megatrain_tier::{HostTier, TierConfig};

/// A small model: per layer a `[rows, cols]` weight and a `[cols]` bias.
pub fn tables(dims: &[(usize, usize)]) -> Vec<ParamTable> {
    dims.iter()
        .enumerate()
        .map(|(l, &(r, c))| {
            let mut t = ParamTable::new();
            t.push(format!("layers.{l}.w"), [r, c], true).unwrap();
            t.push(format!("layers.{l}.b"), [c], false).unwrap();
            t
        })
        .collect()
}

/// Fills params, m, v and steps with distinct, non-round values (so a bit
/// error or a swapped block shows).
pub fn fill(tier: &mut HostTier, seed: u32) {
    for (l, layer) in tier.layers_mut().iter_mut().enumerate() {
        let parts = layer.parts_mut();
        for (i, ((p, m), v)) in parts
            .params
            .iter_mut()
            .zip(parts.m.iter_mut())
            .zip(parts.v.iter_mut())
            .enumerate()
        {
            let x = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed + l as u32 * 977);
            *p = f32::from_bits(0x3c00_0000 | (x & 0x00ff_ffff)) - 0.01;
            *m = f32::from_bits(0x3800_0000 | (x.rotate_left(7) & 0x00ff_ffff));
            *v = f32::from_bits(0x3000_0000 | (x.rotate_left(13) & 0x00ff_ffff));
        }
        *parts.step = 100 + l as u64 + seed as u64;
    }
    tier.refresh_all_transport();
}

pub fn config() -> TierConfig {
    TierConfig::default()
}
