//! Building a filled host tier: seeded initialisation or a Hugging Face
//! checkpoint, written straight into the slabs (no second copy of the model).

use megatrain_tier::{HostTier, TierConfig};
use megatrain_zoo::{HfCheckpoint, ModelConfig, init_layer_into};

use super::{Result, TrainError};

/// A tier for `model` with every layer initialised from `seed`.
pub fn init_tier(model: &ModelConfig, config: TierConfig, seed: u64) -> Result<HostTier> {
    let mut tier = HostTier::new(model.layer_tables(), config)?;
    for (layer, slab) in tier.layers_mut().iter_mut().enumerate() {
        let table = slab.table().clone();
        slab.fill_params(|p| init_layer_into(model, &table, layer, seed, p).map_err(TrainError::from))?;
        slab.settle()?;
    }
    Ok(tier)
}

/// A tier for the checkpoint's model with its weights.
pub fn load_tier(ckpt: &HfCheckpoint, config: TierConfig) -> Result<HostTier> {
    let mut tier = HostTier::new(ckpt.config.layer_tables(), config)?;
    for slab in tier.layers_mut() {
        let table = slab.table().clone();
        slab.fill_params(|p| ckpt.read_layer_into(&table, p).map_err(TrainError::from))?;
        slab.settle()?;
    }
    Ok(tier)
}
