//! Building a filled host tier: seeded initialisation or a Hugging Face
//! checkpoint, written straight into the slabs (no second copy of the model).

use megatrain_tier::{HostTier, TierConfig, TransportDType};
use megatrain_zoo::{HfCheckpoint, ModelConfig, init_layer_into};

use super::{Result, TrainError};

/// An empty tier for `model`, whose checkpoints name its tensors as
/// Hugging Face does ([`ModelConfig::hf_table`]).
pub fn new_tier(model: &ModelConfig, config: TierConfig) -> Result<HostTier> {
    let mut tier = HostTier::new(model.layer_tables(), config)?;
    tier.set_file_tables(model.hf_tables())?;
    Ok(tier)
}

/// A tier for `model` with every layer initialised from `seed`.
pub fn init_tier(model: &ModelConfig, config: TierConfig, seed: u64) -> Result<HostTier> {
    let mut tier = new_tier(model, config)?;
    for (layer, slab) in tier.layers_mut().iter_mut().enumerate() {
        let table = slab.table().clone();
        slab.fill_params(|p| init_layer_into(model, &table, layer, seed, p).map_err(TrainError::from))?;
        slab.settle()?;
    }
    Ok(tier)
}

/// A tier for the checkpoint's model with its weights.
pub fn load_tier(ckpt: &HfCheckpoint, config: TierConfig) -> Result<HostTier> {
    let mut tier = new_tier(&ckpt.config, config)?;
    for slab in tier.layers_mut() {
        let table = slab.table().clone();
        slab.fill_params(|p| ckpt.read_layer_into(&table, p).map_err(TrainError::from))?;
        slab.settle()?;
    }
    Ok(tier)
}

/// [`load_tier`] for forwards only (an evaluation, generation): each
/// layer's fp32 params hand their pages back once its transport copy is
/// written ([`HostTier::keep_transport_only`]), so the tier peaks at the
/// copies and one layer's params.
pub fn load_tier_for_forwards(ckpt: &HfCheckpoint, transport: TransportDType) -> Result<HostTier> {
    let config = TierConfig {
        transport,
        ..TierConfig::default()
    };
    let mut tier = new_tier(&ckpt.config, config)?;
    for slab in tier.layers_mut() {
        let table = slab.table().clone();
        slab.fill_params(|p| ckpt.read_layer_into(&table, p).map_err(TrainError::from))?;
        slab.release_outside(0..0)?;
    }
    tier.keep_transport_only()?;
    Ok(tier)
}
