//! `megatrain plan --ranks N`: host bytes per rank of data parallel
//! training with the optimizer sharded (ZeRO-1/2), placed as the trainer
//! places them ([`TierConfig::shard`]): each rank keeps its 1/N of every RAM
//! layer's p, m and v resident (the pages of the rest are handed back) and
//! a whole transport copy, or its share of the one the machine's ranks
//! map together; held gradients stay whole; under a budget the
//! layers that do not fit spill, and each rank moves its 1/N of them
//! through the disk.

use megatrain_tier::shard::resident_block_bytes;
use megatrain_tier::{MemoryReport, Shard, SharedTransport, TierConfig, padded_bytes};
use megatrain_zoo::ModelConfig;

use super::error::Result;

/// What the busiest rank (the largest shards) holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RankBytes {
    pub ranks: usize,
    /// The tier's resident bytes and its spill files (its range of each
    /// spilled layer, and its held gradients whole).
    pub host: MemoryReport,
    /// Gradient staging and the receive buffers of the reductions in
    /// flight, chunk-sized.
    pub staging: u64,
    /// Bytes of spill files read (and as many written) per step: this
    /// rank's share of the spilled p, m, v, and its held gradients whole.
    pub disk_per_step: u64,
    /// What rank 0 adds while saving a checkpoint: it gathers one layer's
    /// p, m and v whole at a time (the largest RAM layer's, beyond its
    /// share).
    pub save_gather: u64,
}

impl RankBytes {
    /// RAM in training (not while rank 0 saves).
    pub fn total(&self) -> u64 {
        self.host.ram.total() + self.staging
    }
}

/// The busiest rank's bytes on `ranks` ranks with a sharded optimizer,
/// under `tier`'s budget; `shared`: machines of this many ranks each map
/// one transport copy (`train --share-transport`), each rank counting its
/// share; `None`: a copy per rank. `queue`: gradient chunks that may wait
/// for the optimizer (`TrainerConfig::optimizer_queue`).
pub fn per_rank(
    model: &ModelConfig,
    tier: &TierConfig,
    ranks: usize,
    shared: Option<usize>,
    queue: usize,
) -> Result<RankBytes> {
    let ranks = ranks.max(1);
    let tables = model.layer_tables();
    let shard = (ranks > 1).then_some(Shard { rank: 0, ranks });
    let cfg = TierConfig {
        shard,
        shared_transport: shard.and(shared).filter(|&k| k > 1).map(|local| SharedTransport {
            path: Default::default(),
            file: None,
            writes: vec![0],
            ranks,
            local,
        }),
        ..tier.clone()
    };
    let host = megatrain_tier::plan(&tables, &cfg)?;
    let in_ram = host.first_spilled.unwrap_or(tables.len());
    let share = |n: usize| 3 * resident_block_bytes(n, ranks);
    let save_gather = tables[..in_ram]
        .iter()
        .map(|t| 3 * padded_bytes(t.numel(), 4) - share(t.numel()))
        .max()
        .unwrap_or(0);
    let max_layer = tables.iter().map(|t| t.numel() as u64).max().unwrap_or(0);
    let chunk = max_layer.min(crate::trainer::transfer_chunk_for(model.param_count() as u64) as u64);
    Ok(RankBytes {
        ranks,
        staging: staging_bytes(chunk, default_in_flight(&tables, chunk), ranks, queue),
        disk_per_step: host.disk.total(),
        save_gather,
        host,
    })
}

/// Chunks of a layer in flight at once by the trainer's default, for
/// layers `tables` moved in chunks of `chunk` elements.
pub(crate) fn default_in_flight(tables: &[megatrain_tensor::ParamTable], chunk: u64) -> usize {
    let numels: Vec<usize> = tables.iter().map(|t| t.numel()).collect();
    crate::trainer::chunks_in_flight(
        crate::trainer::TrainerConfig::default().chunks_in_flight,
        &numels,
        chunk as usize,
    )
}

