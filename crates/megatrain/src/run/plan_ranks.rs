//! `megatrain plan --ranks N`: host bytes per rank of data parallel
//! training with the optimizer sharded (ZeRO-1/2): each rank keeps its 1/N
//! of every layer's p, m and v resident (the pages of the rest are handed
//! back), and a whole transport copy; held gradients stay whole.

use megatrain_tier::{PAGE, TierConfig};
use megatrain_zoo::ModelConfig;

use crate::dist::shard_range;

/// Resident host bytes of the busiest rank (the largest shards).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankBytes {
    pub ranks: usize,
    pub params: u64,
    /// `m` and `v` together.
    pub moments: u64,
    pub transport: u64,
    pub gradients: u64,
    /// Gradient staging and the receive buffers of the reductions in
    /// flight, chunk-sized.
    pub staging: u64,
}

impl RankBytes {
    pub fn total(&self) -> u64 {
        self.params + self.moments + self.transport + self.gradients + self.staging
    }
}

/// Whole pages of `elems` f32, plus the one a shard boundary can straddle.
fn shard_pages(elems: usize) -> u64 {
    if elems == 0 {
        0
    } else {
        ((elems * 4).div_ceil(PAGE) as u64 + 1) * PAGE as u64
    }
}

/// Per-rank host bytes on `ranks` ranks with a sharded optimizer. Rank
/// N−1 holds the largest range of every layer (ranges differ by at most one
/// element), so it is the one counted.
pub fn per_rank(model: &ModelConfig, tier: &TierConfig, ranks: usize) -> RankBytes {
    let ranks = ranks.max(1);
    let tables = model.layer_tables();
    let mut b = RankBytes {
        ranks,
        ..RankBytes::default()
    };
    let mut max_layer = 0u64;
    for t in &tables {
        let n = t.numel();
        max_layer = max_layer.max(n as u64);
        let own = shard_range(n, ranks - 1, ranks).len();
        let pages = if ranks == 1 {
            megatrain_tier::padded_bytes(n, 4)
        } else {
            shard_pages(own).min(megatrain_tier::padded_bytes(n, 4))
        };
        b.params += pages;
        b.moments += 2 * pages;
        b.transport += megatrain_tier::padded_bytes(n, tier.transport.size_in_bytes());
        if tier.hold_grads {
            b.gradients += megatrain_tier::padded_bytes(n, 4);
        }
    }
    let chunk = crate::trainer::transfer_chunk_for(model.param_count() as u64);
    b.staging = staging_bytes(max_layer.min(chunk as u64), ranks);
    b
}

/// Host gradient staging of a run whose gradients move in transfer chunks
/// of `chunk` elements (the trainer's default for the model, and never
/// more than its largest layer), none sized by a layer. On a GPU the
/// readback buffers the optimizer (and on several ranks, the reduction)
/// reads in place (`gradient_chunks_held`; the CPU executor's staging
/// takes fewer); on several ranks also the receive buffers of two
/// reductions in flight (`trainer/reduce.rs`).
pub(crate) fn staging_bytes(chunk: u64, ranks: usize) -> u64 {
    let queue = crate::trainer::TrainerConfig::default().optimizer_queue;
    let chunks = match ranks {
        1 => crate::trainer::gradient_chunks_held(queue, false),
        _ => crate::trainer::gradient_chunks_held(queue, true) + 2,
    };
    4 * chunk * chunks as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharding_divides_p_m_v_and_keeps_the_transport_whole() {
        let model = megatrain_zoo::preset("llama-tiny", None).unwrap();
        let tier = TierConfig::default();
        let one = per_rank(&model, &tier, 1);
        let four = per_rank(&model, &tier, 4);
        assert_eq!(one.transport, four.transport);
        let n: u64 = model.layer_tables().iter().map(|t| t.numel() as u64).sum();
        // p alone on one rank: 4 bytes a parameter, page-rounded per layer.
        assert!(one.params >= 4 * n);
        assert!(four.params * 4 >= one.params, "a quarter, not less");
        assert!(four.params < one.params / 2, "{four:?} vs {one:?}");
        assert_eq!(four.moments, 2 * four.params);
    }
}