/// Host gradient staging of a run whose gradients move in transfer chunks
/// of `chunk` elements (the trainer's default for the model, and never
/// more than its largest layer), none sized by a layer. On a GPU the
/// readback buffers the optimizer (and on several ranks, the reduction)
/// reads in place (`gradient_chunks_held`; the CPU executor's staging
/// takes fewer); on several ranks also the receive buffers of two
/// reductions in flight (`trainer/reduce.rs`); `queue` chunks waiting for
/// the optimizer.
pub(crate) fn staging_bytes(chunk: u64, in_flight: usize, ranks: usize, queue: usize) -> u64 {
    let chunks = match ranks {
        1 => crate::trainer::gradient_chunks_held(queue, false, in_flight),
        _ => crate::trainer::gradient_chunks_held(queue, true, in_flight) + 2,
    };
    4 * chunk * chunks as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::DEFAULT_OPTIMIZER_QUEUE as Q;

    #[test]
    fn sharding_divides_p_m_v_and_keeps_the_transport_whole() {
        let model = megatrain_zoo::preset("llama-tiny", None).unwrap();
        let tier = TierConfig::default();
        let one = per_rank(&model, &tier, 1, None, Q).unwrap();
        let four = per_rank(&model, &tier, 4, None, Q).unwrap();
        assert_eq!(one.host.ram.transport, four.host.ram.transport);
        let n: u64 = model.layer_tables().iter().map(|t| t.numel() as u64).sum();
        // p alone on one rank: 4 bytes a parameter, page-rounded per layer.
        assert!(one.host.ram.params >= 4 * n);
        assert!(
            four.host.ram.params * 4 >= one.host.ram.params,
            "a quarter, not less"
        );
        assert!(
            four.host.ram.params < one.host.ram.params / 2,
            "{four:?} vs {one:?}"
        );
        assert_eq!(four.host.ram.moments, 2 * four.host.ram.params);
        assert_eq!(one.save_gather, 0);
        // One layer whole, less its share: the one where that is most.
        let most = model
            .layer_tables()
            .iter()
            .map(|t| 3 * (padded_bytes(t.numel(), 4) - resident_block_bytes(t.numel(), 4)))
            .max()
            .unwrap();
        assert!(most > 0 && four.save_gather == most, "{four:?}");
    }

    /// Under a budget, sharding keeps more layers in RAM (each counts its
    /// share), and a rank moves its share of the spilled ones.
    #[test]
    fn a_budget_holds_more_layers_when_sharded() {
        let model = megatrain_zoo::preset("tinyllama-1.1b", None).unwrap();
        let tier = TierConfig {
            ram_budget_bytes: Some(6 << 30),
            spill_dir: Some("/nonexistent".into()),
            ..TierConfig::default()
        };
        let one = per_rank(&model, &tier, 1, None, Q).unwrap();
        let four = per_rank(&model, &tier, 4, None, Q).unwrap();
        let (f1, f4) = (one.host.first_spilled.unwrap(), four.host.first_spilled.unwrap());
        assert!(f4 > f1, "first spilled layer: {f1} on one rank, {f4} on four");
        assert!(four.host.ram.total() <= 6 << 30);
        assert!(four.disk_per_step < one.disk_per_step / 4 + (1 << 20), "{four:?}");
        // A rank's spill files hold a quarter of the spilled layers.
        let spilled: u64 = model.layer_tables()[f4..]
            .iter()
            .map(|t| 12 * t.numel() as u64)
            .sum();
        let disk = four.host.disk.total();
        assert!(disk > spilled / 4 && disk < spilled / 4 + (1 << 20), "{four:?}");
    }

    /// Ranks of one machine that map one transport copy count a quarter
    /// of it each, so under a budget more layers stay in RAM.
    #[test]
    fn a_machine_s_ranks_count_their_share_of_one_transport_copy() {
        let model = megatrain_zoo::preset("tinyllama-1.1b", None).unwrap();
        let tier = TierConfig {
            transport: megatrain_tier::TransportDType::BF16,
            ram_budget_bytes: Some(3 << 30),
            spill_dir: Some("/nonexistent".into()),
            ..TierConfig::default()
        };
        let own = per_rank(&model, &tier, 4, None, Q).unwrap();
        let shared = per_rank(&model, &tier, 4, Some(4), Q).unwrap();
        assert_eq!(shared.host.ram.transport, own.host.ram.transport.div_ceil(4));
        let (a, b) = (
            own.host.first_spilled.unwrap(),
            shared.host.first_spilled.unwrap(),
        );
        assert!(
            b > a,
            "first spilled layer: {a} with a copy each, {b} sharing one"
        );
        assert!(shared.host.ram.total() <= 3 << 30);
        // One rank alone has nothing to share.
        assert_eq!(
            per_rank(&model, &tier, 1, Some(1), Q).unwrap(),
            per_rank(&model, &tier, 1, None, Q).unwrap()
        );
    }
}
